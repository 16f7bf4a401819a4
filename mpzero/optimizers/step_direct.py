"""Direct gradients in the step (grad_bucket.py): where every planned bucket of a phase
writes its parameters in place and holds direct gradients, the fused Adam reads them."""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter
from typing import TYPE_CHECKING

import torch

from mpzero.optimizers.step_plan import GRAD

if TYPE_CHECKING:
    from mpzero.optimizers.step import Phase


class DirectReads:
    """Which gradients a phase of the step reads directly, and how."""

    def __init__(self, layouts, buckets, rank: int):
        self.layouts, self.buckets, self.rank = layouts, buckets, rank

    def order(self, phase: Phase) -> list[tuple[int, list[int]]] | None:
        """``(bucket, parameter of each of its pieces)`` per planned bucket of ``phase``
        where every one of them writes its parameters in place (so may step on direct
        gradients), else None; made once."""
        order = phase.memo.get("direct_order", False)
        if order is False:
            order = phase.memo["direct_order"] = None if not all(
                writes for _, writes in phase.plan_key) else [
                (b, [p.param for p in self.layouts[b].shard_pieces(self.rank)])
                for b in phase.planned]
        return order

    def dicts(self, phase: Phase) -> list[dict[int, torch.Tensor]] | None:
        """Per planned bucket of ``phase`` (in order), its direct gradients (grad_sync.py:
        ``{param: gradient}``) where every one of them has them and writes its
        parameters in place; else None (the buckets' shards are read)."""
        buckets = phase.memo.get("direct_buckets", False)
        if buckets is False:
            order = self.order(phase)
            buckets = phase.memo["direct_buckets"] = None if order is None else [
                self.buckets[b] for b, _ in order]
        if buckets is None:
            return None
        got = []
        for bucket in buckets:
            direct = bucket.direct_grads()
            if direct is None:
                return None
            got.append(direct)
        return got

    def grads(self, phase: Phase, directs=None) -> dict[int, list[torch.Tensor]] | None:
        """Per planned bucket of ``phase``, its direct gradients in the order of its pieces,
        where every one of them has them and writes its parameters in place; else None.
        ``directs``: what :meth:`dicts` gave this step, if already asked."""
        if directs is None:
            directs = self.dicts(phase)
        if directs is None:
            return None
        return {b: list(map(d.__getitem__, params))
                for (b, params), d in zip(self.order(phase), directs)}

    def runs(self, phase: Phase, launch) -> list[tuple[int, Callable, bool]]:
        """A native ``launch``'s per-step tensors with direct gradients, as runs of one
        bucket each: ``(position of the bucket in phase.planned, getter, single)``, the
        getter taking that bucket's direct dict to its gradients of the run (one tensor
        where ``single``, else a tuple), in ``launch.bases`` order (what ``per_step``
        gives)."""
        pos = {b: i for i, b in enumerate(phase.planned)}
        params = dict(self.order(phase))
        runs: list[tuple[int, list[int]]] = []
        for b, which, j in launch.bases:
            assert which == GRAD, "a direct plan's per-step tensors are its gradients"
            if not runs or runs[-1][0] != pos[b]:
                runs.append((pos[b], []))
            runs[-1][1].append(params[b][j])
        return [(i, itemgetter(*ps), len(ps) == 1) for i, ps in runs]
