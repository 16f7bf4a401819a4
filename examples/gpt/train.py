"""Pretrain the GPT example with tensor parallelism x ZeRO-2 data parallelism.

One process per GPU (or per CPU rank with ``--cpu``, gloo)::

    torchrun --nproc-per-node 2 -m examples.gpt.train --cpu \\
        --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 64 \\
        --micro-batch-size 8 --global-batch-size 16 --train-iters 300 \\
        --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 30 --log-file run.jsonl

    torchrun --nproc-per-node 8 -m examples.gpt.train --bf16 \\
        --tensor-model-parallel-size 2 --distributed-optimizer-size 4 --overlap-param-sync ...

The world is ``tp x pp x dp`` ranks (``mpzero.parallel_state``; the pipeline
stages run the 1F1B schedule of pipeline.py); the data-parallel group is split
into the optimizer's distributed x redundant grid (``--distributed-optimizer-size``).
Each iteration consumes one global batch: ``global = micro x dp x grad_acc``
sequences (with PP the grad-acc micro-batches are the pipeline's), the same
sequences whatever the layout (see data.py), with ``optimizer.no_sync()`` for
all micro-batches but the last. See README.md beside this file for the flags and the log format.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mpzero import parallel_state
from mpzero import tensor_parallel as tp

from . import (
    arg_checks,
    checkpointing,
    compiling,
    data,
    faults,
    logging_utils,
    optim,
    pipeline,
    precision,
    resume,
)
from .model import (
    ATTENTION_BACKENDS,
    GPT,
    GPTConfig,
    flops_per_token,
    padded_vocab_size,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Pretrain a GPT with TP x ZeRO-2 DP (mpzero)",
                                formatter_class=arg_checks.HelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="None: 4 x hidden")
    g.add_argument("--seq-length", type=int, default=256)
    g.add_argument("--dropout", type=float, default=0.0)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   default="learned_absolute")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--swiglu", action="store_true", help="SiLU-gated MLP (Llama)")
    g.add_argument("--openai-gelu", action="store_true",
                   help="GELU's tanh approximation (GPT-2's; the function of Megatron's fused "
                        "bias-GELU) instead of the exact erf GELU: cheaper elementwise kernels")
    g.add_argument("--bias-gelu-fusion", action=argparse.BooleanOptionalAction, default=False,
                   help="the MLP's bias add and GELU as one op whose backward also makes the "
                        "bias gradient; the same function either way")
    g.add_argument("--gelu-gemm-fusion", action=argparse.BooleanOptionalAction, default=None,
                   help="the MLP's bias and GELU inside its GEMMs (cuBLASLt epilogues, tanh "
                        "GELU: needs --openai-gelu); the same function. None: on with "
                        "--openai-gelu, --bf16 and the CUDA extension")
    g.add_argument("--gelu-gemm-keep-output", action=argparse.BooleanOptionalAction,
                   default=True, help="with --gelu-gemm-fusion: save the GELU's output for "
                   "the backward (else made again there: less memory, a bit slower)")
    g.add_argument("--heads-grad-fusion", action=argparse.BooleanOptionalAction, default=True,
                   help="the QKV projections' backward takes the heads' gradients and makes "
                        "the bias gradient in one pass (where activations and weights share a "
                        "dtype); the same function")
    g.add_argument("--layernorm-fusion", action=argparse.BooleanOptionalAction, default=True,
                   help="LayerNorm (or RMSNorm) forward and backward one kernel each, with "
                        "the residual add before the second norm of a block in the same pass "
                        "(where activations and weights share a dtype); the same function")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="KV heads with --group-query-attention (split over TP when >= tp)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--attention-backend", choices=["auto", *ATTENTION_BACKENDS], default="auto",
                   help="the SDPA kernel of the attention core (auto: torch's choice, "
                        "cuDNN or flash on Hopper; math: the reference, any device)")
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="no biases in the linear layers (the norms keep theirs)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="shard norms, dropout and residual along the sequence over TP")
    g.add_argument("--recompute-activations", action="store_true",
                   help="= --recompute-granularity selective")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="full: whole blocks; selective: the attention core")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="full: recompute the first N blocks (default all)")
    g = p.add_argument_group("batch and schedule")
    g.add_argument("--micro-batch-size", type=int, default=8)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="sequences per iteration (None: micro x dp, no accumulation)")
    g.add_argument("--train-iters", type=int, default=1000)
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--min-lr", type=float, default=6e-5)
    g.add_argument("--lr-warmup-iters", type=int, default=100)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="None: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="max grad norm; 0 = off")
    g = p.add_argument_group("parallelism and optimizer")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages (1F1B over the micro-batches; see pipeline.py)")
    g.add_argument("--distributed-optimizer-size", type=int, default=None,
                   help="ranks one optimizer shard is spread over (None: the whole DP group)")
    g.add_argument("--distribute-within-nodes", action="store_true",
                   help="shard the optimizer over the DP ranks of each node")
    g.add_argument("--overlap-grad-sync", action=argparse.BooleanOptionalAction, default=True,
                   help="reduce-scatter gradient buckets during backward")
    g.add_argument("--overlap-param-sync", action=argparse.BooleanOptionalAction,
                   default=False, help="all-gather parameters in the next forward pass")
    g.add_argument("--bucket-cap-mb", type=float, default=100.0)
    g.add_argument("--gradient-accumulation-fusion", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="the linear layers' weight-gradient GEMMs add into the optimizer's "
                        "fp32 gradient buffer (dfa; None: on when accumulating over several "
                        "micro-batches without autocast)")
    g = p.add_argument_group("precision and device")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 parameters and activations; fp32 master weights in the optimizer")
    g.add_argument("--autocast-bf16", action="store_true",
                   help="fp32 parameters under bf16 autocast (GPU; fp32 on CPU)")
    g.add_argument("--grad-sync-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype of the gradient reduction (and of DFA's accumulation buckets)")
    g.add_argument("--param-sync-dtype", choices=["fp32", "bf16"], default=None,
                   help="dtype of DFA's parameter all-gather (None: the parameters' dtype)")
    g.add_argument("--store-param-remainders", action="store_true",
                   help="with --bf16 and dfa: keep the fp32 masters as the bf16 parameter "
                        "plus an int16 remainder (2 bytes per parameter instead of 4)")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="optimizer state in host memory and the Adam update on the CPU "
                        "(DistributedFusedAdam's cpu_offload)")
    g.add_argument("--cpu", action="store_true", help="run on CPU with gloo")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads per CPU rank")
    g.add_argument("--dist-timeout", type=float, default=600.0,
                   help="seconds a collective may wait for the other ranks before failing")
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction,
                   default=True, help="skip the step when the loss or grad norm is not finite")
    g.add_argument("--max-consecutive-skipped-iters", type=int, default=10,
                   help="stop with an error after this many skipped steps in a row")
    g = p.add_argument_group("compilation")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--compile-mode", choices=list(compiling.MODES), default=None,
                   help="block: each transformer block (default with --compile); "
                        "model: the whole forward")
    g.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend (aot_eager: no code generation, for checks)")
    g = p.add_argument_group("data")
    g.add_argument("--data-dir", default=None,
                   help="prepared data (data.py); prepared from the default corpus if empty")
    g.add_argument("--vocab-size", type=int, default=4096,
                   help="BPE vocabulary when preparing the default corpus")
    g.add_argument("--data-max-mb", type=float, default=4.0,
                   help="MiB of the default corpus when preparing it")
    g.add_argument("--data-path", default=None,
                   help="Megatron indexed dataset PREFIX (PREFIX.bin + PREFIX.idx)")
    g.add_argument("--split", default="969,30,1",
                   help="train,valid,test document weights of --data-path")
    g.add_argument("--tokenizer-file", default=None,
                   help="tokenizers JSON: its vocabulary sizes the model")
    g.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", default=None, help="checkpoint directory to write")
    g.add_argument("--load", default=None, help="checkpoint directory to resume from")
    g.add_argument("--load-iteration", type=int, default=None, help="None: the latest")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default="torch_dist",
                   help="torch_dist: each rank writes its shards (DCP), loads at any grid; "
                        "torch: one format-2 file per TP rank")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving) at iterations divisible by this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and stop after this many minutes (decided by all ranks)")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    resume.add_arguments(g)
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=100, help="0 = only at the end")
    g.add_argument("--eval-iters", type=int, default=10, help="global batches per evaluation")
    g.add_argument("--log-file", default=None, help="JSONL log (rank 0 appends)")
    g.add_argument("--tensorboard-dir", default=None,
                   help="write the logged scalars for TensorBoard here (rank 0)")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none when stderr is not a terminal)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per device for MFU (None: known GPUs in bf16)")
    args = p.parse_args(argv)
    arg_checks.check_args(p, args)
    resume.check_args(p, args)
    return args


# ----------------------------------------------------------------------------- setup


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize(args) -> torch.device:
    """Process group (torchrun's env, or a world of one), parallel_state, seeds, threads."""
    if "RANK" not in os.environ:  # plain `python -m examples.gpt.train`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cpu = args.cpu or not torch.cuda.is_available()
    if not args.cpu and cpu:
        warnings.warn("no CUDA device: running on CPU with gloo (pass --cpu to silence this)",
                      stacklevel=2)
    if cpu:
        device = torch.device("cpu")
        local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(args.num_threads or max(1, (os.cpu_count() or 1) // local_ws))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.dist_timeout))
    else:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device,
                                timeout=datetime.timedelta(seconds=args.dist_timeout))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        distributed_optimizer_size=args.distributed_optimizer_size,
        distribute_within_nodes=args.distribute_within_nodes,
        timeout=args.dist_timeout)  # every group, not only the world: a hung rank fails them all
    # Same default RNG on every rank (identical replicas); per-TP-rank tracked RNG for dropout.
    tp.model_parallel_manual_seed(args.seed)
    return device


def prepare_data(args) -> Path:
    """The data directory, prepared (by global rank 0) from the default corpus if needed."""
    cfg = data.CorpusConfig(vocab_size=args.vocab_size, max_mb=args.data_max_mb)
    data_dir = Path(args.data_dir) if args.data_dir else data.default_data_dir(cfg)
    ready = data.is_prepared(data_dir) if args.data_dir else data.is_prepared(data_dir, cfg)
    if not ready and dist.get_rank() == 0:
        data.prepare(cfg, data_dir)
    dist.barrier()
    return data_dir


def load_data(args) -> tuple[np.ndarray, np.ndarray, int]:
    """Train and validation token streams and the vocabulary size.

    ``--data-path``: a Megatron indexed dataset split by ``--split``; else the
    prepared memmap directory. ``--tokenizer-file`` sets the vocabulary; token ids
    that do not fit it (or, without one, the prepared vocabulary) are an error.
    """
    if args.data_path:
        train, val = data.load_indexed_splits(args.data_path, args.split)
        vocab = None
    else:
        data_dir = prepare_data(args)
        train, val = data.load_tokens(data_dir, "train"), data.load_tokens(data_dir, "val")
        vocab = data.read_meta(data_dir)["vocab_size"]
    if args.tokenizer_file:
        vocab = data.tokenizer_from_file(args.tokenizer_file).vocab_size
    if vocab is not None:
        for name, tokens in (("training", train), ("validation", val)):
            data.check_vocabulary(tokens, vocab, f"{name} data of "
                                  f"{args.data_path or args.data_dir or 'the default corpus'}")
    else:  # an indexed dataset without a tokenizer: the ids it holds
        vocab = int(max(np.max(train), np.max(val))) + 1
    return train, val, vocab


def lr_at(iteration: int, args) -> float:
    """Linear warmup to --lr over --lr-warmup-iters, then cosine decay to --min-lr."""
    if args.lr_warmup_iters > 0 and iteration <= args.lr_warmup_iters:
        return args.lr * iteration / args.lr_warmup_iters
    decay_iters = args.lr_decay_iters or args.train_iters
    span = max(1, decay_iters - args.lr_warmup_iters)
    progress = min(1.0, (iteration - args.lr_warmup_iters) / span)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)


# ----------------------------------------------------------------------------- steps


def micro_batches(tokens, starts: np.ndarray, args, device):
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    local = data.dp_slice(starts, dp_rank, dp_size)
    for i in range(0, len(local), args.micro_batch_size):
        yield data.get_batch(tokens, local[i:i + args.micro_batch_size], args.seq_length, device)


def train_step(model, optimizer, tokens, starts, args, device, autocast, tied=None,
               guard=None, iteration: int = 0) -> tuple:
    """One global batch: forward/backward per micro-batch, clip, step. Local mean loss.
    With a ``faults.FaultGuard`` the step is skipped (on every rank) when not finite."""
    batches = list(micro_batches(tokens, starts, args, device))
    if args.pipeline_model_parallel_size > 1:
        return pipeline.train_step(model, optimizer, batches, tied, clip_grad=args.clip_grad,
                                   autocast=autocast)
    optimizer.zero_grad()
    losses = []
    for m, (x, y) in enumerate(batches):
        sync = m == len(batches) - 1
        with (contextlib.nullcontext() if sync else optim.no_sync(optimizer)):
            with autocast():
                loss = model(x, y)
            (loss / len(batches)).backward()
        losses.append(loss.detach().float())
    if args.clip_grad > 0:
        grad_norm = optimizer.clip_grad_norm(args.clip_grad)
    else:
        grad_norm = optimizer.grad_norm()
    loss = torch.stack(losses).mean()
    if guard is None or guard.agree(iteration, loss, grad_norm):
        optimizer.step()
    return loss, grad_norm.detach().float()


@torch.no_grad()
def evaluate(model, val_tokens, args, device, autocast) -> float:
    """Mean loss over --eval-iters fixed global batches of the validation split."""
    model.eval()
    starts = data.eval_starts(len(val_tokens), args.seq_length,
                              args.eval_iters * args.global_batch_size)
    losses = []
    for batch in starts.reshape(args.eval_iters, args.global_batch_size):
        if args.pipeline_model_parallel_size > 1:
            batches = list(micro_batches(val_tokens, batch, args, device))
            losses.append(pipeline.forward_only(model, batches, autocast))
            continue
        for x, y in micro_batches(val_tokens, batch, args, device):
            with autocast():
                losses.append(model(x, y).float())
    model.train()
    loss = torch.stack(losses).mean().to(device)
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=parallel_state.get_data_parallel_group())
    return float(loss)


# ----------------------------------------------------------------------------- main


def resolve_args(args: argparse.Namespace, device: torch.device,
                 vocab_size: int) -> argparse.Namespace:
    """The command line completed with what it leaves to the run (the only place these are
    decided): the device, the global batch, gradient-accumulation fusion, the padded
    vocabulary and the MLP width. Returns a new namespace; ``args`` is left as parsed."""
    dp = parallel_state.get_data_parallel_world_size()
    global_batch = args.global_batch_size or args.micro_batch_size * dp
    if global_batch % (args.micro_batch_size * dp):
        raise ValueError(f"--global-batch-size ({global_batch}) must be a multiple of "
                         f"--micro-batch-size x data-parallel size ({args.micro_batch_size} x "
                         f"{dp})")
    out = argparse.Namespace(**vars(args))
    out.cpu, out.global_batch_size = device.type == "cpu", global_batch
    out.gradient_accumulation_fusion = arg_checks.grad_accumulation_fusion(
        args, global_batch // (args.micro_batch_size * dp))
    out.padded_vocab_size = padded_vocab_size(vocab_size, args.tensor_model_parallel_size,
                                              args.make_vocab_size_divisible_by)
    out.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    return out


@dataclass
class Run:
    """What :func:`build` makes and :func:`train` drives."""

    args: argparse.Namespace  # resolved (resolve_args); only resume may change the lr schedule
    device: torch.device
    cfg: GPTConfig
    model: torch.nn.Module
    optimizer: object  # DistributedFusedAdam
    tied: object  # pipeline.TiedEmbedding of a first/last pipeline stage, else None
    sampler: data.GlobalBatchSampler
    guard: faults.FaultGuard
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    vocab_size: int  # of the data (the model's is padded)
    autocast: object  # () -> context manager
    iteration: int = 0  # the last one done (a resumed run starts after it)

    @property
    def grad_acc(self) -> int:
        dp = parallel_state.get_data_parallel_world_size()
        return self.args.global_batch_size // (self.args.micro_batch_size * dp)


def setup(argv: list[str] | None = None) -> tuple[argparse.Namespace, torch.device]:
    """Flags, process groups, seeds; the save directory checked on every rank."""
    args = parse_args(argv)
    device = initialize(args)
    if args.save:  # every rank, before anything is trained, not at the first save
        faults.check_save_dir(args.save)
    return args, device


def build(args: argparse.Namespace, device: torch.device) -> Run:
    """Data, model (or pipeline stage), optimizer, sampler and fault guard; resumes from
    ``--load``."""
    train_tokens, val_tokens, vocab_size = load_data(args)
    args = resolve_args(args, device, vocab_size)
    if args.autocast_bf16 and device.type == "cpu" and dist.get_rank() == 0:
        print("note: --autocast-bf16 is for GPUs; computing in fp32 on CPU")
    cfg = arg_checks.model_config(args, args.padded_vocab_size)
    if args.pipeline_model_parallel_size > 1:
        if args.save or args.load:
            raise ValueError("--pipeline-model-parallel-size > 1 does not support "
                             "--save/--load yet")
        model = pipeline.build_stage(cfg).to(device)
    else:
        model = GPT(cfg).to(device)
    precision.cast_parameters(model, precision.param_dtype(args))
    compiled = (compiling.compile_model(model, args.compile_mode or "block",
                                        backend=args.compile_backend)
                if args.compile else [])
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}
    optimizer = optim.build_optimizer(
        model, lr=args.lr, weight_decay=args.weight_decay,
        betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, device=device,
        overlap_grad_sync=args.overlap_grad_sync, overlap_param_sync=args.overlap_param_sync,
        bucket_cap_mb=args.bucket_cap_mb, grad_sync_dtype=dtypes[args.grad_sync_dtype],
        param_sync_dtype=dtypes[args.param_sync_dtype],
        store_param_remainders=args.store_param_remainders, compiled_units=compiled,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        cpu_offload=args.optimizer_cpu_offload)
    tied = pipeline.tie_embedding(model, optimizer)  # None unless first/last of a pipeline
    if args.gradient_accumulation_fusion:
        optim.prepare_grad_accumulation_fusion(optimizer)
    sampler = data.GlobalBatchSampler(len(train_tokens), args.seq_length,
                                      args.global_batch_size, args.seed)
    guard = faults.FaultGuard(check_nan=args.check_for_nan_in_loss_and_grad,
                              max_skipped=args.max_consecutive_skipped_iters,
                              exit_duration_mins=args.exit_duration_in_mins, device=device)
    run = Run(args, device, cfg, model, optimizer, tied, sampler, guard, train_tokens,
              val_tokens, vocab_size, precision.autocast_factory(args, device))
    if args.load:  # checked against the run before anything is loaded (resume.py)
        run.iteration = resume.resume(args, model, optimizer, sampler, dist.get_rank())
    return run


def start_log(run: Run) -> logging_utils.TrainLogger:
    """Print the run's shape (rank 0) and open the logs with it."""
    args, world = run.args, dist.get_world_size()
    dp = parallel_state.get_data_parallel_world_size()
    precision_name = precision.describe(args, run.device)
    dist_size = parallel_state.get_distributed_optimizer_world_size()
    redundant = parallel_state.get_redundant_optimizer_world_size()
    if dist.get_rank() == 0:
        print(f"GPT: {run.model.num_parameters() / 1e6:.2f}M parameters, vocab "
              f"{run.vocab_size} (padded {run.cfg.vocab_size}), world {world} = tp "
              f"{args.tensor_model_parallel_size} x pp {args.pipeline_model_parallel_size} x "
              f"dp {dp}; optimizer DistributedFusedAdam over distributed {dist_size} x "
              f"redundant {redundant}; global batch {args.global_batch_size} = micro "
              f"{args.micro_batch_size} x dp {dp} x grad-acc {run.grad_acc}"
              f"{' (accumulated in the GEMMs)' if args.gradient_accumulation_fusion else ''}; "
              f"{run.device.type} {precision_name}"
              f"{' compiled (' + (args.compile_mode or 'block') + ')' if args.compile else ''}"
              f"{'; MLP: bias + GELU in the GEMMs' if run.cfg.gelu_gemm_fusion else ''}",
              flush=True)
    # Which node each rank runs on, so the log shows what the optimizer groups span.
    nodes: list = [None] * world
    dist.all_gather_object(nodes, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    log = logging_utils.TrainLogger(enabled=dist.get_rank() == 0,
                                    train_iters=args.train_iters,
                                    start_iteration=run.iteration, log_file=args.log_file,
                                    tensorboard_dir=args.tensorboard_dir,
                                    progress=False if args.no_progress else None)
    log.setup({"iteration": run.iteration, "world_size": world,
               "tensor_model_parallel_size": args.tensor_model_parallel_size,
               "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
               "data_parallel_size": dp, "grad_acc": run.grad_acc, "optimizer": "dfa",
               "distributed_optimizer_size": dist_size, "redundant_optimizer_size": redundant,
               "distributed_group_ranks": dist.get_process_group_ranks(
                   parallel_state.get_distributed_optimizer_group()),
               "nodes": nodes, "parameters": run.model.num_parameters(),
               "flops_per_token": flops_per_token(run.cfg), "device": run.device.type,
               "bf16": precision_name != "fp32", "precision": precision_name,
               "compile": (args.compile_mode or "block") if args.compile else None})
    return log


def save(run: Run, iteration: int) -> None:
    """Checkpoint ``--save`` at ``iteration``; a failed save says why (faults.py)."""
    args = run.args
    try:
        checkpointing.save_checkpoint(args.save, iteration, run.model, run.optimizer,
                                      data_state=run.sampler.state_dict(), args=vars(args),
                                      ckpt_format=args.ckpt_format)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is no Exception
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or (
                faults.disk_error(e) is None and faults.is_comm_error(e)):
            raise  # another rank died: run_guarded says so
        raise faults.save_failed(args.save, iteration, e,
                                 checkpointing.read_latest(args.save)) from e


def log_interval(run: Run, log, iteration: int, lr: float, losses: list, norms: list,
                 seconds: float, iters: int) -> None:
    """One log line: the interval's losses averaged over DP, memory the max over ranks."""
    args, device = run.args, run.device
    loss = torch.stack(losses).to(device)
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=parallel_state.get_data_parallel_group())
    mem = torch.tensor([logging_utils.memory_gib(device)], device=device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    log.train(iteration=iteration, loss=float(loss.mean()), lr=lr,
              grad_norm=float(torch.stack(norms).mean()), interval_s=seconds,
              interval_iters=iters, global_batch_size=args.global_batch_size,
              seq_length=args.seq_length, flops_per_token=flops_per_token(run.cfg),
              world_size=dist.get_world_size(),
              peak_tflops=logging_utils.peak_tflops(args, device), memory_gib=float(mem),
              memory_kind=logging_utils.memory_kind(device))


def train(run: Run) -> None:
    """The training loop: lr, step, log, evaluate, save, stop (``--exit-*`` or a signal)."""
    args, guard = run.args, run.guard
    log = start_log(run)

    def run_eval(it: int) -> None:
        log.eval(it, evaluate(run.model, run.val_tokens, args, run.device, run.autocast))

    losses, norms = [], []
    t_interval, iters_interval = time.perf_counter(), 0
    iteration = run.iteration
    while iteration < args.train_iters:
        iteration += 1
        lr = lr_at(iteration, args)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        loss, norm = train_step(run.model, run.optimizer, run.train_tokens,
                                run.sampler.next_batch(), args, run.device, run.autocast,
                                run.tied, guard, iteration)
        losses.append(loss)
        norms.append(norm)
        iters_interval += 1
        log.step()
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            if run.device.type == "cuda":
                torch.cuda.synchronize(run.device)
            log_interval(run, log, iteration, lr, losses, norms,
                         time.perf_counter() - t_interval, iters_interval)
            losses, norms = [], []
            t_interval, iters_interval = None, 0
        if args.eval_interval and iteration % args.eval_interval == 0:
            run_eval(iteration)
        saved = bool(args.save and args.save_interval and iteration % args.save_interval == 0)
        if saved:
            save(run, iteration)
        stop = None
        if args.exit_interval and iteration % args.exit_interval == 0:
            stop = "--exit-interval"
        elif guard.exit_requested:  # the same on every rank (agreed in train_step)
            stop = guard.exit_reason
        if stop is not None:
            if args.save and not saved:
                save(run, iteration)
            log.message(f"exiting at iteration {iteration} ({stop})")
            break
        if t_interval is None:  # restart the clock after logging, eval and saving
            t_interval = time.perf_counter()
    else:
        if not (args.eval_interval and iteration % args.eval_interval == 0):
            run_eval(iteration)
        if args.save and not (args.save_interval and iteration % args.save_interval == 0):
            save(run, iteration)
    log.close()


def main(argv: list[str] | None = None) -> None:
    """Set up, build, train, tear down."""
    args, device = setup(argv)
    run = build(args, device)
    train(run)
    run.guard.restore()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    faults.run_guarded(main)
