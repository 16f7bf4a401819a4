"""The example tests' jobs (tests/examples/gpt_jobs.py) die with the test runner that
started them, also when the runner is SIGKILLed and cannot clean up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpt_jobs import descendants, is_alive, wait_gone

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG is Linux's")

# A runner-like parent: starts one job through gpt_jobs and one with plain Popen (the
# control), prints both pids, then waits to be killed.
RUNNER = """
import subprocess, sys, time
sys.path.insert(0, {here!r})
import gpt_jobs
job = gpt_jobs.{how}
plain = subprocess.Popen({cmd!r})
print(job.pid, plain.pid, flush=True)
time.sleep(600)
"""
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _start_runner(how: str) -> tuple[subprocess.Popen, int, int]:
    code = RUNNER.format(here=str(HERE), how=how, cmd=SLEEPER)
    runner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    job, plain = map(int, runner.stdout.readline().split())
    return runner, job, plain


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.timeout(120)
def test_a_job_dies_when_its_runner_is_killed():
    runner, job, plain = _start_runner(f"popen({SLEEPER!r})")
    try:
        assert is_alive(job) and is_alive(plain)
        runner.kill()  # SIGKILL: the runner cannot clean anything up
        runner.wait()
        assert wait_gone([job], 60) == [], "the tied job outlived its runner"
        # The control: an untied child of the same runner is still there, so it is the
        # tie (not the runner's death as such) that ended the job.
        assert is_alive(plain)
    finally:
        runner.kill()
        _kill([job, plain])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchrun_and_its_workers_die_when_the_runner_is_killed(tmp_path):
    """torchrun gets SIGTERM when the runner dies and takes its workers down with it."""
    worker = tmp_path / "worker.py"
    worker.write_text("import os, time\nprint('worker', os.getpid(), flush=True)\n"
                      "time.sleep(600)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "--shutdown-timeout", "10", str(worker)]
    runner, torchrun, plain = _start_runner(
        f"popen({cmd!r}, death_signal=gpt_jobs.TORCHRUN_DEATH_SIGNAL)")
    try:
        workers = []
        for _ in range(600):  # the workers start within seconds; poll for them
            workers = [p for p in descendants(torchrun)
                       if "worker.py" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
            if len(workers) == 2:
                break
            wait_gone([torchrun], 0.1)
        assert len(workers) == 2, descendants(torchrun)
        runner.kill()
        runner.wait()
        assert wait_gone([torchrun, *workers], 90) == []
        assert is_alive(plain)
    finally:
        runner.kill()
        _kill([plain, *(descendants(torchrun) if is_alive(torchrun) else []), torchrun])
