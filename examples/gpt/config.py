"""The GPT example's configuration: a tree of frozen dataclasses, built once.

Every field of a section is a command-line flag with Megatron's name (``num_layers``
is ``--num-layers``) and the field's ``help`` is its help text; :func:`parse_args`
builds the tree from the command line, optionally over a TOML file
(``--config FILE``: one table per section, e.g. ``[model] num_layers = 12``), so the
value of a flag is the command line's, else the file's, else the default. After
that nothing is assigned to it: what the run decides later (the global batch, the
padded vocabulary, a resumed run's schedule) makes a new tree with
:func:`dataclasses.replace` (:meth:`Config.resolve`, :meth:`Config.updated`).

Contradictory flags stop the run before anything starts (an argparse error naming
the flag, exit status 2); legal flags that are probably not what was meant print a
``warning:`` line on rank 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import typing
from dataclasses import dataclass, field

from .compiling import MODES as COMPILE_MODES  # each transformer block, or the forward
from .model import ATTENTION_BACKENDS, GPTConfig


def flag(default, help: str, **argparse_kw):
    """A field that is a command-line flag: ``help`` is its help text, ``argparse_kw``
    goes to ``add_argument`` (``choices``, ``aliases``)."""
    return field(default=default, metadata={"help": help, **argparse_kw})


def derived(default=None, help: str = ""):
    """A field the run fills in (:meth:`Config.resolve`), not a flag."""
    return field(default=default, metadata={"help": help, "cli": False})


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape and the choices that change its function or its memory."""

    num_layers: int = flag(4, "transformer blocks")
    hidden_size: int = flag(256, "width of the residual stream")
    num_attention_heads: int = flag(4, "attention heads (split over TP)")
    ffn_hidden_size: int | None = flag(None, "MLP width (None: 4 x --hidden-size)")
    seq_length: int = flag(256, "tokens per sequence (the context length)")
    dropout: float = flag(0.0, "residual, embedding and attention dropout")
    make_vocab_size_divisible_by: int = flag(
        128, "pad the vocabulary to a multiple of lcm(this, TP size)")
    position_embedding_type: str = flag("learned_absolute", "position embedding",
                                        choices=("learned_absolute", "rope"))
    rotary_base: float = flag(10000.0, "RoPE's base (with --position-embedding-type rope)")
    normalization: str = flag("LayerNorm", "the blocks' and the final norm",
                              choices=("LayerNorm", "RMSNorm"))
    swiglu: bool = flag(False, "SiLU-gated MLP (Llama)")
    openai_gelu: bool = flag(
        False, "GELU's tanh approximation (GPT-2's) instead of the exact erf GELU; with "
        "bf16 parameters on a GPU with the CUDA extension the MLP then runs its bias and "
        "GELU inside its GEMMs")
    gelu_gemm_keep_output: bool = flag(
        True, "where the MLP's GELU runs inside its GEMMs: save the GELU's output for the "
        "backward (else made again there: one [tokens, ffn] activation less per layer)")
    group_query_attention: bool = flag(False, "grouped-query attention (needs "
                                              "--num-query-groups)")
    num_query_groups: int | None = flag(
        None, "KV heads with --group-query-attention (split over TP when >= TP size)")
    untie_embeddings_and_output_weights: bool = flag(
        False, "an output layer of its own instead of the input embedding's table")
    attention_backend: str = flag(
        "auto", "the SDPA kernel of the attention core (auto: torch's choice, cuDNN or "
        "flash on Hopper; math: the reference, any device)",
        choices=("auto", *ATTENTION_BACKENDS))
    disable_bias_linear: bool = flag(False, "no biases in the linear layers (the norms "
                                            "keep theirs)")
    sequence_parallel: bool = flag(False, "shard norms, dropout and residual along the "
                                          "sequence over TP")
    recompute_activations: bool = flag(False, "= --recompute-granularity selective")
    recompute_granularity: str | None = flag(
        None, "full: whole blocks; selective: the attention core",
        choices=("full", "selective"))
    recompute_num_layers: int | None = flag(
        None, "with full recompute: the first N blocks (default all)")
    padded_vocab_size: int | None = derived(help="the model's vocabulary (data's, padded)")


@dataclass(frozen=True)
class ParallelConfig:
    """How the world of ranks is split (``mpzero.parallel_state``)."""

    tensor_model_parallel_size: int = flag(1, "tensor-parallel ranks per model replica")
    pipeline_model_parallel_size: int = flag(
        1, "pipeline stages (1F1B over the micro-batches; see pipeline.py)")
    distributed_optimizer_size: int | None = flag(
        None, "ranks one optimizer shard is spread over (None: the whole DP group)")
    distribute_within_nodes: bool = flag(False, "shard the optimizer over the DP ranks "
                                                "of each node")


@dataclass(frozen=True)
class TrainingConfig:
    """Batch, length of the run, seed, and what happens to a step that is not finite."""

    micro_batch_size: int = flag(8, "sequences per forward/backward on one rank")
    global_batch_size: int | None = flag(
        None, "sequences per iteration (None: micro x dp, no accumulation)")
    train_iters: int = flag(1000, "iterations to train for")
    seed: int = flag(1234, "seed of the weights, the data order and dropout")
    check_for_nan_in_loss_and_grad: bool = flag(
        True, "skip the step when the loss or grad norm is not finite")
    max_consecutive_skipped_iters: int = flag(
        10, "stop with an error after this many skipped steps in a row")


@dataclass(frozen=True)
class OptimizerConfig:
    """The learning-rate schedule and DistributedFusedAdam's options."""

    lr: float = flag(6e-4, "peak learning rate")
    min_lr: float = flag(6e-5, "learning rate at the end of the cosine decay")
    lr_warmup_iters: int = flag(100, "linear warmup iterations")
    lr_decay_iters: int | None = flag(None, "cosine decay length (None: --train-iters)")
    weight_decay: float = flag(0.1, "AdamW weight decay of the weight matrices")
    adam_beta1: float = flag(0.9, "Adam's beta1")
    adam_beta2: float = flag(0.95, "Adam's beta2")
    adam_eps: float = flag(1e-8, "Adam's epsilon")
    clip_grad: float = flag(1.0, "max grad norm; 0 = off")
    overlap_grad_sync: bool = flag(True, "reduce-scatter gradient buckets during backward")
    overlap_param_sync: bool = flag(False, "all-gather parameters in the next forward pass")
    bucket_cap_mb: float = flag(100.0, "MiB per gradient bucket")
    gradient_accumulation_fusion: bool | None = flag(
        None, "the linear layers' weight-gradient GEMMs add into the optimizer's fp32 "
        "gradient buffer (None: on when accumulating over several micro-batches without "
        "autocast)")
    grad_sync_dtype: str = flag("fp32", "dtype of the gradient reduction (and of the "
                                        "accumulation buckets)", choices=("fp32", "bf16"))
    param_sync_dtype: str | None = flag(
        None, "dtype of the parameter all-gather (None: the parameters' dtype)",
        choices=("fp32", "bf16"))
    store_param_remainders: bool = flag(
        False, "with --bf16: keep the fp32 masters as the bf16 parameter plus an int16 "
        "remainder (2 bytes per parameter instead of 4)")
    exp_avg_dtype: str = flag(
        "fp32", "dtype of Adam's first moment; bf16 (with --store-param-remainders): "
        "16-bit moments with one fp32 scale per tensor piece, the master stays exact "
        "(DistributedFusedAdam's with_scaled_states)", choices=("fp32", "bf16"))
    exp_avg_sq_dtype: str = flag("fp32", "dtype of Adam's second moment (as --exp-avg-dtype)",
                                 choices=("fp32", "bf16"))
    optimizer_cpu_offload: bool = flag(
        False, "the optimizer state in host memory and the Adam update on the CPU "
        "(DistributedFusedAdam's cpu_offload)")


@dataclass(frozen=True)
class RuntimeConfig:
    """Precision, device, process group and compilation."""

    bf16: bool = flag(False, "bf16 parameters and activations; fp32 master weights in "
                             "the optimizer")
    autocast_bf16: bool = flag(False, "fp32 parameters under bf16 autocast (GPU; fp32 on "
                                      "CPU)")
    cpu: bool = flag(False, "run on CPU with gloo")
    num_threads: int | None = flag(None, "torch threads per CPU rank")
    dist_timeout: float = flag(600.0, "seconds a collective may wait for the other ranks "
                                      "before failing")
    compile: bool = flag(False, "torch.compile the model")
    compile_mode: str | None = flag(None, "block: each transformer block (default with "
                                          "--compile); model: the whole forward",
                                    choices=COMPILE_MODES)
    compile_backend: str = flag("inductor", "torch.compile backend (aot_eager: no code "
                                            "generation, for checks)")


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from."""

    data_dir: str | None = flag(None, "prepared data (data.py); prepared from the default "
                                      "corpus if empty")
    vocab_size: int = flag(4096, "BPE vocabulary when preparing the default corpus")
    data_max_mb: float = flag(4.0, "MiB of the default corpus when preparing it")
    data_path: str | None = flag(None, "Megatron indexed dataset PREFIX (PREFIX.bin + "
                                       "PREFIX.idx)")
    split: str = flag("969,30,1", "train,valid,test document weights of --data-path")
    tokenizer_file: str | None = flag(None, "tokenizers JSON: its vocabulary sizes the "
                                            "model")


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving, resuming (resume.py) and stopping."""

    save: str | None = flag(None, "checkpoint directory to write")
    load: str | None = flag(None, "checkpoint directory to resume from")
    load_iteration: int | None = flag(None, "the iteration to load (None: the latest "
                                            "that verifies)")
    save_interval: int | None = flag(None, "save every this many iterations")
    ckpt_format: str = flag(
        "torch_dist", "torch_dist: each rank writes its shards (DCP), loads at any grid; "
        "torch: one format-2 file per TP rank", choices=("torch_dist", "torch"))
    exit_interval: int | None = flag(None, "stop (after saving) at iterations divisible "
                                           "by this")
    exit_duration_in_mins: float | None = flag(
        None, "save and stop after this many minutes (decided by all ranks)")
    no_load_optim: bool = flag(False, "load the model only (the optimizer starts afresh)")
    no_load_rng: bool = flag(False, "do not restore the RNG states")
    override_opt_param_scheduler: bool = flag(
        False, "on resume, where this command line and the checkpoint differ in the lr "
        "schedule (--lr, --min-lr, --lr-warmup-iters, --lr-decay-iters or --train-iters) "
        "or the optimizer's hyperparameters (--weight-decay, --adam-beta1, --adam-beta2, "
        "--adam-eps), use the command line's values (default: such a difference stops "
        "the run)", aliases=("--override-opt_param-scheduler",))
    use_checkpoint_opt_param_scheduler: bool = flag(
        False, "on resume, take the lr schedule and the optimizer's hyperparameters from "
        "the checkpoint, whatever this command line says",
        aliases=("--use-checkpoint-opt_param-scheduler",))
    allow_missing_load: bool = flag(
        False, "start from scratch when --load does not exist or holds no checkpoint "
        "(default: an error, since a mistyped path would silently restart the run; not "
        "needed when --load is also --save)")


@dataclass(frozen=True)
class LoggingConfig:
    """What is printed and written, and how often."""

    log_interval: int = flag(10, "iterations per log line")
    eval_interval: int = flag(100, "iterations between evaluations (0 = only at the end)")
    eval_iters: int = flag(10, "global batches per evaluation")
    log_file: str | None = flag(None, "JSONL log (rank 0 appends)")
    tensorboard_dir: str | None = flag(None, "write the logged scalars for TensorBoard "
                                             "here (rank 0)")
    no_progress: bool = flag(False, "no progress bar (there is none when stderr is not a "
                                    "terminal)")
    peak_tflops: float | None = flag(None, "peak TFLOP/s per device for MFU (None: known "
                                           "GPUs in bf16)")


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig,
            "optimizer": OptimizerConfig, "runtime": RuntimeConfig, "data": DataConfig,
            "checkpoint": CheckpointConfig, "logging": LoggingConfig}


@dataclass(frozen=True)
class Config:
    """The whole run's configuration: one section per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def flat(self) -> dict:
        """Every field by its flag name (``dest``), as checkpoints record the run."""
        return {k: v for name in SECTIONS for k, v in
                dataclasses.asdict(getattr(self, name)).items()}

    def updated(self, **values) -> Config:
        """A new tree with the fields named by flag (``dest``) replaced."""
        sections = {}
        for name, cls in SECTIONS.items():
            mine = {k: values.pop(k) for k in list(values) if k in _names(cls)}
            if mine:
                sections[name] = dataclasses.replace(getattr(self, name), **mine)
        if values:
            raise KeyError(f"no such configuration fields: {sorted(values)}")
        return dataclasses.replace(self, **sections)

    def resolve(self, *, cpu: bool, dp_size: int, vocab_size: int) -> Config:
        """The tree completed with what the command line leaves to the run (the only
        place these are decided): the device, the global batch, gradient-accumulation
        fusion, the padded vocabulary and the MLP width."""
        t, m = self.training, self.model
        micro = t.micro_batch_size
        global_batch = t.global_batch_size or micro * dp_size
        if global_batch % (micro * dp_size):
            raise ValueError(f"--global-batch-size ({global_batch}) must be a multiple of "
                             f"--micro-batch-size x data-parallel size ({micro} x {dp_size})")
        fusion = self.optimizer.gradient_accumulation_fusion
        if fusion is None:  # one micro-batch: the plain bf16 gradients are cheaper
            fusion = global_batch // (micro * dp_size) > 1 and not self.runtime.autocast_bf16
        return self.updated(
            cpu=cpu, global_batch_size=global_batch, gradient_accumulation_fusion=fusion,
            ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
            padded_vocab_size=padded_vocab_size(
                vocab_size, self.parallel.tensor_model_parallel_size,
                m.make_vocab_size_divisible_by))

    def grad_acc(self, dp_size: int) -> int:
        """Micro-batches per rank and iteration (after :meth:`resolve`)."""
        return self.training.global_batch_size // (self.training.micro_batch_size * dp_size)

    def gpt(self) -> GPTConfig:
        """The model's :class:`GPTConfig` (after :meth:`resolve`)."""
        m = self.model
        if m.num_query_groups is not None and not m.group_query_attention:
            raise ValueError("--num-query-groups needs --group-query-attention")
        if m.group_query_attention and m.num_query_groups is None:
            raise ValueError("--group-query-attention needs --num-query-groups")
        granularity = m.recompute_granularity or ("selective" if m.recompute_activations
                                                  else None)
        return GPTConfig(
            vocab_size=m.padded_vocab_size, seq_length=m.seq_length, num_layers=m.num_layers,
            hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
            ffn_hidden_size=m.ffn_hidden_size, dropout=m.dropout,
            sequence_parallel=m.sequence_parallel, recompute_granularity=granularity,
            recompute_num_layers=m.recompute_num_layers,
            position_embedding_type=m.position_embedding_type, rotary_base=m.rotary_base,
            normalization=m.normalization, swiglu=m.swiglu, openai_gelu=m.openai_gelu,
            num_query_groups=m.num_query_groups,
            untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
            add_bias_linear=not m.disable_bias_linear,
            attention_backend=m.attention_backend,
            gelu_gemm_keep_output=m.gelu_gemm_keep_output)


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int = 1,
                      divisible_by: int = 128) -> int:
    """Round ``vocab_size`` up to a multiple of ``lcm(divisible_by, tp)``: unlike
    Megatron's ``divisible_by * tp``, the same for every TP size dividing
    ``divisible_by``, so TP=1 and TP=2 models are comparable."""
    multiple = math.lcm(divisible_by, tensor_model_parallel_size)
    return -(-vocab_size // multiple) * multiple


def _names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _flags(cls):
    """``(field, type without None)`` of each flag (each field but the derived ones)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli", True):
            args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
            yield f, (args[0] if args else hints[f.name])


def build_parser() -> argparse.ArgumentParser:
    """The command line of :class:`Config`: one argument group per section."""
    p = argparse.ArgumentParser(description="Pretrain a GPT with TP x PP x ZeRO-2 DP "
                                            "(mpzero)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="TOML file with one table per section ([model], [optimizer], ...); "
                        "flags given on the command line win over it")
    for name, cls in SECTIONS.items():
        g = p.add_argument_group(name, cls.__doc__)
        for f, kind in _flags(cls):
            names = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            kw = {"dest": f.name, "default": f.default, "help": f.metadata["help"]}
            if kind is bool and f.default is False:
                kw["action"] = "store_true"
            elif kind is bool:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = kind
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            g.add_argument(*names, **kw)
    return p


def _toml_defaults(path: str, p: argparse.ArgumentParser) -> dict:
    """The TOML file's values by ``dest``; an unknown table or key, a value of another
    type than the flag's or not among its choices is an argparse error."""
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:
        p.error("--config needs Python 3.11 or later (tomllib)")
    with open(path, "rb") as f:
        tables = tomllib.load(f)
    out = {}
    for name, values in tables.items():
        if name not in SECTIONS or not isinstance(values, dict):
            p.error(f"--config {path}: unknown section [{name}] (known: {', '.join(SECTIONS)})")
        flags = {f.name: (f, kind) for f, kind in _flags(SECTIONS[name])}
        for key, value in values.items():
            key = key.replace("-", "_")
            if key not in flags:
                p.error(f"--config {path}: [{name}] has no field {key!r}")
            f, kind = flags[key]
            if kind is float and type(value) is int:
                value = float(value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                p.error(f"--config {path}: [{name}] {key} = {value!r} is not of type "
                        f"{kind.__name__}")
            if value not in f.metadata.get("choices", (value,)):
                p.error(f"--config {path}: [{name}] {key} = {value!r}: choose from "
                        f"{f.metadata['choices']}")
            out[key] = value
    return out


def parse_args(argv: list[str] | None = None) -> Config:
    """The :class:`Config` of a command line (CLI > ``--config`` TOML > defaults), checked."""
    p = build_parser()
    pre, _ = p.parse_known_args(argv)
    if pre.config:
        p.set_defaults(**_toml_defaults(pre.config, p))
    ns = vars(p.parse_args(argv))
    cfg = Config(**{name: cls(**{f.name: ns[f.name] for f, _ in _flags(cls)})
                    for name, cls in SECTIONS.items()})
    check(p, cfg)
    return cfg


def check(p: argparse.ArgumentParser, cfg: Config) -> None:
    """Contradictory flags: an argparse error naming the flag; doubtful ones: a warning."""
    a = cfg.flat()
    for key in ("train_iters", "micro_batch_size", "log_interval", "eval_iters", "seq_length"):
        if a[key] <= 0:
            p.error(f"--{key.replace('_', '-')} must be positive, got {a[key]}")
    if a["min_lr"] > a["lr"]:
        p.error(f"--min-lr ({a['min_lr']}) is larger than --lr ({a['lr']})")
    for key in ("lr_warmup_iters", "eval_interval", "clip_grad", "weight_decay"):
        if a[key] < 0:
            p.error(f"--{key.replace('_', '-')} must not be negative, got {a[key]}")
    if a["global_batch_size"] is not None and a["global_batch_size"] % a["micro_batch_size"]:
        p.error(f"--global-batch-size ({a['global_batch_size']}) must be a multiple of "
                f"--micro-batch-size ({a['micro_batch_size']})")
    if a["bf16"] and a["autocast_bf16"]:
        p.error("--bf16 and --autocast-bf16 cannot be combined: --bf16 makes the parameters "
                "bf16 (fp32 masters in the optimizer), --autocast-bf16 keeps fp32 parameters "
                "under bf16 autocast; pick one")
    if a["store_param_remainders"] and not a["bf16"]:
        p.error("--store-param-remainders needs --bf16 (it stores the fp32 masters of bf16 "
                "parameters as the parameter plus an int16 remainder)")
    if a["store_param_remainders"] and a["param_sync_dtype"] == "fp32":
        p.error("--store-param-remainders needs bf16 parameter gathers, got "
                "--param-sync-dtype fp32")
    if a["exp_avg_dtype"] != a["exp_avg_sq_dtype"]:
        p.error(f"--exp-avg-dtype ({a['exp_avg_dtype']}) and --exp-avg-sq-dtype "
                f"({a['exp_avg_sq_dtype']}) must be the same")
    if a["exp_avg_dtype"] == "bf16" and not a["store_param_remainders"]:
        p.error("--exp-avg-dtype bf16 needs --store-param-remainders (bf16 moments beside an "
                "exact fp32 master: the bf16 parameter plus its int16 remainder)")
    if a["override_opt_param_scheduler"] and a["use_checkpoint_opt_param_scheduler"]:
        p.error("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler "
                "contradict each other: the first makes the command line win, the second "
                "the checkpoint; pick one")
    warnings = [
        (a["lr_warmup_iters"] > a["train_iters"],
         f"--lr-warmup-iters ({a['lr_warmup_iters']}) > --train-iters ({a['train_iters']}): "
         "the run ends before the warmup does"),
        (a["lr_decay_iters"] is not None and a["lr_decay_iters"] < a["lr_warmup_iters"],
         f"--lr-decay-iters ({a['lr_decay_iters']}) < --lr-warmup-iters "
         f"({a['lr_warmup_iters']}): the lr drops to --min-lr right after the warmup"),
        (a["save_interval"] and not a["save"],
         "--save-interval is set but --save is not: nothing is saved"),
        (a["load"] is None and (a["load_iteration"] is not None or a["no_load_optim"]
                                or a["no_load_rng"]),
         "--load-iteration/--no-load-optim/--no-load-rng have no effect without --load"),
        (a["load"] is None and (a["override_opt_param_scheduler"] or a["allow_missing_load"]
                                or a["use_checkpoint_opt_param_scheduler"]),
         "--override-opt-param-scheduler/--use-checkpoint-opt-param-scheduler/"
         "--allow-missing-load have no effect without --load"),
        (a["gradient_accumulation_fusion"] and a["autocast_bf16"],
         "--gradient-accumulation-fusion has no effect under --autocast-bf16 (the layers "
         "fall back to plain weight gradients)"),
        (a["compile_mode"] is not None and not a["compile"],
         f"--compile-mode {a['compile_mode']} has no effect without --compile"),
        (a["eval_interval"] and a["eval_interval"] > a["train_iters"],
         f"--eval-interval ({a['eval_interval']}) > --train-iters ({a['train_iters']}): "
         "validation runs only at the end"),
    ]
    if int(os.environ.get("RANK", "0")) == 0:
        for cond, msg in warnings:
            if cond:
                print(f"warning: {msg}", file=sys.stderr, flush=True)
