"""The GPT example's optimizer: DistributedFusedAdam (ZeRO-2) wired to parallel_state.

:func:`build_optimizer` spreads :class:`mpzero.optimizers.DistributedFusedAdam` over
parallel_state's distributed x redundant grid. With 16-bit model parameters
(``--bf16``) it keeps fp32 master weights in its shards (``store_params=True``; or,
with ``--store-param-remainders``, the bf16 parameter plus an int16 remainder).
Gradient accumulation sums in fp32 unless ``--grad-sync-dtype bf16``: see
:func:`no_sync`. (A plain data-parallel AdamW to compare with is bench/dp_adamw.py.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mpzero import parallel_state

LOW_PRECISION = (torch.bfloat16, torch.float16)


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float,
                    betas: tuple[float, float], eps: float, device: torch.device,
                    overlap_grad_sync: bool = True, overlap_param_sync: bool = False,
                    bucket_cap_mb: float = 100.0, grad_sync_dtype: torch.dtype | None = None,
                    param_sync_dtype: torch.dtype | None = None,
                    store_param_remainders: bool = False, scaled_moments: bool = False,
                    compiled_units: Sequence[torch.nn.Module] = (),
                    gradient_accumulation_fusion: bool = False, cpu_offload: bool = False):
    """The optimizer over ``model.param_groups(weight_decay)`` wired to parallel_state.

    ``grad_sync_dtype``/``param_sync_dtype`` None: fp32 gradients, and parameters
    gathered in their own dtype (bf16 parameters in bf16: the same values as rounding
    the fp32 masters after gathering them, at half the traffic).
    ``store_param_remainders``: DistributedFusedAdam keeps the fp32 masters of bf16
    parameters as the parameter plus an int16 remainder (``store_params=False``);
    ``scaled_moments`` (with it) keeps Adam's moments in bf16 with one fp32 scale per
    piece (``with_scaled_states``).
    ``compiled_units``: the modules whose forward is compiled; with
    ``overlap_param_sync`` each gets one forward pre-hook for all its parameters
    (``attach(unit, unit=True)``) instead of hooks inside the compiled code.
    ``gradient_accumulation_fusion``: DistributedFusedAdam keeps its gradients in one
    contiguous buffer and gives the parameters their ``main_grad`` views of it, into
    which the model's TP linear layers (built with the same option) add their weight
    gradients; call :func:`prepare_grad_accumulation_fusion` once every parameter is
    laid out (after ``pipeline.tie_embedding``). ``cpu_offload``: the optimizer state in
    host memory, the update on the CPU."""
    groups = model.param_groups(weight_decay)
    mp_group = parallel_state.get_model_parallel_group()
    from mpzero.optimizers import DistributedFusedAdam

    if param_sync_dtype is None:
        dtypes = {p.dtype for g in groups for p in g["params"]}
        param_sync_dtype = dtypes.pop() if len(dtypes) == 1 else None
    opt = DistributedFusedAdam(
        groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=True,
        device=device, dtype=torch.float32, grad_sync_dtype=grad_sync_dtype,
        param_sync_dtype=param_sync_dtype,
        store_params=not store_param_remainders, store_param_remainders=store_param_remainders,
        with_scaled_states=scaled_moments,
        overlap_grad_sync=overlap_grad_sync, overlap_param_sync=overlap_param_sync,
        bucket_cap_mb=bucket_cap_mb, model_parallel_group=mp_group,
        contiguous_grad_buffer=gradient_accumulation_fusion, cpu_offload=cpu_offload,
        **parallel_state.get_optimizer_process_groups(),
    )
    if overlap_param_sync:
        for unit in compiled_units:
            opt.attach(unit, unit=True)
        opt.attach(model)
    return opt


def prepare_grad_accumulation_fusion(optimizer) -> None:
    """Make DistributedFusedAdam's layout now: it gives every parameter its ``main_grad``
    then, so the first micro-batch's weight gradients already go straight into it."""
    params = [p for p in optimizer.parameters() if p.requires_grad]
    if params:
        optimizer.grad_buffer_view(params[0])


def no_sync(optimizer):
    """The context for all micro-batches but the last (gradient accumulation).

    DistributedFusedAdam with 16-bit parameters: ``no_sync(greedy_grad_copy=True)``,
    so each micro-batch's gradient goes at once into the optimizer's buckets, which
    hold ``grad_sync_dtype`` (fp32 by default) — accumulating in the bf16
    ``param.grad`` instead would round every partial sum to bf16. fp32 parameters
    accumulate in ``param.grad`` (fp32) and are copied once."""
    greedy = any(p.dtype in LOW_PRECISION for p in optimizer.parameters())
    return optimizer.no_sync(greedy_grad_copy=greedy)


def lr_at(iteration: int, o, train_iters: int) -> float:
    """The learning rate of ``iteration`` for an optimizer section
    (``config.OptimizerConfig``): linear warmup to ``lr`` over ``lr_warmup_iters``, then
    cosine decay to ``min_lr`` over ``lr_decay_iters`` (default ``train_iters``)."""
    if o.lr_warmup_iters > 0 and iteration <= o.lr_warmup_iters:
        return o.lr * iteration / o.lr_warmup_iters
    decay_iters = o.lr_decay_iters or train_iters
    span = max(1, decay_iters - o.lr_warmup_iters)
    progress = min(1.0, (iteration - o.lr_warmup_iters) / span)
    return o.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (o.lr - o.min_lr)
