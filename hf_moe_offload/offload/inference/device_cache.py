"""Decoding on a device: the experts decoding uses most, kept in device memory across tokens.

A decoded token routes to a few experts per layer, and their uploads are the whole cost of an offloaded decode step
on a GPU (a Qwen3-MoE-shaped model's token: 128 experts x 3.1 MB in bf16 up). Experts are reused across tokens with
a skewed frequency, so a cache of device slots keeps the ones decoding's scores rank highest (`DecodeCache.score`:
decayed use counts, offload/inference/policies.py): mixtral-offloading's per-layer expert cache, MoE-Infinity's activation-aware
cache. An expert whose slot holds its current version (the store's update count) is used without an upload.

A miss is admitted into a free slot, or into the slot of the lowest-scored expert not in flight in this layer's call
when the newcomer scores higher (else it streams through the stager's ring and is not kept; pre-gating's guesses of the
next layer are admitted by the same rule). The slots are
allocated when decoding starts and freed when training resumes (`DecodePath.enter_call`, offload/inference/decoding.py),
sized by `OffloadConfig.device_cache_bytes` (default: half the device memory free then, beside the weights already
there, leaving the other half to the KV cache and activations). Ordering: an upload into a slot waits for compute's
last use of the slot (`free_after`); compute waits for the upload (`ready`); a slot in flight (uploaded or hit, its
use not yet done) is never evicted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...runtime import DeviceRuntime, Event, aligned_nbytes
from ..stores.quantized import upload_weights
from ..stores.store import ExpertKey
from ..telemetry import OffloadStats


class DeviceExpertCache:
    def __init__(self, runtime: DeviceRuntime, numel: int, dtype: torch.dtype, capacity: int, stream,
                 score: Callable[[ExpertKey], float], stats: OffloadStats):
        self.rt, self.stream, self.score, self.stats = runtime, stream, score, stats
        self.capacity = capacity
        self.nbytes = capacity * aligned_nbytes(numel, dtype)
        # Written on the copy stream, read on the compute stream between `ready` and `free_after` (persistent: the
        # events order every reuse). One allocation per slot: each slot's uses are ordered on their own.
        self.slots = [runtime.empty((numel,), dtype, stream=stream, persistent=True) for _ in range(capacity)]
        self.slot_of: dict[ExpertKey, int] = {}
        self.holder: list[ExpertKey | None] = [None] * capacity
        self.version: list[int] = [-1] * capacity
        self.ready: list[Event | None] = [None] * capacity  # after the slot's last upload
        self.free_after: list[Event | None] = [None] * capacity  # after compute's last use of the slot
        self.in_flight = [0] * capacity
        self._free = list(range(capacity - 1, -1, -1))  # slots never filled, lowest first (popped from the end)

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self.slot_of

    def holds(self, key: ExpertKey, version: int) -> bool:
        slot = self.slot_of.get(key)
        return slot is not None and self.version[slot] == version

    def hit(self, key: ExpertKey, version: int) -> tuple[torch.Tensor, Event | None, Callable] | None:
        """`key`'s weights if a slot holds its `version` -> (weights, their upload's event, done); None: a miss."""
        if not self.holds(key, version):
            self.stats.device_cache_misses += 1
            return None
        slot = self.slot_of[key]
        self.stats.device_cache_hits += 1
        self.in_flight[slot] += 1
        return self.slots[slot], self.ready[slot], lambda: self._done(slot)

    def upload(self, key: ExpertKey, version: int, src) -> tuple[torch.Tensor, Event, Callable] | None:
        """Admit `key` (see the module docstring) and enqueue its upload from `src` (page-locked host weights, or a
        quantized expert's bytes: `ExpertRecord.upload_source`) on the
        copy stream -> (weights, ready, done); None: not admitted (stream it through the ring)."""
        slot = self._claim(key)
        if slot is None:
            return None
        rt = self.rt
        rt.wait_event(self.free_after[slot], self.stream)  # compute is done with what the slot held
        self.stats.h2d_bytes += upload_weights(rt, self.slots[slot], src, self.stream)
        self.ready[slot] = rt.record(self.stream)
        self.version[slot] = version
        self.in_flight[slot] += 1
        return self.slots[slot], self.ready[slot], lambda: self._done(slot)

    def _claim(self, key: ExpertKey) -> int | None:
        slot = self.slot_of.get(key)
        if slot is not None:  # a stale version: refilled in place once its uses are done
            return slot if self.in_flight[slot] == 0 else None
        if self._free:
            slot = self._free.pop()
        else:  # full: the lowest-scored idle slot (a scan, on a miss of a full cache only)
            lowest, slot = min(((self.score(self.holder[s]), s) for s in range(self.capacity)
                                if self.in_flight[s] == 0), default=(None, None))
            if slot is None or lowest >= self.score(key):
                return None  # ties keep the cached one: admitting them churned a full cache (batch 8: more bytes)
            del self.slot_of[self.holder[slot]]
            self.stats.device_cache_evictions += 1
        self.holder[slot] = key
        self.slot_of[key] = slot
        return slot

    def close(self) -> None:
        """Give the slots back once compute's reads of them are done: the allocator hands their memory to the copy
        stream's next allocation at once (which comes after the copies into them: one stream). The host records
        those copies read are the optimizer's to wait for (`OffloadEngine.wait_for_uploads`)."""
        self.rt.record().synchronize()
        for slot in self.slots:
            self.rt.free(slot)
        self.slots, self.slot_of, self._free = [], {}, []

    def _done(self, slot: int) -> None:
        self.free_after[slot] = self.rt.record()
        self.in_flight[slot] -= 1


__all__ = ["DeviceExpertCache"]
