"""Gradient accumulation fusion: the weight-gradient GEMM adds into ``main_grad``.

Against ``F.linear``'s autograd (one process), and DistributedFusedAdam with
``contiguous_grad_buffer=True`` on gloo worlds: training with fused layers equals
training the same model with plain layers, with and without ``no_sync``, at world
1 and 2 and with several buckets in flight; compiled equals eager.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mpzero import parallel_state as ps
from mpzero.optimizers import DistributedFusedAdam
from mpzero.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mpzero.tensor_parallel.grad_accumulation import (
    can_fuse,
    linear_with_grad_accumulation,
    wgrad_accumulate,
)

# 64 fp32 elements per bucket, and up to 16 syncs in flight: every bucket of a backward
# is still in flight when the next backward's GEMMs add into it.
TINY = 64 * 4 / 2**20


def _randn(seed, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _provide(weight, dtype=torch.float32):
    weight.main_grad = torch.zeros(weight.shape, dtype=dtype)
    weight.main_grad_ready = torch.zeros((), requires_grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_linear_equals_f_linear(dtype, bias):
    """Output, input and bias gradients equal F.linear's; the weight gradients of three
    backward passes are summed into main_grad in fp32; the weight gets no .grad and
    main_grad_ready gets a zero gradient."""
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0, "atol": 0}
    w = nn.Parameter(_randn(0, 6, 5, dtype=dtype))
    b = nn.Parameter(_randn(1, 6, dtype=dtype)) if bias else None
    _provide(w)
    ref_w = nn.Parameter(w.detach().clone())
    ref_b = nn.Parameter(b.detach().clone()) if bias else None
    expected = torch.zeros(6, 5)
    for k in range(3):
        x = _randn(10 + k, 2, 3, 5, dtype=dtype).requires_grad_()
        g = _randn(20 + k, 2, 3, 6, dtype=dtype)
        x_ref = x.detach().clone().requires_grad_()
        out = linear_with_grad_accumulation(x, w, b)
        out_ref = F.linear(x_ref, ref_w, ref_b)
        torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
        out.backward(g)
        out_ref.backward(g)
        torch.testing.assert_close(x.grad, x_ref.grad, **tol)
        expected += g.reshape(-1, 6).float().t() @ x.detach().reshape(-1, 5).float()
    assert w.grad is None
    torch.testing.assert_close(w.main_grad, expected, rtol=1e-5, atol=1e-5)
    assert w.main_grad_ready.grad is not None and float(w.main_grad_ready.grad) == 0.0
    if bias:
        torch.testing.assert_close(b.grad, ref_b.grad, **tol)
    if dtype == torch.float32:  # the unfused sum of three fp32 gradients
        torch.testing.assert_close(w.main_grad, ref_w.grad, rtol=1e-5, atol=1e-6)


def test_plain_path_without_the_protocol():
    """No main_grad (or autocast on, or a frozen weight): plain F.linear, .grad set."""
    w = nn.Parameter(_randn(0, 4, 3))
    assert not can_fuse(w)
    x = _randn(1, 2, 3)
    linear_with_grad_accumulation(x, w).sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(2, 4).t() @ x)
    _provide(w)
    assert can_fuse(w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not can_fuse(w)
    w.requires_grad_(False)
    assert not can_fuse(w)


def test_wgrad_accumulate_mixed_dtypes():
    """bf16 inputs into an fp32 sum (no bf16 rounding of the product)."""
    dy, x = _randn(0, 7, 4, dtype=torch.bfloat16), _randn(1, 7, 3, dtype=torch.bfloat16)
    acc = _randn(2, 4, 3)
    expected = acc + dy.float().t() @ x.float()
    wgrad_accumulate(acc, dy, x)
    torch.testing.assert_close(acc, expected, rtol=1e-6, atol=1e-6)


def test_deepcopy_leaves_the_optimizer_buffer_behind():
    layer = ColumnParallelLinear(3, 4, gradient_accumulation_fusion=True)
    _provide(layer.weight)
    clone = copy.deepcopy(layer)
    assert not hasattr(clone.weight, "main_grad") and not can_fuse(clone.weight)
    assert clone.weight.tensor_model_parallel


class _MLP(nn.Module):
    def __init__(self, fusion, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.fc = ColumnParallelLinear(8, 16, gradient_accumulation_fusion=fusion,
                                       params_dtype=dtype)
        self.proj = RowParallelLinear(16, 8, input_is_parallel=True,
                                      gradient_accumulation_fusion=fusion, params_dtype=dtype)
        self.norm = nn.LayerNorm(8, dtype=dtype)  # a parameter without fusion

    def forward(self, x):
        h, _ = self.fc(x)
        out, _ = self.proj(F.gelu(h))
        return self.norm(out + x)


def _train(fusion, dtype, no_sync, greedy, steps=2, micro=3, compiled=False):
    rank = dist.get_rank()
    model = _MLP(fusion, dtype)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01,
                               bucket_cap_mb=TINY, contiguous_grad_buffer=True,
                               grad_sync_dtype=torch.float32, pipeline_size=16)
    opt.grad_buffer_view(model.fc.weight)  # makes the layout: main_grad from the start
    fn = torch.compile(model) if compiled else model
    for s in range(steps):
        for m in range(micro):
            x = _randn(100 * s + 10 * m + rank, 4, 8, dtype=dtype)
            ctx = opt.no_sync(greedy_grad_copy=greedy) if no_sync and m < micro - 1 \
                else torch.enable_grad()
            with ctx:
                fn(x).float().square().mean().div(micro).backward()
            if fusion:
                assert model.fc.weight.grad is None and model.proj.weight.grad is None
        opt.step()
        opt.zero_grad()
    return [p.detach().float().clone() for p in model.parameters()]


def _fused_equals_plain(dtype, no_sync, greedy, compiled=False):
    ps.initialize_model_parallel(tensor_model_parallel_size=1)  # data parallel only
    fused = _train(True, dtype, no_sync, greedy, compiled=compiled)
    plain = _train(False, dtype, no_sync, greedy, compiled=compiled)  # inductor's numerics
    for a, b in zip(fused, plain):  # the same fp32 sums (addmm_ against mm, add_)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ps.destroy_model_parallel()
    return True


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("no_sync,greedy", [(False, True), (True, True), (True, False)])
def test_dfa_fused_equals_plain(world, size, no_sync, greedy):
    """Without no_sync every micro-batch is a round whose syncs are in flight when the
    next backward's GEMMs add into the same buffers: they must be finished first."""
    assert all(world(size, _fused_equals_plain, torch.float32, no_sync, greedy))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dfa_fused_compiled(world):
    """torch.compile keeps the accumulation one in-place call on the buffer."""
    assert all(world(1, _fused_equals_plain, torch.float32, False, True, compiled=True))


def _arrivals():
    """Fused weights arrive through main_grad_ready: after a backward every bucket is
    complete (what lets a bucket launch during the backward), though no weight got a
    .grad, and no staged addition is left."""
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model = _MLP(True, torch.float32)
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=TINY,
                               contiguous_grad_buffer=True)
    opt.grad_buffer_view(model.fc.weight)
    with opt.no_sync(greedy_grad_copy=True):
        model(_randn(0, 4, 8)).sum().backward()
        assert model.fc.weight.grad is None
        buckets = opt.ensure_layout().grads.buckets
        assert len(buckets) > 4 and all(b.complete for b in buckets)
        # The other parameters' additions are staged and made once each bucket is in
        # (the fused weights count as arrived): nothing is left holding a gradient.
        assert not any(b._adds for b in opt.ensure_layout().grads.buckets)
    ps.destroy_model_parallel()
    return True


def test_fused_weights_arrive(world):
    assert all(world(1, _arrivals))
