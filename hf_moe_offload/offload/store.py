"""The expert store: fp32 master weights, gradients and Adam moments of every expert, outside the device.

ES-MoE §4.1: expert state lives in host memory (the `host` tier) or in files with a bounded host cache (the `disk`
tier, "Offloading experts to SSD"); only experts in flight (and pinned ones, §4.3) are on the device.

Every expert is one `ExpertRecord`: a (4, P) fp32 buffer whose rows are [param | grad | exp_avg | exp_avg_sq], so one
expert is one contiguous block in memory and one file on disk, read and written with single calls. Callers see a
small interface: `acquire(key)` (blocks until the record is in host memory and keeps it there), `release(key, dirty)`,
`prefetch(keys)` (the engine knows the forward and reverse-backward order, so reads are issued ahead, never
page-fault driven), `flush()`, and the `Mapping`-like `keys()` / `read_param(key)` / `write_param(key, ...)`.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .telemetry import OffloadStats

logger = logging.getLogger(__name__)

ExpertKey = tuple[int, int]  # (MoE layer index, expert index)
SLOTS = ("param", "grad", "exp_avg", "exp_avg_sq")


class ExpertStoreError(RuntimeError):
    """Base class of the store's errors; the message says what to do."""


class ExpertStoreFullError(ExpertStoreError):
    pass


class CorruptExpertFileError(ExpertStoreError):
    pass


def _pin(t: torch.Tensor) -> torch.Tensor:
    # Pinned host memory makes H2D copies asynchronous; it only exists with an accelerator.
    return t.pin_memory() if torch.cuda.is_available() else t


class ExpertRecord:
    """One expert's state. `buffer` is (4, P) fp32; `compute` is the low-precision copy used for compute, if any."""

    __slots__ = ("key", "buffer", "param", "grad", "exp_avg", "exp_avg_sq", "compute", "version")

    def __init__(self, key: ExpertKey, buffer: torch.Tensor, compute_dtype: torch.dtype):
        self.key = key
        self.bind(buffer, compute_dtype)
        self.version = 0  # bumped by every optimizer update; device copies compare it

    def bind(self, buffer: torch.Tensor, compute_dtype: torch.dtype) -> None:
        self.buffer = buffer
        self.param, self.grad, self.exp_avg, self.exp_avg_sq = buffer.unbind(0)
        self.compute = None
        if compute_dtype != torch.float32:
            self.compute = _pin(torch.empty(buffer.shape[1], dtype=compute_dtype))
            self.compute.copy_(self.param)

    def compute_param(self) -> torch.Tensor:
        return self.param if self.compute is None else self.compute

    def refresh_compute(self) -> None:
        """Keep the low-precision copy current after an update (ES-MoE mixed precision: fp32 master)."""
        if self.compute is not None:
            self.compute.copy_(self.param)
        self.version += 1


class ExpertStore:
    """Interface shared by the tiers; see the module docstring."""

    tier = "?"

    def __init__(self, keys: Iterable[ExpertKey], numel: int, compute_dtype: torch.dtype, stats: OffloadStats):
        self._keys = list(keys)
        self.numel = numel
        self.compute_dtype = compute_dtype
        self.stats = stats
        self.steps: dict[ExpertKey, int] = {k: 0 for k in self._keys}  # Adam step count per expert
        self.has_grad: dict[ExpertKey, bool] = {k: False for k in self._keys}

    # Mapping-like view
    def keys(self) -> list[ExpertKey]:
        return list(self._keys)

    def __iter__(self) -> Iterator[ExpertKey]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key) -> bool:
        return key in self.steps

    def record_bytes(self) -> int:
        return 4 * self.numel * 4

    def read_param(self, key: ExpertKey) -> torch.Tensor:
        """A copy of the fp32 master weights of `key`."""
        record = self.acquire(key)
        try:
            return record.param.clone()
        finally:
            self.release(key)

    def write_param(self, key: ExpertKey, flat: torch.Tensor, reset_state: bool = True) -> None:
        record = self.acquire(key)
        try:
            record.param.copy_(flat)
            if reset_state:
                record.buffer[1:].zero_()
                self.steps[key] = 0
                self.has_grad[key] = False
            record.refresh_compute()
        finally:
            self.release(key, dirty=True)

    def _new_record(self, key: ExpertKey, buffer: torch.Tensor) -> ExpertRecord:
        """The record object over `buffer` (a subclass may return its own record type, e.g. a node-shared one)."""
        return ExpertRecord(key, buffer, self.compute_dtype)

    # To implement per tier
    def acquire(self, key: ExpertKey) -> ExpertRecord:
        raise NotImplementedError

    def release(self, key: ExpertKey, dirty: bool = False) -> None:
        raise NotImplementedError

    def prefetch(self, keys: Iterable[ExpertKey]) -> None:
        """Start bringing `keys` into host memory in this order (no-op where they already are)."""

    def set_pinned(self, keys: Iterable[ExpertKey]) -> None:
        """ES-MoE §4.3: keep these resident in host memory (disk tier's cache)."""

    def flush(self) -> None:
        """Write every dirty record back to its backing storage."""

    def close(self) -> None:
        self.flush()


class HostExpertStore(ExpertStore):
    """All experts in (pinned, when CUDA exists) host memory, one (4, P) buffer per expert.

    NOTE: separate allocations, not views of one big tensor: views share autograd's version counter, and an expert
    updated by the optimizer while another expert's backward recomputes would trip autograd's in-place check.
    """

    tier = "host"

    def __init__(self, keys, numel, compute_dtype, stats):
        super().__init__(keys, numel, compute_dtype, stats)
        self._records = {k: ExpertRecord(k, _pin(torch.zeros(4, numel)), compute_dtype) for k in self._keys}

    def acquire(self, key):
        self.stats.cache_hits += 1
        return self._records[key]

    def release(self, key, dirty=False):
        pass


class DiskExpertStore(ExpertStore):
    """Expert files in `offload_dir` behind an LRU host cache of `cache_experts` records.

    Reads go to preallocated (pinned) cache slots with explicit `readinto`, ahead of use via `prefetch`; dirty records
    are written back when evicted and on `flush()`. Records in use (acquired) or pinned are never evicted.
    """

    tier = "disk"

    def __init__(self, keys, numel, compute_dtype, stats, offload_dir: str, cache_experts: int, io_threads: int = 2):
        super().__init__(keys, numel, compute_dtype, stats)
        if cache_experts < 1:
            raise ExpertStoreError(
                f"the disk tier's host cache holds {cache_experts} experts; it needs at least 1 (one expert's state "
                f"is {self.record_bytes()} bytes): raise host_cache_bytes/host_cache_experts"
            )
        self.dir = offload_dir
        try:
            os.makedirs(offload_dir, exist_ok=True)
            # Per process: several ranks may open one (node-shared) offload_dir at once (hf_moe_offload.distributed).
            probe = os.path.join(offload_dir, f".write_test{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"0")
            os.remove(probe)
        except OSError as err:
            raise ExpertStoreError(
                f"offload_dir {offload_dir!r} is not writable ({err.strerror}); choose a writable directory"
            ) from err
        self.cache_experts = cache_experts
        self._slots = [_pin(torch.empty(4, numel)) for _ in range(cache_experts)]
        self._free = list(range(cache_experts))
        self._cache: OrderedDict[ExpertKey, tuple[ExpertRecord, int]] = OrderedDict()  # key -> (record, slot)
        self._loading: dict[ExpertKey, Future] = {}
        self._refs: dict[ExpertKey, int] = {}
        self._dirty: set[ExpertKey] = set()
        self._pinned: set[ExpertKey] = set()
        self._writing: set[ExpertKey] = set()  # evicted records being written back (not readable yet)
        self._lock = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="expert-io")

    def path(self, key: ExpertKey) -> str:
        return os.path.join(self.dir, f"layer{key[0]:03d}_expert{key[1]:05d}.bin")

    # --- file I/O (called without the lock) ---
    def _write_file(self, key: ExpertKey, buffer: torch.Tensor) -> None:
        path = self.path(key)
        try:
            with open(path, "wb") as f:
                f.write(memoryview(buffer.numpy()).cast("B"))
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise ExpertStoreFullError(
                    f"disk full while writing expert {key} to {path}: free space in {self.dir!r} or move offload_dir; "
                    f"the tier needs {len(self._keys) * self.record_bytes()} bytes. Saved checkpoints are not affected."
                ) from err
            raise ExpertStoreError(f"could not write expert file {path}: {err}") from err
        self.stats.disk_write_bytes += buffer.numel() * 4

    def _read_file(self, key: ExpertKey, buffer: torch.Tensor) -> None:
        path = self.path(key)
        want = buffer.numel() * 4
        try:
            with open(path, "rb", buffering=0) as f:
                got = f.readinto(memoryview(buffer.numpy()).cast("B"))
        except FileNotFoundError as err:
            raise CorruptExpertFileError(f"expert file {path} is missing; the offload directory was modified") from err
        if got != want:
            raise CorruptExpertFileError(
                f"expert file {path} is truncated ({got} of {want} bytes); the offload directory is corrupt: "
                "reload the model from its last saved checkpoint"
            )
        self.stats.disk_read_bytes += want

    # --- cache management (lock held) ---
    def _take_slot(self) -> int:
        """A free cache slot, evicting the least recently used evictable record (writing it back if dirty)."""
        while True:
            if self._free:
                return self._free.pop()
            victim = next(
                (k for k in self._cache if self._refs.get(k, 0) == 0 and k not in self._pinned and k not in self._loading),
                None,
            )
            if victim is None:
                victim = next((k for k in self._cache if self._refs.get(k, 0) == 0 and k not in self._loading), None)
            if victim is None:
                # Everything is in use or still loading. Loads finish and the optimizer's workers release what they
                # step, so wait; only a cache smaller than the experts one thread holds at once can never progress.
                if not self._lock.wait(timeout=60.0):
                    raise ExpertStoreError(
                        f"the disk tier's host cache ({self.cache_experts} experts) is smaller than the experts in "
                        "flight; raise host_cache_experts/host_cache_bytes or lower prefetch_depth"
                    )
                continue
            record, slot = self._cache.pop(victim)
            if victim in self._dirty:
                self._dirty.discard(victim)
                self._writing.add(victim)
                self._lock.release()
                try:
                    self._write_file(victim, record.buffer)
                finally:
                    self._lock.acquire()
                    self._writing.discard(victim)
                    self._lock.notify_all()
            self.stats.evictions += 1
            return slot

    def _load(self, key: ExpertKey, slot: int) -> None:
        buffer = self._slots[slot]
        try:
            self._read_file(key, buffer)
            record = self._new_record(key, buffer)
        except BaseException:
            with self._lock:
                self._free.append(slot)
                self._loading.pop(key, None)
                self._lock.notify_all()
            raise
        with self._lock:
            self._cache[key] = (record, slot)
            self._loading.pop(key, None)
            self._lock.notify_all()

    def _start_load(self, key: ExpertKey, background: bool) -> Future | None:
        """Lock held. Starts loading `key` unless resident or loading; returns the future if background."""
        while key in self._writing:  # its write-back must land before the file is read again
            self._lock.wait()
        if key in self._cache or key in self._loading:
            return self._loading.get(key)
        slot = self._take_slot()
        if key in self._cache or key in self._loading:  # loaded meanwhile (lock was released while writing back)
            self._free.append(slot)
            return self._loading.get(key)
        fut: Future = Future() if not background else None
        if background:
            fut = self._pool.submit(self._load, key, slot)
        self._loading[key] = fut
        if not background:
            self._lock.release()
            try:
                self._load(key, slot)
                fut.set_result(None)
            except BaseException as err:
                fut.set_exception(err)
                raise
            finally:
                self._lock.acquire()
        return fut

    # --- public interface ---
    def write_param(self, key, flat, reset_state=True):
        if not reset_state:
            return super().write_param(key, flat, reset_state)
        # Whole record replaced: no need to read the old file (lets a fresh store be filled without reading).
        with self._lock:
            while key in self._loading or key in self._writing:
                self._lock.wait()
            if key not in self._cache:
                slot = self._take_slot()
                self._cache[key] = (self._new_record(key, self._slots[slot]), slot)
            record = self._cache[key][0]
            self._refs[key] = self._refs.get(key, 0) + 1
        try:
            record.buffer.zero_()
            record.param.copy_(flat)
            record.refresh_compute()
            self.steps[key] = 0
            self.has_grad[key] = False
        finally:
            self.release(key, dirty=True)

    def acquire(self, key):
        with self._lock:
            if key in self._cache:
                self.stats.cache_hits += 1
            else:
                self.stats.cache_misses += 1
            while key not in self._cache:
                fut = self._loading.get(key)
                if fut is None:
                    self._start_load(key, background=False)
                else:
                    self._lock.release()
                    try:
                        fut.result()
                    finally:
                        self._lock.acquire()
            self._cache.move_to_end(key)
            self._refs[key] = self._refs.get(key, 0) + 1
            return self._cache[key][0]

    def release(self, key, dirty=False):
        with self._lock:
            self._refs[key] -= 1
            if dirty:
                self._dirty.add(key)
            self._lock.notify_all()

    def prefetch(self, keys):
        with self._lock:
            for key in keys:
                if key in self._cache or key in self._loading:
                    continue
                evictable = self._free or any(
                    self._refs.get(k, 0) == 0 and k not in self._pinned and k not in self._loading for k in self._cache
                )
                if not evictable:
                    return  # never evict pinned or in-use experts for a speculative read
                self._start_load(key, background=True)

    def set_pinned(self, keys):
        keys = list(keys)[: max(0, self.cache_experts - 2)]  # keep room for the experts in flight
        with self._lock:
            self._pinned = set(keys)

    def flush(self):
        with self._lock:
            for fut in list(self._loading.values()):
                if fut is not None:
                    self._lock.release()
                    try:
                        fut.result()
                    finally:
                        self._lock.acquire()
            dirty = [(k, self._cache[k][0]) for k in list(self._dirty) if k in self._cache]
            self._dirty.clear()
        for key, record in dirty:
            self._write_file(key, record.buffer)

    def close(self):
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)

    def resident_keys(self) -> list[ExpertKey]:
        with self._lock:
            return list(self._cache)


__all__ = [
    "ExpertKey",
    "ExpertRecord",
    "ExpertStore",
    "HostExpertStore",
    "DiskExpertStore",
    "ExpertStoreError",
    "ExpertStoreFullError",
    "CorruptExpertFileError",
]
