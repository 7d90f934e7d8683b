"""Which experts are pinned (ES-MoE §4.3): kept in the host cache of the disk tier, and close to the compute on a
device (a device copy of the weights, or in training their whole state: offload/device_pins.py).

ES-MoE pins the experts most loaded in the previous iteration. Each change of a pin costs I/O (on the disk tier the
record leaving the cache is written back and the newcomer read; on a device, an upload), while one step's loads are
noisy (e.g. 16 +- 4 tokens per expert at 64 experts): pinning by the last load alone moved most pins every step and
saved almost nothing. So the load is averaged over recent steps and a pinned expert keeps its place until another's
average is `PIN_HYSTERESIS` times its own (bytes written per step). Decoding pins by decoding's use scores
instead (mixtral-offloading's per-layer expert cache on the GPU), and several processes sharing a store pin what the
placement says (ES-MoE §4.2-4.3). The engine applies the choice (`OffloadEngine._set_pins`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from .store import ExpertKey


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


__all__ = ["PinChoice"]
