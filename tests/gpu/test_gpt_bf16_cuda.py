"""The GPT example's ``--bf16`` on CUDA (one GPU, NCCL world 1): DFA with fp32 masters,
``--optimizer adamw`` with MasterWeights and ``--store-param-remainders`` agree and
track fp32 (the CPU test's bounds), inductor-compiled blocks track eager, and the
chunked cross entropy on bf16 logits matches ``F.cross_entropy``."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mpzero.testing import requires_cuda, run_on_world

pytestmark = requires_cuda
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def _setups_on_cuda():
    import test_gpt_bf16

    return test_gpt_bf16._run_setups("cuda", compile_mode="block")


@pytest.mark.timeout(600)
def test_bf16_setups_and_compile_on_cuda():
    import test_gpt_bf16

    out = run_on_world(1, _setups_on_cuda, backend="nccl", timeout=600)
    test_gpt_bf16.check_setups(out[0])


def test_chunked_cross_entropy_bf16_on_cuda():
    from mpzero.tensor_parallel import vocab_parallel_cross_entropy

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (4 * torch.randn(4, 64, 1000, device="cuda", generator=gen)).bfloat16()
    target = torch.randint(1000, (4, 64), device="cuda", generator=gen)
    ref = logits.float().detach().requires_grad_()
    ref_loss = F.cross_entropy(ref.flatten(0, 1), target.flatten(), reduction="none")
    ref_loss.mean().backward()
    mine = logits.detach().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, target, chunk_elements=3 * 1000)
    torch.testing.assert_close(loss.flatten(), ref_loss, rtol=1e-5, atol=1e-5)
    loss.mean().backward()
    assert mine.grad.dtype == torch.bfloat16
    torch.testing.assert_close(mine.grad.float(), ref.grad, rtol=1e-2, atol=1e-6)
