"""train.py's precision and compile flags from the command line (CPU, gloo).

- contradictory flags fail before anything starts and name both flags;
- ``--bf16`` runs with bf16 parameters (the log says so) and tracks the fp32 run;
- ``--compile`` (block and model) logs the eager run's losses: with the
  ``aot_eager`` backend (no code generation, a few seconds) in the quick tier, with
  inductor (C++ code generation on CPU, ~1 min) in the slow tier, there also on 2
  ranks with DistributedFusedAdam's hooks, gradient accumulation and a bit-exact
  resume from a ``--bf16`` checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from examples.gpt import config

REPO = Path(__file__).resolve().parents[2]
GPT = ["-m", "examples.gpt.train"]  # run from the checkout (cwd, PYTHONPATH)


import gpt_jobs  # noqa: E402
from gpt_test_data import prepared_corpus  # noqa: E402

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--log-interval", "1",
        "--eval-interval", "0", "--eval-iters", "1", "--cpu", "--num-threads", "1",
        "--no-progress"]
# Compiled code may fuse and reorder fp32/bf16 arithmetic (inductor does): losses stay
# within a few bf16 roundings of the eager run's.
COMPILE_REL = 2e-3


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepared_corpus(tmp_path_factory, "gpt-precision-data", 0.3, 256)


def run(args: list[str], log: Path, nproc: int = 1, timeout: float = 600) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    launcher = ([] if nproc == 1 else
                ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)])
    cmd = [sys.executable, *launcher, *GPT, *TINY, *args, "--log-file", str(log)]
    proc = gpt_jobs.run(cmd, timeout=timeout, env=env, cwd=REPO)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def records(log: Path, kind: str = "train") -> list[dict]:
    return [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == kind]


def losses(log: Path) -> list[float]:
    return [r["loss"] for r in records(log)]


@pytest.mark.parametrize("argv,flags", [
    (["--bf16", "--autocast-bf16"], ["--bf16", "--autocast-bf16"]),
    (["--store-param-remainders"], ["--store-param-remainders", "--bf16"]),
    (["--bf16", "--store-param-remainders", "--param-sync-dtype", "fp32"],
     ["--store-param-remainders", "--param-sync-dtype"]),
    (["--bf16", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"],
     ["--exp-avg-dtype", "--store-param-remainders"]),
    (["--bf16", "--store-param-remainders", "--exp-avg-dtype", "bf16"],
     ["--exp-avg-dtype", "--exp-avg-sq-dtype"]),
])
def test_conflicting_precision_flags_name_both(argv, flags, capsys):
    with pytest.raises(SystemExit) as exc:
        config.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for flag in flags:
        assert flag in err, (flag, err)


def test_compile_mode_without_compile_warns(capsys):
    config.parse_args(["--compile-mode", "model"])
    assert "--compile-mode model has no effect without --compile" in capsys.readouterr().err


@pytest.mark.slow  # real processes or a big world: `make test` only
@pytest.mark.timeout(300)
def test_bf16_and_compiled_runs_track_eager(data_dir, tmp_path):
    common = ["--data-dir", str(data_dir), "--train-iters", "4"]
    run(common, tmp_path / "fp32.jsonl")
    out = run([*common, "--bf16"], tmp_path / "bf16.jsonl")
    assert "cpu bf16" in out
    setup = records(tmp_path / "bf16.jsonl", "setup")[0]
    assert setup["precision"] == "bf16" and setup["compile"] is None
    for mode in ("block", "model"):
        out = run([*common, "--bf16", "--compile", "--compile-mode", mode, "--compile-backend",
                   "aot_eager"], tmp_path / f"{mode}.jsonl")
        assert f"compiled ({mode})" in out
        assert losses(tmp_path / f"{mode}.jsonl") == pytest.approx(
            losses(tmp_path / "bf16.jsonl"), rel=COMPILE_REL), mode
    assert losses(tmp_path / "bf16.jsonl") == pytest.approx(losses(tmp_path / "fp32.jsonl"),
                                                            rel=5e-3)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU backend needs a C++ compiler")
def test_inductor_compile_two_ranks_with_bf16_resume(data_dir, tmp_path):
    """2 ranks, DFA, 2 micro-batches per rank: inductor-compiled blocks log the eager
    losses; the compiled run saves at iteration 3 (and 6), and a compiled run resumed
    from that save (``--load-iteration 3``, ``torch_dist``) logs the first run's
    iterations 4-6 bit for bit. (Compiling dominates: three launches, not four; the
    save-and-exit path, ``--exit-interval``, is test_gpt_train.py's.)"""
    common = ["--data-dir", str(data_dir), "--train-iters", "6", "--global-batch-size", "8",
              "--bf16"]
    run(common, tmp_path / "eager.jsonl", nproc=2)
    compiled = [*common, "--compile"]
    ckpt = str(tmp_path / "ckpt")
    run([*compiled, "--save", ckpt, "--save-interval", "3"], tmp_path / "a.jsonl", nproc=2)
    a = losses(tmp_path / "a.jsonl")
    assert a == pytest.approx(losses(tmp_path / "eager.jsonl"), rel=COMPILE_REL)
    out = run([*compiled, "--load", ckpt, "--load-iteration", "3"], tmp_path / "c.jsonl",
              nproc=2)
    assert "resumed from" in out and "iteration 3" in out
    assert [r["iteration"] for r in records(tmp_path / "c.jsonl")] == [4, 5, 6]
    assert losses(tmp_path / "c.jsonl") == a[3:]
