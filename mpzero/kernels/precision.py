"""Bit-level precision helpers: bf16 + int16 remainders and byte-level casts.

Pure functions on tensors; they run unchanged on CPU and CUDA and never sync
with the host.

Remainder rule (``store_param_remainders``)
-------------------------------------------
An fp32 value ``x`` has raw bits ``hi16:lo16``. It is stored as a bf16 model
parameter plus an int16 remainder:

``split``::

    bf16_bits = hi16 + (lo16 >> 15)      # +1 when lo16 >= 0x8000
    rem       = lo16 reinterpreted as int16

``merge``::

    hi16 = bf16_bits - (1 if rem < 0 else 0)
    bits = hi16 << 16 | (rem as uint16)

Adding one to ``hi16`` adds one unit in the last place to the *magnitude*
(fp32 is sign-magnitude), so the bf16 is ``x`` rounded to the nearest bf16
with ties rounded away from zero. The sign of the remainder records exactly
whether the magnitude was rounded up (``rem < 0`` iff ``lo16 >= 0x8000``), so
``merge(split(x))`` returns the original bits for every fp32 bit pattern whose
high half is not ``0xFFFF`` (all finite values, the infinities and almost all
NaNs). Round-to-nearest-*even* would not work with a 16-bit remainder: on an
exact tie (``lo16 == 0x8000``) whether ``hi16`` was rounded up depends on the
parity of ``hi16``, which the remainder cannot tell apart from the
``lo16 > 0x8000`` case without one more bit, so merge would be lossy there.
When the rounding of the largest finite values overflows, the bf16 is inf but
the pair still merges back exactly.

The CUDA remainder kernel (``csrc/adam.cu``) implements the same rule; the
GPU tests check it bit for bit against these functions.

Byte-level casts (integer ``param_sync_dtype``)
-----------------------------------------------
:func:`copy_high_bytes` keeps the most significant bytes of each element's raw
bits (little-endian: the last bytes), e.g. uint8 of fp16 = its top byte, int16
of fp32 = the bf16 truncation bits, int32 of fp32 = the raw bits, int64 of fp32 =
the raw bits in the top four bytes
(a wider integer type is lossless: the extra low bytes are zero).
:func:`expand_high_bytes` is its inverse: the bytes become the most
significant bytes of the destination elements and the lower bytes are zeroed.
"""

from __future__ import annotations

import torch

__all__ = ["split_remainder", "merge_remainder", "copy_high_bytes", "expand_high_bytes"]

_TWO16 = 65536


def _to_int16_bits(v: torch.Tensor) -> torch.Tensor:
    """int32 values in [0, 0xFFFF] -> int16 with the same 16 bits (no wrapping cast)."""
    return (v - ((v >> 15) & 1) * _TWO16).to(torch.int16)


def split_remainder(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split fp32 ``x`` into (bf16 nearest to x with ties away from zero, int16 remainder).

    See the module docstring for the rule; ``merge_remainder`` inverts it exactly.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"split_remainder expects float32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32).to(torch.int32)
    hi = (bits >> 16) & 0xFFFF
    lo = bits & 0xFFFF
    rounded = (hi + (lo >> 15)) & 0xFFFF
    hi16 = _to_int16_bits(rounded).view(torch.bfloat16)
    rem = _to_int16_bits(lo)
    return hi16, rem


def merge_remainder(hi: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """Recombine a bf16 tensor and its int16 remainder into the exact fp32 master."""
    if hi.dtype != torch.bfloat16 or rem.dtype != torch.int16:
        raise TypeError(f"merge_remainder expects (bfloat16, int16), got ({hi.dtype}, {rem.dtype})")
    if hi.shape != rem.shape:
        raise ValueError(f"shape mismatch: {tuple(hi.shape)} vs {tuple(rem.shape)}")
    b = hi.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    r = rem.contiguous().to(torch.int32)
    h = (b - (r < 0).to(torch.int32)) & 0xFFFF
    h_signed = h - ((h >> 15) & 1) * _TWO16  # in [-2^15, 2^15): no int32 overflow below
    bits = h_signed * _TWO16 + (r & 0xFFFF)
    return bits.view(torch.float32)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("byte-level casts need contiguous tensors")
    return t.reshape(-1).view(torch.uint8).view(-1, t.element_size())


def _align_high_bytes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """The most significant bytes of src's elements become dst's most significant bytes;
    dst's remaining lower bytes (when dst is wider) are zeroed."""
    if src.numel() != dst.numel():
        raise ValueError(f"byte cast: numel {src.numel()} != {dst.numel()}")
    if src.numel() == 0:
        return
    n, k = src.element_size(), dst.element_size()
    m = min(n, k)
    out = _flat_bytes(dst)
    if k > m:
        out[:, : k - m].zero_()
    out[:, k - m :].copy_(_flat_bytes(src)[:, n - m :])


def copy_high_bytes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst`` (integer dtype) gets the top bytes of each ``src`` element.

    Narrower ``dst``: its bytes are src's most significant ones (e.g. uint8 of fp16 =
    the top byte). Wider ``dst`` (e.g. int64 for fp32): src's bytes sit in dst's most
    significant bytes and the rest is zero, so nothing is lost."""
    if dst.dtype.is_floating_point or dst.dtype.is_complex:
        raise TypeError(f"copy_high_bytes: dst must be an integer dtype, got {dst.dtype}")
    _align_high_bytes(src, dst)


def expand_high_bytes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Inverse of :func:`copy_high_bytes`: src's most significant bytes become dst's
    most significant bytes; dst's lower bytes (if any are left) are zeroed."""
    if src.dtype.is_floating_point or src.dtype.is_complex:
        raise TypeError(f"expand_high_bytes: src must be an integer dtype, got {src.dtype}")
    _align_high_bytes(src, dst)
