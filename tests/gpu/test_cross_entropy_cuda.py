"""The fused cross-entropy kernels (csrc/cross_entropy.cu) on the GPU: against the PyTorch
reference kernels and against F.cross_entropy, vector and scalar row paths, in place and
not, eager and under torch.compile (the GPT example's loss)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpzero.testing import skip_module_without_extension

skip_module_without_extension()

from mpzero import kernels  # noqa: E402
from mpzero.kernels import cuda as kc  # noqa: E402
from mpzero.kernels import reference  # noqa: E402
from mpzero.tensor_parallel import vocab_parallel_cross_entropy  # noqa: E402

DEV = torch.device("cuda")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# (rows, vocab, row stride): 8-aligned rows take the vector path; 1001 columns or a stride
# of 1003 the scalar one; one row wider than a block's threads x 8.
SHAPES = [(5, 64, 64), (9, 1001, 1001), (4, 1000, 1003), (3, 50304, 50304), (2, 8, 16)]


@pytest.fixture(autouse=True)
def _no_distributed():
    if dist.is_initialized():
        pytest.skip("needs a process without torch.distributed")


def _logits(rows, vocab, stride, dtype, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    buf = 5.0 * torch.randn(rows, stride, generator=gen, device=DEV)
    x = buf.to(dtype)[:, :vocab]  # rows of `stride` elements, `vocab` of them used
    x[0, vocab // 2] = 30.0  # a max far above the rest of its row
    if vocab > 2:
        x[-1, 1] = float("-inf")
    target = torch.randint(vocab, (rows,), generator=gen, device=DEV)
    target[0], target[-1] = vocab - 1, -1  # the last id, and a row whose target is elsewhere
    return x, target


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_match_reference(shape, dtype):
    rows, vocab, stride = shape
    x, target = _logits(rows, vocab, stride, dtype, seed=vocab + rows)
    assert kernels.fused_cross_entropy_available(x)
    got, want = kc.cross_entropy_stats(x, target), reference.cross_entropy_stats(x, target)
    # max and target logit exact; the sums in fp32 with another order and __expf.
    torch.testing.assert_close(got[:, 0], want[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(got[:, 2], want[:, 2], rtol=0, atol=0)
    assert got[-1, 2] == 0.0
    torch.testing.assert_close(got[:, 1], want[:, 1], rtol=2e-5, atol=0)
    torch.testing.assert_close(got[:, 3], want[:, 3], rtol=1e-4, atol=1e-3)

    lse = want[:, 0] + want[:, 1].log()
    g = torch.rand(rows, device=DEV) + 0.5
    tol = {torch.float32: dict(rtol=1e-5, atol=1e-7)}.get(dtype, {})  # 16-bit: 1 ulp
    for on, off in ((1.0, 0.0), (0.9, 0.1 / vocab)):
        ref = torch.full_like(x, float("nan"))
        reference.cross_entropy_backward(x, target, lse, g, on, off, ref)
        out = torch.full_like(x, float("nan"))
        kc.cross_entropy_backward(x, target, lse, g, on, off, out)
        torch.testing.assert_close(out, ref, **tol)
        inplace = x.clone()
        kc.cross_entropy_backward(inplace, target, lse, g, on, off, inplace)
        assert torch.equal(inplace, out)  # over the logits: the same values


@pytest.mark.parametrize("dtype", FLOATS)
def test_loss_and_grad_match_torch(dtype):
    gen = torch.Generator(device=DEV).manual_seed(7)
    logits = (4.0 * torch.randn(4, 33, 1000, generator=gen, device=DEV)).to(dtype)
    target = torch.randint(1000, (4, 33), generator=gen, device=DEV)
    weights = torch.rand(4, 33, generator=gen, device=DEV)
    for ls in (0.0, 0.1):
        full = logits.clone().requires_grad_()
        ref = F.cross_entropy(full.float().flatten(0, 1), target.flatten(), reduction="none",
                              label_smoothing=ls).view(4, 33)
        ref.backward(weights)
        for inplace in (False, True):
            x = logits.clone().requires_grad_()
            loss = vocab_parallel_cross_entropy(x * 1 if inplace else x, target, ls,
                                                inplace_backward=inplace)
            torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
            loss.backward(weights)
            # fp32 math, one rounding: within one unit of the 16-bit formats.
            tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else {}
            torch.testing.assert_close(x.grad, full.grad, **tol)


def test_compiled_loss_equals_eager():
    """The GPT example compiles its loss method (``--compile``): the fused kernels run as a
    graph break inside it, with the same values as eagerly."""
    gen = torch.Generator(device=DEV).manual_seed(11)
    logits = (3.0 * torch.randn(2, 64, 512, generator=gen, device=DEV)).bfloat16()
    target = torch.randint(512, (2, 64), generator=gen, device=DEV)

    def loss_fn(x, t):
        return vocab_parallel_cross_entropy(x, t, inplace_backward=True).mean()

    out = {}
    for name, fn in (("eager", loss_fn), ("compiled", torch.compile(loss_fn))):
        x = logits.clone().requires_grad_()
        loss = fn(x * 1, target)
        loss.backward()
        out[name] = (loss.detach(), x.grad)
    assert torch.equal(out["eager"][0], out["compiled"][0])
    assert torch.equal(out["eager"][1], out["compiled"][1])


def test_bad_input_is_refused():
    x = torch.randn(3, 16, device=DEV)
    with pytest.raises(RuntimeError, match="target"):
        kc.cross_entropy_stats(x, torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(RuntimeError, match="last stride 1"):
        kc.cross_entropy_stats(x.t(), torch.zeros(16, dtype=torch.long, device=DEV))
    with pytest.raises(RuntimeError, match="logits must be float32"):
        kc.cross_entropy_stats(x.double(), torch.zeros(3, dtype=torch.long, device=DEV))
