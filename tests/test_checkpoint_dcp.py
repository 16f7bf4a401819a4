"""Sharded DCP checkpoints (mpzero.checkpoint.dcp): optimizer saved at dp 4 loads
bit-exactly at dp 2, 1 and a 2x2 grid; TP model shards saved at tp 2 load at tp 1
and 4; consolidate() gives the full model and a format-2 optimizer state; a wrong
model or a missing piece is refused before anything changes."""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mpzero import parallel_state as ps
from mpzero.checkpoint import dcp as mdcp
from mpzero.optimizers import DistributedFusedAdam
from mpzero.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from dfa_common import batches, groups_for, make_model, train_split_steps

TINY = 24 * 4 / 2**20
pytestmark = pytest.mark.timeout(300)


def _opt(grid, bucket):
    model = make_model()
    opt = DistributedFusedAdam(
        [{"params": [model.fc1.weight, model.fc2.weight], "weight_decay": 0.1},
         {"params": [p for n, p in model.named_parameters()
                     if n not in ("fc1.weight", "fc2.weight")], "lr": 5e-3}],
        lr=1e-2, bucket_cap_mb=bucket, **groups_for(grid))
    return model, opt


def _save(path):
    model, opt = _opt("flat", TINY)
    train_split_steps(model, opt, batches(4, 2, 1), range(2), 4)
    opt.param_groups[1]["lr"] = 4e-3
    mdcp.save_sharded(path, model, opt)
    full = opt.state_dict()
    dist.barrier()
    return full, os.path.getsize(os.path.join(path, f"__{dist.get_rank()}_0.distcp"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from mpzero.testing import run_on_world

    path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    out = run_on_world(4, _save, path)
    return path, out[0][0], [o[1] for o in out]


def _load(path, grid, bucket):
    model, opt = _opt(grid, bucket)
    torch.nn.init.zeros_(model.fc1.weight)  # the model comes from the checkpoint too
    mdcp.load_sharded(path, model, opt)
    return opt.state_dict(), model.fc1.weight.detach().clone()


@pytest.mark.parametrize("world_size,grid,bucket",
                         [(2, "flat", 100.0), (1, "flat", TINY), (4, "2x2", TINY * 3)])
def test_optimizer_reshards_bit_exactly(world, saved, world_size, grid, bucket):
    path, full, _ = saved
    for sd, w in world(world_size, _load, path, grid, bucket):
        assert sd["state"]["step"] == full["state"]["step"] == 2
        assert [g["lr"] for g in sd["param_groups"]] == [g["lr"] for g in full["param_groups"]]
        for i in range(8):
            for k in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(sd["state"][i][k], full["state"][i][k]), (i, k)
        assert torch.equal(w, full["state"][0]["param"])


def test_each_rank_wrote_only_its_shard(saved):
    """Every optimizer element is stored once, and each rank's file holds about a quarter."""
    import torch.distributed.checkpoint as dcp

    path, full, _ = saved
    total = sum(t.numel() for i, st in full["state"].items() if i != "step"
                for k, t in st.items() if k != "step")
    md = dcp.FileSystemReader(path).read_metadata()
    per_file: dict = {}
    for idx, info in md.storage_data.items():
        if idx.fqn.startswith("optim/"):
            n = md.state_dict_metadata[idx.fqn].size.numel()
            per_file[info.relative_path] = per_file.get(info.relative_path, 0) + n
    assert sum(per_file.values()) == total
    assert len(per_file) == 4 and all(n < total / 2 for n in per_file.values()), per_file


def test_consolidate_gives_format_2(saved):
    path, full, _ = saved
    out = mdcp.consolidate(path)
    sd = out["optimizer"]
    assert sd["format"] == 2 and sd["state"]["step"] == 2
    for i in range(8):
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["state"][i][k], full["state"][i][k]), (i, k)
    assert torch.equal(out["model"]["fc1.weight"], full["state"][0]["param"])


def _wrong_model(path):
    model, opt = _opt("flat", TINY)
    other = torch.nn.Linear(7, 3)
    before = other.weight.detach().clone()
    with pytest.raises(ValueError, match="model key 'weight'"):
        mdcp.load_sharded(path, other)
    assert torch.equal(other.weight, before)
    return True


def test_wrong_model_is_refused(world, saved):
    assert all(world(1, _wrong_model, saved[0]))


class TPNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = ColumnParallelLinear(8, 16)
        self.down = RowParallelLinear(16, 8, input_is_parallel=True)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)[0]))[0]


def _tp_model(tp):
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(7)
    return TPNet()


def _tp_save(path):
    model = _tp_model(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(dist.get_rank() * 0)  # same init on every rank: slices of one weight
    mdcp.save_sharded(path, model, tp_group=ps.get_tensor_model_parallel_group())
    return {k: v.clone() for k, v in model.state_dict().items()}


def _tp_load(path, tp):
    model = _tp_model(tp)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    mdcp.load_sharded(path, model, tp_group=ps.get_tensor_model_parallel_group())
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    return {k: v.clone() for k, v in model.state_dict().items()}, model(x).detach()


def test_tp_shards_load_at_other_tp_sizes(world, tmp_path):
    path = str(tmp_path / "tp")
    world(2, _tp_save, path)
    full = mdcp.consolidate(path)["model"]
    assert full["up.weight"].shape == (16, 8) and full["down.weight"].shape == (8, 16)
    (sd1, y1), = world(1, _tp_load, path, 1)
    for k, v in sd1.items():
        assert torch.equal(v, full[k]), k
    outs = world(4, _tp_load, path, 4)
    for r, (sd, y) in enumerate(outs):
        assert torch.equal(sd["up.weight"], full["up.weight"][4 * r:4 * r + 4])
        assert torch.equal(sd["down.weight"], full["down.weight"][:, 4 * r:4 * r + 4])
        torch.testing.assert_close(y, y1, rtol=1e-6, atol=1e-6)


def _tp_optim(path, save):
    model = _tp_model(2)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, **ps.get_optimizer_process_groups())
    if save:
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
        model(x).square().sum().backward()
        opt.step()
        mdcp.save_sharded(path, model, opt, tp_group=ps.get_tensor_model_parallel_group())
    else:
        mdcp.load_sharded(path, model, opt, tp_group=ps.get_tensor_model_parallel_group())
    return opt.state_dict()


def test_tp_optimizer_states_are_kept_per_tp_rank(world, tmp_path):
    path = str(tmp_path / "tpopt")
    saved = world(2, _tp_optim, path, True)
    assert not torch.equal(saved[0]["state"][0]["exp_avg"], saved[1]["state"][0]["exp_avg"])
    loaded = world(2, _tp_optim, path, False)
    for a, b in zip(saved, loaded):
        for i in range(len(a["state"]) - 1):
            for k in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(a["state"][i][k], b["state"][i][k]), (i, k)
    merged = mdcp.consolidate(path)["optimizer"]["state"]
    assert torch.equal(merged[0]["exp_avg"],  # up.weight: rows split over TP
                       torch.cat([saved[0]["state"][0]["exp_avg"],
                                  saved[1]["state"][0]["exp_avg"]], 0))


# ------------------------------------------------------- TP resharding (model + optimizer)
# Saved at one TP size, loaded at another: TPNet has rows split (up.weight, up.bias),
# columns split (down.weight) and a replicated bias (down.bias); tiny buckets fragment
# each parameter over the data-parallel ranks too.
_X = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))


def _tp_opt(model):
    return DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1,
                                bucket_cap_mb=TINY, **ps.get_optimizer_process_groups())


def _tp_train_save(path, tp, legacy=False):
    """Two steps at ``tp`` (same data on every rank: any grid computes the same), then
    a save. ``legacy``: as saves before partition dims were recorded at TP 1."""
    model = _tp_model(tp)
    opt = _tp_opt(model)
    for _ in range(2):
        opt.zero_grad()
        model(_X).square().sum().backward()
        opt.step()
    if legacy:
        for p in model.parameters():
            p.tensor_model_parallel = False
    mdcp.save_sharded(path, model, opt, tp_group=ps.get_tensor_model_parallel_group())
    if legacy and dist.get_rank() == 0:
        meta = mdcp.read_meta(path)
        del meta["optim"]["partition_dims"]
        (Path(path) / mdcp.META).write_text(json.dumps(meta))
    dist.barrier()
    return opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}


def _tp_load_save(path, tp, with_optim, out=None):
    """Load at ``tp`` into a zeroed model (and fresh optimizer), save again to ``out``."""
    model = _tp_model(tp)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = _tp_opt(model)
    chunk, mdcp._RESHARD_CHUNK = mdcp._RESHARD_CHUNK, 7  # many pieces per parameter range
    try:
        mdcp.load_sharded(path, model, opt if with_optim else None,
                          tp_group=ps.get_tensor_model_parallel_group())
    finally:
        mdcp._RESHARD_CHUNK = chunk
    if out is not None:
        mdcp.save_sharded(out, model, opt, tp_group=ps.get_tensor_model_parallel_group())
    return opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same_full(a, b, optimizer=True):
    """Two checkpoints hold the same full model (and optimizer state), bit for bit."""
    ca, cb = mdcp.consolidate(a), mdcp.consolidate(b)
    for k, v in ca["model"].items():
        assert torch.equal(v, cb["model"][k]), k
    if optimizer:
        sa, sb = ca["optimizer"]["state"], cb["optimizer"]["state"]
        assert sa["step"] == sb["step"] == 2
        for i in range(4):
            for k in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(sa[i][k], sb[i][k]), (i, k)
        assert ca["optimizer"]["param_groups"] == cb["optimizer"]["param_groups"]


def _slice(full, name, tp, r):
    dim = {"up.weight": 0, "up.bias": 0, "down.weight": 1}.get(name)
    return full if dim is None else full.chunk(tp, dim)[r]


@pytest.mark.parametrize("legacy", [False, True])
def test_tp1_checkpoint_loads_at_tp2_and_tp4(world, tmp_path, legacy):
    """1 -> 2 and 1 -> 4 (a TP-1 save records how each tensor is split), with and
    without the optimizer; ``legacy``: a TP-1 save that recorded no partition dims."""
    a = str(tmp_path / "tp1")
    ((_, ref),) = world(1, _tp_train_save, a, 1, legacy)
    assert mdcp.read_meta(a)["model"]["up.weight"]["dim"] == (None if legacy else 0)
    for tp in (2, 4):
        out = str(tmp_path / f"again{tp}")
        for r, (_, sd) in enumerate(world(tp, _tp_load_save, a, tp, True, out)):
            for k, v in sd.items():
                assert torch.equal(v, _slice(ref[k], k, tp, r)), (tp, r, k)
        _assert_same_full(a, out)
        for r, (_, sd) in enumerate(world(tp, _tp_load_save, a, tp, False)):  # model only
            for k, v in sd.items():
                assert torch.equal(v, _slice(ref[k], k, tp, r)), (tp, r, k)


@pytest.mark.parametrize("with_optim", [True, False])
def test_tp2_to_tp1_to_tp2_round_trip_is_bit_exact(world, tmp_path, with_optim):
    """2 -> 1 -> 2 on 2 x 2 and 1 x 4 grids: the model (and the optimizer state) come
    back bit for bit on every rank (data-parallel shards included)."""
    a, b, c = (str(tmp_path / n) for n in "abc")
    saved = world(4, _tp_train_save, a, 2)  # tp 2 x dp 2
    world(4, _tp_load_save, a, 1, with_optim, b)  # tp 1 x dp 4
    _assert_same_full(a, b, with_optim)
    back = world(4, _tp_load_save, b, 2, with_optim, c)  # tp 2 x dp 2 again
    _assert_same_full(a, c, with_optim)
    for (sd0, m0), (sd1, m1) in zip(saved, back):
        for k, v in m0.items():
            assert torch.equal(v, m1[k]), k
        if not with_optim:
            continue
        assert sd0["state"]["step"] == sd1["state"]["step"] == 2
        for i in range(4):
            for k in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(sd0["state"][i][k], sd1["state"][i][k]), (i, k)


def _one_rank_wrong_model(path):
    """Rank 1 loads into a model of another shape, rank 0 into the right one: both
    refuse with the same error, and rank 0's model and optimizer are unchanged."""
    model, opt = _opt("flat", TINY)
    if dist.get_rank() == 1:
        model.fc2 = torch.nn.Linear(13, 14)  # the saved fc2 is 13 x 13
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lrs = [g["lr"] for g in opt.param_groups]
    with pytest.raises(ValueError) as info:
        mdcp.load_sharded(path, model, opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert [g["lr"] for g in opt.param_groups] == lrs and opt.step_state.count() == 0
    return str(info.value)


def test_load_refused_on_one_rank_is_refused_on_all(world, saved):
    msgs = world(2, _one_rank_wrong_model, saved[0])
    assert msgs[0] == msgs[1] and "model key 'fc2.weight'" in msgs[0], msgs
    assert "refused on rank 1" in msgs[0]
