"""How an offloaded tier streams the experts in the estimate (hf_moe_offload.planning.estimate): the slab's chunk and the
device pins as the engine's plan binds them (offload/plan.py, whose rules it calls), the uploads per step, and the
disk tier's traffic for trained experts. `w` is the estimate's `Workload`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..offload.config import OffloadConfig
from ..offload.plan import clamp_depth, device_pin_count, pin_room, stage_chunk
from ..offload.plan import device_budget as device_budget_for
from ..offload.streaming.slab import default_chunk, slab_nbytes


@dataclass(frozen=True)
class Stream:
    """How an offloaded tier streams the experts on a GPU, as the engine's plan binds it (offload/plan.py): the slab's experts per chunk and the trained experts whose state stays on the
    device."""

    layer_experts: int
    layers: int
    chunk: int  # the slab's k; 0: no slab (expert by expert through the stager, nothing reused)
    device_pins: int
    slab_bytes: int

    @classmethod
    def of(cls, w, layer_experts: int, layers: int, p: int, cache: int | None,
           device_budget: int) -> Stream:
        """`device_budget`: the device memory free when the engine binds (offload/plan.py `device_budget`)."""
        if w.device != "cuda":
            return cls(layer_experts, layers, 0, 0, 0)
        budget = device_budget_for(OffloadConfig(device_budget_bytes=w.device_budget_bytes), device_budget)
        depth = clamp_depth(w.prefetch_depth, cache)
        k = default_chunk(layer_experts, p, w.dtype, budget, cache, depth)
        pins = 0
        if k and not w.frozen_experts:
            pins = device_pin_count(w.pin_fraction, [layer_experts] * layers, pin_room(cache, depth, slab_experts=k),
                                    p, w.dtype, budget, k)
        return cls(layer_experts, layers, k, pins, slab_nbytes(k, p, w.dtype))

    def uploads(self, checkpointing: bool, frozen: bool = False) -> float:
        """Experts uploaded per step, every expert routed: the forward's, the checkpoint's recompute's, and the
        backward's but those the slab's two blocks still hold where the backward starts (the forward's last two
        chunks; with checkpointing, each layer's backward follows that layer's recompute, whose last two chunks it
        reuses: ES-MoE §4.1's reverse order, and where a chunk is a whole layer the recompute of the last two layers
        finds them from the forward). Frozen experts keep their versions from step to step, so the next forward
        finds the two chunks the backward ended on (layer 0's first two) as well."""
        per_layer = self.layer_experts - self.device_pins / self.layers  # the pins are spread over the layers
        total = per_layer * self.layers
        if not self.chunk:
            return (3 if checkpointing else 2) * total
        k = self.chunk
        rest = per_layer % k if per_layer > k else 0
        last_two = min(per_layer, k + (rest or k))  # a layer's last two chunks
        held = last_two if per_layer > k else min(total, 2 * per_layer)  # a chunk is a layer at most
        first_two = min(per_layer, 2 * k) if per_layer > k else held
        next_forward = first_two if frozen else 0
        if checkpointing:  # the recompute runs a layer's chunks in forward order: it finds only whole layers
            return 2 * total + (total - self.layers * last_two) - (0 if per_layer > k else held) - next_forward
        return 2 * total - held - next_forward


def trained_disk_traffic(w, n_experts: int, layer_experts: int, layers: int, cache: int,
                          row: int) -> tuple[int, int]:
    """Bytes the disk tier reads and writes per step for trained experts, every expert used. ES-MoE's minimum
    (benchmarks/offload.py::minimum_bytes) keeps the same `cache` records all step: each of the u = E - C others is
    read for the forward (weights) and the backward (weights, two moments: the gradient row never leaves the host)
    and written after its step (3 rows). The engine's cache follows the schedule (Belady, offload/stores/eviction.py), so it
    holds different records at the two turnarounds: the m = min(C - pins, u) records the backward starts with (the
    forward's last) hold only their weights and read their two moments (2 rows each), and the m records the backward
    leaves dirty are hit by the next forward and then written back (3 rows each) to make room for its reads, where
    the minimum would keep them. Pins stay (ES-MoE §4.3), so m shrinks with them: at most `pin_fraction` of each
    layer's experts, within the room the engine's plan leaves beside the reads ahead and the staged or slab chunks
    (offload/plan.py `pin_room`)."""
    depth = clamp_depth(w.prefetch_depth, cache)
    if w.device == "cuda":  # the slab's two chunks of up to a layer's experts
        room = pin_room(cache, depth, slab_experts=default_chunk(layer_experts, 0, w.dtype, None, cache, depth))
    else:  # the staging block's two chunks, where the cache holds half the experts
        room = pin_room(cache, depth, stage_experts=stage_chunk(cache, depth, n_experts))
    pins = min(layers * math.ceil(w.pin_fraction * layer_experts), room)
    u = max(0, n_experts - cache)
    m = min(cache - pins, u)
    # Activation checkpointing: the recompute reads each uncached expert's weights once more, at least (a floor: the
    # cache's turnover around it is not modelled; docs/estimate.md gives what runs measured)
    recompute = u if w.gradient_checkpointing else 0
    return (4 * u + 2 * m + recompute) * row, (3 * u + 3 * m) * row


__all__ = ["Stream", "trained_disk_traffic"]
