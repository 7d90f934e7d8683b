"""Expert-wise CPU optimizer (ES-MoE §4.1 "Expert-wise CPU-based optimization").

Each expert's Adam/AdamW step runs on the host, on worker threads, as soon as that expert's gradient is final: on
the micro-step that closes a gradient-accumulation window, the engine hands every finished expert here during
backward, so host updates overlap the rest of backward. (Where the disk tier's experts compute on the CPU, the step
runs on the thread that hands the gradient over by default: see `ExpertOptimizer.workers`.) On other micro-steps
gradients only accumulate in the store. The next forward of expert e waits for e's own update only (no delayed
update, no staleness). Pinned experts whose state lives on the device (training on a GPU: offload/device_pins.py)
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
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import ExitStack, contextmanager
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.optim.adam import adam

from ..offload.engine import GradArrival, OffloadEngine
from ..offload.store import GRAD, WEIGHTS_AND_GRAD, ExpertKey, ExpertRecord
from .fused_adam import adamw_with_copy, fits

logger = logging.getLogger(__name__)


class _InlineExecutor:
    """`ExpertOptimizer(workers=0)`: a job runs at once on the thread that submits it; its Future comes back done
    (an error is kept in it, as a worker's would be, and raised where the result is waited for)."""

    def submit(self, fn, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as err:
            future.set_exception(err)
        return future

    def shutdown(self, wait: bool = True) -> None:
        pass


class _Held:
    """A record held by `ExpertOptimizer._landed`; `grad_zeroed` tells the store, on release, that the gradient
    was zeroed (the disk tier then neither writes nor reads it); `grads`, the gradient per tensor where it was
    used in place instead of landed (`GradArrival.in_place_of`)."""

    __slots__ = ("record", "grad_zeroed", "grads")

    def __init__(self, record: ExpertRecord):
        self.record = record
        self.grad_zeroed = False
        self.grads = None


def accelerate_sync_gradients() -> bool:
    """True on the micro-step that closes an accumulation window, as accelerate (and the Trainer) set it."""
    try:
        from accelerate.state import GradientState
    except ImportError:  # pragma: no cover
        return True
    return bool(GradientState().sync_gradients)


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
        if not engine.store.trainable:
            raise ValueError("these experts were offloaded frozen (OffloadConfig(train_experts=False)): their store "
                             "holds weights only, no gradient or Adam state; offload with train_experts=True to "
                             "train them")
        if clip_mode not in ("global", "per_expert"):
            raise ValueError(f"clip_mode must be 'global' or 'per_expert', got {clip_mode!r}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        self.engine, self.store = engine, engine.store
        self.lr, self.betas, self.eps = lr, betas, eps
        self.weight_decay, self.decoupled = weight_decay, decoupled_weight_decay
        self.max_grad_norm, self.clip_mode = max_grad_norm, clip_mode
        self.lr_fn = lr_fn
        self.boundary_fn = boundary_fn or accelerate_sync_gradients
        self.grad_scaler = grad_scaler
        self.defer_steps = defer_steps
        if workers is not None and workers < 0:
            raise ValueError(f"workers must be >= 0 (0: steps run on the thread that hands the gradients over), "
                             f"got {workers}")
        self.workers_setting = workers
        self._executor: ThreadPoolExecutor | _InlineExecutor | None = None  # made at the first job (`_pool`)
        self._lock = threading.Lock()
        self._stepped: set[ExpertKey] = set()  # experts already stepped in this window
        self._measured: set[ExpertKey] = set()  # deferred mode: experts whose norm is being / was taken
        self._measuring: dict[ExpertKey, Future] = {}  # their squared norms ({key: norm^2} of a batch per job)
        self._window_lr: float | None = None
        # `_queue_steps`: (expert, its update's Future, (lr, clip, scale, window)) of experts waiting for a worker
        self._ready: deque = deque()
        self._share = 1  # experts per job from `_ready`
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None  # over every parameter, experts included (when clipping)
        # Timing of the previous window (complete once the next one closes, because every forward waits for its
        # experts' updates): busy seconds of its expert steps, and the part of them that ran before step() was called,
        # i.e. hidden behind backward (ES-MoE §4.1 overlap).
        self.step_seconds = 0.0
        self.overlapped_seconds = 0.0
        self._window = 0
        self._jobs: list[tuple[int, float, float]] = []  # (window, start, end) of each expert step
        self._step_called: dict[int, float] = {}
        # Removed by `close()`: a later optimizer on the same model (a second Trainer, `train()` again) must not find
        # this one's hooks still taking gradients.
        self._hooks = [engine.ledger.add_grad_hook(self._on_grads, steps_now=lambda: self.eager and self.boundary_fn()),
                       engine.ledger.add_layer_done_hook(self._on_layer_done)]

    # --- workers ---
    @property
    def workers(self) -> int:
        """Threads stepping experts; 0: each job runs on the thread that submits it (in backward, the one computing).
        Unset: the engine's plan says (`OffloadPlan.optimizer_workers`: 0 where the disk tier's experts compute on the
        CPU, else 2), 2 before it binds."""
        if self.workers_setting is not None:
            return self.workers_setting
        plan = self.engine.plan  # None until the first forward binds the engine (offload/plan.py)
        return 2 if plan is None else plan.optimizer_workers

    @property
    def _pool(self) -> ThreadPoolExecutor | _InlineExecutor:
        if self._executor is None:
            workers = self.workers
            self._executor = (_InlineExecutor() if workers == 0
                              else ThreadPoolExecutor(max_workers=workers, thread_name_prefix="expert-adam"))
        return self._executor

    # --- modes ---
    @property
    def eager(self) -> bool:
        """Step during backward (ES-MoE overlap) unless global clipping or loss scaling needs all gradients (or
        `defer_steps=True` asks for every step after backward: the baseline of the overlap measurement)."""
        if self.defer_steps:
            return False
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            return False
        return self.max_grad_norm is None or self.clip_mode == "per_expert"

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
        # Experts that got no token in this micro-step still have a (possibly zero) final gradient.
        self._take_final([((layer, e), None, None) for e in range(self.engine.layers[layer].layout.num_experts)])

    def _take_final(self, items: list[tuple[ExpertKey, ExpertRecord | None, GradArrival | None]]) -> set[ExpertKey]:
        """Claim the final gradients of `items` (key, record or None, arrival or None) once per window (the experts
        this process owns) and step them (eager) or measure them (deferred). Several eager experts at once (a
        layer's, from the grouped host path or the end of its backward) are stepped several per fused call, as
        `step()` does (`_batch_size`), unless each is clipped on its own. Without a record, a deferred expert with no
        gradient is skipped. Returns the keys taken."""
        on_device = self._device_pinned(key for key, _, _ in items)  # stepped in `step()`, on the device
        owned = [item for item in items if self._owns(item[0]) and item[0] not in on_device]
        taken = []
        with self._lock:
            for key, record, arrival in owned:
                if key in self._stepped or key in self._measured:
                    continue
                if record is None and not self.eager and not self.store.has_grad[key]:
                    continue
                (self._stepped if self.eager else self._measured).add(key)
                taken.append((key, record, arrival))
        if not self.eager:
            for batch in self._batches(taken, in_backward=True):
                job = self._pool.submit(self._measure, batch)
                for key, _, _ in batch:
                    self._measuring[key] = job
        elif self.max_grad_norm is None:
            self._start_batched_steps(taken, clip_coef=None, grad_scale=None, in_backward=True)
        else:  # each expert clipped by its own norm
            for key, record, arrival in taken:
                self._start_step(key, record, arrival, clip_coef=None)
        return {key for key, _, _ in taken}

    def _measure(self, entries: list[tuple[ExpertKey, ExpertRecord | None, GradArrival | None]]) -> dict:
        """Deferred mode, on a worker: land these gradients and return their squared L2 norms, {key: norm^2} (fp32,
        one multi-tensor call as in `clip_grad_norm_`; inf/nan where a gradient overflowed)."""
        with ExitStack() as stack:
            helds = [stack.enter_context(self._landed(key, record, arrival, WEIGHTS_AND_GRAD,
                                                      dirty=(GRAD,) if arrival is not None else False))
                     for key, record, arrival in entries]
            norms = torch._foreach_norm([held.record.current_grad() for held in helds])
            return {key: float(norm) ** 2 for (key, _, _), norm in zip(entries, norms)}

    @contextmanager
    def _landed(self, key: ExpertKey, record: ExpertRecord | None, arrival: GradArrival | None,
                rows: tuple[int, ...] | None, dirty: bool | tuple[int, ...], in_place: bool = False):
        """`key`'s record (`rows` of it current; None: all) with its final gradient in it (the in-flight download
        landed; with `in_place`, a host gradient the record's row would only have been a copy of is left where it
        is, in `held.grads`), released afterwards (`dirty`; the body sets `held.grad_zeroed` once it zeroed the
        gradient). A `record` passed in was acquired by the gradient hook that handed it over; None: acquire it
        here, once the engine's host worker has added the gradient."""
        if record is None:
            self.engine.ledger.wait_for_grad(key)
            record = self.store.acquire(key, rows)
        held = _Held(record)
        try:
            self.store.require(key, rows)  # a handed-over record has the weights and gradient only
            if arrival is not None:
                held.grads = arrival.in_place_of(record) if in_place else None
                if held.grads is None:
                    arrival.land(record)
            yield held
        finally:
            self.store.release(key, dirty=dirty, grad_zeroed=held.grad_zeroed)

    # --- stepping ---
    def _owns(self, key: ExpertKey) -> bool:
        """Several processes sharing one store (hf_moe_offload.distributed): only the owner steps an expert."""
        coordinator = self.engine.coordinator
        return coordinator is None or coordinator.owns_update(key)

    def _start_step(self, key: ExpertKey, record: ExpertRecord | None, arrival: GradArrival | None,
                    clip_coef: float | None, grad_scale: float | None = None) -> None:
        """Submit `key`'s step (already marked stepped in this window) to the workers."""
        # The previous window's step of this expert may still run (an expert no forward used since): finish it
        # first, or both could step the same gradient.
        self.engine.ledger.wait_for_update(key)
        if self._window_lr is None:
            self._window_lr = self.current_lr()
        job = self._pool.submit(self._step_expert, key, record, arrival, self._window_lr, clip_coef, grad_scale,
                                self._window)
        self.engine.ledger.set_pending(key, job)

    def _batch_size(self, ready: int, workers: int, held: bool = False) -> int:
        """Experts per job (one fused call): the ready experts split evenly over the `workers` (>= 1). A batch holds
        all its records at once: on the disk tier, at most what the host cache can hold beside the reads in flight
        after backward (`step()`), unless the records are `held` already (handed over by the backward)."""
        size = max(1, -(-ready // workers))
        cache = getattr(self.store, "cache_experts", None)
        if cache is not None and not held:
            size = min(size, max(1, (cache - self.engine.depth - 1) // workers))
        return size

    def _batches(self, entries: list, in_backward: bool) -> list[list]:
        """Jobs for experts whose records a job must acquire. During backward on the disk tier the cache also holds
        what the stream reads: each such expert goes alone."""
        size = 1 if in_backward and getattr(self.store, "cache_experts", None) is not None else \
            self._batch_size(len(entries), max(1, self.workers))  # inline (0): one job
        return [entries[i : i + size] for i in range(0, len(entries), size)]

    def _start_batched_steps(self, entries: list[tuple[ExpertKey, ExpertRecord | None, GradArrival | None]],
                             clip_coef: float | None, grad_scale: float | None, in_backward: bool = False) -> None:
        """Step `entries` (key, the record and arrival a gradient hook handed over or None; already marked stepped)
        in batches, one fused multi-tensor Adam call per batch (the kernel treats every tensor independently, so the
        result equals one call per expert bit for bit; only the per-call overhead is shared)."""
        if not entries:
            return
        for key, _, _ in entries:
            self.engine.ledger.wait_for_update(key)  # the previous window's step of an expert no forward used since
        if self._window_lr is None:
            self._window_lr = self.current_lr()
        if in_backward:  # the records handed over with their gradients: held already
            self._queue_steps([entry for entry in entries if entry[1] is not None], clip_coef, grad_scale)
            entries = [entry for entry in entries if entry[1] is None]
        for batch in self._batches(entries, in_backward):
            job = self._pool.submit(self._step_experts, batch, self._window_lr, clip_coef, grad_scale, self._window)
            for key, _, _ in batch:
                self.engine.ledger.set_pending(key, job)

    def _queue_steps(self, entries: list[tuple[ExpertKey, ExpertRecord, GradArrival | None]], clip_coef: float | None,
                     grad_scale: float | None) -> None:
        """Eager, in backward: experts handed over with their records wait in `_ready`, and each job steps every one
        waiting when it starts (up to an even share per worker; inline, all of them at once) in fused calls, so the
        experts a per-expert loop hands over one at a time are stepped together whenever they arrive faster than a
        worker steps them (the fused kernel's per-call cost, an OpenMP fork and join, was 0.6-0.8x torch's
        fused AdamW one expert per call on 2 cores). Each expert's pending update is its own Future."""
        if not entries:
            return
        step = (self._window_lr, clip_coef, grad_scale, self._window)
        with self._lock:
            for entry in entries:
                done: Future = Future()
                self._ready.append((entry, done, step))
                self.engine.ledger.set_pending(entry[0], done)
            # Each job's share of what waits now (a job that took its share does not shrink the next one's).
            workers = max(1, self.workers)
            self._share = self._batch_size(len(self._ready), workers, held=True)
        for _ in range(min(len(entries), workers)):
            self._pool.submit(self._step_ready)

    def _step_ready(self) -> None:
        """A worker's job: until `_ready` is empty, take the experts at its head (one window and learning rate, at
        most an even share of those waiting), step them and complete their Futures (with the error, should a step
        fail). Every job drains the queue: however many experts one job takes, none is left behind."""
        while True:
            with self._lock:
                if not self._ready:
                    return
                step = self._ready[0][2]
                batch = []
                while self._ready and self._ready[0][2] == step and len(batch) < self._share:
                    batch.append(self._ready.popleft())
            try:
                self._step_experts([entry for entry, _, _ in batch], *step)
            except Exception as err:  # raised where each expert's update is waited for; the queue drains on
                for _, done, _ in batch:
                    done.set_exception(err)
            else:
                for _, done, _ in batch:
                    done.set_result(None)

    def _step_experts(self, entries: list[tuple[ExpertKey, ExpertRecord | None, GradArrival | None]], lr: float,
                      clip_coef: float | None, grad_scale: float | None, window: int) -> None:
        t0 = time.perf_counter()
        keys = [key for key, _, _ in entries]
        try:
            with ExitStack() as held:
                helds = [held.enter_context(self._landed(key, record, arrival, None, dirty=True, in_place=True))
                         for key, record, arrival in entries]
                ready = [(k, h) for k, h in zip(keys, helds) if self.store.has_grad[k]]
                if not ready:
                    return
                steps = [(k, h.record, h.grads if h.grads is not None else self._views(k, h.record.current_grad()))
                         for k, h in ready]
                grads = [g for _, _, gs in steps for g in gs]
                if grad_scale is not None:  # the same two roundings as the per-expert path: unscale, then clip
                    torch._foreach_mul_(grads, 1.0 / grad_scale)
                if clip_coef is not None:
                    torch._foreach_mul_(grads, clip_coef)
                for _, r, _ in steps:
                    self.store.note_host_write(r)  # no upload may still be reading these weights
                copied = self._adam_many(steps, lr)
                for k, h in ready:  # stale, not zeroed in a pass: the next gradient is copied in
                    h.record.clear_grad(self.store.lazy_grad_zero)
                    h.grad_zeroed = True
                    self.store.has_grad[k] = False
                    h.record.refresh_compute(copied)
        finally:
            end = time.perf_counter()
            with self._lock:
                self._jobs.append((window, t0, end))

    def _views(self, key: ExpertKey, row: torch.Tensor) -> list[torch.Tensor]:
        return self.engine.layers[key[0]].layout.views(row)

    def _adam_many(self, steps: list[tuple[ExpertKey, ExpertRecord, list[torch.Tensor]]], lr: float) -> bool:
        """Adam for several experts (key, record, its gradient per tensor in layout order) in two fused calls (the
        decayed tensors, the others). Every path steps per tensor, whether the gradient is the record's row or
        autograd's own tensors: the fused kernel's vectorized body and scalar tail would otherwise round some
        elements differently where a tensor boundary falls. Where every record has a compute copy (bf16/fp16) on the
        host, one kernel updates the weights and writes the copy in one pass (optim/fused_adam.py): returns True
        then (the caller only moves the version: `refresh_compute(copied=True)`)."""
        beta1, beta2 = self.betas
        if all(record.compute is not None for _, record, _ in steps) and self._adam_with_copies(steps, lr):
            for key, _, _ in steps:
                self.store.steps[key] += 1
            return True
        for decayed in (True, False):
            params, grads, avgs, avg_sqs, counts = [], [], [], [], []
            for key, record, expert_grads in steps:
                layout = self.engine.layers[key[0]].layout
                weights, exp_avgs, exp_avg_sqs = record.state_tensors(layout.views)
                for spec, p, g, m, v in zip(layout.tensors, weights, expert_grads, exp_avgs, exp_avg_sqs):
                    if spec.decay == decayed:
                        params.append(p), grads.append(g), avgs.append(m), avg_sqs.append(v)
                        counts.append(float(self.store.steps[key]))
            if params:
                # One step count per tensor (the kernel increments each), beside the parameters (device pins).
                counts = torch.tensor(counts, device=params[0].device).unbind()
                adam(params, grads, avgs, avg_sqs, [], counts, fused=True, amsgrad=False, beta1=beta1, beta2=beta2,
                     lr=lr, weight_decay=self.weight_decay if decayed else 0.0, eps=self.eps, maximize=False,
                     decoupled_weight_decay=self.decoupled)
        for key, _, _ in steps:
            self.store.steps[key] += 1
        return False

    def _adam_with_copies(self, steps: list[tuple[ExpertKey, ExpertRecord, list[torch.Tensor]]], lr: float) -> bool:
        """`_adam_many` through the one-pass kernel; False (nothing touched) where it does not apply."""
        beta1, beta2 = self.betas
        groups = {True: ([], [], [], [], [], []), False: ([], [], [], [], [], [])}
        for key, record, expert_grads in steps:
            layout = self.engine.layers[key[0]].layout
            weights, exp_avgs, exp_avg_sqs = record.state_tensors(layout.views)
            for spec, p, g, m, v, c in zip(layout.tensors, weights, expert_grads, exp_avgs, exp_avg_sqs,
                                           layout.views(record.compute)):
                for out, t in zip(groups[spec.decay], (p, g, m, v, c, self.store.steps[key] + 1)):
                    out.append(t)
        if not all(fits(*group[:5]) for group in groups.values()):
            return False
        for decayed, (params, grads, avgs, avg_sqs, copies, counts) in groups.items():
            adamw_with_copy(params, grads, avgs, avg_sqs, copies, counts, lr=lr, beta1=beta1, beta2=beta2,
                            eps=self.eps, decoupled=self.decoupled, weight_decay=self.weight_decay if decayed else 0.0)
        return True

    def _step_expert(self, key: ExpertKey, record: ExpertRecord | None, arrival: GradArrival | None, lr: float,
                     clip_coef: float | None, grad_scale: float | None, window: int) -> None:
        t0 = time.perf_counter()
        try:
            with self._landed(key, record, arrival, None, dirty=True) as held:
                record = held.record
                if not self.store.has_grad[key]:
                    return  # like torch: a parameter without .grad is not stepped
                grad = record.current_grad()
                if grad_scale is not None:
                    grad.mul_(1.0 / grad_scale)
                if self.max_grad_norm is not None and self.clip_mode == "per_expert":
                    norm = float(torch.linalg.vector_norm(grad))
                    clip_coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
                if clip_coef is not None:
                    grad.mul_(clip_coef)
                self.store.note_host_write(record)  # no upload may still be reading these weights
                copied = self._adam(key, record, lr)
                record.clear_grad(self.store.lazy_grad_zero)
                held.grad_zeroed = True
                self.store.has_grad[key] = False
                record.refresh_compute(copied)
        finally:
            end = time.perf_counter()
            with self._lock:
                self._jobs.append((window, t0, end))

    def _adam(self, key: ExpertKey, record: ExpertRecord, lr: float) -> bool:
        return self._adam_many([(key, record, self._views(key, record.grad))], lr)

    def _measured_sq_norms(self) -> dict[ExpertKey, float]:
        """Deferred mode: the squared norms measured during backward (waits for the measuring jobs)."""
        return {key: fut.result()[key] for key, fut in self._measuring.items()}

    def expert_grad_sq_norm(self) -> float:
        """Sum of squared expert gradient norms (call after backward). On the window's last micro-step in deferred
        mode the norms were taken as each gradient became final; otherwise (or for experts not measured) each
        gradient is read once. With a shared store (hf_moe_offload.distributed) each process sums the experts it
        owns and the sums are all-reduced: every process must call it."""
        measured = self._measured_sq_norms()
        total = sum(measured.values())
        self.engine.wait_in_flight()
        unmeasured = [key for key in self.store.keys()
                      if key not in measured and self.store.has_grad[key] and self._owns(key)]
        on_device = self._device_pinned(unmeasured)
        if on_device:  # one read back for all of them; each norm in fp32 and squared in float64, as below
            pins = self.engine.device_pins
            norms = torch._foreach_norm([pins.record(key).current_grad() for key in sorted(on_device)])
            total += sum(n * n for n in torch.stack(norms).tolist())
        for key in unmeasured:
            if key not in on_device:
                record = self.store.acquire(key, WEIGHTS_AND_GRAD)
                try:
                    total += float(torch.linalg.vector_norm(record.current_grad())) ** 2
                finally:
                    self.store.release(key)
        coordinator = self.engine.coordinator
        return total if coordinator is None else coordinator.all_reduce_sum(total)

    def step(self, non_expert_params: Iterable[torch.nn.Parameter] | None = None,
             expert_overflow: bool | None = None) -> float | None:
        """Close the window: step every expert not stepped yet. Returns the clip coefficient applied (deferred mode).

        With `max_grad_norm` and `clip_mode="global"`, pass the non-expert parameters: their gradients are scaled by
        the same coefficient here (so the caller must not clip them again), exactly as `clip_grad_norm_` over all.
        With a `grad_scaler`, call `scaler.unscale_(optimizer)` first: non-expert gradients are taken as unscaled,
        expert gradients are unscaled here; `expert_overflow`, when the caller already ran `expert_grads_overflow()`,
        saves a second pass over the expert gradients.
        """
        if not self.boundary_fn():
            return None  # not the window's last micro-step (e.g. inside accelerate's accumulate): keep accumulating
        self._step_called[self._window] = time.perf_counter()
        self.engine.wait_for_uploads()  # an evaluation since the backward may have uploads reading host records
        with self._lock:
            # Backward is over: the experts still waiting for a worker go in the order the next forward uses them
            # (layer 0 first; it arrived last), so that it starts a layer once that layer's experts are stepped.
            # Windows stay in order; an expert is never queued twice.
            self._ready = deque(sorted(self._ready, key=lambda item: (item[2][3], item[0][0])))
        clip_coef = None
        grad_scale = None
        if not self.eager:
            params = [p for p in (non_expert_params or []) if p.grad is not None]
            if self.grad_scaler is not None and self.grad_scaler.is_enabled():
                grad_scale = float(self.grad_scaler.get_scale())
                if expert_overflow is None:
                    expert_overflow = self.expert_grads_overflow()
                if expert_overflow or any(not torch.isfinite(p.grad).all() for p in params):
                    self.skipped_steps += 1
                    logger.warning("fp16 overflow: skipping the expert steps of this window")
                    self.engine.zero_grad()
                    self._end_window()
                    return None
            if self.max_grad_norm is not None:
                scale = 1.0 / grad_scale if grad_scale else 1.0  # expert gradients are still scaled here
                sq = self.expert_grad_sq_norm() * scale * scale
                sq += sum(float(p.grad.double().pow(2).sum()) for p in params)
                total = math.sqrt(sq)
                self.last_grad_norm = total
                clip_coef = min(1.0, self.max_grad_norm / (total + 1e-6))
                for p in params:
                    p.grad.mul_(clip_coef)
        self._measured_sq_norms()  # the measuring jobs landed their gradients: wait for them before stepping
        ready = [key for key in self.store.keys()
                 if self._owns(key) and key not in self._stepped and self.store.has_grad[key]]
        self._stepped.update(ready)
        on_device = self._device_pinned(ready)
        self._step_on_device(on_device, clip_coef, grad_scale)
        self._start_batched_steps([(key, None, None) for key in ready if key not in on_device], clip_coef, grad_scale)
        self._end_window()
        return clip_coef

    def _device_pinned(self, keys: Iterable[ExpertKey]) -> set[ExpertKey]:
        """Those of `keys` whose state lives on the device (offload/device_pins.py): stepped in `_step_on_device`."""
        pins = self.engine.device_pins
        return set() if pins is None else {key for key in keys if key in pins}

    def _step_on_device(self, keys: Iterable[ExpertKey], clip_coef: float | None, grad_scale: float | None) -> None:
        """Step device-pinned experts on the device, on the calling thread (the compute stream): the host path's
        arithmetic (unscale, clip, the fused AdamW per tensor), then their compute copies."""
        keys = sorted(keys)
        if not keys:
            return
        if self._window_lr is None:
            self._window_lr = self.current_lr()
        pins = self.engine.device_pins
        steps = [(key, pins.record(key), self._views(key, pins.record(key).current_grad())) for key in keys]
        grads = [g for _, _, gs in steps for g in gs]
        if grad_scale is not None:
            torch._foreach_mul_(grads, 1.0 / grad_scale)
        if self.max_grad_norm is not None and self.clip_mode == "per_expert":
            for _, record, expert_grads in steps:
                norm = float(torch.linalg.vector_norm(record.grad))
                torch._foreach_mul_(expert_grads, min(1.0, self.max_grad_norm / (norm + 1e-6)))
        if clip_coef is not None:
            torch._foreach_mul_(grads, clip_coef)
        copied = self._adam_many(steps, self._window_lr)
        for key, record, _ in steps:
            record.clear_grad(lazy=False)
            record.refresh_compute(copied)
            self.store.has_grad[key] = False

    def unscale_(self, optimizer) -> bool | None:
        """fp16, on the window's last micro-step, before `step()`: check the (still scaled) expert gradients, hand an
        expert overflow to the GradScaler as an inf in one non-expert gradient (so that the scaler skips the
        non-expert step and backs the scale off), then `scaler.unscale_` the non-expert optimizer (an accelerate
        `AcceleratedOptimizer` or a plain one). Returns the experts' overflow flag for `step(expert_overflow=...)`;
        None without loss scaling or off the boundary."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled() or not self.boundary_fn():
            return None
        overflow = self.expert_grads_overflow()
        inner = getattr(optimizer, "optimizer", optimizer)
        if overflow:
            first = next((p for g in inner.param_groups for p in g["params"] if p.grad is not None), None)
            if first is not None:
                first.grad.view(-1)[0] = float("inf")
        scaler.unscale_(inner)
        return overflow

    def expert_grads_overflow(self) -> bool:
        """True when any expert gradient (of this rank's updates; all ranks agree) holds inf/nan. Collective under
        expert parallelism. Uses the norms measured during backward where there are some (an overflowed gradient
        has a non-finite norm)."""
        measured = self._measured_sq_norms()
        found = any(not math.isfinite(v) for v in measured.values())
        self.engine.wait_in_flight()
        pins = self.engine.device_pins
        on_device = self._device_pinned(key for key in self.store.keys() if self.store.has_grad[key])
        if on_device and not found:
            grads = [pins.record(key).current_grad() for key in sorted(on_device)]
            found = not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
        for key in self.store.keys():
            if found:
                break
            if key not in measured and key not in on_device and self.store.has_grad[key] and self._owns(key):
                record = self.store.acquire(key, WEIGHTS_AND_GRAD)
                try:
                    if not torch.isfinite(record.current_grad()).all():
                        found = True
                        break
                finally:
                    self.store.release(key)
        coordinator = self.engine.coordinator
        return found if coordinator is None else coordinator.all_reduce_max(float(found)) > 0

    def _end_window(self) -> None:
        self.engine.end_window()
        with self._lock:
            closing = self._window
            self._window += 1
            previous = [(start, end) for w, start, end in self._jobs if w == closing - 1]
            self._jobs = [job for job in self._jobs if job[0] >= closing]
            self._stepped.clear()
            self._measured.clear()
        self._measuring = {}
        self._window_lr = None
        called = self._step_called.pop(closing - 1, None)
        if called is not None:
            self.step_seconds = sum(end - start for start, end in previous)
            self.overlapped_seconds = sum(max(0.0, min(end, called) - start) for start, end in previous)
        if self.engine.coordinator is not None:
            # Shared store: every process's updates must be complete and visible before any process uses an expert
            # again (the next forward may place expert e on another rank) or saves a checkpoint.
            self.engine.coordinator.window_closed()

    def synchronize(self) -> None:
        self.engine.synchronize()

    # --- state (checkpoints) ---
    def state_dict(self) -> dict:
        self.engine.synchronize()  # the step counts of updates still running on the workers would be stale
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
        self.engine.synchronize()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._executor is not None:
            self._executor.shutdown(wait=True)


class ExpertAwareOptimizer:
    """Wraps the non-expert optimizer for hand-written (accelerate) loops: `step()` closes the expert window
    (clipping globally if configured) and then steps the non-expert parameters; `zero_grad()` clears the non-expert
    gradients (each expert's store gradient is cleared when the expert is stepped, or on an fp16 overflow).
    With fp16 (`ExpertOptimizer(grad_scaler=...)`; under accelerate, the prepared optimizer's scaler), `step()` also
    does the loss-scaler's part: an overflow anywhere skips every step of the window and backs the scale off.

    Under `accelerate`, prepare the inner optimizer as usual and wrap the prepared one; scheduler steps still act on
    `param_groups`, which this wrapper shares, and `ExpertOptimizer.lr_fn` reads them.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, expert_optimizer: ExpertOptimizer):
        self.optimizer = optimizer
        self.expert_optimizer = expert_optimizer
        if expert_optimizer.lr_fn is None:
            expert_optimizer.lr_fn = lambda: self.optimizer.param_groups[0]["lr"]

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        overflow = self.expert_optimizer.unscale_(self.optimizer)  # fp16 only
        self.expert_optimizer.step(non_expert_params=params, expert_overflow=overflow)
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


__all__ = ["ExpertOptimizer", "ExpertAwareOptimizer", "accelerate_sync_gradients"]
