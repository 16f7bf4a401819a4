"""Model TP shards and optimizer shards through ``torch.distributed.checkpoint`` (DCP).

Every rank puts only what it holds into the DCP state dict, under keys that say
which range of which full tensor a tensor is::

    model/<name>                      a TP-replicated tensor (the DP/TP replicas dedup)
    model/<name>/<start>-<end>        rows [start, end) along the TP partition dim
    optim/<i>/<key>/<start>-<end>     elements [start, end) of parameter i's flattened
                                      master ("param"), "exp_avg" or "exp_avg_sq"

Replicas (redundant optimizer ranks, DP replicas of a TP shard) produce the same
keys, which DCP writes once. ``mpzero.json`` beside DCP's files holds what is not
a tensor: param groups, step, full shapes, the partition dims and the grid. A
loading rank reads DCP's metadata (the list of keys and sizes), asks DCP for the
saved ranges that overlap what it holds in *its* grid, and copies those pieces in:
any tensor-parallel size (that divides the shapes) and any distributed x redundant
grid, and no rank ever holds a full state. Loads are all or nothing: everything is
read and checked before the model or optimizer is touched.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from mpzero import comm
from mpzero.optimizers import checkpoint as optim_ckpt

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


def _tp_info(model: torch.nn.Module, tp_group) -> dict[str, dict]:
    """Per state-dict key: full shape, partition dim (None: replicated), this rank's start."""
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    dims = {n: p.partition_dim for n, p in model.named_parameters()
            if getattr(p, "tensor_model_parallel", False) and tp_size > 1}
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
                         "param_names": [names.get(id(p)) for p in optimizer.parameters()]}
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
    """Every tensor key of the DCP checkpoint with its size (from DCP's metadata only)."""
    md = dcp.FileSystemReader(str(directory)).read_metadata()
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items()
            if hasattr(v, "size")}


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
        dcp.load(sd, checkpoint_id=str(directory), no_dist=True)
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
        if sdim is None:
            wanted[f"model/{name}"] = tuple(saved[name]["shape"])
            plan[name] = None
            continue
        dim = info[name]["dim"]
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
        parts = [got[k].narrow(sdim, max(s, lo) - s, min(e, hi) - max(s, lo))
                 for k, s, e in pieces]
        out[name] = torch.cat(parts, sdim).to(t.dtype)
    return out


def _optim_pieces(directory, meta, keys, optimizer, tp_group) -> dict[int, list]:
    """The saved pieces overlapping this rank's shards: ``{param: [(start, end, {key: t})]}``."""
    tp_size, tp_rank = _tp_coords(tp_group)
    saved_tp = meta["optim"].get("tensor_model_parallel_size", 1)
    if saved_tp != tp_size:
        raise ValueError(f"{directory}: the optimizer state was saved at "
                         f"tensor_model_parallel_size={saved_tp}, this run has {tp_size}; "
                         "load it at the same TP size (any data-parallel grid), or load the "
                         "model only")
    prefix = _optim_prefix(tp_rank, tp_size)
    optimizer._ensure_layout()
    mine: dict[int, list[tuple[int, int]]] = {}
    for lay in optimizer._layouts:
        for pc in lay.shard_pieces(optimizer.distributed_rank):
            mine.setdefault(pc.param, []).append((pc.param_start, pc.param_end))
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


def load_sharded(directory: str | os.PathLike, model: torch.nn.Module | None = None,
                 optimizer=None, *, tp_group=None) -> dict:
    """Load a :func:`save_sharded` checkpoint written on any grid into ``model`` and
    ``optimizer`` (either may be None). Every rank reads only the pieces it needs. All
    or nothing: raises ``ValueError`` (naming the key or parameter) before changing
    anything when the checkpoint does not fit. Returns ``mpzero.json``'s contents."""
    meta = read_meta(directory)
    keys = saved_keys(directory)
    model_state = None
    if model is not None:
        model_state = _model_state(directory, meta, keys, model, tp_group)
    if optimizer is not None:
        om = meta.get("optim")
        if om is None:
            raise ValueError(f"{directory} holds no optimizer state")
        optimizer._ensure_layout()
        optimizer.param_sync()
        pieces = _optim_pieces(directory, meta, keys, optimizer, tp_group)
        shapes = {int(i): tuple(s) for i, s in om["shapes"].items()}
        optim_ckpt._check_groups(optimizer, om["param_groups"])
        optim_ckpt._check_pieces(optimizer, lambda i: pieces.get(i, []), shapes)
    if model_state is not None:
        model.load_state_dict(model_state)
    if optimizer is not None:
        optim_ckpt._apply_groups(optimizer, om["param_groups"])
        optim_ckpt._fill_from_pieces(optimizer, lambda i: pieces.get(i, []))
        optimizer.set_step_count(om["step"])
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
                name = (om.get("param_names") or [None] * (int(i) + 1))[int(i)]
                dim = meta.get("model", {}).get(name, {}).get("dim") if name else None
                if tp_size > 1 and dim is None and name is None:
                    raise ValueError(f"{directory}: parameter {i} has no model name; cannot "
                                     "merge its TP shards")
                st[key] = parts[0] if dim is None else torch.cat(parts, dim)
            st["step"] = om["step"]
            state[int(i)] = st
        state["step"] = om["step"]
        groups = [dict(g, betas=tuple(g["betas"])) for g in om["param_groups"]]
        out["optimizer"] = {"format": optim_ckpt.FORMAT, "param_groups": groups,
                            "state": state}
    return out
