"""ZeRO-2 Adam/AdamW: the public optimizer class. Orchestration only.

Flow of one training step::

    backward -> grad hook (copy into bucket)       grad_sync.GradSync
             -> reduce-scatter over the distributed group, all-reduce over the
                redundant group, as soon as a bucket (and all before it) is complete
    step()   -> flush the rest -> scaler / clipping folded into grad_scale
             -> kernels.adam on every local shard (one launch per group x dtypes)
             -> all-gather the updated shards into the parameters
                (now, or in the next forward through module pre-hooks)   param_sync.ParamSync

Layout (which element lives where) is the pure function in ``layout.py``;
checkpoints are in ``checkpoint.py``; option checks in ``options.py``.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist

from mpzero import comm
from mpzero.optimizers import checkpoint, torch_compat
from mpzero.optimizers.flat import flat_like, is_dense
from mpzero.optimizers.layout import (
    LayoutBuilder,
    alignment_elements,
    bucket_capacity_elements,
    default_shard_size,
)
from mpzero.optimizers.layout_state import LayoutMixin
from mpzero.optimizers.options import OptionError, check_options, check_sync_dtypes
from mpzero.optimizers.step import StepMixin


def _weak_hook(obj, method: str, *bound):
    """A hook calling ``obj.method(*bound, *args)`` that does not keep ``obj`` alive.

    Parameters keep their post-accumulate-grad hooks on the C++ side, where the
    garbage collector cannot see them, so a hook holding the optimizer would make
    optimizer -> params -> hook -> optimizer an uncollectable cycle: a dropped
    optimizer (and its state) would never be freed. Once the optimizer is gone the
    hook does nothing.
    """
    ref = weakref.ref(obj)

    def hook(*args):
        target = ref()
        if target is not None:
            return getattr(target, method)(*bound, *args)
        return None

    return hook


class DistributedFusedAdam(StepMixin, LayoutMixin, torch.optim.Optimizer):
    """Adam/AdamW with ZeRO-2 sharding of gradients and optimizer state.

    Gradients and optimizer state are sharded over ``distributed_process_group``
    and replicated over ``redundant_process_group`` (their sizes multiply to the
    size of ``process_group``). Gradients are reduce-scattered bucket by bucket
    during backward (``overlap_grad_sync``); after the local fused Adam step the
    updated shards are all-gathered into the parameters, at the end of
    :meth:`step` or, with ``overlap_param_sync`` and a ``module``, just before
    the next forward pass uses them.

    Args mirror apex's ``DistributedFusedAdam``: ``lr``, ``bias_correction``,
    ``betas``, ``eps``, ``adam_w_mode`` (decoupled decay; ``False`` gives L2
    Adam), ``weight_decay``; ``dtype`` of the optimizer state,
    ``grad_sync_dtype``/``param_sync_dtype`` of the collectives (``None``:
    ``dtype``); ``device`` of the state (``None``: the parameters');
    ``average_grad_sync`` (mean or sum over ``process_group``);
    ``bucket_cap_mb`` (MiB of ``grad_sync_dtype`` per bucket); ``pipeline_size``
    (collectives in flight / side streams); ``store_params`` (keep a master copy);
    ``module`` (whose forward pre-hooks drive ``overlap_param_sync``) and
    ``model_parallel_group`` (TP/PP group the gradient norm also reduces over).
    """

    _step_supports_amp_scaling = True

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
        options = dict(locals())
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors or dicts, not a tensor")
        params = list(params)
        param_list = _collect_params(params)
        device = _resolve_device(device, param_list)
        options["device"] = device
        check_options(options)
        self.dtype, self.grad_sync_dtype, self.param_sync_dtype = check_sync_dtypes(
            dtype, grad_sync_dtype, param_sync_dtype)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        for gi, g in enumerate(self.param_groups):  # options we would silently ignore
            torch_compat.check_param_group_options(g, gi, adam_w_mode=adam_w_mode)
        self.device = device
        self.adam_w_mode = adam_w_mode
        self.average_grad_sync = average_grad_sync
        self.overlap_grad_sync = overlap_grad_sync
        self.overlap_param_sync = overlap_param_sync
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.pipeline_size = pipeline_size
        self.store_params = store_params
        self.store_param_remainders = store_param_remainders
        self.with_scaled_states = with_scaled_states
        self.contiguous_grad_buffer = contiguous_grad_buffer
        self.contiguous_param_buffer = contiguous_param_buffer
        self.nccl_ub = nccl_ub
        self.model_parallel_group = model_parallel_group
        # Decides whether gradients are copied into buckets as soon as they are ready;
        # no_sync() turns it off (unless asked) so they accumulate in param.grad.
        self.greedy_grad_copy = True
        self._no_sync = False
        self._round_close_queued = False
        self._grads_held = False  # some gradient waits in param.grad (no_sync)
        self._stepped = False  # step() ran and no gradient (nor zero_grad) came since
        self._backward_seen = False  # the first backward's one-time checks are done
        self._main_grads = False  # parameters carry main_grad (contiguous_grad_buffer)

        self._groups = _resolve_groups(process_group, distributed_process_group,
                                       redundant_process_group)
        self.process_group, self.distributed_process_group, self.redundant_process_group = (
            self._groups)
        self.distributed_size = comm.group_size(self.distributed_process_group)
        self.distributed_rank = comm.group_rank(self.distributed_process_group)
        self.redundant_size = comm.group_size(self.redundant_process_group)

        self._params: list[torch.Tensor] = []
        self._group_of: list[int] = []
        self._index: dict[int, int] = {}
        self._grad_hooks: list = []
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                self._register_param(p, gi)
        self._keys: dict[int, tuple] = {}
        self._builder: LayoutBuilder | None = None
        self._built = False
        self.capturable = capturable
        self._found_inf_for_kernels: torch.Tensor | None = None
        self._steps = 0
        # capturable: the step count lives on the device and skipped steps (found inf)
        # do not advance it, without a host sync.
        self._step_t = torch.zeros((), dtype=torch.float32, device=device) if capturable else None
        self._grad_scale = torch.ones((), dtype=torch.float32, device=device)
        self._grad_scaled = False  # _grad_scale != 1 (clipping or an unscale folded in)
        self._norm_cache: tuple[int, torch.Tensor] | None = None
        self._warned_no_module = False
        self._module_hooks: list = []
        self._attached: list[tuple[torch.nn.Module, bool]] = []  # (module, unit)
        self._comm = comm.CommContext(device, pipeline_size)
        # capturable: each group's lr is a 0-dim device tensor that the kernels read and
        # LR schedulers update in place (``group["lr"].fill_(...)``), so a CUDA graph
        # replays the current lr, not the one of capture time.
        self._lr_tensors: list[torch.Tensor | None] = [None] * len(self.param_groups)
        if capturable:
            for gi in range(len(self.param_groups)):
                self._device_lr(gi)
        # Replicas start equal: the first rank's values, as DDP does. (Again when the
        # layout is made, for values changed in between, e.g. a model load.)
        self._check_fingerprint()
        self._broadcast_params()
        if module is not None:
            self.attach(module)

    # -- read-only attributes apex code reads ----------------------------------------
    @property
    def process_group_size(self) -> int:
        """Ranks in ``process_group`` (distributed x redundant)."""
        return comm.group_size(self.process_group)

    @property
    def process_group_root(self) -> int:
        """Global rank of ``process_group``'s first rank (the source of the parameter
        broadcast)."""
        pg = self.process_group
        if pg is None or pg is comm.SELF or not (dist.is_available() and dist.is_initialized()):
            return 0
        return dist.get_global_rank(pg, 0)

    @property
    def alignment(self) -> int:
        """Elements of ``grad_sync_dtype`` in 128 bytes: every fragment starts at a
        multiple of it."""
        return alignment_elements(self.grad_sync_dtype.itemsize)

    @property
    def default_shard_size(self) -> int:
        """Elements of one rank's shard of a full bucket of the optimizer's dtypes
        (``bucket_cap_mb`` over the distributed ranks, rounded up to the alignment)."""
        capacity = bucket_capacity_elements(self.bucket_cap_mb, self.grad_sync_dtype.itemsize)
        return default_shard_size(capacity, self.alignment, self.distributed_size)

    def __repr__(self) -> str:
        """The options, then each param group's hyperparameters (as torch optimizers)."""
        options = dict(
            adam_w_mode=self.adam_w_mode, dtype=self.dtype,
            grad_sync_dtype=self.grad_sync_dtype, param_sync_dtype=self.param_sync_dtype,
            device=self.device, distributed_size=self.distributed_size,
            redundant_size=self.redundant_size, average_grad_sync=self.average_grad_sync,
            overlap_grad_sync=self.overlap_grad_sync,
            overlap_param_sync=self.overlap_param_sync, bucket_cap_mb=self.bucket_cap_mb,
            pipeline_size=self.pipeline_size,
            contiguous_param_buffer=self.contiguous_param_buffer,
            contiguous_grad_buffer=self.contiguous_grad_buffer,
            store_params=self.store_params, store_param_remainders=self.store_param_remainders,
            with_scaled_states=self.with_scaled_states, nccl_ub=self.nccl_ub,
            capturable=self.capturable)
        lines = [f"{type(self).__name__} ("]
        lines += [f"    {k}: {v}" for k, v in options.items()]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {k}: {group[k]}" for k in sorted(group) if k != "params"]
        lines.append(")")
        return "\n".join(lines)

    def _register_param(self, p: torch.Tensor, group: int) -> None:
        if p.requires_grad and not is_dense(p):
            raise OptionError("params: every parameter must be dense in memory, contiguous "
                              "in some dimension order such as channels_last (got one of shape "
                              f"{tuple(p.shape)} and stride {p.stride()})")
        i = len(self._params)
        self._params.append(p)
        self._group_of.append(group)
        self._index[id(p)] = i
        if p.requires_grad:
            self._grad_hooks.append(
                p.register_post_accumulate_grad_hook(_weak_hook(self, "_on_grad_ready", i)))

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (``torch.optim.Optimizer`` API). Allowed until the layout
        is made (first gradient hook, ``step()``, ``state_dict()``); after that the
        buckets are fixed and this raises."""
        if not hasattr(self, "_index"):  # called by torch.optim.Optimizer.__init__
            super().add_param_group(param_group)
            return
        if self._built:
            raise RuntimeError("add_param_group: the bucket layout is already made (by a "
                               "gradient hook, step(), state_dict() or grad_sync()); add "
                               "every param group before the first backward")
        torch_compat.check_param_group_options(param_group, len(self.param_groups),
                                               adam_w_mode=self.adam_w_mode)
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        for p in self.param_groups[gi]["params"]:
            self._register_param(p, gi)
        if self._attached:  # the forward pre-hooks must know the new parameters too
            self._hook_modules()

    def parameters(self) -> list[torch.Tensor]:
        """Every parameter of every param group, in order."""
        return list(self._params)

    def parameter(self, group_id: int, param_id: int) -> torch.Tensor:
        return self.param_groups[group_id]["params"][param_id]

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        if not self._backward_seen:
            self._first_backward()
        self._stepped = False
        if not self.greedy_grad_copy:
            self._grads_held = True  # no_sync: it waits in param.grad
            return
        self._ensure_layout()
        self._take_grad(index, param)
        self._grad_arrived()

    def _provide_main_grads(self) -> None:
        """``contiguous_grad_buffer``: give every trainable parameter ``main_grad`` (its
        view of the buffer) and ``main_grad_ready`` (a 0-dim leaf whose gradient says
        the layer added into ``main_grad``): layers built with
        ``gradient_accumulation_fusion=True`` then accumulate their weight gradients
        straight into the buffer (``mpzero.tensor_parallel.grad_accumulation``)."""
        for i, p in enumerate(self._params):
            if not p.requires_grad or not self._grad.fragments.get(i):
                continue
            ready = torch.zeros((), device=p.device, requires_grad=True)
            self._grad_hooks.append(ready.register_post_accumulate_grad_hook(
                _weak_hook(self, "_on_main_grad_ready", i)))
            p.main_grad = self.grad_buffer_view(p)
            p.main_grad_ready = ready
        self._main_grads = True

    def _on_main_grad_ready(self, index: int, ready: torch.Tensor) -> None:
        """A layer added parameter ``index``'s gradient into its ``main_grad`` (the
        bucket buffer itself): it arrived, with nothing to copy."""
        ready.grad = None
        if not self._backward_seen:
            self._first_backward()
        self._stepped = False
        if not self.greedy_grad_copy:
            return  # no_sync: it stays in the buffer, as param.grad would stay
        self._grad.add_grad(index, None)
        self._grad_arrived()

    def _first_backward(self) -> None:
        """Checks that need a backward pass, made once: a DistributedDataParallel wrapped
        around the model after this optimizer was built would reduce every gradient a
        second time."""
        torch_compat.raise_if_ddp_reduces(self._params)
        self._backward_seen = True

    def _grad_arrived(self) -> None:
        """After a gradient arrived: launch what is complete, in order."""
        self._norm_cache = None
        if self.overlap_grad_sync and not self._no_sync:
            if self._param_sync.pending():
                # Gathers the forward pass did not start (modules this rank skipped) go
                # out before the first reduce-scatter, in bucket order, as on every rank.
                self._param_sync.sync_all()
            self._grad.launch_ready()
            if not self._round_close_queued:
                self._round_close_queued = True
                _at_end_of_backward(_weak_hook(self, "_end_of_backward"))

    def _end_of_backward(self) -> None:
        """Every backward pass (outside ``no_sync()``) is one round: what it did not
        complete launches now, in order, with zeros for parameters that got no
        gradient. So ranks whose micro-batches skip different parameters still issue
        the same collectives (gradient accumulation without ``no_sync()``)."""
        self._round_close_queued = False
        if self.overlap_grad_sync and not self._no_sync and self._built:
            if self._grads_held:
                # Gradients that earlier no_sync() micro-batches left in param.grad belong
                # to this round: a parameter this backward did not reach still holds one.
                # Taken after the round closed, they would re-open buckets on this rank
                # alone.
                self._copy_pending_grads()
            self._grad.close_round()
            if self._main_grads:
                # Layers write the next backward's gradients into the buffers in flight
                # (main_grad) before any hook runs: each bucket's sync must be done (and
                # its buffer zeroed) first. The main stream waits; the host does not.
                self._grad.finish_all()

    def _take_grad(self, index: int, param: torch.Tensor) -> None:
        """Move ``param.grad`` into the buckets (in the parameter's memory order)."""
        self._grad.add_grad(index, flat_like(param.grad, param))
        param.grad = None

    @contextlib.contextmanager
    def no_sync(self, greedy_grad_copy: bool = False):
        """Accumulate gradients without communicating (all micro-batches but the last).

        Gradients stay in ``param.grad`` unless ``greedy_grad_copy=True``, which adds
        them into the bucket buffers at once (less memory for models that fit)."""
        old = (self._no_sync, self.greedy_grad_copy)
        self._no_sync, self.greedy_grad_copy = True, greedy_grad_copy
        try:
            yield
        finally:
            self._no_sync, self.greedy_grad_copy = old
            if self._built:
                for b in self._grad.buckets:  # the next backward starts a fresh round
                    b.arrived = set()

    def _copy_pending_grads(self) -> None:
        """Move gradients still held in ``param.grad`` into the buckets."""
        # Usually none (the gradient hooks took them): one pass that only reads .grad.
        self._grads_held = False
        pending = [i for i, p in enumerate(self._params) if p.grad is not None]
        for i in pending:
            p = self._params[i]
            if p.requires_grad:
                self._take_grad(i, p)

    def grad_sync(self) -> None:
        """Synchronize every gradient not yet synchronized (all ranks must call it)."""
        self._ensure_layout()
        self.param_sync()  # pending gathers go out before the reduce-scatters, on every rank
        self._copy_pending_grads()
        self._grad.flush()  # bumps the gradient version (the norm cache key) if it syncs

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (bucket shards and ``param.grad``). Leaves parameter
        gathers pending, for the forward pre-hooks.

        With ``contiguous_grad_buffer=True`` the gradient lives in the persistent
        buffer (``param.grad`` stays ``None``, ZeRO-2 frees it): zero_grad zeroes the
        buffer, and whatever is written into :meth:`grad_buffer_view` afterwards is
        what the next sync reduces (added to what backward accumulates there)."""
        for p in self._params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        if self._built:
            self._grad.reset()
        self._reset_grad_scale()
        self._norm_cache = None
        self._stepped = False

    def param_sync(self) -> None:
        """Finish every pending parameter gather (all ranks must call it)."""
        if self._built and self._param_sync.pending():
            self._param_sync.sync_all()

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
        torch_compat.warn_if_wrapped_in_ddp(module)
        self._attached.append((module, bool(unit)))
        self._hook_modules()

    def _hook_modules(self) -> None:
        """(Re)register the forward pre-hooks of every attached module."""
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []
        units = [m for m, unit in self._attached if unit]
        covered = {id(sub) for u in units for sub in u.modules() if sub is not u}
        hooked: set[int] = set()

        def hook(m: torch.nn.Module, params) -> None:
            owned = tuple(self._index[id(p)] for p in params if id(p) in self._index)
            if owned and id(m) not in hooked and id(m) not in covered:
                hooked.add(id(m))
                self._module_hooks.append(m.register_forward_pre_hook(
                    _weak_hook(self, "_pre_forward", owned)))

        for u in units:
            hook(u, u.parameters())
        unit_ids = {id(u) for u in units}
        for module, unit in self._attached:
            if not unit:
                for m in module.modules():
                    if id(m) not in unit_ids:
                        hook(m, m.parameters(recurse=False))

    def _pre_forward(self, owned, module, args) -> None:
        if self._built and self._param_sync.pending():
            self._param_sync.ensure(owned, prefetch=1)

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
        torch_compat.check_collective_entry("state_dict()", self.process_group)
        self._ensure_layout()
        self.param_sync()
        sd = checkpoint.gather_state_dict(self)
        for group in sd["param_groups"]:  # capturable: the device lr saves as a number
            if isinstance(group.get("lr"), torch.Tensor):
                group["lr"] = float(group["lr"])
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load optimizer state and param groups saved by :meth:`state_dict` on any grid."""
        self._ensure_layout()
        self.param_sync()
        checkpoint.load_state_dict(self, state_dict)
        self._after_load()

    def _after_load(self) -> None:
        """Loaded state reaches the device lr and the step mirrors; with remainders
        the parameters were rebuilt from the loaded masters (gather them now)."""
        for gi in range(len(self.param_groups)):
            if self.capturable:
                self._device_lr(gi)
        self._mirror_step()
        self.param_sync()

    def sharded_state_dict(self) -> dict:
        """This rank's shard pieces only (``checkpoint.save_sharded`` writes them per rank)."""
        self._ensure_layout()
        self.param_sync()
        return checkpoint.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dicts: list[dict]) -> None:
        """Load from the :meth:`sharded_state_dict` of every rank of any grid."""
        self._ensure_layout()
        self.param_sync()
        checkpoint.load_sharded_state_dict(self, state_dicts)
        self._after_load()


# ---------------------------------------------------------------------- helpers
def _at_end_of_backward(callback) -> None:
    """Run ``callback`` once the current backward pass has finished (called from a
    gradient hook). torch exposes this only on its autograd engine (FSDP uses the
    same call); without it the round closes at the next sync instead."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is not None and hasattr(engine, "queue_callback"):
        engine.queue_callback(callback)


def _collect_params(params) -> list[torch.Tensor]:
    """Flatten ``params`` (tensors or param-group dicts); reject duplicates."""
    flat = []
    for item in params:
        if isinstance(item, dict):
            ps = item["params"]
            flat.extend([ps] if isinstance(ps, torch.Tensor) else list(ps))
        else:
            flat.append(item)
    seen = set()
    for p in flat:
        if id(p) in seen:
            raise OptionError(f"params: a parameter of shape {tuple(p.shape)} is given twice")
        seen.add(id(p))
    if not flat:
        raise OptionError("params: the optimizer got an empty parameter list")
    return flat


def _resolve_device(device, params) -> torch.device:
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise OptionError(f"params are on different devices ({sorted(map(str, devices))}); "
                          "DistributedFusedAdam needs all on one")
    if device is None:
        dev = devices.pop()
    else:
        dev = torch.device(device)
        if dev.type not in ("cuda", "cpu"):
            raise OptionError(f"device={device!r}: only 'cuda' and 'cpu' are supported")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _resolve_groups(process_group, distributed_group, redundant_group):
    """(process, distributed, redundant) groups; validates that the sizes multiply."""
    if process_group is None and dist.is_available() and dist.is_initialized():
        process_group = dist.group.WORLD
    if distributed_group is None:
        distributed_group = process_group
        if redundant_group is not None and comm.group_size(redundant_group) > 1:
            raise OptionError("redundant_process_group given without distributed_process_group")
    if redundant_group is None:
        redundant_group = comm.SELF
    n, d, r = (comm.group_size(process_group), comm.group_size(distributed_group),
               comm.group_size(redundant_group))
    if d * r != n:
        raise OptionError(
            f"process_group size ({n}) must equal distributed_process_group size ({d}) x "
            f"redundant_process_group size ({r})")
    return process_group, distributed_group, redundant_group
