"""Per-bucket parameter pipeline: all-gather of updated shards, copy-out, forward prefetch.

States of a bucket's parameters::

    CURRENT --mark_stale--> STALE --start--> GATHERING --finish--> CURRENT

``mark_stale`` hands out a shard-sized buffer (param-sync dtype) for the step's output;
``start`` allocates the full-size buffer only then and gathers into it; ``finish``
copies every fragment into its parameter and frees it (with a contiguous param buffer
the gather runs in place in the parameters). At most ``pipeline_size`` buckets gather
at once, so the transient is bounded by the bucket size. Gathers start in descending
bucket order (forward order) whatever triggered them, the same on every rank.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch
import torch.distributed as dist

from mpzero import kernels
from mpzero.comm import CommContext, Pending
from mpzero.kernels.precision import expand_high_bytes
from mpzero.optimizers.flat import flat_view
from mpzero.optimizers.layout import BucketLayout, fragments_by_param


class ParamState(enum.Enum):
    CURRENT = "current"  # parameters hold the latest values
    STALE = "stale"  # the shard is updated, the gather has not started
    GATHERING = "gathering"  # all-gather in flight


class ParamBucket:
    def __init__(self, layout: BucketLayout, dtype: torch.dtype, device: torch.device,
                 dist_rank: int, persistent: torch.Tensor | None = None):
        self.layout = layout
        # View into the contiguous param buffer: the parameters themselves live there.
        self.persistent = persistent
        self.dtype = dtype
        self.device = device
        self.dist_rank = dist_rank
        self.state = ParamState.CURRENT
        self.full: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None  # the updated shard, between step and start
        self._pending: Pending | None = None

    def _assert_state(self, *states: ParamState) -> None:
        if self.state not in states:
            raise AssertionError(
                f"bucket {self.layout.index}: expected param state in "
                f"{[s.name for s in states]}, found {self.state.name}"
            )

    def mark_stale(self) -> torch.Tensor:
        """Return the buffer the step fills with this rank's updated shard: a fresh
        shard-sized one, or the slice of the contiguous param buffer."""
        self._assert_state(ParamState.CURRENT)
        lo, hi = self.layout.shard_range(self.dist_rank)
        if self.persistent is not None:
            self.shard = self.persistent[lo:hi]
        else:
            # Uninitialized: the step writes every fragment of the shard, and gaps between
            # fragments are gathered but never copied into a parameter.
            self.shard = torch.empty(hi - lo, dtype=self.dtype, device=self.device)
        self.state = ParamState.STALE
        return self.shard

    def start(self, ctx: CommContext, group: dist.ProcessGroup | None) -> None:
        self._assert_state(ParamState.STALE)
        if self.persistent is not None:
            self.full = self.persistent
        else:
            self.full = torch.empty(self.layout.size, dtype=self.dtype, device=self.device)
        self._pending = ctx.all_gather(self.shard, self.full, group)
        self.shard = None  # the pending gather keeps it alive until it is finished
        self.state = ParamState.GATHERING

    def finish(self, params: Sequence[torch.Tensor]) -> None:
        self._assert_state(ParamState.GATHERING)
        self._pending.wait()
        if self.persistent is None:  # else the gather wrote into the parameters already
            srcs, dsts = [], []
            for f in self.layout.fragments:
                srcs.append(self.full[f.bucket_start : f.bucket_end])
                dsts.append(flat_view(params[f.param].detach())[f.param_start : f.param_end])
            with torch.no_grad():
                if self.dtype.is_floating_point:
                    kernels.multi_copy(srcs, dsts)
                else:  # byte-level sync: the gathered bytes are the values' top bytes
                    for src, dst in zip(srcs, dsts):
                        expand_high_bytes(src, dst)
        self.full, self._pending = None, None
        self.state = ParamState.CURRENT


class ParamSync:
    """The parameter pipeline over all buckets of one optimizer."""

    def __init__(self, layouts: Sequence[BucketLayout], dtypes: Sequence[torch.dtype],
                 device: torch.device, ctx: CommContext, group: dist.ProcessGroup | None,
                 dist_rank: int, params: Sequence[torch.Tensor],
                 persistent: Sequence[torch.Tensor] | None = None):
        views = persistent if persistent is not None else [None] * len(layouts)
        self.buckets = [ParamBucket(lay, dt, device, dist_rank, view)
                        for lay, dt, view in zip(layouts, dtypes, views)]
        self.ctx = ctx
        self.group = group
        self.params = params
        self.buckets_of_param = {p: [f.bucket for f in frags]
                                 for p, frags in fragments_by_param(layouts).items()}
        self._gathering: list[int] = []  # bucket indices in the order their gathers started
        # False only when every bucket is known CURRENT: a bucket leaves CURRENT only
        # through mark_stale below, so pending() and sync_all() skip the per-bucket scan
        # (the usual case at the start of a step, and at its end where the step wrote the
        # parameters in place).
        self._maybe_pending = False

    def mark_stale(self, index: int) -> torch.Tensor:
        self._maybe_pending = True
        return self.buckets[index].mark_stale()

    def pending(self) -> bool:
        if not self._maybe_pending:
            return False
        for b in self.buckets:
            if b.state is not ParamState.CURRENT:
                return True
        self._maybe_pending = False
        return False

    def start_through(self, index: int) -> None:
        """Start the gathers of every stale bucket with index >= ``index``, highest first,
        finishing the oldest gather first whenever ``pipeline_size`` are in flight."""
        for i in range(len(self.buckets) - 1, index - 1, -1):
            if self.buckets[i].state is ParamState.STALE:
                self._gathering = [g for g in self._gathering
                                   if self.buckets[g].state is ParamState.GATHERING]
                while len(self._gathering) >= self.ctx.pipeline_size:
                    self.buckets[self._gathering.pop(0)].finish(self.params)
                self.buckets[i].start(self.ctx, self.group)
                self._gathering.append(i)

    def finish(self, index: int) -> None:
        bucket = self.buckets[index]
        if bucket.state is ParamState.STALE:
            self.start_through(index)
        if bucket.state is ParamState.GATHERING:
            bucket.finish(self.params)

    def ensure(self, param_indices, prefetch: int = 1) -> None:
        """Make these parameters current; start the next ``prefetch`` buckets' gathers."""
        needed = sorted({b for p in param_indices for b in self.buckets_of_param.get(p, ())})
        if not needed or all(self.buckets[b].state is ParamState.CURRENT for b in needed):
            return
        lowest = needed[0]
        # Forward runs through buckets in descending order: prefetch the next ones down.
        below = [i for i in range(lowest - 1, -1, -1)
                 if self.buckets[i].state is ParamState.STALE][:max(0, prefetch)]
        self.start_through(below[-1] if below else lowest)
        for b in needed:
            self.finish(b)

    def sync_all(self) -> None:
        """Gather every stale bucket and copy out (``param_sync()``)."""
        if not self._maybe_pending:
            return
        self.start_through(0)
        for i in range(len(self.buckets)):
            if self.buckets[i].state is ParamState.GATHERING:
                self.buckets[i].finish(self.params)
        self._maybe_pending = False  # every bucket is CURRENT now
