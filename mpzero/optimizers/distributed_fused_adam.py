"""ZeRO-2 Adam/AdamW: the public class, a facade over a few composed objects.

Flow of one training step::

    backward -> grad hook (hooks.Backward) -> gradient pipeline (grad_sync.GradSync):
                copy into the bucket, reduce-scatter over the distributed group and
                all-reduce over the redundant group as soon as a bucket (and all
                before it) is complete
    step()   -> flush the rest -> scaler / clipping folded into the grad scale (norm.py)
             -> stepper (step.py): fused Adam on every local shard of the shard store
                (shards.py), one launch per param group x dtypes
             -> parameter pipeline (param_sync.ParamSync): all-gather the updated shards
                into the parameters, now or in the next forward (hooks.ModuleHooks)

Options: one frozen dataclass (options.py); layout: layout.py; checkpoints: checkpoint.py;
state offload (``cpu_offload``): offload.py and offload_step.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim import optimizer as torch_optimizer

from mpzero import comm, torch_compat
from mpzero.collective_check import check_collective_entry
from mpzero.optimizers import checkpoint
from mpzero.optimizers.hooks import Backward, ModuleHooks
from mpzero.optimizers.layout import alignment_elements, bucket_capacity_elements
from mpzero.optimizers.layout import default_shard_size as _default_shard_size
from mpzero.optimizers.options import (
    OPTION_NAMES,
    Groups,
    Options,
    collect_params,
    resolve_device,
)
from mpzero.optimizers.pipelines import Pipelines, build_pipelines
from mpzero.optimizers.shards import GRADS, ShardStore, broadcast_params, check_fingerprint
from mpzero.optimizers.step_state import StepState


class DistributedFusedAdam(torch.optim.Optimizer):
    """Adam/AdamW with ZeRO-2 sharding of gradients and optimizer state.

    Gradients and state are sharded over ``distributed_process_group`` and replicated
    over ``redundant_process_group`` (sizes multiplying to ``process_group``'s).
    Gradients are reduce-scattered bucket by bucket during backward; after the local
    fused Adam step the updated shards are all-gathered into the parameters, at the end
    of :meth:`step` or (``overlap_param_sync`` and a ``module``) just before the next
    forward uses them. The arguments are apex's; each option is documented on
    :class:`~mpzero.optimizers.options.Options` and readable as an attribute
    (``optimizer.bucket_cap_mb``). Public attributes besides: ``groups``, ``shards``
    (the :class:`~mpzero.optimizers.shards.ShardStore`, for checkpoint tools),
    ``step_state`` and apex's read-only ones below.
    """

    _step_supports_amp_scaling = True

    # apex's read-only attributes.
    process_group_size = property(lambda self: comm.group_size(self.groups.process),
                                  doc="Ranks in ``process_group``.")
    process_group_root = property(
        lambda self: torch_compat.global_rank_of_first(self.groups.process),
        doc="Global rank of ``process_group``'s first rank.")
    alignment = property(lambda self: alignment_elements(self.options.grad_sync_dtype.itemsize),
                         doc="Elements of ``grad_sync_dtype`` in 128 bytes (fragment starts).")
    default_shard_size = property(
        lambda self: _default_shard_size(bucket_capacity_elements(
            self.options.bucket_cap_mb, self.options.grad_sync_dtype.itemsize),
            self.alignment, self.groups.distributed_size),
        doc="Elements of one rank's shard of a full bucket.")

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        dtype: torch.dtype = torch.float32,
        grad_sync_dtype: torch.dtype | None = None,
        param_sync_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        process_group: dist.ProcessGroup | None = None,
        distributed_process_group: dist.ProcessGroup | None = None,
        redundant_process_group: dist.ProcessGroup | None = None,
        average_grad_sync: bool = True,
        overlap_grad_sync: bool = True,
        overlap_param_sync: bool = False,
        bucket_cap_mb: float = 100.0,
        pipeline_size: int = 2,
        contiguous_param_buffer: bool = False,
        contiguous_grad_buffer: bool = False,
        store_params: bool = True,
        store_param_remainders: bool = False,
        with_scaled_states: bool = False,
        nccl_ub: bool = False,
        capturable: bool = False,
        module: torch.nn.Module | None = None,
        model_parallel_group: dist.ProcessGroup | None = None,
        cpu_offload: bool = False, cpu_offload_threads: int | None = None,
    ):
        arguments = dict(locals())
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors or dicts, not a tensor")
        params = list(params)
        arguments["device"] = resolve_device(device, collect_params(params))
        options = Options.from_arguments(arguments)
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction,
                                      betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for gi, g in enumerate(self.param_groups):  # options we would silently ignore
            torch_compat.check_param_group_options(g, gi, adam_w_mode=adam_w_mode)
        self.options = options
        self.groups = groups = Groups.resolve(
            process_group, distributed_process_group, redundant_process_group,
            model_parallel_group, torch_compat.tensor_parallel_rank(model_parallel_group))
        self._comm = comm.CommContext(options.device, options.pipeline_size)
        self.shards = ShardStore(options, groups, self._comm)
        self.step_state = StepState(options, self.param_groups)
        self._pipelines: Pipelines | None = None
        self._backward = Backward(options, self.shards, self.ensure_layout)
        self._modules = ModuleHooks(self.shards, options.overlap_param_sync,
                                    lambda: self._pipelines and self._pipelines.gathers)
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                self._backward.register(p, self.shards.register(p, gi))
        # Replicas start equal: the first rank's values, as DDP does. (Again when the
        # layout is made, for values changed in between, e.g. a model load.)
        check_fingerprint(self.shards.params, groups.process, options.device)
        broadcast_params(self.shards.params, groups.process)
        if module is not None:
            self.attach(module)

    def __getattr__(self, name: str):
        """The options (``optimizer.dtype``, ...) and apex's group attributes
        (``optimizer.distributed_size``, ``optimizer.process_group``, ...)."""
        d = self.__dict__
        if "options" in d and name in OPTION_NAMES:
            return getattr(d["options"], name)
        if "groups" in d and name in _GROUP_ATTRIBUTES:
            return getattr(d["groups"], _GROUP_ATTRIBUTES[name])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        """The options, then each param group's hyperparameters (as torch optimizers)."""
        lines = [f"{type(self).__name__} ("]
        lines += [f"    {k}: {v}" for k, v in self.options.items()]
        lines += [f"    {k}: {getattr(self, k)}" for k in ("distributed_size", "redundant_size")]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {k}: {group[k]}" for k in sorted(group) if k != "params"]
        lines.append(")")
        return "\n".join(lines)

    def ensure_layout(self) -> Pipelines:
        """Make the bucket layout now (a collective) unless made already (at the first
        gradient, ``step()``, ``grad_sync()``, ``state_dict()``); then ``init_params`` and
        ``add_param_group`` raise. Returns the pipelines (internal: for tools and tests)."""
        if self._pipelines is not None:
            return self._pipelines
        self._pipelines = build_pipelines(self.shards, self.step_state, self._comm,
                                          self.grad_sync)
        if self.options.contiguous_param_buffer:
            self.shards.params_to_buffer_views()
        if self.options.contiguous_grad_buffer:
            self._backward.provide_main_grads()
        self.step_state.update_mirror(self.state, [self.shards.params[i] for i in self.shards.keys])
        return self._pipelines

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (``torch.optim.Optimizer`` API). Allowed until the layout
        is made (first gradient hook, ``step()``, ``state_dict()``); after that the
        buckets are fixed and this raises."""
        if "shards" not in self.__dict__:  # called by torch.optim.Optimizer.__init__
            super().add_param_group(param_group)
            return
        if self.shards.built:
            raise RuntimeError("add_param_group: the bucket layout is already made (by a "
                               "gradient hook, step(), state_dict() or grad_sync()); add "
                               "every param group before the first backward")
        torch_compat.check_param_group_options(param_group, len(self.param_groups),
                                               adam_w_mode=self.options.adam_w_mode)
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        for p in self.param_groups[gi]["params"]:
            self._backward.register(p, self.shards.register(p, gi))
        if self.options.capturable:
            self.step_state.device_lr(gi)
        if self._modules.attached:  # the forward pre-hooks must know the new parameters too
            self._modules.rehook()

    def parameters(self) -> list[torch.Tensor]:
        """Every parameter of every param group, in order."""
        return list(self.shards.params)

    def parameter(self, group_id: int, param_id: int) -> torch.Tensor:
        """Parameter ``param_id`` of param group ``group_id``."""
        return self.param_groups[group_id]["params"][param_id]

    def init_params(self, params=None, dtype=None, grad_sync_dtype=None,
                    param_sync_dtype=None) -> None:
        """Lay out ``params`` (default: all not laid out yet, reverse param-group order) now,
        in the order given, skipping those laid out already. ``grad_sync_dtype`` /
        ``param_sync_dtype`` put them in buckets of those dtypes (``None``: the optimizer's
        own, as in apex); ``dtype`` may only repeat the optimizer's (``ValueError``
        otherwise). Buckets not syncing bf16 keep an fp32 master even with remainders."""
        if params is None:
            params = self.shards.remaining_params()
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        key = self.shards.bucket_key(dtype, grad_sync_dtype, param_sync_dtype)
        self.shards.lay_out(params, key)

    def init_params_bucket(self, params, dtype=None, grad_sync_dtype=None,
                           param_sync_dtype=None) -> None:
        """Lay out ``params`` in fresh bucket(s) of their own that communicate together."""
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        key = self.shards.bucket_key(dtype, grad_sync_dtype, param_sync_dtype)
        self.shards.lay_out(params, key, own_bucket=True)

    def init_param_buffer(self) -> None:
        """Make every parameter a view into one persistent buffer per dtype key
        (``contiguous_param_buffer=True``): the all-gather then writes straight into the
        parameters. Done at layout time; calling it earlier fixes the layout now."""
        if not self.options.contiguous_param_buffer:
            raise RuntimeError("init_param_buffer needs contiguous_param_buffer=True")
        self.ensure_layout()

    def grad_buffer_view(self, param: torch.Tensor) -> torch.Tensor:
        """``param``-shaped view of the contiguous gradient buffer (``grad_sync_dtype``)."""
        if not self.options.contiguous_grad_buffer:
            raise RuntimeError("grad_buffer_view needs contiguous_grad_buffer=True")
        self.ensure_layout()
        return self.shards.buffer_view(GRADS, self.shards.index[id(param)])

    def no_sync(self, greedy_grad_copy: bool = False):
        """Accumulate gradients without communicating (all micro-batches but the last).

        Gradients stay in ``param.grad`` unless ``greedy_grad_copy=True``, which adds
        them into the bucket buffers at once (less memory for models that fit)."""
        return self._backward.no_sync(greedy_grad_copy)

    def grad_sync(self) -> None:
        """Synchronize every gradient not yet synchronized (all ranks must call it)."""
        pipes = self.ensure_layout()
        self.param_sync()  # pending gathers go out before the reduce-scatters, on every rank
        self._backward.copy_pending(pipes.grads)
        pipes.grads.flush()  # bumps the gradient version (the norm cache key) if it syncs

    def grad_shards(self, param: torch.Tensor) -> list[torch.Tensor]:
        """After :meth:`grad_sync` (a collective), this rank's synchronized gradient shards
        of the bucket(s) holding ``param``, in bucket order; the step reads what they hold
        (e.g. a pipeline's tied embedding sums them over its stages). Whole bucket shards:
        ``init_params_bucket([param])`` gives ``param`` buckets of its own."""
        self.grad_sync()
        return self.ensure_layout().grads.shards_of(self.shards.index[id(param)])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (bucket shards, ``param.grad``, the contiguous buffer: what is
        written into :meth:`grad_buffer_view` afterwards joins the next sync). Leaves the
        parameter gathers pending, for the forward pre-hooks."""
        for p in self.shards.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        if self._pipelines is not None:
            self._pipelines.grads.reset()
            self._pipelines.norm.cache = None
        self.step_state.reset_scale()
        self._backward.stepped = False

    def param_sync(self) -> None:
        """Finish every pending parameter gather (all ranks must call it)."""
        if self._pipelines is not None and self._pipelines.gathers.pending():
            self._pipelines.gathers.sync_all()

    def attach(self, module: torch.nn.Module, *, unit: bool = False) -> None:
        """Drive ``overlap_param_sync`` from ``module``'s forward pre-hooks: each submodule
        gathers its parameters' buckets (one ahead) just before its forward. ``unit=True``:
        one pre-hook on ``module`` gathers everything under it and its submodules get none
        (for a ``torch.compile``'d module, where submodule hooks would break the graph)."""
        self._modules.attach(module, unit)

    def grad_norm(self, parameters=None, norm_type: float = 2.0,
                  force: bool = False) -> torch.Tensor:
        """2-norm of the synchronized gradients of ``parameters`` (``None``: all) times the
        pending grad scale, a 0-dim fp32 device tensor. Cached until the gradients change:
        a repeated call runs no collective (it may be made on one rank, e.g. to log)."""
        return self.ensure_layout().norm.norm(parameters, norm_type, force)

    def clip_grad_norm(self, max_norm: float, parameters=None,
                       norm_type: float = 2.0) -> torch.Tensor:
        """Total gradient norm; folds ``min(1, max_norm / (norm + 1e-6))`` into the grad
        scale so the clipping costs no pass over the gradients."""
        return self.ensure_layout().norm.clip(max_norm, parameters, norm_type)

    def unscale_grads(self, inv_scale: torch.Tensor | float | None = None,
                      grad_scaler=None) -> dict:
        """Fold a gradient unscale into the grad scale (GradScaler integration).

        Exactly one of ``inv_scale`` (the factor) and ``grad_scaler`` (a
        ``torch.amp.GradScaler``: its inverse scale, and the inf/NaN found recorded in its
        state so ``scaler.step()`` skips and ``update()`` backs off); ``ValueError``
        otherwise. Between backward and :meth:`step` only (raises after ``step()``). A
        collective; returns apex's ``{device: flag}`` (1.0 when any rank's synchronized
        gradient is inf/NaN), ``{}`` for a disabled scaler."""
        if (inv_scale is None) == (grad_scaler is None):
            raise ValueError("unscale_grads: give exactly one of inv_scale= and grad_scaler= "
                             f"(got {'both' if inv_scale is not None else 'neither'})")
        if self._backward.stepped:
            raise RuntimeError(
                "unscale_grads() called after step() for the same gradients: the unscale "
                "would apply to the next step's gradients. Call it after backward() and "
                "before step() (or scaler.step(optimizer)).")
        return self.ensure_layout().norm.unscale(inv_scale, grad_scaler, self)

    def step(self, closure=None, *, grad_scaler=None):
        """One optimizer step (the module docstring has the flow). Step hooks and the
        profiler's range work as for torch optimizers; without them the step skips
        torch's per-call wrapper (a share of the step's host time)."""
        if _observed(self):
            return _observed_step(self, closure, grad_scaler=grad_scaler)
        return _step(self, closure, grad_scaler=grad_scaler)

    # torch.optim.Optimizer wraps a class's step() unless it is marked "hooked": this one
    # calls torch's wrapper itself, when hooks or the profiler need it.
    step.hooked = True

    def state_dict(self, gather_on_root: bool | None = None,
                   state_dict_format: int | None = None) -> dict:
        """Format-2 state dict (``checkpoint.py``), the same on every rank (all must call
        it). apex's keywords are accepted: every rank gets the full state whatever
        ``gather_on_root`` says, and format 2 (or ``None``) is the one format written."""
        del gather_on_root
        # Fail in bounded time, not hang, when only some ranks call it (e.g. rank 0 alone).
        check_collective_entry("state_dict()", self.process_group)
        self.ensure_layout()
        self.param_sync()
        return checkpoint.gather_state_dict(self, state_dict_format)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load optimizer state and param groups saved by :meth:`state_dict` on any grid
        (or a ``torch.optim.Adam``/``AdamW`` state dict). All or nothing across ranks."""
        gathers = self.ensure_layout().gathers
        self.param_sync()
        checkpoint.load_state_dict(self, state_dict, gathers.mark_stale)
        self.step_state.after_load()
        self.param_sync()  # with remainders the parameters come from the loaded masters

    def sharded_state_dict(self) -> dict:
        """This rank's shard pieces only (what ``mpzero.checkpoint.dcp`` saves per rank)."""
        self.ensure_layout()
        self.param_sync()
        return checkpoint.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dicts: list[dict]) -> None:
        """Load from the :meth:`sharded_state_dict` of every rank of any grid (or any set
        of pieces covering this rank's shards). All or nothing across ranks."""
        gathers = self.ensure_layout().gathers
        self.param_sync()
        checkpoint.load_sharded_state_dict(self, state_dicts, gathers.mark_stale)
        self.step_state.after_load()
        self.param_sync()


_GROUP_ATTRIBUTES = {"process_group": "process", "distributed_process_group": "distributed",
                     "redundant_process_group": "redundant",
                     "model_parallel_group": "model_parallel",
                     "distributed_size": "distributed_size",
                     "distributed_rank": "distributed_rank", "redundant_size": "redundant_size"}


def _step(opt: DistributedFusedAdam, closure=None, *, grad_scaler=None):
    """The body of :meth:`DistributedFusedAdam.step` (a function, so that torch's hook
    wrapper can wrap it once)."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    pipes = opt.ensure_layout()
    opt.grad_sync()
    opt._backward.stepped = True
    pipes.stepper.step(pipes.norm, grad_scaler, opt, opt._modules.deferring())
    return loss


_observed_step = torch.optim.Optimizer.profile_hook_step(_step)


def _observed(opt) -> bool:
    """Step hooks are registered (on ``opt`` or globally) or the profiler is on."""
    return bool(opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                or torch_optimizer._global_optimizer_pre_hooks
                or torch_optimizer._global_optimizer_post_hooks
                or torch._C._autograd._profiler_enabled())
