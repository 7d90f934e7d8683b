"""`ExpertAwareOptimizer`: the expert optimizer inside a hand-written (accelerate) loop, behind the interface of the
non-expert optimizer it wraps (with the Trainer, `ExpertOptimizerCallback` plays this part)."""

from __future__ import annotations

import torch

from .dense_host import HostDenseAdamW


class ExpertAwareOptimizer:
    """Wraps the non-expert optimizer for hand-written (accelerate) loops: `step()` closes the expert window
    (clipping globally if configured) and then steps the non-expert parameters; `zero_grad()` clears the non-expert
    gradients (each expert's store gradient is cleared when the expert is stepped, or on an fp16 overflow).
    With fp16 (`ExpertOptimizer(grad_scaler=...)`; under accelerate, the prepared optimizer's scaler), `step()` also
    does the loss-scaler's part: an overflow anywhere skips every step of the window and backs the scale off.

    Under `accelerate`, prepare the inner optimizer as usual and wrap the prepared one; scheduler steps still act on
    `param_groups`, which this wrapper shares, and `ExpertOptimizer.lr_fn` reads them.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, expert_optimizer):  # an ExpertOptimizer
        self.optimizer = optimizer
        self.expert_optimizer = expert_optimizer
        if expert_optimizer.lr_fn is None:
            expert_optimizer.lr_fn = lambda: self.optimizer.param_groups[0]["lr"]
        # The dense weights' optimizer on the host (optim/dense_host.py): one thread budget, one global norm.
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        self.dense = inner if isinstance(inner, HostDenseAdamW) else None
        if self.dense is not None:
            self.dense.attach(expert_optimizer)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        overflow = self.expert_optimizer.unscale_(self.optimizer)  # fp16 only
        self.expert_optimizer.step(non_expert_params=params, expert_overflow=overflow, dense=self.dense)
        scaler = self.expert_optimizer.grad_scaler
        if overflow is not None and getattr(self.optimizer, "scaler", None) is None:
            # A plain torch optimizer: the scaler steps it (skipped on overflow) and updates the scale. (accelerate's
            # AcceleratedOptimizer does both inside its own step.)
            out = scaler.step(self.optimizer, closure) if closure is not None else scaler.step(self.optimizer)
            scaler.update()
            return out
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "experts": self.expert_optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.expert_optimizer.load_state_dict(state["experts"])


__all__ = ["ExpertAwareOptimizer"]
