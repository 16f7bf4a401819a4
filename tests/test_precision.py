"""Bit-level tests of mpzero.kernels.precision (remainders, byte-level casts)."""

import pytest
import torch

from mpzero.kernels.precision import (
    copy_high_bytes,
    expand_high_bytes,
    merge_remainder,
    split_remainder,
)

torch.set_num_threads(1)

EDGE_LO = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF]


def _bits_grid(num_random_lo: int = 4, seed: int = 0) -> torch.Tensor:
    """int64 fp32 bit patterns: every high half x (edge + random low halves)."""
    gen = torch.Generator().manual_seed(seed)
    hi = torch.arange(1 << 16, dtype=torch.int64)
    rnd = torch.randint(0, 1 << 16, (num_random_lo,), generator=gen).tolist()
    lo = torch.tensor(EDGE_LO + rnd, dtype=torch.int64)
    return (hi[:, None] << 16 | lo[None, :]).reshape(-1)


def _as_f32(bits64: torch.Tensor) -> torch.Tensor:
    signed = torch.where(bits64 >= 1 << 31, bits64 - (1 << 32), bits64)
    return signed.to(torch.int32).view(torch.float32)


def _u32(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _u16(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16).to(torch.int64) & 0xFFFF


def test_exhaustive_high_halves_round_trip_exact():
    bits = _bits_grid()
    hi = bits >> 16
    # every pattern with a high half other than 0xFFFF (all finite, +-inf, most NaNs)
    keep = hi != 0xFFFF
    bits = bits[keep]
    x = _as_f32(bits)
    b, r = split_remainder(x)
    assert b.dtype == torch.bfloat16 and r.dtype == torch.int16
    back = merge_remainder(b, r)
    assert torch.equal(_u32(back), bits)


def test_exhaustive_nearest_bf16_ties_away_from_zero():
    bits = _bits_grid(num_random_lo=6, seed=1)
    x = _as_f32(bits)
    finite = torch.isfinite(x)
    bits, x = bits[finite], x[finite]
    b, _ = split_remainder(x)
    lo = bits & 0xFFFF
    tie = lo == 0x8000
    # Off ties, nearest is unambiguous: equal to torch's round-to-nearest-even.
    rne = x.to(torch.bfloat16)
    assert torch.equal(_u16(b)[~tie], _u16(rne)[~tie])
    # On ties, the magnitude is rounded up (away from zero).
    trunc = (bits >> 16)[tie]
    assert torch.equal(_u16(b)[tie], trunc + 1)
    # Distance check in fp64 where the rounding does not overflow.
    bx = b.double()
    ok = torch.isfinite(bx)
    xd = x.double()[ok]
    err = (bx[ok] - xd).abs()
    t_lo = _as_f32((bits[ok] >> 16) << 16).double()  # truncation toward zero
    assert torch.all(err <= (t_lo - xd).abs())
    ulp = torch.clamp(t_lo.abs() * 2.0**-7, min=2.0**-133)  # one bf16 step (subnormals too)
    assert torch.all(err <= ulp / 2)  # at most half a step away


def test_remainder_sign_marks_rounding_up():
    bits = _bits_grid(num_random_lo=2, seed=2)
    bits = bits[(bits >> 16) != 0xFFFF]
    x = _as_f32(bits)
    b, r = split_remainder(x)
    up = (bits & 0xFFFF) >= 0x8000
    assert torch.equal(r < 0, up)
    assert torch.equal(_u16(r), bits & 0xFFFF)
    assert torch.equal((_u16(b) - up.long()) & 0xFFFF, bits >> 16)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_property_round_trip(seed):
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-(1 << 31), (1 << 31) - 1, (200_000,), generator=gen, dtype=torch.int64)
    x = raw.to(torch.int32).view(torch.float32)
    x = x[torch.isfinite(x)]
    normal = torch.randn(100_000, generator=gen) * torch.logspace(-30, 30, 100_000).float()
    for v in (x, normal, -normal, torch.zeros(4), -torch.zeros(4)):
        b, r = split_remainder(v)
        assert torch.equal(_u32(merge_remainder(b, r)), _u32(v))
        fin = torch.isfinite(b)  # rounding of the largest values may overflow to inf
        assert torch.all((b.float() - v).abs()[fin] <= (v.abs() * 2.0**-8)[fin] + 2.0**-134)


def test_shapes_and_errors():
    x = torch.randn(3, 5, 7)
    b, r = split_remainder(x)
    assert b.shape == r.shape == x.shape
    assert merge_remainder(b, r).shape == x.shape
    with pytest.raises(TypeError):
        split_remainder(x.double())
    with pytest.raises(TypeError):
        merge_remainder(x.bfloat16(), r.to(torch.int32))
    with pytest.raises(ValueError):
        merge_remainder(b.reshape(-1), r)


def test_copy_high_bytes_fp16_uint8_top_byte():
    x = torch.randn(1001).half()
    d = torch.empty(1001, dtype=torch.uint8)
    copy_high_bytes(x, d)
    assert torch.equal(d.long(), (_u16(x) >> 8) & 0xFF)


def test_copy_high_bytes_fp32_int16_is_bf16_truncation():
    x = torch.randn(4097) * 1e3
    d = torch.empty(4097, dtype=torch.int16)
    copy_high_bytes(x, d)
    assert torch.equal(_u16(d), _u32(x) >> 16)
    # and it is the bf16 obtained by truncation (round toward zero)
    trunc = d.view(torch.bfloat16).float()
    assert torch.all(trunc.abs() <= x.abs())


def test_copy_high_bytes_raw_same_size():
    x = torch.randn(777)
    d = torch.empty(777, dtype=torch.int32)
    copy_high_bytes(x, d)
    assert torch.equal(d, x.view(torch.int32))
    xd = torch.randn(33, dtype=torch.float64)
    d64 = torch.empty(33, dtype=torch.int64)
    copy_high_bytes(xd, d64)
    assert torch.equal(d64, xd.view(torch.int64))


@pytest.mark.parametrize(
    "fdtype,idtype",
    [
        (torch.float16, torch.uint8),
        (torch.bfloat16, torch.uint8),
        (torch.float32, torch.uint8),
        (torch.float32, torch.int16),
        (torch.float32, torch.int32),
        (torch.float64, torch.int32),
        (torch.float16, torch.int16),
    ],
)
def test_byte_round_trips(fdtype, idtype):
    x = (torch.randn(2, 513) * 10).to(fdtype)
    i = torch.empty(2, 513, dtype=idtype)
    copy_high_bytes(x, i)
    y = torch.full_like(x, float("nan"))
    expand_high_bytes(i, y)
    k, n = i.element_size(), x.element_size()
    # y = x with the (n - k) low bytes zeroed
    xb = x.reshape(-1).view(torch.uint8).view(-1, n).clone()
    xb[:, : n - k] = 0
    assert torch.equal(y.reshape(-1).view(torch.uint8).view(-1, n), xb)
    i2 = torch.empty_like(i)
    copy_high_bytes(y, i2)
    assert torch.equal(i2, i)


@pytest.mark.parametrize("fdtype,idtype", [(torch.float16, torch.int32),
                                           (torch.float32, torch.int64),
                                           (torch.bfloat16, torch.int32)])
def test_wider_byte_casts_are_lossless(fdtype, idtype):
    # A wider integer holds the value's bytes in its most significant bytes, the rest zero.
    x = (torch.randn(1031) * 1e3).to(fdtype)
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")]).to(fdtype)
    i = torch.full((1031,), -1, dtype=idtype)
    copy_high_bytes(x, i)
    n, k = x.element_size(), i.element_size()
    ib = i.view(torch.uint8).view(-1, k)
    assert torch.equal(ib[:, k - n:], x.view(torch.uint8).view(-1, n))
    assert not ib[:, : k - n].any()
    y = torch.empty_like(x)
    expand_high_bytes(i, y)
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))


def test_byte_cast_errors():
    with pytest.raises(TypeError):
        copy_high_bytes(torch.randn(4), torch.empty(4, dtype=torch.float16))
    with pytest.raises(ValueError):
        copy_high_bytes(torch.randn(4), torch.empty(5, dtype=torch.int16))
    with pytest.raises(TypeError):
        expand_high_bytes(torch.empty(4).half(), torch.empty(4))
    copy_high_bytes(torch.empty(0), torch.empty(0, dtype=torch.int16))
