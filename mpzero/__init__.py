"""mpzero: Megatron-style model parallelism and a ZeRO-2 DistributedFusedAdam for PyTorch.

- :mod:`mpzero.parallel_state`: the tensor × pipeline × context × data process-group grid,
  and inside the data-parallel group the distributed × redundant optimizer grid.
- :class:`mpzero.optimizers.DistributedFusedAdam`: ZeRO-2 Adam/AdamW.
- :mod:`mpzero.tensor_parallel`: tensor-parallel layers.
- :mod:`mpzero.kernels`: fused multi-tensor kernels (CUDA extension or PyTorch reference).
"""

__version__ = "0.1.0"
