"""TP layers and RNG tracker on a CUDA device (single process, TP=1); skipped without CUDA."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mpzero.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    vocab_parallel_cross_entropy,
)
from mpzero.testing import requires_cuda

pytestmark = [requires_cuda, pytest.mark.cuda]


@pytest.fixture(autouse=True)
def _no_distributed():
    if dist.is_initialized():
        pytest.skip("needs a process without torch.distributed")


def _build(device, dtype=None):
    torch.manual_seed(42)
    return [ColumnParallelLinear(16, 32, device=device, params_dtype=dtype),
            RowParallelLinear(32, 16, device=device, params_dtype=dtype),
            VocabParallelEmbedding(64, 16, device=device, params_dtype=dtype)]


def test_cuda_init_equals_cpu_init():
    for dtype in (torch.float32, torch.bfloat16):
        for cpu, gpu in zip(_build("cpu", dtype), _build("cuda", dtype)):
            assert gpu.weight.is_cuda and gpu.weight.dtype == dtype
            assert torch.equal(gpu.weight.cpu(), cpu.weight)


def test_cuda_layers_match_torch():
    col, row, emb = _build("cuda")
    ref_col, ref_row = nn.Linear(16, 32, device="cuda"), nn.Linear(32, 16, device="cuda")
    with torch.no_grad():
        ref_col.weight.copy_(col.weight), ref_col.bias.copy_(col.bias)
        ref_row.weight.copy_(row.weight), ref_row.bias.copy_(row.bias)
    ids = torch.randint(0, 64, (3, 5), device="cuda")
    x = emb(ids)
    torch.testing.assert_close(x, F.embedding(ids, emb.weight))
    torch.testing.assert_close(row(col(x)[0])[0], ref_row(ref_col(x)), rtol=1e-5, atol=1e-6)
    logits = torch.randn(3, 5, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 64, (3, 5), device="cuda")
    loss = vocab_parallel_cross_entropy(logits, target)
    ref = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="none")
    torch.testing.assert_close(loss, ref.view(3, 5), rtol=1e-5, atol=1e-6)
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and logits.grad.is_cuda


def _cuda_stream(seed, n, skip=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    torch.rand(skip, generator=gen, device="cuda")
    return torch.rand(n, generator=gen, device="cuda")


def test_cuda_rng_tracker():
    model_parallel_cuda_manual_seed(5)
    tracker = get_rng_tracker()
    assert torch.equal(torch.rand(4, device="cuda"), _cuda_stream(5, 4))
    with tracker.fork():
        assert torch.equal(torch.rand(4, device="cuda"), _cuda_stream(5 + 2718, 4))
    assert torch.equal(torch.rand(4, device="cuda"), _cuda_stream(5, 4, skip=4))
    with tracker.fork():
        assert torch.equal(torch.rand(4, device="cuda"), _cuda_stream(5 + 2718, 4, skip=4))
        inside = F.dropout(torch.ones(256, device="cuda"), 0.5)
    assert not torch.equal(F.dropout(torch.ones(256, device="cuda"), 0.5), inside)
    # The CPU stream is tracked alongside the CUDA one.
    model_parallel_cuda_manual_seed(5)
    with tracker.fork():
        cpu = torch.rand(4)
    gen = torch.Generator().manual_seed(5 + 2718)
    assert torch.equal(cpu, torch.rand(4, generator=gen))
