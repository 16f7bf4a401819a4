"""Gradient accumulation fusion: the weight-gradient GEMM adds into ``main_grad``.

Without it a linear layer's backward writes its weight gradient ``dY^T X`` as a new
tensor in the parameter's dtype (e.g. bf16), and the optimizer then adds that tensor
into its fp32 accumulation buffer: one more pass over every weight per micro-batch
(read the bf16 gradient, read and write the fp32 sum). With fusion the GEMM itself
accumulates into the fp32 buffer (``C += dY^T X`` with fp32 ``C``, the sum kept in
fp32: the same arithmetic as Megatron's ``gradient_accumulation_fusion``), and no
weight gradient tensor exists at all.

The protocol between a layer and an optimizer, through two attributes of the weight:

- ``weight.main_grad``: a tensor of the weight's shape the layer adds ``dY^T X``
  into (its dtype is the accumulation dtype, e.g. fp32). The optimizer zeroes it
  when the gradients are dropped; adding into it is always right.
- ``weight.main_grad_ready``: a 0-dim leaf tensor that requires grad. Where the
  layer added into ``main_grad`` it gives this tensor a (zero) gradient instead of
  giving the weight one, so a post-accumulate-grad hook on it tells the optimizer
  that the weight's gradient of this backward is in (to launch its reduction).

:class:`mpzero.optimizers.DistributedFusedAdam` with ``contiguous_grad_buffer=True``
sets both on every parameter when it makes its layout (``main_grad`` is
:meth:`grad_buffer_view`). A layer built with ``gradient_accumulation_fusion=True``
uses them when the weight has both, requires grad, and autocast is off; otherwise it
runs the plain ``F.linear`` and the gradient goes to ``weight.grad`` as usual (the
optimizer adds it into the same buffer, so the two paths mix freely, e.g. a weight
shared with an embedding).

The GEMM is the custom op ``mpzero::wgrad_accumulate`` (it mutates ``main_grad``),
so ``torch.compile`` keeps it as one call that writes the buffer in place. On CUDA
it is one cuBLAS GEMM with fp32 output and ``beta=1``
(``torch.addmm(..., out_dtype=torch.float32)``); elsewhere a matmul in the buffer's
dtype and an add.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear_with_grad_accumulation", "wgrad_accumulate", "can_fuse", "OPTIMIZER_ATTRS"]

OPTIMIZER_ATTRS = ("main_grad", "main_grad_ready")  # set on parameters by the optimizer


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


_CUDA_OUT_DTYPE: dict[str, bool] = {}  # does torch.addmm(out_dtype=..., out=self) work here


def _cuda_addmm_out_dtype(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> bool:
    """``main_grad += dy^T x`` as one GEMM with ``main_grad``'s dtype as output, where
    this torch has ``addmm(..., out_dtype=)`` on CUDA; False where it has not."""
    if _CUDA_OUT_DTYPE.get("ok", True):
        try:
            torch.addmm(main_grad, dy.t(), x, out_dtype=main_grad.dtype, out=main_grad)
            _CUDA_OUT_DTYPE["ok"] = True
            return True
        except (RuntimeError, TypeError):
            _CUDA_OUT_DTYPE["ok"] = False
    return False


@torch.library.custom_op("mpzero::wgrad_accumulate", mutates_args=("main_grad",))
def wgrad_accumulate(main_grad: torch.Tensor, grad_output: torch.Tensor,
                     input: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ input`` over every leading dimension, with the
    products summed in ``main_grad``'s dtype (e.g. bf16 inputs, fp32 sum)."""
    dy, x = _as_matrix(grad_output), _as_matrix(input)
    if main_grad.dtype == dy.dtype == x.dtype:
        main_grad.addmm_(dy.t(), x)
    elif main_grad.is_cuda and _cuda_addmm_out_dtype(main_grad, dy, x):
        pass
    else:
        main_grad.addmm_(dy.t().to(main_grad.dtype), x.to(main_grad.dtype))


@wgrad_accumulate.register_fake
def _(main_grad, grad_output, input) -> None:
    return None


class _LinearWithGradAccumulation(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose weight gradient is added into ``main_grad``
    (the weight gets none; ``ready`` gets a zero gradient instead)."""

    @staticmethod
    def forward(ctx, x, weight, bias, main_grad, ready):
        ctx.save_for_backward(x, weight)
        # Not saved through save_for_backward: main_grad is a view of the optimizer's
        # buffer, whose version counter every other parameter's accumulation bumps.
        ctx.main_grad = main_grad
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        main_grad = ctx.main_grad
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        wgrad_accumulate(main_grad, grad_out, x)
        grad_bias = _as_matrix(grad_out).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] \
            else None
        return grad_x, None, grad_bias, None, grad_out.new_zeros(())


def can_fuse(weight: torch.Tensor) -> bool:
    """Whether ``weight`` carries the optimizer's side of the protocol (and needs a
    gradient) and autocast is off, so its layer may accumulate into ``main_grad``."""
    return (weight.requires_grad and getattr(weight, "main_grad", None) is not None
            and getattr(weight, "main_grad_ready", None) is not None
            and not torch.is_autocast_enabled(weight.device.type))


def linear_with_grad_accumulation(x: torch.Tensor, weight: torch.Tensor,
                                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, adding the weight gradient into
    ``weight.main_grad`` where :func:`can_fuse` allows (else plain ``F.linear``)."""
    if not can_fuse(weight):
        return F.linear(x, weight, bias)
    return _LinearWithGradAccumulation.apply(x, weight, bias, weight.main_grad,
                                             weight.main_grad_ready)
