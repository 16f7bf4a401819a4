"""16-bit optimizer state with one fp32 scale per fragment and state (``with_scaled_states``).

Each of the states of a shard (the master params, unless the master is kept exactly as
parameter + remainder, and ``exp_avg`` / ``exp_avg_sq``) is stored in 16 bits as
``x / scale``, with one fp32 ``scale`` per fragment piece, chosen at every store as
``absmax / (finfo(dtype).max / 2)`` so the stored values use the dtype's dynamic range
with a factor-2 headroom (FP8-LM style), but never below fp32's smallest normal number
(for bf16 the formula would underflow the scale). Gaps between fragments have scale 1 and stay
zero. Nothing per element is kept besides the 16-bit values: the element -> piece map
is made per call (one bucket's shard at a time).
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
        # The shard as consecutive segments (pieces and the gaps between them); a gap's
        # scale is pinned to 1.
        lengths, gap, pos = [], [], 0
        for lo, hi in sorted(ranges):
            if lo > pos:
                lengths.append(lo - pos)
                gap.append(True)
            if hi > lo:
                lengths.append(hi - lo)
                gap.append(False)
            pos = max(pos, hi)
        if shard_size > pos:
            lengths.append(shard_size - pos)
            gap.append(True)
        self.shard_size = shard_size
        self.lengths = torch.tensor(lengths, dtype=torch.int64, device=device)
        self.gap = torch.tensor(gap, dtype=torch.bool, device=device)
        self.half_max = torch.finfo(dtype).max / 2
        self.data = {k: torch.zeros(shard_size, dtype=dtype, device=device) for k in self.keys}
        self.scales = {k: torch.ones(len(lengths), dtype=torch.float32, device=device)
                       for k in self.keys}

    def _per_element(self, per_segment: torch.Tensor) -> torch.Tensor:
        return per_segment.repeat_interleave(self.lengths, output_size=self.shard_size)

    def unscaled(self, key: str) -> torch.Tensor:
        """The fp32 values of ``key`` (a new tensor)."""
        return self.data[key].float().mul_(self._per_element(self.scales[key]))

    def store(self, key: str, values: torch.Tensor) -> None:
        """Store fp32 ``values`` of ``key``, choosing a new scale per piece."""
        values = values.float()
        n = len(self.lengths)
        ids = self._per_element(torch.arange(n, device=values.device))
        absmax = torch.zeros(n, dtype=torch.float32, device=values.device)
        absmax.scatter_reduce_(0, ids, values.abs(), reduce="amax", include_self=True)
        del ids
        # Not below fp32's smallest normal: bf16 has fp32's exponent range, so absmax /
        # (max / 2) underflows the fp32 scale for any absmax below 2 (a zero scale would
        # turn the stored values into inf/NaN); values / tiny still fits the dtype.
        scale = torch.where((absmax > 0) & ~self.gap,
                            (absmax / self.half_max).clamp_(min=_TINY), torch.ones_like(absmax))
        self.scales[key] = scale
        self.data[key].copy_(values / self._per_element(scale))
