"""End-to-end runs of examples/gpt/train.py under torchrun on CPU (gloo).

- 2 ranks, ZeRO over both, gradient accumulation: the loss falls, checkpoints are
  written, and a run interrupted at iteration 15 and resumed from its checkpoint
  logs exactly the losses of the uninterrupted run.
- That run (DP=2), TP=2 x DP=2 and DP=4 with a 2 x 2 distributed x redundant optimizer
  grid (world 4) track one single-rank run of the same seed and global batch within
  1e-3 relative at every iteration (so does ``--optimizer adamw``, the non-ZeRO
  comparison).

Every run trains 30 iterations: enough for the loss to fall by more than 0.5 and for
the layouts to drift apart if their gradients differed; the single-rank reference is
trained once for all the comparisons.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.gpt.plot_log import plot, read_log

REPO = Path(__file__).resolve().parents[2]
GPT_DIR = REPO / "examples" / "gpt"


import gpt_jobs  # noqa: E402
from gpt_test_data import prepared_corpus  # noqa: E402

# Every test here runs real torchrun jobs (2-4 ranks, ~1 min on 2 cores): `make test` only.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "16",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "5", "--clip-grad", "1.0",
        "--weight-decay", "0.1", "--seed", "1234", "--log-interval", "1", "--eval-iters", "2",
        "--cpu", "--num-threads", "1", "--no-progress"]


ITERS = 30
# A safety net against a hung job, far above a run's minute on 2 loaded cores: the
# verdicts never depend on how long a run takes.
JOB_TIMEOUT = 600


def torchrun(nproc: int, args: list[str],
             timeout: float = JOB_TIMEOUT) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), "-m", "examples.gpt.train", *TINY, *args]
    proc = gpt_jobs.run(cmd, timeout=timeout, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepared_corpus(tmp_path_factory, "gpt-train-data", 1.0, 1024)


@pytest.fixture(scope="module")
def resume_runs(data_dir, tmp_path_factory):
    """Run A: 30 iterations. Run B: the same, stopped at 15. Run C: B resumed to 30."""
    root = tmp_path_factory.mktemp("gpt-resume")
    common = ["--data-dir", str(data_dir), "--train-iters", str(ITERS), "--eval-interval",
              "15", "--save-interval", "15"]
    torchrun(2, [*common, "--save", str(root / "ckpt_a"), "--log-file", str(root / "a.jsonl")])
    torchrun(2, [*common, "--save", str(root / "ckpt_b"), "--log-file", str(root / "b.jsonl"),
                 "--exit-interval", "15"])
    resumed = torchrun(2, [*common, "--save", str(root / "ckpt_b"), "--load",
                           str(root / "ckpt_b"), "--log-file", str(root / "c.jsonl")])
    return root, resumed


def test_loss_falls_and_log_has_the_metrics(resume_runs):
    root, _ = resume_runs
    train, evals = read_log(root / "a.jsonl")
    assert [r["iteration"] for r in train] == list(range(1, 31))
    losses = [r["loss"] for r in train]
    assert abs(losses[0] - 6.93) < 0.3  # ~ln(1024) at initialization
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert [e["iteration"] for e in evals] == [15, 30]
    assert max(e["val_loss"] for e in evals) < losses[0] - 0.5
    for r in train:
        assert r["tokens_per_s"] > 0 and r["tflops_per_device"] > 0 and r["memory_gib"] > 0
        assert r["mfu"] is None and r["memory_kind"] == "cpu_peak_rss"
        assert r["grad_norm"] > 0 and r["consumed_samples"] == 16 * r["iteration"]
    lrs = [r["lr"] for r in train]
    assert lrs[4] == pytest.approx(3e-3) and lrs[-1] == pytest.approx(3e-4)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # cosine decay after warmup
    png = plot([str(root / "a.jsonl")], str(root / "curves.png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkpoints_written(resume_runs):
    root, _ = resume_runs
    for it in (15, 30):
        ckpt = root / "ckpt_a" / f"iter_{it:07d}"
        names = {p.name for p in ckpt.iterdir()}
        # --ckpt-format torch_dist (the default): model and optimizer shards under dcp/
        assert names == {"manifest.json", "dcp", "rng_rank00000.pt", "rng_rank00001.pt"}
    assert (root / "ckpt_a" / "latest").read_text() == "iter_0000030"


def test_resume_reproduces_the_uninterrupted_run(resume_runs):
    root, resumed = resume_runs
    a_train, a_eval = read_log(root / "a.jsonl")
    b_train, b_eval = read_log(root / "b.jsonl")
    c_train, c_eval = read_log(root / "c.jsonl")
    assert "resumed from" in resumed.stdout and "iteration 15" in resumed.stdout
    assert [r["iteration"] for r in b_train] == list(range(1, 16))
    assert [r["iteration"] for r in c_train] == list(range(16, 31))
    keys = ("loss", "grad_norm", "lr")
    for a, other in zip(a_train, b_train + c_train, strict=True):
        assert {k: a[k] for k in keys} == {k: other[k] for k in keys}, a["iteration"]
    assert [e["val_loss"] for e in a_eval] == [e["val_loss"] for e in b_eval + c_eval]


def _losses(path: Path) -> list[float]:
    return [r["loss"] for r in read_log(path)[0]]


@pytest.fixture(scope="module")
def single(data_dir, tmp_path_factory) -> list[float]:
    """The losses of one rank training the same model on the same global batches."""
    log = tmp_path_factory.mktemp("gpt-single") / "single.jsonl"
    torchrun(1, ["--data-dir", str(data_dir), "--train-iters", str(ITERS),
                 "--eval-interval", "0", "--log-file", str(log)])
    ref = _losses(log)
    assert len(ref) == ITERS
    assert sum(ref[-5:]) < sum(ref[:5]) - 2.5  # it is learning, not constant
    return ref


def _assert_tracks(name: str, got: list[float], ref: list[float]) -> None:
    assert len(got) == len(ref) == ITERS, name
    worst = max(abs(g - r) / abs(r) for g, r in zip(got, ref))
    assert worst < 1e-3, (name, worst)


def test_data_parallel_run_tracks_single_rank(resume_runs, single):
    """Run A of the fixture above (DP=2, ZeRO over both ranks, 2 micro-batches each)."""
    root, _ = resume_runs
    _assert_tracks("dp2", _losses(root / "a.jsonl"), single)


@pytest.mark.parametrize("layout", [
    ("tp2-dp2", 4, ["--tensor-model-parallel-size", "2"]),
    ("dp4-dist2x2", 4, ["--distributed-optimizer-size", "2", "--overlap-param-sync"]),
], ids=lambda layout: layout[0])
def test_parallel_layout_tracks_single_rank(layout, data_dir, single, tmp_path):
    name, nproc, extra = layout
    log = tmp_path / f"{name}.jsonl"
    torchrun(nproc, ["--data-dir", str(data_dir), "--train-iters", str(ITERS),
                     "--eval-interval", "0", *extra, "--log-file", str(log)])
    _assert_tracks(name, _losses(log), single)
