"""bench/bench_gelu.py's rows on the CPU at a tiny size (aot_eager: no C++ compiler run):
every case is there with a positive time, and the two GELUs differ by what the tanh
approximation is known to be off on N(0, 1) inputs (under 1e-3, above 1e-5)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_gelu  # noqa: E402


@pytest.mark.slow  # a benchmark's smoke test: `make test`
@pytest.mark.timeout(120)
def test_rows_on_cpu():
    table, diff = bench_gelu.rows(64, 256, 2, device="cpu", backend="aot_eager")
    names = [name for name, _, _ in table]
    assert names == ["gelu none forward", "gelu none backward", "gelu tanh forward",
                     "gelu tanh backward",
                     "bias+gelu none bwd, dx, then the sum", "bias+gelu none bwd, mpzero bias_gelu",
                     "bias+gelu tanh bwd, dx, then the sum", "bias+gelu tanh bwd, mpzero bias_gelu",
                     "copy of x (forward's bytes)"]
    assert all(ms > 0 and tbs > 0 for _, ms, tbs in table)
    assert 1e-5 < diff < 1e-3
