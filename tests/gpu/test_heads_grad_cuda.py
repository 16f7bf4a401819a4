"""The CUDA heads-gradient kernel against the PyTorch reference: dy bit-equal (a copy),
dbias within fp32 summation order, deterministic; linear_heads with attention on the
GPU, eager and compiled, against the unfused projection."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpzero import kernels
from mpzero.kernels import reference
from mpzero.tensor_parallel import linear_heads, split_heads
from mpzero.testing import skip_module_without_extension

skip_module_without_extension()

from mpzero.kernels import cuda as kcuda  # noqa: E402  (needs the extension)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _grads(B, H, T, D, n, dtype, layout, seed=0):
    """n gradients [B, H, T, D]: views of one [B, T, H, n, D] tensor ("views", as the
    forward's outputs are), contiguous [B, H, T, D] ("bhtd"), or [B, T, H, D] transposed
    ("bthd", what attention kernels often return)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if layout == "views":
        base = torch.randn(B, T, H, n, D, device="cuda", generator=g).to(dtype)
        return list(base.permute(3, 0, 2, 1, 4).unbind(0))
    out = []
    for _ in range(n):
        t = torch.randn(B, T, H, D, device="cuda", generator=g).to(dtype)
        out.append(t.transpose(1, 2) if layout == "bthd" else t.transpose(1, 2).contiguous())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["views", "bhtd", "bthd"])
@pytest.mark.parametrize("B,H,T,D,n", [(2, 16, 1024, 128, 3), (3, 5, 37, 64, 2), (1, 2, 3, 8, 1),
                                       (2, 3, 0, 16, 3)])
def test_kernel_equals_reference(dtype, layout, B, H, T, D, n):
    grads = _grads(B, H, T, D, n, dtype, layout)
    assert kernels._heads_grad_on_cuda(grads)
    dy, db = kcuda.heads_grad(grads, True)
    rdy, rdb = reference.heads_grad(grads, True)
    assert dy.shape == rdy.shape and torch.equal(dy, rdy)
    if T == 0:
        assert torch.equal(db, torch.zeros_like(db))
        return
    scale = rdy.float().abs().sum(0).clamp_min(1.0)
    err = (db.float() - rdb.float()).abs() / scale
    assert float(err.max()) < max(TOL[dtype], 1e-5), float(err.max())
    dy2, none = kcuda.heads_grad(grads, False)
    assert none is None and torch.equal(dy2, rdy)


def test_kernel_is_deterministic():
    grads = _grads(4, 16, 2048, 128, 3, torch.bfloat16, "bthd", seed=3)
    first = kcuda.heads_grad(grads, True)
    for _ in range(3):
        again = kcuda.heads_grad(grads, True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_inputs_the_kernel_cannot_take_use_the_reference():
    grads = _grads(2, 3, 5, 12, 3, torch.bfloat16, "bhtd")  # head dim 12: not 8-aligned
    assert not kernels._heads_grad_on_cuda(grads)
    dy, db = kernels.heads_grad(grads)
    rdy, rdb = reference.heads_grad(grads, True)
    assert torch.equal(dy, rdy) and torch.equal(db, rdb)
    odd = _grads(2, 3, 5, 16, 2, torch.bfloat16, "bhtd")
    odd[1] = odd[1][..., 1:9]  # 2-byte offset: not 16-byte aligned
    odd[0] = odd[0][..., :8]
    assert not kernels._heads_grad_on_cuda(odd)


def test_kernel_errors_name_the_problem():
    grads = _grads(2, 3, 5, 16, 2, torch.bfloat16, "bhtd")
    dy = torch.empty(10, 96, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="dy must be"):
        kcuda._C.heads_grad(grads, dy[:, :95], None)
    with pytest.raises(RuntimeError, match="head dim must be a multiple of 8"):
        bad = [g[..., :12] for g in grads]
        kcuda._C.heads_grad(bad, torch.empty(10, 72, device="cuda", dtype=torch.bfloat16), None)


def _attention_loss(fn, x, w, b, D, target):
    x, w, b = x.clone().requires_grad_(), nn.Parameter(w.clone()), nn.Parameter(b.clone())
    q, k, v = fn(x, w, b)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (y.float() * target).sum().backward()
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("compiled", [False, True])
def test_linear_heads_with_attention(compiled):
    """q, k, v of a bf16 projection through SDPA: linear_heads gives the unfused
    projection's output and gradients (bias gradient within bf16 rounding of fp32 sums)."""
    B, T, H, D = 2, 256, 4, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, T, H * D, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(3 * H * D, H * D, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(3 * H * D, device="cuda", generator=g).to(torch.bfloat16)
    target = torch.randn(B, H, T, D, device="cuda", generator=g)

    def fused(x, w, b):
        return linear_heads(x, w, b, 3, D)

    def plain(x, w, b):
        return split_heads(F.linear(x, w, b), 3, D)

    if compiled:
        fused, plain = torch.compile(fused), torch.compile(plain)
    got = _attention_loss(fused, x, w, b, D, target)
    want = _attention_loss(plain, x, w, b, D, target)
    assert torch.equal(got[0], want[0])  # the forward is F.linear and views
    # The same dy; the GEMMs may pick other algorithms (bf16 outputs, one rounding apart),
    # the bias gradient sums in another order.
    for a, r in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, r, rtol=1.6e-2, atol=1.6e-2)
