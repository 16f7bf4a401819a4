"""The gradient pipeline over all buckets of one optimizer (one :class:`GradBucket`
each, grad_bucket.py): gradients in, reduce-scatter over the distributed group and
all-reduce over the redundant group, bucket by bucket.

Ordering rule (no deadlocks): a *round* launches every bucket exactly once, in
index order. A complete bucket waits until every bucket before it has launched
in the current round; :meth:`GradSync.flush` launches the rest in order, with
zeros for gradients that never arrived. A gradient for a bucket that already
launched in this round (the next micro-batch of gradient accumulation without
``no_sync()``) first closes the round the same way, then starts the next one.
Every rank thus issues the same collectives in the same order whatever order
autograd produces gradients in, and a parameter may be missing from any
micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mpzero.comm import CommContext
from mpzero.optimizers.grad_bucket import GradBucket, GradState, GradStorage
from mpzero.optimizers.layout import BucketLayout, Fragment


class GradSync:
    """The gradient pipeline over all buckets of one optimizer."""

    def __init__(self, layouts: Sequence[BucketLayout], storages: Sequence[GradStorage],
                 fragments: dict[int, list[Fragment]], device: torch.device, ctx: CommContext,
                 distributed_group: dist.ProcessGroup | None,
                 redundant_group: dist.ProcessGroup | None, dist_rank: int, average: bool):
        self.buckets = [GradBucket(lay, lay.key.grad, device, dist_rank, storage)
                        for lay, storage in zip(layouts, storages)]
        self.ctx = ctx
        self.distributed_group = distributed_group
        self.redundant_group = redundant_group
        self.average = average
        self.fragments = fragments  # param -> its fragments, in bucket order
        self._cursor = 0  # next bucket to launch in this round
        self._in_flight: list[GradBucket] = []
        self.version = 0  # bumps whenever the synced gradients change

    # -- gradients in --------------------------------------------------------------
    def add_grad(self, param: int, grad: torch.Tensor | None) -> None:
        """Copy (add) one parameter's gradient into its buckets and mark it arrived.

        ``grad`` is flat in the parameter's memory order; None: it is in the buckets'
        (persistent) buffers already (a layer added it into ``main_grad``)."""
        frags = self.fragments.get(param, ())
        if any(f.bucket < self._cursor for f in frags):
            self._close_round()  # a new micro-batch reached buckets this round launched
        for f in frags:
            bucket = self.buckets[f.bucket]
            if bucket.state is GradState.SYNCING:
                self._finish(bucket)  # a new round for a bucket still in flight
            if bucket.state is not GradState.FILLING:
                bucket.start_fill()
            if grad is not None:
                bucket.add(f, grad)
            else:
                bucket.added_in_place()
            bucket.mark_arrived(param)
            bucket.release_if_complete()

    # -- launching -----------------------------------------------------------------
    def round_active(self) -> bool:
        if self._cursor > 0:
            return True
        for b in self.buckets:  # a plain loop: a generator costs more than the test
            if b.state is GradState.FILLING:
                return True
        return False

    def launch_ready(self) -> None:
        """Launch complete buckets, in order, up to the first incomplete one."""
        while self._cursor < len(self.buckets) and self.buckets[self._cursor].complete:
            self._launch(self.buckets[self._cursor])
            self._cursor += 1
        if self._cursor == len(self.buckets):
            self._cursor = 0  # round complete

    def close_round(self) -> None:
        """End an active round (a backward pass): launch every bucket it still owes,
        in order, zeros for gradients that did not arrive. Nothing when no round is
        active (every bucket already launched)."""
        if self.round_active():
            self._close_round()

    def _close_round(self) -> None:
        """Launch every bucket the current round still owes, in order."""
        for i in range(self._cursor, len(self.buckets)):
            self._launch(self.buckets[i])
        self._cursor = 0

    def _launch(self, bucket: GradBucket) -> None:
        if bucket.state is GradState.SYNCING:  # still in flight from the previous round
            self._finish(bucket)
        if bucket.state is not GradState.FILLING:
            bucket.start_fill()  # nothing arrived this round: a sync of zeros
        bucket.start_sync(self.ctx, self.distributed_group, self.redundant_group, self.average)
        self._in_flight.append(bucket)
        self.version += 1
        # Bound the buckets in flight: their full-size buffers are the memory cost.
        while len(self._in_flight) > self.ctx.pipeline_size:
            self._finish(self._in_flight[0])

    def finish_all(self) -> None:
        """Finish every sync in flight (the main stream waits for it)."""
        for bucket in list(self._in_flight):
            self._finish(bucket)

    def _finish(self, bucket: GradBucket) -> None:
        bucket.finish_sync()
        self._in_flight.remove(bucket)

    def flush(self) -> None:
        """Launch every bucket this round still owes (in order) and wait for all.

        In an active round (some bucket launched or filling) every bucket from the
        cursor on syncs, with zeros for gradients that never arrived. Otherwise only
        buckets that have not synced since the last reset do (a step with no
        backward still syncs, so all ranks issue the same collectives)."""
        if self.round_active():
            todo = range(self._cursor, len(self.buckets))
        else:
            todo = [i for i, b in enumerate(self.buckets) if not b.launched_since_reset]
        for i in todo:
            self._launch(self.buckets[i])
        self._cursor = 0
        self.finish_all()

    def reset(self) -> None:
        self.finish_all()
        for bucket in self.buckets:
            bucket.reset()
        self._cursor = 0
        self.version += 1

    def shards_of(self, param: int) -> list[torch.Tensor]:
        """The reduced local shards of the buckets holding parameter ``param``, in bucket
        order (each whole: other parameters of those buckets are in it too)."""
        shards = []
        for b in sorted({f.bucket for f in self.fragments.get(param, ())}):
            shard = self.buckets[b].shard
            if shard is None:
                raise RuntimeError(f"bucket {b}'s gradient shard is not synced")
            shards.append(shard)
        return shards

    def mark_stepped(self) -> None:
        """After a step the next step needs a fresh sync (gradients persist until reset)."""
        for bucket in self.buckets:
            bucket.launched_since_reset = False
