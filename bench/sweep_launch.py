"""Launch-constant sweep of the fused Adam kernels: each variant is its own extension build.

    python bench/sweep_launch.py [--threads 256,512] [--chunks 8192,16384,32768]
        [--prefetch 0,1] [--variants 512:16384:0,...] [--modes mixed,capturable,remainders]
        [--reps 25] [--rounds 3] [--jobs 4] [--build-dir DIR] [--build-only] [--json F]

The multi-tensor kernels' launch configuration is compiled in
(``csrc/multi_tensor_apply_config.h``, docs/kernels.md): threads per block
(``MPZERO_LAUNCH_THREADS``, default 512), elements per chunk (``MPZERO_CHUNK_ELEMS``,
default 8192) and the Adam kernels' loads ahead (on; ``-DMPZERO_NO_PREFETCH`` turns them
off). For every variant (the product of ``--threads``, ``--chunks`` and ``--prefetch``, or
the ``--variants`` list of ``THREADS:CHUNK:PREFETCH``) this script compiles
``csrc/adam.cu`` with those defines, and once without any (the default build), each as its
own extension (``torch.utils.cpp_extension.load``, in a temporary build directory unless
``--build-dir`` is given; ``--jobs`` builds at a time). A variant with the default values
is the default build. Then, on the GPU:

* **bits**: every build runs one step on the same inputs (sizes around block steps and
  chunks, misaligned views, more tensors than one launch holds); each variant's outputs
  must equal the default build's bit for bit (the results do not depend on the launch
  configuration);
* **time**: the Adam kernel of each mode through each build, on the tensors of
  ``bench/bench_step.py``'s model (24 x ``nn.Linear(4096, 4096)``, weight and bias: 48
  tensors, 402.8M elements): calls queued back to back, one CUDA event pair each, the
  median of ``--reps``; ``--rounds`` rounds with the builds in a rotated order, the median
  round reported, and each build's time against the default build's.

Modes: ``mixed`` (the default optimizer mode's kernel: fp32 master, m, v; bf16 gradient
and parameter output; 28 B/element), ``capturable`` (the same with lr, step and found_inf
as device tensors), ``remainders`` (bf16 parameter + int16 remainder updated in place, bf16
gradient, fp32 m, v; 26 B/element, as at world 1), ``fp32`` (everything fp32, 28 B).
When ``mpzero._C`` is installed it is timed too ("installed"), next to the default build
made here from the same sources. ``--build-only`` compiles and imports the builds and
prints their constants (no GPU needed).
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(REPO, "csrc")
DEFAULT = (512, 8192, True)  # csrc/multi_tensor_apply_config.h

BINDING = """\
// bench/sweep_launch.py: the Adam kernels of csrc/adam.cu, built with one variant's defines.
#include <torch/extension.h>

#include "mpzero.h"
#include "multi_tensor_apply_config.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam", &mpzero::adam);
  m.def("adam_remainders", &mpzero::adam_remainders);
  m.attr("threads") = mpzero::kLaunchThreads;
  m.attr("chunk_elems") = mpzero::kChunkElems;
  m.attr("loads_ahead") = mpzero::kLoadsAhead;
}
"""

HP = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
BYTES = {"mixed": 28, "capturable": 28, "remainders": 26, "fp32": 28}


@dataclass(frozen=True)
class Variant:
    threads: int
    chunk: int
    ahead: bool

    @property
    def is_default(self) -> bool:
        return (self.threads, self.chunk, self.ahead) == DEFAULT

    @property
    def name(self) -> str:
        """The extension's module name (unique per variant)."""
        if self.is_default:
            return "mpzero_sweep_default"
        return f"mpzero_sweep_t{self.threads}_c{self.chunk}_{'ahead' if self.ahead else 'noahead'}"

    @property
    def label(self) -> str:
        if self.is_default:
            return "default build"
        ahead = "on" if self.ahead else "off"
        return f"{self.threads} threads, chunk {self.chunk}, loads ahead {ahead}"

    def defines(self) -> list[str]:
        """The preprocessor flags of this variant (none for the default build)."""
        if self.is_default:
            return []
        out = [f"-DMPZERO_LAUNCH_THREADS={self.threads}", f"-DMPZERO_CHUNK_ELEMS={self.chunk}"]
        return out + ([] if self.ahead else ["-DMPZERO_NO_PREFETCH"])


def parse_variants(args) -> list[Variant]:
    """The default build first, then every other requested variant once, in order."""
    if args.variants:
        triples = []
        for item in args.variants.split(","):
            parts = item.split(":")
            if len(parts) != 3 or parts[2] not in ("0", "1"):
                raise SystemExit(f"--variants: {item!r}; use THREADS:CHUNK:PREFETCH, e.g. "
                                 "512:16384:0")
            triples.append((int(parts[0]), int(parts[1]), parts[2] == "1"))
    else:
        ahead = args.prefetch.split(",")
        if set(ahead) - {"0", "1"}:
            raise SystemExit(f"--prefetch: {args.prefetch!r}; use 0 and/or 1")
        triples = itertools.product(map(int, args.threads.split(",")),
                                    map(int, args.chunks.split(",")), (a == "1" for a in ahead))
    out = [Variant(*DEFAULT)]
    for t, c, a in triples:
        if t <= 0 or t % 32 or t > 512:
            raise SystemExit(f"threads {t}: a multiple of 32 up to 512 (the launch bounds)")
        if c <= 0:
            raise SystemExit(f"chunk {c}: must be positive")
        v = Variant(t, c, a)
        if v not in out:
            out.append(v)
    return out


def _wheel_includes() -> list[str]:
    """Headers of the nvidia-* wheels next to torch (as setup.py adds them)."""
    import torch

    site = os.path.dirname(os.path.dirname(torch.__file__))
    return [d for d in sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))
            if os.path.isdir(d)]


def build(variant: Variant, root: str, verbose: bool = False):
    """Compile (or reuse) and import the extension of ``variant`` under ``root``: the
    Adam kernels of csrc/adam.cu with the variant's defines and setup.py's flags."""
    from torch.utils.cpp_extension import load

    d = os.path.join(root, variant.name)
    os.makedirs(d, exist_ok=True)
    binding = os.path.join(d, "sweep_bindings.cpp")
    if not os.path.exists(binding) or open(binding).read() != BINDING:
        with open(binding, "w") as f:
            f.write(BINDING)
    defines = variant.defines()
    return load(name=variant.name, sources=[os.path.join(CSRC, "adam.cu"), binding],
                extra_include_paths=[CSRC, *_wheel_includes()],
                extra_cflags=["-O3", "-std=c++20", *defines],
                extra_cuda_cflags=["-O3", "-std=c++20", "--expt-relaxed-constexpr",
                                   "-lineinfo", *defines],
                build_directory=d, verbose=verbose)


def _build_in_child(variant: Variant, root: str) -> tuple[str, float]:
    t0 = time.time()
    build(variant, root)
    return variant.name, time.time() - t0


def build_all(variants: list[Variant], root: str, jobs: int) -> dict[Variant, object]:
    """Every variant's extension: compiled ``jobs`` at a time in child processes (before
    this process touches CUDA), then imported here."""
    if jobs > 1 and len(variants) > 1:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(min(jobs, len(variants))) as pool:
            for name, secs in pool.starmap(_build_in_child, [(v, root) for v in variants]):
                print(f"built {name} in {secs:.0f} s", flush=True)
    mods = {}
    for v in variants:
        t0 = time.time()
        mods[v] = mod = build(v, root)
        got = (int(mod.threads), int(mod.chunk_elems), bool(mod.loads_ahead))
        if got != (v.threads, v.chunk, v.ahead):
            raise SystemExit(f"{v.name}: built with {got}, expected "
                             f"{(v.threads, v.chunk, v.ahead)}")
        print(f"{v.name}: threads {got[0]}, chunk {got[1]}, loads ahead {got[2]} "
              f"({time.time() - t0:.0f} s)", flush=True)
    return mods


# ---- the kernels' arguments -----------------------------------------------------------------


def _hyper(mode: str, device) -> tuple:
    """The hyper-parameter arguments of ``adam`` / ``adam_remainders`` in their order
    (as ``mpzero.kernels.cuda._hyper`` makes them)."""
    import torch

    b1, b2, eps, wd = HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"]
    if mode == "capturable":
        lr_t = torch.tensor(1e-4, device=device)
        step_t = torch.tensor(10, device=device)
        found_inf = torch.zeros((), device=device)
        return (0.0, lr_t, b1, b2, eps, wd, 0, step_t, True, True, None, found_inf)
    return (1e-4, None, b1, b2, eps, wd, 10, None, True, True, None, None)


def make_lists(mode: str, sizes, offset: int = 0, seed: int = 0) -> list[list]:
    """Random argument lists of ``mode`` (views at element ``offset`` of larger buffers)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    f32, b16 = torch.float32, torch.bfloat16

    def rand(dtype, scale=1.0, positive=False):
        out = []
        for n in sizes:
            t = torch.randn(n + offset, device="cuda", generator=gen) * scale
            if positive:
                t = t.abs_().add_(1e-4)
            out.append(t.to(dtype)[offset:])
        return out

    if mode == "remainders":
        rem = [torch.randint(-(2**15), 2**15, (n + offset,), device="cuda", generator=gen,
                             dtype=torch.int16)[offset:] for n in sizes]
        return [rand(b16), rem, rand(b16), rand(f32, 0.1), rand(f32, 0.01, True), []]
    pdt = f32
    gdt = f32 if mode == "fp32" else b16
    out = [] if mode == "fp32" else [torch.empty(n + offset, device="cuda", dtype=b16)[offset:]
                                     for n in sizes]
    return [rand(pdt), rand(gdt), rand(pdt, 0.1), rand(pdt, 0.01, True), out]


def call(mod, mode: str, lists, hyper) -> None:
    if mode == "remainders":
        mod.adam_remainders(*lists, *hyper)
    else:
        mod.adam(*lists, *hyper)


def _bits(t):
    import torch

    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


# Sizes below, at and around block steps (2048-4096 elements) and chunks (4096-65536), a
# size above one chunk of every variant, and more tensors than one launch holds (64 / 56).
CHECK_SIZES = [1, 7, 2047, 2048, 2049, 4095, 4096, 4097, 8191, 8192, 8200, 12289, 16384,
               16385, 24581, 32768, 32769, 65537, 70001, 2**20 + 13] + [5000 + i for i in range(60)]


def check_bits(mods: dict, modes: list[str]) -> dict:
    """{(variant, mode): True when the variant's outputs equal the default build's}."""
    import torch

    default = next(v for v in mods if v.is_default)
    result = {}
    for mode in modes:
        for offset in (0, 1):
            base = make_lists(mode, CHECK_SIZES, offset, seed=1234 + offset)
            hyper = _hyper(mode, "cuda")

            def run(mod, base=base, hyper=hyper, mode=mode):
                lists = [[t.clone() for t in lst] for lst in base]
                call(mod, mode, lists, hyper)
                torch.cuda.synchronize()
                return [t for lst in lists for t in lst]

            want = run(mods[default])
            for v, mod in mods.items():
                got = run(mod)
                same = all(a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
                           for a, b in zip(got, want))
                result[(v, mode)] = result.get((v, mode), True) and same
    return result


def _time(fn, reps: int, warmup: int = 3) -> float:
    """Median GPU ms of ``fn``: calls queued back to back, one event pair each."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def step_sizes(layers: int = 24, hidden: int = 4096) -> list[int]:
    """The parameter sizes of bench/bench_step.py's model: weight and bias per layer."""
    return [hidden * hidden, hidden] * layers


def _time_mode(builds: dict, mode: str, reps: int, rounds: int, times: dict) -> None:
    lists = make_lists(mode, step_sizes())
    hyper = _hyper(mode, "cuda")
    names = list(builds)
    for r in range(rounds):
        for label in names[r % len(names):] + names[:r % len(names)]:
            mod = builds[label]
            ms = _time(lambda mod=mod: call(mod, mode, lists, hyper), reps)
            times.setdefault((label, mode), []).append(ms)
            print(f"  round {r} {mode:<10} {label:<44} {ms:.3f} ms", flush=True)


def time_builds(builds: dict, modes: list[str], reps: int, rounds: int) -> dict:
    """{(label, mode): [ms of each round]}: every build on the same lists, in a rotated
    order each round."""
    import torch

    times = {}
    for mode in modes:
        _time_mode(builds, mode, reps, rounds, times)
        torch.cuda.empty_cache()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="256,512")
    ap.add_argument("--chunks", default="8192,16384,32768")
    ap.add_argument("--prefetch", default="0,1", help="loads ahead off (0) and/or on (1)")
    ap.add_argument("--variants", default=None,
                    help="THREADS:CHUNK:PREFETCH,... instead of the product of the above")
    ap.add_argument("--modes", default="mixed,capturable,remainders")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                    help="extensions compiled at a time")
    ap.add_argument("--build-dir", default=None,
                    help="keep the builds here (reused when unchanged); default: a temporary "
                    "directory, removed at the end")
    ap.add_argument("--build-only", action="store_true",
                    help="compile and import the builds, print their constants, stop")
    ap.add_argument("--no-installed", action="store_true",
                    help="leave the installed mpzero._C out of the timing")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    variants = parse_variants(args)
    modes = args.modes.split(",")
    if set(modes) - set(BYTES):
        raise SystemExit(f"--modes: unknown {sorted(set(modes) - set(BYTES))}; use {list(BYTES)}")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # as setup.py
    tmp = None
    root = args.build_dir
    if root is None:
        tmp = tempfile.TemporaryDirectory(prefix="mpzero-sweep-")
        root = tmp.name
    print(f"{len(variants)} builds in {root}: " + ", ".join(v.name for v in variants), flush=True)
    try:
        mods = build_all(variants, root, args.jobs)
        if args.build_only:
            return
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("sweep_launch.py times the CUDA kernels: it needs a GPU "
                             "(--build-only compiles without one)")
        props = torch.cuda.get_device_properties(0)
        print(f"device: {props.name}, {props.multi_processor_count} SMs, torch "
              f"{torch.__version__}", flush=True)
        bits = check_bits(mods, modes)
        for (v, mode), same in bits.items():
            if not same:
                print(f"BITS DIFFER: {v.label}, {mode}", flush=True)
        builds = {v.label: m for v, m in mods.items()}
        if not args.no_installed:
            try:
                from mpzero import _C
            except ImportError as e:
                print(f"installed mpzero._C not timed ({e})", flush=True)
            else:
                builds["installed mpzero._C"] = _C
        times = time_builds(builds, modes, args.reps, args.rounds)
        n = sum(step_sizes())
        rows = []
        for mode in modes:
            base = statistics.median(times[("default build", mode)])
            for label in builds:
                ms = statistics.median(times[(label, mode)])
                v = next((v for v in mods if v.label == label), None)
                rows.append(dict(
                    mode=mode, build=label, ms=ms, rounds=times[(label, mode)],
                    vs_default=ms / base - 1, tbps=BYTES[mode] * n / ms / 1e9,
                    bits_as_default=None if v is None else bits[(v, mode)],
                    threads=None if v is None else v.threads,
                    chunk=None if v is None else v.chunk,
                    loads_ahead=None if v is None else v.ahead))
        print(f"\n{props.name}, {n / 1e6:.1f}M elements (48 tensors), median of {args.reps} "
              f"calls, median of {args.rounds} rounds; fastest first per mode")
        print("| mode | build | ms | vs default | TB/s | bits as default |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in sorted(rows, key=lambda r: (modes.index(r["mode"]), r["ms"])):
            b = {True: "same", False: "**DIFFER**", None: ""}[r["bits_as_default"]]
            print(f"| {r['mode']} | {r['build']} | {r['ms']:.3f} | {100 * r['vs_default']:+.1f}% "
                  f"| {r['tbps']:.3f} | {b} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=props.name, torch=torch.__version__, elements=n,
                               reps=args.reps, rounds=args.rounds, rows=rows), f, indent=1)
        if not all(bits.values()):
            sys.exit(1)
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
