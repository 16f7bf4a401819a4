"""The DistributedFusedAdam suite on CUDA tensors with NCCL at world 1 (where CUDA is present).

Each check is a CPU/gloo test's rank function, run with CUDA as the default device
inside a one-rank NCCL world, so the side-stream and event code paths are real.
"""

import pytest
import torch

from mpzero.testing import requires_cuda, run_on_world

pytestmark = requires_cuda


def _on_cuda(fn_name, module, *args):
    import importlib

    torch.set_default_device("cuda")
    try:
        fn = getattr(importlib.import_module(module), fn_name)
        return fn(*args)
    finally:
        torch.set_default_device("cpu")


def _ranks_differ_plans():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_dfa_ranks_differ import world1_plans

    return world1_plans()


CHECKS = [
    ("_many_configs", "test_dfa_numerics", ("flat",)),
    ("_bias_correction_off", "test_dfa_numerics", ()),
    ("_different_grad_order_and_unused", "test_dfa_features", ()),
    ("_frozen_params_untouched", "test_dfa_features", ()),
    ("_low_precision", "test_dfa_features", ("grad_bf16",)),
    ("_low_precision", "test_dfa_features", ("param_fp16",)),
    ("_low_precision", "test_dfa_features", ("state_bf16",)),
    ("_model_dtypes", "test_dfa_features", ("bfloat16",)),
    ("_grad_scaler_skips_inf", "test_dfa_features", ()),
    ("_unscale_then_clip", "test_dfa_features", ()),
    ("_grad_norm_api", "test_dfa_features", ()),
    ("_overlap_param_sync", "test_dfa_features", (True,)),
    ("_init_params_order", "test_dfa_features", ()),
    ("_capturable", "test_dfa_features", ()),
    ("_contiguous", "test_dfa_buffers", ("grad",)),
    ("_contiguous", "test_dfa_buffers", ("param",)),
    ("_remainders", "test_dfa_buffers", ()),
    ("_byte_sync", "test_dfa_buffers", ("float16", "uint8")),
    ("_graph_captured_step", "test_dfa_cuda", ()),
    ("_scaled_states", "test_dfa_buffers", ("bfloat16", 1.0)),
    ("_nccl_ub", "test_dfa_cuda", ()),
    ("_plain", "test_direct_grads", (torch.bfloat16, None)),
    ("_plain", "test_direct_grads", (torch.float32, 0.5)),
    ("_fallbacks", "test_direct_grads", ("skip",)),
    ("_fallbacks", "test_direct_grads", ("accumulate",)),
    ("_fallbacks", "test_direct_grads", ("shard_read",)),
    *[("_train", "test_dfa_ranks_differ", (plan,)) for plan in _ranks_differ_plans()],
    ("_unscale_misuse", "test_dfa_apex_api", ()),
    ("_init_params_dtypes", "test_dfa_apex_api", ()),
]


@pytest.mark.parametrize("fn,module,args", CHECKS,
                         ids=[f"{c[0]}{c[2]}" if len(repr(c[2])) < 60 else f"{c[0]}-{i}"
                              for i, c in enumerate(CHECKS)])
def test_dfa_on_cuda_nccl(fn, module, args):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for the rank fns
    if fn == "_graph_captured_step":
        from mpzero import kernels

        if not kernels.extension_available():
            pytest.skip("capturing step() needs the CUDA kernels (mpzero._C): the reference "
                        "kernels copy host scalars to the device")
    out = run_on_world(1, _on_cuda, fn, module, *args, backend="nccl", timeout=300)
    if isinstance(out[0], str) and out[0].startswith("unsupported"):
        pytest.skip(out[0])
    CHECK_RESULT.get(fn, lambda r: r is True)(out[0])


# What the gloo tests assert about the rank functions' results (at world 1).
CHECK_RESULT = {
    "_many_configs": lambda r: _assert(all(d <= 1e-4 for d in r.values()), r),
    "_grad_scaler_skips_inf": lambda r: _assert(r[1] == r[0] / 2, r),
    "_overlap_param_sync": lambda r: _assert(r == 0, r),
    "_scaled_states": lambda r: _assert(r[0] < 5e-2, r),
}


def _assert(ok, what):
    assert ok, what


def _graph_captured_step():
    """capturable=True: the whole step() captured in a CUDA graph and replayed equals eager
    AdamW (gradients land in the contiguous grad buffer, whose address is stable)."""
    import copy

    from mpzero.optimizers import DistributedFusedAdam

    from dfa_common import ATOL, RTOL, batches, loss_fn, make_model

    model = make_model()
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, capturable=True,
                               contiguous_grad_buffer=True, overlap_grad_sync=False,
                               bucket_cap_mb=24 * 4 / 2**20)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    data = batches(1, 6, 1)

    def backward(s):
        opt.zero_grad()
        loss_fn(model, *data[s][0][0]).backward()
        ref_opt.zero_grad()
        loss_fn(ref, *data[s][0][0]).backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture, as torch's docs ask
        for s in range(2):
            backward(s)
            opt.step()
            ref_opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    backward(2)
    with torch.cuda.graph(graph):
        opt.step()
    for s in range(2, 6):
        if s > 2:
            backward(s)
        graph.replay()
        ref_opt.step()
    torch.cuda.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    return True


def _pool_segments(pool) -> list[tuple[int, int]]:
    """(start, end) addresses of a MemPool's segments."""
    if hasattr(pool, "snapshot"):
        segments = pool.snapshot()
    else:  # older torch: the whole snapshot, filtered by pool id
        segments = [s for s in torch.cuda.memory_snapshot()
                    if tuple(s.get("segment_pool_id", ())) == tuple(pool.id)]
    return [(s["address"], s["address"] + s["total_size"]) for s in segments]


def _nccl_ub():
    """nccl_ub=True at world 1: the grad buffer and the reduce-scatter outputs lie in the
    pool's segments, which come from ncclMemAlloc (mpzero's allocator: its live bytes cover
    them) and are registered with the communicator (deregistration accepts the pool); four
    steps, two of them accumulating over two syncs, equal nccl_ub=False bit for bit."""
    from mpzero.nccl_allocator import REGISTER_MEM_POOL, extension_allocator_info
    from mpzero.optimizers import DistributedFusedAdam

    from dfa_common import batches, loss_fn, make_model

    kw = dict(lr=1e-2, contiguous_grad_buffer=True, bucket_cap_mb=24 * 4 / 2**20)
    model, ref = make_model(), make_model()
    opt = DistributedFusedAdam(model.parameters(), nccl_ub=True, **kw)
    try:
        opt.ensure_layout()
    except RuntimeError as e:  # no NCCL user buffers here: the error must say why
        assert "nccl_ub=True" in str(e) and "NCCL user buffers" in str(e), e
        return f"unsupported: {e}"
    ref_opt = DistributedFusedAdam(ref.parameters(), nccl_ub=False, **kw)
    nccl_pool = opt.shards.nccl_pool
    print(f"nccl_ub: {nccl_pool.describe()}")
    segments = _pool_segments(nccl_pool.pool)
    assert segments, "the pool has no segments"
    tensors = list(opt.shards.buffers["grads"].values()) + [
        b.persistent_incoming for b in opt.ensure_layout().grads.buckets]
    for t in tensors:
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert any(a <= start and end <= b for a, b in segments), (hex(start), segments)
    if nccl_pool.source == "mpzero":
        info = extension_allocator_info()
        assert info["live_bytes"] >= sum(b - a for a, b in segments), (info, segments)
    data = batches(1, 4, 2)
    for s in range(4):
        for o, m in ((opt, model), (ref_opt, ref)):
            o.zero_grad()
            for x, y in data[s][0][: 1 + s % 2]:  # odd steps: two syncs (accumulation)
                loss_fn(m, x, y).backward()
            o.step()
    torch.cuda.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q), (p - q).abs().max()
    assert nccl_pool.registered
    if nccl_pool.registration == REGISTER_MEM_POOL:
        nccl_pool.close()  # torch refuses to deregister a pool it never registered
        assert not nccl_pool.registered
    return True
