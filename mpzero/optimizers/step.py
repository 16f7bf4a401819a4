"""One optimizer step, top to bottom: sync, scale, fused Adam on the shards, gather.

Mixed into :class:`~mpzero.optimizers.DistributedFusedAdam`::

    step()  -> param_sync() (finish last step's gathers) -> grad_sync() (flush buckets)
            -> grad scaler: found-inf check, unscale folded into grad_scale
            -> _local_step: per phase, mark buckets stale (shard-sized output buffers),
               one fused Adam launch per param group x dtype key (_planned_adam)
            -> all-gather now, or (overlap_param_sync) the first bucket now and the rest
               from the next forward's module pre-hooks

The gradient norm, clipping and GradScaler integration live here too: they fold
into the same ``grad_scale`` device scalar the kernels read.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.optim import optimizer as torch_optimizer

from mpzero import comm, kernels
from mpzero.kernels.precision import copy_high_bytes
from mpzero.optimizers.flat import flat_view
from mpzero.optimizers.options import is_byte_dtype
from mpzero.optimizers.step_direct import DirectGradsMixin
from mpzero.optimizers.step_plan import GRAD, OUT, PlanBuilder, StepPlan
from mpzero.warn import user_stacklevel


class Phase(NamedTuple):
    """Buckets stepped together (static once the layout is made)."""

    buckets: list[int]
    buffered: list[int]  # their step writes a shard-sized output buffer (then gathered)
    start_gathers: bool  # start the parameter gathers right after this phase
    planned: list[int]  # launched through a StepPlan
    general: list[int]  # the rest (argument lists made per step)
    plan_key: tuple  # (bucket, writes the params directly) of the planned ones
    # What _planned_adam works out once for this phase (direct-gradient order, plans
    # and their fully native launches, by bias corrections x direct).
    memo: dict


class StepMixin(DirectGradsMixin):
    """Norms, AMP and the step of DistributedFusedAdam."""

    def _local_sq_norm(self, parameters=None) -> torch.Tensor:
        norm = kernels.l2norm(self._norm_views(parameters), device=self.device)
        return (norm.to(self.device, torch.float32) ** 2)

    def _norm_views(self, parameters=None) -> list[torch.Tensor]:
        """This rank's synchronized gradient ranges that the norm counts (TP-replicated
        parameters only on TP rank 0): slices of the shards, or the direct gradients
        themselves where they stand for a shard (grad_sync.py)."""
        self.grad_sync()
        views = []
        wanted = None if parameters is None else {self._index[id(p)] for p in parameters}
        tp_rank = tensor_parallel_rank(self.model_parallel_group)
        for bucket, st, lay in zip(self._grad.buckets, self._shards, self._layouts):
            direct = bucket.direct_grads()
            shard = None if direct is not None else bucket.shard
            if direct is None and shard is None:
                continue
            if wanted is None and direct is None:
                views += [shard[a:b] for a, b, counted in st.norm_ranges if counted]
                continue
            for piece in lay.shard_pieces(self.distributed_rank):
                if wanted is None:
                    keep = _counted(st.norm_ranges, piece.shard_start)
                else:
                    p = self._params[piece.param]
                    keep = piece.param in wanted and (
                        getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
                if keep:
                    views.append(direct[piece.param] if direct is not None
                                 else shard[piece.shard_start:piece.shard_end])
        return views

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
        if isinstance(max_norm, torch.Tensor):
            max_norm = float(max_norm)
        if not max_norm > 0:  # also NaN
            raise ValueError(
                f"clip_grad_norm(max_norm={max_norm!r}): max_norm must be positive (a negative "
                "one would turn the step uphill, zero would zero it); to log the norm without "
                "clipping call grad_norm()")
        if parameters is not None and not isinstance(parameters, torch.Tensor):
            parameters = list(parameters)
        norm = self.grad_norm(parameters, norm_type)
        coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
        self._grad_scale.mul_(coef)
        self._grad_scaled = True
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
        if self._stepped:
            raise RuntimeError(
                "unscale_grads() called after step() for the same gradients: the unscale "
                "would apply to the next step's gradients. Call it after backward() and "
                "before step() (or scaler.step(optimizer)).")
        self._ensure_layout()
        if grad_scaler is not None and not grad_scaler.is_enabled():
            return {}
        if grad_scaler is not None:
            from torch.amp.grad_scaler import OptState

            state = grad_scaler._per_optimizer_states[id(self)]
            if state["stage"] is OptState.UNSCALED:
                raise RuntimeError("unscale_grads() has already been called on this optimizer "
                                   "since the last update()")
        found = self._found_inf()  # a collective: after the refusals every rank makes alike
        if grad_scaler is not None:
            scale = grad_scaler._scale
            inv_scale = scale.double().reciprocal().float()
            state["found_inf_per_device"][found.device] = found.to(scale.device)
            state["stage"] = OptState.UNSCALED
        inv = torch.as_tensor(inv_scale, dtype=torch.float32).to(self.device)
        self._grad_scale.mul_(inv)
        self._grad_scaled = True
        return {found.device: found.reshape(1)}

    def step(self, closure=None, *, grad_scaler=None):
        """One optimizer step (see the module docstring for the flow).

        Step pre/post hooks (``register_step_pre_hook``, the global ones) and the
        profiler's ``Optimizer.step#...`` range work as for torch optimizers; without
        any of them the step skips torch's per-call wrapper (a measurable share of the
        host time of a step)."""
        if _observed(self):
            return self._observed_step(closure, grad_scaler=grad_scaler)
        return self._step(closure, grad_scaler=grad_scaler)

    # torch.optim.Optimizer wraps a class's step() unless it is marked "hooked": this one
    # calls torch's wrapper itself, when hooks or the profiler need it.
    step.hooked = True

    def _step(self, closure=None, *, grad_scaler=None):
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
            if state["stage"] is OptState.UNSCALED and not state["found_inf_per_device"]:
                raise RuntimeError(
                    "GradScaler.unscale_(optimizer) cannot unscale DistributedFusedAdam's "
                    "gradients: ZeRO-2 keeps them in sharded buckets and frees param.grad, so "
                    "torch's unscale_ found none (and clipping after it sees none either). "
                    "Call optimizer.unscale_grads(grad_scaler=scaler) instead of "
                    "scaler.unscale_(optimizer), and clip with optimizer.clip_grad_norm().")
            if state["stage"] is not OptState.UNSCALED:
                self.unscale_grads(grad_scaler=grad_scaler)
            found_inf = sum(v.to(self.device) for v in state["found_inf_per_device"].values())
            if not self.capturable and found_inf.item():
                self._reset_grad_scale()  # skipped: same decision on every rank
                self._stepped = True
                return loss
        if self.capturable:
            self._step_t.add_(1.0 if found_inf is None else 1.0 - found_inf)
        else:
            self._steps += 1
        # torch.no_grad() without its two per-call objects (what its __enter__/__exit__ do).
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            self._local_step(found_inf if self.capturable else None)
        finally:
            torch._C._set_grad_enabled(grad_mode)
        self._mirror_step()
        self._grad.mark_stepped()
        self._reset_grad_scale()
        self._norm_cache = None
        self._stepped = True
        return loss

    _observed_step = torch.optim.Optimizer.profile_hook_step(_step)

    def _reset_grad_scale(self) -> None:
        """Back to 1 for the next gradients (no device work when it was never changed;
        with ``capturable`` always, so a captured graph resets it)."""
        if self.capturable or self._grad_scaled:
            self._grad_scale.fill_(1.0)
            self._grad_scaled = False

    def step_count(self):
        """Steps taken: an int, or a 0-dim device tensor with ``capturable``."""
        return self._step_t.clone() if self.capturable else self._steps

    def set_step_count(self, step) -> None:
        if self.capturable:
            self._step_t.fill_(float(step))
        else:
            self._steps = int(step.item() if isinstance(step, torch.Tensor) else step)
        self._mirror_step()

    def _mirror_step(self) -> None:
        """``optimizer.state[p]["step"]`` for every trainable parameter, as torch
        optimizers have it: one shared 0-dim fp32 tensor updated in place (a CPU tensor,
        or the device step count with ``capturable``), so no per-parameter work."""
        if self.capturable:
            shared = self._step_t
        else:
            shared = getattr(self, "_step_mirror", None)
            if shared is None:
                shared = self._step_mirror = torch.zeros((), dtype=torch.float32)
            shared.fill_(float(self._steps))
        if not getattr(self, "_step_mirrored", False) and getattr(self, "_built", False):
            for i in self._keys:
                self.state[self._params[i]]["step"] = shared
            self._step_mirrored = True

    def _device_lr(self, gi: int) -> torch.Tensor:
        """capturable: group ``gi``'s lr as a 0-dim device tensor. A number set on the group
        (by the user, a scheduler or a load) is copied in place into that tensor, which
        then stands in the group again, so graphs captured earlier see it."""
        group = self.param_groups[gi]
        while len(self._lr_tensors) <= gi:
            self._lr_tensors.append(None)
        lr_t = self._lr_tensors[gi]
        if lr_t is None:
            lr_t = self._lr_tensors[gi] = torch.zeros((), dtype=torch.float32,
                                                      device=self.device)
            lr_t.fill_(float(group["lr"]))
            group["lr"] = lr_t
        elif group["lr"] is not lr_t:
            value = group["lr"]
            if isinstance(value, torch.Tensor):
                lr_t.copy_(value.reshape(()))
            else:
                lr_t.fill_(float(value))
            group["lr"] = lr_t
        return lr_t

    def _phases(self, deferred: bool) -> list[Phase]:
        """The buckets stepped together, in order; made once per ``deferred``."""
        cache = self.__dict__.setdefault("_phases_cache", {})
        if deferred not in cache:
            order = list(range(len(self._layouts)))
            if deferred and order:
                # The last bucket is used first by the next forward: step it alone, start
                # its gather, and let the gather overlap the step of the rest.
                groups = [([order[-1]], True), (order[:-1], False)]
            else:
                groups = [(order, False)]
            cache[deferred] = [self._phase(buckets, start) for buckets, start in groups]
        return cache[deferred]

    def _phase(self, buckets: list[int], start: bool) -> Phase:
        # Where one rank holds the whole bucket the kernels write the parameters
        # themselves (no shard buffer, no gather, no copy-out).
        direct = {b: self._writes_params(b) for b in buckets}
        plannable = {b: self._plannable(b, direct[b]) for b in buckets}
        planned = [b for b in buckets if plannable[b]]
        return Phase(buckets, [b for b in buckets if not direct[b]], start, planned,
                     [b for b in buckets if not plannable[b]],
                     tuple((b, direct[b]) for b in planned), {})

    def _local_step(self, found_inf: torch.Tensor | None = None) -> None:
        self._found_inf_for_kernels = found_inf
        deferred = self.overlap_param_sync and bool(self._module_hooks)
        for phase in self._phases(deferred):
            outs = dict.fromkeys(phase.buckets)
            for b in phase.buffered:
                outs[b] = self._param_sync.mark_stale(b)
            # One fused launch per (param group, dtype key, kind) over the phase's buckets.
            if phase.planned:
                self._planned_adam(phase, outs)
            if phase.general:
                self._general_adam(phase.general, outs)
            if phase.start_gathers:
                self._param_sync.start_through(phase.buckets[0])
        if self.overlap_param_sync and not self._module_hooks and not self._warned_no_module:
            self._warned_no_module = True
            warnings.warn("overlap_param_sync=True but no module is attached (module= or "
                          "attach(module)): parameters are gathered at the end of step()",
                          stacklevel=user_stacklevel())
        if not deferred:
            self._param_sync.sync_all()

    def _plannable(self, b: int, direct: bool) -> bool:
        """Bucket ``b``'s launches can be planned once: plain or remainder state, a
        floating param-sync dtype, and a master that is not a per-step copy."""
        st, key = self._shards[b], self._layouts[b].key
        return (st.scaled is None and not is_byte_dtype(key[2])
                and (direct or st.master is not None or st.remainder is not None))

    def _planned_adam(self, phase: Phase, outs) -> None:
        buckets = phase.planned
        directs = self._direct_dicts(phase)
        direct = directs is not None
        key = (tuple([bool(g["bias_correction"]) for g in self.param_groups]), direct)
        memo = phase.memo
        native = memo.get(key)
        if native is not None:
            # Every launch has a native plan: it takes the per-step tensors only (the
            # direct gradients straight from the buckets' dicts, no per-bucket lists).
            plan, runs_of = native
            grads = None if direct else {b: self._grad.buckets[b].shard for b in buckets}
            self._prepare_outs(plan, outs)
            hyper = {}
            for launch, runs in runs_of:
                kw = hyper.get(launch.group)
                if kw is None:
                    kw = hyper[launch.group] = self._hyper(launch.group)
                if direct:
                    dynamic = []
                    for i, get, single in runs:
                        if single:
                            dynamic.append(get(directs[i]))
                        else:
                            dynamic += get(directs[i])
                else:
                    dynamic = launch.per_step(grads, outs)
                launch.native(dynamic, **kw)
            return
        if direct:
            grads = self._direct_grads(phase, directs)
        else:
            grads = {b: self._grad.buckets[b].shard for b in buckets}
        plans = self.__dict__.setdefault("_plans", {})
        plan = plans.get((phase.plan_key, *key))
        if plan is None:
            plan = plans[(phase.plan_key, *key)] = self._build_plan(buckets, outs, direct)
        self._prepare_outs(plan, outs)
        pieces = None
        hyper = {}
        for launch in plan.launches:
            kw = hyper.get(launch.group)
            if kw is None:
                kw = hyper[launch.group] = self._hyper(launch.group)
            if launch.native is not None:  # the per-step shards are all it needs
                launch.native(launch.per_step(grads, outs), **kw)
                continue
            if pieces is None:
                pieces = plan.pieces(grads, outs)
            lists = launch.fill(pieces)
            if launch.remainders:
                lists.append(None)  # no separate output: the bf16 halves are updated in place
            if launch.kernel is None:
                self._choose_kernel(plan, launch, lists, grads, outs, kw["bias_correction"])
            launch.kernel(*lists, **kw)
        if all(launch.native is not None for launch in plan.launches):
            memo[key] = (plan, [(launch, self._direct_runs(phase, launch) if direct else None)
                                for launch in plan.launches])

    def _prepare_outs(self, plan: StepPlan, outs) -> None:
        """What the output buffers must hold before the launches."""
        found_inf = self._found_inf_for_kernels
        for b in plan.needs_out:
            st = self._shards[b]
            if st.remainder is not None:
                # The bf16 high halves come from the parameters and are updated in place,
                # in the buffer that is then gathered.
                if self._param_sync.buckets[b].persistent is None:  # else out *is* params
                    self._copy_params_into(outs[b], self._layouts[b].shard_pieces(
                        self.distributed_rank))
            elif found_inf is not None:
                outs[b].copy_(st.master)  # a skipped step (device flag) gathers old values

    @staticmethod
    def _choose_kernel(plan: StepPlan, launch, lists, grads, outs, bias_correction) -> None:
        """First call of ``launch``: its implementation and, where that supports it, a
        native plan that later steps call with the per-step shards only."""
        launch.kernel = kernels.adam_implementation(launch.remainders, lists, bias_correction)
        slots, launch.bases = plan.native_slots(launch)
        fixed = launch.lists + ([None] if launch.remainders else [])
        launch.native = kernels.adam_plan(launch.kernel, launch.remainders, fixed, slots,
                                          launch.per_step(grads, outs))

    def _build_plan(self, buckets, outs, direct: bool = False) -> StepPlan:
        """``direct``: the gradients come as one tensor per piece (direct gradients)."""
        pb = PlanBuilder()
        for b in buckets:
            st, lay = self._shards[b], self._layouts[b]
            m, v = st.exp_avg, st.exp_avg_sq
            if outs[b] is None:  # direct: per fragment, into the parameters' own storage
                views = self._param_views(b)
                pb.bucket(b, [(s, e) for (s, e, _), _ in views], lay.shard_size, out=False,
                          direct=direct)
                for j, ((s, e, gi), view) in enumerate(views):
                    if st.remainder is not None:
                        pb.add((gi, lay.key, True), True, gi, (
                            view, st.remainder[s:e], (b, GRAD, j), m[s:e], v[s:e]))
                    else:
                        master = view if st.master is None else st.master[s:e]
                        pb.add((gi, lay.key, False), False, gi, (
                            master, (b, GRAD, j), m[s:e], v[s:e], view))
                continue
            pb.bucket(b, [(lo, hi) for lo, hi, _ in st.group_ranges], lay.shard_size,
                      out=True)
            for j, (lo, hi, gi) in enumerate(st.group_ranges):
                if st.remainder is not None:
                    pb.add((gi, lay.key, True), True, gi, (
                        (b, OUT, j), st.remainder[lo:hi], (b, GRAD, j), m[lo:hi], v[lo:hi]))
                else:
                    pb.add((gi, lay.key, False), False, gi, (
                        st.master[lo:hi], (b, GRAD, j), m[lo:hi], v[lo:hi], (b, OUT, j)))
        return pb.finish()

    def _general_adam(self, buckets, outs) -> None:
        """The buckets a plan does not cover (scaled states, byte-level param sync, a
        transient master): argument lists made for this step. Direct and remainder
        buckets are always planned (remainders need bf16 sync and no scaled states)."""
        plain: dict[tuple, tuple[list, ...]] = {}
        byte_outs, rescale = [], []
        for b in buckets:
            st, lay = self._shards[b], self._layouts[b]
            grad = self._grad.buckets[b].shard
            out = outs[b]
            if is_byte_dtype(lay.key[2]):  # the value in the param's dtype, then its top bytes
                value = torch.empty(lay.shard_size, dtype=lay.key[3], device=self.device)
                byte_outs.append((value, out))
                out = value
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
        for b, master, exp_avg, exp_avg_sq in rescale:
            self._shards[b].scaled.store("param", master)
            self._store_moments(b, exp_avg, exp_avg_sq)
        for value, out in byte_outs:
            copy_high_bytes(value, out)

    def _writes_params(self, b: int) -> bool:
        """The step writes bucket ``b``'s parameters in place: one rank holds the whole
        bucket, the state is not scaled, and the value the parameters would receive
        through the sync is the kernel's output cast to their dtype (the param-sync
        dtype is theirs, or fp32, the kernel's own precision, or they are the bf16
        halves of remainders)."""
        # Called once per bucket (the phases are cached). With a contiguous param buffer
        # the shard buffer already is the parameters: writing them directly saves the
        # per-bucket stale/gather bookkeeping.
        if self.distributed_size != 1 or self._shards[b].scaled is not None:
            return False
        sync = self._layouts[b].key[2]
        if is_byte_dtype(sync):
            return False  # the parameters receive the values' top bytes only
        return all(self._params[f.param].dtype == sync
                   or (sync == torch.float32
                       and self._params[f.param].dtype in (torch.float16, torch.bfloat16))
                   for f in self._layouts[b].fragments)

    def _param_views(self, b: int) -> list:
        """``((shard_start, shard_end, group), flat param slice)`` per fragment of bucket
        ``b``'s shard; made once (the parameters' storage does not move)."""
        cache = self.__dict__.setdefault("_param_views_cache", {})
        if b not in cache:
            cache[b] = [((p.shard_start, p.shard_end, self._group_of[p.param]),
                         flat_view(self._params[p.param].detach())[p.param_start:p.param_end])
                        for p in self._layouts[b].shard_pieces(self.distributed_rank)]
        return cache[b]

    def _hyper(self, gi: int) -> dict:
        group = self.param_groups[gi]
        beta1, beta2 = group["betas"]
        lr = self._device_lr(gi) if self.capturable else group["lr"]
        return dict(lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step=self._step_t if self.capturable else self._steps,
                    adam_w_mode=self.adam_w_mode, bias_correction=bool(group["bias_correction"]),
                    grad_scale=self._grad_scale if self.capturable or self._grad_scaled
                    else None, found_inf=self._found_inf_for_kernels)


def _counted(norm_ranges, pos: int) -> bool:
    """Whether the norm range holding shard position ``pos`` is counted."""
    return any(a <= pos < b and counted for a, b, counted in norm_ranges)


def _observed(opt) -> bool:
    """Step hooks are registered (on ``opt`` or globally) or the profiler is on."""
    return bool(opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                or torch_optimizer._global_optimizer_pre_hooks
                or torch_optimizer._global_optimizer_post_hooks
                or torch._C._autograd._profiler_enabled())


def tensor_parallel_rank(model_parallel_group) -> int:
    """TP rank used to count TP-replicated params once in the grad norm.

    With ``parallel_state`` initialized: its TP rank (so a TP x PP model-parallel group
    counts each TP-replicated parameter once per pipeline stage). Without it the
    model-parallel group is taken as pipeline stages (no tensor parallelism): every
    rank counts all of its parameters."""
    if model_parallel_group is None:
        return 0
    from mpzero import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return 0
