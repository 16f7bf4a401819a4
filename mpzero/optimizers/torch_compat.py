"""Helpers that make mistakes made while porting a DDP + ``torch.optim.AdamW`` script
to :class:`~mpzero.optimizers.DistributedFusedAdam` fail (or warn) loudly.

Every function here is standalone: it takes plain values (a param-group dict, a
module, a process group) and has no state in the optimizer, so it is unit-tested
without one. Each docstring names the place in ``DistributedFusedAdam`` meant to
call it. See ``docs/migrating.md`` for the user-facing side.

- :func:`check_param_group_options`: param-group keys mpzero does not implement.
- :func:`torch_param_group_to_mpzero`: the same for the param groups of a
  ``torch.optim.AdamW``/``Adam`` state dict, dropping torch's implementation
  switches (``foreach``, ``fused``, ...), which do not change the math.
- :func:`check_collective_entry`: a collective API (``state_dict()``) entered on
  only some ranks fails within a bounded time instead of hanging.
- :func:`warn_if_wrapped_in_ddp` / :func:`find_ddp` / :func:`inside_ddp_forward`:
  a model still wrapped in ``DistributedDataParallel``; :func:`raise_if_ddp_reduces`:
  one wrapped after the optimizer was built (checked at the first backward).
- :func:`torch_clip_would_be_noop`: what ``torch.nn.utils.clip_grad_norm_`` sees
  under ZeRO-2 (every ``param.grad`` freed) -- for the guide and tests; see its
  docstring for why the optimizer cannot detect that call itself.
- :func:`user_stacklevel`: ``stacklevel`` for ``warnings.warn`` so warnings point at
  the user's line.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import sys
import warnings
import weakref
from collections.abc import Iterable

import torch

from mpzero import comm
from mpzero.optimizers.options import OptionError

__all__ = [
    "MigrationWarning",
    "CollectiveMismatchError",
    "DoubleReductionError",
    "ddp_reducing",
    "raise_if_ddp_reduces",
    "KNOWN_PARAM_GROUP_KEYS",
    "SCHEDULER_PARAM_GROUP_KEYS",
    "register_param_group_key",
    "check_param_group_options",
    "torch_param_group_to_mpzero",
    "COLLECTIVE_CHECK_ENV",
    "DEFAULT_COLLECTIVE_CHECK_TIMEOUT",
    "collective_check_timeout",
    "check_collective_entry",
    "find_ddp",
    "inside_ddp_forward",
    "warn_if_wrapped_in_ddp",
    "torch_clip_would_be_noop",
    "user_stacklevel",
]


class MigrationWarning(UserWarning):
    """A pattern from DDP + ``torch.optim`` that is slow or wrong with mpzero
    (filter it with ``warnings.filterwarnings("ignore", category=MigrationWarning)``)."""


class CollectiveMismatchError(RuntimeError):
    """A collective mpzero API was not entered by every rank of its process group."""


# ---------------------------------------------------------------------- param groups
#: Hyperparameters mpzero reads from each param group (SPEC §2).
OPTIMIZER_PARAM_GROUP_KEYS = frozenset(
    {"params", "lr", "betas", "eps", "weight_decay", "bias_correction"})

#: Keys that ``torch.optim.lr_scheduler`` / ``swa_utils`` write into param groups
#: (torch 2.13): every ``LRScheduler`` sets ``initial_lr``; ``OneCycleLR`` sets
#: ``max_lr``/``min_lr``; ``CyclicLR``/``OneCycleLR`` with ``cycle_momentum`` set
#: ``max_momentum``/``base_momentum`` (and cycle ``betas[0]``, since mpzero has
#: ``betas``); ``SWALR`` sets ``swa_lr``. They are read by the scheduler only.
SCHEDULER_PARAM_GROUP_KEYS = frozenset(
    {"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"})

#: Annotations that change nothing in the update: ``param_names`` (torch >= 2.6 keeps
#: the names given as ``named_parameters()``) and ``name`` (a common user label).
ANNOTATION_PARAM_GROUP_KEYS = frozenset({"param_names", "name"})

KNOWN_PARAM_GROUP_KEYS = (OPTIMIZER_PARAM_GROUP_KEYS | SCHEDULER_PARAM_GROUP_KEYS
                          | ANNOTATION_PARAM_GROUP_KEYS)

# Keys of torch's Adam/AdamW groups that mpzero does not implement, the value at which
# they are harmless (torch's default), and what to do instead.
_TORCH_ONLY_KEYS: dict[str, tuple[tuple, str]] = {
    "maximize": ((False,), "mpzero always minimizes: negate the loss instead "
                           "(loss = -objective) and drop maximize"),
    "amsgrad": ((False,), "mpzero does not implement the AMSGrad variant; use "
                          "torch.optim.AdamW(amsgrad=True) or drop amsgrad"),
    "foreach": ((None, False), "it selects torch's multi-tensor implementation; mpzero "
                               "always runs its own fused kernel, so drop foreach"),
    "fused": ((None, False), "it selects torch's fused implementation; mpzero always runs "
                             "its own fused kernel, so drop fused"),
    "differentiable": ((False,), "mpzero's step is not differentiable (no autograd "
                                 "through the update); drop differentiable"),
    "capturable": ((False,), "CUDA-graph capture is an optimizer-wide option in mpzero: "
                             "pass DistributedFusedAdam(capturable=True) and drop the "
                             "group key"),
}

# Torch implementation switches: they choose a kernel, not the math, so a torch
# state dict saved with them loads (torch_param_group_to_mpzero drops them).
_TORCH_IMPL_KEYS = ("foreach", "fused", "differentiable", "capturable")

_EXTRA_KEYS: set[str] = set()


def register_param_group_key(*keys: str) -> None:
    """Accept more param-group keys, for your own code that reads them (e.g. a custom
    LR scheduler's ``"lr_mult"``). mpzero itself ignores them."""
    for k in keys:
        if not isinstance(k, str):
            raise TypeError(f"register_param_group_key: keys are strings, got {k!r}")
        _EXTRA_KEYS.add(k)


def _is_value(value, allowed: tuple) -> bool:
    return any(value is a or (a is not None and type(value) is type(a) and value == a)
               for a in allowed)


def check_param_group_options(group: dict, index: int, *, adam_w_mode: bool | None = None,
                              extra_keys: Iterable[str] = ()) -> None:
    """Raise :class:`~mpzero.optimizers.OptionError` (a ``ValueError``) for a
    param-group key that mpzero would silently ignore.

    Accepted: ``params, lr, betas, eps, weight_decay, bias_correction``, the keys LR
    schedulers add (:data:`SCHEDULER_PARAM_GROUP_KEYS`), ``param_names``/``name``,
    keys given to :func:`register_param_group_key` or ``extra_keys``, and torch's
    ``maximize``/``amsgrad``/``foreach``/``fused``/``differentiable``/``capturable``
    at their harmless defaults (``False``, or ``None`` for ``foreach``/``fused``).
    ``decoupled_weight_decay`` (torch's Adam/AdamW key) is accepted when it equals
    ``adam_w_mode`` (the optimizer-wide choice); with ``adam_w_mode=None`` it is
    accepted as any bool. Anything else (a typo such as ``"weight_dacay"``, another
    optimizer's ``"momentum"``) fails at once, naming the group and the key.

    Where to call it (``DistributedFusedAdam``):

    - ``__init__``: right after ``super().__init__(params, defaults)``,
      ``for gi, g in enumerate(self.param_groups): check_param_group_options(g, gi,
      adam_w_mode=adam_w_mode)`` (before any hook is registered, so a failed
      construction leaves nothing behind);
    - ``add_param_group`` (the branch after construction), before
      ``super().add_param_group(param_group)``:
      ``check_param_group_options(param_group, len(self.param_groups),
      adam_w_mode=self.adam_w_mode)``;
    - ``load_state_dict``: on each ``state_dict["param_groups"][i]`` of a format-2
      dict; torch-format dicts go through :func:`torch_param_group_to_mpzero` first.
    """
    if not isinstance(group, dict):
        raise TypeError(f"param group {index}: expected a dict, got {type(group).__name__}")
    where = f"param group {index}"
    extra = set(extra_keys)
    for key, value in group.items():
        if key in KNOWN_PARAM_GROUP_KEYS or key in _EXTRA_KEYS or key in extra:
            continue
        if key in _TORCH_ONLY_KEYS:
            harmless, advice = _TORCH_ONLY_KEYS[key]
            if _is_value(value, harmless):
                continue
            raise OptionError(f"{where}: {key}={value!r} is not supported by "
                              f"DistributedFusedAdam: {advice}")
        if key == "decoupled_weight_decay":
            if not isinstance(value, bool):
                raise OptionError(f"{where}: decoupled_weight_decay={value!r} must be a bool")
            if adam_w_mode is None or value == adam_w_mode:
                continue
            raise OptionError(
                f"{where}: decoupled_weight_decay={value} but the optimizer has "
                f"adam_w_mode={adam_w_mode}; in mpzero the weight-decay mode is "
                f"optimizer-wide: pass DistributedFusedAdam(adam_w_mode={value}) "
                "(True = AdamW, False = Adam with L2) and drop the group key")
        raise OptionError(
            f"{where}: unknown key {key!r}; DistributedFusedAdam reads only "
            f"{sorted(OPTIMIZER_PARAM_GROUP_KEYS - {'params'})} (plus LR-scheduler keys "
            f"{sorted(SCHEDULER_PARAM_GROUP_KEYS)}), so this key would be silently ignored. "
            "Fix the spelling, or, if your own code reads it, call "
            f"mpzero.optimizers.torch_compat.register_param_group_key({key!r})")


def torch_param_group_to_mpzero(group: dict, index: int, *,
                                adam_w_mode: bool | None = None) -> dict:
    """A copy of one param group of a ``torch.optim.AdamW``/``Adam`` state dict that
    mpzero accepts, or :class:`~mpzero.optimizers.OptionError` when the saved run used
    math mpzero does not do (``amsgrad=True``, ``maximize=True``, the other
    weight-decay mode).

    torch's implementation switches (``foreach``, ``fused``, ``differentiable``,
    ``capturable``) choose a kernel, not the update, so they are dropped whatever
    their value; ``amsgrad``/``maximize`` at ``False`` and a matching
    ``decoupled_weight_decay`` are dropped too. The result passes
    :func:`check_param_group_options`.

    Where to call it: in the torch-format branch of ``load_state_dict`` (in
    ``checkpoint.py``, the loader of a ``torch.optim.AdamW`` state dict), on each
    ``state_dict["param_groups"][i]`` before the groups' hyperparameters are copied.
    """
    out = {k: v for k, v in group.items() if k not in _TORCH_IMPL_KEYS}
    for key in ("amsgrad", "maximize"):
        if key in out:
            if out[key] is not False:
                raise OptionError(
                    f"param group {index} of the torch state dict: {key}={out[key]!r}; "
                    f"{_TORCH_ONLY_KEYS[key][1]} (the saved run cannot be continued "
                    "exactly by DistributedFusedAdam)")
            del out[key]
    if "decoupled_weight_decay" in out:
        check_param_group_options({"decoupled_weight_decay": out["decoupled_weight_decay"]},
                                  index, adam_w_mode=adam_w_mode)
        del out["decoupled_weight_decay"]
    check_param_group_options(out, index, adam_w_mode=adam_w_mode)
    return out


# ---------------------------------------------------------------------- collectives
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
            raise OptionError(f"{COLLECTIVE_CHECK_ENV}={raw!r} must be a number of seconds "
                              "(0 or 'off' disables the check)") from None
    timeout = float(timeout)
    if not timeout >= 0:
        raise OptionError(f"collective check timeout {timeout!r} must be >= 0 seconds")
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


# ---------------------------------------------------------------------- DDP
_DDP_WARNED: weakref.WeakSet = weakref.WeakSet()

_DDP_ADVICE = (
    "DistributedFusedAdam synchronizes gradients itself (reduce-scatter per bucket), so "
    "DistributedDataParallel around the model all-reduces every gradient a second "
    "time: about twice the gradient traffic plus DDP's own buckets, for nothing. "
    "Remove the wrapper: build the bare model, pass it as DistributedFusedAdam(..., "
    "module=model), call model(...) directly and use optimizer.no_sync() where you "
    "used ddp.no_sync(). Initial parameters need no broadcast either: the optimizer "
    "broadcasts them from the first rank when it lays out its buckets. "
    "See docs/migrating.md.")


def find_ddp(module) -> torch.nn.parallel.DistributedDataParallel | None:
    """The first ``DistributedDataParallel`` in ``module.modules()`` (``module`` itself
    or any submodule), else ``None``.

    Parameters alone cannot tell: DDP keeps no Python-visible mark on them (its
    reducer's autograd hooks live in C++), so the check needs the module."""
    if not isinstance(module, torch.nn.Module):
        return None
    ddp_cls = torch.nn.parallel.DistributedDataParallel
    for m in module.modules():
        if isinstance(m, ddp_cls):
            return m
    return None


class DoubleReductionError(RuntimeError):
    """A ``DistributedDataParallel`` reduces the gradients this optimizer reduces too."""


def ddp_reducing(params) -> torch.nn.parallel.DistributedDataParallel | None:
    """A live ``DistributedDataParallel`` that reduces any of ``params``, else ``None``.

    DDP keeps no Python-visible mark on the parameters it reduces (its reducer's hooks
    live in C++), and a model wrapped after the optimizer was built (``model =
    DDP(model)``, nanoGPT's order) is never handed to the optimizer. So this looks at
    every live DDP module once (one pass over the garbage collector's objects): call
    it once, at the first backward pass (``DistributedFusedAdam`` does)."""
    import gc

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None  # DDP needs a process group: none can exist
    ids = {id(p) for p in params}
    ddp_cls = torch.nn.parallel.DistributedDataParallel
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance on a dead weakref proxy raises.
        if issubclass(type(obj), ddp_cls):
            reduced = getattr(obj, "_module_parameters", None)
            if reduced is None:
                reduced = list(obj.module.parameters())
            if any(id(p) in ids for p in reduced):
                return obj
    return None


def raise_if_ddp_reduces(params) -> None:
    """Raise :class:`DoubleReductionError` when a ``DistributedDataParallel`` reduces any
    of ``params`` (see :func:`ddp_reducing`); called by ``DistributedFusedAdam`` at the
    first backward pass, so both reductions cannot run unnoticed."""
    ddp = ddp_reducing(params)
    if ddp is not None:
        raise DoubleReductionError(
            "a torch.nn.parallel.DistributedDataParallel wraps a model whose parameters this "
            "DistributedFusedAdam optimizes, so every gradient would be reduced twice (DDP's "
            "all-reduce, then the optimizer's reduce-scatter). Remove the line that wraps the "
            "model, e.g. `model = DDP(model, ...)`, and call the bare model. " + _DDP_ADVICE)


def inside_ddp_forward() -> bool:
    """True while a ``DistributedDataParallel.forward`` is running (torch sets
    ``DistributedDataParallel._active_ddp_module`` around the wrapped module's
    forward with the default C++ reducer). Catches the inner model passed as
    ``module=`` but run through a DDP wrapper.

    Where to call it: in ``DistributedFusedAdam._pre_forward`` (the forward pre-hook of
    attached modules), only until the first warning:
    ``if not self._ddp_warned and inside_ddp_forward(): self._ddp_warned = True;
    warn_if_wrapped_in_ddp(torch.nn.parallel.DistributedDataParallel._active_ddp_module)``.
    It reads a private torch attribute through ``getattr`` and returns False when a
    torch version lacks it."""
    ddp_cls = torch.nn.parallel.DistributedDataParallel
    return getattr(ddp_cls, "_active_ddp_module", None) is not None


def warn_if_wrapped_in_ddp(module) -> bool:
    """Warn once per DDP instance (:class:`MigrationWarning`) when ``module`` is, or
    contains, a ``DistributedDataParallel``; return whether it does.

    Where to call it (``DistributedFusedAdam``): in ``attach(module)`` as its first
    statement (the constructor's ``module=`` goes through ``attach``), i.e.
    ``warn_if_wrapped_in_ddp(module)``; and from ``_pre_forward`` through
    :func:`inside_ddp_forward` (see there). ``attach`` should then attach to
    ``ddp.module`` hooks as before (hooks on submodules still fire through DDP)."""
    ddp = find_ddp(module)
    if ddp is None:
        return False
    if ddp not in _DDP_WARNED:
        _DDP_WARNED.add(ddp)
        what = ("the module" if ddp is module else
                "a submodule of the module") + " given to DistributedFusedAdam"
        warnings.warn(f"{what} is a torch.nn.parallel.DistributedDataParallel. "
                      + _DDP_ADVICE, MigrationWarning, stacklevel=user_stacklevel())
    return True


# ---------------------------------------------------------------------- clipping
def torch_clip_would_be_noop(parameters) -> bool:
    """True when ``torch.nn.utils.clip_grad_norm_(parameters, ...)`` would find no
    gradient: every parameter's ``.grad`` is ``None``. torch then returns
    ``tensor(0.)`` and clips nothing. That is the normal state under
    DistributedFusedAdam after the synchronizing backward (ZeRO-2 moves each
    gradient into its bucket and frees ``param.grad``), which is why
    ``optimizer.clip_grad_norm(max_norm)`` is the clipping call to use.

    Why the optimizer does not warn about the torch call: the call cannot be
    observed. It reads ``param.grad`` (None), finds nothing, and touches no
    tensor, hook or state of the optimizer, so nothing at the next ``step()`` differs
    from a run that never clips. Seeing the call would take monkey-patching torch or
    a global ``TorchFunctionMode``, which mpzero does not do. And "every param.grad
    is None at step()" is true for every correct mpzero run too, so warning on it
    would fire always. The detection that is honest is at the user's side: this
    function (e.g. ``assert not torch_clip_would_be_noop(...)`` in a port's test),
    the guide, and the DDP warning (a ported script still wrapped in DDP most
    likely still uses torch's clipping).

    Not called by the optimizer."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return all(p.grad is None for p in parameters)


# ---------------------------------------------------------------------- warnings
def _package_dirs() -> tuple[str, ...]:
    import contextlib

    import mpzero

    dirs = [os.path.dirname(os.path.abspath(mpzero.__file__)),
            os.path.dirname(os.path.abspath(torch.__file__))]
    return tuple(d + os.sep for d in dirs) + (os.path.abspath(contextlib.__file__),)


_INTERNAL: tuple[str, ...] | None = None


def _is_internal(filename: str, internal: tuple[str, ...]) -> bool:
    path = os.path.abspath(filename)
    return any(path.startswith(p) for p in internal)


def user_stacklevel(skip: Iterable[str] | None = None) -> int:
    """The ``stacklevel`` for ``warnings.warn`` that makes the warning point at the
    first frame outside mpzero (and outside torch and ``contextlib``, which sit
    between user code and mpzero's hooks and context managers).

    Call it in the argument list of the ``warnings.warn`` call itself:
    ``warnings.warn(msg, SomeWarning, stacklevel=user_stacklevel())``; the frame
    that calls ``user_stacklevel`` is level 1. ``skip``: other path prefixes to
    treat as internal. Where to use it: every ``warnings.warn`` in
    ``DistributedFusedAdam`` (e.g. the bucket-fill warning in ``_ensure_layout``
    and the ``overlap_param_sync`` warning in ``_local_step``, which now hard-code
    ``stacklevel=3``), in place of the fixed number."""
    global _INTERNAL
    if _INTERNAL is None:
        _INTERNAL = _package_dirs()
    internal = _INTERNAL + tuple(os.path.abspath(s) for s in (skip or ()))
    frame = sys._getframe(1)  # the caller of warnings.warn: stacklevel 1
    level = 1
    while frame is not None and _is_internal(frame.f_code.co_filename, internal):
        if frame.f_back is None:
            break
        frame = frame.f_back
        level += 1
    return level
