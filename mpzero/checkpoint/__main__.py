"""``python -m mpzero.checkpoint``: look into and convert a DCP checkpoint directory
(written by :func:`mpzero.checkpoint.save_sharded`) offline: one process, no process
group, no GPU.

    python -m mpzero.checkpoint inspect DIR
    python -m mpzero.checkpoint consolidate DIR OUT
    python -m mpzero.checkpoint export DIR OUT.safetensors [--dtype bf16|fp32]

- ``inspect``: grid (TP, optimizer distributed x redundant), optimizer step, model size,
  and each file with its size and whether it holds every byte DCP's metadata reads from
  it. Exit status 1 when a file is missing or truncated.
- ``consolidate``: ``OUT/model.pt`` (the full model state dict, TP shards merged) and
  ``OUT/optimizer.pt`` (one format-2 DistributedFusedAdam state dict, loadable at any
  grid at TP 1, and into ``torch.optim.AdamW`` through ``to_torch_state_dict``).
- ``export``: the model weights only, as safetensors named by the model's state-dict keys
  at TP 1, each in ``--dtype`` (default bf16). Load with ``safetensors.torch.load_file``.

A training script keeps its checkpoints in its own layout (iterations, manifests,
checksums); its tool finds the DCP directory and calls :mod:`mpzero.checkpoint.tool`
(the GPT example: ``python -m examples.gpt.checkpoint_tool``).
"""

from __future__ import annotations

import argparse
import sys

from mpzero.checkpoint import tool


def inspect(path: str) -> int:
    d = tool.require_dcp_dir(path)
    print(f"checkpoint {d}")
    try:
        print("\n".join(tool.describe(d)))
    except ValueError as e:
        print(f"  {e}")
    lines, sound = tool.file_table(tool.check_files(d))
    print("\n".join(lines))
    return 0 if sound else 1


def consolidate(path: str, out: str) -> int:
    d = tool.require_dcp_dir(path)
    written = tool.consolidate_to(tool.load_checked(d), out)
    print(f"wrote {' and '.join(map(str, written))} from {d}")
    return 0


def export(path: str, out: str, dtype: str) -> int:
    d = tool.require_dcp_dir(path)
    n = tool.export_to(tool.load_checked(d)["model"], out, dtype, str(d))
    print(f"wrote {n} tensors ({dtype}) to {out} from {d}")
    return 0


def parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """The three subcommands (``inspect DIR``, ``consolidate DIR OUT``, ``export DIR OUT
    [--dtype]``); a script's own tool reuses it with its own description."""
    p = argparse.ArgumentParser(prog=prog, description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("inspect", help="grid, sizes, file checks").add_argument("dir")
    c = sub.add_parser("consolidate", help="OUT/model.pt + OUT/optimizer.pt (format 2)")
    c.add_argument("dir")
    c.add_argument("out")
    e = sub.add_parser("export", help="model weights as safetensors")
    e.add_argument("dir")
    e.add_argument("out")
    e.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser("python -m mpzero.checkpoint", __doc__).parse_args(argv)
    if a.cmd == "inspect":
        return inspect(a.dir)
    if a.cmd == "consolidate":
        return consolidate(a.dir, a.out)
    return export(a.dir, a.out, a.dtype)


if __name__ == "__main__":
    sys.exit(main())
