"""What the one-GPU 7B recipe (examples/gpt/recipes/llama2-7b-1gpu.sh) holds a parameter,
counted on the CPU at a small Llama shape with the same options: bf16 parameters and
gradients, the master as parameter + int16 remainder, bf16 moments with per-piece scales,
two micro-batches a step. Every live tensor's storage is counted (once per storage):
after ``step()`` 2 (parameters) + 2 (gradient buckets) + 2 (remainders) + 4 (moments) =
10 bytes a parameter, and 8 after ``zero_grad()``; a few hundredths on top for the scales,
RoPE's tables and the like. The activations are gone by then."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # `make test` only


def _live_bytes() -> int:
    """Bytes of every live tensor's storage (once per storage). Tensors without real
    storage that earlier tests in this process may have left (fake tensors of a compile)
    do not count."""
    storages = {}
    for obj in gc.get_objects():
        # Plain tensors and parameters only: a subclass (a fake or functional tensor an
        # earlier compile left) has no storage of its own.
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and not obj.is_meta:
            try:
                s = obj.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
            except (RuntimeError, NotImplementedError):
                continue
    return sum(storages.values())


def _bytes_a_parameter() -> tuple[float, float]:
    import warnings

    from examples.gpt import optim, precision
    from examples.gpt.model import GPT, GPTConfig
    from mpzero import parallel_state as ps

    warnings.simplefilter("ignore", FutureWarning)  # gc walks deprecated torch aliases
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    gc.collect()
    base = _live_bytes()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=4096, seq_length=128, num_layers=4, hidden_size=512,
                    num_attention_heads=8, ffn_hidden_size=1408, swiglu=True,
                    normalization="RMSNorm", position_embedding_type="rope",
                    untie_embeddings_and_output_weights=True, add_bias_linear=False,
                    recompute_granularity="full")
    model = GPT(cfg)
    precision.cast_parameters(model, torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    opt = optim.build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95),
                                eps=1e-8, device=torch.device("cpu"),
                                grad_sync_dtype=torch.bfloat16, store_param_remainders=True,
                                scaled_moments=True)
    tokens = torch.randint(cfg.vocab_size, (2, 2, cfg.seq_length + 1))
    for m in range(2):
        with optim.no_sync(opt) if m == 0 else contextlib.nullcontext():
            model(tokens[m, :, :-1], tokens[m, :, 1:]).backward()
    opt.clip_grad_norm(1.0)
    opt.step()
    gc.collect()
    after_step = (_live_bytes() - base) / n
    opt.zero_grad()
    gc.collect()
    after_zero = (_live_bytes() - base) / n
    ps.destroy_model_parallel()
    return after_step, after_zero


def test_the_7b_recipe_mode_holds_ten_bytes_a_parameter(world):
    ((after_step, after_zero),) = world(1, _bytes_a_parameter)
    assert 10.0 <= after_step < 10.1, after_step
    assert 8.0 <= after_zero < 8.1, after_zero
