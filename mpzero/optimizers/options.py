"""Validation of DistributedFusedAdam's constructor options: one place, clear messages."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Integer param-sync dtypes of every width, signed and unsigned (torch >= 2.3 has the
# wider unsigned ones): their bytes are what travels.
BYTE_SYNC_DTYPES = tuple(d for d in (getattr(torch, n, None) for n in (
    "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")) if d is not None)
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float64: "float64"}


class OptionError(ValueError, NotImplementedError):
    """A wrong or not-yet-supported optimizer option.

    A ``ValueError`` (bad configuration) and a ``NotImplementedError`` (planned
    feature), so callers may catch either."""


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
        if not o["store_params"]:
            raise OptionError("with_scaled_states=True requires store_params=True")
        if dtype not in (torch.float16, torch.bfloat16):
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
    if o["nccl_ub"]:
        if not o["contiguous_grad_buffer"]:
            raise OptionError("nccl_ub=True requires contiguous_grad_buffer=True")
        if device is not None and torch.device(device).type != "cuda":
            raise OptionError(f"nccl_ub=True requires a CUDA device, got device={device!r}")
