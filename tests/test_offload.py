"""``cpu_offload``: DistributedFusedAdam with its state in host memory and the update on
the CPU, on gloo worlds, every step's copies across the fake device boundary of
offload_fakes.py (deferred copies, poisoned buffers).

Tolerances against ``torch.optim.AdamW`` (fp32 weights and state) follow from where
each mode rounds:

- fp32 state: no rounding besides fp32's own; torch's kernel orders the operations
  differently, so a few ulps per step: ``RTOL`` = 1.3e-6 (~11 ulps of 2**-23) with an
  ``ATOL`` of 1e-5 for elements near zero (dfa_common).
- remainders (bf16 parameters + int16 remainders): the master is exact fp32, but the
  model computes with the bf16 parameters, each rounded to half a bf16 ulp (2**-9
  relative): after STEPS steps the parameters differ by that rounding plus what the
  rounded forward did to the gradients, and Adam moves an element by at most ~lr per
  step whatever its gradient: ``2**-9 * |p| + STEPS * lr`` bounds it, so rtol 2**-8 and
  atol STEPS * lr.
- scaled states (bf16 master and moments with fp32 scales): each store rounds every
  state to half a bf16 ulp of the piece's scale (2**-9 of its absmax); the master
  error accumulates per step: rtol 2**-8 and atol STEPS * (2**-9 * absmax + lr).
- remainders with scaled moments: against AdamW as remainders. Against the remainders
  run without scaling (same exact master) only the moments differ, each rounded to
  bf16 (2**-9 relative, as the scale only moves the exponent): ``m / sqrt(v)`` is off
  by at most ~2**-8 of itself and Adam's step by that part of lr, so the masters agree
  to STEPS * lr * 2**-6 (a margin of 4 for the compounding), and the bf16 parameters to
  that plus one bf16 ulp where the rounding flips (rtol 2**-7).

Against the same run without offload the results are bitwise equal: on the CPU both
step with the same kernels on the same values.
"""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

from mpzero.kernels import cpu_adam
from mpzero.optimizers import DistributedFusedAdam, OptionError
from mpzero.optimizers.offload_step import OffloadStepper

from dfa_common import (
    ATOL,
    RTOL,
    STATE_MODES,
    batches,
    groups_for,
    loss_fn,
    make_model,
    param_groups,
)
from offload_fakes import FakeBoundary

pytestmark = pytest.mark.timeout(300)

TINY = 24 * 4 / 2**20  # 24 fp32 elements a bucket: many buckets, fragments across them
STEPS, LR = 3, 1e-3
BF16_HALF_ULP = 2.0**-9

MODES = {
    **STATE_MODES,
    "no_master": dict(store_params=False),
    "grad_bf16": dict(grad_sync_dtype=torch.bfloat16),
    "contiguous": dict(contiguous_param_buffer=True, contiguous_grad_buffer=True),
    "byte_sync": dict(param_sync_dtype=torch.int32),  # fp32 values gathered as raw bytes
}


def _tolerance(mode: str, absmax: float) -> tuple[float, float]:
    """(rtol, atol) against AdamW, from the storage precision (module docstring)."""
    if mode in ("fp32", "no_master", "contiguous", "byte_sync"):
        return RTOL, ATOL
    if mode in ("remainders", "remainders_scaled"):
        return 2 * BF16_HALF_ULP, STEPS * LR
    if mode == "grad_bf16":  # bf16 gradients: Adam's update is ~lr whatever their rounding
        return 2 * BF16_HALF_ULP, STEPS * LR
    return 2 * BF16_HALF_ULP, STEPS * (BF16_HALF_ULP * absmax + LR)


def fake_boundary(opt: DistributedFusedAdam) -> FakeBoundary:
    """Put a fake boundary under ``opt``'s staging (makes the layout)."""
    stepper = opt.ensure_layout().stepper
    assert isinstance(stepper, OffloadStepper)
    stepper.staging.boundary = fake = FakeBoundary()
    return fake


def _train(grid, mode, offload, clip=None, overlap_param=False, scaler_inf_step=None):
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    kw = groups_for(grid)
    opt = DistributedFusedAdam(param_groups(model, "two"), lr=LR, weight_decay=0.05,
                               bucket_cap_mb=TINY, cpu_offload=offload,
                               overlap_param_sync=overlap_param,
                               module=model if overlap_param else None, **kw, **MODES[mode])
    fake = fake_boundary(opt) if offload else None
    scaler = None
    if scaler_inf_step is not None:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    data = batches(world, STEPS, 2)
    for s in range(STEPS):
        opt.zero_grad()
        for m, (x, y) in enumerate(data[s][rank]):
            loss = loss_fn(model, x, y)
            if scaler is not None:
                if s == scaler_inf_step and rank == world - 1 and m == 1:
                    loss = loss * float("inf")
                loss = scaler.scale(loss)
            if m == 0:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if clip is not None:
            opt.clip_grad_norm(clip)
        if scaler is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if fake is not None:
            assert not fake.pending, "a copy was never waited on"
    opt.param_sync()
    return model, opt, data, fake


def _reference(data, world, clip=None, skip=()):
    ref = make_model()
    ref_opt = torch.optim.AdamW(param_groups(ref, "two"), lr=LR, weight_decay=0.05)
    for s in range(STEPS):
        if s in skip:
            continue
        ref_opt.zero_grad()
        total = sum(loss_fn(ref, x, y) for r in range(world) for x, y in data[s][r])
        (total / world).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
    return ref


def _compare(grid, mode, clip=None, overlap_param=False):
    world = dist.get_world_size()
    model, opt, data, fake = _train(grid, mode, True, clip, overlap_param)
    plain, _, _, _ = _train(grid, mode, False, clip, overlap_param)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q), "offload differs from the on-device step"
    ref = _reference(data, world, clip)
    absmax = max(p.abs().max().item() for p in ref.parameters())
    rtol, atol = _tolerance(mode, absmax)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)
    if mode == "remainders_scaled":  # against the same master with fp32 moments
        exact, exact_opt, _, _ = _train(grid, "remainders", False, clip, overlap_param)
        for p, q in zip(model.parameters(), exact.parameters()):
            torch.testing.assert_close(p, q, rtol=4 * BF16_HALF_ULP, atol=STEPS * LR * 2**-6)
        ours, theirs = opt.state_dict()["state"], exact_opt.state_dict()["state"]
        for i in range(len(list(model.parameters()))):
            torch.testing.assert_close(ours[i]["param"], theirs[i]["param"], rtol=0,
                                       atol=STEPS * LR * 2**-6)
            for key in ("exp_avg", "exp_avg_sq"):
                # bf16 moments (2**-9 a store), from gradients that differ a little where
                # a bf16 parameter rounded the other way: a few % of the largest moment.
                big = theirs[i][key].abs().max().item()
                torch.testing.assert_close(ours[i][key], theirs[i][key], rtol=2**-7,
                                           atol=2**-5 * big)
    if mode == "remainders":  # the fp32 master (bf16 halves + remainders) as well
        sd = opt.state_dict()
        ordered = [q for g in param_groups(ref, "two") for q in g["params"]]
        for i, q in enumerate(ordered):
            torch.testing.assert_close(sd["state"][i]["param"], q.detach(), rtol=rtol,
                                       atol=atol)
    n_buckets = len(opt.shards.layouts)
    # Pipelined: the next bucket's copy was in flight while one was stepped.
    assert n_buckets < 2 or fake.most_in_flight >= 2
    assert fake.host_waits >= n_buckets * STEPS
    return True


def _offload_cases():
    """World 1 in `make test` (the 2-rank and 2 x 2 grids hold what it does); the scaled
    modes' 2 x 2 runs too (the same code paths as fp32's and remainders' there)."""
    for mode in ("fp32", "remainders", "scaled", "remainders_scaled"):
        for size, grid in ((1, "flat"), (2, "flat"), (4, "2x2")):
            slow = size == 1 or (size == 4 and "scaled" in mode)
            yield pytest.param(size, grid, mode, marks=pytest.mark.slow if slow else (),
                               id=f"{mode}-{size}-{grid}")


@pytest.mark.parametrize("size,grid,mode", _offload_cases())
def test_offload_matches_adamw(world, size, grid, mode):
    assert all(world(size, _compare, grid, mode))


@pytest.mark.parametrize("mode", ["no_master", "grad_bf16", "contiguous", "byte_sync"])
def test_offload_other_modes(world, mode):
    assert all(world(2, _compare, "flat", mode))


@pytest.mark.parametrize("size,grid", [(2, "flat"), (4, "2x2")])
def test_offload_with_clipping(world, size, grid):
    assert all(world(size, _compare, grid, "fp32", 0.5))


def test_offload_with_overlap_param_sync(world):
    assert all(world(2, _compare, "flat", "remainders", None, True))


def _scaler_skip():
    world = dist.get_world_size()
    model, opt, data, _ = _train("flat", "fp32", True, scaler_inf_step=1)
    ref = _reference(data, world, skip={1})
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    return opt.state_dict()["state"]["step"]


def test_offload_grad_scaler_skips_inf_on_every_rank(world):
    assert world(2, _scaler_skip) == [STEPS - 1, STEPS - 1]


def _state_on_host():
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), cpu_offload=True, cpu_offload_threads=2,
                               bucket_cap_mb=TINY, **MODES["remainders"])
    opt.ensure_layout()
    for st in opt.shards.shards:
        for t in (st.master, st.remainder, st.exp_avg, st.exp_avg_sq):
            assert t is None or t.device.type == "cpu"
    before = torch.get_num_threads()
    loss_fn(model, *batches(1, 1, 1)[0][0][0]).backward()
    opt.step()
    assert torch.get_num_threads() == before  # the step's threads were scoped
    assert opt.ensure_layout().stepper.threads == 2
    return True


def test_state_on_host_and_threads_scoped(world):
    assert all(world(1, _state_on_host))


@pytest.mark.parametrize("kwargs,match", [
    (dict(cpu_offload=True, capturable=True), "cpu_offload"),
    (dict(cpu_offload_threads=4), "cpu_offload_threads"),
    (dict(cpu_offload=True, cpu_offload_threads=0), "cpu_offload_threads"),
    (dict(cpu_offload=True, cpu_offload_threads=2.5), "cpu_offload_threads"),
])
def test_bad_offload_options(kwargs, match):
    with pytest.raises(OptionError, match=match):
        DistributedFusedAdam(make_model().parameters(), **kwargs)


def test_options_are_readable():
    opt = DistributedFusedAdam(make_model().parameters(), cpu_offload=True)
    assert opt.cpu_offload is True and opt.cpu_offload_threads is None
    assert "cpu_offload: True" in repr(opt)
    copy.deepcopy(opt.options)


def test_threads_reach_the_kernel_and_are_scoped(monkeypatch):
    """The step's CPU kernels get ``threads=cpu_offload_threads`` and torch runs the step's
    other host passes on that many threads; torch's count is back after the step."""
    from mpzero import kernels

    seen = []
    real = kernels.adam

    def adam(*lists, **kw):
        seen.append((kw.get("threads"), torch.get_num_threads()))
        real(*lists, **kw)

    monkeypatch.setattr(kernels, "adam", adam)
    before = torch.get_num_threads()
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), cpu_offload=True,
                               cpu_offload_threads=before + 1)
    loss_fn(model, *batches(1, 1, 1)[0][0][0]).backward()
    opt.step()
    assert seen and all(s == (before + 1, before + 1) for s in seen), seen
    assert torch.get_num_threads() == before


def _fused_scaled_kernel_runs():
    calls = []
    real = cpu_adam.adam_remainders_scaled

    def counted(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    cpu_adam.adam_remainders_scaled = counted
    try:
        _compare("flat", "remainders_scaled")  # bitwise the on-device (torch ops) step
    finally:
        cpu_adam.adam_remainders_scaled = real
    return len(calls)


@pytest.mark.slow  # `make test`: the quick tier's remainders_scaled run takes the same path
@pytest.mark.skipif(not cpu_adam.available(), reason="mpzero._cpu is not built")
def test_offloaded_scaled_moments_take_the_two_pass_kernel(world):
    """The offloaded step of remainders with bf16 moments runs the C++ kernel's two passes
    (one call per bucket and param group), and its results are the on-device step's bits
    (``_compare`` checks that)."""
    assert all(n >= STEPS for n in world(2, _fused_scaled_kernel_runs))
