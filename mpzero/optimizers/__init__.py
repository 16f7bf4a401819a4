"""Optimizers: :class:`DistributedFusedAdam` (ZeRO-2 Adam/AdamW)."""

from mpzero.optimizers.distributed_fused_adam import DistributedFusedAdam
from mpzero.optimizers.options import OptionError

__all__ = ["DistributedFusedAdam", "OptionError"]
