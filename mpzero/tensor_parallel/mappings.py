"""The tensor-parallel communication patterns, one ``autograd.Function`` each.

Every pattern pairs a forward collective with its adjoint in backward:

- ``copy_to_tensor_model_parallel_region``: identity forward, all-reduce backward;
- ``reduce_from_tensor_model_parallel_region``: all-reduce forward, identity backward;
- ``scatter_to_tensor_model_parallel_region``: split the last dim forward, all-gather backward;
- ``gather_from_tensor_model_parallel_region``: all-gather the last dim forward, split backward.

Sequence parallelism (Megatron's, arXiv:2205.05198) shards the activations of the
regions between the TP layers (LayerNorm, dropout, residual) along the sequence:

- ``scatter_to_sequence_parallel_region``: keep this rank's sequence chunk forward,
  all-gather backward (after the embedding);
- ``gather_from_sequence_parallel_region``: all-gather the sequence forward; backward
  reduce-scatters (the input of a column-parallel layer, whose input gradient is a
  partial sum per rank) or splits (``tensor_parallel_output_grad=False``);
- ``reduce_scatter_to_sequence_parallel_region``: reduce-scatter forward, all-gather
  backward (the output of a row-parallel layer);
- ``reduce_grad_over_tensor_model_parallel_region``: identity forward, all-reduce
  backward, applied to a *parameter* used on a sequence chunk (LayerNorm weights,
  row-parallel bias): its gradient on each rank covers only that rank's tokens, and
  the all-reduce inside the autograd graph makes the accumulated ``param.grad`` the
  full one before any post-accumulate-grad hook (DistributedFusedAdam's) sees it.

The sequence dim is an argument (``seq_dim``, default 0: Megatron's ``[s, b, h]``;
the GPT example is batch-first and passes 1). The sequence length must divide by
the TP size.

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
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


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


def _split_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    world = tp_world_size(group)
    if world == 1:
        return x
    width = divide(x.shape[dim], world, f"dimension {dim} (sequence) of the input")
    return x.narrow(dim, tp_rank(group) * width, width).contiguous()


def _gather_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    world = tp_world_size(group)
    if world == 1:
        return x
    front = x.movedim(dim, 0).contiguous()  # the collectives concatenate along dim 0
    out = torch.empty((world * front.shape[0], *front.shape[1:]), dtype=x.dtype,
                      device=x.device)
    _all_gather_single(out, front, group=group)
    return out.movedim(0, dim)


def _reduce_scatter_dim(x: torch.Tensor, dim: int,
                        group: dist.ProcessGroup | None) -> torch.Tensor:
    world = tp_world_size(group)
    if world == 1:
        return x
    divide(x.shape[dim], world, f"dimension {dim} (sequence) of the input")
    front = x.movedim(dim, 0)
    if front.is_contiguous() and dist.get_backend(group) == "gloo":
        front = front.clone()  # gloo may reduce in the input buffer; it is not ours
    front = front.contiguous()
    out = torch.empty((front.shape[0] // world, *front.shape[1:]), dtype=x.dtype,
                      device=x.device)
    _reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim)


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


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's sequence chunk forward, all-gather the sequence backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_dim(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence forward; reduce-scatter (or split) the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, group, tensor_parallel_output_grad):
        ctx.dim, ctx.group, ctx.reduce = dim, group, tensor_parallel_output_grad
        return _gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce:
            return _reduce_scatter_dim(grad, ctx.dim, ctx.group), None, None, None
        return _split_dim(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_dim(grad, ctx.dim, ctx.group), None, None


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


def scatter_to_sequence_parallel_region(x: torch.Tensor, seq_dim: int = 0,
                                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Keep rank r's chunk ``r*s/tp:(r+1)*s/tp`` of dim ``seq_dim``; all-gather the gradient."""
    group = resolve_tp_group(group)
    if tp_world_size(group) == 1:
        return x
    return _ScatterToSequenceParallelRegion.apply(x, seq_dim, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, seq_dim: int = 0,
                                         group: dist.ProcessGroup | None = None,
                                         tensor_parallel_output_grad: bool = True
                                         ) -> torch.Tensor:
    """Concatenate the ranks' sequence chunks along ``seq_dim`` (rank order).

    Backward: the gradient is reduce-scattered when the consumer is tensor-parallel
    (each rank's gradient is a partial sum, e.g. the input of a column-parallel
    layer; ``tensor_parallel_output_grad=True``, Megatron's default), else split.
    """
    group = resolve_tp_group(group)
    if tp_world_size(group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, seq_dim, group,
                                                   tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, seq_dim: int = 0, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sum over ranks and keep rank r's sequence chunk; all-gather the gradient."""
    group = resolve_tp_group(group)
    if tp_world_size(group) == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, seq_dim, group)


def reduce_grad_over_tensor_model_parallel_region(
    param: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``param`` unchanged; its gradient summed over ``group`` in backward.

    For parameters applied to a sequence-parallel chunk (mark them with
    :func:`mark_sequence_parallel`): each rank's gradient covers its own tokens,
    and the sum is the gradient of the whole sequence, identical on every TP rank,
    already in ``param.grad`` when post-accumulate-grad hooks run.
    """
    return copy_to_tensor_model_parallel_region(param, group)


def mark_sequence_parallel(param: torch.Tensor) -> torch.Tensor:
    """Set ``param.sequence_parallel = True`` (TP-replicated; gradient all-reduced over TP)."""
    param.sequence_parallel = True
    return param
