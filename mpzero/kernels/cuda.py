"""Thin wrappers around ``mpzero._C`` (``csrc/``). Importing this module fails with
ImportError when the extension is not built; :mod:`mpzero.kernels` then uses the
reference implementations. The launch configuration of the multi-tensor kernels is
compiled into the extension (``csrc/multi_tensor_apply_config.h``, docs/kernels.md)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpzero import _C

__all__ = [
    "AdamPlan",
    "adam",
    "adam_remainders",
    "l2norm",
    "multi_copy",
    "multi_add",
    "cross_entropy_stats",
    "cross_entropy_backward",
    "bias_gelu_backward",
    "heads_grad",
    "layer_norm_forward",
    "layer_norm_backward",
    "gemm_bias_gelu",
    "gemm_dgelu",
]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _floats(lst: Sequence[torch.Tensor] | None) -> bool:
    return lst is None or all(t.dtype in _FLOATS for t in lst)


def adam_supported(params, grads, exp_avgs, exp_avg_sqs, params_out) -> bool:
    return (
        _floats(params)
        and _floats(grads)
        and _floats(params_out)
        and all(m.dtype == p.dtype for p, m in zip(params, exp_avgs))
        and all(v.dtype == p.dtype for p, v in zip(params, exp_avg_sqs))
    )


def adam_remainders_supported(params, rems, grads, exp_avgs, exp_avg_sqs, params_out) -> bool:
    return (
        all(p.dtype == torch.bfloat16 for p in params)
        and all(r.dtype == torch.int16 for r in rems)
        and _floats(grads)
        and _floats(params_out)
        and all(t.dtype == torch.float32 for t in exp_avgs)
        and all(t.dtype == torch.float32 for t in exp_avg_sqs)
    )


def l2norm_supported(tensors) -> bool:
    return _floats(tensors)


def multi_copy_supported(srcs, dsts) -> bool:
    return all(
        s.dtype == d.dtype or (s.dtype in _FLOATS and d.dtype in _FLOATS)
        for s, d in zip(srcs, dsts)
    )


def multi_add_supported(srcs, dsts) -> bool:
    """Pairs of one dtype combination: fp32/fp16/bf16 into fp32, or bf16/fp16 into itself."""
    if not srcs:
        return False
    st, dt = srcs[0].dtype, dsts[0].dtype
    ok = (dt == torch.float32 and st in _FLOATS) or (st == dt and st in _FLOATS)
    return ok and all(s.dtype == st and d.dtype == dt for s, d in zip(srcs, dsts))


def _dev_scalar(x, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    """A 0-dim tensor of ``dtype`` on ``device``; no copy when it already is one."""
    if x.device != device or x.dtype != dtype or x.dim() != 0:
        x = x.to(device=device, dtype=dtype).reshape(())
    return x


def _hyper(device, *, lr, beta1, beta2, eps, weight_decay, step, adam_w_mode=True,
           bias_correction=True, grad_scale=None, found_inf=None) -> tuple:
    """The hyper-parameter arguments of ``_C.adam`` / ``_C.adam_remainders`` /
    ``AdamPlan.run`` in their order: ``lr`` and ``step`` each as a host value or a
    device tensor (the other one unused), scale and found-inf as device tensors."""
    if isinstance(lr, torch.Tensor):
        lr_f, lr_t = 0.0, _dev_scalar(lr, device)
    else:
        lr_f, lr_t = float(lr), None
    if isinstance(step, torch.Tensor):
        step_i, step_t = 0, _dev_scalar(step, device, step.dtype)
    else:
        step_i, step_t = int(step), None
    gs = None if grad_scale is None else _dev_scalar(grad_scale, device)
    fi = None if found_inf is None else _dev_scalar(found_inf, device)
    return (lr_f, lr_t, float(beta1), float(beta2), float(eps), float(weight_decay), step_i,
            step_t, bool(adam_w_mode), bool(bias_correction), gs, fi)


def adam(params, grads, exp_avgs, exp_avg_sqs, params_out=None, **hyper) -> None:
    """``_C.adam``; ``hyper`` as in :func:`mpzero.kernels.adam`."""
    _C.adam(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
            list(params_out) if params_out is not None else [],
            *_hyper(params[0].device, **hyper))


def adam_remainders(params_bf16, remainders, grads, exp_avgs, exp_avg_sqs, params_out=None,
                    **hyper) -> None:
    """``_C.adam_remainders``; ``hyper`` as in :func:`mpzero.kernels.adam_remainders`."""
    _C.adam_remainders(list(params_bf16), list(remainders), list(grads), list(exp_avgs),
                       list(exp_avg_sqs), list(params_out) if params_out is not None else [],
                       *_hyper(params_bf16[0].device, **hyper))


class AdamPlan:
    """:func:`adam` / :func:`adam_remainders` planned once (``_C.AdamPlan``): the fixed
    tensors of the argument lists are given here, with ``None`` where a per-step tensor
    goes; ``slots`` are ``(list position, entry, per-step base, element offset)``. A call
    takes the per-step bases and the hyper-parameters and launches with no per-entry
    work on the host."""

    def __init__(self, remainders: bool, lists, slots, dynamic_like) -> None:
        lists = [list(lst) if lst is not None else [] for lst in lists]
        flat = [int(x) for slot in slots for x in slot]
        self._plan = _C.AdamPlan(bool(remainders), lists, flat, list(dynamic_like))
        self._device = next(t.device for lst in lists for t in lst if t is not None)

    @property
    def entries(self) -> int:
        return self._plan.entries

    def __call__(self, dynamic, **hyper) -> None:
        """Launch with the per-step bases ``dynamic``; ``hyper`` as in :func:`adam`."""
        self._plan.run(dynamic, *_hyper(self._device, **hyper))


def l2norm(tensors, *, noop_flag=None) -> torch.Tensor:
    return _C.l2norm(list(tensors), noop_flag)


def multi_copy(srcs, dsts, *, noop_flag=None) -> None:
    _C.multi_copy(list(srcs), list(dsts), noop_flag)


def multi_add(srcs, dsts, *, noop_flag=None) -> None:
    _C.multi_add(list(srcs), list(dsts), noop_flag)


def cross_entropy_stats(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    stats = torch.empty(logits.shape[0], 4, dtype=torch.float32, device=logits.device)
    _C.cross_entropy_stats(logits, target, stats)
    return stats


def cross_entropy_backward(logits, target, lse, grad_loss, on_target: float,
                           off_target: float, out: torch.Tensor) -> None:
    _C.cross_entropy_backward(logits, target, lse, grad_loss, float(on_target),
                              float(off_target), out)


def bias_gelu_backward(x: torch.Tensor, bias: torch.Tensor, dy: torch.Tensor,
                       tanh_approx: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dbias = torch.empty_like(x), torch.empty_like(bias)
    _C.bias_gelu_backward(x, bias, dy, dx, dbias, bool(tanh_approx))
    return dx, dbias


def heads_grad(grads: Sequence[torch.Tensor],
               with_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    B, H, T, D = grads[0].shape
    dy = torch.empty((B * T, H * len(grads) * D), dtype=grads[0].dtype, device=grads[0].device)
    dbias = dy.new_empty(dy.shape[1]) if with_bias else None
    _C.heads_grad(list(grads), dy, dbias)
    return dy, dbias


def layer_norm_forward(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor,
                       bias: torch.Tensor | None, eps: float, rms: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    out = torch.empty_like(x)
    s = torch.empty_like(x) if y is not None else x
    rstd = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    mean = None if rms else torch.empty_like(rstd)
    _C.layer_norm_forward(x, y, weight, bias, s if y is not None else None, out, mean, rstd,
                          eps)
    return out, s, mean, rstd


def layer_norm_backward(g_out: torch.Tensor, g_s: torch.Tensor | None, s: torch.Tensor,
                        mean: torch.Tensor | None, rstd: torch.Tensor, weight: torch.Tensor,
                        with_bias: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    ds = torch.empty_like(s)
    dw = torch.empty_like(weight)
    db = torch.empty_like(weight) if with_bias else None
    _C.layer_norm_backward(g_out, g_s, s, mean, rstd, weight, ds, dw, db)
    return ds, dw, db


def gemm_bias_gelu(x, weight, bias):
    return _C.gemm_bias_gelu(x, weight, bias)


def gemm_dgelu(grad_out, weight, z):
    return _C.gemm_dgelu(grad_out, weight, z)
