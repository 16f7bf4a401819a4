"""The GPT example's precision modes (``--bf16``, ``--autocast-bf16``, fp32).

- ``--bf16`` (Megatron's meaning): the model's parameters are bf16, and so are
  the activations and the matmuls; the fp32 master weights live in the optimizer
  (DistributedFusedAdam's shards), and the loss is computed in fp32 from the bf16
  logits. Parameters and gradients take
  2 + 2 bytes per parameter on every rank, the masters and moments 12 bytes
  sharded by the optimizer.
- ``--autocast-bf16`` (the example's former ``--bf16``): fp32 parameters under
  ``torch.autocast(dtype=torch.bfloat16)`` on GPUs, the usual torch recipe; on CPU
  it computes in fp32.
- neither: fp32 throughout.
"""

from __future__ import annotations

import contextlib

import torch


def param_dtype(rt) -> torch.dtype:
    """The dtype of the model's parameters (``rt``: the run's ``config.RuntimeConfig``)."""
    return torch.bfloat16 if rt.bf16 else torch.float32


def autocast_factory(rt, device: torch.device):
    """A function returning the context each forward runs in."""
    if rt.autocast_bf16 and device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def describe(rt, device: torch.device) -> str:
    """One word for the log: bf16 (parameters), autocast-bf16 or fp32."""
    if rt.bf16:
        return "bf16"
    if rt.autocast_bf16 and device.type == "cuda":
        return "autocast-bf16"
    return "fp32"


@torch.no_grad()
def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast every floating-point parameter to ``dtype`` in place.

    The Parameter objects stay the same (so do their attributes, such as
    ``tensor_model_parallel``); buffers keep their dtype (RoPE's tables stay fp32 and
    are cast where they are used)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model
