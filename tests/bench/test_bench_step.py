"""bench/bench_step.py --cpu at a tiny size, then bench/plot_step.py on its JSON (a smoke
test of the table, the JSON rows and the PNG; no timing is checked)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # real processes or a big world: `make test` only
@pytest.mark.timeout(600)
def test_cpu_table_json_and_plot(tmp_path):
    out, png = tmp_path / "step.json", tmp_path / "step.png"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               MASTER_PORT=str(29700 + os.getpid() % 200))
    proc = subprocess.run([sys.executable, "bench/bench_step.py", "--cpu", "--layers", "2",
                           "--hidden", "64", "--reps", "2", "--warmup", "1",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=540, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "| setup " in proc.stdout and "copy floor" in proc.stdout
    result = json.loads(out.read_text())
    names = [r["name"] for r in result["rows"]]
    assert any(n.startswith("mpzero default") for n in names), names
    assert all(r["ms"] > 0 for r in result["rows"]) and result["floor"]["ms"] > 0
    # GPU ms (the launch hidden behind a sleep kernel) is a CUDA-only column: NaN on CPU
    assert all(math.isnan(r["gpu_ms"]) for r in result["rows"] + [result["floor"]])
    proc = subprocess.run([sys.executable, "bench/plot_step.py", str(out), "--out", str(png)],
                          capture_output=True, text=True, timeout=540, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
