"""The restructured GPT example trains exactly like the example before it (commit 2ed745f).

The old example is taken from git (``git archive 2ed745f examples/gpt``) into a
temporary folder and run as the script it was (``pretrain_gpt.py``); the new one runs
as ``python -m examples.gpt.train``. Both train the same tiny model on the same corpus
and seed with 2 gloo ranks on CPU, and their logs must agree bit for bit: the training
loss and grad norm of every iteration and the validation losses. Both import the same
``mpzero`` (this checkout's), so any difference comes from the example itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.gpt.plot_log import read_log

import gpt_jobs
from gpt_test_data import prepared_corpus

# Two torchrun jobs of 2 ranks per layout (a minute or so on 2 loaded cores): `make test`.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
OLD_COMMIT = "2ed745f"
# A hang guard far above a run's time on loaded cores: no verdict depends on speed.
JOB_TIMEOUT = 600

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "16",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "3", "--clip-grad", "1.0",
        "--weight-decay", "0.1", "--seed", "1234", "--log-interval", "1", "--eval-iters", "2",
        "--train-iters", "8", "--eval-interval", "4", "--dropout", "0.1",
        "--cpu", "--num-threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def old_example(tmp_path_factory) -> Path:
    """``examples/gpt`` of the old commit, extracted; skipped outside a git checkout."""
    root = tmp_path_factory.mktemp("old-example")
    try:
        archive = subprocess.run(["git", "archive", OLD_COMMIT, "examples/gpt"], cwd=REPO,
                                 capture_output=True, check=True, timeout=120).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"commit {OLD_COMMIT} is not available here ({e})")
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True, timeout=120)
    return root / "examples" / "gpt" / "pretrain_gpt.py"


def _train(entry: list[str], args: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", *entry, *TINY, *args]
    proc = gpt_jobs.run(cmd, timeout=JOB_TIMEOUT, env=env, cwd=REPO)
    assert proc.returncode == 0, (f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


@pytest.mark.parametrize("layout", [
    pytest.param([], id="dp2-grad-acc2"),  # ZeRO-2 over 2 ranks, 2 micro-batches a step
    pytest.param(["--tensor-model-parallel-size", "2", "--sequence-parallel"], id="tp2-sp"),
])
def test_new_example_logs_the_old_examples_losses_bitwise(old_example, layout,
                                                          tmp_path_factory):
    data_dir = prepared_corpus(tmp_path_factory, "gpt-train-data", 1.0, 1024)
    out = tmp_path_factory.mktemp("old-vs-new")
    logs = {}
    for name, entry in (("old", [str(old_example)]), ("new", ["-m", "examples.gpt.train"])):
        logs[name] = out / f"{name}.jsonl"
        _train(entry, [*layout, "--data-dir", str(data_dir), "--log-file", str(logs[name])])
    (old_train, old_eval), (new_train, new_eval) = read_log(logs["old"]), read_log(logs["new"])
    assert [r["iteration"] for r in new_train] == list(range(1, 9))
    # Tolerance: none. The same float operations in the same order give the same bits.
    for key in ("loss", "grad_norm", "lr", "consumed_samples"):
        assert [r[key] for r in new_train] == [r[key] for r in old_train], key
    assert [(e["iteration"], e["val_loss"]) for e in new_eval] == \
        [(e["iteration"], e["val_loss"]) for e in old_eval]
    assert len(new_eval) == 2
