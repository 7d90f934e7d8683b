"""`ExpertParallelCallback`: static expert parallelism / PPMoE with resident experts inside a stock `Trainer`.

With resident experts each rank trains only its block of experts (DDP leaves them alone), which the Trainer does not
know about:
- gradient clipping: the Trainer's `clip_grad_norm_` would see only this rank's experts, so every rank would clip by
  a different factor and the DDP replicas would drift apart. The callback takes clipping over (as
  `ExpertOptimizerCallback` does) and clips by the global norm, expert squares all-reduced (`clip_grad_norm_`);
- checkpoints: before every save (and at the end of training) every expert's weights are copied from the rank that
  trains it to all ranks (`sync_expert_parameters`), so rank 0 writes the trained model.

Offloaded experts with dynamic placement need no such callback: they live in one node-shared store and the
`ExpertOptimizerCallback` steps them (its global clipping already reduces across ranks).
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from ..offload.telemetry import add_to_logs
from .expert_parallel import clip_grad_norm_, get_expert_parallel, sync_expert_parameters

logger = logging.getLogger(__name__)


class ExpertParallelCallback(TrainerCallback):
    def __init__(self):
        self._max_grad_norm: float | None = None
        self.last_grad_norm: float | None = None

    def _resident(self, model) -> bool:
        coordinator = get_expert_parallel(model) if model is not None else None
        return coordinator is not None and coordinator.engine is None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not self._resident(model):
            logger.warning("ExpertParallelCallback: no resident expert parallelism on this model; nothing to do")
            return
        if args.max_grad_norm and args.max_grad_norm > 0:
            self._max_grad_norm = args.max_grad_norm
            args.max_grad_norm = 0.0  # clipped in on_pre_optimizer_step, by the norm over all ranks' experts

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self._max_grad_norm is not None and self._resident(model):
            self.last_grad_norm = clip_grad_norm_(model, self._max_grad_norm)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        # DefaultFlowCallback (first in the list) has already decided whether this step saves or ends training.
        if self._resident(model) and (control.should_save or control.should_training_stop):
            sync_expert_parameters(model)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if logs is None:
            return
        values = {}
        if self.last_grad_norm is not None:
            values["grad_norm_expert_parallel"] = round(self.last_grad_norm, 4)
        coordinator = get_expert_parallel(model) if model is not None else None
        if coordinator is not None:
            values["expert_parallel/load_max_over_mean"] = round(coordinator.load_imbalance(), 4)
        add_to_logs(state, logs, values)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self._max_grad_norm is not None:
            args.max_grad_norm = self._max_grad_norm
        if self._resident(model):
            sync_expert_parameters(model)


__all__ = ["ExpertParallelCallback"]
