"""Helpers that make mistakes made while porting a DDP + ``torch.optim.AdamW`` script
to :class:`~mpzero.optimizers.DistributedFusedAdam` fail (or warn) loudly, and the
small facts the optimizer reads from torch and ``parallel_state``.

Every function here is standalone: it takes plain values (a param-group dict, a
module, a process group) and has no state in the optimizer, so it is unit-tested
without one. See ``docs/migrating.md`` for the user-facing side.

- :func:`check_param_group_options`: param-group keys mpzero does not implement
  (:func:`register_param_group_key` accepts a user's own).
- :func:`warn_if_wrapped_in_ddp` / :func:`find_ddp`: a model given to the optimizer
  still wrapped in ``DistributedDataParallel``; :func:`raise_if_ddp_reduces`:
  one wrapped after the optimizer was built (checked at the first backward).
- :func:`tensor_parallel_rank`, :func:`global_rank_of_first`: read once at construction.

A collective API entered on only some ranks fails in bounded time through
:func:`mpzero.collective_check.check_collective_entry`.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable

import torch

from mpzero import comm
from mpzero.optimizers.options import OptionError
from mpzero.warn import user_stacklevel

__all__ = [
    "MigrationWarning",
    "DoubleReductionError",
    "ddp_reducing",
    "raise_if_ddp_reduces",
    "KNOWN_PARAM_GROUP_KEYS",
    "SCHEDULER_PARAM_GROUP_KEYS",
    "register_param_group_key",
    "check_param_group_options",
    "find_ddp",
    "warn_if_wrapped_in_ddp",
    "tensor_parallel_rank",
    "global_rank_of_first",
]


class MigrationWarning(UserWarning):
    """A pattern from DDP + ``torch.optim`` that is slow or wrong with mpzero
    (filter it with ``warnings.filterwarnings("ignore", category=MigrationWarning)``)."""


# ---------------------------------------------------------------------- param groups
#: Hyperparameters mpzero reads from each param group (SPEC §2).
OPTIMIZER_PARAM_GROUP_KEYS = frozenset(
    {"params", "lr", "betas", "eps", "weight_decay", "bias_correction"})

#: Keys that ``torch.optim.lr_scheduler`` / ``swa_utils`` write into param groups
#: (torch 2.13): every ``LRScheduler`` sets ``initial_lr``; ``OneCycleLR`` sets
#: ``max_lr``/``min_lr``; ``CyclicLR``/``OneCycleLR`` with ``cycle_momentum`` set
#: ``max_momentum``/``base_momentum`` (and cycle ``betas[0]``, since mpzero has
#: ``betas``); ``SWALR`` sets ``swa_lr``. They are read by the scheduler only.
SCHEDULER_PARAM_GROUP_KEYS = frozenset(
    {"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"})

#: Annotations that change nothing in the update: ``param_names`` (torch >= 2.6 keeps
#: the names given as ``named_parameters()``) and ``name`` (a common user label).
ANNOTATION_PARAM_GROUP_KEYS = frozenset({"param_names", "name"})

KNOWN_PARAM_GROUP_KEYS = (OPTIMIZER_PARAM_GROUP_KEYS | SCHEDULER_PARAM_GROUP_KEYS
                          | ANNOTATION_PARAM_GROUP_KEYS)

# Keys of torch's Adam/AdamW groups that mpzero does not implement, the value at which
# they are harmless (torch's default), and what to do instead.
_TORCH_ONLY_KEYS: dict[str, tuple[tuple, str]] = {
    "maximize": ((False,), "mpzero always minimizes: negate the loss instead "
                           "(loss = -objective) and drop maximize"),
    "amsgrad": ((False,), "mpzero does not implement the AMSGrad variant; use "
                          "torch.optim.AdamW(amsgrad=True) or drop amsgrad"),
    "foreach": ((None, False), "it selects torch's multi-tensor implementation; mpzero "
                               "always runs its own fused kernel, so drop foreach"),
    "fused": ((None, False), "it selects torch's fused implementation; mpzero always runs "
                             "its own fused kernel, so drop fused"),
    "differentiable": ((False,), "mpzero's step is not differentiable (no autograd "
                                 "through the update); drop differentiable"),
    "capturable": ((False,), "CUDA-graph capture is an optimizer-wide option in mpzero: "
                             "pass DistributedFusedAdam(capturable=True) and drop the "
                             "group key"),
}

_EXTRA_KEYS: set[str] = set()


def register_param_group_key(*keys: str) -> None:
    """Accept more param-group keys, for your own code that reads them (e.g. a custom
    LR scheduler's ``"lr_mult"``). mpzero itself ignores them."""
    for k in keys:
        if not isinstance(k, str):
            raise TypeError(f"register_param_group_key: keys are strings, got {k!r}")
        _EXTRA_KEYS.add(k)


def _is_value(value, allowed: tuple) -> bool:
    return any(value is a or (a is not None and type(value) is type(a) and value == a)
               for a in allowed)


def check_param_group_options(group: dict, index: int, *, adam_w_mode: bool | None = None,
                              extra_keys: Iterable[str] = ()) -> None:
    """Raise :class:`~mpzero.optimizers.OptionError` (a ``ValueError``) for a
    param-group key that mpzero would silently ignore.

    Accepted: ``params, lr, betas, eps, weight_decay, bias_correction``, the keys LR
    schedulers add (:data:`SCHEDULER_PARAM_GROUP_KEYS`), ``param_names``/``name``,
    keys given to :func:`register_param_group_key` or ``extra_keys``, and torch's
    ``maximize``/``amsgrad``/``foreach``/``fused``/``differentiable``/``capturable``
    at their harmless defaults (``False``, or ``None`` for ``foreach``/``fused``).
    ``decoupled_weight_decay`` (torch's Adam/AdamW key) is accepted when it equals
    ``adam_w_mode`` (the optimizer-wide choice); with ``adam_w_mode=None`` it is
    accepted as any bool. Anything else (a typo such as ``"weight_dacay"``, another
    optimizer's ``"momentum"``) fails at once, naming the group and the key.

    Where to call it (``DistributedFusedAdam``):

    - ``__init__``: right after ``super().__init__(params, defaults)``,
      ``for gi, g in enumerate(self.param_groups): check_param_group_options(g, gi,
      adam_w_mode=adam_w_mode)`` (before any hook is registered, so a failed
      construction leaves nothing behind);
    - ``add_param_group`` (the branch after construction), before
      ``super().add_param_group(param_group)``:
      ``check_param_group_options(param_group, len(self.param_groups),
      adam_w_mode=self.adam_w_mode)``;
    - ``load_state_dict``: on each ``state_dict["param_groups"][i]`` of a format-2
      dict; torch-format dicts go through :func:`torch_param_group_to_mpzero` first.
    """
    if not isinstance(group, dict):
        raise TypeError(f"param group {index}: expected a dict, got {type(group).__name__}")
    where = f"param group {index}"
    extra = set(extra_keys)
    for key, value in group.items():
        if key in KNOWN_PARAM_GROUP_KEYS or key in _EXTRA_KEYS or key in extra:
            continue
        if key in _TORCH_ONLY_KEYS:
            harmless, advice = _TORCH_ONLY_KEYS[key]
            if _is_value(value, harmless):
                continue
            raise OptionError(f"{where}: {key}={value!r} is not supported by "
                              f"DistributedFusedAdam: {advice}")
        if key == "decoupled_weight_decay":
            if not isinstance(value, bool):
                raise OptionError(f"{where}: decoupled_weight_decay={value!r} must be a bool")
            if adam_w_mode is None or value == adam_w_mode:
                continue
            raise OptionError(
                f"{where}: decoupled_weight_decay={value} but the optimizer has "
                f"adam_w_mode={adam_w_mode}; in mpzero the weight-decay mode is "
                f"optimizer-wide: pass DistributedFusedAdam(adam_w_mode={value}) "
                "(True = AdamW, False = Adam with L2) and drop the group key")
        raise OptionError(
            f"{where}: unknown key {key!r}; DistributedFusedAdam reads only "
            f"{sorted(OPTIMIZER_PARAM_GROUP_KEYS - {'params'})} (plus LR-scheduler keys "
            f"{sorted(SCHEDULER_PARAM_GROUP_KEYS)}), so this key would be silently ignored. "
            "Fix the spelling, or, if your own code reads it, call "
            f"mpzero.torch_compat.register_param_group_key({key!r})")


# ---------------------------------------------------------------------- DDP
_DDP_WARNED: weakref.WeakSet = weakref.WeakSet()

_DDP_ADVICE = (
    "DistributedFusedAdam synchronizes gradients itself (reduce-scatter per bucket), so "
    "DistributedDataParallel around the model all-reduces every gradient a second "
    "time: about twice the gradient traffic plus DDP's own buckets, for nothing. "
    "Remove the wrapper: build the bare model, pass it as DistributedFusedAdam(..., "
    "module=model), call model(...) directly and use optimizer.no_sync() where you "
    "used ddp.no_sync(). Initial parameters need no broadcast either: the optimizer "
    "broadcasts them from the first rank when it lays out its buckets. "
    "See docs/migrating.md.")


def find_ddp(module) -> torch.nn.parallel.DistributedDataParallel | None:
    """The first ``DistributedDataParallel`` in ``module.modules()`` (``module`` itself
    or any submodule), else ``None``.

    Parameters alone cannot tell: DDP keeps no Python-visible mark on them (its
    reducer's autograd hooks live in C++), so the check needs the module."""
    if not isinstance(module, torch.nn.Module):
        return None
    ddp_cls = torch.nn.parallel.DistributedDataParallel
    for m in module.modules():
        if isinstance(m, ddp_cls):
            return m
    return None


class DoubleReductionError(RuntimeError):
    """A ``DistributedDataParallel`` reduces the gradients this optimizer reduces too."""


def ddp_reducing(params) -> torch.nn.parallel.DistributedDataParallel | None:
    """A live ``DistributedDataParallel`` that reduces any of ``params``, else ``None``.

    DDP keeps no Python-visible mark on the parameters it reduces (its reducer's hooks
    live in C++), and a model wrapped after the optimizer was built (``model =
    DDP(model)``, nanoGPT's order) is never handed to the optimizer. So this looks at
    every live DDP module once (one pass over the garbage collector's objects): call
    it once, at the first backward pass (``DistributedFusedAdam`` does)."""
    import gc

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None  # DDP needs a process group: none can exist
    ids = {id(p) for p in params}
    ddp_cls = torch.nn.parallel.DistributedDataParallel
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance on a dead weakref proxy raises.
        if issubclass(type(obj), ddp_cls):
            reduced = getattr(obj, "_module_parameters", None)
            if reduced is None:
                reduced = list(obj.module.parameters())
            if any(id(p) in ids for p in reduced):
                return obj
    return None


def raise_if_ddp_reduces(params) -> None:
    """Raise :class:`DoubleReductionError` when a ``DistributedDataParallel`` reduces any
    of ``params`` (see :func:`ddp_reducing`); called by ``DistributedFusedAdam`` at the
    first backward pass, so both reductions cannot run unnoticed."""
    ddp = ddp_reducing(params)
    if ddp is not None:
        raise DoubleReductionError(
            "a torch.nn.parallel.DistributedDataParallel wraps a model whose parameters this "
            "DistributedFusedAdam optimizes, so every gradient would be reduced twice (DDP's "
            "all-reduce, then the optimizer's reduce-scatter). Remove the line that wraps the "
            "model, e.g. `model = DDP(model, ...)`, and call the bare model. " + _DDP_ADVICE)


def warn_if_wrapped_in_ddp(module) -> bool:
    """Warn once per DDP instance (:class:`MigrationWarning`) when ``module`` is, or
    contains, a ``DistributedDataParallel`` (``attach`` calls it); return whether it does.
    Hooks on its submodules still fire through DDP, so attaching goes on."""
    ddp = find_ddp(module)
    if ddp is None:
        return False
    if ddp not in _DDP_WARNED:
        _DDP_WARNED.add(ddp)
        what = ("the module" if ddp is module else
                "a submodule of the module") + " given to DistributedFusedAdam"
        warnings.warn(f"{what} is a torch.nn.parallel.DistributedDataParallel. "
                      + _DDP_ADVICE, MigrationWarning, stacklevel=user_stacklevel())
    return True


# ---------------------------------------------------------------------- process groups
def tensor_parallel_rank(model_parallel_group) -> int:
    """TP rank used to count TP-replicated params once in the grad norm.

    With ``parallel_state`` initialized: its TP rank (so a TP x PP model-parallel group
    counts each TP-replicated parameter once per pipeline stage). Without it the
    model-parallel group is taken as pipeline stages (no tensor parallelism): every
    rank counts all of its parameters."""
    if model_parallel_group is None:
        return 0
    from mpzero import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return 0


def global_rank_of_first(group) -> int:
    """Global rank of ``group``'s first rank (0 without torch.distributed)."""
    import torch.distributed as dist

    if group is None or group is comm.SELF or not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_global_rank(group, 0)
