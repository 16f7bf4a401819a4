"""Reading checkpoint files without running code from them.

A checkpoint is data. Two of the formats mpzero reads are pickles, and a pickle can
name any importable callable and have the unpickler call it, so a file handed to
us (or a file replaced in a shared directory) could run code on every rank that
loads it. The sha256 checksums of ``manifest.json`` do not help: the manifest is
not signed, and whoever can replace a file can rewrite its checksum too.

- ``torch.save`` files (model shards, RNG states, optimizer shards): always
  :func:`torch_load`, i.e. ``torch.load(..., weights_only=True)``, whose unpickler
  builds only tensors, plain containers and numbers. A file it refuses becomes an
  :class:`UnsafeCheckpointError` that says so, instead of torch's advice to turn
  ``weights_only`` off.
- DCP's ``.metadata`` (which ``torch.distributed.checkpoint.FileSystemReader``
  reads with a plain ``pickle.load``): :class:`SafeFileSystemReader`, whose
  unpickler resolves only the classes DCP's own metadata is made of
  (:data:`ALLOWED_GLOBALS`, plus torch dtypes) and refuses every other global
  before anything is called. It also refuses entries that DCP would load with
  ``torch.load(weights_only=False)`` (non-tensor "bytes" entries, which mpzero never
  writes) and storage paths that leave the checkpoint directory.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata

__all__ = ["ALLOWED_GLOBALS", "SafeFileSystemReader", "UnsafeCheckpointError", "sha256_file",
           "read_dcp_metadata", "torch_load"]


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something other than plain data (it would have run code,
    or named objects that mpzero never writes); it was not loaded."""


# Every global a DCP ``.metadata`` written by torch.distributed.checkpoint (torch 2.x,
# FileSystemWriter) refers to, found by unpickling the metadata of real checkpoints
# (model and optimizer shards, fp32 and bf16, TP 1/2/4) and listing what was looked up.
# Torch dtypes (torch.float32, torch.bfloat16, ...) are allowed by type, see
# _RestrictedUnpickler.find_class. Each entry is a dataclass, an enum, a path class,
# torch.Size or the layout lookup torch registers for pickling torch.strided: none of
# them does anything but store its arguments.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout's registered reducer
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
})


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that can build DCP's metadata and nothing else: every global is
    checked against :data:`ALLOWED_GLOBALS` before it is imported or called; there are
    no persistent ids (the default ``persistent_load`` raises)."""

    def __init__(self, file, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        # torch.__dict__, not getattr: torch's module __getattr__ imports submodules lazily.
        if module == "torch" and isinstance(torch.__dict__.get(name), torch.dtype):
            return torch.__dict__[name]
        if (module, name) not in ALLOWED_GLOBALS:
            raise UnsafeCheckpointError(
                f"{self.source}: refused to unpickle {module}.{name}: DCP metadata holds "
                "only torch.distributed.checkpoint's metadata classes; this file was not "
                "written by torch.distributed.checkpoint (crafted or corrupted) and is not "
                "loaded")
        return super().find_class(module, name)


def _check_metadata(md: Any, source: str) -> dcp_metadata.Metadata:
    if not isinstance(md, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{source}: holds a {type(md).__name__}, not DCP "
                                    "checkpoint metadata")
    if not isinstance(md.state_dict_metadata, dict):
        raise UnsafeCheckpointError(f"{source}: malformed DCP metadata (no state dict index)")
    for fqn, entry in md.state_dict_metadata.items():
        # DCP loads "bytes" entries with torch.load(weights_only=False): code. mpzero
        # saves tensors only, so such an entry is never ours.
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise UnsafeCheckpointError(
                f"{source}: entry {fqn!r} is a {type(entry).__name__}, not a tensor; mpzero "
                "checkpoints hold tensors only (DCP would unpickle it unrestricted), so "
                "the checkpoint is not loaded")
    for index, info in (md.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if (not isinstance(rel, str) or not rel or "/" in rel or "\\" in rel
                or rel in (".", "..")):
            raise UnsafeCheckpointError(
                f"{source}: storage of {getattr(index, 'fqn', index)!r} points to "
                f"{rel!r}, outside the checkpoint directory")
    return md


def read_dcp_metadata(path: str | os.PathLike) -> dcp_metadata.Metadata:
    """DCP's ``.metadata`` file at ``path``, unpickled with the restricted unpickler.
    Raises :class:`UnsafeCheckpointError` (nothing is executed) for anything else."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        md = _RestrictedUnpickler(io.BytesIO(data), str(path)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or garbled: a bad file, said so
        raise UnsafeCheckpointError(f"{path}: not readable as DCP metadata ({e!r})") from e
    return _check_metadata(md, str(path))


class SafeFileSystemReader(FileSystemReader):
    """``torch.distributed.checkpoint.FileSystemReader`` that reads ``.metadata`` with
    :func:`read_dcp_metadata` instead of ``pickle.load``. Pass it as
    ``dcp.load(..., storage_reader=SafeFileSystemReader(directory))``; the tensor data
    itself is read by DCP with ``torch.load(weights_only=True)`` already."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        md = read_dcp_metadata(Path(self.path) / name)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return md


def weights_only_reason(e: Exception) -> str:
    """What torch's weights-only unpickler objected to (its message goes on to suggest
    loading without ``weights_only``, which is exactly what must not be done here)."""
    text = str(e)
    marker = "WeightsUnpickler error:"
    if marker in text:
        reason = text.split(marker, 1)[1].strip().split(". ")[0]
    else:
        reason = (text.strip().splitlines() or ["unreadable"])[0]
    return reason.replace("GLOBAL ", "").rstrip(".")


def torch_load(path: str | os.PathLike, *, mmap: bool = False) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``; a file the restricted
    unpickler refuses raises :class:`UnsafeCheckpointError` saying what happened.
    ``mmap=True`` maps the tensors instead of reading them (a cheap check of the pickle)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{path}: refused by torch.load(weights_only=True) ({weights_only_reason(e)}): it "
            "holds objects other than tensors, numbers and plain containers, which mpzero "
            "never writes (a crafted or foreign file); it was not unpickled") from None


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of a file's bytes, read in 4 MiB chunks (the checksums that
    checkpoint and data manifests record)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
