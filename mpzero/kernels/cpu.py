"""CPU fast path for :func:`mpzero.kernels.adam`: torch's own fused CPU Adam/AdamW.

``torch._fused_adamw_``/``torch._fused_adam_`` compute the same function as the
reference (AdamW decoupled decay or L2 decay, bias correction, ``lr``/``step``
as tensors, a found-inf flag), vectorized and multi-threaded, with a different
rounding order. Used for lists of contiguous fp32 CPU tensors with bias
correction; everything else goes to the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def supported(params, grads, exp_avgs, exp_avg_sqs, *, bias_correction: bool) -> bool:
    if not bias_correction or not hasattr(torch, "_fused_adamw_"):
        return False
    for lst in (params, grads, exp_avgs, exp_avg_sqs):
        for t in lst:
            if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
                return False
    return True


def adam(params: Sequence[torch.Tensor], grads, exp_avgs, exp_avg_sqs, params_out, *, lr,
         beta1, beta2, eps, weight_decay, step, adam_w_mode, grad_scale, found_inf) -> None:
    """Same contract as :func:`mpzero.kernels.adam`; ``grads`` are left unchanged."""
    step_t = step.reshape(()).float() if isinstance(step, torch.Tensor) else torch.tensor(
        float(step))
    # torch divides by its grad_scale; ours multiplies.
    inv_scale = None if grad_scale is None else grad_scale.reshape(()).float().reciprocal()
    grads = [g.view(p.shape) for g, p in zip(grads, params)]
    if inv_scale is not None:
        if float(inv_scale) == 1.0:  # a CPU scalar: reading it is no device sync
            inv_scale = None
        else:
            # torch's fused kernel writes the unscaled gradients back; ours are the
            # synced gradients a later grad_norm() or step must still see unchanged.
            grads = [g.clone() for g in grads]
    # lr rounded to fp32 whether it came as a Python float or a tensor, as the reference
    # does, so both give the same bits (reading a CPU tensor is no device sync).
    lr = float(torch.as_tensor(lr, dtype=torch.float32))
    fn = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    fn(list(params), grads, list(exp_avgs),
       list(exp_avg_sqs), [], [step_t] * len(params), lr=lr, beta1=beta1, beta2=beta2,
       weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
       grad_scale=inv_scale, found_inf=found_inf)
    skipped = found_inf is not None and bool(found_inf.reshape(()) != 0)
    if params_out is not None and not skipped:
        for p, out in zip(params, params_out):
            out.copy_(p.view(out.shape))
