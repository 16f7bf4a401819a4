"""Checkpoints of DistributedFusedAdam.

Format 2 (``state_dict``/``load_state_dict``) is laid out like
``torch.optim.Optimizer.state_dict()``::

    {"format": 2,
     "param_groups": [{"lr", "betas", "eps", "weight_decay", "bias_correction", ...,
                       "params": [indices]}],
     "state": {i: {"param": fp32 master, "exp_avg", "exp_avg_sq"}  # CPU, full shape
               ..., "step": int}}

It does not depend on the grid or the bucket layout: every rank gathers the
shards of every bucket over the distributed group and cuts out the fragments,
and loading copies each rank's shard pieces out of the full tensors. So a state
saved on one distributed × redundant grid loads on any other, with any bucket
size and parameter init order.

The sharded path (``sharded_state_dict``/``save_sharded``/``load_sharded``)
keeps each rank to its own pieces: a rank writes only the fragment ranges of its
shards (one file per distributed rank, written by redundant rank 0), and a
loading rank reads only the ranges overlapping its new shards, so no rank ever
materializes the whole state.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

from mpzero import comm
from mpzero.optimizers.flat import flat_like, flat_view

FORMAT = 2
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


def _group_meta(opt) -> list[dict]:
    out, start = [], 0
    for group in opt.param_groups:
        meta = {k: v for k, v in group.items() if k != "params"}
        meta["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        out.append(meta)
    return out


def _shard_tensors(opt, b: int) -> dict[str, torch.Tensor]:
    """This rank's shard of bucket ``b`` for each state key (the master in its dtype)."""
    exp_avg, exp_avg_sq = opt._moments(b)
    return {"param": opt._master_shard(b), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _load_targets(opt, b: int) -> dict[str, torch.Tensor]:
    """Where loading writes bucket ``b``'s shard; the master goes through a temporary that
    :func:`_commit_targets` hands to the optimizer (it may be stored as remainders)."""
    lay = opt._layouts[b]
    exp_avg, exp_avg_sq = opt._moments(b)
    return {"param": torch.zeros(lay.shard_size, dtype=torch.float32, device=opt.device),
            "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _commit_targets(opt, b: int, targets: dict) -> None:
    opt._store_master_shard(b, targets["param"])
    opt._store_moments(b, targets["exp_avg"], targets["exp_avg_sq"])


def gather_state_dict(opt) -> dict:
    state: dict = {}
    for i, p in enumerate(opt._params):
        if i in opt._keys:
            # The parameter's own memory layout (e.g. channels_last): shards are in
            # memory order.
            state[i] = {k: torch.zeros_like(p, dtype=torch.float32, device="cpu")
                        for k in STATE_KEYS}
    for b, lay in enumerate(opt._layouts):
        for key, shard in _shard_tensors(opt, b).items():
            full = torch.empty(lay.size, dtype=shard.dtype, device=shard.device)
            opt._comm.all_gather(shard, full, opt.distributed_process_group).wait()
            full = full.float().cpu()
            for f in lay.fragments:
                flat_view(state[f.param][key])[f.param_start:f.param_end] = (
                    full[f.bucket_start:f.bucket_end])
    state["step"] = opt.step_count()
    return {"format": FORMAT, "param_groups": _group_meta(opt), "state": state}


def _load_groups(opt, groups: list[dict]) -> None:
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"load_state_dict: the state has {len(groups)} param groups, this "
                         f"optimizer {len(opt.param_groups)}")
    for gi, (saved, group) in enumerate(zip(groups, opt.param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"load_state_dict: param group {gi} has {len(saved['params'])} "
                             f"params in the state, {len(group['params'])} here")
    for saved, group in zip(groups, opt.param_groups):
        for k, v in saved.items():
            if k != "params":
                group[k] = tuple(v) if k == "betas" else v


def load_state_dict(opt, sd: dict) -> None:
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        got = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
        raise ValueError(f"load_state_dict: expected a format-{FORMAT} DistributedFusedAdam "
                         f"state dict, got format {got!r}")
    _load_groups(opt, sd["param_groups"])
    state = sd["state"]
    for i in opt._keys:
        if i not in state:
            raise ValueError(f"load_state_dict: no state for parameter {i}")
        for k in STATE_KEYS:
            if state[i][k].numel() != opt._params[i].numel():
                raise ValueError(
                    f"load_state_dict: state[{i}][{k!r}] has {state[i][k].numel()} elements, "
                    f"parameter {i} has {opt._params[i].numel()}")
    with torch.no_grad():
        for b, lay in enumerate(opt._layouts):
            targets = _load_targets(opt, b)
            for piece in lay.shard_pieces(opt.distributed_rank):
                for k, dst in targets.items():
                    src = flat_like(state[piece.param][k], opt._params[piece.param])[
                        piece.param_start:piece.param_end]
                    dst[piece.shard_start:piece.shard_end].copy_(src)
            _commit_targets(opt, b, targets)
    opt.set_step_count(state["step"])


# ---------------------------------------------------------------------- sharded
def sharded_state_dict(opt) -> dict:
    """This rank's pieces: ``{"format", "param_groups", "step", "pieces": [...]}`` where each
    piece is ``(param index, start, end, {key: fp32 CPU tensor})`` of the flattened param."""
    pieces = []
    for b, lay in enumerate(opt._layouts):
        shards = _shard_tensors(opt, b)
        for pc in lay.shard_pieces(opt.distributed_rank):
            pieces.append((pc.param, pc.param_start, pc.param_end,
                           {k: t[pc.shard_start:pc.shard_end].float().cpu().clone()
                            for k, t in shards.items()}))
    return {"format": FORMAT, "param_groups": _group_meta(opt), "step": opt.step_count(),
            "numels": {i: opt._params[i].numel() for i in opt._keys}, "pieces": pieces}


def load_sharded_state_dict(opt, sds: list[dict]) -> None:
    """Load from the sharded state dicts of every rank that wrote one (any grid)."""
    if not sds:
        raise ValueError("load_sharded_state_dict: no shards given")
    _load_groups(opt, sds[0]["param_groups"])
    by_param: dict[int, list] = {}
    for sd in sds:
        for param, start, end, tensors in sd["pieces"]:
            by_param.setdefault(param, []).append((start, end, tensors))
    _fill_from_pieces(opt, lambda i: by_param.get(i, []))
    opt.set_step_count(sds[0]["step"])


def _fill_from_pieces(opt, pieces_of) -> None:
    """Copy saved ``(start, end, tensors)`` pieces that overlap this rank's shards."""
    covered = {}
    with torch.no_grad():
        for b, lay in enumerate(opt._layouts):
            targets = _load_targets(opt, b)
            for pc in lay.shard_pieces(opt.distributed_rank):
                for start, end, tensors in pieces_of(pc.param):
                    lo, hi = max(start, pc.param_start), min(end, pc.param_end)
                    if lo >= hi:
                        continue
                    covered[pc.param] = covered.get(pc.param, 0) + hi - lo
                    for k, dst in targets.items():
                        src = tensors[k][lo - start:hi - start]
                        s0 = pc.shard_start + lo - pc.param_start
                        dst[s0:s0 + hi - lo].copy_(src)
            _commit_targets(opt, b, targets)
    for lay in opt._layouts:
        for pc in lay.shard_pieces(opt.distributed_rank):
            covered[pc.param] = covered.get(pc.param, 0) - pc.numel
    missing = [i for i, c in covered.items() if c < 0]
    if missing:
        raise ValueError(f"sharded checkpoint does not cover parameters {missing[:8]}")


def _atomic_write(path: str, write) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-" + os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_sharded(opt, directory: str) -> None:
    """Each distributed rank (redundant rank 0) writes its own pieces to ``directory``.

    Files: ``shard-{rank:05d}-of-{n:05d}.pt`` and, from rank 0, ``index.json``
    (written last; it names the shard files and their sizes, checked on load).
    All ranks of the process group must call it."""
    sd = opt.sharded_state_dict()
    n = opt.distributed_size
    name = f"shard-{opt.distributed_rank:05d}-of-{n:05d}.pt"
    if comm.group_rank(opt.redundant_process_group) == 0:
        _atomic_write(os.path.join(directory, name), lambda f: torch.save(sd, f))
    writer = comm.group_rank(opt.redundant_process_group) == 0
    written = comm.all_gather_object(
        (name, os.path.getsize(os.path.join(directory, name))) if writer else None,
        opt.process_group)
    if comm.group_rank(opt.process_group) == 0:
        files = dict(sorted(w for w in written if w is not None))
        index = {"format": FORMAT, "distributed_size": n, "files": files}
        _atomic_write(os.path.join(directory, "index.json"),
                      lambda f: f.write(json.dumps(index, indent=1).encode()))
    if comm.group_size(opt.process_group) > 1:
        import torch.distributed as dist

        dist.barrier(group=opt.process_group)


def load_sharded(opt, directory: str) -> None:
    """Load a :func:`save_sharded` checkpoint written on any grid. Each rank reads the shard
    files one at a time and keeps only the ranges overlapping its own shards."""
    with open(os.path.join(directory, "index.json")) as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise ValueError(f"{directory}: not a format-{FORMAT} sharded checkpoint")
    opt._ensure_layout()
    opt.param_sync()
    mine: dict[int, list[tuple[int, int]]] = {}
    for lay in opt._layouts:
        for pc in lay.shard_pieces(opt.distributed_rank):
            mine.setdefault(pc.param, []).append((pc.param_start, pc.param_end))
    kept: dict[int, list] = {}
    meta = None
    for fname, size in index["files"].items():
        path = os.path.join(directory, fname)
        if size is not None and os.path.getsize(path) != size:
            raise ValueError(f"{path}: size {os.path.getsize(path)} != {size} in index.json "
                             "(truncated or replaced file)")
        sd = torch.load(path, map_location="cpu", weights_only=False)
        meta = meta or sd
        for param, start, end, tensors in sd["pieces"]:
            if any(start < hi and end > lo for lo, hi in mine.get(param, ())):
                kept.setdefault(param, []).append((start, end, tensors))
        del sd
    _load_groups(opt, meta["param_groups"])
    _fill_from_pieces(opt, lambda i: kept.get(i, []))
    opt.set_step_count(meta["step"])
