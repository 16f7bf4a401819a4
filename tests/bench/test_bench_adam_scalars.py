"""bench/bench_adam_scalars.py on the CPU at a tiny size: every row is there with a
positive time, the table and JSON are written, bad options are refused by name, and what
the rows time is the same update (device scalars give the host scalars' bits)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_adam_scalars as bench  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.timeout(60)
def test_rows_table_and_json(tmp_path, capsys):
    out = tmp_path / "scalars.json"
    bench.main(["--cpu", "--elems", "1000", "--lists", "2", "--reps", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    cases = list(bench.scalar_cases(CPU))
    for case in cases:
        assert f"| {case} |" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == cases
    assert all(r["prefetch"] is None and r["ms"] > 0 for r in rows)


@pytest.mark.parametrize("bad", [["--reps", "0"], ["--elems", "-3"], ["--lists", "0"]])
def test_bad_options_are_refused_by_name(bad, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--cpu", *bad])
    assert f"{bad[0]} must be >= 1" in capsys.readouterr().err


def test_every_case_is_the_same_update():
    """Each row's scalars, as numbers or device tensors, give the same bits."""
    results = []
    for scalars in bench.scalar_cases(CPU).values():
        state = bench.make_state(257, 3, CPU, seed=1)
        bench.call(state, scalars)
        results.append(state)
    first = results[0]
    assert not torch.equal(first["params"][0], bench.make_state(257, 3, CPU, seed=1)["params"][0])
    for other in results[1:]:
        for key in ("params", "exp_avgs", "exp_avg_sqs", "params_out"):
            for a, b in zip(first[key], other[key]):
                assert torch.equal(a, b), key
