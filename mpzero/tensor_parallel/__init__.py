"""Tensor-parallel layers, the autograd mappings between TP regions, and the TP RNG.

``mpzero.tensor_parallel`` follows Megatron-core's names: a GPT block is a
:class:`ColumnParallelLinear` followed by a :class:`RowParallelLinear`
(``input_is_parallel=True``), with a :class:`VocabParallelEmbedding` in front and
:func:`vocab_parallel_cross_entropy` at the end. Groups default to
``parallel_state.get_tensor_model_parallel_group()``.

Sequence parallelism: ``sequence_parallel=True`` on both linear layers plus the
``*_sequence_parallel_region`` mappings; parameters used on sequence chunks are
marked with :func:`mark_sequence_parallel` and wrapped in
:func:`reduce_grad_over_tensor_model_parallel_region` where they are used.
:func:`checkpoint` is activation recomputation that replays the TP RNG tracker.

Fused kernels: the ops with a fused path (:func:`norm`, :func:`add_norm`,
:meth:`ColumnParallelLinear.forward_heads`, :func:`parallel_mlp`) choose it
themselves from dtype, device and build, and fall back to plain PyTorch otherwise
(:mod:`mpzero.tensor_parallel.fusion`; :func:`fused_paths` overrides the choice).
"""

from mpzero.tensor_parallel.bias_gelu import bias_gelu
from mpzero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from mpzero.tensor_parallel.fusion import fused_paths, set_fused_paths
from mpzero.tensor_parallel.gelu_mlp import gelu_mlp, parallel_gelu_mlp, parallel_mlp
from mpzero.tensor_parallel.heads import linear_heads, split_heads
from mpzero.tensor_parallel.layer_norm import (
    add_layer_norm,
    add_norm,
    add_rms_norm,
    fused_layer_norm,
    fused_rms_norm,
    norm,
)
from mpzero.tensor_parallel.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
    scaled_init_method_normal,
)
from mpzero.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    mark_sequence_parallel,
    reduce_from_tensor_model_parallel_region,
    reduce_grad_over_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from mpzero.tensor_parallel.random import (
    MODEL_PARALLEL_RNG_TRACKER_NAME,
    RNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
)
from mpzero.tensor_parallel.utils import divide, set_tensor_model_parallel_attributes

__all__ = [
    "ColumnParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "init_method_normal",
    "scaled_init_method_normal",
    "vocab_parallel_cross_entropy",
    "bias_gelu",
    "gelu_mlp",
    "parallel_gelu_mlp",
    "parallel_mlp",
    "fused_paths",
    "set_fused_paths",
    "linear_heads",
    "split_heads",
    "add_layer_norm",
    "add_rms_norm",
    "fused_layer_norm",
    "fused_rms_norm",
    "norm",
    "add_norm",
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "reduce_grad_over_tensor_model_parallel_region",
    "mark_sequence_parallel",
    "checkpoint",
    "MODEL_PARALLEL_RNG_TRACKER_NAME",
    "RNGStatesTracker",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "model_parallel_manual_seed",
    "divide",
    "set_tensor_model_parallel_attributes",
]
