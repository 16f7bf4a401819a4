"""The shard store: which parameter element lives in which bucket (``layout.py``, keyed
by :class:`~mpzero.optimizers.options.BucketKey`) and, once the layout is final
(:meth:`ShardStore.build`), this rank's :class:`ShardState` per bucket (master, moments,
remainders or scaled states), the persistent buffers and the NCCL memory pool. The
step, the checkpoints and the norm read it through its public methods.
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
from mpzero.optimizers.flat import flat_view, is_dense
from mpzero.optimizers.layout import (
    BucketLayout,
    Fragment,
    LayoutBuilder,
    alignment_elements,
    bucket_capacity_elements,
    fragments_by_param,
    merge_pieces,
    utilization,
)
from mpzero.optimizers.options import BucketKey, Groups, OptionError, Options, check_sync_dtypes
from mpzero.optimizers.scaled_state import MOMENTS, ScaledStates
from mpzero.warn import user_stacklevel

UTILIZATION_WARNING = 0.7
GRADS, PARAMS = "grads", "params"  # the two kinds of persistent buffer


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


class ShardStore:
    """Parameters, their bucket layout, and this rank's shard state per bucket."""

    def __init__(self, options: Options, groups: Groups, ctx: comm.CommContext):
        self.options, self.groups, self.comm = options, groups, ctx
        self.device = options.device
        # Where the shard state lives: host memory with cpu_offload (offload_step.py).
        # Pageable, not pinned: only the CPU reads it; the copies across the boundary go
        # through offload.HostStaging's pinned buffers.
        self.state_device = torch.device("cpu") if options.cpu_offload else self.device
        self.params: list[torch.Tensor] = []
        self.group_of: list[int] = []  # param group of each parameter
        self.index: dict[int, int] = {}  # id(param) -> its index
        self.keys: dict[int, BucketKey] = {}  # laid-out (trained) parameter -> bucket key
        self.builder = LayoutBuilder(groups.distributed_size)
        self.built = False
        self.layouts: list[BucketLayout] = []
        self.shards: list[ShardState] = []
        self.fragments: dict[int, list[Fragment]] = {}  # param -> its fragments, bucket order
        self.buffers: dict[str, dict[BucketKey, torch.Tensor]] = {}
        self.buffer_offsets: list[int] = []
        self.nccl_pool: NcclMemPool | None = None

    # -- parameters and layout ----------------------------------------------------
    def register(self, p: torch.Tensor, group: int) -> int:
        """Add parameter ``p`` of param group ``group``; returns its index."""
        if p.requires_grad and not is_dense(p):
            raise OptionError("params: every parameter must be dense in memory, contiguous "
                              "in some dimension order such as channels_last (got one of shape "
                              f"{tuple(p.shape)} and stride {p.stride()})")
        i = len(self.params)
        self.params.append(p)
        self.group_of.append(group)
        self.index[id(p)] = i
        return i

    def bucket_key(self, dtype=None, grad_sync_dtype=None, param_sync_dtype=None) -> BucketKey:
        """The bucket key of ``init_params(..., dtype, grad_sync_dtype, param_sync_dtype)``.

        As apex's: each ``None`` means the optimizer's own value of that option (not
        ``dtype``'s), and the state ``dtype`` is optimizer-wide."""
        o = self.options
        if dtype is not None:
            given = check_sync_dtypes(dtype, None, None, prefix="init_params: ")[0]
            if given != o.dtype:
                raise OptionError(
                    f"init_params(dtype={given}): the optimizer state dtype is optimizer-wide "
                    f"(dtype={o.dtype} here), as in apex; leave dtype out and give "
                    "grad_sync_dtype= / param_sync_dtype= for buckets of other sync dtypes")
        key = BucketKey(*check_sync_dtypes(
            o.dtype, o.grad_sync_dtype if grad_sync_dtype is None else grad_sync_dtype,
            o.param_sync_dtype if param_sync_dtype is None else param_sync_dtype,
            prefix="init_params: "))
        self._register_key(key)
        return key

    def _register_key(self, key: BucketKey) -> None:
        if key not in self.builder.capacity:
            itemsize = key.grad.itemsize
            self.builder.capacity[key] = bucket_capacity_elements(self.options.bucket_cap_mb,
                                                                  itemsize)
            self.builder.alignment[key] = alignment_elements(itemsize)

    def lay_out(self, params: Iterable[torch.Tensor], key: BucketKey,
                own_bucket: bool = False) -> None:
        """Lay out ``params`` (in the order given) in buckets of ``key``; ``own_bucket``:
        in fresh bucket(s) of their own. Parameters laid out already are skipped."""
        if self.built:
            raise RuntimeError("init_params: the layout is already final (it is made lazily at "
                               "the first gradient, step() or state_dict(), or after all params "
                               "were laid out)")
        entries = []
        for p in params:
            i = self.index.get(id(p))
            if i is None:
                raise ValueError(f"init_params: a parameter of shape {tuple(p.shape)} is not "
                                 "in this optimizer's param groups")
            if not p.requires_grad or i in self.keys:
                continue
            # Byte-level sync gathers the top bytes of values in the parameter's own
            # dtype, so such buckets are also keyed by that dtype.
            pkey = key._replace(param_dtype=p.dtype) if key.byte_sync else key
            self._register_key(pkey)
            self.keys[i] = pkey
            entries.append((i, p.numel(), pkey))
        if own_bucket:
            self.builder.close_all(prefix=key.dtypes)
        self.builder.add(entries)
        if own_bucket:
            self.builder.close_all(prefix=key.dtypes)

    def remaining_params(self) -> list[torch.Tensor]:
        """Trainable params not laid out yet, last param group first (backward order)."""
        return [p for p in reversed(self.params) if p.requires_grad
                and self.index[id(p)] not in self.keys]

    def trained(self) -> list[int]:
        """Indices of the parameters with optimizer state (those with ``requires_grad``,
        which is what the layout takes), known before the layout is made."""
        if self.built:
            return list(self.keys)
        return [i for i, p in enumerate(self.params) if p.requires_grad]

    # -- making the layout final ---------------------------------------------------
    def build(self) -> None:
        """Lay out what is left, check that the ranks agree, broadcast the parameters from
        the first rank and allocate every bucket's shard state and buffers. A collective."""
        self.lay_out(self.remaining_params(), self.bucket_key())
        self.layouts = self.builder.finished()
        self.fragments = fragments_by_param(self.layouts)
        self.built = True
        if self.layouts and utilization(self.layouts) < UTILIZATION_WARNING:
            warnings.warn(
                f"DistributedFusedAdam: only {100 * utilization(self.layouts):.0f}% of bucket "
                "elements hold parameters (alignment padding). Consider decreasing the "
                "bucket_cap_mb argument.", stacklevel=user_stacklevel())
        # Again, on every rank: param groups may have been added since construction (on
        # some ranks only), and the broadcast below must not run on mismatched lists.
        check_fingerprint(self.params, self.groups.process, self.device)
        broadcast_params(self.params, self.groups.process)
        o = self.options
        if o.nccl_ub:
            self.nccl_pool = NcclMemPool(self.groups.distributed, self.device)
        if o.contiguous_grad_buffer:
            with self.nccl_pool.allocate() if self.nccl_pool else contextlib.nullcontext():
                self._make_buffers(GRADS)
        if o.contiguous_param_buffer:
            self._make_buffers(PARAMS)
        self.shards = [self._shard_state(lay) for lay in self.layouts]

    def _shard_state(self, lay: BucketLayout) -> ShardState:
        o, rank = self.options, self.groups.distributed_rank
        tp_rank = self.groups.tensor_parallel_rank
        dtype = lay.key.state
        pieces = lay.shard_pieces(rank)
        master = self.params_shard(lay.index, torch.float32 if o.with_scaled_states else dtype
                                   ).to(self.state_device)
        # Remainders only where the bucket syncs bf16 params from an fp32 state; other
        # buckets (e.g. an fp32 param in its own bucket) keep a master unless the
        # parameter itself holds the state dtype.
        remainders = o.store_param_remainders and lay.key.allows_remainders
        store_master = o.store_params or (
            o.store_param_remainders and not remainders
            and any(self.params[f.param].dtype != dtype for f in lay.fragments))
        scaled = None
        if o.with_scaled_states:
            ranges = [(p.shard_start, p.shard_end) for p in pieces]
            if remainders or not store_master:  # the master is exact (the parameter, plus
                # its remainder): only the moments are scaled, in bf16
                scaled = ScaledStates(ranges, lay.shard_size, torch.bfloat16,
                                      self.state_device, keys=MOMENTS)
            else:
                scaled = ScaledStates(ranges, lay.shard_size, dtype, self.state_device)
                scaled.store("param", master)
        plain = not o.with_scaled_states

        def zeros():
            return (torch.zeros(lay.shard_size, dtype=dtype, device=self.state_device)
                    if plain else None)

        return ShardState(
            master=master if store_master and plain else None,
            remainder=split_remainder(master)[1] if remainders else None,
            exp_avg=zeros(), exp_avg_sq=zeros(), scaled=scaled,
            group_ranges=merge_pieces(pieces, lambda p: self.group_of[p.param]),
            norm_ranges=merge_pieces(pieces, lambda p: bool(
                getattr(self.params[p.param], "tensor_model_parallel", False) or tp_rank == 0)),
        )

    def _make_buffers(self, which: str) -> None:
        """One persistent buffer per bucket key (gradients in the grad-sync dtype,
        parameters in the param-sync dtype); buckets of one key are adjacent."""
        sizes: dict[BucketKey, int] = {}
        offsets = []
        for lay in self.layouts:
            offsets.append(sizes.get(lay.key, 0))
            sizes[lay.key] = offsets[-1] + lay.size
        self.buffers[which] = {
            key: torch.zeros(n, dtype=key.grad if which == GRADS else key.param,
                             device=self.device) for key, n in sizes.items()}
        self.buffer_offsets = offsets

    def bucket_buffers(self, which: str) -> list[torch.Tensor] | None:
        """Each bucket's view of the persistent ``which`` buffer, or None without one."""
        buffers = self.buffers.get(which)
        if buffers is None:
            return None
        return [buffers[lay.key][off:off + lay.size]
                for lay, off in zip(self.layouts, self.buffer_offsets)]

    def buffer_view(self, which: str, index: int) -> torch.Tensor:
        """Parameter ``index`` as a param-shaped view of the persistent ``which`` buffer."""
        frags = self.fragments.get(index)
        if not frags:
            raise ValueError("this parameter has no storage in the optimizer's buffers "
                             "(requires_grad=False?)")
        p = self.params[index]
        offsets = self.buffer_offsets
        base = offsets[frags[0].bucket] + frags[0].bucket_start - frags[0].param_start
        for f in frags:  # a parameter split across buckets is still contiguous in the buffer
            assert offsets[f.bucket] + f.bucket_start == base + f.param_start
        return self.buffers[which][self.keys[index]][base:base + p.numel()].view(p.shape)

    def params_to_buffer_views(self) -> None:
        """``contiguous_param_buffer``: every trained parameter becomes its view of the
        parameter buffer (holding its current values)."""
        for i, p in enumerate(self.params):
            if i not in self.keys:
                continue
            if p.dtype != self.keys[i].param:
                raise OptionError(
                    f"contiguous_param_buffer=True needs parameters of param_sync_dtype "
                    f"({self.keys[i].param}); parameter {i} is {p.dtype}")
            view = self.buffer_view(PARAMS, i)
            with torch.no_grad():
                view.copy_(p)
            p.data = view

    # -- shard values ----------------------------------------------------------------
    def params_shard(self, b: int, dtype: torch.dtype) -> torch.Tensor:
        """A fresh shard of bucket ``b`` holding the parameters' current values (zero gaps)."""
        lay = self.layouts[b]
        shard = torch.zeros(lay.shard_size, dtype=dtype, device=self.device)
        self.copy_params_into(shard, lay.shard_pieces(self.groups.distributed_rank))
        return shard

    def copy_params_into(self, shard: torch.Tensor, pieces) -> None:
        """Copy the parameters' values of ``pieces`` into their places in ``shard``."""
        srcs = [flat_view(self.params[p.param].detach())[p.param_start:p.param_end]
                for p in pieces]
        dsts = [shard[p.shard_start:p.shard_end] for p in pieces]
        if srcs and srcs[0].device != shard.device or any(s.dtype == torch.float64 for s in srcs):
            for s, d in zip(srcs, dsts):
                d.copy_(s)
        else:
            kernels.multi_copy(srcs, dsts)

    def master_shard(self, b: int) -> torch.Tensor:
        """The master values of bucket ``b``'s shard, in the state dtype (exact with
        remainders: the bf16 parameter merged with the int16 remainder)."""
        st = self.shards[b]
        if st.master is not None:
            return st.master
        if st.remainder is not None:
            hi = split_remainder(self.params_shard(b, torch.float32).to(self.state_device))[0]
            return merge_remainder(hi, st.remainder)
        if st.scaled is not None and st.scaled.has_master:
            return st.scaled.unscaled("param")
        return self.params_shard(b, self.layouts[b].key.state)

    def moments(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq) of bucket ``b``'s shard (fp32 copies when scaled)."""
        st = self.shards[b]
        if st.scaled is not None:
            return st.scaled.unscaled("exp_avg"), st.scaled.unscaled("exp_avg_sq")
        return st.exp_avg, st.exp_avg_sq

    def store_moments(self, b: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Set bucket ``b``'s moments (the tensors :meth:`moments` gave, or others)."""
        st = self.shards[b]
        if st.scaled is not None:
            st.scaled.store("exp_avg", exp_avg.to(self.state_device))
            st.scaled.store("exp_avg_sq", exp_avg_sq.to(self.state_device))
        elif exp_avg is not st.exp_avg:
            st.exp_avg.copy_(exp_avg)
            st.exp_avg_sq.copy_(exp_avg_sq)

    def store_master_shard(self, b: int, values: torch.Tensor, stale_params) -> None:
        """Set bucket ``b``'s master shard (loading a checkpoint). Without a stored master
        the parameters are the master: the user loads them with the model. With
        remainders the bf16 high halves go to the parameters through a gather:
        ``stale_params(b)`` gives the shard buffer that gather sends."""
        st = self.shards[b]
        values = values.to(self.state_device)
        if st.master is not None:
            st.master.copy_(values)
        elif st.scaled is not None and st.scaled.has_master:
            st.scaled.store("param", values)
        elif st.remainder is not None:
            # Both halves from the loaded master, whatever rounding the user's model load
            # used: the remainder here, the bf16 high halves through a parameter gather.
            hi, rem = split_remainder(values.float().contiguous())
            st.remainder.copy_(rem)
            stale_params(b).copy_(hi)

    def gather(self, shard: torch.Tensor, size: int) -> torch.Tensor:
        """A bucket's full ``size`` elements from every distributed rank's ``shard``
        (gathered on the device: offloaded state is on the host)."""
        shard = shard.to(self.device)
        full = torch.empty(size, dtype=shard.dtype, device=shard.device)
        self.comm.all_gather(shard, full, self.groups.distributed).wait()
        return full

    def shard_spans(self) -> dict[int, list[tuple[int, int]]]:
        """``{param index: [(start, end)]}``: the ranges of each flattened parameter whose
        optimizer state this rank holds."""
        spans: dict[int, list[tuple[int, int]]] = {}
        for lay in self.layouts:
            for pc in lay.shard_pieces(self.groups.distributed_rank):
                spans.setdefault(pc.param, []).append((pc.param_start, pc.param_end))
        return spans

    def exclude_from_norm(self, param: torch.Tensor) -> None:
        """Leave ``param`` out of this rank's gradient norm (e.g. a pipeline's tied
        embedding copy that another stage counts). Call it once the layout is made;
        ``param`` must have bucket(s) of its own (``init_params_bucket([param])``)."""
        if not self.built:
            raise RuntimeError("exclude_from_norm: the layout is not made yet (it is at the "
                               "first gradient, step() or grad_sync())")
        index = self.index[id(param)]
        for f in self.fragments.get(index, ()):
            lay = self.layouts[f.bucket]
            if set(lay.params) != {index}:
                raise ValueError("exclude_from_norm: the parameter shares a bucket with other "
                                 "parameters; lay it out with init_params_bucket([param])")
            st = self.shards[f.bucket]  # a bucket of its own: every range is this parameter's
            st.norm_ranges = [(a, e, False) for a, e, _ in st.norm_ranges]


def check_fingerprint(params: list[torch.Tensor], group, device) -> None:
    """Fail loudly (on every rank) when ranks have different parameters. A collective,
    called where every rank passes: the constructor and the making of the layout
    (before any other collective of the layout)."""
    if comm.group_size(group) == 1:
        return
    text = repr([(tuple(p.shape), str(p.dtype), p.requires_grad) for p in params])
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    n = len(params)
    mine = torch.tensor([h, n, -h, -n], dtype=torch.int64, device=device)
    # One MAX gives (max, -min) of both: they equal this rank's iff all ranks agree.
    agreed = comm.all_reduce(mine.clone(), group, dist.ReduceOp.MAX)
    if not torch.equal(agreed, mine):
        raise RuntimeError(
            "DistributedFusedAdam: ranks of the process group have different parameters "
            f"(counts or shapes differ between ranks; this rank has {n} params)")


def broadcast_params(params: list[torch.Tensor], group) -> None:
    """Overwrite the trainable parameters with the first rank's values (all ranks)."""
    with torch.no_grad():
        comm.broadcast_from_first([p.data for p in params if p.requires_grad], group)
