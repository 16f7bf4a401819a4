"""bench/bench_cpu_adam.py at a tiny size: every row is there (DeepSpeed's as a time or as
the reason it is missing); no timing is checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a benchmark's smoke run: `make test` only
@pytest.mark.timeout(300)
def test_table_rows():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "bench/bench_cpu_adam.py", "--sizes", "0.05",
                           "--reps", "1", "--rounds", "1", "--threads", "2"],
                          capture_output=True, text=True, timeout=280, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for row in ("copy floor", "torch copy_", "in-place floor", "mpzero._cpu fp32",
                "torch AdamW fused", "torch AdamW foreach", "DeepSpeed CPU Adam",
                "mpzero._cpu bf16 grad+out", "mpzero._cpu remainders"):
        assert f"| {row} |" in proc.stdout, proc.stdout
