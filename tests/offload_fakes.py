"""A fake device boundary for the offload staging (mpzero/optimizers/offload.py).

"Device" tensors are ordinary CPU tensors the caller owns; "host" tensors are the
buffers this boundary hands out, in storage of their own. Nothing is copied when a
copy is started: each copy runs only when its event is waited on (host or device
side), reading its source as it is *then*, as an asynchronous copy may. Meanwhile:

- a host buffer a device->host copy goes into holds poison (all bytes 0xFF: NaN in
  every float dtype) until the copy ran, so reading it before waiting gives NaN;
- a device tensor a host->device copy goes into is poisoned at the start, so a device
  read (the gather) before the device waited on the copy gives NaN;
- a host buffer is poisoned when the staging releases it for reuse, and releasing one
  a copy still reads or writes fails at once; a copy whose source buffer was rewritten
  while in flight delivers the new bytes, i.e. wrong values.

So a staging that reads too early, reuses a buffer in flight, or forgets a device wait
produces wrong values (or an assertion), which the tests compare against AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

POISON = 0xFF


def poison(t: torch.Tensor) -> None:
    t.view(-1).view(torch.uint8).fill_(POISON)


@dataclass(eq=False)  # compared by identity (they hold tensors)
class FakeEvent:
    dst: torch.Tensor
    src: torch.Tensor
    to_host: bool
    done: bool = False


class FakeBoundary:
    """Deferred copies, poisoned buffers, separate host storage (see the module)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.pending: list[FakeEvent] = []
        self.copies = 0
        self.most_in_flight = 0  # copies started and not yet run, at the worst moment
        self.host_waits = 0
        self.device_waits = 0

    def _is_host(self, t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return any(ptr == b.untyped_storage().data_ptr() for b in self.buffers)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        buf.fill_(POISON)
        self.buffers.append(buf)
        return buf

    def _start(self, dst, src, to_host: bool) -> FakeEvent:
        assert self._is_host(dst) == to_host and self._is_host(src) != to_host, (
            "a copy must cross the boundary: host buffers from host_empty() on one side")
        assert dst.numel() == src.numel(), (dst.shape, src.shape)
        if not to_host:
            poison(dst)  # undefined until the device waited on the copy
        ev = FakeEvent(dst, src, to_host)
        self.pending.append(ev)
        self.most_in_flight = max(self.most_in_flight, len(self.pending))
        return ev

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> FakeEvent:
        return self._start(dst, src, True)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> FakeEvent:
        return self._start(dst, src, False)

    def _run(self, ev: FakeEvent) -> None:
        if not ev.done:
            ev.dst.copy_(ev.src.view(ev.dst.shape))
            ev.done = True
            self.copies += 1
            self.pending.remove(ev)

    def wait_host(self, ev: FakeEvent) -> None:
        self.host_waits += 1
        self._run(ev)

    def wait_device(self, ev: FakeEvent) -> None:
        self.device_waits += 1
        self._run(ev)

    def release(self, buffer: torch.Tensor) -> None:
        ptr = buffer.untyped_storage().data_ptr()
        for ev in self.pending:
            for t in (ev.dst, ev.src):
                assert t.untyped_storage().data_ptr() != ptr, (
                    "a host buffer was released while a copy through it is in flight")
        poison(buffer)
