"""Draw ``bench/bench_gpt_peers.py --json`` results: MFU and peak memory per setup.

    python bench/bench_gpt_peers.py --compile --openai-gelu --grad-acc 4 --json peers.json
    python bench/plot_gpt_peers.py peers.json --out docs/img/gpt_peers.png

Two panels side by side, one bar per setup in the JSON's order (rows with an error are
left out): MFU (iteration ms and the optimizer step's share written on each bar), and the
peak memory. mpzero's setups are blue, the peers grey. Rows without an MFU (CPU runs) are
drawn as tokens/s instead.
"""

from __future__ import annotations

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_step import cli, save  # noqa: E402

OURS = ("dfa", "dfa-remainders", "adamw")  # the example's own setups


def _title(report: dict, rows: list[dict]) -> str:
    s = report["shape"]
    first = rows[0]
    what = (f"GPT {first['parameters'] / 1e9:.2f}B ({s['num_layers']} x {s['hidden_size']}, "
            f"seq {s['seq_length']}, micro-batch {s['micro_batch_size']}, "
            f"grad-acc {report.get('grad_acc', first.get('grad_acc', 1))})")
    how = [first["device"], f"world {first['world']}"]
    if first.get("compile"):
        how.append(f"compiled ({first['compile']})")
    if first.get("openai_gelu"):
        how.append("tanh GELU")
    return what + "\n" + ", ".join(how)


def plot(report: dict, out: str) -> None:
    rows = [r for r in report["rows"] if "error" not in r]
    if not rows:
        raise SystemExit("plot_gpt_peers: no row without an error in the JSON")
    names = [r["setup"] for r in rows]
    colors = ["#1f77b4" if n in OURS else "#9e9e9e" for n in names]
    mfu = all(r.get("mfu") is not None for r in rows)
    speed = [100 * r["mfu"] if mfu else r["tokens_per_s"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.5 * len(rows) + 2.4),
                                      gridspec_kw={"width_ratios": [3, 2]})
    y = list(range(len(rows)))[::-1]
    left.barh(y, speed, color=colors)
    for yi, v, r in zip(y, speed, rows):
        label = f"{v:.1f}%" if mfu else f"{v:,.0f}"
        left.text(v, yi, f" {label}  ({r['iter_ms']:.1f} ms/iter, step "
                         f"{100 * r['step_share']:.1f}%)", va="center", fontsize=8)
    left.set_yticks(y, names, fontsize=9)
    left.set_xlim(0, max(speed) * 1.6)
    left.set_xlabel("MFU, % of the GPU's dense bf16 peak" if mfu else "tokens/s")
    peaks = [r["peak_gib"] for r in rows]
    right.barh(y, peaks, color=colors)
    for yi, v in zip(y, peaks):
        right.text(v, yi, f" {v:.2f}", va="center", fontsize=8)
    right.set_yticks(y, [""] * len(y))
    right.set_xlim(0, max(peaks) * 1.25)
    right.set_xlabel("peak memory, GiB")
    fig.suptitle(_title(report, rows), fontsize=10)
    save(fig, out)


if __name__ == "__main__":
    cli(plot, __doc__, "bench_gpt_peers.py", "gpt_peers.png")
