"""A linear projection split into attention heads, whose backward is one pass.

A fused QKV projection writes ``y = x W^T + b`` as ``[B, T, H, n, D]`` (for each head
its ``n`` parts, Megatron's head-major order: TP ranks hold whole heads) and attention
takes ``n`` views of it, ``y[:, :, :, j]`` as ``[B, H, T, D]``. Autograd's backward
of those views stacks the ``n`` gradients into a new tensor, copies it into ``y``'s
row layout, and the linear layer's bias gradient then reads all of it again (its
column sums): three passes over a ``[tokens, n * hidden]`` tensor. Here the backward
is the custom op ``mpzero::heads_grad`` (:func:`mpzero.kernels.heads_grad`: on CUDA
one kernel that reads each gradient once and writes ``dy`` and the bias gradient),
followed by the two GEMMs of the linear layer; with gradient accumulation fusion the
weight gradient is added into ``weight.main_grad``
(:mod:`mpzero.tensor_parallel.grad_accumulation`).

The forward is ``F.linear`` and views: the same function, the same values and the same
gradients (up to the summation order of the bias gradient) as the unfused layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpzero import kernels
from mpzero.tensor_parallel import fusion
from mpzero.tensor_parallel.grad_accumulation import (
    can_fuse,
    linear_with_grad_accumulation,
    wgrad_accumulate,
)

__all__ = ["linear_heads", "split_heads"]


@torch.library.custom_op("mpzero::heads_grad", mutates_args=())
def _heads_grad(grads: list[torch.Tensor], with_bias: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dy, dbias = kernels.heads_grad(grads, with_bias)
    return dy, (dbias if dbias is not None else dy.new_empty(0))


@_heads_grad.register_fake
def _(grads, with_bias):
    B, H, T, D = grads[0].shape
    dy = grads[0].new_empty((B * T, H * len(grads) * D))
    return dy, dy.new_empty(dy.shape[1] if with_bias else 0)


def split_heads(y: torch.Tensor, num_splits: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """``y [B, T, H*n*D]`` as ``n`` views ``[B, H, T, D]`` (part ``j`` of every head)."""
    B, T = y.shape[:2]
    return y.view(B, T, -1, num_splits, head_dim).permute(3, 0, 2, 1, 4).unbind(0)


class _LinearHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, main_grad, ready, num_splits, head_dim):
        ctx.save_for_backward(x, weight)
        # Not saved through save_for_backward: main_grad is a view of the optimizer's
        # buffer, whose version counter every other parameter's accumulation bumps.
        ctx.main_grad = main_grad
        ctx.has_bias = bias is not None
        return split_heads(F.linear(x, weight, bias), num_splits, head_dim)

    @staticmethod
    def backward(ctx, *grads):
        x, weight = ctx.saved_tensors
        with_bias = ctx.has_bias and ctx.needs_input_grad[2]
        dy, dbias = _heads_grad(list(grads), with_bias)
        dbias = dbias if with_bias else None
        dx = dy.matmul(weight).view(x.shape) if ctx.needs_input_grad[0] else None
        if ctx.main_grad is not None:
            wgrad_accumulate(ctx.main_grad, dy, x)
            return dx, None, dbias, None, dy.new_zeros(()), None, None
        dw = dy.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        return dx, dw, dbias, None, None, None, None


def _fusable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The fused backward applies: a 3-D input of the weight's (and bias') dtype, no
    autocast (whose casts this function would not see), gradients needed; on every
    device (:mod:`~mpzero.tensor_parallel.fusion`)."""
    return fusion.applies("heads_grad", pays=True, allowed=(
        x.dim() == 3 and x.dtype == weight.dtype
        and (bias is None or bias.dtype == weight.dtype)
        and not torch.is_autocast_enabled(x.device.type)
        and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear_heads(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 num_splits: int, head_dim: int,
                 gradient_accumulation_fusion: bool = False) -> tuple[torch.Tensor, ...]:
    """``split_heads(F.linear(x, weight, bias), num_splits, head_dim)``: ``x [B, T, in]``,
    ``weight [H*n*D, in]``; ``n = num_splits`` views ``[B, H, T, D]`` of the output
    (e.g. Q, K, V). Where the input, weight and bias share a dtype and autocast is off,
    the backward makes the output's and the bias' gradients in one pass (see the module
    docstring); ``gradient_accumulation_fusion``: the weight gradient is added into
    ``weight.main_grad`` where the optimizer provides one."""
    if weight.shape[0] % (num_splits * head_dim):
        raise ValueError(f"linear_heads: the weight's {weight.shape[0]} output features are "
                         f"not whole heads of {num_splits} x {head_dim}")
    if not _fusable(x, weight, bias):
        linear = linear_with_grad_accumulation if gradient_accumulation_fusion else F.linear
        return split_heads(linear(x, weight, bias), num_splits, head_dim)
    fuse_wgrad = gradient_accumulation_fusion and can_fuse(weight)
    main_grad = weight.main_grad if fuse_wgrad else None
    ready = weight.main_grad_ready if fuse_wgrad else None
    return _LinearHeads.apply(x, weight, bias, main_grad, ready, num_splits, head_dim)
