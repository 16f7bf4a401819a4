"""A GELU MLP whose GELU runs in the GEMMs' epilogues.

``out = gelu(x W1^T + b1) W2^T`` (GELU's tanh approximation) as two fused GEMMs each
way instead of GEMMs with elementwise passes between them:

- forward: one GEMM writes ``z = x W1^T + b1`` and ``y = gelu(z)`` from its fp32
  accumulators (cuBLASLt's ``GELU_AUX_BIAS`` epilogue), then ``out = y W2^T``. No
  separate pass reads ``z`` to make ``y``.
- backward: the GEMM that makes the gradient of ``y`` (``dout W2``) multiplies it by
  ``gelu'(z)`` in its epilogue (``DGELU``), so ``dy`` never goes through memory; ``b1``'s
  gradient is the column sum of that ``dz`` (one reduction: cuBLASLt's ``DGELU_BGRAD``,
  which would do it in the epilogue, took 2.5x the GEMM's time on an H100). The weight
  gradients are the usual GEMMs (added into ``weight.main_grad`` with gradient
  accumulation fusion, :mod:`mpzero.tensor_parallel.grad_accumulation`).

The backward needs ``z`` (for ``gelu'``) and ``y`` (for ``W2``'s gradient). With
``keep_gelu_output=True`` both are saved (one more ``[tokens, ffn]`` activation per
layer than an unfused MLP); with ``False`` only ``z`` is, and the backward makes ``y``
again with one elementwise pass.

The GEMMs are the custom ops ``mpzero::gemm_bias_gelu`` and ``mpzero::gemm_dgelu``
(opaque to ``torch.compile``): on CUDA with fp16/bf16 tensors the cuBLASLt kernels of
``mpzero._C``, elsewhere the PyTorch reference of :mod:`mpzero.kernels` (the same math,
so the layer runs and is tested on the CPU). Megatron's MLP fuses the bias-add and GELU
as an elementwise kernel between the GEMMs; Transformer Engine uses these epilogues.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpzero import kernels
from mpzero.tensor_parallel import fusion
from mpzero.tensor_parallel.bias_gelu import bias_gelu
from mpzero.tensor_parallel.grad_accumulation import can_fuse, wgrad_accumulate

__all__ = ["gelu_mlp", "parallel_gelu_mlp", "parallel_mlp"]


@torch.library.custom_op("mpzero::gemm_bias_gelu", mutates_args=())
def _gemm_bias_gelu(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    y, z = kernels.gemm_bias_gelu(x, weight, bias)
    return y, z


@_gemm_bias_gelu.register_fake
def _(x, weight, bias):
    shape = (x.shape[0], weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


@torch.library.custom_op("mpzero::gemm_dgelu", mutates_args=())
def _gemm_dgelu(grad_out: torch.Tensor, weight: torch.Tensor,
                z: torch.Tensor) -> torch.Tensor:
    return kernels.gemm_dgelu(grad_out, weight, z)


@_gemm_dgelu.register_fake
def _(grad_out, weight, z):
    return torch.empty_like(z)


def _weight_grad(grad_out: torch.Tensor, input: torch.Tensor,
                 main_grad: torch.Tensor | None) -> torch.Tensor | None:
    """``grad_out^T input``, or added into ``main_grad`` (then None)."""
    if main_grad is not None:
        wgrad_accumulate(main_grad, grad_out, input)
        return None
    return grad_out.t().mm(input)


class _GeluMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fc_weight, fc_bias, proj_weight, fc_main_grad, fc_ready,
                proj_main_grad, proj_ready, keep_gelu_output):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        y, z = _gemm_bias_gelu(x2, fc_weight, fc_bias)
        out = y.mm(proj_weight.t())
        ctx.save_for_backward(x2, fc_weight, proj_weight, z, y if keep_gelu_output else None)
        # Not saved through save_for_backward: views of the optimizer's buffer, whose
        # version counter every other parameter's accumulation bumps.
        ctx.main_grads = (fc_main_grad, proj_main_grad)
        ctx.has_bias = fc_bias is not None
        ctx.in_shape = shape
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        x2, fc_weight, proj_weight, z, y = ctx.saved_tensors
        fc_main_grad, proj_main_grad = ctx.main_grads
        needs = ctx.needs_input_grad
        d2 = dout.reshape(-1, dout.shape[-1]).contiguous()
        if y is None:
            y = F.gelu(z, approximate="tanh")
        dz = _gemm_dgelu(d2, proj_weight, z)
        grad_proj = _weight_grad(d2, y, proj_main_grad) if needs[3] or needs[7] else None
        grad_fc = _weight_grad(dz, x2, fc_main_grad) if needs[1] or needs[5] else None
        grad_x = dz.mm(fc_weight).view(ctx.in_shape) if needs[0] else None
        grad_bias = dz.sum(0) if ctx.has_bias and needs[2] else None
        ready = dout.new_zeros(())
        return (grad_x, grad_fc, grad_bias, grad_proj, None,
                ready if fc_main_grad is not None else None, None,
                ready if proj_main_grad is not None else None, None)


def _fusion_args(weight: torch.Tensor, fuse: bool) -> tuple:
    if fuse and can_fuse(weight):
        return weight.main_grad, weight.main_grad_ready
    return None, None


def gelu_mlp(x: torch.Tensor, fc_weight: torch.Tensor, fc_bias: torch.Tensor | None,
             proj_weight: torch.Tensor, *, gradient_accumulation_fusion: bool = False,
             keep_gelu_output: bool = True) -> torch.Tensor:
    """``F.linear(F.gelu(F.linear(x, fc_weight, fc_bias), approximate="tanh"), proj_weight)``
    with the bias and GELU (and their gradients) in the GEMMs' epilogues.

    ``x [..., K]``, ``fc_weight [F, K]``, ``fc_bias [F]`` or None, ``proj_weight [H, F]``,
    all of one dtype. ``gradient_accumulation_fusion``: each weight's gradient is added
    into its ``main_grad`` where the optimizer provides one
    (:func:`~mpzero.tensor_parallel.grad_accumulation.can_fuse`). ``keep_gelu_output``:
    save ``gelu(z)`` for the backward (faster) or make it again there (one
    ``[tokens, F]`` activation less).
    """
    others = [("fc_weight", fc_weight), ("proj_weight", proj_weight)]
    if fc_bias is not None:
        others.append(("fc_bias", fc_bias))
    for name, t in others:
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"gelu_mlp: {name} is {t.dtype} on {t.device}, x is {x.dtype} on "
                             f"{x.device}; all tensors must share x's dtype and device")
    ffn, hidden = fc_weight.shape if fc_weight.dim() == 2 else (-1, -1)
    if (x.shape[-1] != hidden or proj_weight.dim() != 2 or proj_weight.shape[1] != ffn
            or (fc_bias is not None and fc_bias.shape != (ffn,))):
        raise ValueError(f"gelu_mlp: shapes do not chain: x {tuple(x.shape)}, fc_weight "
                         f"{tuple(fc_weight.shape)}, fc_bias "
                         f"{None if fc_bias is None else tuple(fc_bias.shape)}, proj_weight "
                         f"{tuple(proj_weight.shape)}")
    fuse = gradient_accumulation_fusion
    return _GeluMLP.apply(x, fc_weight, fc_bias, proj_weight,
                          *_fusion_args(fc_weight, fuse), *_fusion_args(proj_weight, fuse),
                          keep_gelu_output)


def parallel_gelu_mlp(x: torch.Tensor, fc, proj, *, keep_gelu_output: bool = True):
    """``proj(gelu(fc(x)))`` for a :class:`~mpzero.tensor_parallel.ColumnParallelLinear`
    ``fc`` (``gather_output=False``) and a :class:`~mpzero.tensor_parallel.RowParallelLinear`
    ``proj`` (``input_is_parallel=True``), through :func:`gelu_mlp`: ``fc``'s input region
    (copy, or the sequence-parallel all-gather), the fused GEMMs on this rank's features,
    then ``proj``'s reduction and bias. Returns ``proj``'s ``(output, bias)``; ``fc``'s
    bias is always applied (inside the epilogue) whatever its ``skip_bias_add``."""
    if fc.gather_output or not proj.input_is_parallel:
        raise ValueError("parallel_gelu_mlp: needs fc.gather_output=False and "
                         "proj.input_is_parallel=True")
    x = fc.parallel_input(x)
    partial = gelu_mlp(
        x, fc.weight, fc.bias, proj.weight, keep_gelu_output=keep_gelu_output,
        gradient_accumulation_fusion=fc.gradient_accumulation_fusion
        and proj.gradient_accumulation_fusion)
    return proj.reduce_output(partial)


def parallel_mlp(x: torch.Tensor, fc, proj, *, approximate: str = "none",
                 keep_gelu_output: bool = True):
    """``proj(gelu(fc(x), approximate))`` for a ColumnParallelLinear ``fc`` and a
    RowParallelLinear ``proj`` (``input_is_parallel=True``), by the fastest path that
    computes that function here (:mod:`~mpzero.tensor_parallel.fusion`):

    1. ``gelu_gemm``: the bias and GELU in the GEMMs' epilogues (:func:`parallel_gelu_mlp`)
       for the tanh GELU on fp16/bf16 CUDA tensors with the extension built;
    2. ``bias_gelu``: ``fc``'s GEMM without its bias, then :func:`bias_gelu` (the bias
       gradient in the GELU's backward pass) on CUDA with the extension built;
    3. else ``fc``, ``F.gelu``, ``proj``.

    The fused paths need ``x``, the weights and ``fc``'s bias in one dtype, no autocast,
    and ``fc`` neither gathering its output nor skipping its bias add.
    ``keep_gelu_output``: with path 1, save ``gelu(z)`` for the backward (faster) or
    make it again there (one ``[tokens, ffn]`` activation less). Returns ``proj``'s
    ``(output, bias)``."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"parallel_mlp: approximate must be 'none' or 'tanh', got "
                         f"{approximate!r}")
    same = (x.dtype == fc.weight.dtype == proj.weight.dtype
            and (fc.bias is None or fc.bias.dtype == x.dtype)
            and not torch.is_autocast_enabled(x.device.type)
            and not fc.gather_output and not fc.skip_bias_add and proj.input_is_parallel)
    built = x.is_cuda and kernels.extension_available()
    if fusion.applies("gelu_gemm", allowed=same and approximate == "tanh",
                      pays=built and x.dtype in (torch.float16, torch.bfloat16)
                      and kernels.gemm_gelu_available()):
        return parallel_gelu_mlp(x, fc, proj, keep_gelu_output=keep_gelu_output)
    if fc.bias is not None and fusion.applies("bias_gelu", allowed=same, pays=built):
        y = bias_gelu(fc._linear(fc.parallel_input(x), None), fc.bias, approximate)
    else:
        y, bias = fc(x)  # (..., ffn/tp); bias: only with skip_bias_add
        y = F.gelu(y if bias is None else y + bias, approximate=approximate)
    return proj(y)
