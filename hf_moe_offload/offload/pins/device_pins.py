"""Pinned experts that live on the device and step there (ES-MoE §4.3).

ES-MoE pins each GPU's most loaded experts of the previous iteration (n_p = 25%) so that they need no I/O. While
training on an asynchronous device, a pinned expert's whole training state — fp32 weights, gradient and Adam moments
(the store's four record rows) and its compute-dtype copy — moves into device memory for as long as it stays pinned:
its forward reads the device copy, its backward adds its gradient there (no download), and the expert optimizer steps
it on the device with the same fused AdamW arithmetic as the host's. So a pinned expert costs neither transfers nor host
Adam time; the host steps the others, overlapped with backward.

A new pin comes up at the first training forward that uses the expert, once its last host update is done (waiting
for it at the window's close would stall the step on the host Adam). The store's record of a device-pinned expert is
stale while it is pinned. Its state goes back into the store when the pin moves to another expert (at a window's
close), and before anything reads or writes the store from outside training (a save, a load, `state_dict`, disabling
offload: `OffloadEngine.synchronize`); it then stays pinned, pending, and its next training forward brings it up.

The state sits in one (capacity, 4, P) fp32 block and the copies in one (capacity, P) block, so that a chunk's
pinned experts are placed into the slab, and their gradients added, with one indexed op each whatever their number.
Every operation here runs on the compute stream, on the calling thread.
"""

from __future__ import annotations

import torch

from ...runtime import DeviceRuntime
from ..stores.store import GRAD, STATE_ROWS, ExpertKey, ExpertRecord, ExpertStore
from ..telemetry import OffloadStats


class DevicePins:
    """Up to `capacity` experts' training state on the device (see the module docstring)."""

    def __init__(self, runtime: DeviceRuntime, store: ExpertStore, capacity: int, stats: OffloadStats):
        self.rt = runtime
        self.store = store
        self.stats = stats
        self.capacity = capacity
        numel, dtype = store.numel, store.compute_dtype
        self.state = runtime.empty((capacity, STATE_ROWS, numel), torch.float32, persistent=True)
        self.copies = (runtime.empty((capacity, numel), dtype, persistent=True) if dtype != torch.float32
                       else None)
        self.records: dict[ExpertKey, ExpertRecord] = {}  # over `state[slot]` (and `copies[slot]`)
        self.slots: dict[ExpertKey, int] = {}
        self.versions: dict[ExpertKey, int] = {}  # ExpertRecord.version of the device records: steps taken here
        self.pending: set[ExpertKey] = set()  # pinned, to come up at their next training forward (`admit`)
        self._free = list(reversed(range(capacity)))

    def __contains__(self, key) -> bool:
        return key in self.records

    def __len__(self) -> int:
        return len(self.records)

    def keys(self) -> list[ExpertKey]:
        return list(self.records)

    def weights(self, key: ExpertKey) -> torch.Tensor:
        """The expert's compute weights on the device (what an upload would have brought)."""
        return self.records[key].compute_param()

    def version(self, key: ExpertKey) -> tuple[str, int]:
        """What a slab block holding this expert remembers (never equal to a host record's version)."""
        return ("device", self.versions[key])

    # --- moving state in and out ---
    def use_store(self, store: ExpertStore) -> None:
        """The engine's store was replaced (its state all home already, `release_all`): pins come up from this one."""
        self.store = store

    def set(self, keys: list[ExpertKey]) -> None:
        """Hold exactly these experts (at most `capacity`, the first ones): the others' state goes back to the store
        now, the new ones' comes up when `admit`ted."""
        wanted = list(dict.fromkeys(keys))[: self.capacity]
        for key in [k for k in self.records if k not in wanted]:
            self._evict(key)
        self.pending = {key for key in wanted if key not in self.records}

    def release_all(self) -> None:
        """Every expert's state back into the store (see the module docstring); they stay pinned, pending."""
        self.pending |= set(self.records)
        for key in list(self.records):
            self._evict(key)

    def admit(self, key: ExpertKey) -> None:
        """Bring a pending pin's state up from the store (the caller has waited for its gradient and update)."""
        self.pending.discard(key)
        rt, store = self.rt, self.store
        slot = self._free.pop()
        host = store.acquire(key)  # every row
        try:
            stale = host.grad_stale  # the host row holds an old gradient that counts as zero
            rows = self.state[slot]
            for dst, src in zip(rows, host.buffer):  # row by row: a record's rows may lie apart (host tier)
                rt.copy_(dst, src)
            if stale:
                rows[GRAD].zero_()
            self.versions[key] = 0
            # Its copy is made from the fp32 weights on the device (ExpertRecord's constructor).
            self.records[key] = ExpertRecord(key, rows, store.compute_dtype, self.versions,
                                             self.copies[slot] if self.copies is not None else None)
            self.slots[key] = slot
            rt.record().synchronize()  # the host row is read before anything may write it again
        finally:
            store.release(key)
        self.stats.pin_move_bytes += host.buffer.numel() * host.buffer.element_size()

    def _evict(self, key: ExpertKey) -> None:
        rt, store = self.rt, self.store
        record = self.records.pop(key)
        slot = self.slots.pop(key)
        host = store.acquire(key)
        try:
            store.note_host_write(host)
            for dst, src in zip(host.buffer, record.buffer):
                rt.copy_(dst, src)
            rt.record().synchronize()
            host.grad_stale = False  # the row holds the device's gradient (zero where none was added)
            host.refresh_compute()  # its compute copy, and a new version (uploads made before are stale)
        finally:
            store.release(key, dirty=True)
        self._free.append(slot)
        self.stats.pin_move_bytes += host.buffer.numel() * host.buffer.element_size()

    # --- training ---
    def _index(self, keys: list[ExpertKey]) -> torch.Tensor:
        return torch.tensor([self.slots[k] for k in keys], device=self.state.device)

    def place(self, weights: torch.Tensor, positions: list[int], keys: list[ExpertKey]) -> None:
        """Copy these experts' compute weights into `weights` (a chunk's, in a slab block) at `positions`: one indexed
        copy."""
        if not keys:
            return
        src = self.copies if self.copies is not None else self.state[:, 0]
        pos = torch.tensor(positions, device=weights.device)
        self.rt.access(weights, write=True)
        weights.index_copy_(0, pos, src.index_select(0, self._index(keys)).to(weights.dtype))

    def add_grads(self, keys: list[ExpertKey], grads: torch.Tensor) -> None:
        """Add (k, P) gradients (any float dtype; accumulated in fp32) into these experts' gradient rows."""
        if not keys:
            return
        self.state[:, GRAD].index_add_(0, self._index(keys), grads.to(torch.float32))
        for key in keys:
            self.store.has_grad[key] = True

    def record(self, key: ExpertKey) -> ExpertRecord:
        """The device record of `key` (the expert optimizer steps it like a host record)."""
        return self.records[key]


def pins_within_budget(wanted: int, numel: int, compute_dtype: torch.dtype, budget: int | None,
                       slab_bytes: int) -> int:
    """How many of `wanted` device pins the device budget holds beside the slab: each keeps its whole training state
    (fp32 weights, gradient and moments: 16 bytes per parameter) and, under a narrower compute dtype, its copy."""
    if budget is None:
        return wanted
    per_expert = numel * (16 + (compute_dtype.itemsize if compute_dtype != torch.float32 else 0))
    return min(wanted, max(0, budget - slab_bytes) // per_expert)


__all__ = ["DevicePins", "pins_within_budget"]
