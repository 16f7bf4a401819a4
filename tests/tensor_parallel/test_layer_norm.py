"""add_layer_norm / fused_layer_norm and add_rms_norm / fused_rms_norm (the PyTorch
reference path, as on CPU) against the unfused add + F.layer_norm / F.rms_norm: values
and every gradient, with and without bias, fp64 / fp32 / bf16, compiled, the custom ops'
fake shapes; the kernels' contract functions; errors that name the problem."""

import pytest
import torch
import torch.nn.functional as F

from mpzero import kernels
from mpzero.kernels import reference
from mpzero.tensor_parallel import add_layer_norm, add_rms_norm, fused_layer_norm, fused_rms_norm

# fp64: rounding only; fp32: a few ulps of the sums; bf16: one rounding of the result.
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1.6e-2}


def _leaves(shape, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = shape[-1]
    x = torch.randn(*shape, generator=g, dtype=torch.float64).add_(0.5)
    y = 2 * torch.randn(*shape, generator=g, dtype=torch.float64)
    w = 1 + 0.2 * torch.randn(h, generator=g, dtype=torch.float64)
    b = 0.1 * torch.randn(h, generator=g, dtype=torch.float64) if bias else None
    return [None if t is None else t.to(dtype).requires_grad_() for t in (x, y, w, b)]


def _run(fn, leaves, gs, go):
    outs = fn(*leaves)
    loss = sum((o.double() * g.double()).sum() for o, g in zip(outs, (gs, go, gs)))
    loss.backward()
    return [o.detach() for o in outs] + [None if t is None else t.grad for t in leaves]


def _fused(x, y, w, b):
    s, o = add_layer_norm(x, y, w, b)
    return s, o, fused_layer_norm(x, w, b)


def _plain(x, y, w, b):
    s = x + y
    return s, F.layer_norm(s, (s.shape[-1],), w, b), F.layer_norm(x, (x.shape[-1],), w, b)


def _fused_rms(x, y, w, b):
    s, o = add_rms_norm(x, y, w)
    return s, o, fused_rms_norm(x, w)


def _plain_rms(x, y, w, b):
    s = x + y
    return s, F.rms_norm(s, (s.shape[-1],), w, 1e-5), F.rms_norm(x, (x.shape[-1],), w, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(4, 5, 64), (3, 24), (1, 1, 8)])
def test_against_unfused(dtype, bias, shape):
    gen = torch.Generator().manual_seed(9)
    gs, go = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(2))
    got = _run(_fused, _leaves(shape, dtype, bias), gs, go)
    want = _run(_plain, _leaves(shape, dtype, bias), gs, go)
    names = ["s", "out", "out (no add)", "dx", "dy", "dw", "db"]
    for name, a, r in zip(names, got, want):
        if r is None:
            assert a is None, name
            continue
        scale = r.double().abs().max().clamp_min(1.0)
        err = float((a.double() - r.double()).abs().max() / scale)
        assert err <= TOL[dtype], f"{name}: {err}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 5, 64), (3, 24), (1, 1, 8)])
def test_rms_against_unfused(dtype, shape):
    gen = torch.Generator().manual_seed(9)
    gs, go = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(2))
    got = _run(_fused_rms, _leaves(shape, dtype, False), gs, go)
    want = _run(_plain_rms, _leaves(shape, dtype, False), gs, go)
    # bf16: F.rms_norm rounds the normalized rows before the weight multiplies them (two
    # roundings), the fused op rounds once.
    tol = 2 * TOL[dtype] if dtype == torch.bfloat16 else TOL[dtype]
    for name, a, r in zip(["s", "out", "out (no add)", "dx", "dy", "dw"], got, want):
        scale = r.double().abs().max().clamp_min(1.0)
        err = float((a.double() - r.double()).abs().max() / scale)
        assert err <= tol, f"{name}: {err}"


def test_rms_reference_backward_is_the_forward_derivative():
    x, y, w, _ = _leaves((6, 16), torch.float64, bias=False)
    out, s, mean, rstd = reference.layer_norm_forward(x, y, w, None, 1e-5, rms=True)
    assert mean is None
    g_out, g_s = torch.randn(6, 16, dtype=torch.float64), torch.randn(6, 16, dtype=torch.float64)
    torch.autograd.backward([out, s], [g_out, g_s])
    ds, dw, db = reference.layer_norm_backward(g_out, g_s, s.detach(), None, rstd.detach(),
                                               w.detach(), False)
    torch.testing.assert_close(ds, x.grad)
    torch.testing.assert_close(dw, w.grad)
    assert db is None


def test_compiled_matches_eager():
    leaves = _leaves((2, 16, 32), torch.float32)
    gs, go = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    eager = _run(_fused, leaves, gs, go)
    compiled = torch.compile(_fused, backend="aot_eager", fullgraph=True)
    again = _run(compiled, _leaves((2, 16, 32), torch.float32), gs, go)
    for a, b in zip(eager, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("rms", [False, True])
def test_fake_shapes_under_inductor(rms):
    fused, plain = (_fused_rms, _plain_rms) if rms else (_fused, _plain)
    leaves = _leaves((3, 40), torch.float32, bias=not rms)
    compiled = torch.compile(fused, backend="inductor", fullgraph=True)
    got = _run(compiled, leaves, torch.ones(3, 40), torch.ones(3, 40))
    want = _run(plain, _leaves((3, 40), torch.float32, bias=not rms), torch.ones(3, 40),
                torch.ones(3, 40))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_only_the_output_or_only_s_used():
    x, y, w, b = _leaves((4, 16), torch.float64)
    s, o = add_layer_norm(x, y, w, b)
    o.sum().backward()  # s unused: no residual gradient
    x2, y2, w2, b2 = _leaves((4, 16), torch.float64)
    F.layer_norm(x2 + y2, (16,), w2, b2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    x, y, w, b = _leaves((4, 16), torch.float64)
    s, o = add_layer_norm(x, y, w, b)
    (3 * s).sum().backward()  # output unused: the residual gradient alone
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_no_rows():
    x, y, w, b = _leaves((0, 8), torch.float32)
    s, o = add_layer_norm(x, y, w, b)
    (s.sum() + o.sum()).backward()
    assert o.shape == (0, 8) and torch.equal(w.grad, torch.zeros(8))


def test_reference_backward_is_the_forward_derivative():
    """The reference backward against autograd through the reference forward (fp64)."""
    x, y, w, b = _leaves((6, 16), torch.float64)
    out, s, mean, rstd = reference.layer_norm_forward(x, y, w, b, 1e-5)
    g_out, g_s = torch.randn(6, 16, dtype=torch.float64), torch.randn(6, 16, dtype=torch.float64)
    torch.autograd.backward([out, s], [g_out, g_s])
    ds, dw, db = reference.layer_norm_backward(g_out, g_s, s.detach(), mean.detach(),
                                               rstd.detach(), w.detach(), True)
    torch.testing.assert_close(ds, x.grad)
    torch.testing.assert_close(dw, w.grad)
    torch.testing.assert_close(db, b.grad)


def test_errors_name_the_problem():
    x, y, w, b = _leaves((2, 8), torch.float32)
    with pytest.raises(ValueError, match="weight and bias must have 8"):
        add_layer_norm(x, y, w[:4], b)
    with pytest.raises(ValueError, match="one shape"):
        add_layer_norm(x, y[:1], w, b)
    with pytest.raises(ValueError, match="weight and bias must have 8"):
        fused_layer_norm(x, w, b[:3])
    with pytest.raises(ValueError, match=r"x \[R, H\]"):
        kernels.layer_norm_forward(x.view(2, 2, 4), None, w[:4], None, 1e-5)
    with pytest.raises(ValueError, match="RMSNorm .* takes no bias"):
        kernels.layer_norm_forward(x, None, w, b, 1e-5, rms=True)
    with pytest.raises(ValueError, match="RMSNorm .* has no bias gradient"):
        kernels.layer_norm_backward(x, None, x, None, x[:, 0], w, True)
    with pytest.raises(ValueError, match="add_rms_norm: x and y must have one shape"):
        add_rms_norm(x, y[:1], w)
