"""Optimizer step time on CPU: DistributedFusedAdam (world 1) vs torch.optim.AdamW.

    python bench/bench_step_cpu.py [--sizes 1,4,16,64] [--reps 5] [--threads 2]

For each size (millions of fp32 parameters, split into 8 tensors) the gradients are
produced by a backward pass outside the timed region; the table shows the median
``step()`` time, the effective bandwidth (28 bytes/element: p, g, m, v read,
p, m, v written) and the median number of minor page faults a step took (the
first touch of freshly allocated transient buffers; unlike the times, this does not
depend on the machine's load). The copy row is the ceiling: ``dst.copy_(src)`` over the same
bytes moved (read + write counted). The ``scaled`` rows step with a gradient scale of
1/2 (a GradScaler's unscale or a clipping coefficient), set up outside the timed region:
torch's ``grad_scale`` attribute (as GradScaler sets it; the fused kernel unscales the
gradients in place) and DFA's ``unscale_grads(0.5)`` (folded into its grad scale; the
synced gradients stay unchanged).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from mpzero.optimizers import DistributedFusedAdam


def _params(n: int, parts: int = 8) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    sizes = [n // parts] * parts
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in sizes]


def _grads(params):
    return [torch.randn_like(p) for p in params]


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _time(fn, prepare, reps: int) -> tuple[float, int]:
    """Median seconds of ``fn()`` after a warm-up call, and the median number of minor
    page faults it took (fresh pages of transient buffers; independent of the load)."""
    times, faults = [], []
    for _ in range(reps + 1):
        prepare()
        f0, t0 = _minflt(), time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        faults.append(_minflt() - f0)
    return statistics.median(times[1:]), int(statistics.median(faults[1:]))


def bench(n: int, reps: int) -> list[tuple[str, float, float, int]]:
    rows = []
    grads = None

    def backward(params):
        nonlocal grads
        grads = grads or _grads(params)
        sum((p * g).sum() for p, g in zip(params, grads)).backward()

    def torch_scaled(opt):
        opt.grad_scale = torch.tensor(2.0)  # torch divides by it
        opt.found_inf = torch.tensor(0.0)

    for name, make, scale in [
        ("torch AdamW foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True), None),
        ("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), None),
        ("mpzero DFA (world 1)", lambda ps: DistributedFusedAdam(ps, lr=1e-3), None),
        ("torch AdamW fused, scaled", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
         torch_scaled),
        ("mpzero DFA, scaled", lambda ps: DistributedFusedAdam(ps, lr=1e-3),
         lambda opt: opt.unscale_grads(0.5)),
    ]:
        params = _params(n)
        opt = make(params)

        def prepare(params=params, opt=opt, scale=scale):
            opt.zero_grad()
            backward(params)
            if scale is not None:
                scale(opt)

        t, faults = _time(opt.step, prepare, reps)
        rows.append((name, t, 28 * n / t / 1e9, faults))
        del opt, params
    # The ceiling: a copy moving the same 28 bytes per element (3.5 fp32 read + written).
    src, dst = torch.randn(7 * n // 2), torch.empty(7 * n // 2)
    t, faults = _time(lambda: dst.copy_(src), lambda: None, reps)
    rows.append(("copy (ceiling)", t, 28 * n / t / 1e9, faults))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,16,64", help="millions of parameters")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.reps}")
    print(f"| {'params':>7} | {'optimizer':<25} | {'step ms':>9} | {'GB/s':>6} | {'faults':>7} |")
    print(f"|{'-' * 9}|{'-' * 27}|{'-' * 11}|{'-' * 8}|{'-' * 9}|")
    for m in (int(s) for s in args.sizes.split(",")):
        for name, t, gbs, faults in bench(m * 2**20, args.reps):
            print(f"| {m:>6}M | {name:<25} | {t * 1e3:>9.1f} | {gbs:>6.1f} | {faults:>7} |",
                  flush=True)


if __name__ == "__main__":
    main()
