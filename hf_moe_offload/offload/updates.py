"""`ExpertUpdates`: what the expert optimizer (hf_moe_offload.optim) sees of an offload engine.

The optimizer steps the experts in the engine's store as their gradients become final (ES-MoE §4.1): it needs the
store, the update ledger (hooks, pending updates, gradient landings), each layer's layout, which experts' state lives
on the device (device pins, ES-MoE §4.3), which experts this process updates when several share the store (§4.2),
and the engine's barriers. This object is that surface and nothing more: the optimizer holds it, not the engine, so
the engine's parts (sources, gradients, decoding, pins) can change without the optimizer noticing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..host_threads import DEVICE_THREADS, optimizer_threads
from .ledger import UpdateLedger
from .plan import OPTIMIZER_WORKERS
from .stores.store import ExpertKey, ExpertRecord, ExpertStore

if TYPE_CHECKING:
    from ..families.layouts import ExpertLayout


class ExpertUpdates:
    """The engine's surface for its expert optimizer (`OffloadEngine.updates`)."""

    def __init__(self, engine):
        self._engine = engine  # the OffloadEngine (engine.py imports this module: no import back)

    @property
    def store(self) -> ExpertStore:
        return self._engine.store

    @property
    def ledger(self) -> UpdateLedger:
        return self._engine.ledger

    @property
    def lora(self):
        """The experts' LoRA factors kept in the store (`OffloadConfig.lora_in_store`; offload/lora/lora_store.py)."""
        return self._engine.lora

    @property
    def lora_in_store(self) -> bool:
        return self._engine.config.lora_in_store

    def layout(self, layer: int) -> ExpertLayout:
        return self._engine.layers[layer].layout

    # --- settings the plan resolved ---
    def default_workers(self) -> int:
        """Threads stepping experts where the user set none (`OffloadPlan.optimizer_workers`)."""
        plan = self._engine.plan  # None until the first forward binds the engine (offload/plan.py)
        return OPTIMIZER_WORKERS if plan is None else plan.optimizer_workers

    def optimizer_threads(self) -> int:
        """The optimizer's threads, all workers' teams together (`OffloadPlan.optimizer_threads`; before the engine
        binds, as on a device)."""
        plan = self._engine.plan
        if plan is None:
            return optimizer_threads(self._engine.config.optimizer_threads, reserved=DEVICE_THREADS)
        return plan.optimizer_threads

    def cache_room(self) -> int | None:
        """The disk tier: records the host cache holds beside the reads in flight (the stream's read-ahead and the
        record computing); None where records do not compete for a cache (host tier)."""
        cache = getattr(self.store, "cache_experts", None)
        return None if cache is None else cache - self._engine.depth - 1

    # --- where each expert steps ---
    def owns(self, key: ExpertKey) -> bool:
        """Several processes sharing one store (hf_moe_offload.distributed): only the owner steps an expert."""
        coordinator = self._engine.coordinator
        return coordinator is None or coordinator.owns_update(key)

    @property
    def shared(self) -> bool:
        """Whether several processes share the store (an `UpdateCoordinator` is set)."""
        return self._engine.coordinator is not None

    def on_device(self, keys: Iterable[ExpertKey]) -> set[ExpertKey]:
        """Those of `keys` whose state lives on the device (offload/pins/device_pins.py): stepped there."""
        pins = self._engine.device_pins
        return set() if pins is None else {key for key in keys if key in pins}

    def device_record(self, key: ExpertKey) -> ExpertRecord:
        """A device-pinned expert's record (its state on the device)."""
        return self._engine.device_pins.record(key)

    def all_reduce_sum(self, value: float) -> float:
        coordinator = self._engine.coordinator
        return value if coordinator is None else coordinator.all_reduce_sum(value)

    def all_reduce_max(self, value: float) -> float:
        coordinator = self._engine.coordinator
        return value if coordinator is None else coordinator.all_reduce_max(value)

    # --- the engine's life cycle, as the optimizer drives it ---
    def close_window(self) -> None:
        """An accumulation window closed: the engine forgets unfinished calls and updates its pins; with a shared
        store, every process's updates are complete and visible before any process uses an expert again (the next
        forward may place expert e on another rank) or saves a checkpoint."""
        self._engine.end_window()
        if self._engine.coordinator is not None:
            self._engine.coordinator.window_closed()

    def wait_for_uploads(self) -> None:
        self._engine.wait_for_uploads()

    def wait_in_flight(self) -> None:
        self._engine.wait_in_flight()

    def synchronize(self) -> None:
        self._engine.synchronize()

    def zero_grad(self) -> None:
        self._engine.zero_grad()


__all__ = ["ExpertUpdates"]
