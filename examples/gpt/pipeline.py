"""Pipeline parallelism for the GPT example: stages, a 1F1B schedule, tied embeddings.

A pipeline group of ``P`` ranks splits the blocks into ``P`` consecutive stages
(:func:`stage_layers`); the first also holds the embeddings, the last the final norm and
an output layer tied to its own copy of ``wte``. Each iteration runs ``M`` micro-batches
with the 1F1B schedule of :func:`forward_backward_1f1b` (stage ``r``: ``P - r - 1``
warm-up forwards, one forward one backward, then the remaining backwards), activations
and their gradients going point-to-point between neighbouring stages. One
DistributedFusedAdam per stage (ZeRO-2 over the stage's DP group, the TP x PP group as
``model_parallel_group`` so the grad norm is the global one). :class:`TiedEmbedding`
keeps the two ``wte`` copies equal: ``wte`` has optimizer buckets of its own on both
stages (the same layout, so shard ``k`` holds the same elements), whose synced gradient
shards are all-reduced over the embedding group before the step. The README's "Pipeline
parallelism" section says why the schedule is our own and how it stays deadlock-free.
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch
import torch.distributed as dist

from mpzero import parallel_state

from . import optim
from .model import GPT, GPTConfig

TAG_FORWARD, TAG_BACKWARD = 1, 2
_WARMED_UP: set = set()  # NCCL pipeline groups whose communicator exists


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The global block indices of stage ``pp_rank``: consecutive, sizes differ by <= 1."""
    if num_layers < pp_size:
        raise ValueError(f"--num-layers ({num_layers}) must be at least the pipeline size "
                         f"({pp_size})")
    return range(pp_rank * num_layers // pp_size, (pp_rank + 1) * num_layers // pp_size)


def build_stage(cfg: GPTConfig) -> GPT:
    """This rank's stage of the GPT (the whole model when the pipeline size is 1)."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    return GPT(cfg, pre_process=parallel_state.is_pipeline_first_stage(),
               post_process=parallel_state.is_pipeline_last_stage(),
               layers=stage_layers(cfg.num_layers, pp, rank))


class TiedEmbedding:
    """The word embedding shared by the first and last stage (see the module docstring).

    Create it right after the optimizer, before any backward (it fixes wte's place in
    the layout).
    """

    def __init__(self, model: GPT, optimizer) -> None:
        self.optimizer = optimizer
        self.group = parallel_state.get_embedding_group()
        w = model.wte.weight
        rest = [p for p in reversed(optimizer.parameters()) if p.requires_grad and p is not w]
        if parallel_state.is_pipeline_first_stage():
            optimizer.init_params(rest)  # the default (backward) order, wte's bucket last
            optimizer.init_params_bucket([w])
        else:
            optimizer.init_params_bucket([w])
            optimizer.init_params(rest)
        self.weight, self.checked = w, False

    def _check_layout(self, shards: list[torch.Tensor]) -> None:
        """Both stages laid wte out alike (same shard sizes), once; the last stage's copy
        leaves the gradient norm (the first stage counts wte)."""
        sizes = torch.tensor([s.numel() for s in shards], dtype=torch.int64,
                             device=self.weight.device)
        agreed = sizes.clone()
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        if not torch.equal(agreed, sizes):
            raise RuntimeError("tied embedding: the first and last stage laid out wte "
                               "differently (different bucket_cap_mb or optimizer grid?)")
        if parallel_state.is_pipeline_last_stage():
            self.optimizer.shards.exclude_from_norm(self.weight)
        self.checked = True

    def all_reduce_grads(self) -> None:
        """Sum the synced ``wte`` gradient shards of the two stages (grad_sync included)."""
        shards = self.optimizer.grad_shards(self.weight)
        if not self.checked:
            self._check_layout(shards)
        for shard in shards:
            dist.all_reduce(shard, group=self.group)


def tie_embedding(model: GPT, optimizer) -> TiedEmbedding | None:
    """:class:`TiedEmbedding` on the first and last stage of a pipeline, else None."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return None
    if model.cfg.untie_embeddings_and_output_weights:
        return None
    if not (model.pre_process or model.post_process):
        return None
    return TiedEmbedding(model, optimizer)


class _P2P:
    """Point-to-point messages of one schedule run with the neighbouring stages."""

    def __init__(self, shape: tuple[int, ...], device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        self.shape, self.device, self.dtype = shape, device, dtype
        self.first = parallel_state.is_pipeline_first_stage()
        self.last = parallel_state.is_pipeline_last_stage()
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.next = parallel_state.get_pipeline_model_parallel_next_rank()
        self.prev = parallel_state.get_pipeline_model_parallel_prev_rank()
        self.batched = dist.get_backend(self.group) == "nccl"
        self.pending: list = []  # (work, tensor) of sends in flight
        if self.batched and self.group not in _WARMED_UP:
            # NCCL: the group's first batch_isend_irecv must involve all its ranks (torch's
            # docs); a collective creates the communicator first.
            dist.all_reduce(torch.zeros(1, device=device), group=self.group)
            _WARMED_UP.add(self.group)

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def _run(self, sends: list[tuple[torch.Tensor, int, int]],
             recvs: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Send ``(tensor, peer, tag)``s and receive ``(peer, tag)``s; wait for the receives."""
        bufs = [self._buffer() for _ in recvs]
        if self.batched and sends + recvs:
            ops = [dist.P2POp(dist.isend, t, peer, self.group, tag) for t, peer, tag in sends]
            ops += [dist.P2POp(dist.irecv, b, peer, self.group, tag)
                    for b, (peer, tag) in zip(bufs, recvs)]
            # Coalesced: one work for the whole batch, or one per op; wait for all.
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            self.pending += [(None, t) for t, _, _ in sends]  # alive until the end
            return bufs
        for t, peer, tag in sends:
            self.pending.append((dist.isend(t, peer, group=self.group, tag=tag), t))
        for b, (peer, tag) in zip(bufs, recvs):
            dist.irecv(b, peer, group=self.group, tag=tag).wait()
        return bufs

    def exchange(self, send_forward: torch.Tensor | None = None,
                 send_backward: torch.Tensor | None = None, recv_forward: bool = False,
                 recv_backward: bool = False) -> list[torch.Tensor]:
        """One step of messages; the first and last stage skip what they have no peer for."""
        sends, recvs = [], []
        if send_forward is not None and not self.last:
            sends.append((send_forward.detach().to(self.dtype).contiguous(), self.next,
                          TAG_FORWARD))
        if send_backward is not None and not self.first:
            sends.append((send_backward.detach().to(self.dtype).contiguous(), self.prev,
                          TAG_BACKWARD))
        if recv_forward and not self.first:
            recvs.append((self.prev, TAG_FORWARD))
        if recv_backward and not self.last:
            recvs.append((self.next, TAG_BACKWARD))
        return self._run(sends, recvs)

    def wait(self) -> None:
        for work, _ in self.pending:
            if work is not None:
                work.wait()
        self.pending = []


def _hidden_shape(model: GPT, batches) -> tuple[int, ...]:
    """The activation a stage sends: (micro, seq, h), or (micro, seq/tp, h) with
    sequence parallelism."""
    micro, seq = batches[0][0].shape
    if model.cfg.sequence_parallel:
        seq //= parallel_state.get_tensor_model_parallel_world_size()
    return (micro, seq, model.cfg.hidden_size)


def _activation_dtype(model: GPT) -> torch.dtype:
    """What stages send: the residual stream's dtype, the parameters' (fp32 also under
    autocast, whose matmul outputs are added to the fp32 stream; bf16 with --bf16)."""
    return next(model.parameters()).dtype


def forward_backward_1f1b(model: GPT, optimizer, batches: list, autocast=contextlib.nullcontext
                          ) -> list[torch.Tensor]:
    """Forward and backward of ``batches`` (``[(ids, targets)]``, every stage gets all)
    through the pipeline with 1F1B; the gradients of ``mean(losses)`` accumulate through
    the optimizer's hooks (``no_sync()`` for all but the last backward). Returns the
    detached losses on the last stage, ``[]`` elsewhere."""
    p2p = _P2P(_hidden_shape(model, batches), batches[0][0].device, _activation_dtype(model))
    M = len(batches)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    warmup = min(pp - parallel_state.get_pipeline_model_parallel_rank() - 1, M)
    in_flight: deque = deque()  # (input, output) of micro-batches awaiting backward
    losses: list[torch.Tensor] = []
    n_forward = n_backward = 0

    def forward(received: list[torch.Tensor]) -> torch.Tensor:
        nonlocal n_forward
        ids, targets = batches[n_forward]
        x = ids if p2p.first else received[0].requires_grad_()
        with autocast():
            y = model(x, targets if p2p.last else None)
        if p2p.last:
            losses.append(y.detach().float())
        in_flight.append((x, y))
        n_forward += 1
        return y

    def backward(received: list[torch.Tensor]) -> torch.Tensor | None:
        nonlocal n_backward
        x, y = in_flight.popleft()
        n_backward += 1
        with contextlib.nullcontext() if n_backward == M else optim.no_sync(optimizer):
            if p2p.last:
                (y / M).backward()
            else:
                torch.autograd.backward(y, grad_tensors=received[0])
        return None if p2p.first else x.grad

    for _ in range(warmup):
        y = forward(p2p.exchange(recv_forward=True))
        p2p.exchange(send_forward=y)
    received = p2p.exchange(recv_forward=True) if warmup < M else []
    for i in range(M - warmup):  # steady state: one forward, one backward
        y = forward(received)
        dx = backward(p2p.exchange(send_forward=y, recv_backward=True))
        received = p2p.exchange(send_backward=dx, recv_forward=i < M - warmup - 1)
    for _ in range(warmup):  # cool-down
        dx = backward(p2p.exchange(recv_backward=True))
        p2p.exchange(send_backward=dx)
    p2p.wait()
    return losses


def _loss_from_last_stage(losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Mean of the last stage's ``losses``, on every rank of the pipeline group."""
    loss = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
    loss = loss.to(device=device, dtype=torch.float32).contiguous()
    dist.broadcast(loss, parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return loss


def train_step(model: GPT, optimizer, batches: list, tied: TiedEmbedding | None, *,
               clip_grad: float, autocast=contextlib.nullcontext) -> tuple:
    """One global batch: 1F1B, the tied-embedding all-reduce, clip, step.
    Returns (mean loss of this data-parallel rank's micro-batches, global grad norm)."""
    optimizer.zero_grad()
    losses = forward_backward_1f1b(model, optimizer, batches, autocast)
    if tied is not None:
        tied.all_reduce_grads()
    grad_norm = optimizer.clip_grad_norm(clip_grad) if clip_grad > 0 else optimizer.grad_norm()
    optimizer.step()
    device = batches[0][0].device
    return _loss_from_last_stage(losses, device), grad_norm.detach().float()


@torch.no_grad()
def forward_only(model: GPT, batches: list, autocast=contextlib.nullcontext) -> torch.Tensor:
    """Mean loss of ``batches`` through the pipeline (no backward), on every stage."""
    p2p = _P2P(_hidden_shape(model, batches), batches[0][0].device, _activation_dtype(model))
    losses = []
    for ids, targets in batches:
        received = p2p.exchange(recv_forward=True)
        with autocast():
            y = model(ids if p2p.first else received[0], targets if p2p.last else None)
        if p2p.last:
            losses.append(y.float())
        p2p.exchange(send_forward=y)
    p2p.wait()
    return _loss_from_last_stage(losses, batches[0][0].device)
