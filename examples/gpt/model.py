"""A nanoGPT-sized GPT built from mpzero's tensor-parallel layers.

Pre-LN transformer: ``x + attn(ln(x))``, ``x + mlp(ln(x))``, a final LayerNorm and
an output layer tied to the input embedding. Tensor parallelism (TP) splits:

- the attention heads: the fused QKV projection is a ``ColumnParallelLinear``
  (each rank computes ``heads/tp`` heads), the output projection a
  ``RowParallelLinear`` that sums the ranks' partial products;
- the MLP hidden features: ``ColumnParallelLinear`` -> GELU -> ``RowParallelLinear``;
- the vocabulary: a ``VocabParallelEmbedding``; the logits are computed against
  this rank's rows of the same table (``[B, T, V/tp]``) and the loss by
  ``vocab_parallel_cross_entropy``, so the full ``[B, T, V]`` is never formed.

Everything else (LayerNorms, position embedding, row-parallel biases) is
replicated on the TP ranks. The full weights are drawn from the default RNG
on every rank and each rank keeps its slice, so models built from one seed at
TP=1 and TP=2 hold the same weights and compute the same loss.

QKV layout: the output features of the fused QKV projection are ordered
head-major, ``[head][q|k|v][head_dim]`` (Megatron's layout), so that the
contiguous block a TP rank owns holds whole heads with their q, k and v.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mpzero import tensor_parallel as tp
from mpzero.tensor_parallel.utils import resolve_tp_group, tp_world_size


@dataclass
class GPTConfig:
    vocab_size: int = 4096  # padded (see padded_vocab_size) so every TP size divides it
    seq_length: int = 256  # context length = number of learned position embeddings
    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # None: 4 * hidden_size
    dropout: float = 0.0  # residual and attention dropout
    bias: bool = True  # biases in the linear layers and LayerNorms
    layernorm_epsilon: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by "
                             f"num_attention_heads ({self.num_attention_heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int = 1,
                      divisible_by: int = 128) -> int:
    """Round ``vocab_size`` up to a multiple of ``lcm(divisible_by, tp)``.

    Unlike Megatron (which pads to ``divisible_by * tp``) the result is the same for
    every TP size dividing ``divisible_by``, so TP=1 and TP=2 models are comparable.
    """
    multiple = math.lcm(divisible_by, tensor_model_parallel_size)
    return -(-vocab_size // multiple) * multiple


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, tp_group=None) -> None:
        super().__init__()
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        tp_size = tp_world_size(resolve_tp_group(tp_group))
        self.local_heads = tp.divide(nh, tp_size, "num_attention_heads")
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.qkv = tp.ColumnParallelLinear(h, 3 * h, bias=cfg.bias,
                                           init_method=tp.init_method_normal(cfg.init_std),
                                           tp_group=tp_group)
        self.proj = tp.RowParallelLinear(
            h, h, bias=cfg.bias, input_is_parallel=True, tp_group=tp_group,
            init_method=tp.scaled_init_method_normal(cfg.init_std, cfg.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv, _ = self.qkv(x)  # (B, T, 3*h/tp), head-major
        qkv = qkv.view(B, T, self.local_heads, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each (B, nh/tp, T, hd)
        if self.training and self.dropout > 0:
            # Heads differ per TP rank: their dropout masks come from the per-rank RNG.
            with tp.get_rng_tracker().fork():
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout,
                                                   is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh/tp, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.local_heads * self.head_dim)  # (B, T, h/tp)
        out, _ = self.proj(y)  # (B, T, h), summed over TP
        return out


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, tp_group=None) -> None:
        super().__init__()
        self.fc = tp.ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, bias=cfg.bias,
                                          init_method=tp.init_method_normal(cfg.init_std),
                                          tp_group=tp_group)
        self.proj = tp.RowParallelLinear(
            cfg.ffn_hidden_size, cfg.hidden_size, bias=cfg.bias, input_is_parallel=True,
            init_method=tp.scaled_init_method_normal(cfg.init_std, cfg.num_layers),
            tp_group=tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.fc(x)  # (B, T, ffn/tp)
        y, _ = self.proj(F.gelu(y))  # (B, T, h)
        return y


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, tp_group=None) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, tp_group)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, bias=cfg.bias)
        self.mlp = MLP(cfg, tp_group)
        self.dropout = nn.Dropout(cfg.dropout)  # replicated stream: same mask on TP ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_1(x)))
        x = x + self.dropout(self.mlp(self.ln_2(x)))
        return x


class GPT(nn.Module):
    """``GPT(cfg)(ids, targets)`` -> mean loss; ``GPT(cfg)(ids)`` -> vocab-parallel logits."""

    def __init__(self, cfg: GPTConfig, tp_group=None, *, pre_process: bool = True,
                 post_process: bool = True, layers: range | None = None) -> None:
        """A whole GPT, or one pipeline stage of it (see examples/gpt/pipeline.py).

        ``layers``: the global indices of the blocks this stage holds (default all);
        ``pre_process``: it holds the embeddings (first stage); ``post_process``: the
        final LayerNorm and the tied output layer, with its own copy of ``wte``
        (last stage). Every stage draws the whole model's weights from the default
        RNG in the order of the unsplit model and keeps its part, so stages built
        from one seed hold exactly the unsplit model's weights.
        """
        super().__init__()
        self.cfg = cfg
        self.tp_group = resolve_tp_group(tp_group)
        self.pre_process, self.post_process = pre_process, post_process
        self.layers = range(cfg.num_layers) if layers is None else layers
        wte = tp.VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size,
                                        init_method=tp.init_method_normal(cfg.init_std),
                                        tp_group=tp_group)
        wpe = nn.Embedding(cfg.seq_length, cfg.hidden_size)
        nn.init.normal_(wpe.weight, mean=0.0, std=cfg.init_std)
        if pre_process or post_process:
            self.wte = wte
        if pre_process:
            self.wpe = wpe
            self.drop = nn.Dropout(cfg.dropout)
        blocks = (Block(cfg, tp_group) for _ in range(cfg.num_layers))  # all drawn, some kept
        self.blocks = nn.ModuleList(b for i, b in enumerate(blocks) if i in self.layers)
        if post_process:
            self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, bias=cfg.bias)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``ids`` (B, T) on the first stage, else the previous stage's (B, T, h) output.
        Returns the (B, T, h) hidden states unless this stage is the last."""
        if self.pre_process:
            B, T = ids.shape
            if T > self.cfg.seq_length:
                raise ValueError(f"sequence of {T} tokens is longer than seq_length "
                                 f"{self.cfg.seq_length}")
            pos = torch.arange(T, device=ids.device)
            x = self.drop(self.wte(ids) + self.wpe(pos))  # (B, T, h)
        else:
            x = ids
        for block in self.blocks:
            x = block(x)
        if not self.post_process:
            return x
        x = self.ln_f(x)  # (B, T, h)
        # Tied output layer: this rank's vocabulary rows of the embedding table.
        x = tp.copy_to_tensor_model_parallel_region(x, self.tp_group)
        logits = F.linear(x, self.wte.weight)  # (B, T, V/tp)
        if targets is None:
            return logits
        loss = tp.vocab_parallel_cross_entropy(logits, targets, tp_group=self.tp_group)  # (B, T)
        return loss.mean()

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Two optimizer param groups: weight matrices decayed, everything else not.

        No decay for biases, LayerNorm weights and the embeddings (token table, which
        is also the tied output layer, and positions): decay would pull the rows of
        rare tokens and unused positions towards zero regardless of the data (the
        minGPT convention; nanoGPT decays embeddings, Megatron decays them too).
        """
        no_decay_modules = (nn.LayerNorm, nn.Embedding, tp.VocabParallelEmbedding)
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

    def num_parameters(self) -> int:
        """Parameters of the full (unsharded) model."""
        cfg = self.cfg
        h, f, L = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
        b = 1 if cfg.bias else 0
        per_layer = (3 * h * h + 3 * h * b) + (h * h + h * b) + (2 * h * f + (f + h) * b)
        per_layer += 2 * (h + h * b)  # two LayerNorms
        return L * per_layer + cfg.vocab_size * h + cfg.seq_length * h + (h + h * b)


def flops_per_token(cfg: GPTConfig, seq_length: int | None = None) -> float:
    """Training FLOPs (forward + backward = 3x forward) per token of the full model.

    Matmuls only, 2 FLOPs per multiply-add: per layer QKV ``6h^2``, projection
    ``2h^2``, MLP ``4hf``, attention scores and values ``4sh`` (counted without
    the causal half, as Megatron and PaLM do); the tied output layer ``2hV``.
    Equals ``6 * N_matmul + 12 * L * s * h``.
    """
    s = cfg.seq_length if seq_length is None else seq_length
    h, f, L, V = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers, cfg.vocab_size
    forward = L * (8 * h * h + 4 * h * f + 4 * s * h) + 2 * h * V
    return 3.0 * forward
