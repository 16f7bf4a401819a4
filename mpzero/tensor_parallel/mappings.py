"""The tensor-parallel communication patterns, one ``autograd.Function`` each.

Every pattern pairs a forward collective with its adjoint in backward:

- ``copy_to_tensor_model_parallel_region``: identity forward, all-reduce backward;
- ``reduce_from_tensor_model_parallel_region``: all-reduce forward, identity backward;
- ``scatter_to_tensor_model_parallel_region``: split the last dim forward, all-gather backward;
- ``gather_from_tensor_model_parallel_region``: all-gather the last dim forward, split backward.

Each takes ``group=None`` (parallel_state's tensor-parallel group). With one rank
they return the input unchanged and communicate nothing. Collectives never write
into a tensor autograd handed us (it may be shared with another branch of the
graph or saved for another op's backward): reductions work on a private copy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpzero.tensor_parallel.utils import divide, resolve_tp_group, tp_rank, tp_world_size

# ``all_gather_into_tensor`` is deprecated in favour of ``all_gather_single`` (torch 2.13).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if tp_world_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _split_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    world = tp_world_size(group)
    if world == 1:
        return x
    width = divide(x.shape[-1], world, "last dimension of the input")
    start = tp_rank(group) * width
    return x[..., start : start + width].contiguous()


def _gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    world = tp_world_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    # The concatenated output form (every backend takes it), viewed as (tp, ..., d).
    flat = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(flat, x, group=group)
    stacked = flat.view(world, *x.shape)
    # (tp, ..., d) -> (..., tp, d) -> (..., tp * d): rank r's block lands at columns r*d.
    return stacked.movedim(0, -2).reshape(*x.shape[:-1], world * x.shape[-1])


class _CopyToModelParallelRegion(torch.autograd.Function):
    """Identity forward, all-reduce backward (the input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """All-reduce forward, identity backward (the output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward, all-gather it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """All-gather the last dim forward, keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor,
                                         group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Identity in forward; all-reduce (sum) the gradient over ``group`` in backward."""
    group = resolve_tp_group(group)
    if tp_world_size(group) == 1:
        return x
    return _CopyToModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-reduce (sum) over ``group`` in forward; identity for the gradient."""
    group = resolve_tp_group(group)
    if tp_world_size(group) == 1:
        return x
    return _ReduceFromModelParallelRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Keep rank r's block ``[..., r*d/tp:(r+1)*d/tp]``; all-gather the gradient in backward."""
    group = resolve_tp_group(group)
    if tp_world_size(group) == 1:
        return x
    return _ScatterToModelParallelRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim (rank order); split the gradient."""
    group = resolve_tp_group(group)
    if tp_world_size(group) == 1:
        return x
    return _GatherFromModelParallelRegion.apply(x, group)
