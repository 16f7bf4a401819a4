"""Gradient accumulation fusion on CUDA: the weight-gradient GEMM adds into an fp32
``main_grad`` with one cuBLAS call (bf16 inputs, fp32 output, beta=1), eager and
compiled, under DistributedFusedAdam at world 1 (NCCL)."""

import pytest
import torch
import torch.nn.functional as F

from mpzero.testing import requires_cuda, run_on_world

pytestmark = requires_cuda


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def test_wgrad_accumulate_is_one_fp32_gemm():
    from mpzero.tensor_parallel import grad_accumulation as ga

    g = torch.Generator(device="cuda").manual_seed(0)
    dy = torch.randn(8, 512, 384, device="cuda", generator=g).bfloat16()
    x = torch.randn(8, 512, 256, device="cuda", generator=g).bfloat16()
    acc = torch.randn(384, 256, device="cuda", generator=g)
    product = dy.reshape(-1, 384).float().t() @ x.reshape(-1, 256).float()
    want = acc + product
    ga.wgrad_accumulate(acc, dy, x)
    assert ga._CUDA_OUT_DTYPE.get("ok") is True, "torch.addmm(out_dtype=fp32) is missing here"
    torch.testing.assert_close(acc, want, rtol=1e-5, atol=1e-3)
    # A bf16 main_grad (bf16 accumulation) takes the same-dtype path.
    acc16 = torch.zeros(384, 256, device="cuda", dtype=torch.bfloat16)
    ga.wgrad_accumulate(acc16, dy, x)
    torch.testing.assert_close(acc16.float(), product, rtol=1e-2, atol=0.5)


def _fused_grads(compiled: bool):
    """bf16 MLP on CUDA, 3 micro-batches into DistributedFusedAdam's fp32 buffer, fused
    and plain: the accumulated gradients agree to bf16 rounding of the plain path."""
    from mpzero import parallel_state as ps
    from mpzero.optimizers import DistributedFusedAdam
    from mpzero.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    grads = {}
    for fusion in (True, False):
        torch.manual_seed(0)
        fc = ColumnParallelLinear(256, 1024, gradient_accumulation_fusion=fusion,
                                  params_dtype=torch.bfloat16, device="cuda")
        proj = RowParallelLinear(1024, 256, input_is_parallel=True, device="cuda",
                                 gradient_accumulation_fusion=fusion, params_dtype=torch.bfloat16)
        model = torch.nn.ModuleDict({"fc": fc, "proj": proj})
        opt = DistributedFusedAdam(model.parameters(), contiguous_grad_buffer=True,
                                   grad_sync_dtype=torch.float32, bucket_cap_mb=1)
        opt.grad_buffer_view(fc.weight)

        def forward(x, fc=fc, proj=proj):
            return proj(F.gelu(fc(x)[0]))[0]

        fn = torch.compile(forward) if compiled else forward
        g = torch.Generator(device="cuda").manual_seed(1)
        for m in range(3):
            x = torch.randn(4, 512, 256, device="cuda", generator=g).bfloat16()
            with opt.no_sync(greedy_grad_copy=True) if m < 2 else torch.enable_grad():
                fn(x).float().square().mean().backward()
            if fusion:
                assert fc.weight.grad is None and proj.weight.grad is None
        opt.grad_sync()
        grads[fusion] = [opt.grad_buffer_view(p).clone() for p in (fc.weight, proj.weight)]
    ps.destroy_model_parallel()
    for a, b in zip(grads[True], grads[False]):
        assert float((a - b).norm() / b.norm()) < 1e-2
        assert float(b.norm()) > 0
    return True


@pytest.mark.parametrize("compiled", [False, True])
def test_dfa_fused_grads_on_cuda(compiled):
    assert run_on_world(1, _fused_grads, compiled, backend="nccl", timeout=300) == [True]
