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
all micro-batches but the last. The flags are config.py's (``--help``); README.md beside
this file describes them and the log format.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mpzero import parallel_state
from mpzero import tensor_parallel as tp

from . import (
    checkpointing,
    compiling,
    config,
    data,
    faults,
    logging_utils,
    optim,
    pipeline,
    precision,
    resume,
)
from .config import Config
from .logging_utils import flops_per_token, num_parameters
from .model import GPT, GPTConfig

# ----------------------------------------------------------------------------- setup


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize(cfg: Config) -> torch.device:
    """Process group (torchrun's env, or a world of one), parallel_state, seeds, threads."""
    rt, par = cfg.runtime, cfg.parallel
    if "RANK" not in os.environ:  # plain `python -m examples.gpt.train`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cpu = rt.cpu or not torch.cuda.is_available()
    if not rt.cpu and cpu:
        warnings.warn("no CUDA device: running on CPU with gloo (pass --cpu to silence this)",
                      stacklevel=2)
    timeout = datetime.timedelta(seconds=rt.dist_timeout)
    if cpu:
        device = torch.device("cpu")
        local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(rt.num_threads or max(1, (os.cpu_count() or 1) // local_ws))
        dist.init_process_group("gloo", timeout=timeout)
    else:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        distributed_optimizer_size=par.distributed_optimizer_size,
        distribute_within_nodes=par.distribute_within_nodes,
        timeout=rt.dist_timeout)  # every group, not only the world: a hung rank fails them all
    # Same default RNG on every rank (identical replicas); per-TP-rank tracked RNG for dropout.
    tp.model_parallel_manual_seed(cfg.training.seed)
    return device


# ----------------------------------------------------------------------------- steps


def micro_batches(tokens, starts: np.ndarray, cfg: Config, device):
    """This DP rank's share of a global batch, ``micro_batch_size`` sequences at a time."""
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    local = data.dp_slice(starts, dp_rank, dp_size)
    micro = cfg.training.micro_batch_size
    for i in range(0, len(local), micro):
        yield data.get_batch(tokens, local[i:i + micro], cfg.model.seq_length, device)


def train_step(model, optimizer, tokens, starts, cfg: Config, device, autocast, tied=None,
               guard=None, iteration: int = 0) -> tuple:
    """One global batch: forward/backward per micro-batch, clip, step. Local mean loss.
    With a ``faults.FaultGuard`` the step is skipped (on every rank) when not finite."""
    batches = list(micro_batches(tokens, starts, cfg, device))
    clip = cfg.optimizer.clip_grad
    if cfg.parallel.pipeline_model_parallel_size > 1:
        return pipeline.train_step(model, optimizer, batches, tied, clip_grad=clip,
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
    grad_norm = optimizer.clip_grad_norm(clip) if clip > 0 else optimizer.grad_norm()
    loss = torch.stack(losses).mean()
    if guard is None or guard.agree(iteration, loss, grad_norm):
        optimizer.step()
    return loss, grad_norm.detach().float()


@torch.no_grad()
def evaluate(model, val_tokens, cfg: Config, device, autocast) -> float:
    """Mean loss over --eval-iters fixed global batches of the validation split."""
    model.eval()
    n, gb = cfg.logging.eval_iters, cfg.training.global_batch_size
    starts = data.eval_starts(len(val_tokens), cfg.model.seq_length, n * gb)
    losses = []
    for batch in starts.reshape(n, gb):
        if cfg.parallel.pipeline_model_parallel_size > 1:
            batches = list(micro_batches(val_tokens, batch, cfg, device))
            losses.append(pipeline.forward_only(model, batches, autocast))
            continue
        for x, y in micro_batches(val_tokens, batch, cfg, device):
            with autocast():
                losses.append(model(x, y).float())
    model.train()
    loss = torch.stack(losses).mean().to(device)
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=parallel_state.get_data_parallel_group())
    return float(loss)


# ----------------------------------------------------------------------------- main


@dataclass
class Run:
    """What :func:`build` makes and :func:`train` drives."""

    cfg: Config  # resolved (Config.resolve); a resume may replace the lr schedule
    device: torch.device
    gpt: GPTConfig
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
        return self.cfg.grad_acc(parallel_state.get_data_parallel_world_size())


def setup(argv: list[str] | None = None) -> tuple[Config, torch.device]:
    """Flags, process groups, seeds; the save directory checked on every rank."""
    cfg = config.parse_args(argv)
    device = initialize(cfg)
    if cfg.checkpoint.save:  # every rank, before anything is trained, not at the first save
        faults.check_save_dir(cfg.checkpoint.save)
    return cfg, device


def build(cfg: Config, device: torch.device) -> Run:
    """Data, model (or pipeline stage), optimizer, sampler and fault guard; resumes from
    ``--load``."""
    train_tokens, val_tokens, vocab_size = data.load_splits(cfg.data, dist.get_rank())
    cfg = cfg.resolve(cpu=device.type == "cpu", vocab_size=vocab_size,
                      dp_size=parallel_state.get_data_parallel_world_size())
    rt, o, ck = cfg.runtime, cfg.optimizer, cfg.checkpoint
    rank0 = dist.get_rank() == 0
    if rt.autocast_bf16 and device.type == "cpu" and rank0:
        print("note: --autocast-bf16 is for GPUs; computing in fp32 on CPU")
    if cfg.model.sequence_parallel and cfg.parallel.tensor_model_parallel_size == 1 and rank0:
        print("note: --sequence-parallel with tensor-model-parallel size 1 changes nothing")
    gpt = cfg.gpt()
    if cfg.parallel.pipeline_model_parallel_size > 1:
        if ck.save or ck.load:
            raise ValueError("--pipeline-model-parallel-size > 1 does not support "
                             "--save/--load yet")
        model = pipeline.build_stage(gpt).to(device)
    else:
        model = GPT(gpt).to(device)
    precision.cast_parameters(model, precision.param_dtype(rt))
    compiled = (compiling.compile_model(model, rt.compile_mode or "block",
                                        backend=rt.compile_backend) if rt.compile else [])
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}
    optimizer = optim.build_optimizer(
        model, lr=o.lr, weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps, device=device, overlap_grad_sync=o.overlap_grad_sync,
        overlap_param_sync=o.overlap_param_sync, bucket_cap_mb=o.bucket_cap_mb,
        grad_sync_dtype=dtypes[o.grad_sync_dtype], param_sync_dtype=dtypes[o.param_sync_dtype],
        store_param_remainders=o.store_param_remainders,
        scaled_moments=o.exp_avg_dtype == "bf16", compiled_units=compiled,
        gradient_accumulation_fusion=o.gradient_accumulation_fusion,
        cpu_offload=o.optimizer_cpu_offload)
    tied = pipeline.tie_embedding(model, optimizer)  # None unless first/last of a pipeline
    if o.gradient_accumulation_fusion:
        optim.prepare_grad_accumulation_fusion(optimizer)
    t = cfg.training
    sampler = data.GlobalBatchSampler(len(train_tokens), cfg.model.seq_length,
                                      t.global_batch_size, t.seed)
    guard = faults.FaultGuard(check_nan=t.check_for_nan_in_loss_and_grad,
                              max_skipped=t.max_consecutive_skipped_iters,
                              exit_duration_mins=ck.exit_duration_in_mins, device=device)
    run = Run(cfg, device, gpt, model, optimizer, tied, sampler, guard, train_tokens,
              val_tokens, vocab_size, precision.autocast_factory(rt, device))
    if ck.load:  # checked against the run before anything is loaded (resume.py)
        run.iteration, run.cfg = resume.resume(cfg, model, optimizer, sampler,
                                               dist.get_rank())
    return run


def start_log(run: Run) -> logging_utils.TrainLogger:
    """Print the run's shape (rank 0) and open the logs with it."""
    cfg, world = run.cfg, dist.get_world_size()
    par, rt, t = cfg.parallel, cfg.runtime, cfg.training
    tp_size, pp_size = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    dp = parallel_state.get_data_parallel_world_size()
    precision_name = precision.describe(rt, run.device)
    dist_size = parallel_state.get_distributed_optimizer_world_size()
    redundant = parallel_state.get_redundant_optimizer_world_size()
    compiled = (rt.compile_mode or "block") if rt.compile else None
    if dist.get_rank() == 0:
        fused = cfg.optimizer.gradient_accumulation_fusion
        print(f"GPT: {num_parameters(run.gpt) / 1e6:.2f}M parameters, vocab "
              f"{run.vocab_size} (padded {run.gpt.vocab_size}), world {world} = tp "
              f"{tp_size} x pp {pp_size} x dp {dp}; optimizer DistributedFusedAdam over "
              f"distributed {dist_size} x redundant {redundant}; global batch "
              f"{t.global_batch_size} = micro {t.micro_batch_size} x dp {dp} x grad-acc "
              f"{run.grad_acc}{' (accumulated in the GEMMs)' if fused else ''}; "
              f"{run.device.type} {precision_name}"
              f"{' compiled (' + compiled + ')' if compiled else ''}", flush=True)
    # Which node each rank runs on, so the log shows what the optimizer groups span.
    nodes: list = [None] * world
    dist.all_gather_object(nodes, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    lg = cfg.logging
    log = logging_utils.TrainLogger(enabled=dist.get_rank() == 0, train_iters=t.train_iters,
                                    start_iteration=run.iteration, log_file=lg.log_file,
                                    tensorboard_dir=lg.tensorboard_dir,
                                    progress=False if lg.no_progress else None)
    log.setup({"iteration": run.iteration, "world_size": world,
               "tensor_model_parallel_size": tp_size, "pipeline_model_parallel_size": pp_size,
               "data_parallel_size": dp, "grad_acc": run.grad_acc, "optimizer": "dfa",
               "distributed_optimizer_size": dist_size, "redundant_optimizer_size": redundant,
               "distributed_group_ranks": dist.get_process_group_ranks(
                   parallel_state.get_distributed_optimizer_group()),
               "nodes": nodes, "parameters": num_parameters(run.gpt),
               "flops_per_token": flops_per_token(run.gpt), "device": run.device.type,
               "bf16": precision_name != "fp32", "precision": precision_name,
               "compile": compiled})
    return log


def save(run: Run, iteration: int) -> None:
    """Checkpoint ``--save`` at ``iteration``; a failed save says why (faults.py)."""
    ck = run.cfg.checkpoint
    try:
        checkpointing.save_checkpoint(ck.save, iteration, run.model, run.optimizer,
                                      data_state=run.sampler.state_dict(),
                                      args=run.cfg.flat(), ckpt_format=ck.ckpt_format)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is no Exception
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or (
                faults.disk_error(e) is None and faults.is_comm_error(e)):
            raise  # another rank died: run_guarded says so
        raise faults.save_failed(ck.save, iteration, e, checkpointing.read_latest(ck.save)) from e


def log_interval(run: Run, log, iteration: int, lr: float, losses: list, norms: list,
                 seconds: float, iters: int) -> None:
    """One log line: the interval's losses averaged over DP, memory the max over ranks."""
    cfg, device = run.cfg, run.device
    loss = torch.stack(losses).to(device)
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=parallel_state.get_data_parallel_group())
    mem = torch.tensor([logging_utils.memory_gib(device)], device=device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    bf16 = cfg.runtime.bf16 or cfg.runtime.autocast_bf16
    log.train(iteration=iteration, loss=float(loss.mean()), lr=lr,
              grad_norm=float(torch.stack(norms).mean()), interval_s=seconds,
              interval_iters=iters, global_batch_size=cfg.training.global_batch_size,
              seq_length=cfg.model.seq_length, flops_per_token=flops_per_token(run.gpt),
              world_size=dist.get_world_size(),
              peak_tflops=logging_utils.peak_tflops(cfg.logging.peak_tflops, bf16, device),
              memory_gib=float(mem), memory_kind=logging_utils.memory_kind(device))


def train(run: Run) -> None:
    """The training loop: lr, step, log, evaluate, save, stop (``--exit-*`` or a signal)."""
    cfg, guard = run.cfg, run.guard
    ck, lg, train_iters = cfg.checkpoint, cfg.logging, cfg.training.train_iters
    log = start_log(run)

    def run_eval(it: int) -> None:
        log.eval(it, evaluate(run.model, run.val_tokens, cfg, run.device, run.autocast))

    def saves_at(it: int) -> bool:
        return bool(ck.save and ck.save_interval and it % ck.save_interval == 0)

    losses, norms = [], []
    t_interval, iters_interval = time.perf_counter(), 0
    iteration = run.iteration
    while iteration < train_iters:
        iteration += 1
        lr = optim.lr_at(iteration, cfg.optimizer, train_iters)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        loss, norm = train_step(run.model, run.optimizer, run.train_tokens,
                                run.sampler.next_batch(), cfg, run.device, run.autocast,
                                run.tied, guard, iteration)
        losses.append(loss)
        norms.append(norm)
        iters_interval += 1
        log.step()
        if iteration % lg.log_interval == 0 or iteration == train_iters:
            if run.device.type == "cuda":
                torch.cuda.synchronize(run.device)
            log_interval(run, log, iteration, lr, losses, norms,
                         time.perf_counter() - t_interval, iters_interval)
            losses, norms = [], []
            t_interval, iters_interval = None, 0
        if lg.eval_interval and iteration % lg.eval_interval == 0:
            run_eval(iteration)
        if saves_at(iteration):
            save(run, iteration)
        stop = None
        if ck.exit_interval and iteration % ck.exit_interval == 0:
            stop = "--exit-interval"
        elif guard.exit_requested:  # the same on every rank (agreed in train_step)
            stop = guard.exit_reason
        if stop is not None:
            if ck.save and not saves_at(iteration):
                save(run, iteration)
            log.message(f"exiting at iteration {iteration} ({stop})")
            break
        if t_interval is None:  # restart the clock after logging, eval and saving
            t_interval = time.perf_counter()
    else:
        if not (lg.eval_interval and iteration % lg.eval_interval == 0):
            run_eval(iteration)
        if ck.save and not (ck.save_interval and iteration % ck.save_interval == 0):
            save(run, iteration)
    log.close()


def main(argv: list[str] | None = None) -> None:
    """Set up, build, train, tear down."""
    cfg, device = setup(argv)
    run = build(cfg, device)
    train(run)
    run.guard.restore()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    faults.run_guarded(main)
