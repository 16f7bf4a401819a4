"""Fused multi-tensor kernels: one API over the CUDA extension and the PyTorch reference.

Each function uses ``mpzero._C`` (``csrc/``) when the extension imports and all
tensors are CUDA tensors of the dtypes it handles (fp32/fp16/bf16 state), and
the pure-PyTorch :mod:`mpzero.kernels.reference` otherwise. The reference is
the specification: the GPU tests check the kernels against it. On CPU tensors,
:func:`adam` and :func:`adam_remainders` use ``mpzero._cpu``
(:mod:`mpzero.kernels.cpu_adam`, multi-threaded, bit for bit the reference) where
it is built and takes the lists, else torch's fused CPU Adam
(:mod:`mpzero.kernels.cpu`) or the reference.

Math of :func:`adam`, per element in fp32 registers whatever the storage dtypes::

    g = grad * grad_scale                       (grad_scale: optional device scalar)
    if not adam_w_mode: g += weight_decay * p   (L2 mode)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    mh, vh = m / (1 - beta1^t), v / (1 - beta2^t)   (bias_correction; else m, v)
    u = mh / (sqrt(vh) + eps)
    if adam_w_mode: u += weight_decay * p      (decoupled decay)
    p -= lr * u

The bias corrections are computed as reciprocals in fp64 and rounded to fp32
(``mh = m * fp32(1 / (1 - beta1^t))``). ``lr`` and ``step`` may be 0-dim device
tensors and ``found_inf`` a 0-dim fp32 device flag: a nonzero flag makes the
call change nothing. With tensors for all three there is no host sync, so the
call can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from mpzero.kernels import cpu, cpu_adam, reference

try:  # the CUDA extension is optional
    from mpzero.kernels import cuda as _cuda
except ImportError:  # pragma: no cover - exercised where the extension is absent
    _cuda = None

__all__ = ["adam", "adam_remainders", "adam_implementation", "l2norm", "multi_copy",
           "extension_available", "multi_add", "cross_entropy_stats", "cross_entropy_backward",
           "fused_cross_entropy_available", "bias_gelu_backward", "gemm_gelu_available",
           "gemm_bias_gelu", "gemm_dgelu", "heads_grad", "layer_norm_forward",
           "layer_norm_backward"]

Scalar = float | int | torch.Tensor


def extension_available() -> bool:
    """True when ``mpzero._C`` was built and imports."""
    return _cuda is not None


def _on_cuda(*lists: Sequence[torch.Tensor] | None) -> bool:
    if _cuda is None:
        return False
    seen = False
    for lst in lists:
        if lst is None:
            continue
        for t in lst:
            if not t.is_cuda:
                return False
            seen = True
    return seen


def adam(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    params_out: Sequence[torch.Tensor] | None = None,
    *,
    lr: Scalar,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: Scalar,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    threads: int | None = None,
) -> None:
    """Fused Adam/AdamW step, in place on ``params``, ``exp_avgs`` and ``exp_avg_sqs``.

    ``params`` (fp32/fp16/bf16) are the master shards; ``exp_avgs``/``exp_avg_sqs``
    have the params' dtype; ``grads`` (fp32/fp16/bf16) are read only; ``params_out``
    (optional) receives the updated fp32 value cast to its own dtype. All lists have
    the same length and pairwise equal element counts; ``step`` is the step number
    t >= 1 after the increment. See the module docstring for the math. ``threads``: how
    many CPU threads a CPU implementation uses for this call (CUDA ignores it).
    """
    kw = dict(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        adam_w_mode=adam_w_mode,
        bias_correction=bias_correction,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )
    if len(params) == 0:
        return
    lists = (params, grads, exp_avgs, exp_avg_sqs, params_out)
    impl = adam_implementation(False, lists, bias_correction)
    _call(impl, lists, kw, threads)


def adam_remainders(
    params_bf16: Sequence[torch.Tensor],
    remainders: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    params_out: Sequence[torch.Tensor] | None = None,
    *,
    lr: Scalar,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: Scalar,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    threads: int | None = None,
) -> None:
    """Adam on fp32 masters kept as bf16 ``params_bf16`` + int16 ``remainders``.

    The master is ``merge_remainder(p, rem)`` (``mpzero.kernels.precision``);
    it is updated with fp32 ``exp_avgs``/``exp_avg_sqs`` and split back in place.
    ``params_out`` (optional) gets the new bf16 value, or the new master cast to
    its dtype when it is not bf16.
    """
    kw = dict(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        adam_w_mode=adam_w_mode,
        bias_correction=bias_correction,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )
    if len(params_bf16) == 0:
        return
    lists = (params_bf16, remainders, grads, exp_avgs, exp_avg_sqs, params_out)
    impl = adam_implementation(True, lists, bias_correction)
    _call(impl, lists, kw, threads)


_THREADED = (cpu_adam.adam, cpu_adam.adam_remainders)


def _call(impl, lists, kw: dict, threads: int | None) -> None:
    """``impl(*lists, **kw)`` on ``threads`` CPU threads: the C++ kernel's own pool, or
    torch's intra-op threads for the duration of the call (training ranks run torch on
    one thread)."""
    if threads is None:
        impl(*lists, **kw)
    elif impl in _THREADED:
        impl(*lists, threads=threads, **kw)
    else:
        with torch_threads(threads):
            impl(*lists, **kw)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside, restored after."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)


def _cpu_adam(*lists, bias_correction, **kw):
    """:func:`cpu.adam` (torch's fused kernel applies bias correction always)."""
    cpu.adam(*lists, **kw)


def adam_implementation(remainders: bool, lists: Sequence[Sequence[torch.Tensor] | None],
                        bias_correction: bool):
    """The implementation :func:`adam` (or, with ``remainders``, :func:`adam_remainders`)
    runs for argument lists of these devices and dtypes: the dispatch of both, and for
    callers that make the same call every step, checked once. Called with the same
    arguments (``lists`` positional, the rest by keyword)."""
    if remainders:
        if cpu_adam.supported_remainders(*lists):
            return cpu_adam.adam_remainders
        if _on_cuda(*lists) and _cuda.adam_remainders_supported(*lists):
            return _cuda.adam_remainders
        return reference.adam_remainders
    params, grads, exp_avgs, exp_avg_sqs, params_out = lists
    if cpu_adam.supported(*lists):
        return cpu_adam.adam
    if cpu.supported(params, grads, exp_avgs, exp_avg_sqs, bias_correction=bias_correction):
        return _cpu_adam
    if _on_cuda(*lists) and _cuda.adam_supported(*lists):
        return _cuda.adam
    return reference.adam


def adam_plan(kernel, remainders: bool, lists, slots, dynamic_like):
    """``kernel`` (from :func:`adam_implementation`) planned once where the
    implementation supports it (the CUDA kernels), else ``None``: a callable
    ``plan(dynamic, **hyper)`` for argument ``lists`` whose ``None`` entries are
    filled, every call, from slices of the ``dynamic`` tensors: ``slots`` are
    ``(list position, entry, index into dynamic, element offset)`` and
    ``dynamic_like`` gives the per-step tensors' dtype, device and size."""
    if _cuda is None:
        return None
    if kernel not in (_cuda.adam, _cuda.adam_remainders):
        return None
    return _cuda.AdamPlan(remainders, lists, slots, dynamic_like)


def l2norm(
    tensors: Sequence[torch.Tensor],
    *,
    noop_flag: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """0-dim fp32 L2 norm of all elements of all ``tensors`` (fp32 accumulation).

    When ``noop_flag`` (0-dim fp32) is given and the norm is not finite, the flag
    is set to 1 on the device. An empty list gives 0 on ``device`` (default CPU).
    """
    if len(tensors) == 0:
        return reference.l2norm(tensors, device=device)
    if _on_cuda(tensors) and _cuda.l2norm_supported(tensors):
        return _cuda.l2norm(tensors, noop_flag=noop_flag)
    return reference.l2norm(tensors, noop_flag=noop_flag)


def multi_copy(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    *,
    noop_flag: torch.Tensor | None = None,
) -> None:
    """``dst.copy_(src)`` for every pair: casts among fp32/fp16/bf16, or same-dtype copies
    of any dtype. Nothing is copied when ``noop_flag`` is given and nonzero."""
    if len(srcs) == 0:
        return
    if _on_cuda(srcs, dsts) and _cuda.multi_copy_supported(srcs, dsts):
        _cuda.multi_copy(srcs, dsts, noop_flag=noop_flag)
    else:
        reference.multi_copy(srcs, dsts, noop_flag=noop_flag)


def multi_add(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> None:
    """``dst.add_(src)`` for every pair, in one launch on CUDA where the dtypes allow
    (fp32/fp16/bf16 into fp32, or a 16-bit float into its own dtype: fp32 math, one
    rounding, the same values as ``add_``). No two pairs may share destination memory."""
    if len(srcs) == 0:
        return
    if _on_cuda(srcs, dsts) and _cuda.multi_add_supported(srcs, dsts):
        _cuda.multi_add(srcs, dsts)
    else:
        reference.multi_add(srcs, dsts)


_CE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fused_cross_entropy_available(logits: torch.Tensor) -> bool:
    """The CUDA cross-entropy kernels can take these logits (CUDA, fp32/fp16/bf16, the
    extension built)."""
    return _cuda is not None and logits.is_cuda and logits.dtype in _CE_DTYPES


def cross_entropy_stats(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row of ``logits`` ``[N, V]`` (last stride 1), in one read: fp32 ``[N, 4]`` of
    the row's max ``m``, ``sum(exp(x - m))``, the logit at ``target`` (int64 ``[N]``
    column, or -1 for none: 0) and the sum of the logits."""
    if fused_cross_entropy_available(logits):
        return _cuda.cross_entropy_stats(logits, target)
    return reference.cross_entropy_stats(logits, target)


def cross_entropy_backward(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                           grad_loss: torch.Tensor, on_target: float, off_target: float,
                           out: torch.Tensor) -> None:
    """``out = (exp(logits - lse) - off_target - on_target * onehot(target)) * grad_loss``
    row by row (``lse``, ``grad_loss``: fp32 ``[N]``; ``target`` as in
    :func:`cross_entropy_stats`), fp32 math rounded once; ``out`` may be ``logits``."""
    if fused_cross_entropy_available(logits):
        _cuda.cross_entropy_backward(logits, target, lse, grad_loss, on_target, off_target,
                                     out)
    else:
        reference.cross_entropy_backward(logits, target, lse, grad_loss, on_target,
                                         off_target, out)


def _bias_gelu_on_cuda(x: torch.Tensor, bias: torch.Tensor, dy: torch.Tensor) -> bool:
    """The CUDA bias-GELU kernel takes these: CUDA, one dtype of fp32/fp16/bf16, rows
    contiguous with a multiple of 8 columns, 16-byte aligned."""
    if _cuda is None or not x.is_cuda:
        return False
    if x.dtype not in _CE_DTYPES or not (x.dtype == bias.dtype == dy.dtype):
        return False
    if x.dim() != 2 or x.shape[1] % 8 or not x.is_contiguous() or not dy.is_contiguous():
        return False
    return all(t.data_ptr() % 16 == 0 for t in (x, bias, dy)) and bias.is_contiguous()


def bias_gelu_backward(x: torch.Tensor, bias: torch.Tensor, dy: torch.Tensor,
                       approximate: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of ``gelu(x + bias, approximate)`` over ``x, dy`` ``[R, C]``, in one read:
    ``(dx, dbias)`` with ``dx = gelu'(x + bias) * dy`` (fp32 math, rounded once) and
    ``dbias`` the column sums of the rounded ``dx`` (fp32, in a fixed order)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"bias_gelu_backward: approximate must be 'none' or 'tanh', got "
                         f"{approximate!r}")
    if _bias_gelu_on_cuda(x, bias, dy):
        return _cuda.bias_gelu_backward(x, bias, dy, approximate == "tanh")
    return reference.bias_gelu_backward(x, bias, dy, approximate)


def _heads_grad_on_cuda(grads: Sequence[torch.Tensor]) -> bool:
    """The CUDA heads-gradient kernel takes these: 1-4 CUDA tensors [B, H, T, D] of one
    shape and dtype (fp32/fp16/bf16), D a multiple of 8 and contiguous, the other strides
    multiples of 8 elements, 16-byte aligned."""
    if _cuda is None or not grads or len(grads) > 4:
        return False
    g0 = grads[0]
    if not g0.is_cuda or g0.dim() != 4 or g0.dtype not in _CE_DTYPES or g0.shape[3] % 8:
        return False
    return all(g.is_cuda and g.shape == g0.shape and g.dtype == g0.dtype
               and g.device == g0.device and g.stride(3) == 1
               and all(s % 8 == 0 for s in g.stride()[:3]) and g.data_ptr() % 16 == 0
               for g in grads)


def heads_grad(grads: Sequence[torch.Tensor],
               with_bias: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradient of a fused projection whose output ``y [B, T, H*n*D]`` was split
    into ``n`` head tensors ``y.view(B, T, H, n, D)[:, :, :, j].transpose(1, 2)``
    (``[B, H, T, D]``, e.g. Q, K and V): from their gradients ``grads`` (``n`` tensors
    ``[B, H, T, D]``, any strides), ``(dy, dbias)`` with ``dy [B*T, H*n*D]`` the
    gradient of ``y`` and ``dbias`` its column sums (the bias gradient; ``None``
    unless ``with_bias``), in one read of the gradients on CUDA; else
    :func:`mpzero.kernels.reference.heads_grad`."""
    if not grads or any(g.dim() != 4 or g.shape != grads[0].shape for g in grads):
        raise ValueError(f"heads_grad: grads must be 4-D tensors [B, H, T, D] of one shape, "
                         f"got {[tuple(g.shape) for g in grads]}")
    if _heads_grad_on_cuda(grads):
        return _cuda.heads_grad(grads, with_bias)
    return reference.heads_grad(grads, with_bias)


def _layer_norm_on_cuda(rows: Sequence[torch.Tensor | None],
                        vectors: Sequence[torch.Tensor | None]) -> bool:
    """The CUDA LayerNorm kernels take these: ``rows`` (``[R, H]``) and ``vectors``
    (``[H]``) CUDA tensors of one dtype (fp32/fp16/bf16) on one device, contiguous and
    16-byte aligned, H a multiple of 8 up to 8192 (``None`` entries are absent ones)."""
    if _cuda is None:
        return False
    x = rows[0]
    if not x.is_cuda or x.dim() != 2 or x.dtype not in _CE_DTYPES:
        return False
    H = x.shape[1]
    if H == 0 or H % 8 or H > 8192:
        return False
    return all(t.is_cuda and t.device == x.device and t.dtype == x.dtype and t.is_contiguous()
               and t.data_ptr() % 16 == 0 and t.shape == (x.shape if i < len(rows) else (H,))
               for i, t in enumerate([*rows, *vectors]) if t is not None)


def layer_norm_forward(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor,
                       bias: torch.Tensor | None, eps: float, rms: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """LayerNorm over the last dim of ``x [R, H]`` after an optional residual add ``s = x
    + y``: ``(out, s, mean, rstd)`` (``s`` is ``x`` without ``y``; ``mean``, ``rstd``
    fp32 per row), one pass on CUDA; else :func:`mpzero.kernels.reference.layer_norm_forward`
    (same contract). ``rms``: RMSNorm (``mean`` is ``None``; no bias)."""
    if x.dim() != 2 or (y is not None and y.shape != x.shape):
        raise ValueError(f"layer_norm_forward: x [R, H] and y of its shape expected, got "
                         f"{tuple(x.shape)} and {None if y is None else tuple(y.shape)}")
    if weight.shape != (x.shape[1],) or (bias is not None and bias.shape != weight.shape):
        raise ValueError(f"layer_norm_forward: weight and bias must have {x.shape[1]} "
                         f"elements, got {tuple(weight.shape)} and "
                         f"{None if bias is None else tuple(bias.shape)}")
    if rms and bias is not None:
        raise ValueError("layer_norm_forward: RMSNorm (rms=True) takes no bias")
    if _layer_norm_on_cuda([x, y], [weight, bias]):
        return _cuda.layer_norm_forward(x, y, weight, bias, eps, rms)
    return reference.layer_norm_forward(x, y, weight, bias, eps, rms)


def layer_norm_backward(g_out: torch.Tensor, g_s: torch.Tensor | None, s: torch.Tensor,
                        mean: torch.Tensor | None, rstd: torch.Tensor, weight: torch.Tensor,
                        with_bias: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The backward of :func:`layer_norm_forward`: ``(ds, dw, db)`` from the output's
    gradient ``g_out`` and the gradient ``g_s`` that reaches ``s`` by other paths (the
    residual stream; ``None``: none), ``dw``/``db`` as fp32 column sums in a fixed order
    on CUDA; else :func:`mpzero.kernels.reference.layer_norm_backward`. ``mean`` ``None``:
    RMSNorm's backward (``with_bias`` must be false)."""
    if mean is None and with_bias:
        raise ValueError("layer_norm_backward: RMSNorm (mean None) has no bias gradient")
    ok = all(t.dtype == torch.float32 and t.is_contiguous() and t.shape == (s.shape[0],)
             for t in (mean, rstd) if t is not None)
    if ok and _layer_norm_on_cuda([s, g_out, g_s], [weight]):
        return _cuda.layer_norm_backward(g_out, g_s, s, mean, rstd, weight, with_bias)
    return reference.layer_norm_backward(g_out, g_s, s, mean, rstd, weight, with_bias)


_GEMM_DTYPES = (torch.float16, torch.bfloat16)


def gemm_gelu_available(*tensors: torch.Tensor) -> bool:
    """The cuBLASLt GELU-epilogue GEMMs take these tensors: the extension built, all CUDA
    tensors of one dtype, fp16 or bf16, contiguous, 16-byte aligned, and every last
    dimension a multiple of 8. Without tensors: whether the extension is built."""
    if _cuda is None:
        return False
    if not tensors:
        return True
    dtype = tensors[0].dtype
    return dtype in _GEMM_DTYPES and all(
        t.is_cuda and t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 16 == 0
        and all(s % 8 == 0 for s in t.shape[-1:]) for t in tensors)


def gemm_bias_gelu(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, z)`` with ``z = x @ weight.T + bias`` and ``y = gelu(z)`` (tanh approximation)
    for ``x [M, K]``, ``weight [N, K]``, ``bias [N]``: on CUDA one cuBLASLt GEMM whose
    epilogue adds the bias, writes ``z`` and applies the GELU (fp32 accumulation, ``y``
    from the fp32 ``z``); else :func:`mpzero.kernels.reference.gemm_bias_gelu`."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemm_bias_gelu: x [M, K] and weight [N, K] expected, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"gemm_bias_gelu: bias must have {weight.shape[0]} elements, got "
                         f"{tuple(bias.shape)}")
    if weight.shape[0] % 8 == 0 and gemm_gelu_available(
            x, weight, *((bias,) if bias is not None else ())):
        out = _lt_call("gemm_bias_gelu", _cuda.gemm_bias_gelu, x, weight, bias)
        if out is not None:
            return out
    return reference.gemm_bias_gelu(x, weight, bias)


def gemm_dgelu(grad_out: torch.Tensor, weight: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``dz = (grad_out @ weight) * gelu'(z)`` (tanh approximation) for ``grad_out [M, H]``,
    ``weight [H, F]``, ``z [M, F]``: on CUDA one cuBLASLt GEMM whose epilogue reads ``z``
    (fp32 accumulation, one rounding); else :func:`mpzero.kernels.reference.gemm_dgelu`."""
    if (grad_out.dim() != 2 or weight.dim() != 2 or z.dim() != 2
            or weight.shape[0] != grad_out.shape[1] or z.shape != (grad_out.shape[0],
                                                                  weight.shape[1])):
        raise ValueError(f"gemm_dgelu: grad_out [M, H], weight [H, F] and z [M, F] "
                         f"expected, got {tuple(grad_out.shape)}, {tuple(weight.shape)} and "
                         f"{tuple(z.shape)}")
    if gemm_gelu_available(grad_out, weight, z):
        dz = _lt_call("gemm_dgelu", _cuda.gemm_dgelu, grad_out, weight, z)
        if dz is not None:
            return dz
    return reference.gemm_dgelu(grad_out, weight, z)


_LT_UNSUPPORTED: dict[tuple, str] = {}  # (op, shapes, dtype) cuBLASLt found no algorithm for


def _lt_key(op: str, args: tuple) -> tuple:
    return (op, args[0].device, args[0].dtype,
            *(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))


def _lt_call(op: str, fn, *args):
    """``fn(*args)``, or None where cuBLASLt has no algorithm for this epilogue and these
    shapes (remembered, with one warning: the caller then takes a slower path). The key
    is only built once something was remembered: nothing extra on the usual path."""
    if _LT_UNSUPPORTED and _lt_key(op, args) in _LT_UNSUPPORTED:
        return None
    try:
        return fn(*args)
    except RuntimeError as e:
        if "has no algorithm" not in str(e):
            raise
        import warnings

        from mpzero.warn import user_stacklevel

        _LT_UNSUPPORTED[_lt_key(op, args)] = str(e)
        warnings.warn(f"mpzero: {e}; using the unfused path for these shapes",
                      stacklevel=user_stacklevel())
        return None
