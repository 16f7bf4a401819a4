"""Rank grids as pure functions, checked against a brute-force computation."""

import itertools
import random

import pytest

from mpzero.parallel_state import ParallelGrid, optimizer_rank_groups, parse_order

ORDERS = ["-".join(p) for p in itertools.permutations(["tp", "cp", "dp", "pp"])]


def brute_coords(rank, sizes, axes):
    """Mixed-radix digits of rank, leftmost axis fastest (the SPEC formula)."""
    out = {}
    for a in axes:
        out[a] = rank % sizes[a]
        rank //= sizes[a]
    return out


def brute_groups(world, sizes, axes, varying):
    """Groups of ranks sharing every coordinate outside `varying`."""
    by_key = {}
    for r in range(world):
        c = brute_coords(r, sizes, axes)
        key = tuple(c[a] for a in axes if a not in varying)
        by_key.setdefault(key, []).append(r)
    return sorted(sorted(g) for g in by_key.values())


def cases():
    out = []
    for world in (1, 2, 4, 6, 8, 12, 16, 24):
        for tp, cp, pp in itertools.product((1, 2, 3, 4), repeat=3):
            if world % (tp * cp * pp) == 0:
                out.append((world, tp, cp, pp))
    return out


@pytest.mark.parametrize("world,tp,cp,pp", cases())
def test_groups_match_brute_force_and_partition(world, tp, cp, pp):
    rng = random.Random(world * 1000 + tp * 100 + cp * 10 + pp)
    for order in rng.sample(ORDERS, 4) + ["tp-cp-dp-pp"]:
        grid = ParallelGrid.from_world(world, tp=tp, cp=cp, pp=pp, order=order)
        sizes = {"tp": tp, "cp": cp, "dp": grid.dp, "pp": pp}
        axes = order.split("-")
        for varying in (["tp"], ["cp"], ["dp"], ["pp"], ["dp", "cp"], ["tp", "pp"], ["tp", "cp"]):
            groups = grid.groups("-".join(varying))
            # Every rank exactly once per axis kind.
            flat = sorted(r for g in groups for r in g)
            assert flat == list(range(world)), (order, varying)
            assert sorted(sorted(g) for g in groups) == brute_groups(world, sizes, axes, varying)
            expected = 1
            for a in varying:
                expected *= sizes[a]
            assert all(len(g) == expected for g in groups)


def test_rank_formula_default_order():
    grid = ParallelGrid(world_size=24, tp=2, cp=3, dp=2, pp=2)
    for r in range(24):
        c = grid.coords(r)
        assert r == c["tp"] + 2 * (c["cp"] + 3 * (c["dp"] + 2 * c["pp"]))
        assert grid.rank_of(c) == r


def test_known_megatron_layout():
    # 8 ranks, tp=2, pp=2 -> dp=2 with default order (Megatron's docstring example shape).
    grid = ParallelGrid.from_world(8, tp=2, pp=2)
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.groups("tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert grid.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_group_member_order_follows_grid():
    grid = ParallelGrid.from_world(8, tp=2, cp=2)
    # dp-cp: cp is faster than dp in the default order.
    assert grid.groups("dp-cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize("bad", [dict(tp=3), dict(tp=2, pp=3), dict(cp=5)])
def test_sizes_not_dividing_world_raise(bad):
    with pytest.raises(ValueError, match="world_size"):
        ParallelGrid.from_world(8, **bad)


def test_explicit_sizes_must_multiply():
    with pytest.raises(ValueError, match=r"world_size \(8\).*\(2\).*\(1\).*\(2\).*\(1\)"):
        ParallelGrid(world_size=8, tp=2, dp=2)


@pytest.mark.parametrize("order", ["tp-dp-pp", "tp-cp-dp-pp-tp", "tp-xx-dp-pp", "tp_cp_dp_pp"])
def test_bad_order(order):
    with pytest.raises(ValueError, match="order"):
        parse_order(order)


def test_order_may_leave_out_size_one_axes():
    full = ParallelGrid.from_world(16, tp=2, pp=2, order="tp-cp-pp-dp")
    short = ParallelGrid.from_world(16, tp=2, pp=2, order="tp-pp-dp")
    assert short.axes == ("tp", "pp", "dp", "cp")
    for kind in ("tp", "pp", "dp", "cp", "dp-cp", "tp-pp"):
        assert short.groups(kind) == full.groups(kind)
    with pytest.raises(ValueError, match=r"leaves out cp \(size 2\)"):
        ParallelGrid.from_world(16, tp=2, cp=2, order="tp-pp-dp")


@pytest.mark.parametrize("n,d", [(1, 1), (4, 1), (4, 2), (4, 4), (8, 2), (12, 3), (6, None)])
def test_optimizer_groups(n, d):
    dp_groups = [list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))]
    dist_g, red_g = optimizer_rank_groups(dp_groups, d)
    d = n if d is None else d
    for members in dp_groups:
        mine_d = [g for g in dist_g if g[0] in members]
        mine_r = [g for g in red_g if g[0] in members]
        assert mine_d == [members[i : i + d] for i in range(0, n, d)]  # contiguous chunks
        assert mine_r == [members[j::d] for j in range(d)]  # strided
        # distributed x redundant is a grid over the DP group: each pair meets in one rank.
        for a in mine_d:
            for b in mine_r:
                assert len(set(a) & set(b)) == 1
    assert all(len(g) == d for g in dist_g)
    assert all(len(g) == n // d for g in red_g)


def test_optimizer_groups_bad_size():
    with pytest.raises(ValueError, match="distributed_optimizer_size=3"):
        optimizer_rank_groups([[0, 1, 2, 3]], 3)
    with pytest.raises(ValueError, match="distributed_optimizer_size=0"):
        optimizer_rank_groups([[0, 1, 2, 3]], 0)


def test_optimizer_groups_within_nodes():
    # 8 ranks, 4 per node, dp group = all ranks.
    dist_g, red_g = optimizer_rank_groups([list(range(8))], None, local_world_size=4)
    assert dist_g == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert red_g == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # tp=2 inside the node: dp groups [0,2,4,6] and [1,3,5,7].
    dist_g, red_g = optimizer_rank_groups([[0, 2, 4, 6], [1, 3, 5, 7]], 2, local_world_size=4)
    assert dist_g == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert red_g == [[0, 4], [2, 6], [1, 5], [3, 7]]
    with pytest.raises(ValueError, match="conflicts with distribute_within_nodes"):
        optimizer_rank_groups([list(range(8))], 2, local_world_size=4)
    with pytest.raises(ValueError, match="same number of data-parallel ranks"):
        optimizer_rank_groups([[0, 1, 2, 4]], None, local_world_size=3)
