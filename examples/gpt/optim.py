"""The optimizer of the GPT example, and a plain data-parallel AdamW to compare it with.

``--optimizer dfa`` (default) is :class:`mpzero.optimizers.DistributedFusedAdam`,
ZeRO-2 over parallel_state's distributed x redundant grid. ``--optimizer adamw``
is :class:`DataParallelAdamW`: ``torch.optim.AdamW`` on full replicas with the
gradients all-reduced (averaged) over the data-parallel group. It exposes the
same small interface the training loop uses (``no_sync``, ``clip_grad_norm``,
``grad_norm``, ``step``, ``zero_grad``, ``state_dict``/``load_state_dict``), so
the two are interchangeable and their losses can be compared.

With 16-bit model parameters (``--bf16``) both keep fp32 master weights:
DistributedFusedAdam in its shards (``store_params=True``; or, with
``--store-param-remainders``, as the bf16 parameter plus an int16 remainder), and
DataParallelAdamW through :class:`master_weights.MasterWeights` (fp32 copies and
fp32 gradients; the step runs on the copies and is rounded into the model).
Gradient accumulation sums in fp32 either way unless ``--grad-sync-dtype bf16``
(DistributedFusedAdam then accumulates in its bf16 buckets): see :func:`no_sync`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from mpzero import parallel_state

from .master_weights import MasterWeights

LOW_PRECISION = (torch.bfloat16, torch.float16)


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


def build_optimizer(name: str, model: torch.nn.Module, *, lr: float, weight_decay: float,
                    betas: tuple[float, float], eps: float, device: torch.device,
                    overlap_grad_sync: bool = True, overlap_param_sync: bool = False,
                    bucket_cap_mb: float = 100.0, grad_sync_dtype: torch.dtype | None = None,
                    param_sync_dtype: torch.dtype | None = None,
                    store_param_remainders: bool = False,
                    compiled_units: Sequence[torch.nn.Module] = (),
                    gradient_accumulation_fusion: bool = False):
    """The optimizer over ``model.param_groups(weight_decay)`` wired to parallel_state.

    ``grad_sync_dtype``/``param_sync_dtype`` None: fp32 gradients, and parameters
    gathered in their own dtype (bf16 parameters in bf16: the same values as rounding
    the fp32 masters after gathering them, at half the traffic).
    ``store_param_remainders``: DistributedFusedAdam keeps the fp32 masters of bf16
    parameters as the parameter plus an int16 remainder (``store_params=False``).
    ``compiled_units``: the modules whose forward is compiled; with
    ``overlap_param_sync`` each gets one forward pre-hook for all its parameters
    (``attach(unit, unit=True)``) instead of hooks inside the compiled code.
    ``gradient_accumulation_fusion``: DistributedFusedAdam keeps its gradients in one
    contiguous buffer and gives the parameters their ``main_grad`` views of it, into
    which the model's TP linear layers (built with the same option) add their weight
    gradients; call :func:`prepare_grad_accumulation_fusion` once every parameter is
    laid out (after ``pipeline.tie_embedding``)."""
    groups = model.param_groups(weight_decay)
    mp_group = parallel_state.get_model_parallel_group()
    if name == "adamw":
        if store_param_remainders:
            raise ValueError("store_param_remainders needs optimizer 'dfa'")
        if gradient_accumulation_fusion:
            raise ValueError("gradient_accumulation_fusion needs optimizer 'dfa'")
        return DataParallelAdamW(groups, parallel_state.get_data_parallel_group(),
                                 model_parallel_group=mp_group, bucket_cap_mb=bucket_cap_mb,
                                 grad_sync_dtype=grad_sync_dtype,
                                 lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if name != "dfa":
        raise ValueError(f"optimizer must be 'dfa' or 'adamw', got {name!r}")
    from mpzero.optimizers import DistributedFusedAdam

    if param_sync_dtype is None:
        dtypes = {p.dtype for g in groups for p in g["params"]}
        param_sync_dtype = dtypes.pop() if len(dtypes) == 1 else None
    opt = DistributedFusedAdam(
        groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=True,
        device=device, dtype=torch.float32, grad_sync_dtype=grad_sync_dtype,
        param_sync_dtype=param_sync_dtype,
        store_params=not store_param_remainders, store_param_remainders=store_param_remainders,
        overlap_grad_sync=overlap_grad_sync, overlap_param_sync=overlap_param_sync,
        bucket_cap_mb=bucket_cap_mb, model_parallel_group=mp_group,
        contiguous_grad_buffer=gradient_accumulation_fusion,
        **parallel_state.get_optimizer_process_groups(),
    )
    if overlap_param_sync:
        for unit in compiled_units:
            opt.attach(unit, unit=True)
        opt.attach(model)
    return opt


def prepare_grad_accumulation_fusion(optimizer) -> None:
    """Make DistributedFusedAdam's layout now: it gives every parameter its ``main_grad``
    then, so the first micro-batch's weight gradients already go straight into it."""
    params = [p for p in optimizer.parameters() if p.requires_grad]
    if params:
        optimizer.grad_buffer_view(params[0])


def no_sync(optimizer):
    """The context for all micro-batches but the last (gradient accumulation).

    DistributedFusedAdam with 16-bit parameters: ``no_sync(greedy_grad_copy=True)``,
    so each micro-batch's gradient goes at once into the optimizer's buckets, which
    hold ``grad_sync_dtype`` (fp32 by default) — accumulating in the bf16
    ``param.grad`` instead would round every partial sum to bf16. fp32 parameters
    accumulate in ``param.grad`` (fp32) and are copied once. DataParallelAdamW's
    master weights accumulate in fp32 already (their hooks)."""
    if isinstance(optimizer, DataParallelAdamW):
        return optimizer.no_sync()
    greedy = any(p.dtype in LOW_PRECISION for p in optimizer.parameters())
    return optimizer.no_sync(greedy_grad_copy=greedy)
