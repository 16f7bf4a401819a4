"""Direct gradients (grad_sync.py): where one rank makes up both groups and every parameter
of a bucket brings one gradient, the gradients themselves stand for the reduced shard
(no bucket buffer, no copy); the step and the norm read them.

Every run is compared with the same run with direct gradients switched off (each bucket's
``may_go_direct`` off), which copies them into buffers as before; the fresh buffers are poisoned
with NaN, so an element a copy fails to define shows up. Tolerances: without clipping the
values are the same bits (the same kernel on the same values); with clipping the norm is
summed in another order (per gradient instead of per shard range), so parameters agree
to a few fp32 ulps (``RTOL``).
"""

import contextlib

import pytest
import torch

from mpzero.optimizers import DistributedFusedAdam, grad_bucket

from dfa_common import batches, make_model

CAP = 96 * 4 / 2**20  # several buckets, some of several parameters, some params split
RTOL, ATOL = 4e-6, 1e-7


@contextlib.contextmanager
def _poisoned():
    original = grad_bucket._fresh_buffer
    grad_bucket._fresh_buffer = lambda size, dtype, device: torch.full(
        (size,), float("nan"), dtype=dtype, device=device)
    try:
        yield
    finally:
        grad_bucket._fresh_buffer = original


def _loss(model, x, y, use_fc2=True):
    h = model.norm(torch.tanh(model.fc1(x)))
    if use_fc2:
        h = torch.nn.functional.gelu(model.fc2(h)) + h
    return torch.nn.functional.mse_loss(model.head(h), y, reduction="sum")


def _train(direct: bool, scenario: str, dtype, clip):
    """Three steps of ``scenario``; the final parameters, the norms, and per step which
    buckets held direct gradients at the step."""
    model = make_model(dtype=dtype)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01,
                               bucket_cap_mb=CAP, grad_sync_dtype=torch.float32)
    opt.ensure_layout()
    assert len(opt.ensure_layout().grads.buckets) > 2
    assert max(len(b.layout.fragments) for b in opt.ensure_layout().grads.buckets) > 1
    assert any(len(frags) > 1 for frags in opt.ensure_layout().grads.fragments.values())
    for b in opt.ensure_layout().grads.buckets:
        b.may_go_direct = b.may_go_direct and direct
    data = batches(1, 3, 2, dtype=dtype)
    norms, held = [], []
    for s in range(3):
        opt.zero_grad()
        (x0, y0), (x1, y1) = data[s][0]
        if scenario == "accumulate":  # two rounds: the second adds to the first's shards
            _loss(model, x0, y0).backward()
            _loss(model, x1, y1).backward()
        elif scenario == "no_sync":
            with opt.no_sync():
                _loss(model, x0, y0).backward()
            _loss(model, x1, y1).backward()
        else:
            _loss(model, x0, y0, use_fc2=not (scenario == "skip" and s != 1)).backward()
        opt.grad_sync()
        if scenario == "shard_read":
            # made from the direct gradients
            assert opt.ensure_layout().grads.buckets[1].shard is not None
        held.append([b.direct_grads() is not None for b in opt.ensure_layout().grads.buckets])
        if direct and held[-1][0]:
            b0 = opt.ensure_layout().grads.buckets[0]
            assert b0.buffer is None and b0._shard is None, "a direct bucket allocated a buffer"
        if clip:
            norms.append(float(opt.clip_grad_norm(clip)))
        opt.step()
    return [p.detach().clone() for p in model.parameters()], norms, held


def _compare(scenario, dtype, clip):
    with _poisoned():
        got, got_norms, held = _train(True, scenario, dtype, clip)
        want, want_norms, held_off = _train(False, scenario, dtype, clip)
    assert not any(any(h) for h in held_off)
    for a, b in zip(got, want):
        assert not torch.isnan(a).any()
        if clip:
            torch.testing.assert_close(a.float(), b.float(), rtol=RTOL, atol=ATOL)
        else:
            assert torch.equal(a, b)
    for a, b in zip(got_norms, want_norms):
        assert a == pytest.approx(b, rel=1e-6)
    return held


def _plain(dtype, clip):
    held = _compare("plain", dtype, clip)
    assert all(all(h) for h in held), held  # every bucket, every step
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_direct_equals_copied(world, dtype, clip):
    assert all(world(1, _plain, dtype, clip, timeout=120))


def _fallbacks(scenario):
    held = _compare(scenario, torch.float32, 0.5)
    if scenario == "accumulate":  # the second round adds: buffers, nothing direct
        assert not any(any(h) for h in held)
    elif scenario == "no_sync":  # gradients accumulated in .grad arrive once: direct
        assert all(all(h) for h in held)
    elif scenario == "skip":  # buckets with fc2 have a missing gradient in steps 0 and 2
        assert all(held[1]) and not all(held[0]) and any(held[0]) and held[0] == held[2]
    elif scenario == "shard_read":  # bucket 1 read as a shard; the others stay direct
        assert all(not h[1] and h[0] for h in held)
    return True


@pytest.mark.parametrize("scenario", ["accumulate", "no_sync", "skip", "shard_read"])
def test_direct_falls_back_to_copies(world, scenario):
    assert all(world(1, _fallbacks, scenario, timeout=120))


def _not_at_world_2():
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=CAP)
    x, y = batches(2, 1, 1)[0][torch.distributed.get_rank()][0]
    _loss(model, x, y).backward()
    opt.grad_sync()
    assert all(b.direct_grads() is None and b.shard is not None
               for b in opt.ensure_layout().grads.buckets)
    opt.step()
    return True


def test_no_direct_gradients_when_reducing(world):
    assert all(world(2, _not_at_world_2, timeout=120))


# ------------------------------------------- the step's native-plan path, emulated on the CPU
def _emulated_adam_plan(calls):
    """A stand-in for ``kernels.adam_plan`` (the CUDA ``AdamPlan``): the same contract,
    run by the kernel it was chosen for. Each call fills the fixed lists from the
    per-step tensors through ``slots`` (an entry's length is that of its fixed tensors)."""
    def adam_plan(kernel, remainders, lists, slots, dynamic_like):
        fixed = [None if lst is None else list(lst) for lst in lists]

        def numel(entry):
            return next(lst[entry].numel() for lst in fixed
                        if lst is not None and lst[entry] is not None)

        def plan(dynamic, **hyper):
            filled = [None if lst is None else list(lst) for lst in fixed]
            for pos, entry, base, offset in slots:
                filled[pos][entry] = dynamic[base][offset:offset + numel(entry)]
            calls.append(len(dynamic))
            kernel(*filled, **hyper)

        return plan
    return adam_plan


def _native_steps(native: bool, config: str):
    """Eight steps with hyper-parameters changing between them (lr every step, one group's
    bias correction and the other's weight decay off and on again), steps with and
    without direct gradients (a parameter without gradient, a second backward adding to
    the first); ``native``: through emulated native plans. The final parameters, the
    native calls, and the per-phase keys that went native."""
    from mpzero import kernels

    dtype = torch.bfloat16 if config == "remainders" else torch.float32
    kw = dict(grad_sync_dtype=torch.float32)
    if config == "buffered":  # fp32 params, bf16 sync: shard-sized outputs, then gathered
        kw = dict(param_sync_dtype=torch.bfloat16)
    elif config == "remainders":
        kw = dict(store_params=False, store_param_remainders=True,
                  grad_sync_dtype=torch.bfloat16, param_sync_dtype=torch.bfloat16)
    elif config == "contiguous":
        kw.update(contiguous_grad_buffer=True, contiguous_param_buffer=True)
    model = make_model(dtype=dtype)
    first = [model.fc1.weight, model.fc2.weight, model.head.weight]
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    opt = DistributedFusedAdam([{"params": first}, {"params": rest, "lr": 3e-3}],
                               lr=1e-2, weight_decay=0.01, bucket_cap_mb=CAP, **kw)
    start = [p.detach().clone() for p in model.parameters()]
    calls: list[int] = []
    original = kernels.adam_plan
    if native:
        kernels.adam_plan = _emulated_adam_plan(calls)
    try:
        data = batches(1, 8, 2, dtype=dtype)
        for s in range(8):
            for gi, group in enumerate(opt.param_groups):
                group["lr"] = 1e-2 / (s + 1 + gi)
            if s in (2, 7):  # group 1's bias correction off, then on again
                opt.param_groups[1]["bias_correction"] = s == 7
                opt.param_groups[0]["weight_decay"] = 0.05 if s == 2 else 0.0
            opt.zero_grad()
            (x0, y0), (x1, y1) = data[s][0]
            _loss(model, x0, y0, use_fc2=s != 4).backward()  # 4: a parameter without gradient
            if s == 5:  # a second backward adds to the first: no direct gradients
                _loss(model, x1, y1).backward()
            opt.step()
    finally:
        kernels.adam_plan = original
    memo = {k for phase in opt.ensure_layout().stepper.phases(False) for k in phase.memo
            if isinstance(k, tuple)}
    params = [p.detach().clone() for p in model.parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(params, start)), "a parameter never moved"
    return params, len(calls), memo


def _native_equals_plain(config):
    got, n_native, memo = _native_steps(True, config)
    want, n_plain, _ = _native_steps(False, config)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert n_plain == 0 and n_native >= 8
    # Both bias corrections of group 1 went native; with and without direct gradients
    # where the step may take them.
    assert {bias for bias, _ in memo} == {(True, True), (True, False)}, memo
    assert {direct for _, direct in memo} == (
        {True, False} if config in ("direct", "remainders") else {False}), memo
    return True


@pytest.mark.parametrize("config", ["direct", "buffered", "remainders", "contiguous"])
def test_native_plan_path_equals_unplanned(world, config):
    """The step's path through native plans (kernels.adam_plan, emulated here: it needs
    CUDA) gives the same bits as the CPU kernels on filled lists, while hyper-parameters
    change and steps alternate between direct gradients and shards; what it caches per
    phase is keyed by what may change (the groups' bias corrections, direct or not)."""
    assert all(world(1, _native_equals_plain, config, timeout=120))
