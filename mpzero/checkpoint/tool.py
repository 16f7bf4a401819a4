"""What ``python -m mpzero.checkpoint`` does to one DCP checkpoint directory (written by
:func:`mpzero.checkpoint.save_sharded`), as functions a training script's own tool can
call after it has found the directory in its layout.

- :func:`check_files`: every file DCP's metadata points into, with its size, and whether
  it holds the bytes the metadata says (MISSING / TRUNCATED otherwise).
- :func:`describe`: the grid, the optimizer and the model the checkpoint holds.
- :func:`consolidate_to` / :func:`export_to`: the full model (TP shards merged) and a
  format-2 optimizer state dict as ``.pt`` files, or the weights as safetensors.

Nothing here unpickles a file with plain pickle: DCP's metadata goes through
:mod:`mpzero.checkpoint.safe_load`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mpzero.checkpoint import dcp as mdcp
from mpzero.checkpoint import safe_load


def is_dcp_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / mdcp.META).is_file() and (p / ".metadata").is_file()


def require_dcp_dir(path: str | os.PathLike) -> Path:
    """``path`` as a Path when it is a DCP checkpoint directory; a one-line exit otherwise."""
    p = Path(path)
    if not is_dcp_dir(p):
        missing = [n for n in (mdcp.META, ".metadata") if not (p / n).is_file()]
        raise SystemExit(f"error: {p} is not a DCP checkpoint directory (no "
                         f"{' or '.join(missing)}); pass the folder that save_sharded wrote")
    return p


def check_files(directory: str | os.PathLike) -> list[tuple[str, int | None, str]]:
    """``(file, size, status)`` for the metadata and every data file DCP's metadata
    refers to: ``ok``, ``MISSING``, ``TRUNCATED`` (shorter than the last byte range the
    metadata reads from it) or ``UNREADABLE`` (the metadata itself)."""
    d = Path(directory)
    try:
        md = safe_load.read_dcp_metadata(d / ".metadata")
    except (OSError, ValueError, RuntimeError, safe_load.UnsafeCheckpointError) as e:
        return [(".metadata", None, f"UNREADABLE ({e})")]
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    rows = [(n, (d / n).stat().st_size, "ok") for n in (".metadata", mdcp.META)]
    for name, end in sorted(needed.items()):
        path = d / name
        if not path.is_file():
            rows.append((name, None, "MISSING"))
        else:
            size = path.stat().st_size
            rows.append((name, size, "ok" if size >= end else "TRUNCATED"))
    return rows


def describe(directory: str | os.PathLike) -> list[str]:
    """Lines on the grid, optimizer and model of a DCP checkpoint (from ``mpzero.json``)."""
    meta = mdcp.read_meta(directory)
    lines = [f"  grid: world {meta.get('world_size', '?')}, "
             f"tp {meta.get('tensor_model_parallel_size', '?')}"]
    if "optim" in meta:
        om = meta["optim"]
        lines.append(f"  optimizer: step {om['step']}, distributed {om['distributed_size']} x "
                     f"redundant {om['redundant_size']}, {len(om['shapes'])} params")
    if "model" in meta:
        n = sum(int(torch.Size(m["shape"]).numel()) for m in meta["model"].values())
        lines.append(f"  model: {len(meta['model'])} tensors, {n:,} elements")
    return lines


def file_table(rows: list[tuple[str, int | None, str]],
               verdict: str = "all files sound") -> tuple[list[str], bool]:
    """The rows of :func:`check_files` as lines (the last one says ``verdict`` when every
    file is sound), and whether all are."""
    lines, total = [], 0
    for name, size, status in rows:
        total += size or 0
        lines.append(f"  {name:40s} {'-' if size is None else f'{size:,}':>14s}  {status}")
    bad = [r for r in rows if r[2] != "ok"]
    lines.append(f"  {total:,} bytes; " + (verdict if not bad
                                           else f"{len(bad)} bad file(s)"))
    return lines, not bad


def load_checked(directory: str | os.PathLike) -> dict:
    """:func:`mpzero.checkpoint.consolidate` after :func:`check_files`; a damaged or
    refused checkpoint is a one-line exit (status 1) that names the file."""
    bad = [r for r in check_files(directory) if r[2] != "ok"]
    if bad:
        raise SystemExit(f"error: cannot read checkpoint {directory}: "
                         + ", ".join(f"{n} {s}" for n, _, s in bad))
    try:
        return mdcp.consolidate(directory)
    except (ValueError, OSError, RuntimeError, KeyError) as e:
        raise SystemExit(f"error: cannot read checkpoint {directory}: {e}") from None


def consolidate_to(full: dict, out: str | os.PathLike) -> list[Path]:
    """Write ``full["model"]`` (and ``full["optimizer"]`` when present) as
    ``OUT/model.pt`` / ``OUT/optimizer.pt``; the paths written."""
    o = Path(out)
    o.mkdir(parents=True, exist_ok=True)
    written = []
    for key in ("model", "optimizer"):
        if key in full:
            torch.save(full[key], o / f"{key}.pt")
            written.append(o / f"{key}.pt")
    return written


def export_to(model: dict[str, torch.Tensor], out: str | os.PathLike, dtype: str,
              source: str) -> int:
    """The floating-point tensors of a model state dict as safetensors in ``dtype``
    (``bf16`` or ``fp32``), contiguous; the number of tensors written."""
    from safetensors.torch import save_file

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    tensors = {k: v.to(dt).contiguous() for k, v in model.items() if v.is_floating_point()}
    save_file(tensors, str(out), metadata={"source": source, "dtype": dtype})
    return len(tensors)
