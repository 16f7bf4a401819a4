"""The reference kernels (the spec) against torch.optim and fp64 math, on CPU."""

import math

import pytest
import torch

from mpzero import kernels
from mpzero.kernels import cpu, reference
from mpzero.kernels.precision import merge_remainder, split_remainder

torch.set_num_threads(1)

SIZES = [1, 7, 64, 1000, 4099]
HP = dict(beta1=0.9, beta2=0.999, eps=1e-8)


def _make(sizes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype) for n in sizes]


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_matches_torch_optim(adam_w_mode, weight_decay):
    lr = 1e-2
    params = _make(SIZES, seed=1)
    ref_params = [torch.nn.Parameter(p.clone()) for p in params]
    opt_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    opt = opt_cls(
        ref_params,
        lr=lr,
        betas=(HP["beta1"], HP["beta2"]),
        eps=HP["eps"],
        weight_decay=weight_decay,
        foreach=False,
    )
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step in range(1, 6):
        grads = _make(SIZES, seed=100 + step)
        for rp, g in zip(ref_params, grads):
            rp.grad = g.clone()
        opt.step()
        kernels.adam(
            params,
            grads,
            m,
            v,
            lr=lr,
            weight_decay=weight_decay,
            step=step,
            adam_w_mode=adam_w_mode,
            **HP,
        )
        for p, rp in zip(params, ref_params):
            torch.testing.assert_close(p, rp.detach(), rtol=1.3e-6, atol=1e-5)
        for mm, vv, rp in zip(m, v, ref_params):
            st = opt.state[rp]
            torch.testing.assert_close(mm, st["exp_avg"], rtol=1.3e-6, atol=1e-6)
            torch.testing.assert_close(vv, st["exp_avg_sq"], rtol=1.3e-6, atol=1e-8)


def _adam_fp64(
    p,
    g,
    m,
    v,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    adam_w_mode=True,
    bias_correction=True,
    grad_scale=1.0,
):
    p, g, m, v = p.double(), g.double() * grad_scale, m.double(), v.double()
    if not adam_w_mode:
        g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    u = (m / bc1) / ((v / bc2).sqrt() + eps)
    if adam_w_mode:
        u = u + weight_decay * p
    return p - lr * u, m, v


TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("pdt", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gdt", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("odt", [None, torch.float32, torch.float16, torch.bfloat16])
def test_adam_dtypes_vs_fp64(pdt, gdt, odt):
    sizes = [5, 130]
    p = _make(sizes, pdt, seed=2)
    g = _make(sizes, gdt, seed=3)
    m = [(x * 0.1).to(pdt) for x in _make(sizes, seed=4)]
    v = [(x * x * 0.01).to(pdt) for x in _make(sizes, seed=5)]
    out = None if odt is None else [torch.full((n,), float("nan"), dtype=odt) for n in sizes]
    kw = dict(lr=1e-2, weight_decay=0.01, step=3, bias_correction=True, **HP)
    want = [_adam_fp64(*t, **kw) for t in zip(p, g, m, v)]
    kernels.adam(p, g, m, v, out, **kw)
    for i, (wp, wm, wv) in enumerate(want):
        tol = TOL[pdt]
        torch.testing.assert_close(p[i].double(), wp, rtol=tol, atol=tol)
        torch.testing.assert_close(m[i].double(), wm, rtol=tol, atol=tol)
        torch.testing.assert_close(v[i].double(), wv, rtol=tol, atol=tol * 1e-2)
        if out is not None:
            t = max(tol, TOL[odt])
            torch.testing.assert_close(out[i].double(), wp, rtol=t, atol=t)


def test_adam_no_bias_correction_and_grad_scale():
    sizes = [33, 100]
    p, g = _make(sizes, seed=6), _make(sizes, seed=7)
    m, v = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    scale = torch.tensor(0.25)
    kw = dict(lr=3e-3, weight_decay=0.0, step=1, bias_correction=False, **HP)
    want = [_adam_fp64(a, b, c, d, grad_scale=0.25, **kw) for a, b, c, d in zip(p, g, m, v)]
    kernels.adam(p, g, m, v, grad_scale=scale, **kw)
    for i, (wp, wm, _) in enumerate(want):
        torch.testing.assert_close(p[i].double(), wp, rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(m[i].double(), wm, rtol=2e-6, atol=1e-9)


def test_adam_tensor_scalars_equal_python_scalars():
    sizes = [17, 300]
    base = [_make(sizes, seed=s) for s in (8, 9, 10)]
    kw = dict(weight_decay=0.05, **HP)
    a = [[t.clone() for t in lst] for lst in base]
    b = [[t.clone() for t in lst] for lst in base]
    for lst in (a, b):
        lst[2] = [t.abs() for t in lst[2]]  # exp_avg_sq >= 0
    g = _make(sizes, seed=11)
    kernels.adam(a[0], g, a[1], a[2], lr=1e-3, step=7, **kw)
    kernels.adam(b[0], g, b[1], b[2], lr=torch.tensor(1e-3), step=torch.tensor(7), **kw)
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            assert torch.equal(s, t)


def test_adam_found_inf_changes_nothing():
    sizes = [9, 65]
    p, g, m = _make(sizes, seed=12), _make(sizes, seed=13), _make(sizes, seed=14)
    v = [t.abs() for t in _make(sizes, seed=15)]
    out = [torch.randn(n).bfloat16() for n in sizes]
    before = [t.clone() for t in p + m + v + out]
    kernels.adam(
        p,
        g,
        m,
        v,
        out,
        lr=torch.tensor(1e-2),
        step=torch.tensor(2),
        weight_decay=0.1,
        found_inf=torch.tensor(1.0),
        **HP,
    )
    for x, y in zip(before, p + m + v + out):
        assert torch.equal(x, y)
    kernels.adam(
        p,
        g,
        m,
        v,
        out,
        lr=torch.tensor(1e-2),
        step=torch.tensor(2),
        weight_decay=0.1,
        found_inf=torch.tensor(0.0),
        **HP,
    )
    assert not torch.equal(before[0], p[0])
    assert torch.equal(out[0], p[0].bfloat16())


def test_adam_empty_list_and_empty_tensor():
    kernels.adam([], [], [], [], lr=1e-3, step=1, weight_decay=0.0, **HP)
    p = [torch.empty(0), torch.ones(3)]
    kernels.adam(
        p,
        [torch.empty(0), torch.ones(3)],
        [torch.zeros(0), torch.zeros(3)],
        [torch.zeros(0), torch.zeros(3)],
        lr=1e-3,
        step=1,
        weight_decay=0.0,
        **HP,
    )
    assert p[1].lt(1).all()


def test_adam_remainders_equals_fp32_adam_on_merged_master():
    sizes = [3, 257, 1024]
    master = [t * 3 for t in _make(sizes, seed=16)]
    hi, rem = map(list, zip(*[split_remainder(x) for x in master]))
    g = _make(sizes, torch.bfloat16, seed=17)
    m1, v1 = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    m2, v2 = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    out = [torch.full((n,), float("nan"), dtype=torch.bfloat16) for n in sizes]
    out32 = [torch.full((n,), float("nan")) for n in sizes]
    kw = dict(lr=1e-2, weight_decay=0.1, **HP)
    for step in (1, 2, 3):
        kernels.adam(master, g, m1, v1, out32, step=step, **kw)
        kernels.adam_remainders(hi, rem, g, m2, v2, out, step=step, **kw)
        for i in range(len(sizes)):
            merged = merge_remainder(hi[i], rem[i])
            assert torch.equal(merged.view(torch.int32), master[i].view(torch.int32))
            assert torch.equal(out[i], hi[i])
            assert torch.equal(m1[i], m2[i]) and torch.equal(v1[i], v2[i])
            assert torch.equal(out32[i], master[i])
    # fp32 params_out gets the master itself, found_inf keeps everything
    o = [torch.zeros(n) for n in sizes]
    before = [t.clone() for t in hi + rem]
    kernels.adam_remainders(hi, rem, g, m2, v2, o, step=4, found_inf=torch.tensor(1.0), **kw)
    assert all(torch.equal(a, b) for a, b in zip(before, hi + rem))
    assert all(torch.equal(t, torch.zeros_like(t)) for t in o)
    kernels.adam_remainders(hi, rem, g, m2, v2, o, step=4, **kw)
    for i in range(len(sizes)):
        assert torch.equal(o[i], merge_remainder(hi[i], rem[i]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_l2norm_vs_fp64(dtype):
    ts = _make([1, 100, 12345], dtype, seed=18)
    want = torch.linalg.vector_norm(torch.cat([t.double() for t in ts]))
    got = kernels.l2norm(ts)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert math.isclose(got.item(), want.item(), rel_tol=1e-5)


def test_l2norm_noop_flag_and_empty():
    flag = torch.zeros(())
    ts = _make([10, 20], seed=19)
    kernels.l2norm(ts, noop_flag=flag)
    assert flag.item() == 0
    for bad in (float("inf"), float("nan")):
        flag = torch.zeros(())
        t2 = [t.clone() for t in ts]
        t2[1][5] = bad
        n = kernels.l2norm(t2, noop_flag=flag)
        assert not torch.isfinite(n) and flag.item() == 1
    flag = torch.zeros(())
    kernels.l2norm([torch.full((4,), 1e30)], noop_flag=flag)  # overflow of the sum
    assert flag.item() == 1
    z = kernels.l2norm([])
    assert z.item() == 0 and z.device.type == "cpu"
    assert kernels.l2norm([], device="meta").device.type == "meta"


@pytest.mark.parametrize("sdt", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ddt", [torch.float32, torch.float16, torch.bfloat16])
def test_multi_copy_casts(sdt, ddt):
    srcs = _make([3, 77], sdt, seed=20)
    dsts = [torch.full((n,), float("nan"), dtype=ddt) for n in (3, 77)]
    kernels.multi_copy(srcs, dsts)
    for s, d in zip(srcs, dsts):
        assert torch.equal(d, s.to(ddt))


def test_multi_copy_raw_and_noop():
    srcs = [torch.randint(-100, 100, (50,), dtype=torch.int16), torch.arange(9, dtype=torch.uint8)]
    dsts = [torch.zeros(50, dtype=torch.int16), torch.zeros(9, dtype=torch.uint8)]
    kernels.multi_copy(srcs, dsts, noop_flag=torch.ones(()))
    assert all(int(d.abs().sum()) == 0 for d in dsts)
    kernels.multi_copy(srcs, dsts, noop_flag=torch.zeros(()))
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))
    kernels.multi_copy([], [])


def test_reference_is_what_dispatch_uses_on_cpu():
    assert reference.adam is not None
    sizes = [10]
    p1, p2 = _make(sizes, seed=21), _make(sizes, seed=21)
    g = _make(sizes, seed=22)
    z = [[torch.zeros(10)] for _ in range(4)]
    kernels.adam(p1, g, z[0], z[1], lr=1e-3, step=1, weight_decay=0.0, **HP)
    reference.adam(p2, g, z[2], z[3], lr=1e-3, step=1, weight_decay=0.0, **HP)
    assert torch.equal(p1[0], p2[0])


@pytest.mark.parametrize("chunk", [64, 200, 1 << 22])
@pytest.mark.parametrize("scale", [None, 1.0, 0.37])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_cpu_path_chunks_equal_one_torch_call(monkeypatch, chunk, scale, adam_w_mode):
    """The torch-fused CPU path (``mpzero.kernels.cpu``, used where ``mpzero._cpu`` is
    not built; chunked with a grad scale) gives bitwise what one call of torch's
    fused kernel over whole tensors gives, leaves the gradients unchanged and fills
    params_out; chunks split tensors and pack several into one call."""
    monkeypatch.setattr(cpu, "CHUNK_ELEMENTS", chunk)
    sizes = [1, 7, 64, 1000, 4099, 0, 130]
    p, g = _make(sizes, seed=30), _make(sizes, seed=31)
    m = [t * 0.1 for t in _make(sizes, seed=32)]
    v = [t * t * 0.01 for t in _make(sizes, seed=33)]
    want_p, want_m, want_v = ([t.clone() for t in lst] for lst in (p, m, v))
    g_before = [t.clone() for t in g]
    out = [torch.full((n,), float("nan"), dtype=torch.bfloat16) for n in sizes]
    grad_scale = None if scale is None else torch.tensor(scale)
    cpu.adam(p, g, m, v, out, lr=1e-2, weight_decay=0.1, step=3, adam_w_mode=adam_w_mode,
             grad_scale=grad_scale, found_inf=torch.tensor(0.0), **HP)
    inv = None if scale in (None, 1.0) else grad_scale.reciprocal()
    fn = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    fn(want_p, [t.clone() for t in g], want_m, want_v, [], [torch.tensor(3.0)] * len(sizes),
       lr=float(torch.tensor(1e-2)), weight_decay=0.1, amsgrad=False, maximize=False,
       grad_scale=inv, **HP)
    for got, want in zip(p + m + v + g + out, want_p + want_m + want_v + g_before +
                         [t.bfloat16() for t in want_p]):
        assert torch.equal(got, want)


def test_cpu_path_found_inf_not_one_and_scratch_reused():
    """Any nonzero found_inf skips (torch's kernel only skips on exactly 1.0); the
    grad-scale scratch buffer is kept between calls (no fresh allocation per step)."""
    p = _make([100], seed=34)
    before = p[0].clone()
    cpu.adam(p, _make([100], seed=35), [torch.zeros(100)], [torch.zeros(100)], None, lr=1e-2,
             step=1, weight_decay=0.0, adam_w_mode=True, grad_scale=None,
             found_inf=torch.tensor(2.0), **HP)
    assert torch.equal(p[0], before)
    assert cpu._scratch(1000).data_ptr() == cpu._scratch(10).data_ptr()


def test_cpu_dispatch_without_the_extension(monkeypatch):
    """Where ``mpzero._cpu`` is not built, fp32 CPU lists go to torch's fused kernel and
    remainders to the reference, as before the extension existed; info says so."""
    from mpzero import info
    from mpzero.kernels import cpu_adam

    monkeypatch.setattr(cpu_adam, "_cpu", None)
    f, b = torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16)
    r = torch.zeros(8, dtype=torch.int16)
    assert not cpu_adam.available()
    assert kernels.adam_implementation(False, ([f], [f], [f], [f], None), True) is \
        kernels._cpu_adam
    assert kernels.adam_implementation(True, ([b], [r], [b], [f], [f], None), True) is \
        reference.adam_remainders
    p = _make([100], seed=36)
    want = [p[0].clone()]
    g = _make([100], seed=37)
    kernels.adam(p, g, [torch.zeros(100)], [torch.zeros(100)], lr=1e-2, step=1,
                 weight_decay=0.0, **HP)
    reference.adam(want, g, [torch.zeros(100)], [torch.zeros(100)], lr=1e-2, step=1,
                   weight_decay=0.0, **HP)
    torch.testing.assert_close(p[0], want[0], rtol=1e-6, atol=1e-7)
    assert "torch fused Adam" in info.report()
