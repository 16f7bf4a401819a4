"""The CUDA LayerNorm kernels (residual add + LayerNorm or RMSNorm, forward and backward)
against the PyTorch reference and F.layer_norm / F.rms_norm: outputs within a few units of
the dtype's rounding, the weight and bias gradients within fp32 summation order,
deterministic; the fused ops eager and compiled against the unfused add + norm."""

import pytest
import torch
import torch.nn.functional as F

from mpzero import kernels
from mpzero.kernels import reference
from mpzero.tensor_parallel.layer_norm import (
    add_layer_norm,
    add_rms_norm,
    fused_layer_norm,
    fused_rms_norm,
)
from mpzero.testing import skip_module_without_extension

skip_module_without_extension()

from mpzero.kernels import cuda as kcuda  # noqa: E402  (needs the extension)

# Relative to the values' scale: two roundings of the output dtype (the kernel and the
# reference round the same fp32 value, which they compute in another order).
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SHAPES = [(37, 2048), (5, 8), (3, 264), (64, 768), (9, 4096), (4, 8192), (1, 2048), (300, 1024)]


def _inputs(R, H, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    def r(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale + shift).to(dtype)
    return r(R, H, shift=0.5), r(R, H, scale=2.0), r(H, scale=0.2, shift=1.0), r(H, scale=0.1)


def _close(a, b, dtype, what):
    scale = b.float().abs().max().clamp_min(1.0)
    err = float((a.float() - b.float()).abs().max() / scale)
    assert err < TOL[dtype], f"{what}: relative error {err} >= {TOL[dtype]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("R,H", SHAPES)
@pytest.mark.parametrize("add,bias", [(True, True), (False, True), (True, False), (False, False)])
def test_forward_equals_reference(dtype, R, H, add, bias):
    x, y, w, b = _inputs(R, H, dtype)
    y = y if add else None
    b = b if bias else None
    assert kernels._layer_norm_on_cuda([x, y], [w, b])
    out, s, mean, rstd = kcuda.layer_norm_forward(x, y, w, b, 1e-5)
    rout, rs, rmean, rrstd = reference.layer_norm_forward(x, y, w, b, 1e-5)
    assert torch.equal(s, rs)  # the add rounds the same fp32 sum
    assert mean.dtype == rstd.dtype == torch.float32
    torch.testing.assert_close(mean, rmean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd, rrstd, rtol=1e-5, atol=1e-5)
    _close(out, rout, dtype, "out")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("R,H", SHAPES)
@pytest.mark.parametrize("add", [True, False])
def test_rms_forward_equals_reference(dtype, R, H, add):
    x, y, w, _ = _inputs(R, H, dtype)
    y = y if add else None
    out, s, mean, rstd = kcuda.layer_norm_forward(x, y, w, None, 1e-5, rms=True)
    rout, rs, rmean, rrstd = reference.layer_norm_forward(x, y, w, None, 1e-5, rms=True)
    assert mean is None and rmean is None
    assert torch.equal(s, rs)
    torch.testing.assert_close(rstd, rrstd, rtol=1e-5, atol=1e-5)
    _close(out, rout, dtype, "out")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,H", SHAPES)
@pytest.mark.parametrize("res", [True, False])
def test_rms_backward_equals_reference(dtype, R, H, res):
    x, _, w, _ = _inputs(R, H, dtype)
    _, _, _, rstd = reference.layer_norm_forward(x, None, w, None, 1e-5, rms=True)
    g_out = _inputs(R, H, dtype, seed=1)[1]
    g_s = _inputs(R, H, dtype, seed=2)[1] if res else None
    ds, dw, db = kcuda.layer_norm_backward(g_out, g_s, x, None, rstd, w, False)
    rds, rdw, _ = reference.layer_norm_backward(g_out, g_s, x, None, rstd, w, False)
    assert db is None
    _close(ds, rds, dtype, "ds")
    scale_w = (g_out.float() * x.float() * rstd[:, None]).abs().sum(0).clamp_min(1.0)
    assert float(((dw.float() - rdw.float()).abs() / scale_w).max()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("R,H", SHAPES)
@pytest.mark.parametrize("res,bias", [(True, True), (False, False)])
def test_backward_equals_reference(dtype, R, H, res, bias):
    x, y, w, _ = _inputs(R, H, dtype)
    s = x
    _, _, mean, rstd = reference.layer_norm_forward(s, None, w, None, 1e-5)
    g_out = _inputs(R, H, dtype, seed=1)[1]
    g_s = _inputs(R, H, dtype, seed=2)[1] if res else None
    ds, dw, db = kcuda.layer_norm_backward(g_out, g_s, s, mean, rstd, w, bias)
    rds, rdw, rdb = reference.layer_norm_backward(g_out, g_s, s, mean, rstd, w, bias)
    _close(ds, rds, dtype, "ds")
    # Column sums of R rows: compare against the sum of magnitudes.
    xhat = (s.float() - mean[:, None]) * rstd[:, None]
    scale_w = (g_out.float() * xhat).abs().sum(0).clamp_min(1.0)
    assert float(((dw.float() - rdw.float()).abs() / scale_w).max()) < TOL[dtype]
    if bias:
        scale_b = g_out.float().abs().sum(0).clamp_min(1.0)
        assert float(((db.float() - rdb.float()).abs() / scale_b).max()) < TOL[dtype]
    else:
        assert db is None


def test_no_rows():
    x = torch.empty(0, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    out, s, mean, rstd = kcuda.layer_norm_forward(x, x.clone(), w, w.clone(), 1e-5)
    assert out.shape == (0, 64) and mean.shape == (0,)
    ds, dw, db = kcuda.layer_norm_backward(x, None, x, mean, rstd, w, True)
    assert ds.shape == (0, 64) and torch.equal(dw, torch.zeros_like(dw))
    assert torch.equal(db, torch.zeros_like(db))


def test_backward_is_deterministic():
    x, _, w, _ = _inputs(4096, 2048, torch.bfloat16, seed=3)
    _, _, mean, rstd = kcuda.layer_norm_forward(x, None, w, None, 1e-5)
    g = _inputs(4096, 2048, torch.bfloat16, seed=4)[1]
    first = kcuda.layer_norm_backward(g, g, x, mean, rstd, w, True)
    for _ in range(3):
        again = kcuda.layer_norm_backward(g, g, x, mean, rstd, w, True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_inputs_the_kernels_cannot_take_use_the_reference():
    x, y, w, b = _inputs(6, 20, torch.bfloat16)  # H not a multiple of 8
    assert not kernels._layer_norm_on_cuda([x, y], [w, b])
    out, s, _, _ = kernels.layer_norm_forward(x, y, w, b, 1e-5)
    torch.testing.assert_close(out, F.layer_norm(x + y, (20,), w, b), rtol=1.6e-2, atol=1.6e-2)
    x, y, w, b = _inputs(6, 64, torch.bfloat16)
    assert not kernels._layer_norm_on_cuda([x, y.float()], [w, b])  # mixed dtypes
    assert not kernels._layer_norm_on_cuda([x[:, :56]], [w[:56], None])  # strided rows


def test_kernel_errors_name_the_problem():
    from mpzero import _C
    x, _, w, _ = _inputs(4, 64, torch.bfloat16)
    mean = torch.empty(4, device="cuda")
    with pytest.raises(RuntimeError, match="'weight' must be"):
        _C.layer_norm_forward(x, None, w[:32], None, None, torch.empty_like(x), mean,
                              mean.clone(), 1e-5)
    x12 = torch.zeros(4, 12, device="cuda", dtype=x.dtype)
    with pytest.raises(RuntimeError, match="H must be a multiple of 8"):
        _C.layer_norm_forward(x12, None, w[:12].contiguous(), None, None,
                              torch.empty_like(x12), mean, mean.clone(), 1e-5)
    with pytest.raises(RuntimeError, match="mean and rstd"):
        _C.layer_norm_backward(x, None, x, mean[:2], mean.clone(), w, torch.empty_like(x),
                               torch.empty_like(w), None)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_against_unfused(compiled, dtype, rms):
    x, y, w, b = _inputs(2 * 128, 1024, dtype, seed=5)
    x, y = x.view(2, 128, 1024), y.view(2, 128, 1024)
    gs, go = _inputs(2 * 128, 1024, dtype, seed=6)[:2]
    gs, go = gs.view_as(x), go.view_as(x)

    def fused(x, y, w, b):
        if rms:
            s, o = add_rms_norm(x, y, w)
            return s, o, fused_rms_norm(s, w)
        s, o = add_layer_norm(x, y, w, b)
        return s, o, fused_layer_norm(s, w, None)

    def plain(x, y, w, b):
        s = x + y
        if rms:
            return s, F.rms_norm(s, (1024,), w, 1e-5), F.rms_norm(s, (1024,), w, 1e-5)
        return s, F.layer_norm(s, (1024,), w, b), F.layer_norm(s, (1024,), w, None)

    results = []
    for fn in (fused, plain):
        f = torch.compile(fn, fullgraph=True) if compiled and fn is fused else fn
        leaves = [t.detach().clone().requires_grad_() for t in (x, y, w, b)]
        s, o, o2 = f(*leaves)
        ((s.float() * gs.float()).sum() + (o.float() * go.float()).sum()
         + (o2.float() * gs.float()).sum()).backward()
        results.append([s, o, o2] + [t.grad for t in leaves])
    names = ["s", "out", "out (no add)", "dx", "dy", "dw", "db"]
    for name, a, r in zip(names, *results):
        if r is None:  # RMSNorm: no bias gradient either way
            assert a is None, name
            continue
        _close(a, r, dtype, name)
