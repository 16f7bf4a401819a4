"""fp32 master weights for a model with 16-bit parameters (``--bf16 --optimizer adamw``).

Megatron's ``Float16OptimizerWithFloat16Params`` in a few lines: each bf16 model
parameter gets an fp32 master copy, which is what the torch optimizer sees.

- **Gradients** are moved, as soon as autograd has accumulated them into the bf16
  ``param.grad``, into the master's fp32 ``.grad`` (a post-accumulate-grad hook
  adds them there and frees ``param.grad``), so gradient accumulation over
  micro-batches sums in fp32, not in bf16.
- **The step** runs on the masters; :meth:`MasterWeights.copy_to_model` then
  rounds them into the bf16 parameters (round to nearest even).
- **Checkpoints** keep the masters (:meth:`state_dict`), so a resumed run continues
  from the exact fp32 values, not from the rounded model weights.

The masters carry the model parameters' public attributes
(``tensor_model_parallel``, ``partition_dim``, ...), which the gradient norm reads.
"""

from __future__ import annotations

import torch


class MasterWeights:
    """fp32 copies of ``params`` (16-bit model parameters) and their fp32 gradients."""

    def __init__(self, params, dtype: torch.dtype = torch.float32) -> None:
        self.model_params = [p for p in params if p.requires_grad]
        self.masters = [self._master(p, dtype) for p in self.model_params]
        self._by_param = {id(p): m for p, m in zip(self.model_params, self.masters)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._move_grad)
                       for p in self.model_params]

    @staticmethod
    def _master(p: torch.Tensor, dtype: torch.dtype) -> torch.nn.Parameter:
        m = torch.nn.Parameter(p.detach().to(dtype, copy=True))
        for key, value in vars(p).items():  # tensor_model_parallel, partition_dim, ...
            if not key.startswith("_"):
                setattr(m, key, value)
        return m

    def master_of(self, p: torch.Tensor) -> torch.nn.Parameter:
        return self._by_param[id(p)]

    def _move_grad(self, p: torch.Tensor) -> None:
        """Add ``p.grad`` (bf16, summed by autograd over this backward) into the master's
        fp32 gradient and free it."""
        m = self._by_param[id(p)]
        if m.grad is None:
            m.grad = p.grad.to(m.dtype)
        else:
            m.grad.add_(p.grad)
        p.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the masters into the model parameters (after each step)."""
        torch._foreach_copy_(self.model_params, self.masters)

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Reset the masters to the model's values (after loading a model without the
        optimizer state; Megatron's ``reload_model_params``)."""
        torch._foreach_copy_(self.masters, self.model_params)

    def state_dict(self) -> list[torch.Tensor]:
        return [m.detach().clone() for m in self.masters]

    @torch.no_grad()
    def load_state_dict(self, masters: list[torch.Tensor]) -> None:
        if len(masters) != len(self.masters):
            raise ValueError(f"the checkpoint has {len(masters)} master weights, this model "
                             f"{len(self.masters)}")
        for m, saved in zip(self.masters, masters):
            if m.shape != saved.shape:
                raise ValueError(f"master weight of shape {tuple(saved.shape)} in the "
                                 f"checkpoint, {tuple(m.shape)} in this model")
            m.copy_(saved)
