"""Training logs of the GPT example: console lines, a progress bar, JSONL and TensorBoard.

One :class:`TrainLogger` per run (every rank builds one; only global rank 0 writes):
every ``--log-interval`` iterations one line in the manner of Megatron-LM and
torchtitan (``iter 40/300 | samples ... | loss ... | MFU ... | peak mem ...``), above a
tqdm bar on a terminal (none in files, SLURM logs, CI or with ``--no-progress``); the
JSONL log (``--log-file``) keeps every field, ``--tensorboard-dir`` the same scalars.
Also the model's size and FLOPs per token for the MFU column. (Named so as not to
shadow the standard library's :mod:`logging`.)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from .model import GPTConfig

# Dense bf16 peak per GPU (TFLOP/s) for the MFU column; None elsewhere (CPU, unknown GPU).
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}

# The scalars written to TensorBoard: JSONL key -> TensorBoard tag.
TENSORBOARD_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale",
    "consumed_samples": "train/consumed_samples",
    "consumed_tokens": "train/consumed_tokens",
    "iter_time_ms": "throughput/iter_time_ms",
    "tokens_per_s": "throughput/tokens_per_s",
    "tflops_per_device": "throughput/tflops_per_device",
    "mfu": "throughput/mfu",
    "memory_gib": "memory/peak_gib",
    "val_loss": "eval/val_loss",
}


def peak_tflops(given: float | None, bf16: bool, device: torch.device) -> float | None:
    """``--peak-tflops`` (``given``), or the bf16 peak of a known GPU when computing in
    bf16; None when unknown (no MFU)."""
    if given is not None:
        return given
    if device.type != "cuda" or not bf16:
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: max allocated on CUDA, peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):  # peak RSS, in kB
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def memory_kind(device: torch.device) -> str:
    return "cuda_max_allocated" if device.type == "cuda" else "cpu_peak_rss"


def format_train_line(r: dict) -> str:
    """The console line of a train record (the fields that are present)."""
    total = r.get("train_iters")
    width = len(str(total)) if total else 6
    parts = [f"iter {r['iteration']:{width}d}" + (f"/{total}" if total else ""),
             f"samples {r['consumed_samples']:,}", f"tokens {r['consumed_tokens']:,}",
             f"loss {r['loss']:.4f}", f"lr {r['lr']:.3e}", f"grad norm {r['grad_norm']:.3f}"]
    if r.get("loss_scale") is not None:
        parts.append(f"loss scale {r['loss_scale']:g}")
    parts += [f"{r['iter_time_ms']:.1f} ms/iter", f"{r['tokens_per_s']:,.0f} tok/s",
              f"{r['tflops_per_device']:.4g} TFLOP/s/dev",
              "MFU -" if r.get("mfu") is None else f"MFU {100 * r['mfu']:.1f}%",
              f"peak mem {r['memory_gib']:.2f} GiB"]
    return " | ".join(parts)


class JsonlLog:
    """Appends one JSON object per line (and flushes, so a crash keeps what was written)."""

    def __init__(self, path: str | None) -> None:
        self.f = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.f = open(path, "a")  # noqa: SIM115 - lives as long as the run

    def write(self, record: dict) -> None:
        if self.f is not None:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


def _make_bar(total: int, initial: int):
    try:
        from tqdm import tqdm
    except ImportError:  # plain lines without tqdm
        return None
    return tqdm(total=total, initial=initial, dynamic_ncols=True, mininterval=1.0,
                desc="train", file=sys.stderr, leave=True)


class TrainLogger:
    """Console, progress bar, JSONL and TensorBoard output of one training run.

    ``enabled`` is False on every rank but global rank 0: then every method does
    nothing, so call sites need no rank checks. ``progress=None`` shows the bar
    exactly when stderr is a terminal.
    """

    def __init__(self, *, enabled: bool, train_iters: int, start_iteration: int,
                 log_file: str | None = None, tensorboard_dir: str | None = None,
                 progress: bool | None = None) -> None:
        self.enabled = enabled
        self.train_iters = train_iters
        self.jsonl = JsonlLog(log_file if enabled else None)
        self.tb = None
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=tensorboard_dir)
        if progress is None:
            progress = is_tty()
        self.bar = _make_bar(train_iters, start_iteration) if enabled and progress else None

    # -- output ----------------------------------------------------------------------
    def message(self, text: str) -> None:
        """A line on the console (above the bar when there is one)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(text, flush=True)

    def setup(self, record: dict) -> None:
        """The run's layout (``kind: setup``): JSONL, and as text in TensorBoard."""
        if not self.enabled:
            return
        record = {"kind": "setup", **record}
        self.jsonl.write(record)
        if self.tb is not None:
            self.tb.add_text("setup", "```\n" + json.dumps(record, indent=1) + "\n```",
                             record.get("iteration", 0))

    def step(self, n: int = 1) -> None:
        """Advance the progress bar by ``n`` iterations."""
        if self.bar is not None:
            self.bar.update(n)

    def train(self, *, iteration: int, loss: float, lr: float, grad_norm: float,
              interval_s: float, interval_iters: int, global_batch_size: int,
              seq_length: int, flops_per_token: float, world_size: int,
              peak_tflops: float | None, memory_gib: float, memory_kind: str,
              loss_scale: float | None = None, **extra) -> dict:
        """Log one interval: ``interval_iters`` iterations that took ``interval_s`` seconds.

        Returns the record (on every rank; only rank 0 writes it)."""
        tokens_per_iter = global_batch_size * seq_length
        iter_s = interval_s / max(1, interval_iters)
        tok_s = tokens_per_iter / iter_s if iter_s > 0 else 0.0
        tflops = flops_per_token * tok_s / world_size / 1e12
        record = {"kind": "train", "iteration": iteration, "train_iters": self.train_iters,
                  "consumed_samples": iteration * global_batch_size,
                  "consumed_tokens": iteration * tokens_per_iter,
                  "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "iter_time_s": iter_s, "iter_time_ms": 1e3 * iter_s,
                  "tokens_per_s": tok_s, "tflops_per_device": tflops,
                  "mfu": None if peak_tflops is None else tflops / peak_tflops,
                  "memory_gib": memory_gib, "memory_kind": memory_kind, **extra}
        if loss_scale is not None:
            record["loss_scale"] = loss_scale
        if not self.enabled:
            return record
        self.jsonl.write(record)
        self._scalars(record, iteration)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        self.message(format_train_line(record))
        return record

    def eval(self, iteration: int, val_loss: float) -> None:
        if not self.enabled:
            return
        record = {"kind": "eval", "iteration": iteration, "val_loss": val_loss}
        self.jsonl.write(record)
        self._scalars(record, iteration)
        width = len(str(self.train_iters))
        self.message(f"iter {iteration:{width}d}/{self.train_iters} | validation loss "
                     f"{val_loss:.4f}")

    def _scalars(self, record: dict, iteration: int) -> None:
        if self.tb is None:
            return
        for key, tag in TENSORBOARD_TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.tb.add_scalar(tag, value, iteration)
        self.tb.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        self.jsonl.close()


def is_tty() -> bool:
    """Whether stderr (where the bar goes) is a terminal; ``TERM=dumb`` counts as not."""
    return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"


# ----------------------------------------------------------------------------- model size


def num_parameters(cfg: GPTConfig) -> int:
    """Parameters of the full (unsharded, unsplit) model of ``cfg``."""
    h, f, L, V = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers, cfg.vocab_size
    b = 1 if cfg.linear_bias else 0
    qkv = h + 2 * cfg.num_query_groups * cfg.head_dim
    fc = 2 * f if cfg.swiglu else f
    norm = h * (2 if cfg.bias and cfg.normalization == "LayerNorm" else 1)
    per_layer = (h * qkv + qkv * b) + (h * h + h * b) + (h * fc + fc * b) + (f * h + h * b)
    per_layer += 2 * norm
    total = L * per_layer + V * h + norm
    if cfg.position_embedding_type == "learned_absolute":
        total += cfg.seq_length * h
    if cfg.untie_embeddings_and_output_weights:
        total += V * h
    return total


def flops_per_token(cfg: GPTConfig, seq_length: int | None = None) -> float:
    """Training FLOPs (forward + backward = 3x forward) per token of the full model.

    Matmuls only, 2 FLOPs per multiply-add: per layer QKV ``2h(h + 2*G*hd)`` (``6h^2``
    for multi-head), projection ``2h^2``, MLP ``4hf`` (``6hf`` with SwiGLU), attention
    scores and values ``4sh`` (counted without the causal half, as Megatron and PaLM
    do); the output layer ``2hV``. Recomputation is not counted (model FLOPs).
    Equals ``6 * N_matmul + 12 * L * s * h``.
    """
    s = cfg.seq_length if seq_length is None else seq_length
    h, f, L, V = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers, cfg.vocab_size
    qkv = h + 2 * cfg.num_query_groups * cfg.head_dim
    mlp = 3 * h * f if cfg.swiglu else 2 * h * f
    forward = L * (2 * h * qkv + 2 * h * h + 2 * mlp + 4 * s * h) + 2 * h * V
    return 3.0 * forward
