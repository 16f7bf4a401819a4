"""The TP RNG tracker on gloo worlds: per-rank streams inside fork(), shared ones outside."""

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpzero import parallel_state as ps
from mpzero.tensor_parallel import (
    MODEL_PARALLEL_RNG_TRACKER_NAME,
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
)


def _gather(t, group):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _stream(seed, n, skip=0):
    gen = torch.Generator().manual_seed(seed)
    torch.rand(skip, generator=gen)
    return torch.rand(n, generator=gen)


def _check_tracker(tp):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    r, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    assert get_rng_tracker() is get_cuda_rng_tracker()
    assert model_parallel_manual_seed is model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(123)
    tracker = get_rng_tracker()

    # The default stream is `seed` on every rank; the tracked one is seed + 2718 + tp_rank,
    # and each continues where it left off across forks.
    assert torch.equal(torch.rand(4), _stream(123, 4))
    with tracker.fork():
        assert torch.equal(torch.rand(4), _stream(123 + 2718 + r, 4))
    assert torch.equal(torch.rand(4), _stream(123, 4, skip=4))
    with tracker.fork(MODEL_PARALLEL_RNG_TRACKER_NAME):
        assert torch.equal(torch.rand(4), _stream(123 + 2718 + r, 4, skip=4))

    # Dropout masks: different per TP rank inside fork(), identical outside.
    ones = torch.ones(256)
    with tracker.fork():
        inside = F.dropout(ones, p=0.5)
    outside = F.dropout(ones, p=0.5)
    masks_in, masks_out = _gather(inside, group), _gather(outside, group)
    assert all(torch.equal(m, outside) for m in masks_out)
    assert sum(torch.equal(m, inside) for m in masks_in) == 1  # only my own
    assert not torch.equal(inside, outside)

    # get_states/set_states replay the tracked stream; the states survive weights_only load.
    states = tracker.get_states()
    buf = io.BytesIO()
    torch.save(states, buf)
    with tracker.fork():
        first = torch.rand(8)
    buf.seek(0)
    tracker.set_states(torch.load(buf, weights_only=True))
    with tracker.fork():
        assert torch.equal(torch.rand(8), first)

    # An exception inside fork() still restores the default state.
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="boom"), tracker.fork():
        torch.rand(3)
        raise RuntimeError("boom")
    assert torch.equal(torch.get_rng_state(), before)

    with pytest.raises(ValueError, match="seed"):
        tracker.add("other", 123 + 2718 + r)
    with pytest.raises(ValueError, match="already tracked"):
        tracker.add(MODEL_PARALLEL_RNG_TRACKER_NAME, 999)
    tracker.add("other", 7)
    with tracker.fork("other"):
        assert torch.equal(torch.rand(2), _stream(7, 2))
    tracker.reset()
    with pytest.raises(KeyError, match="model_parallel_manual_seed"):
        with tracker.fork():
            pass
    # Reseeding starts over (and resets the tracker).
    model_parallel_manual_seed(123)
    with tracker.fork():
        assert torch.equal(torch.rand(4), _stream(123 + 2718 + r, 4))
    assert set(tracker.get_states()) == {MODEL_PARALLEL_RNG_TRACKER_NAME}
    return r


@pytest.mark.parametrize("world_size,tp", [(1, 1), (2, 2), (4, 4), (4, 2)])
def test_rng_tracker(world, world_size, tp):
    assert world(world_size, _check_tracker, tp) == [i % tp for i in range(world_size)]
