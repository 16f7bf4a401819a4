"""The 1.3B GPT's MLP (forward + backward of fc -> tanh GELU -> proj, bf16) three ways,
side by side in one run:

- ``unfused``: ``F.linear`` (bias in the GEMM) -> ``F.gelu`` -> ``F.linear``, compiled as
  the example's blocks are (inductor makes the GELU, its gradient and the bias sum);
- ``gelu_mlp``: ``mpzero.tensor_parallel.gelu_mlp`` (bias and GELU in the GEMMs'
  epilogues), saving the GELU output for the backward;
- ``gelu_mlp, recompute``: the same, making the GELU output again in the backward.

Also the six GEMMs alone (no bias, no GELU): what any MLP of this shape must spend, and
on CUDA the two epilogue GEMMs one by one next to their plain counterparts. TFLOP/s
counts the 6 GEMMs' 2 m n k each (12 T H F per MLP; 2 T H F for the single-GEMM rows).

    python bench/bench_mlp.py [--tokens 16384] [--hidden 2048] [--ffn 8192] [--iters 30]
    python bench/bench_mlp.py --cpu --tokens 64 --hidden 32 --ffn 128 --backend aot_eager
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gelu  # noqa: E402
from bench_gelu import time_ms  # noqa: E402

from mpzero import kernels  # noqa: E402
from mpzero.tensor_parallel import gelu_mlp  # noqa: E402


def rows(tokens: int, hidden: int, ffn: int, iters: int, device: str = "cuda",
         backend: str = "inductor") -> list[tuple[str, float, float, float]]:
    """(case, ms, TFLOP/s, peak GiB) per case; peak: the most memory one forward +
    backward held above what was allocated before it (inputs and weights)."""
    g = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dt)

    x = randn(tokens, hidden).requires_grad_()
    w1 = randn(ffn, hidden, scale=0.02).requires_grad_()
    b1 = randn(ffn, scale=0.02).requires_grad_()
    w2 = randn(hidden, ffn, scale=0.02).requires_grad_()
    dout = randn(tokens, hidden)
    leaves = (x, w1, b1, w2)

    def unfused(x, w1, b1, w2):
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2)

    cases = {
        "unfused (compiled)": torch.compile(unfused, backend=backend),
        "gelu_mlp": torch.compile(lambda *t: gelu_mlp(*t), backend=backend),
        "gelu_mlp, recompute": torch.compile(
            lambda *t: gelu_mlp(*t, keep_gelu_output=False), backend=backend),
    }
    flops = 12 * tokens * hidden * ffn
    out = []
    for name, fn in cases.items():
        def step(fn=fn):
            y = fn(*leaves)
            torch.autograd.grad(y, leaves, dout)

        step()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        ms = time_ms(step, iters, device)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device == "cuda" else 0.0
        out.append((name, ms, flops / ms / 1e9, peak))

    xd, w1d, w2d = x.detach(), w1.detach(), w2.detach()
    h = xd @ w1d.t()

    def gemms():
        a = xd @ w1d.t()       # fc forward
        b = h @ w2d.t()        # proj forward
        c = dout @ w2d         # proj dgrad
        d = dout.t() @ h       # proj wgrad
        e = h @ w1d            # fc dgrad
        f = h.t() @ xd         # fc wgrad
        return a, b, c, d, e, f

    ms = time_ms(gemms, iters, device)
    out.append(("the 6 GEMMs alone", ms, flops / ms / 1e9, 0.0))
    if device == "cuda" and kernels.gemm_gelu_available(xd, w1d):
        b1d, z = b1.detach(), h
        one = 2 * tokens * hidden * ffn
        for name, fn in (("fc GEMM + bias (addmm)", lambda: torch.addmm(b1d, xd, w1d.t())),
                         ("fc GEMM, GELU_AUX_BIAS", lambda: kernels.gemm_bias_gelu(xd, w1d, b1d)),
                         ("dgrad GEMM (mm)", lambda: dout @ w2d),
                         ("dgrad GEMM, DGELU", lambda: kernels.gemm_dgelu(dout, w2d, z))):
            ms = time_ms(fn, iters, device)
            out.append((name, ms, one / ms / 1e9, 0.0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384, help="micro-batch x sequence")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    bench_gelu.add_run_args(ap, iters=30)
    a = ap.parse_args()
    device, name = bench_gelu.device_and_name(a.cpu)
    print(f"{name}, torch {torch.__version__}, tokens {a.tokens}, hidden {a.hidden}, "
          f"ffn {a.ffn}, bf16, median of {a.iters}; cuBLASLt epilogues: "
          f"{kernels.gemm_gelu_available()}")
    print(f"| {'case':<24} | {'ms':>7} | {'TFLOP/s':>7} | {'peak GiB':>8} |")
    print(f"|{'-' * 26}|{'-' * 9}|{'-' * 9}|{'-' * 10}|")
    for case, ms, tflops, peak in rows(a.tokens, a.hidden, a.ffn, a.iters, device, a.backend):
        print(f"| {case:<24} | {ms:>7.3f} | {tflops:>7.1f} | {peak:>8.2f} |")


if __name__ == "__main__":
    main()
