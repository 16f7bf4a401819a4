"""Checkpoints of the GPT example: atomic, checksummed, all or nothing.

``--save DIR`` holds ``iter_0000100/`` directories (layout: docs/checkpoints.md) with
the model and optimizer (``--ckpt-format torch_dist``, the default: every rank's shards
through :mod:`mpzero.checkpoint.dcp`, loadable at any TP size and optimizer grid;
``torch``: one format-2 file per TP rank, loadable at its TP size), every rank's RNG
states and ``manifest.json`` (iteration, the run's configuration, data position, grid,
sha256 of each file), and ``latest``. Every file goes to a temporary name, is fsynced
and ``os.replace``d; the manifest comes after all files, ``latest`` after it, so a crash
mid-save leaves the previous checkpoint the newest. On load a corrupted file, or one
that would run code when unpickled (:mod:`mpzero.checkpoint.safe_load`), is refused;
checkpoint_choice.py picks which checkpoint to load (docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mpzero import comm, parallel_state
from mpzero import tensor_parallel as tp
from mpzero.checkpoint import dcp as mdcp
from mpzero.checkpoint import safe_load
from mpzero.checkpoint.safe_load import sha256_file

FORMAT = "mpzero-gpt-checkpoint-1"
DCP_DIR = "dcp"
_ITER_NAME = re.compile(r"iter_\d{7,}")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit this run."""


class NonFiniteWeights(CheckpointError):
    """The model holds NaN or Inf: saving it would make a broken checkpoint the newest."""


# ----------------------------------------------------------------------------- helpers


def ranks() -> dict[str, int]:
    """Rank coordinates; a single process without parallel_state is rank 0 of everything."""
    if parallel_state.model_parallel_is_initialized():
        return {"rank": dist.get_rank(), "world": dist.get_world_size(),
                "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
                "dp_rank": parallel_state.get_data_parallel_rank(),
                "dp_size": parallel_state.get_data_parallel_world_size()}
    return {"rank": 0, "world": 1, "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1}


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _failed_write(tmp: Path, path: Path, e: BaseException) -> None:
    """Drop the temporary file of a write that failed (a full disk keeps what it holds),
    and let the error name the file (torch.save's OSError names none)."""
    try:
        tmp.unlink()
    except OSError:
        pass
    if isinstance(e, OSError) and e.filename is None:
        e.filename = str(path)


def _atomic_write(path: Path, write) -> None:
    """``write(f)`` into a temporary file beside ``path``, fsync it, rename it to ``path``
    and fsync the directory: a crash leaves the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        _failed_write(tmp, path, e)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """``data`` into ``path``, atomically (:func:`_atomic_write`)."""
    _atomic_write(path, lambda f: f.write(data))


def atomic_torch_save(obj, path: Path) -> str:
    """``torch.save(obj)`` into ``path``, atomically; returns the file's sha256."""
    _atomic_write(path, lambda f: torch.save(obj, f))
    return sha256_file(path)


def iteration_dir(save_dir: str | Path, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def read_latest(save_dir: str | Path) -> Path | None:
    """The directory ``latest`` points to, or None when there is none or ``latest`` is not
    a readable ``iter_NNNNNNN`` name of an existing directory (garbage is tolerated: the
    resume scans the ``iter_*`` directories anyway)."""
    try:
        tag = (Path(save_dir) / "latest").read_bytes().decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not _ITER_NAME.fullmatch(tag) or not (Path(save_dir) / tag).is_dir():
        return None
    return Path(save_dir) / tag


def list_checkpoints(save_dir: str | Path) -> list[Path]:
    """The ``iter_*`` directories of ``save_dir``, newest first."""
    try:
        dirs = [d for d in Path(save_dir).iterdir() if _ITER_NAME.fullmatch(d.name)]
    except OSError:
        return []
    return sorted(dirs, key=lambda d: int(d.name[5:]), reverse=True)


def partition_dims(model: torch.nn.Module) -> dict[str, int | None]:
    """State-dict key -> the dim it is split along over TP (None: replicated)."""
    dims = {}
    for name, p in model.named_parameters():
        dims[name] = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
    return dims


def _cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def rng_state() -> dict:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tp.get_rng_tracker().get_states()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("tracker"):
        tp.get_rng_tracker().set_states(state["tracker"])


# ----------------------------------------------------------------------------- save


def _tp_group():
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return None


def check_finite(model: torch.nn.Module, iteration: int | None = None) -> None:
    """Collective: raise :class:`NonFiniteWeights` on every rank when any rank's model
    parameters hold a NaN or Inf (each rank checks its own shards)."""
    named = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
    bad: list[str] = []
    if named:
        finite = torch.stack([torch.isfinite(p.detach()).all() for _, p in named]).cpu()
        bad = [n for (n, _), ok in zip(named, finite.tolist()) if not ok]
    reports = [(len(bad), bad[:3])]
    if distributed() and dist.get_world_size() > 1:
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, (len(bad), bad[:3]))
    found = [(rank, n, names) for rank, (n, names) in enumerate(reports) if n]
    if found:
        where = "; ".join(f"rank {rank}: {n} tensor{'s' if n > 1 else ''} ({', '.join(names)}"
                          f"{', ...' if n > len(names) else ''})" for rank, n, names in found)
        at = f"at iteration {iteration} " if iteration is not None else ""
        raise NonFiniteWeights(
            f"the model's weights {at}hold NaN or Inf ({where}); refusing to save them, "
            "so that the newest checkpoint stays a usable one")


def _save_dcp(out: Path, model, optimizer, r: dict) -> dict[str, str]:
    """The torch_dist format: model and optimizer shards through DCP in ``out/dcp``; each
    rank checksums the file it wrote (rank 0 also DCP's metadata and mpzero.json)."""
    mdcp.save_sharded(out / DCP_DIR, model, optimizer, tp_group=_tp_group())
    written = {}
    names = [f"__{r['rank']}_0.distcp"] + ([".metadata", mdcp.META] if r["rank"] == 0 else [])
    for name in names:
        if (out / DCP_DIR / name).exists():
            written[f"{DCP_DIR}/{name}"] = sha256_file(out / DCP_DIR / name)
    return written


def save_checkpoint(save_dir: str | Path, iteration: int, model: torch.nn.Module, optimizer,
                    *, data_state: dict | None = None, args: dict | None = None,
                    ckpt_format: str = "torch_dist") -> Path:
    """Write the checkpoint of ``iteration`` (every rank must call it). Returns its dir.

    ``ckpt_format="torch_dist"`` (needs an optimizer with ``sharded_state_dict``, i.e.
    DistributedFusedAdam; others fall back to "torch"): every rank writes only its model
    and optimizer shards through torch.distributed.checkpoint, loadable at any TP size
    and optimizer grid. ``"torch"``: one file per TP rank with the format-2 state."""
    r = ranks()
    t0 = time.perf_counter()
    out = iteration_dir(save_dir, iteration)
    if ckpt_format not in ("torch", "torch_dist"):
        raise ValueError(f"ckpt_format must be 'torch' or 'torch_dist', got {ckpt_format!r}")
    if ckpt_format == "torch_dist" and not (distributed()
                                            and hasattr(optimizer, "sharded_state_dict")):
        ckpt_format = "torch"
    if hasattr(optimizer, "param_sync"):
        # With overlap_param_sync the weights are all-gathered in the next forward: until
        # then model.state_dict() would hold the previous step's values.
        optimizer.param_sync()
    # Before anything is written: NaN weights must not become the newest checkpoint
    # (resume picks the newest that verifies, and a NaN checkpoint verifies).
    check_finite(model, iteration)
    out.mkdir(parents=True, exist_ok=True)
    if distributed():
        dist.barrier()  # the directory exists for everyone (shared file systems lag)
    written: dict[str, str] = {}
    if ckpt_format == "torch_dist":
        written.update(_save_dcp(out, model, optimizer, r))
    else:
        optim_state = optimizer.state_dict()  # a collective for DistributedFusedAdam
    # The files below are each rank's own (no collective inside): a rank whose write
    # fails (disk full...) reports it through the gather instead of leaving the others
    # waiting for it, and every rank raises the same error.
    failure: OSError | None = None
    try:
        if ckpt_format == "torch" and r["dp_rank"] == 0:
            name = f"model_tp{r['tp_rank']:02d}.pt"
            written[name] = atomic_torch_save(
                {"model": _cpu_state(model), "partition_dims": partition_dims(model),
                 "optimizer": optim_state, "tp_rank": r["tp_rank"], "tp_size": r["tp_size"]},
                out / name)
        name = f"rng_rank{r['rank']:05d}.pt"
        written[name] = atomic_torch_save(rng_state(), out / name)
    except OSError as e:
        failure = e
    if distributed():
        gathered: list = [None] * r["world"]
        dist.all_gather_object(gathered, (written, failure))
    else:
        gathered = [(written, failure)]
    _raise_first_failure(out, [f for _, f in gathered])
    if r["rank"] == 0:
        files = {k: v for part, _ in gathered for k, v in part.items()}
        manifest = {"format": FORMAT, "iteration": iteration, "time": time.time(),
                    "tensor_model_parallel_size": r["tp_size"],
                    "data_parallel_size": r["dp_size"], "world_size": r["world"],
                    "ckpt_format": ckpt_format,
                    "data": data_state, "args": args, "files": files}
        try:
            atomic_write_bytes(out / "manifest.json", json.dumps(manifest, indent=1).encode())
            atomic_write_bytes(Path(save_dir) / "latest", out.name.encode())
        except OSError as e:
            failure = e
    if distributed():  # also the barrier: the save is complete for everyone after it
        box = [failure if r["rank"] == 0 else None]
        dist.broadcast_object_list(box, src=0)
        _raise_first_failure(out, box)
    elif failure is not None:
        raise failure
    if r["rank"] == 0:
        print(f"saved checkpoint iter {iteration} to {out} in "
              f"{time.perf_counter() - t0:.2f} s", flush=True)
    return out


def _raise_first_failure(out: Path, failures: list) -> None:
    """Raise (on every rank that calls it with the same list) the first rank's OSError."""
    for rank, failure in enumerate(failures):
        if failure is not None:
            error = CheckpointError(f"saving {out} failed on rank {rank}: {failure}")
            error.rank = rank  # read by the example's faults.save_failed
            raise error from failure


# ----------------------------------------------------------------------------- load


def read_manifest(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{ckpt_dir} has no manifest.json: the save did not finish") from None
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')!r}")
    return manifest


def verified_load(ckpt_dir: str | Path, name: str, manifest: dict):
    """``torch.load`` one file of the checkpoint after checking its sha256."""
    path = Path(ckpt_dir) / name
    expected = manifest["files"].get(name)
    if expected is None:
        raise CheckpointError(f"{name} is not listed in {ckpt_dir}/manifest.json")
    if not path.exists():
        raise CheckpointError(f"{path} is missing")
    actual = sha256_file(path)
    if actual != expected:
        raise CheckpointError(f"checksum mismatch for {path}: manifest says {expected[:12]}..., "
                              f"file has {actual[:12]}... (corrupted or partially written)")
    try:
        return safe_load.torch_load(path)
    except safe_load.UnsafeCheckpointError as e:
        raise CheckpointError(str(e)) from None


class CheckpointMismatch(CheckpointError):
    """A sound checkpoint that does not fit this run (another TP size in the torch
    format, another model or optimizer): the run stops rather than resume from an older
    checkpoint that happens to fit, which would silently lose the newer progress."""


def tp_mismatch(ckpt: Path, manifest: dict, r: dict) -> str | None:
    saved = manifest.get("tensor_model_parallel_size")
    if manifest.get("ckpt_format") == "torch_dist" or saved == r["tp_size"]:
        return None
    return (f"{ckpt} was saved with --ckpt-format torch at tensor_model_parallel_size="
            f"{saved}, this run has {r['tp_size']}: torch-format checkpoints load only at "
            f"the TP size they were saved with. Resume it at --tensor-model-parallel-size "
            f"{saved} (with --ckpt-format torch_dist and --save to write it again in the "
            "sharded format, which loads at any TP size)")


def collective_device() -> torch.device:
    """Where a flag tensor for a collective of the default group must live (NCCL: the
    current GPU; gloo: the CPU)."""
    if distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_model_state(ckpt: Path, model: torch.nn.Module, saved: dict) -> None:
    """Raise unless ``model.load_state_dict(saved)`` loads every tensor (torch's own
    check copies the tensors that fit before it reports the others)."""
    local = model.state_dict()
    missing = [k for k in local if k not in saved]
    extra = [k for k in saved if k not in local]
    if missing or extra:
        raise CheckpointMismatch(f"{ckpt} does not fit this model: missing keys "
                                 f"{missing[:5]}, unexpected keys {extra[:5]}")
    for k, v in local.items():
        t = saved[k]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(v.shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise CheckpointMismatch(f"{ckpt} does not fit this model: {k} has shape {got} "
                                     f"in the checkpoint, {tuple(v.shape)} here")


def _optimizer_kind(optimizer) -> str:
    return "DistributedFusedAdam" if hasattr(optimizer, "sharded_state_dict") \
        else type(optimizer).__name__


def _check_optimizer_state(ckpt: Path, optimizer, sd) -> None:
    """Raise unless ``optimizer.load_state_dict(sd)`` would load (checks only)."""
    saved_dfa = isinstance(sd, dict) and "format" in sd
    if saved_dfa and not hasattr(optimizer, "sharded_state_dict"):
        raise CheckpointMismatch(f"{ckpt} holds a DistributedFusedAdam state (--optimizer "
                                 f"dfa), this run's optimizer is a {_optimizer_kind(optimizer)}")
    if hasattr(optimizer, "sharded_state_dict"):
        from mpzero.optimizers import checkpoint as optim_ckpt

        try:
            optim_ckpt.check_state_dict(optimizer, sd)
        except ValueError as e:
            raise CheckpointMismatch(f"{ckpt}: the optimizer state does not fit: {e}") from e
    elif not isinstance(sd, dict) or len(sd.get("param_groups", ())) != len(
            optimizer.param_groups):
        raise CheckpointMismatch(f"{ckpt}: the optimizer state has other param groups than "
                                 "this run's optimizer")


def _agree_or_raise(error: BaseException | None) -> None:
    """Every rank raises the same :class:`CheckpointError` when any rank passes one
    (collective over the world), before anything is loaded anywhere."""
    group = dist.group.WORLD if distributed() else None
    try:
        comm.agree(error, group, collective_device())
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def load_checkpoint(ckpt: str | Path, model: torch.nn.Module, optimizer=None, *,
                    load_rng: bool = True) -> dict:
    """Load model (this TP rank's shard), optimizer and RNG from the checkpoint
    directory ``ckpt`` (``checkpoint_choice.choose_checkpoint`` picks it); returns the
    manifest. Every rank must call it (the load is collective).

    All or nothing over the world: every rank reads and checks what it needs first, the
    ranks agree, and only then is anything copied into the model or optimizer. A
    checkpoint that does not fit (another model, optimizer or, in the torch format, TP
    size) raises :class:`CheckpointMismatch` on every rank with nothing loaded.
    ``torch_dist`` checkpoints load at any TP size and optimizer grid; the RNG states
    are restored when the world and TP sizes are those of the save."""
    t0 = time.perf_counter()
    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt)
    r = ranks()
    if manifest.get("ckpt_format") == "torch_dist":
        try:
            mdcp.load_sharded(ckpt / DCP_DIR, model, optimizer, tp_group=_tp_group())
        except ValueError as e:  # wrong model or optimizer, or a file that cannot be read
            raise CheckpointError(f"{ckpt} does not fit this run: {e}") from e
    else:
        shard, error = None, None
        try:
            mismatch = tp_mismatch(ckpt, manifest, r)
            if mismatch:
                raise CheckpointMismatch(mismatch)
            shard = verified_load(ckpt, f"model_tp{r['tp_rank']:02d}.pt", manifest)
            if not isinstance(shard, dict) or "model" not in shard:
                raise CheckpointError(f"{ckpt}: model_tp{r['tp_rank']:02d}.pt holds no model")
            _check_model_state(ckpt, model, shard["model"])
            if optimizer is not None:
                _check_optimizer_state(ckpt, optimizer, shard.get("optimizer"))
        except CheckpointError as e:
            error = e
        _agree_or_raise(error)
        model.load_state_dict(shard["model"])
        if optimizer is not None:
            optimizer.load_state_dict(shard["optimizer"])
    _load_rng(ckpt, manifest, r, load_rng)
    if r["rank"] == 0:
        print(f"loaded checkpoint iter {manifest['iteration']} from {ckpt} in "
              f"{time.perf_counter() - t0:.2f} s", flush=True)
    return manifest


def _restores_rng(manifest: dict, r: dict) -> bool:
    """RNG states go back to the same rank only when the layout is the save's: the same
    world size and TP size (else rank k's generator would be another rank's stream)."""
    return (manifest.get("world_size") == r["world"]
            and manifest.get("tensor_model_parallel_size", r["tp_size"]) == r["tp_size"])


def restores_rng(manifest: dict, r: dict | None = None) -> bool:
    """Whether loading the checkpoint of ``manifest`` restores this rank's (or the rank
    ``r``'s, :func:`ranks`) RNG states."""
    return _restores_rng(manifest, ranks() if r is None else r)


def _load_rng(ckpt: Path, manifest: dict, r: dict, load_rng: bool) -> None:
    rng_name = f"rng_rank{r['rank']:05d}.pt"
    if load_rng and _restores_rng(manifest, r) and rng_name in manifest["files"]:
        set_rng_state(verified_load(ckpt, rng_name, manifest))
