"""Sharded checkpoints of a model and its DistributedFusedAdam through
``torch.distributed.checkpoint`` (:mod:`mpzero.checkpoint.dcp`), reading checkpoint
files without running code from them (:mod:`mpzero.checkpoint.safe_load`), and the
``python -m mpzero.checkpoint`` tool (inspect / consolidate / export a DCP folder;
:mod:`mpzero.checkpoint.tool`)."""

from mpzero.checkpoint.dcp import (
    DCP_FORMAT,
    consolidate,
    load_sharded,
    read_meta,
    save_sharded,
)
from mpzero.checkpoint.safe_load import (
    SafeFileSystemReader,
    UnsafeCheckpointError,
    read_dcp_metadata,
    sha256_file,
    torch_load,
)

__all__ = ["DCP_FORMAT", "SafeFileSystemReader", "UnsafeCheckpointError", "consolidate",
           "load_sharded", "read_dcp_metadata", "read_meta", "save_sharded", "sha256_file",
           "torch_load"]
