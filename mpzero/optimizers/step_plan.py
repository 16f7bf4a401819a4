"""The fused Adam launches of one step phase, worked out once.

A phase launches the same kernels on the same state slices every step; only the
gradient shards and the output buffers are new. A :class:`StepPlan` keeps the static
argument lists and the split sizes that cut the new tensors (one ``split`` per bucket
instead of a slice per fragment), with the kernel chosen once; where the kernels have a
native plan (``kernels.adam_plan``) later steps pass only the per-step tensors. State
tensors are never replaced and parameters do not move, so a plan lives as long as the
optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

GRAD, OUT = "grad", "out"  # per-step tensors of a bucket


def split_sizes(ranges: Sequence[tuple[int, int]], total: int) -> tuple[list[int], list[int]]:
    """Sizes that ``split`` a length-``total`` tensor into pieces containing each of the
    sorted, disjoint ``ranges`` (gaps become pieces of their own), and the index of
    each range's piece."""
    sizes, index, pos = [], [], 0
    for s, e in ranges:
        if s < pos:
            raise ValueError(f"ranges overlap or are unsorted at {s} < {pos}")
        if s > pos:
            sizes.append(s - pos)
        index.append(len(sizes))
        sizes.append(e - s)
        pos = e
    if pos < total:
        sizes.append(total - pos)
    return sizes, index


@dataclass
class Cutter:
    """Cuts a bucket's per-step shard tensor into the slices of ``ranges``."""

    ranges: list[tuple[int, int]]
    total: int
    sizes: list[int] = field(init=False)
    index: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.sizes, self.index = split_sizes(self.ranges, self.total)

    def __call__(self, t: torch.Tensor) -> list[torch.Tensor]:
        if len(self.sizes) == 1:
            return [t]
        pieces = t.split(self.sizes)
        return [pieces[k] for k in self.index]


@dataclass
class Launch:
    """One kernel call: argument lists with ``None`` where a per-step slice goes.

    ``slots[i]`` is ``(position in lists, entry, bucket, GRAD|OUT, range index)`` for
    each per-step entry."""

    remainders: bool
    group: int
    lists: list[list]
    slots: list[tuple[int, int, int, str, int]]
    kernel: Callable | None = None
    native: Callable | None = None  # kernels.adam_plan: takes the per-step bases only
    # (bucket, GRAD|OUT) each, or (bucket, GRAD, range index) for a direct bucket's gradient
    bases: list[tuple] = field(default_factory=list)

    def per_step(self, grads: dict, outs: dict) -> list[torch.Tensor]:
        """This step's tensors of ``bases``, in order (what ``native`` is called with)."""
        runs = self.__dict__.get("_runs")
        if runs is None:  # consecutive direct gradients of one bucket: one list slice
            runs = self._runs = []
            for k in self.bases:
                last = runs[-1] if runs else None
                if len(k) == 3 and last and last[0] == k[0] and last[2] is not None \
                        and last[3] == k[2]:
                    runs[-1][3] += 1
                else:
                    runs.append([k[0], k[1], None, None] if len(k) == 2
                                else [k[0], GRAD, k[2], k[2] + 1])
        got = []
        for b, which, lo, hi in runs:
            if lo is None:
                got.append(grads[b] if which == GRAD else outs[b])
            else:
                got += grads[b][lo:hi]
        return got

    def fill(self, pieces: dict) -> list[list]:
        lists = [list(lst) for lst in self.lists]
        for pos, entry, b, which, j in self.slots:
            lists[pos][entry] = pieces[b, which][j]
        return lists


@dataclass
class StepPlan:
    """The launches of one phase and the cutters of its buckets."""

    launches: list[Launch]
    cutters: dict[int, Cutter]  # bucket -> how its gradient / output shard is cut
    needs_out: set[int]  # buckets whose shard-sized output buffer is written
    # Buckets whose per-step gradient is a list of tensors, one per range (direct
    # gradients, grad_sync.py), instead of one shard to cut.
    direct: set[int] = field(default_factory=set)

    def native_slots(self, launch: Launch) -> tuple[list[tuple[int, int, int, int]],
                                                    list[tuple[int, str]]]:
        """``launch``'s per-step slots as ``(list position, entry, base, element offset)``
        into the distinct per-step tensors ``(bucket, GRAD|OUT)`` it reads (the second
        list, in base order)."""
        bases: dict[tuple, int] = {}
        slots = []
        for pos, entry, b, which, j in launch.slots:
            if which == GRAD and b in self.direct:  # a tensor of its own per range
                slots.append((pos, entry, bases.setdefault((b, which, j), len(bases)), 0))
                continue
            k = bases.setdefault((b, which), len(bases))
            slots.append((pos, entry, k, self.cutters[b].ranges[j][0]))
        return slots, list(bases)

    def pieces(self, grads: dict[int, torch.Tensor], outs: dict) -> dict:
        """``(bucket, GRAD|OUT) -> slices`` of this step's gradient and output shards."""
        got = {}
        for b, cut in self.cutters.items():
            got[b, GRAD] = grads[b] if b in self.direct else cut(grads[b])
            if b in self.needs_out:
                got[b, OUT] = cut(outs[b])
        return got


class PlanBuilder:
    """Collects kernel entries per (param group, bucket key, kind) into launches."""

    def __init__(self) -> None:
        self._launches: dict[tuple, Launch] = {}
        self.cutters: dict[int, Cutter] = {}
        self.needs_out: set[int] = set()
        self.direct: set[int] = set()

    def bucket(self, b: int, ranges: list[tuple[int, int]], total: int, out: bool,
               direct: bool = False) -> None:
        """``direct``: the bucket's per-step gradient comes as one tensor per range."""
        self.cutters[b] = Cutter(ranges, total)
        if out:
            self.needs_out.add(b)
        if direct:
            self.direct.add(b)

    def add(self, key: tuple, remainders: bool, group: int, entry: Sequence) -> None:
        """``entry``: one tensor per list, or ``(bucket, GRAD|OUT, range index)`` for a
        per-step slice."""
        launch = self._launches.get(key)
        if launch is None:
            launch = self._launches[key] = Launch(remainders, group,
                                                  [[] for _ in entry], [])
        n = len(launch.lists[0])
        for pos, t in enumerate(entry):
            if isinstance(t, tuple):
                launch.slots.append((pos, n, *t))
                launch.lists[pos].append(None)
            else:
                launch.lists[pos].append(t)

    def finish(self) -> StepPlan:
        return StepPlan(list(self._launches.values()), self.cutters, self.needs_out,
                        self.direct)
