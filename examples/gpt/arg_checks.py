"""pretrain_gpt.py's command line: ``--help`` with defaults, contradictory flags, and the
model it describes.

``check_args`` stops the run before anything starts when flags contradict each other
(an argparse error that names the flag, exit status 2), and prints a ``warning:`` line
on rank 0 for flags that are legal but probably not what was meant. ``model_config`` is
the :class:`GPTConfig` of the flags (with the options resolved that depend on the run).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist

from .model import GPTConfig


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows the default of every flag, also of those without a help text."""

    def _format_action(self, action):
        if action.help is None and action.option_strings:
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Contradictory flags: fail (argparse error naming the flag) or warn."""
    for flag in ("train_iters", "micro_batch_size", "log_interval", "eval_iters", "seq_length"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.min_lr > args.lr:
        p.error(f"--min-lr ({args.min_lr}) is larger than --lr ({args.lr})")
    for flag in ("lr_warmup_iters", "eval_interval", "clip_grad", "weight_decay"):
        if getattr(args, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must not be negative, got {getattr(args, flag)}")
    if args.global_batch_size is not None and args.global_batch_size % args.micro_batch_size:
        p.error(f"--global-batch-size ({args.global_batch_size}) must be a multiple of "
                f"--micro-batch-size ({args.micro_batch_size})")

    if args.bf16 and args.autocast_bf16:
        p.error("--bf16 and --autocast-bf16 cannot be combined: --bf16 makes the parameters "
                "bf16 (fp32 masters in the optimizer), --autocast-bf16 keeps fp32 parameters "
                "under bf16 autocast; pick one")
    if args.store_param_remainders and not args.bf16:
        p.error("--store-param-remainders needs --bf16 (it stores the fp32 masters of bf16 "
                "parameters as the parameter plus an int16 remainder)")
    if args.gelu_gemm_fusion and (not args.openai_gelu or args.swiglu):
        p.error("--gelu-gemm-fusion fuses GELU's tanh approximation: it needs --openai-gelu "
                "and no --swiglu")
    if args.store_param_remainders and args.param_sync_dtype == "fp32":
        p.error("--store-param-remainders needs bf16 parameter gathers, got "
                "--param-sync-dtype fp32")

    def warn(msg: str) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"warning: {msg}", file=sys.stderr, flush=True)

    if args.lr_warmup_iters > args.train_iters:
        warn(f"--lr-warmup-iters ({args.lr_warmup_iters}) > --train-iters "
             f"({args.train_iters}): the run ends before the warmup does")
    if args.lr_decay_iters is not None and args.lr_decay_iters < args.lr_warmup_iters:
        warn(f"--lr-decay-iters ({args.lr_decay_iters}) < --lr-warmup-iters "
             f"({args.lr_warmup_iters}): the lr drops to --min-lr right after the warmup")
    if args.save_interval and not args.save:
        warn("--save-interval is set but --save is not: nothing is saved")
    if args.load is None and (args.load_iteration is not None or args.no_load_optim
                              or args.no_load_rng):
        warn("--load-iteration/--no-load-optim/--no-load-rng have no effect without --load")
    if args.gradient_accumulation_fusion and args.autocast_bf16:
        warn("--gradient-accumulation-fusion has no effect under --autocast-bf16 (the "
             "layers fall back to plain weight gradients)")
    if args.gelu_gemm_fusion and args.autocast_bf16:
        warn("--gelu-gemm-fusion has no effect under --autocast-bf16 (the fused MLP takes "
             "one dtype; autocast mixes fp32 weights with bf16 activations)")
    if args.compile_mode is not None and not args.compile:
        warn(f"--compile-mode {args.compile_mode} has no effect without --compile")
    if args.eval_interval and args.eval_interval > args.train_iters:
        warn(f"--eval-interval ({args.eval_interval}) > --train-iters ({args.train_iters}): "
             "validation runs only at the end")


def grad_accumulation_fusion(args: argparse.Namespace, grad_acc: int) -> bool:
    """``--gradient-accumulation-fusion`` resolved: as given, or (None) on where it pays:
    several micro-batches per step and no autocast. With one
    micro-batch the plain bf16 weight gradients are cheaper (at one rank the optimizer
    reads them as they are, with no fp32 buffer to fill)."""
    if args.gradient_accumulation_fusion is not None:
        return bool(args.gradient_accumulation_fusion)
    return grad_acc > 1 and not args.autocast_bf16


def gelu_gemm_fusion(args: argparse.Namespace) -> bool:
    """``--gelu-gemm-fusion`` resolved: as given, or (None) on where it pays: tanh GELU
    (``--openai-gelu``, no ``--swiglu``), bf16 parameters (``--bf16``) on a GPU, and the
    CUDA extension built with the cuBLASLt GEMMs (elsewhere its PyTorch reference runs,
    which is slower than the unfused MLP)."""
    flag = getattr(args, "gelu_gemm_fusion", None)
    if flag is not None:
        return bool(flag)
    from mpzero import kernels

    return (bool(getattr(args, "openai_gelu", False)) and not getattr(args, "swiglu", False)
            and bool(getattr(args, "bf16", False)) and not getattr(args, "cpu", False)
            and kernels.gemm_gelu_available())


def model_config(args, vocab_size: int) -> GPTConfig:
    """The GPTConfig of the command line (Megatron's flag names)."""
    granularity = args.recompute_granularity or ("selective" if args.recompute_activations
                                                 else None)
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ValueError("--num-query-groups needs --group-query-attention")
    if args.group_query_attention and args.num_query_groups is None:
        raise ValueError("--group-query-attention needs --num-query-groups")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1 and \
            dist.get_rank() == 0:
        print("note: --sequence-parallel with tensor-model-parallel size 1 changes nothing")
    gelu_gemm = gelu_gemm_fusion(args)
    if gelu_gemm and getattr(args, "bias_gelu_fusion", False) and dist.get_rank() == 0:
        print("note: --bias-gelu-fusion is not used where the GELU runs in the MLP's GEMMs "
              "(--gelu-gemm-fusion)")
    return GPTConfig(vocab_size=vocab_size, seq_length=args.seq_length,
                     num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads,
                     ffn_hidden_size=args.ffn_hidden_size, dropout=args.dropout,
                     sequence_parallel=args.sequence_parallel,
                     recompute_granularity=granularity,
                     recompute_num_layers=args.recompute_num_layers,
                     position_embedding_type=args.position_embedding_type,
                     rotary_base=args.rotary_base, normalization=args.normalization,
                     swiglu=args.swiglu, openai_gelu=args.openai_gelu,
                     num_query_groups=args.num_query_groups,
                     untie_embeddings_and_output_weights=
                         args.untie_embeddings_and_output_weights,
                     add_bias_linear=not args.disable_bias_linear,
                     attention_backend=args.attention_backend,
                     gradient_accumulation_fusion=bool(
                         getattr(args, "gradient_accumulation_fusion", False)),
                     bias_gelu_fusion=bool(getattr(args, "bias_gelu_fusion", False)),
                     gelu_gemm_fusion=gelu_gemm,
                     gelu_gemm_keep_output=bool(getattr(args, "gelu_gemm_keep_output", True)),
                     heads_grad_fusion=bool(getattr(args, "heads_grad_fusion", True)),
                     layernorm_fusion=bool(getattr(args, "layernorm_fusion", True)))
