"""NCCL user buffers (``nccl_ub=True``): a ``torch.cuda.MemPool`` whose segments come from
``ncclMemAlloc`` and are registered with the NCCL communicator of the optimizer's process
group, so collectives on tensors from the pool can run zero-copy.

Two choices, each made once per pool (docs/distributed_fused_adam.md, "nccl_ub"):

- **allocator**: the backend's own (``ProcessGroupNCCL.mem_allocator``) where torch
  provides one; else mpzero's (``mpzero._C``: ``ncclMemAlloc``/``ncclMemFree`` resolved at
  run time) through ``torch.cuda.memory.CUDAPluggableAllocator``. Torch's raises on
  devices without NVLink multicast, e.g. torch 2.11 on a single H200 in a VM.
- **registration**: ``ProcessGroupNCCL.register_mem_pool`` (every current segment, and
  later ones through torch's allocator hook); else torch's allocator hook enabled by
  ``TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1`` (every segment allocated after the
  communicator exists); else none is possible and ``nccl_ub=True`` is refused.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

HOOK_ENV = "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"
REGISTER_MEM_POOL = "register_mem_pool"
ALLOCATOR_HOOK = "allocator_hook"


@dataclass(frozen=True)
class AllocatorChoice:
    """Where the pool's memory comes from."""

    allocator: object  # a torch._C._cuda_CUDAAllocator, for torch.cuda.MemPool(allocator)
    source: str  # "backend" (ProcessGroupNCCL.mem_allocator) or "mpzero" (mpzero._C)
    reason: str  # why mpzero's: the backend's refusal ("" for the backend's)


def extension_allocator_info() -> dict | None:
    """``mpzero._C.nccl_allocator_info()``; None without the extension (or an older one)."""
    try:
        from mpzero import _C
    except ImportError:
        return None
    info = getattr(_C, "nccl_allocator_info", None)
    return info() if info is not None else None


def last_allocator_error() -> str:
    """The last ncclMemAlloc/ncclMemFree failure of mpzero's allocator ('' when none)."""
    try:
        from mpzero import _C
    except ImportError:
        return ""
    last = getattr(_C, "nccl_allocator_last_error", None)
    return last(True) if last is not None else ""


_PLUGGABLE: dict[str, object] = {}  # one CUDAPluggableAllocator per library, kept alive


def _pluggable(info: dict) -> object:
    key = info["library_path"]
    if key not in _PLUGGABLE:
        _PLUGGABLE[key] = torch.cuda.memory.CUDAPluggableAllocator(
            info["library_path"], info["alloc"], info["free"]).allocator()
    return _PLUGGABLE[key]


def choose_allocator(backend, info=None, make=None) -> AllocatorChoice:
    """The backend's NCCL allocator where it has a working one, else mpzero's.

    ``info`` (default: :func:`extension_allocator_info`) and ``make`` (info -> allocator)
    are parameters for the tests."""
    try:
        return AllocatorChoice(backend.mem_allocator, "backend", "")
    except AttributeError:
        refusal = f"{type(backend).__name__} has no mem_allocator (torch {torch.__version__})"
    except Exception as e:  # noqa: BLE001 - the backend's RuntimeError says why
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]  # no C++ trace
        refusal = f"{type(backend).__name__}.mem_allocator: {first}"
    info = extension_allocator_info() if info is None else info
    if info is None:
        raise RuntimeError(
            f"nccl_ub=True: cannot allocate NCCL user buffers: {refusal}; and mpzero's own "
            "allocator needs the CUDA extension mpzero._C with nccl_allocator_info, which "
            "is not built here (or older): reinstall with MPZERO_BUILD_CUDA=1")
    if not info["found"]:
        raise RuntimeError(
            f"nccl_ub=True: cannot allocate NCCL user buffers: {refusal}; and mpzero's own "
            f"allocator cannot find NCCL: {info['error']}")
    return AllocatorChoice((make or _pluggable)(info), "mpzero", refusal)


def _expandable_segments() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get(
        "PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "y", "on")


def choose_registration(backend) -> str:
    """:data:`REGISTER_MEM_POOL` or :data:`ALLOCATOR_HOOK`; raises when neither works."""
    if callable(getattr(backend, "register_mem_pool", None)):
        return REGISTER_MEM_POOL
    if _env_true(HOOK_ENV) and not _expandable_segments():
        return ALLOCATOR_HOOK
    hint = (f"{HOOK_ENV}=1 is set, but torch disables its allocator hook with "
            "expandable_segments" if _env_true(HOOK_ENV) else
            f"set {HOOK_ENV}=1 before init_process_group (torch then registers every "
            "CUDA allocation with NCCL), or use a torch with register_mem_pool")
    raise RuntimeError(
        f"nccl_ub=True: cannot register NCCL user buffers: {type(backend).__name__} has no "
        f"register_mem_pool (torch {torch.__version__}); {hint}")


def _init_communicator(group: dist.ProcessGroup, device: torch.device) -> None:
    """Create the group's NCCL communicator now (NCCL's is lazy): register_mem_pool refuses
    a pool before it exists, and the allocator hook registers with existing ones only.
    Every rank builds its layout at the same point, so this collective is matched."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)


class NcclMemPool:
    """Allocate tensors from a MemPool registered with ``group``'s NCCL backend."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        if torch.device(device).type != "cuda":
            raise RuntimeError(f"nccl_ub=True needs CUDA tensors, got device {device}")
        if not (hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")):
            raise RuntimeError(
                f"nccl_ub=True: torch {torch.__version__} has no torch.cuda.MemPool / "
                "use_mem_pool, so NCCL user buffers cannot be allocated (needs a newer PyTorch)")
        group = group if group is not None else dist.group.WORLD
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        try:
            backend = group._get_backend(self.device)
        except Exception as e:  # noqa: BLE001 - any failure here means: not NCCL
            raise RuntimeError(
                f"nccl_ub=True needs an NCCL process group for NCCL user buffers ({e})") from e
        self.registration = choose_registration(backend)
        self.choice = choose_allocator(backend)
        self.backend = backend
        _init_communicator(group, self.device)
        self.pool = torch.cuda.MemPool(self.choice.allocator)
        self.registered = False

    @property
    def source(self) -> str:
        return self.choice.source

    def describe(self) -> str:
        """One line: which allocator and which registration (for logs and tests)."""
        alloc = ("ProcessGroupNCCL.mem_allocator" if self.source == "backend" else
                 f"mpzero._C ncclMemAlloc ({self.choice.reason})")
        reg = ("ProcessGroupNCCL.register_mem_pool" if self.registration == REGISTER_MEM_POOL
               else f"torch's allocator hook ({HOOK_ENV}=1)")
        return f"allocator: {alloc}; registration: {reg}"

    @contextlib.contextmanager
    def allocate(self):
        """Tensors created inside come from the pool."""
        try:
            with torch.cuda.use_mem_pool(self.pool, device=self.device):
                yield
        except torch.cuda.OutOfMemoryError as e:
            why = last_allocator_error() if self.source == "mpzero" else ""
            if why:
                raise RuntimeError(f"nccl_ub=True: NCCL user buffer allocation failed: {why}"
                                   ) from e
            raise

    def register(self) -> None:
        """Register the pool's segments with NCCL (after the buffers are allocated). With
        the allocator hook torch already registered each segment as it was allocated."""
        if self.registered:
            return
        if self.registration == REGISTER_MEM_POOL:
            self.backend.register_mem_pool(self.pool)
        self.registered = True

    def close(self) -> None:
        """Deregister (register_mem_pool only; the allocator hook deregisters on free)."""
        if self.registered and self.registration == REGISTER_MEM_POOL:
            self.backend.deregister_mem_pool(self.pool)
        self.registered = False
