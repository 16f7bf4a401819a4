"""Start the GPT example's processes from tests, tied to the test runner's life.

A test runner that dies (killed by a CI timeout, SIGKILL, a second Ctrl-C) must not
leave training jobs behind: they would hold CPU, ports and files in pytest's
temporary directories for as long as they run. Every process started here gets
``PR_SET_PDEATHSIG`` (Linux): the kernel signals it when the runner *thread* that
started it exits. Start jobs from the test's own (main) thread, not from a thread
that ends before the job should.

- Ranks started directly (``RANK``/``WORLD_SIZE`` in their environment) get SIGKILL.
- ``torchrun`` gets SIGTERM instead (:data:`TORCHRUN_DEATH_SIGNAL`): its workers are its
  children, in sessions of their own, so only torchrun can take them down. It forwards
  SIGTERM to them and SIGKILLs the ones still there after its ``--shutdown-timeout``.

:func:`run` is ``subprocess.run(..., capture_output=True, text=True)`` with the same tie,
and on its own timeout it kills the whole process tree (torchrun *and* its workers),
where ``subprocess.run`` would kill torchrun alone and orphan the workers.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

TORCHRUN_DEATH_SIGNAL = signal.SIGTERM
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Loaded in the parent: the child (between fork and exec) only calls into it.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def tie_to_runner(death_signal: int = signal.SIGKILL,
                  then: Callable[[], None] | None = None) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive ``death_signal`` when the calling
    thread (the runner) dies, then runs ``then`` (e.g. a resource limit) if given."""
    runner = os.getpid()

    def preexec() -> None:
        if _LIBC is not None:
            if _LIBC.prctl(_PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0) != 0:
                os._exit(111)  # untied jobs are what this module exists to prevent
            if os.getppid() != runner:  # the runner died before prctl took effect
                os.kill(os.getpid(), death_signal)
        if then is not None:
            then()

    return preexec


def popen(cmd: list[str], *, death_signal: int = signal.SIGKILL,
          preexec: Callable[[], None] | None = None, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)`` tied to this runner (see the module doc)."""
    return subprocess.Popen(cmd, preexec_fn=tie_to_runner(death_signal, preexec), **kwargs)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), from /proc; [] where there is
    no /proc."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop(0)
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                kids = Path(f"/proc/{parent}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            for kid in map(int, kids):
                if kid not in out:
                    out.append(kid)
                    todo.append(kid)
    return out


def is_alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an exited child nobody has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and everything it started (what a timed-out test leaves)."""
    for pid in reversed([proc.pid, *descendants(proc.pid)]):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def run(cmd: list[str], *, timeout: float, death_signal: int | None = None,
        **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)``,
    tied to the runner; a ``torch.distributed.run`` command gets
    :data:`TORCHRUN_DEATH_SIGNAL` unless ``death_signal`` says otherwise. On timeout the
    process tree is killed and ``subprocess.TimeoutExpired`` raised."""
    if death_signal is None:
        death_signal = (TORCHRUN_DEATH_SIGNAL if "torch.distributed.run" in cmd
                        or any(Path(c).name == "torchrun" for c in cmd[:1])
                        else signal.SIGKILL)
    with popen(cmd, death_signal=death_signal, stdout=subprocess.PIPE,
               stderr=subprocess.PIPE, text=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
        except BaseException:
            kill_tree(proc)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Poll until none of ``pids`` is alive or ``timeout`` seconds passed; the live ones."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if is_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if is_alive(p)]
    return alive


#: The smallest GPT the fault, launcher and resume tests train (one layer, CPU, one
#: thread a rank).
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--lr", "1e-3",
        "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-interval", "0",
        "--eval-iters", "1", "--cpu", "--num-threads", "1", "--no-progress"]


def free_port() -> int:
    """A TCP port that was free a moment ago (for --master-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
