"""Host staging for ``cpu_offload``: the device<->host copies of the offloaded step.

With ``cpu_offload`` every bucket's optimizer state lives in host memory and the Adam
update runs on the CPU (``offload_step.py``). What crosses the device boundary per
bucket and step is the reduced gradient shard (device->host, the parameters' shard too
where they hold the master's high halves) and the updated values in the param-sync
dtype (host->device, into the shard buffer the gather sends). :class:`HostStaging`
owns that traffic:

- a :class:`Boundary` does the copies: :class:`CudaBoundary` owns one side stream per
  direction and records an event per copy; :class:`SyncBoundary` (a CPU device) copies
  at once. Tests put a boundary of their own in its place that defers each copy to the
  wait on its event and poisons released buffers, so that reading a staging buffer
  before its copy finished, or reusing one still in flight, gives wrong values.
- a ring of ``depth`` staging slots per kind of buffer (pinned host memory on CUDA, so
  the copies are asynchronous DMA); a slot is handed out again only after the last
  copy through it finished (a host wait on its event).
- every copy in flight is a :class:`Transfer` that keeps both of its tensors referenced
  until its event has been waited on, so the caching allocator cannot reuse the device
  memory while a side stream still reads or writes it.

Order on CUDA: a device->host copy waits for the compute stream (the shard was written
there); a host->device copy waits for the compute stream too (its destination was just
allocated there); the compute stream waits for a host->device copy's event
(:meth:`HostStaging.on_device`) before anything reads what it wrote (the gather).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class Boundary(Protocol):
    """The device/host boundary the staging copies across."""

    def host_empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of uint8 host memory that copies can run from and into."""

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        """Start copying device ``src`` into host ``dst``; returns the copy's event."""

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        """Start copying host ``src`` into device ``dst``; returns the copy's event."""

    def wait_host(self, event: object) -> None:
        """Block the host until the copy of ``event`` finished."""

    def wait_device(self, event: object) -> None:
        """Make later device work (the compute stream) wait for the copy of ``event``."""

    def release(self, buffer: torch.Tensor) -> None:
        """``buffer`` (from :meth:`host_empty`) holds nothing anyone will read any more."""


class SyncBoundary:
    """A CPU device: host and "device" are the same memory, copies happen at once."""

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        dst.copy_(src)
        return None

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        dst.copy_(src)
        return None

    def wait_host(self, event: object) -> None:
        pass

    def wait_device(self, event: object) -> None:
        pass

    def release(self, buffer: torch.Tensor) -> None:
        pass


class CudaBoundary:
    """Pinned host memory and one side stream per direction, so gradients going out and
    updated values coming back use both copy engines while the CPU steps."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _copy(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor):
        # The source was written (or the destination allocated) on the compute stream.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        return self._copy(self.d2h, dst, src)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        return self._copy(self.h2d, dst, src)

    def wait_host(self, event: object) -> None:
        event.synchronize()

    def wait_device(self, event: object) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def release(self, buffer: torch.Tensor) -> None:
        pass


def boundary_for(device: torch.device) -> Boundary:
    """The boundary between ``device`` and the host."""
    return CudaBoundary(device) if device.type == "cuda" else SyncBoundary()


@dataclass(eq=False)  # compared by identity (they hold tensors)
class Transfer:
    """One copy in flight: both tensors stay referenced until it was waited on."""

    host: torch.Tensor
    device: torch.Tensor
    event: object
    to_host: bool
    done: bool = False


@dataclass(eq=False)  # compared by identity (they hold tensors)
class _Slot:
    buffer: torch.Tensor | None = None  # uint8 host memory, grown as needed
    transfer: Transfer | None = None  # the last copy through it


@dataclass
class _Ring:
    slots: list[_Slot]
    next: int = 0


class HostStaging:
    """Owns the boundary, the host staging slots and the copies in flight."""

    def __init__(self, boundary: Boundary, depth: int = 2):
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.boundary = boundary
        self.depth = depth
        self.rings: dict[str, _Ring] = {}
        self.to_devices: list[Transfer] = []  # host->device copies the device has not waited on
        # id(view) -> (view, its slot) for the views handed out this step (the view is
        # held so that its id stays its own).
        self.handed: dict[int, tuple[torch.Tensor, _Slot]] = {}

    def host_buffer(self, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The next host staging buffer of ``kind`` as ``numel`` elements of ``dtype``,
        once the last copy through it has finished (it is then released: the boundary
        may poison it)."""
        ring = self.rings.get(kind)
        if ring is None:
            ring = self.rings[kind] = _Ring([_Slot() for _ in range(self.depth)])
        slot = ring.slots[ring.next]
        ring.next = (ring.next + 1) % self.depth
        if slot.transfer is not None:
            self.wait(slot.transfer)
            slot.transfer = None
        nbytes = numel * dtype.itemsize
        if slot.buffer is None or slot.buffer.numel() < nbytes:
            # Rounded up to 64 bytes: every dtype view starts aligned, and a slightly
            # larger later bucket does not reallocate pinned memory.
            slot.buffer = self.boundary.host_empty(-(-nbytes // 64) * 64)
        else:
            self.boundary.release(slot.buffer)
        view = slot.buffer[:nbytes].view(dtype)
        self.handed[id(view)] = (view, slot)
        return view

    def _slot_of(self, host: torch.Tensor) -> _Slot:
        got = self.handed.get(id(host))
        if got is None or got[0] is not host:
            raise ValueError("not a host staging buffer handed out by host_buffer()")
        return got[1]

    def to_host(self, kind: str, src: torch.Tensor) -> Transfer:
        """Start copying device ``src`` into a fresh staging buffer of ``kind``."""
        host = self.host_buffer(kind, src.numel(), src.dtype)
        t = Transfer(host, src, self.boundary.to_host(host, src.view(-1)), True)
        self._slot_of(host).transfer = t
        return t

    def to_device(self, host: torch.Tensor, dst: torch.Tensor) -> Transfer:
        """Start copying the staging buffer ``host`` into device ``dst``. The buffer is
        handed out again only after the copy; the device reads ``dst`` only after
        :meth:`on_device` (or :meth:`all_on_device`)."""
        slot = self._slot_of(host)
        t = Transfer(host, dst, self.boundary.to_device(dst.view(-1), host), False)
        slot.transfer = t
        self.to_devices.append(t)
        return t

    def wait(self, t: Transfer) -> torch.Tensor:
        """Block the host until ``t`` finished; its host buffer (what a device->host copy
        brought) is then readable."""
        if not t.done:
            self.boundary.wait_host(t.event)
            t.done = True
            t.device = None  # the device memory may be reused from here on
        return t.host

    def on_device(self, t: Transfer) -> None:
        """The device's later work sees what the host->device copy ``t`` wrote."""
        if t in self.to_devices:
            self.boundary.wait_device(t.event)
            self.to_devices.remove(t)

    def all_on_device(self) -> None:
        """:meth:`on_device` for every host->device copy not waited on yet."""
        for t in self.to_devices:
            self.boundary.wait_device(t.event)
        self.to_devices.clear()

    def finish(self) -> None:
        """End of a step: the device waits for every copy; the slots' bookkeeping is
        dropped (their last copies are still waited on before reuse)."""
        self.all_on_device()
        self.handed.clear()
