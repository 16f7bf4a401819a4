"""Draw the loss and throughput curves of pretrain_gpt.py's JSONL log(s) to a PNG.

    python examples/gpt/plot_log.py run.jsonl [other.jsonl ...] --output curves.png
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

    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(11, 4))
    for path in paths:
        train, evals = read_log(path)
        label = Path(path).stem
        if train:
            its = [r["iteration"] for r in train]
            ax_loss.plot(its, [r["loss"] for r in train], label=f"{label} train")
            ax_tput.plot(its, [r["tokens_per_s"] for r in train], label=label)
        if evals:
            ax_loss.plot([r["iteration"] for r in evals], [r["val_loss"] for r in evals],
                         "o--", label=f"{label} validation")
    ax_loss.set(xlabel="iteration", ylabel="loss (nats/token)", title="loss")
    ax_tput.set(xlabel="iteration", ylabel="tokens / s (whole job)", title="throughput")
    ax_tput.set_ylim(bottom=0)
    for ax in (ax_loss, ax_tput):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="JSONL logs written by --log-file")
    p.add_argument("--output", "-o", default="gpt_curves.png")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    print(f"wrote {plot(a.logs, a.output, a.title)}")


if __name__ == "__main__":
    main()
