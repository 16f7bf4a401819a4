"""A collective that only some ranks reach hangs; this check turns that into an error.

:func:`check_collective_entry` is called on the way into a collective API (e.g.
``DistributedFusedAdam.state_dict()``, ``mpzero.checkpoint.dcp.save_sharded``): every
rank of the group announces itself in the default store and waits, with a timeout,
for the others, so a call made on some ranks only fails in bounded time with a message
naming the ranks that did not come.
"""

from __future__ import annotations

import datetime
import hashlib
import os

from mpzero import comm


class CollectiveMismatchError(RuntimeError):
    """A collective mpzero API was not entered by every rank of its process group."""


COLLECTIVE_CHECK_ENV = "MPZERO_COLLECTIVE_CHECK_TIMEOUT"
#: Seconds the ranks that entered wait for the others. Generous on purpose: a rank
#: may legitimately arrive late (rank 0 evaluates or logs before the checkpoint) and
#: a false alarm would kill a healthy run; it stays below NCCL's default 600 s
#: watchdog so the clear message comes first.
DEFAULT_COLLECTIVE_CHECK_TIMEOUT = 300.0
_KEY_PREFIX = "mpzero/collective_check"
_CALLS: dict[tuple[str, str], int] = {}


def collective_check_timeout(timeout: float | None = None) -> float:
    """``timeout`` if given, else ``$MPZERO_COLLECTIVE_CHECK_TIMEOUT`` (seconds), else
    :data:`DEFAULT_COLLECTIVE_CHECK_TIMEOUT`. ``0`` (or ``off``) disables the check."""
    if timeout is None:
        raw = os.environ.get(COLLECTIVE_CHECK_ENV, "").strip()
        if not raw:
            return DEFAULT_COLLECTIVE_CHECK_TIMEOUT
        if raw.lower() in ("off", "none", "false", "no"):
            return 0.0
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"{COLLECTIVE_CHECK_ENV}={raw!r} must be a number of seconds "
                              "(0 or 'off' disables the check)") from None
    timeout = float(timeout)
    if not timeout >= 0:
        raise ValueError(f"collective check timeout {timeout!r} must be >= 0 seconds")
    return timeout


def _group_ranks(group) -> list[int] | None:
    """Global ranks of ``group``; None when this rank is not a member."""
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    try:
        ranks = dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):
        return None
    return ranks if dist.get_rank() in ranks else None


def _ranks_key(ranks: list[int]) -> str:
    text = ",".join(map(str, ranks))
    if len(text) <= 64:
        return text
    return f"n{len(ranks)}-" + hashlib.sha1(text.encode()).hexdigest()[:16]


def check_collective_entry(name: str, group=None, *, timeout: float | None = None) -> None:
    """Return once every rank of ``group`` has called ``check_collective_entry(name,
    group)`` the same number of times; raise :class:`CollectiveMismatchError` within
    ``timeout`` seconds (:func:`collective_check_timeout`) otherwise, instead of
    hanging in the collective that follows.

    It goes through the default process group's key-value store (the one
    ``init_process_group`` made), so it works for gloo and NCCL alike and for
    subgroups: the keys hold ``name``, the group's global ranks and a per-(name,
    group) call counter. Cost per call: one ``store.add`` and one ``store.wait``
    (the last rank to arrive instead sets the release key and deletes the previous
    call's two keys, so the store does not grow). No-op without torch.distributed,
    for a group of one rank, on ranks outside ``group``, for ``comm.SELF``, or
    with the timeout 0.

    On a timeout the rank withdraws its arrival before raising, so a later call made
    on every rank pairs up again. (A rank that arrives in the microseconds between
    the timeout and the withdrawal passes and then waits in the collective; the
    job is broken at that point anyway, and the error says why.)

    Where to call it (``DistributedFusedAdam``), as the first statement, before any
    collective: ``state_dict`` (``check_collective_entry("state_dict()",
    self.process_group)``), ``load_state_dict``, ``sharded_state_dict``,
    ``load_sharded_state_dict``, and ``checkpoint.save_sharded``/``load_sharded``.
    Not in per-step APIs (``step``, ``grad_sync``): they run every iteration and a
    missing rank there hangs in the gradient sync, not in checkpoint code.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if group is comm.SELF:  # one rank
        return
    limit = collective_check_timeout(timeout)
    if limit == 0:
        return
    ranks = _group_ranks(group)
    if ranks is None or len(ranks) <= 1:
        return
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    rkey = _ranks_key(ranks)
    n = _CALLS.get((name, rkey), 0) + 1
    _CALLS[(name, rkey)] = n
    base = f"{_KEY_PREFIX}/{name}/{rkey}"
    count_key, done_key = f"{base}/{n}/count", f"{base}/{n}/done"
    arrived = store.add(count_key, 1)
    if arrived == len(ranks):
        store.set(done_key, "1")
        if n > 1:  # every rank has left call n-1 (each added to call n's counter)
            for key in (f"{base}/{n - 1}/count", f"{base}/{n - 1}/done"):
                try:
                    store.delete_key(key)
                except (RuntimeError, NotImplementedError):
                    pass
        return
    try:
        store.wait([done_key], datetime.timedelta(seconds=limit))
    except RuntimeError:  # DistStoreError: timed out (or the store went away)
        # Withdraw, so the ranks' counters agree again and a later call (e.g. the
        # corrected one on every rank) pairs up. The add returns how many are left.
        _CALLS[(name, rkey)] = n - 1
        try:
            got = store.add(count_key, -1) + 1
        except RuntimeError:
            got = arrived
        raise CollectiveMismatchError(
            f"{name} is collective: every rank of the process group (global ranks "
            f"{_short(ranks)}) must call it, but only {got} of {len(ranks)} ranks "
            f"entered it within {limit:g} s (this is rank {dist.get_rank()}, call "
            f"#{n}). Call it on every rank and write the file on rank 0 only, e.g. "
            "`sd = optimizer.state_dict()` on all ranks, then "
            "`if rank == 0: torch.save(sd, path)`; or let each rank save its own "
            "shard with mpzero.optimizers.checkpoint.save_sharded(optimizer, path). "
            f"If a rank is only slow (e.g. evaluation on rank 0), raise "
            f"{COLLECTIVE_CHECK_ENV} (seconds; 0 disables the check)."
        ) from None


def _short(ranks: list[int]) -> str:
    if len(ranks) <= 16:
        return str(ranks)
    return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


