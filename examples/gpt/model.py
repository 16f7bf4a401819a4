"""A nanoGPT-sized GPT built from mpzero's tensor-parallel layers.

Pre-LN transformer, ``x + attn(ln(x))`` then ``x + mlp(ln(x))``, a final norm and an
output layer tied to the input embedding. Tensor parallelism (TP) splits the attention
heads (QKV a ``ColumnParallelLinear``, head-major ``[head][q|k|v][head_dim]`` as in
Megatron so a rank's block holds whole heads; the output projection a
``RowParallelLinear``), the MLP's hidden features, and the vocabulary (the logits
``[B, T, V/tp]`` go straight to ``vocab_parallel_cross_entropy``). Norms and the
position embedding are replicated. Every rank draws the full weights from the default
RNG and keeps its slice, so TP=1 and TP=2 models from one seed are the same model.
Megatron's everyday options (sequence parallelism, recompute, RoPE, RMSNorm, SwiGLU,
grouped-query attention, untied output, no linear biases) are :class:`GPTConfig` fields.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mpzero import tensor_parallel as tp
from mpzero.tensor_parallel.utils import resolve_tp_group, tp_rank, tp_world_size


@dataclass
class GPTConfig:
    vocab_size: int = 4096  # padded (config.padded_vocab_size) so every TP size divides it
    seq_length: int = 256  # context length (= number of learned position embeddings)
    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # None: 4 * hidden_size
    dropout: float = 0.0  # residual and attention dropout
    bias: bool = True  # biases in the linear layers and LayerNorms
    layernorm_epsilon: float = 1e-5
    init_std: float = 0.02
    # Megatron's everyday options (flags of the same names, config.py).
    sequence_parallel: bool = False  # shard norms/dropout/residual along the sequence over TP
    recompute_granularity: str | None = None  # None, "full" (whole blocks), "selective"
    recompute_num_layers: int | None = None  # "full": the first N blocks (None: all)
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: float = 10000.0
    normalization: str = "LayerNorm"  # or "RMSNorm" (no bias)
    swiglu: bool = False  # SiLU-gated MLP: fc holds gate and up features, interleaved
    openai_gelu: bool = False  # GELU's tanh approximation (GPT-2's, Megatron's fused bias-GELU)
    num_query_groups: int | None = None  # grouped-query attention; None: one group per head
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True  # False: no biases in the linear layers (LayerNorm keeps its)
    attention_backend: str = "auto"  # SDPA kernel: "auto" (torch picks) or ATTENTION_BACKENDS
    # Where the MLP's GELU runs in its GEMMs (tp.parallel_mlp): save gelu(z) for the
    # backward, or make it again there (one [tokens, ffn] activation less per layer).
    gelu_gemm_keep_output: bool = True

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by "
                             f"num_attention_heads ({self.num_attention_heads})")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be "
                             f"divisible by num_query_groups ({self.num_query_groups})")
        choices = {"recompute_granularity": (None, "full", "selective"),
                   "attention_backend": ("auto", *ATTENTION_BACKENDS),
                   "position_embedding_type": ("learned_absolute", "rope"),
                   "normalization": ("LayerNorm", "RMSNorm")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def linear_bias(self) -> bool:
        return self.bias and self.add_bias_linear


# --attention-backend: the one SDPA kernel the attention core may use (else torch picks).
ATTENTION_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                      "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}

SEQ_DIM = 1  # activations are batch-first, (B, T, h); sequence parallelism splits T


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the hidden dim, replicated on the TP ranks. With sequence
    parallelism the weight and bias gradients are partial over TP (each rank's tokens):
    all-reduced inside the autograd graph. ``plain``: PyTorch's norm, never a fused one."""

    def __init__(self, cfg: GPTConfig, tp_group=None, plain: bool = False) -> None:
        super().__init__()
        h, self.plain = cfg.hidden_size, plain
        self.rms = cfg.normalization == "RMSNorm"
        self.eps, self.sequence_parallel = cfg.layernorm_epsilon, cfg.sequence_parallel
        self.tp_group = resolve_tp_group(tp_group) if cfg.sequence_parallel else None
        self.weight = nn.Parameter(torch.ones(h))
        has_bias = cfg.bias and not self.rms
        self.bias = nn.Parameter(torch.zeros(h)) if has_bias else None
        if self.sequence_parallel:
            for p in self.parameters():
                tp.mark_sequence_parallel(p)

    def _params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        w, b = self.weight, self.bias
        if self.sequence_parallel:
            w = tp.reduce_grad_over_tensor_model_parallel_region(w, self.tp_group)
            b = None if b is None else tp.reduce_grad_over_tensor_model_parallel_region(
                b, self.tp_group)
        return w, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self._params()
        if self.plain:
            return F.rms_norm(x, w.shape, w, self.eps) if self.rms else \
                F.layer_norm(x, w.shape, w, b, self.eps)
        return tp.norm(x, w, b, self.eps, self.rms)

    def add_forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, self(s))`` with ``s = x + y`` (the residual add before the norm)."""
        w, b = self._params()
        return tp.add_norm(x, y, w, b, self.eps, self.rms)


def dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool) -> torch.Tensor:
    """Dropout on the replicated stream, or per TP rank on sequence-parallel chunks."""
    if not training or p == 0.0:
        return x
    if sequence_parallel:  # each rank holds other tokens: draw from the per-rank RNG
        with tp.get_rng_tracker().fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


class Rotary(nn.Module):
    """Rotary position embedding (RoPE, rotate-half layout) of q and k, ``(B, n, T, hd)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        inv_freq = 1.0 / cfg.rotary_base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.outer(torch.arange(cfg.seq_length, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # (T, hd)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[-2]
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class CausalSelfAttention(nn.Module):
    """Causal self-attention over ``heads/tp`` heads per rank: one fused QKV projection,
    or (grouped-query) ``q`` and ``kv`` (``[group][k|v][head_dim]``), whose groups are
    split over TP when ``groups >= tp`` and else replicated (``tp.ReplicatedLinear``:
    each rank uses its query heads' group)."""

    def __init__(self, cfg: GPTConfig, tp_group=None) -> None:
        super().__init__()
        h, nh, groups = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups
        self.tp_group = resolve_tp_group(tp_group)
        tp_size = tp_world_size(self.tp_group)
        self.local_heads = tp.divide(nh, tp_size, "num_attention_heads")
        self.head_dim, hd = cfg.head_dim, cfg.head_dim
        self.dropout = cfg.dropout
        self.sdpa_backend = ATTENTION_BACKENDS.get(cfg.attention_backend)  # None: auto
        self.selective_recompute = cfg.recompute_granularity == "selective"
        self.rotary = Rotary(cfg) if cfg.position_embedding_type == "rope" else None
        sp = dict(sequence_parallel=cfg.sequence_parallel, sequence_dim=SEQ_DIM,
                  gradient_accumulation_fusion=True)  # where the optimizer gives main_grad
        init = tp.init_method_normal(cfg.init_std)
        self.gqa = groups != nh
        if not self.gqa:
            self.qkv = tp.ColumnParallelLinear(h, 3 * h, bias=cfg.linear_bias,
                                               init_method=init, tp_group=tp_group, **sp)
        else:
            self.q = tp.ColumnParallelLinear(h, nh * hd, bias=cfg.linear_bias,
                                             init_method=init, tp_group=tp_group, **sp)
            self.kv_replicated = groups < tp_size
            if not self.kv_replicated:
                tp.divide(groups, tp_size, "num_query_groups")
                self.kv = tp.ColumnParallelLinear(h, 2 * groups * hd, bias=cfg.linear_bias,
                                                  init_method=init, tp_group=tp_group, **sp)
            else:
                if tp_size % groups:
                    raise ValueError(f"num_query_groups ({groups}) smaller than the "
                                     f"tensor-parallel size ({tp_size}) must divide it")
                self.kv = tp.ReplicatedLinear(h, 2 * groups * hd, 2 * hd, cfg.linear_bias,
                                              init, tp_group, sequence_dim=SEQ_DIM,
                                              sequence_parallel=cfg.sequence_parallel)
                self.group = tp_rank(self.tp_group) * groups // tp_size
        self.proj = tp.RowParallelLinear(
            h, h, bias=cfg.linear_bias, input_is_parallel=True, tp_group=tp_group,
            init_method=tp.scaled_init_method_normal(cfg.init_std, cfg.num_layers), **sp)

    def _qkv(self, x: torch.Tensor):
        hd = self.head_dim
        if not self.gqa:
            return self.qkv.forward_heads(x, 3, hd)  # each (B, nh/tp, T, hd)
        (q,) = self.q.forward_heads(x, 1, hd)  # (B, nh/tp, T, hd)
        if self.kv_replicated:
            kv = self.kv(x, self.group)  # (B, T, 2*hd): this rank's group only
            k, v = tp.split_heads(kv, 2, self.head_dim)  # each (B, 1, T, hd)
        else:
            k, v = self.kv.forward_heads(x, 2, hd)  # each (B, G/tp, T, hd)
        return q, k, v

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        p = self.dropout if self.training else 0.0
        # Heads differ per TP rank: their dropout masks come from the per-rank RNG.
        with (sdpa_kernel(self.sdpa_backend) if self.sdpa_backend else nullcontext()), \
                (tp.get_rng_tracker().fork() if p > 0 else nullcontext()):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                  enable_gqa=self.gqa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        if self.selective_recompute and self.training:
            y = tp.checkpoint(self._core_attention, q, k, v)
        else:
            y = self._core_attention(q, k, v)  # (B, nh/tp, T, hd)
        B, _, T, _ = y.shape
        y = y.transpose(1, 2).reshape(B, T, self.local_heads * self.head_dim)  # (B, T, h/tp)
        out, _ = self.proj(y)  # (B, T, h) summed over TP (or (B, T/tp, h) with SP)
        return out


class MLP(nn.Module):
    """``fc`` -> GELU (or SwiGLU) -> ``proj``, the hidden features split over TP.
    SwiGLU's ``fc`` outputs are ``[feature][gate|up]``: a rank's block holds whole pairs."""

    def __init__(self, cfg: GPTConfig, tp_group=None) -> None:
        super().__init__()
        sp = dict(sequence_parallel=cfg.sequence_parallel, sequence_dim=SEQ_DIM,
                  gradient_accumulation_fusion=True)  # where the optimizer gives main_grad
        self.swiglu = cfg.swiglu
        self.gelu_approximate = "tanh" if cfg.openai_gelu else "none"
        self.keep_gelu_output = cfg.gelu_gemm_keep_output
        fc_out = 2 * cfg.ffn_hidden_size if cfg.swiglu else cfg.ffn_hidden_size
        self.fc = tp.ColumnParallelLinear(cfg.hidden_size, fc_out, bias=cfg.linear_bias,
                                          init_method=tp.init_method_normal(cfg.init_std),
                                          tp_group=tp_group, **sp)
        self.proj = tp.RowParallelLinear(
            cfg.ffn_hidden_size, cfg.hidden_size, bias=cfg.linear_bias, input_is_parallel=True,
            init_method=tp.scaled_init_method_normal(cfg.init_std, cfg.num_layers),
            tp_group=tp_group, **sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.swiglu:  # the op picks its fused path (GELU in the GEMMs, bias-GELU)
            y, _ = tp.parallel_mlp(x, self.fc, self.proj, approximate=self.gelu_approximate,
                                   keep_gelu_output=self.keep_gelu_output)
            return y  # (B, T, h)
        y, _ = self.fc(x)  # (B, T, 2*ffn/tp)
        gate, up = y.unflatten(-1, (-1, 2)).unbind(-1)  # each (B, T, ffn/tp)
        y, _ = self.proj(F.silu(gate) * up)  # (B, T, h)
        return y


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, tp_group=None) -> None:
        super().__init__()
        self.ln_1 = Norm(cfg, tp_group)
        self.attn = CausalSelfAttention(cfg, tp_group)
        self.ln_2 = Norm(cfg, tp_group)
        self.mlp = MLP(cfg, tp_group)
        # Replicated stream (same mask on TP ranks), per-rank with sequence parallelism.
        self.p, self.sequence_parallel = cfg.dropout, cfg.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, sp = self.p, self.sequence_parallel
        a = dropout(self.attn(self.ln_1(x)), p, self.training, sp)
        x, h = self.ln_2.add_forward(x, a)  # x + a, and ln_2 of it, in one pass
        return x + dropout(self.mlp(h), p, self.training, sp)


class GPT(nn.Module):
    """``GPT(cfg)(ids, targets)`` -> mean loss; ``GPT(cfg)(ids)`` -> vocab-parallel logits."""

    def __init__(self, cfg: GPTConfig, tp_group=None, *, pre_process: bool = True,
                 post_process: bool = True, layers: range | None = None) -> None:
        """A whole GPT, or one pipeline stage (pipeline.py) holding the blocks ``layers``
        (global indices; default all), the embeddings if ``pre_process``, the final norm
        and output layer (its own copy of a tied ``wte``) if ``post_process``."""
        super().__init__()
        self.cfg = cfg
        self.tp_group = resolve_tp_group(tp_group)
        tp_size = tp_world_size(self.tp_group)
        if cfg.sequence_parallel:
            tp.divide(cfg.seq_length, tp_size, "seq_length (sequence parallel)")
        self.pre_process, self.post_process = pre_process, post_process
        self.layers = range(cfg.num_layers) if layers is None else layers
        tied = not cfg.untie_embeddings_and_output_weights
        # Every stage draws every weight, in the unsplit model's order, and keeps its part.
        wte = tp.VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size,
                                        init_method=tp.init_method_normal(cfg.init_std),
                                        tp_group=tp_group)
        wpe = None
        if cfg.position_embedding_type == "learned_absolute":
            wpe = nn.Embedding(cfg.seq_length, cfg.hidden_size)
            nn.init.normal_(wpe.weight, mean=0.0, std=cfg.init_std)
        blocks = [Block(cfg, tp_group) for _ in range(cfg.num_layers)]  # all drawn, some kept
        output_layer = None
        if not tied:
            output_layer = tp.ColumnParallelLinear(
                cfg.hidden_size, cfg.vocab_size, bias=False,
                init_method=tp.init_method_normal(cfg.init_std), tp_group=tp_group,
                sequence_parallel=cfg.sequence_parallel, sequence_dim=SEQ_DIM,
                gradient_accumulation_fusion=True)
        if pre_process or (post_process and tied):
            self.wte = wte
        self.wpe = wpe if pre_process else None
        self.blocks = nn.ModuleList(b for i, b in enumerate(blocks) if i in self.layers)
        self.output_layer = output_layer if post_process else None
        if post_process:
            # PyTorch's norm: the fused kernel rounds differently, and the final norm has
            # always been this one, so runs and checkpoints keep their loss curves.
            self.ln_f = Norm(cfg, tp_group, plain=True)
        recompute = cfg.recompute_num_layers if cfg.recompute_num_layers is not None else \
            len(self.blocks)
        self.full_recompute_layers = recompute if cfg.recompute_granularity == "full" else 0

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``ids`` (B, T) on the first stage, else the previous stage's output (B, T, h),
        or (B, T/tp, h) with sequence parallelism. Returns that hidden state unless this
        stage is the last."""
        cfg = self.cfg
        if self.pre_process:
            B, T = ids.shape
            if T > cfg.seq_length:
                raise ValueError(f"sequence of {T} tokens is longer than seq_length "
                                 f"{cfg.seq_length}")
            x = self.wte(ids)  # (B, T, h)
            if self.wpe is not None:
                x = x + self.wpe(torch.arange(T, device=ids.device))
            if cfg.sequence_parallel:  # (B, T, h) -> (B, T/tp, h)
                x = tp.scatter_to_sequence_parallel_region(x, SEQ_DIM, self.tp_group)
            x = dropout(x, cfg.dropout, self.training, cfg.sequence_parallel)
        else:
            x = ids
        for i, block in enumerate(self.blocks):
            if i < self.full_recompute_layers and self.training and torch.is_grad_enabled():
                x = tp.checkpoint(block, x)
            else:
                x = block(x)
        if not self.post_process:
            return x
        x = self.ln_f(x)  # (B, T, h), or (B, T/tp, h) with SP
        if self.output_layer is not None:
            logits, _ = self.output_layer(x)  # (B, T, V/tp)
        else:
            # Tied output layer: this rank's vocabulary rows of the embedding table.
            if cfg.sequence_parallel:
                x = tp.gather_from_sequence_parallel_region(x, SEQ_DIM, self.tp_group)
            else:
                x = tp.copy_to_tensor_model_parallel_region(x, self.tp_group)
            logits = F.linear(x, self.wte.weight)  # (B, T, V/tp)
        if targets is None:
            return logits
        return self.cross_entropy(logits, targets)

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of the vocab-parallel logits ``(B, T, V/tp)``, which nothing else may
        read: the backward overwrites them with their gradient (``inplace_backward``).
        Its own method so that ``--compile`` compiles it (the CPU's chunked path)."""
        loss = tp.vocab_parallel_cross_entropy(logits, targets, tp_group=self.tp_group,
                                               inplace_backward=True)  # (B, T)
        return loss.mean()

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Two optimizer param groups: weight matrices decayed; biases, norms and the
        embeddings not (decay would pull the rows of rare tokens and unused positions
        towards zero whatever the data: minGPT's convention)."""
        no_decay_modules = (Norm, nn.LayerNorm, nn.Embedding, tp.VocabParallelEmbedding)
        decay, no_decay = [], []
        for module in self.modules():
            for name, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                if name == "bias" or isinstance(module, no_decay_modules) or p.ndim < 2:
                    no_decay.append(p)
                else:
                    decay.append(p)
        return [{"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]
