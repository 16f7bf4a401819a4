"""The pre-LN block's residual add + LayerNorm at the 1.3B GPT's shape, forward and
forward + backward: inductor's kernels for the unfused ``s = x + y; F.layer_norm(s)``
(compiled) against ``mpzero.tensor_parallel.add_layer_norm`` (one kernel each way), and
the copy floor of the traffic; ``--rms``: the same with RMSNorm (``F.rms_norm`` against
``add_rms_norm``).

    python bench/bench_layer_norm.py [--tokens 16384] [--hidden 2048] [--iters 50] [--rms]
    python bench/bench_layer_norm.py --cpu --tokens 64 --hidden 64 --backend aot_eager  # smoke

Bytes counted once per tensor (bf16): the forward reads x and y and writes s and the
output (4 tensors of [tokens, hidden]); the backward reads the output's gradient, s and
the residual's gradient and writes ds (4 more). The weight and bias gradients are small.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gelu import add_run_args, device_and_name, print_table, time_ms  # noqa: E402

from mpzero.tensor_parallel import add_layer_norm, add_rms_norm  # noqa: E402


def _unfused(x, y, w, b):
    s = x + y
    return s, F.layer_norm(s, (s.shape[-1],), w, b)


def _unfused_rms(x, y, w, b):
    s = x + y
    return s, F.rms_norm(s, (s.shape[-1],), w, 1e-5)


def _fused_rms(x, y, w, b):
    return add_rms_norm(x, y, w)


def rows(tokens: int, hidden: int, iters: int, device: str = "cuda",
         backend: str = "inductor", rms: bool = False) -> list[tuple[str, float, float]]:
    """(name, ms, TB/s at the counted bytes) per case."""
    n = tokens * hidden
    gbytes = 4 * n * 2 / 1e9  # one way: 4 tensors of 2 bytes per element
    bf16 = dict(device=device, dtype=torch.bfloat16)
    src = torch.randn(2 * n, **bf16)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters, device)
    out = [("copy of the same bytes (floor, one way)", ms, gbytes / ms)]
    x, y, gs, go = (torch.randn(tokens, hidden, **bf16) for _ in range(4))
    w = (1 + 0.1 * torch.randn(hidden, **bf16)).requires_grad_()
    b = (0.1 * torch.randn(hidden, **bf16)).requires_grad_()
    x.requires_grad_()
    y.requires_grad_()
    if rms:
        cases = (("compiled add + F.rms_norm", torch.compile(_unfused_rms, backend=backend)),
                 ("mpzero add_rms_norm", _fused_rms))
    else:
        cases = (("compiled add + F.layer_norm", torch.compile(_unfused, backend=backend)),
                 ("mpzero add_layer_norm", add_layer_norm))
    for name, fn in cases:
        with torch.no_grad():
            ms = time_ms(lambda f=fn: f(x, y, w, b), iters, device)
        out.append((f"{name}: forward", ms, gbytes / ms))

        def both(f=fn):
            s, o = f(x, y, w, b)
            torch.autograd.backward([s, o], [gs, go])
        ms = time_ms(both, iters, device)
        out.append((f"{name}: forward + backward", ms, 2 * gbytes / ms))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="micro-batch x sequence")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--rms", action="store_true", help="RMSNorm instead of LayerNorm")
    add_run_args(p)
    a = p.parse_args(argv)
    device, name = device_and_name(a.cpu)
    print(f"torch {torch.__version__}, {name}; [{a.tokens}, {a.hidden}] bf16, median of "
          f"{a.iters}")
    print_table(rows(a.tokens, a.hidden, a.iters, device, a.backend, a.rms), 48)


if __name__ == "__main__":
    main()
