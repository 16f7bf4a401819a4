"""CPU fast path for :func:`mpzero.kernels.adam`: torch's own fused CPU Adam/AdamW.

``torch._fused_adamw_``/``torch._fused_adam_`` compute the same function as the
reference (AdamW decoupled decay or L2 decay, bias correction, ``lr``/``step``
as tensors), vectorized and multi-threaded, with a different rounding order.
Used for lists of contiguous fp32 CPU tensors with bias correction; everything
else goes to the reference.

With a grad scale, torch's kernel writes the unscaled gradients back into its
``grads``; ours are the synchronized gradients, which a later ``grad_norm()``
must still see unchanged. So the step then runs in chunks of
:data:`CHUNK_ELEMENTS` elements (one kernel call per chunk): each chunk's
gradients are copied into a scratch buffer, kept between calls, that the
kernel overwrites. (Cloning every gradient instead, as before, allocated a
buffer the size of the gradients on every step and page-faulted it in: 64K
page faults and 2.6x the step time at 64M parameters on a 2-core machine.)

Chunk boundaries inside a tensor fall on multiples of :data:`_ALIGN` elements
from its start, so every element takes the same (vector or scalar-tail) path
in torch's kernel as in a single call over whole tensors: the result is
bitwise the same as one unchunked call.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import torch

CHUNK_ELEMENTS = 1 << 20
"""Elements per kernel call with a grad scale (4 MiB of scratch per thread). Measured on
the 2-core machine, 2 threads, idle: 2**20 was fastest (the scratch stays in cache; at
64M parameters 51 ms vs 57 ms at 2**21, 62 ms at 2**22, 135 ms with a clone per step).
On an oversubscribed machine fewer, larger chunks do better (each call's parallel
region waits for both threads to be scheduled): raise it there."""

_ALIGN = 64
"""Chunk boundaries inside a tensor: multiples of this many elements (>= any SIMD width
torch's kernel uses, and a multiple of its cache-line task unit)."""


def supported(params, grads, exp_avgs, exp_avg_sqs, *, bias_correction: bool) -> bool:
    """True when torch's fused CPU kernel can run the step: bias correction, and all
    of ``params``/``grads``/``exp_avgs``/``exp_avg_sqs`` contiguous fp32 CPU tensors."""
    if not bias_correction or not hasattr(torch, "_fused_adamw_"):
        return False
    for lst in (params, grads, exp_avgs, exp_avg_sqs):
        for t in lst:
            if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
                return False
    return True


def _batches(numels: Sequence[int], chunk: int) -> Iterator[list[tuple[int, int, int]]]:
    """Split tensors of ``numels`` elements into batches of ``(index, lo, hi)`` pieces of
    at most ``chunk`` elements in all; a piece ends a tensor or has a multiple of
    ``_ALIGN`` elements. Empty tensors are left out."""
    batch: list[tuple[int, int, int]] = []
    room = chunk
    for i, n in enumerate(numels):
        lo = 0
        while lo < n:
            take = n - lo
            if take > room:
                take = room - room % _ALIGN
            if take == 0:
                yield batch
                batch, room = [], chunk
                continue
            batch.append((i, lo, lo + take))
            room -= take
            lo += take
    if batch:
        yield batch


_local = threading.local()


def _scratch(n: int) -> torch.Tensor:
    """``n`` fp32 elements of this thread's scratch buffer, kept between calls (a fresh
    buffer on every step would be page-faulted in every time)."""
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.numel() < n:
        buf = _local.scratch = torch.empty(n, dtype=torch.float32)
    return buf[:n]


def _piece(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``t``'s flat elements ``[lo, hi)``: ``t`` itself (flattened) when that is all of it."""
    flat = t.view(-1)
    return flat if lo == 0 and hi == flat.numel() else flat[lo:hi]


def _out_pairs(params_out, batch, ps) -> tuple[list, list]:
    """``(dsts, srcs)`` copying each updated piece into ``params_out``: a whole output
    tensor keeps its own shape (any layout), a part of one is a slice of its flat view."""
    dsts, srcs = [], []
    for (i, lo, hi), p in zip(batch, ps):
        out = params_out[i]
        if lo == 0 and hi == out.numel():
            dsts.append(out)
            srcs.append(p.view(out.shape))
        else:
            dsts.append(out.view(-1)[lo:hi])
            srcs.append(p)
    return dsts, srcs


def adam(params: Sequence[torch.Tensor], grads, exp_avgs, exp_avg_sqs, params_out, *, lr,
         beta1, beta2, eps, weight_decay, step, adam_w_mode, grad_scale, found_inf) -> None:
    """Same contract as :func:`mpzero.kernels.adam`; ``grads`` are left unchanged and a
    nonzero ``found_inf`` changes nothing (no kernel runs)."""
    # All flags here are CPU scalars: reading them is no device sync.
    if found_inf is not None and bool(found_inf.reshape(()) != 0):
        return
    step_t = step.reshape(()).float() if isinstance(step, torch.Tensor) else torch.tensor(
        float(step))
    # torch divides by its grad_scale; ours multiplies.
    inv_scale = None if grad_scale is None else grad_scale.reshape(()).float().reciprocal()
    if inv_scale is not None and float(inv_scale) == 1.0:
        inv_scale = None
    # lr rounded to fp32 whether it came as a Python float or a tensor, as the reference
    # does, so both give the same bits.
    lr = float(torch.as_tensor(lr, dtype=torch.float32))
    fn = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    numels = [p.numel() for p in params]
    total = sum(numels)
    if total == 0:
        return
    # Without a grad scale: one call over whole tensors (chunking gained nothing there).
    chunk = total if inv_scale is None else min(CHUNK_ELEMENTS, total)
    scratch = None if inv_scale is None else _scratch(chunk)
    for batch in _batches(numels, chunk):
        ps = [_piece(params[i], lo, hi) for i, lo, hi in batch]
        gs = [_piece(grads[i], lo, hi) for i, lo, hi in batch]
        if scratch is not None:
            views, off = [], 0
            for _, lo, hi in batch:
                views.append(scratch[off:off + hi - lo])
                off += hi - lo
            torch._foreach_copy_(views, gs)
            gs = views
        fn(ps, gs, [_piece(exp_avgs[i], lo, hi) for i, lo, hi in batch],
           [_piece(exp_avg_sqs[i], lo, hi) for i, lo, hi in batch], [], [step_t] * len(ps),
           lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
           amsgrad=False, maximize=False, grad_scale=inv_scale, found_inf=None)
        if params_out is not None:
            torch._foreach_copy_(*_out_pairs(params_out, batch, ps))
