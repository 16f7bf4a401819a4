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

    def __init__(self, param_groups, dp_group, model_parallel_group=None, **kwargs) -> None:
        self.optimizer = torch.optim.AdamW(param_groups, **kwargs)
        self.dp_group, self.model_parallel_group = dp_group, model_parallel_group
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
        for p in self._params():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if world > 1:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.dp_group)
                p.grad.div_(world)
        self._synced = True

    def grad_norm(self) -> torch.Tensor:
        self.grad_sync()
        tp_rank = (parallel_state.get_tensor_model_parallel_rank()
                   if self.model_parallel_group is not None else 0)
        sq = torch.zeros((), dtype=torch.float32)
        for p in self._params():
            if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                sq = sq + p.grad.detach().float().pow(2).sum().cpu()
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


def build_optimizer(name: str, model: torch.nn.Module, *, lr: float, weight_decay: float,
                    betas: tuple[float, float], eps: float, device: torch.device,
                    overlap_grad_sync: bool = True, overlap_param_sync: bool = False,
                    bucket_cap_mb: float = 100.0, grad_sync_dtype: torch.dtype | None = None):
    """The optimizer over ``model.param_groups(weight_decay)`` wired to parallel_state."""
    groups = model.param_groups(weight_decay)
    mp_group = parallel_state.get_model_parallel_group()
    if name == "adamw":
        return DataParallelAdamW(groups, parallel_state.get_data_parallel_group(),
                                 model_parallel_group=mp_group, lr=lr, betas=betas, eps=eps,
                                 weight_decay=weight_decay)
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
