"""Sequence-parallel mappings and layers on gloo worlds, against local references.

Every rank's tensors are a deterministic function of a seed the TP group shares (or of
the global rank), so each rank computes what the collectives must return locally.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tp_mlp_layers import fc_and_proj

from mpzero import parallel_state as ps
from mpzero import tensor_parallel as tp

TOL = {"rtol": 1e-12, "atol": 1e-12}


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def _check_mappings(tp_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    members = ps.get_tensor_model_parallel_ranks()
    me, r = dist.get_rank(), ps.get_tensor_model_parallel_rank()
    for dim in (0, 1):
        full_shape = [3, 5, 4]
        full_shape[dim] = 2 * tp_size
        chunk = 2

        # scatter: my chunk of `dim`; backward all-gathers the chunks' gradients.
        x = _randn(7, *full_shape).requires_grad_()
        y = tp.scatter_to_sequence_parallel_region(x, dim)
        torch.testing.assert_close(y, x.detach().narrow(dim, r * chunk, chunk), **TOL)
        grads = [_randn(100 + m, *y.shape) for m in members]
        y.backward(grads[r])
        torch.testing.assert_close(x.grad, torch.cat(grads, dim), **TOL)

        # gather: concatenate; backward reduce-scatters (default) or splits.
        for reduce in (True, False):
            x = _randn(me, *y.shape).requires_grad_()
            out = tp.gather_from_sequence_parallel_region(
                x, dim, tensor_parallel_output_grad=reduce)
            torch.testing.assert_close(out, torch.cat([_randn(m, *y.shape) for m in members],
                                                      dim), **TOL)
            gs = [_randn(200 + m, *full_shape) for m in members]
            out.backward(gs[r])
            total = sum(gs) if reduce else gs[r]
            torch.testing.assert_close(x.grad, total.narrow(dim, r * chunk, chunk), **TOL)

        # reduce-scatter: sum, my chunk (input untouched); backward all-gathers.
        x = _randn(me, *full_shape).requires_grad_()
        before = x.detach().clone()
        out = tp.reduce_scatter_to_sequence_parallel_region(x, dim)
        total = sum(_randn(m, *full_shape) for m in members)
        torch.testing.assert_close(out, total.narrow(dim, r * chunk, chunk), **TOL)
        assert torch.equal(x.detach(), before)
        gs = [_randn(300 + m, *out.shape) for m in members]
        out.backward(gs[r])
        torch.testing.assert_close(x.grad, torch.cat(gs, dim), **TOL)

        # reduce_grad: identity; the gradient is summed over TP.
        w = _randn(9, 4).requires_grad_()
        v = tp.reduce_grad_over_tensor_model_parallel_region(w)
        assert torch.equal(v, w)
        v.backward(_randn(400 + me, 4))
        torch.testing.assert_close(w.grad, sum(_randn(400 + m, 4) for m in members), **TOL)
    return True


@pytest.mark.timeout(120)
# A TP group of 4 in `make test` (the same mappings over more chunks).
@pytest.mark.parametrize("size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sequence_parallel_mappings(world, size):
    assert all(world(size, _check_mappings, size))


def _mlp(sp: bool, tp_size: int, bias: bool):
    """Column -> GELU -> Row on batch-first (B, T, h) input, with or without SP."""
    ps.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    r = ps.get_tensor_model_parallel_rank()
    fc, proj = fc_and_proj(sp, bias)
    x = _randn(1, 2, 4 * tp_size, 8).requires_grad_()
    inp = tp.scatter_to_sequence_parallel_region(x, 1) if sp else x
    h, _ = fc(inp)
    out, _ = proj(F.gelu(h))
    full = tp.gather_from_sequence_parallel_region(out, 1, tensor_parallel_output_grad=False) \
        if sp else out
    (full * _randn(2, *full.shape)).sum().backward()
    ps.destroy_model_parallel()
    grads = {"x": x.grad, "fc.w": fc.weight.grad, "proj.w": proj.weight.grad}
    if bias:
        grads.update({"fc.b": fc.bias.grad, "proj.b": proj.bias.grad})
    assert getattr(proj.bias, "sequence_parallel", False) == (sp and bias)
    return full.detach(), grads, r


def _sp_vs_tp(tp_size):
    out = []
    for bias in (True, False):
        ref, ref_grads, _ = _mlp(False, tp_size, bias)
        got, grads, _ = _mlp(True, tp_size, bias)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-10, atol=1e-12,
                                       msg=name)
        out.append(True)
    return all(out)


@pytest.mark.timeout(120)
def test_sequence_parallel_layers_equal_plain_tp(world):
    assert all(world(2, _sp_vs_tp, 2))


def test_row_parallel_sequence_parallel_needs_parallel_input():
    with pytest.raises(ValueError, match="input_is_parallel"):
        tp.RowParallelLinear(4, 4, sequence_parallel=True)


def test_single_process_is_identity():
    x = torch.randn(2, 4, 3)
    assert tp.scatter_to_sequence_parallel_region(x, 1) is x
    assert tp.gather_from_sequence_parallel_region(x, 1) is x
    assert tp.reduce_scatter_to_sequence_parallel_region(x, 1) is x
