"""Flat views of parameters and gradients in *memory order*.

The optimizer's shards hold each parameter's elements in the order they sit in
memory, so a ``channels_last`` (or any dense, non-overlapping) parameter is a
plain 1-D view with no copy, and the all-gather writes back in that order.
"""

from __future__ import annotations

import torch


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill one block of memory without gaps or overlap
    (contiguous in some dimension order, e.g. ``channels_last``)."""
    if t.is_contiguous():
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """1-D view of ``t`` in memory order (``t`` must be dense)."""
    if t.is_contiguous():
        return t.view(-1)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a flat memory-order view of ``a`` lines up with one of ``b``."""
    if a.is_contiguous() and b.is_contiguous():
        return True
    return a.stride() == b.stride()


def flat_like(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` flattened in ``param``'s memory order (copied only when the layouts
    differ, e.g. a contiguous gradient for a ``channels_last`` parameter)."""
    if grad.shape != param.shape:
        raise RuntimeError(
            f"gradient of shape {tuple(grad.shape)} for a parameter of shape "
            f"{tuple(param.shape)}: shapes must match (a transposed or reshaped gradient "
            "with the same number of elements is not accepted)")
    grad = grad.detach()
    if not same_layout(grad, param) or not is_dense(grad):
        grad = torch.empty_like(param, dtype=grad.dtype).copy_(grad)
    return flat_view(grad)
