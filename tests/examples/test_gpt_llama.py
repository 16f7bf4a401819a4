"""Llama-style blocks (--position-embedding-type rope, --normalization RMSNorm, --swiglu,
--group-query-attention --num-query-groups, --untie-embeddings-and-output-weights,
--disable-bias-linear): each one TP-equal, TP=2 (and TP=4 for replicated KV groups)
built from one seed gives the TP=1 loss and gradients (fp64 model; the vocab-parallel
cross entropy computes in fp32, so agreement is ~1e-7, bounded here at 1e-6)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from examples.gpt.logging_utils import flops_per_token, num_parameters
from examples.gpt.model import GPT, GPTConfig
from mpzero import parallel_state as ps  # noqa: E402

CFG = dict(vocab_size=128, seq_length=16, num_layers=2, hidden_size=32, num_attention_heads=4)
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             num_query_groups=2, untie_embeddings_and_output_weights=True,
             add_bias_linear=False, ffn_hidden_size=48)
VARIANTS = {
    "rope": dict(position_embedding_type="rope"),
    "rmsnorm": dict(normalization="RMSNorm"),
    "swiglu": dict(swiglu=True),
    "gqa2_split": dict(num_query_groups=2),
    "gqa1_replicated": dict(num_query_groups=1),
    "untied": dict(untie_embeddings_and_output_weights=True),
    "no_linear_bias": dict(add_bias_linear=False),
    "llama": LLAMA,
}


def _gather(t, dim, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def _run(cfg, tp_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(cfg.vocab_size, (2, cfg.seq_length), generator=g)
    targets = torch.randint(cfg.vocab_size, (2, cfg.seq_length), generator=g)
    torch.manual_seed(1234)
    model = GPT(cfg).double()
    loss = model(ids, targets)
    loss.backward()
    group = ps.get_tensor_model_parallel_group()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if getattr(p, "tensor_model_parallel", False):
            grad = _gather(grad, p.partition_dim, group)
        grads[name] = grad
    ps.destroy_model_parallel()
    return float(loss.detach()), grads


def _tp_equal(variants: dict, tp_size: int) -> dict:
    out = {}
    for name, extra in variants.items():
        cfg = GPTConfig(**{**CFG, **extra})
        ref_loss, ref = _run(cfg, 1)
        loss, grads = _run(cfg, tp_size)
        err = max(float((grads[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30))
                  for n in ref)
        out[name] = (abs(loss - ref_loss) / ref_loss, err, sorted(ref) == sorted(grads))
    return out


@pytest.mark.timeout(120)
def test_llama_options_are_tp_equal(world):
    for r in world(2, _tp_equal, VARIANTS, 2):
        for name, (loss_err, grad_err, same_names) in r.items():
            assert loss_err <= 1e-6 and grad_err <= 1e-6 and same_names, (name, r)


@pytest.mark.slow  # real processes or a big world: `make test` only
@pytest.mark.timeout(120)
def test_gqa_tp4(world):
    """2 groups over TP=4: each KV group replicated on two ranks; 4 groups: split."""
    variants = {"gqa4_split_h8": dict(num_query_groups=4, num_attention_heads=8),
                "gqa2_replicated_h8": dict(num_query_groups=2, num_attention_heads=8)}
    for r in world(4, _tp_equal, variants, 4):
        for name, (loss_err, grad_err, same_names) in r.items():
            assert loss_err <= 1e-6 and grad_err <= 1e-6 and same_names, (name, r)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_parameter_count_and_flops(name):
    cfg = GPTConfig(**{**CFG, **VARIANTS[name]})
    model = GPT(cfg)
    assert num_parameters(model.cfg) == sum(p.numel() for p in model.parameters())
    h, L, s = cfg.hidden_size, cfg.num_layers, cfg.seq_length
    # Every matrix but the lookup tables; a tied token table counts as the output layer.
    lookups = ("wpe", "wte") if cfg.untie_embeddings_and_output_weights else ("wpe",)
    matmul = sum(p.numel() for n, p in model.named_parameters()
                 if p.ndim == 2 and not n.startswith(lookups))
    assert flops_per_token(cfg) == 6 * matmul + 12 * L * s * h


def test_rope_model_is_causal_and_has_no_position_table():
    cfg = GPTConfig(**{**CFG, **LLAMA})
    torch.manual_seed(0)
    model = GPT(cfg)
    assert model.wpe is None and model.output_layer is not None
    assert not any(n.endswith(".bias") for n, _ in model.named_parameters())
    ids = torch.randint(cfg.vocab_size, (2, cfg.seq_length))
    changed = ids.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert "rotary.cos" not in model.state_dict() and "blocks.0.attn.rotary.cos" not in \
        model.state_dict()


def test_bad_groups_are_rejected():
    with pytest.raises(ValueError, match="num_query_groups"):
        GPTConfig(**{**CFG, "num_query_groups": 3})
