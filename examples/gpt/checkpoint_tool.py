"""``python -m examples.gpt.checkpoint_tool``: look into and convert the example's
checkpoints offline (one process, no process group, no GPU).

    python -m examples.gpt.checkpoint_tool inspect DIR
    python -m examples.gpt.checkpoint_tool consolidate DIR OUT
    python -m examples.gpt.checkpoint_tool export DIR OUT.safetensors [--dtype bf16|fp32]

``DIR`` is a ``--save`` directory (its newest iteration is used; ``inspect`` lists them
all) or one ``iter_NNNNNNN`` directory. Every file is checked against the sha256 the
manifest records before anything is read. ``consolidate`` writes ``OUT/model.pt`` (TP
shards merged) and ``OUT/optimizer.pt`` (format 2); ``export`` the weights as
safetensors. The DCP part (``--ckpt-format torch_dist``) is read by
:mod:`mpzero.checkpoint.tool`, as ``python -m mpzero.checkpoint`` reads a bare DCP folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from mpzero.checkpoint import safe_load
from mpzero.checkpoint import tool as dcp_tool
from mpzero.checkpoint.__main__ import parser

from .checkpointing import DCP_DIR, CheckpointError, list_checkpoints, read_manifest


def resolve(path: str | Path) -> Path:
    """The iteration directory ``path`` names (the newest one of a save directory)."""
    p = Path(path)
    if (p / "manifest.json").exists():
        return p
    its = list_checkpoints(p)
    if its:
        return its[0]
    raise SystemExit(f"error: {p} is not a checkpoint of the example (no manifest.json or "
                     "iter_* directories)")


def check(ckpt: Path) -> list[tuple[str, int | None, str]]:
    """``(file, size, status)`` for every file of the manifest: ok / MISMATCH / MISSING
    (``manifest.json`` UNREADABLE or MISSING when there is no valid manifest)."""
    try:
        manifest = read_manifest(ckpt)
    except CheckpointError:
        status = "UNREADABLE" if (ckpt / "manifest.json").exists() else "MISSING"
        return [("manifest.json", None, status)]
    rows = []
    for name, digest in sorted(manifest["files"].items()):
        path = ckpt / name
        if not path.exists():
            rows.append((name, None, "MISSING"))
        else:
            rows.append((name, path.stat().st_size,
                         "ok" if safe_load.sha256_file(path) == digest else "MISMATCH"))
    return rows


def inspect(path: str) -> int:
    root = Path(path)
    if not (root / "manifest.json").exists() and list_checkpoints(root):
        print(f"{root}: {len(list_checkpoints(root))} checkpoint(s)")
        try:
            print(f"latest -> {(root / 'latest').read_bytes()[:80]!r}")
        except OSError:
            print("latest: none")
    ckpt = resolve(path)
    print(f"checkpoint {ckpt}")
    try:
        m = read_manifest(ckpt)
        print(f"  iteration {m['iteration']}, format {m.get('ckpt_format', 'torch')}, grid: "
              f"world {m['world_size']}, tp {m['tensor_model_parallel_size']}, "
              f"dp {m['data_parallel_size']}")
    except (CheckpointError, KeyError) as e:
        print(f"  {e}")
    if dcp_tool.is_dcp_dir(ckpt / DCP_DIR):
        try:
            print("\n".join(dcp_tool.describe(ckpt / DCP_DIR)[1:]))  # the grid is above
        except ValueError as e:
            print(f"  {e}")
    lines, sound = dcp_tool.file_table(check(ckpt), "all checksums verified")
    print("\n".join(lines))
    return 0 if sound else 1


def load(ckpt: Path) -> dict:
    """``{"model": full state dict, "optimizer": format 2}`` of a verified checkpoint (the
    torch format's optimizer only at TP 1); a damaged one is a one-line exit."""
    bad = [r for r in check(ckpt) if r[2] != "ok"]
    if bad:
        raise SystemExit(f"error: cannot read checkpoint {ckpt}: "
                         + ", ".join(f"{n} {s}" for n, _, s in bad))
    if dcp_tool.is_dcp_dir(ckpt / DCP_DIR):
        return dcp_tool.load_checked(ckpt / DCP_DIR)
    tp = read_manifest(ckpt)["tensor_model_parallel_size"]
    try:
        shards = [safe_load.torch_load(ckpt / f"model_tp{t:02d}.pt") for t in range(tp)]
    except (ValueError, OSError, RuntimeError) as e:
        raise SystemExit(f"error: cannot read checkpoint {ckpt}: {e}") from None
    dims = shards[0]["partition_dims"]
    out = {"model": {k: v if dims.get(k) is None else
                     torch.cat([s["model"][k] for s in shards], dims[k])
                     for k, v in shards[0]["model"].items()}}
    if tp == 1:
        out["optimizer"] = shards[0]["optimizer"]
    else:
        print("note: torch-format optimizer states of TP > 1 are not merged (use "
              "--ckpt-format torch_dist); writing the model only", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    a = parser("python -m examples.gpt.checkpoint_tool", __doc__).parse_args(argv)
    if a.cmd == "inspect":
        return inspect(a.dir)
    ckpt = resolve(a.dir)
    full = load(ckpt)
    if a.cmd == "consolidate":
        written = dcp_tool.consolidate_to(full, a.out)
        print(f"wrote {' and '.join(map(str, written))} from {ckpt}")
    else:
        n = dcp_tool.export_to(full["model"], a.out, a.dtype, str(ckpt))
        print(f"wrote {n} tensors ({a.dtype}) to {a.out} from {ckpt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
