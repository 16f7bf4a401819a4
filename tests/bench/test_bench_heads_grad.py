"""bench/bench_heads_grad.py's rows on the CPU at a tiny size (aot_eager: no C++ compiler
run): every case is there with a positive time, and what it times is right (the unfused
baseline equals the op it is compared with)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_heads_grad  # noqa: E402

from mpzero import kernels  # noqa: E402


@pytest.mark.timeout(120)
def test_rows_on_cpu():
    table = bench_heads_grad.rows(2, 16, 2, 8, 2, device="cpu", backend="aot_eager")
    names = [name for name, _, _ in table]
    assert names[0] == "copy (floor)" and len(names) == 9
    assert sum("mpzero heads_grad" in n for n in names) == 4
    assert all(ms > 0 and tbs > 0 for _, ms, tbs in table)


def test_unfused_baseline_equals_the_op():
    grads = [torch.randn(2, 3, 4, 8).transpose(1, 2) for _ in range(3)]  # [B, H, T, D] views
    dy, db = bench_heads_grad._unfused(*grads)
    want_dy, want_db = kernels.heads_grad(grads)
    assert torch.equal(dy, want_dy)
    torch.testing.assert_close(db, want_db, rtol=1e-6, atol=1e-6)
