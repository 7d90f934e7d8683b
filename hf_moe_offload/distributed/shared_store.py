"""Node-shared expert stores: one copy of every expert per node, used by whichever rank the placement picks.

ES-MoE §4.2 places each batch's experts on any GPU of the node, so every rank must be able to stream every expert and
add to its gradient. Rather than a copy per rank (k x host memory) the stores here keep one copy per node:

- `SharedHostExpertStore` (host tier): the (4, P) fp32 records [param | grad | exp_avg | exp_avg_sq] of all experts
  live in one file in a tmpfs (`/dev/shm`), mapped MAP_SHARED by every rank of the node. Each record is its own
  tensor (own storage and autograd version counter, as in `HostExpertStore`) over its slice of the mapping. On CUDA
  the mapping is page-locked in place (`cudaHostRegister`) for asynchronous uploads.
- `SharedDiskExpertStore` (disk tier): the expert files live in one offload directory per node; each rank keeps its
  own bounded host cache. Coherence comes from a version number per expert in shared memory: every write of an
  expert's file bumps it, and a rank drops a cached copy whose version is behind. `publish()` writes back what this
  rank changed so that the next rank to use the expert reads it.

Both keep the Adam step count of every expert in shared memory (so whichever rank steps an expert continues its bias
correction) and the version numbers that tell ranks to refresh low-precision compute copies and pinned device copies.
What makes concurrent use race-free is the protocol of `expert_parallel.py` (one rank touches an expert at a time,
ordered by the collectives of each MoE layer), not locks: see `ExpertParallelCoordinator`.

The mapping's file is unlinked once every rank has mapped it, so a crashed job leaves nothing behind in /dev/shm.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import socket
import uuid
from collections.abc import Iterable, Iterator, MutableMapping

import numpy as np
import torch
import torch.distributed as dist

from ..offload.stores.disk_store import CACHED, DiskExpertStore
from ..offload.stores.store import (
    STATE_ROWS,
    ExpertKey,
    ExpertRecord,
    ExpertStore,
    ExpertStoreError,
    HostExpertStore,
)
from ..offload.telemetry import OffloadStats

logger = logging.getLogger(__name__)

_ALIGN = 4096  # records start on page boundaries (DMA-friendly, no false sharing between records)


def _round_up(n: int, to: int = _ALIGN) -> int:
    return (n + to - 1) // to * to


class SharedRegion:
    """A file in a tmpfs mapped shared by every rank of a node. The leader creates and sizes it (ENOSPC surfaces here,
    not as a SIGBUS on first touch); `unlink()` removes the name once everyone has mapped it."""

    def __init__(self, path: str, nbytes: int, create: bool):
        self.path = path
        self.nbytes = nbytes
        if create:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, max(nbytes, 1))
            except OSError as err:
                os.close(fd)
                os.unlink(path)
                if err.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise ExpertStoreError(
                        f"the node-shared expert store needs {nbytes / 2**30:.2f} GiB in {os.path.dirname(path)} "
                        f"({err.strerror}): enlarge that tmpfs (docker: --shm-size), choose another with "
                        "shared_dir=..., or use the disk tier"
                    ) from err
                raise
        else:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError as err:
                raise ExpertStoreError(
                    f"node-shared store {path} not found: the ranks of a node must see the same {os.path.dirname(path)}"
                    " (one node per store; are the processes in different containers?)"
                ) from err
        try:
            self.mmap = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> torch.Tensor:
        """A tensor over bytes [offset, ...) of the mapping with its own storage (own autograd version counter)."""
        count = int(np.prod(shape))
        arr = np.frombuffer(self.mmap, dtype=dtype, count=count, offset=offset).reshape(shape)
        return torch.from_numpy(arr)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def register_with_cuda(self) -> None:
        """Page-lock the mapping in place so H2D copies from it are asynchronous (pinned memory, ES-MoE §4.1)."""
        if not torch.cuda.is_available():
            return
        whole = torch.frombuffer(self.mmap, dtype=torch.uint8)
        err = torch.cuda.cudart().cudaHostRegister(whole.data_ptr(), self.nbytes, 0)
        if int(err) != 0:
            logger.warning("cudaHostRegister of the node-shared store failed (error %s): uploads from it will be "
                           "synchronous; raise the locked-memory limit (ulimit -l)", int(err))


class SharedStepCounts(MutableMapping):
    """`ExpertStore.steps` over an int64 row in shared memory: Adam's step count per expert, the same on every rank."""

    def __init__(self, counts: torch.Tensor, index: dict[ExpertKey, int]):
        self._counts = counts
        self._index = index

    def __getitem__(self, key: ExpertKey) -> int:
        return int(self._counts[self._index[key]])

    def __setitem__(self, key: ExpertKey, value: int) -> None:
        self._counts[self._index[key]] = int(value)

    def __delitem__(self, key: ExpertKey) -> None:
        raise TypeError("the experts of a node-shared store are fixed")

    def __iter__(self) -> Iterator[ExpertKey]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key) -> bool:
        return key in self._index


class SharedExpertRecord(ExpertRecord):
    """An `ExpertRecord` whose version number is node-wide: an update on one rank is seen by all."""

    __slots__ = ("_shared_versions", "_index", "_local_version")

    def __init__(self, key: ExpertKey, buffer: torch.Tensor, compute_dtype: torch.dtype, versions: torch.Tensor,
                 index: int, compute: torch.Tensor | None = None):
        super().__init__(key, buffer, compute_dtype, None, compute)
        self._shared_versions = versions
        self._index = index
        self._local_version = int(versions[index])

    @property
    def version(self) -> int:
        """The node-wide version this process's copy reflects (the table in shared memory survives evictions)."""
        return self._local_version

    @version.setter
    def version(self, value: int) -> None:
        self._local_version = value

    def refresh_compute(self, copied: bool = False) -> None:
        """After an update (by the one rank that steps this expert): refresh the local compute copy (unless the update
        wrote it: `copied`) and bump the node-wide version, so other ranks refresh theirs (and their pinned device
        copies) on their next acquire."""
        if self.compute is not None and not copied:
            self.compute.copy_(self.param)
        version = int(self._shared_versions[self._index]) + 1
        self._shared_versions[self._index] = version
        self.version = version

    def sync(self) -> None:
        """Catch up with an update made by another rank (refreshes the low-precision copy)."""
        version = int(self._shared_versions[self._index])
        if version != self.version:
            if self.compute is not None:
                self.compute.copy_(self.param)
            self.version = version


class _SharedControl:
    """steps and versions: (2, K) int64 in shared memory."""

    def __init__(self, region: SharedRegion, offset: int, keys: list[ExpertKey]):
        self.table = region.tensor(offset, (2, len(keys)), np.int64)
        self.index = {k: i for i, k in enumerate(keys)}
        self.steps = SharedStepCounts(self.table[0], self.index)
        self.versions = self.table[1]

    @staticmethod
    def nbytes(num_keys: int) -> int:
        return _round_up(2 * num_keys * 8)


class SharedHostExpertStore(HostExpertStore):
    """The host tier with one copy per node (see the module docstring). Build it with `create_node_shared_store`."""

    switches_compute_dtype = False  # the node's ranks share the weights; their copies are each rank's

    tier = "host"
    lazy_grad_zero = False  # the gradient row is shared by the ranks; a stale flag would be one rank's only

    def __init__(self, keys: Iterable[ExpertKey], numel: int, compute_dtype: torch.dtype, stats: OffloadStats,
                 region: SharedRegion):
        ExpertStore.__init__(self, keys, numel, compute_dtype, stats)
        self.region = region
        self._control = _SharedControl(region, 0, self._keys)
        self.steps = self._control.steps
        base = _SharedControl.nbytes(len(self._keys))
        stride = _round_up(STATE_ROWS * numel * 4)  # fp32 rows
        self._records = {
            k: self._new_record(k, region.tensor(base + i * stride, (STATE_ROWS, numel), np.float32))
            for i, k in enumerate(self._keys)
        }
        region.register_with_cuda()

    def _dma_sources(self):
        return [r.compute_param() for r in self._records.values()]  # the rows are in the registered region

    def grouped_weights(self, layer, used=0):
        return None  # each rank syncs an expert's copy at its acquire (SharedExpertRecord.sync): one by one

    @staticmethod
    def region_bytes(num_keys: int, numel: int) -> int:
        return _SharedControl.nbytes(num_keys) + num_keys * _round_up(STATE_ROWS * numel * 4)

    def _new_record(self, key, buffer, compute=None):
        return SharedExpertRecord(key, buffer, self.compute_dtype, self._control.versions, self._control.index[key],
                                  compute)

    def acquire(self, key, rows=None):
        record = super().acquire(key, rows)
        record.sync()
        return record

    def publish(self, keys: Iterable[ExpertKey] | None = None) -> None:
        """Nothing to write back: every rank maps the same memory."""


class SharedDiskExpertStore(DiskExpertStore):
    """The disk tier with one set of expert files per node and a private host cache per rank, kept coherent by
    node-wide version numbers (see the module docstring). Build it with `create_node_shared_store`."""

    switches_compute_dtype = False  # the node's ranks share the weights; their copies are each rank's

    tier = "disk"
    lazy_grad_zero = False  # the gradient row is shared by the ranks; a stale flag would be one rank's only
    row_io = False  # which gradients are zero is known per rank only: whole records move (see DiskExpertStore)

    def __init__(self, keys, numel, compute_dtype, stats, offload_dir: str, cache_experts: int, io_threads: int,
                 region: SharedRegion, owner: bool = True):
        self.region = region
        self._control = _SharedControl(region, 0, list(keys))
        # Only the node leader (`owner`) locks the directory and discards a killed run's files; the other ranks of
        # the node share it under that lock.
        super().__init__(self._control.index.keys(), numel, compute_dtype, stats, offload_dir, cache_experts,
                         io_threads, owner=owner)
        self.steps = self._control.steps

    def _new_record(self, key, buffer, compute=None):
        return SharedExpertRecord(key, buffer, self.compute_dtype, self._control.versions, self._control.index[key],
                                  compute)

    def _write_file(self, key, buffer, rows):
        super()._write_file(key, buffer, rows)
        # The file changed: any other rank's cached copy of this expert is now behind. (This thread owns the
        # expert's WRITING state, so its entry cannot change meanwhile.)
        i = self._control.index[key]
        version = int(self._control.versions[i]) + 1
        self._control.versions[i] = version
        entry = self._entries.get(key)
        if entry is not None and entry.record is not None and entry.record.buffer is buffer:
            entry.record.version = version

    def _drop_if_stale(self, key: ExpertKey) -> None:
        """Lock held. Forget a cached copy older than the node-wide version (another rank wrote the file since)."""
        entry = self._entries.get(key)
        if entry is None or entry.state is not CACHED:
            return
        if entry.record.version == int(self._control.versions[self._control.index[key]]):
            return
        if entry.refs > 0 or entry.dirty:
            raise ExpertStoreError(
                f"expert {key} was changed by another rank while this rank holds a modified or in-use copy: two "
                "ranks used one expert at once. Use the node-shared store only through enable_expert_parallel"
            )
        del self._entries[key]
        self._free.append(entry.index)

    def acquire(self, key, rows=None, give_way=None):
        with self._lock:
            self._drop_if_stale(key)
        return super().acquire(key, rows, give_way)

    def prefetch(self, keys, rows=None):
        keys = list(keys)
        with self._lock:
            for key in keys:
                self._drop_if_stale(key)
        super().prefetch(keys, rows)

    def publish(self, keys: Iterable[ExpertKey] | None = None) -> None:
        """Write back the records this rank modified (among `keys`; all when None) and are not in use, so that the
        next rank to use them reads the current state. In-use records are left for a later publish."""
        with self._lock:
            self._write_back_idle(keys, wait_in_use=False)


def _group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def create_node_shared_store(
    tier: str,
    keys: list[ExpertKey],
    numel: int,
    compute_dtype: torch.dtype,
    stats: OffloadStats,
    group=None,
    shared_dir: str = "/dev/shm",
    offload_dir: str | None = None,
    cache_experts: int | None = None,
    io_threads: int = 2,
) -> tuple[ExpertStore, bool]:
    """Collective over `group` (all its ranks on one node): builds the node-shared store of `tier` ("host" or
    "disk"). Returns (store, is_leader); the leader (lowest rank) is the one that should fill it."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("create_node_shared_store needs torch.distributed: run under `accelerate launch` (or torchrun)")
    ranks = _group_ranks(group)
    hosts: list = [None] * len(ranks)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) != 1:
        raise ValueError(
            f"dynamic expert placement shares one expert store per node, but the group spans hosts {sorted(set(hosts))}:"
            " pass the node-local group (see README: several nodes)"
        )
    leader = dist.get_rank() == ranks[0]
    name = [uuid.uuid4().hex if leader else None]
    dist.broadcast_object_list(name, src=ranks[0], group=group)
    if tier == "host":
        nbytes = SharedHostExpertStore.region_bytes(len(keys), numel)
    elif tier == "disk":
        if not offload_dir or cache_experts is None:
            raise ValueError("the node-shared disk tier needs offload_dir (the same directory on every rank of the "
                             "node) and cache_experts")
        nbytes = _SharedControl.nbytes(len(keys))
    else:
        raise ValueError(f"node-shared stores exist for the host and disk tiers, not {tier!r}")
    path = os.path.join(shared_dir, f"hf_moe_offload-{name[0]}-{tier}")
    error = None
    region = None
    if leader:
        try:
            region = SharedRegion(path, nbytes, create=True)
        except Exception as err:  # tell the other ranks before raising, or they wait forever
            error = repr(err)
            raise_later = err
    status = [error]
    dist.broadcast_object_list(status, src=ranks[0], group=group)
    if status[0] is not None:
        if leader:
            raise raise_later
        raise ExpertStoreError(f"the node leader could not create the shared expert store: {status[0]}")
    try:
        if region is None:
            region = SharedRegion(path, nbytes, create=False)
        if tier == "host":
            store = SharedHostExpertStore(keys, numel, compute_dtype, stats, region)
        else:
            store = SharedDiskExpertStore(keys, numel, compute_dtype, stats, offload_dir, cache_experts, io_threads,
                                          region, owner=leader)
    finally:
        dist.barrier(group=group)  # everyone has mapped it (or failed): the name is no longer needed
        if leader:
            region.unlink()
    logger.info("node-shared %s expert store: %d experts, %.1f MiB shared by ranks %s", tier, len(keys),
                nbytes / 2**20, ranks)
    return store, leader


def private_copy(shared, stats: OffloadStats, offload_dir: str | None):
    """A store of this process's own holding what the node-shared store holds (host memory, or files in
    `offload_dir`), for a process that goes on training alone."""
    if shared.tier == "host":
        private = HostExpertStore(shared.keys(), shared.numel, shared.compute_dtype, stats)
    else:
        private = DiskExpertStore(shared.keys(), shared.numel, shared.compute_dtype, stats, offload_dir,
                                  shared.cache_experts, 2)
    private.copy_experts_from(shared)
    private.flush()
    return private


__all__ = [
    "private_copy",
    "SharedRegion",
    "SharedStepCounts",
    "SharedExpertRecord",
    "SharedHostExpertStore",
    "SharedDiskExpertStore",
    "create_node_shared_store",
]
