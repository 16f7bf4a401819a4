"""Faults of a long run, decided collectively so every rank does the same thing
(docs/reliability.md): a pre-emption signal (SIGTERM, SIGINT, SIGUSR1) or
``--exit-duration-in-mins`` saves and exits 0 at the end of the iteration (a second
SIGINT stops at once); a non-finite loss or grad norm skips the step on every rank (too
many in a row stop the run); a failed collective ends every rank with status 1 and the
cause (:func:`run_guarded`); ``--save`` is checked at start-up and a failed save says
why in words. One iteration's flags travel in one small all-reduce over the world.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

# torchrun forwards SIGTERM and SIGINT by default and SIGUSR1 when asked to
# (``--signals-to-handle``, as slurm/pretrain_gpt.sbatch does).
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class TrainingAborted(RuntimeError):
    """The run cannot continue (too many skipped iterations)."""


class SaveFailed(RuntimeError):
    """Writing a checkpoint failed (disk full, file-size limit, I/O error, non-finite
    weights...)."""


class SaveDirNotWritable(RuntimeError):
    """``--save`` cannot be written by some rank (found at start-up)."""


class FaultGuard:
    """Per-run state: pending exit signal, deadline, consecutive skipped steps."""

    def __init__(self, *, check_nan: bool = True, max_skipped: int = 10,
                 exit_duration_mins: float | None = None, device=None) -> None:
        self.check_nan = check_nan
        self.max_skipped = max_skipped
        self.deadline = (None if exit_duration_mins is None
                         else time.monotonic() + 60.0 * exit_duration_mins)
        self.device = device
        self.signal_name: str | None = None
        self.skipped_in_a_row = 0
        self.skipped_total = 0
        self.exit_requested = False
        self.exit_reason = ""
        self._previous = {}
        for sig in EXIT_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signal_name == "SIGINT":
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without saving
        self.signal_name = signal.Signals(signum).name  # acted on at the iteration's end
        if signum == signal.SIGINT and _rank() == 0:
            # os.write, not print: a handler may run in the middle of a print.
            os.write(2, b"SIGINT: saving at the end of this iteration, then exiting "
                        b"(Ctrl-C again to stop at once without saving)\n")

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def agree(self, iteration: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Collective: True when the step may be applied. Also records (on every rank
        alike) whether the run should save and exit after this iteration."""
        bad = 0.0
        if self.check_nan:
            bad = float(not (torch.isfinite(loss).all() and torch.isfinite(grad_norm).all()))
        sig = 1.0 if self.signal_name else 0.0
        late = 1.0 if self.deadline is not None and time.monotonic() > self.deadline else 0.0
        flags = torch.tensor([bad, sig, late], dtype=torch.float32, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad, sig, late = (bool(v) for v in flags.tolist())
        if sig or late:
            self.exit_requested = True
            self.exit_reason = (f"signal {self.signal_name or 'on another rank'}" if sig
                                else "--exit-duration-in-mins reached")
        if not bad:
            self.skipped_in_a_row = 0
            return True
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        if _rank() == 0:
            print(f"iteration {iteration}: non-finite loss or grad norm (loss "
                  f"{float(loss):.4g}, grad norm {float(grad_norm):.4g} on rank 0): step "
                  f"skipped, no update applied ({self.skipped_in_a_row} in a row)", flush=True)
        if self.skipped_in_a_row >= self.max_skipped:
            raise TrainingAborted(
                f"iteration {iteration}: {self.skipped_in_a_row} consecutive iterations "
                "with a non-finite loss or grad norm (--max-consecutive-skipped-iters "
                f"{self.max_skipped}); stopping. Resume from the last checkpoint with a "
                "lower --lr or check the data.")
        return False


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def run_guarded(main, argv=None) -> None:
    """Run ``main(argv)``; turn a failed collective or an abort into a clear message and
    exit status 1 without waiting on the (possibly broken) process group."""
    try:
        main(argv)
    except SystemExit:
        raise
    except TrainingAborted as e:
        print(f"rank {_rank()}: training aborted: {e}", file=sys.stderr, flush=True)
        _exit(1)
    except SaveDirNotWritable as e:
        print(f"rank {_rank()}: {e}", file=sys.stderr, flush=True)
        _exit(1)
    except SaveFailed as e:
        traceback.print_exc()
        print(f"rank {_rank()}: {e}", file=sys.stderr, flush=True)
        _exit(1)
    except (RuntimeError, OSError) as e:  # DistBackendError, gloo/NCCL connection errors
        text = str(e)
        traceback.print_exc()
        if is_comm_error(e):
            print(f"rank {_rank()}: a collective failed: another rank died or did not "
                  "answer within --dist-timeout; exiting. Relaunch with --load to resume "
                  f"from the last checkpoint. ({text.splitlines()[0] if text else ''})",
                  file=sys.stderr, flush=True)
        else:
            print(f"rank {_rank()}: failed: {text.splitlines()[0] if text else e!r}",
                  file=sys.stderr, flush=True)
        _exit(1)


def is_comm_error(e: BaseException) -> bool:
    """``e`` reads like a failed collective (a rank died, a timeout, a broken connection)."""
    lowered = str(e).lower()
    return any(w in lowered for w in ("connection", "gloo", "nccl", "timed out", "timeout",
                                      "peer", "broken pipe", "distbackend"))


def _exit(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# ----------------------------------------------------------------------------- saving

# What an errno means for a checkpoint directory, in the words a user searches for.
_DISK_ERRORS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (a file-size limit, e.g. ulimit -f)",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a part of the path is not a directory",
    errno.EEXIST: "a part of the path exists and is not a directory",
    errno.EIO: "input/output error",
}


def _exception_graph(exc: BaseException):
    """``exc`` and every exception it leads to: causes, contexts, and the per-rank
    failures a ``torch.distributed.checkpoint`` CheckpointException carries
    (``failures``: rank -> (exception, traceback)), with the rank they came from (also
    an int ``rank`` attribute, as checkpointing's save errors carry)."""
    seen, todo = set(), [(exc, None)]
    while todo:
        e, rank = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e, rank
        if isinstance(getattr(e, "rank", None), int):
            rank = e.rank
        todo += [(e.__cause__, rank), (e.__context__, rank)]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for r, failure in sorted(failures.items(), key=lambda kv: str(kv[0])):
                inner = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(inner, BaseException):
                    todo.append((inner, r))


def disk_error(exc: BaseException) -> tuple[OSError, int | None] | None:
    """The first file-system error (``OSError`` with an errno of :data:`_DISK_ERRORS`)
    behind ``exc``, and the rank it happened on when another rank reported it (DCP), or
    None. Connection errors are OSErrors too, but not disk errors: they are left out."""
    for e, rank in _exception_graph(exc):
        if isinstance(e, OSError) and e.errno in _DISK_ERRORS:
            return e, rank
    return None


def describe_disk_error(e: OSError, fallback_dir: str | Path | None = None) -> str:
    """``"no space left on device in DIR ([Errno 28] ...)"``: the errno in words and the
    directory of the file (``fallback_dir`` when the error names no file)."""
    where = Path(e.filename).parent if e.filename else fallback_dir
    return (f"{_DISK_ERRORS.get(e.errno, os.strerror(e.errno or 0))}"
            + (f" in {where}" if where is not None else "") + f" ({e})")


def probe_write(directory: str | Path, nbytes: int) -> None:
    """Create ``directory`` if needed, write ``nbytes`` to a file there, fsync, remove it.
    Raises the OSError the file system gives (ENOSPC, EFBIG, EROFS, ...)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".write-test-rank{_rank()}-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * nbytes)
            f.flush()
            os.fsync(f.fileno())
    finally:
        try:
            probe.unlink()
        except FileNotFoundError:
            pass


# After a failed save with no errno in its exception: how much a test write tries, to ask
# the file system what is wrong. (torch.save turns a failed write into "RuntimeError:
# unexpected pos", and DCP passes exceptions between ranks pickled, without their
# causes, so the OSError behind a failed checkpoint write is often gone.)
_DIAGNOSTIC_WRITE = 1 << 20


def save_failed(save_dir: str, iteration: int, exc: BaseException,
                kept: Path | None) -> SaveFailed:
    """The :class:`SaveFailed` to raise when saving ``iteration`` to ``save_dir`` raised
    ``exc``: the cause in words, what stays safe (``kept``: the last complete checkpoint)
    and what to do. Local (no collective): it may run on some ranks only. Where ``exc``
    holds no file-system error, a 1 MiB test write in ``save_dir`` tells whether the file
    system is full (or read-only, or over a size limit) on this rank."""
    last = (str(exc).strip().splitlines() or [repr(exc)])[-1]
    found = disk_error(exc)
    cause = None
    if found is not None:
        err, rank = found
        cause = describe_disk_error(err, save_dir) + (f" on rank {rank}" if rank is not None
                                                     else "")
    elif type(exc).__name__ != "NonFiniteWeights":
        try:
            probe_write(save_dir, _DIAGNOSTIC_WRITE)
        except OSError as e:
            if e.errno in _DISK_ERRORS:
                cause = (f"{_DISK_ERRORS[e.errno]} in {save_dir} (rank {_rank()}: a test "
                         f"write there after the failure got [Errno {e.errno}] {e.strerror};"
                         f" the save's own error: {last})")
    if cause is not None:
        todo = ("free space on that file system (or fix its permissions or limits) and "
                "relaunch with --load")
    else:
        cause = last
        todo = ("relaunch with --load, with --check-for-nan-in-loss-and-grad on (it skips "
                "the steps that would make the weights non-finite) or a lower --lr"
                if type(exc).__name__ == "NonFiniteWeights"
                else "fix the error and relaunch with --load")
    safe = (f"the last complete checkpoint, {kept.name}, is unchanged and stays the resume "
            "point" if kept is not None else "no earlier checkpoint exists")
    return SaveFailed(f"saving checkpoint iter {iteration} to {save_dir} failed: {cause}; "
                      f"{safe}: {todo}")


def check_save_dir(path: str | Path, option: str = "--save") -> None:
    """Collective, at start-up: every rank creates ``path`` if needed and writes (then
    removes) a small file there, so a directory a rank cannot write is found before
    training rather than at the first save. When any rank fails, every rank raises the
    same :class:`SaveDirNotWritable` naming ``option``, the path and each rank's reason."""
    problem = None
    path = Path(path)
    try:
        probe_write(path, 4096)
    except OSError as e:
        problem = describe_disk_error(e) if e.errno in _DISK_ERRORS else repr(e)
    problems = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    failing: dict[str, list[int]] = {}
    for rank, text in enumerate(problems):
        if text is not None:
            failing.setdefault(text, []).append(rank)
    if failing:
        reasons = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {t}"
                            for t, r in failing.items())
        raise SaveDirNotWritable(
            f"{option} {path} is not writable ({reasons}); nothing was trained. Choose "
            f"another {option} directory or fix this one (every rank must be able to write it)")
