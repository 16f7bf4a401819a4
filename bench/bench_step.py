"""Optimizer step time, host time and peak memory: every DistributedFusedAdam mode
side by side with torch's fused AdamW and the copy floor, in one run.

    python bench/bench_step.py                 # CUDA: 24 x Linear(4096, 4096) bf16 = 402.7M
    python bench/bench_step.py --cpu --layers 4 --hidden 2048 --reps 5

World 1 (a one-rank process group, NCCL on CUDA, gloo on CPU). Gradients come from
a backward outside the timed region (through the optimizer's gradient hooks, as in
training); each row shows the median of ``--reps`` timed ``step()`` calls after
warm-up: device time (CUDA events), host time of the call, and the peak memory
allocated while stepping (model, grads, state and transients).

Two device times per row. ``step ms`` starts on an idle GPU (synchronized before
the call), so it includes the time the host takes to launch the first kernel (and,
for the eager modes, the Python before it). ``GPU ms`` keeps the GPU busy with a
sleep kernel while the host enqueues the step, as in a training loop where the host
runs ahead of the GPU: it is the time the step itself occupies the GPU. The floor is a
device copy moving 28 bytes per parameter (fp32 master, m, v read and written,
bf16 grad read, bf16 param written) at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from mpzero import kernels
from mpzero.optimizers import DistributedFusedAdam


def _model(args, dtype):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.hidden, args.hidden, dtype=dtype, device=args.device)
              for _ in range(args.layers)]
    return torch.nn.Sequential(*layers)


def _sync(args):
    if args.device.type == "cuda":
        torch.cuda.synchronize()


_AHEAD_CYCLES = 4_000_000  # ~2 ms of sleep at 2 GHz: far more than any step's launch


class _Timer:
    """Device time (CUDA events) and host time of one call. With ``ahead`` the GPU sleeps
    while the host enqueues the call, so the device time leaves the launch out."""

    def __init__(self, args, ahead: bool = False):
        self.cuda = args.device.type == "cuda"
        self.ahead = ahead and self.cuda

    def __call__(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if self.ahead:
                torch.cuda._sleep(_AHEAD_CYCLES)
            start.record()
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0
        if self.cuda:
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, host
        return host, host


def prepare(args, model_dtype, make_opt, graph=False):
    """Model, optimizer and gradients of one setup, warmed up: ``(params, opt, backward,
    step)``; ``step`` is ``opt.step`` or the replay of a captured ``step()``."""
    model = _model(args, model_dtype)
    params = list(model.parameters())
    opt = make_opt(params, model)
    g = torch.Generator(device=args.device).manual_seed(1)
    grads = [torch.randn(p.shape, generator=g, device=args.device, dtype=p.dtype) * 1e-3
             for p in params]

    def backward():
        opt.zero_grad()
        torch.autograd.backward(params, grads)  # leaf backward: hooks fire as in training
        if graph:
            opt.grad_sync()

    for _ in range(args.warmup):
        backward()
        opt.step()
    step = opt.step
    if graph:  # capture step() once, then replay it (capturable=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            backward()
            opt.step()
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        backward()
        with torch.cuda.graph(cuda_graph):
            opt.step()
        step = cuda_graph.replay
    return params, opt, backward, step


def run_setup(args, name, model_dtype, make_opt, graph=False):
    params, opt, backward, step = prepare(args, model_dtype, make_opt, graph)
    idle, ahead = _Timer(args), _Timer(args, ahead=True)
    times, gpu_times, hosts = [], [], []
    _sync(args)
    if args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.reps):
        backward()
        _sync(args)
        t, h = idle(step)
        times.append(t)
        hosts.append(h)
        if ahead.ahead:
            backward()
            _sync(args)
            gpu_times.append(ahead(step)[0])
    peak = (torch.cuda.max_memory_allocated() / 2**30 if args.device.type == "cuda"
            else float("nan"))
    n = sum(p.numel() for p in params)
    return dict(name=name, params=n, ms=statistics.median(times) * 1e3,
                gpu_ms=statistics.median(gpu_times) * 1e3 if gpu_times else float("nan"),
                host_ms=statistics.median(hosts) * 1e3, peak_gib=peak)


def copy_floor(args, n_params: int) -> dict:
    """Time a copy moving 28 bytes per parameter (14 read + 14 written)."""
    src = torch.empty(7 * n_params // 2, dtype=torch.float32, device=args.device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)

    def median_s(timer):
        return statistics.median(timer(lambda: dst.copy_(src))[0] for _ in range(args.reps))

    t = median_s(_Timer(args))
    gpu_t = median_s(_Timer(args, ahead=True)) if args.device.type == "cuda" else float("nan")
    return dict(name="copy floor (28 B/param)", params=n_params, ms=t * 1e3, gpu_ms=gpu_t * 1e3,
                host_ms=float("nan"), peak_gib=float("nan"), tbps=28 * n_params / t / 1e12)


def setups(args):
    bf16 = torch.bfloat16
    sync = dict(grad_sync_dtype=bf16, param_sync_dtype=bf16)
    fused = args.device.type == "cuda"
    cuda = args.device.type == "cuda"

    def dfa(**kw):
        return lambda ps, m: DistributedFusedAdam(ps, lr=1e-4, weight_decay=0.1, **kw)

    rows = [
        ("torch AdamW fused, fp32 model", torch.float32,
         lambda ps, m: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, fused=fused), False),
        ("torch AdamW fused, bf16 model", bf16,
         lambda ps, m: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, fused=fused), False),
        ("mpzero default", bf16, dfa(**sync), False),
        ("mpzero contiguous buffers", bf16,
         dfa(contiguous_param_buffer=True, contiguous_grad_buffer=True, **sync), False),
        ("mpzero store_param_remainders", bf16,
         dfa(store_params=False, store_param_remainders=True, **sync), False),
        ("mpzero fp32 grad/param sync", bf16,
         dfa(grad_sync_dtype=torch.float32, param_sync_dtype=torch.float32), False),
    ]
    if cuda:
        rows.append(("mpzero capturable", bf16, dfa(capturable=True, **sync), False))
    if cuda and kernels.extension_available():  # the reference kernels cannot be captured
        rows.append(("mpzero capturable, CUDA graph", bf16,
                     dfa(capturable=True, contiguous_grad_buffer=True, overlap_grad_sync=False,
                         **sync), True))
    only = set(args.only.split(",")) if args.only else None
    return [r for i, r in enumerate(rows) if only is None or str(i) in only]


def setup_args(description: str) -> argparse.ArgumentParser:
    """The options every step tool shares: the model and which setups run."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated row indices of the setups")
    return ap


def init_world(args, port: int) -> None:
    """``args.device`` (CUDA unless ``--cpu`` or none is present) and a one-rank process
    group on it (NCCL on CUDA, gloo on CPU)."""
    cpu = getattr(args, "cpu", False) or not torch.cuda.is_available()
    args.device = (torch.device("cpu") if cpu
                   else torch.device("cuda", torch.cuda.current_device()))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    cuda = args.device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                            device_id=args.device if cuda else None)


def main() -> None:
    ap = setup_args(__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None, help="also write the rows here (bench/plot_step.py "
                    "draws them)")
    args = ap.parse_args()
    init_world(args, 29533)
    print(f"torch {torch.__version__}, {args.device}, {args.layers} x Linear({args.hidden}, "
          f"{args.hidden}), median of {args.reps} steps, kernels: "
          f"{'mpzero._C' if kernels.extension_available() else 'reference (no mpzero._C)'}")
    results = []
    for s in setups(args):
        results.append(run_setup(args, *s))
        gc.collect()  # the setup's model and optimizer go before the next one starts
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    floor = copy_floor(args, results[0]["params"])
    print(f"| {'setup':<34} | {'step ms':>8} | {'GPU ms':>8} | {'host ms':>8} | {'peak GiB':>8} |")
    print(f"|{'-' * 36}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 10}|")
    for r in results + [floor]:
        print(f"| {r['name']:<34} | {r['ms']:>8.2f} | {r['gpu_ms']:>8.2f} | {r['host_ms']:>8.2f} | "
              f"{r['peak_gib']:>8.2f} |")
    print(f"params: {results[0]['params'] / 1e6:.1f}M; copy bandwidth {floor['tbps']:.2f} TB/s")
    if args.json:
        meta = dict(torch=torch.__version__, device=str(args.device), layers=args.layers,
                    hidden=args.hidden, reps=args.reps,
                    gpu=torch.cuda.get_device_name(args.device) if args.device.type == "cuda"
                    else "cpu")
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=results, floor=floor), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
