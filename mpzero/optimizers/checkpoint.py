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
import math
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
    step = opt.step_count()
    for i in opt._keys:
        state[i]["step"] = step
    state["step"] = step
    return {"format": FORMAT, "param_groups": _group_meta(opt), "state": state}


def _check_groups(opt, groups) -> None:
    """Raise (touching nothing) unless ``groups`` fit this optimizer's param groups."""
    if not isinstance(groups, (list, tuple)):
        raise ValueError(f"load_state_dict: 'param_groups' must be a list, got "
                         f"{type(groups).__name__}")
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"load_state_dict: the state has {len(groups)} param groups, this "
                         f"optimizer {len(opt.param_groups)}")
    for gi, (saved, group) in enumerate(zip(groups, opt.param_groups)):
        if not isinstance(saved, dict) or "params" not in saved:
            raise ValueError(f"load_state_dict: param group {gi} is not a dict with 'params'")
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"load_state_dict: param group {gi} has {len(saved['params'])} "
                             f"params in the state, {len(group['params'])} here")
        _check_group_values(gi, saved)


def _is_number(v) -> bool:
    if isinstance(v, torch.Tensor):  # a capturable optimizer's lr may be a tensor
        return (v.numel() == 1 and not v.is_meta and not v.dtype.is_complex
                and v.dtype != torch.bool)
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_group_values(gi: int, saved: dict) -> None:
    """The hyperparameters the step reads are finite numbers of the right kind, so that
    applying them cannot fail (or poison the next step) half-way through a load."""
    for key in ("lr", "eps", "weight_decay"):
        if key in saved:
            v = saved[key]
            if not _is_number(v) or not math.isfinite(float(v)) or float(v) < 0:
                raise ValueError(f"load_state_dict: param group {gi} has {key}={v!r}; "
                                 "expected a finite number >= 0")
    if "betas" in saved:
        betas = saved["betas"]
        if (not isinstance(betas, (list, tuple)) or len(betas) != 2
                or not all(_is_number(b) and 0.0 <= float(b) < 1.0 for b in betas)):
            raise ValueError(f"load_state_dict: param group {gi} has betas {betas!r}; "
                             "expected two numbers in [0, 1)")
    if "bias_correction" in saved and not isinstance(saved["bias_correction"], (bool, int)):
        raise ValueError(f"load_state_dict: param group {gi} has bias_correction="
                         f"{saved['bias_correction']!r}")


def _check_step(step, where: str = "state['step']") -> int:
    """The step count as an int, or ValueError: an int, an integral float, or a
    one-element tensor holding one, >= 0 (bool is refused: it is no count)."""
    value = step
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.is_meta or step.dtype.is_complex:
            raise ValueError(f"load_state_dict: {where} is a tensor of shape "
                             f"{tuple(step.shape)} ({step.dtype}, {step.device.type}); "
                             "expected one number")
        value = step.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"load_state_dict: {where} is {step!r}; expected the step count "
                         "(an int)")
    if not math.isfinite(value) or value != int(value) or value < 0:
        raise ValueError(f"load_state_dict: {where} is {step!r}; expected a whole number "
                         ">= 0")
    return int(value)


def _apply_groups(opt, groups, keys=None) -> None:
    for saved, group in zip(groups, opt.param_groups):
        for k, v in saved.items():
            if k != "params" and (keys is None or k in keys):
                group[k] = tuple(v) if k == "betas" else v


def _is_torch_adam(sd: dict) -> bool:
    """A ``torch.optim.Adam``/``AdamW`` state dict: per-param states without ``"param"``."""
    if "format" in sd or not isinstance(sd.get("state"), dict):
        return False
    states = [v for v in sd["state"].values() if isinstance(v, dict)]
    return bool(states) and all(
        {"exp_avg", "exp_avg_sq", "step"} <= set(v) and "param" not in v for v in states)


def _check_tensor(opt, i: int, key: str, t) -> None:
    p = opt._params[i]
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"load_state_dict: state[{i}][{key!r}] is a {type(t).__name__}, "
                         "not a tensor")
    if tuple(t.shape) != tuple(p.shape):
        raise ValueError(f"load_state_dict: state[{i}][{key!r}] has shape {tuple(t.shape)}, "
                         f"parameter {i} has shape {tuple(p.shape)}")
    _check_data(t, f"state[{i}][{key!r}]")


def _check_data(t: torch.Tensor, where: str) -> None:
    """A tensor whose values can be copied: floating point, dense, with storage."""
    if not t.is_floating_point():
        raise ValueError(f"load_state_dict: {where} has dtype {t.dtype}")
    if t.is_meta:
        raise ValueError(f"load_state_dict: {where} is a meta tensor (shape only, no values)")
    if t.layout != torch.strided:
        raise ValueError(f"load_state_dict: {where} has layout {t.layout}, not dense")


def _trained(opt) -> list[int]:
    """Indices of the parameters that have optimizer state. Before the layout is made
    (which is a collective) they are the ones with ``requires_grad``: the layout takes
    exactly those, so a state dict can be checked before anything communicates."""
    if getattr(opt, "_built", False):
        return list(opt._keys)
    return [i for i, p in enumerate(opt._params) if p.requires_grad]


def _normalized_state(opt, sd: dict) -> tuple[dict, list[dict], set | None]:
    """Validate ``sd`` completely and return ``(state, param_groups, group keys to apply)``
    with ``state[i]`` holding every key of :data:`STATE_KEYS`. Raises before any change."""
    if not isinstance(sd, dict):
        raise ValueError(f"load_state_dict: expected a dict, got {type(sd).__name__}")
    if sd.get("format", FORMAT) != FORMAT:
        raise ValueError(f"load_state_dict: expected a format-{FORMAT} DistributedFusedAdam "
                         f"state dict (or a torch Adam/AdamW one), got format "
                         f"{sd.get('format')!r}")
    for key in ("state", "param_groups"):
        if key not in sd:
            raise ValueError(f"load_state_dict: the state dict has no {key!r}")
    if _is_torch_adam(sd):
        return _from_torch(opt, sd)
    groups, state = sd["param_groups"], sd["state"]
    _check_groups(opt, groups)
    if not isinstance(state, dict):
        raise ValueError("load_state_dict: 'state' must be a dict")
    if "step" not in state:
        raise ValueError("load_state_dict: state has no 'step' (the step count)")
    _check_step(state["step"])
    keys = _trained(opt)
    for i in keys:
        if i in state and not isinstance(state[i], dict):
            raise ValueError(f"load_state_dict: state[{i}] is a {type(state[i]).__name__}, "
                             "not a dict")
    for i in keys:
        if i not in state:
            raise ValueError(f"load_state_dict: no state for parameter {i} "
                             f"(shape {tuple(opt._params[i].shape)})")
        for k in STATE_KEYS:
            if k not in state[i]:
                raise ValueError(f"load_state_dict: state[{i}] has no {k!r} "
                                 f"(keys: {sorted(map(str, state[i]))})")
            _check_tensor(opt, i, k, state[i][k])
    extra = [i for i in state if i != "step" and i not in keys]
    if extra:
        raise ValueError(f"load_state_dict: state for parameters {extra[:8]} that this "
                         "optimizer does not train (no such index, or requires_grad=False)")
    return state, groups, None


def _from_torch(opt, sd: dict) -> tuple[dict, list[dict], set]:
    """A torch Adam/AdamW state dict as format-2 state; masters are the current params."""
    groups, tstate = sd["param_groups"], sd["state"]
    _check_groups(opt, groups)
    for gi, group in enumerate(groups):
        if group.get("amsgrad"):
            raise ValueError(f"load_state_dict: torch param group {gi} uses amsgrad, "
                             "which DistributedFusedAdam does not support")
        decoupled = group.get("decoupled_weight_decay")
        if decoupled is not None and group.get("weight_decay", 0.0) and \
                bool(decoupled) != bool(opt.adam_w_mode):
            raise ValueError(
                f"load_state_dict: torch param group {gi} has decoupled_weight_decay="
                f"{decoupled}, this optimizer adam_w_mode={opt.adam_w_mode}")
    steps = set()
    state: dict = {}
    keys = _trained(opt)
    for i in keys:
        p = opt._params[i]
        saved = tstate.get(i)
        if saved is None:  # torch creates state lazily: a param never stepped
            zeros = torch.zeros(p.shape, dtype=torch.float32)
            state[i] = {"exp_avg": zeros, "exp_avg_sq": zeros.clone()}
        else:
            if not isinstance(saved, dict):
                raise ValueError(f"load_state_dict: torch state[{i}] is a "
                                 f"{type(saved).__name__}, not a dict")
            for k in ("exp_avg", "exp_avg_sq", "step"):
                if k not in saved:
                    raise ValueError(f"load_state_dict: torch state[{i}] has no {k!r} "
                                     f"(keys: {sorted(map(str, saved))})")
            for k in ("exp_avg", "exp_avg_sq"):
                _check_tensor(opt, i, k, saved[k])
            state[i] = {k: saved[k] for k in ("exp_avg", "exp_avg_sq")}
            steps.add(_check_step(saved["step"], f"torch state[{i}]['step']"))
        state[i]["param"] = p.detach().float().cpu()
    extra = [i for i in tstate if i not in keys]
    if extra:
        raise ValueError(f"load_state_dict: torch state for parameters {extra[:8]} that this "
                         "optimizer does not train")
    if len(steps) > 1:
        raise ValueError(f"load_state_dict: torch state has different step counts {steps}; "
                         "DistributedFusedAdam keeps one per optimizer")
    state["step"] = steps.pop() if steps else 0
    return state, groups, {"lr", "betas", "eps", "weight_decay"}


def check_state_dict(opt, sd: dict) -> None:
    """Raise ``ValueError`` (naming the key) unless :func:`load_state_dict` would load
    ``sd`` into ``opt``; changes nothing and communicates nothing, so a caller can check
    before it loads anything else (e.g. the model) and agree on the verdict itself."""
    _normalized_state(opt, sd)


def load_state_dict(opt, sd: dict) -> None:
    """Load a format-2 (or torch Adam/AdamW) state dict, all or nothing across the process
    group: every rank validates the whole dict (every parameter, key, full shape, the step
    and the param groups' values), the ranks agree on the verdict (:func:`mpzero.comm.agree`), and
    only then is anything changed. When any rank refuses, every rank raises the same
    ``ValueError`` and no rank has changed its state. Collective over
    ``opt.process_group``."""
    try:
        state, groups, group_keys = _normalized_state(opt, sd)
    except Exception as e:  # noqa: BLE001 - every refusal travels to the other ranks
        comm.agree(e, opt.process_group, opt.device)
        raise  # unreachable: agree raised
    comm.agree(None, opt.process_group, opt.device)
    _apply_groups(opt, groups, group_keys)
    with torch.no_grad():
        for b, lay in enumerate(opt._layouts):
            targets = _load_targets(opt, b)
            for piece in lay.shard_pieces(opt.distributed_rank):
                for k, dst in targets.items():
                    src = flat_like(state[piece.param][k], opt._params[piece.param])[
                        piece.param_start:piece.param_end]
                    dst[piece.shard_start:piece.shard_end].copy_(src)
            _commit_targets(opt, b, targets)
    opt.set_step_count(_check_step(state["step"]))


_TORCH_GROUP_DEFAULTS = {"amsgrad": False, "foreach": None, "maximize": False,
                         "capturable": False, "differentiable": False, "fused": None}


def to_torch_state_dict(sd: dict, *, adam_w_mode: bool = True) -> dict:
    """Convert a format-2 state dict to ``torch.optim.AdamW`` (``adam_w_mode=False``:
    ``torch.optim.Adam``) format, which ``torch.optim.AdamW.load_state_dict`` accepts for
    the same parameters in the same param groups. Moments are copied bit for bit; the
    masters (``"param"``) are dropped: torch keeps them in the model. Raises when a group
    has ``bias_correction=False`` (torch always corrects)."""
    if not isinstance(sd, dict) or sd.get("format", FORMAT) != FORMAT or "state" not in sd:
        raise ValueError("to_torch_state_dict: expected a format-2 DistributedFusedAdam "
                         "state dict")
    step = sd["state"]["step"]
    step = float(step.item() if isinstance(step, torch.Tensor) else step)
    groups = []
    for gi, g in enumerate(sd["param_groups"]):
        if not g.get("bias_correction", True):
            raise ValueError(f"to_torch_state_dict: param group {gi} has bias_correction="
                             "False, which torch's Adam/AdamW cannot express")
        out = {k: v for k, v in g.items() if k != "bias_correction"}
        out.update({k: v for k, v in _TORCH_GROUP_DEFAULTS.items() if k not in out})
        out["betas"] = tuple(out["betas"])
        out["decoupled_weight_decay"] = adam_w_mode
        out["params"] = list(g["params"])
        groups.append(out)
    state = {i: {"step": torch.tensor(step), "exp_avg": st["exp_avg"].clone(),
                 "exp_avg_sq": st["exp_avg_sq"].clone()}
             for i, st in sd["state"].items() if i != "step"}
    return {"state": state, "param_groups": groups}


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
            "numels": {i: opt._params[i].numel() for i in opt._keys},
            "shapes": {i: tuple(opt._params[i].shape) for i in opt._keys}, "pieces": pieces}


def _check_sharded_meta(sd, where: str) -> None:
    if not isinstance(sd, dict):
        raise ValueError(f"{where}: expected a sharded state dict, got {type(sd).__name__}")
    if sd.get("format", FORMAT) != FORMAT:
        raise ValueError(f"{where}: expected format {FORMAT}, got {sd.get('format')!r}")
    for key in ("param_groups", "step", "pieces"):
        if key not in sd:
            raise ValueError(f"{where}: no {key!r}")
    if not isinstance(sd["pieces"], (list, tuple)):
        raise ValueError(f"{where}: 'pieces' must be a list")


def _index_pieces(opt, pieces, by_param: dict, where: str, keep=None) -> None:
    """Sort well-formed ``(param, start, end, tensors)`` pieces into ``by_param`` (only
    those ``keep(param, start, end)`` accepts); raise on a malformed one."""
    for n, piece in enumerate(pieces):
        if not isinstance(piece, (list, tuple)) or len(piece) != 4:
            raise ValueError(f"{where}: piece {n} is not (param, start, end, tensors)")
        param, start, end, tensors = piece
        if not all(isinstance(x, int) and not isinstance(x, bool)
                   for x in (param, start, end)):
            raise ValueError(f"{where}: piece {n} has non-integer param/start/end "
                             f"{param!r}, {start!r}, {end!r}")
        if param not in opt._keys:
            raise ValueError(f"{where}: piece {n} is for parameter {param}, which this "
                             "optimizer does not train")
        if not 0 <= start < end <= opt._params[param].numel():
            raise ValueError(f"{where}: piece {n} covers [{start}, {end}) of parameter "
                             f"{param}, which has {opt._params[param].numel()} elements")
        if not isinstance(tensors, dict):
            raise ValueError(f"{where}: piece {n} holds a {type(tensors).__name__}, not a "
                             "dict of tensors")
        if keep is None or keep(param, start, end):
            by_param.setdefault(param, []).append((start, end, tensors))


def load_sharded_state_dict(opt, sds: list[dict]) -> None:
    """Load from the sharded state dicts of every rank that wrote one (any grid). All or
    nothing across the process group, as :func:`load_state_dict`. Collective."""
    try:
        if not sds:
            raise ValueError("load_sharded_state_dict: no shards given")
        by_param: dict[int, list] = {}
        for n, sd in enumerate(sds):
            _check_sharded_meta(sd, f"load_sharded_state_dict: shard {n}")
            _index_pieces(opt, sd["pieces"], by_param, f"load_sharded_state_dict: shard {n}")
        _check_groups(opt, sds[0]["param_groups"])
        step = _check_step(sds[0]["step"], "the sharded state's 'step'")
        _check_pieces(opt, lambda i: by_param.get(i, []), sds[0].get("shapes"))
    except Exception as e:  # noqa: BLE001 - every refusal travels to the other ranks
        comm.agree(e, opt.process_group, opt.device)
        raise
    comm.agree(None, opt.process_group, opt.device)
    _apply_groups(opt, sds[0]["param_groups"])
    _fill_from_pieces(opt, lambda i: by_param.get(i, []))
    opt.set_step_count(step)


def _check_pieces(opt, pieces_of, shapes: dict | None) -> None:
    """Raise (touching nothing) unless the saved pieces cover every element of this rank's
    shards, with every key, and the saved full shapes match the parameters."""
    for i in opt._keys:
        saved = (shapes or {}).get(i)
        if saved is not None and tuple(saved) != tuple(opt._params[i].shape):
            raise ValueError(f"sharded checkpoint: parameter {i} was saved with shape "
                             f"{tuple(saved)}, this parameter has {tuple(opt._params[i].shape)}")
    for lay in opt._layouts:
        for pc in lay.shard_pieces(opt.distributed_rank):
            covered = 0
            for start, end, tensors in pieces_of(pc.param):
                lo, hi = max(start, pc.param_start), min(end, pc.param_end)
                if lo >= hi:
                    continue
                for k in STATE_KEYS:
                    t = tensors.get(k)
                    if not isinstance(t, torch.Tensor) or t.numel() != end - start \
                            or t.dim() != 1:
                        raise ValueError(f"sharded checkpoint: parameter {pc.param} piece "
                                         f"[{start}, {end}) has a bad or missing {k!r}")
                    _check_data(t, f"sharded checkpoint: parameter {pc.param} piece "
                                   f"[{start}, {end}) {k!r}")
                covered += hi - lo
            if covered < pc.numel:
                raise ValueError(f"sharded checkpoint does not cover parameter {pc.param} "
                                 f"elements [{pc.param_start}, {pc.param_end})")


def _fill_from_pieces(opt, pieces_of) -> None:
    """Copy saved ``(start, end, tensors)`` pieces that overlap this rank's shards."""
    with torch.no_grad():
        for b, lay in enumerate(opt._layouts):
            targets = _load_targets(opt, b)
            for pc in lay.shard_pieces(opt.distributed_rank):
                for start, end, tensors in pieces_of(pc.param):
                    lo, hi = max(start, pc.param_start), min(end, pc.param_end)
                    if lo >= hi:
                        continue
                    for k, dst in targets.items():
                        src = tensors[k][lo - start:hi - start]
                        s0 = pc.shard_start + lo - pc.param_start
                        dst[s0:s0 + hi - lo].copy_(src)
            _commit_targets(opt, b, targets)


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
    files one at a time and keeps only the ranges overlapping its own shards. All or
    nothing across the process group: a missing, truncated or malformed file on any rank
    makes every rank raise the same ``ValueError`` before any state changes. Collective."""
    from mpzero.checkpoint import safe_load  # (mpzero.checkpoint imports this module)

    opt._ensure_layout()
    opt.param_sync()
    try:
        with open(os.path.join(directory, "index.json")) as f:
            index = json.load(f)
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise ValueError(f"{directory}: not a format-{FORMAT} sharded checkpoint")
        mine: dict[int, list[tuple[int, int]]] = {}
        for lay in opt._layouts:
            for pc in lay.shard_pieces(opt.distributed_rank):
                mine.setdefault(pc.param, []).append((pc.param_start, pc.param_end))
        kept: dict[int, list] = {}
        meta = None
        for fname, size in index["files"].items():
            path = os.path.join(directory, os.path.basename(fname))
            if size is not None and os.path.getsize(path) != size:
                raise ValueError(f"{path}: size {os.path.getsize(path)} != {size} in "
                                 "index.json (truncated or replaced file)")
            sd = safe_load.torch_load(path)
            _check_sharded_meta(sd, path)
            meta = meta or sd
            _index_pieces(opt, sd["pieces"], kept, path,
                          keep=lambda p, s, e: any(s < hi and e > lo
                                                   for lo, hi in mine.get(p, ())))
            del sd
        if meta is None:
            raise ValueError(f"{directory}/index.json lists no shard files")
        _check_groups(opt, meta["param_groups"])
        step = _check_step(meta["step"], f"{directory}: 'step'")
        _check_pieces(opt, lambda i: kept.get(i, []), meta.get("shapes"))
    except Exception as e:  # noqa: BLE001 - every refusal travels to the other ranks
        comm.agree(e, opt.process_group, opt.device)
        raise
    comm.agree(None, opt.process_group, opt.device)
    _apply_groups(opt, meta["param_groups"])
    _fill_from_pieces(opt, lambda i: kept.get(i, []))
    opt.set_step_count(step)
