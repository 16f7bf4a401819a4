"""Launch configuration sweep of the fused Adam kernel on the real step's lists.

    python bench/sweep_launch.py [--reps 20] [--threads 256,512 --chunks ...]
        [--grids block-per-chunk,persistent --blocks 0,1,2] [--prefetch 0,1]

For the bf16 default mode and remainders of ``bench/bench_step.py``, times ``step()``
(default: replayed as a CUDA graph, no host time in the figure; remainders, which cannot
be captured: eager, host time included) for each (grid, threads, chunk
elements, blocks per SM on a persistent grid, and the Adam kernels' loads ahead
(``set_prefetch``)) and prints the table, fastest first. The
kernels' defaults live in ``csrc/multi_tensor_apply_config.h``.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402

from mpzero.kernels import cuda as kcuda  # noqa: E402
from mpzero.optimizers import DistributedFusedAdam  # noqa: E402


def main() -> None:
    ap = bench_step.setup_args(__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", default="256,512")
    ap.add_argument("--blocks", default="0,1,2", help="blocks per SM (persistent grid only; "
                    "0: as many as fit)")
    ap.add_argument("--chunks", default="2048,4096,8192,16384,65536")
    ap.add_argument("--grids", default="block-per-chunk,persistent")
    ap.add_argument("--prefetch", default="0,1", help="loads ahead off (0) and/or on (1)")
    args = ap.parse_args()
    bench_step.init_world(args, 29535)
    if args.device.type != "cuda":
        raise SystemExit("sweep_launch.py times the CUDA kernels: it needs a GPU")
    bf16 = torch.bfloat16
    modes = {
        "default": dict(grad_sync_dtype=bf16, param_sync_dtype=bf16),
        "remainders": dict(grad_sync_dtype=bf16, param_sync_dtype=bf16, store_params=False,
                           store_param_remainders=True),
    }
    base = kcuda.get_launch_config()
    grids = args.grids.split(",")
    bad = set(grids) - {"block-per-chunk", "persistent"}
    if bad:
        raise SystemExit(f"--grids: unknown {sorted(bad)}; use block-per-chunk and/or persistent")
    ahead = [int(x) for x in args.prefetch.split(",")]
    if set(ahead) - {0, 1}:
        raise SystemExit(f"--prefetch: {args.prefetch!r}; use 0 and/or 1")
    configs = [(g, t, b, c, a) for g in grids for t in map(int, args.threads.split(","))
               for b in (map(int, args.blocks.split(",")) if g == "persistent" else [0])
               for c in map(int, args.chunks.split(",")) for a in ahead]
    base_ahead = kcuda.prefetch()
    rows = []
    for mode, kw in modes.items():
        graph = mode != "remainders"  # remainders are not capturable: eager steps

        def make(ps, m, kw=kw, graph=graph):
            return DistributedFusedAdam(ps, lr=1e-4, weight_decay=0.1, capturable=graph,
                                        overlap_grad_sync=False, **kw)
        for grid, threads, blocks, chunk, a in configs:
            kcuda.set_persistent_grid(grid == "persistent")
            kcuda.set_launch_config(threads, blocks, chunk)
            kcuda.set_prefetch(bool(a))
            _p, _o, backward, replay = bench_step.prepare(args, bf16, make, graph=graph)
            timer, times = bench_step._Timer(args), []
            for _ in range(args.reps):
                backward()
                torch.cuda.synchronize()
                times.append(timer(replay)[0] * 1e3)
            rows.append((mode, grid, threads, blocks, chunk, a, statistics.median(times)))
            print(f"{mode:<11} {grid:<15} threads {threads:>4} blocks/SM {blocks} "
                  f"chunk {chunk:>6} prefetch {a}: {rows[-1][-1]:.3f} ms", flush=True)
            del _p, _o, backward, replay
            torch.cuda.empty_cache()
        kcuda.set_launch_config(*base)
        kcuda.set_persistent_grid(False)
        kcuda.set_prefetch(base_ahead)
    print("\nfastest first:")
    for r in sorted(rows, key=lambda r: (r[0], r[-1])):
        print(f"| {r[0]:<11} | {r[1]:<15} | {r[2]:>4} | {r[3]} | {r[4]:>6} | {r[5]} | "
              f"{r[6]:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
