"""The GPT example's model trained by mpzero and by its PyTorch peers, side by side.

    python bench/bench_gpt_peers.py                       # 1.3B shape, one GPU, all setups
    python bench/bench_gpt_peers.py --compile --json peers_compiled.json
    python bench/bench_gpt_peers.py --small --nproc 8 --setups ddp,fsdp2,dfa
    python bench/bench_gpt_peers.py --cpu --iters 2       # tiny shape on gloo (CI smoke test)

One process per setup (``gpt_peers_worker.py``, under ``torch.distributed.run``
when ``--nproc`` > 1), each from the same seed, on the same random tokens, with the
same model (examples/gpt/model.py at TP=1) and hyper-parameters; the setups are
listed in gpt_peers_worker.py: plain PyTorch with bf16 autocast (``torch``),
``ddp``, ``zero1`` (ZeroRedundancyOptimizer), ``fsdp2`` (bf16 params, fp32
reduce), and the example's ``--bf16`` with DistributedFusedAdam (``dfa``),
``--store-param-remainders`` (``dfa-remainders``) and ``--optimizer adamw``
(``adamw``, fp32 master copies). ``--compile`` compiles every setup's blocks
(``--compile-mode model``: the whole forward).

The table: iteration time (median of ``--iters`` after ``--warmup``), tokens/s
(over all ranks), TFLOP/s per device and MFU (the example's ``flops_per_token``:
6 x matmul parameters + 12 x layers x seq x hidden, over the device's dense bf16
peak, ``--peak-tflops``; 989 for H100/H200), peak memory
(``torch.cuda.max_memory_allocated``, max over ranks; peak RSS on CPU), and the
step phase (clip + wait for the gradient reductions + step, timed with CUDA
events; DFA's parameter all-gather is in the next forward with the default
``--overlap-param-sync``, FSDP2's always) in ms and as a share of the iteration.
``--json PATH`` writes every row (with the per-iteration times).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpt_peers_worker as worker  # noqa: E402

LARGE = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
             micro_batch_size=8, vocab_size=50304)  # the 1.3B of the GPT-3 paper (default)
SMALL = dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024,
             micro_batch_size=8, vocab_size=50304)  # GPT-2 small (124M)
LLAMA7B = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=4096,
               micro_batch_size=1, vocab_size=32000, ffn_hidden_size=11008)  # Llama-2-7B
CPU = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
           micro_batch_size=2, vocab_size=512)
SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
               "micro_batch_size", "vocab_size", "ffn_hidden_size")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--setups", default=",".join(worker.SETUPS),
                   help=f"comma-separated, of {', '.join(worker.SETUPS)}")
    p.add_argument("--nproc", type=int, default=1, help="ranks per setup (one GPU each)")
    p.add_argument("--small", action="store_true", help="GPT-2 small shape: " + str(SMALL))
    p.add_argument("--llama7b", action="store_true",
                   help="the Llama-2-7B shape (" + str(LLAMA7B) + ") with --llama and full "
                   "recompute: the one-GPU memory modes, e.g. --setups dfa-scaled,dfa-offload,"
                   "fsdp2-offload,torch-bf16,torch --grad-acc 8")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per setup")
    worker.add_shape_args(p)
    p.set_defaults(**dict.fromkeys(SHAPE_FLAGS))  # None: from the preset
    a = p.parse_args(argv)
    preset = CPU if a.cpu else SMALL if a.small else LLAMA7B if a.llama7b else LARGE
    for key, value in preset.items():
        if getattr(a, key) is None:  # explicit shape flags win over the preset
            setattr(a, key, value)
    if a.llama7b:
        a.llama = True
        a.recompute_granularity = a.recompute_granularity or "full"
    a.setups = [s for s in a.setups.split(",") if s]
    unknown = sorted(set(a.setups) - set(worker.SETUPS))
    if unknown:
        p.error(f"--setups: unknown {unknown}; choose from {', '.join(worker.SETUPS)}")
    for one in ("torch", "torch-bf16"):
        if a.nproc > 1 and one in a.setups:
            a.setups.remove(one)  # no gradient sync: a one-process baseline
            print(f"note: setup {one!r} runs only with --nproc 1; skipped", file=sys.stderr)
    return a


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_argv(a: argparse.Namespace, setup: str, result: Path) -> list[str]:
    out = ["--setup", setup, "--result", str(result)]
    for key in (*SHAPE_FLAGS, "grad_acc", "warmup", "iters", "seed", "compile_mode",
                "grad_sync_dtype", "bucket_cap_mb", "peak_tflops", "attention_backend",
                "recompute_granularity"):
        value = getattr(a, key)
        if value is not None:
            out += [f"--{key.replace('_', '-')}", str(value)]
    for flag in ("compile", "cpu", "openai_gelu", "llama"):
        if getattr(a, flag):
            out.append(f"--{flag.replace('_', '-')}")
    out.append("--overlap-param-sync" if a.overlap_param_sync else "--no-overlap-param-sync")
    for flag in ("gradient_accumulation_fusion", "bias_gelu_fusion", "gelu_gemm_fusion",
                 "gelu_gemm_keep_output", "heads_grad_fusion", "layernorm_fusion"):
        value = getattr(a, flag)
        if value is not None:
            name = flag.replace("_", "-")
            out.append(f"--{name}" if value else f"--no-{name}")
    return out


def launch(a: argparse.Namespace, setup: str) -> dict:
    """Run one setup in fresh processes; its row, or ``{"setup", "error"}``."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        script = [str(HERE / "gpt_peers_worker.py"), *worker_argv(a, setup, result)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])))
        if a.cpu:
            env["OMP_NUM_THREADS"] = "1"
        if a.nproc == 1:
            env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
            cmd = [sys.executable, *script]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(a.nproc), *script]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                                  env=env, cwd=HERE.parent)
        except subprocess.TimeoutExpired:
            return {"setup": setup, "error": f"timed out after {a.timeout:.0f} s"}
        if proc.returncode != 0 or not result.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
            return {"setup": setup, "error": f"exit {proc.returncode}", "log": tail}
        return json.loads(result.read_text())


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    head = ("setup", "compile", "iter ms", "tokens/s", "TFLOP/s/dev", "MFU", "peak GiB",
            "step ms", "step %", "loss first→last")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['setup']} | failed: {r['error']}" + " | " * (len(head) - 2))
            continue
        lines.append(" | ".join([
            r["setup"], r["compile"] or "-", _fmt(r["iter_ms"], ".1f"),
            _fmt(r["tokens_per_s"], ",.0f"), _fmt(r["tflops_per_device"], ".4g"),
            _fmt(r["mfu"], ".3f"), _fmt(r["peak_gib"], ".2f"), _fmt(r["step_ms"], ".1f"),
            _fmt(100 * r["step_share"], ".1f"),
            f"{r['loss_first']:.3f}→{r['loss_last']:.3f}"]))
    return "\n".join("| " + line + " |" for line in lines)


def main(argv: list[str] | None = None) -> list[dict]:
    a = parse_args(argv)
    shape = {k: getattr(a, k) for k in SHAPE_FLAGS}
    print(f"shape {shape}, grad-acc {a.grad_acc}, ranks {a.nproc}, "
          f"{'tanh' if a.openai_gelu else 'exact'} GELU, "
          f"{'cpu (gloo)' if a.cpu else 'cuda (nccl)'}, warmup {a.warmup}, iters {a.iters}"
          f"{', compiled (' + a.compile_mode + ')' if a.compile else ''}", flush=True)
    rows = []
    for setup in a.setups:
        row = launch(a, setup)
        rows.append(row)
        if "error" in row:
            print(f"{setup}: failed ({row['error']})\n  " + "\n  ".join(row.get("log", [])),
                  file=sys.stderr, flush=True)
        else:
            print(f"{setup}: {row['iter_ms']:.1f} ms/iter, {row['peak_gib']:.2f} GiB, "
                  f"step {row['step_ms']:.1f} ms", flush=True)
        if a.json:  # after every setup: a run cut off later keeps the rows it has
            Path(a.json).write_text(json.dumps({"shape": shape, "nproc": a.nproc,
                                                "grad_acc": a.grad_acc, "compile": a.compile,
                                                "openai_gelu": a.openai_gelu,
                                                "compile_mode": a.compile_mode, "rows": rows},
                                               indent=1))
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
