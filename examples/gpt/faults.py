"""Faults of a long run, decided collectively so every rank does the same thing.

- Pre-emption: SIGTERM or SIGUSR1 (SLURM: ``#SBATCH --signal=USR1@90``) sets a flag;
  at the end of the current iteration the ranks agree (one MAX all-reduce) to save
  and exit 0. ``--exit-duration-in-mins`` goes through the same flag.
- Non-finite loss or gradient norm (``--check-for-nan-in-loss-and-grad``): the step
  is skipped on every rank (no update), with a message naming the iteration; after
  ``--max-consecutive-skipped-iters`` skips in a row the run stops with an error.
- A collective that fails (a rank died, or ``--dist-timeout`` passed) ends the rank
  with exit status 1 and a message naming the cause (see :func:`run_guarded`).

The flags of one iteration travel in a single small all-reduce over the world.
Fault injection for tests: ``MPZERO_INJECT_NAN_ITERS=3,4`` makes the loss NaN on
those iterations (read once, at import).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

_INJECT_NAN = {int(v) for v in os.environ.get("MPZERO_INJECT_NAN_ITERS", "").split(",")
               if v.strip().isdigit()}
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class TrainingAborted(RuntimeError):
    """The run cannot continue (too many skipped iterations)."""


class SaveFailed(RuntimeError):
    """Writing a checkpoint failed (disk full, file-size limit, I/O error...)."""


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
        self.signal_name = signal.Signals(signum).name  # acted on at the iteration's end

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @staticmethod
    def inject(loss: torch.Tensor, iteration: int) -> torch.Tensor:
        return loss * float("nan") if iteration in _INJECT_NAN else loss

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
