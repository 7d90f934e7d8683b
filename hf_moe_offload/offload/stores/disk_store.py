"""The disk tier: expert files behind a bounded host cache (ES-MoE §4.1, "Offloading experts to SSD").

This module is the cache's state machine (`_Entry`: LOADING, CACHED, WRITING, each expert owned by one thread at a
time) and the store interface over it; the files (format, checksums, directory lock, memory mapping) are
offload/stores/expert_files.py, and which record to evict is offload/stores/eviction.py.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from ...errors import ExpertStoreError
from ...runtime import HOST
from .disk_overlap import CACHED, LOADING, WRITING, DiskOverlap
from .eviction import EvictionPolicy
from .expert_files import DirectoryLock, ExpertFiles
from .quantized import ExpertQuantization
from .store import GRAD, PARAM, STATE_ROWS, ExpertKey, ExpertRecord, ExpertStore

logger = logging.getLogger(__name__)


class _Entry:
    """An expert of the disk tier that is not only on disk: its state, its record and the cache buffer it lies in.

    States (every transition under the store's lock; the I/O itself runs without it):
    - LOADING: one thread (the one that set it) reads rows of the file into the record: a new entry (claiming a
      cache buffer first), or rows an existing record lacks (its holders keep using the rows they have);
    - CACHED: the record is in the cache; `refs` > 0 while in use; `valid`: the rows of the record that are current;
      `dirty_rows`: those newer than the file;
    - WRITING: one thread (the one that set it, from CACHED with refs == 0) writes the dirty rows back to the file.
    An expert without an entry is on disk only and nobody is touching its file. Every other thread that needs an
    expert in LOADING or WRITING waits until it is CACHED or gone, so a file is never read while it is written, a
    record is never written back while it is in use, and a record's buffer is never reused while the record is
    read, written or held.
    """

    __slots__ = ("state", "index", "record", "refs", "valid", "dirty_rows")

    def __init__(self):
        self.state = LOADING
        self.index: int | None = None  # the record's buffer in the cache (`DiskExpertStore._buffers`)
        self.record: ExpertRecord | None = None
        self.refs = 0
        self.valid: set[int] = set()
        self.dirty_rows: set[int] = set()

    @property
    def dirty(self) -> bool:
        return bool(self.dirty_rows)


class DiskExpertStore(DiskOverlap, ExpertStore):
    """Expert files in `offload_dir` behind a host cache of `cache_experts` records.

    Reads go to preallocated (pinned) cache records with explicit `readinto`, ahead of use via `prefetch` (on the I/O
    threads, which also do the write-backs that make room); dirty rows are written back when evicted and on
    `flush()`. Only the rows a caller asks for are read and only changed rows are written: a forward reads
    an expert's weights, its backward adds the gradient (neither read nor zeroed when it is known to be zero: marked
    stale), its optimizer step reads the moments. Eviction follows the engine's schedule (`set_schedule`: forward in
    order, backward in reverse, then the next forward): the idle record needed furthest in the future goes (Belady's
    MIN), least recently used first among equals and without a schedule. Records in use (acquired) are never
    evicted; pinned ones only when nothing else can be. Each expert's state is owned by one thread at a time (see
    `_Entry`). Every file carries a checksum per row (XXH3-64), checked on every read. The directory is locked while
    the store is open (`DirectoryLock`); expert files left by a run that did not close its store are discarded with a
    warning (`owner=False`: a node-shared store's other ranks, which neither lock nor clean).
    """

    tier = "disk"
    wants_schedule = True
    stall_timeout = 60.0  # seconds a thread waits for room in the cache before it is declared too small
    # Row-level I/O and gradients known to be zero. A node-shared store (several processes, one set of files) turns
    # it off: which gradients are zero is known per process only, so it moves whole records.
    row_io = True

    def __init__(self, keys, numel, compute_dtype, stats, offload_dir: str, cache_experts: int, io_threads: int = 2,
                 owner: bool = True, state_rows: int = STATE_ROWS, row_dtype: torch.dtype = torch.float32,
                 quantization: ExpertQuantization | None = None):
        super().__init__(keys, numel, compute_dtype, stats, state_rows, row_dtype, quantization)
        row_dtype, row_numel = self.row_dtype, self.row_numel
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
        self.files = ExpertFiles(offload_dir, row_numel, state_rows, row_dtype, stats, self.row_io, len(self._keys))
        self._dir_lock = DirectoryLock(offload_dir) if owner else None
        if owner:
            self.files.discard_stale(killed=not self._dir_lock.previous_closed)
        self.cache_experts = cache_experts
        # The cache's records, each in a buffer of its own (an `_Entry`'s `index`).
        self._buffers = [torch.empty(state_rows, row_numel, dtype=row_dtype) for _ in range(cache_experts)]
        # One compute copy per cache record, allocated (and page-locked) once, not per read (quantized rows: none,
        # they are dequantized where they compute).
        self._compute_buffers = ([torch.empty(numel, dtype=compute_dtype) for _ in range(cache_experts)]
                               if compute_dtype != row_dtype and quantization is None else [None] * cache_experts)
        self._free = list(range(cache_experts))
        self._entries: OrderedDict[ExpertKey, _Entry] = OrderedDict()  # least recently used first
        self._pinned: set[ExpertKey] = set()
        # False: the gradient is zero and its row, in a cache record not `valid` or in the file, means nothing.
        self._grad_live: dict[ExpertKey, bool] = {k: False for k in self._keys}
        self.eviction = EvictionPolicy()
        self._lock = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="expert-io")

    def _dma_sources(self):
        return [c if c is not None else b[0] for b, c in zip(self._buffers, self._compute_buffers)]

    switches_compute_dtype = True

    def use_compute_dtype(self, dtype: torch.dtype) -> None:
        """`ExpertStore.switches_compute_dtype`: a copy buffer per cache record; cached records get theirs now."""
        with self._lock:
            self._check_compute_switch(dtype)
            if any(entry.refs or entry.state != CACHED for entry in self._entries.values()):
                raise RuntimeError("the disk tier's compute dtype changes only while no record is in use or in I/O")
            self.compute_dtype = dtype
            self._compute_buffers = [torch.empty(self.numel, dtype=dtype) for _ in range(self.cache_experts)]
            for entry in self._entries.values():  # cached records get their buffer's copy
                entry.record.compute = self._compute_buffers[entry.index]
                entry.record.compute.copy_(entry.record.param)

    def path(self, key: ExpertKey) -> str:
        """The file of `key`."""
        return self.files.path(key)

    def _rows(self, rows: Iterable[int] | None) -> set[int]:
        """The rows to have current: PARAM always (a record's compute copy mirrors it); every row without row I/O."""
        if rows is None or not self.row_io:
            return set(range(self.state_rows))
        return {r for r in rows if r < self.state_rows} | {PARAM}

    def _live(self, key: ExpertKey) -> bool:
        return self._grad_live[key] or not self.row_io

    # --- file I/O (called without the lock, by the thread that owns the expert's LOADING/WRITING state) ---
    def _write_file(self, key: ExpertKey, buffer: torch.Tensor, rows: list[int]) -> None:
        self.files.write(key, buffer, rows)

    def _read_file(self, key: ExpertKey, buffer: torch.Tensor, rows: list[int]) -> None:
        self.files.read(key, buffer, rows, trust_checked=self.eviction.decode is not None)

    def _fill_rows(self, key: ExpertKey, record_buffer: torch.Tensor, rows: set[int], grad_live: bool) -> bool:
        """Make `rows` of the record's buffer current: read them, except a zero gradient, which is neither read nor
        written: -> True when the caller must mark the record's gradient stale (it counts as zero; the next gradient is
        copied in, or the optimizer steps straight from autograd's: `ExpertRecord.grad_stale`)."""
        read = sorted(rows if grad_live else rows - {GRAD})
        if read:
            self._read_file(key, record_buffer, read)
        return GRAD in rows and not grad_live

    def set_schedule(self, keys):
        with self._lock:
            self.eviction.set_schedule(keys)

    def set_decode_cache(self, policy) -> None:
        """Evict by `policy` (a `DecodeCache`: decoding's frequency scores and per-layer budgets) instead of the
        schedule; None goes back to the schedule."""
        with self._lock:
            self.eviction.decode = policy

    # --- state transitions (lock held; may release it around I/O, see each) ---
    def _victim(self, evict_pinned: bool, for_key: ExpertKey | None = None,
                speculative: bool = False) -> ExpertKey | None:
        """The idle record to evict (offload/stores/eviction.py)."""
        idle = [k for k, e in self._entries.items() if e.state is CACHED and e.refs == 0]
        return self.eviction.victim(idle, self._entries, self._pinned, evict_pinned, for_key, speculative)

    def _claim_buffer(self, block: bool = True, for_key: ExpertKey | None = None,
                      give_way: Callable[[], bool] | None = None) -> int | None:
        """A free buffer of the cache (its index), evicting an idle record (written back first if dirty; the lock is
        released meanwhile). Non-blocking (speculative reads for `for_key`): never evicts a pinned record, nor one
        needed before `for_key`, and returns None when nothing is evictable. Blocking with `give_way`: returns None
        instead of waiting for room while `give_way()` says so (`acquire`)."""
        while True:
            if self._free:
                return self._free.pop()
            victim = self._victim(evict_pinned=block, for_key=for_key, speculative=not block)
            if victim is None:
                if not block or give_way is not None and give_way():
                    return None
                # Everything is in use, loading or writing. Loads and writes finish and the optimizer's workers
                # release what they step, so wait; only a cache smaller than what one step holds at once never does.
                if not self._lock.wait(timeout=self.stall_timeout):
                    raise ExpertStoreError(
                        f"the disk tier's host cache ({self.cache_experts} experts) is smaller than the experts in "
                        "flight; raise host_cache_experts/host_cache_bytes or lower prefetch_depth"
                    )
                continue
            entry = self._entries[victim]
            if entry.dirty:
                self._write_back(victim, entry)
                continue  # the lock was released: choose again (the victim is now clean unless taken meanwhile)
            del self._entries[victim]
            self.stats.evictions += 1
            return entry.index

    def _write_back(self, key: ExpertKey, entry: _Entry) -> None:
        """CACHED, idle and dirty -> WRITING -> CACHED and clean (or still dirty if the write failed: nothing lost).
        A gradient known to be zero is not written (its row in the file is never read)."""
        rows = entry.dirty_rows & entry.valid
        if not self._live(key):
            rows.discard(GRAD)
        if not self.row_io:
            rows = set(range(self.state_rows))
        entry.state = WRITING
        self._lock.release()
        written = False
        try:
            if rows:
                self._write_file(key, entry.record.buffer, sorted(rows))
            written = True
        finally:
            self._lock.acquire()
            entry.state = CACHED
            if written:
                entry.dirty_rows.clear()
            self._lock.notify_all()

    def _load(self, key: ExpertKey, entry: _Entry, rows: set[int], block: bool,
              give_way: Callable[[], bool] | None = None) -> bool:
        """Fill this thread's LOADING `entry`: claim a cache buffer, read `rows` of the file into it (lock released),
        -> CACHED. On failure, a speculative load finding nothing to evict or a blocking one giving way
        (`_claim_buffer`), the entry is removed (on disk only again)."""
        try:
            index = self._claim_buffer(block=block, for_key=key, give_way=give_way)
        except BaseException:
            self._abandon(key, entry, None)
            raise
        if index is None:
            self._abandon(key, entry, None)
            return False
        live = self._live(key)
        self._lock.release()
        try:
            # The buffer's last record may still be read by an upload: the engine releases it only after the copy.
            self.runtime.access(self._buffers[index][0], write=True, stream=HOST)
            stale = self._fill_rows(key, self._buffers[index], rows, live)
            record = self._new_record(key, self._buffers[index], self._compute_buffers[index])
            record.grad_stale = stale
        except BaseException:
            self._lock.acquire()
            self._abandon(key, entry, index)
            raise
        self._lock.acquire()
        entry.index, entry.record, entry.state, entry.valid = index, record, CACHED, set(rows)
        self._entries.move_to_end(key)
        self._lock.notify_all()
        return True

    def _add_rows(self, key: ExpertKey, entry: _Entry, rows: set[int]) -> None:
        """Read `rows` into the CACHED `entry`'s record (CACHED -> LOADING -> CACHED, lock released around the
        read). Its holders keep using the rows they have; nobody can evict it or write it back meanwhile."""
        entry.state = LOADING
        live = self._live(key)
        self._lock.release()
        done = False
        try:
            if self._fill_rows(key, entry.record.buffer, rows, live):
                entry.record.grad_stale = True  # its holders have not acquired the gradient: none of them reads it
            done = True
        finally:
            self._lock.acquire()
            entry.state = CACHED
            if done:
                entry.valid |= rows
            self._lock.notify_all()

    def _abandon(self, key: ExpertKey, entry: _Entry, index: int | None) -> None:
        del self._entries[key]
        if index is not None:
            self._free.append(index)
        self._lock.notify_all()

    def _background_load(self, key: ExpertKey, entry: _Entry, rows: set[int]) -> None:
        with self._lock:
            try:
                if entry.state is LOADING and entry.record is None:
                    self._load(key, entry, rows, block=False)
                elif self._entries.get(key) is entry and entry.state is CACHED and rows - entry.valid:
                    self._add_rows(key, entry, rows - entry.valid)
            except Exception as err:  # the acquire that needs it reads again and raises in the caller
                logger.debug("prefetch of expert %s failed: %s", key, err)

    def _write_back_idle(self, keys: Iterable[ExpertKey] | None, wait_in_use: bool) -> None:
        """Write back every dirty record among `keys` (all when None). In-use records are waited for
        (`wait_in_use`) or left dirty for a later write-back."""
        wanted = None if keys is None else set(keys)
        while True:
            dirty = [(k, e) for k, e in self._entries.items() if e.dirty and (wanted is None or k in wanted)]
            idle = [(k, e) for k, e in dirty if e.state is CACHED and e.refs == 0]
            if not dirty or (not idle and not wait_in_use):
                return
            if not idle:
                if not self._lock.wait(timeout=self.stall_timeout):
                    raise ExpertStoreError(
                        f"flush: experts {[k for k, _ in dirty][:4]} stayed in use for {self.stall_timeout:.0f} s; "
                        "synchronize the expert optimizer (engine.synchronize()) before flushing"
                    )
                continue
            for key, entry in idle:
                if self._entries.get(key) is entry and entry.state is CACHED and entry.refs == 0 and entry.dirty:
                    self._write_back(key, entry)

    # --- public interface ---
    def write_param(self, key, flat, reset_state=True):
        if not reset_state:
            return super().write_param(key, flat, reset_state)
        # Whole record replaced: no need to read the old file (lets a fresh store be filled without reading).
        with self._lock:
            while True:
                entry = self._entries.get(key)
                if entry is None:
                    entry = self._entries[key] = _Entry()
                    try:
                        index = self._claim_buffer()
                    except BaseException:
                        self._abandon(key, entry, None)
                        raise
                    record = self._new_record(key, self._buffers[index], self._compute_buffers[index])
                    entry.index, entry.record, entry.state = index, record, CACHED
                    break
                if entry.state is CACHED:
                    break
                self._lock.wait()
            entry.refs += 1
            entry.valid = set(range(self.state_rows))
            self._entries.move_to_end(key)
            record = entry.record
        try:
            self.note_host_write(record)
            record.buffer.zero_()
            record.grad_stale = False
            record.set_weights(flat)
            record.refresh_compute()
            self.steps[key] = 0
            self.has_grad[key] = False
        finally:
            self.release(key, dirty=True, grad_zeroed=True)

    def acquire(self, key, rows=None, give_way: Callable[[], bool] | None = None):
        """`ExpertStore.acquire`; `give_way()`, asked while waiting for room (again at each `wake_waiters()`): True
        returns None, so that the caller first frees records (optim/store_steps.py, ES-MoE §4.1)."""
        want = self._rows(rows)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.state is CACHED:
                self.stats.cache_hits += 1
            else:
                self.stats.cache_misses += 1
            while True:
                entry = self._entries.get(key)
                if entry is None:
                    entry = self._entries[key] = _Entry()
                    if not self._load(key, entry, want, block=True, give_way=give_way):
                        return None
                elif entry.state is CACHED:
                    missing = want - entry.valid
                    if missing:
                        self._add_rows(key, entry, missing)
                        continue
                    entry.refs += 1
                    # The schedule moves on once the record is held: advanced before a wait for its load, the
                    # loaded record would sit idle with its next use a step away, the first victim of a prefetch
                    # (read twice per sweep at small caches)
                    self.eviction.advance(key)
                    self._entries.move_to_end(key)
                    return entry.record
                else:
                    self._lock.wait()  # another thread owns it (loading or writing back)

    def wake_waiters(self) -> None:
        """Threads waiting for room in `acquire` ask their `give_way` again."""
        with self._lock:
            self._lock.notify_all()

    def try_acquire(self, key, rows=None):
        want = self._rows(rows)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.state is not CACHED or want - entry.valid:
                return None
            entry.refs += 1
            self._entries.move_to_end(key)
            return entry.record

    def require(self, key, rows=None):
        want = self._rows(rows)
        with self._lock:
            while True:
                entry = self._entries.get(key)
                if entry is None or entry.refs <= 0:
                    raise ExpertStoreError(f"require({key}): the caller must hold the expert (acquire it first)")
                if entry.state is CACHED:
                    missing = want - entry.valid
                    if not missing:
                        return
                    self._add_rows(key, entry, missing)
                else:
                    self._lock.wait()

    def release(self, key, dirty=False, grad_zeroed=False):
        with self._lock:
            entry = self._entries[key]
            if entry.refs <= 0:
                raise ExpertStoreError(f"expert {key} released more often than acquired")
            entry.refs -= 1
            if dirty is not False:
                rows = set(entry.valid) if dirty is True or not self.row_io else set(dirty)
                if not rows <= entry.valid:
                    raise ExpertStoreError(f"expert {key}: rows {sorted(rows - entry.valid)} released dirty but "
                                           "never acquired")
                entry.dirty_rows |= rows
                if GRAD in rows:
                    self._grad_live[key] = True
            if grad_zeroed and self.row_io:
                self._grad_live[key] = False
                entry.dirty_rows.discard(GRAD)
            self._lock.notify_all()

    def clear_grad(self, key):
        if not self.row_io:
            return super().clear_grad(key)
        with self._lock:
            while True:
                entry = self._entries.get(key)
                if entry is None or entry.state is CACHED:
                    break
                self._lock.wait()
            self._grad_live[key] = False
            if entry is not None:
                entry.dirty_rows.discard(GRAD)
                if entry.refs == 0:
                    entry.valid.discard(GRAD)  # marked stale when next needed
                elif GRAD in entry.valid:
                    entry.record.clear_grad(lazy=True)

    def prefetch(self, keys, rows=None):
        want = self._rows(rows)
        with self._lock:
            for key in keys:
                if self.eviction.decode is not None:
                    self.eviction.decode.expect(key)
                entry = self._entries.get(key)
                if entry is None:
                    entry = self._entries[key] = _Entry()
                    self._pool.submit(self._background_load, key, entry, want)
                elif entry.state is CACHED and want - entry.valid:
                    self._pool.submit(self._background_load, key, entry, want)

    def set_pinned(self, keys):
        # The engine leaves room for the records in flight (OffloadEngine.pin_limit); should every cache record be
        # pinned, pinned records are still evicted, last.
        with self._lock:
            self._pinned = set(keys)

    def flush(self):
        with self._lock:
            self._write_back_idle(None, wait_in_use=True)

    def close(self):
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)
            self.files.close()
            if self._dir_lock is not None:
                self._dir_lock.release()

    def resident_keys(self) -> list[ExpertKey]:
        with self._lock:
            return [k for k, e in self._entries.items() if e.state is CACHED]

    def dirty_keys(self) -> list[ExpertKey]:
        """Experts whose cached record is newer than their file."""
        with self._lock:
            return [k for k, e in self._entries.items() if e.dirty]



__all__ = ["DiskExpertStore"]
