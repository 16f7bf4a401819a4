"""World 8 smoke tests (one shared world): 4x2 and 2x4 distributed x redundant grids
against DDP + AdamW, and a checkpoint carried 8 -> 4 -> 2 -> 1 ranks (sharded and
format-2 hops) ending where an uninterrupted 8-rank run ends."""

import pytest
import torch
import torch.distributed as dist

from mpzero.checkpoint import dcp as mdcp
from mpzero.optimizers import DistributedFusedAdam

from dfa_common import batches, groups_for, make_model, train_compare, train_split_steps

TINY = 24 * 4 / 2**20
GLOBAL = 8  # micro-batches per step, split over the ranks of each hop
STEPS_PER_HOP = 2
HOPS = [(8, "4x2", "sharded"), (4, "2x2", "format2"), (2, "flat", "sharded"), (1, "flat", None)]


def _grids_vs_ddp():
    out = {}
    out["4x2"] = train_compare("4x2")
    out["4x2 no overlap, contiguous grads"] = train_compare(
        "4x2", overlap=False, steps=2, contiguous_grad_buffer=True)
    out["2x4 clip, overlap param sync"] = train_compare(
        "2x4", clip=0.5, steps=2, overlap_param_sync=True)
    out["8x1 sum, big bucket"] = train_compare("8x1", average=False, bucket_cap_mb=100.0,
                                               steps=2)
    return out


def _make(grid, bucket):
    model = make_model()
    opt = DistributedFusedAdam(
        [{"params": [model.fc1.weight, model.fc2.weight], "weight_decay": 0.1},
         {"params": [p for n, p in model.named_parameters()
                     if n not in ("fc1.weight", "fc2.weight")], "lr": 5e-3}],
        lr=1e-2, bucket_cap_mb=bucket, **groups_for(grid))
    return model, opt


def _hop(index, path):
    """Hop ``index`` of HOPS: load the previous hop's checkpoint (if any), train
    STEPS_PER_HOP steps, save for the next hop; return the params."""
    world, grid, save_as = HOPS[index]
    assert dist.get_world_size() == world
    # Another bucket size at every hop, so the layout really changes.
    model, opt = _make(grid, TINY * (index + 1))
    if index > 0:
        saved = torch.load(f"{path}.{index - 1}.model", weights_only=True)
        model.load_state_dict(saved)
        if HOPS[index - 1][2] == "sharded":
            mdcp.load_sharded(f"{path}.{index - 1}.sharded", None, opt)
        else:
            opt.load_state_dict(torch.load(f"{path}.{index - 1}.optim", weights_only=True))
        assert opt.state_dict()["state"]["step"] == index * STEPS_PER_HOP
    data = batches(GLOBAL, STEPS_PER_HOP * len(HOPS), 1)
    first = index * STEPS_PER_HOP
    train_split_steps(model, opt, data, range(first, first + STEPS_PER_HOP), GLOBAL)
    if save_as == "sharded":
        mdcp.save_sharded(f"{path}.{index}.sharded", None, opt)
    elif save_as == "format2":
        sd = opt.state_dict()
        if dist.get_rank() == 0:
            torch.save(sd, f"{path}.{index}.optim")
    if save_as and dist.get_rank() == 0:
        torch.save(model.state_dict(), f"{path}.{index}.model")
    dist.barrier()
    return [p.detach().clone() for p in model.parameters()]


def _uninterrupted():
    model, opt = _make("4x2", TINY)
    data = batches(GLOBAL, STEPS_PER_HOP * len(HOPS), 1)
    train_split_steps(model, opt, data, range(STEPS_PER_HOP * len(HOPS)), GLOBAL)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_world8_grids_and_reshard_chain(tmp_path):
    from mpzero.testing import World, run_on_world

    path = str(tmp_path / "ckpt")
    with World(8) as w:
        for r in w.run(_grids_vs_ddp, timeout=300):
            assert all(d <= 1e-4 for d in r.values()), r
        expected = w.run(_uninterrupted)[0]
        w.run(_hop, 0, path)
    for index in range(1, len(HOPS)):
        results = run_on_world(HOPS[index][0], _hop, index, path)
    for params in results:
        for p, q in zip(params, expected):
            # Other world sizes sum the same gradients in another order: fp32 rounding.
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
