"""Where one GPT training iteration's device time goes, for one setup of bench_gpt_peers.

    python bench/profile_gpt.py --setup dfa --compile [--attention-backend cudnn] [shape flags]

Builds the setup exactly as ``bench/gpt_peers_worker.py`` does (same model, data, step),
trains ``--warmup`` iterations, then profiles ``--profile-iters`` iterations with
torch.profiler and prints the device time per iteration by kernel class (GEMMs,
attention, the optimizer's kernels, loss, fused elementwise, collectives, other),
the busiest kernels, and the device's idle share (wall time not covered by kernels:
host-bound gaps). A tool for finding where time goes, not a benchmark: the iteration
times of bench_gpt_peers.py are the figures to quote.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_peers_worker as worker  # noqa: E402

from mpzero import parallel_state  # noqa: E402

CLASSES = (  # first match wins, on the lower-cased kernel name
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa", "attn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "splitk")),
    ("optimizer", ("adam", "l2norm", "multi_tensor", "foreach", "fill_kernel")),
    ("loss", ("cross_entropy", "log_softmax", "nll", "logsumexp")),
    ("collective", ("nccl",)),
    ("inductor fused", ("triton",)),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((cls for cls, keys in CLASSES if any(k in low for k in keys)), "other")


def report(kernels: list[tuple[str, float, float]], wall_us: float, iters: int,
           top: int) -> str:
    """``kernels``: (name, start us, duration us) of the profiled iterations."""
    by_class, by_name = collections.Counter(), collections.defaultdict(lambda: [0, 0.0])
    for name, _, dur in kernels:
        by_class[kernel_class(name)] += dur
        r = by_name[name[:100]]
        r[0] += 1
        r[1] += dur
    busy, end = 0.0, -1.0  # union of kernel intervals (streams may overlap)
    for _, start, dur in sorted(kernels, key=lambda k: k[1]):
        busy += max(0.0, start + dur - max(start, end))
        end = max(end, start + dur)
    total = sum(by_class.values())
    lines = [f"wall {wall_us / iters / 1e3:8.2f} ms/iter, device busy {busy / iters / 1e3:8.2f} "
             f"ms/iter ({100 * busy / wall_us:.1f}%), kernel sum {total / iters / 1e3:.2f} ms",
             "class            ms/iter   share"]
    for cls, us in by_class.most_common():
        lines.append(f"  {cls:14s} {us / iters / 1e3:8.2f}  {100 * us / total:5.1f}%")
    lines.append(f"top {top} kernels (ms/iter, calls/iter):")
    for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {us / iters / 1e3:7.2f}  x{n / iters:5.1f}  [{kernel_class(name)}] {name}")
    return "\n".join(lines)


def op_table(prof, iters: int, top: int) -> str:
    """Host ops by the device time of their own kernels, with their Python call sites."""
    def dev(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    rows = sorted(prof.key_averages(group_by_stack_n=8), key=lambda e: -dev(e))[:top]
    lines = [f"top {top} host ops by own device time (ms/iter, calls/iter):"]
    for e in rows:
        lines.append(f"  {dev(e) / iters / 1e3:7.2f}  x{e.count / iters:6.1f}  {e.key}")
        frames = [f for f in (e.stack or []) if "torch/" not in f][:4]
        lines += [f"            at {f}" for f in frames]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", choices=worker.SETUPS, default="dfa")
    p.add_argument("--profile-iters", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trace", default=None, help="also write a Chrome trace here")
    p.add_argument("--stacks", type=int, default=0,
                   help="also print the N host ops with the most device time, with their "
                        "Python call sites")
    worker.add_shape_args(p)
    a = p.parse_args(argv)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    for k, v in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29561").items():
        os.environ.setdefault(k, v)
    dist.init_process_group("nccl", device_id=device)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    worker.set_fused_paths(a)
    cfg = worker.model_config(a, a.setup)
    w = worker.build(a.setup, cfg, device, a)
    data = torch.randint(cfg.vocab_size, (a.grad_acc, a.micro_batch_size, cfg.seq_length + 1),
                         generator=torch.Generator().manual_seed(a.seed)).to(device)

    def iteration():
        w.forward_backward(data)
        w.step()

    for _ in range(a.warmup):
        iteration()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, with_stack=a.stacks > 0) as prof:
        t0 = time.perf_counter()
        for _ in range(a.profile_iters):
            iteration()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    kernels = [(e.name, e.time_range.start, e.time_range.elapsed_us())
               for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    print(f"=== {a.setup} compile={a.compile_mode if a.compile else None} "
          f"attention={a.attention_backend}")
    print(report(kernels, wall_us, a.profile_iters, a.top))
    if a.stacks:
        print(op_table(prof, a.profile_iters, a.stacks))
    if a.trace:
        prof.export_chrome_trace(a.trace)
    with contextlib.suppress(Exception):
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
