"""parallel_state on real gloo worlds: getters agree, collectives sum exactly their members."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from mpzero import parallel_state as ps
from mpzero.parallel_state import ParallelGrid, optimizer_rank_groups

GETTERS = {
    "tp": (ps.get_tensor_model_parallel_group, ps.get_tensor_model_parallel_world_size,
           ps.get_tensor_model_parallel_rank),
    "pp": (ps.get_pipeline_model_parallel_group, ps.get_pipeline_model_parallel_world_size,
           ps.get_pipeline_model_parallel_rank),
    "cp": (ps.get_context_parallel_group, ps.get_context_parallel_world_size,
           ps.get_context_parallel_rank),
    "dp": (ps.get_data_parallel_group, ps.get_data_parallel_world_size, ps.get_data_parallel_rank),
    "tp-pp": (ps.get_model_parallel_group, ps.get_model_parallel_world_size,
              ps.get_model_parallel_rank),
    "dist-opt": (ps.get_distributed_optimizer_group, ps.get_distributed_optimizer_world_size,
                 ps.get_distributed_optimizer_rank),
    "red-opt": (ps.get_redundant_optimizer_group, ps.get_redundant_optimizer_world_size,
                ps.get_redundant_optimizer_rank),
}


def _expected_groups(world, tp, cp, pp, order, dos):
    grid = ParallelGrid.from_world(world, tp=tp, cp=cp, pp=pp, order=order)
    exp = {k: grid.groups(k) for k in ("tp", "pp", "cp", "dp", "tp-pp")}
    exp["dist-opt"], exp["red-opt"] = optimizer_rank_groups(grid.groups("dp-cp"), dos)
    return exp


def _check_grid(tp, cp, pp, order, dos):
    rank, world = dist.get_rank(), dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, distributed_optimizer_size=dos,
                                 order=order)
    exp = _expected_groups(world, tp, cp, pp, order, dos)
    for kind, (group_fn, size_fn, rank_fn) in GETTERS.items():
        mine = next(g for g in exp[kind] if rank in g)
        group = group_fn()
        assert size_fn() == len(mine) == dist.get_world_size(group), kind
        assert rank_fn() == mine.index(rank) == dist.get_rank(group), kind
        # A collective over the group sums exactly its members: sum of 2^rank is unique.
        t = torch.tensor([float(2**rank)], dtype=torch.float64)
        dist.all_reduce(t, group=group)
        assert t.item() == sum(2.0**r for r in mine), (kind, t.item(), mine)
    # The optimizer grid multiplies to the data-parallel (x context) size.
    assert (ps.get_distributed_optimizer_world_size() * ps.get_redundant_optimizer_world_size()
            == ps.get_data_parallel_world_size(with_context_parallel=True) == world // (tp * pp))
    kw = ps.get_optimizer_process_groups()
    assert set(kw) == {"process_group", "distributed_process_group", "redundant_process_group"}
    assert dist.get_world_size(kw["process_group"]) == world // (tp * pp)
    tp_group = next(g for g in exp["tp"] if rank in g)
    dp_group = next(g for g in exp["dp"] if rank in g)
    pp_group = next(g for g in exp["pp"] if rank in g)
    assert ps.get_tensor_model_parallel_src_rank() == tp_group[0]
    assert ps.get_data_parallel_src_rank() == dp_group[0]
    i = pp_group.index(rank)
    assert ps.get_pipeline_model_parallel_next_rank() == pp_group[(i + 1) % pp]
    assert ps.get_pipeline_model_parallel_prev_rank() == pp_group[(i - 1) % pp]
    assert ps.get_pipeline_model_parallel_first_rank() == pp_group[0]
    assert ps.get_pipeline_model_parallel_last_rank() == pp_group[-1]
    assert ps.is_pipeline_first_stage() == (i == 0)
    assert ps.is_pipeline_last_stage() == (i == pp - 1)
    emb = ps.get_embedding_group()
    assert dist.get_world_size(emb) == (1 if pp == 1 else 2) or i not in (0, pp - 1)
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    return rank


@pytest.mark.parametrize("tp,cp,pp,order,dos", [
    (1, 1, 1, "tp-cp-dp-pp", None),
    (2, 1, 1, "tp-cp-dp-pp", None),
    (1, 1, 1, "tp-cp-dp-pp", 2),
    (2, 1, 2, "tp-cp-dp-pp", None),
    (1, 2, 1, "tp-cp-dp-pp", 1),
    (1, 1, 2, "tp-pp-dp-cp", 1),
    (1, 1, 1, "dp-tp-cp-pp", 4),
])
def test_world4_getters(world, tp, cp, pp, order, dos):
    assert world(4, _check_grid, tp, cp, pp, order, dos) == [0, 1, 2, 3]


@pytest.mark.slow
def test_world8_getters():
    from mpzero.testing import World

    with World(8) as w:
        for args in [(2, 1, 2, "tp-cp-dp-pp", None), (2, 1, 1, "tp-cp-dp-pp", 2),
                     (1, 2, 2, "pp-dp-cp-tp", 2), (2, 2, 2, "tp-cp-dp-pp", None),
                     (1, 1, 1, "tp-cp-dp-pp", 4)]:
            assert w.run(_check_grid, *args) == list(range(8))


def _cycle(n):
    before = None
    for i in range(n):
        ps.initialize_model_parallel(tensor_model_parallel_size=2 if i % 2 else 1,
                                     distributed_optimizer_size=1)
        t = torch.ones(1)
        dist.all_reduce(t, group=ps.get_redundant_optimizer_group())
        expected = dist.get_world_size() // ps.get_tensor_model_parallel_world_size()
        assert t.item() == expected
        n_groups = len(ps._STATE.created)
        if before is not None and i % 2 == 0:
            assert n_groups == before
        before = n_groups if i % 2 == 0 else before
        ps.destroy_model_parallel()
        with pytest.raises(RuntimeError, match="not initialized"):
            ps.get_data_parallel_group()
    return True


def test_init_destroy_cycles(world):
    assert all(world(2, _cycle, 6))


def _destroy_really_destroys():
    from torch.distributed.distributed_c10d import _world

    before = len(_world.pg_map)
    ps.initialize_model_parallel(distributed_optimizer_size=1)
    group = ps.get_data_parallel_group()
    assert group in _world.pg_map and len(_world.pg_map) > before
    ps.destroy_model_parallel()
    assert group not in _world.pg_map
    assert len(_world.pg_map) == before
    return True


def test_destroy_destroys_groups(world):
    assert all(world(2, _destroy_really_destroys))


def _errors():
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_tensor_model_parallel_world_size()
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size \(3\)"):
        ps.initialize_model_parallel(tensor_model_parallel_size=3)
    with pytest.raises(ValueError, match="distributed_optimizer_size=3"):
        ps.initialize_model_parallel(distributed_optimizer_size=3)
    assert not ps.model_parallel_is_initialized()
    ps.initialize_model_parallel()
    with pytest.raises(RuntimeError, match="already initialized"):
        ps.initialize_model_parallel()
    ps.destroy_model_parallel()
    # pp=4: the middle stages are in no embedding group, and say so.
    ps.initialize_model_parallel(pipeline_model_parallel_size=4)
    stage = ps.get_pipeline_model_parallel_rank()
    if stage in (1, 2):
        with pytest.raises(RuntimeError, match=f"stage {stage}.*not in the embedding group"):
            ps.get_embedding_group()
    else:
        assert dist.get_world_size(ps.get_embedding_group()) == 2
    if stage != 0:
        with pytest.raises(RuntimeError, match="not in the position embedding group"):
            ps.get_position_embedding_group()
    ps.destroy_model_parallel()
    # Axes of size 1 may be left out of the order (Megatron does the same).
    ps.initialize_model_parallel(tensor_model_parallel_size=2, order="tp-pp-dp")
    assert ps.get_tensor_model_parallel_world_size() == 2
    assert ps.get_data_parallel_world_size() == 2
    ps.destroy_model_parallel()
    return True


def test_errors(world):
    assert all(world(4, _errors))


def _within_nodes():
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        ps.initialize_model_parallel(distribute_within_nodes=True)
        assert ps.get_distributed_optimizer_world_size() == 2
        rank = dist.get_rank()
        t = torch.tensor([float(2**rank)])
        dist.all_reduce(t, group=ps.get_distributed_optimizer_group())
        node = rank // 2
        assert t.item() == 2.0 ** (2 * node) + 2.0 ** (2 * node + 1)
        ps.destroy_model_parallel()
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = str(dist.get_world_size())
    return True


def test_distribute_within_nodes(world):
    assert all(world(4, _within_nodes))


def test_use_before_init_single_process():
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        ps.get_optimizer_process_groups()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ps.initialize_model_parallel()


# ------------------------------------------------------------------------------ timeouts


def _group_timeouts(timeout, tp, pp):
    """Seconds of every group this rank created (the world group's first)."""
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 distributed_optimizer_size=1, timeout=timeout)
    try:
        groups = list(ps._STATE.created)  # every group, getter or not
        assert groups
        return [ps.get_process_group_timeout().total_seconds()] + [
            ps.get_process_group_timeout(g).total_seconds() for g in groups]
    finally:
        ps.destroy_model_parallel()


@pytest.mark.timeout(300)
def test_every_group_carries_the_timeout(world):
    """``timeout=`` reaches every group, and without it every group takes the default
    (world) group's timeout, not torch's 30 min: a hung rank then fails collectives on
    the optimizer's groups as soon as on the world group."""
    world_s = world(4, _group_timeouts, None, 1, 1)[0][0]
    assert world_s == 300.0 != timedelta(minutes=30).total_seconds()  # mpzero.testing's
    for tp, pp in ((1, 1), (2, 2)):
        for per_rank in world(4, _group_timeouts, 5, tp, pp):
            assert per_rank[0] == world_s and set(per_rank[1:]) == {5.0}, per_rank
        for per_rank in world(4, _group_timeouts, timedelta(seconds=7.5), tp, pp):
            assert set(per_rank[1:]) == {7.5}, per_rank
        for per_rank in world(4, _group_timeouts, None, tp, pp):
            assert set(per_rank) == {world_s}, per_rank


def _reduce_scatter_without_a_peer():
    """Rank 0 reduce-scatters over the distributed optimizer group; rank 1 does not come.
    Returns how long rank 0 waited and what it raised."""
    ps.initialize_model_parallel(timeout=5)
    try:
        group = ps.get_distributed_optimizer_group()
        assert dist.get_world_size(group) == 2
        result = None
        if dist.get_rank() == 0:
            t0 = time.monotonic()
            try:
                dist.reduce_scatter_tensor(torch.zeros(4), torch.ones(8), group=group)
                result = (time.monotonic() - t0, "no error")
            except RuntimeError as e:
                result = (time.monotonic() - t0, str(e))
        # Rank 1 stays in the job (at a world barrier, 300 s) until rank 0 gave up, so
        # rank 0 fails by the group's timeout, not because rank 1 left.
        dist.barrier()
        return result
    finally:
        ps.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_collective_without_a_peer_fails_after_the_group_timeout():
    from mpzero.testing import World

    with World(2) as w:  # its own world: a timed-out group leaves pending messages behind
        waited, error = w.run(_reduce_scatter_without_a_peer, timeout=240)[0]
    assert "timed out" in error.lower(), error
    # 5 s expected; generous for a loaded machine, far below torch's default 1800 s.
    assert 4.0 <= waited < 120, waited


@pytest.mark.timeout(30)
def test_timeout_values_are_checked():
    for bad in (0, -1, timedelta(0), "10", True):
        with pytest.raises(ValueError, match="timeout must be"):
            ps._as_timedelta(bad)
    assert ps._as_timedelta(2.5) == timedelta(seconds=2.5)
