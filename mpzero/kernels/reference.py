"""Pure-PyTorch reference kernels: the executable specification of :mod:`mpzero.kernels`.

Every function does its math in fp32 whatever the storage dtypes, element by
element in one fixed order of correctly rounded operations (multiply, add,
divide, square root, never a fused multiply-add; the bias corrections are
fp64 reciprocals rounded to fp32), so the CUDA kernels, which
use the same order with round-to-nearest intrinsics, can match them bit for
bit. Device scalars (``lr``, ``step``, ``grad_scale``, ``found_inf``) are used
as tensors, so nothing here synchronizes with the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpzero.kernels.precision import merge_remainder, split_remainder

__all__ = ["adam", "adam_remainders", "l2norm", "multi_copy", "gemm_bias_gelu", "heads_grad",
           "layer_norm_forward", "layer_norm_backward", "gemm_dgelu"]

Scalar = float | int | torch.Tensor


def _check_lists(name: str, *lists: Sequence[torch.Tensor] | None) -> int:
    n = len(lists[0])
    for lst in lists:
        if lst is not None and len(lst) != n:
            raise ValueError(f"{name}: tensor lists have different lengths")
    return n


def _scalar(x: Scalar, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    """A 0-dim tensor on ``device`` (a device tensor, so CUDA does true division by it)."""
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype).reshape(())
    return torch.tensor(x, dtype=dtype, device=device)


def bias_corrections(
    beta1: float, beta2: float, step: Scalar, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(1 / (1 - beta1^t), 1 / (1 - beta2^t))``: computed in fp64, then rounded to fp32."""
    if isinstance(step, torch.Tensor):
        t = step.to(device=device, dtype=torch.float64).reshape(())
        b1 = torch.tensor(beta1, dtype=torch.float64, device=device)
        b2 = torch.tensor(beta2, dtype=torch.float64, device=device)
        inv1 = (1.0 / (1.0 - torch.pow(b1, t))).float()
        inv2 = (1.0 / (1.0 - torch.pow(b2, t))).float()
        return inv1, inv2
    return _scalar(1.0 / (1.0 - beta1**step), device), _scalar(1.0 / (1.0 - beta2**step), device)


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root. On CPU, ``torch.sqrt`` of a large fp32
    tensor is not (it goes through a vector math library: 0.7% of results one ulp off,
    whatever the CPU capability); fp64's root rounded to fp32 is (no fp32 root lies
    within fp64's error of a rounding boundary), so the reference stays the IEEE
    function that the CUDA and CPU kernels compute. CUDA's ``sqrt`` is IEEE already."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return x.double().sqrt_().float()
    return torch.sqrt(x)


def _adam_math(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    c: dict,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Adam update on fp32 tensors; returns new (p, m, v). ``c`` holds fp32 0-dim scalars."""
    if c["grad_scale"] is not None:
        g = g * c["grad_scale"]
    if not c["adam_w_mode"]:
        g = g + c["wd"] * p
    m = c["beta1"] * m + c["omb1"] * g
    v = c["beta2"] * v + c["omb2"] * (g * g)
    if c["bias_correction"]:
        mh = m * c["bc1_inv"]
        vh = v * c["bc2_inv"]
    else:
        mh, vh = m, v
    u = mh / (_sqrt_rn(vh) + c["eps"])
    if c["adam_w_mode"]:
        u = u + c["wd"] * p
    p = p - c["lr"] * u
    return p, m, v


def _consts(
    device, *, lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, bias_correction, grad_scale
) -> dict:
    c = {
        "lr": _scalar(lr, device),
        "beta1": _scalar(beta1, device),
        "beta2": _scalar(beta2, device),
        "omb1": _scalar(1.0 - beta1, device),
        "omb2": _scalar(1.0 - beta2, device),
        "eps": _scalar(eps, device),
        "wd": _scalar(weight_decay, device),
        "adam_w_mode": bool(adam_w_mode),
        "bias_correction": bool(bias_correction),
        "grad_scale": None if grad_scale is None else _scalar(grad_scale, device),
    }
    if bias_correction:
        c["bc1_inv"], c["bc2_inv"] = bias_corrections(beta1, beta2, step, device)
    return c


def _keep_if(flag: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``old`` where the device flag is nonzero, else ``new`` (no host sync)."""
    if flag is None:
        return new
    return torch.where(flag.to(old.device).reshape(()) != 0, old, new)


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
) -> None:
    """Fused Adam/AdamW step over lists of tensors (see :func:`mpzero.kernels.adam`)."""
    n = _check_lists("adam", params, grads, exp_avgs, exp_avg_sqs, params_out)
    consts = {}
    for i in range(n):
        p, g, m, v = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]
        if not (p.numel() == g.numel() == m.numel() == v.numel()):
            raise ValueError(f"adam: tensor {i} has mismatched element counts")
        if p.numel() == 0:
            continue
        dev = p.device
        if dev not in consts:
            consts[dev] = _consts(
                dev,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=eps,
                weight_decay=weight_decay,
                step=step,
                adam_w_mode=adam_w_mode,
                bias_correction=bias_correction,
                grad_scale=grad_scale,
            )
        p32, m32, v32 = p.float(), m.float(), v.float()
        g32 = g.reshape(p.shape).float()
        np_, nm, nv = _adam_math(p32, g32, m32, v32, consts[dev])
        np_, nm, nv = (
            _keep_if(found_inf, p32, np_),
            _keep_if(found_inf, m32, nm),
            _keep_if(found_inf, v32, nv),
        )
        if params_out is not None:
            out = params_out[i]
            out.copy_(_keep_if(found_inf, out.float(), np_).reshape(out.shape))
        p.copy_(np_)
        m.copy_(nm)
        v.copy_(nv)


def adam_remainders(
    params_bf16: Sequence[torch.Tensor],
    remainders: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    params_out: Sequence[torch.Tensor] | None = None,
    **kwargs,
) -> None:
    """Adam on fp32 masters stored as bf16 params + int16 remainders (see ``precision.py``)."""
    n = _check_lists(
        "adam_remainders", params_bf16, remainders, grads, exp_avgs, exp_avg_sqs, params_out
    )
    masters = []
    for i in range(n):
        p, r = params_bf16[i], remainders[i]
        if p.dtype != torch.bfloat16 or r.dtype != torch.int16:
            raise TypeError("adam_remainders: params must be bfloat16 and remainders int16")
        if exp_avgs[i].dtype != torch.float32 or exp_avg_sqs[i].dtype != torch.float32:
            raise TypeError("adam_remainders: exp_avg and exp_avg_sq must be float32")
        masters.append(merge_remainder(p, r))
    # The fp32 update of the merged masters, then split them back.
    adam(masters, grads, exp_avgs, exp_avg_sqs, None, **kwargs)
    for i in range(n):
        hi, lo = split_remainder(masters[i])
        params_bf16[i].copy_(hi)
        remainders[i].copy_(lo)
        if params_out is not None:
            out = params_out[i]
            src = hi if out.dtype == torch.bfloat16 else masters[i]
            found_inf = kwargs.get("found_inf")
            out.copy_(_keep_if(found_inf, out, src.to(out.dtype)).reshape(out.shape))


def l2norm(
    tensors: Sequence[torch.Tensor],
    *,
    noop_flag: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """sqrt(sum of squares of all elements), fp32 accumulation; flags non-finite results."""
    if len(tensors) == 0:
        return torch.zeros((), dtype=torch.float32, device=device or "cpu")
    dev = tensors[0].device
    total = torch.zeros((), dtype=torch.float32, device=dev)
    for t in tensors:
        if t.numel():
            t32 = t.float()
            total = total + (t32 * t32).sum()
    norm = torch.sqrt(total)
    if noop_flag is not None:
        noop_flag.copy_(torch.where(torch.isfinite(norm), noop_flag, torch.ones_like(noop_flag)))
    return norm


def multi_copy(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    *,
    noop_flag: torch.Tensor | None = None,
) -> None:
    """``dst.copy_(src)`` for each pair (dtype cast), skipped when ``noop_flag`` is nonzero."""
    _check_lists("multi_copy", srcs, dsts)
    for s, d in zip(srcs, dsts):
        if s.numel() != d.numel():
            raise ValueError(f"multi_copy: numel {s.numel()} != {d.numel()}")
        if s.numel() == 0:
            continue
        src = s.reshape(d.shape)
        d.copy_(src if noop_flag is None else _keep_if(noop_flag, d, src.to(d.dtype)))


def multi_add(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> None:
    """``dst.add_(src)`` for each pair (``src`` viewed in ``dst``'s shape)."""
    _check_lists("multi_add", srcs, dsts)
    for s, d in zip(srcs, dsts):
        if s.numel() != d.numel():
            raise ValueError(f"multi_add: numel {s.numel()} != {d.numel()}")
        if s.numel():
            d.add_(s.reshape(d.shape))


def cross_entropy_stats(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row of ``logits`` ``[N, V]``: ``(max, sum exp(x - max), x[target], sum x)`` as
    fp32 ``[N, 4]``; the target's logit is 0 where ``target`` is -1 (not on this rank)."""
    x = logits.float()
    m = x.amax(dim=-1)
    s = torch.exp(x - m.unsqueeze(-1)).sum(dim=-1)
    here = target >= 0
    t = x.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
    return torch.stack([m, s, t, x.sum(dim=-1)], dim=-1)


def cross_entropy_backward(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                           grad_loss: torch.Tensor, on_target: float, off_target: float,
                           out: torch.Tensor) -> None:
    """``out = (exp(x - lse) - off_target - on_target * onehot(target)) * grad_loss``
    per row, fp32 math, one rounding to ``out``'s dtype; ``out`` may be ``logits``."""
    g = grad_loss.unsqueeze(-1)
    p = torch.exp(logits.float() - lse.unsqueeze(-1)).sub_(off_target)
    here = target >= 0
    hit = torch.full_like(lse, -on_target).masked_fill_(~here, 0.0).unsqueeze(-1)
    p.scatter_add_(-1, target.clamp(min=0).unsqueeze(-1), hit)
    out.copy_(p.mul_(g))


def bias_gelu_backward(x: torch.Tensor, bias: torch.Tensor, dy: torch.Tensor,
                       approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of ``gelu(x + bias)`` over ``x, dy`` ``[R, C]``: ``dx = gelu'(x + bias) *
    dy`` in fp32, rounded once to ``x``'s dtype, and ``dbias``, the fp32 column sums of
    that rounded ``dx`` (rounded to ``bias``'s dtype)."""
    h = x.float() + bias.float()
    dx = torch.ops.aten.gelu_backward(dy.float(), h, approximate=approximate).to(x.dtype)
    return dx, dx.float().sum(0).to(bias.dtype)


def heads_grad(grads: Sequence[torch.Tensor],
               with_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradient of a fused projection split into heads: ``grads`` are ``n`` tensors
    ``[B, H, T, D]`` (the gradients of ``y.view(B, T, H, n, D)[:, :, :, j]`` seen as
    ``[B, H, T, D]``); returns ``dy [B*T, H*n*D]`` (``dy[b*T + t, (h*n + j)*D + d] =
    grads[j][b, h, t, d]``) and, ``with_bias``, its column sums (fp32 sums, or wider for
    fp64, rounded to the gradients' dtype), else ``None``."""
    B, H, T, D = grads[0].shape
    dy = torch.stack(list(grads), dim=3).permute(0, 2, 1, 3, 4).reshape(B * T, H * len(grads) * D)
    return dy, (_wide(dy).sum(0).to(dy.dtype) if with_bias else None)


def layer_norm_forward(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor,
                       bias: torch.Tensor | None, eps: float, rms: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """LayerNorm over the last dim of ``[R, H]`` rows after an optional residual add:
    ``(out, s, mean, rstd)`` with ``s = x + y`` as an eager add writes it (``s = x``
    without ``y``), ``mean``, ``rstd = 1 / sqrt(var + eps)`` of ``s`` per row (fp32, or
    fp64 for fp64 input; biased variance) and ``out = (s - mean) * rstd * weight + bias``
    computed wide and rounded once. ``rms``: RMSNorm, ``mean`` is ``None`` and taken as
    0 (``rstd = 1 / sqrt(mean(s^2) + eps)``, ``out = s * rstd * weight``; no bias)."""
    if rms and bias is not None:
        raise ValueError("layer_norm_forward: RMSNorm (rms=True) takes no bias")
    s = x + y if y is not None else x
    sw = _wide(s)
    mean = None if rms else sw.mean(-1)
    centered = sw if rms else sw - mean.unsqueeze(-1)
    rstd = torch.rsqrt(centered.square().mean(-1) + eps)
    out = centered * rstd.unsqueeze(-1) * _wide(weight)
    if bias is not None:
        out = out + _wide(bias)
    return out.to(x.dtype), s, mean, rstd


def layer_norm_backward(g_out: torch.Tensor, g_s: torch.Tensor | None, s: torch.Tensor,
                        mean: torch.Tensor | None, rstd: torch.Tensor, weight: torch.Tensor,
                        with_bias: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The backward of :func:`layer_norm_forward` (all ``[R, H]`` but the per-row
    ``mean``, ``rstd`` and ``weight [H]``): ``(ds, dw, db)`` with ``xhat = (s - mean) *
    rstd``, ``dxh = g_out * weight``, ``ds = rstd * (dxh - mean(dxh) - xhat * mean(dxh *
    xhat)) + g_s`` (rounded once), ``dw`` the column sums of ``g_out * xhat`` and ``db``
    those of ``g_out`` (``None`` unless ``with_bias``), computed wide. ``mean`` ``None``:
    RMSNorm's backward (``xhat = s * rstd``, no ``mean(dxh)`` term, no bias)."""
    if mean is None and with_bias:
        raise ValueError("layer_norm_backward: RMSNorm (mean None) has no bias gradient")
    g = _wide(g_out)
    sw = _wide(s)
    xhat = (sw if mean is None else sw - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    dxh = g * _wide(weight)
    centered = dxh if mean is None else dxh - dxh.mean(-1, keepdim=True)
    ds = rstd.unsqueeze(-1) * (centered - xhat * (dxh * xhat).mean(-1, keepdim=True))
    if g_s is not None:
        ds = ds + _wide(g_s)
    dw = (g * xhat).sum(0).to(weight.dtype)
    db = g.sum(0).to(weight.dtype) if with_bias else None
    return ds.to(s.dtype), dw, db


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or wider where it already is (fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def gemm_bias_gelu(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gelu_tanh(z), z)`` with ``z = x weight^T + bias`` (``x [M, K]``, ``weight
    [N, K]``): ``z`` rounded to ``x``'s dtype as a GEMM writes it, the GELU of that ``z``
    in fp32 (or wider), rounded once."""
    z = torch.addmm(bias, x, weight.t()) if bias is not None else x.mm(weight.t())
    return torch.nn.functional.gelu(_wide(z), approximate="tanh").to(z.dtype), z


def gemm_dgelu(grad_out: torch.Tensor, weight: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``dz = (grad_out weight) * gelu_tanh'(z)`` (``grad_out [M, H]``, ``weight [H, F]``,
    ``z [M, F]``), the product kept in fp32 (or wider) until ``dz`` is rounded."""
    dy = _wide(grad_out).mm(_wide(weight))
    return torch.ops.aten.gelu_backward(dy, _wide(z), approximate="tanh").to(z.dtype)
