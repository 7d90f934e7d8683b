"""`ExpertOptimizerCallback`: the expert-wise CPU optimizer inside a stock `transformers.Trainer`.

What it does, in Trainer order (clip -> on_pre_optimizer_step -> optimizer.step -> scheduler.step -> zero_grad):
- on_train_begin: builds an `ExpertOptimizer` over the model's offload engine with the Trainer's AdamW settings
  (lr follows the Trainer's optimizer, i.e. its scheduler, every step); with `max_grad_norm` it takes clipping over
  (exact global norm across expert and non-expert gradients) so the Trainer does not clip the non-expert part alone.
  On resume it restores the expert state saved in the checkpoint folder.
- during backward: experts are stepped as their gradients finish on the micro-step that closes the accumulation
  window (the Trainer's `sync_gradients`), overlapping the rest of backward (ES-MoE §4.1).
- on_pre_optimizer_step: closes the window (deferred mode: clip, then step all experts). With fp16 (the Trainer's
  accelerate `GradScaler`): unscales the non-expert gradients, unscales and checks the expert ones, and an overflow
  anywhere skips every step of the window, experts and non-experts alike, and backs the scale off (`GradScaler.step`
  semantics; an expert overflow is handed to the scaler as an inf in a non-expert gradient).
- on_save: writes `expert_state.safetensors` (fp32 master weights, Adam moments, steps) into the checkpoint folder.
- on_log: adds optimizer time, overlap and offload telemetry to the logs.

Offloaded experts are not `nn.Parameter`s, so the Trainer's optimizer never holds them (no double step) and DDP does
not all-reduce them (each rank keeps single-process semantics for its experts).
"""

from __future__ import annotations

import logging
import os

from transformers import TrainerCallback

from ..offload.api import get_offload_engine
from ..offload.checkpoint import EXPERT_STATE_FILE, load_expert_state, save_expert_state
from ..offload.telemetry import add_to_logs
from .expert_optimizer import ExpertOptimizer

logger = logging.getLogger(__name__)


class ExpertOptimizerCallback(TrainerCallback):
    def __init__(self, clip_mode: str = "global", workers: int = 2, resume_from_checkpoint: str | None = None):
        self.clip_mode = clip_mode
        self.workers = workers
        self.resume_from_checkpoint = resume_from_checkpoint
        self.expert_optimizer: ExpertOptimizer | None = None
        self._max_grad_norm = None
        self._trainer_optimizer = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        engine = get_offload_engine(model)
        if engine is None or engine.store is None:
            logger.warning("ExpertOptimizerCallback: the model has no offloaded experts; nothing to do")
            return
        self._trainer_optimizer = optimizer
        if args.world_size > 1 and getattr(engine, "coordinator", None) is None:
            logger.warning(
                "ExpertOptimizerCallback under %d processes without expert parallelism: every rank updates its own "
                "copy of the offloaded experts from its own batches, so the copies drift apart. Call "
                "hf_moe_offload.distributed.enable_expert_parallel(model, mode='dynamic') before the Trainer for "
                "single-model semantics", args.world_size,
            )
        if args.max_grad_norm and args.max_grad_norm > 0:
            # Exact global clipping needs the expert gradients too: take it over from the Trainer.
            self._max_grad_norm = args.max_grad_norm
            args.max_grad_norm = 0.0
        self.expert_optimizer = ExpertOptimizer(
            engine,
            lr=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
            weight_decay=args.weight_decay,
            max_grad_norm=self._max_grad_norm,
            clip_mode=self.clip_mode,
            workers=self.workers,
            lr_fn=lambda: optimizer.param_groups[0]["lr"],
            # accelerate's AcceleratedOptimizer carries the fp16 GradScaler (None for fp32/bf16 and on CPU).
            grad_scaler=getattr(optimizer, "scaler", None),
        )
        resume = self.resume_from_checkpoint
        if resume is None and state.global_step > 0:
            # Trainer restored trainer_state.json from checkpoint-<global_step> before calling us.
            candidate = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            resume = candidate if os.path.isdir(candidate) else None
        if resume is not None:
            if not os.path.exists(os.path.join(resume, EXPERT_STATE_FILE)):
                raise FileNotFoundError(
                    f"resuming from {resume}, but it has no {EXPERT_STATE_FILE}: was it saved with ExpertOptimizerCallback?"
                )
            self.expert_optimizer.load_state_dict(load_expert_state(engine, resume))
            logger.info("restored expert weights and optimizer state from %s", resume)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.expert_optimizer is None:
            return
        params = [p for g in self._trainer_optimizer.param_groups for p in g["params"]]
        overflow = self.expert_optimizer.unscale_(self._trainer_optimizer)  # fp16 only; the Trainer then scaler-steps
        self.expert_optimizer.step(non_expert_params=params, expert_overflow=overflow)

    def on_save(self, args, state, control, **kwargs):
        if self.expert_optimizer is None:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        save_expert_state(self.expert_optimizer.engine, folder, self.expert_optimizer.state_dict())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.expert_optimizer is None or logs is None:
            return
        opt = self.expert_optimizer
        values = {
            "expert_optim/step_s": round(opt.step_seconds, 4),
            "expert_optim/overlap": round(opt.overlapped_seconds / opt.step_seconds, 3) if opt.step_seconds else 0.0,
        }
        if opt.last_expert_grad_norm is not None:
            values["grad_norm_with_experts"] = opt.last_expert_grad_norm
        values.update({k: round(v, 4) for k, v in opt.engine.stats.as_log_dict().items()})
        add_to_logs(state, logs, values)
        opt.engine.stats.reset()

    def on_train_end(self, args, state, control, **kwargs):
        if self.expert_optimizer is None:
            return
        self.expert_optimizer.close()
        if self._max_grad_norm is not None:
            args.max_grad_norm = self._max_grad_norm


__all__ = ["ExpertOptimizerCallback"]
