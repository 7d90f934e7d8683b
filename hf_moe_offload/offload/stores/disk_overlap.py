"""The disk tier's I/O beside its cache (ES-MoE §4.1): what overlaps compute without taking a cache record.

- Mapped weights: a forward on the CPU computes an uncached expert from its memory-mapped file (`map_weights`), its
  read-ahead an fadvise (`advise`), instead of copying it into a cache record.
- Write-behind: records stepped at the end of a backward are written back while the next forward computes from
  mapped files (`write_behind`), instead of by the eviction that needs their place in the cache.
`DiskExpertStore` (offload/stores/disk_store.py) mixes these in; they use its lock, entries, eviction policy and files.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from .expert_files import ExpertFiles
from .store import ExpertKey

logger = logging.getLogger(__name__)

# The states of a disk-tier cache entry (offload/stores/disk_store.py `_Entry`), compared by identity.
LOADING, CACHED, WRITING = "loading", "cached", "writing"


class DiskOverlap:
    """Mixed into `DiskExpertStore`: mapped weights and write-behind (above)."""

    # --- memory-mapped weights (a forward on the CPU) ---
    @property
    def mappable(self) -> bool:
        """Whether `map_weights` can serve computations: row I/O (a private store: which files change is known) and
        rows already in the compute dtype (no conversion copy to make)."""
        return self.row_io and self.row_dtype == self.compute_dtype

    def map_weights(self, key: ExpertKey) -> torch.Tensor | None:
        """A forward on the CPU (inference, or a training forward: only backward needs the record): `key`'s weights as
        a view of its memory-mapped file (`ExpertFiles.map_weights`), without copying them into the cache, or None
        when the expert has an entry (the cache is current for it: acquire it). A use in the schedule's order, like an
        acquire. Safe: only an entry's write-back writes a file, and an expert without an entry has none in flight
        (see `_Entry`); its update in flight must be waited for first (`UpdateLedger.wait_for_update`), and nothing
        updates it between a forward and its backward."""
        with self._lock:
            if key in self._entries:
                return None
            self.eviction.advance(key)
            return self.files.map_weights(key)

    unmap_weights = staticmethod(ExpertFiles.unmap_weights)

    def advise(self, keys: Iterable[ExpertKey]) -> None:
        """The read-ahead of mapped weights (`ExpertFiles.advise`) for `keys` without a cache entry. Like `prefetch`,
        a no-op for an expert already read ahead for this token and not used yet (the engine's lookahead windows
        overlap: each costs an open, an fadvise and a close)."""
        decode = self.eviction.decode
        with self._lock:
            wanted = []
            for key in keys:
                if key in self._entries or (decode is not None and decode.expecting(key)):
                    continue
                if decode is not None:
                    decode.expect(key)
                wanted.append(key)
        self.files.advise(wanted)

    # --- write-behind ---
    def write_behind(self):
        # A training forward computes from mapped files and leaves the I/O threads idle, while each eviction in the
        # backward that follows would first write its victim back on the thread that needs its place (often the one
        # computing). Records stepped at the end of the last backward are written now instead. Only under the
        # training schedule: a record cleaned and dirtied again before its eviction would be written twice.
        with self._lock:
            if not self.eviction.training:
                return
            keys = [key for key, entry in self._entries.items() if self._behind(key, entry)]
        if keys:
            self._pool.submit(self._write_behind, keys)

    def _behind(self, key: ExpertKey, entry) -> bool:
        """Lock held: whether `write_behind` writes `entry` back now: dirty, idle, not pinned, and not needed again
        within the next `cache_experts` acquisitions of the schedule (a cache of that many records evicts it first)."""
        return (entry.state is CACHED and entry.refs == 0 and entry.dirty and key not in self._pinned
                and self.eviction.not_needed_within(key, self.cache_experts))

    def _write_behind(self, keys: list[ExpertKey]) -> None:
        with self._lock:
            try:
                for key in keys:
                    entry = self._entries.get(key)
                    if entry is not None and self._behind(key, entry):
                        self._write_back(key, entry)
            except Exception as err:  # still dirty: the eviction writes it again and raises in the caller
                logger.debug("write-behind of expert %s failed: %s", key, err)
