"""Checkpoints with ``cpu_offload``: a state saved with offload loads without it and vice
versa, on other grids (resharding), through the format-2 state dict and through DCP
(mpzero.checkpoint.dcp); the loaded state is bit-exact and training continues as it
would have without the checkpoint."""

import os

import pytest
import torch
import torch.distributed as dist

from mpzero.checkpoint import dcp as mdcp
from mpzero.optimizers import DistributedFusedAdam

from dfa_common import (
    ATOL,
    RTOL,
    STATE_MODES,
    batches,
    groups_for,
    loss_fn,
    make_model,
    param_groups,
    train_split_steps,
)
from offload_fakes import FakeBoundary

pytestmark = pytest.mark.timeout(300)

TINY = 24 * 4 / 2**20
MODES = STATE_MODES
SAVE_WORLD, STEPS = 2, 2


def _opt(mode, offload, grid="flat", bucket=TINY):
    model = make_model()
    opt = DistributedFusedAdam(param_groups(model, "two"), lr=1e-2, weight_decay=0.05,
                               bucket_cap_mb=bucket, cpu_offload=offload,
                               **groups_for(grid), **MODES[mode])
    if offload:
        opt.ensure_layout().stepper.staging.boundary = FakeBoundary()
    return model, opt


def _step(model, opt, data, s):
    """Step ``s`` over the whole global batch, split evenly over this world's ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world <= SAVE_WORLD:
        train_split_steps(model, opt, data, [s], SAVE_WORLD)
        return
    opt.zero_grad()  # more ranks than micro-batches: halves of each, rescaled
    x, y = data[s][rank // (world // SAVE_WORLD)][0]
    half = x.shape[0] // (world // SAVE_WORLD)
    k = rank % (world // SAVE_WORLD)
    x, y = x[k * half:(k + 1) * half], y[k * half:(k + 1) * half]
    (loss_fn(model, x, y) * world / SAVE_WORLD).backward()
    opt.step()


def _save(path, mode, offload):
    model, opt = _opt(mode, offload)
    data = batches(SAVE_WORLD, STEPS + 1, 1)
    for s in range(STEPS):
        _step(model, opt, data, s)
    full = opt.state_dict()
    mdcp.save_sharded(path, model, opt)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt, data, STEPS)  # what a resumed run's next step must give
    after = [p.detach().clone() for p in model.parameters()]
    dist.barrier()
    return full, weights, after


def _saves():
    """Every mode saved with and without offload; remainders with scaled moments saved
    on the device (loaded offloaded) only in `make test` (the other direction stays
    quick)."""
    for m in MODES:
        for o in (True, False):
            slow = m == "remainders_scaled" and not o
            yield pytest.param((m, o), marks=pytest.mark.slow if slow else (),
                               id=f"{m}-{'offload' if o else 'device'}")


@pytest.fixture(scope="module", params=_saves())
def saved(request, tmp_path_factory):
    from mpzero.testing import run_on_world

    mode, offload = request.param
    path = str(tmp_path_factory.mktemp("ckpt") / "dcp")
    full, weights, after = run_on_world(SAVE_WORLD, _save, path, mode, offload)[0]
    return mode, offload, path, full, weights, after


def _resume(saved, grid, sharded):
    mode, offload, path, full, weights, after = saved
    model, opt = _opt(mode, not offload, grid, TINY * 3)  # the other placement, other buckets
    if sharded:
        torch.nn.init.zeros_(model.fc1.weight)  # comes from the checkpoint too
        mdcp.load_sharded(path, model, opt)
    else:
        model.load_state_dict(weights)
        opt.load_state_dict(full)
    loaded = opt.state_dict()
    assert loaded["state"]["step"] == full["state"]["step"] == STEPS
    for i in opt.shards.keys:
        for k in ("param", "exp_avg", "exp_avg_sq"):
            got, want = loaded["state"][i][k], full["state"][i][k]
            if mode == "scaled" or (mode == "remainders_scaled" and k != "param"):
                # One scale per fragment piece, and other grids and buckets cut other
                # pieces: each value is re-stored to half a bf16 ulp of its new piece's
                # absmax (on the same layout the values come back bit-exact; with or
                # without offload alike).
                absmax = want.abs().max().item()
                torch.testing.assert_close(got, want, rtol=2.0**-8, atol=2.0**-9 * absmax)
            else:
                assert torch.equal(got, want), (i, k)
    _step(model, opt, batches(SAVE_WORLD, STEPS + 1, 1), STEPS)
    for p, q in zip(model.parameters(), after):
        if mode == "scaled":  # the master re-stored as above, then one step of ~lr (1e-2)
            torch.testing.assert_close(p, q, rtol=2.0**-8,
                                       atol=2.0**-9 * q.abs().max().item() + 2 * 1e-2)
        elif mode == "remainders_scaled":  # exact master; the moments re-stored move the
            # step by ~2**-8 of lr (1e-2), and a bf16 parameter may round the other way
            torch.testing.assert_close(p, q, rtol=2.0**-7, atol=2.0**-6 * 1e-2)
        else:
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    return True


# The 2 x 2 grid in the quick tier (resharding and redundancy together); 1 and 2 ranks in
# `make test`.
@pytest.mark.parametrize("size,grid", [pytest.param(1, "flat", marks=pytest.mark.slow),
                                       pytest.param(2, "flat", marks=pytest.mark.slow),
                                       (4, "2x2")])
@pytest.mark.parametrize("sharded", [False, True], ids=["full", "dcp"])
def test_offload_checkpoint_round_trip(world, saved, size, grid, sharded):
    assert all(world(size, _resume, saved, grid, sharded))


def test_saved_dcp_files_exist(saved):
    assert any(name.endswith(".distcp") for name in os.listdir(saved[2]))
