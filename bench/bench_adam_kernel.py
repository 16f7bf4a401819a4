"""Fused Adam kernel bandwidth on one GPU: one run, one table.

Rows: device-to-device copy (the ceiling), torch.optim.AdamW(fused=True) fp32, and
mpzero's kernel for fp32, mixed (fp32 p/m/v, bf16 grad and bf16 p_out), capturable
mixed (lr, step, or lr/step/found_inf on the device; eager and replayed from a CUDA graph)
and bf16 + int16 remainders, in the launch configuration compiled into the installed
``mpzero._C`` (other configurations: ``bench/sweep_launch.py``). Each at the given total
sizes, split over 4 tensors per list, random data, warm-up, then the median of ``--iters``
timings with CUDA events, every row measured ``--repeat`` times.

Effective bandwidth counts each input read once and each output written once:
  copy 8 B/elem (fp32 read + write); fp32 Adam 28 (p, g, m, v read 16; p, m, v written 12);
  mixed 28 (4+2+4+4 read, 4+4+4+2 written); remainders 28 (p 2, rem 2, g 2, m 4, v 4 read;
  p 2, rem 2, m 4, v 4, p_out 2 written).

    python bench/bench_adam_kernel.py [--sizes 64M,512M] [--iters 20] [--repeat 2] [--json F]

Timing: calls are queued back to back (the host runs ahead, as in training), one event
pair per call; the host's own time per call is reported in its own column.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mpzero import kernels

HP = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
NT = 4  # tensors per list


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def _time(fn, iters: int, warmup: int = 5) -> tuple[float, float]:
    """(median GPU ms per call, host µs per call).

    The calls are queued back to back with a CUDA event pair around each, and the host
    synchronizes once at the end: the host runs ahead, as in training, so each pair times
    the GPU work of one call, not the Python/launch overhead (reported separately: host
    wall time per call while queueing)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    t0 = time.perf_counter()
    for a, b in zip(starts, ends):
        a.record()
        fn()
        b.record()
    host_us = (time.perf_counter() - t0) / iters * 1e6
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends)), host_us


def _split(n: int) -> list[int]:
    base = n // NT
    return [base] * (NT - 1) + [n - base * (NT - 1)]


def _randn(sizes, dtype, scale=1.0, positive=False):
    out = []
    for k in sizes:
        t = torch.randn(k, device="cuda") * scale
        if positive:
            t = t.abs_().add_(1e-4)
        out.append(t.to(dtype))
    return out


def case_copy(n, iters):
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    return _time(lambda: dst.copy_(src), iters), 8


def case_torch_fused(n, iters):
    params = [torch.nn.Parameter(t) for t in _randn(_split(n), torch.float32)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True, **{"weight_decay": HP["weight_decay"]})
    return _time(opt.step, iters), 28


def _adam_lists(n, pdt, gdt, odt):
    sizes = _split(n)
    p = _randn(sizes, pdt)
    g = _randn(sizes, gdt)
    m = _randn(sizes, pdt, 0.1)
    v = _randn(sizes, pdt, 0.01, positive=True)
    out = None if odt is None else [torch.empty(k, device="cuda", dtype=odt) for k in sizes]
    return p, g, m, v, out


def case_fp32(n, iters):
    p, g, m, v, _ = _adam_lists(n, torch.float32, torch.float32, None)
    return _time(lambda: kernels.adam(p, g, m, v, lr=1e-4, step=10, **HP), iters), 28


def case_mixed(n, iters):
    lists = _adam_lists(n, torch.float32, torch.bfloat16, torch.bfloat16)
    return _time(lambda: kernels.adam(*lists, lr=1e-4, step=10, **HP), iters), 28


def _graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _one_placement(n, iters, pad_mb):
    pad = torch.empty(pad_mb * 2**20, dtype=torch.uint8, device="cuda")  # noqa: F841
    p, g, m, v, _ = _adam_lists(n, torch.float32, torch.float32, None)
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)

    def fn():
        kernels.adam(p, g, m, v, lr=1e-4, step=10, **HP)

    eager, _ = _time(fn, iters)
    graph_ms, _ = _time(_graph_of(fn).replay, iters)
    eager2, _ = _time(fn, iters)
    copy_ms, _ = _time(lambda: dst.copy_(src), iters)
    return dict(pad_mb=pad_mb, eager=eager, graph=graph_ms, eager2=eager2, copy=copy_ms)


def placements(n, iters, count, seed=0):
    """Time the fp32 kernel (eager, graph replay, eager again) and a copy on ``count``
    different allocations of the same size (a random padding allocation before each set
    moves the buffers' physical placement), to separate placement from kernel effects."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(count):
        torch.cuda.empty_cache()
        row = _one_placement(n, iters, rng.randrange(1, 512))
        rows.append(row)
        tb = {k: (8 if k == "copy" else 28) * n / row[k] / 1e9 for k in row if k != "pad_mb"}
        print(
            f"  placement {i} pad {row['pad_mb']:4d} MB: copy {tb['copy']:.3f} TB/s  "
            f"fp32 eager {tb['eager']:.3f}  graph {tb['graph']:.3f}  "
            f"eager again {tb['eager2']:.3f} TB/s  "
            f"(eager / copy {tb['eager'] / tb['copy']:.3f})",
            flush=True,
        )
    return rows


def _capturable_args():
    return dict(
        lr=torch.tensor(1e-4, device="cuda"),
        step=torch.tensor(10, device="cuda"),
        found_inf=torch.zeros((), device="cuda"),
        **HP,
    )


def _mixed_on_device(name: str):
    """The mixed row with one scalar (``lr`` or ``step``) a 0-dim device tensor, as
    ``_capturable_args`` makes it, the other a number."""
    def case(n, iters):
        lists = _adam_lists(n, torch.float32, torch.bfloat16, torch.bfloat16)
        kw = dict(HP, lr=1e-4, step=10)
        kw[name] = _capturable_args()[name]
        return _time(lambda: kernels.adam(*lists, **kw), iters), 28
    return case


def case_capturable(n, iters):
    lists = _adam_lists(n, torch.float32, torch.bfloat16, torch.bfloat16)
    kw = _capturable_args()
    return _time(lambda: kernels.adam(*lists, **kw), iters), 28


def case_capturable_graph(n, iters):
    lists = _adam_lists(n, torch.float32, torch.bfloat16, torch.bfloat16)
    kw = _capturable_args()
    return _time(_graph_of(lambda: kernels.adam(*lists, **kw)).replay, iters), 28


def case_remainders(n, iters):
    sizes = _split(n)
    p = _randn(sizes, torch.bfloat16)
    rem = [torch.randint(-(2**15), 2**15, (k,), device="cuda", dtype=torch.int16) for k in sizes]
    g = _randn(sizes, torch.bfloat16)
    m = _randn(sizes, torch.float32, 0.1)
    v = _randn(sizes, torch.float32, 0.01, positive=True)
    out = [torch.empty(k, device="cuda", dtype=torch.bfloat16) for k in sizes]
    fn = lambda: kernels.adam_remainders(p, rem, g, m, v, out, lr=1e-4, step=10, **HP)  # noqa: E731
    return _time(fn, iters), 28


CASES = [
    ("D2D copy (ceiling)", case_copy),
    ("torch AdamW fused fp32", case_torch_fused),
    ("mpzero fp32", case_fp32),
    ("mpzero mixed", case_mixed),
    ("mpzero mixed, device lr", _mixed_on_device("lr")),
    ("mpzero mixed, device step", _mixed_on_device("step")),
    ("mpzero capturable mixed", case_capturable),
    ("mpzero capturable mixed, graph", case_capturable_graph),
    ("mpzero remainders", case_remainders),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64M,512M")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=2, help="measure every row this many times")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cases", default=None, help="comma-separated row-name substrings")
    ap.add_argument(
        "--placements", type=int, default=0,
        help="first time fp32 + copy on this many allocations at the smallest size",
    )
    args = ap.parse_args()
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    if not kernels.extension_available():
        raise SystemExit("mpzero._C is not built: the rows would time the reference")

    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    result = {"device": props.name, "torch": torch.__version__, "rows": []}
    if args.placements:
        result["placements"] = placements(min(sizes), args.iters, args.placements)
    cases = CASES
    if args.cases:
        keys = args.cases.split(",")
        cases = [c for c in CASES if any(k in c[0] for k in keys)]
    table, after = {}, {}
    # Sizes outermost: every row of a size is measured before any larger allocation
    # exists (a 15 GB allocation cycle was seen to slow later 64M rows, the copy included,
    # by ~11%; the "after" column re-measures the smallest size at the end to show it).
    passes = [(n, rep) for n in sizes for rep in range(args.repeat)]
    if len(sizes) > 1:
        passes.append((min(sizes), "after"))
    for n, rep in passes:
        for name, fn in cases:
            (ms, host_us), bpe = fn(n, args.iters)
            torch.cuda.empty_cache()
            tbs = bpe * n / ms / 1e9
            if rep == "after":
                after[name] = (ms, tbs)
            else:
                table.setdefault((name, n), []).append((ms, tbs, host_us))
            result["rows"].append({"case": name, "elems": n, "ms": ms, "tbps": tbs,
                                   "host_us": host_us, "bytes_per_elem": bpe, "repeat": rep})
            print(
                f"  [{rep}] {name:32s} {n // 2**20:5d}M  {ms:8.3f} ms  {tbs:6.3f} TB/s  "
                f"host {host_us:6.1f} us/call",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print()
    print(
        f"median of {args.iters} per row, first of {args.repeat} repeats, spread = max "
        f"difference between repeats"
    )
    head = (
        f"| {'case':32s} |"
        + "".join(f" {n // 2**20}M ms | {n // 2**20}M TB/s | spread |" for n in sizes)
        + " host us/call |"
        + (f" {min(sizes) // 2**20}M TB/s after |" if after else "")
    )
    print(head)
    print("|" + "---|" * (2 + 3 * len(sizes) + bool(after)))
    for name, _ in cases:
        cells = ""
        for n in sizes:
            runs = table[(name, n)]
            ms, tbs, _ = runs[0]
            spread = (max(r[0] for r in runs) - min(r[0] for r in runs)) / ms * 100
            cells += f" {ms:.3f} | {tbs:.3f} | {spread:.1f}% |"
        host = statistics.median(r[2] for n in sizes for r in table[(name, n)])
        tail = f" {after[name][1]:.3f} |" if after else ""
        print(f"| {name:32s} |{cells} {host:.0f} |{tail}")


if __name__ == "__main__":
    main()
