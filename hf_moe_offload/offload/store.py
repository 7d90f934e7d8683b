"""The expert store: fp32 master weights, gradients and Adam moments of every expert, outside the device.

ES-MoE §4.1: expert state lives in host memory (the `host` tier) or in files with a bounded host cache (the `disk`
tier, "Offloading experts to SSD"); only experts in flight (and pinned ones, §4.3) are on the device.

Every expert is one `ExpertRecord`: a (4, P) fp32 buffer whose rows are [param | grad | exp_avg | exp_avg_sq], so one
expert is one contiguous block in memory and one file on disk. Callers see a small interface: `acquire(key, rows)`
(blocks until those rows of the record are in host memory and keeps it there), `release(key, dirty, grad_zeroed)`,
`prefetch(keys, rows)` (the engine knows the forward and reverse-backward order, so reads are issued ahead, never
page-fault driven), `set_schedule(keys)` (that order, for the disk tier's eviction), `flush()`, and the
`Mapping`-like `keys()` / `read_param(key)` / `write_param(key, ...)`.

Each phase asks only for the rows it uses (issue 14): forward the weights, backward the weights and the gradient (and
the moments where the optimizer steps the expert in that backward), the expert's optimizer step all four. The disk
tier reads and writes just those rows, never reads a gradient that is known to be zero (`release(...,
grad_zeroed=True)` / `clear_grad`) and never writes one back.

While the engine decodes (`set_decode_cache`), the disk tier evicts by decoding's scores instead of the schedule
(offload/inference.py), and a row whose checksum a read already matched since it was written is not checked again.
Where the experts compute on the CPU, a forward (decoding, or training's) can use an expert that is not cached
straight from its memory-mapped file (`map_weights`): the page cache is then the host's cache and nothing is copied;
the I/O threads meanwhile write back what the backward would evict (`write_behind`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import math
import mmap
import os
import re
import struct
import sys
import threading
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from ..errors import ExpertStoreError
from ..runtime import HOST, DeviceRuntime, InlineRuntime
from .telemetry import OffloadStats

logger = logging.getLogger(__name__)

ExpertKey = tuple[int, int]  # (MoE layer index, expert index)
SLOTS = ("param", "grad", "exp_avg", "exp_avg_sq")


def _libc_madvise():
    """madvise(2) where libc exports it (Linux), else None (`DiskExpertStore.unmap_weights` is then a no-op)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_madvise = _libc_madvise()
_MADV_DONTNEED = 4

STATE_ROWS = 4  # rows of a trainable expert's record: param, grad, exp_avg, exp_avg_sq
PARAM, GRAD, EXP_AVG, EXP_AVG_SQ = range(STATE_ROWS)
WEIGHTS = (PARAM,)  # what a forward reads
WEIGHTS_AND_GRAD = (PARAM, GRAD)  # what a backward reads (and adds its gradient to)


class ExpertStoreFullError(ExpertStoreError):
    pass


class CorruptExpertFileError(ExpertStoreError):
    pass


class ExpertRecord:
    """One expert's state. `buffer` is (4, P) fp32, or (1, P) weights only, in fp32 or the model's dtype (a
    weights-only store of a bf16 model keeps bf16: there is no master to keep); `compute` is the low-precision copy
    used for compute, if the buffer is not already in the compute dtype.

    `version` counts the updates of this expert (it lives in the store, so it survives an eviction from the disk
    tier's cache): a device copy made at version v is current while the version is still v.

    `grad_stale`: the gradient row holds an old gradient that counts as zero (issue 14: the optimizer step does not
    zero it in a separate pass; the next gradient is copied in instead of added). Read the gradient through
    `current_grad()`, add to it through `add_grad()`.
    """

    __slots__ = ("key", "buffer", "param", "grad", "exp_avg", "exp_avg_sq", "compute", "grad_stale", "_versions",
                 "_split")

    def __init__(self, key: ExpertKey, buffer: torch.Tensor, compute_dtype: torch.dtype,
                 versions: dict[ExpertKey, int] | None = None, compute: torch.Tensor | None = None):
        self.key = key
        self._versions = versions if versions is not None else {key: 0}
        self.buffer = buffer
        rows = buffer.unbind(0)
        self.param = rows[0]
        # A weights-only record (frozen experts, `OffloadConfig(train_experts=False)`) has no training state.
        self.grad, self.exp_avg, self.exp_avg_sq = rows[1:] if len(rows) == STATE_ROWS else (None, None, None)
        self.grad_stale = False
        self._split = None
        self.compute = None
        if compute_dtype != buffer.dtype:
            # The disk tier passes its cache slot's compute buffer: nothing is allocated (or pinned) per read.
            self.compute = compute if compute is not None else torch.empty(buffer.shape[1], dtype=compute_dtype)
            self.compute.copy_(self.param)

    @property
    def version(self) -> int:
        return self._versions[self.key]

    @version.setter
    def version(self, value: int) -> None:
        self._versions[self.key] = value

    def compute_param(self) -> torch.Tensor:
        """What is copied to the device: the low-precision copy, or the fp32 weights (the DMA source)."""
        return self.param if self.compute is None else self.compute

    def add_grad(self, g: torch.Tensor) -> None:
        """Accumulate `g` (flat) into the fp32 gradient."""
        if self.grad_stale:
            self.grad.copy_(g)
            self.grad_stale = False
        else:
            self.grad.add_(g)

    def add_grad_parts(self, parts: list[torch.Tensor], views: Callable[[torch.Tensor], list[torch.Tensor]]) -> None:
        """`add_grad` of a gradient given per tensor, `views` splitting the flat row the same way (no flat copy)."""
        for dst, g in zip(views(self.grad), parts):
            if self.grad_stale:
                dst.copy_(g)
            else:
                dst.add_(g)
        self.grad_stale = False

    def state_tensors(self, views: Callable[[torch.Tensor], list[torch.Tensor]]) -> tuple[list[torch.Tensor], ...]:
        """(weights, exp_avg, exp_avg_sq), each split per tensor by `views` (the layout's): made once per record,
        as the optimizer steps per tensor every step."""
        if self._split is None or self._split[0] != views:  # (a bound method: equal, not identical)
            self._split = (views, (views(self.param), views(self.exp_avg), views(self.exp_avg_sq)))
        return self._split[1]

    def current_grad(self) -> torch.Tensor:
        """The accumulated gradient (a stale one is zeroed first)."""
        if self.grad_stale:
            self.grad.zero_()
            self.grad_stale = False
        return self.grad

    def clear_grad(self, lazy: bool) -> None:
        """The gradient is zero from now on: marked stale (`lazy`, no pass over it) or zeroed."""
        if lazy:
            self.grad_stale = True
        else:
            self.grad.zero_()
            self.grad_stale = False

    def refresh_compute(self, copied: bool = False) -> None:
        """Keep the low-precision copy current after an update (ES-MoE mixed precision: fp32 master); `copied`: the
        update wrote it already (optim/fused_adam.py), only the version moves."""
        if self.compute is not None and not copied:
            self.compute.copy_(self.param)
        self.version += 1


class ExpertStore:
    """Interface shared by the tiers; see the module docstring."""

    tier = "?"
    wants_schedule = False  # whether `set_schedule` is used (the engine builds the schedule only then)
    # Whether a cleared gradient may be left stale (`ExpertRecord.clear_grad(lazy=True)`). Node-shared stores say
    # no: the flag is per process, the gradient row is shared with the other ranks.
    lazy_grad_zero = True

    def __init__(self, keys: Iterable[ExpertKey], numel: int, compute_dtype: torch.dtype, stats: OffloadStats,
                 state_rows: int = STATE_ROWS, row_dtype: torch.dtype = torch.float32):
        if state_rows not in (1, STATE_ROWS):
            raise ValueError(f"state_rows must be 1 (weights only) or {STATE_ROWS}, got {state_rows}")
        if row_dtype != torch.float32 and state_rows != 1:
            raise ValueError("only a weights-only store (state_rows=1) keeps its rows in another dtype than fp32: "
                             "training needs fp32 masters, gradients and moments")
        self.row_dtype = row_dtype
        self._keys = list(keys)
        self.numel = numel
        self.state_rows = state_rows  # 4: [param | grad | exp_avg | exp_avg_sq]; 1: weights only (frozen experts)
        self.compute_dtype = compute_dtype
        self.stats = stats
        self.steps: dict[ExpertKey, int] = {k: 0 for k in self._keys}  # Adam step count per expert
        self.has_grad: dict[ExpertKey, bool] = {k: False for k in self._keys}
        self.versions: dict[ExpertKey, int] = {k: 0 for k in self._keys}  # see ExpertRecord.version
        self.runtime = InlineRuntime()  # set by the engine when it binds to its device (bind_runtime)

    # Mapping-like view
    def keys(self) -> list[ExpertKey]:
        return list(self._keys)

    def __iter__(self) -> Iterator[ExpertKey]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key) -> bool:
        return key in self.steps

    @property
    def trainable(self) -> bool:
        return self.state_rows == STATE_ROWS

    def record_bytes(self) -> int:
        return self.state_rows * self.numel * self.row_dtype.itemsize

    def read_param(self, key: ExpertKey) -> torch.Tensor:
        """A copy of the weights of `key`, in fp32."""
        record = self.acquire(key, WEIGHTS)
        try:
            return record.param.to(torch.float32, copy=True)
        finally:
            self.release(key)

    def write_param(self, key: ExpertKey, flat: torch.Tensor, reset_state: bool = True) -> None:
        record = self.acquire(key, None if reset_state else WEIGHTS)
        try:
            self.note_host_write(record)
            record.param.copy_(flat)
            if reset_state:
                record.buffer[1:].zero_()
                record.grad_stale = False
                self.steps[key] = 0
                self.has_grad[key] = False
            record.refresh_compute()
        finally:
            self.release(key, dirty=True, grad_zeroed=reset_state)

    def copy_experts_from(self, other: "ExpertStore") -> None:
        """Every expert's record (weights, gradient, moments), step count and gradient flag from `other`, a store
        of the same experts (moving between a private and a node-shared store: hf_moe_offload.distributed)."""
        for key in other.keys():
            src = other.acquire(key)
            try:
                src.current_grad()  # a stale gradient is zero: copied as such
                self.write_param(key, src.param)
                dst = self.acquire(key)
                try:
                    dst.buffer.copy_(src.buffer)
                    dst.refresh_compute()
                finally:
                    self.release(key, dirty=True)
                self.steps[key] = other.steps[key]
                self.has_grad[key] = other.has_grad[key]
            finally:
                other.release(key)

    def reset_optimizer_state(self) -> None:
        """Every expert's Adam state afresh (moments zero, step count 0), its weights kept: what a new
        `torch.optim.AdamW` over resident experts starts from. Gradients are left as they are."""
        for key in self.keys():
            record = self.acquire(key)
            try:
                record.exp_avg.zero_()
                record.exp_avg_sq.zero_()
            finally:
                self.release(key, dirty=(EXP_AVG, EXP_AVG_SQ))
            self.steps[key] = 0

    def clear_grad(self, key: ExpertKey) -> None:
        """Zero `key`'s accumulated gradient (the disk tier does it without I/O)."""
        record = self.acquire(key, WEIGHTS_AND_GRAD)
        try:
            if record.grad is not None:
                record.clear_grad(self.lazy_grad_zero)
        finally:
            self.release(key, dirty=True, grad_zeroed=True)

    def _new_record(self, key: ExpertKey, buffer: torch.Tensor, compute: torch.Tensor | None = None) -> ExpertRecord:
        """The record object over `buffer` (a subclass may return its own record type, e.g. a node-shared one)."""
        return ExpertRecord(key, buffer, self.compute_dtype, self.versions, compute)

    def bind_runtime(self, runtime: DeviceRuntime) -> None:
        """The engine computes on `runtime`'s device: page-lock what its uploads read (the DMA sources only: the
        compute copy, or the fp32 weight row; never the gradient and moments)."""
        self.runtime = runtime
        for source in self._dma_sources():
            runtime.pin_(source)

    def _dma_sources(self) -> list[torch.Tensor]:
        return []

    # Whether the tier has `use_compute_dtype(dtype)`: stream copies in `dtype` from now on, each record getting a
    # compute copy made from its weights (issue 35: under autocast on a device the uploads carry the autocast dtype by
    # default). Called before the engine binds (`bind_runtime` page-locks the DMA sources), only on a store without
    # compute copies. The node-shared stores cannot: their ranks share the weights but would each own the copies.
    switches_compute_dtype = False

    def _check_compute_switch(self, dtype: torch.dtype) -> None:
        if self.compute_dtype != self.row_dtype:
            raise RuntimeError(f"the store already streams {self.compute_dtype} copies (asked for {dtype})")

    def note_host_write(self, record: ExpertRecord) -> None:
        """About to write `record`'s weights on the host (an update, a load): declared to the runtime, which checks
        (in simulation) that no upload still reads them."""
        self.runtime.access(record.compute_param(), write=True, stream=HOST)

    # To implement per tier
    def acquire(self, key: ExpertKey, rows: Iterable[int] | None = None) -> ExpertRecord:
        """`key`'s record, held until `release`, with at least `rows` (row indices, PARAM always; None: all) current.
        Other rows of a disk-tier record may hold anything: read only what you asked for."""
        raise NotImplementedError

    def require(self, key: ExpertKey, rows: Iterable[int] | None = None) -> None:
        """The caller holds `key`: make `rows` (None: all) current in its record too (e.g. the moments, for a step
        of an expert the backward acquired with its weights and gradient)."""

    def release(self, key: ExpertKey, dirty: bool | Iterable[int] = False, grad_zeroed: bool = False) -> None:
        """Hand `key` back. `dirty`: True (every row held may have changed) or the rows the caller changed;
        `grad_zeroed`: the caller zeroed the gradient (the disk tier then neither writes nor reads it again until a
        new gradient is added)."""
        raise NotImplementedError

    def prefetch(self, keys: Iterable[ExpertKey], rows: Iterable[int] | None = None) -> None:
        """Start bringing `rows` (None: all) of `keys` into host memory in this order (no-op where they already
        are)."""

    def set_schedule(self, keys: list[ExpertKey]) -> None:
        """The order in which the engine will acquire experts from now on (its next forward and backward passes);
        the disk tier evicts the cached expert needed furthest in the future (Belady's MIN)."""

    def set_pinned(self, keys: Iterable[ExpertKey]) -> None:
        """ES-MoE §4.3: keep these resident in host memory (disk tier's cache)."""

    def write_behind(self) -> None:
        """Start writing back, in the background, cached records that the schedule says will be evicted before
        their next use (no-op where nothing is written back)."""

    def grouped_weights(self, layer: int, used: int = 0) -> torch.Tensor | None:
        """The weights of all of `layer`'s experts as one (E, P) tensor, where a tier keeps them so (the host tier);
        None: acquire them one by one."""
        return None

    def flush(self) -> None:
        """Write every dirty record back to its backing storage."""

    def close(self) -> None:
        self.flush()


class HostExpertStore(ExpertStore):
    """All experts in (pinned, when CUDA exists) host memory.

    The records of one layer's experts lie in one (rows, E, P) block, each row contiguous and `ROW_GAP_BYTES` after
    the previous (and their compute copies, if any, in one (E, P) block), so that the layer's weights are one
    contiguous (E, P) tensor: `grouped_weights` hands it to a grouped GEMM as (E, out, in) views without a copy (issue
    14: the host tier at the speed of the grouped resident experts), and a CUDA runtime page-locks exactly it in one
    registration (page-locked row by row, the rows of an (E, rows, P) block uploaded at ~7 GB/s instead of ~40 on an
    H200: measured). Each record is still a tensor of its own over its slice of the block (`_own_tensor`), with its
    own autograd version counter: views of one tensor share its counter, and an expert updated by the optimizer while
    another expert's backward recomputes would otherwise trip autograd's in-place check.
    """

    tier = "host"

    def __init__(self, keys, numel, compute_dtype, stats, state_rows: int = STATE_ROWS,
                 row_dtype: torch.dtype = torch.float32):
        super().__init__(keys, numel, compute_dtype, stats, state_rows, row_dtype)
        by_layer: dict[int, list[int]] = {}
        for layer, e in self._keys:
            by_layer.setdefault(layer, []).append(e)
        self._records: dict[ExpertKey, ExpertRecord] = {}
        # layer -> (its weights (E, P), in the compute dtype, or None when the layer's experts are not exactly 0..E-1)
        self._grouped: dict[int, torch.Tensor | None] = {}
        # What uploads read, page-locked at bind: each layer's (E, P) weights (or compute copies), one registration.
        self._dma: list[torch.Tensor] = []
        with_copies = compute_dtype != row_dtype
        for layer, experts in by_layer.items():
            order = sorted(experts)
            block = _row_block(state_rows, len(order), numel, row_dtype)
            copies = torch.empty(len(order), numel, dtype=compute_dtype) if with_copies else None
            for i, e in enumerate(order):
                self._records[(layer, e)] = self._new_record(
                    (layer, e), _own_tensor(block[:, i]), _own_tensor(copies[i]) if with_copies else None)
            weights = copies if with_copies else block[0]
            self._grouped[layer] = weights if order == list(range(len(order))) else None
            self._dma.append(weights)

    def _dma_sources(self):
        return self._dma

    switches_compute_dtype = True

    def use_compute_dtype(self, dtype: torch.dtype) -> None:
        """`ExpertStore.switches_compute_dtype`: each layer's copies as one (E, P) block, as at construction."""
        self._check_compute_switch(dtype)
        self.compute_dtype = dtype
        self._dma = []
        for layer in sorted({layer for layer, _ in self._keys}):
            keys = sorted(key for key in self._keys if key[0] == layer)
            copies = torch.empty(len(keys), self.numel, dtype=dtype)  # one (E, P) block: one upload per run
            for i, key in enumerate(keys):
                record = self._records[key]
                record.compute = _own_tensor(copies[i])
                record.compute.copy_(record.param)
            if self._grouped.get(layer) is not None:
                self._grouped[layer] = copies
            self._dma.append(copies)

    def acquire(self, key, rows=None):
        self.stats.cache_hits += 1
        return self._records[key]

    def release(self, key, dirty=False, grad_zeroed=False):
        pass

    def grouped_weights(self, layer: int, used: int = 0) -> torch.Tensor | None:
        """The weights of every expert of `layer`, (E, P) in the compute dtype, rows in expert order: a view of the
        records themselves, read-only, current until the experts' next update (the caller waits for pending ones).
        None when the layer's experts here are not all of 0..E-1 (an expert-parallel shard). `used`: the experts the
        caller computes from it, counted as hits like that many `acquire`s."""
        self.stats.cache_hits += used
        return self._grouped.get(layer)


# Bytes left free after each row of a host-tier layer block (`_row_block`). Adam streams through an expert's weight,
# gradient and two moments together; rows an exact power of two apart (16 experts x 2**21 parameters: 128 MiB) put
# those four streams on the same cache sets, and the fused step ran ~1.5x slower than over separate allocations on
# the 2-core box (measured; benchmarks/cpu_optimizer.py's 16 x 2.1M shape). 16 KiB + 64 B apart it runs at their speed.
ROW_GAP_BYTES = 16 * 1024 + 64


def _row_block(rows: int, experts: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed (rows, experts, numel) block whose rows are each contiguous (E, P) but `ROW_GAP_BYTES` apart."""
    stride = experts * numel + ROW_GAP_BYTES // dtype.itemsize
    return torch.zeros(rows * stride, dtype=dtype).as_strided((rows, experts, numel), (stride, numel, 1))


def _own_tensor(view: torch.Tensor) -> torch.Tensor:
    """`view` as a tensor of its own: the same memory with an autograd version counter of its own (views share their
    base's), so that writes through other tensors of that memory do not count as changes of this one."""
    return view.new_empty(0).set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


class _Entry:
    """An expert of the disk tier that is not only on disk: its state, the cache slot it owns and its record.

    States (every transition under the store's lock; the I/O itself runs without it):
    - LOADING: one thread (the one that set it) reads rows of the file into the slot: a new entry (claiming a slot
      first), or rows an existing record lacks (its holders keep using the rows they have);
    - CACHED: the record is in its slot; `refs` > 0 while in use; `valid`: the rows that are current in the slot;
      `dirty_rows`: those newer than the file;
    - WRITING: one thread (the one that set it, from CACHED with refs == 0) writes the dirty rows back to the file.
    An expert without an entry is on disk only and nobody is touching its file. Every other thread that needs an
    expert in LOADING or WRITING waits until it is CACHED or gone, so a file is never read while it is written, a
    record is never written back while it is in use, and a slot is never reused while its record is read, written
    or held.
    """

    __slots__ = ("state", "slot", "record", "refs", "valid", "dirty_rows")

    def __init__(self):
        self.state = LOADING
        self.slot: int | None = None
        self.record: ExpertRecord | None = None
        self.refs = 0
        self.valid: set[int] = set()
        self.dirty_rows: set[int] = set()

    @property
    def dirty(self) -> bool:
        return bool(self.dirty_rows)


LOADING, CACHED, WRITING = "loading", "cached", "writing"

# Expert files: the (rows, P) fp32 record, then this trailer: magic, layer, expert, P, rows, one 64-bit checksum per
# row. The checksums make a flipped or torn byte an error instead of a weight (issue 11); the key and size catch a file
# of another expert or another model. Rows are read and written on their own (a row's checksum covers that row only).
# The checksum is XXH3-64 (issue 14): every byte the tier moves is hashed on the host's cores, and zlib's CRC32 ran at
# ~4 GB/s there (slower than an NVMe drive), XXH3 at ~60 GB/s (benchmarks/RESULTS.md).
_TRAILER = struct.Struct("<8sIIQI4x4Q")
_MAGIC = b"HFMOEXP3"
_FILE_PATTERN = re.compile(r"^layer\d+_expert\d+\.bin$")
_CLOSED = b"closed"


def _runs(rows: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted row indices as [start, stop) runs of consecutive rows (one read or write call each)."""
    out: list[list[int]] = []
    for r in sorted(rows):
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return [(a, b) for a, b in out]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor as a flat memoryview (a view for contiguous tensors: writable, for readinto)."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _row_hash(buffer: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(tensor_bytes(buffer))


class _DirectoryLock:
    """An exclusive `flock` on `<dir>/.lock`, held while a store uses the directory: a second live process (or a
    second store in this process) gets a clear error instead of overwriting the first one's expert files. The kernel
    drops the lock when its holder dies, so a killed run's directory is free again (and detected as reused)."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, ".lock")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            self._fd = None
            where = "this process (another expert store)" if holder == str(os.getpid()) else f"process {holder}"
            raise ExpertStoreError(
                f"offload_dir {directory!r} is in use by {where}: two stores must not share a directory (each "
                "would overwrite the other's expert files). Choose another offload_dir (--offload-dir), or close "
                "the other store first (disable_expert_offload)"
            ) from None
        # What the previous holder left: its pid while it ran, "closed" once it closed its store properly.
        self.previous_closed = os.pread(self._fd, 64, 0).strip() == _CLOSED
        self._write(str(os.getpid()).encode())
        self._finalizer = weakref.finalize(self, os.close, self._fd)

    def _write(self, content: bytes) -> None:
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, content, 0)

    def release(self) -> None:
        if self._finalizer.alive:
            self._write(_CLOSED)
        self._finalizer()  # closing the descriptor drops the lock


class DiskExpertStore(ExpertStore):
    """Expert files in `offload_dir` behind a host cache of `cache_experts` records.

    Reads go to preallocated (pinned) cache slots with explicit `readinto`, ahead of use via `prefetch` (on the I/O
    threads, which also do the write-backs that make room); dirty rows are written back when evicted and on
    `flush()`. Only the rows a caller asks for are read and only changed rows are written (issue 14): a forward reads
    an expert's weights, its backward adds the gradient (neither read nor zeroed when it is known to be zero: marked
    stale), its optimizer step reads the moments. Eviction follows the engine's schedule (`set_schedule`: forward in
    order, backward in reverse, then the next forward): the idle record needed furthest in the future goes (Belady's
    MIN), least recently used first among equals and without a schedule. Records in use (acquired) are never
    evicted; pinned ones only when nothing else can be. Each expert's state is owned by one thread at a time (see
    `_Entry`). Every file carries a checksum per row (XXH3-64), checked on every read. The directory is locked while
    the store is open (`_DirectoryLock`); expert files left by a run that did not close its store are discarded with a
    warning (`owner=False`: a node-shared store's other ranks, which neither lock nor clean).
    """

    tier = "disk"
    wants_schedule = True
    stall_timeout = 60.0  # seconds a thread waits for a cache slot before the cache is declared too small
    # Row-level I/O and gradients known to be zero. A node-shared store (several processes, one set of files) turns
    # it off: which gradients are zero is known per process only, so it moves whole records.
    row_io = True

    def __init__(self, keys, numel, compute_dtype, stats, offload_dir: str, cache_experts: int, io_threads: int = 2,
                 owner: bool = True, state_rows: int = STATE_ROWS, row_dtype: torch.dtype = torch.float32):
        super().__init__(keys, numel, compute_dtype, stats, state_rows, row_dtype)
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
        self._dir_lock = _DirectoryLock(offload_dir) if owner else None
        if owner:
            self._discard_stale_files(killed=not self._dir_lock.previous_closed)
        self.cache_experts = cache_experts
        self._slots = [torch.empty(state_rows, numel, dtype=row_dtype) for _ in range(cache_experts)]
        # One compute copy per slot, allocated (and page-locked) once, not per read.
        self._compute_slots = ([torch.empty(numel, dtype=compute_dtype) for _ in range(cache_experts)]
                               if compute_dtype != row_dtype else [None] * cache_experts)
        self._free = list(range(cache_experts))
        self._entries: OrderedDict[ExpertKey, _Entry] = OrderedDict()  # least recently used first
        self._pinned: set[ExpertKey] = set()
        # False: the gradient is zero and its row, in a slot not `valid` or in the file, means nothing.
        self._grad_live: dict[ExpertKey, bool] = {k: False for k in self._keys}
        self._hashes: dict[ExpertKey, list[int]] = {}  # the checksum of each row of each file this process wrote
        self._uses: dict[ExpertKey, deque[int]] = {}  # set_schedule: each expert's positions in the schedule
        self._schedule: list[ExpertKey] = []
        self._cursor = 0
        self._decode = None  # a DecodeCache (offload/inference.py) while the engine runs inference
        # Rows whose checksum a read has matched since this process last wrote them. While decoding they are not
        # checked again (the files do not change then; the first read of every row still is).
        self._checked: dict[ExpertKey, set[int]] = {}
        self._maps: dict[ExpertKey, tuple[torch.Tensor, torch.Tensor]] = {}  # `_mapping`: files mapped for inference
        self._lock = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="expert-io")

    def _dma_sources(self):
        return [c if c is not None else b[0] for b, c in zip(self._slots, self._compute_slots)]

    switches_compute_dtype = True

    def use_compute_dtype(self, dtype: torch.dtype) -> None:
        """`ExpertStore.switches_compute_dtype`: a copy buffer per cache slot; cached records get theirs now."""
        with self._lock:
            self._check_compute_switch(dtype)
            if any(entry.refs or entry.state != CACHED for entry in self._entries.values()):
                raise RuntimeError("the disk tier's compute dtype changes only while no record is in use or in I/O")
            self.compute_dtype = dtype
            self._compute_slots = [torch.empty(self.numel, dtype=dtype) for _ in range(self.cache_experts)]
            for entry in self._entries.values():  # cached records get their slot's copy
                entry.record.compute = self._compute_slots[entry.slot]
                entry.record.compute.copy_(entry.record.param)

    def path(self, key: ExpertKey) -> str:
        return os.path.join(self.dir, f"layer{key[0]:03d}_expert{key[1]:05d}.bin")

    def _discard_stale_files(self, killed: bool) -> None:
        """Expert files of an earlier store in this directory are never read: a new store writes every expert
        afresh (from the model being offloaded, or a checkpoint being loaded). A store that was not closed (a killed
        run) is worth a warning."""
        stale = [n for n in os.listdir(self.dir) if _FILE_PATTERN.match(n)]
        if not stale:
            return
        if killed:
            logger.warning(
                "offload_dir %r holds %d expert files of an earlier run that did not close its store (killed?); they "
                "are discarded: the experts are written afresh from the model being offloaded", self.dir, len(stale))
        else:
            logger.info("offload_dir %r: replacing %d expert files of a closed store", self.dir, len(stale))
        for name in stale:
            os.remove(os.path.join(self.dir, name))

    def _rows(self, rows: Iterable[int] | None) -> set[int]:
        """The rows to have current: PARAM always (a record's compute copy mirrors it); every row without row I/O."""
        if rows is None or not self.row_io:
            return set(range(self.state_rows))
        return {r for r in rows if r < self.state_rows} | {PARAM}

    def _live(self, key: ExpertKey) -> bool:
        return self._grad_live[key] or not self.row_io

    # --- file I/O (called without the lock, by the thread that owns the expert's LOADING/WRITING state) ---
    def _write_file(self, key: ExpertKey, buffer: torch.Tensor, rows: list[int]) -> None:
        """Write `rows` of `buffer` and the trailer. A file this process wrote before keeps its other rows; a new
        one (or any file of a store without row I/O) is written whole from `rows`."""
        path = self.path(key)
        row_bytes = self.numel * self.row_dtype.itemsize
        previous = self._hashes.get(key) if self.row_io else None
        sums = list(previous) if previous is not None else [0] * STATE_ROWS
        for r in rows:
            sums[r] = _row_hash(buffer[r])
        trailer = _TRAILER.pack(_MAGIC, key[0], key[1], self.numel, self.state_rows, *sums)
        if previous is None:
            self._maps.pop(key, None)  # the file is written anew (truncated first): map it again when needed
        try:
            with open(path, "r+b" if previous is not None else "wb") as f:
                for start, stop in _runs(rows):
                    f.seek(start * row_bytes)
                    f.write(tensor_bytes(buffer[start:stop]))
                f.seek(self.state_rows * row_bytes)
                f.write(trailer)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise ExpertStoreFullError(
                    f"disk full while writing expert {key} to {path}: free space in {self.dir!r} or move offload_dir; "
                    f"the tier needs {len(self._keys) * (self.record_bytes() + _TRAILER.size)} bytes. The expert is "
                    "still in the host cache and saved checkpoints are not affected."
                ) from err
            raise ExpertStoreError(f"could not write expert file {path}: {err}") from err
        self._hashes[key] = sums
        self._checked.get(key, set()).difference_update(rows)
        self.stats.disk_write_bytes += len(rows) * row_bytes

    def _read_file(self, key: ExpertKey, buffer: torch.Tensor, rows: list[int]) -> None:
        path = self.path(key)
        row_bytes = self.numel * self.row_dtype.itemsize
        size = self._file_size()
        try:
            with open(path, "rb", buffering=0) as f:
                actual = os.fstat(f.fileno()).st_size
                if actual != size:
                    raise CorruptExpertFileError(
                        f"expert file {path} is truncated or padded ({actual} bytes, expected {size}); the offload "
                        "directory is corrupt: resume from your last checkpoint"
                    )
                for start, stop in _runs(rows):
                    f.seek(start * row_bytes)
                    got = f.readinto(tensor_bytes(buffer[start:stop]))
                    if got != (stop - start) * row_bytes:
                        raise CorruptExpertFileError(
                            f"expert file {path} is truncated (changed while read); resume from your last checkpoint")
                f.seek(self.state_rows * row_bytes)
                trailer = f.read(_TRAILER.size)
        except FileNotFoundError as err:
            raise CorruptExpertFileError(
                f"expert file {path} is missing: the offload directory was modified while in use; resume from your "
                "last checkpoint"
            ) from err
        sums = self._check_trailer(key, path, trailer)
        checked = self._checked.setdefault(key, set())
        trusted = checked if self._decode is not None and self.row_io else set()
        if any(_row_hash(buffer[r]) != sums[r] for r in rows if r not in trusted):
            self._corrupt(path, "its checksum does not match its contents (bytes changed on disk)")
        checked.update(rows)
        self.stats.disk_read_bytes += len(rows) * row_bytes

    def _check_trailer(self, key: ExpertKey, path: str, trailer: bytes) -> list[int]:
        """The row checksums of `key`'s file, after checking that its trailer is this version's and names `key`."""
        magic, layer, expert, numel, state_rows, *sums = _TRAILER.unpack(trailer)
        if magic != _MAGIC:
            self._corrupt(path, "it is not an expert file of this version")
        if (layer, expert) != tuple(key) or numel != self.numel or state_rows != self.state_rows:
            self._corrupt(path, f"it holds expert {(layer, expert)} with {state_rows} x {numel} values, not expert "
                                f"{key} with {self.state_rows} x {self.numel}")
        return sums

    def _corrupt(self, path: str, problem: str):
        raise CorruptExpertFileError(
            f"expert file {path} is corrupt: {problem}. Nothing from it was used; check the disk under {self.dir!r} "
            "and resume from your last checkpoint"
        )

    def _file_size(self) -> int:
        return self.state_rows * self.numel * self.row_dtype.itemsize + _TRAILER.size

    # --- memory-mapped weights (inference on the CPU) ---
    @property
    def mappable(self) -> bool:
        """Whether `map_weights` can serve computations: row I/O (a private store: which files change is known) and
        rows already in the compute dtype (no conversion copy to make)."""
        return self.row_io and self.row_dtype == self.compute_dtype

    def _mapping(self, key: ExpertKey) -> tuple[torch.Tensor, torch.Tensor]:
        """Lock held: `key`'s whole file mapped as bytes, and its weights row as a tensor over the mapping (made once
        per file; the mapping stays valid across this store's writes, which rewrite files in place). `torch.from_file`
        closes the file after mapping it (Python's `mmap` keeps a duplicate descriptor open per mapping, and a model
        with thousands of experts would run out of descriptors); the mapping is private (MAP_PRIVATE): nothing writes
        through it, and until something did, it shows the file's current bytes."""
        found = self._maps.get(key)
        if found is not None:
            return found
        path = self.path(key)
        try:
            actual = os.stat(path).st_size
        except FileNotFoundError as err:
            raise CorruptExpertFileError(
                f"expert file {path} is missing: the offload directory was modified while in use; resume from your "
                "last checkpoint"
            ) from err
        if actual != self._file_size():  # checked before mapping: a read past a file's end would kill the process
            self._corrupt(path, f"it is truncated or padded ({actual} bytes, expected {self._file_size()})")
        whole = torch.from_file(path, shared=False, size=actual, dtype=torch.uint8)
        row_bytes = self.numel * self.row_dtype.itemsize
        row = whole[PARAM * row_bytes : (PARAM + 1) * row_bytes].view(self.row_dtype)
        found = self._maps[key] = (whole, row)
        return found

    def map_weights(self, key: ExpertKey) -> torch.Tensor | None:
        """A forward on the CPU (inference, or a training forward: only backward needs the record): `key`'s weights as
        a view of its memory-mapped file (private: never written through), without copying them into the cache, or
        None when the expert has an entry (the cache is current for it: acquire it). A use in the schedule's order,
        like an acquire. Its row's checksum is matched at its first use since it was last written, like a read's.
        Safe: only an entry's write-back writes a file, and an expert without an entry has none in flight (see
        `_Entry`); its update in flight must be waited for first (the engine's `wait_for_update`), and nothing updates
        it between a forward and its backward."""
        with self._lock:
            if key in self._entries:
                return None
            self._advance(key)
            mapped, row = self._mapping(key)
            checked = self._checked.setdefault(key, set())
            if PARAM not in checked:
                path = self.path(key)
                sums = self._check_trailer(key, path, mapped[-_TRAILER.size:].numpy().tobytes())
                if _row_hash(row) != sums[PARAM]:
                    self._corrupt(path, "its checksum does not match its contents (bytes changed on disk)")
                checked.add(PARAM)
            self.stats.disk_mapped_bytes += self.numel * self.row_dtype.itemsize
            self.stats.disk_mapped_experts += 1
            return row

    @staticmethod
    def unmap_weights(row: torch.Tensor) -> None:
        """Done with mapped weights `row` (from `map_weights`) for now: drop their pages from this process
        (MADV_DONTNEED; the page cache keeps them, the next use maps them again from there). A training step uses
        every expert's weights: left mapped, they would all count in the process's resident memory, which the disk
        tier bounds by its cache."""
        if _madvise is None:
            return
        first = -(-row.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE  # the whole pages inside the row
        end = (row.data_ptr() + row.numel() * row.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > first:
            _madvise(first, end - first, _MADV_DONTNEED)

    def advise(self, keys: Iterable[ExpertKey]) -> None:
        """The read-ahead of mapped weights: ask the kernel to start reading the weights rows of `keys` without a
        cache entry into its page cache. Like `prefetch`, a no-op for an expert already read ahead for this token and
        not used yet (the engine's lookahead windows overlap: each costs an open, an fadvise and a close)."""
        if not hasattr(os, "posix_fadvise"):
            return
        row_bytes = self.numel * self.row_dtype.itemsize
        with self._lock:
            paths = []
            for key in keys:
                if key in self._entries or (self._decode is not None and self._decode.expecting(key)):
                    continue
                if self._decode is not None:
                    self._decode.expect(key)
                paths.append(self.path(key))
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # a hint only: the use that follows reports the missing file
            try:
                os.posix_fadvise(fd, PARAM * row_bytes, row_bytes, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def _fill_rows(self, key: ExpertKey, record_buffer: torch.Tensor, rows: set[int], grad_live: bool) -> bool:
        """Make `rows` of the slot current: read them, except a zero gradient, which is neither read nor written:
        -> True when the caller must mark the record's gradient stale (it counts as zero; the next gradient is
        copied in, or the optimizer steps straight from autograd's: `ExpertRecord.grad_stale`)."""
        read = sorted(rows if grad_live else rows - {GRAD})
        if read:
            self._read_file(key, record_buffer, read)
        return GRAD in rows and not grad_live

    # --- the schedule (Belady's MIN over the engine's known order) ---
    def set_schedule(self, keys):
        uses: dict[ExpertKey, deque[int]] = {}
        for i, key in enumerate(keys):
            uses.setdefault(key, deque()).append(i)
        with self._lock:
            self._schedule, self._uses, self._cursor = list(keys), uses, 0

    def _advance(self, key: ExpertKey) -> None:
        """Lock held: an acquire of the schedule's next expert moves the schedule on."""
        if self._cursor < len(self._schedule) and self._schedule[self._cursor] == key:
            self._uses[key].popleft()
            self._cursor += 1

    def _next_use(self, key: ExpertKey) -> float:
        uses = self._uses.get(key)
        return uses[0] if uses else math.inf

    def set_decode_cache(self, policy) -> None:
        """Evict by `policy` (a `DecodeCache`: decoding's frequency scores and per-layer budgets) instead of the
        schedule; None goes back to the schedule."""
        with self._lock:
            self._decode = policy

    # --- state transitions (lock held; may release it around I/O, see each) ---
    def _victim(self, evict_pinned: bool, for_key: ExpertKey | None = None,
                speculative: bool = False) -> ExpertKey | None:
        """The idle record needed furthest in the future (ties: least recently used), not pinned if possible
        (pinned only when `evict_pinned`). A `speculative` read for `for_key` evicts only one needed later than
        `for_key`, or nothing (the cache is better used as it is). While decoding, the decode cache chooses."""
        if self._decode is not None:
            idle = [k for k, e in self._entries.items() if e.state is CACHED and e.refs == 0]
            held = Counter(k[0] for k in self._entries)
            victim = self._decode.victim([k for k in idle if k not in self._pinned], held, for_key, speculative)
            if victim is None and evict_pinned:
                victim = self._decode.victim([k for k in idle if k in self._pinned], held, for_key, speculative)
            return victim
        best, best_use, pinned, pinned_use = None, -1.0, None, -1.0
        for key, entry in self._entries.items():
            if entry.state is CACHED and entry.refs == 0:
                use = self._next_use(key)
                if key not in self._pinned:
                    if use > best_use:
                        best, best_use = key, use
                elif use > pinned_use:
                    pinned, pinned_use = key, use
        if best is None and evict_pinned:
            best, best_use = pinned, pinned_use
        if best is not None and speculative and best_use != math.inf and best_use <= self._next_use(for_key):
            return None
        return best

    def _claim_slot(self, block: bool = True, for_key: ExpertKey | None = None) -> int | None:
        """A free cache slot, evicting an idle record (written back first if dirty; the lock is released meanwhile).
        Non-blocking (speculative reads for `for_key`): never evicts a pinned record, nor one needed before
        `for_key`, and returns None when nothing is evictable."""
        while True:
            if self._free:
                return self._free.pop()
            victim = self._victim(evict_pinned=block, for_key=for_key, speculative=not block)
            if victim is None:
                if not block:
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
            return entry.slot

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

    def _load(self, key: ExpertKey, entry: _Entry, rows: set[int], block: bool) -> bool:
        """Fill this thread's LOADING `entry`: claim a slot, read `rows` of the file into it (lock released),
        -> CACHED. On failure, or when a speculative load finds nothing to evict, the entry is removed (on disk only
        again)."""
        try:
            slot = self._claim_slot(block=block, for_key=key)
        except BaseException:
            self._abandon(key, entry, None)
            raise
        if slot is None:
            self._abandon(key, entry, None)
            return False
        live = self._live(key)
        self._lock.release()
        try:
            # The slot's last record may still be read by an upload: the engine releases it only after the copy.
            self.runtime.access(self._slots[slot][0], write=True, stream=HOST)
            stale = self._fill_rows(key, self._slots[slot], rows, live)
            record = self._new_record(key, self._slots[slot], self._compute_slots[slot])
            record.grad_stale = stale
        except BaseException:
            self._lock.acquire()
            self._abandon(key, entry, slot)
            raise
        self._lock.acquire()
        entry.slot, entry.record, entry.state, entry.valid = slot, record, CACHED, set(rows)
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

    def _abandon(self, key: ExpertKey, entry: _Entry, slot: int | None) -> None:
        del self._entries[key]
        if slot is not None:
            self._free.append(slot)
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

    def _behind(self, key: ExpertKey, entry: _Entry) -> bool:
        """Lock held: whether `write_behind` writes `entry` back now: dirty, idle, not pinned, and not needed again
        within the next `cache_experts` acquisitions of the schedule (a cache of that many slots evicts it first)."""
        return (entry.state is CACHED and entry.refs == 0 and entry.dirty and key not in self._pinned
                and self._next_use(key) - self._cursor > self.cache_experts)

    def _write_behind(self, keys: list[ExpertKey]) -> None:
        with self._lock:
            try:
                for key in keys:
                    entry = self._entries.get(key)
                    if entry is not None and self._behind(key, entry):
                        self._write_back(key, entry)
            except Exception as err:  # still dirty: the eviction writes it again and raises in the caller
                logger.debug("write-behind of expert %s failed: %s", key, err)

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
                        slot = self._claim_slot()
                    except BaseException:
                        self._abandon(key, entry, None)
                        raise
                    record = self._new_record(key, self._slots[slot], self._compute_slots[slot])
                    entry.slot, entry.record, entry.state = slot, record, CACHED
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
            record.param.copy_(flat)
            record.refresh_compute()
            self.steps[key] = 0
            self.has_grad[key] = False
        finally:
            self.release(key, dirty=True, grad_zeroed=True)

    def acquire(self, key, rows=None):
        want = self._rows(rows)
        with self._lock:
            self._advance(key)
            entry = self._entries.get(key)
            if entry is not None and entry.state is CACHED:
                self.stats.cache_hits += 1
            else:
                self.stats.cache_misses += 1
            while True:
                entry = self._entries.get(key)
                if entry is None:
                    entry = self._entries[key] = _Entry()
                    self._load(key, entry, want, block=True)
                elif entry.state is CACHED:
                    missing = want - entry.valid
                    if missing:
                        self._add_rows(key, entry, missing)
                        continue
                    entry.refs += 1
                    self._entries.move_to_end(key)
                    return entry.record
                else:
                    self._lock.wait()  # another thread owns it (loading or writing back)

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
                if self._decode is not None:
                    self._decode.expect(key)
                entry = self._entries.get(key)
                if entry is None:
                    entry = self._entries[key] = _Entry()
                    self._pool.submit(self._background_load, key, entry, want)
                elif entry.state is CACHED and want - entry.valid:
                    self._pool.submit(self._background_load, key, entry, want)

    def write_behind(self):
        # A training forward computes from mapped files and leaves the I/O threads idle, while each eviction in the
        # backward that follows would first write its victim back on the thread that needs the slot (often the one
        # computing). Records stepped at the end of the last backward are written now instead. Only under the
        # training schedule: a record cleaned and dirtied again before its eviction would be written twice.
        with self._lock:
            if not self._schedule or self._decode is not None:
                return
            keys = [key for key, entry in self._entries.items() if self._behind(key, entry)]
        if keys:
            self._pool.submit(self._write_behind, keys)

    def set_pinned(self, keys):
        # The engine leaves room for the records in flight (OffloadEngine.pin_limit); should every slot be pinned,
        # pinned records are still evicted, last.
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
            self._maps.clear()
            if self._dir_lock is not None:
                self._dir_lock.release()

    def resident_keys(self) -> list[ExpertKey]:
        with self._lock:
            return [k for k, e in self._entries.items() if e.state is CACHED]

    def dirty_keys(self) -> list[ExpertKey]:
        """Experts whose cached record is newer than their file."""
        with self._lock:
            return [k for k, e in self._entries.items() if e.dirty]


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
