"""GELU in the GEMMs' epilogues (``gelu_mlp``, ``parallel_gelu_mlp``) on the CPU.

The CPU path runs the PyTorch reference of the fused GEMMs inside the same autograd
function and custom ops as CUDA, so these tests check the function's structure: output
and every gradient against the unfused ``F.linear -> gelu(tanh) -> F.linear`` (fp64,
tight; bf16, within one rounding of each stored value), gradient accumulation fusion,
``torch.compile`` through the custom ops' fake kernels, and TP / sequence parallelism on
gloo worlds against one device. The CUDA kernels are checked in tests/gpu.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from tp_mlp_layers import fc_and_proj

from mpzero import kernels
from mpzero import parallel_state as ps
from mpzero import tensor_parallel as tp
from mpzero.tensor_parallel.gelu_mlp import gelu_mlp

F64 = {"rtol": 1e-12, "atol": 1e-12}


def _randn(seed, *shape, dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _params(dtype, bias, hidden=8, ffn=16, seed=0):
    w1 = nn.Parameter(_randn(seed, ffn, hidden, dtype=dtype, scale=0.3))
    b1 = nn.Parameter(_randn(seed + 1, ffn, dtype=dtype)) if bias else None
    w2 = nn.Parameter(_randn(seed + 2, hidden, ffn, dtype=dtype, scale=0.3))
    return w1, b1, w2


def _clone(ps_):
    return [nn.Parameter(p.detach().clone()) if p is not None else None for p in ps_]


def _unfused(x, w1, b1, w2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2)


def _grads(x, params):
    return [x.grad] + [p.grad if p is not None else None for p in params]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("keep", [True, False])
def test_equals_unfused_fp64(bias, keep):
    params = _params(torch.float64, bias)
    ref_params = _clone(params)
    x = _randn(10, 2, 3, 8).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    out = gelu_mlp(x, *params, keep_gelu_output=keep)
    ref = _unfused(x_ref, *ref_params)
    torch.testing.assert_close(out, ref, **F64)
    g = _randn(11, *out.shape)
    out.backward(g)
    ref.backward(g)
    for name, a, b in zip(("x", "w1", "b1", "w2"), _grads(x, params), _grads(x_ref, ref_params)):
        if b is None:
            assert a is None, name
        else:
            torch.testing.assert_close(a, b, **F64, msg=name)


def test_bf16_within_rounding():
    """bf16 tensors: every output and gradient within bf16 rounding of the fp64 function
    of the same (bf16) inputs."""
    params = _params(torch.bfloat16, True)
    x = _randn(3, 4, 8, dtype=torch.bfloat16).requires_grad_()
    out = gelu_mlp(x, *params)
    g = _randn(4, *out.shape, dtype=torch.bfloat16)
    out.backward(g)
    wide = [nn.Parameter(p.detach().double()) for p in params]
    xw = x.detach().double().requires_grad_()
    ref = _unfused(xw, *wide)
    ref.backward(g.double())
    tol = {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(out.double(), ref, **tol)
    for name, a, b in zip(("x", "w1", "b1", "w2"), _grads(x, params), _grads(xw, wide)):
        assert a.dtype == torch.bfloat16, name
        torch.testing.assert_close(a.double(), b, **tol, msg=name)


def test_reference_kernels_match_their_definition():
    """The reference GEMMs (what the CPU runs): z = x W^T + b rounded once, y = gelu(z);
    dz = (dout W2) gelu'(z)."""
    x, w, b = _randn(0, 5, 8), _randn(1, 16, 8), _randn(2, 16)
    y, z = kernels.gemm_bias_gelu(x, w, b)
    torch.testing.assert_close(z, x @ w.t() + b, **F64)
    torch.testing.assert_close(y, F.gelu(z, approximate="tanh"), **F64)
    dout, w2 = _randn(3, 5, 4), _randn(4, 4, 16)
    dz = kernels.gemm_dgelu(dout, w2, z)
    zz = z.clone().requires_grad_()
    F.gelu(zz, approximate="tanh").backward(dout @ w2)
    torch.testing.assert_close(dz, zz.grad, **F64)
    y0, _ = kernels.gemm_bias_gelu(x, w)
    torch.testing.assert_close(y0, F.gelu(x @ w.t(), approximate="tanh"), **F64)


def test_gradient_accumulation_fusion():
    """With main_grad on both weights: their gradients of two backward passes are added
    into main_grad (fp32), the weights get no .grad, main_grad_ready a zero gradient."""
    params = _params(torch.float32, True)
    ref_params = _clone(params)
    for w in (params[0], params[2]):
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        w.main_grad_ready = torch.zeros((), requires_grad=True)
    for k in range(2):
        x = _randn(20 + k, 3, 8, dtype=torch.float32)
        g = _randn(30 + k, 3, 8, dtype=torch.float32)
        gelu_mlp(x, *params, gradient_accumulation_fusion=True).backward(g)
        _unfused(x, *ref_params).backward(g)
    for w, ref in ((params[0], ref_params[0]), (params[2], ref_params[2])):
        assert w.grad is None
        assert float(w.main_grad_ready.grad) == 0.0
        torch.testing.assert_close(w.main_grad, ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(params[1].grad, ref_params[1].grad, rtol=1e-5, atol=1e-6)


def test_without_fusion_flag_main_grad_is_left_alone():
    params = _params(torch.float32, True)
    params[0].main_grad = torch.zeros(params[0].shape)
    params[0].main_grad_ready = torch.zeros((), requires_grad=True)
    gelu_mlp(_randn(1, 3, 8, dtype=torch.float32), *params).sum().backward()
    assert params[0].grad is not None and not params[0].main_grad.any()


def test_compiled_equals_eager():
    """torch.compile (aot_eager: the custom ops' fake kernels and the autograd function
    traced into forward and backward graphs) gives the eager values."""
    params = _params(torch.float32, True)
    ref_params = _clone(params)
    x = _randn(5, 2, 3, 8, dtype=torch.float32)
    g = _randn(6, 2, 3, 8, dtype=torch.float32)
    compiled = torch.compile(lambda x, a, b, c: gelu_mlp(x, a, b, c), backend="aot_eager",
                             fullgraph=True)
    compiled(x, *params).backward(g)
    gelu_mlp(x, *ref_params).backward(g)
    for name, a, b in zip(("w1", "b1", "w2"), params, ref_params):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_errors_name_the_problem():
    w1, b1, w2 = _params(torch.float32, True)
    x = _randn(0, 2, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="fc_weight is torch.float64"):
        gelu_mlp(x, w1.detach().double(), b1, w2)
    with pytest.raises(ValueError, match="shapes do not chain"):
        gelu_mlp(_randn(0, 2, 7, dtype=torch.float32), w1, b1, w2)
    with pytest.raises(ValueError, match="shapes do not chain"):
        gelu_mlp(x, w1, b1, w2[:, :5])
    with pytest.raises(ValueError, match="bias must have 16"):
        kernels.gemm_bias_gelu(x, w1.detach(), b1.detach()[:3])
    with pytest.raises(ValueError, match="gemm_dgelu"):
        kernels.gemm_dgelu(x, w2.detach(), x)
    fc = tp.ColumnParallelLinear(8, 16, gather_output=True)
    proj = tp.RowParallelLinear(16, 8, input_is_parallel=True)
    with pytest.raises(ValueError, match="gather_output"):
        tp.parallel_gelu_mlp(x, fc, proj)


def _tp_mlp(tp_size, sp, bias, fused):
    """fc -> gelu(tanh) -> proj over TP (fp64), the fused or the unfused way: the full
    output and this rank's gradients."""
    ps.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    fc, proj = fc_and_proj(sp, bias)
    x = _randn(1, 2, 4 * tp_size, 8).requires_grad_()
    inp = tp.scatter_to_sequence_parallel_region(x, 1) if sp else x
    if fused:
        out, _ = tp.parallel_gelu_mlp(inp, fc, proj)
    else:
        h, _ = fc(inp)
        out, _ = proj(F.gelu(h, approximate="tanh"))
    full = tp.gather_from_sequence_parallel_region(out, 1, tensor_parallel_output_grad=False) \
        if sp else out
    (full * _randn(2, *full.shape)).sum().backward()
    grads = {"x": x.grad, "fc.w": fc.weight.grad, "proj.w": proj.weight.grad}
    if bias:
        grads.update({"fc.b": fc.bias.grad, "proj.b": proj.bias.grad})
    ps.destroy_model_parallel()
    return full.detach(), grads


def _fused_vs_unfused(tp_size):
    for sp in (False, True):
        for bias in (True, False):
            ref, ref_grads = _tp_mlp(tp_size, sp, bias, fused=False)
            got, grads = _tp_mlp(tp_size, sp, bias, fused=True)
            torch.testing.assert_close(got, ref, **F64)
            for name in ref_grads:
                torch.testing.assert_close(grads[name], ref_grads[name], **F64, msg=name)
    return True


@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [1, pytest.param(2, marks=pytest.mark.slow)])  # TP 2: make test
def test_tensor_parallel_equals_unfused(world, size):
    """TP 1 and 2, with and without sequence parallelism and biases: the fused MLP's
    output and gradients equal the unfused TP layers'."""
    assert all(world(size, _fused_vs_unfused, size))
