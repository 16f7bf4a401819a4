"""The gradient norm, clipping and the GradScaler integration, all folded into the one
``grad_scale`` device scalar the Adam kernels read (no pass over the gradients). The norm
is taken over the reduced shards, summed over the distributed and model-parallel groups,
TP-replicated parameters counted on TP rank 0 only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mpzero import comm, kernels
from mpzero.optimizers.grad_sync import GradSync
from mpzero.optimizers.options import Groups
from mpzero.optimizers.shards import ShardStore
from mpzero.optimizers.step_state import StepState


class GradNorm:
    """Norms, found-inf checks and unscaling over one optimizer's synced gradients."""

    def __init__(self, store: ShardStore, grads: GradSync, groups: Groups, state: StepState,
                 sync: Callable[[], None]):
        self.store, self.grads, self.groups, self.state = store, grads, groups, state
        self.sync = sync  # synchronizes every gradient (a collective)
        self.cache: tuple[tuple, torch.Tensor] | None = None

    def views(self, parameters=None) -> list[torch.Tensor]:
        """This rank's synchronized gradient ranges that the norm counts (TP-replicated
        parameters only on TP rank 0): slices of the shards, or the direct gradients
        themselves where they stand for a shard (grad_bucket.py). Call after ``sync``."""
        views = []
        store, rank = self.store, self.groups.distributed_rank
        wanted = None if parameters is None else {store.index[id(p)] for p in parameters}
        tp_rank = self.groups.tensor_parallel_rank
        for bucket, st, lay in zip(self.grads.buckets, store.shards, store.layouts):
            direct = bucket.direct_grads()
            shard = None if direct is not None else bucket.shard
            if direct is None and shard is None:
                continue
            if wanted is None and direct is None:
                views += [shard[a:b] for a, b, counted in st.norm_ranges if counted]
                continue
            for piece in lay.shard_pieces(rank):
                if wanted is None:
                    keep = _counted(st.norm_ranges, piece.shard_start)
                else:
                    p = store.params[piece.param]
                    keep = piece.param in wanted and (
                        getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
                if keep:
                    views.append(direct[piece.param] if direct is not None
                                 else shard[piece.shard_start:piece.shard_end])
        return views

    def norm(self, parameters=None, norm_type: float = 2.0,
             force: bool = False) -> torch.Tensor:
        """2-norm of the synchronized gradients times the pending grad scale (cached until
        the gradients change)."""
        if float(norm_type) != 2.0:
            raise ValueError(f"grad_norm: only norm_type=2.0 is supported, got {norm_type!r}")
        if parameters is not None:
            parameters = ([parameters] if isinstance(parameters, torch.Tensor)
                          else list(parameters))
        self.sync()
        key = (self.grads.version, None if parameters is None else
               tuple(id(p) for p in parameters))
        if force or self.cache is None or self.cache[0] != key:
            views = self.views(parameters)
            sq = kernels.l2norm(views, device=self.store.device).to(
                self.store.device, torch.float32) ** 2
            comm.all_reduce(sq, self.groups.distributed)
            if self.groups.model_parallel is not None:
                comm.all_reduce(sq, self.groups.model_parallel)
            self.cache = (key, sq.sqrt())
        return self.cache[1] * self.state.grad_scale

    def clip(self, max_norm: float, parameters=None, norm_type: float = 2.0) -> torch.Tensor:
        """The norm; folds ``min(1, max_norm / (norm + 1e-6))`` into the grad scale."""
        if isinstance(max_norm, torch.Tensor):
            max_norm = float(max_norm)
        if not max_norm > 0:  # also NaN
            raise ValueError(
                f"clip_grad_norm(max_norm={max_norm!r}): max_norm must be positive (a negative "
                "one would turn the step uphill, zero would zero it); to log the norm without "
                "clipping call grad_norm()")
        norm = self.norm(parameters, norm_type)
        self.state.scale_by(torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0))
        return norm

    def found_inf(self) -> torch.Tensor:
        """1.0 on every rank when any synchronized gradient (anywhere) is inf/NaN."""
        # Per element, as torch's GradScaler: the largest magnitude is finite exactly
        # when every element is (NaN propagates). A squared norm would overflow for
        # finite gradients above ~1.8e19 and skip steps torch takes.
        self.sync()
        views = [v for v in self.views() if v.numel()]
        device = self.store.device
        if views:
            amax = torch.stack(torch._foreach_norm(views, ord=float("inf"))).float().amax()
        else:
            amax = torch.zeros((), dtype=torch.float32, device=device)
        flag = (~torch.isfinite(amax.to(device))).to(torch.float32)
        comm.all_reduce(flag, self.groups.distributed, dist.ReduceOp.MAX)
        if self.groups.model_parallel is not None:
            comm.all_reduce(flag, self.groups.model_parallel, dist.ReduceOp.MAX)
        return flag

    def unscale(self, inv_scale, grad_scaler, owner) -> dict:
        """Fold ``inv_scale`` (or ``grad_scaler``'s inverse scale, recording the found inf
        in its state for ``owner``) into the grad scale; ``{device: found-inf flag}``."""
        if grad_scaler is not None and not grad_scaler.is_enabled():
            return {}
        if grad_scaler is not None:
            from torch.amp.grad_scaler import OptState

            state = grad_scaler._per_optimizer_states[id(owner)]
            if state["stage"] is OptState.UNSCALED:
                raise RuntimeError("unscale_grads() has already been called on this optimizer "
                                   "since the last update()")
        found = self.found_inf()  # a collective: after the refusals every rank makes alike
        if grad_scaler is not None:
            scale = grad_scaler._scale
            inv_scale = scale.double().reciprocal().float()
            state["found_inf_per_device"][found.device] = found.to(scale.device)
            state["stage"] = OptState.UNSCALED
        self.state.scale_by(torch.as_tensor(inv_scale, dtype=torch.float32).to(self.store.device))
        return {found.device: found.reshape(1)}

    def scaler_found_inf(self, grad_scaler, owner) -> torch.Tensor:
        """``step(grad_scaler=...)``: unscale unless the user did, and the found-inf flag
        summed over the scaler's devices."""
        from torch.amp.grad_scaler import OptState

        state = grad_scaler._per_optimizer_states[id(owner)]
        if state["stage"] is OptState.UNSCALED and not state["found_inf_per_device"]:
            raise RuntimeError(
                "GradScaler.unscale_(optimizer) cannot unscale DistributedFusedAdam's "
                "gradients: ZeRO-2 keeps them in sharded buckets and frees param.grad, so "
                "torch's unscale_ found none (and clipping after it sees none either). "
                "Call optimizer.unscale_grads(grad_scaler=scaler) instead of "
                "scaler.unscale_(optimizer), and clip with optimizer.clip_grad_norm().")
        if state["stage"] is not OptState.UNSCALED:
            self.unscale(None, grad_scaler, owner)
        return sum(v.to(self.store.device) for v in state["found_inf_per_device"].values())


def _counted(norm_ranges, pos: int) -> bool:
    """Whether the norm range holding shard position ``pos`` is counted."""
    return any(a <= pos < b and counted for a, b, counted in norm_ranges)
