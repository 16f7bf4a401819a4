"""The backward of the fused QKV projection's split into heads, at the 1.3B GPT's shape:
from the gradients of q, k and v to the projection's output gradient ``dy [B*T, 3h]``
and its bias gradient, as inductor compiles the unfused views (a stack, a copy into the
row layout, a column sum) against ``mpzero::heads_grad`` (one kernel), and the copy
floor of the traffic.

    python bench/bench_heads_grad.py [--batch 8] [--seq 2048] [--heads 16] [--head-dim 128]
    python bench/bench_heads_grad.py --cpu --batch 2 --seq 64 --heads 2 --head-dim 16 \\
        --backend aot_eager  # smoke

Bytes counted once per tensor (bf16): read q, k, v's gradients, write dy (4 B per element
of dy); the bias gradient is small. The gradients come as ``[B, T, H, D]`` tensors seen
as ``[B, H, T, D]`` (what the attention backward returns) or as contiguous ``[B, H, T,
D]``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gelu import add_run_args, device_and_name, print_table, time_ms  # noqa: E402

from mpzero import kernels  # noqa: E402


def _unfused(dq, dk, dv):
    """What autograd does for the views' backward plus the linear layer's bias sum."""
    B, H, T, D = dq.shape
    dy = torch.stack([dq, dk, dv], dim=3).permute(0, 2, 1, 3, 4).reshape(B * T, -1)
    return dy, dy.sum(0)


def rows(B: int, T: int, H: int, D: int, iters: int, device: str = "cuda",
         backend: str = "inductor") -> list[tuple[str, float, float]]:
    """(name, ms, TB/s at the counted bytes) per case."""
    n = B * T * H * D * 3
    gbytes = 4 * n / 1e9
    out = []
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters, device)
    out.append(("copy (floor)", ms, gbytes / ms))
    for layout in ("bthd", "bhtd"):
        grads = []
        for _ in range(3):
            t = torch.randn(B, T, H, D, device=device, dtype=torch.bfloat16)
            grads.append(t.transpose(1, 2) if layout == "bthd" else t.transpose(1, 2).contiguous())
        compiled = torch.compile(_unfused, backend=backend)
        ms = time_ms(lambda g=grads, f=compiled: f(*g), iters, device)
        out.append((f"{layout}: compiled stack + copy + sum", ms, gbytes / ms))
        ms = time_ms(lambda g=grads: _unfused(*g), iters, device)
        out.append((f"{layout}: eager stack + copy + sum", ms, gbytes / ms))
        ms = time_ms(lambda g=grads: kernels.heads_grad(g, True), iters, device)
        out.append((f"{layout}: mpzero heads_grad (+ bias)", ms, gbytes / ms))
        ms = time_ms(lambda g=grads: kernels.heads_grad(g, False), iters, device)
        out.append((f"{layout}: mpzero heads_grad, no bias", ms, gbytes / ms))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    add_run_args(p)
    a = p.parse_args(argv)
    device, name = device_and_name(a.cpu)
    print(f"torch {torch.__version__}, {name}; q, k, v gradients [{a.batch}, {a.heads}, "
          f"{a.seq}, {a.head_dim}] bf16, median of {a.iters}")
    print_table(rows(a.batch, a.seq, a.heads, a.head_dim, a.iters, device, a.backend))


if __name__ == "__main__":
    main()
