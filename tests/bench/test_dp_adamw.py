"""bench/dp_adamw.py, the plain data-parallel AdamW on fp32 master copies that the GPT
example's DistributedFusedAdam is compared with, on the GPT example's ``--bf16`` setups
(2-rank gloo world; the helpers are tests/examples/test_gpt_bf16.py's): the same losses
and grad norms as DFA, fp32 gradient accumulation in its masters, bit-exact resume, and
masters that follow a model loaded without its optimizer. Slow tier (`make test`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import test_gpt_bf16 as bf16  # noqa: E402

from mpzero import parallel_state as ps  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_bf16_adamw_baseline_agrees_with_dfa(world):
    for r in world(2, bf16._run_setups, keys=("dfa", "adamw")):
        bf16.check_setups(r)


@pytest.mark.timeout(120)
def test_accumulation_sums_bf16_gradients_in_fp32_masters(world):
    for r in world(2, bf16._accumulation, "adamw"):
        bf16.check_accumulation(r, "adamw")


@pytest.mark.timeout(240)
def test_bf16_resume_is_bit_exact(world, tmp_path):
    # The torch format: torch_dist would fall back to it for this optimizer.
    for r in world(2, bf16._resume, str(tmp_path / "ckpt"), "adamw", False, "torch", False):
        assert r["resumed"] == r["straight"]  # losses and grad norms, bit for bit
        assert r["same"] == r["all"]


def _reload_masters() -> bool:
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model, opt = bf16._build("adamw", True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # as if a checkpoint's model had been loaded without the optimizer
    opt.reload_model_params()
    for p in model.parameters():
        m = opt.masters.master_of(p)
        assert m.dtype == torch.float32 and torch.equal(m, p.float())
    return True


def test_adamw_masters_follow_a_model_loaded_without_optimizer(world):
    assert all(world(1, _reload_masters))
