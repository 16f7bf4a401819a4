"""Which fused paths the tensor-parallel ops take.

Each op with a fused path decides from its inputs whether the path applies and
computes the same function with plain PyTorch ops otherwise, so a model calls one
function per op and carries no kernel switches:

- ``layer_norm`` (:func:`~mpzero.tensor_parallel.norm`,
  :func:`~mpzero.tensor_parallel.add_norm`) and ``heads_grad``
  (:meth:`~mpzero.tensor_parallel.ColumnParallelLinear.forward_heads`): wherever the
  activations and the weights share a dtype and autocast is off, on every device
  (on the CPU through the kernels' PyTorch reference: one code path everywhere);
- ``bias_gelu`` and ``gelu_gemm`` (:func:`~mpzero.tensor_parallel.parallel_mlp`): on
  CUDA with the extension ``mpzero._C`` built (the GEMM epilogues also need
  fp16/bf16 and the tanh GELU), since elsewhere their references are slower than the
  unfused ops.

:func:`fused_paths` overrides that decision, for benchmarks and tests that compare the
two paths: ``"off"`` never fuses, ``"on"`` fuses wherever the math allows (also where
only the PyTorch reference of a kernel exists), ``"auto"`` is the default above. The
dtype and autocast conditions hold in every mode: they are what makes the fused path
the same function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

__all__ = ["FUSED_OPS", "MODES", "applies", "fused_paths", "set_fused_paths"]

FUSED_OPS = ("layer_norm", "heads_grad", "bias_gelu", "gelu_gemm")
MODES = ("auto", "on", "off")
_mode = dict.fromkeys(FUSED_OPS, "auto")


def set_fused_paths(mode: str, ops: Iterable[str] = FUSED_OPS) -> None:
    """Set the mode of ``ops`` for the whole process (a benchmark's command line)."""
    if mode not in MODES:
        raise ValueError(f"fused path mode must be one of {MODES}, got {mode!r}")
    ops = list(ops)
    unknown = [op for op in ops if op not in FUSED_OPS]
    if unknown:
        raise ValueError(f"no fused path named {unknown}; known: {FUSED_OPS}")
    for op in ops:
        _mode[op] = mode


@contextlib.contextmanager
def fused_paths(mode: str, ops: Iterable[str] = FUSED_OPS) -> Iterator[None]:
    """Within the block, ``ops`` take their fused path per ``mode`` (see the module
    docstring); the previous modes come back on exit."""
    saved = dict(_mode)
    set_fused_paths(mode, ops)
    try:
        yield
    finally:
        _mode.update(saved)


def applies(op: str, *, allowed: bool, pays: bool) -> bool:
    """Whether ``op`` takes its fused path: ``allowed`` (the inputs make it the same
    function) and, in ``"auto"`` mode, ``pays`` (the device and the build make it the
    faster one)."""
    mode = _mode[op]
    return allowed and mode != "off" and (mode == "on" or pays)
