"""Layer-granular streaming on an asynchronous device (a GPU; the simulated device in CI).

ES-MoE §4.1 pipelines one expert at a time. On a GPU that is one small GEMM and a dozen launches per expert and matmul
(a profile on an H200: 470 matmuls and ~2,000 launches per MoE layer, the GPU idle 80% of a host-tier step), so a
training call streams a layer's routed experts in chunks instead: a chunk's experts are uploaded (in the store's
compute dtype) into one (k, P) device block and run as one grouped GEMM per matmul, the path the resident experts
take, while the next chunk uploads into the other block (two blocks: double buffering). Backward uploads the chunks
again in reverse, unless a block still holds them, recomputes each chunk's forward and differentiates it once, and
sends the chunk's gradients to the host as one (k, P) block (`GradRing`). k = every expert of the layer where the
device budget allows: then the work launched per layer does not grow with the number of experts.

Upload copies: one per run of experts whose host rows are adjacent (the host tier keeps a layer's weights as one
(E, P) block, so the routed experts of a layer are a few runs); the disk tier's cache records are apart (one copy per
expert). A pinned expert (ES-MoE §4.3) comes from the device: a training call's pins hold their whole state there
(offload/pins/device_pins.py) and compute copies their weights into the block after the upload; otherwise from the stager's
device copy, on the slab's stream.
"""

from __future__ import annotations

import torch

from ...runtime import DeviceRuntime, Event, aligned_nbytes
from ..stores.quantized import upload_weights
from ..stores.store import ExpertKey
from ..telemetry import OffloadStats


class StallTimer:
    """The compute stream's waits for uploads, timed with device events and added to `stats.stall_seconds` once they
    have happened (never blocking the compute thread to read them)."""

    def __init__(self, runtime: DeviceRuntime, stats: OffloadStats):
        self.rt, self.stats = runtime, stats
        self._stalls: list[tuple[Event, Event]] = []

    def wait(self, ready: Event) -> None:
        start = self.rt.now_event()
        self.rt.wait_event(ready)
        self._stalls.append((start, self.rt.now_event()))

    def settle(self, block: bool = False) -> None:
        pending = []
        for start, end in self._stalls:
            if block:
                end.synchronize()
            if end.query():
                self.stats.stall_seconds += self.rt.elapsed(start, end)
            else:
                pending.append((start, end))
        self._stalls = pending


class DeviceSlab:
    """Two (k, P) device blocks in the compute dtype, written by uploads on a copy stream of their own.

    `upload(sources)` fills the next block (after the compute stream is done with what it held: `done`) and returns
    (weights, ready, index); compute waits for `ready` (`wait`) before reading the weights and calls `done(index)`
    after its last use. A block remembers which experts at which versions it holds (`holding`), so that a pass
    finding them still there (a backward after its forward; the recompute of activation checkpointing after the
    forward) skips their upload.
    """

    def __init__(self, runtime: DeviceRuntime, numel: int, dtype: torch.dtype, experts: int, stats: OffloadStats):
        self.rt = runtime
        self.stats = stats
        self.experts = experts
        self.numel = numel
        self.dtype = dtype
        self.stream = runtime.new_stream()
        self.timer = StallTimer(runtime, stats)
        # Each expert's row 16-byte aligned (the grouped GEMM's rule); contiguous, so that one copy fills a run of
        # experts.
        self.stride = aligned_nbytes(numel, dtype) // dtype.itemsize
        self.blocks = [runtime.empty((experts * self.stride,), dtype, stream=self.stream, persistent=True)
                       .as_strided((experts, numel), (self.stride, 1)) for _ in range(2)]
        self.free: list[Event | None] = [None, None]  # after compute's last use of each block
        self.ready: list[Event | None] = [None, None]  # after each block's last upload
        self.holding: list[list[tuple[ExpertKey, int]]] = [[], []]  # (key, version) per row
        self.next = 0

    def reuse(self, held: list[tuple[ExpertKey, int]]) -> tuple[torch.Tensor, Event, int] | None:
        """The block that still holds exactly these (key, version)s, row by row, as `upload` returns it (the next upload
        goes to the other block); None: no block does."""
        for i in (0, 1):
            if self.holding[i] == held:
                self.next = 1 - i
                return self.blocks[i][: len(held)], self.ready[i], i
        return None

    def upload(self, sources: list[tuple[ExpertKey, int, torch.Tensor, Event | None]],
               backward: bool = False) -> tuple[torch.Tensor, Event, int]:
        """Upload each (key, version, source, source_ready) into the next block, one row each in order -> (weights,
        ready, index). `source` is a host row (page-locked), a device copy (a pinned expert, `source_ready` its upload)
        or None (a row the caller fills on the compute stream after `wait`: a device-pinned expert). Host rows adjacent
        in memory go up in one copy. Counted in `stats.h2d_bytes` (host sources; a backward's in
        `h2d_reupload_bytes` too)."""
        rt, i = self.rt, self.next
        self.next = 1 - i
        held = [(key, version) for key, version, _, _ in sources]
        weights = self.blocks[i][: len(sources)]
        rt.wait_event(self.free[i], self.stream)  # compute is done with what the block held
        self.holding[i] = []  # overwritten from here on
        for lo, hi in _runs(sources, self.stride):
            src = sources[lo][2]
            if src is None:
                continue
            if sources[lo][3] is not None:  # a device copy, written on the stager's stream
                rt.wait_event(sources[lo][3], self.stream)
                rt.record_stream(src, self.stream)
            if hi - lo > 1:
                src = src.as_strided((hi - lo, self.numel), (self.numel, 1))
            nbytes = upload_weights(rt, weights[lo:hi] if hi - lo > 1 else weights[lo], src, self.stream)
            if sources[lo][3] is None:  # from the host (a pinned expert's device copy was counted when uploaded)
                self.stats.h2d_bytes += nbytes
                if backward:
                    self.stats.h2d_reupload_bytes += nbytes
        self.ready[i] = rt.record(self.stream)
        self.holding[i] = held
        return weights, self.ready[i], i

    def wait(self, index: int, weights: torch.Tensor) -> None:
        """The compute stream waits for block `index`'s upload before reading `weights` (the chunk's, in that block)."""
        self.timer.wait(self.ready[index])
        self.rt.access(weights)

    def done(self, index: int) -> None:
        """Compute's last use of block `index` is enqueued: the next upload into it waits for this point."""
        self.free[index] = self.rt.record()

    def forget(self) -> None:
        """The store's versions start again (a replaced store): no block holds anything reusable."""
        self.holding = [[], []]


def default_chunk(layer_experts: int, numel: int, dtype: torch.dtype, budget: int | None, cache: int | None,
                  depth: int) -> int:
    """The slab's experts per chunk unless `OffloadConfig.stage_experts` says: a whole layer's, bounded by the device
    memory the slab may take (two blocks) and, on the disk tier, by the host `cache` (two chunks' records beside the
    `depth` reads ahead); 0 where chunks of two do not fit (expert by expert, through the stager's slots)."""
    k = layer_experts
    if budget is not None:
        k = min(k, budget // (2 * numel * dtype.itemsize))
    if cache is not None:
        k = min(k, (cache - depth - 1) // 2)
    return k if k >= 2 else 0


def slab_nbytes(experts: int, numel: int, dtype: torch.dtype) -> int:
    """Device bytes of a slab of `experts` per chunk: two blocks, one aligned row per expert."""
    return 2 * experts * aligned_nbytes(numel, dtype)


def _runs(sources: list, stride: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of `sources` whose tensors follow one another in memory with no gap, in a slab whose experts lie
    `stride` elements apart (a multi-expert copy needs them packed alike on both sides)."""
    out, lo = [], 0
    for j in range(1, len(sources) + 1):
        if j < len(sources):
            a, b = sources[j - 1][2], sources[j][2]
            if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):  # None, or quantized bytes
                out.append((lo, j))
                lo = j
                continue
            numel = a.numel()
            if (stride == numel and a.device == b.device and sources[j][3] is None and sources[j - 1][3] is None
                    and a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous()
                    and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                    and b.storage_offset() == a.storage_offset() + numel):
                continue
        out.append((lo, j))
        lo = j
    return out


__all__ = ["DeviceSlab", "StallTimer", "default_chunk", "slab_nbytes"]
