"""Which experts are pinned (ES-MoE §4.3): kept in the host cache of the disk tier, and close to the compute on a
device (a device copy of the weights, or in training their whole state: offload/pins/device_pins.py).

ES-MoE pins the experts most loaded in the previous iteration. Each change of a pin costs I/O (on the disk tier the
record leaving the cache is written back and the newcomer read; on a device, an upload), while one step's loads are
noisy (e.g. 16 +- 4 tokens per expert at 64 experts): pinning by the last load alone moved most pins every step and
saved almost nothing. So the load is averaged over recent steps and a pinned expert keeps its place until another's
average is `PIN_HYSTERESIS` times its own (bytes written per step). Decoding pins by decoding's use scores
instead (mixtral-offloading's per-layer expert cache on the GPU), and several processes sharing a store pin what the
placement says (ES-MoE §4.2-4.3). `PinManager` applies the choice for the engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from ..stores.store import ExpertKey


class PinChoice:
    """Each layer's `fraction` of its experts to pin, best first across layers (the engine keeps the first
    `pin_limit`)."""

    PIN_LOAD_DECAY = 0.9
    PIN_HYSTERESIS = 2.0

    def __init__(self, fraction: float):
        self.fraction = fraction
        self._load_scores: dict[ExpertKey, float] = {}  # each expert's decayed token load

    def by_load(self, layers: Iterable, pinned: Iterable[ExpertKey]) -> list[ExpertKey]:
        """Training: by recent load (each layer's `last_counts`, decayed), the experts `pinned` now favoured by
        `PIN_HYSTERESIS`."""
        layers = list(layers)
        for layer in layers:
            for e, n in enumerate(layer.last_counts):
                key = (layer.layer, e)
                self._load_scores[key] = self.PIN_LOAD_DECAY * self._load_scores.get(key, 0.0) + n
        held = set(pinned)
        return self.top(layers, lambda key: self._load_scores[key] * (self.PIN_HYSTERESIS if key in held else 1.0))

    def top(self, layers: Iterable, score: Callable[[ExpertKey], float]) -> list[ExpertKey]:
        """Each layer's `fraction` best-scored experts (an expert scored 0 is never pinned), best first across
        layers."""
        chosen: list[tuple[float, ExpertKey]] = []
        for layer in layers:
            k = math.ceil(self.fraction * layer.num_experts) if self.fraction else 0
            scores = [score((layer.layer, e)) for e in range(layer.num_experts)]
            best = sorted(range(layer.num_experts), key=lambda e: -scores[e])[:k]
            chosen += [(scores[e], (layer.layer, e)) for e in best if scores[e] > 0]
        return [key for _, key in sorted(chosen, key=lambda item: -item[0])]




class PinManager:
    """Applies the pinning choice for the engine: the pins in the store and the stager, the device pins' state
    (offload/pins/device_pins.py), admitted at a training forward and sent home before the store is read from outside
    training. The engine updates the pins at each window's close (`OffloadEngine.end_window`), and hands the manager
    what it uses: the shared resources (offload/resources.py: the store, stager, device pins, coordinator and the
    room for pins), the layers, the update ledger, the decoding path (whose mode and device cache the pins follow)
    and the engine's `wait_in_flight`."""

    def __init__(self, resources, layers: list, ledger, decoding, pin_fraction: float, wait_in_flight):
        self.res = resources  # the store, stager and device pins that hold the pins (offload/resources.py)
        self.layers = layers  # the engine's OffloadedExpertsLayers: their loads choose the pins
        self.ledger = ledger  # a pin comes up once its gradient has landed and its update is done
        self.decoding = decoding  # decoding pins device copies only, none while its device cache is open
        self.wait_in_flight = wait_in_flight  # the engine's: everything in flight done before the pins go home
        self.pin_choice = PinChoice(pin_fraction)
        self.pinned: list[ExpertKey] = []  # best first, at most the engine's `pin_limit`

    def admit(self, keys: list[ExpertKey]) -> None:
        """A training forward is about to use these: pins among them that wait to come up do, once their gradient
        has landed and their update is done (which the forward would wait for anyway)."""
        res = self.res
        pins = res.device_pins
        for key in keys:
            if key in pins.pending:
                self.ledger.wait_for_grad(key)
                self.ledger.wait_for_update(key)
                pins.admit(key)

    def release_device(self) -> None:
        """The device-pinned experts' state back into the store (they stay pinned, pending: their next training
        forward brings them up again): before anything reads or writes the store from outside training."""
        res = self.res
        if res.device_pins is not None and len(res.device_pins):
            self.wait_in_flight()
            res.device_pins.release_all()
            self.sync_stager()

    def update(self) -> None:
        """At a window's close: pin each layer's `pin_fraction` experts by recent load (several processes: the
        placement's pins)."""
        res = self.res
        if res.coordinator is not None:  # several ranks: pins must agree with the placement (ES-MoE §4.2-4.3)
            self.set(res.coordinator.pinned_keys())
            return
        self.set(self.pin_choice.by_load(self.layers, self.pinned))

    def set(self, pinned: list[ExpertKey]) -> None:
        """Pin these (best first), at most `pin_limit` of them."""
        res = self.res
        pinned = list(pinned)[: res.pin_limit]
        res.store.set_pinned(pinned)
        on_device = []
        if res.device_pins is not None:
            # Training, one process: the first (best) pins keep their whole state on the device. A shared store's
            # ranks, and decoding, pin device copies of the weights only.
            if res.coordinator is None and not self.decoding.inference:
                on_device = pinned[: res.device_pins.capacity]
            res.device_pins.set(on_device)  # new ones come up at their next training forward (`admit`)
        self.pinned = pinned
        self.sync_stager(set(on_device))

    def sync_stager(self, on_device: set[ExpertKey] = frozenset()) -> None:
        """The stager keeps device copies of the pinned experts whose state is not on the device (`on_device`: the
        device pins'), none while the device cache is open: it holds decoding's device copies, within its budget."""
        res = self.res
        if res.stager is not None:
            decoding_copies = self.decoding.device_cache is not None
            res.stager.set_pinned(set() if decoding_copies else set(self.pinned) - on_device)


__all__ = ["PinChoice", "PinManager"]
