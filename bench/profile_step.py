"""Where one optimizer step's time goes: device kernels and host functions per setup.

    python bench/profile_step.py [--only 2,3] [--layers 24 --hidden 4096]

For every setup of ``bench/bench_step.py`` (same model, same options): the CUDA kernels
of ``--steps`` profiled ``step()`` calls (torch.profiler: count, total and mean device
time per kernel name, per step), then the host functions that take the most time
(cProfile, cumulative). A tool for finding overheads, not a benchmark: the timings
come with the profilers' own cost.
"""

from __future__ import annotations

import collections
import cProfile
import io
import os
import pstats
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402


def _annotation(ev) -> bool:
    """A user range mirrored on the device timeline (our STEP/BACKWARD ranges, torch's
    ``Optimizer.step#...``), not a kernel."""
    return bool(getattr(ev, "is_user_annotation", False)) or ev.name in ("STEP", "BACKWARD") \
        or ev.name.startswith("Optimizer.step#")


def kernel_table(events, steps: int, top: int) -> str:
    rows = collections.defaultdict(lambda: [0, 0.0])
    for ev in events:
        r = rows[ev.name[:90]]
        r[0] += 1
        r[1] += ev.time_range.elapsed_us()
    total = sum(r[1] for r in rows.values()) / steps
    lines = [f"  device us/step {total:9.1f}   (kernels per step: "
             f"{sum(r[0] for r in rows.values()) / steps:.1f})"]
    for name, (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {us / steps:9.1f} us  x{n / steps:5.1f}  {name}")
    return "\n".join(lines)


def host_table(step, backward, sync, steps: int, top: int) -> str:
    pr = cProfile.Profile()
    for _ in range(steps):
        backward()
        sync()
        pr.enable()
        step()
        pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(top)
    text = out.getvalue().splitlines()
    start = next((i for i, s in enumerate(text) if "ncalls" in s), 0)
    return "\n".join("  " + s for s in text[start:start + top + 1])


def main() -> None:
    ap = bench_step.setup_args(__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    bench_step.init_world(args, 29534)
    cuda = args.device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for name, dtype, make_opt, graph in bench_step.setups(args):
        _params, _opt, backward, step = bench_step.prepare(args, dtype, make_opt, graph)
        print(f"=== {name}")
        acts = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(args.steps):
                with torch.profiler.record_function("BACKWARD"):
                    backward()
                    sync()
                with torch.profiler.record_function("STEP"):
                    step()
                sync()
        # Only the kernels of step(): those starting between a STEP range's start and the
        # next BACKWARD's start (the device catches up at the sync after each step).
        marks = sorted((e.time_range.start, e.name) for e in prof.events()
                       if e.name in ("STEP", "BACKWARD"))
        windows = [(t, marks[i + 1][0] if i + 1 < len(marks) else float("inf"))
                   for i, (t, n) in enumerate(marks) if n == "STEP"]
        kernels = [e for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA
                   and not _annotation(e)
                   and any(a <= e.time_range.start < b for a, b in windows)]

        if cuda:
            print(kernel_table(kernels, args.steps, args.top))
        print(host_table(step, backward, sync, args.steps, args.top))
        del _params, _opt, backward, step
        if cuda:
            torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
