"""The ops that choose their fused path (mpzero.tensor_parallel.fusion): which path runs
by default on the CPU, that ``fused_paths`` forces either, and that both compute the same
function (the fused kernels themselves: test_layer_norm.py, test_heads.py,
test_bias_gelu.py, test_gelu_mlp.py; on CUDA: tests/gpu/)."""

import pytest
import torch
import torch.nn.functional as F

from mpzero import tensor_parallel as tp
from mpzero.tensor_parallel import fusion
from mpzero.testing import autograd_node_names

pytestmark = pytest.mark.timeout(120)




def _norm_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g, dtype=dtype, requires_grad=True)
    y = torch.randn(3, 5, 16, generator=g, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(16, generator=g)).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(16, generator=g)).to(dtype).requires_grad_()
    return x, y, w, b


@pytest.mark.parametrize("rms", [False, True])
def test_norm_paths(rms):
    """Default (CPU, one dtype): the fused op; ``off``: exactly PyTorch's norm; both the
    same function; under autocast always PyTorch's."""
    x, y, w, b = _norm_inputs()
    b = None if rms else b
    plain = F.rms_norm(x, (16,), w, 1e-5) if rms else F.layer_norm(x, (16,), w, b, 1e-5)
    fused = tp.norm(x, w, b, 1e-5, rms)
    assert "mpzero_layer_norm_forward" in autograd_node_names(fused)
    with tp.fused_paths("off", ["layer_norm"]):
        off = tp.norm(x, w, b, 1e-5, rms)
    assert "mpzero_layer_norm_forward" not in autograd_node_names(off)
    assert torch.equal(off, plain)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "mpzero_layer_norm_forward" not in autograd_node_names(tp.norm(x, w, b, 1e-5, rms))


def test_add_norm_paths_agree_forward_and_backward():
    x, y, w, b = _norm_inputs()
    out = {}
    for mode in ("on", "off"):
        with tp.fused_paths(mode, ["layer_norm"]):
            s, h = tp.add_norm(x, y, w, b)
        (s.square().sum() + h.pow(3).sum()).backward()
        out[mode] = [s, h] + [t.grad.clone() for t in (x, y, w, b)]
        for t in (x, y, w, b):
            t.grad = None
    assert torch.equal(out["on"][0], x.detach() + y.detach())  # the add, as eager rounds it
    for a, ref in zip(out["on"], out["off"]):
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-5)


def test_mixed_dtypes_never_fuse():
    """The dtype conditions hold in every mode: they make the fused path the same function."""
    x, _, w, b = _norm_inputs()
    with tp.fused_paths("on"):
        out = tp.norm(x.bfloat16(), w, b)
    assert "mpzero_layer_norm_forward" not in autograd_node_names(out)  # PyTorch's mixed-dtype norm


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_parallel_mlp_paths(approximate):
    """CPU default: the plain MLP (bias-GELU and the GEMM epilogues pay only on CUDA with
    the extension); forced on: bias-GELU for the erf GELU, the epilogue GEMMs for tanh; all
    the same function, forward and backward."""
    torch.manual_seed(0)
    fc = tp.ColumnParallelLinear(16, 64)
    proj = tp.RowParallelLinear(64, 16, input_is_parallel=True)
    with torch.no_grad():
        fc.bias.normal_()
    x = torch.randn(2, 3, 16, requires_grad=True)
    want_fused = "_GeluMLPBackward" if approximate == "tanh" else "_BiasGeluBackward"
    results = {}
    for mode in ("auto", "on", "off"):
        with tp.fused_paths(mode, ["bias_gelu", "gelu_gemm"]):
            out, bias = tp.parallel_mlp(x, fc, proj, approximate=approximate)
        graph = autograd_node_names(out)
        assert (want_fused in graph) == (mode == "on"), (mode, graph)
        out.square().sum().backward()
        results[mode] = [out.detach()] + [p.grad.clone() for p in (x, fc.weight, fc.bias,
                                                                   proj.weight)]
        for p in (x, fc.weight, fc.bias, proj.weight):
            p.grad = None
    ref = proj(F.gelu(fc(x)[0], approximate=approximate))[0]
    assert torch.equal(results["off"][0], ref.detach())
    assert torch.equal(results["auto"][0], ref.detach())
    for a, b in zip(results["on"], results["off"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_parallel_mlp_needs_a_known_gelu():
    fc, proj = tp.ColumnParallelLinear(4, 8), tp.RowParallelLinear(8, 4, input_is_parallel=True)
    with pytest.raises(ValueError, match="approximate"):
        tp.parallel_mlp(torch.randn(1, 4), fc, proj, approximate="sigmoid")


def test_modes_are_checked_and_restored():
    with pytest.raises(ValueError, match="no fused path named"):
        tp.set_fused_paths("on", ["layernorm"])
    with pytest.raises(ValueError, match="mode"):
        tp.set_fused_paths("sometimes")
    with tp.fused_paths("off"):
        with tp.fused_paths("on", ["heads_grad"]):
            assert fusion.applies("heads_grad", allowed=True, pays=False)
            assert not fusion.applies("layer_norm", allowed=True, pays=True)
        assert not fusion.applies("heads_grad", allowed=True, pays=True)
    assert fusion.applies("heads_grad", allowed=True, pays=True)
    assert not fusion.applies("gelu_gemm", allowed=True, pays=False)  # auto: if it pays
    assert not fusion.applies("gelu_gemm", allowed=False, pays=True)
