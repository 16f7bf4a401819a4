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

Options are one frozen dataclass (options.py); which element lives where is the pure
function of layout.py; checkpoints are checkpoint.py (+ state_checks.py).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.optim import optimizer as torch_optimizer

from mpzero import comm
from mpzero.collective_check import check_collective_entry
from mpzero.optimizers import checkpoint, torch_compat
from mpzero.optimizers.grad_bucket import GradStorage
from mpzero.optimizers.grad_sync import GradSync
from mpzero.optimizers.hooks import Backward, ModuleHooks, Pipelines
from mpzero.optimizers.layout import alignment_elements, bucket_capacity_elements
from mpzero.optimizers.layout import default_shard_size as _default_shard_size
from mpzero.optimizers.norm import GradNorm
from mpzero.optimizers.options import (
    OPTION_NAMES,
    Groups,
    Options,
    collect_params,
    resolve_device,
)
from mpzero.optimizers.param_sync import ParamSync
from mpzero.optimizers.shards import GRADS, PARAMS, ShardStore, broadcast_params, check_fingerprint
from mpzero.optimizers.step import Stepper
from mpzero.optimizers.step_state import StepState
from mpzero.warn import user_stacklevel


class DistributedFusedAdam(torch.optim.Optimizer):
    """Adam/AdamW with ZeRO-2 sharding of gradients and optimizer state.

    Gradients and optimizer state are sharded over ``distributed_process_group``
    and replicated over ``redundant_process_group`` (their sizes multiply to the
    size of ``process_group``). Gradients are reduce-scattered bucket by bucket
    during backward (``overlap_grad_sync``); after the local fused Adam step the
    updated shards are all-gathered into the parameters, at the end of
    :meth:`step` or, with ``overlap_param_sync`` and a ``module``, just before
    the next forward pass uses them.

    Args mirror apex's ``DistributedFusedAdam`` (each option is documented on
    :class:`~mpzero.optimizers.options.Options`, readable here as an attribute, e.g.
    ``optimizer.bucket_cap_mb``, and fixed after construction): ``lr``,
    ``bias_correction``, ``betas``, ``eps``, ``weight_decay`` (param-group
    hyperparameters); ``process_group`` / ``distributed_process_group`` /
    ``redundant_process_group``; ``module`` (whose forward pre-hooks drive
    ``overlap_param_sync``) and ``model_parallel_group`` (TP/PP group the gradient
    norm also reduces over).

    Public attributes besides the options: ``groups`` (the process groups),
    ``shards`` (the :class:`~mpzero.optimizers.shards.ShardStore`: layout and this
    rank's state, for checkpoint tools), ``step_state`` (step count, learning rates,
    grad scale), and apex's ``process_group_size``, ``process_group_root``,
    ``alignment``, ``default_shard_size``, ``distributed_size``, ``distributed_rank``,
    ``redundant_size``.
    """

    _step_supports_amp_scaling = True

    # apex's read-only attributes.
    process_group_size = property(lambda self: comm.group_size(self.groups.process),
                                  doc="Ranks in ``process_group`` (distributed x redundant).")
    process_group_root = property(
        lambda self: torch_compat.global_rank_of_first(self.groups.process),
        doc="Global rank of ``process_group``'s first rank (the parameter broadcast's source).")
    alignment = property(lambda self: alignment_elements(self.options.grad_sync_dtype.itemsize),
                         doc="Elements of ``grad_sync_dtype`` in 128 bytes: every fragment "
                             "starts at a multiple of it.")
    default_shard_size = property(
        lambda self: _default_shard_size(bucket_capacity_elements(
            self.options.bucket_cap_mb, self.options.grad_sync_dtype.itemsize),
            self.alignment, self.groups.distributed_size),
        doc="Elements of one rank's shard of a full bucket (``bucket_cap_mb`` over the "
            "distributed ranks, rounded up to the alignment).")

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
        # apex's attributes.
        self.process_group, self.distributed_process_group = groups.process, groups.distributed
        self.redundant_process_group = groups.redundant
        self.model_parallel_group = model_parallel_group
        self.distributed_size, self.distributed_rank = (groups.distributed_size,
                                                        groups.distributed_rank)
        self.redundant_size = groups.redundant_size

        self._comm = comm.CommContext(options.device, options.pipeline_size)
        self.shards = ShardStore(options, groups, self._comm)
        self.step_state = StepState(options, self.param_groups)
        self._pipelines: Pipelines | None = None
        self._backward = Backward(options, self.shards, self.ensure_layout)
        self._modules = ModuleHooks(
            self.shards, lambda: self._pipelines and self._pipelines.gathers)
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
        """The options (``optimizer.dtype``, ``optimizer.bucket_cap_mb``, ...) as read-only
        attributes, as apex has them."""
        options = self.__dict__.get("options")
        if options is not None and name in OPTION_NAMES:
            return getattr(options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        """The options, then each param group's hyperparameters (as torch optimizers)."""
        lines = [f"{type(self).__name__} ("]
        lines += [f"    {k}: {v}" for k, v in self.options.items()]
        lines += [f"    distributed_size: {self.distributed_size}",
                  f"    redundant_size: {self.redundant_size}"]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {k}: {group[k]}" for k in sorted(group) if k != "params"]
        lines.append(")")
        return "\n".join(lines)

    def ensure_layout(self) -> Pipelines:
        """Make the bucket layout now if it is not made yet: a collective (every rank calls
        it), otherwise made at the first gradient, ``step()``, ``grad_sync()`` or
        ``state_dict()``. After it ``init_params`` and ``add_param_group`` raise. Returns
        the pipelines working on the layout (internal objects: for tools and tests)."""
        if self._pipelines is not None:
            return self._pipelines
        store, o, g = self.shards, self.options, self.groups
        store.build()
        grad_views = store.bucket_buffers(GRADS) or [None] * len(store.layouts)
        storages = []
        for lay, view in zip(store.layouts, grad_views):
            incoming = None
            if store.nccl_pool is not None:  # reduce-scatter outputs from the same pool
                with store.nccl_pool.allocate():
                    incoming = torch.empty(lay.shard_size, dtype=lay.key.grad, device=o.device)
            storages.append(GradStorage(view, incoming, o.capturable, g.local_only))
        if store.nccl_pool is not None:
            store.nccl_pool.register()
        grads = GradSync(store.layouts, storages, store.fragments, o.device, self._comm,
                         g.distributed, g.redundant, g.distributed_rank, o.average_grad_sync)
        gathers = ParamSync(store.layouts, [lay.key.param for lay in store.layouts], o.device,
                            self._comm, g.distributed, g.distributed_rank, store.params,
                            persistent=store.bucket_buffers(PARAMS))
        norm = GradNorm(store, grads, g, self.step_state, self.grad_sync)
        self._pipelines = Pipelines(grads, gathers, norm,
                                    Stepper(o, store, grads, gathers, self.step_state))
        if o.contiguous_param_buffer:
            store.params_to_buffer_views()
        if o.contiguous_grad_buffer:
            self._backward.provide_main_grads()
        self.step_state.update_mirror(self.state, [store.params[i] for i in store.keys])
        return self._pipelines

    # -- param groups and layout -----------------------------------------------------
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
        """Lay out ``params`` now, in the order given (optionally with their own sync dtypes).

        ``params=None``: every parameter not laid out yet, in the default (reverse
        param-group) order; a tensor or an iterable of them otherwise. Parameters laid
        out already are skipped. ``grad_sync_dtype`` / ``param_sync_dtype`` put these
        parameters in buckets of those dtypes; each left ``None`` is the optimizer's own
        option (as in apex, not ``dtype``). ``dtype`` (the state dtype) may only repeat the
        optimizer's ``dtype``: anything else raises ``ValueError``, as apex does. Buckets
        whose param-sync dtype differs from the optimizer's keep an fp32 master even with
        ``store_param_remainders`` (remainders need bf16 parameters)."""
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

    # -- gradients -------------------------------------------------------------------
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
        """This rank's synchronized gradient shards of the bucket(s) holding ``param``,
        in bucket order, after :meth:`grad_sync` (a collective: every rank calls it).
        Changing them in place changes what the step reads: e.g. a pipeline's tied
        embedding sums them over its embedding group. Each is a whole bucket's shard:
        lay ``param`` out alone (``init_params_bucket([param])``) to get only its values."""
        self.grad_sync()
        return self.ensure_layout().grads.shards_of(self.shards.index[id(param)])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (bucket shards and ``param.grad``). Leaves parameter
        gathers pending, for the forward pre-hooks.

        With ``contiguous_grad_buffer=True`` the gradient lives in the persistent
        buffer (``param.grad`` stays ``None``, ZeRO-2 frees it): zero_grad zeroes the
        buffer, and whatever is written into :meth:`grad_buffer_view` afterwards is
        what the next sync reduces (added to what backward accumulates there)."""
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
        """Drive ``overlap_param_sync`` from ``module``'s forward pre-hooks: each
        submodule gathers the buckets of its own parameters (prefetching one ahead)
        just before its forward runs.

        ``unit=True``: one pre-hook on ``module`` itself gathers every parameter under
        it, and its submodules get no hook (also not from other ``attach`` calls, in
        either order). Use it for a module whose ``forward`` is ``torch.compile``'d:
        its own hooks run eagerly around the compiled code, while its submodules'
        hooks would run inside it, where each distinct hook splits the graph or
        forces a recompilation (e.g. ``attach(block, unit=True)`` for each compiled
        transformer block, then ``attach(model)`` for the rest)."""
        self._modules.attach(module, unit)

    # -- norms and AMP ---------------------------------------------------------------
    def grad_norm(self, parameters=None, norm_type: float = 2.0,
                  force: bool = False) -> torch.Tensor:
        """2-norm of the synchronized gradients (times the pending grad scale), as a
        0-dim fp32 tensor on the optimizer's device.

        ``parameters``: any iterable (e.g. ``model.parameters()``); ``None`` = all.
        Cached until gradients change: a second call for the same gradients runs no
        collective, so it may be made on one rank only (e.g. for logging)."""
        if float(norm_type) != 2.0:
            raise ValueError(f"grad_norm: only norm_type=2.0 is supported, got {norm_type!r}")
        if parameters is not None:
            parameters = ([parameters] if isinstance(parameters, torch.Tensor)
                          else list(parameters))
        return self.ensure_layout().norm.norm(parameters, force)

    def clip_grad_norm(self, max_norm: float, parameters=None,
                       norm_type: float = 2.0) -> torch.Tensor:
        """Total gradient norm; folds ``min(1, max_norm / (norm + 1e-6))`` into the grad
        scale so the clipping costs no pass over the gradients."""
        if isinstance(max_norm, torch.Tensor):
            max_norm = float(max_norm)
        if not max_norm > 0:  # also NaN
            raise ValueError(
                f"clip_grad_norm(max_norm={max_norm!r}): max_norm must be positive (a negative "
                "one would turn the step uphill, zero would zero it); to log the norm without "
                "clipping call grad_norm()")
        if float(norm_type) != 2.0:
            raise ValueError(f"grad_norm: only norm_type=2.0 is supported, got {norm_type!r}")
        if parameters is not None:
            parameters = ([parameters] if isinstance(parameters, torch.Tensor)
                          else list(parameters))
        return self.ensure_layout().norm.clip(max_norm, parameters)

    def unscale_grads(self, inv_scale: torch.Tensor | float | None = None,
                      grad_scaler=None) -> dict:
        """Fold a gradient unscale into the grad scale (GradScaler integration).

        Give exactly one of ``inv_scale`` (the factor to multiply the gradients by) and
        ``grad_scaler`` (a ``torch.amp.GradScaler``: its inverse scale is used, and the
        inf/NaN found is recorded in its per-optimizer state, so ``scaler.step()`` skips
        and ``scaler.update()`` backs off); ``ValueError`` otherwise. Call it between
        the backward pass and :meth:`step`: after ``step()`` (before the next
        gradients or ``zero_grad()``) it raises, since the factor would fall on the next
        step's gradients.

        Returns the found-inf flags as apex does, ``{device: flag}`` with a one-element
        fp32 tensor that is 1.0 when any synchronized gradient of any rank is inf/NaN
        (a collective: every rank calls it). A disabled scaler (``enabled=False``) does
        nothing and returns ``{}``, as ``GradScaler.unscale_`` does nothing."""
        if (inv_scale is None) == (grad_scaler is None):
            raise ValueError("unscale_grads: give exactly one of inv_scale= and grad_scaler= "
                             f"(got {'both' if inv_scale is not None else 'neither'})")
        if self._backward.stepped:
            raise RuntimeError(
                "unscale_grads() called after step() for the same gradients: the unscale "
                "would apply to the next step's gradients. Call it after backward() and "
                "before step() (or scaler.step(optimizer)).")
        return self.ensure_layout().norm.unscale(inv_scale, grad_scaler, self)

    # -- the step ----------------------------------------------------------------------
    def step(self, closure=None, *, grad_scaler=None):
        """One optimizer step (see the module docstring for the flow).

        Step pre/post hooks (``register_step_pre_hook``, the global ones) and the
        profiler's ``Optimizer.step#...`` range work as for torch optimizers; without
        any of them the step skips torch's per-call wrapper (a measurable share of the
        host time of a step)."""
        if _observed(self):
            return _observed_step(self, closure, grad_scaler=grad_scaler)
        return _step(self, closure, grad_scaler=grad_scaler)

    # torch.optim.Optimizer wraps a class's step() unless it is marked "hooked": this one
    # calls torch's wrapper itself, when hooks or the profiler need it.
    step.hooked = True

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self, gather_on_root: bool | None = None,
                   state_dict_format: int | None = None) -> dict:
        """Format-2 state dict (see ``checkpoint.py``): every rank must call it and every
        rank returns the same dict.

        ``gather_on_root`` and ``state_dict_format`` are the reference's keywords,
        accepted so its users' code runs unchanged: every rank gets the full state
        whatever ``gather_on_root`` says (the reference returns it on the root only,
        so saving on the root works the same), and format 2 (or ``None``) is the one
        format written; anything else raises."""
        if state_dict_format not in (None, checkpoint.FORMAT):
            raise ValueError(f"state_dict(state_dict_format={state_dict_format!r}): only "
                             f"format {checkpoint.FORMAT} is written")
        del gather_on_root
        # Fail in bounded time, not hang, when only some ranks call it (e.g. rank 0 alone).
        check_collective_entry("state_dict()", self.process_group)
        self.ensure_layout()
        self.param_sync()
        sd = checkpoint.gather_state_dict(self)
        for group in sd["param_groups"]:  # capturable: the device lr saves as a number
            if isinstance(group.get("lr"), torch.Tensor):
                group["lr"] = float(group["lr"])
        return sd

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


def _step(opt: DistributedFusedAdam, closure=None, *, grad_scaler=None):
    """The body of :meth:`DistributedFusedAdam.step` (a function of this module, so that
    torch's hook wrapper can wrap it once)."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    pipes = opt.ensure_layout()
    opt.param_sync()
    opt.grad_sync()
    state, capturable = opt.step_state, opt.options.capturable
    found_inf = None
    if grad_scaler is not None:
        found_inf = pipes.norm.scaler_found_inf(grad_scaler, opt)
        if not capturable and found_inf.item():
            state.reset_scale()  # skipped: same decision on every rank
            opt._backward.stepped = True
            return loss
    state.advance(found_inf)
    deferred = opt.options.overlap_param_sync and opt._modules.active
    if opt.options.overlap_param_sync and not deferred and not opt._modules.warned_no_module:
        opt._modules.warned_no_module = True
        warnings.warn("overlap_param_sync=True but no module is attached (module= or "
                      "attach(module)): parameters are gathered at the end of step()",
                      stacklevel=user_stacklevel())
    # torch.no_grad() without its two per-call objects (what its __enter__/__exit__ do).
    grad_mode = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        pipes.stepper.run(found_inf if capturable else None, deferred)
    finally:
        torch._C._set_grad_enabled(grad_mode)
    state.update_mirror()
    pipes.grads.mark_stepped()
    state.reset_scale()
    pipes.norm.cache = None
    opt._backward.stepped = True
    return loss


_observed_step = torch.optim.Optimizer.profile_hook_step(_step)


def _observed(opt) -> bool:
    """Step hooks are registered (on ``opt`` or globally) or the profiler is on."""
    return bool(opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                or torch_optimizer._global_optimizer_pre_hooks
                or torch_optimizer._global_optimizer_post_hooks
                or torch._C._autograd._profiler_enabled())
