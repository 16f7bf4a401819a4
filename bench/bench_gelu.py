"""GELU forward + backward at the 1.3B GPT's MLP shape, compiled as the example's blocks
are: the exact (erf) GELU against the tanh approximation, and the copy floor of their
traffic (inductor's exact GELU kernels ran at ~60% of the copy rate at this shape, as
fast on an H100 as on an H200).

    python bench/bench_gelu.py [--tokens 16384] [--features 8192] [--iters 50]
    python bench/bench_gelu.py --cpu --tokens 64 --features 64 --backend aot_eager  # smoke

Bytes counted once per tensor (bf16): forward reads x and writes y (4 B/element),
backward reads x and dy and writes dx (6 B/element). The ``bias+gelu`` rows time
the backward of ``gelu(x + bias)`` with the bias gradient: inductor's ``dx`` and
then its column sum, against ``mpzero.tensor_parallel.bias_gelu`` (one kernel).
Also prints the largest difference between the two GELUs on the same input (they are
different functions).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import types

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402


def time_ms(fn, iters: int, device: str) -> float:
    """Median ms of ``iters`` calls after 3 warm-ups (bench_step's timer: CUDA events
    around each call, the host clock on CPU)."""
    for _ in range(3):
        fn()
    timer = bench_step._Timer(types.SimpleNamespace(device=torch.device(device)))
    return statistics.median(timer(fn)[0] for _ in range(iters)) * 1e3


def add_run_args(p, iters: int = 50) -> None:
    """The flags every kernel bench shares: --iters, --cpu, --backend."""
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--cpu", action="store_true", help="run on the CPU (a smoke test)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")


def print_table(table, width: int = 42) -> None:
    """``(case, ms, TB/s)`` rows as a Markdown table."""
    print(f"| {'case':<{width}} | {'ms':>7} | {'TB/s':>6} |")
    print(f"|{'-' * (width + 2)}|{'-' * 9}|{'-' * 8}|")
    for case, ms, tbps in table:
        print(f"| {case:<{width}} | {ms:7.3f} | {tbps:6.3f} |")


def device_and_name(cpu: bool) -> tuple[str, str]:
    """``("cpu", "cpu")`` with ``--cpu``, else ``("cuda", the GPU's name)`` (exit if none)."""
    if cpu:
        return "cpu", "cpu"
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --cpu)")
    return "cuda", torch.cuda.get_device_name()


def rows(tokens: int, features: int, iters: int, device: str = "cuda",
         backend: str = "inductor") -> tuple[list[tuple[str, float, float]], float]:
    """(name, ms, TB/s at the counted bytes) per case, and the largest difference between
    the exact and the tanh GELU of the same input."""
    n = tokens * features
    x = torch.randn(tokens, features, device=device, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    out = []
    for approximate in ("none", "tanh"):
        fwd = torch.compile(lambda t, a=approximate: F.gelu(t, approximate=a), backend=backend)
        xg = x.detach().requires_grad_()
        y = fwd(xg)

        def backward(y=y, xg=xg):
            (grad,) = torch.autograd.grad(y, xg, dy, retain_graph=True)
            return grad

        ms_f = time_ms(lambda f=fwd: f(x), iters, device)
        ms_b = time_ms(backward, iters, device)
        out.append((f"gelu {approximate} forward", ms_f, 4 * n / ms_f / 1e9))
        out.append((f"gelu {approximate} backward", ms_b, 6 * n / ms_b / 1e9))
    # With the MLP's bias: the backward also makes the bias gradient (a column sum of dx).
    from mpzero.tensor_parallel import bias_gelu

    bias = torch.randn(features, device=device, dtype=torch.bfloat16)
    for approximate in ("none", "tanh"):
        cases = (("dx, then the sum", lambda t, b, a=approximate: F.gelu(t + b, approximate=a)),
                 ("mpzero bias_gelu", lambda t, b, a=approximate: bias_gelu(t, b, a)))
        for name, f in cases:
            fn = torch.compile(f, backend=backend)
            xg, bg = x.detach().requires_grad_(), bias.detach().requires_grad_()
            y = fn(xg, bg)

            def backward(y=y, xg=xg, bg=bg):
                return torch.autograd.grad(y, (xg, bg), dy, retain_graph=True)

            ms_b = time_ms(backward, iters, device)
            out.append((f"bias+gelu {approximate} bwd, {name}", ms_b, 6 * n / ms_b / 1e9))
    dst = torch.empty_like(x)
    ms_c = time_ms(lambda: dst.copy_(x), iters, device)
    out.append(("copy of x (forward's bytes)", ms_c, 4 * n / ms_c / 1e9))
    diff = (F.gelu(x.float()) - F.gelu(x.float(), approximate="tanh")).abs().max().item()
    return out, diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384, help="micro-batch x sequence")
    ap.add_argument("--features", type=int, default=8192, help="MLP hidden features")
    add_run_args(ap)
    a = ap.parse_args()
    device, name = device_and_name(a.cpu)
    print(f"{name}, torch {torch.__version__}, [{a.tokens}, {a.features}] bf16, "
          f"median of {a.iters}")
    table, diff = rows(a.tokens, a.features, a.iters, device, a.backend)
    print_table(table, 40)
    print(f"max |gelu(x) - gelu_tanh(x)| over the N(0, 1) input: {diff:.2e}")


if __name__ == "__main__":
    main()
