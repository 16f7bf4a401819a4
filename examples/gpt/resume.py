"""``--load``: which checkpoint the GPT example resumes from, whether it fits this run,
and which side wins where the command line and the checkpoint differ.

1. The checkpoint is chosen first (:func:`checkpoint_choice.choose_checkpoint`, collective:
   the newest that verifies on every rank, or ``--load-iteration``); ``latest`` is
   never trusted. Every check below reads *that* checkpoint's manifest.
2. Model shape (:data:`ARCH_ARGS`) and optimizer (DistributedFusedAdam) must be the
   checkpoint's, else the run stops before anything is loaded.
3. The lr schedule (``--lr --min-lr --lr-warmup-iters`` and the decay length,
   ``--lr-decay-iters`` or else ``--train-iters``) and the optimizer's hyperparameters
   (``--weight-decay --adam-beta1 --adam-beta2 --adam-eps``) must match the
   checkpoint's too, unless ``--use-checkpoint-opt-param-scheduler`` (the checkpoint's
   values win) or ``--override-opt-param-scheduler`` (the command line's win) says
   which side wins, as in Megatron. Rank 0 prints what was taken from where.
4. No checkpoint in ``--load`` (a missing or empty directory) is an error, since a typo
   there would silently start a long run from scratch, unless ``--load`` is also
   ``--save`` (the resume-or-start command of a requeued job) or
   ``--allow-missing-load`` is given.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import checkpoint_choice, checkpointing
from .config import Config

ARCH_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
             "seq_length", "padded_vocab_size", "position_embedding_type", "normalization",
             "swiglu", "num_query_groups", "untie_embeddings_and_output_weights",
             "disable_bias_linear", "openai_gelu")
SCHEDULE_ARGS = ("lr", "min_lr", "lr_warmup_iters")
OPTIMIZER_ARGS = ("weight_decay", "adam_beta1", "adam_beta2", "adam_eps")
OVERRIDE, USE_CHECKPOINT = "--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"
# The param-group values the optimizer flags set: restored from the command line after a
# load when it wins (load_state_dict applies the checkpoint's groups).
GROUP_KEYS = ("betas", "eps", "weight_decay")
OPTIMIZER_NAMES = {"dfa": "DistributedFusedAdam", "adamw": "torch AdamW"}


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def check_architecture(cfg: Config, ckpt: Path, manifest: dict) -> None:
    """The checkpoint ``ckpt`` (the one chosen to load) has this run's model shape."""
    saved, here = manifest.get("args") or {}, cfg.flat()
    for key in ARCH_ARGS:
        if key in saved and saved[key] != here.get(key):
            raise checkpointing.CheckpointMismatch(
                f"{ckpt} has {key}={saved[key]}, this run has {_flag(key)}={here.get(key)}")


def _saved_optimizer(manifest: dict) -> str | None:
    saved = (manifest.get("args") or {}).get("optimizer")
    if saved is None and manifest.get("ckpt_format") == "torch_dist":
        return "dfa"  # only DistributedFusedAdam writes sharded states
    return saved


def check_optimizer(cfg: Config, ckpt: Path, manifest: dict) -> None:
    """The checkpoint holds a DistributedFusedAdam state, the example's optimizer (unless
    ``--no-load-optim``: then only the model is loaded). Checkpoints of the former
    ``--optimizer adamw`` baseline hold torch AdamW's state instead."""
    saved = _saved_optimizer(manifest)
    if cfg.checkpoint.no_load_optim or saved in (None, "dfa"):
        return
    raise checkpointing.CheckpointMismatch(
        f"{ckpt} holds the state of --optimizer {saved} ({OPTIMIZER_NAMES.get(saved, saved)})"
        ", this example trains with DistributedFusedAdam: add --no-load-optim to load the "
        "model only (the optimizer then starts afresh)")


def _decay_iters(a) -> int:
    return a.get("lr_decay_iters") or a.get("train_iters")


def _differences(cfg: Config, saved: dict,
                 with_optimizer: bool) -> list[tuple[str, object, object]]:
    """``(flag, checkpoint value, command-line value)`` of every difference."""
    here = cfg.flat()
    out = []
    for key in SCHEDULE_ARGS + (OPTIMIZER_ARGS if with_optimizer else ()):
        if key in saved and saved[key] != here[key]:
            out.append((_flag(key), saved[key], here[key]))
    if ("train_iters" in saved or "lr_decay_iters" in saved) and \
            _decay_iters(saved) != _decay_iters(here):
        flag = "--lr-decay-iters" if here.get("lr_decay_iters") or \
            saved.get("lr_decay_iters") else "--train-iters"
        out.append((f"the lr decay length ({flag})", _decay_iters(saved), _decay_iters(here)))
    return out


def resolve_hyperparameters(cfg: Config, ckpt: Path,
                            manifest: dict) -> tuple[Config, list[str]]:
    """Compare the lr schedule and (when the optimizer state is loaded) the optimizer's
    hyperparameters with the checkpoint's. A difference stops the run
    (:class:`checkpointing.CheckpointMismatch`) unless a flag says which side wins.
    Returns the configuration to run with (a new one holding the checkpoint's values
    with ``--use-checkpoint-opt-param-scheduler``, else ``cfg``) and the lines rank 0
    prints: what was taken from where."""
    saved = manifest.get("args") or {}
    ck = cfg.checkpoint
    with_optimizer = not ck.no_load_optim
    diffs = _differences(cfg, saved, with_optimizer)
    covered = "the lr schedule" + (" and the optimizer's hyperparameters" if with_optimizer
                                   else "")
    lines = []
    if not diffs:
        lines.append(f"{covered}: the checkpoint's and the command line's agree")
    elif ck.override_opt_param_scheduler:
        lines.append(f"{covered}: from the command line ({OVERRIDE}): " + ", ".join(
            f"{flag} {new} (the checkpoint had {old})" for flag, old, new in diffs))
    elif ck.use_checkpoint_opt_param_scheduler:
        taken = {key: saved[key] for key in SCHEDULE_ARGS + OPTIMIZER_ARGS
                 if key in saved and (key in SCHEDULE_ARGS or with_optimizer)}
        if _decay_iters(saved) is not None:
            taken["lr_decay_iters"] = _decay_iters(saved)
        cfg = cfg.updated(**taken)
        lines.append(f"{covered}: from the checkpoint ({USE_CHECKPOINT}): " + ", ".join(
            f"{flag} {old} (the command line said {new})" for flag, old, new in diffs))
    else:
        raise checkpointing.CheckpointMismatch(
            f"{ckpt} was saved with other settings than this command line: "
            + "; ".join(f"{flag} is {old} in the checkpoint, {new} here"
                        for flag, old, new in diffs)
            + f". Pass {USE_CHECKPOINT} to continue with the checkpoint's values, or "
            f"{OVERRIDE} to use the command line's")
    if ck.no_load_optim:
        lines.append("the optimizer's hyperparameters: from the command line "
                     "(--no-load-optim: the optimizer starts afresh)")
    return cfg, lines


def _same_dir(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and \
        os.path.realpath(a) == os.path.realpath(b)


def no_checkpoint(ck) -> str:
    """What to say when ``--load`` holds no checkpoint; raises unless starting from scratch
    is what the command line asks for (``ck``: the checkpoint section)."""
    where = "does not exist" if not Path(ck.load).exists() else \
        "holds no checkpoint (no iter_* directories)"
    if ck.allow_missing_load:
        return f"--load {ck.load} {where}: starting from scratch (--allow-missing-load)"
    if _same_dir(ck.load, ck.save):
        return (f"--load {ck.load} {where}: starting from scratch (it is also --save: "
                "the first launch of a resumable job)")
    raise checkpointing.CheckpointError(
        f"--load {ck.load} {where}: check the path (a wrong one would restart the run "
        "from scratch); to start from scratch on purpose, drop --load, make --save the "
        "same directory, or add --allow-missing-load")


def prepare(cfg: Config) -> tuple[Path | None, dict | None, list[str], Config]:
    """Choose the checkpoint (collective) and check it against the command line, before
    anything is loaded: ``(checkpoint dir, manifest, lines to print, configuration to
    run with)``, or ``(None, None, lines, cfg)`` when the run starts from scratch."""
    ck = cfg.checkpoint
    ckpt = checkpoint_choice.choose_checkpoint(ck.load, ck.load_iteration)
    if ckpt is None:
        return None, None, [no_checkpoint(ck)], cfg
    manifest = checkpointing.read_manifest(ckpt)
    check_architecture(cfg, ckpt, manifest)
    check_optimizer(cfg, ckpt, manifest)
    cfg, lines = resolve_hyperparameters(cfg, ckpt, manifest)
    return ckpt, manifest, lines, cfg


def resume(cfg: Config, model, optimizer, sampler, rank: int) -> tuple[int, Config]:
    """Everything ``--load`` does (every rank calls it): returns the iteration to continue
    from (0 when starting from scratch) and the configuration to continue with."""
    ckpt, manifest, lines, cfg = prepare(cfg)
    ck = cfg.checkpoint
    if ckpt is None:
        if rank == 0:
            print(lines[0], flush=True)
        return 0, cfg
    built = [{k: g[k] for k in GROUP_KEYS if k in g} for g in optimizer.param_groups]
    manifest = checkpointing.load_checkpoint(ckpt, model,
                                             None if ck.no_load_optim else optimizer,
                                             load_rng=not ck.no_load_rng)
    if ck.no_load_optim:
        if hasattr(optimizer, "reload_model_params"):
            optimizer.reload_model_params()  # master weights from the loaded model
    elif ck.override_opt_param_scheduler:
        for group, values in zip(optimizer.param_groups, built):
            group.update(values)  # the command line's, over the loaded groups
    if manifest.get("data"):
        sampler.load_state_dict(manifest["data"])
    iteration = manifest["iteration"]
    if rank == 0:
        loaded = ["model", *([] if ck.no_load_optim else ["optimizer state"]),
                  *(["RNG states"] if not ck.no_load_rng
                    and checkpointing.restores_rng(manifest) else []),
                  "data position", f"iteration {iteration}"]
        print(f"resume from {ckpt}: from the checkpoint: {', '.join(loaded)}", flush=True)
        if not ck.no_load_rng and not checkpointing.restores_rng(manifest):
            print(f"resume from {ckpt}: RNG states start afresh (saved at world size "
                  f"{manifest.get('world_size')}, tensor_model_parallel_size "
                  f"{manifest.get('tensor_model_parallel_size')}; restored only at the "
                  "same sizes)", flush=True)
        for line in lines:
            print(f"resume from {ckpt}: {line}", flush=True)
        print(f"resumed from {ck.load} at iteration {iteration}", flush=True)
    return iteration, cfg
