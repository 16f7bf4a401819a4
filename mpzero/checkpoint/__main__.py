"""``python -m mpzero.checkpoint``: look into and convert checkpoints offline (one process,
no process group, no GPU).

    python -m mpzero.checkpoint inspect DIR
    python -m mpzero.checkpoint consolidate DIR OUT
    python -m mpzero.checkpoint export DIR OUT.safetensors [--dtype bf16|fp32]

``DIR`` is a ``--save`` directory of the GPT example (its newest iteration is used;
``inspect`` lists them all), one ``iter_NNNNNNN`` directory, or a bare DCP directory
written by :func:`mpzero.checkpoint.save_sharded`.

- ``inspect``: iteration, format, grid (TP, DP, optimizer distributed x redundant),
  each file's size and whether its sha256 matches the manifest. Exit status 1 when
  a file is missing or corrupted.
- ``consolidate``: ``OUT/model.pt`` (the full model state dict, TP shards merged) and
  ``OUT/optimizer.pt`` (one format-2 DistributedFusedAdam state dict, loadable at any
  grid at TP 1, and into ``torch.optim.AdamW`` through ``to_torch_state_dict``).
- ``export``: the model weights only as safetensors; tensor names are the model's
  state-dict keys at TP 1 (for the GPT example: ``embedding.weight``,
  ``blocks.N.attn.qkv.weight``, ...; ``model.state_dict()`` of a TP-1 model names them),
  each in ``--dtype`` (default bf16), contiguous. Load with
  ``safetensors.torch.load_file(OUT)``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

from mpzero.checkpoint import dcp as mdcp
from mpzero.checkpoint import safe_load

_ITER = re.compile(r"iter_\d{7,}")


def _iterations(root: Path) -> list[Path]:
    return sorted((d for d in root.iterdir() if _ITER.fullmatch(d.name)),
                  key=lambda d: int(d.name[5:]), reverse=True)


def resolve(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names (the newest iteration of a save dir)."""
    p = Path(path)
    if (p / "manifest.json").exists() or (p / mdcp.META).exists():
        return p
    if p.is_dir():
        its = _iterations(p)
        if its:
            return its[0]
    raise SystemExit(f"{p}: not a checkpoint (no manifest.json, {mdcp.META} or iter_* dirs)")


def _manifest(ckpt: Path) -> dict | None:
    try:
        return json.loads((ckpt / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def _dcp_dir(ckpt: Path) -> Path | None:
    if (ckpt / mdcp.META).exists():
        return ckpt
    if (ckpt / "dcp" / mdcp.META).exists():
        return ckpt / "dcp"
    return None


def check(ckpt: Path) -> list[tuple[str, int | None, str]]:
    """``(file, size, status)`` for every file of the manifest: ok / MISMATCH / MISSING."""
    manifest = _manifest(ckpt)
    rows = []
    if manifest is None:
        if (ckpt / "manifest.json").exists():
            return [("manifest.json", None, "UNREADABLE")]
        if _dcp_dir(ckpt) is None:
            return [("manifest.json", None, "MISSING")]
        return [(str(f.relative_to(ckpt)), f.stat().st_size, "no checksum")
                for f in sorted(ckpt.iterdir()) if f.is_file()]
    for name, digest in sorted(manifest.get("files", {}).items()):
        path = ckpt / name
        if not path.exists():
            rows.append((name, None, "MISSING"))
        else:
            rows.append((name, path.stat().st_size,
                         "ok" if safe_load.sha256_file(path) == digest else "MISMATCH"))
    return rows


def inspect(path: str) -> int:
    root = Path(path)
    if root.is_dir() and not (root / "manifest.json").exists() and _iterations(root):
        print(f"{root}: {len(_iterations(root))} checkpoint(s)")
        try:
            print(f"latest -> {(root / 'latest').read_bytes()[:80]!r}")
        except OSError:
            print("latest: none")
    ckpt = resolve(path)
    manifest = _manifest(ckpt) or {}
    dcp_dir = _dcp_dir(ckpt)
    meta = {}
    if dcp_dir is not None:
        try:
            meta = mdcp.read_meta(dcp_dir)
        except ValueError as e:
            print(f"  {e}")
    print(f"checkpoint {ckpt}")
    print(f"  iteration {manifest.get('iteration', '?')}, format "
          f"{manifest.get('ckpt_format', 'torch' if manifest else 'torch_dist (bare DCP)')}")
    tp = manifest.get("tensor_model_parallel_size", meta.get("tensor_model_parallel_size", "?"))
    print(f"  grid: world {manifest.get('world_size', meta.get('world_size', '?'))}, tp {tp}, "
          f"dp {manifest.get('data_parallel_size', '?')}")
    if "optim" in meta:
        om = meta["optim"]
        print(f"  optimizer: step {om['step']}, distributed {om['distributed_size']} x "
              f"redundant {om['redundant_size']}, {len(om['shapes'])} params")
    if "model" in meta:
        n = sum(int(torch.Size(m["shape"]).numel()) for m in meta["model"].values())
        print(f"  model: {len(meta['model'])} tensors, {n:,} elements")
    rows = check(ckpt)
    total = 0
    for name, size, status in rows:
        total += size or 0
        print(f"  {name:40s} {'-' if size is None else f'{size:,}':>14s}  {status}")
    bad = [r for r in rows if r[2] in ("MISSING", "MISMATCH", "UNREADABLE")]
    verdict = "all checksums verified" if not bad else f"{len(bad)} bad file(s)"
    print(f"  {total:,} bytes; {verdict}")
    return 1 if bad else 0


def _load_verified(ckpt: Path) -> dict:
    bad = [r for r in check(ckpt) if r[2] in ("MISSING", "MISMATCH", "UNREADABLE")]
    if bad:
        raise SystemExit(f"{ckpt}: " + ", ".join(f"{n} {s}" for n, _, s in bad))
    dcp_dir = _dcp_dir(ckpt)
    if dcp_dir is not None:
        return mdcp.consolidate(dcp_dir)
    manifest = _manifest(ckpt)
    tp = manifest["tensor_model_parallel_size"]
    shards = [safe_load.torch_load(ckpt / f"model_tp{t:02d}.pt") for t in range(tp)]
    dims = shards[0]["partition_dims"]
    model = {k: v if dims.get(k) is None else torch.cat([s["model"][k] for s in shards],
                                                          dims[k])
             for k, v in shards[0]["model"].items()}
    out = {"model": model}
    if tp == 1:
        out["optimizer"] = shards[0]["optimizer"]
    else:
        print("note: torch-format optimizer states of TP > 1 are not merged (use "
              "--ckpt-format torch_dist); writing the model only", file=sys.stderr)
    return out


def _load_or_exit(ckpt: Path) -> dict:
    """:func:`_load_verified`, with a refused or unreadable checkpoint as a one-line exit
    (status 1) that names the file, not a traceback."""
    try:
        return _load_verified(ckpt)
    except (ValueError, OSError, RuntimeError, KeyError) as e:
        raise SystemExit(f"error: cannot read checkpoint {ckpt}: {e}") from None


def consolidate(path: str, out: str) -> int:
    ckpt = resolve(path)
    full = _load_or_exit(ckpt)
    o = Path(out)
    o.mkdir(parents=True, exist_ok=True)
    torch.save(full["model"], o / "model.pt")
    if "optimizer" in full:
        torch.save(full["optimizer"], o / "optimizer.pt")
    print(f"wrote {o / 'model.pt'}" + (f" and {o / 'optimizer.pt'}" if "optimizer" in full
                                       else "") + f" from {ckpt}")
    return 0


def export(path: str, out: str, dtype: str) -> int:
    from safetensors.torch import save_file

    ckpt = resolve(path)
    model = _load_or_exit(ckpt)["model"]
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    tensors = {k: v.to(dt).contiguous() for k, v in model.items() if v.is_floating_point()}
    save_file(tensors, out, metadata={"source": str(ckpt), "dtype": dtype})
    print(f"wrote {len(tensors)} tensors ({dtype}) to {out} from {ckpt}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpzero.checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("inspect", help="iteration, grid, sizes, checksums").add_argument("dir")
    c = sub.add_parser("consolidate", help="OUT/model.pt + OUT/optimizer.pt (format 2)")
    c.add_argument("dir")
    c.add_argument("out")
    e = sub.add_parser("export", help="model weights as safetensors")
    e.add_argument("dir")
    e.add_argument("out")
    e.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    a = p.parse_args(argv)
    if a.cmd == "inspect":
        return inspect(a.dir)
    if a.cmd == "consolidate":
        return consolidate(a.dir, a.out)
    return export(a.dir, a.out, a.dtype)


if __name__ == "__main__":
    sys.exit(main())
