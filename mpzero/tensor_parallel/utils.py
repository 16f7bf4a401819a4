"""Small helpers shared by the tensor-parallel modules: groups, sizes, partitions."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpzero import parallel_state


def resolve_tp_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """The group to use: ``group``, else parallel_state's tensor-parallel group.

    A single process without ``torch.distributed`` is a TP world of one: ``None`` is
    returned and every mapping is the identity. When ``torch.distributed`` is running
    but parallel_state is not initialized, parallel_state's error is raised (silently
    treating a multi-rank job as TP=1 would hide a missing initialization).
    """
    if group is not None:
        return group
    if not parallel_state.model_parallel_is_initialized() and not dist.is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def tp_world_size(group: dist.ProcessGroup | None) -> int:
    """Size of a group returned by :func:`resolve_tp_group` (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def tp_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in a group returned by :func:`resolve_tp_group` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def divide(numerator: int, denominator: int, name: str) -> int:
    """``numerator // denominator``; ``ValueError`` naming ``name`` when it does not divide."""
    if numerator % denominator != 0:
        raise ValueError(
            f"{name} ({numerator}) must be divisible by the tensor-parallel size ({denominator})"
        )
    return numerator // denominator


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool,
                                         partition_dim: int, partition_stride: int = 1) -> None:
    """Mark ``param`` as sharded over TP along ``partition_dim`` (read by optimizers, norms)."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = partition_dim
    param.partition_stride = partition_stride


def vocab_range(per_partition: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of the vocabulary ids held by ``rank`` when each holds ``per_partition``."""
    start = rank * per_partition
    return start, start + per_partition
