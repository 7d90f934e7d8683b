"""Memory reuse across partitions and the restore strategies S1-S4 (MPMoE §3.3, Table 2).

Partition p of an MoE layer produces T_DI (dispatched tokens, (N_p, C)), T_M (the experts' hidden activations,
(N_p, I)) and T_DO (expert outputs, (N_p, C)). Autograd would keep all three alive until backward, so the memory of
every partition adds up ("memory bubbles", Fig. 6). A `PartitionSaver` intercepts what autograd saves while one
partition's experts run (`torch.autograd.graph.saved_tensors_hooks`) and, per strategy, moves it off the device or
drops it and remembers how to rebuild it:

    strategy   T_DI (expert inputs)          T_M, T_DO (activations inside/after the experts)
    keep       kept on device                kept on device                 (no reuse; the baseline)
    S1         offloaded to host             offloaded to host
    S2         re-dispatched from T_I        offloaded to host
    S3         offloaded to host             recomputed from restored T_DI
    S4         re-dispatched from T_I        recomputed from restored T_DI

Once nothing references a partition's device tensors they are freed, and the next partition's allocations of the same
sizes reuse those blocks (the caching allocator on CUDA): that is how partitions share the T_DI / T_M / T_DO buffers
here (NOTE: no hand-managed buffer pool; see `PartitionSaver` for what is counted).

Parameters (and views of them, e.g. `unbind` slices) are never moved: they are stored as they are.

With offloaded experts (`hf_moe_offload.offload`), the engine's autograd Function saves only T_DI and recomputes T_M
itself in backward, so the strategy decides T_DI (offload vs re-dispatch) and T_DO (offload vs recompute: recomputing
T_DO of a streamed layer re-runs its forward without grad, streaming the experts once more).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..precision import autocast_state, restore_autocast
from ..rng import get_rng, set_rng
from ..runtime import DeviceRuntime, Event, runtime_for

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreStrategy:
    """How T_DI and T_M are brought back for backward (MPMoE Table 2)."""

    name: str
    offload_tdi: bool  # False: re-dispatch ("comm.") when reused, or keep
    offload_tm: bool  # False: recompute when reused, or keep
    reuse: bool = True  # False only for "keep"

    @property
    def needs_host_copies(self) -> bool:
        return self.reuse and (self.offload_tdi or self.offload_tm)


RESTORE_STRATEGIES: dict[str, RestoreStrategy] = {
    "keep": RestoreStrategy("keep", False, False, reuse=False),
    "S1": RestoreStrategy("S1", True, True),
    "S2": RestoreStrategy("S2", False, True),
    "S3": RestoreStrategy("S3", True, False),
    "S4": RestoreStrategy("S4", False, False),
}


def restore_strategy(name: str | RestoreStrategy) -> RestoreStrategy:
    if isinstance(name, RestoreStrategy):
        return name
    if name not in RESTORE_STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(RESTORE_STRATEGIES)} (or 'auto'); got {name!r}")
    return RESTORE_STRATEGIES[name]


# ----------------------------------------------------------------------------------------------------------------
# Host copies: a side stream + pinned memory on CUDA, a background thread on CPU (overlap with compute, §3.3 Fig. 7)
# ----------------------------------------------------------------------------------------------------------------
class HostCopy:
    """One tensor copied to host memory, asynchronously; `get()` brings it back to its device.

    Runtimes with a side stream (CUDA, the simulation): device-to-host into page-locked memory on the copier's side
    stream, after the producer's work; back on the same stream (prefetched), waited for by the consumer's stream.
    Without one (inline, CPU): a clone on the copier's background thread."""

    def __init__(self, tensor: torch.Tensor, copier: "HostCopier"):
        self.rt = rt = runtime_for(tensor.device)
        self.copier = copier
        self._future: Future | None = None
        self._host: torch.Tensor | None = None
        self._done: Event | None = None
        self._back: torch.Tensor | None = None
        self._back_done: Event | None = None
        stream = copier.side_stream(rt)
        if stream is not None:
            rt.wait_stream(stream, rt.current_stream())  # the producer kernel must finish first
            self._host = rt.pinned_empty(tensor.shape, tensor.dtype, cached=True)
            rt.record_stream(tensor, stream)  # keep the device block alive until the copy has read it
            rt.copy_(self._host, tensor, stream)
            self._done = rt.record(stream)
        else:
            # NOTE: on CPU "device" and host are the same memory; the copy keeps the code path (and its overlap on a
            # background thread) identical to the CUDA one, it saves no RAM.
            self._future = copier.pool.submit(torch.Tensor.clone, tensor.detach())

    def prefetch(self) -> None:
        """Start the host-to-device copy early (backward of the next partition, §3.3 'prefetch')."""
        if self._host is None or self._back is not None:
            return
        rt = self.rt
        stream = self.copier.side_stream(rt)
        rt.wait_event(self._done, stream)
        self._back = rt.empty(self._host.shape, self._host.dtype, stream=stream)
        rt.copy_(self._back, self._host, stream)
        self._back_done = rt.record(stream)

    def get(self) -> torch.Tensor:
        if self._future is not None:
            return self._future.result()
        self.prefetch()
        rt = self.rt
        rt.wait_event(self._back_done)
        rt.record_stream(self._back, rt.current_stream())
        rt.access(self._back)
        return self._back


class HostCopier:
    """Owns the side stream (`DeviceRuntime.side_stream`: None inline) and the copy thread (CPU) of host offload."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._streams: dict[int, object] = {}

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpmoe-offload")
        return self._pool

    def side_stream(self, rt: DeviceRuntime):
        if id(rt) not in self._streams:
            self._streams[id(rt)] = rt.side_stream()
        return self._streams[id(rt)]

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        return HostCopy(tensor, self)


# ----------------------------------------------------------------------------------------------------------------
# What one partition saved, where it went
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class SavedBytes:
    """Bytes autograd saved for backward inside the partitions' hooks, by tensor kind and by fate.

    kind: "tdi" (expert inputs), "tm" (saved inside the experts: T_M), "tdo" (saved by the weighting: T_DO and the
    partition's combine weights).
    fate: "device" (kept on the compute device), "host" (offloaded), "dropped" (re-dispatched / recomputed).
    Each storage is counted once (ReLU's output is saved twice, by ReLU and by fc2, but occupies memory once).
    `max_partition` holds the largest single partition's T_DI / T_M+T_DO bytes: the working set that partitions share.
    """

    by: dict[tuple[str, str], int] = field(default_factory=dict)
    max_partition: dict[str, int] = field(default_factory=lambda: {"tdi": 0, "tm": 0, "tdo": 0})

    def add(self, kind: str, fate: str, nbytes: int) -> None:
        self.by[(kind, fate)] = self.by.get((kind, fate), 0) + nbytes

    def total(self, kind: str | None = None, fate: str | None = None) -> int:
        return sum(v for (k, f), v in self.by.items() if (kind is None or k == kind) and (fate is None or f == fate))


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class PartitionSaver:
    """saved_tensors_hooks for one partition: pack moves/drops T_DI and T_M/T_DO per strategy, unpack restores them.

    `redispatch()` rebuilds T_DI from the layer input (S2, S4: the "comm." column of Table 2); `recompute(tdi)`
    re-runs the partition's experts + weighting on a restored T_DI (S3, S4). The recompute pass records what autograd
    saves, in the same order as the first pass (like non-reentrant activation checkpointing), under the RNG state of
    the first pass so dropout masks match.
    """

    def __init__(
        self,
        strategy: RestoreStrategy,
        tdi: torch.Tensor,
        param_storages: set[int],
        redispatch: Callable[[], torch.Tensor],
        recompute: Callable[[torch.Tensor], None],
        copier: HostCopier,
        stats: SavedBytes,
    ):
        self.strategy = strategy
        self.tdi = tdi
        self.tdi_key = _storage_key(tdi)
        self.tdi_requires_grad = tdi.requires_grad
        self.tdi_device_type = tdi.device.type
        self.param_storages = param_storages
        self._redispatch = redispatch
        self._recompute = recompute
        self.copier = copier
        self.stats = stats
        self.rng_state = get_rng(tdi.device)
        self.autocast = autocast_state(tdi.device.type)  # re-entered by the re-dispatch and the recompute
        self.on_first_unpack: Callable[[], None] | None = None
        self._counted: dict[int, torch.Tensor] = {}  # holds the counted tensors until close(): no address reuse
        self._part_bytes = {"tdi": 0, "tm": 0, "tdo": 0}
        self.phase = "tm"  # the executor sets "tdo" around the weighting, for the accounting only
        self._tdi_host: HostCopy | None = None
        self._tdi_restored: torch.Tensor | None = None
        self._n_act = 0
        self._recorded: list[torch.Tensor] | None = None
        self._host_copies: list[HostCopy] = []
        self._unpacked = False

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def close(self) -> None:
        """End of the partition's forward: drop our own reference to T_DI (unless it is kept) and record sizes."""
        for kind in ("tdi", "tm", "tdo"):
            self.stats.max_partition[kind] = max(self.stats.max_partition[kind], self._part_bytes[kind])
        self._counted = {}
        if self.strategy.reuse:
            self.tdi = None

    def _count(self, t: torch.Tensor, kind: str, fate: str) -> None:
        key = _storage_key(t)
        if key in self._counted:
            return
        self._counted[key] = t
        nbytes = t.untyped_storage().nbytes()
        self.stats.add(kind, fate, nbytes)
        self._part_bytes[kind] += nbytes

    # --- pack: forward ---
    def pack(self, t: torch.Tensor):
        key = _storage_key(t)
        if key in self.param_storages or t.device.type == "meta":
            return ("raw", t)
        if key == self.tdi_key:
            meta = (t.storage_offset() - self.tdi.storage_offset(), tuple(t.shape), t.stride())
            if not self.strategy.reuse:
                self._count(t, "tdi", "device")
                return ("raw", t)
            if self.strategy.offload_tdi:
                self._count(t, "tdi", "host")
                if self._tdi_host is None:
                    self._tdi_host = self.copier.to_host(self.tdi)
                    self._host_copies.append(self._tdi_host)
            else:
                self._count(t, "tdi", "dropped")
            return ("tdi", meta)
        if not self.strategy.reuse:
            self._count(t, self.phase, "device")
            return ("raw", t)
        if self.strategy.offload_tm:
            self._count(t, self.phase, "host")
            copy = self.copier.to_host(t)
            self._host_copies.append(copy)
            return ("host", copy)
        self._count(t, self.phase, "dropped")
        self._n_act += 1
        return ("recompute", self._n_act - 1)

    # --- unpack: backward ---
    def prefetch(self) -> None:
        for copy in self._host_copies:
            copy.prefetch()

    def unpack(self, packed):
        if not self._unpacked:
            self._unpacked = True
            if self.on_first_unpack is not None:
                self.on_first_unpack()  # e.g. prefetch the previous partition's host copies
        kind, value = packed
        if kind == "raw":
            return value
        if kind == "host":
            return value.get()
        if kind == "tdi":
            base = self._restore_tdi()
            offset, shape, stride = value
            return base.as_strided(shape, stride, base.storage_offset() + offset)
        if self._recorded is None:
            self._run_recompute()
        return self._recorded[value]

    def _restore_tdi(self) -> torch.Tensor:
        if self._tdi_restored is None:
            with torch.no_grad(), restore_autocast(self.tdi_device_type, self.autocast):
                if self._tdi_host is not None:
                    self._tdi_restored = self._tdi_host.get()
                else:
                    self._tdi_restored = self._redispatch()
        return self._tdi_restored

    def _run_recompute(self) -> None:
        tdi = self._restore_tdi().detach().requires_grad_(self.tdi_requires_grad)
        recorded: list[torch.Tensor] = []
        tdi_key = _storage_key(tdi)

        def record(t: torch.Tensor):
            key = _storage_key(t)
            if key not in self.param_storages and key != tdi_key:
                recorded.append(t)
            return t

        devices = [tdi.device] if tdi.is_cuda else []
        hooks = torch.autograd.graph.saved_tensors_hooks(record, lambda t: t)
        autocast = restore_autocast(tdi.device.type, self.autocast)
        with torch.enable_grad(), torch.random.fork_rng(devices=devices), hooks, autocast:
            set_rng(tdi.device, self.rng_state)
            self._recompute(tdi)
        if len(recorded) != self._n_act:
            raise RuntimeError(
                f"recomputation saved {len(recorded)} tensors, the forward saved {self._n_act}: the experts are not "
                "deterministic in what they save; use strategy S1/S2 (offload T_M) for this experts module"
            )
        self._recorded = recorded


__all__ = ["RESTORE_STRATEGIES", "HostCopier", "PartitionSaver", "RestoreStrategy", "SavedBytes", "restore_strategy"]
