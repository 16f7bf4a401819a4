"""Cross entropy over vocab-parallel logits, without gathering the vocabulary.

Each rank holds logits ``[..., V/tp]`` for vocabulary ids ``r*V/tp:(r+1)*V/tp``.
The loss needs three per-token statistics over the whole vocabulary, each a small
all-reduce of ``[...]``-shaped tensors: the max logit (for a stable softmax), the
target's logit (only the rank owning the id contributes) and the sum of
``exp(logit - max)``; label smoothing adds the sum of the logits. The gradient,
``softmax - target distribution``, is computed on the local shard alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpzero.tensor_parallel.utils import resolve_tp_group, tp_rank, tp_world_size, vocab_range


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group):
        world = tp_world_size(group)
        ctx.logits_dtype = logits.dtype
        logits = logits.float()
        logits_max = logits.amax(dim=-1)  # (...)
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)  # (..., V/tp), a fresh fp32 buffer

        start, end = vocab_range(shifted.shape[-1], tp_rank(group))
        outside = (target < start) | (target >= end)
        local_target = (target.long() - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        stats = [predicted.masked_fill(outside, 0.0)]
        if label_smoothing > 0.0:
            stats.append(shifted.sum(dim=-1))
        exp = shifted.exp_()  # shifted is no longer needed
        stats.append(exp.sum(dim=-1))
        # One all-reduce for the sums that do not depend on each other.
        stats = torch.stack(stats, dim=-1)  # (..., 2 or 3)
        if world > 1:
            dist.all_reduce(stats, group=group)
        predicted, sum_exp = stats[..., 0], stats[..., -1]

        log_z = torch.log(sum_exp)
        loss = log_z - predicted  # -log p[target]
        vocab_size = exp.shape[-1] * world
        if label_smoothing > 0.0:
            # The target distribution is (1-eps)*onehot + eps/V (torch's convention):
            # the smoothing term is the mean over the vocabulary of -log p.
            mean_neg_log_p = log_z - stats[..., 1] / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * mean_neg_log_p

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        eps = ctx.label_smoothing
        g = grad_loss.float().unsqueeze(-1)  # (..., 1)
        grad = softmax * g  # a new buffer: the saved softmax stays intact for a re-run
        if eps > 0.0:
            grad.sub_(g * (eps / ctx.vocab_size))
        hit = (~outside).unsqueeze(-1).to(grad.dtype) * g * (1.0 - eps)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0,
                                 tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Per-token cross entropy of vocab-sharded logits; no reduction.

    ``vocab_parallel_logits`` is ``[..., V/tp]`` (this rank's vocabulary block),
    ``target`` the ``[...]`` full-vocabulary ids. Returns the fp32 ``[...]`` loss equal
    to ``F.cross_entropy(full_logits.float(), target, reduction="none",
    label_smoothing=label_smoothing)``; the math runs in fp32 and the gradient comes
    back in the logits' dtype. ``tp_group`` defaults to parallel_state's TP group.
    """
    if target.shape != vocab_parallel_logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal the logits shape without its "
            f"last (vocabulary) dimension {tuple(vocab_parallel_logits.shape[:-1])}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    group = resolve_tp_group(tp_group)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target,
                                            float(label_smoothing), group)
