"""DistributedFusedAdam's options, its process groups and its bucket keys: what is fixed
at construction, validated once, in one place, with messages that name the option."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist

from mpzero import comm

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Integer param-sync dtypes of every width, signed and unsigned (torch >= 2.3 has the
# wider unsigned ones): their bytes are what travels.
BYTE_SYNC_DTYPES = tuple(d for d in (getattr(torch, n, None) for n in (
    "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")) if d is not None)
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float64: "float64"}


class OptionError(ValueError, NotImplementedError):
    """A wrong (``ValueError``) or not-yet-supported (``NotImplementedError``) option."""


def _name(dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype))


def resolve_dtype(value, option: str, allowed) -> torch.dtype:
    if isinstance(value, str):
        value = getattr(torch, value, value)
    if value not in allowed:
        raise OptionError(
            f"{option}={value!r} is not supported; expected one of "
            f"{', '.join(_name(d) for d in allowed)}"
        )
    return value


def check_sync_dtypes(dtype: torch.dtype, grad_sync_dtype, param_sync_dtype,
                      prefix: str = "") -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """Resolve ``None`` to ``dtype`` and check the three dtypes of one bucket key."""
    dtype = resolve_dtype(dtype, f"{prefix}dtype", FLOAT_DTYPES)
    gsd = dtype if grad_sync_dtype is None else resolve_dtype(
        grad_sync_dtype, f"{prefix}grad_sync_dtype", FLOAT_DTYPES)
    psd = dtype if param_sync_dtype is None else resolve_dtype(
        param_sync_dtype, f"{prefix}param_sync_dtype", FLOAT_DTYPES + BYTE_SYNC_DTYPES)
    return dtype, gsd, psd


def is_byte_dtype(dtype: torch.dtype) -> bool:
    """Integer param-sync dtypes: the top bytes of each value are gathered."""
    return dtype in BYTE_SYNC_DTYPES


def check_options(o: dict) -> None:
    """Raise :class:`OptionError` naming the option for any invalid combination."""
    if o["amsgrad"]:
        raise OptionError("amsgrad=True: DistributedFusedAdam does not support the AMSGrad variant")
    betas = o["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(0.0 <= b < 1.0 for b in betas)):
        raise OptionError(f"betas={betas!r} must be two numbers in [0, 1)")
    if not float(o["eps"]) >= 0.0:
        raise OptionError(f"eps={o['eps']!r} must be non-negative")
    lr = o["lr"]
    if not isinstance(lr, torch.Tensor) and not float(lr) >= 0.0:
        raise OptionError(f"lr={lr!r} must be non-negative")
    if not float(o["weight_decay"]) >= 0.0:
        raise OptionError(f"weight_decay={o['weight_decay']!r} must be non-negative")
    if not (isinstance(o["pipeline_size"], int) and o["pipeline_size"] >= 1):
        raise OptionError(f"pipeline_size={o['pipeline_size']!r} must be a positive integer")
    if not float(o["bucket_cap_mb"]) > 0:
        raise OptionError(f"bucket_cap_mb={o['bucket_cap_mb']!r} must be positive")
    dtype, _, psd = check_sync_dtypes(o["dtype"], o["grad_sync_dtype"], o["param_sync_dtype"])
    device = o["device"]
    if o["store_param_remainders"]:
        if o["store_params"]:
            raise OptionError(
                "store_param_remainders=True requires store_params=False (the fp32 master is "
                "the bf16 parameter plus an int16 remainder)"
            )
        if dtype != torch.float32 or psd != torch.bfloat16:
            raise OptionError(
                "store_param_remainders=True requires dtype=torch.float32 and "
                f"param_sync_dtype=torch.bfloat16, got dtype={_name(dtype)}, "
                f"param_sync_dtype={_name(psd)}"
            )
    if o["with_scaled_states"]:
        if not (o["store_params"] or o["store_param_remainders"]):
            raise OptionError("with_scaled_states=True requires store_params=True (or "
                              "store_param_remainders=True: an exact master, bf16 moments)")
        # With remainders the dtype is fp32 (checked above) and the moments are bf16.
        if not o["store_param_remainders"] and dtype not in (torch.float16, torch.bfloat16):
            raise OptionError(
                f"with_scaled_states=True requires dtype float16 or bfloat16, got {_name(dtype)}"
            )
        if psd == torch.float32:
            raise OptionError("with_scaled_states=True requires a param_sync_dtype other than "
                              "float32")
    if o["capturable"] and o["store_param_remainders"]:
        raise OptionError("capturable=True cannot be combined with store_param_remainders=True")
    if o["capturable"] and o["with_scaled_states"]:
        raise OptionError("capturable=True cannot be combined with with_scaled_states=True")
    check_offload_options(o)
    if o["nccl_ub"]:
        if not o["contiguous_grad_buffer"]:
            raise OptionError("nccl_ub=True requires contiguous_grad_buffer=True")
        if device is not None and torch.device(device).type != "cuda":
            raise OptionError(f"nccl_ub=True requires a CUDA device, got device={device!r}")


def check_offload_options(o: dict) -> None:
    """The ``cpu_offload`` combinations that cannot work."""
    threads = o.get("cpu_offload_threads")
    if threads is not None:
        if not o.get("cpu_offload"):
            raise OptionError("cpu_offload_threads is given but cpu_offload=False")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise OptionError(f"cpu_offload_threads={threads!r} must be a positive integer")
    if o.get("cpu_offload") and o["capturable"]:
        # The CPU step reads the learning rate, the step and found-inf on the host: a
        # captured graph could not replay it.
        raise OptionError("capturable=True cannot be combined with cpu_offload=True")


@dataclasses.dataclass(frozen=True)
class Options:
    """Everything fixed at construction besides the parameters, the param groups'
    hyperparameters and the process groups (see :class:`Groups`). Made once by the
    constructor from its apex-compatible keywords and validated there."""

    adam_w_mode: bool = True
    """Decoupled weight decay (AdamW); ``False``: L2 regularization added to the gradient."""
    dtype: torch.dtype = torch.float32
    """The optimizer state's dtype (master parameters and moments)."""
    grad_sync_dtype: torch.dtype = torch.float32
    """The dtype gradients are reduced in (``None`` at the constructor: ``dtype``)."""
    param_sync_dtype: torch.dtype = torch.float32
    """The dtype updated parameters are gathered in; an integer dtype gathers raw bytes."""
    device: torch.device = torch.device("cpu")
    """Where the state lives (the parameters' device unless given)."""
    average_grad_sync: bool = True
    """Mean (``True``) or sum of the gradients over the process group."""
    overlap_grad_sync: bool = True
    """Reduce-scatter buckets during backward as soon as they are complete."""
    overlap_param_sync: bool = False
    """Gather each bucket just before the next forward uses it (module pre-hooks)."""
    bucket_cap_mb: float = 100.0
    """MiB of ``grad_sync_dtype`` per bucket."""
    pipeline_size: int = 2
    """Buckets whose collectives may be in flight at once (and CUDA side streams)."""
    contiguous_param_buffer: bool = False
    """Parameters are views of one buffer per bucket key; gathers write into them."""
    contiguous_grad_buffer: bool = False
    """Gradient buckets are views of one persistent buffer (``grad_buffer_view``)."""
    store_params: bool = True
    """Keep a master copy of the parameters in ``dtype``."""
    store_param_remainders: bool = False
    """bf16 parameters + int16 remainders stand for the fp32 master (bit-exact)."""
    with_scaled_states: bool = False
    """Master and moments in 16 bits (``dtype``) with one fp32 scale per fragment; with
    ``store_param_remainders`` the master stays exact (parameter + remainder) and only
    the moments are scaled, in bf16."""
    nccl_ub: bool = False
    """Gradient and shard buffers from the NCCL-registered memory pool."""
    capturable: bool = False
    """lr and step on the device, no host sync in ``step()`` (CUDA graphs)."""
    cpu_offload: bool = False
    """Optimizer state in host memory and the Adam update on the CPU (``offload.py``): each
    bucket's reduced gradient shard is staged device->host, stepped on the CPU and its
    updated values staged host->device before the usual gather, pipelined per bucket.
    On a CPU device the state is in host memory anyway: the same staged path runs with
    synchronous copies (no memory saved; for testing)."""
    cpu_offload_threads: int | None = None
    """Threads of the CPU step with ``cpu_offload`` (``None``: the physical cores of this
    rank's share of the host): the kernels' ``threads`` argument where they take one,
    else torch's thread count, set for the step only and restored after."""

    @classmethod
    def from_arguments(cls, arguments: dict) -> Options:
        """The options of the constructor's keyword ``arguments`` (checked first)."""
        check_options(arguments)
        dtype, gsd, psd = check_sync_dtypes(arguments["dtype"], arguments["grad_sync_dtype"],
                                            arguments["param_sync_dtype"])
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in arguments.items() if k in names}
        values.update(dtype=dtype, grad_sync_dtype=gsd, param_sync_dtype=psd,
                      bucket_cap_mb=float(arguments["bucket_cap_mb"]))
        return cls(**values)

    def items(self) -> list[tuple[str, object]]:
        """``(name, value)`` of every option, in declaration order."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]


OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(Options))


class BucketKey(NamedTuple):
    """The dtypes a bucket is keyed by: parameters with other dtypes go in other buckets."""

    state: torch.dtype  # master and moments
    grad: torch.dtype  # gradient reduce-scatter
    param: torch.dtype  # parameter all-gather (an integer dtype: raw top bytes)
    # Byte-level sync only: the parameters' own dtype, whose top bytes travel.
    param_dtype: torch.dtype | None = None

    @property
    def dtypes(self) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        """``(state, grad, param)``: the part ``init_params`` chooses."""
        return (self.state, self.grad, self.param)

    @property
    def byte_sync(self) -> bool:
        return is_byte_dtype(self.param)

    @property
    def allows_remainders(self) -> bool:
        """bf16 + int16 remainders need an fp32 state and bf16 parameter sync."""
        return (self.state == torch.float32 and self.param == torch.bfloat16
                and self.param_dtype is None)


@dataclasses.dataclass(frozen=True)
class Groups:
    """The optimizer's process groups and this rank's place in them."""

    process: dist.ProcessGroup | None  # distributed x redundant
    distributed: dist.ProcessGroup | None  # gradients and state are sharded over it
    redundant: object  # the shards are replicated over it (comm.SELF when trivial)
    model_parallel: dist.ProcessGroup | None  # TP/PP: the grad norm also reduces over it
    tensor_parallel_rank: int  # TP-replicated parameters count in the norm on TP rank 0
    distributed_size: int
    distributed_rank: int
    redundant_size: int

    @classmethod
    def resolve(cls, process_group, distributed_group, redundant_group,
                model_parallel_group, tensor_parallel_rank: int = 0) -> Groups:
        """Fill in the defaults and check that the sizes multiply."""
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        if distributed_group is None:
            distributed_group = process_group
            if redundant_group is not None and comm.group_size(redundant_group) > 1:
                raise OptionError(
                    "redundant_process_group given without distributed_process_group")
        if redundant_group is None:
            redundant_group = comm.SELF
        n, d, r = (comm.group_size(process_group), comm.group_size(distributed_group),
                   comm.group_size(redundant_group))
        if d * r != n:
            raise OptionError(
                f"process_group size ({n}) must equal distributed_process_group size ({d}) x "
                f"redundant_process_group size ({r})")
        return cls(process_group, distributed_group, redundant_group, model_parallel_group,
                   tensor_parallel_rank, d, comm.group_rank(distributed_group), r)

    @property
    def local_only(self) -> bool:
        """This rank alone makes up both groups: nothing to communicate."""
        return self.distributed_size == 1 and self.redundant_size == 1


def resolve_device(device, params) -> torch.device:
    """The state's device: ``device``, or the parameters' (which must share one)."""
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise OptionError(f"params are on different devices ({sorted(map(str, devices))}); "
                          "DistributedFusedAdam needs all on one")
    if device is None:
        dev = devices.pop()
    else:
        dev = torch.device(device)
        if dev.type not in ("cuda", "cpu"):
            raise OptionError(f"device={device!r}: only 'cuda' and 'cpu' are supported")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def collect_params(params) -> list[torch.Tensor]:
    """Flatten ``params`` (tensors or param-group dicts); reject duplicates."""
    flat = []
    for item in params:
        if isinstance(item, dict):
            ps = item["params"]
            flat.extend([ps] if isinstance(ps, torch.Tensor) else list(ps))
        else:
            flat.append(item)
    seen = set()
    for p in flat:
        if id(p) in seen:
            raise OptionError(f"params: a parameter of shape {tuple(p.shape)} is given twice")
        seen.add(id(p))
    if not flat:
        raise OptionError("params: the optimizer got an empty parameter list")
    return flat
