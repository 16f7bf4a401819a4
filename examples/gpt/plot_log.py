"""Draw loss, learning rate, throughput and memory of training logs (JSONL) to a PNG.

    python -m examples.gpt.plot_log run.jsonl [other.jsonl ...] --output curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_log(path: str | Path) -> tuple[list[dict], list[dict]]:
    """``(train_records, eval_records)`` of a log; a later record for an iteration wins
    (a resumed run appends over the iterations after its checkpoint)."""
    train, evals = {}, {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            kind = rec.get("kind", "train")
            if kind in ("train", "eval"):
                (evals if kind == "eval" else train)[rec["iteration"]] = rec
    return [train[k] for k in sorted(train)], [evals[k] for k in sorted(evals)]


def plot(paths: list[str], output: str, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    (ax_loss, ax_lr), (ax_tput, ax_mem) = axes
    for path in paths:
        train, evals = read_log(path)
        label = Path(path).stem
        if train:
            its = [r["iteration"] for r in train]
            ax_loss.plot(its, [r["loss"] for r in train], label=f"{label} train")
            ax_lr.plot(its, [r["lr"] for r in train], label=label)
            ax_tput.plot(its, [r["tokens_per_s"] for r in train], label=label)
            mem = [(r["iteration"], r["memory_gib"]) for r in train if "memory_gib" in r]
            if mem:
                ax_mem.plot(*zip(*mem), label=f"{label} ({train[-1].get('memory_kind', '')})")
        if evals:
            ax_loss.plot([r["iteration"] for r in evals], [r["val_loss"] for r in evals],
                         "o--", label=f"{label} validation")
    ax_loss.set(xlabel="iteration", ylabel="loss (nats/token)", title="loss")
    ax_lr.set(xlabel="iteration", ylabel="learning rate", title="learning rate")
    ax_tput.set(xlabel="iteration", ylabel="tokens / s (whole job)", title="throughput")
    ax_mem.set(xlabel="iteration", ylabel="GiB (max over ranks)", title="peak memory")
    for ax in (ax_tput, ax_mem, ax_lr):
        ax.set_ylim(bottom=0)
        if ax.lines:  # headroom above the highest point (a flat memory curve hugs the top)
            top = max((max(line.get_ydata(), default=0) for line in ax.lines), default=0)
            if top > 0:
                ax.set_ylim(0, 1.1 * top)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m examples.gpt.plot_log``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="JSONL logs written by --log-file")
    p.add_argument("--output", "-o", default="gpt_curves.png", help="the PNG to write")
    p.add_argument("--title", default=None, help="the figure's title")
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    print(f"wrote {plot(a.logs, a.output, a.title)}")


if __name__ == "__main__":
    main()
