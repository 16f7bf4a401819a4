"""Memory per rank of the GPT example's training step, at data-parallel worlds of 1-8,
on one device: DistributedFusedAdam (ZeRO-2) against DDP-style torch AdamW and FSDP2.

    python bench/bench_memory.py [--worlds 1,2,4,8] [--layers 24 --hidden 2048 ...]

The world is simulated: rank 0 of a ``fake`` process group (torch's
``torch.testing._internal.distributed.fake_pg``: every collective returns at once and
moves no data) of each world size, so one GPU holds exactly what one rank of that
world holds — the same shards, buckets and gather buffers — while the numbers in them
are meaningless. Only memory is measured here, never numerics or time.

Per row: ``persistent`` = allocated after ``step()`` + ``zero_grad()`` (params,
optimizer state, persistent buffers), ``peak`` = max allocated during the last of
``--steps`` iterations (forward, backward, step), ``peak in step()`` = max allocated
during that ``step()`` alone, all measured with the CUDA caching
allocator's counters (on CPU they are not available and the table shows the formula
only). The formula for the persistent memory of each optimizer, with P parameters,
d = world and fp32 parameters and state:

- DFA (ZeRO-2): 4P (params) + 12P/d (fp32 master, exp_avg, exp_avg_sq shards); with
  ``contiguous_grad_buffer`` + 4P (the persistent fp32 bucket buffer)
- torch AdamW on replicas: 4P (params) + 8P (exp_avg, exp_avg_sq)
- FSDP2 (ZeRO-3, ``fully_shard``): 4P/d (param shards) + 8P/d (exp_avg, exp_avg_sq)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

# Run as a script from the checkout: the GPT example is the package examples.gpt.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from examples.gpt.model import GPT, GPTConfig
from examples.gpt.optim import build_optimizer

sys.path.insert(0, os.path.dirname(__file__))  # bench/: the baselines beside this script
from dp_adamw import build_dp_adamw  # noqa: E402

from mpzero import parallel_state  # noqa: E402

GIB = 2**30


def _fake_world(world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    parallel_state.initialize_model_parallel()


def _end_world() -> None:
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _formula(name: str, n: int, world: int) -> float:
    if "contiguous" in name:  # + the persistent fp32 grad buffer
        return 8 * n + 12 * n / world
    if name.startswith("mpzero DFA"):
        return 4 * n + 12 * n / world
    if name.startswith("torch AdamW"):
        return 12 * n
    return 12 * n / world  # FSDP2


def _fsdp2(model: torch.nn.Module, device: torch.device, reshard: bool, lr: float):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    fused = device.type == "cuda"
    return torch.optim.AdamW(model.param_groups(0.1), lr=lr, fused=fused or None)


class _Counter:
    """Allocated bytes now and the peak since ``reset()`` (CUDA allocator; None on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def now(self) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    def peak(self) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()


def measure(name: str, cfg: GPTConfig, world: int, args, device: torch.device) -> dict:
    counter = _Counter(device)
    _fake_world(world)
    try:
        torch.manual_seed(0)
        base = counter.now()
        with device:  # initialised on the device (fast; the same init as on the CPU)
            model = GPT(cfg)
        n = sum(p.numel() for p in model.parameters())
        if name.startswith("FSDP2"):
            opt = _fsdp2(model, device, reshard="ZeRO-3" in name, lr=args.lr)
        elif "contiguous" in name:
            from mpzero.optimizers import DistributedFusedAdam

            opt = DistributedFusedAdam(model.param_groups(0.1), lr=args.lr, device=device,
                                       bucket_cap_mb=args.bucket_cap_mb,
                                       contiguous_param_buffer=True,
                                       contiguous_grad_buffer=True,
                                       **parallel_state.get_optimizer_process_groups())
            opt.init_param_buffer()
        else:
            build = build_optimizer if name.startswith("mpzero DFA") else build_dp_adamw
            grad_dtype = torch.bfloat16 if "bf16 grads" in name else None
            opt = build(model, lr=args.lr, weight_decay=0.1,
                                  betas=(0.9, 0.95), eps=1e-8, device=device,
                                  bucket_cap_mb=args.bucket_cap_mb, grad_sync_dtype=grad_dtype)
        g = torch.Generator(device="cpu").manual_seed(1)
        ids = torch.randint(cfg.vocab_size, (args.micro, cfg.seq_length), generator=g)
        ids = ids.to(device)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
        peak = step_peak = None
        for _ in range(args.steps):
            counter.reset()
            with autocast:
                loss = model(ids, ids)
            loss.backward()
            peak = counter.peak()
            counter.reset()
            opt.step()
            step_peak = counter.peak()
            peak = None if peak is None else max(peak, step_peak)
            opt.zero_grad(set_to_none=True)
        persistent = counter.now()
        row = {"name": name, "world": world, "params": n,
               "formula_gib": _formula(name, n, world) / GIB}
        if persistent is not None:
            row["persistent_gib"] = (persistent - base) / GIB
            row["peak_gib"] = (peak - base) / GIB
            row["step_peak_gib"] = (step_peak - base) / GIB
        del model, opt, loss
        return row
    finally:
        _end_world()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


NAMES = ["mpzero DFA", "mpzero DFA, bf16 grads", "mpzero DFA, contiguous buffers",
         "torch AdamW (replicas)",
         "FSDP2 ZeRO-3 (reshard)", "FSDP2 ZeRO-2 (no reshard)"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bucket-cap-mb", type=float, default=100.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU)")
    ap.add_argument("--cases", default=None, help="comma-separated row-name substrings")
    ap.add_argument("--cpu", action="store_true", help="run on CPU (formula only)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    cfg = GPTConfig(vocab_size=args.vocab, seq_length=args.seq, num_layers=args.layers,
                    hidden_size=args.hidden, num_attention_heads=args.heads)
    names = [n for n in NAMES
             if args.cases is None or any(c in n for c in args.cases.split(","))]
    rows = []
    print(f"device {device}; GPT {args.layers}L x {args.hidden}h, vocab {args.vocab}, "
          f"seq {args.seq}, micro-batch {args.micro}, bf16 autocast {args.bf16}, "
          f"buckets {args.bucket_cap_mb} MiB")
    for world in [int(w) for w in args.worlds.split(",")]:
        for name in names:
            try:
                row = measure(name, cfg, world, args, device)
            except Exception as e:  # a peer that cannot run here: say so, keep the others
                print(f"  world {world}  {name:28s} failed: {type(e).__name__}: {e}")
                continue
            rows.append(row)
            meas = (f"persistent {row['persistent_gib']:7.2f} GiB  peak {row['peak_gib']:7.2f} "
                    f"GiB  in step() {row['step_peak_gib']:7.2f} GiB"
                    if "peak_gib" in row else "(not measured on CPU)")
            print(f"  world {world}  {name:28s} formula {row['formula_gib']:7.2f} GiB  {meas}",
                  flush=True)
    n = rows[0]["params"] if rows else 0
    print(f"\nparameters: {n / 1e9:.3f} B; GiB per rank (persistent = after step + zero_grad; "
          "formula = persistent model of the docstring)")
    worlds = sorted({r["world"] for r in rows})
    cols = ("formula_gib", "persistent_gib", "peak_gib", "step_peak_gib")
    head = "| optimizer | " + " | ".join(f"d={w} formula | d={w} persistent | d={w} peak | "
                                        f"d={w} peak in step()" for w in worlds) + " |"
    print(head)
    print("|---|" + "---|" * (len(cols) * len(worlds)))
    for name in names:
        cells = []
        for w in worlds:
            r = next((r for r in rows if r["name"] == name and r["world"] == w), {})
            cells += [f"{r.get(k, float('nan')):.2f}" for k in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "torch": torch.__version__, "args": vars(args),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
