"""The step with ``cpu_offload``: Adam on the CPU over host state, pipelined per bucket.

::

    for each bucket b, last first (the next forward uses it first):
        device->host of bucket b+1's gradient shard          (HostStaging, side stream)
        wait for b's gradient shard on the host
        kernels.adam / adam_remainders on the CPU            (cpu_offload_threads)
        host->device of b's updated values into its shard buffer (side stream)
        its gather now (or, overlap_param_sync, from the next forward)

so the copies of the buckets before and after overlap the CPU work on this one. The
state (master, remainders, moments, scaled states) never leaves the host. Where the
parameters hold (part of) the master (remainders: its bf16 high halves; no stored
master: the parameters themselves) their shard travels to the host with the gradient,
as the on-device step reads it from them; updated in place there, it comes back as the
output. Grad scale, clipping and a GradScaler's skip work as on the device (the skip
happens before anything is staged).
"""

from __future__ import annotations

import torch

from mpzero import kernels
from mpzero.kernels import cpu_adam
from mpzero.kernels.precision import copy_high_bytes
from mpzero.optimizers.offload import HostStaging, Transfer
from mpzero.optimizers.options import is_byte_dtype
from mpzero.optimizers.step import Stepper, by_group

GRAD, PARAM, OUT, VALUE = "grad", "param", "out", "value"  # kinds of staging buffer


class OffloadStepper(Stepper):
    """:class:`~mpzero.optimizers.step.Stepper` whose local step runs on the CPU over
    the host state of the :class:`~mpzero.optimizers.shards.ShardStore`, with the
    device<->host copies owned by ``staging``."""

    def __init__(self, *args, staging: HostStaging, threads: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.staging = staging
        self.threads = threads

    def _params_dtype(self, b: int) -> torch.dtype | None:
        """The dtype bucket ``b``'s parameter shard travels to the host in, or None where
        the host state holds the whole master."""
        st, key = self.store.shards[b], self.store.layouts[b].key
        if st.remainder is not None:
            return torch.bfloat16  # the master's high halves, updated in place
        if st.master is None and (st.scaled is None or not st.scaled.has_master):
            return key.state  # the parameters are the master
        return None

    def _stage_in(self, b: int) -> list[Transfer]:
        """Start bucket ``b``'s device->host copies: gradient shard, parameter shard."""
        out = [self.staging.to_host(GRAD, self.grads.buckets[b].shard)]
        dtype = self._params_dtype(b)
        if dtype is not None:
            out.append(self.staging.to_host(PARAM, self.store.params_shard(b, dtype)))
        return out

    def _host_hyper(self, gi: int, grad_scale: torch.Tensor | None) -> dict:
        kw = self.state.hyper(gi, None)
        lr = kw["lr"]
        kw["lr"] = float(lr) if isinstance(lr, torch.Tensor) else lr
        kw["grad_scale"] = grad_scale if kw["grad_scale"] is not None else None
        kw["threads"] = self.threads
        return kw

    def run(self, found_inf: torch.Tensor | None, deferred: bool) -> None:
        """The CPU step of every bucket, last first, copies pipelined one bucket ahead;
        then the gathers (all now, or only the first-used bucket's when ``deferred``)."""
        assert found_inf is None, "cpu_offload refuses capturable (options.py)"
        self.found_inf = None
        order = list(range(len(self.store.layouts)))[::-1]
        if not order:
            return
        # One host copy of the scale per step (the kernels' grad_scale is a device scalar).
        scale = self.state.grad_scale.cpu() if self.state.grad_scaled else None
        hyper = [self._host_hyper(gi, scale) for gi in range(len(self.state.param_groups))]
        staging = self.staging
        # The other host passes of the step (scaled states, byte casts) are torch ops.
        with kernels.torch_threads(self.threads):
            incoming = {order[0]: self._stage_in(order[0])}
            for i, b in enumerate(order):
                if i + 1 < len(order):
                    incoming[order[i + 1]] = self._stage_in(order[i + 1])
                host = [staging.wait(t) for t in incoming.pop(b)]
                values = self._cpu_step(b, host, hyper)
                back = staging.to_device(values, self.gathers.mark_stale(b))
                if i == 0 or not deferred:
                    staging.on_device(back)
                    self.gathers.start_through(b)
        # Gathers started later (the forward's pre-hooks, sync_all) read what came back.
        staging.finish()
        if not deferred:
            self.gathers.sync_all()

    def _cpu_step(self, b: int, host: list[torch.Tensor], hyper: list[dict]) -> torch.Tensor:
        """Adam over bucket ``b``'s host state; returns the staging buffer holding the
        updated values in the param-sync dtype (what goes back to the device)."""
        st, lay = self.store.shards[b], self.store.layouts[b]
        grad = host[0]
        if st.remainder is not None and st.scaled is not None:
            hi = host[1]
            m16, v16 = st.scaled.data["exp_avg"], st.scaled.data["exp_avg_sq"]
            if cpu_adam.supported_scaled([hi], [st.remainder], [grad], [m16], [v16]):
                self._scaled_remainders(st, hi, grad, hyper)  # two passes, no fp32 copies
                return hi
        exp_avg, exp_avg_sq = self.store.moments(b)  # fp32 working copies when scaled
        if st.remainder is not None:
            hi = host[1]  # bf16 high halves: updated in place, then the output
            for gi, lists in by_group(st.group_ranges, hi, st.remainder, grad,
                                       exp_avg, exp_avg_sq).items():
                kernels.adam_remainders(*lists, None, **hyper[gi])
            self.store.store_moments(b, exp_avg, exp_avg_sq)
            return hi
        out = self.staging.host_buffer(OUT, lay.shard_size, lay.key.param)
        value = out
        if is_byte_dtype(lay.key.param):  # the value in the param's dtype, then its top bytes
            value = self.staging.host_buffer(VALUE, lay.shard_size, lay.key.param_dtype)
        if st.scaled is not None and st.scaled.has_master:
            master = st.scaled.unscaled("param")
        else:
            master = st.master if st.master is not None else host[1]
        for gi, lists in by_group(st.group_ranges, master, grad, exp_avg, exp_avg_sq,
                                   value).items():
            kernels.adam(*lists, **hyper[gi])
        if st.scaled is not None and st.scaled.has_master:
            st.scaled.store("param", master)
        self.store.store_moments(b, exp_avg, exp_avg_sq)
        if value is not out:
            copy_high_bytes(value, out)
        return out


    @staticmethod
    def _scaled_remainders(st, hi: torch.Tensor, grad: torch.Tensor, hyper: list[dict]) -> None:
        """Remainders with bf16 moments scaled per piece: the C++ kernel's two passes per
        param group (the same bits as unscaling, ``adam_remainders`` and storing)."""
        sc = st.scaled
        ranges, pieces = sc.pieces(st.group_ranges)
        for gi, lists in by_group(ranges, hi, st.remainder, grad, sc.data["exp_avg"],
                                  sc.data["exp_avg_sq"], pieces).items():
            cpu_adam.adam_remainders_scaled(*lists, sc.scales["exp_avg"],
                                            sc.scales["exp_avg_sq"], sc.half_max, **hyper[gi])
