"""--recompute-granularity full|selective (--recompute-num-layers): with dropout > 0
the gradients are bit-equal to no recompute, at TP=2 (attention dropout draws from
the tracked per-rank RNG, which the recomputation must replay) and with sequence
parallelism (residual dropout then draws from it too)."""

from __future__ import annotations

import pytest
import torch

from examples.gpt.model import GPT, GPTConfig
from mpzero import parallel_state as ps  # noqa: E402
from mpzero import tensor_parallel as tp  # noqa: E402

CFG = dict(vocab_size=128, seq_length=16, num_layers=3, hidden_size=32, num_attention_heads=4,
           dropout=0.2)


def _grads(**extra) -> tuple[float, dict]:
    cfg = GPTConfig(**CFG, **extra)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(cfg.vocab_size, (2, cfg.seq_length), generator=g)
    targets = torch.randint(cfg.vocab_size, (2, cfg.seq_length), generator=g)
    tp.model_parallel_manual_seed(1234)
    model = GPT(cfg)
    loss = model(ids, targets)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def _compare(tp_size: int) -> list:
    ps.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    failures = []
    for sp in (False, True):
        ref_loss, ref = _grads(sequence_parallel=sp)
        for extra in ({"recompute_granularity": "selective"},
                      {"recompute_granularity": "full"},
                      {"recompute_granularity": "full", "recompute_num_layers": 1}):
            loss, grads = _grads(sequence_parallel=sp, **extra)
            if loss != ref_loss:
                failures.append((sp, extra, "loss", loss, ref_loss))
            failures += [(sp, extra, n) for n in ref if not torch.equal(grads[n], ref[n])]
    # Without the tracker replay the recomputed attention dropout masks would differ.
    _, plain = _grads(sequence_parallel=False)
    tracker_state = tp.get_rng_tracker().get_states()
    assert tracker_state  # the tracked stream exists and was advanced by the forward
    return failures + ([] if plain else ["no grads"])


@pytest.mark.timeout(120)
def test_recompute_is_bit_equal_with_dropout(world):
    for failures in world(2, _compare, 2):
        assert not failures, failures


def test_checkpoint_replays_the_tracked_rng():
    """tp.checkpoint == no checkpoint; torch's own checkpoint draws a new tracked mask."""
    tp.model_parallel_manual_seed(7)
    x = torch.randn(64, requires_grad=True)

    def f(t):
        with tp.get_rng_tracker().fork():
            return torch.nn.functional.dropout(t, 0.5, True) * t

    results = {}
    for name, run in (("plain", f), ("tp", lambda t: tp.checkpoint(f, t)),
                      ("torch", lambda t: torch.utils.checkpoint.checkpoint(
                          f, t, use_reentrant=False))):
        tp.model_parallel_manual_seed(7)
        x.grad = None
        run(x).sum().backward()
        results[name] = x.grad.clone()
    assert torch.equal(results["tp"], results["plain"])
    assert not torch.equal(results["torch"], results["plain"])


def test_recompute_config_is_checked():
    with pytest.raises(ValueError, match="recompute_granularity"):
        GPTConfig(recompute_granularity="everything")
