"""RNG state tracking for tensor parallelism.

Two streams of randomness are needed. Everything replicated across the TP ranks
(weight initialization, dropout outside TP regions) must draw the *same* numbers
on every TP rank: that is the default torch generator, seeded with ``seed``
everywhere. Dropout on activations that are split across TP ranks must draw
*different* numbers on each: that is the tracked ``"model-parallel-rng"`` state,
seeded with ``seed + 2718 + tp_rank`` and swapped in by
``get_rng_tracker().fork()``.

A tracked state holds the CPU generator state and, when CUDA is available, the
current device's CUDA generator state; ``fork()`` swaps both in and restores the
default ones afterwards, so dropout inside the fork is per-rank on either device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from mpzero.tensor_parallel.utils import resolve_tp_group, tp_rank

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
# Offset of the model-parallel seed from the default one (Megatron's constant).
_MODEL_PARALLEL_SEED_OFFSET = 2718


@dataclass
class RNGState:
    """A snapshot of the CPU generator and, when CUDA is available, the CUDA one."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None = None

    @classmethod
    def capture(cls) -> RNGState:
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        return cls(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)

    def to_dict(self) -> dict[str, torch.Tensor | None]:
        # Plain tensors in a dict load with torch.load(weights_only=True).
        return {"cpu": self.cpu.clone(), "cuda": None if self.cuda is None else self.cuda.clone()}

    @classmethod
    def from_dict(cls, state: dict[str, torch.Tensor | None]) -> RNGState:
        cuda = state.get("cuda")
        return cls(state["cpu"].clone(), None if cuda is None else cuda.clone())


def _seeded_state(seed: int) -> RNGState:
    """The generator state after ``manual_seed(seed)``, leaving the current state untouched."""
    saved = RNGState.capture()
    try:
        torch.random.default_generator.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.default_generators[torch.cuda.current_device()].manual_seed(seed)
        return RNGState.capture()
    finally:
        saved.restore()


class RNGStatesTracker:
    """Named generator states that :meth:`fork` swaps in for the duration of a block."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every tracked state and seed."""
        self.states_: dict[str, RNGState] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, dict[str, torch.Tensor | None]]:
        """A copy of the tracked states, ``{name: {"cpu": state, "cuda": state or None}}``.

        Plain tensors only, so a checkpoint holding them loads with ``weights_only=True``.
        """
        return {name: state.to_dict() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, dict[str, torch.Tensor | None]]) -> None:
        """Replace the tracked states with ones from :meth:`get_states` (seeds are kept)."""
        self.states_ = {name: RNGState.from_dict(state) for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` seeded with ``seed``; both must be new."""
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self.seeds_.add(seed)
        self.states_[name] = _seeded_state(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block with state ``name``; it advances, and the default state is restored."""
        if name not in self.states_:
            raise KeyError(
                f"RNG state {name!r} is not tracked; call model_parallel_manual_seed(seed) "
                "(or get_rng_tracker().add(name, seed)) first"
            )
        default = RNGState.capture()
        self.states_[name].restore()
        try:
            yield
        finally:
            self.states_[name] = RNGState.capture()
            default.restore()


_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (it handles CPU generators too, despite the name)."""
    return _TRACKER


get_rng_tracker = get_cuda_rng_tracker


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generators with ``seed`` and the model-parallel state per TP rank.

    Call it with the same ``seed`` on every rank of a TP group (after
    ``initialize_model_parallel``; a single process counts as TP rank 0). The default
    CPU and CUDA generators get ``seed``; the tracker is reset and its
    ``"model-parallel-rng"`` state gets ``seed + 2718 + tp_rank``.
    """
    rank = tp_rank(resolve_tp_group())
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _MODEL_PARALLEL_SEED_OFFSET + rank)


model_parallel_manual_seed = model_parallel_cuda_manual_seed


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint`` (non-reentrant) that also replays the tracked RNG.

    torch's checkpoint restores the default CPU/CUDA generators before the
    recomputation (``preserve_rng_state``), but the tracker's states live outside
    them: dropout inside ``get_rng_tracker().fork()`` would draw a fresh mask on
    recompute. The tracker's states are saved here at the forward pass, swapped in
    for the recomputation and swapped back after it (also when torch stops the
    recomputation early), so recomputed activations are bit-identical.
    """
    saved = _TRACKER.get_states()
    calls = 0

    def run(*a: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:  # the forward pass itself
            return function(*a, **kw)
        current = _TRACKER.get_states()
        _TRACKER.set_states(saved)
        try:
            return function(*a, **kw)
        finally:
            _TRACKER.set_states(current)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False,
                                             preserve_rng_state=True, **kwargs)
