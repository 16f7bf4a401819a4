"""``cpu_offload`` on a CUDA device: the real boundary (pinned staging, side streams,
events) and the offloaded step against the on-device step (the CPU and CUDA kernels
round in other orders: fp32 tolerances on the masters), checkpoints across the two."""

from __future__ import annotations

import copy

import pytest
import torch

from mpzero.optimizers import DistributedFusedAdam
from mpzero.optimizers.offload import CudaBoundary, HostStaging
from mpzero.testing import requires_cuda

from dfa_common import STATE_MODES  # tests/ is on the path (tests/conftest.py)

pytestmark = [requires_cuda, pytest.mark.timeout(300)]

MODES = STATE_MODES  # fp32, remainders, scaled, remainders_scaled (tests/dfa_common.py)


def test_cuda_staging_round_trip():
    dev = torch.device("cuda", torch.cuda.current_device())
    staging = HostStaging(CudaBoundary(dev))
    outs = []
    for k in range(5):  # more than the slots: reuse waits for the copies in flight
        src = torch.full((1 << 20,), float(k), device=dev) + torch.arange(1 << 20, device=dev)
        t = staging.to_host("grad", src)
        host = staging.wait(t)
        assert host.is_pinned() and torch.equal(host, src.cpu())
        back = staging.host_buffer("out", host.numel(), torch.bfloat16)
        back.copy_(host)
        dst = torch.empty(host.numel(), dtype=torch.bfloat16, device=dev)
        staging.on_device(staging.to_device(back, dst))
        outs.append((dst, src))
    staging.finish()
    for dst, src in outs:
        assert torch.equal(dst, src.bfloat16())


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(),
                               torch.nn.Linear(96, 32)).cuda().to(dtype)


def _train(mode, offload, steps=3, model=None, opt_state=None):
    dtype = torch.bfloat16 if mode != "fp32" else torch.float32
    model = model or _model(dtype)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01,
                               bucket_cap_mb=0.01, cpu_offload=offload, **MODES[mode])
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    g = torch.Generator(device="cpu").manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 64, generator=g).cuda().to(dtype)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.clip_grad_norm(1.0)
        opt.step()
    torch.cuda.synchronize()
    return model, opt


@pytest.mark.parametrize("mode", list(MODES))
def test_offload_matches_the_device_step(mode):
    _, on_gpu = _train(mode, False)
    _, offloaded = _train(mode, True)
    a, b = on_gpu.state_dict(), offloaded.state_dict()
    tol = (dict(rtol=1e-5, atol=1e-6) if "scaled" not in mode
           else dict(rtol=2.0**-7, atol=1e-4))
    for i in offloaded.shards.keys:
        for k in ("param", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(b["state"][i][k], a["state"][i][k], **tol)
    for st in offloaded.shards.shards:
        for t in (st.master, st.remainder, st.exp_avg, st.exp_avg_sq):
            assert t is None or t.device.type == "cpu"
        if st.scaled is not None:
            assert all(t.device.type == "cpu" for t in st.scaled.data.values())


def test_remainders_with_scaled_moments_keep_ten_bytes_a_parameter():
    """bf16 parameter + int16 remainder + bf16 moments: the optimizer's persistent state
    on the device is 6 bytes a parameter (the gradient's 2 or 4 come on top)."""
    model = _model(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-3, bucket_cap_mb=0.01,
                               **MODES["remainders_scaled"])
    opt.ensure_layout()
    torch.cuda.synchronize()
    state = torch.cuda.memory_allocated() - before
    padded = sum(lay.shard_size for lay in opt.shards.layouts)
    assert padded * 6 <= state <= padded * 6 + 256 * 1024, (state, n, padded)


@pytest.mark.parametrize("offload_first", [True, False])
def test_checkpoint_across_placements(offload_first):
    model, opt = _train("remainders", offload_first, steps=2)
    saved = opt.state_dict()
    weights = copy.deepcopy(model.state_dict())
    other = _model(torch.bfloat16)
    other.load_state_dict(weights)
    _, loaded = _train("remainders", not offload_first, steps=0, model=other, opt_state=saved)
    sd = loaded.state_dict()
    for i in loaded.shards.keys:
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["state"][i][k], saved["state"][i][k])
