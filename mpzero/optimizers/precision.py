"""Compatibility alias: the bit tricks live in :mod:`mpzero.kernels.precision`
(below both the kernels and the optimizer)."""

from mpzero.kernels.precision import (  # noqa: F401
    copy_high_bytes,
    expand_high_bytes,
    merge_remainder,
    split_remainder,
)
