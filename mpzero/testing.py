"""Run functions on real multi-process worlds inside tests.

A :class:`World` is a set of ``size`` spawned processes that joined one
``torch.distributed`` process group (gloo on CPU, NCCL on CUDA) and then wait for
work. Starting a world costs seconds (each rank imports torch), so worlds are
kept alive and reused: :func:`run_on_world` sends a picklable, module-level
function to every rank of a cached world of that size and returns the per-rank
results. Many checks then share one world.

Failure handling: a rank that raises returns its traceback, which becomes the
:class:`RankError` raised in the test. A world whose ranks do not all answer in
time is killed (so a hang fails the test, with every rank's Python stack in the
error), and the next call starts a fresh one. After each function the ranks
tear down :mod:`mpzero.parallel_state` so tests do not leak groups into each other.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "RankError",
    "World",
    "run_on_world",
    "close_worlds",
    "requires_cuda",  # noqa: F822 - provided lazily by __getattr__ (imports pytest)
    "cuda_available",
    "skip_module_without_extension",
]

DEFAULT_TIMEOUT = float(os.environ.get("MPZERO_TEST_TIMEOUT", "120"))
# How long to wait for the other ranks once one rank failed (they may be blocked
# in a collective with it) before the world is killed.
FAILURE_GRACE = 3.0
# Cached worlds may hold at most this many processes together (2 cores, 24 GiB).
MAX_CACHED_PROCESSES = 8


def cuda_available() -> bool:
    return torch.cuda.is_available()


def __getattr__(name: str):
    # ``requires_cuda`` is a pytest marker; pytest is imported only when it is asked for,
    # so this module (World, run_on_world) works without pytest installed.
    if name == "requires_cuda":
        import pytest

        return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def skip_module_without_extension() -> None:
    """Skip the calling test module (pytest) unless a CUDA device and the built
    extension ``mpzero._C`` are both there."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device", allow_module_level=True)
    try:
        from mpzero import _C  # noqa: F401
    except ImportError as e:  # depends on the build
        pytest.skip(f"mpzero._C not built ({e})", allow_module_level=True)


class RankError(RuntimeError):
    """One or more ranks of a :class:`World` raised; the message holds their tracebacks."""


def _worker(rank: int, size: int, backend: str, host: str, port: int, conn, results,
            stack_dir: str, pg_timeout: float) -> None:
    """Entry point of a world's rank: join the process group, then serve calls."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    stack_file = open(os.path.join(stack_dir, f"rank{rank}.txt"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(size), MASTER_ADDR=host, MASTER_PORT=str(port))
    device_id = None
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device_id = torch.device("cuda", torch.cuda.current_device())
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=pg_timeout), device_id=device_id)
    results.put((rank, "ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        call_id, payload, path = msg
        for p in path:
            if p not in sys.path:
                sys.path.append(p)
        try:
            fn, args, kwargs = pickle.loads(payload)
            out = fn(*args, **kwargs)
            try:
                blob = pickle.dumps(out)
            except Exception as e:  # noqa: BLE001
                raise TypeError(f"result of {fn!r} is not picklable: {e}") from e
            results.put((rank, call_id, ("ok", blob)))
        except BaseException:  # noqa: BLE001 - report everything, the parent decides
            results.put((rank, call_id, ("error", traceback.format_exc())))
        finally:
            _reset_rank_state()
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _reset_rank_state() -> None:
    from mpzero import parallel_state

    try:
        parallel_state.destroy_model_parallel()
    except Exception:  # noqa: BLE001 - a broken group must not break the next test
        parallel_state._STATE = None


class World:
    """``size`` processes in one process group, serving function calls.

    >>> with World(2) as w:
    ...     w.run(some_module_level_fn, arg)   # -> [result_rank0, result_rank1]
    """

    def __init__(self, size: int, backend: str = "gloo", *, start_timeout: float = 120.0,
                 pg_timeout: float = 300.0):
        import torch.distributed as dist

        if size < 1:
            raise ValueError(f"world size must be positive, got {size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.size, self.backend = size, backend
        self._call_id = 0
        self._closed = False
        # The parent hosts the rendezvous store on a free port picked by the OS.
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._stack_dir = tempfile.mkdtemp(prefix="mpzero-world-")
        _STACK_DIRS.add(self._stack_dir)
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._conns, self._procs = [], []
        try:
            self._start(ctx, size, backend, pg_timeout, start_timeout)
        except BaseException:
            self.kill()  # also removes the temporary directory
            raise

    def _start(self, ctx, size: int, backend: str, pg_timeout: float,
               start_timeout: float) -> None:
        for rank in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(rank, size, backend, "127.0.0.1", self._store.port, child, self._results,
                      self._stack_dir, pg_timeout),
                daemon=True,
                name=f"mpzero-world{size}-rank{rank}",
            )
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        ready = self._collect("ready", start_timeout, what="start")
        if len(ready) != size:  # pragma: no cover - _collect raises first
            raise RuntimeError("world failed to start")

    # -- lifecycle -----------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._closed and all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for c in self._conns:
            try:
                c.send(None)
            except Exception:  # noqa: BLE001
                pass
        deadline = time.time() + 5
        for p in self._procs:
            p.join(max(0.0, deadline - time.time()))
        self.kill()

    def kill(self) -> None:
        self._closed = True
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5)
        _remove_dir(self._stack_dir)

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- calls ---------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args, timeout: float | None = None,
            **kwargs) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` must be importable by name (a module-level function). Raises
        :class:`RankError` with the tracebacks of failing ranks, or :class:`TimeoutError`
        (with each rank's stack) when not all ranks answer within ``timeout`` seconds.
        """
        if not self.alive:
            raise RuntimeError("this world is closed or lost a process")
        self._call_id += 1
        payload = pickle.dumps((fn, args, kwargs))
        for c in self._conns:
            c.send((self._call_id, payload, list(sys.path)))
        got = self._collect(self._call_id, timeout or DEFAULT_TIMEOUT,
                            what=getattr(fn, "__qualname__", repr(fn)))
        return [pickle.loads(got[r][1]) for r in range(self.size)]

    def _collect(self, tag, timeout: float, what: str) -> dict[int, Any]:
        got: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.time() + timeout
        while len(got) + len(errors) < self.size:
            remaining = deadline - time.time()
            if remaining <= 0:
                break
            try:
                rank, call_id, result = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead and not errors:
                    codes = {r: self._procs[r].exitcode for r in dead}
                    self.kill()
                    raise RankError(f"{what}: rank(s) {dead} died (exit codes {codes})") from None
                continue
            if call_id != tag:
                continue  # a stale answer from a call that timed out earlier
            if tag == "ready":
                got[rank] = None
            elif result[0] == "ok":
                got[rank] = result
            else:
                errors[rank] = result[1]
                # The others may be blocked in a collective with the failed rank.
                deadline = min(deadline, time.time() + FAILURE_GRACE)
        if errors:
            missing = sorted(set(range(self.size)) - set(got) - set(errors))
            if missing:
                self.kill()  # the others are stuck in collectives with the failed rank
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankError(f"{what} failed on rank(s) {sorted(errors)} of {self.size}:\n{text}")
        if len(got) < self.size:
            missing = sorted(set(range(self.size)) - set(got))
            stacks = self._dump_stacks()
            self.kill()
            raise TimeoutError(
                f"{what}: rank(s) {missing} of world {self.size} did not finish within "
                f"{timeout:.0f} s (world killed). Stacks:\n{stacks}"
            )
        return got

    def _dump_stacks(self) -> str:
        for p in self._procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGUSR1)
                except OSError:
                    pass
        time.sleep(0.5)
        out = []
        for r in range(self.size):
            try:
                with open(os.path.join(self._stack_dir, f"rank{r}.txt")) as f:
                    text = f.read()
            except OSError:
                text = "(no stack)"
            out.append(f"--- rank {r} ---\n{text[-4000:]}")
        return "\n".join(out)


_WORLDS: OrderedDict[tuple[int, str], World] = OrderedDict()
# Every /tmp/mpzero-world-* this process made and has not removed yet (atexit removes them).
_STACK_DIRS: set[str] = set()


def _remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    _STACK_DIRS.discard(path)


def get_world(size: int, backend: str = "gloo") -> World:
    """A live cached world of ``size`` ranks (started if needed, least recently used evicted)."""
    key = (size, backend)
    world = _WORLDS.get(key)
    if world is not None and not world.alive:
        world.kill()
        del _WORLDS[key]
        world = None
    if world is None:
        while _WORLDS and sum(w.size for w in _WORLDS.values()) + size > MAX_CACHED_PROCESSES:
            _, old = _WORLDS.popitem(last=False)
            old.close()
        world = World(size, backend)
        _WORLDS[key] = world
    _WORLDS.move_to_end(key)
    return world


def run_on_world(size: int, fn: Callable[..., Any], *args, backend: str = "gloo",
                 timeout: float | None = None, **kwargs) -> list[Any]:
    """Run ``fn`` on every rank of a cached ``size``-rank world; return per-rank results."""
    return get_world(size, backend).run(fn, *args, timeout=timeout, **kwargs)


def close_worlds() -> None:
    """Close every cached world and remove the temporary directories of all worlds."""
    try:
        while _WORLDS:
            _, w = _WORLDS.popitem()
            w.close()
    finally:
        for path in list(_STACK_DIRS):
            _remove_dir(path)


atexit.register(close_worlds)


def autograd_node_names(t: torch.Tensor) -> str:
    """The class names of every autograd node behind ``t``, joined by spaces (which ops a
    forward recorded: e.g. whether a fused path ran)."""
    seen, todo, names = set(), [t.grad_fn], []
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return " ".join(names)
