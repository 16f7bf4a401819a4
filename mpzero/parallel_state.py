"""Process-group grid of a training job (Megatron-core names).

A job of ``world = tp * cp * dp * pp`` ranks is a 4-D grid. The ``order``
string names the axes from fastest to slowest: with ``"tp-cp-dp-pp"``,
``rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))``. A group
along a set of axes holds the ranks that differ only in those axes.

Inside the data-parallel group (with the context-parallel ranks folded in,
size ``dp * cp``) the optimizer grid is built: ``distributed`` groups (the ranks
one optimizer shard is spread over: contiguous chunks of the DP rank list, or
the DP ranks of one node) and ``redundant`` groups (ranks holding the same
shard, strided). ``distributed_size * redundant_size == dp * cp``.

Everything that can be computed without processes is a pure function here
(:class:`ParallelGrid`, :func:`optimizer_rank_groups`); the process groups are
built from those rank lists by :func:`initialize_model_parallel`.
"""

from __future__ import annotations

import datetime
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

AXES = ("tp", "cp", "dp", "pp")
DEFAULT_ORDER = "tp-cp-dp-pp"


def parse_order(order: str, sizes: dict[str, int] | None = None) -> tuple[str, ...]:
    """Split an order string such as ``"tp-cp-dp-pp"`` into axes, validating it.

    With ``sizes`` (axis -> size), axes of size 1 may be left out (as Megatron allows):
    they are appended, where their position changes no rank.
    """
    if not isinstance(order, str):
        raise TypeError(f"order must be a string like {DEFAULT_ORDER!r}, got {order!r}")
    axes = tuple(a.strip().lower() for a in order.split("-"))
    unknown = [a for a in axes if a not in AXES]
    if unknown or len(set(axes)) != len(axes):
        raise ValueError(
            f"order={order!r} must name axes among {', '.join(AXES)}, each at most once, "
            f"separated by '-' (e.g. {DEFAULT_ORDER!r})"
            + (f"; unknown: {', '.join(unknown)}" if unknown else "")
        )
    missing = [a for a in AXES if a not in axes]
    needed = [a for a in missing if sizes is None or sizes.get(a, 1) != 1]
    if needed:
        raise ValueError(
            f"order={order!r} leaves out {', '.join(needed)}"
            + (f" (size {', '.join(str(sizes[a]) for a in needed)})" if sizes else "")
            + f": name every axis whose size is not 1 (e.g. {DEFAULT_ORDER!r})"
        )
    return axes + tuple(missing)


@dataclass(frozen=True)
class ParallelGrid:
    """The rank grid of a job: sizes per axis and their order. Pure, no processes."""

    world_size: int
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    order: str = DEFAULT_ORDER
    axes: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("world_size", *AXES):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "axes", parse_order(self.order, {a: getattr(self, a)
                                                                  for a in AXES}))
        if self.tp * self.cp * self.dp * self.pp != self.world_size:
            raise ValueError(
                f"world_size ({self.world_size}) must equal tensor_model_parallel_size ({self.tp})"
                f" * context_parallel_size ({self.cp}) * data_parallel_size ({self.dp})"
                f" * pipeline_model_parallel_size ({self.pp})"
            )

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, cp: int = 1, pp: int = 1,
                   order: str = DEFAULT_ORDER) -> ParallelGrid:
        """Derive ``dp`` from the world size; error when tp*cp*pp does not divide it."""
        for name, value in (("tensor_model_parallel_size", tp), ("context_parallel_size", cp),
                            ("pipeline_model_parallel_size", pp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        model = tp * cp * pp
        if world_size % model != 0:
            raise ValueError(
                f"world_size ({world_size}) is not divisible by tensor_model_parallel_size ({tp})"
                f" * context_parallel_size ({cp}) * pipeline_model_parallel_size ({pp})"
                f" = {model}"
            )
        return cls(world_size, tp=tp, cp=cp, dp=world_size // model, pp=pp, order=order)

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` along each axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")
        out = {}
        for axis in self.axes:
            out[axis] = rank % self.size(axis)
            rank //= self.size(axis)
        return out

    def rank_of(self, coords: dict[str, int]) -> int:
        """Inverse of :meth:`coords`."""
        rank, stride = 0, 1
        for axis in self.axes:
            rank += coords[axis] * stride
            stride *= self.size(axis)
        return rank

    def groups(self, varying: str | Sequence[str]) -> list[list[int]]:
        """Rank groups along ``varying`` axes (e.g. ``"tp"``, ``"dp-cp"``, ``("tp", "pp")``).

        Each group holds the ranks that differ only in the varying axes; the groups
        partition the world. Ranks inside a group are ordered with the varying axes
        in grid order (leftmost fastest); groups are ordered by their fixed coordinates.
        """
        names = varying.split("-") if isinstance(varying, str) else list(varying)
        for name in names:
            if name not in AXES:
                raise ValueError(f"unknown parallel axis {name!r}; expected one of {AXES}")
        vary = [a for a in self.axes if a in names]
        fixed = [a for a in self.axes if a not in names]
        groups = []
        # itertools.product varies its last factor fastest: reverse so the leftmost axis is.
        for fixed_vals in itertools.product(*(range(self.size(a)) for a in reversed(fixed))):
            base = dict(zip(reversed(fixed), fixed_vals))
            members = []
            for vary_vals in itertools.product(*(range(self.size(a)) for a in reversed(vary))):
                coords = {**base, **dict(zip(reversed(vary), vary_vals))}
                members.append(self.rank_of(coords))
            groups.append(members)
        return groups

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each pipeline group (one rank when pp == 1)."""
        out = []
        for ranks in self.groups("pp"):
            out.append([ranks[0]] if len(ranks) == 1 else [ranks[0], ranks[-1]])
        return out

    def position_embedding_groups(self) -> list[list[int]]:
        """First pipeline stage of each pipeline group."""
        return [[ranks[0]] for ranks in self.groups("pp")]


def optimizer_rank_groups(
    dp_groups: Sequence[Sequence[int]],
    distributed_size: int | None = None,
    *,
    local_world_size: int | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """Split each data-parallel rank list into distributed (shard) and redundant groups.

    Returns ``(distributed_groups, redundant_groups)``. Without ``local_world_size``,
    distributed groups are contiguous chunks of ``distributed_size`` ranks of each DP
    list and redundant groups take every ``distributed_size``-th rank. With
    ``local_world_size`` (``distribute_within_nodes``), a distributed group is the DP
    ranks on one node (node = global rank // local_world_size); nodes must hold equally
    many ranks of each DP list, and ``distributed_size``, if given, must match that.
    """
    dist_groups: list[list[int]] = []
    red_groups: list[list[int]] = []
    for ranks in dp_groups:
        ranks = list(ranks)
        n = len(ranks)
        if local_world_size is not None:
            if local_world_size < 1:
                raise ValueError(f"local world size must be positive, got {local_world_size}")
            by_node: dict[int, list[int]] = {}
            for r in ranks:
                by_node.setdefault(r // local_world_size, []).append(r)
            chunks = list(by_node.values())
            sizes = {len(c) for c in chunks}
            if len(sizes) != 1:
                raise ValueError(
                    "distribute_within_nodes=True needs the same number of data-parallel ranks "
                    f"on every node; data-parallel group {ranks} has {sorted(sizes)} per node "
                    f"(LOCAL_WORLD_SIZE={local_world_size})"
                )
            d = sizes.pop()
            if distributed_size is not None and distributed_size != d:
                raise ValueError(
                    f"distributed_optimizer_size={distributed_size} conflicts with "
                    f"distribute_within_nodes=True, which gives {d} data-parallel ranks per node"
                )
        else:
            d = n if distributed_size is None else distributed_size
            if not isinstance(d, int) or isinstance(d, bool) or d < 1 or n % d != 0:
                raise ValueError(
                    f"distributed_optimizer_size={distributed_size!r} must be a positive divisor "
                    f"of the data-parallel size (data_parallel_size * context_parallel_size = {n})"
                )
            chunks = [ranks[i : i + d] for i in range(0, n, d)]
        dist_groups.extend(chunks)
        red_groups.extend([c[j] for c in chunks] for j in range(d))
    return dist_groups, red_groups


# --------------------------------------------------------------------------------------
# Process groups


@dataclass
class _State:
    grid: ParallelGrid
    rank: int
    groups: dict[str, dist.ProcessGroup]
    ranks: dict[str, list[int]]
    created: list[dist.ProcessGroup]
    virtual_pp_size: int | None = None
    virtual_pp_rank: int | None = None


_STATE: _State | None = None


def _state() -> _State:
    if _STATE is None:
        raise RuntimeError(
            "mpzero.parallel_state is not initialized: call "
            "parallel_state.initialize_model_parallel(...) after "
            "torch.distributed.init_process_group"
        )
    return _STATE


def model_parallel_is_initialized() -> bool:
    """Whether :func:`initialize_model_parallel` has run (and not been destroyed)."""
    return _STATE is not None


def _as_timedelta(timeout) -> datetime.timedelta | None:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        if timeout.total_seconds() > 0:
            return timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return datetime.timedelta(seconds=timeout)
    raise ValueError(f"timeout must be a datetime.timedelta or positive seconds, got {timeout!r}")


def get_process_group_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta | None:
    """The timeout of ``group``'s collectives (default: the default/world group), or None
    when the backend does not expose it.

    torch keeps the timeout in each backend's options (``ProcessGroupGloo`` and
    ``ProcessGroupNCCL`` alike); a group made by ``new_group`` without ``timeout=`` gets
    torch's default (30 min on gloo, 10 min on NCCL), not the world group's.
    """
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    for device_type in ("cuda", "cpu"):
        try:
            backend = group._get_backend(torch.device(device_type))
            timeout = backend.options._timeout
        except (RuntimeError, AttributeError, ValueError):
            continue  # no backend for this device type, or one without options
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    distributed_optimizer_size: int | None = None,
    distribute_within_nodes: bool = False,
    order: str = DEFAULT_ORDER,
    backend: str | None = None,
    timeout=None,
) -> None:
    """Build every process group of the grid. Every rank must call it with the same args.

    ``distributed_optimizer_size`` is the size of each optimizer shard group (``None``:
    the whole data-parallel group, i.e. no redundancy). ``distribute_within_nodes``
    makes each shard group the data-parallel ranks of one node (``LOCAL_WORLD_SIZE``).
    ``backend`` defaults to the default group's. ``timeout`` (a timedelta or seconds) is
    how long a collective on any of these groups may wait for the other ranks before it
    fails; ``None``: the default group's timeout (``init_process_group(timeout=...)``), so
    a rank that stops answering makes the others fail after that time in every group.
    """
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel needs torch.distributed.init_process_group to have run"
        )
    if _STATE is not None:
        raise RuntimeError(
            "model parallel is already initialized; call destroy_model_parallel() first"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = ParallelGrid.from_world(
        world, tp=tensor_model_parallel_size, cp=context_parallel_size,
        pp=pipeline_model_parallel_size, order=order,
    )
    if virtual_pipeline_model_parallel_size is not None:
        if not isinstance(virtual_pipeline_model_parallel_size, int) or (
            virtual_pipeline_model_parallel_size < 1
        ):
            raise ValueError(
                "virtual_pipeline_model_parallel_size must be a positive integer or None, "
                f"got {virtual_pipeline_model_parallel_size!r}"
            )
        if pipeline_model_parallel_size < 2:
            raise ValueError(
                "virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1, "
                f"got {pipeline_model_parallel_size}"
            )
    local_ws = None
    if distribute_within_nodes:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise ValueError(
                "distribute_within_nodes=True needs LOCAL_WORLD_SIZE in the environment"
            )
        local_ws = int(env)
    kinds = {
        "tp": grid.groups("tp"), "pp": grid.groups("pp"), "cp": grid.groups("cp"),
        "dp": grid.groups("dp"), "dp-cp": grid.groups("dp-cp"), "tp-pp": grid.groups("tp-pp"),
        "tp-cp": grid.groups("tp-cp"), "embd": grid.embedding_groups(),
        "pos-embd": grid.position_embedding_groups(),
    }
    kinds["dist-opt"], kinds["red-opt"] = optimizer_rank_groups(
        kinds["dp-cp"], distributed_optimizer_size, local_world_size=local_ws
    )
    pg_kwargs = {"backend": backend}
    # Every group carries a timeout: the one given, else the default group's. Without it
    # torch would give each new group its own default (30 min on gloo, 10 on NCCL), and a
    # rank that hangs would stall the others' gradient reduce-scatter that long, whatever
    # timeout the world group was made with.
    td = _as_timedelta(timeout)
    if td is None:
        td = get_process_group_timeout()
    if td is not None:
        pg_kwargs["timeout"] = td
    groups, ranks, created = {}, {}, []
    # Every rank creates every group, in the same order, as new_group requires.
    for kind, rank_lists in kinds.items():
        for members in rank_lists:
            pg = dist.new_group(members, **pg_kwargs)
            if rank in members:
                groups[kind], ranks[kind] = pg, list(members)
                created.append(pg)
            elif pg is not None and pg != dist.GroupMember.NON_GROUP_MEMBER:
                created.append(pg)
    _STATE = _State(grid=grid, rank=rank, groups=groups, ranks=ranks, created=created,
                    virtual_pp_size=virtual_pipeline_model_parallel_size,
                    virtual_pp_rank=0 if virtual_pipeline_model_parallel_size else None)


def destroy_model_parallel() -> None:
    """Destroy every process group :func:`initialize_model_parallel` created (a no-op if none)."""
    global _STATE
    if _STATE is None:
        return
    state, _STATE = _STATE, None
    if dist.is_initialized():
        for pg in state.created:
            dist.destroy_process_group(pg)


# --------------------------------------------------------------------------------------
# Getters


_GROUP_NAMES = {"embd": "embedding group (first and last pipeline stages)",
                "pos-embd": "position embedding group (first pipeline stage)"}


def _group(kind: str) -> dist.ProcessGroup:
    groups = _state().groups
    if kind not in groups:
        raise RuntimeError(f"this rank (pipeline stage {get_pipeline_model_parallel_rank()}) "
                           f"is not in the {_GROUP_NAMES.get(kind, kind)}")
    return groups[kind]


def _ranks(kind: str) -> list[int]:
    return _state().ranks[kind]


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    return _group("tp")


def get_pipeline_model_parallel_group() -> dist.ProcessGroup:
    return _group("pp")


def get_context_parallel_group() -> dist.ProcessGroup:
    return _group("cp")


def get_data_parallel_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    return _group("dp-cp" if with_context_parallel else "dp")


def get_model_parallel_group() -> dist.ProcessGroup:
    """Tensor × pipeline group (the ranks holding one model replica)."""
    return _group("tp-pp")


def get_tensor_and_context_parallel_group() -> dist.ProcessGroup:
    return _group("tp-cp")


def get_embedding_group() -> dist.ProcessGroup:
    """First and last pipeline stages (they share the tied word embeddings)."""
    return _group("embd")


def get_position_embedding_group() -> dist.ProcessGroup:
    return _group("pos-embd")


def get_distributed_optimizer_group() -> dist.ProcessGroup:
    """The ranks this rank's optimizer shards are spread over."""
    return _group("dist-opt")


def get_redundant_optimizer_group() -> dist.ProcessGroup:
    """The ranks holding the same optimizer shard as this rank."""
    return _group("red-opt")


def get_optimizer_process_groups() -> dict[str, dist.ProcessGroup]:
    """Keyword arguments wiring :class:`DistributedFusedAdam` to this grid."""
    return {
        "process_group": get_data_parallel_group(with_context_parallel=True),
        "distributed_process_group": get_distributed_optimizer_group(),
        "redundant_process_group": get_redundant_optimizer_group(),
    }


def _world_size(kind: str) -> int:
    return len(_ranks(kind))


def _rank(kind: str) -> int:
    return _ranks(kind).index(_state().rank)


def get_tensor_model_parallel_world_size() -> int:
    return _world_size("tp")


def get_pipeline_model_parallel_world_size() -> int:
    return _world_size("pp")


def get_context_parallel_world_size() -> int:
    return _world_size("cp")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _world_size("dp-cp" if with_context_parallel else "dp")


def get_model_parallel_world_size() -> int:
    return _world_size("tp-pp")


def get_distributed_optimizer_world_size() -> int:
    return _world_size("dist-opt")


def get_redundant_optimizer_world_size() -> int:
    return _world_size("red-opt")


def get_tensor_model_parallel_rank() -> int:
    return _rank("tp")


def get_pipeline_model_parallel_rank() -> int:
    return _rank("pp")


def get_context_parallel_rank() -> int:
    return _rank("cp")


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _rank("dp-cp" if with_context_parallel else "dp")


def get_model_parallel_rank() -> int:
    return _rank("tp-pp")


def get_distributed_optimizer_rank() -> int:
    return _rank("dist-opt")


def get_redundant_optimizer_rank() -> int:
    return _rank("red-opt")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first member of this rank's tensor-parallel group."""
    return _ranks("tp")[0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the first member of this rank's data-parallel group."""
    return _ranks("dp-cp" if with_context_parallel else "dp")[0]


def get_tensor_model_parallel_ranks() -> list[int]:
    return list(_ranks("tp"))


def get_pipeline_model_parallel_ranks() -> list[int]:
    return list(_ranks("pp"))


def get_data_parallel_ranks(with_context_parallel: bool = False) -> list[int]:
    return list(_ranks("dp-cp" if with_context_parallel else "dp"))


def get_pipeline_model_parallel_first_rank() -> int:
    return _ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _ranks("pp")
    return ranks[(ranks.index(_state().rank) + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _ranks("pp")
    return ranks[(ranks.index(_state().rank) - 1) % len(ranks)]


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return _state().virtual_pp_size


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    return _state().virtual_pp_rank


def set_virtual_pipeline_model_parallel_rank(rank: int) -> None:
    state = _state()
    if state.virtual_pp_size is None:
        raise RuntimeError("virtual pipeline parallelism is not enabled")
    if not 0 <= rank < state.virtual_pp_size:
        raise ValueError(f"virtual pipeline rank {rank} out of range [0, {state.virtual_pp_size})")
    state.virtual_pp_rank = rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    state = _state()
    if not ignore_virtual and state.virtual_pp_size is not None and state.virtual_pp_rank != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    state = _state()
    if (not ignore_virtual and state.virtual_pp_size is not None
            and state.virtual_pp_rank != state.virtual_pp_size - 1):
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_grid() -> ParallelGrid:
    """The :class:`ParallelGrid` this job was initialized with."""
    return _state().grid
