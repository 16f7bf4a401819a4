"""Contiguous grad/param buffers, bf16 + int16 remainders, byte-level param sync."""

import pytest
import torch
import torch.distributed as dist

from mpzero.kernels.precision import copy_high_bytes, expand_high_bytes, split_remainder
from mpzero.optimizers import DistributedFusedAdam

from dfa_common import ATOL, RTOL, batches, loss_fn, make_model

TINY = 24 * 4 / 2**20


def _reference(world, data, steps, lr=1e-2):
    ref = make_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01)
    for s in range(steps):
        opt.zero_grad()
        sum(loss_fn(ref, *data[s][r][0]) for r in range(world)).div(world).backward()
        opt.step()
    return ref


def _train(model, opt, data, steps):
    rank = dist.get_rank()
    for s in range(steps):
        opt.zero_grad()
        loss_fn(model, *data[s][rank][0]).backward()
        opt.step()


def _contiguous(which):
    world = dist.get_world_size()
    model = make_model()
    kw = {"contiguous_grad_buffer": True} if which == "grad" else {"contiguous_param_buffer": True}
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01,
                               bucket_cap_mb=TINY, **kw)
    if which == "param":
        opt.init_param_buffer()
        (buf,) = opt.shards.buffers["params"].values()
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
        for p in model.parameters():  # every parameter now lives in the one buffer
            assert lo <= p.data_ptr() < hi
    data = batches(world, 3, 1)
    _train(model, opt, data, 3)
    if which == "grad":
        view = opt.grad_buffer_view(model.fc2.weight)
        assert view.shape == model.fc2.weight.shape and view.dtype == torch.float32
        (buf,) = opt.shards.buffers["grads"].values()
        assert buf.data_ptr() <= view.data_ptr() < buf.data_ptr() + 4 * buf.numel()
    ref = _reference(world, data, 3)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    return True


@pytest.mark.parametrize("which", ["grad", "param"])
@pytest.mark.parametrize("size", [1, 2])
def test_contiguous_buffers(world, size, which):
    assert all(world(size, _contiguous, which))


def _remainders():
    """bf16 model + int16 remainders: the fp32 master equals a plain fp32 AdamW on the
    same gradients, bit-exactly reconstructed, and the model holds its bf16 rounding."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model().to(torch.bfloat16)
    # The optimizer starts from the bf16 parameters (remainders zero): so does the reference.
    master = [p.detach().float().clone() for p in model.parameters()]
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01,
                               bucket_cap_mb=TINY, store_params=False,
                               store_param_remainders=True, param_sync_dtype=torch.bfloat16)
    ref_params = [torch.nn.Parameter(m.clone()) for m in master]
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.01)
    data = batches(world, 3, 1, dtype=torch.bfloat16)
    for s in range(3):
        ref_model = make_model().to(torch.bfloat16)
        with torch.no_grad():
            for q, m in zip(ref_model.parameters(), ref_params):
                q.copy_(split_remainder(m.detach())[0])
        grads = []
        for r in range(world):  # each rank's bf16 gradient, averaged in fp32 like the sync
            ref_model.zero_grad()
            loss_fn(ref_model, *data[s][r][0]).float().backward()
            grads.append([q.grad.float() for q in ref_model.parameters()])
        for j, rp in enumerate(ref_params):
            rp.grad = sum(g[j] for g in grads) / world
        ref_opt.step()
        opt.zero_grad()
        loss_fn(model, *data[s][rank][0]).float().backward()
        opt.step()
    sd = opt.state_dict()
    for i, (p, rp) in enumerate(zip(model.parameters(), ref_params)):
        got = sd["state"][i]["param"]
        torch.testing.assert_close(got, rp.detach().cpu(), rtol=RTOL, atol=ATOL)
        # The model's bf16 is exactly the high half of the reconstructed master.
        assert torch.equal(p.detach().cpu(), split_remainder(got)[0])
    return True


def test_remainders(world):
    assert all(world(2, _remainders))


def _byte_sync(param_dtype_name, sync_dtype_name):
    world = dist.get_world_size()
    pdtype, sdtype = getattr(torch, param_dtype_name), getattr(torch, sync_dtype_name)
    model = make_model().to(pdtype)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01,
                               bucket_cap_mb=TINY, param_sync_dtype=sdtype)
    data = batches(world, 2, 1, dtype=pdtype)
    _train(model, opt, data, 2)
    sd = opt.state_dict()
    for i, p in enumerate(model.parameters()):
        value = sd["state"][i]["param"].to(pdtype)
        top = torch.empty(value.shape, dtype=sdtype, device="cpu")
        copy_high_bytes(value, top)
        expected = torch.empty_like(value)
        expand_high_bytes(top, expected)
        assert torch.equal(p.detach().cpu(), expected), i  # top bytes kept, the rest zeroed
    return True


@pytest.mark.parametrize("pdt,sdt", [("float32", "int32"), ("float16", "uint8"),
                                     ("float32", "int16"), ("bfloat16", "int8"),
                                     ("float32", "uint16"), ("float16", "uint32")])
def test_byte_level_param_sync(world, pdt, sdt):
    assert all(world(2, _byte_sync, pdt, sdt))


def _byte_sync_int32_is_exact():
    world = dist.get_world_size()
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01,
                               bucket_cap_mb=TINY, param_sync_dtype=torch.int32)
    data = batches(world, 3, 1)
    _train(model, opt, data, 3)
    for p, q in zip(model.parameters(), _reference(world, data, 3).parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    return True


def test_byte_level_int32_equals_fp32_sync(world):
    assert all(world(2, _byte_sync_int32_is_exact))


def _wide_byte_sync_is_exact(param_dtype_name, sync_dtype_name):
    """An integer param_sync_dtype wider than the parameter carries its bytes in the most
    significant bytes (the rest zero): lossless, the same as syncing the value itself."""
    world = dist.get_world_size()
    pdtype, sdtype = getattr(torch, param_dtype_name), getattr(torch, sync_dtype_name)
    runs = []
    for sync in (sdtype, pdtype):
        model = make_model().to(pdtype)
        opt = DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01,
                                   bucket_cap_mb=TINY, param_sync_dtype=sync)
        _train(model, opt, batches(world, 3, 1, dtype=pdtype), 3)
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    return True


@pytest.mark.parametrize("pdt,sdt", [("float32", "int64"), ("bfloat16", "int32"),
                                     ("float16", "int64"), ("float32", "uint64"),
                                     ("bfloat16", "uint32")])
def test_byte_sync_wider_than_param_is_lossless(world, pdt, sdt):
    assert all(world(2, _wide_byte_sync_is_exact, pdt, sdt))


def _scaled_states(dtype_name, loss_scale):
    """16-bit states with per-fragment scales track fp32 AdamW; returns the max error, and
    that of plain 16-bit state (no scales) for comparison."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, dtype_name)
    errors = []
    for scaled in (True, False):
        model = make_model()
        opt = DistributedFusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01,
                                   bucket_cap_mb=TINY, dtype=dtype, param_sync_dtype=dtype,
                                   grad_sync_dtype=torch.float32, with_scaled_states=scaled)
        data = batches(world, 3, 1)
        for s in range(3):
            opt.zero_grad()
            (loss_fn(model, *data[s][rank][0]) * loss_scale).backward()
            opt.step()
        sd = opt.state_dict()
        ref = make_model()
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
        for s in range(3):
            ropt.zero_grad()
            (sum(loss_fn(ref, *data[s][r][0]) for r in range(world)) * loss_scale / world)\
                .backward()
            ropt.step()
        err = max((sd["state"][i]["param"] - q.detach().cpu()).abs().max().item()
                  for i, q in enumerate(ref.parameters()))
        errors.append(err)
        if scaled:
            for i, q in enumerate(ref.parameters()):
                ref_v = ropt.state[q]["exp_avg_sq"].cpu()
                rtol = 2e-2 if dtype == torch.float16 else 8e-2
                torch.testing.assert_close(sd["state"][i]["exp_avg_sq"], ref_v,
                                           rtol=rtol, atol=1e-30)
    return errors


@pytest.mark.parametrize("dtype_name,tol", [("float16", 5e-3), ("bfloat16", 5e-2)])
def test_scaled_states(world, dtype_name, tol):
    for scaled_err, _ in world(2, _scaled_states, dtype_name, 1.0):
        assert scaled_err < tol


def test_scaled_states_keep_tiny_moments(world):
    # Gradients of 1e-5: exp_avg_sq ~ 1e-13 underflows in plain fp16, not with scales.
    for scaled_err, plain_err in world(2, _scaled_states, "float16", 1e-5):
        assert scaled_err < 5e-3 < plain_err
