"""The optimizer of the GPT example, and a plain data-parallel AdamW to compare it with.

``--optimizer dfa`` (default) is :class:`mpzero.optimizers.DistributedFusedAdam`,
ZeRO-2 over parallel_state's distributed x redundant grid. ``--optimizer adamw``
is :class:`DataParallelAdamW`: ``torch.optim.AdamW`` on full replicas with the
gradients all-reduced (averaged) over the data-parallel group. It exposes the
same small interface the training loop uses (``no_sync``, ``clip_grad_norm``,
``grad_norm``, ``step``, ``zero_grad``, ``state_dict``/``load_state_dict``), so
the two are interchangeable and their losses can be compared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from mpzero import parallel_state


class DataParallelAdamW:
    """``torch.optim.AdamW`` with gradients averaged over ``dp_group`` before the step.

    The gradient norm sums the squares of TP-sharded parameters
    (``param.tensor_model_parallel``) over ``model_parallel_group`` and counts
    replicated ones once, like DistributedFusedAdam's.
    """

    def __init__(self, param_groups, dp_group, model_parallel_group=None,
                 bucket_cap_mb: float = 100.0, **kwargs) -> None:
        on_cuda = all(p.is_cuda for g in param_groups for p in g["params"])
        # CUDA: torch's fused kernel (the strongest torch peer); CPU: the default.
        self.optimizer = torch.optim.AdamW(param_groups, fused=True if on_cuda else None,
                                           **kwargs)
        self.dp_group, self.model_parallel_group = dp_group, model_parallel_group
        self.bucket_bytes = int(bucket_cap_mb * 2**20)
        self._synced = False
        self._skip_sync = False

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def _params(self) -> Iterator[torch.nn.Parameter]:
        for group in self.optimizer.param_groups:
            yield from group["params"]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Nothing is communicated during backward anyway; kept for interface parity."""
        yield

    def grad_sync(self) -> None:
        if self._synced:
            return
        world = dist.get_world_size(self.dp_group)
        grads = []
        for p in self._params():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if world > 1:
            # DDP-style: flat buckets of about bucket_cap_mb, one all-reduce each.
            for bucket in _buckets(grads, self.bucket_bytes):
                flat = torch._utils._flatten_dense_tensors(bucket)
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)
                flat.div_(world)
                for g, f in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                    g.copy_(f)
        self._synced = True

    def grad_norm(self) -> torch.Tensor:
        self.grad_sync()
        tp_rank = (parallel_state.get_tensor_model_parallel_rank()
                   if self.model_parallel_group is not None else 0)
        mine = [p.grad.detach() for p in self._params()
                if getattr(p, "tensor_model_parallel", False) or tp_rank == 0]
        device = next(self._params()).device
        sq = torch.zeros((), dtype=torch.float32, device=device)
        if mine:
            norms = torch._foreach_norm(mine)
            sq = torch.stack([n.float() for n in norms]).pow(2).sum()
        if self.model_parallel_group is not None:
            dist.all_reduce(sq, group=self.model_parallel_group)
        return sq.sqrt()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        norm = self.grad_norm()
        coef = min(1.0, float(max_norm) / (float(norm) + 1e-6))
        if coef < 1.0:
            for p in self._params():
                p.grad.mul_(coef)
        return norm

    def step(self) -> None:
        self.grad_sync()
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._synced = False

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def _buckets(tensors: list[torch.Tensor], cap_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of same-dtype tensors of at most ``cap_bytes`` (at least one each)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > cap_bytes or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def build_optimizer(name: str, model: torch.nn.Module, *, lr: float, weight_decay: float,
                    betas: tuple[float, float], eps: float, device: torch.device,
                    overlap_grad_sync: bool = True, overlap_param_sync: bool = False,
                    bucket_cap_mb: float = 100.0, grad_sync_dtype: torch.dtype | None = None):
    """The optimizer over ``model.param_groups(weight_decay)`` wired to parallel_state."""
    groups = model.param_groups(weight_decay)
    mp_group = parallel_state.get_model_parallel_group()
    if name == "adamw":
        return DataParallelAdamW(groups, parallel_state.get_data_parallel_group(),
                                 model_parallel_group=mp_group, bucket_cap_mb=bucket_cap_mb,
                                 lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if name != "dfa":
        raise ValueError(f"optimizer must be 'dfa' or 'adamw', got {name!r}")
    from mpzero.optimizers import DistributedFusedAdam

    return DistributedFusedAdam(
        groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=True,
        device=device, grad_sync_dtype=grad_sync_dtype,
        overlap_grad_sync=overlap_grad_sync, overlap_param_sync=overlap_param_sync,
        module=model if overlap_param_sync else None, bucket_cap_mb=bucket_cap_mb,
        model_parallel_group=mp_group, **parallel_state.get_optimizer_process_groups(),
    )
