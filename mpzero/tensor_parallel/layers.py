"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Each layer holds one block of the full weight of its single-device counterpart
(``nn.Linear``, ``nn.Embedding``) and its forward and backward equal that layer's:

- :class:`ColumnParallelLinear` splits the output features: rank r holds rows
  ``r*out/tp:(r+1)*out/tp`` of the ``[out, in]`` weight (and of the bias).
- :class:`RowParallelLinear` splits the input features: rank r holds columns
  ``r*in/tp:(r+1)*in/tp``; partial products are summed over TP, then the full
  (replicated) bias is added.
- :class:`VocabParallelEmbedding` splits the vocabulary rows.

Initialization draws the *full* weight from the default torch RNG on the CPU in
fp32, identically on every TP rank, and keeps this rank's block: a model built
from one seed holds the same weights at any TP size, and on CPU or CUDA.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mpzero.tensor_parallel.grad_accumulation import (
    OPTIMIZER_ATTRS,
    linear_with_grad_accumulation,
)
from mpzero.tensor_parallel.heads import linear_heads, split_heads
from mpzero.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    mark_sequence_parallel,
    reduce_from_tensor_model_parallel_region,
    reduce_grad_over_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from mpzero.tensor_parallel.utils import (
    divide,
    resolve_tp_group,
    set_tensor_model_parallel_attributes,
    tp_rank,
    tp_world_size,
    vocab_range,
)

InitMethod = Callable[[torch.Tensor], object]


def init_method_normal(sigma: float = 0.02) -> InitMethod:
    """An ``init_method`` filling a tensor in place from N(0, sigma^2)."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> InitMethod:
    """N(0, (sigma / sqrt(2 * num_layers))^2), for projections into the residual stream."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def _init_shard(param: nn.Parameter, full_shape: tuple[int, ...], partition_dim: int,
                rank: int, init_method: InitMethod) -> None:
    """Draw the full weight (CPU, fp32, default RNG) and copy this rank's block into ``param``."""
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    width = param.shape[partition_dim]
    with torch.no_grad():
        param.copy_(master.narrow(partition_dim, rank * width, width))


class _TensorParallelModule(nn.Module):
    """Holds the TP group and its size and rank (resolved once, at construction)."""

    def __init__(self, tp_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.tp_group = resolve_tp_group(tp_group)
        self.tp_size = tp_world_size(self.tp_group)
        self.tp_rank = tp_rank(self.tp_group)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear`` with this layer's weight; with ``gradient_accumulation_fusion``
        the weight gradient is added into ``weight.main_grad`` where the optimizer
        provides one (see :mod:`mpzero.tensor_parallel.grad_accumulation`)."""
        if self.gradient_accumulation_fusion:
            return linear_with_grad_accumulation(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def __deepcopy__(self, memo: dict) -> _TensorParallelModule:
        # A process group is a process-wide handle that cannot be copied: share it.
        memo.setdefault(id(self.tp_group), self.tp_group)
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        # Parameter.__deepcopy__ drops Python attributes such as tensor_model_parallel.
        for name, param in self.named_parameters(recurse=False):
            for attr, value in vars(param).items():
                # The optimizer's accumulation buffer belongs to the original's parameter.
                if attr in OPTIMIZER_ATTRS:
                    continue
                if not hasattr(getattr(new, name), attr):
                    setattr(getattr(new, name), attr, value)
        return new


def _param(shape: tuple[int, ...], params_dtype, device) -> nn.Parameter:
    dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


class ColumnParallelLinear(_TensorParallelModule):
    """``Y = X A^T + b`` with ``A`` split by rows (output features) over TP ranks.

    ``weight`` is this rank's ``[output_size/tp, input_size]`` block, ``bias`` its
    ``[output_size/tp]`` block. The input is replicated (its gradient is all-reduced);
    the output is this rank's block of features, or the full output with
    ``gather_output=True``. ``forward`` returns ``(output, bias)``: ``bias`` is
    ``None`` unless ``skip_bias_add``, which returns it instead of adding it (so a
    caller can fuse the add into what follows).

    ``sequence_parallel=True``: the input is this rank's chunk of the sequence (dim
    ``sequence_dim``), all-gathered before the matmul; its gradient is
    reduce-scattered back to the chunk (instead of all-reduced).

    ``gradient_accumulation_fusion=True`` (both linear layers): the weight-gradient
    GEMM adds into ``weight.main_grad`` (fp32) where the optimizer provides it
    (:class:`~mpzero.optimizers.DistributedFusedAdam` with
    ``contiguous_grad_buffer=True``), instead of writing ``weight.grad``:
    :mod:`mpzero.tensor_parallel.grad_accumulation`.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 gather_output: bool = False, init_method: InitMethod | None = None,
                 skip_bias_add: bool = False, params_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 tp_group: dist.ProcessGroup | None = None, *,
                 sequence_parallel: bool = False, sequence_dim: int = 0,
                 gradient_accumulation_fusion: bool = False) -> None:
        super().__init__(tp_group)
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, self.tp_size, "output_size")
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.init_method = init_method if init_method is not None else init_method_normal()
        self.weight = _param((self.output_size_per_partition, input_size), params_dtype, device)
        set_tensor_model_parallel_attributes(self.weight, True, partition_dim=0)
        if bias:
            self.bias = _param((self.output_size_per_partition,), params_dtype, device)
            set_tensor_model_parallel_attributes(self.bias, True, partition_dim=0)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Redraw the full weight from the default RNG and keep this rank's rows; zero bias."""
        _init_shard(self.weight, (self.output_size, self.input_size), 0, self.tp_rank,
                    self.init_method)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def parallel_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the matmul takes it: ``x`` itself (its gradient all-reduced over
        TP), or with ``sequence_parallel`` the all-gathered sequence."""
        if self.sequence_parallel:  # (.., s/tp, ..) -> (.., s, ..)
            return gather_from_sequence_parallel_region(x, self.sequence_dim, self.tp_group)
        return copy_to_tensor_model_parallel_region(x, self.tp_group)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.parallel_input(x)
        bias = None if self.skip_bias_add else self.bias
        out = self._linear(x, bias)  # (..., out/tp)
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out, self.tp_group)  # (..., out)
        return out, (self.bias if self.skip_bias_add else None)

    def forward_heads(self, x: torch.Tensor, num_splits: int,
                      head_dim: int) -> tuple[torch.Tensor, ...]:
        """``forward(x)``'s output ``[B, T, out/tp]`` split into attention heads: ``n =
        num_splits`` views ``[B, H, T, D]`` (part ``j`` of each of this rank's heads, whose
        ``n * D`` features lie together, Megatron's order), e.g. ``q, k, v``. Where it
        can (see :func:`mpzero.tensor_parallel.heads.linear_heads`) the backward makes
        the output's and the bias' gradients in one pass over the heads' gradients."""
        if self.skip_bias_add:
            raise ValueError("forward_heads: skip_bias_add=True returns the bias unadded; "
                             "split forward()'s output instead")
        if self.gather_output:
            out, _ = self.forward(x)
            return split_heads(out, num_splits, head_dim)
        return linear_heads(self.parallel_input(x), self.weight, self.bias, num_splits,
                            head_dim, self.gradient_accumulation_fusion)

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, "
                f"tp={self.tp_size}, bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, skip_bias_add={self.skip_bias_add}")


class RowParallelLinear(_TensorParallelModule):
    """``Y = X A^T + b`` with ``A`` split by columns (input features) over TP ranks.

    ``weight`` is this rank's ``[output_size, input_size/tp]`` block; ``bias`` is full
    and replicated, added after the sum over ranks. The input is this rank's block of
    features (``input_is_parallel=True``, e.g. a :class:`ColumnParallelLinear`
    output) or the full input, which is then split. ``forward`` returns
    ``(output, bias)`` as :class:`ColumnParallelLinear` does.

    ``sequence_parallel=True`` (needs ``input_is_parallel``): the sum over ranks is a
    reduce-scatter, so the output is this rank's chunk of the sequence (dim
    ``sequence_dim``). The bias is then added to a chunk: it is marked
    ``sequence_parallel`` and its gradient is all-reduced over TP inside the
    autograd graph (also the bias returned by ``skip_bias_add``).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 input_is_parallel: bool = False, init_method: InitMethod | None = None,
                 skip_bias_add: bool = False, params_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 tp_group: dist.ProcessGroup | None = None, *,
                 sequence_parallel: bool = False, sequence_dim: int = 0,
                 gradient_accumulation_fusion: bool = False) -> None:
        super().__init__(tp_group)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear(sequence_parallel=True) needs "
                             "input_is_parallel=True")
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, self.tp_size, "input_size")
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.init_method = init_method if init_method is not None else init_method_normal()
        self.weight = _param((output_size, self.input_size_per_partition), params_dtype, device)
        set_tensor_model_parallel_attributes(self.weight, True, partition_dim=1)
        if bias:
            self.bias = _param((output_size,), params_dtype, device)
            self.bias.tensor_model_parallel = False  # replicated on every TP rank
            if sequence_parallel:
                mark_sequence_parallel(self.bias)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Redraw the full weight from the default RNG and keep this rank's columns; zero bias."""
        _init_shard(self.weight, (self.output_size, self.input_size), 1, self.tp_rank,
                    self.init_method)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)  # (..., in/tp)
        return self.reduce_output(self._linear(x, None))

    def reduce_output(self, partial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(output, bias)`` from this rank's share ``partial`` of ``X A^T`` (``[..., out]``):
        the sum over TP (a reduce-scatter with ``sequence_parallel``), then the bias as
        :meth:`forward` applies it."""
        bias = self.bias
        if self.sequence_parallel:  # (.., s, ..) -> (.., s/tp, ..)
            out = reduce_scatter_to_sequence_parallel_region(partial, self.sequence_dim,
                                                             self.tp_group)
            if bias is not None:
                bias = reduce_grad_over_tensor_model_parallel_region(bias, self.tp_group)
        else:
            out = reduce_from_tensor_model_parallel_region(partial, self.tp_group)
        if self.skip_bias_add:
            return out, bias
        if bias is not None:
            out = out + bias
        return out, None

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, "
                f"tp={self.tp_size}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, skip_bias_add={self.skip_bias_add}")


class VocabParallelEmbedding(_TensorParallelModule):
    """``nn.Embedding`` with the vocabulary split over TP ranks.

    ``weight`` holds rows ``r*V/tp:(r+1)*V/tp``. Each rank looks up the ids it owns,
    writes zeros for the others, and the sum over ranks is the full embedding
    ``[..., embedding_dim]`` on every rank.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 init_method: InitMethod | None = None,
                 params_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = divide(num_embeddings, self.tp_size,
                                                   "num_embeddings")
        self.vocab_start_index, self.vocab_end_index = vocab_range(
            self.num_embeddings_per_partition, self.tp_rank)
        self.init_method = init_method if init_method is not None else init_method_normal()
        self.weight = _param((self.num_embeddings_per_partition, embedding_dim), params_dtype,
                             device)
        set_tensor_model_parallel_attributes(self.weight, True, partition_dim=0)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Redraw the full table from the default RNG and keep this rank's rows."""
        _init_shard(self.weight, (self.num_embeddings, self.embedding_dim), 0, self.tp_rank,
                    self.init_method)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight)  # (..., D)
        # Zeroing the foreign rows also zeroes their gradient into row 0.
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"tp={self.tp_size}, rows={self.vocab_start_index}:{self.vocab_end_index}")


class ReplicatedLinear(nn.Module):
    """A linear layer held whole on every TP rank, whose rows the ranks use in parts.

    For example the KV projection of grouped-query attention with fewer KV groups than
    TP ranks: ``forward(x, part)`` applies rows ``part * rows_per_part`` to
    ``(part + 1) * rows_per_part`` only (the part this rank's query heads use), so each
    rank's weight gradient is partial and is all-reduced over TP inside the autograd
    graph (the parameters are marked sequence-parallel and not tensor-parallel: counted
    once in the grad norm). The input is all-gathered (``sequence_parallel``) or copied
    into the TP region, whose backward sums the ranks' input gradients. The weight is
    drawn whole from the default RNG (fp32, as at TP=1), like the other layers' weights.
    """

    def __init__(self, input_size: int, output_size: int, rows_per_part: int,
                 bias: bool = True, init_method: InitMethod | None = None,
                 tp_group: dist.ProcessGroup | None = None, *, sequence_parallel: bool = False,
                 sequence_dim: int = 0) -> None:
        super().__init__()
        self.tp_group = resolve_tp_group(tp_group)
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.rows_per_part = rows_per_part
        master = torch.empty(output_size, input_size, dtype=torch.float32)
        (init_method or init_method_normal())(master)
        self.weight = nn.Parameter(master)
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None
        for p in self.parameters():
            p.tensor_model_parallel = False
            mark_sequence_parallel(p)

    def forward(self, x: torch.Tensor, part: int) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.sequence_dim, self.tp_group)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        w = reduce_grad_over_tensor_model_parallel_region(self.weight, self.tp_group)
        rows = slice(part * self.rows_per_part, (part + 1) * self.rows_per_part)
        b = self.bias
        if b is not None:
            b = reduce_grad_over_tensor_model_parallel_region(b, self.tp_group)[rows]
        return F.linear(x, w[rows], b)  # (..., rows_per_part)
