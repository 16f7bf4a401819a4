"""Draw ``bench/bench_step.py --json`` results: step time per setup against the copy floor.

    python bench/bench_step.py --json step.json
    python bench/plot_step.py step.json --out docs/img/step_modes.png
"""

from __future__ import annotations

import argparse
import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(result: dict, out: str) -> None:
    rows, floor, meta = result["rows"], result["floor"], result["meta"]
    names = [r["name"] for r in rows]
    ms = [r["ms"] for r in rows]
    colors = ["#9e9e9e" if n.startswith("torch") else "#1f77b4" for n in names]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 2.2))
    y = range(len(rows))[::-1]
    ax.barh(list(y), ms, color=colors)
    for yi, t in zip(y, ms):
        ax.text(t + 0.03, yi, f"{t:.2f}", va="center", fontsize=9)
    gpu = [(yi, r["gpu_ms"]) for yi, r in zip(y, rows)
           if not math.isnan(r.get("gpu_ms", float("nan")))]
    if gpu:  # the same step with the launch hidden (the GPU busy while the host enqueues it)
        ax.scatter([t for _, t in gpu], [yi for yi, _ in gpu], marker="|", s=300, color="black",
                   zorder=3, label="GPU time, host ahead (launch hidden)")
    ax.axvline(floor["ms"], color="#d62728", linestyle="--",
               label=f"copy floor, 28 B/param ({floor['ms']:.2f} ms at {floor['tbps']:.2f} TB/s)")
    # store_param_remainders at world 1 updates the parameters in place: bf16 param, int16
    # remainder, fp32 m and v read and written, bf16 grad read = 26 B/param.
    ax.axvline(floor["ms"] * 26 / 28, color="#d62728", linestyle=":",
               label=f"26 B/param, the remainders' traffic ({floor['ms'] * 26 / 28:.2f} ms)")
    ax.set_yticks(list(y), names, fontsize=9)
    ax.set_xlabel("optimizer step, ms (median)")
    ax.set_xlim(0, max(ms) * 1.15)
    ax.set_title(f"{rows[0]['params'] / 1e6:.1f}M parameters ({meta['layers']} x Linear"
                 f"({meta['hidden']}, {meta['hidden']}))\n{meta['gpu']}, torch {meta['torch']}",
                 fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.4, -0.12), fontsize=9, ncol=1)
    save(fig, out)


def save(fig, out: str) -> None:
    """Lay ``fig`` out, write it to ``out`` (120 dpi) and close it."""
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def cli(plot_fn, doc: str, source: str, default_out: str) -> None:
    """A plot script's command line: the JSON that ``source`` wrote, drawn by
    ``plot_fn(result, out)`` into ``--out``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("json", help=f"{source} --json output")
    ap.add_argument("--out", default=default_out)
    a = ap.parse_args()
    with open(a.json) as f:
        plot_fn(json.load(f), a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    cli(plot, __doc__, "bench_step.py", "step_modes.png")
