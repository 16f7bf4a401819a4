"""The multi-threaded CPU Adam/AdamW step of ``mpzero._cpu`` (``csrc/cpu_adam.cpp``).

One pass over memory, vectorized (AVX2/AVX-512 clones picked at load time), on
``threads`` threads of its own: training ranks call ``torch.set_num_threads(1)``, and an
optimizer step (offloaded or not) must still use the cores it is given. The result is
bit for bit :func:`mpzero.kernels.reference.adam` / ``adam_remainders`` (same operations,
same order, each rounded; the bias corrections are the reference's own fp32 values).

Modes (every list entry a contiguous CPU tensor; views at any element offset are fine):

- plain: fp32 ``params``, ``exp_avgs``, ``exp_avg_sqs``; fp32/bf16/fp16 ``grads``;
  optional ``params_out`` in fp32/bf16/fp16 (may be ``params`` itself);
- remainders: bf16 ``params`` + int16 ``remainders`` (the exact fp32 master), fp32
  moments, the same grads and outputs (a bf16 output receives the new bf16 halves).

- remainders with bf16 moments, one fp32 scale per piece (:func:`adam_remainders_scaled`,
  ``with_scaled_states`` beside ``store_param_remainders``): two passes, the second
  storing the moments over the scales the first chose.

Other scaled states are not a kernel mode: the optimizer unscales them into fp32
working copies and calls the plain mode. Other dtypes or layouts go to the PyTorch paths
(:func:`supported` says which). A nonzero ``found_inf`` changes nothing.

Threads: :func:`get_threads` (:func:`set_threads`'s value, else :func:`default_threads`);
the ``threads=`` argument sets it for one call.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from functools import lru_cache

import torch

from mpzero.kernels.reference import bias_corrections

try:
    from mpzero import _cpu
except ImportError:  # pragma: no cover - built on every install that has a C++ compiler
    _cpu = None

__all__ = ["available", "supported", "supported_remainders", "supported_scaled", "adam",
           "adam_remainders", "adam_remainders_scaled", "get_threads", "set_threads",
           "default_threads"]

_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NO_OUT = 3
_threads: int | None = None


def available() -> bool:
    """True when ``mpzero._cpu`` was built and imports."""
    return _cpu is not None


def _physical_cores(cpus: Sequence[int]) -> int:
    """Distinct physical cores among logical ``cpus`` (SMT siblings count once)."""
    cores = set()
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(c))
    return len(cores)


@lru_cache(maxsize=1)
def default_threads() -> int:
    """The physical cores this rank may use: those of its CPU affinity mask, divided by
    ``LOCAL_WORLD_SIZE`` when the mask is the whole host (ranks that share the host share
    its cores; a launcher that pins each rank gives each its own mask). At least 1."""
    total = os.cpu_count() or 1
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(total)
    n = _physical_cores(cpus)
    if len(cpus) >= total:
        n //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, n)


def get_threads() -> int:
    """Threads a step uses: :func:`set_threads`'s value, else :func:`default_threads`."""
    return default_threads() if _threads is None else _threads


def set_threads(n: int | None) -> None:
    """Use ``n`` threads for every later step of this process (``None``: the default)."""
    global _threads
    if n is not None and int(n) < 1:
        raise ValueError(f"set_threads: need at least one thread, got {n}")
    _threads = None if n is None else int(n)


def _ok(t: torch.Tensor, dtypes) -> bool:
    return t.device.type == "cpu" and t.dtype in dtypes and t.is_contiguous()


_FP32 = (torch.float32,)
_FLOATS = tuple(_CODES)


def supported(params, grads, exp_avgs, exp_avg_sqs, params_out=None) -> bool:
    """The plain mode takes these lists (see the module docstring)."""
    return (_cpu is not None and all(_ok(t, _FP32) for t in params)
            and all(_ok(t, _FLOATS) for t in grads)
            and all(_ok(t, _FP32) for t in exp_avgs) and all(_ok(t, _FP32) for t in exp_avg_sqs)
            and (params_out is None or all(_ok(t, _FLOATS) for t in params_out)))


def supported_remainders(params_bf16, remainders, grads, exp_avgs, exp_avg_sqs,
                         params_out=None) -> bool:
    """The remainder mode takes these lists (see the module docstring)."""
    return (_cpu is not None and all(_ok(t, (torch.bfloat16,)) for t in params_bf16)
            and all(_ok(t, (torch.int16,)) for t in remainders)
            and supported([], grads, exp_avgs, exp_avg_sqs, params_out))


def _table(name: str, lists) -> array:
    """Rows of 9 int64 (``csrc/cpu_adam.cpp``'s ``Row``): the addresses of p, remainder,
    g, m, v and out (0: none), the element count, the dtype codes of g and out. The
    kernel reads raw memory: every tensor is checked here (a wrong one raises)."""
    p, rem, g, m, v, out = lists
    n = len(p)
    for lst in lists:
        if lst is not None and len(lst) != n:
            raise ValueError(f"{name}: tensor lists have different lengths")
    ok = (supported_remainders(p, rem, g, m, v, out) if rem is not None
          else supported(p, g, m, v, out))
    if not ok:
        raise TypeError(f"{name}: mpzero._cpu takes contiguous CPU tensors of the dtypes "
                        f"its supported{'_remainders' if rem is not None else ''}() lists")
    rows = array("q")
    for i in range(n):
        k = p[i].numel()
        if (g[i].numel() != k or m[i].numel() != k or v[i].numel() != k
                or (rem is not None and rem[i].numel() != k)
                or (out is not None and out[i].numel() != k)):
            raise ValueError(f"{name}: tensor {i} has mismatched element counts")
        if k == 0:
            continue
        o = out[i] if out is not None else None
        rows.extend((p[i].data_ptr(), 0 if rem is None else rem[i].data_ptr(), g[i].data_ptr(),
                     m[i].data_ptr(), v[i].data_ptr(), 0 if o is None else o.data_ptr(), k,
                     _CODES[g[i].dtype], _NO_OUT if o is None else _CODES[o.dtype]))
    return rows


def _num(x) -> float:
    """``x`` (a number or a one-element tensor) as a Python float; the extension rounds
    every hyper-parameter to fp32 (round to nearest even, as ``torch.tensor(x,
    dtype=torch.float32)`` does in the reference)."""
    return float(x.reshape(())) if isinstance(x, torch.Tensor) else float(x)


def _hyper(*, lr, beta1, beta2, eps, weight_decay, step, adam_w_mode=True,
           bias_correction=True, grad_scale=None, found_inf=None) -> tuple | None:
    """The extension's hyper-parameter arguments, from ``lr`` to ``adam_w_mode``; None
    when ``found_inf`` (a CPU flag: reading it is no device sync) says skip."""
    if found_inf is not None and bool(found_inf.reshape(()) != 0):
        return None
    if not bias_correction:
        bc1 = bc2 = 1.0
    elif isinstance(step, torch.Tensor):  # fp64 pow in torch, as the reference computes it
        bc1, bc2 = (float(c) for c in bias_corrections(beta1, beta2, step, torch.device("cpu")))
    else:  # the reference's Python expressions, rounded to fp32 by the extension
        bc1, bc2 = 1.0 / (1.0 - beta1**step), 1.0 / (1.0 - beta2**step)
    return (_num(lr), beta1, beta2, 1.0 - beta1, 1.0 - beta2, eps, weight_decay, bc1, bc2,
            1.0 if grad_scale is None else _num(grad_scale), bool(adam_w_mode))


def _threads_of(threads: int | None) -> int:
    """The thread count of one call: ``threads``, else :func:`get_threads`."""
    return max(1, get_threads() if threads is None else int(threads))


def _run(name: str, lists, remainders: bool, *, threads: int | None = None, **kw) -> None:
    table = _table(name, lists)
    hyper = _hyper(**kw)
    if not table or hyper is None:
        return
    _cpu.adam(table, remainders, *hyper, _threads_of(threads))


def adam(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
         exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
         params_out: Sequence[torch.Tensor] | None = None, *, threads: int | None = None,
         **hyper) -> None:
    """:func:`mpzero.kernels.adam` on ``threads`` threads (default :func:`get_threads`), for
    lists :func:`supported` accepts; ``hyper`` are that function's keywords."""
    _run("adam", (params, None, grads, exp_avgs, exp_avg_sqs, params_out), False,
         threads=threads, **hyper)


def adam_remainders(params_bf16: Sequence[torch.Tensor], remainders: Sequence[torch.Tensor],
                    grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                    exp_avg_sqs: Sequence[torch.Tensor],
                    params_out: Sequence[torch.Tensor] | None = None, *,
                    threads: int | None = None, **hyper) -> None:
    """:func:`mpzero.kernels.adam_remainders` on ``threads`` threads, for lists
    :func:`supported_remainders` accepts; ``hyper`` are that function's keywords."""
    _run("adam_remainders", (params_bf16, remainders, grads, exp_avgs, exp_avg_sqs, params_out),
         True, threads=threads, **hyper)


def supported_scaled(params_bf16, remainders, grads, exp_avgs, exp_avg_sqs) -> bool:
    """:func:`adam_remainders_scaled` takes these lists: bf16 halves, int16 remainders,
    fp32/bf16/fp16 gradients, bf16 moments, each contiguous on the CPU."""
    bf16 = (torch.bfloat16,)
    return (_cpu is not None and all(_ok(t, bf16) for t in params_bf16)
            and all(_ok(t, (torch.int16,)) for t in remainders)
            and all(_ok(t, _FLOATS) for t in grads)
            and all(_ok(t, bf16) for t in exp_avgs) and all(_ok(t, bf16) for t in exp_avg_sqs))


def adam_remainders_scaled(params_bf16: Sequence[torch.Tensor],
                           remainders: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                           exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                           pieces: Sequence[int], exp_avg_scales: torch.Tensor,
                           exp_avg_sq_scales: torch.Tensor, half_max: float, *,
                           threads: int | None = None, **hyper) -> None:
    """:func:`adam_remainders` whose moments are stored in bf16 as ``x / scale``, one fp32
    scale per piece (``with_scaled_states`` beside remainders), in two passes over memory.

    Entry ``i`` of the lists is piece ``pieces[i]``; ``exp_avg_scales`` /
    ``exp_avg_sq_scales`` (contiguous fp32 CPU tensors, one scale per piece of the whole
    shard) hold the scales the moments are stored with, and receive, for these pieces,
    the new ones: ``absmax / half_max`` of the new moments, at least fp32's smallest
    normal, 1 where the absmax is 0. The bits are those of unscaling into fp32,
    :func:`adam_remainders` and storing with the new scales
    (``mpzero.optimizers.scaled_state``)."""
    lists = (params_bf16, remainders, grads, exp_avgs, exp_avg_sqs)
    n = len(params_bf16)
    if any(len(lst) != n for lst in lists) or len(pieces) != n:
        raise ValueError("adam_remainders_scaled: tensor lists have different lengths")
    scales = (exp_avg_scales, exp_avg_sq_scales)
    if not (supported_scaled(*lists) and all(_ok(t, _FP32) for t in scales)
            and exp_avg_scales.numel() == exp_avg_sq_scales.numel()):
        raise TypeError("adam_remainders_scaled: mpzero._cpu takes contiguous CPU tensors "
                        "of the dtypes its supported_scaled() lists, and fp32 scales")
    rows = array("q")
    for i in range(n):
        k = params_bf16[i].numel()
        if any(t[i].numel() != k for t in lists[1:]):
            raise ValueError(f"adam_remainders_scaled: tensor {i} has mismatched counts")
        if not 0 <= pieces[i] < exp_avg_scales.numel():
            raise ValueError(f"adam_remainders_scaled: piece {pieces[i]} has no scale")
        if k:
            rows.extend((params_bf16[i].data_ptr(), remainders[i].data_ptr(),
                         grads[i].data_ptr(), exp_avgs[i].data_ptr(),
                         exp_avg_sqs[i].data_ptr(), k, _CODES[grads[i].dtype], pieces[i]))
    h = _hyper(**hyper)
    if not rows or h is None:
        return
    views = [memoryview(s.numpy()).cast("B") for s in scales]
    _cpu.adam_scaled(rows, *views, float(half_max), *h, _threads_of(threads))
