"""What the Adam kernels read besides the tensors: the step count, each param group's
learning rate and the gradient scale, on the host or (``capturable``) on the device."""

from __future__ import annotations

import torch

from mpzero.optimizers.options import Options


class StepState:
    """Step count, learning rates and the gradient scale of one optimizer."""

    def __init__(self, options: Options, param_groups: list[dict]):
        self.capturable = options.capturable
        self.adam_w_mode = options.adam_w_mode
        self.device = options.device
        self.param_groups = param_groups
        self.steps = 0
        # capturable: the step count lives on the device and skipped steps (found inf)
        # do not advance it, without a host sync.
        self.step_t = (torch.zeros((), dtype=torch.float32, device=self.device)
                       if self.capturable else None)
        # The factor the kernels multiply gradients by: unscale and clipping fold into it.
        self.grad_scale = torch.ones((), dtype=torch.float32, device=self.device)
        self.grad_scaled = False  # grad_scale != 1
        # capturable: each group's lr is a 0-dim device tensor that the kernels read and
        # LR schedulers update in place (``group["lr"].fill_(...)``), so a CUDA graph
        # replays the current lr, not the one of capture time.
        self.lr_tensors: list[torch.Tensor | None] = []
        self.mirror: torch.Tensor | None = None  # optimizer.state[p]["step"], shared
        self.mirrored = False
        if self.capturable:
            for gi in range(len(param_groups)):
                self.device_lr(gi)

    # -- the step count ------------------------------------------------------------
    def count(self):
        """Steps taken: an int, or a 0-dim device tensor with ``capturable``."""
        return self.step_t.clone() if self.capturable else self.steps

    def set_count(self, step) -> None:
        if self.capturable:
            self.step_t.fill_(float(step))
        else:
            self.steps = int(step.item() if isinstance(step, torch.Tensor) else step)
        self.update_mirror()

    def advance(self, found_inf: torch.Tensor | None) -> None:
        """One more step (on the device, not where ``found_inf`` says it is skipped)."""
        if self.capturable:
            self.step_t.add_(1.0 if found_inf is None else 1.0 - found_inf)
        else:
            self.steps += 1

    def update_mirror(self, state=None, params=()) -> None:
        """``optimizer.state[p]["step"]`` for every trained parameter, as torch optimizers
        have it: one shared 0-dim fp32 tensor updated in place (a CPU tensor, or the device
        step count with ``capturable``), so no per-parameter work. ``state`` / ``params``:
        where to put it the first time (once the layout is made)."""
        if self.capturable:
            shared = self.step_t
        else:
            if self.mirror is None:
                self.mirror = torch.zeros((), dtype=torch.float32)
            shared = self.mirror
            shared.fill_(float(self.steps))
        if state is not None and not self.mirrored:
            for p in params:
                state[p]["step"] = shared
            self.mirrored = True

    # -- learning rates and the scale ------------------------------------------------
    def device_lr(self, gi: int) -> torch.Tensor:
        """capturable: group ``gi``'s lr as a 0-dim device tensor. A number set on the group
        (by the user, a scheduler or a load) is copied in place into that tensor, which
        then stands in the group again, so graphs captured earlier see it."""
        group = self.param_groups[gi]
        while len(self.lr_tensors) <= gi:
            self.lr_tensors.append(None)
        lr_t = self.lr_tensors[gi]
        if lr_t is None:
            lr_t = self.lr_tensors[gi] = torch.zeros((), dtype=torch.float32, device=self.device)
            lr_t.fill_(float(group["lr"]))
            group["lr"] = lr_t
        elif group["lr"] is not lr_t:
            value = group["lr"]
            if isinstance(value, torch.Tensor):
                lr_t.copy_(value.reshape(()))
            else:
                lr_t.fill_(float(value))
            group["lr"] = lr_t
        return lr_t

    def after_load(self) -> None:
        """Loaded param groups reach the device lr (capturable)."""
        if self.capturable:
            for gi in range(len(self.param_groups)):
                self.device_lr(gi)
        self.update_mirror()

    def scale_by(self, factor: torch.Tensor) -> None:
        """Fold ``factor`` (unscale, clipping) into the gradient scale."""
        self.grad_scale.mul_(factor)
        self.grad_scaled = True

    def reset_scale(self) -> None:
        """Back to 1 for the next gradients (no device work when it was never changed;
        with ``capturable`` always, so a captured graph resets it)."""
        if self.capturable or self.grad_scaled:
            self.grad_scale.fill_(1.0)
            self.grad_scaled = False

    def hyper(self, gi: int, found_inf: torch.Tensor | None) -> dict:
        """The keyword arguments of ``kernels.adam`` for param group ``gi``."""
        group = self.param_groups[gi]
        beta1, beta2 = group["betas"]
        return dict(lr=self.device_lr(gi) if self.capturable else group["lr"],
                    beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step=self.step_t if self.capturable else self.steps,
                    adam_w_mode=self.adam_w_mode, bias_correction=bool(group["bias_correction"]),
                    grad_scale=self.grad_scale if self.capturable or self.grad_scaled
                    else None, found_inf=found_inf)
