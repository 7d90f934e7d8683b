"""Pipelined per-expert processing over the expert store (ES-MoE §4.1, §4.3).

One MoE layer's experts run one after another on their contiguous token slices. While expert e computes, experts
e+1 .. e+depth are being brought in: disk reads on background threads (disk tier), and on CUDA an upload on a side
stream into a ring of device slots guarded by events. Backward re-streams the weights in reverse order, recomputes
each expert's FFN locally (its middle activation is never kept), and hands the finished fp32 gradient to the store,
where it accumulates across micro-steps; on the micro-step that closes an accumulation window the expert-wise
optimizer (hf_moe_offload.optim) may step that expert at once. The next forward of an expert waits for its own update
only (no staleness, no global barrier).

On CPU-only machines the "device" is the host: the same loop runs, with weights used in place (host tier) or from
the disk tier's cache.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Protocol

import torch
from torch import nn

from .layout import ExpertLayout
from .store import ExpertKey, ExpertRecord, ExpertStore
from .telemetry import OffloadStats

logger = logging.getLogger(__name__)


class DeviceStager:
    """Makes expert weights usable on the compute device.

    CUDA: copies into `depth + 1` device slots on a side stream; an event per upload lets compute wait for exactly
    that expert, and an event per use lets the copy engine reuse the slot only after compute is done with it. Pinned
    experts (ES-MoE §4.3) keep a device copy, refreshed when their version changes (after an update).
    CPU: the host tensor is already usable; nothing is copied.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, depth: int, stats: OffloadStats):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stats = stats
        self.pinned: dict[ExpertKey, tuple[torch.Tensor, int]] = {}
        self.pinned_keys: set[ExpertKey] = set()
        if self.cuda:
            self.stream = torch.cuda.Stream(device=device)
            self.slots = [torch.empty(numel, dtype=dtype, device=device) for _ in range(depth + 1)]
            self.slot_free = [None] * (depth + 1)  # event recorded after the last use of each slot
            self.next_slot = 0

    def upload(self, key: ExpertKey, record: ExpertRecord) -> tuple[torch.Tensor, object, int | None]:
        """Returns (weights, ready_event_or_None, slot_or_None)."""
        src = record.compute_param()
        if not self.cuda:
            return src, None, None
        cached = self.pinned.get(key)
        if cached is not None and cached[1] == record.version:
            return cached[0], None, None
        if key in self.pinned_keys:
            dst = torch.empty_like(self.slots[0])
            slot = None
        else:
            slot = self.next_slot
            self.next_slot = (slot + 1) % len(self.slots)
            dst = self.slots[slot]
        with torch.cuda.stream(self.stream):
            if slot is not None and self.slot_free[slot] is not None:
                self.stream.wait_event(self.slot_free[slot])
            dst.copy_(src, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self.stats.h2d_bytes += src.numel() * src.element_size()
        if slot is None:
            self.pinned[key] = (dst, record.version)
        return dst, ready, slot

    def wait(self, ready) -> None:
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)

    def done(self, slot: int | None) -> None:
        if self.cuda and slot is not None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.slot_free[slot] = ev

    def set_pinned(self, keys: set[ExpertKey]) -> None:
        self.pinned_keys = set(keys)
        for key in list(self.pinned):
            if key not in self.pinned_keys:
                del self.pinned[key]


class OffloadedExpertsLayer:
    """Replaces one experts module's forward; its weights live in the store under keys (layer, e)."""

    def __init__(self, engine: "OffloadEngine", layer: int, module: nn.Module, layout: ExpertLayout):
        self.engine = engine
        self.layer = layer
        self.module = module
        self.layout = layout
        self.last_counts: list[int] = [0] * layout.num_experts
        # Streamed calls of this layer whose backward has not run yet. A layer may be called several times per
        # micro-step (MPMoE partitions): an expert's gradient is final only in the backward of the last call.
        self.outstanding = 0
        # Makes autograd call our backward even when no input requires grad (e.g. frozen layers below).
        self._anchor = torch.zeros(0, requires_grad=True)

    def keys(self, expert_ids: list[int]) -> list[ExpertKey]:
        return [(self.layer, e) for e in expert_ids]

    def prefetch(self, counts: list[int]) -> None:
        """Called with the dispatch plan before the token permutation, so the first reads overlap it."""
        ids = [e for e, n in enumerate(counts) if n]
        self.engine.store.prefetch(self.keys(ids[: self.engine.depth + 1]))

    def routed_forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' experts signature: sort by expert, stream, weight and combine (index_add_)."""
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.layout.num_experts + 1)[: self.layout.num_experts].tolist()
        order = order[: sum(counts)]  # ids >= num_experts mark dropped assignments
        token_index = order // k
        self.prefetch(counts)
        y = self.forward(hidden.index_select(0, token_index), counts)
        y = y * top_k_weights.reshape(-1)[order].to(y.dtype).unsqueeze(-1)
        return torch.zeros_like(hidden).index_add_(0, token_index, y)

    def forward(self, x_sorted: torch.Tensor, counts: list[int], expert_ids: list[int] | None = None) -> torch.Tensor:
        ids = list(range(len(counts))) if expert_ids is None else list(expert_ids)
        total = [0] * self.layout.num_experts
        for e, n in zip(ids, counts):
            total[e] += n
        self.last_counts = total
        self.engine.stats.tokens_per_expert[str(self.layer)] = total
        if torch.is_grad_enabled() and self.engine.trainable:
            self.outstanding += 1
            return _StreamedExperts.apply(x_sorted, self._anchor, self, tuple(counts), tuple(ids))
        with torch.no_grad():
            return self.run_forward(x_sorted, counts, ids, rng_states=None)

    # --- the two streamed loops ---
    def _segments(self, counts, ids) -> list[tuple[int, int, int]]:
        out, start = [], 0
        for e, n in zip(ids, counts):
            if n:
                out.append((e, start, n))
            start += n
        return out

    def run_forward(self, x, counts, ids, rng_states: list | None) -> torch.Tensor:
        segments = self._segments(counts, ids)
        y = torch.empty_like(x)
        save_rng = rng_states is not None and self._has_dropout()
        for w, (e, start, n) in zip(self.engine.stream(self.layer, [s[0] for s in segments]), segments):
            if save_rng:
                rng_states.append(_get_rng(x.device))
            y[start : start + n] = self.layout.forward(x[start : start + n], self.layout.views(w.to(x.dtype)))
        return y

    def run_backward(self, x, gy, counts, ids, rng_states: list) -> torch.Tensor:
        segments = self._segments(counts, ids)
        gx = torch.zeros_like(x)
        order = list(reversed(range(len(segments))))
        stream = self.engine.stream(self.layer, [segments[i][0] for i in order], keep=True)
        for (w, record), i in zip(stream, order):
            e, start, n = segments[i]
            leaves = [v.detach().requires_grad_(True) for v in self.layout.views(w.to(x.dtype))]
            xs = x[start : start + n].detach().requires_grad_(True)
            with torch.enable_grad(), torch.random.fork_rng(devices=_rng_devices(x.device), enabled=bool(rng_states)):
                if rng_states:
                    _set_rng(x.device, rng_states[i])
                ys = self.layout.forward(xs, leaves)
            grads = torch.autograd.grad(ys, [xs, *leaves], gy[start : start + n])
            gx[start : start + n] = grads[0]
            self.engine.accumulate_grad((self.layer, e), record, grads[1:])
        self.engine.layer_backward_done(self.layer)
        return gx

    def _has_dropout(self) -> bool:
        return self.module.training and any(
            isinstance(m, nn.Dropout) and m.p > 0 for m in self.module.modules()
        )


def _rng_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []


def _get_rng(device: torch.device):
    return (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng(device: torch.device, state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class _StreamedExperts(torch.autograd.Function):
    """Saves only the expert inputs (T_DI); weights are re-streamed and T_M recomputed in backward."""

    @staticmethod
    def forward(ctx, x_sorted, anchor, layer: OffloadedExpertsLayer, counts, ids):
        ctx.layer, ctx.counts, ctx.ids = layer, counts, ids
        ctx.rng_states = []
        ctx.save_for_backward(x_sorted)
        return layer.run_forward(x_sorted, counts, ids, ctx.rng_states)

    @staticmethod
    def backward(ctx, gy):
        (x_sorted,) = ctx.saved_tensors
        gx = ctx.layer.run_backward(x_sorted, gy.contiguous(), ctx.counts, ctx.ids, ctx.rng_states)
        return gx, None, None, None, None


class UpdateCoordinator(Protocol):
    """Set as `OffloadEngine.coordinator` when several processes share one expert store (hf_moe_offload.distributed,
    ES-MoE §4.2 dynamic placement): it says which process steps each expert in the current accumulation window and
    reduces the optimizer's global checks across processes. None (the default) = this process owns every expert."""

    def owns_update(self, key: ExpertKey) -> bool: ...

    def all_reduce_sum(self, value: float) -> float: ...

    def all_reduce_max(self, value: float) -> float: ...

    def pinned_keys(self) -> list[ExpertKey]: ...

    def window_closed(self) -> None: ...


class OffloadEngine:
    """Owns the store, the device stager and the per-layer streaming; the expert optimizer plugs in here."""

    def __init__(self, store: ExpertStore, layers_modules: list[tuple[nn.Module, ExpertLayout]], device: torch.device,
                 depth: int, pin_fraction: float, stats: OffloadStats, mode: str):
        self.store = store
        self.stats = stats
        self.mode = mode
        self.device = device
        cache = getattr(store, "cache_experts", None)
        # Records in flight must fit the cache: clamp the lookahead (a cache of 1 expert streams with no lookahead).
        self.depth = depth if cache is None else max(0, min(depth, cache - 2))
        self.pin_fraction = pin_fraction
        self.trainable = True
        self._state_dict_experts = True
        self.layers = [OffloadedExpertsLayer(self, i, m, layout) for i, (m, layout) in enumerate(layers_modules)]
        numel = store.numel
        self.stager = DeviceStager(numel, store.compute_dtype, device, max(self.depth, 1), stats)
        self._pending: dict[ExpertKey, Future] = {}  # expert updates in flight (set by the optimizer)
        self._grad_hooks: list[Callable[[ExpertKey, ExpertRecord], bool]] = []
        self._layer_done_hooks: list[Callable[[int], None]] = []
        self._warned_no_optimizer = False
        self.coordinator: UpdateCoordinator | None = None

    # --- streaming ---
    def stream(self, layer: int, expert_ids: list[int], keep: bool = False) -> Iterator:
        """Yields each expert's compute weights in order, `depth` experts ahead; with keep=True also the record,
        which the caller must hand back through `accumulate_grad` (backward)."""
        keys = [(layer, e) for e in expert_ids]
        self.store.prefetch(keys[: self.depth + 1])
        inflight: deque = deque()
        nxt = 0
        t_start = time.perf_counter()

        def issue() -> None:
            nonlocal nxt
            key = keys[nxt]
            nxt += 1
            t0 = time.perf_counter()
            self.wait_for_update(key)
            record = self.store.acquire(key)
            self.stats.stall_seconds += time.perf_counter() - t0
            inflight.append((key, record, *self.stager.upload(key, record)))
            if nxt + self.depth < len(keys):
                self.store.prefetch(keys[nxt : nxt + self.depth + 1])

        try:
            while nxt < len(keys) or inflight:
                while nxt < len(keys) and len(inflight) <= self.depth:
                    issue()
                key, record, weights, ready, slot = inflight.popleft()
                t0 = time.perf_counter()
                self.stager.wait(ready)
                self.stats.stall_seconds += time.perf_counter() - t0
                handed_over = False
                try:
                    if keep:
                        handed_over = True
                        yield weights, record
                    else:
                        yield weights
                finally:
                    if not handed_over:
                        if ready is not None:
                            # The async H2D copy reads the host record: it must be done before the record can be
                            # evicted and its cache slot refilled.
                            ready.synchronize()
                        self.store.release(key)
                    self.stager.done(slot)
        finally:
            for key, *_ in inflight:  # interrupted: hand back what was acquired
                self.store.release(key)
            self.stats.compute_seconds += time.perf_counter() - t_start

    # --- gradients and updates ---
    def accumulate_grad(self, key: ExpertKey, record: ExpertRecord, grads: tuple[torch.Tensor, ...]) -> None:
        """Adds one expert's gradient (per-tensor, layout order) into its fp32 store slot; releases the record
        unless a hook (the expert optimizer) takes it over to step it."""
        flat = torch.cat([g.reshape(-1) for g in grads]).float()
        if flat.device.type != "cpu":
            self.stats.d2h_bytes += flat.numel() * flat.element_size()
            flat = flat.to("cpu")
        record.grad.add_(flat)
        self.store.has_grad[key] = True
        if self.layers[key[0]].outstanding > 1:  # more calls of this layer still to run backward (partitions)
            self.store.release(key, dirty=True)
            return
        if not self._grad_hooks and not self._warned_no_optimizer:
            self._warned_no_optimizer = True
            logger.warning(
                "expert gradients are accumulating in the offload store but no ExpertOptimizer is attached, so the "
                "experts will not be updated: add ExpertOptimizerCallback() to the Trainer (or an ExpertOptimizer to "
                "your loop); call engine.zero_grad() if you only inspect gradients"
            )
        for hook in self._grad_hooks:
            if hook(key, record):
                return
        self.store.release(key, dirty=True)

    def layer_backward_done(self, layer: int) -> None:
        # Plain autograd gives every expert of a layer that ran backward a (possibly zero) gradient.
        for e in range(self.layers[layer].layout.num_experts):
            self.store.has_grad[(layer, e)] = True
        state = self.layers[layer]
        state.outstanding = max(0, state.outstanding - 1)
        if state.outstanding == 0:  # the layer's gradients are final for this micro-step
            for hook in self._layer_done_hooks:
                hook(layer)
        prev = layer - 1  # ES-MoE: prefetch in the known reverse order, across layers too
        if prev >= 0:
            counts = self.layers[prev].last_counts
            ids = [e for e in reversed(range(len(counts))) if counts[e]]
            self.store.prefetch([(prev, e) for e in ids[: self.depth + 1]])

    def add_grad_hook(self, hook: Callable[[ExpertKey, ExpertRecord], bool]) -> None:
        self._grad_hooks.append(hook)

    def add_layer_done_hook(self, hook: Callable[[int], None]) -> None:
        self._layer_done_hooks.append(hook)

    def set_pending(self, key: ExpertKey, fut: Future) -> None:
        self._pending[key] = fut

    def wait_for_update(self, key: ExpertKey) -> None:
        fut = self._pending.pop(key, None)
        if fut is not None:
            fut.result()

    def end_window(self) -> None:
        """An accumulation window closed: forget calls whose backward never ran (e.g. a forward under grad that was
        only evaluated), so the next window's eager stepping starts clean."""
        for layer in self.layers:
            layer.outstanding = 0

    def synchronize(self) -> None:
        """Wait for every expert update in flight."""
        for key in list(self._pending):
            self.wait_for_update(key)

    def zero_grad(self) -> None:
        self.synchronize()
        for key in self.store.keys():
            if self.coordinator is not None and not self.coordinator.owns_update(key):
                continue  # a shared store: the process that owns this expert clears it
            if self.store.has_grad[key]:
                record = self.store.acquire(key)
                record.grad.zero_()
                self.store.release(key, dirty=True)
                self.store.has_grad[key] = False
        publish = getattr(self.store, "publish", None)
        if self.coordinator is not None and publish is not None:
            # Node-shared disk tier: write the cleared records back now. Left dirty in this rank's cache, they would
            # be written whenever evicted, maybe while another rank reads the same file for the expert it runs next.
            publish()

    def expert_grad(self, key: ExpertKey) -> torch.Tensor | None:
        """A copy of the accumulated fp32 gradient of `key` (None if it has none)."""
        if not self.store.has_grad[key]:
            return None
        record = self.store.acquire(key)
        try:
            return record.grad.clone()
        finally:
            self.store.release(key)

    # --- pinning (ES-MoE §4.3) ---
    def update_pins(self) -> None:
        """Keep the top `pin_fraction` experts of each layer by last-iteration load resident."""
        pinned: list[ExpertKey] = []
        if self.coordinator is not None:  # several ranks: pins must agree with the placement (ES-MoE §4.2-4.3)
            pinned = self.coordinator.pinned_keys()
        else:
            for layer in self.layers:
                k = math.ceil(self.pin_fraction * layer.layout.num_experts) if self.pin_fraction else 0
                top = sorted(range(len(layer.last_counts)), key=lambda e: -layer.last_counts[e])[:k]
                pinned += [(layer.layer, e) for e in top if layer.last_counts[e]]
        self.store.set_pinned(pinned)
        self.stager.set_pinned(set(pinned))
        self.pinned = pinned


class ResidentEngine:
    """The `device` tier: experts stay ordinary resident parameters (still dropless and mask-free)."""

    mode = "device"
    store = None
    layers: list = []

    def __init__(self, stats: OffloadStats):
        self.stats = stats

    def synchronize(self) -> None:
        pass

    def update_pins(self) -> None:
        pass


__all__ = ["OffloadEngine", "ResidentEngine", "OffloadedExpertsLayer", "DeviceStager", "UpdateCoordinator"]
