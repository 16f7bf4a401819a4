"""One bucket's gradients: a small state machine over its buffer and reduced shard.

::

    EMPTY --start_fill--> FILLING --start_sync--> SYNCING --finish_sync--> SYNCED
      ^                                                                      |
      +-------------------------------- reset -------------------------------+

(a SYNCED or EMPTY bucket may also start a new fill, or a sync of zeros). Gradients are
added into the full-size buffer in the gradient-sync dtype; after the sync only the
reduced local shard is kept (accumulating over syncs until ``reset``). Where the buffer
and shard live is the bucket's :class:`GradStorage`, chosen once at construction.

A fresh buffer is not zeroed: each fragment's first gradient is cast-copied in, later
ones added, both staged and made with one multi-tensor launch per bucket when it is
complete or read (``capturable``: at once, so a captured step never reads a freed
gradient); what nothing wrote is zeroed just before the buffer is read. The contiguous
grad buffer keeps zeroed semantics (a user may write into ``grad_buffer_view()``), and
layers with gradient accumulation fusion add into it themselves (:meth:`added_in_place`).

Direct gradients: where this rank alone makes up both groups and every parameter of the
bucket brought exactly one gradient in the round, the gradients themselves (in the
parameters' dtype) stand for the reduced shard (:meth:`GradBucket.direct_grads`): no
copy, no buffer. Anything else that reads the shard, or adds to it, first makes the copy
(:meth:`GradBucket.materialize`), so the values are the same either way.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from mpzero import kernels
from mpzero.comm import CommContext, Pending
from mpzero.optimizers.layout import BucketLayout, Fragment


@dataclass(frozen=True)
class GradStorage:
    """Where one bucket's gradients live, fixed at construction."""

    persistent: torch.Tensor | None = None  # its view of the contiguous grad buffer
    incoming: torch.Tensor | None = None  # nccl_ub: the registered reduce-scatter output
    stable_shard: bool = False  # capturable: the reduced shard keeps its address (graphs)
    local_only: bool = False  # this rank alone makes up both groups: nothing to reduce

    @property
    def may_go_direct(self) -> bool:
        """Nothing to reduce and no fixed shard address (contiguous buffer, CUDA graphs,
        nccl_ub's registered pool): the gradients may stand for the shard."""
        return (self.local_only and self.persistent is None and not self.stable_shard
                and self.incoming is None)


class GradState(enum.Enum):
    EMPTY = "empty"  # no buffer, nothing arrived since the last reset/sync
    FILLING = "filling"  # buffer allocated, gradients arriving
    SYNCING = "syncing"  # collective in flight
    SYNCED = "synced"  # reduced local shard available


class GradBucket:
    """Gradient state of one bucket."""

    def __init__(self, layout: BucketLayout, dtype: torch.dtype, device: torch.device,
                 dist_rank: int, storage: GradStorage = GradStorage()):
        self.layout = layout
        # Where the bucket's gradients live: chosen once, never changed (GradStorage).
        self.storage = storage
        self.persistent = storage.persistent
        self.persistent_incoming = storage.incoming
        self.stable_shard = storage.stable_shard
        self.local_only = storage.local_only
        self.dtype = dtype
        self.device = device
        self.dist_rank = dist_rank
        self.state = GradState.EMPTY
        self.buffer: torch.Tensor | None = None
        self.arrived: set[int] = set()
        # Reduced local shard, accumulated over syncs. Its storage is kept across resets
        # (only ``shard_valid`` drops) so its address is stable, e.g. for CUDA graphs.
        self._shard: torch.Tensor | None = None
        self.shard_valid = False
        self.launched_since_reset = False
        self._pending: Pending | None = None
        self._incoming: torch.Tensor | None = None
        self._params = set(layout.params)
        # Lazily zeroed buffer: the fragments (by parameter) written since it was fresh;
        # None when the whole buffer holds defined values (zeros or gradients).
        self._written: set[int] | None = None
        self._gaps = _gaps(layout)  # bucket ranges no fragment covers
        self._staged: list[tuple[Fragment, torch.Tensor]] = []  # first copies to make
        # Later gradients to add (accumulation), made with the copies in one launch each;
        # ``_adding``: their parameters (a second gradient of one makes them first).
        self._adds: list[tuple[Fragment, torch.Tensor]] = []
        self._adding: set[int] = set()
        # Fragments whose gradient a layer added into the buffer itself (main_grad) since
        # the last launch of the staged work: they need no copy either.
        self._in_place = 0
        # Direct gradients (see the module docstring): param -> its gradient's slice for
        # this bucket's fragment, standing for the reduced shard; None when not direct.
        self._direct: dict[int, torch.Tensor] | None = None
        self.may_go_direct = storage.may_go_direct

    def _assert_state(self, *states: GradState) -> None:
        if self.state not in states:
            raise AssertionError(
                f"bucket {self.layout.index}: expected state in {[s.name for s in states]}, "
                f"found {self.state.name}"
            )

    @property
    def complete(self) -> bool:
        return self.state is GradState.FILLING and self.arrived >= self._params

    @property
    def shard(self) -> torch.Tensor | None:
        """The reduced local shard (made from direct gradients first, if it stands for them;
        with the staged additions made where the shard is this round's buffer)."""
        if not self.shard_valid:
            return None
        if self._direct is not None:
            self.materialize()
        if self._adds and self.buffer is self._shard:
            self.copy_staged()
        return self._shard

    @property
    def all_pending(self) -> bool:
        """A gradient of every fragment waits in the staged copies and additions (so
        one launch of each makes them all)."""
        return (len(self._staged) + len(self._adds) + self._in_place
                >= len(self.layout.fragments))

    def release_if_complete(self) -> None:
        """Every gradient of this pass is in: make the staged copies and additions now,
        releasing the gradients, unless they are first copies that may stand for the
        shard (direct gradients)."""
        if self.complete and self.all_pending and (self._adds or not self.may_go_direct):
            self.copy_staged()

    def direct_grads(self) -> dict[int, torch.Tensor] | None:
        """Direct gradients standing for the synced shard: ``{param: flat gradient slice
        of its fragment}`` (in the parameter's dtype), or None when the shard is a buffer."""
        return self._direct if self.shard_valid else None

    def materialize(self) -> None:
        """Copy direct gradients into a shard buffer of the sync dtype (zeros in the gaps)."""
        direct, self._direct = self._direct, None
        if direct is None:
            return
        # The staged first copies of every fragment, as the fill would have made them.
        self._staged = [(f, direct[f.param]) for f in self.layout.fragments]
        self._written, self.buffer = set(self._params), None
        self._define()
        self._shard, self.buffer = self.buffer, None

    def _ensure_buffer(self) -> torch.Tensor:
        if self.buffer is None:  # a fresh buffer is allocated at its first copy or add
            self.buffer = _fresh_buffer(self.layout.size, self.dtype, self.device)
        return self.buffer

    def start_fill(self) -> None:
        """Start a new round of gradients: a zeroed buffer, or where the bucket buffer
        is the shard (one rank in both groups) the shard itself, accumulated in place."""
        self._assert_state(GradState.EMPTY, GradState.SYNCED)
        if self._direct is not None:
            self.materialize()  # the next micro-batch adds to the synced values
        if self.local_only and self._shard is not None:
            # Valid: the next micro-batch adds to it; else (kept across resets) it was
            # zeroed at reset.
            self.buffer = self._shard
        elif self.persistent is not None:
            # Zeroed when its last round finished syncing (or at reset), not here: what
            # the user wrote into grad_buffer_view() since then is part of this round.
            self.buffer = self.persistent
        else:
            self.buffer = None  # allocated lazily: direct gradients need none
            self._written = set()
        self.arrived = set()
        self.state = GradState.FILLING

    def add(self, fragment: Fragment, grad_flat: torch.Tensor) -> None:
        """Add one fragment of a gradient into the buffer (cast to the sync dtype);
        the fragment's first gradient into a fresh buffer is copied."""
        self._assert_state(GradState.FILLING)
        grad = grad_flat[fragment.param_start : fragment.param_end]
        written = self._written
        if written is not None and fragment.param not in written:
            written.add(fragment.param)
            if self.stable_shard:
                # capturable: copy now, so a step captured in a CUDA graph never reads
                # the (then freed) gradient tensors of a bucket still incomplete.
                self._ensure_buffer()[fragment.bucket_start : fragment.bucket_end].copy_(grad)
            else:
                self._staged.append((fragment, grad))  # the cast copy, made later in place
            return
        exact = _exact_cast(grad.dtype, self.dtype)
        if exact and not self.stable_shard:
            # Staged: one multi-tensor add per bucket (copy_staged) instead of an add_ per
            # parameter, the same values (fp32 math, one rounding).
            if self._staged or fragment.param in self._adding:
                # A second gradient: the first copies can no longer stand for the shard
                # (direct), so they are made now; or this fragment's earlier addition.
                self.copy_staged()
            self._adding.add(fragment.param)
            self._adds.append((fragment, grad))
            return
        self.copy_staged()
        view = self._ensure_buffer()[fragment.bucket_start : fragment.bucket_end]
        if exact:
            view.add_(grad)  # mixed-dtype add: the same sums without a cast copy
        else:
            view.add_(grad.to(self.dtype))  # round to the sync dtype first, as ever

    def added_in_place(self) -> None:
        """A layer added one fragment's gradient into the (persistent) buffer itself."""
        self._assert_state(GradState.FILLING)
        self._in_place += 1

    def copy_staged(self) -> None:
        """Make the staged first copies (one multi-tensor cast for all of them), then the
        staged additions (one multi-tensor add)."""
        staged, adds = self._staged, self._adds
        self._staged, self._adds, self._adding, self._in_place = [], [], set(), 0
        for pending, op in ((staged, kernels.multi_copy), (adds, kernels.multi_add)):
            if pending:
                buf = self._ensure_buffer()
                op([g for _, g in pending], [buf[f.bucket_start:f.bucket_end] for f, _ in pending])

    def _define(self) -> None:
        """Zero what no gradient wrote into a fresh buffer (before anything reads it)."""
        self.copy_staged()
        written, self._written = self._written, None
        if written is None:
            return
        self._ensure_buffer()
        ranges = list(self._gaps)
        if len(written) < len(self._params):  # some parameters got no gradient
            ranges += [(f.bucket_start, f.bucket_end)
                       for f in self.layout.fragments if f.param not in written]
        views = [self.buffer[a:b] for a, b in ranges if b > a]
        if views:
            torch._foreach_zero_(views)

    def mark_arrived(self, param: int) -> None:
        self.arrived.add(param)

    def start_sync(self, ctx: CommContext, distributed_group, redundant_group,
                   average: bool) -> None:
        """Launch the reduce-scatter (+ redundant all-reduce) of what was filled (zeros
        where nothing arrived)."""
        self._assert_state(GradState.FILLING)
        if self._can_go_direct():
            self._direct = {f.param: g for f, g in self._staged}
            self._staged, self._written, self.buffer = [], None, None
            self._incoming, self._pending = None, None
            self.state = GradState.SYNCING
            self.launched_since_reset = True
            return
        self._define()
        if self.local_only:
            # One rank in both groups: the bucket buffer is already the reduced shard.
            self._incoming = self.buffer
            self.state = GradState.SYNCING
            self._pending = None
            self.launched_since_reset = True
            return
        if self.persistent_incoming is not None:
            if self.shard_valid and self._shard is self.persistent_incoming:
                self._shard = self._shard.clone()  # accumulating: keep what it holds
            self._incoming = self.persistent_incoming
        else:
            self._incoming = torch.empty(self.layout.shard_size, dtype=self.dtype,
                                         device=self.device)
        self._pending = ctx.reduce_scatter(self.buffer, self._incoming, distributed_group,
                                           redundant_group, average)
        self.launched_since_reset = True
        self.state = GradState.SYNCING

    def _can_go_direct(self) -> bool:
        """Every fragment's one gradient is staged, nothing added, no earlier values."""
        return (self.may_go_direct and self._written is not None and not self.shard_valid
                and not self._adds and len(self._staged) == len(self.layout.fragments)
                and len(self._written) == len(self._params))

    def finish_sync(self) -> None:
        self._assert_state(GradState.SYNCING)
        if self._direct is not None:  # the gradients themselves are the shard
            self._shard, self.shard_valid = None, True
            self.arrived = set()
            self.state = GradState.SYNCED
            return
        if self._pending is not None:
            self._pending.wait()
        if self._incoming is self._shard:
            pass  # accumulated in place (the bucket buffer is the shard)
        elif self.shard_valid:
            self._shard.add_(self._incoming)
        elif self._shard is not None and self.stable_shard:
            self._shard.copy_(self._incoming)  # keep the address (CUDA graphs)
        elif self.persistent_incoming is not None and self.stable_shard:
            self._shard = self._incoming.clone()  # its own address, kept across steps
        else:
            # nccl_ub: the pool's buffer itself until this bucket's next sync, which copies
            # it first if it still holds gradients (accumulation).
            self._shard = self._incoming
        self.shard_valid = True
        if self.persistent is not None and self._shard is not self.persistent:
            self.persistent.zero_()  # ready for the next round's gradients
        self._pending, self._incoming, self.buffer = None, None, None
        self.arrived = set()
        self.state = GradState.SYNCED

    def reset(self) -> None:
        """Drop every gradient (``zero_grad``)."""
        if self.state is GradState.SYNCING:
            self.finish_sync()
        if self.persistent is not None:
            self.persistent.zero_()
        self._staged, self._direct = [], None  # dropped gradients need no copy
        self._adds, self._adding, self._in_place = [], set(), 0
        self.buffer, self.arrived = None, set()
        self.shard_valid = False
        if not self.stable_shard:  # free the reduced shard (CUDA graphs keep its address)
            self._shard = None
        elif self.local_only and self._shard is not None and self._shard is not self.persistent:
            self._written = set()  # the next round fills it in place (copies, then adds)
        self.launched_since_reset = False
        self.state = GradState.EMPTY


def _fresh_buffer(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A bucket buffer whose contents are undefined (the fill defines every element)."""
    return torch.empty(size, dtype=dtype, device=device)


def _gaps(layout: BucketLayout) -> tuple[tuple[int, int], ...]:
    """The ranges of the bucket that no fragment covers (alignment and shard padding)."""
    gaps, cursor = [], 0
    for f in sorted(layout.fragments, key=lambda f: f.bucket_start):
        if f.bucket_start > cursor:
            gaps.append((cursor, f.bucket_start))
        cursor = max(cursor, f.bucket_end)
    if layout.size > cursor:
        gaps.append((cursor, layout.size))
    return tuple(gaps)


_FLOAT_BITS = {torch.float16: (5, 10), torch.bfloat16: (8, 7), torch.float32: (8, 23),
               torch.float64: (11, 52)}  # (exponent, mantissa) bits


def _exact_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every ``src`` value is exactly a ``dst`` value (so adding ``src``
    into ``dst`` equals adding its cast)."""
    if src == dst:
        return True
    a, b = _FLOAT_BITS.get(src), _FLOAT_BITS.get(dst)
    return a is not None and b is not None and a[0] <= b[0] and a[1] <= b[1]
