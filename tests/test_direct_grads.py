"""Direct gradients (grad_sync.py): where one rank makes up both groups and every parameter
of a bucket brings one gradient, the gradients themselves stand for the reduced shard
(no bucket buffer, no copy); the step and the norm read them.

Every run is compared with the same run with direct gradients switched off (each bucket's
``direct_ok``), which copies them into buffers as before; the fresh buffers are poisoned
with NaN, so an element a copy fails to define shows up. Tolerances: without clipping the
values are the same bits (the same kernel on the same values); with clipping the norm is
summed in another order (per gradient instead of per shard range), so parameters agree
to a few fp32 ulps (``RTOL``).
"""

import contextlib

import pytest
import torch

from mpzero.optimizers import DistributedFusedAdam, grad_sync

from dfa_common import batches, make_model

CAP = 96 * 4 / 2**20  # several buckets, some of several parameters, some params split
RTOL, ATOL = 4e-6, 1e-7


@contextlib.contextmanager
def _poisoned():
    original = grad_sync._fresh_buffer
    grad_sync._fresh_buffer = lambda size, dtype, device: torch.full(
        (size,), float("nan"), dtype=dtype, device=device)
    try:
        yield
    finally:
        grad_sync._fresh_buffer = original


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
    opt._ensure_layout()
    assert len(opt._grad.buckets) > 2
    assert max(len(b.layout.fragments) for b in opt._grad.buckets) > 1
    assert any(len(frags) > 1 for frags in opt._grad.fragments.values())
    for b in opt._grad.buckets:
        b.direct_ok = direct
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
            assert opt._grad.buckets[1].shard is not None  # made from the direct gradients
        held.append([b.direct_grads() is not None for b in opt._grad.buckets])
        if direct and held[-1][0]:
            b0 = opt._grad.buckets[0]
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
    assert all(b.direct_grads() is None and b.shard is not None for b in opt._grad.buckets)
    opt.step()
    return True


def test_no_direct_gradients_when_reducing(world):
    assert all(world(2, _not_at_world_2, timeout=120))
