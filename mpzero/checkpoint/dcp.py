"""Model TP shards and optimizer shards through ``torch.distributed.checkpoint`` (DCP).

Every rank puts only what it holds into the DCP state dict, under keys that say
which range of which full tensor a tensor is::

    model/<name>                      a TP-replicated tensor (the DP/TP replicas dedup)
    model/<name>/<start>-<end>        rows [start, end) along the TP partition dim
    optim/<i>/<key>/<start>-<end>     elements [start, end) of parameter i's flattened
                                      master ("param"), "exp_avg" or "exp_avg_sq"

Replicas (redundant optimizer ranks, DP replicas of a TP shard) produce the same
keys, which DCP writes once. ``mpzero.json`` beside DCP's files holds what is not
a tensor: param groups, step, full shapes, the grid, and the partition dim of every
model tensor and optimizer parameter (from the layers' ``tensor_model_parallel`` /
``partition_dim`` marks, so also at TP 1). A loading rank reads DCP's metadata (the
list of keys and sizes; through :mod:`mpzero.checkpoint.safe_load`, never a plain
unpickling), asks DCP for the saved ranges that overlap what it holds in *its* grid,
and copies those pieces in: any tensor-parallel size (that divides the shapes), for
the model and the optimizer state, and any distributed x redundant grid. DCP reads a
saved piece whole, so a rank holds the saved pieces overlapping its part (its share
when the checkpoint was written by as many ranks; more when by fewer). Loads are all
or nothing across the ranks: everything is read and checked, and the ranks agree,
before any model or optimizer is touched.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from mpzero import comm
from mpzero.checkpoint import safe_load
from mpzero.optimizers import checkpoint as optim_ckpt
from mpzero.optimizers import state_checks as checks

DCP_FORMAT = "mpzero-dcp-1"
META = "mpzero.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _tp_coords(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return comm.group_size(tp_group), comm.group_rank(tp_group)


def _optim_prefix(tp_rank: int, tp_size: int) -> str:
    """Optimizer keys: each TP rank's optimizer has its own (TP-local) parameters."""
    return "optim/" if tp_size == 1 else f"optim/tp{tp_rank}/"


def _range_key(prefix: str, start: int, end: int) -> str:
    return f"{prefix}/{start}-{end}"


def _parse_range(key: str) -> tuple[str, int, int]:
    prefix, rng = key.rsplit("/", 1)
    start, end = rng.split("-")
    return prefix, int(start), int(end)


def partition_dim(param: torch.Tensor) -> int | None:
    """The dim ``param`` is split along over TP, from its layer's marking
    (``tensor_model_parallel`` and ``partition_dim``); None: replicated. The same at
    every TP size, TP 1 included, so a checkpoint saved at any size says how to
    split or merge each tensor for another."""
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


def _tp_info(model: torch.nn.Module, tp_group) -> dict[str, dict]:
    """Per state-dict key: full shape, partition dim (None: replicated), this rank's start."""
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    dims = {n: partition_dim(p) for n, p in model.named_parameters(remove_duplicate=False)}
    out = {}
    for name, t in model.state_dict().items():
        shape = list(t.shape)
        dim = dims.get(name)
        start = 0
        if dim is not None:
            start = tp_rank * shape[dim]
            shape[dim] *= tp_size
        out[name] = {"shape": shape, "dim": dim, "start": start}
    return out


def _model_items(model, tp_group) -> dict[str, torch.Tensor]:
    info = _tp_info(model, tp_group)
    items = {}
    for name, t in model.state_dict().items():
        i = info[name]
        t = t.detach().cpu()
        if i["dim"] is None:
            items[f"model/{name}"] = t
        else:
            items[_range_key(f"model/{name}", i["start"], i["start"] + t.shape[i["dim"]])] = t
    return items


def save_sharded(directory: str | os.PathLike, model: torch.nn.Module | None = None,
                 optimizer=None, *, tp_group=None, extra: dict | None = None) -> float:
    """Write ``model`` (this rank's TP shard) and ``optimizer`` (this rank's shard pieces)
    as one DCP checkpoint in ``directory``. Collective over the default group. Returns
    the seconds it took. ``extra`` (JSON-able) is stored in ``mpzero.json``."""
    t0 = time.perf_counter()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    meta: dict = {"format": DCP_FORMAT, "world_size": _world(),
                  "extra": extra or {}}
    if model is not None:
        state.update(_model_items(model, tp_group))
        meta["model"] = {k: {"shape": v["shape"], "dim": v["dim"]}
                         for k, v in _tp_info(model, tp_group).items()}
        meta["tensor_model_parallel_size"] = (dist.get_world_size(tp_group)
                                              if tp_group is not None else 1)
    if optimizer is not None:
        tp_size, tp_rank = _tp_coords(tp_group)
        prefix = _optim_prefix(tp_rank, tp_size)
        sd = optimizer.sharded_state_dict()
        for param, start, end, tensors in sd["pieces"]:
            for key, t in tensors.items():
                state[_range_key(f"{prefix}{param}/{key}", start, end)] = t
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        step = sd["step"]
        meta["optim"] = {"param_groups": sd["param_groups"],
                         "step": int(step.item() if isinstance(step, torch.Tensor) else step),
                         "shapes": {str(i): list(s) for i, s in sd["shapes"].items()},
                         "distributed_size": optimizer.distributed_size,
                         "redundant_size": comm.group_size(optimizer.redundant_process_group),
                         "tensor_model_parallel_size": tp_size,
                         "param_names": [names.get(id(p)) for p in optimizer.parameters()],
                         "partition_dims": [partition_dim(p) for p in optimizer.parameters()]}
    if _rank() == 0:  # before DCP's .metadata, which DCP writes last
        tmp = directory / f".{META}.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, directory / META)
    dcp.save(state, checkpoint_id=str(directory))
    return time.perf_counter() - t0


def read_meta(directory: str | os.PathLike) -> dict:
    path = Path(directory) / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} is missing: not an mpzero DCP checkpoint") from None
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if meta.get("format") != DCP_FORMAT:
        raise ValueError(f"{path}: unknown format {meta.get('format')!r}")
    return meta


def saved_keys(directory: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every tensor key of the DCP checkpoint with its size (from DCP's metadata only,
    read without running code from it: :func:`safe_load.read_dcp_metadata`)."""
    md = safe_load.read_dcp_metadata(Path(directory) / ".metadata")
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items()}


def _overlapping(keys: dict, prefix: str, lo: int, hi: int) -> list[tuple[str, int, int]]:
    out = []
    for key in keys:
        if key.startswith(prefix + "/"):
            p, start, end = _parse_range(key)
            if p == prefix and start < hi and end > lo:
                out.append((key, start, end))
    return sorted(out, key=lambda x: x[1])


def _read(directory, wanted: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """DCP-load exactly the keys in ``wanted`` (key -> size) on this rank alone."""
    sd = {k: torch.empty(size, dtype=torch.float32) for k, size in wanted.items()}
    if sd:
        # DCP's own reader would pickle.load the metadata: a crafted file runs code.
        try:
            dcp.load(sd, storage_reader=safe_load.SafeFileSystemReader(str(directory)),
                     no_dist=True)
        except CheckpointException as e:  # a BaseException: say what failed, as a ValueError
            causes = [exc for exc, _ in e.failures.values()]
            for c in causes:
                if isinstance(c, safe_load.UnsafeCheckpointError):
                    raise c from None
                if isinstance(c, pickle.UnpicklingError):  # DCP's weights-only tensor load
                    raise safe_load.UnsafeCheckpointError(
                        f"{directory}: a tensor file was refused by torch.load(weights_only="
                        f"True) ({safe_load.weights_only_reason(c)}); it was not unpickled "
                        "(a crafted or foreign file)") from None
            raise ValueError(f"{directory}: reading the checkpoint's tensors failed: "
                             + "; ".join(f"{type(c).__name__}: {c}" for c in causes)) from None
    return sd


def _model_state(directory, meta, keys, model, tp_group) -> dict[str, torch.Tensor]:
    """This rank's model state dict (its TP shard in *this* run), assembled from pieces."""
    info = _tp_info(model, tp_group)
    saved = meta.get("model")
    if saved is None:
        raise ValueError(f"{directory} holds no model state")
    local = model.state_dict()
    wanted, plan = {}, {}
    for name, t in local.items():
        if name not in saved:
            raise ValueError(f"{directory}: no saved tensor for model key {name!r}")
        if list(saved[name]["shape"]) != info[name]["shape"]:
            raise ValueError(f"{directory}: model key {name!r} was saved with full shape "
                             f"{saved[name]['shape']}, this model has {info[name]['shape']}")
        sdim = saved[name]["dim"]
        dim = info[name]["dim"]
        if sdim is None:  # saved whole (replicated then, or an older TP-1 save)
            wanted[f"model/{name}"] = tuple(saved[name]["shape"])
            plan[name] = None if dim is None else (dim, info[name]["start"],
                                                   info[name]["start"] + t.shape[dim], None)
            continue
        if dim is not None and dim != sdim:
            raise ValueError(f"{directory}: model key {name!r} partitioned along {sdim}, "
                             f"here along {dim}")
        lo = info[name]["start"] if dim is not None else 0
        hi = lo + (t.shape[dim] if dim is not None else t.shape[sdim])
        pieces = _overlapping(keys, f"model/{name}", lo, hi)
        if sum(min(e, hi) - max(s, lo) for _, s, e in pieces) < hi - lo:
            raise ValueError(f"{directory}: model key {name!r} rows [{lo}, {hi}) not saved")
        for k, _, _ in pieces:
            wanted[k] = keys[k]
        plan[name] = (sdim, lo, hi, pieces)
    got = _read(directory, wanted)
    out = {}
    for name, t in local.items():
        if plan[name] is None:
            out[name] = got[f"model/{name}"].to(t.dtype)
            continue
        sdim, lo, hi, pieces = plan[name]
        if pieces is None:  # this rank's rows of a tensor saved whole
            out[name] = got[f"model/{name}"].narrow(sdim, lo, hi - lo).to(t.dtype)
            continue
        parts = [got[k].narrow(sdim, max(s, lo) - s, min(e, hi) - max(s, lo))
                 for k, s, e in pieces]
        out[name] = torch.cat(parts, sdim).to(t.dtype)
    return out


def _optim_pieces(directory, meta, keys, optimizer, tp_group, model=None) -> dict[int, list]:
    """The saved pieces overlapping this rank's shards: ``{param: [(start, end, {key: t})]}``."""
    tp_size, tp_rank = _tp_coords(tp_group)
    saved_tp = meta["optim"].get("tensor_model_parallel_size", 1)
    optimizer.ensure_layout()
    mine = optimizer.shards.shard_spans()
    if saved_tp != tp_size:
        return _resharded_optim_pieces(directory, meta, keys, optimizer, tp_group, mine, model)
    prefix = _optim_prefix(tp_rank, tp_size)
    wanted, ranges = {}, {}
    for param, spans in mine.items():
        for lo, hi in spans:
            for key in optim_ckpt.STATE_KEYS:
                for k, s, e in _overlapping(keys, f"{prefix}{param}/{key}", lo, hi):
                    wanted[k] = keys[k]
                    ranges.setdefault((param, s, e), {})[key] = k
    got = _read(directory, wanted)
    out: dict[int, list] = {}
    for (param, s, e), names in sorted(ranges.items()):
        out.setdefault(param, []).append((s, e, {key: got[k] for key, k in names.items()}))
    return out


def _saved_optim_dims(directory, meta) -> list[int | None]:
    """The TP partition dim of every saved optimizer parameter (None: replicated)."""
    om = meta["optim"]
    n = len(om["shapes"])
    if om.get("partition_dims") is not None:
        return list(om["partition_dims"])
    if om.get("tensor_model_parallel_size", 1) == 1:
        return [None] * n  # saved whole: any split of it is a slice
    names = om.get("param_names") or [None] * n
    model = meta.get("model", {})
    if any(name is None or name not in model for name in names):
        raise ValueError(f"{directory}: the optimizer state was saved at tensor_model_parallel_"
                         f"size={om['tensor_model_parallel_size']} without the partition dims "
                         "of its parameters, so it cannot be resharded to another TP size; "
                         "load it at the same TP size, or load the model only")
    return [model[name]["dim"] for name in names]


def _global_index(x: torch.Tensor, full: list[int], dim: int | None, size: int,
                  rank: int) -> torch.Tensor:
    """Flat indices into the full tensor of the flat indices ``x`` of TP rank ``rank``'s
    block (of ``size`` blocks along ``dim``; ``dim`` None: the block is the whole)."""
    if dim is None:
        return x
    b = math.prod(full[dim + 1:])
    rows = full[dim] // size
    a, rem = x // (rows * b), x % (rows * b)
    return (a * full[dim] + rank * rows + rem // b) * b + rem % b


def _block_index(g: torch.Tensor, full: list[int], dim: int | None,
                 size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block rank, flat index in that block)`` of the full tensor's flat indices ``g``
    split ``size`` ways along ``dim`` (None: replicated, read from block 0)."""
    if dim is None:
        return torch.zeros_like(g), g
    b = math.prod(full[dim + 1:])
    rows = full[dim] // size
    a, row, col = g // (full[dim] * b), (g // b) % full[dim], g % b
    return row // rows, (a * rows + row % rows) * b + col


_RESHARD_CHUNK = 1 << 22  # elements per piece when resharding the optimizer over TP


def _resharded_optim_pieces(directory, meta, keys, optimizer, tp_group, mine,
                            model) -> dict[int, list]:
    """Optimizer pieces saved at another TP size, cut to this rank's shards.

    Each saved TP rank stored ranges of its own block of each parameter, flattened. For
    every range this rank holds (a range of its own block, flattened), the flat index
    of each element in the full tensor is computed, then the saved block and position
    it sits in (:func:`_global_index`, :func:`_block_index`), the saved ranges covering
    those positions are read, and the values gathered. A rank reads about as much as it
    keeps (the rows of its range, across the saved blocks)."""
    om = meta["optim"]
    tp_size, tp_rank = _tp_coords(tp_group)
    saved_tp = om.get("tensor_model_parallel_size", 1)
    saved_dims = _saved_optim_dims(directory, meta)
    saved_shapes = {int(i): list(s) for i, s in om["shapes"].items()}
    saved_names = om.get("param_names") or []
    names = {}
    if model is not None:
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    plan, wanted = [], {}
    for i, spans in sorted(mine.items()):
        p = optimizer.shards.params[i]
        name = names.get(id(p))
        j = saved_names.index(name) if name is not None and name in saved_names else i
        if j not in saved_shapes:
            raise ValueError(f"{directory}: no saved optimizer state for parameter {i}"
                             + (f" ({name})" if name else ""))
        dim, sdim = partition_dim(p), saved_dims[j]
        full = list(p.shape)
        if dim is not None:
            full[dim] *= tp_size
        saved_full = list(saved_shapes[j])
        if sdim is not None:
            saved_full[sdim] *= saved_tp
        if saved_full != full:
            raise ValueError(f"{directory}: parameter {i}" + (f" ({name})" if name else "")
                             + f" was saved with full shape {saved_full}, this run has {full}")
        # Bounded pieces: the index tensors (8 bytes per element, a few of them) stay
        # small next to the state itself, however large a parameter is.
        chunks = [(c, min(c + _RESHARD_CHUNK, hi)) for lo, hi in spans
                  for c in range(lo, hi, _RESHARD_CHUNK)]
        for lo, hi in chunks:
            g = _global_index(torch.arange(lo, hi, dtype=torch.int64), full, dim, tp_size,
                              tp_rank)
            src_rank, src = _block_index(g, full, sdim, saved_tp)
            sources = []
            for t in torch.unique(src_rank).tolist():
                sel = (src_rank == t).nonzero().squeeze(1)
                lo_t, hi_t = int(src[sel].min()), int(src[sel].max()) + 1
                per_key = {}
                for key in optim_ckpt.STATE_KEYS:
                    prefix = f"{_optim_prefix(t, saved_tp)}{j}/{key}"
                    found = _overlapping(keys, prefix, lo_t, hi_t)
                    covered = torch.zeros(hi_t - lo_t, dtype=torch.bool)
                    for k, s_, e_ in found:
                        covered[max(s_, lo_t) - lo_t:min(e_, hi_t) - lo_t] = True
                        wanted[k] = keys[k]
                    if not bool(covered[src[sel] - lo_t].all()):
                        raise ValueError(f"{directory}: the saved optimizer state of "
                                         f"parameter {j} {key!r} (TP rank {t}) does not cover "
                                         f"the elements this rank needs")
                    per_key[key] = found
                sources.append((sel, src[sel] - lo_t, lo_t, hi_t, per_key))
            plan.append((i, lo, hi, sources))
    got = _read(directory, wanted)
    out: dict[int, list] = {}
    for i, lo, hi, sources in plan:
        tensors = {}
        for key in optim_ckpt.STATE_KEYS:
            values = torch.empty(hi - lo, dtype=torch.float32)
            for sel, idx, lo_t, hi_t, per_key in sources:
                buf = torch.empty(hi_t - lo_t, dtype=torch.float32)
                for k, s_, e_ in per_key[key]:
                    a, b = max(s_, lo_t), min(e_, hi_t)
                    buf[a - lo_t:b - lo_t] = got[k][a - s_:b - s_]
                values[sel] = buf[idx]
            tensors[key] = values
        out.setdefault(i, []).append((lo, hi, tensors))
    return out


def _world_device() -> torch.device:
    """Where a tensor for a collective of the default group lives (NCCL: this GPU)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_sharded(directory: str | os.PathLike, model: torch.nn.Module | None = None,
                 optimizer=None, *, tp_group=None) -> dict:
    """Load a :func:`save_sharded` checkpoint written on any grid into ``model`` and
    ``optimizer`` (either may be None): any tensor-parallel size whose blocks divide the
    shapes (the model and the optimizer state are cut again along each tensor's
    partition dim) and any distributed x redundant optimizer grid. Every rank reads only
    the pieces it needs.

    All or nothing across the default process group (every rank of it must call this):
    each rank reads and checks what it needs, the ranks agree on the verdict
    (:func:`mpzero.comm.agree`), and only then is anything copied.
    When the checkpoint does not fit on any rank (wrong model, missing piece, a file
    that cannot be read), every rank raises the same ``ValueError`` naming the key or
    parameter, and no rank has changed its model or optimizer. The DCP metadata is read
    without running code from it (:mod:`mpzero.checkpoint.safe_load`); a file that
    would is refused with :class:`~mpzero.checkpoint.safe_load.UnsafeCheckpointError`.
    Returns ``mpzero.json``'s contents."""
    if optimizer is not None and hasattr(optimizer, "ensure_layout"):
        optimizer.ensure_layout()  # collectives: before anything that may fail
        optimizer.param_sync()
    group = dist.group.WORLD if dist.is_initialized() else None
    try:
        meta = read_meta(directory)
        keys = saved_keys(directory)
        model_state = None
        if model is not None:
            model_state = _model_state(directory, meta, keys, model, tp_group)
        if optimizer is not None:
            if not hasattr(optimizer, "sharded_state_dict"):
                raise ValueError(f"{directory} holds DistributedFusedAdam shards, which load "
                                 "only into a DistributedFusedAdam, not a "
                                 f"{type(optimizer).__name__}")
            om = meta.get("optim")
            if om is None:
                raise ValueError(f"{directory} holds no optimizer state")
            pieces = _optim_pieces(directory, meta, keys, optimizer, tp_group, model)
            same_tp = om.get("tensor_model_parallel_size", 1) == _tp_coords(tp_group)[0]
            # At another TP size the saved shapes are other blocks: the full shapes were
            # compared while resharding.
            shapes = {int(i): tuple(s) for i, s in om["shapes"].items()} if same_tp else None
            checks.check_groups(optimizer, om["param_groups"])
            step = checks.check_step(om["step"], f"{directory}: the optimizer step")
            checks.check_pieces(optimizer, lambda i: pieces.get(i, []), shapes)
    except Exception as e:  # noqa: BLE001 - every refusal travels to the other ranks
        comm.agree(e, group, _world_device())
        raise
    comm.agree(None, group, _world_device())
    if model_state is not None:
        model.load_state_dict(model_state)
    if optimizer is not None:
        # Checked above on every rank: this load validates again (no file access) and
        # applies the pieces, the param groups and the step, as its own loads do.
        optimizer.load_sharded_state_dict([{
            "format": optim_ckpt.FORMAT, "param_groups": om["param_groups"], "step": step,
            "pieces": [(i, lo, hi, tensors) for i, got in sorted(pieces.items())
                       for lo, hi, tensors in got]}])
    return meta


def consolidate(directory: str | os.PathLike, *, optimizer: bool = True) -> dict:
    """Full (TP-merged) model state dict and a format-2 optimizer state dict from a DCP
    checkpoint, in one process (no process group needed): ``{"model", "optimizer"}``."""
    meta = read_meta(directory)
    keys = saved_keys(directory)
    out: dict = {}
    if "model" in meta:
        wanted = {k: v for k, v in keys.items() if k.startswith("model/")}
        got = _read(directory, wanted)
        model = {}
        for name, m in meta["model"].items():
            if m["dim"] is None:
                model[name] = got[f"model/{name}"]
            else:
                pieces = _overlapping(keys, f"model/{name}", 0, m["shape"][m["dim"]])
                model[name] = torch.cat([got[k] for k, _, _ in pieces], m["dim"])
        out["model"] = model
    if optimizer and "optim" in meta:
        om = meta["optim"]
        got = _read(directory, {k: v for k, v in keys.items() if k.startswith("optim/")})
        tp_size = om.get("tensor_model_parallel_size", 1)
        dims = _saved_optim_dims(directory, meta) if tp_size > 1 else None
        state: dict = {}
        for i, shape in om["shapes"].items():
            numel = int(torch.Size(shape).numel())
            st = {}
            for key in optim_ckpt.STATE_KEYS:
                parts = []
                for t in range(tp_size):
                    flat = torch.zeros(numel, dtype=torch.float32)
                    covered = 0
                    for k, s, e in _overlapping(keys, f"{_optim_prefix(t, tp_size)}{i}/{key}",
                                                0, numel):
                        flat[s:e] = got[k]
                        covered += e - s
                    if covered != numel:
                        raise ValueError(f"{directory}: parameter {i} {key!r} covers "
                                         f"{covered} of {numel} elements")
                    parts.append(flat.view(shape))
                dim = dims[int(i)] if dims is not None else None
                st[key] = parts[0] if dim is None else torch.cat(parts, dim)
            st["step"] = om["step"]
            state[int(i)] = st
        state["step"] = om["step"]
        groups = [dict(g, betas=tuple(g["betas"])) for g in om["param_groups"]]
        out["optimizer"] = {"format": optim_ckpt.FORMAT, "param_groups": groups,
                            "state": state}
    return out
