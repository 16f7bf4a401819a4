"""The fc -> proj layer pair the TP MLP tests share (seeded, fp64, batch-first input)."""

import torch

from mpzero import tensor_parallel as tp


def fc_and_proj(sp: bool, bias: bool):
    """``ColumnParallelLinear(8, 16)`` and ``RowParallelLinear(16, 8)``
    (``input_is_parallel``), fp64, the sequence on dim 1, drawn from seed 0 with N(0, 1)
    biases (so a dropped bias would show); call inside an initialized TP grid."""
    torch.manual_seed(0)
    kw = dict(sequence_parallel=sp, sequence_dim=1, params_dtype=torch.float64)
    fc = tp.ColumnParallelLinear(8, 16, bias=bias, **kw)
    proj = tp.RowParallelLinear(16, 8, bias=bias, input_is_parallel=True, **kw)
    with torch.no_grad():
        for p in (fc.bias, proj.bias):
            if p is not None:
                p.normal_()
    return fc, proj
