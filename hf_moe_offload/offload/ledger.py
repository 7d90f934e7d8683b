"""The update ledger: what the expert optimizer plugs into, and the updates and gradient landings in flight.

Hooks (`add_grad_hook`, `add_layer_done_hook`) take a micro-step's final expert gradients and layers (ES-MoE §4.1: an
expert is stepped as soon as its gradient is final, overlapping the rest of the backward); an update in flight is
pending until done, and the expert's next forward waits for its own update only (`wait_for_update`: no staleness, no
global barrier). Gradients that no hook takes are landed on the engine's host worker (`grad_job`, `wait_for_grad`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from torch.utils.hooks import RemovableHandle

from .stores.store import ExpertKey
from .streaming.transfers import GradHook

logger = logging.getLogger(__name__)


class UpdateCoordinator(Protocol):
    """Set as the engine's `coordinator` when several processes share one expert store (hf_moe_offload.distributed,
    ES-MoE §4.2 dynamic placement): it says which process steps each expert in the current accumulation window and
    reduces the optimizer's global checks across processes. None (the default) = this process owns every expert."""

    def owns_update(self, key: ExpertKey) -> bool: ...

    def all_reduce_sum(self, value: float) -> float: ...

    def all_reduce_max(self, value: float) -> float: ...

    def pinned_keys(self) -> list[ExpertKey]: ...

    def window_closed(self) -> None: ...


class UpdateLedger:
    def __init__(self) -> None:
        self._pending: dict[ExpertKey, Future] = {}  # expert updates in flight (set by the optimizer)
        self._grad_jobs: dict[ExpertKey, Future] = {}  # gradients landing on the engine's host worker
        # Hooks by handle id: each `add_*` returns a handle that removes it (OrderedDicts: a handle holds a weak
        # reference to its dict).
        self._grad_hooks: OrderedDict[int, GradHook] = OrderedDict()
        self._layer_done_hooks: OrderedDict[int, Callable[[int], None]] = OrderedDict()
        # `add_grad_hook(..., steps_now=)`: whether a hook steps the experts it takes in the backward that hands them
        # over (`ChunkSources.backward_rows`).
        self._steps_now: OrderedDict[int, Callable[[], bool]] = OrderedDict()
        self._warned_no_optimizer = False

    # --- hooks ---
    def add_grad_hook(self, hook: GradHook, steps_now: Callable[[], bool] | None = None) -> RemovableHandle:
        """`hook(items)` on the micro-step where these experts' gradients are final (one expert, or a chunk's experts
        at once), items being (key, record, arrival); it returns the keys it takes over: for each, the hook must
        `arrival.land(record)` (or use `arrival.in_place_of(record)`) and release the record (dirty). `steps_now()`:
        whether the hook updates those experts right away (the backward then reads their Adam moments with their
        weights). Returns a handle whose `remove()` takes both off again (the expert optimizer's `close()`)."""
        handle = RemovableHandle(self._grad_hooks, extra_dict=self._steps_now)
        self._grad_hooks[handle.id] = hook
        if steps_now is not None:
            self._steps_now[handle.id] = steps_now
        return handle

    def add_layer_done_hook(self, hook: Callable[[int], None]) -> RemovableHandle:
        """`hook(layer)` once `layer`'s expert gradients are final for the micro-step. Returns its removable handle."""
        handle = RemovableHandle(self._layer_done_hooks)
        self._layer_done_hooks[handle.id] = hook
        return handle

    def has_hooks(self) -> bool:
        """Whether a gradient or layer-done hook is attached (an expert optimizer)."""
        return bool(self._grad_hooks or self._layer_done_hooks)

    def steps_now(self) -> bool:
        """Whether a hook steps the experts it takes in the backward that hands them over."""
        return any(f() for f in self._steps_now.values())

    def offer(self, items: list) -> list:
        """Final gradients to the hooks: what no hook takes comes back (the engine lands it)."""
        if not self._grad_hooks and not self._warned_no_optimizer:
            self._warned_no_optimizer = True
            logger.warning(
                "expert gradients are accumulating in the offload store but no ExpertOptimizer is attached, so the "
                "experts will not be updated: add ExpertOptimizerCallback() to the Trainer (or an ExpertOptimizer to "
                "your loop); call engine.zero_grad() if you only inspect gradients")
        for hook in list(self._grad_hooks.values()):
            taken = hook(items)
            if taken:
                items = [item for item in items if item[0] not in taken]
        return items

    def layer_done(self, layer: int) -> None:
        for hook in list(self._layer_done_hooks.values()):
            hook(layer)

    # --- in flight ---
    def set_pending(self, key: ExpertKey, fut: Future) -> None:
        self._pending[key] = fut

    def is_pending(self, key: ExpertKey) -> bool:
        return key in self._pending

    def wait_for_update(self, key: ExpertKey) -> None:
        fut = self._pending.pop(key, None)
        if fut is not None:
            fut.result()

    def grad_job(self, key: ExpertKey, fut: Future) -> None:
        self._grad_jobs[key] = fut

    def wait_for_grad(self, key: ExpertKey) -> None:
        """Wait until the gradients of `key` handed to the engine's host worker are in the store."""
        fut = self._grad_jobs.pop(key, None)
        if fut is not None:
            fut.result()

    def wait_all(self) -> None:
        """Every update in flight done (the host worker's jobs, gradient landings among them, are waited for by the
        engine first)."""
        self._grad_jobs.clear()
        for key in list(self._pending):
            self.wait_for_update(key)
