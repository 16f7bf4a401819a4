"""Bias-GELU fusion against ``F.gelu(x + bias)`` and its autograd (CPU: the reference
kernel; tests/gpu/test_bias_gelu_cuda.py checks the CUDA kernel against it)."""

import pytest
import torch
import torch.nn.functional as F

from mpzero import kernels
from mpzero.kernels import reference
from mpzero.tensor_parallel import bias_gelu

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}


def _randn(seed, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _both(fn, x, b, g, approximate):
    x, b = x.clone().requires_grad_(), b.clone().requires_grad_()
    out = fn(x, b, approximate)
    out.backward(g)
    return out.detach(), x.grad, b.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_equals_gelu_of_sum(dtype, approximate):
    x, b = _randn(0, 3, 5, 16, dtype=dtype) * 2, _randn(1, 16, dtype=dtype)
    g = _randn(2, 3, 5, 16, dtype=dtype)
    got = _both(bias_gelu, x, b, g, approximate)
    want = _both(lambda x, b, a: F.gelu(x + b, approximate=a), x, b, g, approximate)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for a, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, w, **TOL[dtype])


def test_reference_kernel_sums_the_rounded_gradient():
    """dbias is the fp32 column sum of dx as rounded to x's dtype."""
    x, b, g = (_randn(i, 64, 24, dtype=torch.bfloat16) for i in range(3))
    b = b[0]
    dx, db = reference.bias_gelu_backward(x, b, g, "tanh")
    want = torch.ops.aten.gelu_backward(g.float(), x.float() + b.float(), approximate="tanh")
    assert torch.equal(dx, want.to(torch.bfloat16))
    assert torch.equal(db, dx.float().sum(0).to(torch.bfloat16))


@pytest.mark.slow
def test_bias_gelu_compiled_equals_eager():
    x, b, g = _randn(0, 4, 32), _randn(1, 32), _randn(2, 4, 32)
    eager = _both(bias_gelu, x, b, g, "tanh")
    compiled = _both(torch.compile(bias_gelu), x, b, g, "tanh")
    for a, w in zip(compiled, eager):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6)


def test_bad_input_names_the_value():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="approximate"):
        bias_gelu(x, torch.zeros(8), "erf")
    with pytest.raises(ValueError, match="bias must be a 1-D tensor"):
        bias_gelu(x, torch.zeros(4), "none")
    with pytest.raises(ValueError, match="approximate"):
        kernels.bias_gelu_backward(x, torch.zeros(8), x, "sigmoid")
