"""TP mappings on gloo worlds: each forward/backward against a locally computed reference.

Every rank's tensors are a deterministic function of its global rank, so each rank
can compute what the collectives must return without communicating.
"""

import pytest
import torch
import torch.distributed as dist

from mpzero import parallel_state as ps
from mpzero.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

MAPPINGS = (copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
            scatter_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region)


def _randn(seed, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _check_mappings(tp):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    members = ps.get_tensor_model_parallel_ranks()
    me, r = dist.get_rank(), ps.get_tensor_model_parallel_rank()
    src = ps.get_tensor_model_parallel_src_rank()  # a seed common to my TP group only
    for dtype in (torch.float32, torch.float64):
        shape = (2, 3, 4 * tp)
        tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12,
                                                                           "atol": 1e-12}

        # copy_to: identity forward; the gradient is summed over the TP group.
        x = _randn(me, *shape, dtype=dtype).requires_grad_()
        y = copy_to_tensor_model_parallel_region(x)
        assert torch.equal(y, x)
        grad = _randn(100 + me, *shape, dtype=dtype)
        # `+ x` shares the incoming gradient with the copy's backward: it must not be
        # reduced in place.
        (y + x).backward(grad)
        expected = sum(_randn(100 + m, *shape, dtype=dtype) for m in members)
        torch.testing.assert_close(x.grad, expected + grad, **tol)
        if tp > 1:
            assert not torch.allclose(x.grad, 2 * grad)

        # reduce_from: sum forward (the input is left alone); identity backward.
        x = _randn(me, *shape, dtype=dtype).requires_grad_()
        x_before = x.detach().clone()
        y = reduce_from_tensor_model_parallel_region(x)
        expected = sum(_randn(m, *shape, dtype=dtype) for m in members)
        torch.testing.assert_close(y, expected, **tol)
        assert torch.equal(x.detach(), x_before)
        y.backward(grad)
        assert torch.equal(x.grad, grad)

        # scatter_to: keep my block of the last dim; backward gathers every rank's block.
        full = _randn(1000 + src, *shape, dtype=dtype).requires_grad_()
        y = scatter_to_tensor_model_parallel_region(full)
        assert torch.equal(y, full.detach()[..., 4 * r : 4 * (r + 1)])
        y.backward(_randn(200 + me, 2, 3, 4, dtype=dtype))
        expected = torch.cat([_randn(200 + m, 2, 3, 4, dtype=dtype) for m in members], dim=-1)
        assert torch.equal(full.grad, expected)

        # gather_from: concatenate in rank order (non-contiguous input); backward splits.
        x = _randn(me, 2, 5, 3, dtype=dtype).transpose(1, 2).requires_grad_()  # (2, 3, 5)
        y = gather_from_tensor_model_parallel_region(x)
        expected = torch.cat([_randn(m, 2, 5, 3, dtype=dtype).transpose(1, 2)
                              for m in members], dim=-1)
        assert torch.equal(y, expected)
        g = _randn(300 + me, 2, 3, 5 * tp, dtype=dtype)
        y.backward(g)
        assert torch.equal(x.grad, g[..., 5 * r : 5 * (r + 1)])

    # 16-bit tensors go through the same collectives.
    x = _randn(me, 2, 4, dtype=torch.bfloat16)
    y = gather_from_tensor_model_parallel_region(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, torch.cat([_randn(m, 2, 4, dtype=torch.bfloat16) for m in members], -1))

    if tp == 1:  # the fast path: the very same tensor, no communication
        x = torch.ones(3)
        assert all(fn(x) is x for fn in MAPPINGS)
    else:
        with pytest.raises(ValueError, match="last dimension"):
            scatter_to_tensor_model_parallel_region(torch.ones(2, 4 * tp + 1))
    return True


@pytest.mark.parametrize("world_size,tp", [(1, 1), (2, 2), (4, 4), (4, 2)])
def test_mappings_match_reference(world, world_size, tp):
    assert all(world(world_size, _check_mappings, tp))


def _check_explicit_group():
    # tp=2, dp=2: mappings over the data-parallel group sum data-parallel peers only.
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    me = dist.get_rank()
    x = torch.tensor([2.0**me])
    dp_members = ps.get_data_parallel_ranks()
    assert dp_members == [me % 2, me % 2 + 2]
    y = reduce_from_tensor_model_parallel_region(x, group=ps.get_data_parallel_group())
    assert y.item() == sum(2.0**m for m in dp_members)
    y = reduce_from_tensor_model_parallel_region(x)  # default: the TP group
    assert y.item() == sum(2.0**m for m in ps.get_tensor_model_parallel_ranks())
    y = gather_from_tensor_model_parallel_region(x.view(1, 1), group=ps.get_data_parallel_group())
    assert y.flatten().tolist() == [2.0**m for m in dp_members]
    return True


def test_mappings_explicit_group(world):
    assert all(world(4, _check_explicit_group))


def test_single_process_is_identity():
    if dist.is_initialized():
        pytest.skip("needs a process without torch.distributed")
    x = torch.ones(2, 3)
    assert all(fn(x) is x for fn in MAPPINGS)
