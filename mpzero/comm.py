"""Collectives over NCCL or gloo behind one interface.

The optimizer never calls ``torch.distributed`` directly: it starts a collective
here and gets a :class:`Pending` back, which it finishes later. What differs
between backends lives in this file only:

- CUDA/NCCL: a :class:`CommContext` owns ``pipeline_size`` side streams
  (round-robin). A collective waits for the compute stream, runs on a side
  stream, and records an event; finishing makes the compute stream wait for
  that event. The buffers stay referenced by the :class:`Pending` until then, so
  the caching allocator cannot hand their memory out while NCCL still uses it
  (they are freed only after the compute stream has waited for the event).
- CPU/gloo: gloo has no coalescing manager and no streams; collectives are
  issued one by one with ``async_op=True`` and waited on the host. A collective
  that needs another one's result (the redundant all-reduce of a reduce-scattered
  shard) is issued when its :class:`Pending` is finished, and finishing one first
  finishes every earlier such collective of the context: the second stages go out
  in the order the first ones were issued, on every rank, whichever bucket a rank
  happens to finish first.

Groups of size 1 (and ``group=None`` without an initialized process group) are
handled locally without any communication.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch >= 2.13 renamed the tensor collectives; older builds (e.g. torch 2.11) only
# have the original names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _SelfGroup:
    """The trivial group of one rank (no process group object is needed for it)."""

    def __repr__(self) -> str:
        return "comm.SELF"


SELF = _SelfGroup()


def group_size(group) -> int:
    """World size of ``group`` (1 for :data:`SELF` or without torch.distributed)."""
    if group is SELF or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    if group is SELF or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


_GATHER_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8,
                  torch.int8, torch.int32, torch.int64)


def reduce_op(average: bool) -> dist.ReduceOp:
    return dist.ReduceOp.AVG if average else dist.ReduceOp.SUM


@dataclass
class Pending:
    """An asynchronous collective in flight: finish with :meth:`wait`."""

    works: list = field(default_factory=list)  # host-side gloo works
    event: torch.cuda.Event | None = None  # CUDA: recorded on the side stream
    tensors: tuple = ()  # kept alive while the collective runs
    then: Callable[[], None] | None = None  # gloo: the next stage, run after the works
    done: bool = False
    # gloo: the context's pendings with a ``then`` stage, in issue order (this one among them)
    queue: collections.deque | None = None

    def wait(self) -> None:
        if self.done:
            return
        queue = self.queue
        if queue is not None:
            # The ``then`` stages are collectives too: issue the earlier ones first, so
            # their order is the issue order on every rank.
            while queue and queue[0] is not self:
                queue[0].wait()
            if queue and queue[0] is self:
                queue.popleft()
        for w in self.works:
            w.wait()
        if self.then is not None:
            self.then()
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        self.done = True
        self.tensors = ()


DONE = Pending(done=True)


class CommContext:
    """Owns the side streams collectives run on (CUDA), nothing on CPU."""

    def __init__(self, device: torch.device, pipeline_size: int = 2):
        if pipeline_size < 1:
            raise ValueError(f"pipeline_size must be at least 1, got {pipeline_size}")
        self.device = torch.device(device)
        self.pipeline_size = pipeline_size
        self.streams: list[torch.cuda.Stream] = []
        if self.device.type == "cuda":
            # Side streams for collectives; round-robin so up to pipeline_size
            # buckets communicate concurrently.
            self.streams = [torch.cuda.Stream(self.device) for _ in range(pipeline_size)]
        self._next = itertools.cycle(range(len(self.streams))) if self.streams else None
        # gloo: pendings whose second stage is still to be issued, in issue order.
        self._staged: collections.deque[Pending] = collections.deque()

    @property
    def is_cuda(self) -> bool:
        return bool(self.streams)

    def _stream(self) -> torch.cuda.Stream:
        stream = self.streams[next(self._next)]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return stream

    def reduce_scatter(
        self,
        full: torch.Tensor,
        shard: torch.Tensor,
        distributed_group: dist.ProcessGroup | None,
        redundant_group: dist.ProcessGroup | None,
        average: bool,
    ) -> Pending:
        """``shard`` = this rank's part of ``full`` reduced over the distributed group,
        then all-reduced over the redundant group (AVG or SUM on both: the result is
        the mean, or the sum, over distributed × redundant)."""
        op = reduce_op(average)
        dist_n, red_n = group_size(distributed_group), group_size(redundant_group)

        def stage1(async_op: bool):
            if dist_n == 1:
                shard.copy_(full)
                return None
            return _reduce_scatter(shard, full, op=op, group=distributed_group, async_op=async_op)

        def stage2():
            if red_n > 1:
                dist.all_reduce(shard, op=op, group=redundant_group)

        if self.is_cuda:
            stream = self._stream()
            with torch.cuda.stream(stream):
                stage1(False)
                stage2()
                event = torch.cuda.Event()
                event.record(stream)
            return Pending(event=event, tensors=(full, shard))
        work = stage1(True)
        if red_n == 1:
            return Pending(works=[work] if work is not None else [], tensors=(full, shard))
        pending = Pending(works=[work] if work is not None else [], tensors=(full, shard),
                          then=stage2, queue=self._staged)
        self._staged.append(pending)
        return pending

    def all_gather(self, shard: torch.Tensor, full: torch.Tensor,
                   group: dist.ProcessGroup | None) -> Pending:
        """``full`` = concatenation of every rank's ``shard`` (``shard`` may be a view of
        this rank's slice of ``full``)."""
        if group_size(group) == 1:
            if shard.data_ptr() != full.data_ptr():
                full.copy_(shard)
            return DONE
        if shard.dtype not in _GATHER_DTYPES:
            # Neither NCCL nor gloo moves int16 (nor gloo the wide unsigned types): an
            # all-gather only moves bytes.
            shard, full = shard.view(torch.uint8), full.view(torch.uint8)
        if self.is_cuda:
            stream = self._stream()
            with torch.cuda.stream(stream):
                _all_gather(full, shard, group=group)
                event = torch.cuda.Event()
                event.record(stream)
            return Pending(event=event, tensors=(shard, full))
        work = _all_gather(full, shard, group=group, async_op=True)
        return Pending(works=[work], tensors=(shard, full))


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None,
               op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """Blocking (host-ordered) all-reduce in place; a no-op for groups of size 1."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather_object(obj, group: dist.ProcessGroup | None) -> list:
    """Every rank's ``obj`` (a list of one for groups of size 1)."""
    n = group_size(group)
    if n == 1:
        return [obj]
    out = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_from_first(tensors: list[torch.Tensor], group: dist.ProcessGroup | None,
                         chunk_elements: int = 1 << 26) -> None:
    """Overwrite ``tensors`` with the values of the group's first rank.

    Tensors of one dtype are packed into flat buffers of about ``chunk_elements``
    (one collective each, a bounded transient), then unpacked."""
    if group_size(group) == 1 or not tensors:
        return
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    chunks: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    for t in tensors:
        lists = chunks.setdefault(t.dtype, [[]])
        if lists[-1] and sum(x.numel() for x in lists[-1]) + t.numel() > chunk_elements:
            lists.append([])
        lists[-1].append(t)
    for lists in chunks.values():
        for same in lists:
            flat = torch.cat([t.reshape(-1) for t in same])
            dist.broadcast(flat, src, group=group)
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()


def agree(error: BaseException | None, group, device) -> None:
    """Agree on a verdict across ``group`` (collective): return when no rank passes an
    error; otherwise raise the same ``ValueError`` on every rank, with the message of the
    lowest rank that failed. So a load refused by one rank is refused by all, before any
    of them changes state (each calls this between checking and applying).

    The message travels as UTF-8 bytes in tensors (one MIN all-reduce when all is well;
    two broadcasts more when not): nothing is pickled. An error that was an
    :class:`~mpzero.checkpoint.safe_load.UnsafeCheckpointError` is raised as one on
    every rank."""
    n = group_size(group)
    if n == 1:
        if isinstance(error, ValueError):
            raise error
        if error is not None:
            raise ValueError(_error_text(error)) from error
        return
    me = group_rank(group)
    flag = torch.tensor([me if error is not None else n], dtype=torch.int64, device=device)
    all_reduce(flag, group, dist.ReduceOp.MIN)
    first = int(flag.item())
    if first == n:
        return
    src = dist.get_global_rank(group, first) if group not in (None, dist.group.WORLD) \
        else first
    data = _error_text(error).encode() if me == first else b""
    unsafe = me == first and type(error).__name__ == "UnsafeCheckpointError"
    head = torch.tensor([len(data), int(unsafe)], dtype=torch.int64, device=device)
    dist.broadcast(head, src, group=group)
    buf = torch.zeros(int(head[0]), dtype=torch.uint8, device=device)
    if me == first and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src, group=group)
    msg = bytes(buf.cpu().tolist()).decode(errors="replace")
    msg = f"{msg} [refused on rank {src}; nothing was loaded on any rank]"
    if int(head[1]):
        from mpzero.checkpoint.safe_load import UnsafeCheckpointError

        raise UnsafeCheckpointError(msg) from error  # the refusing rank keeps its cause
    raise ValueError(msg) from error


def _error_text(error: BaseException) -> str:
    return str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
