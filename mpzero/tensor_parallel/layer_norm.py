"""LayerNorm (or RMSNorm) fused with the residual add before it, forward and backward one
pass each.

A pre-LN transformer block computes ``s = x + branch(x)`` and then ``LayerNorm(s)``; the
backward of that LayerNorm adds the residual stream's gradient to its own and the weight
and bias gradients are column sums over the same rows. Here the forward is one kernel
(``mpzero.kernels.layer_norm_forward``: reads ``x`` and the branch, writes ``s`` and
the normalized rows, keeps fp32 mean and 1/std per row) and so is the backward
(``layer_norm_backward``: reads the output's gradient, ``s`` and the residual gradient,
writes ``ds`` and sums the weight and bias gradients in a fixed order). CUDA where built,
else PyTorch (the same contract: ``mpzero.kernels.reference``).

Both are custom ops (``mpzero::layer_norm_forward`` / ``mpzero::layer_norm_backward``):
one opaque call each under ``torch.compile``. Megatron and Apex ship a fused LayerNorm
kernel; the residual add is a separate kernel there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpzero import kernels
from mpzero.tensor_parallel import fusion

__all__ = ["add_layer_norm", "add_norm", "add_rms_norm", "fused_layer_norm", "fused_rms_norm",
           "norm"]


@torch.library.custom_op("mpzero::layer_norm_forward", mutates_args=())
def _forward(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor,
             bias: torch.Tensor | None, eps: float, rms: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out, s, mean, rstd = kernels.layer_norm_forward(x, y, weight, bias, eps, rms)
    # A custom op may not return its input: without the add, s is a copy the caller drops.
    # RMSNorm has no mean: an empty tensor stands for it.
    return (out, (s if y is not None else s.new_empty(0)),
            (mean if mean is not None else rstd.new_empty(0)), rstd)


@_forward.register_fake
def _(x, y, weight, bias, eps, rms):
    stats = x.new_empty(x.shape[0], dtype=torch.promote_types(x.dtype, torch.float32))
    return (torch.empty_like(x), torch.empty_like(x) if y is not None else x.new_empty(0),
            stats.new_empty(0) if rms else torch.empty_like(stats), stats)


@torch.library.custom_op("mpzero::layer_norm_backward", mutates_args=())
def _backward(g_out: torch.Tensor, g_s: torch.Tensor | None, s: torch.Tensor,
              mean: torch.Tensor | None, rstd: torch.Tensor, weight: torch.Tensor,
              with_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ds, dw, db = kernels.layer_norm_backward(g_out, g_s, s, mean, rstd, weight, with_bias)
    return ds, dw, (db if db is not None else dw.new_empty(0))


@_backward.register_fake
def _(g_out, g_s, s, mean, rstd, weight, with_bias):
    return (torch.empty_like(s), torch.empty_like(weight),
            torch.empty_like(weight) if with_bias else weight.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, y, weight, bias, _eps, rms = inputs
    _out, s, mean, rstd = output
    ctx.save_for_backward(s if y is not None else x, mean, rstd, weight)
    ctx.has_y, ctx.has_bias, ctx.rms = y is not None, bias is not None, rms


def _backward_rule(ctx, g_out, g_s, _g_mean, _g_rstd):
    s, mean, rstd, weight = ctx.saved_tensors
    if g_out is None:
        g_out = torch.zeros_like(s)
    if not ctx.has_y or (g_s is not None and g_s.numel() == 0):
        g_s = None
    ds, dw, db = _backward(g_out.contiguous(), None if g_s is None else g_s.contiguous(), s,
                           None if ctx.rms else mean, rstd, weight, ctx.has_bias)
    return ds, (ds if ctx.has_y else None), dw, (db if ctx.has_bias else None), None, None


_forward.register_autograd(_backward_rule, setup_context=_setup_context)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, who: str) -> None:
    h = x.shape[-1]
    if weight.shape != (h,) or (bias is not None and bias.shape != (h,)):
        raise ValueError(f"{who}: weight and bias must have {h} elements (x's last dim), got "
                         f"{tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}")


def _add_norm(x, y, weight, bias, eps, rms, who):
    if y.shape != x.shape:
        raise ValueError(f"{who}: x and y must have one shape, got {tuple(x.shape)} "
                         f"and {tuple(y.shape)}")
    _check(x, weight, bias, who)
    out, s, _, _ = _forward(_rows(x.contiguous()), _rows(y.contiguous()), weight, bias, eps, rms)
    return s.view(x.shape), out.view(x.shape)


def _norm(x, weight, bias, eps, rms, who):
    _check(x, weight, bias, who)
    out, _, _, _ = _forward(_rows(x.contiguous()), None, weight, bias, eps, rms)
    return out.view(x.shape)


def add_layer_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, eps: float = 1e-5
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, F.layer_norm(s, (h,), weight, bias, eps))`` with ``s = x + y`` (the residual
    add, rounded to the dtype as an eager add writes it), in one pass forward and one
    backward. ``x``, ``y`` of one shape ``[..., h]``, one dtype with ``weight``/``bias``."""
    return _add_norm(x, y, weight, bias, eps, False, "add_layer_norm")


def fused_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm(x, (h,), weight, bias, eps)`` over the last dim ``h``, forward and
    backward one pass each (the backward's weight and bias gradients in the same pass)."""
    return _norm(x, weight, bias, eps, False, "fused_layer_norm")


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, F.rms_norm(s, (h,), weight, eps))`` with ``s = x + y``, as
    :func:`add_layer_norm` (the normalized rows times ``weight`` computed in fp32 and
    rounded once)."""
    return _add_norm(x, y, weight, None, eps, True, "add_rms_norm")


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``F.rms_norm(x, (h,), weight, eps)`` over the last dim ``h``, forward and backward
    one pass each."""
    return _norm(x, weight, None, eps, True, "fused_rms_norm")


def _fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The fused kernels compute the same function: activations, weight and bias of one
    dtype, no autocast (whose casts they would not see)."""
    return fusion.applies(
        "layer_norm", pays=True,
        allowed=(x.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype)
                 and not torch.is_autocast_enabled(x.device.type)))


def _plain(x, weight, bias, eps, rms):
    if rms:
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.layer_norm(x, weight.shape, weight, bias, eps)


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         eps: float = 1e-5, rms: bool = False) -> torch.Tensor:
    """LayerNorm (``rms``: RMSNorm, no bias) of ``x [..., h]`` over its last dim: by
    :func:`fused_layer_norm` / :func:`fused_rms_norm` where they apply
    (:mod:`~mpzero.tensor_parallel.fusion`), else ``F.layer_norm`` / ``F.rms_norm``."""
    if _fused(x, weight, bias):
        return _norm(x, weight, bias, eps, rms, "norm")
    return _plain(x, weight, bias, eps, rms)


def add_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None, eps: float = 1e-5, rms: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, norm(s))`` with ``s = x + y``: the residual add and the norm after it in one
    pass each way (:func:`add_layer_norm` / :func:`add_rms_norm`) where they apply, else
    the add and ``F.layer_norm`` / ``F.rms_norm``."""
    if _fused(x, weight, bias):
        return _add_norm(x, y, weight, bias, eps, rms, "add_norm")
    s = x + y
    return s, _plain(s, weight, bias, eps, rms)
