"""The CUDA bias-GELU backward kernel against the PyTorch reference: dx within one
rounding, dbias within fp32 summation order, deterministic; the MLP op compiled."""

import pytest
import torch
import torch.nn.functional as F

from mpzero import kernels
from mpzero.kernels import reference
from mpzero.testing import skip_module_without_extension

skip_module_without_extension()

from mpzero.kernels import cuda as kcuda  # noqa: E402  (needs the extension)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(R, C, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(R, C, device="cuda", generator=g) * 3).to(dtype)
    b = torch.randn(C, device="cuda", generator=g).to(dtype)
    dy = torch.randn(R, C, device="cuda", generator=g).to(dtype)
    return x, b, dy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("R,C", [(16384, 8192), (1000, 264), (3, 8), (0, 16)])
def test_kernel_equals_reference(dtype, approximate, R, C):
    x, b, dy = _inputs(R, C, dtype)
    assert kernels._bias_gelu_on_cuda(x, b, dy)
    dx, db = kcuda.bias_gelu_backward(x, b, dy, approximate == "tanh")
    rdx, rdb = reference.bias_gelu_backward(x, b, dy, approximate)
    # dx: the same fp32 formula up to the last bits of erf/tanh, then one rounding.
    torch.testing.assert_close(dx, rdx, rtol=TOL[dtype], atol=TOL[dtype])
    if R == 0:
        assert torch.equal(db, torch.zeros_like(db))
        return
    # dbias: fp32 sums of ~R terms in another order, rounded to the dtype.
    scale = rdx.float().abs().sum(0).clamp_min(1.0)
    err = (db.float() - rdb.float()).abs() / scale
    assert float(err.max()) < max(TOL[dtype], 1e-5), float(err.max())


def test_kernel_is_deterministic():
    x, b, dy = _inputs(8192, 4096, torch.bfloat16, seed=3)
    first = kcuda.bias_gelu_backward(x, b, dy, True)
    for _ in range(3):
        again = kcuda.bias_gelu_backward(x, b, dy, True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_shapes_the_kernel_cannot_take_use_the_reference():
    x, b, dy = _inputs(64, 12, torch.bfloat16)  # 12 columns: not a multiple of 8
    assert not kernels._bias_gelu_on_cuda(x, b, dy)
    dx, db = kernels.bias_gelu_backward(x, b, dy, "none")
    rdx, rdb = reference.bias_gelu_backward(x, b, dy, "none")
    assert torch.equal(dx, rdx) and torch.equal(db, rdb)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_mlp_op_compiled_equals_unfused(approximate):
    from mpzero.tensor_parallel import bias_gelu

    x, b, dy = _inputs(4 * 512, 1024, torch.bfloat16, seed=5)
    x, dy = x.view(4, 512, 1024), dy.view(4, 512, 1024)
    out = {}
    for name, fn in (("fused", torch.compile(bias_gelu)),
                     ("plain", lambda x, b, a: F.gelu(x + b, approximate=a))):
        xx, bb = x.clone().requires_grad_(), b.clone().requires_grad_()
        y = fn(xx, bb, approximate)
        y.backward(dy)
        out[name] = (y.detach(), xx.grad, bb.grad)
    for a, w in zip(out["fused"], out["plain"]):
        rel = float((a.float() - w.float()).norm() / w.float().norm())
        assert rel < 1e-2, rel
