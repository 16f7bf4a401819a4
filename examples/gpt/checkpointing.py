"""Checkpoints of the GPT example: atomic, checksummed, one model shard per TP rank.

Layout of ``--save DIR``::

    DIR/latest                       "iter_0000100"       written last (atomic; a hint only)
    DIR/iter_0000100/
        dcp/                         --ckpt-format torch_dist (default): every rank's model
                                     and optimizer shards (mpzero.checkpoint.dcp)
        model_tp00.pt, model_tp01.pt --ckpt-format torch: one per TP rank:
                                     {"model", "partition_dims", "optimizer"}
        rng_rank00000.pt, ...        one per global rank: CPU/CUDA generators, TP RNG tracker
        manifest.json                iteration, args, data position, grid, sha256 of each file

The model shards are written by the first data-parallel rank of each TP rank
(the data-parallel replicas hold the same shard). The optimizer state is
DistributedFusedAdam's format-2 ``state_dict()``, which every rank of the
data-parallel group computes together and which is the same on all of them: it
is stored beside that TP rank's model shard, and loads at any
distributed x redundant grid. Every file goes to a temporary name in the same
directory, is fsynced and ``os.replace``d into place; ``manifest.json`` (with
the checksums) comes after all files, ``latest`` after the manifest. A crash
mid-save leaves ``latest`` on the previous checkpoint, and a corrupted file is
refused on load (checksum mismatch). Resuming picks the newest checkpoint that
verifies on every rank (:func:`find_loadable_checkpoint`); see docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mpzero import parallel_state
from mpzero import tensor_parallel as tp
from mpzero.checkpoint import dcp as mdcp

FORMAT = "mpzero-gpt-checkpoint-1"
DCP_DIR = "dcp"
_ITER_NAME = re.compile(r"iter_\d{7,}")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit this run."""


class NonFiniteWeights(CheckpointError):
    """The model holds NaN or Inf: saving it would make a broken checkpoint the newest."""


# ----------------------------------------------------------------------------- helpers


def _ranks() -> dict[str, int]:
    """Rank coordinates; a single process without parallel_state is rank 0 of everything."""
    if parallel_state.model_parallel_is_initialized():
        return {"rank": dist.get_rank(), "world": dist.get_world_size(),
                "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
                "dp_rank": parallel_state.get_data_parallel_rank(),
                "dp_size": parallel_state.get_data_parallel_world_size()}
    return {"rank": 0, "world": 1, "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        _failed_write(tmp, path, e)
        raise
    _fsync_dir(path.parent)


def atomic_torch_save(obj, path: Path) -> str:
    """``torch.save`` to a temp file in the same dir, fsync, rename; returns its sha256."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        digest = sha256_file(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        _failed_write(tmp, path, e)
        raise
    _fsync_dir(path.parent)
    return digest


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
    if _distributed() and dist.get_world_size() > 1:
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
    r = _ranks()
    t0 = time.perf_counter()
    out = iteration_dir(save_dir, iteration)
    if ckpt_format not in ("torch", "torch_dist"):
        raise ValueError(f"ckpt_format must be 'torch' or 'torch_dist', got {ckpt_format!r}")
    if ckpt_format == "torch_dist" and not (_distributed()
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
    if _distributed():
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
    if _distributed():
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
    if _distributed():  # also the barrier: the save is complete for everyone after it
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
    return torch.load(path, map_location="cpu", weights_only=True)


def _verify_local(ckpt: Path, r: dict) -> str | None:
    """Why this rank cannot load ``ckpt`` (None: it can). Checks the files this rank
    reads (checksums); rank 0 also checks that every file of the manifest exists."""
    try:
        manifest = read_manifest(ckpt)
        if manifest.get("ckpt_format") == "torch_dist":  # every rank reads any file:
            names = [n for k, n in enumerate(sorted(manifest["files"]))  # split the checks
                     if n.startswith(DCP_DIR + "/") and k % r["world"] == r["rank"]]
        else:
            names = [f"model_tp{r['tp_rank']:02d}.pt"]
        rng = f"rng_rank{r['rank']:05d}.pt"
        if manifest.get("world_size") == r["world"] and rng in manifest["files"]:
            names.append(rng)
        for name in names:
            path = ckpt / name
            expected = manifest["files"].get(name)
            if expected is None:
                return f"{name} is not listed in {ckpt}/manifest.json (incomplete save)"
            if not path.exists():
                return f"{path} is missing"
            if sha256_file(path) != expected:
                return f"checksum mismatch for {path} (truncated, corrupted or half-written)"
        if r["rank"] == 0:
            for name in manifest["files"]:
                if not (ckpt / name).exists():
                    return f"{ckpt / name} is missing (listed in the manifest)"
    except CheckpointError as e:
        return str(e)
    except (OSError, KeyError, TypeError, AttributeError) as e:
        return f"{ckpt}: unreadable ({e!r})"
    return None


def _collective_device() -> torch.device:
    """Where a flag tensor for a collective of the default group must live (NCCL: the
    current GPU; gloo: the CPU)."""
    if _distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def find_loadable_checkpoint(load_dir: str | Path) -> Path | None:
    """The newest checkpoint of ``load_dir`` that verifies on EVERY rank (collective:
    every rank gets the same answer). Broken ones are reported with their path and
    skipped. None when ``load_dir`` has no checkpoint at all; a :class:`CheckpointError`
    on every rank when there are checkpoints but none verifies everywhere."""
    r = _ranks()
    candidates = list_checkpoints(load_dir)
    if _distributed():  # every rank walks the same list (rank 0's view of the directory)
        box = [[str(c) for c in candidates]]
        dist.broadcast_object_list(box, src=0)
        candidates = [Path(c) for c in box[0]]
    reasons = []
    for ckpt in candidates:
        why = _verify_local(ckpt, r)
        ok = torch.tensor([0.0 if why else 1.0], device=_collective_device())
        if _distributed():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if why:
            print(f"rank {r['rank']}: skipping checkpoint {ckpt}: {why}", flush=True)
        if ok.item() == 1.0:
            return ckpt
        reasons.append(f"{ckpt}: {why or 'fails on another rank'}")
        if r["rank"] == 0 and not why:
            print(f"skipping checkpoint {ckpt}: it does not verify on every rank", flush=True)
    if candidates:
        raise CheckpointError(f"no checkpoint in {load_dir} verifies on every rank: "
                              + "; ".join(reasons))
    return None


def load_checkpoint(load_dir: str | Path, model: torch.nn.Module, optimizer=None,
                    *, iteration: int | None = None, load_rng: bool = True) -> dict | None:
    """Load model (this TP rank's shard), optimizer and RNG; returns the manifest.

    Without ``iteration``, the newest checkpoint that verifies on every rank
    (:func:`find_loadable_checkpoint`). Returns None when ``load_dir`` holds no
    checkpoint. Every rank must call it (the choice and the optimizer load are
    collective)."""
    t0 = time.perf_counter()
    if iteration is not None:
        ckpt = iteration_dir(load_dir, iteration)
    else:
        ckpt = find_loadable_checkpoint(load_dir)
    if ckpt is None:
        return None
    manifest = read_manifest(ckpt)
    r = _ranks()
    if manifest.get("ckpt_format") == "torch_dist":
        try:
            mdcp.load_sharded(ckpt / DCP_DIR, model, optimizer, tp_group=_tp_group())
        except ValueError as e:  # wrong model or grid that cannot be resharded
            raise CheckpointError(f"{ckpt} does not fit this run: {e}") from e
        _load_rng(ckpt, manifest, r, load_rng)
        if r["rank"] == 0:
            print(f"loaded checkpoint iter {manifest['iteration']} from {ckpt} in "
                  f"{time.perf_counter() - t0:.2f} s", flush=True)
        return manifest
    if manifest["tensor_model_parallel_size"] != r["tp_size"]:
        raise CheckpointError(
            f"{ckpt} was saved with tensor_model_parallel_size="
            f"{manifest['tensor_model_parallel_size']}, this run has {r['tp_size']} (merge "
            "the shards with merge_tensor_parallel_shards to change it)")
    shard = verified_load(ckpt, f"model_tp{r['tp_rank']:02d}.pt", manifest)
    try:
        model.load_state_dict(shard["model"])
    except RuntimeError as e:  # wrong model: shapes or names differ
        raise CheckpointError(f"{ckpt} does not fit this model: {e}") from e
    if optimizer is not None:
        optimizer.load_state_dict(shard["optimizer"])
    _load_rng(ckpt, manifest, r, load_rng)
    if r["rank"] == 0:
        print(f"loaded checkpoint iter {manifest['iteration']} from {ckpt} in "
              f"{time.perf_counter() - t0:.2f} s", flush=True)
    return manifest


def _load_rng(ckpt: Path, manifest: dict, r: dict, load_rng: bool) -> None:
    rng_name = f"rng_rank{r['rank']:05d}.pt"
    if load_rng and manifest["world_size"] == r["world"] and rng_name in manifest["files"]:
        set_rng_state(verified_load(ckpt, rng_name, manifest))


def verify_all(ckpt_dir: str | Path) -> list[str]:
    """Problems of a checkpoint (every file's checksum, in one process); [] when sound."""
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError as e:
        return [str(e)]
    problems = []
    for name, digest in manifest["files"].items():
        path = Path(ckpt_dir) / name
        if not path.exists():
            problems.append(f"{path} is missing")
        elif sha256_file(path) != digest:
            problems.append(f"checksum mismatch for {path}")
    return problems


def merge_tensor_parallel_shards(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """The full (TP=1) model state dict of a checkpoint, every file verified."""
    manifest = read_manifest(ckpt_dir)
    if manifest.get("ckpt_format") == "torch_dist":
        problems = verify_all(ckpt_dir)
        if problems:
            raise CheckpointError("; ".join(problems))
        return mdcp.consolidate(Path(ckpt_dir) / DCP_DIR, optimizer=False)["model"]
    shards = [verified_load(ckpt_dir, f"model_tp{t:02d}.pt", manifest)
              for t in range(manifest["tensor_model_parallel_size"])]
    dims = shards[0]["partition_dims"]
    full = {}
    for key, value in shards[0]["model"].items():
        dim = dims.get(key)
        full[key] = value if dim is None else torch.cat([s["model"][key] for s in shards], dim)
    return full
