"""16-bit optimizer state with one fp32 scale per fragment and state (``with_scaled_states``).

Each of the master params, ``exp_avg`` and ``exp_avg_sq`` of a shard is stored in
16 bits as ``x / scale``, with one fp32 ``scale`` per fragment piece, chosen at
every store as ``absmax / (finfo(dtype).max / 2)`` so the stored values use the
dtype's dynamic range with a factor-2 headroom (FP8-LM style). Gaps between
fragments have scale 1 and stay zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KEYS = ("param", "exp_avg", "exp_avg_sq")


class ScaledStates:
    def __init__(self, ranges: Sequence[tuple[int, int]], shard_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.dtype = dtype
        self.n = len(ranges)
        # Element -> piece id; gaps map to the extra id n (scale fixed at 1).
        ids = torch.full((shard_size,), self.n, dtype=torch.int64, device="cpu")
        for j, (lo, hi) in enumerate(ranges):
            ids[lo:hi] = j
        self.ids = ids.to(device)
        self.half_max = torch.finfo(dtype).max / 2
        self.data = {k: torch.zeros(shard_size, dtype=dtype, device=device) for k in KEYS}
        self.scales = {k: torch.ones(self.n + 1, dtype=torch.float32, device=device)
                       for k in KEYS}

    def unscaled(self, key: str) -> torch.Tensor:
        """The fp32 values of ``key``."""
        return self.data[key].float() * self.scales[key][self.ids]

    def store(self, key: str, values: torch.Tensor) -> None:
        """Store fp32 ``values`` of ``key``, choosing a new scale per piece."""
        values = values.float()
        absmax = torch.zeros(self.n + 1, dtype=torch.float32, device=values.device)
        absmax.scatter_reduce_(0, self.ids, values.abs(), reduce="amax", include_self=True)
        scale = torch.where(absmax > 0, absmax / self.half_max, torch.ones_like(absmax))
        scale[self.n] = 1.0
        self.scales[key] = scale
        self.data[key].copy_(values / scale[self.ids])
