"""DistributedFusedAdam grad sync + step with ``nccl_ub`` True vs False (CUDA, NCCL).

    python bench/bench_nccl_ub.py                      # world 1: 8 x Linear(4096, 4096) bf16
    torchrun --nproc-per-node 8 bench/bench_nccl_ub.py # any world size (one GPU a rank)

Both rows use ``contiguous_grad_buffer=True`` (``nccl_ub`` needs it) and bf16 gradient and
parameter sync. Each timed iteration is a leaf backward through the optimizer's gradient
hooks plus ``grad_sync()`` (the "sync" column: bucket copy-in and reduce-scatter), then
``step()``; the table shows medians over ``--reps`` iterations after warm-up (CUDA events).
At world 1 no NCCL collective runs (the reduce-scatter is a local copy), so the row shows
only what the pool costs or saves; the zero-copy gain needs world > 1.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics

import torch
import torch.distributed as dist

from mpzero.optimizers import DistributedFusedAdam


def _elapsed(fn) -> float:
    """Device milliseconds of ``fn`` (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def run(args, nccl_ub: bool) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[
        torch.nn.Linear(args.hidden, args.hidden, dtype=torch.bfloat16, device=args.device)
        for _ in range(args.layers)])
    params = list(model.parameters())
    opt = DistributedFusedAdam(params, lr=1e-4, weight_decay=0.1, nccl_ub=nccl_ub,
                               contiguous_grad_buffer=True, grad_sync_dtype=torch.bfloat16,
                               param_sync_dtype=torch.bfloat16, bucket_cap_mb=args.bucket_mb)
    g = torch.Generator(device=args.device).manual_seed(1)
    grads = [torch.randn(p.shape, generator=g, device=args.device, dtype=p.dtype) * 1e-3
             for p in params]

    def sync():
        opt.zero_grad()
        torch.autograd.backward(params, grads)  # leaf backward: the hooks fire as in training
        opt.grad_sync()

    for _ in range(args.warmup):
        sync()
        opt.step()
    syncs, steps = [], []
    for _ in range(args.reps):
        torch.cuda.synchronize()
        syncs.append(_elapsed(sync))
        steps.append(_elapsed(opt.step))
    pool = getattr(opt, "_nccl_pool", None)
    row = dict(name=f"nccl_ub={nccl_ub}", sync=statistics.median(syncs),
               step=statistics.median(steps),
               total=statistics.median(a + b for a, b in zip(syncs, steps)),
               params=sum(p.numel() for p in params),
               how=pool.describe() if pool is not None else "caching allocator, unregistered")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--bucket-mb", type=float, default=100.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="run the False/True pair this often")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_nccl_ub.py needs a CUDA device (NCCL user buffers)")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    args.device = torch.device("cuda", local)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("nccl", device_id=args.device)
    rows = []
    for nccl_ub in (False, True) * args.rounds:
        rows.append(run(args, nccl_ub))
        gc.collect()  # the run's model and optimizer go before the next one starts
        torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        print(f"torch {torch.__version__}, NCCL {nccl}, world {dist.get_world_size()}, "
              f"{args.layers} x Linear({args.hidden}, {args.hidden}) bf16 = "
              f"{rows[0]['params'] / 1e6:.1f}M params, median of {args.reps}")
        print(f"| {'setup':<14} | {'sync ms':>8} | {'step ms':>8} | {'total ms':>8} |")
        print(f"|{'-' * 16}|{'-' * 10}|{'-' * 10}|{'-' * 10}|")
        for r in rows:
            print(f"| {r['name']:<14} | {r['sync']:>8.3f} | {r['step']:>8.3f} | "
                  f"{r['total']:>8.3f} |")
        for r in rows[:2]:
            print(f"{r['name']}: {r['how']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
