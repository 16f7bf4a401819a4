"""The fused Adam kernel alone, with its scalars on the host or on the device.

    python bench/bench_adam_scalars.py [--elems 50350000] [--lists 8] [--reps 25] [--json F]

One call of ``mpzero.kernels.adam`` over ``--lists`` tensors of ``--elems`` elements (fp32
master, exp_avg and exp_avg_sq, bf16 gradient and bf16 output: 28 B per element, the
optimizer step's traffic) per row: ``lr`` and ``step`` as Python numbers; ``lr``, then
``step``, then ``lr``, ``step`` and ``found_inf`` as 0-dim device tensors (what
``capturable=True`` passes); the last again captured once and replayed as a CUDA graph.
On CUDA each row runs with the Adam kernels' loads ahead off and on
(``mpzero.kernels.cuda.set_prefetch``), and a device copy of the same bytes gives the
floor. Times: median of ``--reps`` calls, each from an idle GPU (CUDA events); on the CPU
(the reference path, for a smoke run) wall-clock time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mpzero import kernels

HP = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def make_state(elems: int, lists: int, device: torch.device, seed: int = 0) -> dict:
    """Adam's lists for ``lists`` tensors of ``elems`` elements (random params and grads)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(dtype):
        return [torch.randn(elems, generator=gen).to(device, dtype) for _ in range(lists)]

    return dict(params=rand(torch.float32), grads=rand(torch.bfloat16),
                exp_avgs=[torch.zeros(elems, device=device) for _ in range(lists)],
                exp_avg_sqs=[torch.zeros(elems, device=device) for _ in range(lists)],
                params_out=[torch.empty(elems, device=device, dtype=torch.bfloat16)
                            for _ in range(lists)])


def scalar_cases(device: torch.device, lr: float = 1e-4, step: int = 10) -> dict[str, dict]:
    """The rows' scalar arguments: the same values, as numbers or as device tensors."""
    lr_t = torch.tensor(lr, device=device)
    step_t = torch.tensor(float(step), device=device)
    found_inf = torch.zeros((), device=device)
    return {
        "host lr and step": dict(lr=lr, step=step),
        "device lr": dict(lr=lr_t, step=step),
        "device step": dict(lr=lr, step=step_t),
        "device lr, step, found_inf": dict(lr=lr_t, step=step_t, found_inf=found_inf),
    }


def call(state: dict, scalars: dict) -> None:
    kernels.adam(state["params"], state["grads"], state["exp_avgs"], state["exp_avg_sqs"],
                 state["params_out"], **HP, **scalars)


def median_ms(fn, reps: int, device: torch.device, warmup: int = 3) -> float:
    """Median time of ``fn()`` in ms, each call from an idle device."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def captured(state: dict, scalars: dict):
    """``call(state, scalars)`` captured once as a CUDA graph: its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch asks
        call(state, scalars)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(state, scalars)
    return graph.replay


def rows(elems: int, lists: int, reps: int, device: torch.device) -> list[dict]:
    """One dict per (scalars, loads ahead) row: ``case``, ``prefetch`` (None on the CPU),
    ``ms``; on CUDA a last row for the copy floor of the same bytes."""
    state = make_state(elems, lists, device)
    cases = scalar_cases(device)
    cuda = device.type == "cuda"
    settings = [False, True] if cuda else [None]
    out = []
    if cuda:
        from mpzero.kernels import cuda as kcuda
        before = kcuda.prefetch()
    try:
        for ahead in settings:
            if ahead is not None:
                kcuda.set_prefetch(ahead)
            for name, scalars in cases.items():
                out.append(dict(case=name, prefetch=ahead,
                                ms=median_ms(lambda s=scalars: call(state, s), reps, device)))
            if cuda:
                replay = captured(state, cases["device lr, step, found_inf"])
                out.append(dict(case="device lr, step, found_inf; CUDA graph", prefetch=ahead,
                                ms=median_ms(replay, reps, device)))
    finally:
        if cuda:
            kcuda.set_prefetch(before)
    if cuda:  # 28 B per element: 14 read, 14 written, as a copy of 14 B per element
        src = torch.empty(elems * lists * 7 // 2, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        ms = median_ms(lambda: dst.copy_(src), reps, device)
        out.append(dict(case="copy of the same bytes (floor)", prefetch=None, ms=ms,
                        tbps=2 * src.numel() * 4 / ms / 1e9))
    return out


def table(result: list[dict]) -> str:
    """Markdown: one line per case, a column per loads-ahead setting."""
    settings = list(dict.fromkeys(r["prefetch"] for r in result if "tbps" not in r))
    head = ["scalars"] + [{None: "ms", False: "loads ahead off, ms", True: "on, ms"}[a]
                          for a in settings]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for case in dict.fromkeys(r["case"] for r in result):
        by = {r["prefetch"]: r for r in result if r["case"] == case}
        if "tbps" in next(iter(by.values())):
            r = next(iter(by.values()))
            lines.append(f"| {case} ({r['tbps']:.2f} TB/s) | {r['ms']:.3f} |"
                         + " |" * (len(settings) - 1))
            continue
        cells = [f"{by[a]['ms']:.3f}" if a in by else "" for a in settings]
        lines.append("| " + " | ".join([case] + cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elems", type=int, default=50_350_000, help="elements per tensor")
    ap.add_argument("--lists", type=int, default=8, help="tensors per list")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--cpu", action="store_true", help="the reference path on the CPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for opt in ("elems", "lists", "reps"):
        if getattr(args, opt) < 1:
            ap.error(f"--{opt} must be >= 1, got {getattr(args, opt)}")
    if not args.cpu and not torch.cuda.is_available():
        ap.error("no GPU: pass --cpu for the reference path")
    device = torch.device("cpu" if args.cpu else "cuda")
    result = rows(args.elems, args.lists, args.reps, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}, {name}, {args.lists} x {args.elems} elements, "
          f"median of {args.reps}")
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, elems=args.elems, lists=args.lists, reps=args.reps,
                           rows=result), f, indent=1)


if __name__ == "__main__":
    main()
