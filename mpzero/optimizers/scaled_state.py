"""16-bit optimizer state with one fp32 scale per fragment and state (``with_scaled_states``).

Each of the states of a shard (the master params, unless the master is kept exactly as
parameter + remainder, and ``exp_avg`` / ``exp_avg_sq``) is stored in 16 bits as
``x / scale``, with one fp32 ``scale`` per fragment piece, chosen at every store as
``absmax / (finfo(dtype).max / 2)`` so the stored values use the dtype's dynamic range
with a factor-2 headroom (FP8-LM style), but never below fp32's smallest normal number
(for bf16 the formula would underflow the scale). Gaps between fragments have scale 1 and stay
zero. Nothing per element is kept besides the 16-bit values: each piece is a slice of
the shard, reduced and scaled on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KEYS = ("param", "exp_avg", "exp_avg_sq")
_TINY = torch.finfo(torch.float32).tiny
MOMENTS = KEYS[1:]


class ScaledStates:
    def __init__(self, ranges: Sequence[tuple[int, int]], shard_size: int, dtype: torch.dtype,
                 device: torch.device, keys: Sequence[str] = KEYS):
        self.dtype = dtype
        self.keys = tuple(keys)
        self.has_master = "param" in self.keys
        # The shard as consecutive segments (pieces and the gaps between them), each a
        # slice: one reduction and one scaling per segment, no per-element index.
        bounds, gap, pos = [], [], 0
        for lo, hi in sorted(ranges):
            if lo > pos:
                bounds.append((pos, lo))
                gap.append(True)
            if hi > lo:
                bounds.append((lo, hi))
                gap.append(False)
            pos = max(pos, hi)
        if shard_size > pos:
            bounds.append((pos, shard_size))
            gap.append(True)
        self.bounds, self.is_gap = bounds, gap
        self.gap = torch.tensor(gap, dtype=torch.bool, device=device)  # scale pinned to 1
        self.half_max = torch.finfo(dtype).max / 2
        self.data = {k: torch.zeros(shard_size, dtype=dtype, device=device) for k in self.keys}
        self.scales = {k: torch.ones(len(bounds), dtype=torch.float32, device=device)
                       for k in self.keys}

    def pieces(self, group_ranges) -> tuple[list[tuple[int, int, int]], list[int]]:
        """The scaled pieces of the shard (not the gaps): their ``(lo, hi, group)``, each
        under the group of the ``(lo, hi, group)`` range of ``group_ranges`` that holds
        it, and their indices in the scales."""
        ranges, pieces = [], []
        for j, ((lo, hi), gap) in enumerate(zip(self.bounds, self.is_gap)):
            if not gap:
                ranges.append((lo, hi, next(g for a, b, g in group_ranges
                                            if a <= lo and hi <= b)))
                pieces.append(j)
        return ranges, pieces

    def _segments(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t[lo:hi] for lo, hi in self.bounds]

    def unscaled(self, key: str) -> torch.Tensor:
        """The fp32 values of ``key`` (a new tensor)."""
        out = self.data[key].float()
        for seg, scale in zip(self._segments(out), self.scales[key].unbind()):
            seg.mul_(scale)
        return out

    def store(self, key: str, values: torch.Tensor) -> None:
        """Store fp32 ``values`` of ``key``, choosing a new scale per piece."""
        segments = self._segments(values.float())
        absmax = torch.stack(torch._foreach_norm(segments, float("inf"))) if segments \
            else torch.zeros(0, device=values.device)
        # Not below fp32's smallest normal: bf16 has fp32's exponent range, so absmax /
        # (max / 2) underflows the fp32 scale for any absmax below 2 (a zero scale would
        # turn the stored values into inf/NaN); values / tiny still fits the dtype.
        scale = torch.where((absmax > 0) & ~self.gap,
                            (absmax / self.half_max).clamp_(min=_TINY), torch.ones_like(absmax))
        self.scales[key] = scale
        for dst, seg, s in zip(self._segments(self.data[key]), segments, scale.unbind()):
            dst.copy_(seg / s)
