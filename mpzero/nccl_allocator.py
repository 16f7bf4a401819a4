"""NCCL user buffers (``nccl_ub=True``): a ``torch.cuda.MemPool`` backed by the NCCL process
group's allocator and registered with it, so collectives on tensors from the pool run
zero-copy (NCCL's user-buffer registration)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class NcclMemPool:
    """Allocate tensors from a MemPool registered with ``group``'s NCCL backend."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        if torch.device(device).type != "cuda":
            raise RuntimeError(f"nccl_ub=True needs CUDA tensors, got device {device}")
        if not (hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")):
            raise RuntimeError(
                f"nccl_ub=True: torch {torch.__version__} has no torch.cuda.MemPool / "
                "use_mem_pool (needs a newer PyTorch)")
        group = group if group is not None else dist.group.WORLD
        try:
            backend = group._get_backend(torch.device(device))
        except Exception as e:  # noqa: BLE001 - any failure here means: not NCCL
            raise RuntimeError(f"nccl_ub=True needs an NCCL process group ({e})") from e
        try:
            for attr in ("register_mem_pool", "deregister_mem_pool"):
                getattr(backend, attr)
            allocator = backend.mem_allocator  # raises when NCCL lacks user-buffer support
        except Exception as e:  # noqa: BLE001 - AttributeError or the backend's RuntimeError
            raise RuntimeError(
                f"nccl_ub=True: this torch/NCCL build cannot allocate NCCL user buffers "
                f"({type(backend).__name__}: {e})") from e
        self.backend = backend
        self.device = torch.device(device)
        self.pool = torch.cuda.MemPool(allocator)
        self._registered = False

    @contextlib.contextmanager
    def allocate(self):
        """Tensors created inside come from the pool."""
        with torch.cuda.use_mem_pool(self.pool, device=self.device):
            yield

    def register(self) -> None:
        """Register the pool's segments with NCCL (after the buffers are allocated)."""
        if not self._registered:
            self.backend.register_mem_pool(self.pool)
            self._registered = True

    def close(self) -> None:
        if self._registered:
            self.backend.deregister_mem_pool(self.pool)
            self._registered = False
