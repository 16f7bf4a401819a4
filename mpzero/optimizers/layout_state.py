"""Where each element lives: the bucket layout, the local shard state and the buffers.

Mixed into :class:`~mpzero.optimizers.DistributedFusedAdam`. The layout is made
once (:meth:`LayoutMixin._ensure_layout`): parameters are broadcast from the first
rank of the process group, laid out into buckets by the pure functions of
``layout.py``, and each bucket gets its local shard state (master, moments,
remainders or scaled states) and its gradient / parameter pipelines.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mpzero import comm, kernels
from mpzero.kernels.precision import merge_remainder, split_remainder
from mpzero.nccl_allocator import NcclMemPool
from mpzero.optimizers.flat import flat_view
from mpzero.optimizers.grad_sync import GradSync
from mpzero.optimizers.layout import (
    LayoutBuilder,
    alignment_elements,
    bucket_capacity_elements,
    merge_pieces,
    utilization,
)
from mpzero.optimizers.options import OptionError, check_sync_dtypes, is_byte_dtype
from mpzero.optimizers.param_sync import ParamSync
from mpzero.optimizers.scaled_state import ScaledStates
from mpzero.optimizers.step import tensor_parallel_rank
from mpzero.warn import user_stacklevel

UTILIZATION_WARNING = 0.7


def _remainders_fit(key: tuple) -> bool:
    """bf16 + int16 remainders need an fp32 state and bf16 parameter sync."""
    return key[0] == torch.float32 and key[2] == torch.bfloat16 and len(key) == 3


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


class LayoutMixin:
    """Layout, shard state and persistent buffers of DistributedFusedAdam."""

    def _layout_builder(self) -> LayoutBuilder:
        if self._builder is None:
            self._builder = LayoutBuilder(self.distributed_size)
        return self._builder

    def _bucket_key(self, dtype=None, grad_sync_dtype=None, param_sync_dtype=None) -> tuple:
        """The bucket key of ``init_params(..., dtype, grad_sync_dtype, param_sync_dtype)``.

        As apex's: each ``None`` means the optimizer's own value of that option (not
        ``dtype``'s), and the state ``dtype`` is optimizer-wide."""
        if dtype is not None:
            given = check_sync_dtypes(dtype, None, None, prefix="init_params: ")[0]
            if given != self.dtype:
                raise OptionError(
                    f"init_params(dtype={given}): the optimizer state dtype is optimizer-wide "
                    f"(dtype={self.dtype} here), as in apex; leave dtype out and give "
                    "grad_sync_dtype= / param_sync_dtype= for buckets of other sync dtypes")
        key = check_sync_dtypes(
            self.dtype,
            self.grad_sync_dtype if grad_sync_dtype is None else grad_sync_dtype,
            self.param_sync_dtype if param_sync_dtype is None else param_sync_dtype,
            prefix="init_params: ")
        self._register_key(key)
        return key

    def _register_key(self, key: tuple) -> None:
        builder = self._layout_builder()
        if key not in builder.capacity:
            itemsize = torch.empty((), dtype=key[1]).element_size()
            builder.capacity[key] = bucket_capacity_elements(self.bucket_cap_mb, itemsize)
            builder.alignment[key] = alignment_elements(itemsize)

    def _param_key(self, p: torch.Tensor, key: tuple) -> tuple:
        """Byte-level sync gathers the top bytes of values in the parameter's own dtype, so
        such buckets are also keyed by that dtype."""
        if not is_byte_dtype(key[2]):
            return key
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
            params = self._remaining_params()
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self._lay_out(params, self._bucket_key(dtype, grad_sync_dtype, param_sync_dtype))

    def init_params_bucket(self, params, dtype=None, grad_sync_dtype=None,
                           param_sync_dtype=None) -> None:
        """Lay out ``params`` in fresh bucket(s) of their own that communicate together."""
        key = self._bucket_key(dtype, grad_sync_dtype, param_sync_dtype)
        builder = self._layout_builder()
        # Byte-level sync files buckets under key + (parameter dtype,): close those too.
        builder.close_all(prefix=key)
        self.init_params(params, dtype, grad_sync_dtype, param_sync_dtype)
        builder.close_all(prefix=key)

    def _ensure_layout(self) -> None:
        if self._built:
            return
        self._lay_out(self._remaining_params(), self._bucket_key())
        layouts = self._layout_builder().finished()
        self._built = True
        self._layouts = layouts
        if layouts and utilization(layouts) < UTILIZATION_WARNING:
            warnings.warn(
                f"DistributedFusedAdam: only {100 * utilization(layouts):.0f}% of bucket elements "
                "hold parameters (alignment padding). Consider decreasing the bucket_cap_mb "
                "argument.", stacklevel=user_stacklevel())
        # Again, on every rank: param groups may have been added since construction (on
        # some ranks only), and the broadcast below must not run on mismatched lists.
        self._check_fingerprint()
        self._broadcast_params()  # replicas start from the first rank's values
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
                              persistent=grad_views)
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
        tp_rank = tensor_parallel_rank(self.model_parallel_group)
        self._shards = []
        for b, lay in enumerate(layouts):
            dtype = lay.key[0]
            pieces = lay.shard_pieces(rank)
            master = self._params_shard(b, torch.float32 if self.with_scaled_states else dtype)
            # Remainders only where the bucket syncs bf16 params from an fp32 state; other
            # buckets (e.g. an fp32 param in its own bucket) keep a master unless the
            # parameter itself holds the state dtype.
            remainders = self.store_param_remainders and _remainders_fit(lay.key)
            store_master = self.store_params or (
                self.store_param_remainders and not remainders
                and any(self._params[f.param].dtype != dtype for f in lay.fragments))
            scaled = None
            if self.with_scaled_states:
                scaled = ScaledStates([(p.shard_start, p.shard_end) for p in pieces],
                                      lay.shard_size, dtype, self.device)
                scaled.store("param", master)
            plain = not self.with_scaled_states
            self._shards.append(ShardState(
                master=master if store_master and plain else None,
                remainder=split_remainder(master)[1] if remainders else None,
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
        if grad_views is not None:
            self._provide_main_grads()
        self._mirror_step()

    def _remaining_params(self) -> list[torch.Tensor]:
        """Trainable params not laid out yet, last param group first (backward order)."""
        return [p for p in reversed(self._params) if p.requires_grad
                and self._index[id(p)] not in self._keys]

    def _broadcast_params(self) -> None:
        """Overwrite the trainable parameters with the first rank's values (all ranks)."""
        params = [p for p in self._params if p.requires_grad]
        with torch.no_grad():
            comm.broadcast_from_first([p.data for p in params], self.process_group)

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
            # Both halves from the loaded master, whatever rounding the user's model load
            # used: the remainder here, the bf16 high halves through a parameter gather.
            hi, rem = split_remainder(values.float().contiguous())
            st.remainder.copy_(rem)
            self._param_sync.mark_stale(b).copy_(hi)

    def _copy_params_into(self, shard: torch.Tensor, pieces) -> None:
        srcs = [flat_view(self._params[p.param].detach())[p.param_start:p.param_end]
                for p in pieces]
        dsts = [shard[p.shard_start:p.shard_end] for p in pieces]
        if srcs and srcs[0].device != shard.device or any(s.dtype == torch.float64 for s in srcs):
            for s, d in zip(srcs, dsts):
                d.copy_(s)
        else:
            kernels.multi_copy(srcs, dsts)

    def _check_fingerprint(self) -> None:
        """Fail loudly (on every rank) when ranks have different parameters. A collective,
        called where every rank passes: the constructor and the making of the layout
        (before any other collective of the layout)."""
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
