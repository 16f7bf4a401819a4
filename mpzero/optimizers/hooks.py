"""What the optimizer does from inside the model's passes, through public hooks only:
gradients arriving in backward (:class:`Backward`: post-accumulate-grad hooks,
``no_sync``, rounds of one backward pass each) and parameter gathers driven by the
forward pass (:class:`ModuleHooks`: module forward pre-hooks).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable

import torch

from mpzero import torch_compat
from mpzero.optimizers.flat import flat_like
from mpzero.optimizers.grad_sync import GradSync
from mpzero.optimizers.options import Options
from mpzero.optimizers.param_sync import ParamSync
from mpzero.optimizers.pipelines import Pipelines
from mpzero.optimizers.shards import GRADS, ShardStore
from mpzero.warn import user_stacklevel


def weak_hook(obj, method: str, *bound):
    """A hook calling ``obj.method(*bound, *args)`` that does not keep ``obj`` alive:
    parameters hold their grad hooks on the C++ side, out of the garbage collector's
    sight, so a strong reference would keep a dropped optimizer (and its state) forever."""
    ref = weakref.ref(obj)

    def hook(*args):
        target = ref()
        if target is not None:
            return getattr(target, method)(*bound, *args)
        return None

    return hook


def at_end_of_backward(callback) -> None:
    """Run ``callback`` once the current backward pass has finished (called from a
    gradient hook). torch exposes this only on its autograd engine (FSDP uses the
    same call); without it the round closes at the next sync instead."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is not None and hasattr(engine, "queue_callback"):
        engine.queue_callback(callback)


class Backward:
    """Gradients into the gradient pipeline as backward produces them."""

    def __init__(self, options: Options, store: ShardStore, ensure: Callable[[], Pipelines]):
        self.options, self.store = options, store
        self.ensure = ensure  # makes the layout if needed; returns the pipelines
        # Whether gradients are copied into buckets as soon as they are ready; no_sync()
        # turns it off (unless asked) so they accumulate in param.grad.
        self.greedy_grad_copy = True
        self.no_sync_active = False
        self.round_close_queued = False
        self.grads_held = False  # some gradient waits in param.grad (no_sync)
        self.stepped = False  # step() ran and no gradient (nor zero_grad) came since
        self.backward_seen = False  # the first backward's one-time checks are done
        self.main_grads = False  # parameters carry main_grad (contiguous_grad_buffer)
        self.handles: list = []

    def register(self, p: torch.Tensor, index: int) -> None:
        if p.requires_grad:
            self.handles.append(
                p.register_post_accumulate_grad_hook(weak_hook(self, "on_grad_ready", index)))

    def on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        self._arriving()
        if not self.greedy_grad_copy:
            self.grads_held = True  # no_sync: it waits in param.grad
            return
        pipes = self.ensure()
        self.take_grad(pipes.grads, index, param)
        self._arrived(pipes)

    def provide_main_grads(self) -> None:
        """``contiguous_grad_buffer``: every trainable parameter gets ``main_grad`` (its view
        of the buffer) and ``main_grad_ready`` (a 0-dim leaf whose gradient says a layer with
        ``gradient_accumulation_fusion`` added into ``main_grad``)."""
        for i, p in enumerate(self.store.params):
            if not p.requires_grad or not self.store.fragments.get(i):
                continue
            ready = torch.zeros((), device=p.device, requires_grad=True)
            self.handles.append(ready.register_post_accumulate_grad_hook(
                weak_hook(self, "on_main_grad_ready", i)))
            p.main_grad = self.store.buffer_view(GRADS, i)
            p.main_grad_ready = ready
        self.main_grads = True

    def on_main_grad_ready(self, index: int, ready: torch.Tensor) -> None:
        """A layer added parameter ``index``'s gradient into its ``main_grad`` (the
        bucket buffer itself): it arrived, with nothing to copy."""
        ready.grad = None
        self._arriving()
        if not self.greedy_grad_copy:
            return  # no_sync: it stays in the buffer, as param.grad would stay
        pipes = self.ensure()
        pipes.grads.add_grad(index, None)
        self._arrived(pipes)

    def _arriving(self) -> None:
        if not self.backward_seen:
            # A DistributedDataParallel wrapped around the model after this optimizer was
            # built would reduce every gradient a second time: checked once.
            torch_compat.raise_if_ddp_reduces(self.store.params)
            self.backward_seen = True
        self.stepped = False

    def _arrived(self, pipes: Pipelines) -> None:
        """After a gradient arrived: launch what is complete, in order."""
        pipes.norm.cache = None
        if self.options.overlap_grad_sync and not self.no_sync_active:
            if pipes.gathers.pending():
                # Gathers the forward pass did not start (modules this rank skipped) go
                # out before the first reduce-scatter, in bucket order, as on every rank.
                pipes.gathers.sync_all()
            pipes.grads.launch_ready()
            if not self.round_close_queued:
                self.round_close_queued = True
                at_end_of_backward(weak_hook(self, "end_of_backward"))

    def end_of_backward(self) -> None:
        """Every backward pass (outside ``no_sync()``) is one round: what it did not complete
        launches now, in order, zeros for parameters without a gradient, so ranks that skip
        different parameters still issue the same collectives."""
        self.round_close_queued = False
        if self.options.overlap_grad_sync and not self.no_sync_active and self.store.built:
            grads = self.ensure().grads
            if self.grads_held:
                # Gradients that earlier no_sync() micro-batches left in param.grad belong
                # to this round: a parameter this backward did not reach still holds one.
                # Taken after the round closed, they would re-open buckets on this rank
                # alone.
                self.copy_pending(grads)
            grads.close_round()
            if self.main_grads:
                # Layers write the next backward's gradients into the buffers in flight
                # (main_grad) before any hook runs: each bucket's sync must be done (and
                # its buffer zeroed) first. The main stream waits; the host does not.
                grads.finish_all()

    def take_grad(self, grads: GradSync, index: int, param: torch.Tensor) -> None:
        """Move ``param.grad`` into the buckets (in the parameter's memory order)."""
        grads.add_grad(index, flat_like(param.grad, param))
        param.grad = None

    def copy_pending(self, grads: GradSync) -> None:
        """Move gradients still held in ``param.grad`` into the buckets."""
        # Usually none (the gradient hooks took them): one pass that only reads .grad.
        self.grads_held = False
        params = self.store.params
        for i in [i for i, p in enumerate(params) if p.grad is not None]:
            if params[i].requires_grad:
                self.take_grad(grads, i, params[i])

    @contextlib.contextmanager
    def no_sync(self, greedy_grad_copy: bool = False):
        old = (self.no_sync_active, self.greedy_grad_copy)
        self.no_sync_active, self.greedy_grad_copy = True, greedy_grad_copy
        try:
            yield
        finally:
            self.no_sync_active, self.greedy_grad_copy = old
            if self.store.built:
                for b in self.ensure().grads.buckets:  # the next backward starts a fresh round
                    b.arrived = set()


class ModuleHooks:
    """Forward pre-hooks that gather each module's parameters just before it runs."""

    def __init__(self, store: ShardStore, overlap: bool,
                 gathers: Callable[[], ParamSync | None]):
        self.store, self.overlap = store, overlap
        self.gathers = gathers  # the parameter pipeline, or None before the layout
        self.attached: list[tuple[torch.nn.Module, bool]] = []  # (module, unit)
        self.handles: list = []
        self.warned_no_module = False

    def deferring(self) -> bool:
        """Whether a step leaves the gathers to the forward pre-hooks (``overlap_param_sync``
        with a module attached); warns once when the option is on without a module."""
        if self.overlap and not self.handles and not self.warned_no_module:
            self.warned_no_module = True
            warnings.warn("overlap_param_sync=True but no module is attached (module= or "
                          "attach(module)): parameters are gathered at the end of step()",
                          stacklevel=user_stacklevel())
        return self.overlap and bool(self.handles)

    def attach(self, module: torch.nn.Module, unit: bool) -> None:
        torch_compat.warn_if_wrapped_in_ddp(module)
        self.attached.append((module, bool(unit)))
        self.rehook()

    def rehook(self) -> None:
        """(Re)register the forward pre-hooks of every attached module."""
        for h in self.handles:
            h.remove()
        self.handles = []
        units = [m for m, unit in self.attached if unit]
        covered = {id(sub) for u in units for sub in u.modules() if sub is not u}
        hooked: set[int] = set()
        index = self.store.index

        def hook(m: torch.nn.Module, params) -> None:
            owned = tuple(index[id(p)] for p in params if id(p) in index)
            if owned and id(m) not in hooked and id(m) not in covered:
                hooked.add(id(m))
                self.handles.append(m.register_forward_pre_hook(
                    weak_hook(self, "pre_forward", owned)))

        for u in units:
            hook(u, u.parameters())
        unit_ids = {id(u) for u in units}
        for module, unit in self.attached:
            if not unit:
                for m in module.modules():
                    if id(m) not in unit_ids:
                        hook(m, m.parameters(recurse=False))

    def pre_forward(self, owned, module, args) -> None:
        gathers = self.gathers()
        if gathers is not None and gathers.pending():
            gathers.ensure(owned, prefetch=1)
