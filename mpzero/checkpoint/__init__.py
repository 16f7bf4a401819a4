"""Sharded checkpoints of a model and its DistributedFusedAdam through
``torch.distributed.checkpoint`` (:mod:`mpzero.checkpoint.dcp`), and the
``python -m mpzero.checkpoint`` tool (inspect / consolidate / export)."""

from mpzero.checkpoint.dcp import (
    DCP_FORMAT,
    consolidate,
    load_sharded,
    read_meta,
    save_sharded,
)

__all__ = ["DCP_FORMAT", "consolidate", "load_sharded", "read_meta", "save_sharded"]
