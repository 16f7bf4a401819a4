"""Bucket layout as a pure function: coverage, partition, alignment, determinism."""

import random

import pytest

from mpzero.optimizers.layout import (
    LayoutBuilder,
    alignment_elements,
    bucket_capacity_elements,
    layout_buckets,
    merge_pieces,
    utilization,
)

KEY = ("fp32", "fp32", "fp32")


def _check(buckets, numels, align, dsize):
    seen = {i: [0] * n for i, n in enumerate(numels)}
    for b in buckets:
        assert b.shard_size % align == 0 and b.shard_size >= align
        assert b.size == b.shard_size * dsize
        occupied = [False] * b.size
        for f in b.fragments:
            assert f.bucket == b.index
            assert f.bucket_start % align == 0, "fragment start not aligned"
            assert 0 <= f.bucket_start < f.bucket_end <= b.size
            assert f.bucket_end - f.bucket_start == f.param_end - f.param_start
            for j in range(f.bucket_start, f.bucket_end):
                assert not occupied[j], "two fragments overlap in a bucket"
                occupied[j] = True
            for e in range(f.param_start, f.param_end):
                seen[f.param][e] += 1
        # Shards partition the bucket: each fragment element is in exactly one rank's shard.
        covered = [0] * b.size
        for r in range(dsize):
            lo, hi = b.shard_range(r)
            for p in b.shard_pieces(r):
                assert 0 <= p.shard_start < p.shard_end <= b.shard_size
                for j in range(p.shard_start, p.shard_end):
                    covered[lo + j] += 1
        assert covered == [int(o) for o in occupied]
    for i, counts in seen.items():
        assert counts == [1] * numels[i], f"param {i}: every element exactly once"


@pytest.mark.parametrize("seed", range(40))
def test_random_layouts(seed):
    rng = random.Random(seed)
    dsize = rng.choice([1, 2, 3, 4, 8])
    align = rng.choice([8, 16, 32, 64])
    cap = rng.choice([1, 7, 50, 100, 333, 1000])
    sizes = [1, 2, 5, 31, 64, 100, 257, 1000, 3000]
    numels = [rng.choice(sizes) for _ in range(rng.randint(1, 25))]
    params = [(i, n, KEY) for i, n in enumerate(numels)]
    buckets = layout_buckets(params, distributed_size=dsize, capacity={KEY: cap},
                             alignment={KEY: align})
    _check(buckets, numels, align, dsize)
    # Deterministic: same input, same layout.
    again = layout_buckets(params, distributed_size=dsize, capacity={KEY: cap},
                           alignment={KEY: align})
    assert again == buckets


def test_params_split_across_buckets_in_order():
    # capacity 64 elements over 2 ranks, alignment 16: a 100-element param spans 2 buckets.
    buckets = layout_buckets([(0, 100, KEY), (1, 10, KEY)], distributed_size=2,
                             capacity={KEY: 64}, alignment={KEY: 16})
    assert [b.shard_size for b in buckets] == [32, 32]
    f0, f1 = buckets[0].fragments[0], buckets[1].fragments[0]
    assert (f0.param, f0.param_start, f0.param_end, f0.bucket_start) == (0, 0, 64, 0)
    assert (f1.param, f1.param_start, f1.param_end, f1.bucket_start) == (0, 64, 100, 0)
    assert buckets[1].fragments[1].bucket_start == 48  # 36 rounded up to 16
    assert buckets[1].params == (0, 1)


def test_shrinks_last_bucket_and_keys_separate():
    k2 = ("bf16", "bf16", "bf16")
    b = LayoutBuilder(4, {KEY: 10_000, k2: 10_000}, {KEY: 32, k2: 64})
    b.add([(0, 10, KEY), (1, 10, k2), (2, 5, KEY)])
    buckets = b.finished()
    assert [x.key for x in buckets] == [KEY, k2]
    assert buckets[0].params == (0, 2) and buckets[1].params == (1,)
    assert buckets[0].shard_size == 32 and buckets[1].shard_size == 64  # one alignment unit


def test_close_forces_fresh_bucket():
    b = LayoutBuilder(2, {KEY: 1000}, {KEY: 8})
    b.add([(0, 3, KEY)])
    b.close(KEY)
    b.add([(1, 3, KEY), (2, 3, KEY)])
    b.close(KEY)
    b.add([(3, 3, KEY)])
    assert [bk.params for bk in b.finished()] == [(0,), (1, 2), (3,)]


def test_twice_is_an_error():
    b = LayoutBuilder(2, {KEY: 1000}, {KEY: 8})
    b.add([(0, 3, KEY)])
    with pytest.raises(ValueError, match="twice"):
        b.add([(0, 3, KEY)])


def test_sizes():
    assert alignment_elements(4) == 32 and alignment_elements(2) == 64
    assert alignment_elements(8) == 16
    assert bucket_capacity_elements(1.0, 4) == 2**18
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        bucket_capacity_elements(0, 4)


def test_utilization_and_merge():
    buckets = layout_buckets([(i, 1, KEY) for i in range(4)], distributed_size=1,
                             capacity={KEY: 10_000}, alignment={KEY: 32})
    assert utilization(buckets) == pytest.approx(4 / 128)
    pieces = buckets[0].shard_pieces(0)
    merged = merge_pieces(pieces, label=lambda p: p.param % 2 == 0 and p.param < 2)
    assert merged == [(0, 1, True), (32, 97, False)]
