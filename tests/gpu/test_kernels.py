"""The CUDA kernels (mpzero._C) against the PyTorch reference, on the GPU.

Every check draws fresh random inputs, poisons outputs with NaN so unwritten elements
show, and covers odd sizes, misaligned views (element offsets 1 and 3), empty lists,
lists longer than one launch holds, and every dtype combination. The bit-exactness
checks come last in the file so that ``pytest -x`` reports the tolerance checks first.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mpzero.testing import skip_module_without_extension

skip_module_without_extension()

from mpzero import kernels  # noqa: E402
from mpzero.kernels import cuda as kc  # noqa: E402
from mpzero.kernels import reference  # noqa: E402
from mpzero.kernels.precision import merge_remainder, split_remainder  # noqa: E402

DEV = torch.device("cuda")
F = (torch.float32, torch.float16, torch.bfloat16)
HP = dict(beta1=0.9, beta2=0.999, eps=1e-8)
SIZES = [1, 7, 8, 9, 4095, 4097, 65543]
_seed = itertools.count(1000)


def _gen() -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(next(_seed))


def _rand(n: int, dtype, gen, offset: int = 0, scale: float = 1.0, positive=False):
    """Random (never zero) data; a view at element ``offset`` of a bigger buffer."""
    buf = torch.randn(n + offset, device=DEV, generator=gen) * scale
    if positive:
        buf = buf.abs() + 1e-3 * scale
    return buf.to(dtype)[offset:]


def _poison(n: int, dtype, offset: int = 0):
    return torch.full((n + offset,), float("nan"), device=DEV, dtype=dtype)[offset:]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(
        {4: torch.int32, 2: torch.int16, 1: torch.uint8, 8: torch.int64}[t.element_size()]
    )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _ulp_close(a: torch.Tensor, b: torch.Tensor, ulps: float = 1.0, atol: float = 1e-8):
    """a and b agree within ``ulps`` units of a's dtype (relative) plus ``atol`` (room for
    cancellation in p - lr*u); NaN never passes. Bit-exactness is checked separately."""
    tol = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[a.dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=ulps * tol, atol=atol)


def _adam_inputs(sizes, pdt, gdt, odt, gen, offset=0):
    p = [_rand(n, pdt, gen, offset) for n in sizes]
    g = [_rand(n, gdt, gen, offset) for n in sizes]
    m = [_rand(n, pdt, gen, offset, 0.1) for n in sizes]
    v = [_rand(n, pdt, gen, offset, 0.01, positive=True) for n in sizes]
    out = None if odt is None else [_poison(n, odt, offset) for n in sizes]
    return p, g, m, v, out


def _clone(lst):
    return None if lst is None else [t.clone() for t in lst]


def _run_adam_pair(sizes, pdt, gdt, odt, offset=0, **kw):
    """Run the kernel and the reference on the same fresh inputs; return both results."""
    gen = _gen()
    p, g, m, v, out = _adam_inputs(sizes, pdt, gdt, odt, gen, offset)
    rp, rg, rm, rv, rout = map(_clone, (p, g, m, v, out))
    kernels.adam(p, g, m, v, out, **kw)
    reference.adam(rp, rg, rm, rv, rout, **kw)
    return (p, m, v, out), (rp, rm, rv, rout)


def _check_adam(got, want):
    for gl, wl in zip(got, want):
        if gl is None:
            continue
        for a, b in zip(gl, wl):
            assert not torch.isnan(a).any(), "unwritten (NaN-poisoned) or NaN output"
            _ulp_close(a, b)


BASE = dict(lr=1e-2, weight_decay=0.01, step=5, **HP)


def test_dispatch_uses_extension():
    assert kernels.extension_available()


@pytest.mark.parametrize("pdt", F)
@pytest.mark.parametrize("gdt", F)
@pytest.mark.parametrize("odt", (None,) + F)
def test_adam_every_dtype_combination(pdt, gdt, odt):
    got, want = _run_adam_pair(SIZES, pdt, gdt, odt, **BASE)
    _check_adam(got, want)


@pytest.mark.parametrize("offset", [1, 3])
@pytest.mark.parametrize(
    "pdt,gdt,odt",
    [
        (torch.float32, torch.float32, torch.bfloat16),
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float16, torch.float32),
    ],
)
def test_adam_misaligned_views(offset, pdt, gdt, odt):
    got, want = _run_adam_pair(SIZES + [(1 << 20) + 3], pdt, gdt, odt, offset=offset, **BASE)
    _check_adam(got, want)


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_adam_modes_and_grad_scale(adam_w_mode, bias_correction):
    kw = dict(
        BASE,
        adam_w_mode=adam_w_mode,
        bias_correction=bias_correction,
        grad_scale=torch.tensor(0.37, device=DEV),
        weight_decay=0.1,
    )
    got, want = _run_adam_pair(SIZES, torch.float32, torch.bfloat16, torch.float16, **kw)
    _check_adam(got, want)


@pytest.mark.parametrize("step_dtype", [torch.int64, torch.int32, torch.float32, torch.float64])
def test_adam_device_scalars(step_dtype):
    kw = dict(
        BASE, lr=torch.tensor(3e-3, device=DEV), step=torch.tensor(4, device=DEV, dtype=step_dtype)
    )
    got, want = _run_adam_pair(SIZES, torch.float32, torch.float32, torch.bfloat16, **kw)
    _check_adam(got, want)


def test_adam_many_tensors_mixed_dtypes_and_empties():
    gen = _gen()
    n = 300  # more than one launch holds (64 tensors of depth 5)
    sizes = torch.randint(0, 3000, (n,), generator=torch.Generator().manual_seed(3)).tolist()
    pdts = [F[i % 3] if i % 7 else torch.float32 for i in range(n)]
    p = [_rand(k, d, gen) for k, d in zip(sizes, pdts)]
    g = [_rand(k, F[i % 2], gen) for i, k in enumerate(sizes)]
    m = [_rand(k, d, gen, 0, 0.1) for k, d in zip(sizes, pdts)]
    v = [_rand(k, d, gen, 0, 0.01, positive=True) for k, d in zip(sizes, pdts)]
    out = [_poison(k, torch.bfloat16) for k in sizes]
    ref = list(map(_clone, (p, g, m, v, out)))
    kernels.adam(p, g, m, v, out, **BASE)
    reference.adam(*ref, **BASE)
    _check_adam((p, m, v, out), (ref[0], ref[2], ref[3], ref[4]))


def test_adam_empty_lists():
    kernels.adam([], [], [], [], None, **BASE)
    kernels.adam_remainders([], [], [], [], [], None, **BASE)
    empty = [torch.empty(0, device=DEV)]
    kernels.adam(empty, empty, empty, empty, empty, **BASE)


def test_adam_found_inf_changes_nothing():
    gen = _gen()
    for pdt, gdt, odt in [
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32, torch.float32),
    ]:
        p, g, m, v, out = _adam_inputs(SIZES, pdt, gdt, odt, gen, offset=1)
        before = [t.clone() for t in p + m + v + out]
        kw = dict(
            BASE,
            lr=torch.tensor(1e-2, device=DEV),
            step=torch.tensor(3, device=DEV),
            found_inf=torch.tensor(1.0, device=DEV),
        )
        kernels.adam(p, g, m, v, out, **kw)
        torch.cuda.synchronize()
        assert all(_same_bits(a, b) for a, b in zip(before, p + m + v + out))
        kw["found_inf"] = torch.tensor(0.0, device=DEV)
        kernels.adam(p, g, m, v, out, **kw)
        assert not _same_bits(before[-1], out[-1])


def test_adam_no_host_sync_with_device_scalars():
    gen = _gen()
    p, g, m, v, out = _adam_inputs([4097], torch.float32, torch.bfloat16, torch.bfloat16, gen)
    kw = dict(
        BASE,
        lr=torch.tensor(1e-3, device=DEV),
        step=torch.tensor(2, device=DEV),
        found_inf=torch.zeros((), device=DEV),
        grad_scale=torch.ones((), device=DEV),
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernels.adam(p, g, m, v, out, **kw)
        kernels.l2norm(g, noop_flag=kw["found_inf"])
        kernels.multi_copy(p, out, noop_flag=kw["found_inf"])
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("remainders", [False, True])
def test_capturable_in_cuda_graph(remainders):
    gen = _gen()
    sizes = [4097, 70001, 3]
    g = [_rand(n, torch.bfloat16, gen) for n in sizes]
    m = [_rand(n, torch.float32, gen, 0, 0.1) for n in sizes]
    v = [_rand(n, torch.float32, gen, 0, 0.01, positive=True) for n in sizes]
    out = [_poison(n, torch.bfloat16) for n in sizes]
    if remainders:
        hi, rem = map(list, zip(*[split_remainder(_rand(n, torch.float32, gen)) for n in sizes]))
        state = [hi, rem]
    else:
        state = [[_rand(n, torch.float32, gen) for n in sizes]]
    ref_state, rg, rm, rv, rout = [_clone(s) for s in state], _clone(g), _clone(m), _clone(v), None
    lr_t = torch.tensor(1e-3, device=DEV)
    step_t = torch.tensor(1, device=DEV, dtype=torch.int64)
    found = torch.ones((), device=DEV)  # warm-up and capture with the step skipped

    def call():
        kw = dict(lr=lr_t, step=step_t, weight_decay=0.05, found_inf=found, **HP)
        if remainders:
            kernels.adam_remainders(state[0], state[1], g, m, v, out, **kw)
        else:
            kernels.adam(state[0], g, m, v, out, **kw)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    rout = [t.clone() for t in out]
    for k, (lr, skip) in enumerate([(1e-3, 0.0), (2e-3, 0.0), (5e-3, 1.0), (3e-3, 0.0)], 1):
        new_g = [_rand(n, torch.bfloat16, gen) for n in sizes]
        for a, b, c in zip(g, rg, new_g):
            a.copy_(c)
            b.copy_(c)
        lr_t.fill_(lr)
        step_t.fill_(k)
        found.fill_(skip)
        graph.replay()
        kw = dict(lr=lr, step=k, weight_decay=0.05, found_inf=torch.tensor(skip, device=DEV), **HP)
        if remainders:
            reference.adam_remainders(ref_state[0], ref_state[1], rg, rm, rv, rout, **kw)
        else:
            reference.adam(ref_state[0], rg, rm, rv, rout, **kw)
        torch.cuda.synchronize()
        if remainders:
            _ulp_close(
                merge_remainder(state[0][0], state[1][0]),
                merge_remainder(ref_state[0][0], ref_state[1][0]),
            )
        else:
            _check_adam((state[0], m, v, out), (ref_state[0], rm, rv, rout))
        for a, b in zip(out, rout):
            assert not torch.isnan(a).any()
            _ulp_close(a, b)


def _rem_inputs(sizes, gdt, odt, gen, offset=0):
    masters = [_rand(n, torch.float32, gen, offset, 2.0) for n in sizes]
    pairs = [split_remainder(x) for x in masters]
    p = []
    r = []
    for (hi, lo), n in zip(pairs, sizes):
        ph = torch.empty(n + offset, device=DEV, dtype=torch.bfloat16)[offset:]
        pr = torch.empty(n + offset, device=DEV, dtype=torch.int16)[offset:]
        ph.copy_(hi)
        pr.copy_(lo)
        p.append(ph)
        r.append(pr)
    g = [_rand(n, gdt, gen, offset) for n in sizes]
    m = [_rand(n, torch.float32, gen, offset, 0.1) for n in sizes]
    v = [_rand(n, torch.float32, gen, offset, 0.01, positive=True) for n in sizes]
    out = None if odt is None else [_poison(n, odt, offset) for n in sizes]
    return p, r, g, m, v, out


@pytest.mark.parametrize("gdt", F)
@pytest.mark.parametrize("odt", (None,) + F)
@pytest.mark.parametrize("offset", [0, 3])
def test_adam_remainders_vs_reference(gdt, odt, offset):
    gen = _gen()
    lists = _rem_inputs(SIZES, gdt, odt, gen, offset)
    ref = list(map(_clone, lists))
    kernels.adam_remainders(*lists, **BASE)
    reference.adam_remainders(*ref, **BASE)
    p, r, _, m, v, out = lists
    for i in range(len(SIZES)):
        _ulp_close(merge_remainder(p[i], r[i]), merge_remainder(ref[0][i], ref[1][i]))
        _ulp_close(m[i], ref[3][i])
        _ulp_close(v[i], ref[4][i])
        if out is not None:
            assert not torch.isnan(out[i]).any()
            _ulp_close(out[i], ref[5][i])


def test_adam_remainders_found_inf_and_many_tensors():
    gen = _gen()
    sizes = [int(x) for x in torch.randint(1, 2000, (130,), generator=torch.Generator())]
    lists = _rem_inputs(sizes, torch.bfloat16, torch.bfloat16, gen)
    before = [t.clone() for lst in lists for t in lst]
    kernels.adam_remainders(*lists, **dict(BASE, found_inf=torch.ones((), device=DEV)))
    torch.cuda.synchronize()
    assert all(_same_bits(a, b) for a, b in zip(before, [t for lst in lists for t in lst]))
    ref = list(map(_clone, lists))
    kernels.adam_remainders(*lists, **BASE)
    reference.adam_remainders(*ref, **BASE)
    for i in range(len(sizes)):
        _ulp_close(merge_remainder(lists[0][i], lists[1][i]), merge_remainder(ref[0][i], ref[1][i]))
        assert torch.equal(lists[5][i], lists[0][i])  # bf16 params_out = the new bf16 param


@pytest.mark.parametrize("dtype", F)
@pytest.mark.parametrize("offset", [0, 1])
def test_l2norm_vs_fp64(dtype, offset):
    gen = _gen()
    ts = [_rand(n, dtype, gen, offset, 3.0) for n in SIZES + [(1 << 22) + 5]]
    want = torch.linalg.vector_norm(torch.cat([t.double() for t in ts]))
    got = kernels.l2norm(ts)
    assert got.dtype == torch.float32 and got.dim() == 0 and got.is_cuda
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=0)
    again = kernels.l2norm(ts)
    assert _same_bits(got, again), "l2norm must be deterministic"


def test_l2norm_many_tensors_mixed_dtypes():
    gen = _gen()
    ts = [
        _rand(int(n), F[i % 3], gen, i % 4)
        for i, n in enumerate(torch.randint(1, 5000, (400,), generator=torch.Generator()))
    ]
    ts.insert(5, torch.empty(0, device=DEV))
    want = torch.linalg.vector_norm(torch.cat([t.double() for t in ts]))
    torch.testing.assert_close(kernels.l2norm(ts).double(), want, rtol=2e-6, atol=0)


def test_l2norm_noop_flag():
    gen = _gen()
    ts = [_rand(n, torch.bfloat16, gen) for n in SIZES]
    flag = torch.zeros((), device=DEV)
    kernels.l2norm(ts, noop_flag=flag)
    assert flag.item() == 0
    for bad in (float("inf"), float("-inf"), float("nan")):
        t2 = [t.clone() for t in ts]
        t2[-1][-2] = bad
        flag = torch.zeros((), device=DEV)
        n = kernels.l2norm(t2, noop_flag=flag)
        assert not torch.isfinite(n).item() and flag.item() == 1
    flag = torch.zeros((), device=DEV)
    kernels.l2norm([torch.full((100,), 3e38, device=DEV)], noop_flag=flag)  # sum overflows
    assert flag.item() == 1
    assert kernels.l2norm([], device=DEV).item() == 0


def test_l2norm_and_copy_beyond_int32_indices():
    n = (1 << 31) + 9
    x = torch.ones(n, device=DEV, dtype=torch.bfloat16)
    x[-1] = 1000.0
    got = kernels.l2norm([x]).item()
    want = ((n - 1) + 1e6) ** 0.5
    assert abs(got - want) / want < 1e-6
    y = torch.empty(n, device=DEV, dtype=torch.bfloat16)
    y[-1] = 0
    kernels.multi_copy([x], [y])
    assert y[-1].item() == 1000.0 and y[0].item() == 1.0
    del x, y
    torch.cuda.empty_cache()


@pytest.mark.parametrize("sdt", F)
@pytest.mark.parametrize("ddt", F)
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_multi_copy_casts(sdt, ddt, offset):
    gen = _gen()
    srcs = [_rand(n, sdt, gen, offset, 10.0) for n in SIZES]
    dsts = [_poison(n, ddt, (offset * 2) % 5) for n in SIZES]
    kernels.multi_copy(srcs, dsts)
    for s, d in zip(srcs, dsts):
        assert _same_bits(d, s.to(ddt))


@pytest.mark.parametrize(
    "dtype", [torch.int16, torch.uint8, torch.int32, torch.float64, torch.bfloat16, torch.int64]
)
@pytest.mark.parametrize("offset", [0, 1])
def test_multi_copy_raw(dtype, offset):
    g = torch.Generator().manual_seed(next(_seed))
    srcs, dsts = [], []
    for n in SIZES + [100003]:
        src = torch.randint(1, 100, (n + offset,), generator=g).to(dtype).to(DEV)[offset:]
        srcs.append(src)
        dsts.append(torch.zeros(n, device=DEV, dtype=dtype))
    kernels.multi_copy(srcs, dsts)
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))


def test_multi_copy_noop_and_many():
    gen = _gen()
    srcs = [_rand(n, torch.float32, gen) for n in range(1, 260)]
    dsts = [_poison(n, torch.bfloat16) for n in range(1, 260)]
    kernels.multi_copy(srcs, dsts, noop_flag=torch.ones((), device=DEV))
    assert all(torch.isnan(d).all() for d in dsts)
    kernels.multi_copy(srcs, dsts, noop_flag=torch.zeros((), device=DEV))
    assert all(_same_bits(d, s.bfloat16()) for s, d in zip(srcs, dsts))
    kernels.multi_copy([], [])


ADD_PAIRS = [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
             (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
             (torch.float16, torch.float16)]


@pytest.mark.parametrize("sdt,ddt", ADD_PAIRS)
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_multi_add_equals_add_(sdt, ddt, offset):
    """One launch for many pairs, bit for bit ``dst.add_(src)`` (the gradient
    accumulation into the buckets), odd sizes, misaligned views, more pairs than one
    launch holds."""
    assert kc.multi_add_supported([torch.empty(1, dtype=sdt, device=DEV)],
                                  [torch.empty(1, dtype=ddt, device=DEV)])
    gen = _gen()
    sizes = SIZES + list(range(1, 300))
    srcs = [_rand(n, sdt, gen, offset, 10.0) for n in sizes]
    dsts = [_rand(n, ddt, gen, (offset * 2) % 5, 10.0) for n in sizes]
    want = [d.clone().add_(s) for s, d in zip(srcs, dsts)]
    kernels.multi_add(srcs, dsts)
    for w, d in zip(want, dsts):
        assert _same_bits(d, w)
    kernels.multi_add([], [])


def test_multi_add_refuses_what_it_cannot_make_exactly():
    a, b = torch.ones(8, device=DEV), torch.ones(8, device=DEV, dtype=torch.bfloat16)
    assert not kc.multi_add_supported([a], [b])  # fp32 into bf16 rounds first: not here
    kernels.multi_add([a], [b])  # the reference path instead
    assert torch.equal(b, torch.full_like(b, 2.0))
    with pytest.raises(RuntimeError, match="unsupported dtypes"):
        kc.multi_add([a], [b])


# ---- bit-exactness: the kernels compute the reference's bits -------------------------------


@pytest.mark.parametrize("pdt", F)
@pytest.mark.parametrize("gdt", F)
def test_adam_bit_exact(pdt, gdt):
    got, want = _run_adam_pair(
        SIZES,
        pdt,
        gdt,
        torch.float32,
        offset=0,
        **dict(BASE, grad_scale=torch.tensor(0.5, device=DEV)),
    )
    for gl, wl in zip(got, want):
        for a, b in zip(gl, wl):
            assert _same_bits(a, b), f"max diff {(a.float() - b.float()).abs().max().item()}"


def test_remainder_merge_split_bit_exact_vs_precision():
    gen = _gen()
    sizes = [5, 4099, 65536 + 7]
    # lr = 0 and no decay: the master is unchanged, so fp32 params_out is the kernel's merge
    p, r, g, m, v, _ = _rem_inputs(sizes, torch.bfloat16, None, gen)
    # include exact ties and other edge low halves
    r[1][:6] = torch.tensor([0, 1, 0x7FFF, -0x8000, -0x7FFF, -1], dtype=torch.int16)
    want = [merge_remainder(a, b) for a, b in zip(p, r)]
    out = [_poison(n, torch.float32) for n in sizes]
    p0, r0 = _clone(p), _clone(r)
    kernels.adam_remainders(p, r, g, m, v, out, **dict(BASE, lr=0.0, weight_decay=0.0))
    for i in range(len(sizes)):
        assert _same_bits(out[i], want[i]), "kernel merge differs from precision.merge"
        assert _same_bits(p[i], p0[i]) and _same_bits(r[i], r0[i])
    # a real step: the kernel's split of its own new master is precision.split's
    out = [_poison(n, torch.float32) for n in sizes]
    kernels.adam_remainders(p, r, g, m, v, out, **BASE)
    for i in range(len(sizes)):
        hi, lo = split_remainder(out[i])
        assert _same_bits(hi, p[i]) and _same_bits(lo, r[i]), "kernel split != precision.split"


@pytest.mark.parametrize("gdt", F)
def test_adam_remainders_bit_exact_vs_reference(gdt):
    gen = _gen()
    lists = _rem_inputs(SIZES, gdt, torch.bfloat16, gen, 1)
    ref = list(map(_clone, lists))
    kernels.adam_remainders(*lists, **BASE)
    reference.adam_remainders(*ref, **BASE)
    for a, b in zip([t for lst in lists for t in lst], [t for lst in ref for t in lst]):
        assert _same_bits(a, b)


def test_argument_errors_raise_with_their_numbers():
    """Bad arguments raise RuntimeError naming the numbers (no crash: see csrc/messages.h)."""
    x = torch.zeros(8, device=DEV)
    with pytest.raises(RuntimeError, match="list 'grads' has 2 tensors, expected 1"):
        kc.adam([x], [x, x], [x], [x], None, lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8,
                weight_decay=0.0, step=1)
    with pytest.raises(RuntimeError, match="step must be >= 1 with bias correction, got 0"):
        kc.adam([x], [x], [x], [x], None, lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8,
                weight_decay=0.0, step=0)
    with pytest.raises(RuntimeError, match="pair 0 has numel 8 vs 4"):
        kc.multi_copy([x], [x[:4]])


# ---- around the block step: the bits at the edges of a chunk's vector path ----------------

# Block steps are 4096 elements (512 threads x 8; a thread's 8 as two runs of 4 half a step
# apart, the next step's loads issued ahead), chunks 8192: sizes below, at and around one
# and two steps, several whole and partial chunks, each with and without a scalar tail.
STEP_SIZES = [1, 7, 4095, 4096, 4097, 8200, 12289, 16384, 24581, 70001, 2**20 + 13]


@pytest.mark.parametrize("pdt,gdt,odt", [(torch.float32, torch.bfloat16, torch.bfloat16),
                                         (torch.float32, torch.float32, None),
                                         (torch.bfloat16, torch.bfloat16, torch.float32),
                                         (torch.float16, torch.float32, torch.float16)])
def test_adam_bit_exact_around_block_steps(pdt, gdt, odt):
    """The Adam kernels give the reference's bits for sizes below, at and around one and
    two block steps and with a scalar tail (other launch constants: bench/sweep_launch.py
    checks each variant's bits against the default build)."""
    kw = dict(BASE, grad_scale=torch.tensor(0.5, device=DEV))
    got, want = _run_adam_pair(STEP_SIZES, pdt, gdt, odt, offset=0, **kw)
    for gl, wl in zip(got, want):
        for a, b in zip(gl or [], wl or []):
            assert not torch.isnan(a).any(), "unwritten (NaN-poisoned) output"
            assert _same_bits(a, b), f"max diff {(a.float() - b.float()).abs().max().item()}"
    for gdt_r, odt_r in [(torch.bfloat16, torch.bfloat16), (torch.float32, None)]:
        lists = _rem_inputs(STEP_SIZES, gdt_r, odt_r, _gen())
        ref = list(map(_clone, lists))
        kernels.adam_remainders(*lists, **kw)
        reference.adam_remainders(*ref, **kw)
        for a_list, b_list in zip(lists, ref):
            for a, b in zip(a_list or [], b_list or []):
                assert _same_bits(a, b)
