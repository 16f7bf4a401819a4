"""The parts of apex's ``DistributedFusedAdam`` API its users trip over: what
``unscale_grads`` returns and refuses, ``clip_grad_norm``'s ``max_norm``, ``init_params``'s
dtypes, the read-only attributes and ``repr``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from mpzero import parallel_state as ps
from mpzero.optimizers import DistributedFusedAdam, OptionError

from dfa_common import make_model


def _opt(model=None, **kw):
    model = model or make_model()
    return model, DistributedFusedAdam(model.parameters(), lr=1e-2, **kw)


def _backward(model):
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(4, 7, generator=g, device="cpu").to(torch.get_default_device())
    loss = model(x).square().sum()
    loss.backward()
    return loss


def _unscale_returns_flags() -> bool:
    torch.set_num_threads(1)
    model, opt = _opt()
    _backward(model)
    flags = opt.unscale_grads(inv_scale=torch.tensor(0.5))
    assert set(flags) == {opt.device}, flags
    flag = flags[opt.device]
    assert flag.shape == (1,) and flag.dtype == torch.float32 and flag.item() == 0.0
    # An inf on one rank: every rank's flag says so.
    opt.zero_grad()
    loss = model(torch.randn(2, 7)).sum()
    if dist.get_rank() == 1:
        loss = loss * float("inf")
    loss.backward()
    flags = opt.unscale_grads(inv_scale=1.0)
    assert flags[opt.device].item() == 1.0
    # With a scaler: the same flag is recorded for scaler.step()/update().
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.randn(2, 7)).sum()).backward()
    flags = opt.unscale_grads(grad_scaler=scaler)
    state = scaler._per_optimizer_states[id(opt)]
    assert flags[opt.device].item() == 0.0
    assert sum(v.item() for v in state["found_inf_per_device"].values()) == 0.0
    scaler.step(opt)
    scaler.update()
    # A disabled scaler does nothing.
    opt.zero_grad()
    off = torch.amp.GradScaler("cpu", enabled=False)
    model(torch.randn(2, 7)).sum().backward()
    assert opt.unscale_grads(grad_scaler=off) == {}
    return True


@pytest.mark.timeout(120)
def test_unscale_grads_returns_found_inf_flags(world):
    assert all(world(2, _unscale_returns_flags, timeout=100))


def _unscale_misuse() -> bool:
    torch.set_num_threads(1)
    model, opt = _opt()
    _backward(model)
    with pytest.raises(ValueError, match="exactly one of inv_scale= and grad_scaler=.*neither"):
        opt.unscale_grads()
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="exactly one.*both"):
        opt.unscale_grads(inv_scale=0.5, grad_scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    with pytest.raises(RuntimeError, match=r"after step\(\)"):
        opt.unscale_grads(inv_scale=0.5)
    # Nothing was folded in: the next step's gradients are not scaled by the refused call.
    assert float(opt.step_state.grad_scale) == 1.0
    # A new backward (or zero_grad) starts the next iteration: allowed again.
    opt.zero_grad()
    _backward(model)
    opt.unscale_grads(inv_scale=1.0)
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return True


@pytest.mark.timeout(120)
def test_unscale_grads_misuse_raises(world):
    assert all(world(2, _unscale_misuse, timeout=100))


@pytest.mark.parametrize("max_norm", [0.0, -1.0, float("nan"), torch.tensor(-2.0)])
def test_clip_grad_norm_rejects_non_positive(max_norm):
    model, opt = _opt()
    model(torch.randn(3, 7)).sum().backward()
    before = float(opt.step_state.grad_scale)
    with pytest.raises(ValueError, match="max_norm must be positive"):
        opt.clip_grad_norm(max_norm)
    assert float(opt.step_state.grad_scale) == before  # nothing folded in


def test_clip_grad_norm_inf_means_no_clipping():
    model, opt = _opt()
    model(torch.randn(3, 7)).sum().backward()
    norm = opt.clip_grad_norm(math.inf)
    assert torch.isfinite(norm) and float(opt.step_state.grad_scale) == 1.0


def _init_params_dtypes() -> bool:
    torch.set_num_threads(1)
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-3, grad_sync_dtype=torch.bfloat16,
                               param_sync_dtype=torch.float32)
    # Each dtype left out is the optimizer's own (apex), not the given dtype's.
    opt.init_params([model.fc1.weight], dtype=torch.float32)
    opt.init_params([model.fc2.weight], param_sync_dtype=torch.bfloat16)
    with pytest.raises(OptionError, match=r"init_params\(dtype=torch.bfloat16\).*optimizer-wide"):
        opt.init_params([model.head.weight], dtype=torch.bfloat16)
    with pytest.raises(OptionError, match="init_params: grad_sync_dtype"):
        opt.init_params([model.head.weight], grad_sync_dtype=torch.int8)
    opt.init_params()
    i1 = opt.shards.index[id(model.fc1.weight)]
    i2 = opt.shards.index[id(model.fc2.weight)]
    i3 = opt.shards.index[id(model.head.weight)]
    assert opt.shards.keys[i1].dtypes == (torch.float32, torch.bfloat16, torch.float32)
    assert opt.shards.keys[i2].dtypes == (torch.float32, torch.bfloat16, torch.bfloat16)
    assert opt.shards.keys[i3].dtypes == (torch.float32, torch.bfloat16, torch.float32)
    return True


@pytest.mark.timeout(120)
def test_init_params_dtypes_as_apex(world):
    assert all(world(2, _init_params_dtypes, timeout=100))


def _attributes() -> dict:
    torch.set_num_threads(1)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(distributed_optimizer_size=2)
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=1.0,
                               grad_sync_dtype=torch.bfloat16,
                               **ps.get_optimizer_process_groups())
    sub = dist.new_group([2, 3])
    attrs = dict(size=opt.process_group_size, root=opt.process_group_root,
                 align=opt.alignment, shard=opt.default_shard_size, text=repr(opt))
    if dist.get_rank() >= 2:
        other = DistributedFusedAdam(make_model().parameters(), process_group=sub)
        attrs["sub_root"] = other.process_group_root
    ps.destroy_model_parallel()
    return attrs


@pytest.mark.timeout(120)
def test_read_only_attributes_and_repr(world):
    res = world(4, _attributes, timeout=100)
    for r, a in enumerate(res):
        assert a["size"] == 4 and a["root"] == 0
        assert a["align"] == 64  # 128 bytes of bf16
        # 1 MiB of bf16 over 2 distributed ranks, a multiple of 64 elements
        assert a["shard"] == 2**19 // 2
        assert "DistributedFusedAdam (" in a["text"]
        for needle in ("grad_sync_dtype: torch.bfloat16", "bucket_cap_mb: 1.0",
                       "distributed_size: 2", "redundant_size: 2", "Parameter Group 0",
                       "lr: 0.001", "weight_decay: 0.0"):
            assert needle in a["text"], (needle, a["text"])
        if r >= 2:
            assert a["sub_root"] == 2
    single = DistributedFusedAdam(make_model().parameters())
    assert single.process_group_size == 1 and single.process_group_root == 0
    assert single.alignment == 32 and single.default_shard_size == 100 * 2**20 // 4
    with pytest.raises(AttributeError):
        single.alignment = 7
