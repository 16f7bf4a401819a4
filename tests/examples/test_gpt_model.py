"""The GPT example's model: TP=2 equals TP=1 (loss, logits, every gradient), and helpers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from examples.gpt.config import padded_vocab_size
from examples.gpt.logging_utils import flops_per_token, num_parameters
from examples.gpt.model import GPT, GPTConfig
from mpzero import parallel_state as ps  # noqa: E402
from mpzero import tensor_parallel as tp
from mpzero.testing import autograd_node_names

CFG = dict(vocab_size=256, seq_length=16, num_layers=2, hidden_size=32, num_attention_heads=4)


def _batch(cfg: GPTConfig, batch: int = 3):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(cfg.vocab_size, (batch, cfg.seq_length), generator=g)
    targets = torch.randint(cfg.vocab_size, (batch, cfg.seq_length), generator=g)
    return ids, targets


def _run(model: GPT, ids, targets):
    logits = model(ids)  # (B, T, V/tp)
    loss = model(ids, targets)
    loss.backward()
    return loss.detach(), logits.detach()


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def _tp_vs_single(dtype_name: str, tp_size: int) -> dict:
    """On every rank: the TP=1 model, then the TP=`tp_size` one from the same seed."""
    dtype = getattr(torch, dtype_name)
    cfg = GPTConfig(**CFG)
    ids, targets = _batch(cfg)

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(1234)
    ref = GPT(cfg).to(dtype)
    ref_loss, ref_logits = _run(ref, ids, targets)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    group = ps.get_tensor_model_parallel_group()
    torch.manual_seed(1234)
    model = GPT(cfg).to(dtype)
    loss, logits = _run(model, ids, targets)
    out = {"loss": (float(loss), float(ref_loss)),
           "logits": float((_gather(logits, -1, group) - ref_logits).norm() / ref_logits.norm()),
           "param": {}, "grad": {}, "sharded": []}
    for name, p in model.named_parameters():
        full_p, full_g = p.detach(), p.grad
        if getattr(p, "tensor_model_parallel", False):
            out["sharded"].append(name)
            full_p = _gather(full_p, p.partition_dim, group)
            full_g = _gather(full_g, p.partition_dim, group)
        out["param"][name] = float((full_p - ref_params[name]).abs().max())
        denom = ref_grads[name].norm().clamp_min(1e-30)
        out["grad"][name] = float((full_g - ref_grads[name]).norm() / denom)
    return out


# vocab_parallel_cross_entropy does its math in fp32 whatever the logits' dtype, so
# even the fp64 model agrees only to ~1e-9 (relative to each gradient's norm).
@pytest.mark.parametrize("dtype_name,tol", [("float64", 1e-7), ("float32", 1e-5)])
def test_tp2_equals_tp1(world, dtype_name, tol):
    results = world(2, _tp_vs_single, dtype_name, 2)
    for rank, r in enumerate(results):
        loss, ref = r["loss"]
        assert abs(loss - ref) <= tol * abs(ref), (rank, loss, ref)
        assert r["logits"] <= tol, (rank, r["logits"])
        # Shards are slices of the same full initialization: bit-identical weights.
        assert max(r["param"].values()) == 0.0, (rank, r["param"])
        bad = {n: e for n, e in r["grad"].items() if not e <= tol}
        assert not bad, (rank, bad)
        # The split really happened: heads, MLP features and the vocabulary are sharded.
        assert {"wte.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight",
                "blocks.1.mlp.fc.weight", "blocks.1.mlp.proj.weight"} <= set(r["sharded"])
        assert "wpe.weight" not in r["sharded"] and "ln_f.weight" not in r["sharded"]


def test_single_process_model_trains_and_is_causal():
    cfg = GPTConfig(**CFG)
    torch.manual_seed(0)
    model = GPT(cfg)
    ids, targets = _batch(cfg)
    with torch.no_grad():
        logits = model(ids)
        changed = ids.clone()
        changed[:, 10:] = (changed[:, 10:] + 1) % cfg.vocab_size
        logits2 = model(changed)
    assert logits.shape == (3, cfg.seq_length, cfg.vocab_size)
    torch.testing.assert_close(logits[:, :10], logits2[:, :10], rtol=0, atol=0)
    assert not torch.allclose(logits[:, 10:], logits2[:, 10:])
    # Initial loss is close to uniform over the vocabulary.
    with torch.no_grad():
        assert abs(float(model(ids, targets)) - torch.log(torch.tensor(256.0)).item()) < 0.1
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=3e-3)
    first = None
    for _ in range(30):
        opt.zero_grad()
        loss = model(ids, targets)
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < 0.5 * first


def test_param_groups_exclude_bias_norm_and_embeddings():
    model = GPT(GPTConfig(**CFG))
    decay, no_decay = model.param_groups(0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decay_names = {names[id(p)] for p in decay["params"]}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert decay_names.isdisjoint(no_decay_names)
    assert decay_names | no_decay_names == set(names.values())
    for n in no_decay_names:
        assert n.endswith(".bias") or ".ln_" in n or n.startswith(("ln_f", "wte", "wpe")), n
    assert decay_names == {f"blocks.{i}.{m}.weight" for i in range(2)
                           for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
    assert "blocks.0.ln_1.weight" in no_decay_names and "blocks.0.attn.qkv.bias" in no_decay_names


def test_parameter_count_and_flops():
    cfg = GPTConfig(**CFG)
    model = GPT(cfg)
    assert num_parameters(model.cfg) == sum(p.numel() for p in model.parameters())
    h, L, s, V = cfg.hidden_size, cfg.num_layers, cfg.seq_length, cfg.vocab_size
    matmul_params = L * (12 * h * h) + V * h  # QKV + proj + 2 MLP matrices, tied head
    assert flops_per_token(cfg) == 6 * matmul_params + 12 * L * s * h


def test_padded_vocab_is_the_same_for_every_tp_size():
    assert {padded_vocab_size(257, tp) for tp in (1, 2, 4, 8)} == {384}
    assert padded_vocab_size(4096, 2) == 4096
    assert padded_vocab_size(100, 3) % 3 == 0


def test_heads_must_divide_over_tp():
    with pytest.raises(ValueError, match="hidden_size"):
        GPTConfig(hidden_size=30, num_attention_heads=4)


def test_attention_is_causal_sdpa_without_a_mask(monkeypatch):
    """The default path hands SDPA ``is_causal=True`` and no mask, so it may pick its
    flash / memory-efficient kernels (an explicit mask rules flash out)."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((args, kwargs))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    cfg = GPTConfig(**CFG)
    ids, targets = _batch(cfg)
    GPT(cfg)(ids, targets).backward()
    assert len(calls) == cfg.num_layers
    for args, kwargs in calls:
        assert args == () and kwargs.get("is_causal") is True, kwargs
        assert kwargs.get("attn_mask") is None and "attn_mask" not in kwargs


def test_openai_gelu_is_the_tanh_approximation():
    """``openai_gelu`` (``--openai-gelu``): the MLP applies GELU's tanh approximation, the
    rest of the model is unchanged (same weights from one seed)."""
    x = torch.randn(2, 5, CFG["hidden_size"], generator=torch.Generator().manual_seed(3))
    out = {}
    for flag in (False, True):
        torch.manual_seed(0)
        mlp = GPT(GPTConfig(**CFG, openai_gelu=flag)).blocks[0].mlp
        with torch.no_grad():
            out[flag] = mlp(x)
            h = mlp.fc(x)[0]
            want = mlp.proj(torch.nn.functional.gelu(h, approximate="tanh" if flag else
                                                     "none"))[0]
        torch.testing.assert_close(out[flag], want, rtol=0, atol=0)
    assert not torch.equal(out[False], out[True])


def _fusion_vs_plain(tp_size: int, extra: dict | None = None) -> bool:
    """The GPT with ``gradient_accumulation_fusion`` under DistributedFusedAdam (fp32
    buffer, 3 micro-batches) trains like the same GPT without it: the TP linear
    weights get no ``.grad``, their gradients go straight into the optimizer's buffer.
    ``extra["fused_mlp"]``: the fused run's MLP is also the GELU-in-GEMM one."""
    from examples.gpt import optim

    extra = dict(extra or {})
    fused_mlp = extra.pop("fused_mlp", False)  # the fused run also has the GELU-in-GEMM MLP
    ps.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    params = {}
    for fusion in (True, False):
        cfg = GPTConfig(**CFG, **extra)
        torch.manual_seed(1234)
        model = GPT(cfg)
        mlp_mode = "on" if fusion and fused_mlp else "auto"
        opt = optim.build_optimizer(model, lr=1e-3, weight_decay=0.1,
                                    betas=(0.9, 0.95), eps=1e-8, device=torch.device("cpu"),
                                    bucket_cap_mb=0.01, gradient_accumulation_fusion=fusion)
        if fusion:
            optim.prepare_grad_accumulation_fusion(opt)
        for step in range(2):
            for m in range(3):
                ids, targets = _batch(cfg, 2 + m + step)
                with (optim.no_sync(opt) if m < 2 else torch.enable_grad(),
                      tp.fused_paths(mlp_mode, ["gelu_gemm"])):
                    model(ids, targets).div(3).backward()
                if fusion:
                    assert model.blocks[0].mlp.fc.weight.grad is None
            opt.step()
            opt.zero_grad()
        params[fusion] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(params[True], params[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ps.destroy_model_parallel()
    return True


@pytest.mark.parametrize("size,tp,extra", [
    (1, 1, None), (2, 2, None),
    (2, 2, {"sequence_parallel": True, "recompute_granularity": "full",
            "untie_embeddings_and_output_weights": True}),
    (2, 2, {"sequence_parallel": True, "recompute_granularity": "full", "openai_gelu": True,
            "fused_mlp": True}),
], ids=["tp1", "tp2", "tp2-sp-recompute-untied", "tp2-sp-recompute-gelu-gemm"])
def test_gradient_accumulation_fusion_trains_like_plain(world, size, tp, extra):
    assert all(world(size, _fusion_vs_plain, tp, extra))


def test_gradient_accumulation_fusion_flag():
    """``--gradient-accumulation-fusion``: on by default with DistributedFusedAdam and
    several micro-batches (no autocast), as given otherwise."""
    from examples.gpt import config

    def resolved(flags, grad_acc):
        cfg = config.parse_args(["--micro-batch-size", "1", "--global-batch-size",
                                 str(grad_acc), *flags])
        return cfg.resolve(cpu=True, dp_size=1, vocab_size=64).optimizer \
            .gradient_accumulation_fusion

    assert resolved([], 4) and not resolved([], 1)
    assert not resolved(["--autocast-bf16"], 4)
    assert not resolved(["--no-gradient-accumulation-fusion"], 4)
    assert resolved(["--gradient-accumulation-fusion"], 1)




def _same_model_either_way(ops: list[str], check=None, **cfg):
    """Loss and every gradient of ``GPT(GPTConfig(**CFG, **cfg))`` are equal with the
    fused paths of ``ops`` off and on (``tp.fused_paths``, on: also where only the
    PyTorch reference of a kernel exists, as on the CPU); ``check(model, fused)`` asserts
    which path the model took."""
    out = {}
    for fused in (False, True):
        with tp.fused_paths("on" if fused else "off", ops):
            torch.manual_seed(0)
            model = GPT(GPTConfig(**CFG, **cfg))
            ids, targets = _batch(model.cfg)
            with torch.no_grad():  # nonzero biases, so a dropped bias would show
                model.blocks[0].mlp.fc.bias.normal_(generator=torch.Generator().manual_seed(1))
            if check is not None:
                check(model, fused)
            loss = model(ids, targets)
            loss.backward()
        out[fused] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-6, atol=1e-6)
    for name, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], g, rtol=1e-5, atol=1e-6, msg=name)


def _mlp_graph(model) -> str:
    x = torch.randn(2, 3, CFG["hidden_size"], requires_grad=True)
    return autograd_node_names(model.blocks[0].mlp(x))


@pytest.mark.parametrize("openai_gelu", [False, True])
def test_bias_gelu_path_is_the_same_model(openai_gelu):
    """The MLP's bias-GELU path (``tp.bias_gelu``: fc's GEMM without its bias, the bias
    gradient in the GELU's backward) gives the unfused model's loss and gradients."""
    def check(model, fused):
        assert ("_BiasGeluBackward" in _mlp_graph(model)) == fused

    _same_model_either_way(["bias_gelu"], check, openai_gelu=openai_gelu)


@pytest.mark.parametrize("keep", [True, False])
def test_gelu_gemm_path_is_the_same_model(keep):
    """The MLP as one fused function (GELU in the GEMMs' epilogues; the PyTorch reference
    of those GEMMs on the CPU) gives the unfused model's loss and gradients; it needs the
    tanh GELU, and under autocast the MLP stays unfused."""
    def check(model, fused):
        assert ("_GeluMLPBackward" in _mlp_graph(model)) == fused
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert "_GeluMLPBackward" not in _mlp_graph(model)

    _same_model_either_way(["gelu_gemm"], check, openai_gelu=True,
                           gelu_gemm_keep_output=keep)
    with tp.fused_paths("on", ["gelu_gemm"]):  # erf GELU: no epilogue computes it
        torch.manual_seed(0)
        assert "_GeluMLPBackward" not in _mlp_graph(GPT(GPTConfig(**CFG)))


@pytest.mark.parametrize("groups", [None, 2])
def test_heads_grad_path_is_the_same_model(groups):
    """The QKV (or Q and KV) projections' one-pass backward gives the unfused model's
    loss and gradients; the projections' outputs come from the fused function exactly
    when it is on."""
    def check(model, fused):
        attn = model.blocks[0].attn
        projections = [attn.qkv] if groups is None else [attn.q, attn.kv]
        with torch.no_grad():  # nonzero biases, so a wrong bias gradient would show
            for k, lin in enumerate(projections):
                lin.bias.normal_(generator=torch.Generator().manual_seed(2 + k))
        x = torch.randn(2, 3, CFG["hidden_size"], requires_grad=True)
        names = {type(t.grad_fn).__name__ for t in attn._qkv(x)}
        assert (names == {"_LinearHeadsBackward"}) == fused, names

    _same_model_either_way(["heads_grad"], check, num_query_groups=groups)


def test_fused_paths_chosen_on_the_cpu():
    """On the CPU by default (``auto``) the norms and the heads' backward take their fused
    paths (the kernels' PyTorch reference: one code path everywhere), the MLP its plain
    one (the bias-GELU and GELU-in-GEMM references only pay with the CUDA extension)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG, openai_gelu=True))
    x = torch.randn(2, 3, CFG["hidden_size"], requires_grad=True)
    block = autograd_node_names(model.blocks[0](x))
    assert "mpzero_layer_norm_forward" in block and "_LinearHeadsBackward" in block
    assert "_GeluMLPBackward" not in block and "_BiasGeluBackward" not in block
    with tp.fused_paths("off"):
        block = autograd_node_names(model.blocks[0](x))
    assert "mpzero_layer_norm_forward" not in block and "_LinearHeadsBackward" not in block
    with pytest.raises(ValueError, match="no fused path named"):
        tp.set_fused_paths("on", ["layernorm"])


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layer_norm_path_is_the_same_model(normalization):
    """The blocks' norms (LayerNorm or RMSNorm) by the fused ops (ln_2 with the residual
    add before it) give the unfused model's loss and gradients, and the block runs them
    exactly when they are on; under autocast it stays unfused."""
    def check(model, fused):
        block = model.blocks[0]
        with torch.no_grad():  # a non-trivial norm, so a wrong weight/bias gradient shows
            block.ln_2.weight.normal_(1.0, 0.2, generator=torch.Generator().manual_seed(4))
        x = torch.randn(2, 3, CFG["hidden_size"], requires_grad=True)
        assert ("mpzero_layer_norm_forward" in autograd_node_names(block(x))) == fused
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert "mpzero_layer_norm_forward" not in autograd_node_names(block(x))

    _same_model_either_way(["layer_norm"], check, normalization=normalization)


