"""DistributedFusedAdam equals DDP + torch.optim.AdamW/Adam on real gloo worlds.

Tiny buckets (24 fp32 elements of capacity) make every parameter fragment
across buckets; 3 micro-batches with no_sync() for the first two.
"""

import pytest
import torch
import torch.distributed as dist

from mpzero.optimizers import DistributedFusedAdam

from dfa_common import ATOL, RTOL, batches, loss_fn, make_model, train_compare

WORLDS = [(1, "flat"), (2, "flat"), (4, "flat"), (4, "2x2")]
SLOW_WORLDS = [(1, "flat"), (4, "flat")]


def _many_configs(grid):
    out = {}
    out["adamw"] = train_compare(grid)
    out["adam_l2"] = train_compare(grid, adam_w=False, groups="one")
    out["no_overlap"] = train_compare(grid, overlap=False, steps=2)
    out["sum"] = train_compare(grid, average=False, steps=2)
    out["clip"] = train_compare(grid, clip=0.5, steps=2)
    out["big_bucket"] = train_compare(grid, bucket_cap_mb=100.0, steps=2)
    out["no_no_sync"] = train_compare(grid, no_sync=False, steps=2, micro=2)
    return out


# The 2-rank and the 2 x 2 grids in the quick tier; the single rank and the flat 4 (the
# same code paths with other shard counts) in `make test`.
@pytest.mark.parametrize("world_size,grid", [
    pytest.param(w, g, id=f"{w}-{g}", marks=[pytest.mark.slow] if (w, g) in SLOW_WORLDS else [])
    for w, g in WORLDS])
def test_matches_ddp_adamw(world, world_size, grid):
    results = world(world_size, _many_configs, grid, timeout=300)
    for r in results:
        assert all(d <= 1e-4 for d in r.values()), r


def _wrong_run_differs():
    """Sharded optimizer with no gradient sync (each rank its own group) must differ."""
    world, rank = dist.get_world_size(), dist.get_rank()
    own = [dist.new_group([r]) for r in range(world)][rank]
    model = make_model()
    ref = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, process_group=own,
                               bucket_cap_mb=24 * 4 / 2**20)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    data = batches(world, 2, 1)
    for s in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        x, y = data[s][rank][0]
        loss_fn(model, x, y).backward()
        opt.step()
        sum(loss_fn(ref, *data[s][r][0]) for r in range(world)).div(world).backward()
        ref_opt.step()
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))


def test_unsynced_run_differs(world):
    diffs = world(2, _wrong_run_differs)
    assert all(d > 1e-4 for d in diffs), diffs


def _bias_correction_off():
    """bias_correction=False against a hand-written Adam without bias correction."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    params = [p.detach().clone() for p in model.parameters()]
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, betas=(0.8, 0.95), eps=1e-6,
                               weight_decay=0.1, bias_correction=False,
                               bucket_cap_mb=24 * 4 / 2**20)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    data = batches(world, 3, 1)
    for s in range(3):
        opt.zero_grad()
        loss_fn(model, *data[s][rank][0]).backward()
        opt.step()
        ref = make_model()
        with torch.no_grad():
            for q, p in zip(ref.parameters(), params):
                q.copy_(p)
        sum(loss_fn(ref, *data[s][r][0]) for r in range(world)).div(world).backward()
        for i, q in enumerate(ref.parameters()):
            g = q.grad
            m[i] = 0.8 * m[i] + 0.2 * g
            v[i] = 0.95 * v[i] + 0.05 * g * g
            params[i] = params[i] - 1e-2 * (m[i] / (v[i].sqrt() + 1e-6) + 0.1 * params[i])
    for p, q in zip(model.parameters(), params):
        torch.testing.assert_close(p.detach(), q, rtol=RTOL, atol=ATOL)
    return True


def test_bias_correction_off(world):
    assert all(world(2, _bias_correction_off))
