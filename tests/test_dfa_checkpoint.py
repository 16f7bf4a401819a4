"""Checkpoints: format 2 saved on a 2x2 grid loads on 1, 2 and 4 ranks, other bucket
sizes and init orders, and training continues identically; sharded save/load (through
the DCP path, ``mpzero.checkpoint.dcp``, which saves ``sharded_state_dict()``)."""


import pytest
import torch
import torch.distributed as dist

from mpzero.checkpoint import dcp as mdcp
from mpzero.optimizers import DistributedFusedAdam
from mpzero.optimizers import checkpoint as ckpt

from dfa_common import batches, groups_for, make_model, train_split_steps

TINY = 24 * 4 / 2**20
SAVED_WORLD, STEPS, MORE = 4, 2, 2


def _make(grid, bucket, reverse_init=False):
    model = make_model()
    kw = groups_for(grid)
    opt = DistributedFusedAdam(
        [{"params": [model.fc1.weight, model.fc2.weight], "weight_decay": 0.1},
         {"params": [p for n, p in model.named_parameters()
                     if n not in ("fc1.weight", "fc2.weight")], "lr": 5e-3}],
        lr=1e-2, bucket_cap_mb=bucket, **kw)
    if reverse_init:
        opt.init_params(list(model.parameters()))
    return model, opt


def _save(path):
    model, opt = _make("2x2", TINY)
    data = batches(SAVED_WORLD, STEPS + MORE, 1)
    train_split_steps(model, opt, data, range(STEPS), SAVED_WORLD)
    opt.param_groups[1]["lr"] = 4e-3  # changed by the user: must be restored on load
    sd = opt.state_dict()
    mdcp.save_sharded(path + "-sharded", None, opt)
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "optim": sd}, path)
    dist.barrier()
    train_split_steps(model, opt, data, range(STEPS, STEPS + MORE), SAVED_WORLD)
    return [p.detach().clone() for p in model.parameters()], sd["state"][0]["exp_avg"]


def _resume(path, grid, bucket, reverse_init, sharded):
    saved = torch.load(path, weights_only=True)
    model, opt = _make(grid, bucket, reverse_init)
    model.load_state_dict(saved["model"])
    if sharded:
        mdcp.load_sharded(path + "-sharded", None, opt)
    else:
        opt.load_state_dict(saved["optim"])
    assert opt.param_groups[1]["lr"] == 4e-3
    sd = opt.state_dict()
    for i, st in saved["optim"]["state"].items():
        if i == "step":
            assert sd["state"]["step"] == st
            continue
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["state"][i][k], st[k]), (i, k)
    data = batches(SAVED_WORLD, STEPS + MORE, 1)
    train_split_steps(model, opt, data, range(STEPS, STEPS + MORE), SAVED_WORLD)
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from mpzero.testing import run_on_world

    path = str(tmp_path_factory.mktemp("ckpt") / "state.pt")
    out = run_on_world(SAVED_WORLD, _save, path)
    return path, out[0][0]


@pytest.mark.parametrize("world_size,grid,bucket,reverse_init,sharded", [
    (1, "flat", TINY, False, False),
    (2, "flat", 100.0, True, False),
    (4, "flat", TINY * 3, False, False),
    (4, "2x2", TINY, True, False),
    (2, "1x2", TINY, False, True),
    (4, "flat", 100.0, False, True),
])
def test_reshard_and_continue(world, saved, world_size, grid, bucket, reverse_init, sharded):
    path, expected = saved
    results = world(world_size, _resume, path, grid, bucket, reverse_init, sharded)
    for params in results:
        for p, q in zip(params, expected):
            # Different world sizes sum the same gradients in another order: fp32 rounding.
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_format_2_layout(saved):
    path, _ = saved
    sd = torch.load(path, weights_only=True)["optim"]
    assert sd["format"] == 2
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3, 4, 5, 6, 7]]
    g0 = sd["param_groups"][0]
    assert {"lr", "betas", "eps", "weight_decay", "bias_correction"} <= set(g0)
    assert sd["state"]["step"] == STEPS and isinstance(sd["state"]["step"], int)
    model = make_model()
    for i, p in enumerate([model.fc1.weight, model.fc2.weight]):
        for k in ("param", "exp_avg", "exp_avg_sq"):
            t = sd["state"][i][k]
            assert t.shape == p.shape and t.dtype == torch.float32 and t.device.type == "cpu"
    assert sd["state"][0]["exp_avg_sq"].min() >= 0 and sd["state"][0]["exp_avg"].abs().sum() > 0


def _bad_load(path):
    model, opt = _make("flat", TINY)
    with pytest.raises(ValueError, match="format"):
        opt.load_state_dict({"format": 1})
    sd = torch.load(path, weights_only=True)["optim"]
    sd["param_groups"] = sd["param_groups"][:1]
    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict(sd)
    return True


def test_bad_state_dicts(world, saved):
    assert all(world(1, _bad_load, saved[0]))


def _in_memory_sharded():
    """sharded_state_dict() of every rank (2x... here flat 2) loads into a 1-bucket layout."""
    model, opt = _make("flat", TINY)
    data = batches(SAVED_WORLD, STEPS, 1)
    train_split_steps(model, opt, data, range(STEPS), SAVED_WORLD)
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, opt.sharded_state_dict())
    other_model, other = _make("flat", 100.0, reverse_init=True)
    other.load_sharded_state_dict(pieces)
    a, b = opt.state_dict(), other.state_dict()
    for i in range(8):
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a["state"][i][k], b["state"][i][k])
    assert b["state"]["step"] == STEPS
    return True


def test_load_sharded_state_dicts_in_memory(world):
    assert all(world(2, _in_memory_sharded))


# --------------------------------------------------------------- all-or-nothing loads
def _snapshot(opt):
    sd = opt.state_dict()
    return [g["lr"] for g in opt.param_groups], sd


def _assert_unchanged(opt, before):
    lrs, sd = before
    assert [g["lr"] for g in opt.param_groups] == lrs
    now = opt.state_dict()
    assert now["state"]["step"] == sd["state"]["step"]
    for i in range(8):
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(now["state"][i][k], sd["state"][i][k]), (i, k)


def _rejects_bad_states(path):
    import copy

    model, opt = _make("flat", TINY)
    good = torch.load(path, weights_only=True)["optim"]
    before = _snapshot(opt)
    cases = []
    t = copy.deepcopy(good)  # transposed: same element count, wrong shape
    t["state"][0]["exp_avg"] = t["state"][0]["exp_avg"].t().contiguous()
    t["param_groups"][1]["lr"] = 123.0
    cases.append((t, r"state\[0\]\['exp_avg'\] has shape \(7, 13\)"))
    m = copy.deepcopy(good)  # a key missing in the last parameter
    del m["state"][7]["exp_avg_sq"]
    m["param_groups"][0]["lr"] = 123.0
    cases.append((m, r"state\[7\] has no 'exp_avg_sq'"))
    n = copy.deepcopy(good)
    del n["state"][5]
    cases.append((n, "no state for parameter 5"))
    s = copy.deepcopy(good)
    del s["state"]["step"]
    cases.append((s, "no 'step'"))
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(bad)
        _assert_unchanged(opt, before)
    return True


def test_load_is_all_or_nothing(world, saved):
    assert all(world(1, _rejects_bad_states, saved[0]))


def _torch_round_trip(path):
    good = torch.load(path, weights_only=True)
    model, opt = _make("flat", TINY)
    model.load_state_dict(good["model"])
    opt.load_state_dict(good["optim"])
    sd = opt.state_dict()
    exported = ckpt.to_torch_state_dict(sd)
    adamw = torch.optim.AdamW(
        [{"params": [model.fc1.weight, model.fc2.weight]},
         {"params": [p for n, p in model.named_parameters()
                     if n not in ("fc1.weight", "fc2.weight")]}])
    adamw.load_state_dict(exported)
    assert adamw.param_groups[1]["lr"] == 4e-3 and adamw.param_groups[0]["weight_decay"] == 0.1
    back = adamw.state_dict()
    assert "format" not in back and "param" not in back["state"][0]
    model2, opt2 = _make("2x1" if dist.get_world_size() == 2 else "flat", 100.0, True)
    model2.load_state_dict(good["model"])  # masters come from the parameters
    opt2.load_state_dict(back)
    again = opt2.state_dict()
    assert again["state"]["step"] == sd["state"]["step"] == STEPS
    for i in range(8):
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(again["state"][i][k], sd["state"][i][k]), (i, k)
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    # One more step: torch's AdamW from the exported state and DFA agree.
    x, y = batches(1, 1, 1)[0][0][0]
    ref = make_model()
    ref.load_state_dict(good["model"])
    ref_opt = torch.optim.AdamW(
        [{"params": [ref.fc1.weight, ref.fc2.weight]},
         {"params": [p for n, p in ref.named_parameters()
                     if n not in ("fc1.weight", "fc2.weight")]}])
    ref_opt.load_state_dict(ckpt.to_torch_state_dict(sd))
    from dfa_common import loss_fn

    loss_fn(ref, x, y).backward()
    ref_opt.step()
    opt2.zero_grad()
    loss_fn(model2, x, y).backward()
    opt2.step()
    for p, q in zip(model2.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_torch_adamw_state_round_trip(world, saved, world_size):
    assert all(world(world_size, _torch_round_trip, saved[0]))


# ------------------------------------- all or nothing across the process group (gloo)
# Each case corrupts what one rank (or every rank) loads. Every rank must raise the same
# ValueError, and no rank may have changed its optimizer: state, step, param groups.
def _trained(grid):
    model, opt = _make(grid, TINY)
    train_split_steps(model, opt, batches(SAVED_WORLD, STEPS, 1), range(STEPS), SAVED_WORLD)
    return model, opt


def _full_snapshot(opt):
    import copy

    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
              for g in opt.param_groups]
    mirror = [float(opt.state[p]["step"]) for p in opt.parameters()]
    return groups, mirror, opt.state_dict()


def _assert_identical(opt, snap):
    groups, mirror, sd = snap
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    assert [float(opt.state[p]["step"]) for p in opt.parameters()] == mirror
    now = opt.state_dict()
    assert now["state"]["step"] == sd["state"]["step"]
    for i in range(8):
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(now["state"][i][k], sd["state"][i][k]), (i, k)


def _corrupt_full(sd, case):
    """A copy of the format-2 dict ``sd`` broken as ``case`` says."""
    import copy

    bad = copy.deepcopy(sd)
    bad["param_groups"][1]["lr"] = 123.0  # would show if groups were applied
    if case == "step-string":
        bad["state"]["step"] = "three"
    elif case == "step-negative":
        bad["state"]["step"] = -1
    elif case == "step-vector":
        bad["state"]["step"] = torch.tensor([2, 2])
    elif case == "meta-tensor":  # the last parameter: the copy would fail half-way
        bad["state"][7]["exp_avg_sq"] = torch.empty(bad["state"][7]["exp_avg_sq"].shape,
                                                    device="meta")
    elif case == "transposed":
        bad["state"][0]["exp_avg"] = bad["state"][0]["exp_avg"].t().contiguous()
    elif case == "bad-betas":
        bad["param_groups"][0]["betas"] = (0.9, 1.5)
    elif case == "bad-lr":
        bad["param_groups"][0]["lr"] = "fast"
    return bad


FULL_CASES = ["step-string", "step-negative", "step-vector", "meta-tensor", "transposed",
              "bad-betas", "bad-lr"]


def _full_load_refused(grid, only_rank):
    """Every case, broken on ``only_rank`` alone (None: on every rank)."""
    model, opt = _trained(grid)
    good = opt.state_dict()
    snap = _full_snapshot(opt)
    messages = []
    for case in FULL_CASES:
        sd = _corrupt_full(good, case) if only_rank in (None, dist.get_rank()) else good
        with pytest.raises(ValueError) as info:
            opt.load_state_dict(sd)
        _assert_identical(opt, snap)
        messages.append(str(info.value))
    return messages


@pytest.mark.parametrize("world_size,grid,only_rank", [
    (2, "flat", None), (2, "flat", 1), (4, "2x2", 3)])
def test_full_load_is_all_or_nothing_across_ranks(world, world_size, grid, only_rank):
    results = world(world_size, _full_load_refused, grid, only_rank)
    assert all(r == results[0] for r in results)  # the same message on every rank
    expected = ["'step'", "'step'", "'step'", "meta tensor", r"state[0]['exp_avg'] has shape",
                "betas", "lr="]
    for msg, part in zip(results[0], expected):
        assert part in msg, msg
        if only_rank is not None:
            assert f"refused on rank {only_rank}" in msg, msg


def _sharded_pieces_refused(grid, only_rank, case):
    """load_sharded_state_dict from every rank's sharded_state_dict, one piece broken: it
    is used by ``only_rank`` alone (the same grid and buckets: each rank its own)."""
    model, opt = _trained(grid)
    mine = opt.sharded_state_dict()
    if dist.get_rank() == only_rank:
        param, start, end, tensors = mine["pieces"][-1]
        tensors = dict(tensors)
        if case == "short":
            tensors["exp_avg"] = tensors["exp_avg"][:-1]
        elif case == "meta":
            tensors["exp_avg"] = torch.empty(tensors["exp_avg"].shape, device="meta")
        else:  # missing key
            del tensors["exp_avg_sq"]
        mine["pieces"][-1] = (param, start, end, tensors)
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, mine)
    snap = _full_snapshot(opt)
    sds = [dict(p, param_groups=[dict(g, lr=99.0) for g in p["param_groups"]])
           for p in pieces]
    with pytest.raises(ValueError) as info:
        opt.load_sharded_state_dict(sds)
    _assert_identical(opt, snap)
    return str(info.value)


@pytest.mark.parametrize("case", ["short", "meta", "missing"])
def test_sharded_load_is_all_or_nothing_across_ranks(world, case):
    results = world(2, _sharded_pieces_refused, "flat", 1, case)
    assert results[0] == results[1] and "refused on rank 1" in results[0], results
    assert "sharded checkpoint: parameter" in results[0]
