"""A plain data-parallel AdamW, the baseline the GPT example's optimizer is compared with.

:class:`DataParallelAdamW` is ``torch.optim.AdamW`` on full replicas with the gradients
all-reduced (averaged) over the data-parallel group, behind the small interface the
example's training step uses (``no_sync``, ``clip_grad_norm``, ``grad_norm``, ``step``,
``zero_grad``, ``state_dict``/``load_state_dict``), so it can stand in for
DistributedFusedAdam in ``examples.gpt.train.train_step``. With 16-bit parameters it
steps fp32 master copies (:class:`MasterWeights`, below): gradient
accumulation sums in fp32 in the masters' ``.grad``.

Used by gpt_peers_worker.py and bench_memory.py (setup ``adamw``) and by the example's
bf16 tests (``from bench import dp_adamw``).

:class:`MasterWeights` is Megatron's ``Float16OptimizerWithFloat16Params`` in a few
lines: each bf16 model parameter gets an fp32 master copy, which is what the torch
optimizer sees.

- **Gradients** are moved, as soon as autograd has accumulated them into the bf16
  ``param.grad``, into the master's fp32 ``.grad`` (a post-accumulate-grad hook
  adds them there and frees ``param.grad``), so gradient accumulation over
  micro-batches sums in fp32, not in bf16.
- **The step** runs on the masters; :meth:`MasterWeights.copy_to_model` then
  rounds them into the bf16 parameters (round to nearest even).
- **Checkpoints** keep the masters (:meth:`state_dict`), so a resumed run continues
  from the exact fp32 values, not from the rounded model weights.

The masters carry the model parameters' public attributes
(``tensor_model_parallel``, ``partition_dim``, ...), which the gradient norm reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from mpzero import parallel_state

LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeights:
    """fp32 copies of ``params`` (16-bit model parameters) and their fp32 gradients."""

    def __init__(self, params, dtype: torch.dtype = torch.float32) -> None:
        self.model_params = [p for p in params if p.requires_grad]
        self.masters = [self._master(p, dtype) for p in self.model_params]
        self._by_param = {id(p): m for p, m in zip(self.model_params, self.masters)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._move_grad)
                       for p in self.model_params]

    @staticmethod
    def _master(p: torch.Tensor, dtype: torch.dtype) -> torch.nn.Parameter:
        m = torch.nn.Parameter(p.detach().to(dtype, copy=True))
        for key, value in vars(p).items():  # tensor_model_parallel, partition_dim, ...
            if not key.startswith("_"):
                setattr(m, key, value)
        return m

    def master_of(self, p: torch.Tensor) -> torch.nn.Parameter:
        return self._by_param[id(p)]

    def _move_grad(self, p: torch.Tensor) -> None:
        """Add ``p.grad`` (bf16, summed by autograd over this backward) into the master's
        fp32 gradient and free it."""
        m = self._by_param[id(p)]
        if m.grad is None:
            m.grad = p.grad.to(m.dtype)
        else:
            m.grad.add_(p.grad)
        p.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the masters into the model parameters (after each step)."""
        torch._foreach_copy_(self.model_params, self.masters)

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Reset the masters to the model's values (after loading a model without the
        optimizer state; Megatron's ``reload_model_params``)."""
        torch._foreach_copy_(self.masters, self.model_params)

    def state_dict(self) -> list[torch.Tensor]:
        return [m.detach().clone() for m in self.masters]

    @torch.no_grad()
    def load_state_dict(self, masters: list[torch.Tensor]) -> None:
        if len(masters) != len(self.masters):
            raise ValueError(f"the checkpoint has {len(masters)} master weights, this model "
                             f"{len(self.masters)}")
        for m, saved in zip(self.masters, masters):
            if m.shape != saved.shape:
                raise ValueError(f"master weight of shape {tuple(saved.shape)} in the "
                                 f"checkpoint, {tuple(m.shape)} in this model")
            m.copy_(saved)


class DataParallelAdamW:
    """``torch.optim.AdamW`` with gradients averaged over ``dp_group`` before the step.

    The gradient norm sums the squares of TP-sharded parameters
    (``param.tensor_model_parallel``) over ``model_parallel_group`` and counts
    replicated ones once, like DistributedFusedAdam's. ``master_weights=True`` (the
    default for 16-bit parameters): the optimizer steps fp32 copies of the parameters
    (:class:`MasterWeights`) and rounds them into the model after each step.
    ``grad_sync_dtype``: the dtype of the all-reduce (default: the gradients').
    """

    def __init__(self, param_groups, dp_group, model_parallel_group=None,
                 bucket_cap_mb: float = 100.0, master_weights: bool | None = None,
                 grad_sync_dtype: torch.dtype | None = None, **kwargs) -> None:
        params = [p for g in param_groups for p in g["params"]]
        self._model_params = params
        if master_weights is None:
            master_weights = any(p.dtype in LOW_PRECISION for p in params)
        self.masters = MasterWeights(params) if master_weights else None
        if self.masters is not None:
            param_groups = [dict(g, params=[self.masters.master_of(p) for p in g["params"]])
                            for g in param_groups]
        on_cuda = all(p.is_cuda for p in params)
        # CUDA: torch's fused kernel (the strongest torch peer); CPU: the default.
        self.optimizer = torch.optim.AdamW(param_groups, fused=True if on_cuda else None,
                                           **kwargs)
        self.dp_group, self.model_parallel_group = dp_group, model_parallel_group
        self.grad_sync_dtype = grad_sync_dtype
        self.bucket_bytes = int(bucket_cap_mb * 2**20)
        self._synced = False
        self._skip_sync = False

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def parameters(self) -> list[torch.nn.Parameter]:
        """The model's parameters (not the masters), as DistributedFusedAdam lists them."""
        return list(self._model_params)

    def _params(self) -> Iterator[torch.nn.Parameter]:
        for group in self.optimizer.param_groups:
            yield from group["params"]

    @contextlib.contextmanager
    def no_sync(self, greedy_grad_copy: bool = False) -> Iterator[None]:
        """Nothing is communicated during backward anyway; DistributedFusedAdam's
        signature, so the example's training step drives either optimizer."""
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
                if self.grad_sync_dtype is not None:
                    flat = flat.to(self.grad_sync_dtype)
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
        if self.masters is not None:
            self.masters.copy_to_model()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self.masters is not None:
            for p in self.masters.model_params:
                p.grad = None
        self._synced = False

    def reload_model_params(self) -> None:
        """The model was loaded without this optimizer's state: masters from the model."""
        if self.masters is not None:
            self.masters.copy_from_model()

    def state_dict(self) -> dict:
        state = self.optimizer.state_dict()
        if self.masters is not None:
            state = {**state, "master_weights": self.masters.state_dict()}
        return state

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        masters = state.pop("master_weights", None)
        if self.masters is not None:
            if masters is None:  # saved without masters (fp32 run): start from the model
                self.masters.copy_from_model()
            else:
                self.masters.load_state_dict(masters)
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


def build_dp_adamw(model: torch.nn.Module, *, lr: float, weight_decay: float,
                   betas: tuple[float, float], eps: float, bucket_cap_mb: float = 100.0,
                   grad_sync_dtype: torch.dtype | None = None, **_) -> DataParallelAdamW:
    """DataParallelAdamW over ``model.param_groups(weight_decay)``, wired to
    parallel_state's data-parallel and model-parallel groups (the keyword arguments of
    ``examples.gpt.optim.build_optimizer`` it has no use for are ignored)."""
    return DataParallelAdamW(model.param_groups(weight_decay),
                             parallel_state.get_data_parallel_group(),
                             model_parallel_group=parallel_state.get_model_parallel_group(),
                             bucket_cap_mb=bucket_cap_mb, grad_sync_dtype=grad_sync_dtype,
                             lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
