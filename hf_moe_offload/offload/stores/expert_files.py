"""The disk tier's expert files: their format and checksums, the directory lock, and memory mapping (ES-MoE §4.1,
"Offloading experts to SSD"; nothing corrupt is ever used).

One file per expert: the (rows, P) record, then a trailer: magic, layer, expert, P, rows, one 64-bit checksum per row.
The checksums make a flipped or torn byte an error instead of a weight; the key and size catch a file of another
expert or another model. Rows are read and written on their own (a row's checksum covers that row only). The checksum
is XXH3-64: every byte the tier moves is hashed on the host's cores, and zlib's CRC32 ran at ~4 GB/s there
(slower than an NVMe drive), XXH3 at ~60 GB/s (benchmarks/RESULTS.md).

`ExpertFiles` does the I/O of one directory; the cache that decides when (offload/stores/disk_store.py) calls it without its
lock, from the thread that owns the expert's LOADING or WRITING state, except `map_weights` (lock held).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import struct
import sys
import weakref
from collections.abc import Iterable

import torch
import xxhash

from ...errors import ExpertStoreError
from .store import PARAM, STATE_ROWS, CorruptExpertFileError, ExpertKey, ExpertStoreFullError, tensor_bytes
from ..telemetry import OffloadStats

logger = logging.getLogger(__name__)

_TRAILER = struct.Struct("<8sIIQI4x4Q")
_MAGIC = b"HFMOEXP3"
_FILE_PATTERN = re.compile(r"^layer\d+_expert\d+\.bin$")
_CLOSED = b"closed"


def _libc_madvise():
    """madvise(2) where libc exports it (Linux), else None (`ExpertFiles.unmap_weights` is then a no-op)."""
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


def _runs(rows: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted row indices as [start, stop) runs of consecutive rows (one read or write call each)."""
    out: list[list[int]] = []
    for r in sorted(rows):
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return [(a, b) for a, b in out]


def _row_hash(buffer: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(tensor_bytes(buffer))


class DirectoryLock:
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


class ExpertFiles:
    """The expert files of one directory: `write` and `read` rows (checked against the trailer's checksums),
    `map_weights` (a file's weights row as a tensor over a private mapping), the kernel's read-ahead (`advise`).
    `row_io` False (a node-shared store): files are written whole, never partly rewritten."""

    def __init__(self, directory: str, numel: int, state_rows: int, row_dtype: torch.dtype, stats: OffloadStats,
                 row_io: bool, experts: int):
        self.dir = directory
        self.numel, self.state_rows, self.row_dtype = numel, state_rows, row_dtype
        self.stats = stats
        self.row_io = row_io
        self.experts = experts  # for the disk-full error's size
        self.row_bytes = numel * row_dtype.itemsize
        self.hashes: dict[ExpertKey, list[int]] = {}  # the checksum of each row of each file this process wrote
        # Rows whose checksum a read has matched since this process last wrote them (while decoding, not checked
        # again: the files do not change then; the first read of every row still is).
        self.checked: dict[ExpertKey, set[int]] = {}
        self.maps: dict[ExpertKey, tuple[torch.Tensor, torch.Tensor]] = {}  # `_mapping`: files mapped for compute

    def path(self, key: ExpertKey) -> str:
        return os.path.join(self.dir, f"layer{key[0]:03d}_expert{key[1]:05d}.bin")

    @property
    def size(self) -> int:
        """Bytes of one expert's file."""
        return self.state_rows * self.row_bytes + _TRAILER.size

    def discard_stale(self, killed: bool) -> None:
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

    def write(self, key: ExpertKey, buffer: torch.Tensor, rows: list[int]) -> None:
        """Write `rows` of `buffer` and the trailer. A file this process wrote before keeps its other rows; a new
        one (or any file without row I/O) is written whole from `rows`."""
        path = self.path(key)
        previous = self.hashes.get(key) if self.row_io else None
        sums = list(previous) if previous is not None else [0] * STATE_ROWS
        for r in rows:
            sums[r] = _row_hash(buffer[r])
        trailer = _TRAILER.pack(_MAGIC, key[0], key[1], self.numel, self.state_rows, *sums)
        if previous is None:
            self.maps.pop(key, None)  # the file is written anew (truncated first): map it again when needed
        try:
            with open(path, "r+b" if previous is not None else "wb") as f:
                for start, stop in _runs(rows):
                    f.seek(start * self.row_bytes)
                    f.write(tensor_bytes(buffer[start:stop]))
                f.seek(self.state_rows * self.row_bytes)
                f.write(trailer)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise ExpertStoreFullError(
                    f"disk full while writing expert {key} to {path}: free space in {self.dir!r} or move offload_dir; "
                    f"the tier needs {self.experts * self.size} bytes. The expert is still in the host cache and saved "
                    "checkpoints are not affected."
                ) from err
            raise ExpertStoreError(f"could not write expert file {path}: {err}") from err
        self.hashes[key] = sums
        self.checked.get(key, set()).difference_update(rows)
        self.stats.disk_write_bytes += len(rows) * self.row_bytes

    def read(self, key: ExpertKey, buffer: torch.Tensor, rows: list[int], trust_checked: bool) -> None:
        """Read `rows` of `key`'s file into `buffer`, each checked against its checksum (`trust_checked`: not the
        rows a read already matched since this process last wrote them)."""
        path = self.path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                actual = os.fstat(f.fileno()).st_size
                if actual != self.size:
                    raise CorruptExpertFileError(
                        f"expert file {path} is truncated or padded ({actual} bytes, expected {self.size}); the "
                        "offload directory is corrupt: resume from your last checkpoint"
                    )
                for start, stop in _runs(rows):
                    f.seek(start * self.row_bytes)
                    got = f.readinto(tensor_bytes(buffer[start:stop]))
                    if got != (stop - start) * self.row_bytes:
                        raise CorruptExpertFileError(
                            f"expert file {path} is truncated (changed while read); resume from your last checkpoint")
                f.seek(self.state_rows * self.row_bytes)
                trailer = f.read(_TRAILER.size)
        except FileNotFoundError as err:
            raise self._missing(path) from err
        sums = self.check_trailer(key, path, trailer)
        checked = self.checked.setdefault(key, set())
        trusted = checked if trust_checked and self.row_io else set()
        if any(_row_hash(buffer[r]) != sums[r] for r in rows if r not in trusted):
            self.corrupt(path, "its checksum does not match its contents (bytes changed on disk)")
        checked.update(rows)
        self.stats.disk_read_bytes += len(rows) * self.row_bytes

    def check_trailer(self, key: ExpertKey, path: str, trailer: bytes) -> list[int]:
        """The row checksums of `key`'s file, after checking that its trailer is this version's and names `key`."""
        magic, layer, expert, numel, state_rows, *sums = _TRAILER.unpack(trailer)
        if magic != _MAGIC:
            self.corrupt(path, "it is not an expert file of this version")
        if (layer, expert) != tuple(key) or numel != self.numel or state_rows != self.state_rows:
            self.corrupt(path, f"it holds expert {(layer, expert)} with {state_rows} x {numel} values, not expert "
                               f"{key} with {self.state_rows} x {self.numel}")
        return sums

    def corrupt(self, path: str, problem: str):
        raise CorruptExpertFileError(
            f"expert file {path} is corrupt: {problem}. Nothing from it was used; check the disk under {self.dir!r} "
            "and resume from your last checkpoint"
        )

    @staticmethod
    def _missing(path: str) -> CorruptExpertFileError:
        return CorruptExpertFileError(
            f"expert file {path} is missing: the offload directory was modified while in use; resume from your last "
            "checkpoint")

    # --- memory-mapped weights (the experts computing on the CPU) ---
    def _mapping(self, key: ExpertKey) -> tuple[torch.Tensor, torch.Tensor]:
        """`key`'s whole file mapped as bytes, and its weights row as a tensor over the mapping (made once per file;
        the mapping stays valid across this store's writes, which rewrite files in place). `torch.from_file` closes
        the file after mapping it (Python's `mmap` keeps a duplicate descriptor open per mapping, and a model with
        thousands of experts would run out of descriptors); the mapping is private (MAP_PRIVATE): nothing writes
        through it, and until something did, it shows the file's current bytes."""
        found = self.maps.get(key)
        if found is not None:
            return found
        path = self.path(key)
        try:
            actual = os.stat(path).st_size
        except FileNotFoundError as err:
            raise self._missing(path) from err
        if actual != self.size:  # checked before mapping: a read past a file's end would kill the process
            self.corrupt(path, f"it is truncated or padded ({actual} bytes, expected {self.size})")
        whole = torch.from_file(path, shared=False, size=actual, dtype=torch.uint8)
        row = whole[PARAM * self.row_bytes : (PARAM + 1) * self.row_bytes].view(self.row_dtype)
        found = self.maps[key] = (whole, row)
        return found

    def map_weights(self, key: ExpertKey) -> torch.Tensor:
        """`key`'s weights as a view of its memory-mapped file (private: never written through), its row's checksum
        matched at its first use since it was last written, like a read's. The caller (the store, its lock held)
        makes sure no write of the file is in flight."""
        mapped, row = self._mapping(key)
        checked = self.checked.setdefault(key, set())
        if PARAM not in checked:
            path = self.path(key)
            sums = self.check_trailer(key, path, mapped[-_TRAILER.size:].numpy().tobytes())
            if _row_hash(row) != sums[PARAM]:
                self.corrupt(path, "its checksum does not match its contents (bytes changed on disk)")
            checked.add(PARAM)
        self.stats.disk_mapped_bytes += self.row_bytes
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
        """Ask the kernel to start reading the weights rows of `keys` into its page cache (the read-ahead of mapped
        weights; a hint: a missing file is reported by the use that follows)."""
        if not hasattr(os, "posix_fadvise"):
            return
        for key in keys:
            try:
                fd = os.open(self.path(key), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.posix_fadvise(fd, PARAM * self.row_bytes, self.row_bytes, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def close(self) -> None:
        self.maps.clear()


__all__ = ["DirectoryLock", "ExpertFiles"]
