"""Checks of saved optimizer state, made before anything is changed: a state dict (format
2, torch Adam/AdamW, or sharded pieces) either fits the optimizer completely or is
refused with a ``ValueError`` naming the key, parameter or value."""

from __future__ import annotations

import math

import torch

FORMAT = 2
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


def check_groups(opt, groups) -> None:
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
        check_group_values(gi, saved)


def is_number(v) -> bool:
    if isinstance(v, torch.Tensor):  # a capturable optimizer's lr may be a tensor
        return (v.numel() == 1 and not v.is_meta and not v.dtype.is_complex
                and v.dtype != torch.bool)
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_group_values(gi: int, saved: dict) -> None:
    """The hyperparameters the step reads are finite numbers of the right kind, so that
    applying them cannot fail (or poison the next step) half-way through a load."""
    for key in ("lr", "eps", "weight_decay"):
        if key in saved:
            v = saved[key]
            if not is_number(v) or not math.isfinite(float(v)) or float(v) < 0:
                raise ValueError(f"load_state_dict: param group {gi} has {key}={v!r}; "
                                 "expected a finite number >= 0")
    if "betas" in saved:
        betas = saved["betas"]
        if (not isinstance(betas, (list, tuple)) or len(betas) != 2
                or not all(is_number(b) and 0.0 <= float(b) < 1.0 for b in betas)):
            raise ValueError(f"load_state_dict: param group {gi} has betas {betas!r}; "
                             "expected two numbers in [0, 1)")
    if "bias_correction" in saved and not isinstance(saved["bias_correction"], (bool, int)):
        raise ValueError(f"load_state_dict: param group {gi} has bias_correction="
                         f"{saved['bias_correction']!r}")


def check_step(step, where: str = "state['step']") -> int:
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


def apply_groups(opt, groups, keys=None) -> None:
    for saved, group in zip(groups, opt.param_groups):
        for k, v in saved.items():
            if k != "params" and (keys is None or k in keys):
                group[k] = tuple(v) if k == "betas" else v


def is_torch_adam(sd: dict) -> bool:
    """A ``torch.optim.Adam``/``AdamW`` state dict: per-param states without ``"param"``."""
    if "format" in sd or not isinstance(sd.get("state"), dict):
        return False
    states = [v for v in sd["state"].values() if isinstance(v, dict)]
    return bool(states) and all(
        {"exp_avg", "exp_avg_sq", "step"} <= set(v) and "param" not in v for v in states)


def check_tensor(opt, i: int, key: str, t) -> None:
    p = opt.shards.params[i]
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"load_state_dict: state[{i}][{key!r}] is a {type(t).__name__}, "
                         "not a tensor")
    if tuple(t.shape) != tuple(p.shape):
        raise ValueError(f"load_state_dict: state[{i}][{key!r}] has shape {tuple(t.shape)}, "
                         f"parameter {i} has shape {tuple(p.shape)}")
    check_data(t, f"state[{i}][{key!r}]")


def check_data(t: torch.Tensor, where: str) -> None:
    """A tensor whose values can be copied: floating point, dense, with storage."""
    if not t.is_floating_point():
        raise ValueError(f"load_state_dict: {where} has dtype {t.dtype}")
    if t.is_meta:
        raise ValueError(f"load_state_dict: {where} is a meta tensor (shape only, no values)")
    if t.layout != torch.strided:
        raise ValueError(f"load_state_dict: {where} has layout {t.layout}, not dense")


def trained(opt) -> list[int]:
    """Indices of the parameters that have optimizer state, known before the layout is
    made (a collective), so a state dict can be checked before anything communicates."""
    return opt.shards.trained()


def normalized_state(opt, sd: dict) -> tuple[dict, list[dict], set | None]:
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
    if is_torch_adam(sd):
        return from_torch(opt, sd)
    groups, state = sd["param_groups"], sd["state"]
    check_groups(opt, groups)
    if not isinstance(state, dict):
        raise ValueError("load_state_dict: 'state' must be a dict")
    if "step" not in state:
        raise ValueError("load_state_dict: state has no 'step' (the step count)")
    check_step(state["step"])
    keys = trained(opt)
    for i in keys:
        if i in state and not isinstance(state[i], dict):
            raise ValueError(f"load_state_dict: state[{i}] is a {type(state[i]).__name__}, "
                             "not a dict")
    for i in keys:
        if i not in state:
            raise ValueError(f"load_state_dict: no state for parameter {i} "
                             f"(shape {tuple(opt.shards.params[i].shape)})")
        for k in STATE_KEYS:
            if k not in state[i]:
                raise ValueError(f"load_state_dict: state[{i}] has no {k!r} "
                                 f"(keys: {sorted(map(str, state[i]))})")
            check_tensor(opt, i, k, state[i][k])
    extra = [i for i in state if i != "step" and i not in keys]
    if extra:
        raise ValueError(f"load_state_dict: state for parameters {extra[:8]} that this "
                         "optimizer does not train (no such index, or requires_grad=False)")
    return state, groups, None


def from_torch(opt, sd: dict) -> tuple[dict, list[dict], set]:
    """A torch Adam/AdamW state dict as format-2 state; masters are the current params."""
    groups, tstate = sd["param_groups"], sd["state"]
    check_groups(opt, groups)
    for gi, group in enumerate(groups):
        if group.get("amsgrad"):
            raise ValueError(f"load_state_dict: torch param group {gi} uses amsgrad, "
                             "which DistributedFusedAdam does not support")
        decoupled = group.get("decoupled_weight_decay")
        if decoupled is not None and group.get("weight_decay", 0.0) and \
                bool(decoupled) != bool(opt.options.adam_w_mode):
            raise ValueError(
                f"load_state_dict: torch param group {gi} has decoupled_weight_decay="
                f"{decoupled}, this optimizer adam_w_mode={opt.options.adam_w_mode}")
    steps = set()
    state: dict = {}
    keys = trained(opt)
    for i in keys:
        p = opt.shards.params[i]
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
                check_tensor(opt, i, k, saved[k])
            state[i] = {k: saved[k] for k in ("exp_avg", "exp_avg_sq")}
            steps.add(check_step(saved["step"], f"torch state[{i}]['step']"))
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


def check_sharded_meta(sd, where: str) -> None:
    if not isinstance(sd, dict):
        raise ValueError(f"{where}: expected a sharded state dict, got {type(sd).__name__}")
    if sd.get("format", FORMAT) != FORMAT:
        raise ValueError(f"{where}: expected format {FORMAT}, got {sd.get('format')!r}")
    for key in ("param_groups", "step", "pieces"):
        if key not in sd:
            raise ValueError(f"{where}: no {key!r}")
    if not isinstance(sd["pieces"], (list, tuple)):
        raise ValueError(f"{where}: 'pieces' must be a list")


def index_pieces(opt, pieces, by_param: dict, where: str, keep=None) -> None:
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
        if param not in opt.shards.keys:
            raise ValueError(f"{where}: piece {n} is for parameter {param}, which this "
                             "optimizer does not train")
        if not 0 <= start < end <= opt.shards.params[param].numel():
            raise ValueError(f"{where}: piece {n} covers [{start}, {end}) of parameter "
                             f"{param}, which has {opt.shards.params[param].numel()} elements")
        if not isinstance(tensors, dict):
            raise ValueError(f"{where}: piece {n} holds a {type(tensors).__name__}, not a "
                             "dict of tensors")
        if keep is None or keep(param, start, end):
            by_param.setdefault(param, []).append((start, end, tensors))


def check_pieces(opt, pieces_of, shapes: dict | None) -> None:
    """Raise (touching nothing) unless the saved pieces cover every element of this rank's
    shards, with every key, and the saved full shapes match the parameters."""
    for i in opt.shards.keys:
        saved = (shapes or {}).get(i)
        if saved is not None and tuple(saved) != tuple(opt.shards.params[i].shape):
            raise ValueError(f"sharded checkpoint: parameter {i} was saved with shape "
                             f"{tuple(saved)}, this parameter has "
                             f"{tuple(opt.shards.params[i].shape)}")
    for lay in opt.shards.layouts:
        for pc in lay.shard_pieces(opt.groups.distributed_rank):
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
                    check_data(t, f"sharded checkpoint: parameter {pc.param} piece "
                                   f"[{start}, {end}) {k!r}")
                covered += hi - lo
            if covered < pc.numel:
                raise ValueError(f"sharded checkpoint does not cover parameter {pc.param} "
                                 f"elements [{pc.param_start}, {pc.param_end})")


