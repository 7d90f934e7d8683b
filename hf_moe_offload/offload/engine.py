"""The offload engine: the experts' weights brought to where they compute, their gradients handed on (ES-MoE §4.1).

It owns the store (offload/store.py), binds to the compute device and its runtime at the first forward, and streams
each call's chunks of experts (`stream_chunks`, for the layer of offload/streamed.py): the next ones are read ahead
(disk reads on background threads) and, on a device, uploaded on a side stream (offload/transfers.py one expert at a
time, offload/slab.py a chunk of them) while the current one computes; a backward streams them again in reverse. A
chunk's finished gradients go to the hooks (the expert optimizer, hf_moe_offload.optim), which may step them at once on
the micro-step that closes an accumulation window; the next forward of an expert waits for its own update only (no
staleness, no global barrier). Pinning (ES-MoE §4.3) keeps the most-loaded experts close (`update_pins`; on a device
their whole state: offload/device_pins.py).

On CPU-only machines the "device" is the host: weights are used in place (host tier) or from the disk tier's cache.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..runtime import DeviceRuntime, Event, aligned_nbytes, runtime_for
from .config import OffloadConfig
from .device_cache import DeviceExpertCache
from .device_pins import DevicePins
from .inference import DecodeCache, PlacementCostModel, PreGate
from .pinning import PinChoice
from .plan import GRADS_IN_PLACE, Machine, OffloadPlan, StoreFacts, clamp_depth, pin_room, resolve_plan
from ..layouts import ExpertLayout
from .slab import DeviceSlab
from .store import GRAD, WEIGHTS, WEIGHTS_AND_GRAD, ExpertKey, ExpertRecord, ExpertStore
from .streamed import OffloadedExpertsLayer, Segment
from .telemetry import OffloadStats
from .transfers import DeviceStager, GradArrival, GradHook, GradRing, HostStager

logger = logging.getLogger(__name__)


class UpdateCoordinator(Protocol):
    """Set as `OffloadEngine.coordinator` when several processes share one expert store (hf_moe_offload.distributed,
    ES-MoE §4.2 dynamic placement): it says which process steps each expert in the current accumulation window and
    reduces the optimizer's global checks across processes. None (the default) = this process owns every expert."""

    def owns_update(self, key: ExpertKey) -> bool: ...

    def all_reduce_sum(self, value: float) -> float: ...

    def all_reduce_max(self, value: float) -> float: ...

    def pinned_keys(self) -> list[ExpertKey]: ...

    def window_closed(self) -> None: ...


class OffloadEngine:
    """Owns the store, the device stager and the per-layer streaming; the expert optimizer plugs in here.

    The compute device is the device of the first streamed input (or `OffloadConfig.device`, checked against the
    inputs): the engine binds to it and its runtime (hf_moe_offload.runtime) then, so each accelerate process uses its
    own device.
    """

    grad_ring_size = 4  # gradient download buffers in flight (asynchronous runtimes)

    def __init__(self, store: ExpertStore, layers_modules: list[tuple[nn.Module, ExpertLayout]], config: OffloadConfig,
                 stats: OffloadStats, mode: str, pregate: PreGate | None = None):
        # The user's settings (a copy): what depends on the device is resolved once, at `bind`; `inference` per call.
        self.config = dataclasses.replace(config)
        self.store = store
        self.stats = stats
        self.mode = mode
        self.device: torch.device | None = None  # bound on the first forward
        self.runtime: DeviceRuntime | None = None
        self.stager: DeviceStager | HostStager | None = None
        cache = getattr(store, "cache_experts", None)
        self._cache = cache
        self.depth = clamp_depth(config.prefetch_depth, cache)
        self.pin_fraction = config.pin_fraction
        self.train_experts = config.train_experts  # False (frozen experts, e.g. LoRA): input gradients only
        self.layers = [OffloadedExpertsLayer(self, i, m, layout) for i, (m, layout) in enumerate(layers_modules)]
        # --- resolved at bind (offload/plan.py) ---
        self.plan: OffloadPlan | None = None
        self._staging: torch.Tensor | None = None
        self.slab: DeviceSlab | None = None  # a device's training calls (offload/slab.py)
        self.device_pins: DevicePins | None = None  # training on a device: pins' whole state there (device_pins.py)
        # Fiddler's compute-on-host choice (asynchronous runtimes): measured at bind when OffloadConfig.compute_on_host
        # allows, or given.
        self.cost_model: PlacementCostModel | None = None
        self.device_cache: DeviceExpertCache | None = None  # decoding on a device (offload/device_cache.py)
        self._device_cache_tried = False  # opened (or found no room) since inference began
        self.peak_in_flight = 0  # the most experts one `stream` had in flight at once (tests, benchmarks)
        self.pregate = pregate  # OffloadConfig.pregate: dropped at bind where the plan says so
        self._guessed: list[ExpertKey] = []  # pre-gating's guess of the next layer, to upload after this layer's own
        # --- streaming and gradients ---
        self._grad_rings: dict[torch.dtype, GradRing] = {}  # chunks' gradients on their way to the host, by dtype
        # Host-side work of asynchronous runtimes, in order on one thread: releasing records once their upload has
        # happened, landing gradients nobody else takes.
        self._host_worker: ThreadPoolExecutor | None = None
        self._host_jobs: deque[Future] = deque()
        self._grad_jobs: dict[ExpertKey, Future] = {}
        self._pending: dict[ExpertKey, Future] = {}  # expert updates in flight (set by the optimizer)
        # Hooks by handle id (`add_grad_hook`, `add_layer_done_hook`: each returns a handle that removes it).
        # (OrderedDicts: a handle holds a weak reference to its dict.)
        self._grad_hooks: OrderedDict[int, GradHook] = OrderedDict()
        self._layer_done_hooks: OrderedDict[int, Callable[[int], None]] = OrderedDict()
        # `add_grad_hook(..., steps_now=)`: whether a hook steps the experts it takes in the backward that hands them
        # over (`backward_rows`).
        self._steps_now: OrderedDict[int, Callable[[], bool]] = OrderedDict()
        self._warned_no_optimizer = False
        self.coordinator: UpdateCoordinator | None = None  # several processes sharing the store
        self._state_dict_experts = True  # `experts_left_out_of_state_dict`
        # --- inference (offload/inference.py): the mode of the current call ---
        self.inference = False
        # Decoding's use scores (OffloadConfig.decode_cache_decay): the disk tier's eviction and, on an asynchronous
        # device, which experts keep a device copy (`pin_hot_experts`).
        self.decode_cache = DecodeCache(len(self.layers), cache if cache is not None else len(store.keys()),
                                        config.decode_cache_decay)
        self.decode_pin_interval = 16  # tokens between two choices of the hot experts to keep on the device
        # --- pinning (ES-MoE §4.3) ---
        self.pin_choice = PinChoice(self.pin_fraction)
        self.pinned: list[ExpertKey] = []  # best first, at most `pin_limit`

    # --- device binding ---
    def bind(self, device: torch.device) -> None:
        """Bind to the compute device of the inputs (first call), or check that the inputs are still there."""
        if self.device is not None:
            if device != self.device:
                raise RuntimeError(
                    f"the offloaded experts compute on {self.device} (where this model's first forward ran) but got "
                    f"inputs on {device}: keep the model's non-expert weights and its inputs on one device (under "
                    "accelerate, each process offloads its own copy of the model and uses accelerator.device)"
                )
            return
        if self.config.device is not None and device != _normalized(self.config.device):
            raise RuntimeError(
                f"OffloadConfig.device is {self.config.device} but the inputs are on {device}: move the model "
                "and its inputs there, or leave OffloadConfig.device unset (the engine then uses the inputs' device)"
            )
        self.device = device
        self.runtime = runtime_for(device)
        self.plan = plan = resolve_plan(self.config, Machine.of(self.runtime, device), StoreFacts.of(self.store),
                                        [layer.num_experts for layer in self.layers], self.depth,
                                        shared_store=self.coordinator is not None, where=str(device))
        if plan.compute_dtype != self.store.compute_dtype:
            self.store.use_compute_dtype(plan.compute_dtype)
            logger.info("expert offload: streaming %s copies of the experts (autocast at the first forward)",
                        plan.compute_dtype)
        if plan.slab_experts:
            self.slab = DeviceSlab(self.runtime, self.store.numel, plan.compute_dtype, plan.slab_experts, self.stats)
        elif plan.waits_for_device:
            logger.info("expert offload: no room for the slab's two chunks (host cache %s experts): streaming one "
                        "expert at a time", self._cache)
        if plan.device_pins:
            self.device_pins = DevicePins(self.runtime, self.store, plan.device_pins, self.stats)
        self.store.bind_runtime(self.runtime)
        stager = DeviceStager if plan.waits_for_device else HostStager
        self.stager = stager(self.runtime, self.store.numel, self.store.compute_dtype, max(self.depth, 1), self.stats)
        if not plan.pregate:
            self.pregate = None
        if plan.measure_host_compute and self.cost_model is None:
            self.cost_model = PlacementCostModel.measure(self.runtime, self.store.numel, self.store.compute_dtype)
        logger.debug("expert offload: computing on %s (runtime %s)", device, self.runtime.name)

    @property
    def stage_experts(self) -> int:
        """The disk tier on the host: experts per staged chunk (1 before bind)."""
        return 1 if self.plan is None else self.plan.stage_experts

    @property
    def keep_activations(self) -> bool:
        return self.plan is not None and self.plan.keep_activations

    @property
    def map_files(self) -> bool:
        return self.plan is not None and self.plan.map_files

    @property
    def pin_limit(self) -> int | None:
        """Pins the disk tier's cache has room for beside the records in flight (offload/plan.py `pin_room`)."""
        return pin_room(self._cache, self.depth) if self.plan is None else self.plan.pin_limit

    @contextmanager
    def training_threads(self):
        """The experts of a training call computing on the CPU use `compute_threads` intra-op threads (default: one
        fewer than torch's, at least 1): the expert optimizer's steps and the disk tier's reads and write-backs run
        alongside on their own threads (ES-MoE §4.1's overlap), and with every core in the experts' OpenMP teams
        they wait on each other (measured faster on both tiers: benchmarks/RESULTS.md, "the experts' threads").
        An asynchronous device computes elsewhere: nothing changes there."""
        before = torch.get_num_threads()
        wanted = self.config.compute_threads if self.config.compute_threads is not None else max(1, before - 1)
        if self.plan is None or not self.plan.limit_compute_threads or wanted == before:
            yield
            return
        torch.set_num_threads(wanted)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _admit_pins(self, keys: list[ExpertKey]) -> None:
        """A training forward is about to use these: pins among them that wait to come up do, once their gradient
        has landed and their update is done (which the forward would wait for anyway)."""
        pins = self.device_pins
        for key in keys:
            if key in pins.pending:
                self.wait_for_grad(key)
                self.wait_for_update(key)
                pins.admit(key)

    def release_device_pins(self) -> None:
        """The device-pinned experts' state back into the store (they stay pinned, pending: their next training
        forward brings them up again): before anything reads or writes the store from outside training."""
        if self.device_pins is not None and len(self.device_pins):
            self.wait_in_flight()
            self.device_pins.release_all()
            self._sync_stager_pins()

    def staging_block(self) -> torch.Tensor:
        """(stage_experts, P) in the store's compute dtype, each row 64-byte aligned: the weights of a staged chunk."""
        if self._staging is None:
            numel, dtype = self.store.numel, self.store.compute_dtype
            stride = -(-numel * dtype.itemsize // 64) * 64 // dtype.itemsize
            self._staging = torch.empty(self.stage_experts * stride, dtype=dtype).as_strided(
                (self.stage_experts, numel), (stride, 1))
        return self._staging

    def freeze_experts(self) -> None:
        """The experts are not trained from now on (LoRA on the other parts): backward gives input gradients only."""
        self.train_experts = False

    # --- inference (offload/inference.py) ---
    def inference_for(self, module: nn.Module) -> bool:
        """Whether a call of `module` runs in inference mode (decode cache, pre-gating, compute on host)."""
        if self.config.inference is not None:
            return self.config.inference
        return not torch.is_grad_enabled() or not module.training

    def enter_call(self, layer: int, inference: bool, evaluating: bool = True) -> bool:
        """A layer's call begins in this mode: the store switches its eviction policy when the mode changes, and
        the decode cache counts a token at layer 0. The device cache opens at the first inference call of a model
        in eval mode (`evaluating`; or `OffloadConfig.inference=True`), not for a training model's no-grad forward
        (a reentrant activation checkpoint's), and closes when training resumes. Returns `inference`."""
        if inference != self.inference:
            self.inference = inference
            set_policy = getattr(self.store, "set_decode_cache", None)
            if set_policy is not None:
                set_policy(self.decode_cache if inference else None)
            if not inference:
                self._close_device_cache()
                self._device_cache_tried = False
        if inference and not self._device_cache_tried and (evaluating or self.config.inference):
            self._device_cache_tried = True
            self._open_device_cache()
        if inference and layer == 0:
            self.decode_cache.next_token()
            if (self.plan is not None and self.plan.decode_device_copies and self.pin_fraction
                    and self.device_cache is None and self.decode_cache.tick % self.decode_pin_interval == 1):
                self.pin_hot_experts()
        return inference

    def _open_device_cache(self) -> None:
        """Decoding starts on an asynchronous device (one process): the device expert cache (offload/device_cache.py),
        `OffloadConfig.device_cache_bytes` of device memory, by default half of what is free now; capacity at most
        every expert."""
        if self.plan is None or not self.plan.decode_device_copies or self.coordinator is not None:
            return
        budget = self.config.device_cache_bytes
        if budget is None:
            free = self.runtime.free_memory()
            budget = 0 if free is None else free // 2
        dtype = self.store.compute_dtype
        capacity = min(len(self.store), budget // aligned_nbytes(self.store.numel, dtype))
        if capacity < 1:
            return
        self.device_cache = DeviceExpertCache(self.runtime, self.store.numel, dtype, capacity, self.stager.stream,
                                              self.decode_cache.score, self.stats)
        self._sync_stager_pins()
        logger.debug("expert offload: device expert cache of %d experts (%.1f MiB)", capacity,
                     self.device_cache.nbytes / 2**20)

    def upload_ahead(self, keys: list[ExpertKey]) -> None:
        """Pre-gating on a device: upload the next layer's guessed experts into the device cache while this layer
        computes, once this layer's own uploads are enqueued (`stream`: one copy stream, first in first out): those
        whose weights are in host memory by then (the disk tier's reads ahead are the host cache's `prefetch`) and
        that the cache admits (offload/device_cache.py)."""
        self._guessed = keys if self.device_cache is not None else []

    def _upload_guessed(self) -> None:
        keys, self._guessed = self._guessed, []
        cache = self.device_cache
        for key in keys:
            version = self.store.versions[key]
            if key in self._pending or self._on_device(key) or cache.holds(key, version):
                continue
            record = self.store.try_acquire(key, WEIGHTS)
            if record is None:
                continue
            kept = cache.upload(key, version, record.upload_source())
            if kept is None:
                self.store.release(key)
                continue
            _, ready, done = kept
            done()  # no compute use: the slot's next upload waits for this point only
            self._release_after(key, ready)
            self.stats.pregate_uploads += 1

    def _close_device_cache(self) -> None:
        """Training resumes: the cache's memory goes back (once compute is done with it)."""
        if self.device_cache is not None:
            self.device_cache.close()
            self.device_cache = None
            pins = self.device_pins
            self._sync_stager_pins(set() if pins is None else set(pins.keys()) | pins.pending)
            self.runtime.release_cached_memory()

    def pin_hot_experts(self) -> None:
        """Decoding on an asynchronous device: keep a device copy of each layer's `pin_fraction` hottest experts by
        decoding's use scores (mixtral-offloading's per-layer expert cache on the GPU; ES-MoE §4.3's pinning, chosen
        by recent use instead of the last training step's load). Their uploads are then reused across tokens."""
        self._set_pins(self.pin_choice.top(self.layers, self.decode_cache.score))

    def compute_on_host(self, key: ExpertKey, tokens: int, x: torch.Tensor) -> bool:
        """The cost model's choice for one expert of an inference call: host compute, unless a current device copy
        (a pinned expert) makes its upload free."""
        if (key in self.stager.pinned_keys or self._on_device(key)
                or self.device_cache is not None and key in self.device_cache):
            return False
        layout = self.layers[key[0]].layout
        weight_bytes = self.store.numel * self.store.compute_dtype.itemsize
        return self.cost_model.compute_on_host(tokens, 2.0 * layout.decay_numel, weight_bytes,
                                               x.shape[-1] * x.element_size())

    def replace_store(self, store: ExpertStore) -> None:
        """Swap the expert store (node-shared <-> private, hf_moe_offload.distributed): device copies made from the
        old one are dropped, since the new store counts versions afresh."""
        self.release_device_pins()  # into the old store, which the new one is made from
        self.wait_in_flight()
        self.store = store
        if self.device_pins is not None:
            self.device_pins.store = store
        for layer in self.layers:
            layer.forget_buffers()
        if self.runtime is not None:
            store.bind_runtime(self.runtime)
        if self.stager is not None:
            self.stager.drop_copies()
        self._close_device_cache()
        if self.slab is not None:
            self.slab.forget()

    def _submit_host(self, fn, *args) -> Future:
        if self._host_worker is None:
            self._host_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expert-host")
        fut = self._host_worker.submit(fn, *args)
        self._host_jobs.append(fut)
        while self._host_jobs and self._host_jobs[0].done():
            self._host_jobs.popleft().result()  # surfaces an error of a finished job
        return fut

    def _release_after(self, key: ExpertKey, ready: Event | None) -> None:
        """Hand a record back to the store once the upload that reads it has happened (a disk-tier slot or an
        update could overwrite it otherwise). Waited for on the host worker, never on the compute thread."""
        if ready is None or self.store.tier == "host" and self.coordinator is None:
            # Host tier: the record never moves, and its next write (an update) is ordered after this upload by the
            # gradient download it follows.
            self.store.release(key)
            return

        def release():
            ready.synchronize()
            self.store.release(key)

        self._submit_host(release)

    # --- streaming ---
    def stream(self, layer: int, expert_ids: list[int], keep: bool = False, phase: str = "inference") -> Iterator:
        """Yields each expert's compute weights in order, `depth` experts ahead; with keep=True also the record,
        which the caller must hand back (`chunk_grads_arrived`, `release_record`: backward). `phase` ("forward" of training,
        "backward", "inference") tells the store what comes next (`_schedule`)."""
        keys = [(layer, e) for e in expert_ids]
        # Only the rows this phase uses: weights; in a training backward `backward_rows`.
        rows = self.backward_rows(layer) if keep else WEIGHTS
        # A forward computes uncached experts from their mapped files: nothing for it to acquire or release.
        mapping = self.map_files and not keep
        if self.store.wants_schedule and not self.inference:  # decoding: the decode cache's scores instead
            self.store.set_schedule(self._schedule(layer, keys, phase))
        cache = self.device_cache if phase == "inference" else None
        self.read_ahead(keys, rows, mapping)
        if phase == "forward" and mapping:
            self.store.write_behind()  # the I/O threads have nothing else to do until the backward
        inflight: deque = deque()
        held = [0]  # entries of `inflight` holding a store record
        nxt = 0
        t_start = time.perf_counter()
        stager = self.stager
        pins = self.device_pins
        if pins is not None and phase == "forward":
            self._admit_pins(keys)
        stager.timer.settle()

        def issue() -> None:
            nonlocal nxt
            key = keys[nxt]
            nxt += 1
            t0 = time.perf_counter()  # host-side waits: the expert's update, a disk read
            self.wait_for_update(key)
            mapped = self.store.map_weights(key) if mapping else None
            if pins is not None and key in pins:  # its state is on the device: nothing acquired or uploaded
                inflight.append((key, None, pins.weights(key), None, None, False))
            elif cache is not None and (hit := cache.hit(key, self.store.versions[key])) is not None:
                inflight.append((key, None, *hit, False))  # decoding: current in the device cache, nothing moves
            elif mapped is not None:  # computed from its mapped file: nothing acquired, nothing to release
                inflight.append((key, None, mapped, None, None, True))
            else:
                record = self.store.acquire(key, rows)
                inflight.append((key, record, *stager.upload(key, record, cache), False))
                held[0] += 1
            self.stats.stall_seconds += time.perf_counter() - t0
            if nxt + self.depth < len(keys):
                self.prefetch(keys[nxt : nxt + self.depth + 1], rows, mapping)
            elif nxt == len(keys) and self._guessed and cache is not None:
                self._upload_guessed()  # pre-gating's uploads queue behind this layer's own

        def room() -> bool:
            """Whether to issue the next expert: while at most `depth` are in flight; decoding with the device cache
            enqueues a layer's uploads all at once (batched per layer), bounded only by the ring slots and the disk
            tier's records still held (what the cache serves or keeps holds neither)."""
            if cache is None or not inflight:
                return len(inflight) <= self.depth
            return stager.ring_in_flight <= self.depth and (self.store.tier == "host" or held[0] <= self.depth)

        try:
            while nxt < len(keys) or inflight:
                while nxt < len(keys) and room():
                    issue()
                self.peak_in_flight = max(self.peak_in_flight, len(inflight))
                key, record, weights, ready, done, mapped = inflight.popleft()
                held[0] -= record is not None
                stager.wait(ready, weights)  # device-side wait: timed with events
                handed_over = False
                try:
                    if keep:
                        handed_over = True
                        yield weights, record
                    else:
                        yield weights
                finally:
                    if done is not None:
                        done()  # compute's last use of the upload is enqueued
                    if mapped and not self.inference:  # decoding reuses its hot experts' pages
                        self.store.unmap_weights(weights)
                    if not handed_over and record is not None:
                        self._release_after(key, ready)
        finally:
            for key, record, _weights, ready, done, _mapped in inflight:  # interrupted: hand back what was acquired
                if done is not None:
                    done()  # never used by compute: the slot is free again
                if record is not None:
                    self._release_after(key, ready)
            self.stats.compute_seconds += time.perf_counter() - t_start

    def stream_chunks(self, layer: int, source: str, chunks: list[list[Segment]], phase: str) -> Iterator:
        """The weights of each chunk of `layer`'s segments where the experts compute, in the given order (a backward
        passes them reversed): yields (chunk, rows, records). `source` (streamed.ChunkPlan): "slab" (a device block,
        `_slab_chunks`), "layer" (the host tier's (E, P) block, `_layer_chunk`), "staged" (one by one through `stream`,
        copied into the staging block), "expert" (one by one through `stream`). `rows`: (k, P), or for "expert" the
        expert's (P,) weights. In a "backward" the
        caller owns `records` (one per segment; None where nothing was acquired: a device-pinned expert, an expert
        without rows) and hands them over with the gradients (`chunk_grads_arrived`) or `release_record`s them; in a
        "forward" or "inference" `records` is None and the stream hands them back itself."""
        if source == "slab":
            return self._slab_chunks(layer, chunks, phase)
        if source == "layer":
            return self._layer_chunk(layer, chunks, phase)
        return self._expert_chunks(layer, chunks, phase, staged=source == "staged")

    def _layer_chunk(self, layer: int, chunks: list[list[Segment]], phase: str) -> Iterator:
        """The host tier computing on the host: every expert of the layer at once, from the store's (E, P) block,
        once their pending updates are in."""
        (chunk,) = chunks
        t0 = time.perf_counter()
        for e, _, _ in chunk:
            self.wait_for_update((layer, e))
        self.stats.stall_seconds += time.perf_counter() - t0
        records = None
        if phase == "backward":
            rows = self.backward_rows(layer)
            records = [self.store.acquire((layer, e), rows) if n else None for e, _, n in chunk]
        weights = self.store.grouped_weights(layer, used=0 if records is not None else sum(1 for s in chunk if s[2]))
        t_start = time.perf_counter()
        try:
            yield chunk, weights, records
        finally:
            self.stats.compute_seconds += time.perf_counter() - t_start

    def _expert_chunks(self, layer: int, chunks: list[list[Segment]], phase: str, staged: bool) -> Iterator:
        """Chunks of the per-expert `stream`: each expert's weights as they come (k = 1), or, `staged` (the disk tier
        computing on the host), a chunk's weights copied into the staging block as the stream yields them (its records
        go back to the cache as soon as they are copied in a forward)."""
        keep = phase == "backward"
        order = [e for chunk in chunks for e, _, _ in (reversed(chunk) if keep else chunk)]
        stream = self.stream(layer, order, keep=keep, phase=phase)
        held: list[tuple[ExpertKey, ExpertRecord]] = []  # handed over by the stream for the chunk being staged
        try:
            for chunk in chunks:
                if not staged:
                    item = next(stream)
                    yield (chunk, item[0], [item[1]]) if keep else (chunk, item, None)
                    continue
                block = self.staging_block()
                records: list[ExpertRecord | None] = [None] * len(chunk)
                for i in (reversed(range(len(chunk))) if keep else range(len(chunk))):
                    item = next(stream)
                    if keep:
                        item, records[i] = item
                        held.append(((layer, chunk[i][0]), records[i]))
                    block[i].copy_(item)
                held = []
                yield chunk, block[: len(chunk)], records if keep else None
        finally:
            for key, record in held:  # interrupted while staging: hand back what the stream handed over
                self.release_record(key, record)
            stream.close()

    def _slab_chunks(self, layer: int, chunks: list[list[Segment]], phase: str) -> Iterator:
        """The slab's pipeline (offload/slab.py): each chunk's rows in a device block, the next chunk's upload
        enqueued before this one is yielded (double buffering); a backward's chunk a block still holds from the
        forward is not uploaded again."""
        keep = phase == "backward"
        slab, store, pins = self.slab, self.store, self.device_pins
        if pins is not None and phase == "forward":
            self._admit_pins([(layer, e) for chunk in chunks for e, _, _ in chunk])
        keys_all = [(layer, e) for chunk in chunks for e, _, _ in chunk if not self._on_device((layer, e))]
        rows_wanted = self.backward_rows(layer) if keep else WEIGHTS
        if store.wants_schedule and not self.inference:
            store.set_schedule(self._schedule(layer, keys_all, phase))
        self.read_ahead(keys_all, rows_wanted, False)
        t_start = time.perf_counter()
        slab.timer.settle()
        pending: deque = deque()  # (chunk, keys, records, rows, ready, index), at most two: one per block
        issued = 0
        try:
            while issued < len(chunks) or pending:
                while issued < len(chunks) and len(pending) < 2:
                    issued += 1
                    pending.append(self._upload_chunk(layer, chunks[issued - 1], chunks[issued : issued + 1],
                                                      rows_wanted, keep))
                chunk, keys, records, rows, ready, index = pending.popleft()
                slab.wait(index, rows)
                if pins is not None:
                    placed = [i for i, record in enumerate(records) if record is None]
                    pins.place(rows, placed, [keys[i] for i in placed])
                try:
                    yield chunk, rows, records if keep else None  # a backward's records are the caller's now
                finally:
                    slab.done(index)
                    if not keep:
                        for key, record in zip(keys, records):
                            if record is not None:
                                self._release_after(key, ready)
        finally:
            for _, keys, records, _, ready, _ in pending:  # interrupted: hand back what was acquired
                for key, record in zip(keys, records):
                    if record is not None:
                        self._release_after(key, ready)
            self.stats.compute_seconds += time.perf_counter() - t_start

    def _on_device(self, key: ExpertKey) -> bool:
        """A device-pinned expert (offload/device_pins.py): neither acquired nor uploaded; compute places it."""
        return self.device_pins is not None and key in self.device_pins

    def _upload_chunk(self, layer: int, chunk: list[Segment], after: list[list[Segment]], rows_wanted,
                      backward: bool) -> tuple:
        """Acquire a chunk's records (once their updates are done), start reading the next chunk's (`after`), and
        enqueue its upload into the next slab block, unless a backward finds it still in a block ->
        (chunk, keys, records, rows, ready, block index)."""
        store, slab, pins = self.store, self.slab, self.device_pins
        t0 = time.perf_counter()  # host-side waits: the experts' updates, disk reads
        keys = [(layer, e) for e, _, _ in chunk]
        records: list[ExpertRecord | None] = []
        try:
            for key in keys:
                if self._on_device(key):
                    records.append(None)
                    continue
                self.wait_for_update(key)
                records.append(store.acquire(key, rows_wanted))
            self.stats.stall_seconds += time.perf_counter() - t0
            ahead = [(layer, e) for c in after for e, _, _ in c if not self._on_device((layer, e))]
            if ahead:
                self.prefetch(ahead[: self.depth + 1], rows_wanted, False)
            held = [(key, pins.version(key) if record is None else record.version)
                    for key, record in zip(keys, records)]
            # A backward may find the chunk still in a block (the forward's last chunks): no upload.
            reused = slab.reuse(held) if backward else None
            if reused is None:
                sources = []
                for (key, version), record in zip(held, records):
                    if record is None:  # placed from the device pins by compute (`_slab_chunks`)
                        sources.append((key, version, None, None))
                    elif key in self.stager.pinned_keys:  # its device copy (ES-MoE §4.3 pinning)
                        copy, copy_ready, _ = self.stager.upload(key, record)
                        sources.append((key, version, copy, copy_ready))
                    else:
                        sources.append((key, version, record.upload_source(), None))
                reused = slab.upload(sources, backward=backward)
        except BaseException:  # what was acquired goes back (after the compute enqueued so far, as a stream's would)
            for key, record in zip(keys, records):
                self.release_record(key, record)
            raise
        return (chunk, keys, records, *reused)

    def read_ahead(self, keys: list[ExpertKey], rows, mapped: bool) -> None:
        """Start reading the first `depth + 1` of `keys`, the experts a streamed loop is about to acquire. In inference
        the first one is left to the thread that computes it: handing it to an I/O thread and waiting costs two thread
        switches and overlaps next to nothing while decoding (few tokens)."""
        self._read(self._not_in_device_cache(keys)[1 if self.inference else 0 : self.depth + 1], rows, mapped)

    def prefetch(self, keys: list[ExpertKey], rows, mapped: bool) -> None:
        """Start reading `keys` into the store's cache; for a forward computing from `mapped` files, the kernel's
        read-ahead of their weights instead (a copy into the cache would not be used)."""
        self._read(self._not_in_device_cache(keys), rows, mapped)

    def _not_in_device_cache(self, keys: list[ExpertKey]) -> list[ExpertKey]:
        """Decoding: what the device cache holds needs no host copy (a read would evict one that does)."""
        cache = self.device_cache
        return keys if cache is None else [key for key in keys if key not in cache]

    def _read(self, keys: list[ExpertKey], rows, mapped: bool) -> None:
        if mapped:
            self.store.advise(keys)
        else:
            self.store.prefetch(keys, rows)

    def backward_rows(self, layer: int) -> tuple[int, ...] | None:
        """The rows a training backward of `layer` reads (None: all): the weights and the gradient's slot; also the
        Adam moments where the expert optimizer steps each expert in this backward (the layer's last call of the
        micro-step ends its window: `add_grad_hook`'s `steps_now`). ES-MoE §4.1: the step's reads then run ahead on
        the I/O threads with the weights', instead of on the optimizer's worker once the gradient is in, while the
        record holds its slot."""
        if not self.train_experts:
            return WEIGHTS
        if (self.coordinator is None and self.layers[layer].outstanding <= 1
                and any(f() for f in self._steps_now.values())):
            return None
        return WEIGHTS_AND_GRAD

    def _schedule(self, layer: int, current: list[ExpertKey], phase: str) -> list[ExpertKey]:
        """The acquisitions to come (ES-MoE's known order), for the disk tier's eviction: this call's experts, the
        rest of this pass, the backward in reverse (training), and the next step's passes up to this layer again.
        The experts of the other layers are predicted from their last routing."""
        def fwd(l: int) -> list[ExpertKey]:
            return [(l, e) for e, n in enumerate(self.layers[l].last_counts) if n]

        n = len(self.layers)
        if phase == "forward":
            passes = [fwd(l) for l in range(layer + 1, n)] + [fwd(l)[::-1] for l in reversed(range(n))]
            passes += [fwd(l) for l in range(layer + 1)]
        elif phase == "backward":
            passes = [fwd(l)[::-1] for l in reversed(range(layer))] + [fwd(l) for l in range(n)]
            passes += [fwd(l)[::-1] for l in reversed(range(layer, n))]
        else:
            passes = [fwd(l) for l in range(layer + 1, n)] + [fwd(l) for l in range(layer + 1)]
        return list(current) + [key for keys in passes for key in keys]

    # --- gradients and updates ---
    def chunk_grads_arrived(self, layer: int, chunk: list[Segment], records: list[ExpertRecord | None],
                            grads: tuple[torch.Tensor, ...]) -> None:
        """A chunk's expert gradients ((k, ...) per tensor, layout order, in the dtype the GEMMs produced them in;
        none: frozen experts) on their way into the store's fp32 slots, the records `stream_chunks` handed over with
        them. Where the host computes: each expert's rows of autograd's tensors, as its arrival. On a device: the rows
        of the experts with tokens go down as one (k, P) block on the gradient stream (`GradRing`), each row handed
        over as its arrival (landed by whoever takes it; the buffer is reused once all are); device-pinned experts'
        (record None) stay on the device, added in one indexed add (offload/device_pins.py)."""
        routed = [i for i, (_, _, n) in enumerate(chunk) if n]
        keys = [(layer, chunk[i][0]) for i in routed]
        if not grads:
            for i, key in zip(routed, keys):
                self.release_record(key, records[i])
            return
        rt = self.runtime
        if self.plan.gradients == GRADS_IN_PLACE:
            views = self.layers[layer].layout.views
            self.grads_arrived(layer, [(key, records[i], GradArrival.on_host(rt, [g[i] for g in grads], views))
                                       for i, key in reversed(list(zip(routed, keys)))])
            return
        flat = torch.cat([g.reshape(g.shape[0], -1) for g in grads], dim=1)
        if len(routed) < len(chunk):
            flat = flat.index_select(0, torch.tensor(routed, device=flat.device))
        records = [records[i] for i in routed]
        on_device = [i for i, record in enumerate(records) if record is None]
        if on_device:  # device-pinned experts: their gradients stay on the device
            self.device_pins.add_grads([keys[i] for i in on_device],
                                       flat.index_select(0, torch.tensor(on_device, device=flat.device)))
            if len(on_device) == len(keys):
                return
            host = [i for i, record in enumerate(records) if record is not None]
            flat = flat.index_select(0, torch.tensor(host, device=flat.device))
            keys, records = [keys[i] for i in host], [records[i] for i in host]
        k = len(keys)
        ring = self._grad_rings.get(flat.dtype)
        if ring is None:
            per_chunk = self.slab.experts if self.slab is not None else 1
            ring = self._grad_rings[flat.dtype] = GradRing(rt, per_chunk * self.store.numel, flat.dtype,
                                                           self.grad_ring_size)
        block = ring.send(flat.reshape(-1))
        self.stats.d2h_bytes += flat.numel() * flat.element_size()
        if k == 1:
            self.grads_arrived(layer, [(keys[0], records[0], block)])
            return
        rows = block.buffer.view(k, self.store.numel).unbind(0)  # one op, not one per expert
        left = [k]
        lock = threading.Lock()

        def landed() -> None:  # the last row landed: the buffer goes back to the ring
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                block.release()

        self.grads_arrived(layer, [(key, record, GradArrival(rt, rows[i], block.event, landed))
                                   for i, (key, record) in enumerate(zip(keys, records))])

    def grads_arrived(self, layer: int, items: list[tuple[ExpertKey, ExpertRecord, GradArrival]]) -> None:
        """These experts of `layer` have their gradients on the way (a chunk's at once, so that the expert optimizer
        can step them several per fused call)."""
        for key, _, _ in items:
            self.store.has_grad[key] = True
        self._hand_over(layer, items)

    def _hand_over(self, layer: int, items: list[tuple[ExpertKey, ExpertRecord, GradArrival]]) -> None:
        """Gradients of `layer`'s experts on their way to the store: to the hooks if they are final, else (or what
        no hook takes) landed and released by the engine."""
        final = self.layers[layer].outstanding <= 1  # more calls of this layer still to run backward (partitions)
        if final:
            if not self._grad_hooks and not self._warned_no_optimizer:
                self._warned_no_optimizer = True
                logger.warning(
                    "expert gradients are accumulating in the offload store but no ExpertOptimizer is attached, so "
                    "the experts will not be updated: add ExpertOptimizerCallback() to the Trainer (or an "
                    "ExpertOptimizer to your loop); call engine.zero_grad() if you only inspect gradients"
                )
            for hook in list(self._grad_hooks.values()):
                taken = hook(items)
                if taken:
                    items = [item for item in items if item[0] not in taken]
        for key, record, arrival in items:
            if self.plan.gradients == GRADS_IN_PLACE:
                arrival.land(record)
                self.store.release(key, dirty=(GRAD,))
            else:
                self._grad_jobs[key] = self._submit_host(self._land_and_release, key, record, arrival)

    def _land_and_release(self, key: ExpertKey, record: ExpertRecord, arrival: GradArrival) -> None:
        arrival.land(record)
        self.store.release(key, dirty=(GRAD,))

    def release_record(self, key: ExpertKey, record: ExpertRecord) -> None:
        """Hand back a record `stream(keep=True)` yielded, without a gradient (frozen experts), once the compute
        enqueued so far (which used its upload) has run. None: a device-pinned expert (nothing was acquired)."""
        if record is None:
            return
        self._release_after(key, self.runtime.record() if self.plan.waits_for_device else None)

    def wait_for_grad(self, key: ExpertKey) -> None:
        """Wait until the gradients of `key` handed to the engine's host worker are in the store."""
        fut = self._grad_jobs.pop(key, None)
        if fut is not None:
            fut.result()

    def layer_backward_done(self, layer: int) -> None:
        # Plain autograd gives every expert of a layer that ran backward a (possibly zero) gradient; frozen experts
        # get none.
        if self.train_experts:
            for e in range(self.layers[layer].layout.num_experts):
                self.store.has_grad[(layer, e)] = True
        state = self.layers[layer]
        state.outstanding = max(0, state.outstanding - 1)
        if state.outstanding == 0:  # the layer's gradients are final for this micro-step
            for hook in list(self._layer_done_hooks.values()):
                hook(layer)
        prev = layer - 1  # ES-MoE: prefetch in the known reverse order, across layers too
        if prev >= 0:
            counts = self.layers[prev].last_counts
            ids = [e for e in reversed(range(len(counts))) if counts[e]]
            self.store.prefetch([(prev, e) for e in ids[: self.depth + 1]], self.backward_rows(prev))

    def add_grad_hook(self, hook: GradHook, steps_now: Callable[[], bool] | None = None) -> RemovableHandle:
        """`hook(items)` on the micro-step where these experts' gradients are final (one expert, or a layer's experts
        at once from the grouped host path), items being (key, record, arrival); it returns the keys it takes over:
        for each, the hook must `arrival.land(record)` (or use `arrival.in_place_of(record)`) and release the record
        (dirty). `steps_now()`: whether the hook updates those experts right away (the backward then reads their Adam
        moments with their weights: `backward_rows`). Returns a handle whose `remove()` takes both off again (the
        expert optimizer's `close()`)."""
        handle = RemovableHandle(self._grad_hooks, extra_dict=self._steps_now)
        self._grad_hooks[handle.id] = hook
        if steps_now is not None:
            self._steps_now[handle.id] = steps_now
        return handle

    def has_hooks(self) -> bool:
        """Whether a gradient or layer-done hook is attached (an expert optimizer)."""
        return bool(self._grad_hooks or self._layer_done_hooks)

    @property
    def experts_in_state_dict(self) -> bool:
        """Whether the experts modules' state-dict hooks put the experts' tensors in `state_dict()` (offload/api.py)."""
        return self._state_dict_experts

    @contextmanager
    def experts_left_out_of_state_dict(self):
        """`state_dict()` without the experts' tensors meanwhile (a streaming save writes them from the store)."""
        self._state_dict_experts = False
        try:
            yield
        finally:
            self._state_dict_experts = True

    def add_layer_done_hook(self, hook: Callable[[int], None]) -> RemovableHandle:
        """`hook(layer)` once `layer`'s expert gradients are final for the micro-step. Returns its removable handle."""
        handle = RemovableHandle(self._layer_done_hooks)
        self._layer_done_hooks[handle.id] = hook
        return handle

    def set_pending(self, key: ExpertKey, fut: Future) -> None:
        self._pending[key] = fut

    def wait_for_update(self, key: ExpertKey) -> None:
        fut = self._pending.pop(key, None)
        if fut is not None:
            fut.result()

    def end_window(self) -> None:
        """An accumulation window closed: forget calls whose backward never ran (e.g. a forward under grad that was
        only evaluated), so the next window's eager stepping starts clean."""
        for layer in self.layers:
            layer.outstanding = 0

    def synchronize(self) -> None:
        """Make the store current: every expert update, gradient download and record release in flight done, and the
        device-pinned experts' state back in it (what saves, loads and readers of the store need; their next training
        forward moves them up again). Not for timing or logging a step: that is `step_barrier`, which leaves the
        pins on the device (sending them home and back every step moves 16 bytes per pinned parameter twice)."""
        self.release_device_pins()
        self.wait_in_flight()

    def step_barrier(self) -> None:
        """The barrier to time or log a training step at: everything the step started is done (expert updates,
        gradient downloads, record releases, and the device's compute and copy streams), and the device-pinned
        experts stay where they are (ES-MoE §4.3). Saves, loads and readers of the store use `synchronize`."""
        self.wait_in_flight()
        if self.plan is not None and self.plan.waits_for_device:
            self.wait_for_uploads()
            self.runtime.record().synchronize()

    def wait_for_uploads(self) -> None:
        """The host waits for every upload enqueued so far (the stager's and the slab's copy streams): before an
        optimizer step writes host records that an evaluation's uploads may still read (a training upload is ordered
        before the step by the gradient download that follows it; an evaluation's by nothing)."""
        if self.plan is None or not self.plan.waits_for_device:
            return
        if self.stager is not None:
            self.runtime.record(self.stager.stream).synchronize()
        if self.slab is not None:
            self.runtime.record(self.slab.stream).synchronize()

    def wait_in_flight(self) -> None:
        """Wait for every expert update, gradient download and record release in flight (device pins stay; the
        device's streams are not waited for: `step_barrier` also waits for them)."""
        while self._host_jobs:
            self._host_jobs.popleft().result()
        self._grad_jobs.clear()
        for key in list(self._pending):
            self.wait_for_update(key)
        if self.stager is not None:
            self.stager.timer.settle(block=True)
            if self.slab is not None:
                self.slab.timer.settle(block=True)

    def zero_grad(self) -> None:
        self.wait_in_flight()
        pins = self.device_pins
        for key in self.store.keys():
            if self.coordinator is not None and not self.coordinator.owns_update(key):
                continue  # a shared store: the process that owns this expert clears it
            if self.store.has_grad[key]:
                if pins is not None and key in pins:
                    pins.record(key).clear_grad(lazy=False)
                else:
                    self.store.clear_grad(key)
                self.store.has_grad[key] = False
        publish = getattr(self.store, "publish", None)
        if self.coordinator is not None and publish is not None:
            # Node-shared disk tier: write the cleared records back now. Left dirty in this rank's cache, they would
            # be written whenever evicted, maybe while another rank reads the same file for the expert it runs next.
            publish()

    def expert_grad(self, key: ExpertKey) -> torch.Tensor | None:
        """A copy of the accumulated fp32 gradient of `key` (None if it has none)."""
        self.wait_in_flight()
        if not self.store.has_grad[key]:
            return None
        if self._on_device(key):
            grad = self.device_pins.record(key).current_grad().to("cpu", copy=True)
            self.runtime.record().synchronize()
            return grad
        record = self.store.acquire(key, WEIGHTS_AND_GRAD)
        try:
            return record.current_grad().clone()
        finally:
            self.store.release(key)

    # --- pinning (ES-MoE §4.3; the choice: offload/pinning.py) ---
    def update_pins(self) -> None:
        """At a window's close: pin each layer's `pin_fraction` experts by recent load (several processes: the
        placement's pins)."""
        if self.coordinator is not None:  # several ranks: pins must agree with the placement (ES-MoE §4.2-4.3)
            self._set_pins(self.coordinator.pinned_keys())
            return
        self._set_pins(self.pin_choice.by_load(self.layers, self.pinned))

    def _set_pins(self, pinned: list[ExpertKey]) -> None:
        """Pin these (best first), at most `pin_limit` of them."""
        pinned = list(pinned)[: self.pin_limit]
        self.store.set_pinned(pinned)
        on_device = []
        if self.device_pins is not None:
            # Training, one process: the first (best) pins keep their whole state on the device. A shared store's
            # ranks, and decoding, pin device copies of the weights only.
            if self.coordinator is None and not self.inference:
                on_device = pinned[: self.device_pins.capacity]
            self.device_pins.set(on_device)  # new ones come up at their next training forward (`_admit_pins`)
        self.pinned = pinned
        self._sync_stager_pins(set(on_device))

    def _sync_stager_pins(self, on_device: set[ExpertKey] = frozenset()) -> None:
        """The stager keeps device copies of the pinned experts whose state is not on the device (`on_device`: the
        device pins'), none while the device cache is open: it holds decoding's device copies, within its budget."""
        if self.stager is not None:
            self.stager.set_pinned(set() if self.device_cache is not None else set(self.pinned) - on_device)


class ResidentEngine:
    """The `device` tier: experts stay ordinary resident parameters (still dropless and mask-free)."""

    mode = "device"
    store = None
    plan = None
    layers: list = []

    def __init__(self, stats: OffloadStats):
        self.stats = stats

    def synchronize(self) -> None:
        pass

    def step_barrier(self) -> None:
        """The resident experts have nothing in flight on the host: the device's work is all there is to wait for."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def update_pins(self) -> None:
        pass


def _normalized(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


__all__ = ["GradArrival", "GradRing", "OffloadEngine", "ResidentEngine", "OffloadedExpertsLayer", "DeviceStager", "UpdateCoordinator"]
