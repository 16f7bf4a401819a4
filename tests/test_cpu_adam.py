"""The CPU Adam of ``mpzero._cpu`` (``mpzero.kernels.cpu_adam``) against the reference, bit
for bit, in every mode it serves; thread counts, odd sizes, views at odd offsets into flat
buffers, found-inf skipping, dispatch and the thread setting."""

import math

import pytest
import torch

from mpzero import kernels
from mpzero.kernels import cpu_adam, reference
from mpzero.kernels.precision import merge_remainder, split_remainder

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not cpu_adam.available(), reason="mpzero._cpu is not built"),
]

HP = dict(beta1=0.9, beta2=0.999, eps=1e-8)
# Not multiples of any vector width, a block (512), a work item (2^15) or the per-thread
# share (2^16): tails everywhere, and enough elements for three threads to take part.
SIZES = [1, 7, 0, 513, 4099, 70001, 200003]
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _rand(n, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * scale


def _slots(buf, sizes, offset=3):
    """Views of ``sizes`` into the flat ``buf``, each starting ``offset`` elements after
    the previous one ends (so no view is aligned to a vector)."""
    out, pos = [], offset
    for n in sizes:
        out.append(buf[pos:pos + n])
        pos += n + offset
    return out


def _views(buf_numel, sizes, dtype, seed, scale=1.0, positive=False):
    x = _rand(buf_numel, seed, scale)
    return None, _slots((x.abs() if positive else x).to(dtype), sizes)


def _state(sizes, gdt, seed):
    total = sum(sizes) + 3 * (len(sizes) + 1)
    _, p = _views(total, sizes, torch.float32, seed)
    _, g = _views(total, sizes, gdt, seed + 1)
    _, m = _views(total, sizes, torch.float32, seed + 2, scale=0.1)
    _, v = _views(total, sizes, torch.float32, seed + 3, scale=0.01, positive=True)
    return p, g, m, v


def _clone(lst):
    return [t.clone() for t in lst]


def _bits_equal(a, b):
    """Bitwise equality (NaNs compare by their bits too)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    if a.dtype in (torch.bfloat16, torch.float16):
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    return torch.equal(a, b)


def _hyper(adam_w_mode, bias_correction, scale, step=3):
    return dict(lr=1e-2, weight_decay=0.1, step=step, adam_w_mode=adam_w_mode,
                bias_correction=bias_correction,
                grad_scale=None if scale is None else torch.tensor(scale), **HP)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("gdt", FLOATS)
@pytest.mark.parametrize("odt", [None, *FLOATS])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_plain_matches_reference(threads, gdt, odt, adam_w_mode):
    p, g, m, v = _state(SIZES, gdt, seed=10)
    out = None if odt is None else [torch.full((n,), float("nan"), dtype=odt) for n in SIZES]
    rp, rm, rv = _clone(p), _clone(m), _clone(v)
    rout = None if out is None else _clone(out)
    g_before = _clone(g)
    for step, scale in ((1, None), (2, 0.37)):  # two steps: the moments are nonzero
        hyper = _hyper(adam_w_mode, True, scale, step)
        cpu_adam.adam(p, g, m, v, out, threads=threads, **hyper)
        reference.adam(rp, g, rm, rv, rout, **hyper)
    for got, want in zip(p + m + v + g + (out or []), rp + rm + rv + g_before + (rout or [])):
        assert _bits_equal(got, want)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("gdt", FLOATS)
@pytest.mark.parametrize("odt", [None, *FLOATS])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_remainders_match_reference(threads, gdt, odt, adam_w_mode):
    p32, g, m, v = _state(SIZES, gdt, seed=20)
    total = sum(SIZES) + 3 * (len(SIZES) + 1)
    hi = _slots(torch.empty(total, dtype=torch.bfloat16), SIZES)
    rem = _slots(torch.empty(total + 1, dtype=torch.int16)[1:], SIZES)
    for h, r, t in zip(hi, rem, p32):
        h.copy_(split_remainder(t.contiguous())[0])
        r.copy_(split_remainder(t.contiguous())[1])
    out = None if odt is None else [torch.full((n,), float("nan"), dtype=odt) for n in SIZES]
    rh, rr, rm, rv = _clone(hi), _clone(rem), _clone(m), _clone(v)
    rout = None if out is None else _clone(out)
    for step, scale in ((1, 0.5), (2, None)):
        hyper = _hyper(adam_w_mode, True, scale, step)
        cpu_adam.adam_remainders(hi, rem, g, m, v, out, threads=threads, **hyper)
        reference.adam_remainders(rh, rr, g, rm, rv, rout, **hyper)
    for got, want in zip(hi + rem + m + v + (out or []), rh + rr + rm + rv + (rout or [])):
        assert _bits_equal(got, want)
    # The pair still is the exact fp32 master the plain step would have made.
    for h, r in zip(hi, rem):
        assert torch.isfinite(merge_remainder(h, r)).all()


@pytest.mark.parametrize("bias_correction", [True, False])
def test_no_bias_correction_and_tensor_scalars(bias_correction):
    """``lr``/``step`` as tensors give what Python numbers give (and the reference)."""
    sizes = [1000, 33]
    p, g, m, v = _state(sizes, torch.bfloat16, seed=30)
    p2, m2, v2 = _clone(p), _clone(m), _clone(v)
    rp, rm, rv = _clone(p), _clone(m), _clone(v)
    hyper = _hyper(True, bias_correction, 0.25, step=7)
    cpu_adam.adam(p, g, m, v, threads=2, **hyper)
    reference.adam(rp, g, rm, rv, **hyper)
    hyper.update(lr=torch.tensor(1e-2), step=torch.tensor(7))
    cpu_adam.adam(p2, g, m2, v2, threads=2, **hyper)
    for got, got2, want in zip(p + m + v, p2 + m2 + v2, rp + rm + rv):
        assert _bits_equal(got, want) and _bits_equal(got2, want)


@pytest.mark.parametrize("flag", [1.0, 2.0, float("inf"), float("nan")])
def test_found_inf_changes_nothing(flag):
    p, g, m, v = _state([70001], torch.float32, seed=40)
    out = [torch.zeros(70001, dtype=torch.bfloat16)]
    before = _clone(p + m + v + out)
    cpu_adam.adam(p, g, m, v, out, found_inf=torch.tensor(flag), threads=2,
                  **_hyper(True, True, None))
    assert all(_bits_equal(a, b) for a, b in zip(p + m + v + out, before))
    cpu_adam.adam(p, g, m, v, out, found_inf=torch.tensor(0.0), threads=2,
                  **_hyper(True, True, None))
    assert not torch.equal(p[0], before[0])


def test_nonfinite_values_as_the_reference():
    """Inf/NaN gradients and parameters propagate as in the reference (no skipping
    inside the kernel: that is found_inf's job)."""
    n = 600
    p, g, m, v = _state([n], torch.float32, seed=50)
    g[0][:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0])
    p[0][4:6] = torch.tensor([float("inf"), 1e38])
    g[0][5] = 1e38
    rp, rm, rv = _clone(p), _clone(m), _clone(v)
    out = [torch.zeros(n, dtype=torch.float16)]
    rout = _clone(out)
    cpu_adam.adam(p, g, m, v, out, threads=1, **_hyper(False, True, 4.0))
    reference.adam(rp, g, rm, rv, rout, **_hyper(False, True, 4.0))
    for got, want in zip(p + m + v + out, rp + rm + rv + rout):
        fin = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), fin)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert _bits_equal(got[fin], want[fin])


def test_fp16_conversions_edge_values():
    """fp16 grads in and fp16 params out across the range: subnormals, the
    subnormal/normal boundary, the overflow threshold (65520 rounds to inf)."""
    vals = torch.tensor([0.0, -0.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14 - 2.0**-25,
                         2.0**-14, 65504.0, 65519.0, 65520.0, -65520.0, 1e6, 1 / 3, -2.5e-6])
    n = vals.numel()
    # Zero gradients and moments: the output is the parameter itself, rounded to fp16.
    p = [vals.clone()]
    out = [torch.zeros(n, dtype=torch.float16)]
    zeros = [torch.zeros(n, dtype=torch.float16)]
    cpu_adam.adam(p, zeros, [torch.zeros(n)], [torch.zeros(n)], out, lr=1e-3,
                  weight_decay=0.0, step=1, **HP, threads=1)
    assert _bits_equal(out[0], vals.to(torch.float16))
    # fp16 gradients in: the first moment is 0 + (1 - beta1) * g, exactly as in fp32.
    g = [vals.to(torch.float16)]
    m = [torch.zeros(n)]
    cpu_adam.adam([torch.zeros(n)], g, m, [torch.zeros(n)], lr=1e-3, weight_decay=0.0,
                  step=1, **HP, threads=1)
    assert _bits_equal(m[0], torch.zeros(n) + g[0].float() * torch.tensor(1.0 - 0.9))


def test_empty_and_single_element():
    cpu_adam.adam([], [], [], [], threads=2, **_hyper(True, True, None))
    p, g, m, v = [torch.zeros(0)], [torch.zeros(0)], [torch.zeros(0)], [torch.zeros(0)]
    cpu_adam.adam(p, g, m, v, threads=2, **_hyper(True, True, None))
    p, g, m, v = _state([1], torch.float32, seed=60)
    rp, rm, rv = _clone(p), _clone(m), _clone(v)
    cpu_adam.adam(p, g, m, v, threads=3, **_hyper(True, True, None))
    reference.adam(rp, g, rm, rv, **_hyper(True, True, None))
    assert _bits_equal(p[0], rp[0]) and not math.isnan(float(p[0]))


def test_out_may_be_params():
    p, g, m, v = _state([5000], torch.float32, seed=70)
    rp, rm, rv = _clone(p), _clone(m), _clone(v)
    cpu_adam.adam(p, g, m, v, p, threads=2, **_hyper(True, True, None))
    reference.adam(rp, g, rm, rv, **_hyper(True, True, None))
    assert _bits_equal(p[0], rp[0])


def test_mismatched_sizes_raise():
    with pytest.raises(ValueError, match="mismatched element counts"):
        cpu_adam.adam([torch.zeros(4)], [torch.zeros(5)], [torch.zeros(4)], [torch.zeros(4)],
                      threads=1, **_hyper(True, True, None))
    with pytest.raises(ValueError, match="different lengths"):
        cpu_adam.adam([torch.zeros(4)], [], [torch.zeros(4)], [torch.zeros(4)],
                      threads=1, **_hyper(True, True, None))


def test_wrong_tensors_raise():
    """The kernel reads raw memory: the wrapper refuses what it cannot read as such."""
    z = torch.zeros(8)
    for bad in (torch.zeros(16)[::2], torch.zeros(8, dtype=torch.float64)):
        with pytest.raises(TypeError, match="contiguous CPU tensors"):
            cpu_adam.adam([bad], [z], [z.clone()], [z.clone()], threads=1,
                          **_hyper(True, True, None))
    with pytest.raises(TypeError, match="supported_remainders"):
        cpu_adam.adam_remainders([z], [torch.zeros(8, dtype=torch.int16)], [z], [z], [z],
                                 threads=1, **_hyper(True, True, None))


def test_dispatch():
    """``kernels.adam`` takes the extension for fp32 state on CPU, contiguous; the rest
    goes elsewhere (non-contiguous, 16-bit state)."""
    f = torch.zeros(8)
    b = torch.zeros(8, dtype=torch.bfloat16)
    r = torch.zeros(8, dtype=torch.int16)
    nc = torch.zeros(16)[::2]
    assert kernels.adam_implementation(False, ([f], [b], [f], [f], [b]), True) is cpu_adam.adam
    assert kernels.adam_implementation(False, ([f], [f], [f], [f], None), False) is cpu_adam.adam
    assert (kernels.adam_implementation(True, ([b], [r], [b], [f], [f], None), True)
            is cpu_adam.adam_remainders)
    assert kernels.adam_implementation(False, ([nc], [f], [f], [f], None), True) is not \
        cpu_adam.adam
    assert kernels.adam_implementation(False, ([b], [b], [b], [b], None), True) is \
        reference.adam


def test_kernels_adam_equals_reference():
    p, g, m, v = _state(SIZES, torch.bfloat16, seed=80)
    out = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES]
    rp, rm, rv, rout = _clone(p), _clone(m), _clone(v), _clone(out)
    kernels.adam(p, g, m, v, out, **_hyper(True, True, 0.5))
    reference.adam(rp, g, rm, rv, rout, **_hyper(True, True, 0.5))
    for got, want in zip(p + m + v + out, rp + rm + rv + rout):
        assert _bits_equal(got, want)


def test_threads_setting(monkeypatch):
    monkeypatch.setattr(cpu_adam, "_threads", None)
    assert cpu_adam.get_threads() == cpu_adam.default_threads() >= 1
    cpu_adam.set_threads(3)
    assert cpu_adam.get_threads() == 3
    cpu_adam.set_threads(None)
    assert cpu_adam.get_threads() == cpu_adam.default_threads()
    with pytest.raises(ValueError):
        cpu_adam.set_threads(0)


def test_default_threads_share_the_host(monkeypatch):
    cpu_adam.default_threads.cache_clear()
    try:
        one = cpu_adam.default_threads()
        cpu_adam.default_threads.cache_clear()
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(one * 4))
        assert cpu_adam.default_threads() == 1
    finally:
        cpu_adam.default_threads.cache_clear()


def test_kernels_adam_threads_reach_every_cpu_implementation(monkeypatch):
    """``kernels.adam(..., threads=n)``: the C++ kernel gets ``threads=n``; any other CPU
    implementation runs with torch on ``n`` threads, restored after."""
    seen = []

    def impl(*lists, **kw):
        seen.append((kw.get("threads"), torch.get_num_threads()))

    monkeypatch.setattr(kernels, "adam_implementation", lambda *a: impl)
    p, g, m, v = _state([8], torch.float32, seed=95)
    before = torch.get_num_threads()
    kernels.adam(p, g, m, v, threads=before + 2, **_hyper(True, True, None))
    monkeypatch.setattr(kernels, "_THREADED", (impl,))
    kernels.adam(p, g, m, v, threads=before + 2, **_hyper(True, True, None))
    assert seen == [(None, before + 2), (before + 2, before)]
    assert torch.get_num_threads() == before


def test_default_threads_are_the_rank_share_of_physical_cores(monkeypatch):
    """16 CPUs, two per core: four unbound ranks get 2 cores each; a rank a launcher bound
    to 4 CPUs has its share already (2 cores); without SMT those 4 CPUs are 4 cores."""
    monkeypatch.setattr(cpu_adam.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(cpu_adam, "_physical_cores", lambda cpus: len(cpus) // 2)
    cases = [(range(16), "4", 2), (range(4), "4", 2)]
    try:
        for mask, local, want in cases:
            monkeypatch.setattr(cpu_adam.os, "sched_getaffinity", lambda _, m=mask: set(m),
                                raising=False)
            monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
            cpu_adam.default_threads.cache_clear()
            assert cpu_adam.default_threads() == want, (mask, local)
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        monkeypatch.setattr(cpu_adam, "_physical_cores", lambda cpus: len(cpus))
        cpu_adam.default_threads.cache_clear()
        assert cpu_adam.default_threads() == 4
    finally:
        cpu_adam.default_threads.cache_clear()


def test_many_threads_more_than_work():
    """More threads than items or cores: the result does not depend on the count."""
    p, g, m, v = _state([300001], torch.float32, seed=90)
    p2, m2, v2 = _clone(p), _clone(m), _clone(v)
    cpu_adam.adam(p, g, m, v, threads=1, **_hyper(True, True, None))
    cpu_adam.adam(p2, g, m2, v2, threads=16, **_hyper(True, True, None))
    assert all(_bits_equal(a, b) for a, b in zip(p + m + v, p2 + m2 + v2))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("gdt", FLOATS)
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_remainders_with_scaled_moments_match_the_torch_path(threads, gdt, adam_w_mode):
    """``adam_remainders_scaled`` (two passes over bf16 moments) gives the bits of the path
    it replaces: ``ScaledStates.unscaled``, ``adam_remainders``, ``ScaledStates.store``;
    pieces of several sizes with gaps between them, two steps (the second reads moments
    stored over the first's scales), moments spanning many orders of magnitude."""
    from mpzero.optimizers.scaled_state import MOMENTS, ScaledStates
    from mpzero.optimizers.step import by_group

    ranges = [(3, 516), (516, 4615), (4620, 74621), (74700, 274703)]
    size = 274710
    inside = torch.zeros(size, dtype=torch.bool)  # the gaps hold zeros, as in a shard
    for lo, hi in ranges:
        inside[lo:hi] = True
    master = _rand(size, 1) * 0.05 * inside
    grads = [(_rand(size, 10 + s) * torch.logspace(-6, 1, size) * inside).to(gdt)
             for s in range(2)]
    kw = dict(lr=1e-3, weight_decay=0.1, adam_w_mode=adam_w_mode, **HP)
    out = {}
    for fused in (False, True):
        hi, rem = split_remainder(master.clone())
        states = ScaledStates(ranges, size, torch.bfloat16, torch.device("cpu"), keys=MOMENTS)
        for step in (1, 2):
            g = grads[step - 1]
            if fused:
                ranges_, pieces = states.pieces([(0, size, 0)])
                (lists,) = by_group(ranges_, hi, rem, g, states.data["exp_avg"],
                                    states.data["exp_avg_sq"], pieces).values()
                cpu_adam.adam_remainders_scaled(
                    *lists, states.scales["exp_avg"], states.scales["exp_avg_sq"],
                    states.half_max, step=step, threads=threads, **kw)
            else:
                m, v = states.unscaled("exp_avg"), states.unscaled("exp_avg_sq")
                cpu_adam.adam_remainders([hi], [rem], [g], [m], [v], step=step,
                                         threads=threads, **kw)
                states.store("exp_avg", m)
                states.store("exp_avg_sq", v)
        out[fused] = (hi, rem, states.data["exp_avg"], states.data["exp_avg_sq"],
                      states.scales["exp_avg"], states.scales["exp_avg_sq"])
    for a, b in zip(out[False], out[True]):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
    assert not torch.equal(out[True][0], split_remainder(master.clone())[0])  # it moved
