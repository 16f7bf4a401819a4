"""The multi-tensor kernels' outputs on fixed inputs, saved, and two saved sets compared bit
for bit: a check that two builds of ``mpzero._C`` compute the same bits.

    python bench/kernel_bits.py --out new.pt
    PYTHONPATH=/path/to/other/checkout python bench/kernel_bits.py --out old.pt
    python bench/kernel_bits.py --compare old.pt new.pt

Runs ``mpzero.kernels``' public functions (the API both builds share): Adam for four
(params, grads, output) dtype combinations with host scalars and a gradient scale, the
default mode's Adam with lr, step and found_inf on the device, the remainder kernel with
and without an output, the L2 norm, casts, raw copies and ``multi_add``, each on seeded
random inputs over sizes around block steps and chunks, misaligned views, and more tensors
than one launch holds. On a machine without CUDA it runs the reference implementations.
"""

from __future__ import annotations

import argparse
import sys

import torch

SIZES = [1, 7, 2047, 2049, 4095, 4096, 4097, 8191, 8192, 8200, 12289, 16385, 24581, 32769,
         70001, 2**20 + 13] + [5000 + i for i in range(60)]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=5)
F32, F16, B16 = torch.float32, torch.float16, torch.bfloat16


def _inputs(device):
    gen = torch.Generator(device=device).manual_seed(20261207)

    def rand(dtype, offset, scale=1.0, positive=False):
        out = []
        for n in SIZES:
            t = torch.randn(n + offset, device=device, generator=gen) * scale
            if positive:
                t = t.abs_().add_(1e-3 * scale)
            out.append(t.to(dtype)[offset:])
        return out

    def ints(offset):
        return [torch.randint(-(2**15), 2**15, (n + offset,), device=device, generator=gen,
                              dtype=torch.int16)[offset:] for n in SIZES]

    def empty(dtype, offset):
        return [torch.full((n + offset,), float("nan"), device=device, dtype=dtype)[offset:]
                for n in SIZES]

    return rand, ints, empty


def run(device) -> dict[str, list[torch.Tensor]]:
    """{case: output tensors} of every case on ``device``."""
    from mpzero import kernels

    rand, ints, empty = _inputs(device)
    out = {}
    for offset in (0, 1):
        for pdt, gdt, odt in [(F32, B16, B16), (F32, F32, None), (B16, B16, F32),
                              (F16, F32, F16)]:
            p, g, m = rand(pdt, offset), rand(gdt, offset), rand(pdt, offset, 0.1)
            v = rand(pdt, offset, 0.01, True)
            o = None if odt is None else empty(odt, offset)
            kernels.adam(p, g, m, v, o, **HP, grad_scale=torch.tensor(0.5, device=device))
            out[f"adam {pdt} {gdt} {odt} +{offset}"] = p + m + v + (o or [])
        p, g, m = rand(F32, offset), rand(B16, offset), rand(F32, offset, 0.1)
        v, o = rand(F32, offset, 0.01, True), empty(B16, offset)
        dev = dict(HP, lr=torch.tensor(HP["lr"], device=device),
                   step=torch.tensor(HP["step"], device=device),
                   found_inf=torch.zeros((), device=device))
        kernels.adam(p, g, m, v, o, **dev)
        out[f"adam capturable +{offset}"] = p + m + v + o
        for gdt, odt in [(B16, B16), (F32, None)]:
            p, r, g = rand(B16, offset), ints(offset), rand(gdt, offset)
            m, v = rand(F32, offset, 0.1), rand(F32, offset, 0.01, True)
            o = None if odt is None else empty(odt, offset)
            kernels.adam_remainders(p, r, g, m, v, o, **HP)
            out[f"adam_remainders {gdt} {odt} +{offset}"] = p + r + m + v + (o or [])
        for dt in (B16, F32):
            out[f"l2norm {dt} +{offset}"] = [kernels.l2norm(rand(dt, offset, 3.0))]
        for st, dt in [(F32, B16), (B16, F32), (F32, F32), (B16, B16)]:
            d = empty(dt, offset)
            kernels.multi_copy(rand(st, offset), d)
            out[f"multi_copy {st} {dt} +{offset}"] = d
        d = rand(F32, offset)
        kernels.multi_add(rand(B16, offset), d)
        out[f"multi_add bf16 fp32 +{offset}"] = d
    return {k: [t.cpu() for t in ts] for k, ts in out.items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def compare(a: dict, b: dict) -> list[str]:
    """The cases whose outputs differ (empty: the same bits everywhere)."""
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        if len(a[k]) != len(b[k]) or not all(
                x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y))
                for x, y in zip(a[k], b[k])):
            bad.append(k)
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="save this build's outputs here")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two saved sets")
    args = ap.parse_args()
    if args.compare:
        a, b = (torch.load(f) for f in args.compare)
        bad = compare(a["outputs"], b["outputs"])
        for f, d in zip(args.compare, (a, b)):
            print(f"{f}: {d['device']}, {d['extension']}")
        if bad:
            print(f"{len(bad)} of {len(a['outputs'])} cases differ:\n  " + "\n  ".join(bad))
            sys.exit(1)
        print(f"all {len(a['outputs'])} cases equal bit for bit")
        return
    if not args.out:
        ap.error("--out or --compare")
    from mpzero import kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ext = "mpzero._C" if kernels.extension_available() else "no extension (reference)"
    if kernels.extension_available():
        from mpzero import _C

        ext = _C.__file__
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    torch.save(dict(device=name, extension=ext, outputs=run(device)), args.out)
    print(f"saved {args.out} ({name}, {ext})")


if __name__ == "__main__":
    main()
