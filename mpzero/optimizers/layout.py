"""Where every parameter element lives: buckets, shards and fragments.

A pure function of parameter sizes, alignment, bucket capacity and the distributed
size (every rank computes it without talking). A *bucket* of ``shard_size *
distributed_size`` elements communicates as one unit; rank ``r`` owns *shard* ``r``. A
parameter is cut into *fragments*, one per bucket it touches, each starting at a multiple
of ``alignment`` (128 bytes of the gradient-sync dtype); the gaps stay zero. ``shard_size``
is a multiple of the alignment; a bucket closed before it fills shrinks to what it holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def alignment_elements(itemsize: int, alignment_bytes: int = 128) -> int:
    """Elements of ``itemsize`` bytes in one alignment unit (128 bytes)."""
    if alignment_bytes % itemsize != 0:
        raise ValueError(f"itemsize {itemsize} does not divide the alignment {alignment_bytes}")
    return alignment_bytes // itemsize


def bucket_capacity_elements(bucket_cap_mb: float, itemsize: int) -> int:
    """Elements of ``itemsize`` bytes in ``bucket_cap_mb`` MiB (2**20 bytes)."""
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
    return max(1, int(bucket_cap_mb * 2**20) // itemsize)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def default_shard_size(capacity: int, alignment: int, distributed_size: int) -> int:
    """Elements of one rank's shard of a full bucket: ``capacity`` spread over the
    distributed ranks, rounded up to ``alignment``, at least one alignment unit."""
    return max(alignment, _round_up(math.ceil(capacity / distributed_size), alignment))


@dataclass(frozen=True)
class Fragment:
    """A contiguous piece of one flattened parameter inside one bucket."""

    param: int  # index of the parameter in the optimizer's flat parameter list
    bucket: int
    param_start: int  # range in the flattened parameter
    param_end: int
    bucket_start: int  # range in the bucket
    bucket_end: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start

    def shard_part(self, shard_start: int, shard_end: int) -> ShardPiece | None:
        """The part of this fragment inside bucket range ``[shard_start, shard_end)``."""
        lo, hi = max(self.bucket_start, shard_start), min(self.bucket_end, shard_end)
        if lo >= hi:
            return None
        offset = lo - self.bucket_start
        return ShardPiece(
            param=self.param,
            param_start=self.param_start + offset,
            param_end=self.param_start + offset + (hi - lo),
            shard_start=lo - shard_start,
            shard_end=hi - shard_start,
        )


@dataclass(frozen=True)
class ShardPiece:
    """The part of a fragment that one rank's shard holds (ranges in param and shard)."""

    param: int
    param_start: int
    param_end: int
    shard_start: int
    shard_end: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: its dtype key, shard size and fragments (in bucket order)."""

    index: int
    key: tuple  # (dtype, grad_sync_dtype, param_sync_dtype): anything hashable
    shard_size: int
    distributed_size: int
    fragments: tuple[Fragment, ...]

    @property
    def size(self) -> int:
        return self.shard_size * self.distributed_size

    @property
    def used(self) -> int:
        return sum(f.numel for f in self.fragments)

    @property
    def params(self) -> tuple[int, ...]:
        """Indices of the parameters with a fragment here, without repeats, in bucket order."""
        return tuple(dict.fromkeys(f.param for f in self.fragments))

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def shard_pieces(self, rank: int) -> list[ShardPiece]:
        """The pieces of fragments that fall into ``rank``'s shard, in shard order."""
        lo, hi = self.shard_range(rank)
        return [p for f in self.fragments if (p := f.shard_part(lo, hi)) is not None]


@dataclass
class LayoutBuilder:
    """Incrementally lays parameters out into buckets (one open bucket per dtype key).

    ``add(params)`` appends parameters given as ``(index, numel, key)``; parameters of
    one key fill that key's open bucket, in the order given. ``close(key)`` (or
    ``close_all()``) ends open buckets, shrinking them to what they hold, so the next
    parameters start fresh buckets (``init_params_bucket``).
    """

    distributed_size: int
    capacity: dict = field(default_factory=dict)  # key -> bucket capacity in elements
    alignment: dict = field(default_factory=dict)  # key -> alignment in elements
    buckets: list[BucketLayout] = field(default_factory=list)
    _open: dict = field(default_factory=dict)  # key -> [index|None, shard_size, frags, cursor]
    _seen: set = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.distributed_size < 1:
            raise ValueError(f"distributed size must be positive, got {self.distributed_size}")

    def _shard_size(self, key) -> int:
        return default_shard_size(self.capacity[key], self.alignment[key], self.distributed_size)

    def add(self, params: Sequence[tuple[int, int, tuple]]) -> None:
        for index, numel, key in params:
            if index in self._seen:
                raise ValueError(f"parameter {index} is laid out twice")
            if key not in self.capacity or key not in self.alignment:
                raise KeyError(f"no capacity/alignment for bucket key {key!r}")
            self._seen.add(index)
            self._add_one(index, numel, key)

    def _add_one(self, index: int, numel: int, key) -> None:
        align = self.alignment[key]
        start = 0
        while start < numel:
            if key not in self._open:
                self._open[key] = [None, self._shard_size(key), [], 0]
            bucket, shard_size, frags, cursor = self._open[key]
            size = shard_size * self.distributed_size
            offset = _round_up(cursor, align)
            if offset >= size:
                self.close(key)
                continue
            if bucket is None:  # indices follow the order buckets receive their first fragment
                bucket = self._open[key][0] = len(self.buckets)
                self.buckets.append(None)
            take = min(numel - start, size - offset)
            frags.append(Fragment(index, bucket, start, start + take, offset, offset + take))
            self._open[key][3] = offset + take
            start += take

    def close(self, key) -> None:
        """End ``key``'s open bucket, shrinking its shard size to what it holds."""
        if key not in self._open:
            return
        bucket, shard_size, frags, cursor = self._open.pop(key)
        if bucket is None:
            return
        align = self.alignment[key]
        shrunk = max(align, _round_up(math.ceil(cursor / self.distributed_size), align))
        self.buckets[bucket] = BucketLayout(bucket, key, min(shard_size, shrunk),
                                            self.distributed_size, tuple(frags))

    def close_all(self, prefix: tuple | None = None) -> None:
        """End every open bucket, or those whose key starts with ``prefix``."""
        for key in list(self._open):
            if prefix is None or key[:len(prefix)] == prefix:
                self.close(key)

    def finished(self) -> list[BucketLayout]:
        """Close every open bucket and return all buckets in index order."""
        self.close_all()
        return list(self.buckets)


def layout_buckets(
    params: Sequence[tuple[int, int, tuple]],
    *,
    distributed_size: int,
    capacity: dict,
    alignment: dict,
) -> list[BucketLayout]:
    """Lay out ``(index, numel, key)`` parameters in one pass (see :class:`LayoutBuilder`)."""
    builder = LayoutBuilder(distributed_size, dict(capacity), dict(alignment))
    builder.add(params)
    return builder.finished()


def fragments_by_param(buckets: Sequence[BucketLayout]) -> dict[int, list[Fragment]]:
    """Every parameter's fragments, in bucket order."""
    out: dict[int, list[Fragment]] = {}
    for b in buckets:
        for f in b.fragments:
            out.setdefault(f.param, []).append(f)
    return out


def utilization(buckets: Sequence[BucketLayout]) -> float:
    """Fraction of bucket elements that hold parameter data (1.0 for no buckets)."""
    total = sum(b.size for b in buckets)
    return 1.0 if total == 0 else sum(b.used for b in buckets) / total


def merge_pieces(pieces: Sequence[ShardPiece], label) -> list[tuple[int, int, object]]:
    """Contiguous shard ranges covering ``pieces``, one per run of equal ``label(piece)``.

    The zero gaps between fragments are absorbed into a range when both neighbours
    share the label, so a fused kernel sees a few long ranges instead of many
    fragments. Returns ``(shard_start, shard_end, label)`` triples in shard order.
    """
    out: list[list] = []
    for p in sorted(pieces, key=lambda p: p.shard_start):
        lab = label(p)
        if out and out[-1][2] == lab:
            out[-1][1] = p.shard_end
        else:
            out.append([p.shard_start, p.shard_end, lab])
    return [tuple(x) for x in out]
