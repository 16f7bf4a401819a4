"""Bias-GELU fusion: ``gelu(x + bias)`` whose backward also makes the bias gradient.

A linear layer's bias gradient is the column sum of its output gradient; after a GELU
that gradient is ``gelu'(x + bias) * dy``, made by one elementwise pass, and the sum is a
second pass over the same ``[tokens, features]`` tensor. Here the backward is one
kernel (``mpzero.kernels.bias_gelu_backward``: CUDA where built, else PyTorch) that
writes ``dx`` and sums its columns while it holds them. The forward is plain PyTorch
(``torch.compile`` fuses the add into the GELU), so the layer before it runs without its
bias (``skip_bias_add=True``: the GEMM writes ``x``, not ``x + bias``).

The backward is the custom op ``mpzero::bias_gelu_backward``: one opaque call under
``torch.compile``. Megatron's ``--bias-gelu-fusion`` fuses the same add and GELU (its
bias gradient is still a separate sum).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpzero import kernels

__all__ = ["bias_gelu"]


@torch.library.custom_op("mpzero::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward(x: torch.Tensor, bias: torch.Tensor, dy: torch.Tensor,
                        approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dbias = kernels.bias_gelu_backward(x, bias, dy, approximate)
    return dx, dbias


@_bias_gelu_backward.register_fake
def _(x, bias, dy, approximate):
    return torch.empty_like(x), torch.empty_like(bias)


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate):
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        return F.gelu(x + bias, approximate=approximate)

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        shape = x.shape
        dx, dbias = _bias_gelu_backward(x.reshape(-1, shape[-1]), bias,
                                        dy.reshape(-1, shape[-1]).contiguous(),
                                        ctx.approximate)
        return dx.view(shape), dbias, None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x + bias, approximate=approximate)`` (``bias`` over the last dimension),
    with the bias gradient made in the same pass as ``x``'s. ``x``, ``bias`` of one
    dtype; ``approximate``: ``"none"`` (erf) or ``"tanh"``."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"bias_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1] or bias.dtype != x.dtype:
        raise ValueError(f"bias_gelu: bias must be a 1-D tensor of x's last size "
                         f"({x.shape[-1]}) and dtype {x.dtype}; got {tuple(bias.shape)} "
                         f"{bias.dtype}")
    return _BiasGelu.apply(x.contiguous(), bias, approximate)
