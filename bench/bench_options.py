"""Time and peak memory of one GPT forward/backward per model option (one GPU, bf16).

    python bench/bench_options.py [--layers 24 --hidden 2048 --heads 16 --seq 2048]

Prints one JSON line per variant: median step time over --iters and
``torch.cuda.max_memory_allocated`` (parameters and gradients included), for the
default model, ``--recompute-activations`` (selective), ``--recompute-granularity
full`` and the Llama options. Sequence parallelism needs TP > 1 (several GPUs).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch

# The GPT example is the package examples.gpt (--compare-module: any module path).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {
    "default": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full"},
    "llama": {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
              "untie_embeddings_and_output_weights": True, "add_bias_linear": False},
}


def run(module: str, extra: dict, a) -> dict:
    mod = importlib.import_module(module)
    cfg = mod.GPTConfig(vocab_size=a.vocab, seq_length=a.seq, num_layers=a.layers,
                        hidden_size=a.hidden, num_attention_heads=a.heads, **extra)
    torch.manual_seed(0)
    model = mod.GPT(cfg).cuda()
    ids = torch.randint(a.vocab, (a.micro_batch, a.seq), device="cuda")
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(a.warmup + a.iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, ids)
        loss.backward()
        torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=False)
    out = {"model": module, "variant": extra, "step_s": sorted(times)[len(times) // 2],
           "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
           "loss": float(loss.detach())}
    del model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--compare-module", default=None,
                   help="also time this module's default model (e.g. an older model.py)")
    a = p.parse_args()
    if a.compare_module:
        print(json.dumps(run(a.compare_module, {}, a)), flush=True)
    for name in a.variants:
        row = run("examples.gpt.model", VARIANTS[name], a)
        print(json.dumps({"name": name, **row}), flush=True)
    if a.compare_module:
        print(json.dumps(run(a.compare_module, {}, a)), flush=True)


if __name__ == "__main__":
    main()
