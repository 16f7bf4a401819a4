"""Faults of the GPT example, with real processes (one per rank, gloo on CPU):
corrupted checkpoints are skipped by a collective decision, a signal saves and
exits 0, a rank killed with SIGKILL takes the others down (each exits by itself, naming
the failed collective), NaN steps are skipped and too many in a row stop the run.

The time limits here (``JOB``) only stop a hung job; they are far above what a job
takes on two loaded cores, and no verdict depends on how long something took."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.gpt import checkpointing

# Every test runs real multi-process jobs of the example: `make test` only.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
GPT = ["-m", "examples.gpt.train"]  # run from the checkout (cwd, PYTHONPATH)
# The example with NaN losses on chosen iterations (``--nan-iters``): a test-only wrapper.
NAN_GPT = Path(__file__).resolve().parent / "gpt_nan_injection.py"


import gpt_jobs  # noqa: E402
from gpt_test_data import prepared_corpus, verify_all  # noqa: E402

# Seconds a job may take before the test calls it hung (a few seconds when idle).
JOB = 300

TINY = gpt_jobs.TINY


_port = gpt_jobs.free_port


def launch(n: int, args: list[str], out: Path, env_extra: dict | None = None,
           preexec: dict | None = None, nan_iters: str | None = None) -> list:
    """Start ``n`` ranks of train.py (torchrun's environment, without torchrun),
    tied to this test runner (gpt_jobs); ``preexec``: rank -> function run in that rank's
    process before it starts; ``nan_iters`` ("3,4"): the losses of those iterations are
    NaN (gpt_nan_injection.py)."""
    script = GPT if nan_iters is None else [str(NAN_GPT), "--nan-iters", nan_iters]
    port = str(_port())
    procs = []
    for r in range(n):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), RANK=str(r),
                   WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **(env_extra or {}))
        log = open(out / f"rank{r}.log", "w")  # noqa: SIM115 - closed by the caller's wait
        procs.append((gpt_jobs.popen([sys.executable, *script, *TINY, *args], env=env,
                                     stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                     preexec=(preexec or {}).get(r)), log))
    return procs


def wait_all(procs, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(None)
        log.close()
    return codes


def logs(out: Path, n: int) -> list[str]:
    return [(out / f"rank{r}.log").read_text() for r in range(n)]


def wait_for(out: Path, text: str, timeout: float) -> None:
    """Until rank 0's log matches the regular expression ``text``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(text, (out / "rank0.log").read_text()):
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in rank 0's log after {timeout} s:\n"
                         + (out / "rank0.log").read_text()[-3000:])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepared_corpus(tmp_path_factory, "gpt-faults-data", 0.5, 512)


@pytest.fixture(scope="module")
def saved(data_dir, tmp_path_factory):
    """A 2-rank run that saved iterations 2 and 4."""
    out = tmp_path_factory.mktemp("faults-saved")
    procs = launch(2, ["--data-dir", str(data_dir), "--train-iters", "4", "--save-interval",
                       "2", "--save", str(out / "ckpt")], out)
    codes = wait_all(procs, JOB)
    assert codes == [0, 0], logs(out, 2)
    assert "saved checkpoint iter 4 to" in logs(out, 2)[0]
    return out / "ckpt"


def _resume(data_dir, ckpt: Path, out: Path) -> tuple[list, list[str]]:
    procs = launch(2, ["--data-dir", str(data_dir), "--train-iters", "4", "--load", str(ckpt)],
                   out)
    return wait_all(procs, JOB), logs(out, 2)


@pytest.mark.timeout(900)
def test_broken_checkpoints_are_skipped_on_every_rank(saved, data_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    (ckpt / "latest").write_bytes(b"\xff\x00garbage\n")  # binary junk in latest
    (ckpt / "iter_0000006").mkdir()  # a save that died before its manifest
    (ckpt / "iter_0000006" / "model_tp00.pt").write_bytes(b"half")
    rng1 = ckpt / "iter_0000004" / "rng_rank00001.pt"  # only rank 1 reads this file
    blob = bytearray(rng1.read_bytes())
    blob[len(blob) // 2] ^= 0x10
    rng1.write_bytes(bytes(blob))
    codes, text = _resume(data_dir, ckpt, tmp_path)
    assert codes == [0, 0], text
    assert "no manifest.json" in text[0] and "iter_0000006" in text[0]
    assert "checksum mismatch for" in text[1] and str(rng1) in text[1]
    assert "loaded checkpoint iter 2 from" in text[0]
    # rank 0 skipped iter 4 too (collective), and trained 3..4 again.
    assert "does not verify on every rank" in text[0]


@pytest.mark.timeout(900)
def test_no_valid_checkpoint_stops_every_rank_with_the_same_error(saved, data_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    (ckpt / "latest").write_text("iter_9999999 is not a checkpoint")
    (ckpt / "iter_0000004" / "rng_rank00001.pt").unlink()  # missing shard
    model = ckpt / "iter_0000002" / "dcp" / "__0_0.distcp"
    with open(model, "r+b") as f:  # truncated
        f.truncate(model.stat().st_size // 2)
    codes, text = _resume(data_dir, ckpt, tmp_path)
    assert codes == [1, 1], text
    for t in text:
        assert "verifies on every rank" in t and "iter_0000002" in t and "iter_0000004" in t
    assert "rng_rank00001.pt is missing" in text[0]


def _file_size_limit(nbytes: int):
    def apply() -> None:  # in the child: writes past nbytes fail with EFBIG (Python
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))  # ignores SIGXFSZ)
    return apply


@contextlib.contextmanager
def _small_file_system(path: Path, nbytes: int):
    """A tmpfs of ``nbytes`` mounted on ``path`` (root only; the test skips otherwise)."""
    path.mkdir(parents=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("a full file system needs root (mount -t tmpfs)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(path: Path, leave: int) -> None:
    """Write a file that leaves only ``leave`` bytes free on ``path``'s file system."""
    st = os.statvfs(path)
    with open(path / "filler", "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", ["enospc", "file-size-limit"])
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(saved, data_dir, tmp_path,
                                                               fault):
    """A save whose writes fail half-way: every rank exits non-zero naming the save and
    the cause in words, ``latest`` and the checkpoints already there are untouched, and a
    relaunch resumes from the last complete save and reports the unfinished one.

    ``enospc``: the checkpoint directory is on a tmpfs filled up to its last 24 KiB (the
    kernel's own "No space left on device"); ``file-size-limit``: rank 1 may write no
    file over 64 KiB (RLIMIT_FSIZE, any user), so its shard fails with EFBIG."""
    out = tmp_path / "full"
    out.mkdir()
    with contextlib.ExitStack() as stack:
        if fault == "enospc":
            disk = stack.enter_context(_small_file_system(tmp_path / "disk", 16 << 20))
            ckpt, preexec, expected = disk / "ckpt", None, "no space left on device in "
        else:
            ckpt, preexec = tmp_path / "ckpt", {1: _file_size_limit(64 << 10)}
            expected = "file too large (a file-size limit, e.g. ulimit -f) in "
        shutil.copytree(saved, ckpt)
        if fault == "enospc":
            _fill(ckpt.parent, 24 << 10)
        latest = (ckpt / "latest").read_bytes()
        manifest = (ckpt / "iter_0000004" / "manifest.json").read_bytes()
        procs = launch(2, ["--data-dir", str(data_dir), "--train-iters", "6",
                           "--save-interval", "2", "--save", str(ckpt), "--load", str(ckpt),
                           "--dist-timeout", "30",
                           "--use-checkpoint-opt-param-scheduler"],  # the lr decays over 4
                       out, preexec=preexec)
        codes = wait_all(procs, JOB)
        text = logs(out, 2)
        assert None not in codes and codes[0] != 0 and codes[1] != 0, (codes, text)
        # Every rank (DCP shares the writing rank's failure) names the save and what stays
        # safe; the cause in words with the directory on every rank that can see it (the
        # full disk: all; the size limit: rank 1's own).
        for r, t in enumerate(text):
            assert f"saving checkpoint iter 6 to {ckpt} failed: " in t, t[-3000:]
            if fault == "enospc" or r == 1:
                assert f"failed: {expected}{ckpt}" in t, t[-3000:]
            assert "iter_0000004, is unchanged and stays the resume point" in t, t[-3000:]
        assert "saved checkpoint iter 6" not in text[0]
        assert (ckpt / "latest").read_bytes() == latest
        assert (ckpt / "iter_0000004" / "manifest.json").read_bytes() == manifest
        assert verify_all(ckpt / "iter_0000004") == []
        codes, text = _resume(data_dir, ckpt, tmp_path)
        assert codes == [0, 0], text
        assert "loaded checkpoint iter 4 from" in text[0]
        if (ckpt / "iter_0000006").exists():  # the unfinished save is reported, not loaded
            assert "iter_0000006" in text[0], text[0][-3000:]


def _read_only_mount(path: Path):
    """In the child: a private mount namespace where ``path`` is an empty read-only tmpfs
    (this rank alone cannot write there; the other ranks see the real directory)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def apply() -> None:
        clone_newns, ms_rdonly, ms_rec, ms_private = 0x20000, 1, 0x4000, 0x40000
        if (libc.unshare(clone_newns) != 0
                or libc.mount(b"none", b"/", None, ms_rec | ms_private, None) != 0
                or libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", ms_rdonly, None) != 0):
            os._exit(97)
    return apply


@pytest.mark.timeout(900)
@pytest.mark.parametrize("where", ["every-rank", "rank-1"])
def test_an_unwritable_save_dir_stops_every_rank_before_training(data_dir, tmp_path, where):
    """``--save`` that a rank cannot write is found at start-up, not at the first save:
    every rank exits 1 with the same message naming --save, the path and the failing
    rank(s), before the first iteration. ``every-rank``: the path runs through a file
    (any user: root may write anywhere else); ``rank-1``: only rank 1 sees a read-only
    file system there (its own mount namespace; root only)."""
    preexec = None
    if where == "every-rank":
        (tmp_path / "a-file").write_text("not a directory\n")
        save, reason = tmp_path / "a-file" / "ckpt", "ranks 0, 1: a part of the path is not a"
    else:
        if os.geteuid() != 0:
            pytest.skip("a per-rank read-only mount needs root")
        (tmp_path / "shared").mkdir()
        save, reason = tmp_path / "shared" / "ckpt", "rank 1: read-only file system"
        preexec = {1: _read_only_mount(tmp_path / "shared")}
    procs = launch(2, ["--data-dir", str(data_dir), "--train-iters", "4", "--save",
                       str(save)], tmp_path, preexec=preexec)
    codes = wait_all(procs, JOB)
    text = logs(tmp_path, 2)
    assert codes == [1, 1], (codes, text)
    for t in text:
        assert f"--save {save} is not writable ({reason}" in t, t[-3000:]
        assert not re.search(r"iter +1/", t), t[-3000:]  # nothing was trained


@pytest.mark.timeout(900)
def test_non_finite_weights_are_not_saved(data_dir, tmp_path):
    """With the NaN check off, a NaN loss at iteration 3 makes the weights NaN: the save
    of iteration 4 is refused on every rank before anything is written, and the last good
    checkpoint (iteration 2) stays the newest and ``latest``."""
    ckpt = tmp_path / "ckpt"
    procs = launch(2, ["--data-dir", str(data_dir), "--train-iters", "4", "--save-interval",
                       "2", "--save", str(ckpt), "--no-check-for-nan-in-loss-and-grad"],
                   tmp_path, nan_iters="3")
    codes = wait_all(procs, JOB)
    text = logs(tmp_path, 2)
    assert codes == [1, 1], (codes, text)
    for t in text:
        assert f"saving checkpoint iter 4 to {ckpt} failed: the model's weights at " \
               "iteration 4 hold NaN or Inf (rank 0: " in t, t[-3000:]
        assert "iter_0000002, is unchanged and stays the resume point" in t, t[-3000:]
    assert "saved checkpoint iter 2 " in text[0]
    assert checkpointing.read_latest(ckpt).name == "iter_0000002"
    assert [d.name for d in checkpointing.list_checkpoints(ckpt)] == ["iter_0000002"]


@pytest.mark.timeout(900)
def test_sigterm_saves_and_exits_zero(data_dir, tmp_path):
    procs = launch(2, ["--data-dir", str(data_dir), "--train-iters", "100000",
                       "--save", str(tmp_path / "ckpt")], tmp_path)
    wait_for(tmp_path, r"iter +3/\d+ \|", JOB)
    procs[1][0].send_signal(signal.SIGTERM)  # one rank is enough: the decision is collective
    codes = wait_all(procs, JOB)
    text = logs(tmp_path, 2)
    assert codes == [0, 0], text
    assert "(signal SIGTERM" in text[0] or "(signal on another rank" in text[0], text[0]
    assert "saved checkpoint iter" in text[0]
    it = int(text[0].split("saved checkpoint iter ")[1].split()[0])
    assert (tmp_path / "ckpt" / f"iter_{it:07d}" / "manifest.json").exists()
    assert f"exiting at iteration {it}" in text[0]


@pytest.mark.timeout(1200)
def test_kill_9_of_one_rank_stops_every_rank(data_dir, tmp_path):
    """SIGKILL of rank 2 of 4: the other three exit non-zero *by themselves* (a rank that
    had to be killed here reads as None), each naming the failed collective, and a
    relaunch resumes from the newest save that verifies. With ``--dist-timeout 30`` the
    survivors stop within a minute on an idle machine (gloo usually sees the closed
    connection at once); the wait for them is only a hang guard, as wide as ``JOB``."""
    ckpt = str(tmp_path / "ckpt")
    procs = launch(4, ["--data-dir", str(data_dir), "--train-iters", "100000",
                       "--dist-timeout", "30", "--save", ckpt, "--save-interval", "2"], tmp_path)
    wait_for(tmp_path, "saved checkpoint iter 2 ", JOB)
    procs[2][0].send_signal(signal.SIGKILL)
    codes = wait_all(procs, JOB)
    text = logs(tmp_path, 4)
    assert codes[2] == -signal.SIGKILL
    assert all(c is not None and c != 0 for c in codes), (codes, text)
    for r in (0, 1, 3):
        assert "a collective failed" in text[r], text[r][-3000:]
    # Relaunch: resumes from the newest save that verifies (a save cut short is skipped).
    printed = max(int(t.split()[0]) for t in text[0].split("saved checkpoint iter ")[1:])
    # The newest complete save: rank 0 prints "saved" after the save's last barrier, so
    # when rank 2 dies in that barrier the save is complete (the manifest comes after
    # every rank's files) but not printed, and the relaunch rightly resumes from it.
    last = max(int(d.name[5:]) for d in checkpointing.list_checkpoints(ckpt)
               if not verify_all(d))
    assert last >= printed
    relaunch = tmp_path / "relaunch"
    relaunch.mkdir()
    procs = launch(4, ["--data-dir", str(data_dir), "--train-iters", str(last + 1),
                       "--load", ckpt, "--save", ckpt,
                       "--use-checkpoint-opt-param-scheduler"],  # decay over 100000 still
                   relaunch)
    assert wait_all(procs, JOB) == [0, 0, 0, 0], logs(relaunch, 4)
    assert f"loaded checkpoint iter {last} from" in logs(relaunch, 4)[0]


@pytest.mark.timeout(900)
def test_nan_steps_are_skipped_then_the_run_stops(data_dir, tmp_path):
    procs = launch(2, ["--data-dir", str(data_dir), "--train-iters", "8",
                       "--max-consecutive-skipped-iters", "3"], tmp_path, nan_iters="2,5,6,7")
    codes = wait_all(procs, JOB)
    text = logs(tmp_path, 2)
    assert codes == [1, 1], text
    assert "iteration 2: non-finite loss" in text[0] and "step skipped" in text[0]
    assert "iteration 7: 3 consecutive iterations" in text[0]
    assert "iteration 7: 3 consecutive iterations" in text[1]


@pytest.mark.timeout(900)
def test_other_grid_loads_and_wrong_model_is_refused(saved, data_dir, tmp_path):
    # Saved by 2 ranks (dp 2) as torch_dist: one rank reshards it.
    procs = launch(1, ["--data-dir", str(data_dir), "--train-iters", "4",
                       "--load", str(saved)], tmp_path)
    assert wait_all(procs, JOB) == [0], logs(tmp_path, 1)
    assert "loaded checkpoint iter 4 from" in logs(tmp_path, 1)[0]
    hidden = TINY.index("--hidden-size") + 1
    procs = launch(1, ["--data-dir", str(data_dir), "--train-iters", "4", "--load", str(saved),
                       "--hidden-size", "48"], tmp_path)
    text = logs(tmp_path, 1)[0] if wait_all(procs, JOB) != [0] else "exit 0"
    # Refused before loading, naming the option and both values.
    assert TINY[hidden] == "32"
    assert "has hidden_size=32, this run has --hidden-size=48" in text, text


@pytest.mark.timeout(120)
def test_checkpoint_cli_inspect_consolidate_export(saved, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file

    from examples.gpt.checkpoint_tool import main as cli
    from mpzero.checkpoint.__main__ import main as dcp_cli

    assert cli(["inspect", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "iteration 4" in out and "all checksums verified" in out and "tp 1" in out
    assert cli(["consolidate", str(saved), str(tmp_path / "full")]) == 0
    model = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    optim = torch.load(tmp_path / "full" / "optimizer.pt", weights_only=True)
    assert optim["format"] == 2 and optim["state"]["step"] == 4
    assert cli(["export", str(saved), str(tmp_path / "m.safetensors"), "--dtype", "fp32"]) == 0
    weights = load_file(tmp_path / "m.safetensors")
    assert weights.keys() == {k for k, v in model.items() if v.is_floating_point()}
    assert all(torch.equal(weights[k], model[k].float()) for k in weights)
    bad = tmp_path / "bad"
    shutil.copytree(saved / "iter_0000004", bad)
    with open(bad / "dcp" / "__1_0.distcp", "r+b") as f:
        f.truncate(10)
    capsys.readouterr()
    assert cli(["inspect", str(bad)]) == 1
    assert "MISMATCH" in capsys.readouterr().out
    # mpzero's own tool reads the DCP folder alone: no checksums there, but DCP's
    # metadata says how many bytes each file must hold.
    assert dcp_cli(["inspect", str(saved / "iter_0000004" / "dcp")]) == 0
    assert "all files sound" in capsys.readouterr().out
    assert dcp_cli(["inspect", str(bad / "dcp")]) == 1
    assert "TRUNCATED" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not a DCP checkpoint directory"):
        dcp_cli(["inspect", str(saved)])
