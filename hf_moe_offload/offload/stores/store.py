"""The expert store: fp32 master weights, gradients and Adam moments of every expert, outside the device.

ES-MoE §4.1: expert state lives in host memory (the `host` tier) or in files with a bounded host cache (the `disk`
tier, "Offloading experts to SSD"); only experts in flight (and pinned ones, §4.3) are on the device.

Every expert is one `ExpertRecord`: a (4, P) fp32 buffer whose rows are [param | grad | exp_avg | exp_avg_sq], so one
expert is one contiguous block in memory and one file on disk. Frozen experts keep the weights row only, in the
model's dtype or quantized (a row of bitsandbytes' bytes, `offload/stores/quantized.py`). Callers see a small interface: `acquire(key, rows)`
(blocks until those rows of the record are in host memory and keeps it there), `release(key, dirty, grad_zeroed)`,
`prefetch(keys, rows)` (the engine knows the forward and reverse-backward order, so reads are issued ahead, never
page-fault driven), `set_schedule(keys)` (that order, for the disk tier's eviction), `flush()`, and the
`Mapping`-like `keys()` / `read_param(key)` / `write_param(key, ...)`.

Each phase asks only for the rows it uses: forward the weights, backward the weights and the gradient (and
the moments where the optimizer steps the expert in that backward), the expert's optimizer step all four. The disk
tier reads and writes just those rows, never reads a gradient that is known to be zero (`release(...,
grad_zeroed=True)` / `clear_grad`) and never writes one back.

While the engine decodes (`set_decode_cache`), the disk tier evicts by decoding's scores instead of the schedule
(offload/inference/policies.py), and a row whose checksum a read already matched since it was written is not checked again.
Where the experts compute on the CPU, a forward (decoding, or training's) can use an expert that is not cached
straight from its memory-mapped file (`map_weights`): the page cache is then the host's cache and nothing is copied;
the I/O threads meanwhile write back what the backward would evict (`write_behind`).

This module holds the record, the interface and the host tier; the disk tier is offload/stores/disk_store.py (its files in
offload/stores/expert_files.py, its eviction in offload/stores/eviction.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from ...errors import ExpertStoreError
from ...runtime import HOST, DeviceRuntime, InlineRuntime
from .quantized import EncodedWeights, ExpertQuantization
from ..telemetry import OffloadStats

ExpertKey = tuple[int, int]  # (MoE layer index, expert index)


STATE_ROWS = 4  # rows of a trainable expert's record: param, grad, exp_avg, exp_avg_sq
ROW_NAMES = ("param", "grad", "exp_avg", "exp_avg_sq")  # the record's rows, in order
PARAM, GRAD, EXP_AVG, EXP_AVG_SQ = range(STATE_ROWS)
WEIGHTS = (PARAM,)  # what a forward reads
WEIGHTS_AND_GRAD = (PARAM, GRAD)  # what a backward reads (and adds its gradient to)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor as a flat memoryview (a view for contiguous tensors: writable, for readinto)."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


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

    `grad_stale`: the gradient row holds an old gradient that counts as zero (the optimizer step does not
    zero it in a separate pass; the next gradient is copied in instead of added). Read the gradient through
    `current_grad()`, add to it through `add_grad()`.

    `decoder` (quantized frozen experts, offload/stores/quantized.py): `param` is a row of bytes in the library's format;
    there is no compute copy: `compute_param()` dequantizes it each time, `upload_source()` hands the bytes to a
    device upload that dequantizes there. Write and read the weights through `set_weights` / `weights`.
    """

    __slots__ = ("key", "buffer", "param", "grad", "exp_avg", "exp_avg_sq", "compute", "grad_stale", "_versions",
                 "_split", "decoder")

    def __init__(self, key: ExpertKey, buffer: torch.Tensor, compute_dtype: torch.dtype,
                 versions: dict[ExpertKey, int] | None = None, compute: torch.Tensor | None = None,
                 decoder: "Decoder | None" = None):
        self.key = key
        self.decoder = decoder
        self._versions = versions if versions is not None else {key: 0}
        self.buffer = buffer
        rows = buffer.unbind(0)
        self.param = rows[0]
        # A weights-only record (frozen experts, `OffloadConfig(train_experts=False)`) has no training state.
        self.grad, self.exp_avg, self.exp_avg_sq = rows[1:] if len(rows) == STATE_ROWS else (None, None, None)
        self.grad_stale = False
        self._split = None
        self.compute = None
        if compute_dtype != buffer.dtype and decoder is None:
            # The disk tier passes its cache record's compute buffer: nothing is allocated (or pinned) per read.
            self.compute = compute if compute is not None else torch.empty(buffer.shape[1], dtype=compute_dtype)
            self.compute.copy_(self.param)

    @property
    def version(self) -> int:
        return self._versions[self.key]

    @version.setter
    def version(self, value: int) -> None:
        self._versions[self.key] = value

    def compute_param(self) -> torch.Tensor:
        """The weights in the compute dtype, on the host: the low-precision copy, or the weights row itself (the DMA
        source); a quantized record's dequantized now, into a new tensor."""
        if self.decoder is not None:
            return self.decoder.quantization.decode(self.param, self.decoder.dtype)
        return self.param if self.compute is None else self.compute

    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        """A quantized record's weights dequantized into `out` ((numel,) in the compute dtype) -> `out`."""
        return self.decoder.quantization.decode(self.param, out.dtype, out=out)

    def upload_source(self) -> "torch.Tensor | EncodedWeights":
        """What a device upload reads (`offload/stores/quantized.py::upload_weights`): `compute_param()`, or a quantized
        record's bytes, dequantized on the device."""
        if self.decoder is not None:
            return EncodedWeights(self.param, self.decoder.quantization, self.decoder.dtype)
        return self.compute_param()

    def weights(self, dtype: torch.dtype = torch.float32, start: int = 0, length: int | None = None) -> torch.Tensor:
        """A copy of the weights (`length` of them from `start`: one tensor of the layout) in `dtype` (a quantized
        record's dequantized)."""
        end = self.param.numel() if length is None else start + length
        if self.decoder is not None:
            flat = self.decoder.quantization.decode(self.param, dtype)
            return flat if length is None else flat[start:end]
        return self.param[start:end].to(dtype, copy=True)

    def set_weights(self, flat: torch.Tensor) -> None:
        """Write the weights (quantized where the record is); the caller then calls `refresh_compute`."""
        if self.decoder is not None:
            self.decoder.quantization.encode(flat, out=self.param)
        else:
            self.param.copy_(flat)

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


class Decoder:
    """A quantized store's format and the dtype its records dequantize to (shared by its records)."""

    __slots__ = ("quantization", "dtype")

    def __init__(self, quantization: ExpertQuantization, dtype: torch.dtype):
        self.quantization, self.dtype = quantization, dtype


class ExpertStore:
    """Interface shared by the tiers; see the module docstring."""

    tier = "?"
    wants_schedule = False  # whether `set_schedule` is used (the engine builds the schedule only then)
    # Whether a cleared gradient may be left stale (`ExpertRecord.clear_grad(lazy=True)`). Node-shared stores say
    # no: the flag is per process, the gradient row is shared with the other ranks.
    lazy_grad_zero = True

    def __init__(self, keys: Iterable[ExpertKey], numel: int, compute_dtype: torch.dtype, stats: OffloadStats,
                 state_rows: int = STATE_ROWS, row_dtype: torch.dtype = torch.float32,
                 quantization: ExpertQuantization | None = None):
        if state_rows not in (1, STATE_ROWS):
            raise ValueError(f"state_rows must be 1 (weights only) or {STATE_ROWS}, got {state_rows}")
        if row_dtype != torch.float32 and state_rows != 1 or quantization is not None and state_rows != 1:
            raise ValueError("only a weights-only store (state_rows=1) keeps its rows in another dtype than fp32 or "
                             "quantized: training needs fp32 masters, gradients and moments")
        # Quantized frozen experts (offload/stores/quantized.py): each record one row of `quantization.nbytes` bytes.
        self.quantization = quantization
        self.decoder = Decoder(quantization, compute_dtype) if quantization is not None else None
        if quantization is not None:
            if quantization.numel != numel:
                raise ValueError(f"the quantization is of {quantization.numel} parameters, the experts have {numel}")
            row_dtype = torch.uint8
        self.row_dtype = row_dtype
        self.row_numel = quantization.nbytes if quantization is not None else numel  # a row's length, in row_dtype
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
        return self.state_rows * self.row_numel * self.row_dtype.itemsize

    def read_param(self, key: ExpertKey) -> torch.Tensor:
        """A copy of the weights of `key`, in fp32."""
        record = self.acquire(key, WEIGHTS)
        try:
            return record.weights(torch.float32)
        finally:
            self.release(key)

    def write_param(self, key: ExpertKey, flat: torch.Tensor, reset_state: bool = True) -> None:
        record = self.acquire(key, None if reset_state else WEIGHTS)
        try:
            self.note_host_write(record)
            record.set_weights(flat)
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
        return ExpertRecord(key, buffer, self.compute_dtype, self.versions, compute, self.decoder)

    def bind_runtime(self, runtime: DeviceRuntime) -> None:
        """The engine computes on `runtime`'s device: page-lock what its uploads read (the DMA sources only: the
        compute copy, or the fp32 weight row; never the gradient and moments)."""
        self.runtime = runtime
        for source in self._dma_sources():
            runtime.pin_(source)

    def _dma_sources(self) -> list[torch.Tensor]:
        return []

    # Whether the tier has `use_compute_dtype(dtype)`: stream copies in `dtype` from now on, each record getting a
    # compute copy made from its weights (under autocast on a device the uploads carry the autocast dtype by
    # default). Called before the engine binds (`bind_runtime` page-locks the DMA sources), only on a store without
    # compute copies. The node-shared stores cannot: their ranks share the weights but would each own the copies.
    switches_compute_dtype = False

    def _check_compute_switch(self, dtype: torch.dtype) -> None:
        if self.compute_dtype != self.row_dtype or self.quantization is not None:
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

    def try_acquire(self, key: ExpertKey, rows: Iterable[int] | None = None) -> ExpertRecord | None:
        """`acquire` where it needs no I/O (the host tier: always); None where it would wait for a read."""
        return self.acquire(key, rows)

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
                 row_dtype: torch.dtype = torch.float32, quantization: ExpertQuantization | None = None):
        super().__init__(keys, numel, compute_dtype, stats, state_rows, row_dtype, quantization)
        row_dtype, row_numel = self.row_dtype, self.row_numel
        by_layer: dict[int, list[int]] = {}
        for layer, e in self._keys:
            by_layer.setdefault(layer, []).append(e)
        self._records: dict[ExpertKey, ExpertRecord] = {}
        # layer -> (its weights (E, P), in the compute dtype, or None when the layer's experts are not exactly 0..E-1)
        self._grouped: dict[int, torch.Tensor | None] = {}
        # What uploads read, page-locked at bind: each layer's (E, P) weights (or compute copies), one registration.
        self._dma: list[torch.Tensor] = []
        with_copies = compute_dtype != row_dtype and quantization is None
        for layer, experts in by_layer.items():
            order = sorted(experts)
            block = _row_block(state_rows, len(order), row_numel, row_dtype)
            copies = torch.empty(len(order), numel, dtype=compute_dtype) if with_copies else None
            for i, e in enumerate(order):
                self._records[(layer, e)] = self._new_record(
                    (layer, e), _own_tensor(block[:, i]), _own_tensor(copies[i]) if with_copies else None)
            weights = copies if with_copies else block[0]
            # (quantized rows are no weights: the layer's experts are dequantized per chunk, `stage_experts`)
            grouped = order == list(range(len(order))) and quantization is None
            self._grouped[layer] = weights if grouped else None
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
        """The weights of every expert of `layer`, (E, P) in the compute dtype, experts in order: a view of the
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


__all__ = [
    "ExpertKey",
    "ExpertRecord",
    "ExpertStore",
    "HostExpertStore",
    "ExpertStoreError",
    "ExpertStoreFullError",
    "CorruptExpertFileError",
]
