"""The offload's host staging (mpzero/optimizers/offload.py) across a fake device
boundary (offload_fakes.py): copies deferred to the waits, poisoned buffers. No CUDA."""

import pytest
import torch

from mpzero.kernels import torch_threads
from mpzero.optimizers.offload import (
    HostStaging,
    SyncBoundary,
)

from offload_fakes import FakeBoundary

pytestmark = pytest.mark.timeout(60)


def _staging(depth=2):
    fake = FakeBoundary()
    return HostStaging(fake, depth), fake


def test_host_buffer_holds_poison_until_the_copy_is_waited_on():
    staging, fake = _staging()
    src = torch.arange(10, dtype=torch.float32)
    t = staging.to_host("grad", src)
    assert t.host.isnan().all()  # started, not run: the fake really defers
    assert t.device is src  # the device tensor stays referenced while in flight
    got = staging.wait(t)
    torch.testing.assert_close(got, src, rtol=0, atol=0)
    assert t.device is None and fake.copies == 1 and not fake.pending
    assert got.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()


def test_device_sees_host_values_only_after_waiting():
    staging, fake = _staging()
    host = staging.host_buffer("out", 6, torch.bfloat16)
    host.copy_(torch.arange(6))
    dev = torch.zeros(6, dtype=torch.bfloat16)
    t = staging.to_device(host, dev)
    assert dev.isnan().all()  # in flight: undefined on the device
    staging.on_device(t)
    torch.testing.assert_close(dev, torch.arange(6, dtype=torch.bfloat16), rtol=0, atol=0)
    assert fake.device_waits == 1
    staging.finish()
    assert not fake.pending


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_slot_in_flight_is_not_rewritten(depth):
    """More buffers than slots, each sent to the device and never waited on by the
    caller: the staging must finish each copy before it hands its slot out again, else
    the deferred copy delivers the later bucket's values."""
    staging, fake = _staging(depth)
    devs = []
    for k in range(3 * depth + 1):
        host = staging.host_buffer("out", 5, torch.float32)
        host.fill_(float(k))
        devs.append(torch.empty(5))
        staging.to_device(host, devs[-1])
        assert len(fake.pending) <= depth
    staging.finish()
    for k, d in enumerate(devs):
        assert torch.equal(d, torch.full((5,), float(k))), k


def test_reused_slot_is_poisoned_then_refilled():
    staging, fake = _staging(depth=1)
    a = staging.to_host("grad", torch.ones(4))
    staging.wait(a)
    b = staging.to_host("grad", torch.full((4,), 2.0))
    # The same memory as a's (one slot), poisoned at release and not yet copied into.
    assert a.host.untyped_storage().data_ptr() == b.host.untyped_storage().data_ptr()
    assert b.host.isnan().all()
    assert torch.equal(staging.wait(b), torch.full((4,), 2.0))


def test_kinds_have_separate_slots_and_sizes_grow():
    staging, _ = _staging(depth=1)
    g = staging.wait(staging.to_host("grad", torch.ones(3)))
    p = staging.wait(staging.to_host("param", torch.full((3,), 7.0, dtype=torch.bfloat16)))
    assert torch.equal(g, torch.ones(3))  # "param" did not take "grad"'s slot
    big = staging.wait(staging.to_host("grad", torch.arange(100.0)))
    assert torch.equal(big, torch.arange(100.0)) and p.dtype == torch.bfloat16


def test_the_fake_catches_a_staging_that_does_not_wait(monkeypatch):
    """The double has teeth: a staging whose reuse skips the wait gives wrong values."""
    staging, fake = _staging(depth=1)
    monkeypatch.setattr(HostStaging, "wait", lambda self, t: t.host)
    devs = []
    with pytest.raises(AssertionError, match="released while a copy"):
        for k in range(2):
            host = staging.host_buffer("out", 4, torch.float32)
            host.fill_(float(k))
            devs.append(torch.empty(4))
            staging.to_device(host, devs[-1])


def test_the_fake_catches_a_read_before_the_wait():
    staging, _ = _staging()
    t = staging.to_host("grad", torch.ones(8))
    assert t.host.isnan().all()  # what a staging reading t.host without wait() would use


def test_copies_must_cross_the_boundary():
    staging, fake = _staging()
    host = staging.host_buffer("out", 4, torch.float32)
    with pytest.raises(AssertionError, match="cross the boundary"):
        fake.to_host(host, host)
    with pytest.raises(ValueError, match="host_buffer"):
        staging.to_device(torch.zeros(4), torch.zeros(4))


def test_sync_boundary_copies_at_once():
    staging = HostStaging(SyncBoundary())
    t = staging.to_host("grad", torch.arange(4.0))
    assert torch.equal(t.host, torch.arange(4.0))
    assert torch.equal(staging.wait(t), torch.arange(4.0))


def test_torch_threads_are_scoped():
    before = torch.get_num_threads()
    with torch_threads(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(before + 2):
        raise RuntimeError("the step failed")
    assert torch.get_num_threads() == before

