"""Moving expert weights to the compute device and gradients back (ES-MoE §4.1's pipeline, its copies).

`DeviceStager`: one expert's weights at a time into a ring of device slots on a side stream (the per-expert stream,
k = 1), and the device copies of pinned experts (ES-MoE §4.3); `HostStager` where the host computes (nothing copied). `GradRing`: gradients on their way to the host, a ring
of page-locked buffers filled on a stream of their own. `GradArrival`: one expert's gradient for this micro-step,
landed into the record's fp32 gradient row by whoever takes it (the expert optimizer's worker, or the engine's). The
slab of a layer's experts (k > 1 on a device) is `offload/streaming/slab.py`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch

from ...runtime import HOST, DeviceRuntime, Event
from ..inference.device_cache import DeviceExpertCache
from ..stores.quantized import upload_weights
from .slab import StallTimer
from ..stores.store import ExpertKey, ExpertRecord
from ..telemetry import OffloadStats


class _Stager:
    """What both stagers share: the pinned experts (ES-MoE §4.3) and the timer of compute's waits."""

    def __init__(self, runtime: DeviceRuntime, numel: int, dtype: torch.dtype, depth: int, stats: OffloadStats):
        self.rt = runtime
        self.stats = stats
        self.numel, self.dtype, self.depth = numel, dtype, depth
        self.pinned: dict[ExpertKey, tuple[torch.Tensor, int, Event]] = {}  # key -> (copy, version, its upload)
        self.pinned_keys: set[ExpertKey] = set()
        self.timer = StallTimer(runtime, stats)

    def set_pinned(self, keys: set[ExpertKey]) -> None:
        self.pinned_keys = set(keys)
        for key in list(self.pinned):
            if key not in self.pinned_keys:
                del self.pinned[key]

    def drop_copies(self) -> None:
        """Forget every device copy (the store was replaced: its versions start again)."""
        self.pinned.clear()


class HostStager(_Stager):
    """The host computes (the inline runtime): a record's tensor is already usable and nothing is copied. A quantized
    expert is dequantized into a ring of `depth + 2` host buffers (the stream holds at most `depth + 1` issued experts
    beside the one its consumer just finished), not into a new tensor per use: the host's allocator would keep every
    size it handed out."""

    def __init__(self, runtime: DeviceRuntime, numel: int, dtype: torch.dtype, depth: int, stats: OffloadStats):
        super().__init__(runtime, numel, dtype, depth, stats)
        self.host_ring: list[torch.Tensor] = []  # quantized experts: made on first use
        self.host_next = 0

    def upload(self, key: ExpertKey, record: ExpertRecord,
               cache: DeviceExpertCache | None = None) -> tuple[torch.Tensor, None, None]:
        """-> (weights, None, None): nothing to wait for, nothing to hand back."""
        if record.decoder is None:
            return record.compute_param(), None, None
        if not self.host_ring:
            self.host_ring = [torch.empty(self.numel, dtype=self.dtype) for _ in range(self.depth + 2)]
        out = self.host_ring[self.host_next]
        self.host_next = (self.host_next + 1) % len(self.host_ring)
        return record.decode_into(out), None, None

    def wait(self, ready: Event | None, weights: torch.Tensor) -> None:
        if ready is not None:
            self.timer.wait(ready)


class DeviceStager(_Stager):
    """Makes expert weights usable on an asynchronous device (CUDA, the CPU simulation; hf_moe_offload.runtime):
    copies into `depth + 1` device slots on a side stream; an event per upload lets compute wait for exactly that
    expert, and an event per use lets the copy stream reuse the slot only after compute is done with it. Pinned
    experts (ES-MoE §4.3) keep a device copy, reused while the expert's version (its update count, kept by the store)
    is unchanged."""

    def __init__(self, runtime: DeviceRuntime, numel: int, dtype: torch.dtype, depth: int, stats: OffloadStats):
        super().__init__(runtime, numel, dtype, depth, stats)
        self.stream = runtime.new_stream()
        # Allocated for the copy stream (which writes them) and owned for the stager's life: compute reads them only
        # between the upload's event and the use's event.
        self.slots = [runtime.empty((numel,), dtype, stream=self.stream, persistent=True) for _ in range(depth + 1)]
        self.slot_free: list[Event | None] = [None] * (depth + 1)  # after the last use of each slot
        self.next_slot = 0
        self.ring_in_flight = 0  # ring slots handed out whose use is not done yet

    def upload(self, key: ExpertKey, record: ExpertRecord,
               cache: DeviceExpertCache | None = None) -> tuple[torch.Tensor, Event | None, Callable | None]:
        """-> (weights, their upload's event or None, `done` to call after compute's last use, or None). With `cache`
        (decoding, offload/inference/device_cache.py) an admitted expert goes into a cache slot instead of the ring."""
        rt = self.rt
        src = record.upload_source()
        cached = self.pinned.get(key)
        if cached is not None and cached[1] == record.version:
            # Its upload's event too: a first use that was interrupted may never have waited for it.
            return cached[0], cached[2], None
        if cache is not None:
            kept = cache.upload(key, record.version, src)
            if kept is not None:
                return kept
        if key in self.pinned_keys:
            # A copy of its own, allocated on the copy stream that writes it; compute reads it (record_stream), so
            # its memory is not handed out again before compute is done with it.
            dst = rt.empty((self.numel,), self.dtype, stream=self.stream)
            rt.record_stream(dst, rt.current_stream())
            done = None
        else:
            slot = self.next_slot
            self.next_slot = (slot + 1) % len(self.slots)
            dst = self.slots[slot]
            rt.wait_event(self.slot_free[slot], self.stream)  # compute is done with the slot's previous expert
            done = functools.partial(self._slot_done, slot)
            self.ring_in_flight += 1
        self.stats.h2d_bytes += upload_weights(rt, dst, src, self.stream)
        ready = rt.record(self.stream)
        if done is None:
            self.pinned[key] = (dst, record.version, ready)
        return dst, ready, done

    def wait(self, ready: Event | None, weights: torch.Tensor) -> None:
        """Compute waits for the upload of `weights` (timed with events: the compute stream's idle time); its read is
        declared whatever it waited for (the simulated device checks it)."""
        if ready is not None:
            self.timer.wait(ready)
        self.rt.access(weights)

    def _slot_done(self, slot: int) -> None:
        self.slot_free[slot] = self.rt.record()
        self.ring_in_flight -= 1


class GradRing:
    """Expert gradients on their way to the host (asynchronous runtimes): a ring of page-locked buffers in the
    gradient's dtype, filled by copies on a side stream. `send` returns a `GradArrival` that the consumer (the expert
    optimizer's worker, or the engine's own) lands on the host; the buffer is reused only after that."""

    def __init__(self, runtime: DeviceRuntime, numel: int, dtype: torch.dtype, size: int):
        self.rt = runtime
        self.stream = runtime.new_stream()
        self.buffers = [runtime.pinned_empty((numel,), dtype) for _ in range(size)]
        self._free = list(range(size))
        self._cond = threading.Condition()

    def send(self, flat: torch.Tensor) -> "GradArrival":
        with self._cond:
            while not self._free:  # every buffer is waiting for its consumer: backpressure on the compute thread
                self._cond.wait()
            i = self._free.pop()
        rt = self.rt
        rt.access(flat, write=True)  # produced on the compute stream
        rt.wait_stream(self.stream, rt.current_stream())
        rt.record_stream(flat, self.stream)
        buffer = self.buffers[i][: flat.numel()]  # a slab chunk may hold fewer experts than the buffer
        rt.copy_(buffer, flat, self.stream)
        return GradArrival(rt, buffer, rt.record(self.stream), lambda: self._give_back(i))

    def _give_back(self, i: int) -> None:
        with self._cond:
            self._free.append(i)
            self._cond.notify()


class GradArrival:
    """One expert's gradient for this micro-step, on its way into the record's fp32 gradient row: a flat `buffer`
    downloaded from a device (`event` marks the copy), or, where the host computes, the per-tensor gradients autograd
    made (`parts`, layout order, `views` splitting the record's flat row the same way)."""

    __slots__ = ("rt", "buffer", "event", "release", "parts", "views")

    def __init__(self, rt: DeviceRuntime, buffer: torch.Tensor | None, event: Event | None, release=None,
                 parts: list[torch.Tensor] | None = None, views: Callable | None = None):
        self.rt, self.buffer, self.event, self.release = rt, buffer, event, release
        self.parts, self.views = parts, views

    @classmethod
    def on_host(cls, rt: DeviceRuntime, parts: list[torch.Tensor], views: Callable) -> "GradArrival":
        return cls(rt, None, None, parts=parts, views=views)

    def land(self, record: ExpertRecord) -> None:
        """Add it to `record.grad` (fp32) on the calling host thread, once its copy has happened."""
        if self.parts is not None:
            record.add_grad_parts(self.parts, self.views)
            self.parts = None
            return
        if self.buffer is None:
            return  # landed already
        if self.event is not None:
            self.event.synchronize()
            self.rt.access(self.buffer, stream=HOST)
        record.add_grad(self.buffer)
        self.buffer = None
        if self.release is not None:
            self.release()

    def in_place_of(self, record: ExpertRecord) -> list[torch.Tensor] | None:
        """The gradient per tensor, to be used instead of landing it (the copy into the store's row was
        the host tier's largest cost over resident training): where it is autograd's own host tensors in the
        record's dtype and the record's row holds nothing (stale: it counts as zero, so the sum would be this
        gradient). The row stays stale; None: `land` it."""
        parts = self.parts
        if parts is None or not record.grad_stale or any(p.dtype != record.grad.dtype for p in parts):
            return None
        self.parts = None
        return parts


# `UpdateLedger.add_grad_hook` (offload/ledger.py): (key, record, arrival) of experts whose gradients are final -> the keys taken over.
GradHook = Callable[[list[tuple[ExpertKey, ExpertRecord, GradArrival]]], set]


__all__ = ["DeviceStager", "GradArrival", "GradHook", "GradRing", "HostStager"]
