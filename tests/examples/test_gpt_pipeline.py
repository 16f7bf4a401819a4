"""Pipeline parallelism of the GPT example (examples/gpt/pipeline.py) equals PP=1.

Each layout trains a tiny GPT for a few iterations with the 1F1B schedule and
DistributedFusedAdam per stage (clipping active, several optimizer buckets, wte
split over buckets); the reference is the unsplit model from the same seed in
this (single) process with ``torch.optim.AdamW`` and ``clip_grad_norm_`` over
the same global batches. Loss and grad norm per iteration, and every updated
weight (the last stage's ``wte`` copy too), agree within 1e-5 (fp32, relative
for loss and norm, absolute + relative for weights).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "gpt"))

import pipeline  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from optim import build_optimizer  # noqa: E402

from mpzero import parallel_state as ps  # noqa: E402
from mpzero import tensor_parallel as tp  # noqa: E402
from mpzero.testing import run_on_world  # noqa: E402

CFG = dict(vocab_size=128, seq_length=16, num_layers=4, hidden_size=32, num_attention_heads=4)
SEED, STEPS, MICRO = 1234, 3, 2
OPT = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
CLIP = 0.5
TOL = 1e-5


def _global_batches(global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(CFG["vocab_size"], (global_batch, CFG["seq_length"]), generator=g)
        targets = torch.randint(CFG["vocab_size"], (global_batch, CFG["seq_length"]),
                                generator=g)
        out.append((ids, targets))
    return out


def _train_pipeline(tp_size: int, pp_size: int, global_batch: int) -> dict:
    """On each rank: train its stage; return losses, norms and its weights by global name."""
    torch.set_num_threads(1)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                 pipeline_model_parallel_size=pp_size)
    tp.model_parallel_manual_seed(SEED)
    model = pipeline.build_stage(GPTConfig(**CFG))
    optimizer = build_optimizer("dfa", model, device=torch.device("cpu"),
                                bucket_cap_mb=0.01, **OPT)
    tied = pipeline.tie_embedding(model, optimizer)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = global_batch // dp
    losses, norms = [], []
    for ids, targets in _global_batches(global_batch):
        mine = slice(dp_rank * per, (dp_rank + 1) * per)  # data.dp_slice's share
        ids, targets = ids[mine], targets[mine]
        batches = [(ids[i:i + MICRO], targets[i:i + MICRO]) for i in range(0, per, MICRO)]
        loss, norm = pipeline.train_step(model, optimizer, batches, tied, clip_grad=CLIP)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=ps.get_data_parallel_group())
        losses.append(float(loss))  # the global batch's mean, as the training log's
        norms.append(float(norm))
    weights = {}
    for name, p in model.named_parameters():
        if name.startswith("blocks."):
            local, rest = name[len("blocks."):].split(".", 1)
            name = f"blocks.{model.layers[int(local)]}.{rest}"
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        weights[name] = (p.detach().clone(), dim)
    return {"losses": losses, "norms": norms, "weights": weights,
            "tp": (ps.get_tensor_model_parallel_rank(), tp_size)}


def _reference(global_batch: int) -> dict:
    """The unsplit model (PP=1, TP=1, one process): AdamW, same micro-batches and clipping."""
    tp.model_parallel_manual_seed(SEED)
    model = GPT(GPTConfig(**CFG))
    optimizer = torch.optim.AdamW(model.param_groups(OPT["weight_decay"]), **OPT)
    losses, norms = [], []
    for ids, targets in _global_batches(global_batch):
        optimizer.zero_grad()
        n = global_batch // MICRO
        step_losses = []
        for i in range(0, global_batch, MICRO):
            loss = model(ids[i:i + MICRO], targets[i:i + MICRO])
            (loss / n).backward()
            step_losses.append(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        losses.append(float(torch.stack(step_losses).mean()))
    return {"losses": losses, "norms": norms,
            "weights": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(global_batch: int) -> dict:
        if global_batch not in cache:
            cache[global_batch] = _reference(global_batch)
        return cache[global_batch]

    return get


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,tp_size,pp_size,global_batch", [
    (2, 1, 2, 8),  # 4 micro-batches over 2 stages
    (4, 1, 4, 8),  # 4 micro-batches over 4 stages (stage 0 warms up 3)
    (4, 1, 4, 4),  # 2 micro-batches over 4 stages: fewer than the stages, no steady state
    (4, 2, 2, 8),  # PP=2 x TP=2
    (4, 1, 2, 8),  # PP=2 x DP=2: 2 micro-batches per data-parallel rank
], ids=["pp2", "pp4", "pp4-m2", "pp2-tp2", "pp2-dp2"])
def test_pipeline_equals_unsplit_model(reference, world, tp_size, pp_size, global_batch):
    ref = reference(global_batch)
    results = run_on_world(world, _train_pipeline, tp_size, pp_size, global_batch, timeout=90)
    seen = set()
    for rank, res in enumerate(results):
        assert res["losses"] == pytest.approx(ref["losses"], rel=TOL), rank
        assert res["norms"] == pytest.approx(ref["norms"], rel=TOL), rank
        tp_rank, tp_n = res["tp"]
        for name, (w, dim) in res["weights"].items():
            want = ref["weights"][name]
            if dim is not None:
                want = want.chunk(tp_n, dim=dim)[tp_rank]
            torch.testing.assert_close(w, want, rtol=TOL, atol=TOL, msg=f"{name} rank {rank}")
            seen.add(name)
    assert seen == set(ref["weights"])  # every weight is held by some stage
    # The ranks of the last stage hold an updated copy of wte equal to the first stage's.
    assert sum("wte.weight" in r["weights"] for r in results) == 2 * world // pp_size

