"""Expert-wise CPU optimizer (ES-MoE §4.1 "Expert-wise CPU-based optimization").

Each expert's Adam/AdamW step runs on the host, on worker threads, as soon as that expert's gradient is final: on
the micro-step that closes a gradient-accumulation window, the engine hands every finished expert here during
backward, so host updates overlap the rest of backward. (Where the disk tier's experts compute on the CPU, the step
runs on the thread that hands the gradient over by default: see `ExpertOptimizer.workers`.) On other micro-steps
gradients only accumulate in the store. The next forward of expert e waits for e's own update only (no delayed
update, no staleness). Pinned experts whose state lives on the device (training on a GPU: offload/pins/device_pins.py)
step there instead, in `step()`, with the same fused arithmetic.

Semantics are those of `torch.optim.AdamW` / `Adam` (the same fused kernel, on per-expert views): betas, eps,
decoupled or L2 weight decay (matrices only, as transformers' Trainer groups parameters), bias correction with a
per-expert step count, and a per-step learning rate read from `lr_fn` (e.g. the Trainer's scheduler).

Clipping and loss scaling need every gradient before any update, so they switch to the *deferred* mode, where
experts are stepped in `step()` after backward (still on parallel workers, no longer overlapping backward):
- `clip_mode="global"`: exact `clip_grad_norm_` semantics over expert and non-expert gradients together;
- `clip_mode="per_expert"`: the cheaper mode; each expert is clipped by its own norm to `max_grad_norm` during
  backward (stays eager), non-expert parameters are clipped among themselves. Not equivalent to global clipping.
- fp16 loss scaling (`grad_scaler=`): expert gradients are unscaled and checked; an overflow anywhere skips every
  expert step, as `GradScaler.step` skips the non-expert one.

With `OffloadConfig.lora_in_store` the experts' LoRA factors, kept in the store, are stepped here too, with the same
windows, learning rate, clipping and loss scaling (`lora_steps`).

This module claims the final gradients and closes windows; the rest has a module each: `adamw_step` (the pure step:
unscale, clip, AdamW), `store_steps` (records landed, stepped and cleared), `step_queue` (the workers and the experts
waiting for them), `grad_norms` (norms for clipping, inf/nan checks), `window_clock` (windows, their learning rate and
timing), `aware_optimizer` (the wrapper for hand-written loops).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from ..offload.engine import GradArrival, OffloadEngine
from ..offload.updates import ExpertUpdates
from ..offload.stores.store import ExpertKey, ExpertRecord
from .adamw_step import AdamWSettings, adamw_update_
from .aware_optimizer import ExpertAwareOptimizer
from .grad_norms import GradNorms, global_clip, non_finite, unscale_non_experts_
from .lora_steps import LoraSteps
from .step_queue import StepQueue, batch_size
from .store_steps import Entry, Step, StoreSteps
from .window_clock import WindowClock, accelerate_sync_gradients

logger = logging.getLogger(__name__)


class ExpertOptimizer:
    """Adam(W) for the experts held in an `OffloadEngine`'s store.

    Example (hand-written loop; with the Trainer use `ExpertOptimizerCallback`):

    ```python
    >>> engine = enable_expert_offload(model, OffloadConfig(mode="host"))
    >>> expert_opt = ExpertOptimizer(engine, lr=1e-3, weight_decay=0.01)
    >>> loss.backward()          # experts step here, as their gradients finish
    >>> expert_opt.step()        # steps whatever is left; non-expert optimizer.step() after it
    ```
    """

    def __init__(
        self,
        engine: OffloadEngine,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = True,
        max_grad_norm: float | None = None,
        clip_mode: str = "global",
        workers: int | None = None,
        lr_fn: Callable[[], float] | None = None,
        boundary_fn: Callable[[], bool] | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        defer_steps: bool = False,
    ):
        if engine.store is None:
            raise ValueError("ExpertOptimizer needs offloaded experts (mode host or disk); on the device tier use "
                             "the ordinary optimizer")
        if not engine.store.trainable and not engine.updates.lora_in_store:
            raise ValueError("these experts were offloaded frozen (OffloadConfig(train_experts=False)): their store "
                             "holds weights only, no gradient or Adam state; offload with train_experts=True to "
                             "train them (or with lora_in_store=True to step their LoRA factors here)")
        if clip_mode not in ("global", "per_expert"):
            raise ValueError(f"clip_mode must be 'global' or 'per_expert', got {clip_mode!r}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        if workers is not None and workers < 0:
            raise ValueError(f"workers must be >= 0 (0: steps run on the thread that hands the gradients over), "
                             f"got {workers}")
        # The engine's surface for its optimizer (offload/updates.py): the store, the ledger, the barriers.
        self.updates: ExpertUpdates = engine.updates
        self.store = engine.store
        self.lr, self.betas, self.eps = lr, betas, eps
        self.weight_decay, self.decoupled = weight_decay, decoupled_weight_decay
        self.max_grad_norm, self.clip_mode = max_grad_norm, clip_mode
        self.lr_fn = lr_fn
        self.boundary_fn = boundary_fn or accelerate_sync_gradients
        self.grad_scaler = grad_scaler
        self.defer_steps = defer_steps
        self.workers_setting = workers
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None  # over every parameter, experts included (when clipping)
        self._clock = WindowClock()
        # Late-bound, so that a job always runs the optimizer's current `_step_experts` and `_batch_size`.
        self._queue = StepQueue(lambda: self.workers, lambda entries, *step: self._step_experts(entries, *step),
                                lambda *args, **kwargs: self._batch_size(*args, **kwargs),
                                self.updates.ledger.set_pending, self.updates.optimizer_threads)
        self._records = StoreSteps(self.updates, self._queue)
        self._norms = GradNorms(self._records)
        self._lora = LoraSteps(engine.updates.lora)  # the experts' LoRA factors kept in the store (lora_in_store)
        # Removed by `close()`: a later optimizer on the same model (a second Trainer, `train()` again) must not find
        # this one's hooks still taking gradients.
        ledger = self.updates.ledger
        self._hooks = [ledger.add_grad_hook(self._on_grads, steps_now=lambda: self.eager and self.boundary_fn()),
                       ledger.add_layer_done_hook(self._on_layer_done)]

    # --- workers and timing ---
    @property
    def workers(self) -> int:
        """Threads stepping experts; 0: each job runs on the thread that submits it (in backward, the one computing).
        Unset: the engine's plan says (`OffloadPlan.optimizer_workers`: 0 where the disk tier's experts compute on the
        CPU, else 2), 2 before it binds."""
        return self.workers_setting if self.workers_setting is not None else self.updates.default_workers()

    # The queue's pool and the window's stepped experts, where benchmarks/cpu_optimizer.py and the tests reach them.
    _executor = property(lambda self: self._queue.executor, lambda self, pool: setattr(self._queue, "executor", pool))
    _pool = property(lambda self: self._queue.pool)
    _stepped = property(lambda self: self._clock.stepped)

    def _batch_size(self, ready: int, workers: int, held: bool = False) -> int:
        """Experts per job: on the disk tier, at most what the host cache can hold beside the reads in flight after
        backward (`step()`), unless the records are `held` already (handed over by the backward)."""
        return batch_size(ready, workers, None if held else self.updates.cache_room())

    def _cache_bound(self) -> bool:
        """The disk tier: the records a step holds compete for the host cache with the stream's."""
        return self.updates.cache_room() is not None

    step_seconds = property(lambda self: self._clock.step_seconds,
                            doc="Busy seconds of the previous window's expert steps.")
    overlapped_seconds = property(lambda self: self._clock.overlapped_seconds,
                                  doc="The part of `step_seconds` that ran before `step()` was called, hidden behind "
                                      "backward (ES-MoE §4.1).")

    # --- modes ---
    @property
    def eager(self) -> bool:
        """Step during backward (ES-MoE overlap) unless global clipping or loss scaling needs all gradients (or
        `defer_steps=True` asks for every step after backward: the baseline of the overlap measurement)."""
        if self.defer_steps:
            return False
        if self._scaling:
            return False
        return self.max_grad_norm is None or self.clip_mode == "per_expert"

    @property
    def _scaling(self) -> bool:
        return self.grad_scaler is not None and self.grad_scaler.is_enabled()

    def current_lr(self) -> float:
        return float(self.lr_fn()) if self.lr_fn is not None else self.lr

    # --- engine hooks (called from backward) ---
    def _on_grads(self, items: list[tuple[ExpertKey, ExpertRecord, GradArrival]]) -> set[ExpertKey]:
        """These experts' gradients are final (the window's last micro-step): step them now (eager), or measure
        their norms now (deferred: clipping / loss scaling need every norm before any step). Returns the experts
        taken; the others are left to the engine."""
        if not self.boundary_fn():
            return set()
        return self._take_final(items)

    def _on_layer_done(self, layer: int) -> None:
        if not self.boundary_fn():
            return
        if self.store.trainable:
            # Experts that got no token in this micro-step still have a (possibly zero) final gradient.
            self._take_final([((layer, e), None, None) for e in range(self.updates.layout(layer).num_experts)])
        if self.eager:  # the layer's LoRA factors in the store: final too
            per_expert = self.max_grad_norm if self.clip_mode == "per_expert" else None
            self._lora.step([layer], self._clock.lr(self.current_lr), self._settings(), None, None, per_expert)

    def _take_final(self, items: list[Entry]) -> set[ExpertKey]:
        """Claim the final gradients of `items` once per window (the experts this process owns) and step them
        (eager) or measure them (deferred). Several eager experts at once (a layer's, from the grouped host path or
        the end of its backward) are stepped several per fused call, as `step()` does, unless each is clipped on its
        own. Returns the keys taken."""
        on_device = self.updates.on_device(key for key, _, _ in items)  # stepped in `step()`, on the device
        owned = [item for item in items if self.updates.owns(item[0]) and item[0] not in on_device]
        wanted = {}
        for key, record, arrival in owned:  # without a record, a deferred expert with no gradient is skipped
            if record is not None or self.eager or self.store.has_grad[key]:
                wanted.setdefault(key, (key, record, arrival))
        taken = [wanted[key] for key in self._clock.claim(wanted, measure=not self.eager)]
        if not self.eager:
            for batch in self._queue.batches(taken, one_each=self._cache_bound()):
                self._norms.track((key for key, _, _ in batch), self._queue.submit(self._norms.measure, batch))
        else:
            self._start_steps(taken, clip_coef=None, grad_scale=None, in_backward=True,
                              per_expert=self.max_grad_norm is not None)
        return {key for key, _, _ in taken}

    # --- stepping ---
    def _start_steps(self, entries: list[Entry], clip_coef: float | None, grad_scale: float | None,
                     in_backward: bool = False, per_expert: bool = False) -> None:
        """Submit the steps of `entries` (already marked stepped in this window): several per job, each job one fused
        multi-tensor Adam call (the kernel treats every tensor independently, so the result equals one call per
        expert bit for bit; only the per-call overhead is shared), or one job per expert where each is clipped by its
        own norm (`per_expert`). Records handed over during backward are held already: they wait in the queue."""
        if not entries:
            return
        for key, _, _ in entries:
            self.updates.ledger.wait_for_update(key)  # the previous window's step of an expert no forward used since
        step = (self._clock.lr(self.current_lr), clip_coef, grad_scale, self._clock.window)
        if in_backward and not per_expert:
            held = [entry for entry in entries if entry[1] is not None]
            self._queue.put(held, step)
            if held:
                self._records.arrived()
            entries = [entry for entry in entries if entry[1] is None]
        # During backward on the disk tier the cache also holds what the stream reads: each expert goes alone.
        one_each = per_expert or in_backward and self._cache_bound()
        self._queue.start(entries, step, self._step_expert if per_expert else self._step_experts, one_each)

    def _step_experts(self, entries: list[Entry], lr: float, clip_coef: float | None, grad_scale: float | None,
                      window: int) -> None:
        """A job: step `entries` in fused calls, their gradients unscaled and clipped by the window's coefficient."""
        with self._clock.timed(window):
            self._records.step_host(entries, self._adam_many, lr, grad_scale, clip_coef, None)

    def _step_expert(self, entries: list[Entry], lr: float, clip_coef: float | None, grad_scale: float | None,
                     window: int) -> None:
        """A job: step one expert (`entries` holds one) clipped by its own norm (`clip_mode="per_expert"`)."""
        with self._clock.timed(window):
            self._records.step_host(entries, lambda steps, lr, *_: self._adam(*steps[0][:2], lr), lr, grad_scale,
                                    clip_coef, self.max_grad_norm)

    def _adam(self, key: ExpertKey, record: ExpertRecord, lr: float) -> bool:
        return self._adam_many([(key, record, self._records.views(key, record.grad))], lr)

    def _adam_many(self, steps: list[Step], lr: float, grad_scale: float | None = None,
                   clip_coef: float | None = None) -> bool:
        """The Adam update of several experts (key, record, its gradient per tensor in layout order, whether the
        record's row or autograd's own tensors), their gradients unscaled and clipped by `clip_coef` first, counted
        in the store's step counts. Returns True where the update wrote the compute copies too (the caller only moves
        the version: `refresh_compute(copied=True)`)."""
        copied = adamw_update_([self._records.tensors(*step) for step in steps], lr, self._settings(), grad_scale,
                               clip_coef)
        for key, _, _ in steps:
            self.store.steps[key] += 1
        return copied

    def _settings(self) -> AdamWSettings:
        return AdamWSettings(self.betas, self.eps, self.weight_decay, self.decoupled)

    def expert_grad_sq_norm(self) -> float:
        """Sum of squared expert gradient norms (call after backward). On the window's last micro-step in deferred
        mode the norms were taken as each gradient became final; otherwise (or for experts not measured) each
        gradient is read once. With a shared store (hf_moe_offload.distributed) each process sums the experts it
        owns and the sums are all-reduced: every process must call it."""
        return self._norms.expert_sq_norm() + self._lora.sq_norm()

    def step(self, non_expert_params: Iterable[torch.nn.Parameter] | None = None,
             expert_overflow: bool | None = None, dense=None) -> float | None:
        """Close the window: step every expert not stepped yet. Returns the clip coefficient applied (deferred mode).

        With `max_grad_norm` and `clip_mode="global"`, pass the non-expert parameters: their gradients are scaled by
        the same coefficient here (so the caller must not clip them again), exactly as `clip_grad_norm_` over all.
        With `clip_mode="per_expert"` each expert is clipped by its own norm (in backward, or here in deferred mode)
        and the non-expert parameters passed are clipped among themselves here (`clip_grad_norm_` over them).
        With a `grad_scaler`, call `scaler.unscale_(optimizer)` first: non-expert gradients are taken as unscaled,
        expert gradients are unscaled here; `expert_overflow`, when the caller already ran `expert_grads_overflow()`,
        saves a second pass over the expert gradients. `dense`: the `HostDenseAdamW` stepping the non-expert
        parameters on the host; the global norm includes its gradients and it is handed the coefficient.
        """
        if not self.boundary_fn():
            return None  # not the window's last micro-step (e.g. inside accelerate's accumulate): keep accumulating
        self._clock.step_called()
        self.updates.wait_for_uploads()  # an evaluation since the backward may have uploads reading host records
        self._queue.order_for_next_forward()
        clip_coef = None
        grad_scale = None
        per_expert = self.max_grad_norm is not None and self.clip_mode == "per_expert"
        clip_dense = dense is not None and self.max_grad_norm is not None and not per_expert
        # (first: it takes the gradients a backward left on the device, which `params` then no longer holds)
        dense_sq = dense.grad_sq_norm() if clip_dense else 0.0
        params = [p for p in (non_expert_params or []) if p.grad is not None]
        if not self.eager:
            if self._scaling:
                grad_scale = float(self.grad_scaler.get_scale())
                if expert_overflow is None:
                    expert_overflow = self.expert_grads_overflow()
                if expert_overflow or non_finite([p.grad for p in params]):
                    self.skipped_steps += 1
                    logger.warning("fp16 overflow: skipping the expert steps of this window")
                    self.updates.zero_grad()
                    self._end_window()
                    return None
            if self.max_grad_norm is not None and not per_expert:
                self.last_grad_norm, clip_coef = global_clip(self.expert_grad_sq_norm(), params, grad_scale,
                                                             self.max_grad_norm, dense_sq)
                for p in params:
                    p.grad.mul_(clip_coef)
                if clip_dense:
                    dense.clip_by(clip_coef, self.last_grad_norm)
        self._norms.measured()  # the measuring jobs landed their gradients: wait for them before stepping
        ready = [key for key in self.store.keys()
                 if self.updates.owns(key) and key not in self._clock.stepped and self.store.has_grad[key]]
        self._clock.stepped.update(ready)
        on_device = self.updates.on_device(ready)
        self._records.step_device(on_device, self._adam_many, lambda: self._clock.lr(self.current_lr), grad_scale,
                                  clip_coef, self.max_grad_norm if per_expert else None)
        self._start_steps([(key, None, None) for key in ready if key not in on_device], clip_coef, grad_scale,
                          per_expert=per_expert)
        self._lora.step(self._lora.pending(), self._clock.lr(self.current_lr), self._settings(), grad_scale, clip_coef,
                        self.max_grad_norm if per_expert else None)
        if per_expert and params:  # the non-expert parameters among themselves (their gradients are unscaled)
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        self._end_window()
        return clip_coef

    def unscale_(self, optimizer) -> bool | None:
        """fp16, on the window's last micro-step, before `step()`: check the (still scaled) expert gradients, hand an
        expert overflow to the GradScaler as an inf in one non-expert gradient (so that the scaler skips the
        non-expert step and backs the scale off), then `scaler.unscale_` the non-expert optimizer (an accelerate
        `AcceleratedOptimizer` or a plain one). Returns the experts' overflow flag for `step(expert_overflow=...)`;
        None without loss scaling or off the boundary."""
        if not self._scaling or not self.boundary_fn():
            return None
        overflow = self.expert_grads_overflow()
        unscale_non_experts_(self.grad_scaler, optimizer, overflow)
        return overflow

    def expert_grads_overflow(self) -> bool:
        """True when any expert gradient (of this rank's updates; all ranks agree) holds inf/nan. Collective under
        expert parallelism. Uses the norms measured during backward where there are some (an overflowed gradient
        has a non-finite norm)."""
        return self._norms.overflow() or self._lora.overflow()

    def _end_window(self) -> None:
        self.updates.close_window()
        self._clock.close()
        self._norms.clear()

    def synchronize(self) -> None:
        self.updates.synchronize()

    # --- state (checkpoints) ---
    def state_dict(self) -> dict:
        self.updates.synchronize()  # the step counts of updates still running on the workers would be stale
        return {
            "lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay,
            "decoupled_weight_decay": self.decoupled, "skipped_steps": self.skipped_steps,
            "steps": {f"{k[0]}.{k[1]}": v for k, v in self.store.steps.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = state.get("skipped_steps", 0)
        for name, v in state["steps"].items():
            layer, e = (int(x) for x in name.split("."))
            self.store.steps[(layer, e)] = int(v)

    def close(self) -> None:
        """Finish every update in flight, stop the workers and take this optimizer's hooks off the engine (a new
        ExpertOptimizer on the same model then steps alone). Closing twice is harmless."""
        self.updates.synchronize()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._queue.shutdown()


__all__ = ["ExpertOptimizer", "ExpertAwareOptimizer", "accelerate_sync_gradients"]
