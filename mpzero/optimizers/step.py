"""The stepper: fused Adam on every local shard, then the parameter gathers.

::

    run() -> per phase (buckets stepped together): mark the buckets' parameters stale
             (shard-sized output buffers), one fused Adam launch per param group x
             bucket key x kind over the phase's buckets
          -> all-gather now, or (overlap_param_sync) the first-used bucket now and the
             rest from the next forward's module pre-hooks

A phase's launches are worked out once (:mod:`step_plan`): planned buckets (plain or
remainder state) reuse their argument lists, and where the kernels have a native plan
only the per-step tensors cross into it. Buckets a plan cannot cover (scaled states,
byte-level parameter sync, a master that is a per-step copy) get argument lists made
per step. Where one rank holds a whole bucket the kernels write the parameters in place
and may read the gradients themselves (:mod:`step_direct`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mpzero import kernels
from mpzero.kernels.precision import copy_high_bytes
from mpzero.optimizers.flat import flat_view
from mpzero.optimizers.grad_sync import GradSync
from mpzero.optimizers.norm import GradNorm
from mpzero.optimizers.options import Options, is_byte_dtype
from mpzero.optimizers.param_sync import ParamSync
from mpzero.optimizers.shards import ShardStore
from mpzero.optimizers.step_direct import DirectReads
from mpzero.optimizers.step_plan import GRAD, OUT, PlanBuilder, StepPlan
from mpzero.optimizers.step_state import StepState


def by_group(ranges, *columns) -> dict[int, list[list]]:
    """Per param group of ``ranges`` (``(lo, hi, group)`` each), one list per column of
    that group's pieces, in order: a tensor column gives its ``[lo:hi]`` slice, any other
    column (one entry per range) its own entry. One kernel call per group."""
    lists: dict[int, list[list]] = {}
    for k, (lo, hi, gi) in enumerate(ranges):
        per = lists.setdefault(gi, [[] for _ in columns])
        for lst, col in zip(per, columns):
            lst.append(col[lo:hi] if isinstance(col, torch.Tensor) else col[k])
    return lists


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


class Stepper:
    """Runs the local Adam step over a :class:`ShardStore`'s shards, reading the gradient
    pipeline's reduced shards and handing the results to the parameter pipeline."""

    def __init__(self, options: Options, store: ShardStore, grads: GradSync,
                 gathers: ParamSync, state: StepState):
        self.options, self.store, self.grads, self.gathers = options, store, grads, gathers
        self.state = state
        self.rank = store.groups.distributed_rank
        self.found_inf: torch.Tensor | None = None
        self.direct = DirectReads(store.layouts, grads.buckets, self.rank)
        self.phases_cache: dict[bool, list[Phase]] = {}
        self.plans: dict[tuple, StepPlan] = {}
        self.param_views_cache: dict[int, list] = {}

    def step(self, norm: GradNorm, grad_scaler, owner, deferred: bool) -> None:
        """One step over synced gradients: the scaler's found-inf check (a skipped step
        changes nothing), the local step, the gathers (see :meth:`run`), and the per-step
        state back to its start (grad scale 1, norm cache dropped)."""
        state, capturable = self.state, self.options.capturable
        found_inf = None
        if grad_scaler is not None:
            found_inf = norm.scaler_found_inf(grad_scaler, owner)
            if not capturable and found_inf.item():
                state.reset_scale()  # skipped: the same decision on every rank
                return
        state.advance(found_inf)
        # torch.no_grad() without its two per-call objects (what its __enter__/__exit__ do).
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            self.run(found_inf if capturable else None, deferred)
        finally:
            torch._C._set_grad_enabled(grad_mode)
        state.update_mirror()
        self.grads.mark_stepped()
        state.reset_scale()
        norm.cache = None

    def _kwargs(self, gi: int) -> dict:
        return self.state.hyper(gi, self.found_inf)

    def phases(self, deferred: bool) -> list[Phase]:
        """The buckets stepped together, in order; made once per ``deferred``."""
        cache = self.phases_cache
        if deferred not in cache:
            order = list(range(len(self.store.layouts)))
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

    def run(self, found_inf: torch.Tensor | None, deferred: bool) -> None:
        """The local step of every bucket, then the parameter gathers: all now, or
        (``deferred``, a module drives them) the first-used bucket's now and the rest
        from the next forward's pre-hooks. ``found_inf``: the device flag that makes
        the kernels skip (``capturable``)."""
        self.found_inf = found_inf
        for phase in self.phases(deferred):
            outs = dict.fromkeys(phase.buckets)
            for b in phase.buffered:
                outs[b] = self.gathers.mark_stale(b)
            # One fused launch per (param group, dtype key, kind) over the phase's buckets.
            if phase.planned:
                self._planned_adam(phase, outs)
            if phase.general:
                self._general_adam(phase.general, outs)
            if phase.start_gathers:
                self.gathers.start_through(phase.buckets[0])
        if not deferred:
            self.gathers.sync_all()

    def _plannable(self, b: int, direct: bool) -> bool:
        """Bucket ``b``'s launches can be planned once: plain or remainder state, a
        floating param-sync dtype, and a master that is not a per-step copy."""
        st, key = self.store.shards[b], self.store.layouts[b].key
        return (st.scaled is None and not is_byte_dtype(key.param)
                and (direct or st.master is not None or st.remainder is not None))

    def _planned_adam(self, phase: Phase, outs) -> None:
        buckets = phase.planned
        directs = self.direct.dicts(phase)
        direct = directs is not None
        key = (tuple([bool(g["bias_correction"]) for g in self.state.param_groups]), direct)
        memo = phase.memo
        native = memo.get(key)
        if native is not None:
            # Every launch has a native plan: it takes the per-step tensors only (the
            # direct gradients straight from the buckets' dicts, no per-bucket lists).
            plan, runs_of = native
            grads = None if direct else {b: self.grads.buckets[b].shard for b in buckets}
            self._prepare_outs(plan, outs)
            hyper = {}
            for launch, runs in runs_of:
                kw = hyper.get(launch.group)
                if kw is None:
                    kw = hyper[launch.group] = self._kwargs(launch.group)
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
            grads = self.direct.grads(phase, directs)
        else:
            grads = {b: self.grads.buckets[b].shard for b in buckets}
        plans = self.plans
        plan = plans.get((phase.plan_key, *key))
        if plan is None:
            plan = plans[(phase.plan_key, *key)] = self._build_plan(buckets, outs, direct)
        self._prepare_outs(plan, outs)
        pieces = None
        hyper = {}
        for launch in plan.launches:
            kw = hyper.get(launch.group)
            if kw is None:
                kw = hyper[launch.group] = self._kwargs(launch.group)
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
            memo[key] = (plan, [(launch, self.direct.runs(phase, launch) if direct else None)
                                for launch in plan.launches])

    def _prepare_outs(self, plan: StepPlan, outs) -> None:
        """What the output buffers must hold before the launches."""
        found_inf = self.found_inf
        for b in plan.needs_out:
            st = self.store.shards[b]
            if st.remainder is not None:
                # The bf16 high halves come from the parameters and are updated in place,
                # in the buffer that is then gathered.
                if self.gathers.buckets[b].persistent is None:  # else out *is* params
                    self.store.copy_params_into(outs[b], self.store.layouts[b].shard_pieces(
                        self.rank))
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
            st, lay = self.store.shards[b], self.store.layouts[b]
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
        transient master): argument lists made for this step. Plain and remainder
        buckets without scaled states are always planned. Scaled buckets run one at a
        time: their fp32 working copies exist for one bucket's shard only."""
        plain: dict[tuple, tuple[list, ...]] = {}
        byte_outs = []
        for b in buckets:
            st, lay = self.store.shards[b], self.store.layouts[b]
            if st.scaled is not None:
                self._scaled_adam(b, outs[b])
                continue
            grad = self.grads.buckets[b].shard
            out = outs[b]
            if is_byte_dtype(lay.key.param):  # the value in the param's dtype, then its top bytes
                value = torch.empty(lay.shard_size, dtype=lay.key.param_dtype,
                                    device=self.store.device)
                byte_outs.append((value, out))
                out = value
            master = (st.master if st.master is not None
                      else self.store.params_shard(b, lay.key.state))
            if self.found_inf is not None:
                out.copy_(master)  # a skipped step (device flag) must gather the old values
            for lo, hi, gi in st.group_ranges:
                lists = plain.setdefault((gi, lay.key), ([], [], [], [], []))
                for lst, t in zip(lists, (master, grad, st.exp_avg, st.exp_avg_sq, out)):
                    lst.append(t[lo:hi])
        for (gi, _), (p, g, m, v, out) in plain.items():
            kernels.adam(p, g, m, v, out, **self._kwargs(gi))
        for value, out in byte_outs:
            copy_high_bytes(value, out)

    def _scaled_adam(self, b: int, out: torch.Tensor | None) -> None:
        """Bucket ``b`` with scaled states: fp32 working copies of its moments (and of a
        scaled master), the update, and the states stored back with new scales. With
        remainders the bf16 halves are updated in place: in ``out`` (then gathered), or
        where one rank holds the whole bucket (``out`` None) in the parameters."""
        st, lay = self.store.shards[b], self.store.layouts[b]
        grad = self.grads.buckets[b].shard
        exp_avg, exp_avg_sq = self.store.moments(b)
        value = out
        if is_byte_dtype(lay.key.param):
            value = torch.empty(lay.shard_size, dtype=lay.key.param_dtype,
                                device=self.store.device)
        if st.remainder is not None:  # the bf16 halves, updated in place
            if out is None:  # one rank holds the bucket: in the parameters themselves
                views = self._param_views(b)
                ranges, halves = [r for r, _ in views], [view for _, view in views]
            else:
                if self.gathers.buckets[b].persistent is None:  # else out *is* the params
                    self.store.copy_params_into(out, lay.shard_pieces(self.rank))
                ranges, halves = st.group_ranges, out
            for gi, lists in by_group(ranges, halves, st.remainder, grad, exp_avg,
                                      exp_avg_sq).items():
                kernels.adam_remainders(*lists, None, **self._kwargs(gi))
        else:
            master = (st.scaled.unscaled("param") if st.scaled.has_master
                      else self.store.params_shard(b, lay.key.state))
            if self.found_inf is not None:
                value.copy_(master)
            for gi, lists in by_group(st.group_ranges, master, grad, exp_avg, exp_avg_sq,
                                      value).items():
                kernels.adam(*lists, **self._kwargs(gi))
            if st.scaled.has_master:
                st.scaled.store("param", master)
        self.store.store_moments(b, exp_avg, exp_avg_sq)
        if value is not out:
            copy_high_bytes(value, out)

    def _writes_params(self, b: int) -> bool:
        """The step writes bucket ``b``'s parameters in place: one rank holds the whole
        bucket, the master is not a scaled copy, and the value the parameters would receive
        through the sync is the kernel's output cast to their dtype (the param-sync
        dtype is theirs, or fp32, the kernel's own precision, or they are the bf16
        halves of remainders)."""
        # Called once per bucket (the phases are cached). With a contiguous param buffer
        # the shard buffer already is the parameters: writing them directly saves the
        # per-bucket stale/gather bookkeeping.
        st = self.store.shards[b]
        if self.store.groups.distributed_size != 1 or (st.scaled is not None
                                                       and st.remainder is None):
            return False  # a scaled master is stored, not the parameters
        sync = self.store.layouts[b].key.param
        if is_byte_dtype(sync):
            return False  # the parameters receive the values' top bytes only
        return all(self.store.params[f.param].dtype == sync
                   or (sync == torch.float32
                       and self.store.params[f.param].dtype in (torch.float16, torch.bfloat16))
                   for f in self.store.layouts[b].fragments)

    def _param_views(self, b: int) -> list:
        """``((shard_start, shard_end, group), flat param slice)`` per fragment of bucket
        ``b``'s shard; made once (the parameters' storage does not move)."""
        cache = self.param_views_cache
        if b not in cache:
            cache[b] = [((p.shard_start, p.shard_end, self.store.group_of[p.param]),
                         flat_view(self.store.params[p.param].detach())[p.param_start:p.param_end])
                        for p in self.store.layouts[b].shard_pieces(self.rank)]
        return cache[b]
