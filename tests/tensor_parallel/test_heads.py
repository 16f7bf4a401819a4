"""A linear projection split into heads (``linear_heads``, ``forward_heads``) against
``F.linear`` and views of its output: the same outputs and gradients, on CPU (the
reference kernel) and on gloo TP worlds (tests/gpu/test_heads_grad_cuda.py checks the
CUDA kernel against the reference)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpzero import kernels
from mpzero import parallel_state as ps
from mpzero.kernels import reference
from mpzero.tensor_parallel import ColumnParallelLinear, linear_heads, split_heads

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float64: {"rtol": 1e-12, "atol": 1e-12},
       torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}}


def _randn(seed, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _fused(ys) -> bool:
    """The outputs come from the fused function (its backward is the one-pass op)."""
    return all(type(y.grad_fn).__name__ == "_LinearHeadsBackward" for y in ys)


def _run(fn, x, w, b, outs, used=None, fused=None):
    """Outputs and (x, w, b) gradients of ``sum_j <fn(x, w, b)[j], outs[j]>`` over the
    ``used`` outputs (default all); ``fused``: assert which backward ran."""
    x, w = x.clone().requires_grad_(), nn.Parameter(w.clone())
    b = nn.Parameter(b.clone()) if b is not None else None
    ys = fn(x, w, b)
    if fused is not None:
        assert _fused(ys) == fused
    used = range(len(ys)) if used is None else used
    sum((ys[j].float() * outs[j].float()).sum() for j in used).backward()
    return [y.detach() for y in ys], x.grad, w.grad, (b.grad if b is not None else None)


def _case(n, dtype, bias, B=2, T=5, H=3, D=8, n_in=16, seed=0):
    x = _randn(seed, B, T, n_in, dtype=dtype)
    w = _randn(seed + 1, H * n * D, n_in, dtype=dtype)
    b = _randn(seed + 2, H * n * D, dtype=dtype) if bias else None
    outs = [_randn(seed + 3 + j, B, H, T, D, dtype=dtype) for j in range(n)]
    return x, w, b, outs, D


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_heads_equals_views_of_f_linear(dtype, n, bias):
    x, w, b, outs, D = _case(n, dtype, bias)
    got = _run(lambda x, w, b: linear_heads(x, w, b, n, D), x, w, b, outs, fused=True)
    want = _run(lambda x, w, b: split_heads(F.linear(x, w, b), n, D), x, w, b, outs, fused=False)
    for g, r in zip(got[0], want[0]):  # the forward is F.linear itself
        assert g.shape == (2, 3, 5, D)
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    for g, r in zip(got[1:], want[1:]):
        if r is None:
            assert g is None
        else:
            torch.testing.assert_close(g, r, **TOL[dtype])


def test_unused_heads_get_zero_gradients():
    """Only k used (v unused): the fused backward sees zeros for v, as autograd would."""
    x, w, b, outs, D = _case(3, torch.float64, True, seed=4)
    got = _run(lambda x, w, b: linear_heads(x, w, b, 3, D), x, w, b, outs, used=[1], fused=True)
    want = _run(lambda x, w, b: split_heads(F.linear(x, w, b), 3, D), x, w, b, outs, used=[1])
    for g, r in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, r, **TOL[torch.float64])
    # The bias rows of q and v (parts 0 and 2 of every head) got exactly zero.
    assert torch.equal(got[3].view(3, 3, D)[:, [0, 2]], torch.zeros(3, 2, D, dtype=torch.float64))


def test_reference_kernel_layout_with_strided_gradients():
    """dy[b*T + t, (h*n + j)*D + d] = grads[j][b, h, t, d], whatever the gradients'
    strides; dbias is dy's column sum."""
    B, H, T, D, n = 2, 3, 4, 8, 3
    base = _randn(0, B, T, H, n, D)
    grads = base.permute(3, 0, 2, 1, 4).unbind(0)  # views, as attention's inputs are
    grads = [grads[0], grads[1].contiguous(), grads[2].transpose(1, 2).contiguous().transpose(1, 2)]
    dy, dbias = reference.heads_grad(grads, True)
    assert dy.shape == (B * T, H * n * D) and dy.is_contiguous()
    for b in range(B):
        for t in range(T):
            for h in range(H):
                for j in range(n):
                    assert torch.equal(dy[b * T + t, (h * n + j) * D:(h * n + j + 1) * D],
                                       grads[j][b, h, t])
    torch.testing.assert_close(dbias, base.reshape(B * T, -1).sum(0), rtol=1e-6, atol=1e-6)
    assert reference.heads_grad(grads, False)[1] is None
    dy2, db2 = kernels.heads_grad(grads)  # CPU: the reference
    assert torch.equal(dy2, dy) and torch.equal(db2, dbias)


def test_no_tokens():
    dy, dbias = kernels.heads_grad([torch.zeros(2, 3, 0, 8) for _ in range(3)])
    assert dy.shape == (0, 72) and torch.equal(dbias, torch.zeros(72))


def test_gradient_accumulation_fusion_adds_into_main_grad():
    """With the optimizer's main_grad, three backward passes add their weight gradients
    into it in fp32; the weight gets no .grad; main_grad_ready gets a zero gradient."""
    x0, w0, b0, _, D = _case(3, torch.bfloat16, True)
    w = nn.Parameter(w0.clone())
    b = nn.Parameter(b0.clone())
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    w.main_grad_ready = torch.zeros((), requires_grad=True)
    expected = torch.zeros(w.shape, dtype=torch.float64)
    for k in range(3):
        x = _randn(10 + k, *x0.shape, dtype=torch.bfloat16).requires_grad_()
        outs = [_randn(20 + 3 * k + j, 2, 3, 5, D, dtype=torch.bfloat16) for j in range(3)]
        ys = linear_heads(x, w, b, 3, D, gradient_accumulation_fusion=True)
        assert _fused(ys)
        sum((y.float() * o.float()).sum() for y, o in zip(ys, outs)).backward()
        dy = torch.stack(outs, dim=3).permute(0, 2, 1, 3, 4).reshape(10, -1)
        expected += dy.double().t() @ x.detach().reshape(10, -1).double()
    assert w.grad is None and b.grad is not None
    assert w.main_grad_ready.grad is not None and float(w.main_grad_ready.grad) == 0.0
    torch.testing.assert_close(w.main_grad.double(), expected, rtol=1e-2, atol=1e-2)


def test_autocast_takes_the_plain_path():
    """Under autocast the result is F.linear's views (the fused backward would not see
    autocast's casts)."""
    x, w, b, outs, D = _case(3, torch.float32, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(lambda x, w, b: linear_heads(x, w, b, 3, D), x, w, b, outs, fused=False)
        want = _run(lambda x, w, b: split_heads(F.linear(x, w, b), 3, D), x, w, b, outs)
    assert got[0][0].dtype == torch.bfloat16
    for g, r in zip(got, want):
        if isinstance(g, list):
            for a, c in zip(g, r):
                assert torch.equal(a, c)
        else:
            assert g.dtype == torch.float32 and torch.equal(g, r)


def test_compiled_equals_eager():
    x, w, b, outs, D = _case(3, torch.float32, True, seed=7)

    def fn(x, w, b):
        return linear_heads(x, w, b, 3, D)

    eager = _run(fn, x, w, b, outs)
    compiled = _run(torch.compile(fn), x, w, b, outs)
    for g, r in zip(compiled[1:], eager[1:]):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_bad_input_names_the_value():
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="whole heads of 3 x 8"):
        linear_heads(x, torch.zeros(20, 4), None, 3, 8)
    with pytest.raises(ValueError, match="grads must be 4-D"):
        kernels.heads_grad([torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 5, 8)])
    layer = ColumnParallelLinear(4, 24, skip_bias_add=True)
    with pytest.raises(ValueError, match="skip_bias_add"):
        layer.forward_heads(x, 3, 8)


def _check_forward_heads(tp, gather_output):
    """Rank r's heads of ColumnParallelLinear.forward_heads equal the single-device
    nn.Linear's output split into all heads (rank r holds heads r*H/tp ...)."""
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    r = ps.get_tensor_model_parallel_rank()
    dtype, n, D, H, n_in = torch.float64, 3, 8, 4, 16
    ref = nn.Linear(n_in, H * n * D, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(_randn(1, H * n * D, n_in, dtype=dtype))
        ref.bias.copy_(_randn(2, H * n * D, dtype=dtype))
    x = _randn(3, 2, 5, n_in, dtype=dtype)
    outs = [_randn(4 + j, 2, H, 5, D, dtype=dtype) for j in range(n)]
    x_ref = x.clone().requires_grad_()
    ys = split_heads(ref(x_ref), n, D)
    sum((y * o).sum() for y, o in zip(ys, outs)).backward()

    layer = ColumnParallelLinear(n_in, H * n * D, gather_output=gather_output, params_dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(ref.weight.chunk(tp, 0)[r])
        layer.bias.copy_(ref.bias.chunk(tp, 0)[r])
    x_tp = x.clone().requires_grad_()
    mine = slice(None) if gather_output else slice(r * H // tp, (r + 1) * H // tp)
    got = layer.forward_heads(x_tp, n, D)
    assert _fused(got) != gather_output  # gathered outputs are split after the gather
    sum((y * o[:, mine]).sum() for y, o in zip(got, outs)).backward()
    tol = TOL[dtype]
    for g, want in zip(got, ys):
        torch.testing.assert_close(g, want.detach()[:, mine], **tol)
    torch.testing.assert_close(x_tp.grad, x_ref.grad, **tol)
    if not gather_output:
        torch.testing.assert_close(layer.weight.grad, ref.weight.grad.chunk(tp, 0)[r], **tol)
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad.chunk(tp, 0)[r], **tol)
    return True


@pytest.mark.parametrize("world_size,gather_output", [(1, False), (2, False), (2, True)])
def test_forward_heads_matches_single_device(world, world_size, gather_output):
    assert all(world(world_size, _check_forward_heads, world_size, gather_output))
