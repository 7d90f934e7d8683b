"""Experts as the offload store holds them, made ready for the pure AdamW step (optim/adamw_step.py) and put back.

A step or a norm needs an expert's final gradient in its record: the engine may still be downloading it (landed
here first) or may hand over autograd's own tensors, which a step reads in place instead of copying them into the
record's row. After the update the record's gradient is cleared, its compute copy refreshed and the store told that
host weights changed (no upload may still be reading them: ES-MoE §4.1's next forward waits for the update)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import ExitStack, contextmanager

import torch

from ..offload.streaming.transfers import GradArrival
from ..offload.stores.store import ExpertKey, ExpertRecord
from ..offload.updates import ExpertUpdates
from .adamw_step import ExpertTensors, prepare_grads_

# (key, the record a gradient hook handed over or None, its gradient's arrival or None)
Entry = tuple[ExpertKey, ExpertRecord | None, GradArrival | None]
# (key, record, its gradient per tensor in layout order): what an update is handed
Step = tuple[ExpertKey, ExpertRecord, list[torch.Tensor]]
# (steps, lr, grad_scale, clip_coef) -> whether the compute copies were written (optim/adamw_step.py `adamw_update_`)
Update = Callable[[list[Step], float, float | None, float | None], bool]


class _Held:
    """A record held by `landed`; `grad_zeroed` tells the store, on release, that the gradient was zeroed (the disk
    tier then neither writes nor reads it); `grads`, the gradient per tensor where it was used in place instead of
    landed (`GradArrival.in_place_of`)."""

    __slots__ = ("record", "grad_zeroed", "grads")

    def __init__(self, record: ExpertRecord):
        self.record = record
        self.grad_zeroed = False
        self.grads = None


class StoreSteps:
    """Landing, viewing and clearing the experts of an engine's store around their updates (`updates`: the engine's
    surface for its optimizer, offload/updates.py)."""

    def __init__(self, updates: ExpertUpdates, queue=None):
        self.updates, self.store = updates, updates.store
        self.queue = queue  # the optimizer's StepQueue: what `_acquire` gives way to

    def _acquire(self, key: ExpertKey, rows: tuple[int, ...] | None) -> ExpertRecord:
        """`store.acquire`, for a step of an expert the backward did not hand over. On the disk tier the cache may
        be full of records waiting in the queue for a worker (handed over by the backward, ES-MoE §4.1) beside the
        stream's: a worker that waited for room there would wait for itself (every worker waiting so, until the
        store's stall timeout), so while experts wait in the queue it steps them first, which releases their
        records, and then acquires again. Where the cache has room the acquire never waits and nothing changes."""
        if self.queue is None or self.updates.cache_room() is None:
            return self.store.acquire(key, rows)
        while True:
            record = self.store.acquire(key, rows, give_way=self.queue.waiting)
            if record is not None:
                return record
            self.queue.help()

    def arrived(self) -> None:
        """Experts were put in the queue: workers waiting for room in the cache give way to them (`_acquire`)."""
        if self.updates.cache_room() is not None:
            self.store.wake_waiters()

    @contextmanager
    def landed(self, key: ExpertKey, record: ExpertRecord | None, arrival: GradArrival | None,
               rows: tuple[int, ...] | None, dirty: bool | tuple[int, ...], in_place: bool = False):
        """`key`'s record (`rows` of it current; None: all) with its final gradient in it (the in-flight download
        landed; with `in_place`, a host gradient the record's row would only have been a copy of is left where it
        is, in `held.grads`), released afterwards (`dirty`; the body sets `held.grad_zeroed` once it zeroed the
        gradient). A `record` passed in was acquired by the gradient hook that handed it over; None: acquire it
        here, once the engine's host worker has added the gradient."""
        # An earlier gradient of this micro-step (another call of the layer: MPMoE's partitions, a layer called
        # twice) may still be landing on the engine's host worker: the final one is added after it, never in its
        # place.
        self.updates.ledger.wait_for_grad(key)
        if record is None:
            record = self._acquire(key, rows)
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

    def views(self, key: ExpertKey, row: torch.Tensor) -> list[torch.Tensor]:
        return self.updates.layout(key[0]).views(row)

    def tensors(self, key: ExpertKey, record: ExpertRecord, grads: list[torch.Tensor]) -> ExpertTensors:
        """`key`'s tensors for `adamw_update_`, per tensor in layout order (its compute copy's where it has one)."""
        layout = self.updates.layout(key[0])
        weights, exp_avgs, exp_avg_sqs = record.state_tensors(layout.views)
        return ExpertTensors(weights, grads, exp_avgs, exp_avg_sqs, [spec.decay for spec in layout.tensors],
                             self.store.steps[key], None if record.compute is None else layout.views(record.compute))

    def step_host(self, entries: list[Entry], update: Update, lr: float, grad_scale: float | None,
                  clip_coef: float | None, max_norm: float | None) -> None:
        """Land `entries`' gradients, step those that have one (unscaled, clipped by their own norm to `max_norm`,
        clipped by `clip_coef`, then `update`d: without `max_norm` the update unscales and clips, in its own pass
        where it can) and clear them. Clipping by an expert's own norm takes the norm over
        its gradient row, so there the gradient is landed in the row rather than used in place."""
        with ExitStack() as stack:
            helds = [stack.enter_context(self.landed(key, record, arrival, None, dirty=True,
                                                     in_place=max_norm is None))
                     for key, record, arrival in entries]
            ready = [(key, held) for (key, _, _), held in zip(entries, helds) if self.store.has_grad[key]]
            if not ready:
                return  # like torch: a parameter without .grad is not stepped
            steps = [(key, held.record,
                      held.grads if held.grads is not None else self.views(key, held.record.current_grad()))
                     for key, held in ready]
            if max_norm is not None:  # each expert's own norm is taken unscaled: the passes run before the update
                prepare_grads_([grads for _, _, grads in steps], grad_scale, clip_coef, max_norm,
                               [held.record.grad for _, held in ready])
                grad_scale = clip_coef = None
            for _, held in ready:
                self.store.note_host_write(held.record)  # no upload may still be reading these weights
            copied = update(steps, lr, grad_scale, clip_coef)
            for key, held in ready:  # stale, not zeroed in a pass: the next gradient is copied in
                held.record.clear_grad(self.store.lazy_grad_zero)
                held.grad_zeroed = True
                self.store.has_grad[key] = False
                held.record.refresh_compute(copied)

    def step_device(self, keys: Iterable[ExpertKey], update: Update, lr: Callable[[], float],
                    grad_scale: float | None, clip_coef: float | None, max_norm: float | None) -> None:
        """Step device-pinned experts (offload/pins/device_pins.py) on the device, on the calling thread (the compute
        stream): the host path's arithmetic, then their compute copies. `lr` is read only if there is one."""
        keys = sorted(keys)
        if not keys:
            return
        records = [self.updates.device_record(key) for key in keys]
        steps = [(key, record, self.views(key, record.current_grad())) for key, record in zip(keys, records)]
        if max_norm is not None:
            prepare_grads_([grads for _, _, grads in steps], grad_scale, clip_coef, max_norm,
                           [record.grad for _, record, _ in steps])
            grad_scale = clip_coef = None
        copied = update(steps, lr(), grad_scale, clip_coef)
        for key, record, _ in steps:
            record.clear_grad(lazy=False)
            record.refresh_compute(copied)
            self.store.has_grad[key] = False


__all__ = ["Entry", "Step", "StoreSteps"]
