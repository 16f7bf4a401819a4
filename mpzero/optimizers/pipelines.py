"""What works on the layout once it is made: the gradient and parameter pipelines, the
gradient norm and the stepper, built together from the shard store."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from mpzero.comm import CommContext
from mpzero.kernels import cpu_adam
from mpzero.optimizers.grad_bucket import GradStorage
from mpzero.optimizers.grad_sync import GradSync
from mpzero.optimizers.norm import GradNorm
from mpzero.optimizers.offload import HostStaging, boundary_for
from mpzero.optimizers.offload_step import OffloadStepper
from mpzero.optimizers.param_sync import ParamSync
from mpzero.optimizers.shards import GRADS, PARAMS, ShardStore
from mpzero.optimizers.step import Stepper
from mpzero.optimizers.step_state import StepState


class Pipelines(NamedTuple):
    """What exists once the layout is made."""

    grads: GradSync
    gathers: ParamSync
    norm: GradNorm
    stepper: Stepper


def build_pipelines(store: ShardStore, state: StepState, ctx: CommContext,
                    sync: Callable[[], None]) -> Pipelines:
    """Make ``store``'s layout final (a collective) and the objects working on it.
    ``sync``: synchronizes every gradient (what the norm calls first)."""
    o, g = store.options, store.groups
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
    grads = GradSync(store.layouts, storages, store.fragments, o.device, ctx,
                     g.distributed, g.redundant, g.distributed_rank, o.average_grad_sync)
    gathers = ParamSync(store.layouts, [lay.key.param for lay in store.layouts], o.device,
                        ctx, g.distributed, g.distributed_rank, store.params,
                        persistent=store.bucket_buffers(PARAMS))
    if o.cpu_offload:
        stepper = OffloadStepper(o, store, grads, gathers, state,
                                 staging=HostStaging(boundary_for(o.device)),
                                 threads=o.cpu_offload_threads or cpu_adam.default_threads())
    else:
        stepper = Stepper(o, store, grads, gathers, state)
    return Pipelines(grads, gathers, GradNorm(store, grads, g, state, sync), stepper)
