"""bench/bench_layer_norm.py's rows on the CPU at a tiny size (aot_eager: no C++ compiler
run): every case is there with a positive time, and the unfused baseline computes what
the fused op does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_layer_norm  # noqa: E402

from mpzero.tensor_parallel import add_layer_norm  # noqa: E402


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rms", [False, True])
def test_rows_on_cpu(rms):
    table = bench_layer_norm.rows(32, 64, 2, device="cpu", backend="aot_eager", rms=rms)
    names = [name for name, _, _ in table]
    assert names[0].startswith("copy") and len(names) == 5
    op = "mpzero add_rms_norm" if rms else "mpzero add_layer_norm"
    assert sum(op in n for n in names) == 2
    assert all(ms > 0 and tbs > 0 for _, ms, tbs in table)


def test_unfused_baseline_equals_the_op():
    x, y = torch.randn(6, 32), torch.randn(6, 32)
    w, b = 1 + 0.1 * torch.randn(32), 0.1 * torch.randn(32)
    for got, want in zip(bench_layer_norm._unfused(x, y, w, b), add_layer_norm(x, y, w, b)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for got, want in zip(bench_layer_norm._unfused_rms(x, y, w, b),
                         bench_layer_norm._fused_rms(x, y, w, b)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
