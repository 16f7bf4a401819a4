"""One setup of bench_gpt_peers.py in this process (one rank of a torchrun-style world).

Every setup trains the GPT example's model (examples/gpt/model.py, TP=1) on the
same random tokens from the same seed; only the training wrapper differs:

========================  ==============================================================
``torch``                 fp32 weights, bf16 autocast, ``torch.optim.AdamW(fused=True)``,
                          eager, no wrapper (world 1 only)
``ddp``                   the same under ``DistributedDataParallel``
``zero1``                 DDP + ``ZeroRedundancyOptimizer`` (fused AdamW shards, ZeRO-1)
``fsdp2``                 ``fully_shard`` per block and the root, ``MixedPrecisionPolicy(
                          param_dtype=bf16, reduce_dtype=fp32)``, fused AdamW on DTensors
``dfa``                   the example's ``--bf16``: bf16 parameters, DistributedFusedAdam
                          with fp32 masters in its shards
``dfa-remainders``        ``--bf16 --store-param-remainders`` (bf16 + int16 remainder)
``adamw``                 ``--bf16`` with bench/dp_adamw.py's DataParallelAdamW: torch AdamW on fp32
                          master copies, gradients all-reduced
``dfa-scaled``            the 7B recipe's memory mode: ``--bf16 --store-param-remainders
                          --exp-avg-dtype bf16`` with bf16 gradients (10 B a parameter)
``dfa-offload``           the same with ``--optimizer-cpu-offload`` (4 B a parameter on
                          the device; the update on the CPU)
``fsdp2-offload``         ``fsdp2`` with ``CPUOffloadPolicy``: parameters, gradients and
                          AdamW's state on the host, the step by torch's CPU AdamW
``torch-bf16``            bf16 weights and ``torch.optim.AdamW(fused=True)`` on them: no
                          fp32 master (lossy; a speed and memory reference)
========================  ==============================================================

A setup that runs out of device memory is a row too (``"oom": true``).

Each iteration: ``grad_acc`` forward/backward passes (all but the last without
gradient sync: ``no_sync`` / ``set_requires_gradient_sync(False)`` / the example's
``optim.no_sync``), clipping to 1.0, the step, ``zero_grad``. Timed per iteration:
the whole iteration and its *step phase* — from the end of the last backward to
the end of ``step()``, so clipping, the wait for outstanding gradient
reductions (DFA, FSDP2) and the step (with ZeRO-1's parameter broadcast, and
DFA's all-gather unless ``--overlap-param-sync`` defers it to the next forward)
— with CUDA events on GPUs, ``perf_counter`` on CPU. Rank 0 writes a JSON
result file.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
# Run as a script from the checkout: the GPT example is the package examples.gpt.
sys.path.insert(0, str(REPO))

import dp_adamw  # noqa: E402  (bench/, beside this script)

from examples.gpt import compiling, logging_utils, optim, precision  # noqa: E402
from examples.gpt.logging_utils import flops_per_token, num_parameters  # noqa: E402
from examples.gpt.model import ATTENTION_BACKENDS, GPT, GPTConfig  # noqa: E402
from mpzero import parallel_state  # noqa: E402
from mpzero import tensor_parallel as tp  # noqa: E402

SETUPS = ("torch", "ddp", "zero1", "fsdp2", "dfa", "dfa-remainders", "adamw", "dfa-scaled",
          "dfa-offload", "fsdp2-offload", "torch-bf16")
DFA = ("dfa", "dfa-remainders", "dfa-scaled", "dfa-offload")
BF16_PARAMS = (*DFA, "adamw", "torch-bf16")  # the example's --bf16 (and bf16 AdamW)
HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
WEIGHT_DECAY, CLIP = 0.1, 1.0


class Timer:
    """Marks on the device's timeline: CUDA events, or the host clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


def _torch_adamw(params, device):
    fused = True if device.type == "cuda" else None
    return torch.optim.AdamW(params, weight_decay=WEIGHT_DECAY, fused=fused, **HP)


class Wrapped:
    """A setup: the module to call, the optimizer, and how it syncs, clips and steps."""

    def __init__(self, model: GPT, module, optimizer, *, autocast, no_sync, clip) -> None:
        self.model, self.module, self.optimizer = model, module, optimizer
        self.autocast, self.no_sync, self.clip = autocast, no_sync, clip

    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        """Forward and backward over ``batch`` (``[grad_acc, micro, seq + 1]`` tokens),
        without gradient sync for all micro-batches but the last; the mean loss."""
        grad_acc = batch.shape[0]
        loss_sum = torch.zeros((), device=batch.device)
        for m in range(grad_acc):
            x, y = batch[m, :, :-1], batch[m, :, 1:]
            with contextlib.nullcontext() if m == grad_acc - 1 else self.no_sync():
                with self.autocast():
                    loss = self.module(x, y)
                (loss / grad_acc).backward()
            loss_sum += loss.detach().float()
        return loss_sum / grad_acc

    def step(self) -> torch.Tensor:
        norm = self.clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


def build(setup: str, cfg: GPTConfig, device: torch.device, a) -> Wrapped:
    """The model of ``cfg`` (seeded, identical in every setup) wrapped for ``setup``."""
    torch.manual_seed(a.seed)
    model = GPT(cfg).to(device)
    autocast = contextlib.nullcontext
    if uses_autocast(setup):  # the torch users' AMP recipe
        def autocast():
            return torch.autocast(device.type, dtype=torch.bfloat16)
    if setup in BF16_PARAMS:
        precision.cast_parameters(model, torch.bfloat16)
    units = compiling.compile_model(model, a.compile_mode) if a.compile else []
    groups = model.param_groups(WEIGHT_DECAY)
    world = dist.get_world_size()

    def torch_clip():
        return torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)

    if setup in ("torch", "torch-bf16"):
        if world != 1:
            raise ValueError("setup 'torch' has no gradient sync: run it with --nproc 1")
        return Wrapped(model, model, _torch_adamw(groups, device), autocast=autocast,
                       no_sync=contextlib.nullcontext, clip=torch_clip)
    if setup in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  bucket_cap_mb=a.bucket_cap_mb)
        if setup == "ddp":
            opt = _torch_adamw(groups, device)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                groups, optimizer_class=torch.optim.AdamW, weight_decay=WEIGHT_DECAY,
                fused=True if device.type == "cuda" else None, **HP)
        return Wrapped(model, ddp, opt, autocast=autocast, no_sync=ddp.no_sync,
                       clip=torch_clip)
    if setup in ("fsdp2", "fsdp2-offload"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        kw = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                            reduce_dtype=torch.float32))
        if setup == "fsdp2-offload":
            kw["offload_policy"] = CPUOffloadPolicy()
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        opt = _torch_adamw(model.param_groups(WEIGHT_DECAY),
                           torch.device("cpu") if setup == "fsdp2-offload" else device)

        @contextlib.contextmanager
        def no_sync():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return Wrapped(model, model, opt, autocast=autocast, no_sync=no_sync,
                       clip=torch_clip)
    if setup in (*DFA, "adamw"):
        build = dp_adamw.build_dp_adamw if setup == "adamw" else optim.build_optimizer
        scaled = setup in ("dfa-scaled", "dfa-offload")
        extra = dict(scaled_moments=True, cpu_offload=setup == "dfa-offload") if scaled else {}
        opt = build(
            model, weight_decay=WEIGHT_DECAY,
            device=device, overlap_grad_sync=True, overlap_param_sync=a.overlap_param_sync,
            bucket_cap_mb=a.bucket_cap_mb,
            grad_sync_dtype=torch.bfloat16 if a.grad_sync_dtype == "bf16" or scaled else None,
            store_param_remainders=setup == "dfa-remainders" or scaled, compiled_units=units,
            gradient_accumulation_fusion=grad_accumulation_fusion(setup, a), **extra, **HP)
        if grad_accumulation_fusion(setup, a):
            optim.prepare_grad_accumulation_fusion(opt)
        return Wrapped(model, model, opt, autocast=autocast,
                       no_sync=lambda: optim.no_sync(opt), clip=lambda: opt.clip_grad_norm(CLIP))
    raise ValueError(f"unknown setup {setup!r}; one of {SETUPS}")


def uses_autocast(setup: str) -> bool:
    """The fp32-weight setups run their forward under bf16 autocast (FSDP2 casts its
    parameters to bf16 itself, the example's setups hold bf16 parameters)."""
    return setup not in BF16_PARAMS and not setup.startswith("fsdp2")


def grad_accumulation_fusion(setup: str, a) -> bool:
    """The dfa setups' weight-gradient GEMMs add into the optimizer's buffer: as the flag
    says, or (None) with several micro-batches per iteration, as the example does."""
    if setup not in ("dfa", "dfa-remainders"):
        return False
    flag = a.gradient_accumulation_fusion
    return a.grad_acc > 1 if flag is None else bool(flag)


def model_config(a, setup: str = "") -> GPTConfig:
    """The GPT of the shape flags (:func:`add_shape_args`); the same for every setup."""
    llama = dict(swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                 untie_embeddings_and_output_weights=True, add_bias_linear=False) \
        if a.llama else {}
    return GPTConfig(vocab_size=a.vocab_size, seq_length=a.seq_length, num_layers=a.num_layers,
                     hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                     ffn_hidden_size=a.ffn_hidden_size,
                     recompute_granularity=a.recompute_granularity,
                     attention_backend=a.attention_backend, openai_gelu=a.openai_gelu,
                     gelu_gemm_keep_output=bool(a.gelu_gemm_keep_output), **llama)


# Bench-only flags that force a fused path of mpzero.tensor_parallel on or off (default:
# the op decides, as in the example): --X-fusion / --no-X-fusion.
FUSION_FLAGS = {"bias_gelu_fusion": "bias_gelu", "gelu_gemm_fusion": "gelu_gemm",
                "heads_grad_fusion": "heads_grad", "layernorm_fusion": "layer_norm"}


def fused_path_modes(a) -> dict[str, str]:
    """``{op: "auto" | "on" | "off"}`` of the fusion flags (``tp.fused_paths``'s modes;
    "on" still needs the dtypes that make the fused path the same function, so the
    autocast setups stay unfused)."""
    return {op: "auto" if getattr(a, flag) is None else ("on" if getattr(a, flag) else "off")
            for flag, op in FUSION_FLAGS.items()}


def set_fused_paths(a) -> None:
    """Apply the fusion flags to this process (``tp.set_fused_paths``)."""
    for op, mode in fused_path_modes(a).items():
        tp.set_fused_paths(mode, [op])


def run(setup: str, a) -> dict | None:
    """Train ``a.warmup + a.iters`` iterations; rank 0's summary (None elsewhere)."""
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) \
        if not a.cpu else torch.device("cpu")
    cfg = model_config(a, setup)
    try:
        return _train(setup, cfg, device, a)
    except torch.OutOfMemoryError as e:  # a row of its own: the setup does not fit
        if rank != 0:
            return None
        return {"setup": setup, "error": "out of memory", "oom": True,
                "detail": str(e).splitlines()[0][:300]}


def _train(setup: str, cfg: GPTConfig, device: torch.device, a) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    w = build(setup, cfg, device, a)
    gen = torch.Generator().manual_seed(a.seed * 1000 + rank)  # each DP rank its own data
    total = a.warmup + a.iters
    data = torch.randint(cfg.vocab_size, (total, a.grad_acc, a.micro_batch_size,
                                          cfg.seq_length + 1), generator=gen)
    timer = Timer(device)
    marks, losses = [], []  # read after the loop: no host sync inside it, as in training
    for it in range(total):
        batch = data[it].to(device)
        start = timer.mark()
        losses.append(w.forward_backward(batch))
        backward_end = timer.mark()
        w.step()
        end = timer.mark()
        if it >= a.warmup:
            marks.append((start, backward_end, end))
    iter_ms = [timer.ms(s, e) for s, _, e in marks]
    step_ms = [timer.ms(b, e) for _, b, e in marks]
    losses = [float(x) for x in losses]
    mem = torch.tensor([logging_utils.memory_gib(device)], device=device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    if rank != 0:
        return None
    it_ms, st_ms = statistics.median(iter_ms), statistics.median(step_ms)
    tokens = a.micro_batch_size * cfg.seq_length * a.grad_acc * world
    tokens_per_s = tokens / (it_ms / 1e3)
    tflops = flops_per_token(cfg) * tokens_per_s / world / 1e12
    peak = a.peak_tflops
    if peak is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in logging_utils.PEAK_BF16_TFLOPS.items() if k in name), None)
    return {"setup": setup, "compile": a.compile_mode if a.compile else None, "world": world,
            "attention_backend": a.attention_backend, "openai_gelu": a.openai_gelu,
            "grad_acc": a.grad_acc,
            "gradient_accumulation_fusion": grad_accumulation_fusion(setup, a),
            "fused_paths": fused_path_modes(a),
            "gelu_gemm_keep_output": cfg.gelu_gemm_keep_output,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "iter_ms": it_ms, "tokens_per_s": tokens_per_s, "tflops_per_device": tflops,
            "mfu": tflops / peak if peak else None, "peak_gib": float(mem),
            "memory_kind": logging_utils.memory_kind(device),
            "step_ms": st_ms, "step_share": st_ms / it_ms, "loss_first": losses[0],
            "loss_last": losses[-1], "parameters": num_parameters(cfg),
            "iter_ms_all": iter_ms, "step_ms_all": step_ms}


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The flags the driver passes on to every worker."""
    g = p.add_argument_group("model and batch")
    g.add_argument("--num-layers", type=int, default=24)
    g.add_argument("--hidden-size", type=int, default=2048)
    g.add_argument("--num-attention-heads", type=int, default=16)
    g.add_argument("--seq-length", type=int, default=2048)
    g.add_argument("--micro-batch-size", type=int, default=8)
    g.add_argument("--vocab-size", type=int, default=50304)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP width (4 x hidden)")
    g.add_argument("--llama", action="store_true", help="SwiGLU, RMSNorm, RoPE, untied "
                   "output layer, no linear biases (the example's Llama flags)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="every setup's activation recompute (the example's flag)")
    g.add_argument("--grad-acc", type=int, default=1, help="micro-batches per iteration")
    g.add_argument("--attention-backend", choices=["auto", *ATTENTION_BACKENDS], default="auto",
                   help="SDPA kernel of every setup (the example's flag)")
    g.add_argument("--openai-gelu", action="store_true",
                   help="every setup's MLP with GELU's tanh approximation (the example's flag)")
    g = p.add_argument_group("run")
    g.add_argument("--warmup", type=int, default=5, help="untimed iterations (compilation)")
    g.add_argument("--iters", type=int, default=20, help="timed iterations")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--compile", action="store_true", help="torch.compile every setup")
    g.add_argument("--compile-mode", choices=list(compiling.MODES), default="block")
    g.add_argument("--grad-sync-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dfa/dfa-remainders/adamw: gradient reduction dtype")
    g.add_argument("--overlap-param-sync", action=argparse.BooleanOptionalAction,
                   default=True, help="dfa setups: all-gather parameters in the next forward")
    g.add_argument("--bucket-cap-mb", type=float, default=100.0)
    g.add_argument("--bias-gelu-fusion", action=argparse.BooleanOptionalAction, default=None,
                   help="force every setup's MLP bias + GELU op (bias gradient in its "
                        "backward) on or off, where its dtypes allow (None: the op decides)")
    g.add_argument("--gelu-gemm-fusion", action=argparse.BooleanOptionalAction, default=None,
                   help="force every setup's MLP with bias and GELU in its GEMMs on or off, "
                        "where its dtypes allow (None: the op decides: --openai-gelu, bf16, "
                        "a GPU with the extension)")
    g.add_argument("--gelu-gemm-keep-output", action=argparse.BooleanOptionalAction,
                   default=True, help="where the GELU runs in the GEMMs: save its output for "
                   "the backward (else made again there)")
    g.add_argument("--heads-grad-fusion", action=argparse.BooleanOptionalAction, default=None,
                   help="force every setup's one-pass QKV backward on or off, where its "
                        "dtypes allow (None: the op decides)")
    g.add_argument("--layernorm-fusion", action=argparse.BooleanOptionalAction, default=None,
                   help="force every setup's fused norms (and ln_2's residual add) on or off, "
                        "where its dtypes allow (None: the op decides)")
    g.add_argument("--gradient-accumulation-fusion", action=argparse.BooleanOptionalAction,
                   default=None, help="dfa setups: weight-gradient GEMMs add into the "
                   "optimizer's fp32 buffer (None: when --grad-acc > 1, as the example)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per device for MFU (None: known GPUs' dense bf16 peak, "
                        "e.g. 989 for H100/H200)")
    g.add_argument("--cpu", action="store_true", help="CPU ranks with gloo")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", choices=SETUPS, required=True)
    p.add_argument("--result", required=True, help="JSON file rank 0 writes")
    add_shape_args(p)
    a = p.parse_args(argv)
    if a.cpu:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    set_fused_paths(a)
    out = run(a.setup, a)
    if out is not None:
        Path(a.result).write_text(json.dumps(out))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
