"""vocab_parallel_cross_entropy on gloo worlds against F.cross_entropy on the full logits."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpzero import parallel_state as ps
from mpzero.tensor_parallel import vocab_parallel_cross_entropy

VOCAB = 16
FP32 = {"rtol": 1e-5, "atol": 1e-6}


def _data(shift=0.0):
    gen = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(2, 5, VOCAB, generator=gen) + shift
    # The first and last id of each block at tp=4 (so of every block at tp 1, 2, 4).
    target = torch.tensor([[0, 15, 4, 7, 8], [11, 12, 3, 5, 14]])
    weights = torch.rand(2, 5, generator=gen)  # a per-token gradient of the loss
    return logits, target, weights


def _ref(logits, target, weights, label_smoothing):
    full = logits.detach().clone().requires_grad_()
    loss = F.cross_entropy(full.float().flatten(0, -2), target.flatten(), reduction="none",
                           label_smoothing=label_smoothing).view(target.shape)
    loss.backward(weights)
    return loss.detach(), full.grad


def _check_cross_entropy(tp):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    r, width = ps.get_tensor_model_parallel_rank(), VOCAB // tp
    cols = slice(r * width, (r + 1) * width)
    logits, target, weights = _data()
    # Targets fall in every rank's vocabulary block.
    assert set((target // width).flatten().tolist()) == set(range(tp))
    for ls in (0.0, 0.1, 1.0):
        for dtype, grad_tol in ((torch.float32, FP32), (torch.float64, FP32),
                                (torch.bfloat16, {"rtol": 1e-2, "atol": 1e-3})):
            full = logits.to(dtype)
            ref_loss, ref_grad = _ref(full, target, weights, ls)
            local = full[..., cols].clone().requires_grad_()
            loss = vocab_parallel_cross_entropy(local, target, label_smoothing=ls)
            assert loss.dtype == torch.float32 and loss.shape == target.shape
            torch.testing.assert_close(loss, ref_loss.float(), **FP32)
            loss.backward(weights)
            assert local.grad.dtype == dtype
            torch.testing.assert_close(local.grad, ref_grad[..., cols], **grad_tol)
            if tp > 1:
                other = ref_grad[..., (r + 1) % tp * width:][..., :width]
                assert not torch.allclose(local.grad, other, **grad_tol)
    # Label smoothing changes the loss (so the branch above is really exercised).
    local = logits[..., cols]
    assert not torch.allclose(vocab_parallel_cross_entropy(local, target, 0.1),
                              vocab_parallel_cross_entropy(local, target), **FP32)

    # Large logits stay finite (the max is subtracted across the whole vocabulary).
    big, target, weights = _data(shift=1e4)
    big[0, 0, 0] += 50.0  # one rank's max differs from the others'
    ref_loss, ref_grad = _ref(big, target, weights, 0.0)
    local = big[..., cols].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target)
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-3)  # 1e4 loses fp32 digits
    loss.backward(weights)
    torch.testing.assert_close(local.grad, ref_grad[..., cols], rtol=1e-3, atol=1e-3)

    # 1-D tokens; backward twice through one graph (the saved softmax is not consumed).
    logits, target, weights = _data()
    local = logits.view(-1, VOCAB)[:, cols].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target.flatten())
    loss.backward(weights.flatten(), retain_graph=True)
    first = local.grad.clone()
    loss.backward(weights.flatten())
    torch.testing.assert_close(local.grad, 2 * first, rtol=1e-6, atol=0)

    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_cross_entropy(local, target)
    return True


@pytest.mark.parametrize("world_size,tp", [(1, 1), (2, 2), (4, 4), (4, 2)])
def test_matches_full_cross_entropy(world, world_size, tp):
    assert all(world(world_size, _check_cross_entropy, tp))


def test_single_process():
    if dist.is_initialized():
        pytest.skip("needs a process without torch.distributed")
    logits, target, weights = _data()
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, target),
                               _ref(logits, target, weights, 0.0)[0], **FP32)


# -- the chunked path: chunks of a few tokens, bf16 logits, what is kept for backward

BIG_VOCAB = 256
BF16_GRAD = {"rtol": 1e-2, "atol": 1e-4}  # two bf16 roundings: stored gradient, product


def _check_chunked(tp):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    r, width = ps.get_tensor_model_parallel_rank(), BIG_VOCAB // tp
    cols = slice(r * width, (r + 1) * width)
    gen = torch.Generator().manual_seed(1)
    logits = 4.0 * torch.randn(3, 7, BIG_VOCAB, generator=gen)
    target = torch.randint(BIG_VOCAB, (3, 7), generator=gen)
    weights = torch.rand(3, 7, generator=gen)
    for ls in (0.0, 0.1):
        for dtype, grad_tol in ((torch.float32, FP32), (torch.bfloat16, BF16_GRAD)):
            full = logits.to(dtype)
            ref_loss, ref_grad = _ref(full, target, weights, ls)
            # 1 token, 5 tokens (chunks straddle the batch rows) and everything at once.
            for tokens_per_chunk in (1, 5, 10**6):
                local = full[..., cols].clone().requires_grad_()
                saved = []

                def pack(t, saved=saved):
                    saved.append((t.dtype, t.numel()))
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = vocab_parallel_cross_entropy(
                        local, target, ls, chunk_elements=tokens_per_chunk * width)
                torch.testing.assert_close(loss, ref_loss.float(), **FP32)
                # Kept for backward: one gradient in the logits' dtype, no fp32 softmax.
                assert saved == [(dtype, local.numel())], saved
                loss.backward(weights)
                assert local.grad.dtype == dtype
                torch.testing.assert_close(local.grad, ref_grad[..., cols], **grad_tol)
    # No gradient wanted: nothing is computed or kept (the loss is the same).
    local = logits[..., cols].clone().requires_grad_()
    with torch.no_grad():
        torch.testing.assert_close(
            vocab_parallel_cross_entropy(local, target, chunk_elements=width),
            vocab_parallel_cross_entropy(local.detach(), target), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="chunk_elements"):
        vocab_parallel_cross_entropy(local, target, chunk_elements=0)
    return True


@pytest.mark.parametrize("world_size,tp", [(1, 1), (2, 2)])
def test_chunked_bf16_matches_full_cross_entropy(world, world_size, tp):
    assert all(world(world_size, _check_chunked, tp))



def _stored_gradient(dtype_name):
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(3)
    logits = (4.0 * torch.randn(6, 257, generator=gen)).to(dtype)
    target = torch.randint(257, (6,), generator=gen)
    target[2] = 257  # outside the vocabulary: its row keeps the plain softmax
    m = logits.amax(-1).float()
    exp = torch.sub(logits, m.unsqueeze(-1)).float().exp()
    p = exp / exp.sum(-1, keepdim=True)
    inside = target < 257
    p[torch.arange(6)[inside], target[inside]] -= 1.0
    expected = p.to(dtype)
    for rows in (1, 4, 6):
        x = logits.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(x, target, chunk_elements=rows * 257)
        loss.backward(torch.ones_like(loss))
        assert torch.equal(x.grad, expected), rows
    ps.destroy_model_parallel()
    return True


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_stored_gradient_is_the_rounded_fp32_gradient(world, dtype):
    """TP=1 without label smoothing the softmax is rounded straight into the stored
    gradient and the target entries rewritten: bit for bit the fp32 ``softmax -
    onehot`` (computed as the chunk loop does) rounded once to the logits' dtype, for
    chunks that split the tokens and for an out-of-range target (no one-hot)."""
    assert all(world(1, _stored_gradient, dtype))


# -- the fused path (CUDA kernels; here the same algorithm with the reference kernels)

def _check_fused(tp):
    """``_fused_cross_entropy`` (the path CUDA logits take; on CPU it runs the reference
    kernels, so this checks the statistics' combination over TP ranks, the loss and the
    backward against F.cross_entropy on the full logits)."""
    from mpzero.tensor_parallel.cross_entropy import _fused_cross_entropy

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    group = ps.get_tensor_model_parallel_group()
    r, width = ps.get_tensor_model_parallel_rank(), BIG_VOCAB // tp
    cols = slice(r * width, (r + 1) * width)
    gen = torch.Generator().manual_seed(2)
    logits = 4.0 * torch.randn(3, 7, BIG_VOCAB, generator=gen)
    logits[0, 0, 5] += 40.0  # one rank's max far above the others' (the rescaled sums)
    logits[1, 2, -3] = float("-inf")  # a vocabulary entry that can never be predicted
    target = torch.randint(BIG_VOCAB, (3, 7), generator=gen)
    target[0, 0], target[2, 6] = 0, BIG_VOCAB - 1  # the first and last id
    weights = torch.rand(3, 7, generator=gen)
    for ls in (0.0, 0.1):
        for dtype, grad_tol in ((torch.float32, FP32), (torch.bfloat16, BF16_GRAD)):
            full = logits.to(dtype)
            ref_loss, ref_grad = _ref(full, target, weights, ls)
            for inplace in (False, True):
                local = full[..., cols].clone().requires_grad_()
                x = local * 1 if inplace else local  # the function may overwrite x
                loss = _fused_cross_entropy(x, target, ls, group, inplace)
                torch.testing.assert_close(loss, ref_loss.float(), **FP32)
                loss.backward(weights)
                assert local.grad.dtype == dtype
                torch.testing.assert_close(local.grad, ref_grad[..., cols], **grad_tol)
                if inplace:  # the gradient was written over the logits
                    torch.testing.assert_close(x.detach(), local.grad, rtol=0, atol=0)
    # In place: a second backward through the same loss is refused, not wrong.
    x = logits[..., cols].clone().requires_grad_()
    loss = _fused_cross_entropy(x * 1, target, 0.0, group, True)
    loss.backward(weights, retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace_backward=False"):
        loss.backward(weights)
    # Not in place: twice through one graph doubles the gradient.
    x = logits[..., cols].clone().requires_grad_()
    loss = _fused_cross_entropy(x, target, 0.0, group, False)
    loss.backward(weights, retain_graph=True)
    first = x.grad.clone()
    loss.backward(weights)
    torch.testing.assert_close(x.grad, 2 * first, rtol=1e-6, atol=0)
    # No gradient wanted: nothing kept for backward.
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.no_grad():
            _fused_cross_entropy(x, target, 0.0, group, False)
    assert saved == []
    return True


@pytest.mark.parametrize("world_size,tp", [(1, 1), (2, 2), (4, 4)])
def test_fused_path_matches_full_cross_entropy(world, world_size, tp):
    assert all(world(world_size, _check_fused, tp))
