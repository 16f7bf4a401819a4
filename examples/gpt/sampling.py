"""Sampling for the GPT example: which token windows each iteration trains on.

:class:`GlobalBatchSampler` draws the *global* batch from one seeded stream,
identically on every rank; :func:`dp_slice` is data-parallel rank ``r``'s share,
:func:`get_batch` turns window starts into ``(inputs, targets)`` tensors and
:func:`eval_starts` is the fixed evaluation set. The token stream is any 1-D
array (a memmap of a prepared split or of an indexed dataset).
"""

from __future__ import annotations

import numpy as np
import torch


class GlobalBatchSampler:
    """Window indices of each global batch, from one seeded stream (same on every rank).

    An epoch covers the non-overlapping windows of ``seq_length + 1`` tokens that
    start at a random offset in ``[0, seq_length)``, in a random order; both come
    from ``np.random.default_rng([seed, epoch])``. A global batch is the next
    ``global_batch_size`` windows, continuing into the next epoch when needed. The
    state (epoch, index into the epoch) is what a checkpoint stores.
    """

    def __init__(self, num_tokens: int, seq_length: int, global_batch_size: int,
                 seed: int) -> None:
        if num_tokens < 2 * (seq_length + 1):
            raise ValueError(f"{num_tokens} tokens are too few for sequences of {seq_length}")
        self.num_tokens, self.seq_length = num_tokens, seq_length
        self.global_batch_size, self.seed = global_batch_size, seed
        self.epoch, self.index = 0, 0
        self._cache: tuple[int, np.ndarray] | None = None

    def _epoch_starts(self, epoch: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            offset = int(rng.integers(self.seq_length))
            n = (self.num_tokens - offset) // (self.seq_length + 1)
            starts = offset + (self.seq_length + 1) * rng.permutation(n)
            self._cache = (epoch, starts)
        return self._cache[1]

    def next_batch(self) -> np.ndarray:
        """Start offsets (tokens) of the next global batch's sequences, ``[G]`` int64."""
        out = []
        need = self.global_batch_size
        while need:
            starts = self._epoch_starts(self.epoch)
            take = starts[self.index:self.index + need]
            out.append(take)
            need -= len(take)
            self.index += len(take)
            if self.index >= len(starts):
                self.epoch, self.index = self.epoch + 1, 0
        return np.concatenate(out).astype(np.int64)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "seq_length": self.seq_length, "global_batch_size": self.global_batch_size,
                "num_tokens": self.num_tokens}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_length", "num_tokens"):
            if state[key] != getattr(self, key):
                raise ValueError(f"data sampler state was saved with {key}={state[key]}, "
                                 f"this run has {getattr(self, key)}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def eval_starts(num_tokens: int, seq_length: int, count: int) -> np.ndarray:
    """The first ``count`` windows of a split (wrapping around): a fixed evaluation set."""
    n = (num_tokens - 1) // (seq_length + 1)
    return (seq_length + 1) * (np.arange(count) % n)


def get_batch(tokens: np.ndarray, starts: np.ndarray, seq_length: int,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` int64 ``[len(starts), seq_length]``; targets shifted by one."""
    rows = np.stack([np.asarray(tokens[s:s + seq_length + 1], dtype=np.int64) for s in starts])
    batch = torch.from_numpy(rows)
    if torch.device(device).type == "cuda":
        batch = batch.pin_memory().to(device, non_blocking=True)
    return batch[:, :-1], batch[:, 1:]


def dp_slice(starts: np.ndarray, dp_rank: int, dp_size: int) -> np.ndarray:
    """Data-parallel rank ``dp_rank``'s contiguous share of a global batch."""
    per = len(starts) // dp_size
    return starts[dp_rank * per:(dp_rank + 1) * per]
