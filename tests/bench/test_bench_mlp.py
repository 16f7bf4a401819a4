"""bench/bench_mlp.py's rows on the CPU at a tiny size (aot_eager: no C++ compiler run):
every case is there with a positive time and rate (the epilogue GEMM rows are CUDA only)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_mlp  # noqa: E402


@pytest.mark.timeout(120)
def test_rows_on_cpu():
    table = bench_mlp.rows(32, 16, 64, 2, device="cpu", backend="aot_eager")
    assert [name for name, *_ in table] == ["unfused (compiled)", "gelu_mlp",
                                            "gelu_mlp, recompute", "the 6 GEMMs alone"]
    assert all(ms > 0 and tflops > 0 for _, ms, tflops, _ in table)
