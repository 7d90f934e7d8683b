"""`ExpertOptimizerCallback`: the expert-wise CPU optimizer inside a stock `transformers.Trainer`.

What it does, in Trainer order (clip -> on_pre_optimizer_step -> optimizer.step -> scheduler.step -> zero_grad):
- on_init_end: removes what interrupted checkpoint saves left in `output_dir` (see `checkpoints.py`), so that the
  Trainer's `resume_from_checkpoint=True` never picks a partial checkpoint.
- on_train_begin: builds an `ExpertOptimizer` over the model's offload engine with the Trainer's AdamW settings
  (lr follows the Trainer's optimizer, i.e. its scheduler, every step); with `max_grad_norm` it takes clipping over
  (exact global norm across expert and non-expert gradients) so the Trainer does not clip the non-expert part alone.
  The experts' Adam state follows the Trainer's optimizer: `train()` again continues it (the Trainer keeps its
  optimizer), a new Trainer on a model an earlier Trainer trained starts it afresh (a new optimizer starts from zero
  moments), as `torch.optim.AdamW` over resident experts would.
  When the Trainer resumes (from any path: the argument of `Trainer.train(resume_from_checkpoint=...)`), it restores
  the experts' fp32 weights, Adam moments and step counts from that checkpoint, or stops with an error that says what
  is missing there; never a silent restart from the initial expert weights.
- during backward: experts are stepped as their gradients finish on the micro-step that closes the accumulation
  window (the Trainer's `sync_gradients`), overlapping the rest of backward (ES-MoE §4.1).
- on_pre_optimizer_step: closes the window (deferred mode: clip, then step all experts). With fp16 (the Trainer's
  accelerate `GradScaler`): unscales the non-expert gradients, unscales and checks the expert ones, and an overflow
  anywhere skips every step of the window, experts and non-experts alike, and backs the scale off (`GradScaler.step`
  semantics; an expert overflow is handed to the scaler as an inf in a non-expert gradient).
- on_step_end / on_epoch_end (when the Trainer is about to save) and on_evaluate (`save_strategy="best"`, a new
  best): writes `expert_state.safetensors` into the coming checkpoint folder before the Trainer's own files, so a
  checkpoint is never complete without it; on_save writes it if that did not happen (a save requested later).
- on_log: adds optimizer time, overlap and offload telemetry to the logs, and replaces the Trainer's `grad_norm`
  (non-expert parameters only) by the norm over all parameters that the clipping computed.

Offloaded experts are not `nn.Parameter`s, so the Trainer's optimizer never holds them (no double step) and DDP does
not all-reduce them (each rank keeps single-process semantics for its experts).
"""

from __future__ import annotations

import logging
import os
import weakref

from accelerate import PartialState
from transformers import TrainerCallback

from ..offload.api import get_offload_engine
from ..errors import CheckpointError
from ..offload.checkpoint import load_expert_state, read_expert_state_header, save_expert_state
from ..offload.telemetry import add_to_logs, remove_from_logs
from .checkpoints import (
    NOT_FOUND,
    checkpoint_problems,
    clean_interrupted_saves,
    latest_complete_checkpoint,
    trainer_resume_argument,
)
from .dense_host import HostDenseAdamW
from .expert_optimizer import ExpertOptimizer

logger = logging.getLogger(__name__)


# engine -> the (inner) optimizer of the last Trainer that trained it: a new one starts the experts' Adam state afresh.
_TRAINED_WITH: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _has_offloaded_experts(model) -> bool:
    engine = get_offload_engine(model) if model is not None else None
    return engine is not None and engine.store is not None


class ExpertOptimizerCallback(TrainerCallback):
    """See the module docstring. `resume_from_checkpoint` overrides the checkpoint the experts are restored from
    (by default: the one the Trainer resumes from). `workers`: `ExpertOptimizer`'s (None: its default)."""

    def __init__(self, clip_mode: str = "global", workers: int | None = None,
                 resume_from_checkpoint: str | None = None):
        self.clip_mode = clip_mode
        self.workers = workers
        self.resume_from_checkpoint = resume_from_checkpoint
        self.expert_optimizer: ExpertOptimizer | None = None
        self._engine = None  # the model's offload engine, from `on_train_begin`
        self._max_grad_norm = None
        self._trainer_optimizer = None
        self._dense: HostDenseAdamW | None = None  # the Trainer's optimizer where it steps on the host
        self._saved_step: int | None = None  # the step whose checkpoint already has the expert state

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if not _has_offloaded_experts(model):
            return
        if args.process_index == 0:
            clean_interrupted_saves(args.output_dir)
        PartialState().wait_for_everyone()

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        engine = get_offload_engine(model)
        if engine is None or engine.store is None:
            logger.warning("ExpertOptimizerCallback: the model has no offloaded experts; nothing to do")
            return
        self._trainer_optimizer = optimizer
        self._engine = engine
        if args.world_size > 1 and not engine.updates.shared:
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
        resume = self._resume_path(args, state)
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper is made anew by every train()
        self._dense = inner if isinstance(inner, HostDenseAdamW) else None
        if self._dense is not None:  # the dense weights stepped on the host: one thread budget, one global norm
            self._dense.attach(self.expert_optimizer)
        last = _TRAINED_WITH.get(engine)
        if resume is None and last is not None and last() is not inner and (engine.store.trainable
                                                                              or engine.updates.lora_in_store):
            if engine.updates.shared:  # NOTE: ranks share the store; one reset would need a collective
                logger.warning("ExpertOptimizerCallback: a new Trainer under expert parallelism: the experts' Adam "
                               "state continues from the earlier run (not reset across ranks)")
            else:
                engine.synchronize()
                if engine.store.trainable:
                    engine.store.reset_optimizer_state()
                engine.updates.lora.reset_optimizer_state()
                logger.info("ExpertOptimizerCallback: a new Trainer's optimizer: the experts' Adam state starts "
                            "afresh")
        if inner is not None:
            _TRAINED_WITH[engine] = weakref.ref(inner)
        if resume is not None:
            self._restore(engine, str(resume), state)

    def _resume_path(self, args, state) -> str | None:
        if self.resume_from_checkpoint is not None:
            return self.resume_from_checkpoint
        path = trainer_resume_argument()
        if path is not NOT_FOUND:
            return path
        if state.global_step == 0:
            return None
        # Not called from Trainer.train (or a transformers that renamed its loop): this run's own checkpoint.
        candidate = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(candidate):
            return candidate
        raise CheckpointError(
            f"the Trainer resumed at step {state.global_step}, but the checkpoint it resumed from could not be "
            "determined, so the offloaded experts cannot be restored: pass "
            "ExpertOptimizerCallback(resume_from_checkpoint=PATH)"
        )

    def _restore(self, engine, resume: str, state) -> None:
        problems = checkpoint_problems(resume, experts=True)
        if problems:
            parent = os.path.dirname(os.path.abspath(resume))
            latest = latest_complete_checkpoint(parent)
            hint = f"; the latest complete checkpoint beside it is {latest}" if latest else ""
            raise CheckpointError(
                f"cannot resume the offloaded experts from {resume}: {'; '.join(problems)}{hint}"
            )
        saved_step = read_expert_state_header(resume).get("global_step")
        if saved_step is not None and state.global_step and int(saved_step) != state.global_step:
            raise CheckpointError(
                f"{resume}: its expert state is of step {saved_step} but its trainer state of step "
                f"{state.global_step}; the folder mixes two checkpoints"
            )
        self.expert_optimizer.load_state_dict(load_expert_state(engine, resume))
        logger.info("restored expert weights and optimizer state from %s", resume)

    def _save(self, args, state) -> None:
        """Write the expert state into the checkpoint folder of this step (the main process; the others wait, so no
        expert changes while it is read)."""
        if self.expert_optimizer is None or self._saved_step == state.global_step:
            return
        if args.process_index == 0:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            save_expert_state(self._engine, folder, self.expert_optimizer.state_dict(),
                              global_step=state.global_step)
        PartialState().wait_for_everyone()
        self._saved_step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._save(args, state)

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._save(args, state)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        # save_strategy="best": the Trainer decides to save after this call; a new best means it will.
        if args.save_strategy != "best" or not metrics:
            return
        name = args.metric_for_best_model or "loss"
        name = name if name.startswith("eval_") else f"eval_{name}"
        value = metrics.get(name)
        if value is None:
            return
        best = state.best_metric
        if best is None or (value > best if args.greater_is_better else value < best):
            self._save(args, state)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.expert_optimizer is None:
            return
        params = [p for g in self._trainer_optimizer.param_groups for p in g["params"]]
        overflow = self.expert_optimizer.unscale_(self._trainer_optimizer)  # fp16 only; the Trainer then scaler-steps
        self.expert_optimizer.step(non_expert_params=params, expert_overflow=overflow, dense=self._dense)

    def on_save(self, args, state, control, **kwargs):
        # Normally written before the Trainer's files (see on_step_end); a save requested after our on_step_end
        # (e.g. by another callback) gets it here, after them.
        self._save(args, state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.expert_optimizer is None or logs is None:
            return
        opt = self.expert_optimizer
        values = {
            "expert_optim/step_s": round(opt.step_seconds, 4),
            "expert_optim/overlap": round(opt.overlapped_seconds / opt.step_seconds, 3) if opt.step_seconds else 0.0,
        }
        if opt.last_grad_norm is not None:
            # The Trainer's own grad_norm covers the non-expert parameters only (offloaded experts are not
            # parameters); the norm the clipping used covers all of them.
            values["grad_norm"] = opt.last_grad_norm
        elif "grad_norm" in logs:
            # Without clipping no norm over the experts is taken: name what the Trainer's figure covers.
            values["grad_norm_non_expert"] = logs["grad_norm"]
            remove_from_logs(state, logs, "grad_norm")
        values.update({k: round(v, 4) for k, v in self._engine.stats.as_log_dict().items()})
        add_to_logs(state, logs, values)
        self._engine.stats.reset()

    def on_train_end(self, args, state, control, **kwargs):
        if self.expert_optimizer is None:
            return
        self.expert_optimizer.close()
        if self._max_grad_norm is not None:
            args.max_grad_norm = self._max_grad_norm


__all__ = ["ExpertOptimizerCallback"]
