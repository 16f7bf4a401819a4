"""The cuBLASLt GELU-epilogue GEMMs against the PyTorch reference, and the fused MLP
(eager and compiled, with gradient accumulation fusion) against the unfused one on CUDA.

Tolerances: the GEMMs accumulate in fp32 in another order than the reference's GEMM and
round once to bf16/fp16, so values agree within a few roundings of the output dtype;
the bias gradient (a sum over every token) is compared relative to its size.
"""

import pytest
import torch
import torch.nn.functional as F

from mpzero import kernels
from mpzero.kernels import reference
from mpzero.testing import autograd_node_names, skip_module_without_extension

skip_module_without_extension()

from mpzero.kernels import cuda as kcuda  # noqa: E402  (needs the extension)
from mpzero.tensor_parallel import gelu_mlp  # noqa: E402

TOL = {torch.float16: {"rtol": 1e-2, "atol": 1e-2}, torch.bfloat16: {"rtol": 4e-2, "atol": 4e-2}}


def _randn(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("M,K,N", [(16384, 2048, 8192), (1000, 264, 136), (3, 8, 16), (0, 8, 16)])
def test_gemm_bias_gelu_equals_reference(dtype, bias, M, K, N):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = _randn(g, M, K, dtype=dtype)
    w = _randn(g, N, K, dtype=dtype, scale=K ** -0.5)
    b = _randn(g, N, dtype=dtype) if bias else None
    assert kernels.gemm_gelu_available(x, w, *([b] if bias else []))
    y, z = kcuda.gemm_bias_gelu(x, w, b)
    ry, rz = reference.gemm_bias_gelu(x, w, b)
    assert y.shape == z.shape == (M, N) and y.dtype == z.dtype == dtype
    torch.testing.assert_close(z, rz, **TOL[dtype])
    # y is the GELU of the fp32 accumulator, the reference's of the rounded z.
    torch.testing.assert_close(y, ry, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,H,F", [(16384, 2048, 8192), (1000, 136, 264), (3, 16, 8), (0, 8, 16)])
def test_gemm_dgelu_equals_reference(dtype, M, H, F):
    g = torch.Generator(device="cuda").manual_seed(1)
    dout = _randn(g, M, H, dtype=dtype)
    w = _randn(g, H, F, dtype=dtype, scale=H ** -0.5)
    z = _randn(g, M, F, dtype=dtype, scale=2.0)
    dz = kcuda.gemm_dgelu(dout, w, z)
    assert dz.shape == (M, F) and dz.dtype == dtype
    torch.testing.assert_close(dz, reference.gemm_dgelu(dout, w, z), **TOL[dtype])


_ERRORS = """
import torch
from mpzero.kernels import cuda as kcuda
x = torch.randn(4, 8, device="cuda", dtype=torch.bfloat16)
w = torch.randn(16, 8, device="cuda", dtype=torch.bfloat16)
cases = [(lambda: kcuda.gemm_bias_gelu(x, w.half(), None), "weight must have x's dtype"),
         (lambda: kcuda.gemm_bias_gelu(x, w, torch.zeros(3, device="cuda",
                                                         dtype=torch.bfloat16)),
          "bias must be a contiguous 1-D tensor of 16 features of x's dtype, got [3]"),
         (lambda: kcuda.gemm_bias_gelu(x.t(), w, None),
          "x must be a contiguous 2-D CUDA tensor, got [8, 4]"),
         (lambda: kcuda.gemm_dgelu(x, w, x), "do not match")]
for call, want in cases:
    try:
        call()
    except RuntimeError as e:
        assert want in str(e), (want, str(e))
    else:
        raise AssertionError("no error: " + want)
print("ok")
"""


def test_gemm_errors_name_the_argument():
    """Bad tensors get an error naming the argument and its shape. Run in a child process:
    a crash while the message is built (seen once with streamed sizes) fails this test
    instead of ending the session."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ERRORS], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


def _mlp_inputs(dtype, seed=0, tokens=(4, 512), hidden=256, ffn=1024):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = _randn(g, *tokens, hidden, dtype=dtype)
    w1 = _randn(g, ffn, hidden, dtype=dtype, scale=hidden ** -0.5)
    b1 = _randn(g, ffn, dtype=dtype, scale=0.5)
    w2 = _randn(g, hidden, ffn, dtype=dtype, scale=ffn ** -0.5)
    dout = _randn(g, *tokens, hidden, dtype=dtype)
    return x, w1, b1, w2, dout


def _grads(fn, x, w1, b1, w2, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, b1, w2)]
    y = fn(*leaves)
    y.backward(dout)
    return [y.detach()] + [t.grad for t in leaves]


def _unfused(x, w1, b1, w2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2)


def _assert_close_rel(got, want, name):
    scale = want.float().abs().max().clamp_min(1e-3)
    torch.testing.assert_close(got.float() / scale, want.float() / scale, rtol=0, atol=3e-2,
                               msg=name)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("compiled", [False, True])
def test_gelu_mlp_equals_unfused(keep, compiled):
    """Output and every gradient of the fused MLP (cuBLASLt) within bf16 roundings of the
    unfused MLP's (cuBLAS GEMMs and an elementwise GELU)."""
    inputs = _mlp_inputs(torch.bfloat16)

    def fused(*t):
        return gelu_mlp(*t, keep_gelu_output=keep)

    fn = torch.compile(fused, fullgraph=True) if compiled else fused
    got = _grads(fn, *inputs)
    want = _grads(_unfused, *inputs)
    for name, a, b in zip(("out", "x", "w1", "b1", "w2"), got, want):
        assert a.dtype == torch.bfloat16, name
        _assert_close_rel(a, b, name)


def test_gelu_mlp_gradient_accumulation_fusion():
    """Two backward passes with main_grad on both weights: the fp32 sums equal the sums
    of the unfused MLP's weight gradients (within bf16 roundings of each)."""
    x, w1, b1, w2, dout = _mlp_inputs(torch.bfloat16)
    w1p, b1p, w2p = (t.detach().clone().requires_grad_() for t in (w1, b1, w2))
    for w in (w1p, w2p):
        w.main_grad = torch.zeros(w.shape, device="cuda", dtype=torch.float32)
        w.main_grad_ready = torch.zeros((), device="cuda", requires_grad=True)
    want = [torch.zeros(w.shape, device="cuda") for w in (w1, w2)]
    for k in range(2):
        xs = x * (k + 1)
        gelu_mlp(xs, w1p, b1p, w2p, gradient_accumulation_fusion=True).backward(dout)
        ref = _grads(_unfused, xs, w1, b1, w2, dout)
        want[0] += ref[2].float()
        want[1] += ref[4].float()
    assert w1p.grad is None and w2p.grad is None
    _assert_close_rel(w1p.main_grad, want[0], "w1")
    _assert_close_rel(w2p.main_grad, want[1], "w2")




@pytest.mark.parametrize("approximate,fused", [("tanh", "_GeluMLPBackward"),
                                               ("none", "_BiasGeluBackward")])
def test_parallel_mlp_picks_its_fused_path_on_cuda(approximate, fused):
    """With the extension built, ``tp.parallel_mlp`` on bf16 CUDA tensors takes the GEMM
    epilogues (tanh GELU) or the bias-GELU backward (erf) by itself; forced off
    (``tp.fused_paths``), the plain layers, with the same output and gradients."""
    from mpzero import tensor_parallel as tp

    torch.manual_seed(0)
    fc = tp.ColumnParallelLinear(256, 1024, params_dtype=torch.bfloat16, device="cuda")
    proj = tp.RowParallelLinear(1024, 256, input_is_parallel=True, params_dtype=torch.bfloat16,
                                device="cuda")
    with torch.no_grad():
        fc.bias.normal_()
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(4, 64, 256, device="cuda")
    out = {}
    for mode in ("auto", "off"):
        with tp.fused_paths(mode, ["bias_gelu", "gelu_gemm"]):
            y, _ = tp.parallel_mlp(x, fc, proj, approximate=approximate)
        assert (fused in autograd_node_names(y)) == (mode == "auto"), mode
        (y.float() * g).sum().backward()
        out[mode] = [y.detach()] + [p.grad.clone() for p in (x, fc.weight, fc.bias,
                                                             proj.weight)]
        for p in (x, fc.weight, fc.bias, proj.weight):
            p.grad = None
    for a, b in zip(out["auto"], out["off"]):  # a few bf16 roundings apart, as a whole
        assert (a.float() - b.float()).norm() <= 2e-2 * b.float().norm()
