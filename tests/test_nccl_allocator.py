"""nccl_ub=True's choices, on the CPU: which allocator (the backend's or mpzero._C's), which
registration (register_mem_pool or torch's allocator hook), and the errors that name
nccl_ub when neither works. Backends, the extension and the MemPool are stand-ins; the
real thing runs in tests/gpu/test_dfa_cuda.py (_nccl_ub)."""

import contextlib

import pytest
import torch

from mpzero import nccl_allocator as na

FOUND = dict(library_path="/x/mpzero/_C.so", alloc="mpzero_nccl_alloc",
             free="mpzero_nccl_free", found=True, nccl_library="/x/libnccl.so.2",
             lookup="libnccl.so.2 (already loaded)", nccl_version=22703, error="",
             live_allocations=0, live_bytes=0)
MISSING = dict(FOUND, found=False, nccl_library="", lookup="",
               error="libnccl.so.2 has no ncclMemAlloc/ncclMemFree (they need NCCL 2.19 "
                     "or newer)")
NO_MULTICAST = "NCCL mem allocator is not supported in this NCCL version"


class WithAllocator:
    mem_allocator = object()

    def register_mem_pool(self, pool):
        self.registered = pool

    def deregister_mem_pool(self, pool):
        self.deregistered = pool


class Refusing(WithAllocator):
    """torch 2.11 on a device without NVLink multicast."""

    @property
    def mem_allocator(self):
        raise RuntimeError(NO_MULTICAST + "\nException raised from getMemAllocator at ...")


class Bare:
    """A backend with neither mem_allocator nor register_mem_pool (older torch)."""


def _make(info):
    return ("pluggable", info["library_path"], info["alloc"], info["free"])


def test_backend_allocator_preferred():
    backend = WithAllocator()
    choice = na.choose_allocator(backend, info=FOUND, make=_make)
    assert choice.source == "backend" and choice.allocator is WithAllocator.mem_allocator
    assert choice.reason == ""


def test_refusing_backend_falls_back_to_mpzero():
    choice = na.choose_allocator(Refusing(), info=FOUND, make=_make)
    assert choice.source == "mpzero"
    assert choice.allocator == ("pluggable", "/x/mpzero/_C.so", "mpzero_nccl_alloc",
                                "mpzero_nccl_free")
    assert choice.reason == f"Refusing.mem_allocator: {NO_MULTICAST}"  # first line only


def test_backend_without_allocator_falls_back_to_mpzero():
    choice = na.choose_allocator(Bare(), info=FOUND, make=_make)
    assert choice.source == "mpzero" and "Bare has no mem_allocator" in choice.reason


def test_no_extension_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(na, "extension_allocator_info", lambda: None)
    with pytest.raises(RuntimeError) as e:
        na.choose_allocator(Refusing(), make=_make)
    msg = str(e.value)
    assert msg.startswith("nccl_ub=True: cannot allocate NCCL user buffers")
    assert NO_MULTICAST in msg and "mpzero._C" in msg and "MPZERO_BUILD_CUDA=1" in msg
    assert "\n" not in msg


def test_nccl_without_mem_alloc_is_a_clear_error():
    with pytest.raises(RuntimeError, match="nccl_ub=True") as e:
        na.choose_allocator(Bare(), info=MISSING, make=_make)
    assert "NCCL 2.19" in str(e.value) and "Bare has no mem_allocator" in str(e.value)


def test_registration_prefers_register_mem_pool(monkeypatch):
    monkeypatch.setenv(na.HOOK_ENV, "1")
    assert na.choose_registration(Refusing()) == na.REGISTER_MEM_POOL


def test_registration_by_allocator_hook(monkeypatch):
    monkeypatch.setenv(na.HOOK_ENV, "1")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert na.choose_registration(Bare()) == na.ALLOCATOR_HOOK


def test_no_registration_names_the_env_var(monkeypatch):
    monkeypatch.delenv(na.HOOK_ENV, raising=False)
    with pytest.raises(RuntimeError) as e:
        na.choose_registration(Bare())
    msg = str(e.value)
    assert msg.startswith("nccl_ub=True: cannot register NCCL user buffers")
    assert "register_mem_pool" in msg and f"{na.HOOK_ENV}=1" in msg


def test_allocator_hook_off_with_expandable_segments(monkeypatch):
    monkeypatch.setenv(na.HOOK_ENV, "1")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(RuntimeError, match="expandable_segments"):
        na.choose_registration(Bare())


def test_cpu_device_refused():
    with pytest.raises(RuntimeError, match="nccl_ub=True needs CUDA"):
        na.NcclMemPool(None, torch.device("cpu"))


def test_extension_info_shape():
    info = na.extension_allocator_info()  # None on a CPU-only install
    if info is not None:
        assert set(FOUND) <= set(info) and info["alloc"] == "mpzero_nccl_alloc"


class FakeGroup:
    def __init__(self, backend):
        self.backend = backend

    def _get_backend(self, device):
        return self.backend


class FakePool:
    def __init__(self, allocator):
        self.allocator = allocator


@pytest.fixture
def fake_cuda(monkeypatch):
    """MemPool, use_mem_pool and the communicator warm-up without a GPU."""
    calls = []
    monkeypatch.setattr(torch.cuda, "MemPool", FakePool, raising=False)
    monkeypatch.setattr(torch.cuda, "use_mem_pool",
                        lambda pool, device=None: contextlib.nullcontext(), raising=False)
    monkeypatch.setattr(na, "_init_communicator", lambda g, d: calls.append(("init", d)))
    monkeypatch.setattr(na, "extension_allocator_info", lambda: FOUND)
    monkeypatch.setattr(na, "_pluggable", _make)
    return calls


def test_pool_with_mpzero_allocator_registers_and_deregisters(fake_cuda):
    backend = Refusing()
    pool = na.NcclMemPool(FakeGroup(backend), torch.device("cuda", 0))
    assert fake_cuda == [("init", torch.device("cuda", 0))]
    assert pool.source == "mpzero" and pool.pool.allocator[0] == "pluggable"
    with pool.allocate():
        pass
    assert not pool.registered
    pool.register()
    assert pool.registered and backend.registered is pool.pool
    assert "mpzero._C ncclMemAlloc" in pool.describe() and NO_MULTICAST in pool.describe()
    assert "register_mem_pool" in pool.describe()
    pool.close()
    assert not pool.registered and backend.deregistered is pool.pool


def test_pool_with_backend_allocator(fake_cuda):
    pool = na.NcclMemPool(FakeGroup(WithAllocator()), torch.device("cuda", 0))
    assert pool.source == "backend" and pool.pool.allocator is WithAllocator.mem_allocator
    assert pool.describe().startswith("allocator: ProcessGroupNCCL.mem_allocator")


def test_pool_with_allocator_hook(fake_cuda, monkeypatch):
    monkeypatch.setenv(na.HOOK_ENV, "1")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    pool = na.NcclMemPool(FakeGroup(Bare()), torch.device("cuda", 0))
    pool.register()  # nothing to call: torch registered each segment as it was allocated
    assert pool.registered and na.HOOK_ENV in pool.describe()
    pool.close()
    assert not pool.registered


def test_pool_refused_before_the_warm_up(fake_cuda, monkeypatch):
    monkeypatch.delenv(na.HOOK_ENV, raising=False)
    with pytest.raises(RuntimeError, match="nccl_ub=True: cannot register"):
        na.NcclMemPool(FakeGroup(Bare()), torch.device("cuda", 0))
    assert fake_cuda == []  # no collective was issued: the error comes first


def test_allocation_failure_names_nccl(fake_cuda, monkeypatch):
    pool = na.NcclMemPool(FakeGroup(Refusing()), torch.device("cuda", 0))
    monkeypatch.setattr(na, "last_allocator_error",
                        lambda: "ncclMemAlloc(4096 bytes) on device 0 failed: NCCL error 1")
    with pytest.raises(RuntimeError, match="nccl_ub=True: NCCL user buffer allocation failed"):
        with pool.allocate():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")


def _incoming_buffers(micro):
    """GradSync with nccl_ub's persistent reduce-scatter outputs (here plain CPU tensors in
    place of the pool's) equals the plain pipeline bit for bit, with ``micro`` syncs per
    step (gradient accumulation: the reduced shard must survive the next sync)."""
    import torch.distributed as dist

    from mpzero.optimizers import DistributedFusedAdam

    from dfa_common import batches, loss_fn, make_model

    world, rank = dist.get_world_size(), dist.get_rank()
    kw = dict(lr=1e-2, contiguous_grad_buffer=True, bucket_cap_mb=24 * 4 / 2**20)
    model, ref = make_model(), make_model()
    opt = DistributedFusedAdam(model.parameters(), **kw)
    ref_opt = DistributedFusedAdam(ref.parameters(), **kw)
    opt.ensure_layout()
    for bucket in opt.ensure_layout().grads.buckets:  # what _ensure_layout allocates from the pool
        bucket.persistent_incoming = torch.empty(bucket.layout.shard_size, dtype=bucket.dtype)
    data = batches(world, 3, micro)
    for s in range(3):
        for o, m in ((opt, model), (ref_opt, ref)):
            o.zero_grad()
            for x, y in data[s][rank]:
                loss_fn(m, x, y).backward()
            o.step()
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("size,micro", [(1, 1), (1, 2), (2, 3)])
def test_persistent_incoming_matches_plain(world, size, micro):
    assert all(world(size, _incoming_buffers, micro))
