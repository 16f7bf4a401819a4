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
import hashlib
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mpzero import comm, kernels
from mpzero.nccl_allocator import NcclMemPool
from mpzero.optimizers import checkpoint
from mpzero.optimizers.grad_sync import GradSync
from mpzero.optimizers.layout import (
    LayoutBuilder,
    alignment_elements,
    bucket_capacity_elements,
    merge_pieces,
    utilization,
)
from mpzero.optimizers.options import (
    OptionError,
    check_options,
    check_sync_dtypes,
    is_byte_dtype,
)
from mpzero.optimizers.param_sync import ParamSync
from mpzero.optimizers.precision import copy_high_bytes, merge_remainder, split_remainder
from mpzero.optimizers.scaled_state import ScaledStates

UTILIZATION_WARNING = 0.7


@dataclass
class ShardState:
    """Optimizer state of one bucket's local shard."""

    master: torch.Tensor | None  # None with store_params=False (the parameter is the master)
    remainder: torch.Tensor | None  # int16 low halves with store_param_remainders
    exp_avg: torch.Tensor | None  # None with with_scaled_states (kept in ``scaled``)
    exp_avg_sq: torch.Tensor | None
    scaled: ScaledStates | None  # 16-bit states with per-fragment fp32 scales
    group_ranges: list  # (start, end, param group index) covering the shard's fragments
    norm_ranges: list  # (start, end, counted) for the grad norm (TP-replicated counted once)


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


class DistributedFusedAdam(torch.optim.Optimizer):
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
        self._norm_cache: tuple[int, torch.Tensor] | None = None
        self._fingerprint_checked = False
        self._warned_no_module = False
        self._module_hooks: list = []
        self._attached: list[torch.nn.Module] = []
        self._comm = comm.CommContext(device, pipeline_size)
        if module is not None:
            self.attach(module)

    def _register_param(self, p: torch.Tensor, group: int) -> None:
        if p.requires_grad and not p.is_contiguous():
            raise OptionError("params: every parameter must be contiguous "
                              f"(got one of shape {tuple(p.shape)} that is not)")
        self._check_sync_width(p, self.param_sync_dtype)
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
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        for p in self.param_groups[gi]["params"]:
            self._register_param(p, gi)
        if self._attached:  # the forward pre-hooks must know the new parameters too
            modules, self._attached = self._attached, []
            for h in self._module_hooks:
                h.remove()
            self._module_hooks = []
            for m in modules:
                self.attach(m)

    # ------------------------------------------------------------------ layout
    def _layout_builder(self) -> LayoutBuilder:
        if self._builder is None:
            self._builder = LayoutBuilder(self.distributed_size)
        return self._builder

    def _bucket_key(self, dtype=None, grad_sync_dtype=None, param_sync_dtype=None) -> tuple:
        key = check_sync_dtypes(dtype or self.dtype,
                                grad_sync_dtype or (None if dtype else self.grad_sync_dtype),
                                param_sync_dtype or (None if dtype else self.param_sync_dtype))
        self._register_key(key)
        return key

    def _register_key(self, key: tuple) -> None:
        builder = self._layout_builder()
        if key not in builder.capacity:
            itemsize = torch.empty((), dtype=key[1]).element_size()
            builder.capacity[key] = bucket_capacity_elements(self.bucket_cap_mb, itemsize)
            builder.alignment[key] = alignment_elements(itemsize)

    @staticmethod
    def _check_sync_width(p: torch.Tensor, sync_dtype: torch.dtype) -> None:
        if p.requires_grad and is_byte_dtype(sync_dtype) and (
                torch.empty((), dtype=sync_dtype).element_size() > p.element_size()):
            raise OptionError(f"param_sync_dtype={sync_dtype} is wider than a {p.dtype} "
                              "parameter; byte-level sync needs an integer type of smaller "
                              "or equal size")

    def _param_key(self, p: torch.Tensor, key: tuple) -> tuple:
        """Byte-level sync gathers the top bytes of values in the parameter's own dtype, so
        such buckets are also keyed by that dtype."""
        if not is_byte_dtype(key[2]):
            return key
        self._check_sync_width(p, key[2])
        full = key + (p.dtype,)
        self._register_key(full)
        return full

    def _lay_out(self, params: Iterable[torch.Tensor], key: tuple) -> None:
        if self._built:
            raise RuntimeError("init_params: the layout is already final (it is made lazily at "
                               "the first gradient, step() or state_dict(), or after all params "
                               "were laid out)")
        entries = []
        for p in params:
            i = self._index.get(id(p))
            if i is None:
                raise ValueError(f"init_params: a parameter of shape {tuple(p.shape)} is not "
                                 "in this optimizer's param groups")
            if not p.requires_grad or i in self._keys:
                continue
            pkey = self._param_key(p, key)
            self._keys[i] = pkey
            entries.append((i, p.numel(), pkey))
        self._layout_builder().add(entries)

    def init_params(self, params, dtype=None, grad_sync_dtype=None,
                    param_sync_dtype=None) -> None:
        """Lay out ``params`` now, in the order given (optionally with their own dtypes)."""
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self._lay_out(params, self._bucket_key(dtype, grad_sync_dtype, param_sync_dtype))

    def init_params_bucket(self, params, dtype=None, grad_sync_dtype=None,
                           param_sync_dtype=None) -> None:
        """Lay out ``params`` in fresh bucket(s) of their own that communicate together."""
        key = self._bucket_key(dtype, grad_sync_dtype, param_sync_dtype)
        builder = self._layout_builder()
        builder.close(key)
        self.init_params(params, dtype, grad_sync_dtype, param_sync_dtype)
        builder.close(key)

    def _ensure_layout(self) -> None:
        if self._built:
            return
        rest = [p for p in reversed(self._params) if p.requires_grad
                and self._index[id(p)] not in self._keys]
        self._lay_out(rest, self._bucket_key())
        layouts = self._layout_builder().finished()
        self._built = True
        self._layouts = layouts
        if layouts and utilization(layouts) < UTILIZATION_WARNING:
            warnings.warn(
                f"DistributedFusedAdam: only {100 * utilization(layouts):.0f}% of bucket elements "
                "hold parameters (alignment padding); a smaller bucket_cap_mb or fewer, larger "
                "parameters use memory better", stacklevel=3)
        rank = self.distributed_rank
        self._nccl_pool = None
        if self.nccl_ub:
            self._nccl_pool = NcclMemPool(self.distributed_process_group, self.device)
        with self._nccl_pool.allocate() if self._nccl_pool else contextlib.nullcontext():
            grad_views = self._persistent_buffers(1) if self.contiguous_grad_buffer else None
        param_views = self._persistent_buffers(2) if self.contiguous_param_buffer else None
        self._grad = GradSync(layouts, [lay.key[1] for lay in layouts], self.device, self._comm,
                              self.distributed_process_group, self.redundant_process_group,
                              rank, self.average_grad_sync,
                              on_first_collective=self._check_fingerprint, persistent=grad_views)
        for bucket in self._grad.buckets:
            bucket.stable_shard = self.capturable
        if self._nccl_pool is not None:
            with self._nccl_pool.allocate():  # reduce-scatter outputs from the same pool
                for bucket in self._grad.buckets:
                    bucket.persistent_incoming = torch.empty(
                        bucket.layout.shard_size, dtype=bucket.dtype, device=self.device)
            self._nccl_pool.register()
        self._param_sync = ParamSync(layouts, [lay.key[2] for lay in layouts], self.device,
                                     self._comm, self.distributed_process_group, rank,
                                     self._params, persistent=param_views)
        tp_rank = _tensor_parallel_rank(self.model_parallel_group)
        self._shards = []
        for b, lay in enumerate(layouts):
            dtype = lay.key[0]
            pieces = lay.shard_pieces(rank)
            master = self._params_shard(b, torch.float32 if self.with_scaled_states else dtype)
            scaled = None
            if self.with_scaled_states:
                scaled = ScaledStates([(p.shard_start, p.shard_end) for p in pieces],
                                      lay.shard_size, dtype, self.device)
                scaled.store("param", master)
            plain = not self.with_scaled_states
            self._shards.append(ShardState(
                master=master if self.store_params and plain else None,
                remainder=split_remainder(master)[1] if self.store_param_remainders else None,
                exp_avg=torch.zeros(lay.shard_size, dtype=dtype, device=self.device)
                if plain else None,
                exp_avg_sq=torch.zeros(lay.shard_size, dtype=dtype, device=self.device)
                if plain else None,
                scaled=scaled,
                group_ranges=merge_pieces(pieces, lambda p: self._group_of[p.param]),
                norm_ranges=merge_pieces(pieces, lambda p: bool(
                    getattr(self._params[p.param], "tensor_model_parallel", False)
                    or tp_rank == 0)),
            ))
        if param_views is not None:
            self._params_to_buffer_views(param_views)

    def _persistent_buffers(self, which: int) -> list[torch.Tensor]:
        """One persistent buffer per dtype key (``which``: 1 grads, 2 params); returns each
        bucket's view into it. Buckets of one key are adjacent, in index order."""
        sizes: dict[tuple, int] = {}
        offsets = []
        for lay in self._layouts:
            offsets.append(sizes.get(lay.key, 0))
            sizes[lay.key] = offsets[-1] + lay.size
        buffers = {key: torch.zeros(n, dtype=key[which], device=self.device)
                   for key, n in sizes.items()}
        self._buffers = getattr(self, "_buffers", {})
        self._buffers[which] = buffers
        self._buffer_offsets = offsets
        return [buffers[lay.key][off:off + lay.size]
                for lay, off in zip(self._layouts, offsets)]

    def _buffer_view(self, which: int, index: int) -> torch.Tensor:
        """Parameter ``index`` as a view of persistent buffer ``which`` (param-shaped)."""
        frags = self._grad.fragments.get(index, [])
        if not frags:
            raise ValueError("this parameter has no storage in the optimizer's buffers "
                             "(requires_grad=False?)")
        p = self._params[index]
        key = self._keys[index]
        base = self._buffer_offsets[frags[0].bucket] + frags[0].bucket_start - frags[0].param_start
        for f in frags:  # a parameter split across buckets is still contiguous in the buffer
            assert self._buffer_offsets[f.bucket] + f.bucket_start == base + f.param_start
        return self._buffers[which][key][base:base + p.numel()].view(p.shape)

    def grad_buffer_view(self, param: torch.Tensor) -> torch.Tensor:
        """``param``-shaped view of the contiguous gradient buffer (``grad_sync_dtype``)."""
        if not self.contiguous_grad_buffer:
            raise RuntimeError("grad_buffer_view needs contiguous_grad_buffer=True")
        self._ensure_layout()
        return self._buffer_view(1, self._index[id(param)])

    def init_param_buffer(self) -> None:
        """Make every parameter a view into one persistent buffer per dtype key
        (``contiguous_param_buffer=True``): the all-gather then writes straight into the
        parameters. Done at layout time; calling it earlier fixes the layout now."""
        if not self.contiguous_param_buffer:
            raise RuntimeError("init_param_buffer needs contiguous_param_buffer=True")
        self._ensure_layout()

    def _params_to_buffer_views(self, views) -> None:
        for i, p in enumerate(self._params):
            if i not in self._keys:
                continue
            if p.dtype != self._keys[i][2]:
                raise OptionError(
                    f"contiguous_param_buffer=True needs parameters of param_sync_dtype "
                    f"({self._keys[i][2]}); parameter {i} is {p.dtype}")
            view = self._buffer_view(2, i)
            with torch.no_grad():
                view.copy_(p)
            p.data = view

    def _params_shard(self, b: int, dtype: torch.dtype) -> torch.Tensor:
        """A fresh shard of bucket ``b`` holding the parameters' current values (zero gaps)."""
        lay = self._layouts[b]
        shard = torch.zeros(lay.shard_size, dtype=dtype, device=self.device)
        self._copy_params_into(shard, lay.shard_pieces(self.distributed_rank))
        return shard

    def _master_shard(self, b: int) -> torch.Tensor:
        """The master values of bucket ``b``'s shard, in the state dtype (exact with
        remainders: the bf16 parameter merged with the int16 remainder)."""
        st = self._shards[b]
        if st.master is not None:
            return st.master
        if st.scaled is not None:
            return st.scaled.unscaled("param")
        if st.remainder is not None:
            hi = split_remainder(self._params_shard(b, torch.float32))[0]
            return merge_remainder(hi, st.remainder)
        return self._params_shard(b, self._layouts[b].key[0])

    def _moments(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq) of bucket ``b``'s shard (fp32 copies when scaled)."""
        st = self._shards[b]
        if st.scaled is not None:
            return st.scaled.unscaled("exp_avg"), st.scaled.unscaled("exp_avg_sq")
        return st.exp_avg, st.exp_avg_sq

    def _store_moments(self, b: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        st = self._shards[b]
        if st.scaled is not None:
            st.scaled.store("exp_avg", exp_avg)
            st.scaled.store("exp_avg_sq", exp_avg_sq)
        elif exp_avg is not st.exp_avg:
            st.exp_avg.copy_(exp_avg)
            st.exp_avg_sq.copy_(exp_avg_sq)

    def _store_master_shard(self, b: int, values: torch.Tensor) -> None:
        """Set bucket ``b``'s master shard (loading a checkpoint). Without a stored master
        the parameters are the master: the user loads them with the model."""
        st = self._shards[b]
        if st.master is not None:
            st.master.copy_(values)
        elif st.scaled is not None:
            st.scaled.store("param", values)
        elif st.remainder is not None:
            st.remainder.copy_(split_remainder(values.float())[1])

    def _copy_params_into(self, shard: torch.Tensor, pieces) -> None:
        srcs = [self._params[p.param].detach().view(-1)[p.param_start:p.param_end]
                for p in pieces]
        dsts = [shard[p.shard_start:p.shard_end] for p in pieces]
        if srcs and srcs[0].device != shard.device or any(s.dtype == torch.float64 for s in srcs):
            for s, d in zip(srcs, dsts):
                d.copy_(s)
        else:
            kernels.multi_copy(srcs, dsts)

    def _check_fingerprint(self) -> None:
        """Fail loudly (on every rank) when ranks have different parameters."""
        if self._fingerprint_checked:
            return
        self._fingerprint_checked = True
        if comm.group_size(self.process_group) == 1:
            return
        text = repr([(tuple(p.shape), str(p.dtype), p.requires_grad) for p in self._params])
        h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
        n = len(self._params)
        mine = torch.tensor([h, n, -h, -n], dtype=torch.int64, device=self.device)
        # One MAX gives (max, -min) of both: they equal this rank's iff all ranks agree.
        agreed = comm.all_reduce(mine.clone(), self.process_group, dist.ReduceOp.MAX)
        if not torch.equal(agreed, mine):
            raise RuntimeError(
                "DistributedFusedAdam: ranks of the process group have different parameters "
                f"(counts or shapes differ between ranks; this rank has {n} params)")

    # ------------------------------------------------------------------ accessors
    def parameters(self) -> list[torch.Tensor]:
        """Every parameter of every param group, in order."""
        return list(self._params)

    def parameter(self, group_id: int, param_id: int) -> torch.Tensor:
        return self.param_groups[group_id]["params"][param_id]

    # ------------------------------------------------------------------ grad sync
    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        if not self.greedy_grad_copy or param.grad is None:
            return
        self._ensure_layout()
        self._grad.add_grad(index, param.grad)
        param.grad = None
        self._norm_cache = None
        if self.overlap_grad_sync and not self._no_sync:
            self._grad.launch_ready()

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
        for i, p in enumerate(self._params):
            if p.requires_grad and p.grad is not None:
                self._grad.add_grad(i, p.grad)
                p.grad = None

    def grad_sync(self) -> None:
        """Synchronize every gradient not yet synchronized (all ranks must call it)."""
        self._ensure_layout()
        self._check_fingerprint()
        self._copy_pending_grads()
        self._grad.flush()
        self._norm_cache = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (bucket shards and ``param.grad``). Leaves parameter
        gathers pending, for the forward pre-hooks."""
        for p in self._params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        if self._built:
            self._grad.reset()
        self._grad_scale.fill_(1.0)
        self._norm_cache = None

    # ------------------------------------------------------------------ norms / AMP
    def _synced_shards(self) -> list[torch.Tensor | None]:
        self.grad_sync()
        return self._grad.shards()

    def _local_sq_norm(self, parameters=None) -> torch.Tensor:
        norm = kernels.l2norm(self._norm_views(parameters), device=self.device)
        return (norm.to(self.device, torch.float32) ** 2)

    def _norm_views(self, parameters=None) -> list[torch.Tensor]:
        """This rank's synchronized gradient ranges that the norm counts (TP-replicated
        parameters only on TP rank 0)."""
        shards = self._synced_shards()
        views = []
        if parameters is None:
            for shard, st in zip(shards, self._shards):
                if shard is not None:
                    views += [shard[a:b] for a, b, counted in st.norm_ranges if counted]
        else:
            wanted = {self._index[id(p)] for p in parameters}
            tp_rank = _tensor_parallel_rank(self.model_parallel_group)
            for shard, lay in zip(shards, self._layouts):
                for piece in lay.shard_pieces(self.distributed_rank):
                    p = self._params[piece.param]
                    if piece.param in wanted and (
                            getattr(p, "tensor_model_parallel", False) or tp_rank == 0):
                        views.append(shard[piece.shard_start:piece.shard_end])
        return views

    def grad_norm(self, parameters=None, norm_type: float = 2.0,
                  force: bool = False) -> torch.Tensor:
        """2-norm of the synchronized gradients (times the pending grad scale), as a
        0-dim fp32 tensor on the optimizer's device. Cached until gradients change."""
        if float(norm_type) != 2.0:
            raise ValueError(f"grad_norm: only norm_type=2.0 is supported, got {norm_type!r}")
        self._ensure_layout()
        self.grad_sync()
        key = (self._grad.version, None if parameters is None else
               tuple(id(p) for p in parameters))
        if force or self._norm_cache is None or self._norm_cache[0] != key:
            sq = self._local_sq_norm(parameters)
            comm.all_reduce(sq, self.distributed_process_group)
            if self.model_parallel_group is not None:
                comm.all_reduce(sq, self.model_parallel_group)
            self._norm_cache = (key, sq.sqrt())
        return self._norm_cache[1] * self._grad_scale

    def clip_grad_norm(self, max_norm: float, parameters=None,
                       norm_type: float = 2.0) -> torch.Tensor:
        """Total gradient norm; folds ``min(1, max_norm / (norm + 1e-6))`` into the grad
        scale so the clipping costs no pass over the gradients."""
        norm = self.grad_norm(parameters, norm_type)
        coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
        self._grad_scale.mul_(coef)
        return norm

    def _found_inf(self) -> torch.Tensor:
        """1.0 on every rank when any synchronized gradient (anywhere) is inf/NaN."""
        # Per element, as torch's GradScaler: the largest magnitude is finite exactly
        # when every element is (NaN propagates). A squared norm would overflow for
        # finite gradients above ~1.8e19 and skip steps torch takes.
        views = [v for v in self._norm_views() if v.numel()]
        if views:
            amax = torch.stack(torch._foreach_norm(views, ord=float("inf"))).float().amax()
        else:
            amax = torch.zeros((), dtype=torch.float32, device=self.device)
        flag = (~torch.isfinite(amax.to(self.device))).to(torch.float32)
        comm.all_reduce(flag, self.distributed_process_group, dist.ReduceOp.MAX)
        if self.model_parallel_group is not None:
            comm.all_reduce(flag, self.model_parallel_group, dist.ReduceOp.MAX)
        return flag

    def unscale_grads(self, inv_scale: torch.Tensor | float | None = None, grad_scaler=None):
        """Fold a gradient unscale into the grad scale (GradScaler integration).

        With ``grad_scaler``, its inverse scale is used, inf/NaN in the synchronized
        gradients is detected and recorded in the scaler's per-optimizer state (so
        ``scaler.update()`` works) and that state is marked unscaled."""
        self._ensure_layout()
        if grad_scaler is not None:
            from torch.amp.grad_scaler import OptState

            state = grad_scaler._per_optimizer_states[id(self)]
            if state["stage"] is OptState.UNSCALED:
                raise RuntimeError("unscale_grads() has already been called on this optimizer "
                                   "since the last update()")
            scale = grad_scaler._scale
            if inv_scale is None:
                inv_scale = scale.double().reciprocal().float()
            found = self._found_inf()
            state["found_inf_per_device"][found.device] = found.to(scale.device)
            state["stage"] = OptState.UNSCALED
        if inv_scale is not None:
            inv = torch.as_tensor(inv_scale, dtype=torch.float32).to(self.device)
            self._grad_scale.mul_(inv)

    # ------------------------------------------------------------------ step
    def step(self, closure=None, *, grad_scaler=None):
        """One optimizer step (see the module docstring for the flow)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_layout()
        self.param_sync()
        self.grad_sync()
        found_inf = None
        if grad_scaler is not None:
            from torch.amp.grad_scaler import OptState

            state = grad_scaler._per_optimizer_states[id(self)]
            if state["stage"] is not OptState.UNSCALED:
                self.unscale_grads(grad_scaler=grad_scaler)
            found_inf = sum(v.to(self.device) for v in state["found_inf_per_device"].values())
            if not self.capturable and found_inf.item():
                self._grad_scale.fill_(1.0)  # skipped: same decision on every rank
                return loss
        if self.capturable:
            self._step_t.add_(1.0 if found_inf is None else 1.0 - found_inf)
        else:
            self._steps += 1
        with torch.no_grad():
            self._local_step(found_inf if self.capturable else None)
        self._grad.mark_stepped()
        self._grad_scale.fill_(1.0)
        self._norm_cache = None
        return loss

    def step_count(self):
        """Steps taken: an int, or a 0-dim device tensor with ``capturable``."""
        return self._step_t.clone() if self.capturable else self._steps

    def set_step_count(self, step) -> None:
        if self.capturable:
            self._step_t.fill_(float(step))
        else:
            self._steps = int(step.item() if isinstance(step, torch.Tensor) else step)

    def _local_step(self, found_inf: torch.Tensor | None = None) -> None:
        self._found_inf_for_kernels = found_inf
        outs = {}
        first_gathered = None
        order = list(range(len(self._layouts)))
        deferred = self.overlap_param_sync and bool(self._module_hooks)
        if deferred and order:
            # The last bucket is used first by the next forward: step it alone, start its
            # gather, and let the gather overlap the step of the rest.
            first_gathered = order[-1]
            phases = [[first_gathered], order[:-1]]
        else:
            phases = [order]
        for phase in phases:
            for b in phase:
                outs[b] = self._param_sync.mark_stale(b)
            self._fused_adam(phase, outs)
            if deferred and phase == [first_gathered]:
                self._param_sync.start_through(first_gathered)
        if self.overlap_param_sync and not self._module_hooks and not self._warned_no_module:
            self._warned_no_module = True
            warnings.warn("overlap_param_sync=True but no module is attached (module= or "
                          "attach(module)): parameters are gathered at the end of step()",
                          stacklevel=3)
        if not deferred:
            self._param_sync.sync_all()

    def _fused_adam(self, buckets, outs) -> None:
        """One fused launch per (param group, dtype key) over the given buckets."""
        plain: dict[tuple, tuple[list, ...]] = {}
        with_rem: dict[tuple, tuple[list, ...]] = {}
        byte_outs, rescale = [], []
        for b in buckets:
            st, lay = self._shards[b], self._layouts[b]
            grad = self._grad.buckets[b].shard
            out = outs[b]
            if is_byte_dtype(lay.key[2]):  # the value in the param's dtype, then its top bytes
                value = torch.empty(lay.shard_size, dtype=lay.key[3], device=self.device)
                byte_outs.append((value, out))
                out = value
            if st.remainder is not None:
                # The bf16 high halves come from the parameters and are updated in place,
                # in the buffer that is then gathered.
                out.copy_(split_remainder(self._params_shard(b, torch.float32))[0])
                for lo, hi, gi in st.group_ranges:
                    lists = with_rem.setdefault((gi, lay.key), ([], [], [], [], []))
                    for lst, t in zip(lists, (out, st.remainder, grad, st.exp_avg,
                                              st.exp_avg_sq)):
                        lst.append(t[lo:hi])
                continue
            if st.scaled is not None:  # fp32 working copies, rescaled after the update
                master = st.scaled.unscaled("param")
                exp_avg, exp_avg_sq = self._moments(b)
                rescale.append((b, master, exp_avg, exp_avg_sq))
            else:
                master = (st.master if st.master is not None
                          else self._params_shard(b, lay.key[0]))
                exp_avg, exp_avg_sq = st.exp_avg, st.exp_avg_sq
            if self._found_inf_for_kernels is not None:
                out.copy_(master)  # a skipped step (device flag) must gather the old values
            for lo, hi, gi in st.group_ranges:
                lists = plain.setdefault((gi, lay.key), ([], [], [], [], []))
                for lst, t in zip(lists, (master, grad, exp_avg, exp_avg_sq, out)):
                    lst.append(t[lo:hi])
        for (gi, _), (p, g, m, v, out) in plain.items():
            kernels.adam(p, g, m, v, out, **self._hyper(gi))
        for (gi, _), (hi, rem, g, m, v) in with_rem.items():
            kernels.adam_remainders(hi, rem, g, m, v, None, **self._hyper(gi))
        for b, master, exp_avg, exp_avg_sq in rescale:
            self._shards[b].scaled.store("param", master)
            self._store_moments(b, exp_avg, exp_avg_sq)
        for value, out in byte_outs:
            copy_high_bytes(value, out)

    def _hyper(self, gi: int) -> dict:
        group = self.param_groups[gi]
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step=self._step_t if self.capturable else self._steps,
                    adam_w_mode=self.adam_w_mode, bias_correction=bool(group["bias_correction"]),
                    grad_scale=self._grad_scale, found_inf=self._found_inf_for_kernels)

    # ------------------------------------------------------------------ param sync
    def param_sync(self) -> None:
        """Finish every pending parameter gather (all ranks must call it)."""
        if self._built and self._param_sync.pending():
            self._param_sync.sync_all()

    def attach(self, module: torch.nn.Module) -> None:
        """Drive ``overlap_param_sync`` from ``module``'s forward pre-hooks: each
        submodule gathers the buckets of its own parameters (prefetching one ahead)
        just before its forward runs."""
        self._attached.append(module)
        for m in module.modules():
            owned = [self._index[id(p)] for p in m.parameters(recurse=False)
                     if id(p) in self._index]
            if owned:
                self._module_hooks.append(m.register_forward_pre_hook(
                    _weak_hook(self, "_pre_forward", tuple(owned))))

    def _pre_forward(self, owned, module, args) -> None:
        if self._built and self._param_sync.pending():
            self._param_sync.ensure(owned, prefetch=1)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Format-2 state dict (see ``checkpoint.py``): every rank returns the same dict."""
        self._ensure_layout()
        self._check_fingerprint()
        self.param_sync()
        return checkpoint.gather_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load optimizer state and param groups saved by :meth:`state_dict` on any grid."""
        self._ensure_layout()
        self.param_sync()
        checkpoint.load_state_dict(self, state_dict)

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


# ---------------------------------------------------------------------- helpers
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


def _tensor_parallel_rank(model_parallel_group) -> int:
    """TP rank used to count TP-replicated params once in the grad norm."""
    if model_parallel_group is None:
        return 0
    from mpzero import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return comm.group_rank(model_parallel_group)
