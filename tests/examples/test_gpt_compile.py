"""``--compile-mode block`` compiles the loss too, and ``--attention-backend`` picks the
SDPA kernel.

The compiled loss (``GPT.cross_entropy``) must give the eager loss and gradients (the
``aot_eager`` backend traces the same autograd graph, so agreement is to rounding:
bounded at 1e-6), trace without graph breaks at TP=1, and stay correct at TP=2, where
its collectives run inside the compiled function.
"""

from __future__ import annotations

import pytest
import torch

from examples.gpt import compiling, config
from examples.gpt.model import GPT, GPTConfig
from mpzero import parallel_state as ps  # noqa: E402

CFG = dict(vocab_size=128, seq_length=16, num_layers=2, hidden_size=32, num_attention_heads=4)
TOL = dict(rtol=1e-6, atol=1e-6)


def _compiled_loss_matches_eager(tp: int):
    import torch._dynamo
    from torch._dynamo.utils import counters

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = GPT(GPTConfig(**CFG))
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    units = compiling.compile_model(model, "block", backend="aot_eager")
    assert units == list(model.blocks)  # the optimizer's hook units: the blocks only
    assert getattr(model.cross_entropy, "_torchdynamo_orig_callable", None) is not None
    ids = torch.randint(CFG["vocab_size"], (3, CFG["seq_length"] + 1),
                        generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        losses = []
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
            loss = m(ids[:, :-1], ids[:, 1:])
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], **TOL)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():  # evaluation: no gradient kept, another batch size
        torch.testing.assert_close(model(ids[:2, :-1], ids[:2, 1:]),
                                   eager(ids[:2, :-1], ids[:2, 1:]), **TOL)
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    ps.destroy_model_parallel()
    return breaks


@pytest.mark.slow
def test_block_mode_compiles_the_loss(world):
    (breaks,) = world(1, _compiled_loss_matches_eager, 1, timeout=180)
    assert breaks == 0


@pytest.mark.slow
def test_block_mode_compiled_loss_tp2(world):
    world(2, _compiled_loss_matches_eager, 2, timeout=240)  # graph breaks allowed here


def _attention_backends():
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    ids = torch.randint(CFG["vocab_size"], (2, CFG["seq_length"] + 1),
                        generator=torch.Generator().manual_seed(2))
    out = {}
    for backend in ("math", "auto", "flash"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**CFG, attention_backend=backend))
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        out[backend] = (loss.detach(), [p.grad for p in model.parameters()])
    for backend in ("auto", "flash"):
        torch.testing.assert_close(out[backend][0], out["math"][0], rtol=1e-5, atol=1e-6)
        for g, ref in zip(out[backend][1], out["math"][1]):
            torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6)
    def gpt(argv):
        return config.parse_args(argv).updated(padded_vocab_size=256).gpt()

    assert gpt(["--attention-backend", "cudnn"]).attention_backend == "cudnn"
    default = gpt([])
    assert default.attention_backend == "auto"
    ps.destroy_model_parallel()
    return True


def test_attention_backends_agree(world):
    """Every backend that runs on the CPU gives the math reference's loss and gradients;
    the example's flag reaches the model config."""
    assert all(world(1, _attention_backends, timeout=120))


def test_attention_backend_errors():
    with pytest.raises(ValueError, match="attention_backend"):
        GPTConfig(**CFG, attention_backend="fa3")
    with pytest.raises(SystemExit):
        config.parse_args(["--attention-backend", "fa3"])
