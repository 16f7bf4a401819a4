"""Cross entropy over vocab-parallel logits, without gathering the vocabulary.

Each rank holds logits ``[..., V/tp]`` for vocabulary ids ``r*V/tp:(r+1)*V/tp``.
The loss needs three per-token statistics over the whole vocabulary, each a small
all-reduce of ``[...]``-shaped tensors: the max logit (for a stable softmax), the
target's logit (only the rank owning the id contributes) and the sum of
``exp(logit - max)``; label smoothing adds the sum of the logits. The gradient,
``softmax - target distribution``, is computed on the local shard alone.

Memory: the logits (typically bf16, ``[B, T, V/tp]``, the largest activation of
a GPT) are never upcast as a whole. The tokens are processed in chunks of about
``chunk_elements`` logits; each chunk is upcast to fp32, and the gradient with
respect to the logits is computed in the forward pass and stored in the logits'
dtype (so the logits themselves can be freed as soon as the loss is known, and
no fp32 softmax is kept for the backward pass). The backward pass only scales
that stored gradient by the incoming per-token gradient. At TP=1 each chunk is
read once (max, sums and gradient in one pass); with TP > 1 the global max and
sums are needed before the gradient, so the chunks are read twice, with one
all-reduce of the max and one of the sums in between, whatever the chunk count.

CUDA logits (fp32/fp16/bf16, with ``mpzero._C`` built) take the fused path instead:
two kernels, each one read of the logits (csrc/cross_entropy.cu). The forward reads
each row once for its max, its online-rescaled ``sum(exp(x - max))``, the target's
logit and the sum of the logits; over TP ranks those combine with one all-reduce of
the maxes and one of the (rescaled) sums. It keeps the logits and ``logsumexp`` per
token; the backward reads the logits again and writes ``(softmax - target
distribution) * grad`` in fp32 math, rounded once, into a new tensor, or over the
logits themselves with ``inplace_backward=True`` (no second logits-sized buffer; the
graph can then be back-propagated only once). Three passes over logits-sized memory
in all, against the chunked path's six at least.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpzero import kernels
from mpzero.tensor_parallel.utils import resolve_tp_group, tp_rank, tp_world_size, vocab_range

# fp32 scratch per chunk (elements); 2^25 fp32 = 128 MiB.
DEFAULT_CHUNK_ELEMENTS = 1 << 25


def _chunks(n_tokens: int, vocab: int, chunk_elements: int):
    rows = max(1, chunk_elements // max(1, vocab))
    for lo in range(0, n_tokens, rows):
        yield slice(lo, min(n_tokens, lo + rows))


def _adjust_to_gradient(p: torch.Tensor, local_target: torch.Tensor, inside: torch.Tensor,
                        eps: float, vocab_size: int) -> torch.Tensor:
    """``softmax -> softmax - target distribution`` in place (fp32), for one chunk."""
    if eps > 0.0:
        p.sub_(eps / vocab_size)
    hit = inside.to(p.dtype).mul_(-(1.0 - eps)).unsqueeze(-1)
    return p.scatter_add_(-1, local_target.unsqueeze(-1), hit)


def _store_softmax_gradient(exp: torch.Tensor, sum_exp: torch.Tensor,
                            local_target: torch.Tensor, inside: torch.Tensor,
                            out: torch.Tensor) -> None:
    """``out`` (logits' dtype) = ``exp / sum_exp - onehot(target)`` for one chunk, no
    label smoothing: the fp32 softmax is rounded straight into ``out`` (no second fp32
    pass), then each row's target entry is rewritten from its fp32 value. The same
    values as rounding :func:`_adjust_to_gradient`'s fp32 result."""
    total = sum_exp.unsqueeze(-1)
    torch.div(exp, total, out=out)
    idx = local_target.unsqueeze(-1)
    hit = inside.to(exp.dtype).neg_().unsqueeze(-1)  # -1 where this rank has the target
    out.scatter_(-1, idx, exp.gather(-1, idx).div_(total).add_(hit).to(out.dtype))


def _local_targets(target: torch.Tensor, vl: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat targets as ``(inside, relative)``: whether this rank's vocabulary block
    holds each, and its id relative to the block's start (int64)."""
    start, end = vocab_range(vl, tp_rank(group))
    tgt = target.reshape(-1).long()
    return (tgt >= start) & (tgt < end), tgt - start


def _loss(log_z: torch.Tensor, predicted: torch.Tensor, logit_sum: torch.Tensor | None,
          eps: float, vocab_size: int) -> torch.Tensor:
    """``-log p[target]`` from ``log Z`` and the target's logit (both shifted alike); with
    label smoothing (``logit_sum``: the sum of the logits, shifted the same way) the
    target distribution is ``(1-eps)*onehot + eps/V`` (torch's convention): the
    smoothing term is the mean over the vocabulary of ``-log p``."""
    loss = log_z - predicted
    if eps > 0.0:
        loss = (1.0 - eps) * loss + eps * (log_z - logit_sum / vocab_size)
    return loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group, need_grad, chunk_elements):
        world = tp_world_size(group)
        vl = logits.shape[-1]
        flat = logits.reshape(-1, vl)  # a view for contiguous logits
        n = flat.shape[0]
        acc = torch.promote_types(logits.dtype, torch.float32)  # fp32 (fp64 stays fp64)
        eps, vocab_size = label_smoothing, vl * world

        inside, local_target = _local_targets(target, vl, group)
        local_target = local_target.masked_fill_(~inside, 0)
        grad = torch.empty_like(flat, memory_format=torch.contiguous_format) \
            if need_grad else None
        n_stats = 3 if eps > 0.0 else 2
        stats = torch.empty(n, n_stats, dtype=acc, device=logits.device)  # predicted, [sum], Z

        if world > 1:
            logits_max = flat.amax(dim=-1).to(acc)  # exact in any dtype
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        else:
            logits_max = torch.empty(n, dtype=acc, device=logits.device)

        for rows in _chunks(n, vl, chunk_elements):
            x = flat[rows]
            if world == 1:
                logits_max[rows] = x.amax(dim=-1).to(acc)
            m = logits_max[rows]
            shifted = torch.sub(x, m.unsqueeze(-1)).to(acc)  # fresh fp32 chunk
            lt = local_target[rows]
            predicted = shifted.gather(-1, lt.unsqueeze(-1)).squeeze(-1)
            stats[rows, 0] = predicted.masked_fill_(~inside[rows], 0.0)
            if eps > 0.0:
                stats[rows, 1] = shifted.sum(dim=-1)
            exp = shifted.exp_()
            sum_exp = exp.sum(dim=-1)
            stats[rows, -1] = sum_exp
            if world == 1 and grad is not None:  # the whole row is here: gradient now
                if eps > 0.0 or torch.compiler.is_compiling():
                    # Traced, the rounding-into-``out`` form below compiles to a kernel
                    # per chunk about 40x slower than this one (1.4 ms per 2^25 logits on
                    # an H200); the values are the same.
                    p = exp.div_(sum_exp.unsqueeze(-1))
                    grad[rows] = _adjust_to_gradient(p, lt, inside[rows], eps, vocab_size)
                else:
                    _store_softmax_gradient(exp, sum_exp, lt, inside[rows], grad[rows])

        if world > 1:
            dist.all_reduce(stats, group=group)  # the sums do not depend on each other
        predicted, sum_exp = stats[:, 0], stats[:, -1]
        log_z = torch.log(sum_exp)
        loss = _loss(log_z, predicted, stats[:, 1] if eps > 0.0 else None, eps, vocab_size)

        if world > 1 and grad is not None:  # second pass: softmax = exp(x - max - log Z)
            shift = logits_max + log_z
            for rows in _chunks(n, vl, chunk_elements):
                p = torch.sub(flat[rows], shift[rows].unsqueeze(-1)).to(acc).exp_()
                grad[rows] = _adjust_to_gradient(p, local_target[rows], inside[rows], eps,
                                                 vocab_size)

        if grad is not None:
            ctx.save_for_backward(grad)
        ctx.logits_shape, ctx.chunk_elements = logits.shape, chunk_elements
        return loss.float().view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors  # (N, V/tp), logits' dtype; left intact for a re-run
        g = grad_loss.reshape(-1, 1).to(torch.promote_types(grad.dtype, torch.float32))
        out = torch.empty_like(grad)
        for rows in _chunks(grad.shape[0], grad.shape[1], ctx.chunk_elements):
            torch.mul(grad[rows], g[rows], out=out[rows])  # fp32 math, one rounding
        return out.view(ctx.logits_shape), None, None, None, None, None


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """Two reads of the logits: per-row statistics forward, the gradient backward."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group, inplace_backward):
        world = tp_world_size(group)
        vl = logits.shape[-1]
        flat = logits.reshape(-1, vl)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        inside, local = _local_targets(target, vl, group)
        local = local.masked_fill_(~inside, -1)  # -1: not on this rank
        m, s, t, total = kernels.cross_entropy_stats(flat, local).unbind(-1)
        if world > 1:
            gm = m.clone()
            dist.all_reduce(gm, op=dist.ReduceOp.MAX, group=group)
            # Each rank's sum rescaled to the global max (a row all -inf stays 0).
            s = torch.where(m == gm, s, s * torch.exp(m - gm))
            sums = torch.stack([s, t, total])
            dist.all_reduce(sums, group=group)
            (s, t, total), m = sums.unbind(0), gm
        lse = m + torch.log(s)
        eps, vocab_size = label_smoothing, vl * world
        loss = _loss(lse, t, total, eps, vocab_size)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(flat, local, lse)
        ctx.eps, ctx.vocab_size, ctx.inplace, ctx.done = eps, vocab_size, inplace_backward, False
        ctx.logits_shape = logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.inplace:
            if ctx.done:
                raise RuntimeError(
                    "vocab_parallel_cross_entropy(inplace_backward=True): a second backward "
                    "through the same loss, but the first wrote the gradient over the "
                    "logits; use inplace_backward=False to back-propagate more than once")
            ctx.done = True
        flat, local, lse = ctx.saved_tensors
        out = flat if ctx.inplace else torch.empty_like(flat)
        g = grad_loss.reshape(-1).float().contiguous()
        kernels.cross_entropy_backward(flat, local, lse, g, 1.0 - ctx.eps,
                                       ctx.eps / ctx.vocab_size, out)
        return out.view(ctx.logits_shape), None, None, None, None


@torch.compiler.disable  # two extension kernels; under torch.compile a graph break
def _fused_cross_entropy(logits, target, label_smoothing, group, inplace_backward):
    return _FusedVocabParallelCrossEntropy.apply(logits, target, label_smoothing, group,
                                                 inplace_backward)


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0,
                                 tp_group: dist.ProcessGroup | None = None, *,
                                 chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
                                 inplace_backward: bool = False) -> torch.Tensor:
    """Per-token cross entropy of vocab-sharded logits; no reduction.

    ``vocab_parallel_logits`` is ``[..., V/tp]`` (this rank's vocabulary block),
    ``target`` the ``[...]`` full-vocabulary ids. Returns the fp32 ``[...]`` loss equal
    to ``F.cross_entropy(full_logits.float(), target, reduction="none",
    label_smoothing=label_smoothing)``; the math runs in fp32 (fp64 for fp64 logits)
    on chunks of about ``chunk_elements`` logits, and the gradient is computed in the
    forward pass and kept in the logits' dtype (see the module docstring). When no
    gradient is needed (``torch.no_grad()``, logits without ``requires_grad``) it is
    not computed. ``tp_group`` defaults to parallel_state's TP group.

    CUDA logits of those dtypes take the fused kernels instead (module docstring;
    ``chunk_elements`` does not apply): the gradient is computed in the backward pass,
    in a new tensor, or, with ``inplace_backward=True``, over the logits (which the
    caller must not use afterwards; the loss can then be back-propagated once only).
    """
    if target.shape != vocab_parallel_logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal the logits shape without its "
            f"last (vocabulary) dimension {tuple(vocab_parallel_logits.shape[:-1])}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be positive, got {chunk_elements}")
    group = resolve_tp_group(tp_group)
    if kernels.fused_cross_entropy_available(vocab_parallel_logits):
        return _fused_cross_entropy(vocab_parallel_logits, target, float(label_smoothing),
                                    group, bool(inplace_backward))
    need_grad = torch.is_grad_enabled() and vocab_parallel_logits.requires_grad
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target,
                                            float(label_smoothing), group, need_grad,
                                            int(chunk_elements))
