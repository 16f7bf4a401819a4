"""Checkpoints of DistributedFusedAdam.

Format 2 (``state_dict``/``load_state_dict``) is laid out like
``torch.optim.Optimizer.state_dict()``::

    {"format": 2,
     "param_groups": [{"lr", "betas", "eps", "weight_decay", "bias_correction", ...,
                       "params": [indices]}],
     "state": {i: {"param": fp32 master, "exp_avg", "exp_avg_sq"}  # CPU, full shape
               ..., "step": int}}

It does not depend on the grid or the bucket layout (full tensors per parameter), so
it loads on any other grid, bucket size and init order. The sharded path
(``sharded_state_dict``/``load_sharded_state_dict``, what ``mpzero.checkpoint.dcp``
writes and reads) keeps each rank to the fragment ranges of its own shards. Everything
here reads the optimizer through public attributes (``shards``, ``groups``,
``options``, ``step_state``, ``param_groups``).
"""

from __future__ import annotations

import torch

from mpzero import comm
from mpzero.optimizers import state_checks as checks
from mpzero.optimizers.flat import flat_like, flat_view
from mpzero.optimizers.state_checks import FORMAT, STATE_KEYS


def _group_meta(opt) -> list[dict]:
    out, start = [], 0
    for group in opt.param_groups:
        meta = {k: v for k, v in group.items() if k != "params"}
        if isinstance(meta.get("lr"), torch.Tensor):  # capturable: the device lr saves as a number
            meta["lr"] = float(meta["lr"])
        meta["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        out.append(meta)
    return out


def _shard_tensors(opt, b: int) -> dict[str, torch.Tensor]:
    """This rank's shard of bucket ``b`` for each state key (the master in its dtype)."""
    exp_avg, exp_avg_sq = opt.shards.moments(b)
    return {"param": opt.shards.master_shard(b), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _load_targets(opt, b: int) -> dict[str, torch.Tensor]:
    """Where loading writes bucket ``b``'s shard; the master goes through a temporary that
    :func:`_commit_targets` hands to the optimizer (it may be stored as remainders)."""
    lay = opt.shards.layouts[b]
    exp_avg, exp_avg_sq = opt.shards.moments(b)
    return {"param": torch.zeros(lay.shard_size, dtype=torch.float32,
                                 device=opt.shards.state_device),
            "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _commit_targets(opt, b: int, targets: dict, stale) -> None:
    opt.shards.store_master_shard(b, targets["param"], stale)
    opt.shards.store_moments(b, targets["exp_avg"], targets["exp_avg_sq"])


def gather_state_dict(opt, state_dict_format: int | None = None) -> dict:
    """The format-2 state dict (a collective over the distributed group)."""
    if state_dict_format not in (None, FORMAT):
        raise ValueError(f"state_dict(state_dict_format={state_dict_format!r}): only "
                         f"format {FORMAT} is written")
    state: dict = {}
    for i, p in enumerate(opt.shards.params):
        if i in opt.shards.keys:
            # The parameter's own memory layout (e.g. channels_last): shards are in
            # memory order.
            state[i] = {k: torch.zeros_like(p, dtype=torch.float32, device="cpu")
                        for k in STATE_KEYS}
    for b, lay in enumerate(opt.shards.layouts):
        for key, shard in _shard_tensors(opt, b).items():
            full = opt.shards.gather(shard, lay.size).float().cpu()
            for f in lay.fragments:
                flat_view(state[f.param][key])[f.param_start:f.param_end] = (
                    full[f.bucket_start:f.bucket_end])
    step = opt.step_state.count()
    for i in opt.shards.keys:
        state[i]["step"] = step
    state["step"] = step
    return {"format": FORMAT, "param_groups": _group_meta(opt), "state": state}


def check_state_dict(opt, sd: dict) -> None:
    """Raise ``ValueError`` (naming the key) unless :func:`load_state_dict` would load
    ``sd`` into ``opt``; changes nothing and communicates nothing, so a caller can check
    before it loads anything else (e.g. the model) and agree on the verdict itself."""
    checks.normalized_state(opt, sd)


def load_state_dict(opt, sd: dict, stale) -> None:
    """Load a format-2 (or torch Adam/AdamW) state dict, all or nothing across the process
    group: every rank validates the whole dict (every parameter, key, full shape, the step
    and the param groups' values), the ranks agree on the verdict (:func:`mpzero.comm.agree`), and
    only then is anything changed. When any rank refuses, every rank raises the same
    ``ValueError`` and no rank has changed its state. Collective over
    ``opt.groups.process``."""
    try:
        state, groups, group_keys = checks.normalized_state(opt, sd)
    except Exception as e:  # noqa: BLE001 - every refusal travels to the other ranks
        comm.agree(e, opt.groups.process, opt.options.device)
        raise  # unreachable: agree raised
    comm.agree(None, opt.groups.process, opt.options.device)
    checks.apply_groups(opt, groups, group_keys)
    with torch.no_grad():
        for b, lay in enumerate(opt.shards.layouts):
            targets = _load_targets(opt, b)
            for piece in lay.shard_pieces(opt.groups.distributed_rank):
                for k, dst in targets.items():
                    src = flat_like(state[piece.param][k], opt.shards.params[piece.param])[
                        piece.param_start:piece.param_end]
                    dst[piece.shard_start:piece.shard_end].copy_(src)
            _commit_targets(opt, b, targets, stale)
    opt.step_state.set_count(checks.check_step(state["step"]))


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
    for b, lay in enumerate(opt.shards.layouts):
        shards = _shard_tensors(opt, b)
        for pc in lay.shard_pieces(opt.groups.distributed_rank):
            pieces.append((pc.param, pc.param_start, pc.param_end,
                           {k: t[pc.shard_start:pc.shard_end].float().cpu().clone()
                            for k, t in shards.items()}))
    return {"format": FORMAT, "param_groups": _group_meta(opt), "step": opt.step_state.count(),
            "numels": {i: opt.shards.params[i].numel() for i in opt.shards.keys},
            "shapes": {i: tuple(opt.shards.params[i].shape) for i in opt.shards.keys},
            "pieces": pieces}


def load_sharded_state_dict(opt, sds: list[dict], stale) -> None:
    """Load from the sharded state dicts of every rank that wrote one (any grid). All or
    nothing across the process group, as :func:`load_state_dict`. Collective."""
    try:
        if not sds:
            raise ValueError("load_sharded_state_dict: no shards given")
        by_param: dict[int, list] = {}
        for n, sd in enumerate(sds):
            checks.check_sharded_meta(sd, f"load_sharded_state_dict: shard {n}")
            checks.index_pieces(opt, sd["pieces"], by_param, f"load_sharded_state_dict: shard {n}")
        checks.check_groups(opt, sds[0]["param_groups"])
        step = checks.check_step(sds[0]["step"], "the sharded state's 'step'")
        checks.check_pieces(opt, lambda i: by_param.get(i, []), sds[0].get("shapes"))
    except Exception as e:  # noqa: BLE001 - every refusal travels to the other ranks
        comm.agree(e, opt.groups.process, opt.options.device)
        raise
    comm.agree(None, opt.groups.process, opt.options.device)
    checks.apply_groups(opt, sds[0]["param_groups"])
    fill_from_pieces(opt, lambda i: by_param.get(i, []), stale)
    opt.step_state.set_count(step)


def fill_from_pieces(opt, pieces_of, stale) -> None:
    """Copy saved ``(start, end, tensors)`` pieces that overlap this rank's shards."""
    with torch.no_grad():
        for b, lay in enumerate(opt.shards.layouts):
            targets = _load_targets(opt, b)
            for pc in lay.shard_pieces(opt.groups.distributed_rank):
                for start, end, tensors in pieces_of(pc.param):
                    lo, hi = max(start, pc.param_start), min(end, pc.param_end)
                    if lo >= hi:
                        continue
                    for k, dst in targets.items():
                        src = tensors[k][lo - start:hi - start]
                        s0 = pc.shard_start + lo - pc.param_start
                        dst[s0:s0 + hi - lo].copy_(src)
            _commit_targets(opt, b, targets, stale)
