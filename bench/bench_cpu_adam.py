"""The CPU Adam step alone: mpzero._cpu against torch's and DeepSpeed's CPU Adams and the
host's copy rate, side by side in one run.

    python bench/bench_cpu_adam.py [--sizes 16,256] [--threads N] [--reps 5] [--rounds 3]

Every row steps one flat tensor per state (as an offloaded optimizer shard is) of
``size`` million parameters, AdamW, fp32 state. All rows share one arena of 28 bytes per
parameter, so the largest size needs 28 B x size of memory and no more:

- ``copy floor``: a copy of 14 B/param (28 B moved: read + written) on the kernel's own
  pool of ``--threads`` threads (``mpzero._cpu.copy``, memcpy in 1 MiB items taken as
  the step takes its items): the host's copy rate on these bytes, scheduled as the
  step is; ``% floor`` is relative to it;
- ``torch copy_``: ``dst.copy_(src)`` of the same bytes, torch on ``--threads`` threads
  (its OpenMP threads wait for each other, which a loaded host makes slower);
- ``in-place floor``: ``mpzero._cpu.stream``, ``p, m, v += g`` over the fp32 tensors on
  the same pool: the step's own memory traffic (read 16 B, write 12 B back in place) with
  next to no arithmetic, the stricter floor (``% in-place``);
- ``mpzero._cpu``: :func:`mpzero.kernels.cpu_adam.adam` on ``--threads`` threads (its own
  pool: torch's thread count does not matter to it), fp32 p, g, m, v (28 B);
- ``torch AdamW fused`` / ``foreach``: ``torch.optim.AdamW(fused=True / foreach=True)``,
  ``torch.set_num_threads(--threads)``, the same tensors (28 B);
- ``DeepSpeed CPU Adam``: ``DeepSpeedCPUAdam`` (its op is built on first use, outside the
  timed region; ``OMP_NUM_THREADS=--threads``) where ``deepspeed`` imports and the op
  builds, else a row saying why not (28 B);
- mpzero's other modes: fp32 master with bf16 gradient and bf16 parameter output (the
  default mode, 28 B) and bf16 parameter + int16 remainder updated in place (26 B).

Times are medians over ``--rounds`` rounds of ``--reps`` steps (each after one warm-up
step), the rows interleaved in every round so that a shared machine's load hits all of
them alike. ``GB/s`` counts each byte read or written once; ``% floor`` is that rate over
the copy's. A copy also reads every destination line before writing it (write-allocate),
an in-place update does not: so a step can pass 100% of the copy floor, not of the
in-place one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from mpzero.kernels import cpu_adam

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


class Arena:
    """All tensors of one size, as views into 28 B/param: fp32 p, g, m, v (16 B) and the
    16-bit tensors of the other modes (12 B); the copy floor reuses all of it."""

    def __init__(self, n: int):
        self.n = n
        self.buf = torch.empty(7 * n, dtype=torch.float32)
        f32 = self.buf[:4 * n]
        self.p, self.g, self.m, self.v = (f32[i * n:(i + 1) * n] for i in range(4))
        h = self.buf[4 * n:].view(torch.int16)
        self.g16, self.out16, self.p16 = (h[i * n:(i + 1) * n].view(torch.bfloat16)
                                          for i in range(3))
        self.rem = h[3 * n:4 * n]
        self.step = 0
        self.reset()

    def reset(self) -> None:
        """Values that stay normal (no subnormal slow paths) for many steps."""
        for t, x in ((self.p, 0.5), (self.g, 1e-3), (self.m, 1e-4), (self.v, 1e-6),
                     (self.g16, 1e-3), (self.p16, 0.5), (self.rem, 0)):
            t.fill_(x)

    def copy_floor(self, threads: int | None = None):
        """A copy of half the arena onto the other half: ``mpzero._cpu.copy`` on
        ``threads`` threads, or torch's ``copy_`` (``threads`` None)."""
        half = 7 * self.n // 2
        src, dst = self.buf[:half], self.buf[half:2 * half]
        if threads is None:
            return lambda: dst.copy_(src)
        from mpzero import _cpu

        return lambda: _cpu.copy(dst.data_ptr(), src.data_ptr(), half * 4, threads)

    def in_place_floor(self, threads: int):
        """``p, m, v += g`` on the kernel's pool: the step's traffic, no Adam."""
        from mpzero import _cpu

        ptrs = [t.data_ptr() for t in (self.p, self.g, self.m, self.v)]
        return lambda: _cpu.stream(*ptrs, self.n, threads)


def _mpzero(a: Arena, threads: int, mode: str):
    kw = dict(HP)

    def run():
        a.step += 1
        if mode == "fp32":
            cpu_adam.adam([a.p], [a.g], [a.m], [a.v], step=a.step, threads=threads, **kw)
        elif mode == "bf16 grad+out":
            cpu_adam.adam([a.p], [a.g16], [a.m], [a.v], [a.out16], step=a.step,
                          threads=threads, **kw)
        else:
            cpu_adam.adam_remainders([a.p16], [a.rem], [a.g16], [a.m], [a.v], step=a.step,
                                     threads=threads, **kw)
    return run


def _scaled(a: Arena, threads: int, fused: bool):
    """Remainders with bf16 moments, one fp32 scale per piece (two pieces): the two-pass
    kernel, or the path it replaces (fp32 copies of the moments, ``adam_remainders``,
    stored back over new scales with torch ops)."""
    from mpzero import kernels
    from mpzero.optimizers.scaled_state import MOMENTS, ScaledStates
    from mpzero.optimizers.step import by_group

    half = a.n // 2
    st = ScaledStates([(0, half), (half, a.n)], a.n, torch.bfloat16, torch.device("cpu"),
                      keys=MOMENTS)
    st.store("exp_avg", torch.full((a.n,), 1e-4))
    st.store("exp_avg_sq", torch.full((a.n,), 1e-6))
    ranges, pieces = st.pieces([(0, a.n, 0)])
    (lists,) = by_group(ranges, a.p16, a.rem, a.g16, st.data["exp_avg"],
                        st.data["exp_avg_sq"], pieces).values()

    def run():
        a.step += 1
        if fused:
            cpu_adam.adam_remainders_scaled(*lists, st.scales["exp_avg"],
                                            st.scales["exp_avg_sq"], st.half_max, step=a.step,
                                            threads=threads, **HP)
            return
        with kernels.torch_threads(threads):
            m, v = st.unscaled("exp_avg"), st.unscaled("exp_avg_sq")
            cpu_adam.adam_remainders([a.p16], [a.rem], [a.g16], [m], [v], step=a.step,
                                     threads=threads, **HP)
            st.store("exp_avg", m)
            st.store("exp_avg_sq", v)
    return run


def _torch(a: Arena, **opts):
    param = torch.nn.Parameter(a.p)
    param.grad = a.g
    opt = torch.optim.AdamW([param], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                            eps=HP["eps"], weight_decay=HP["weight_decay"], **opts)
    # The state is the arena's (no extra memory); torch's fused kernel wants a float step.
    opt.state[param] = {"step": torch.tensor(0.0), "exp_avg": a.m, "exp_avg_sq": a.v}
    return opt.step


def _deepspeed(a: Arena, threads: int):
    """DeepSpeedCPUAdam's step, or the reason it is not there (a string)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)  # its op's own OpenMP runtime reads this
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001 - any failure is the row's reason
        return f"did not import: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    param = torch.nn.Parameter(a.p)
    param.grad = a.g
    try:
        opt = DeepSpeedCPUAdam([param], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                               eps=HP["eps"], weight_decay=HP["weight_decay"], adamw_mode=True)
    except Exception as e:  # noqa: BLE001
        return f"did not build: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    opt.state[param] = {"step": 0, "exp_avg": a.m, "exp_avg_sq": a.v}
    return opt.step


ROWS = [  # name, bytes per parameter
    ("copy floor", 28),
    ("torch copy_", 28),
    ("in-place floor", 28),
    ("mpzero._cpu fp32", 28),
    ("torch AdamW fused", 28),
    ("torch AdamW foreach", 28),
    ("DeepSpeed CPU Adam", 28),
    ("mpzero._cpu bf16 grad+out", 28),
    ("mpzero._cpu remainders", 26),
    # bf16 moments with scales: 6 B read in the first pass, 10 read + 8 written in the
    # second; the torch path moves the same useful bytes through fp32 copies
    ("mpzero._cpu remainders + bf16 scaled moments", 24),
    ("remainders + bf16 scaled moments, torch ops", 24),
]


def bench(n: int, threads: int, reps: int, rounds: int) -> list[tuple[str, int, float | str]]:
    a = Arena(n)
    fns = {
        "copy floor": a.copy_floor(threads),
        "torch copy_": a.copy_floor(),
        "in-place floor": a.in_place_floor(threads),
        "mpzero._cpu fp32": _mpzero(a, threads, "fp32"),
        "torch AdamW fused": _torch(a, fused=True),
        "torch AdamW foreach": _torch(a, foreach=True),
        "DeepSpeed CPU Adam": _deepspeed(a, threads),
        "mpzero._cpu bf16 grad+out": _mpzero(a, threads, "bf16 grad+out"),
        "mpzero._cpu remainders": _mpzero(a, threads, "remainders"),
        "mpzero._cpu remainders + bf16 scaled moments": _scaled(a, threads, True),
        "remainders + bf16 scaled moments, torch ops": _scaled(a, threads, False),
    }
    times: dict[str, list[float]] = {name: [] for name, _ in ROWS}
    for _ in range(rounds):
        for name, _ in ROWS:
            fn = fns[name]
            if isinstance(fn, str):
                continue
            fn()  # warm-up (first touch, a lazy build, the optimizer's state check)
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
            if name.startswith(("copy", "torch copy", "in-place")):
                a.reset()  # the floors overwrote the states
    out = []
    for name, nbytes in ROWS:
        fn = fns[name]
        out.append((name, nbytes, fn if isinstance(fn, str) else statistics.median(times[name])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,256", help="millions of parameters (2^20 each)")
    ap.add_argument("--threads", type=int, default=cpu_adam.default_threads(),
                    help="threads for every row (default: this host's physical cores)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs, "
          f"median of {args.rounds} rounds x {args.reps} steps, load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| params | implementation | B/param | step ms | GB/s | % floor | % in-place |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for m in (float(s) for s in args.sizes.split(",")):
        n = int(m * 2**20)
        rows = bench(n, args.threads, args.reps, args.rounds)
        rate = {name: nbytes * n / t / 1e9 for name, nbytes, t in rows if not isinstance(t, str)}
        for name, nbytes, t in rows:
            if isinstance(t, str):
                print(f"| {m:g}M | {name} | {nbytes} | {t} | | | |", flush=True)
                continue
            gbs = rate[name]
            print(f"| {m:g}M | {name} | {nbytes} | {t * 1e3:.1f} | {gbs:.1f} | "
                  f"{100 * gbs / rate['copy floor']:.0f}% | "
                  f"{100 * gbs / rate['in-place floor']:.0f}% |", flush=True)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
