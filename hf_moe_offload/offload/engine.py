"""The offload engine: the shared resources of the expert offload and their life cycle (ES-MoE §4.1).

It owns the resources the parts share (offload/resources.py: the store, offload/stores/store.py, and once bound to the
compute device of the first forward its runtime and the plan resolved once there, offload/plan.py, which sizes the
slab, the device pins and the stager) and the counters, and composes the parts that do the work, one job each, handing
each the resources, the other parts and the engine's calls it uses (no part holds the engine):
- `sources` (offload/streaming/chunk_sources.py): each call's chunks of experts brought where they compute, read and uploaded
  ahead of the one computing;
- `gradients` (offload/streaming/gradients.py): a chunk's gradients home, on the host or down from a device;
- `ledger` (offload/ledger.py): the expert optimizer's hooks, pending updates (the next forward of an expert waits for
  its own update only: no staleness, no global barrier), gradient landings;
- `decoding` (offload/inference/decoding.py): inference calls (decode cache, device cache, pre-gating, compute on host);
- `pins` (offload/pins/pinning.py): ES-MoE §4.3's pins, updated at each accumulation window's close.
The engine keeps the waits and barriers over all of them (`synchronize`, `step_barrier`, `wait_in_flight`), its host
worker, and the store's replacement. On CPU-only machines the "device" is the host: weights are used in place (host
tier) or from the disk tier's cache.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from ..host_threads import set_thread_team
from ..families.layouts import ExpertLayout
from ..runtime import Event, runtime_for
from .streaming.chunk_sources import ChunkSources
from .copies import copy_engine
from .config import OffloadConfig
from .inference.decoding import DecodePath
from .pins.device_pins import DevicePins
from .streaming.gradients import DeviceGradients, HostGradients
from .inference.policies import PreGate
from .ledger import UpdateCoordinator, UpdateLedger
from .lora.lora_store import LoraStore
from .pins.pinning import PinManager
from .plan import GRADS_DOWNLOADED, Machine, StoreFacts, clamp_depth, compute_threads, resolve_plan
from .resources import EngineResources
from .streaming.slab import DeviceSlab
from .stores.store import WEIGHTS_AND_GRAD, ExpertKey, ExpertStore
from .streaming.streamed import OffloadedExpertsLayer
from .telemetry import OffloadStats
from .streaming.transfers import DeviceStager, GradArrival, GradRing, HostStager
from .updates import ExpertUpdates

logger = logging.getLogger(__name__)


class OffloadEngine:
    """Owns the store and the shared device parts, and composes the parts that stream chunks, bring gradients home,
    keep the update ledger (where the expert optimizer plugs in), decode and pin.

    The compute device is the device of the first streamed input (or `OffloadConfig.device`, checked against the
    inputs): the engine binds to it and its runtime (hf_moe_offload.runtime) then, so each accelerate process uses its
    own device.
    """

    def __init__(self, store: ExpertStore, layers_modules: list[tuple[nn.Module, ExpertLayout]], config: OffloadConfig,
                 stats: OffloadStats, pregate: PreGate | None = None):
        # The user's settings (a copy): what depends on the device is resolved once, at `bind`; `inference` per call.
        self.config = dataclasses.replace(config)
        self.stats = stats
        self.layers = [OffloadedExpertsLayer(self, i, m, layout) for i, (m, layout) in enumerate(layers_modules)]
        self.lora = LoraStore()  # the experts' LoRA factors, with OffloadConfig.lora_in_store (lora_store.py)
        self._compose(store, pregate)

    def _compose(self, store: ExpertStore, pregate: PreGate | None) -> None:
        """The shared resources over `store` and the parts over them and the layers, unbound (what a new engine and a
        copy start from)."""
        self.device: torch.device | None = None  # bound on the first forward (set last: bound = device set)
        cache = getattr(store, "cache_experts", None)
        # The store, the device resources resolved at bind (offload/plan.py) and the coordinator (offload/resources.py)
        self.resources = EngineResources(store, clamp_depth(self.config.prefetch_depth, cache), cache,
                                         self.config.train_experts)
        self.pin_fraction = self.config.pin_fraction
        # Host-side work of asynchronous runtimes, in order on one thread: releasing records once their upload has
        # happened, landing gradients nobody else takes.
        self._host_worker: ThreadPoolExecutor | None = None
        self._host_jobs: deque[Future] = deque()
        self.ledger = UpdateLedger()  # hooks, pending updates, gradient landings (offload/ledger.py)
        self.gradients: HostGradients | None = None  # the plan's gradient sink, at bind (streaming/gradients.py)
        self._state_dict_experts = True  # `experts_left_out_of_state_dict`
        self._warned_lora = False  # LoRA factors in the store with no expert optimizer: said once
        res = self.resources
        # Inference calls: decode cache, device cache, pre-gating, compute on host (offload/inference/decoding.py)
        self.decoding = DecodePath(res, self.layers, self.config, self.stats, self.ledger, self.pin_fraction,
                                   self.release_after, pregate, cache if cache is not None else len(store.keys()))
        # Pinning (ES-MoE §4.3; offload/pins/pinning.py); decoding pins its hot experts through it, from bind on.
        self.pins = PinManager(res, self.layers, self.ledger, self.decoding, self.pin_fraction, self.wait_in_flight)
        # Where each call's chunks come from (offload/streaming/chunk_sources.py)
        self.sources = ChunkSources(res, self.layers, self.stats, self.ledger, self.decoding, self.pins,
                                    self.release_after)
        self.updates = ExpertUpdates(self)  # what the expert optimizer sees (offload/updates.py)

    # --- the shared resources (offload/resources.py), read here as the parts read them ---
    store = property(lambda self: self.resources.store, doc="The expert store (offload/stores/store.py).")
    tier = property(lambda self: self.store.tier, doc='"host" or "disk": `OffloadConfig.mode` resolved (api.py).')
    runtime = property(lambda self: self.resources.runtime, doc="The compute device's runtime (None before bind).")
    plan = property(lambda self: self.resources.plan, doc="The OffloadPlan (offload/plan.py; None before bind).")
    slab = property(lambda self: self.resources.slab, doc="A device's slab (offload/streaming/slab.py) or None.")
    stager = property(lambda self: self.resources.stager, doc="The per-expert stager (None before bind).")
    device_pins = property(lambda self: self.resources.device_pins, doc="The device pins' state or None.")
    coordinator = property(lambda self: self.resources.coordinator, doc="Several processes sharing the store.")
    train_experts = property(lambda self: self.resources.train_experts, doc="False: frozen experts.")
    depth = property(lambda self: self.resources.depth, doc="Experts read and uploaded ahead.")
    stage_experts = property(lambda self: self.resources.stage_experts,
                             doc="The disk tier on the host: experts per staged chunk (1 before bind).")
    keep_activations = property(lambda self: self.resources.keep_activations)
    map_files = property(lambda self: self.resources.map_files)
    pin_limit = property(lambda self: self.resources.pin_limit,
                         doc="Pins the disk tier's cache has room for beside the records in flight.")

    def __deepcopy__(self, memo: dict) -> "OffloadEngine":
        """`copy.deepcopy(model)`: an engine of the copy's own, unbound, over a copy of the store (copies.py)."""
        return copy_engine(self, memo)

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
        # Everything is resolved and built first, then taken in one step: a failure leaves the engine unbound (and a
        # later forward binds afresh), never half-bound.
        runtime = runtime_for(device)
        plan = resolve_plan(self.config, Machine.of(runtime, device), StoreFacts.of(self.store),
                            [layer.num_experts for layer in self.layers], self.depth,
                            shared_store=self.coordinator is not None, where=str(device))
        if plan.compute_dtype != self.store.compute_dtype:  # the store's own switch: a retry finds it done
            self.store.use_compute_dtype(plan.compute_dtype)
            logger.info("expert offload: streaming %s copies of the experts (autocast at the first forward)",
                        plan.compute_dtype)
        slab = device_pins = None
        if plan.slab_experts:
            slab = DeviceSlab(runtime, self.store.numel, plan.compute_dtype, plan.slab_experts, self.stats)
        elif plan.waits_for_device:
            logger.info("expert offload: no room for the slab's two chunks (host cache %s experts): streaming one "
                        "expert at a time", self.resources.cache)
        if plan.device_pins:
            device_pins = DevicePins(runtime, self.store, plan.device_pins, self.stats)
        stager = (DeviceStager if plan.waits_for_device else HostStager)(
            runtime, self.store.numel, self.store.compute_dtype, max(self.depth, 1), self.stats)
        self.store.bind_runtime(runtime)
        self.resources.bind(runtime, plan, slab, stager, device_pins)
        if plan.gradients == GRADS_DOWNLOADED:
            self.gradients = DeviceGradients(self.resources, self.layers, self.ledger, self.stats, self.submit_host,
                                             self.release_after)
        else:
            self.gradients = HostGradients(self.resources, self.layers, self.ledger)
        self.sources.bind(self.gradients)
        self.decoding.bind(plan, self.pins)
        self.device = device
        logger.debug("expert offload: computing on %s (runtime %s)", device, self.runtime.name)

    @contextmanager
    def training_threads(self):
        """The experts of a training call computing on the CPU use `compute_threads` intra-op threads (default: one
        fewer than torch's, at least 1): the expert optimizer's steps and the disk tier's reads and write-backs run
        alongside on their own threads (ES-MoE §4.1's overlap), and with every core in the experts' OpenMP teams
        they wait on each other (measured faster on both tiers: benchmarks/RESULTS.md, "the experts' threads").
        An asynchronous device computes elsewhere: nothing changes there."""
        before = torch.get_num_threads()
        wanted = compute_threads(self.config)
        if self.plan is None or not self.plan.limit_compute_threads or wanted == before:
            yield
            return
        set_thread_team(wanted)  # this thread's team only: the optimizer's workers size their own
        try:
            yield
        finally:
            set_thread_team(before)

    def freeze_experts(self) -> None:
        """The experts are not trained from now on (LoRA on the other parts): backward gives input gradients only."""
        self.resources.freeze_experts()

    def set_coordinator(self, coordinator: UpdateCoordinator | None) -> None:
        """Several processes share the store from now on (hf_moe_offload.distributed), or none does (None)."""
        self.resources.set_coordinator(coordinator)

    def replace_store(self, store: ExpertStore) -> None:
        """Swap the expert store (node-shared <-> private, hf_moe_offload.distributed): device copies made from the
        old one are dropped, since the new store counts versions afresh."""
        self.pins.release_device()  # into the old store, which the new one is made from
        self.wait_in_flight()
        self.resources.replace_store(store)
        for layer in self.layers:
            layer.forget_buffers()
        if self.runtime is not None:
            store.bind_runtime(self.runtime)
        if self.stager is not None:
            self.stager.drop_copies()
        self.decoding.close_device_cache()
        if self.slab is not None:
            self.slab.forget()

    def submit_host(self, fn, *args) -> Future:
        if self._host_worker is None:
            self._host_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expert-host")
        fut = self._host_worker.submit(fn, *args)
        self._host_jobs.append(fut)
        while self._host_jobs and self._host_jobs[0].done():
            self._host_jobs.popleft().result()  # surfaces an error of a finished job
        return fut

    def release_after(self, key: ExpertKey, ready: Event | None) -> None:
        """Hand a record back to the store once the upload that reads it has happened (the disk tier's cache
        reusing its buffer, or an update, could overwrite it otherwise). Waited for on the host worker, never on the
        compute thread."""
        if ready is None or self.store.tier == "host" and self.coordinator is None:
            # Host tier: the record never moves, and its next write (an update) is ordered after this upload by the
            # gradient download it follows.
            self.store.release(key)
            return

        def release():
            ready.synchronize()
            self.store.release(key)

        self.submit_host(release)

    def on_device(self, key: ExpertKey) -> bool:
        """A device-pinned expert (offload/pins/device_pins.py): neither acquired nor uploaded; compute places it."""
        return self.resources.on_device(key)

    # --- gradients and updates (offload/streaming/gradients.py, offload/ledger.py) ---
    def layer_backward_done(self, layer: int) -> None:
        # Plain autograd gives every expert of a layer that ran backward a (possibly zero) gradient; frozen experts
        # get none.
        if self.train_experts:
            for e in range(self.layers[layer].layout.num_experts):
                self.store.has_grad[(layer, e)] = True
        self.lora.release_modules()
        if layer in self.lora.layers and not self.ledger.has_hooks() and not self._warned_lora:
            self._warned_lora = True
            logger.warning("the experts' LoRA factors are in the expert store (OffloadConfig.lora_in_store) but no "
                           "ExpertOptimizer is attached, so they will not be updated: add ExpertOptimizerCallback() "
                           "to the Trainer (or an ExpertOptimizer to a hand-written loop)")
        if self.layers[layer].backward_done():  # the layer's gradients are final for this micro-step
            self.ledger.layer_done(layer)
        prev = layer - 1  # ES-MoE: prefetch in the known reverse order, across layers too
        if prev >= 0:
            counts = self.layers[prev].last_counts
            ids = [e for e in reversed(range(len(counts))) if counts[e]]
            self.store.prefetch([(prev, e) for e in ids[: self.depth + 1]], self.sources.backward_rows(prev))

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

    def end_window(self) -> None:
        """An accumulation window closed: forget calls whose backward never ran (e.g. a forward under grad that was
        only evaluated), so the next window's eager stepping starts clean."""
        for layer in self.layers:
            layer.forget_calls()
        self.pins.update()  # the window's loads are in: ES-MoE §4.3's pins for the next one

    def synchronize(self) -> None:
        """Make the store current: every expert update, gradient download and record release in flight done, and the
        device-pinned experts' state back in it (what saves, loads and readers of the store need; their next training
        forward moves them up again). Not for timing or logging a step: that is `step_barrier`, which leaves the
        pins on the device (sending them home and back every step moves 16 bytes per pinned parameter twice)."""
        self.pins.release_device()
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
        self.ledger.wait_all()
        if self.stager is not None:
            self.stager.timer.settle(block=True)
            if self.slab is not None:
                self.slab.timer.settle(block=True)

    def zero_grad(self) -> None:
        self.wait_in_flight()
        self.lora.zero_grad()
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
        if self.on_device(key):
            grad = self.device_pins.record(key).current_grad().to("cpu", copy=True)
            self.runtime.record().synchronize()
            return grad
        record = self.store.acquire(key, WEIGHTS_AND_GRAD)
        try:
            return record.current_grad().clone()
        finally:
            self.store.release(key)


def _normalized(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


__all__ = ["GradArrival", "GradRing", "OffloadEngine", "OffloadedExpertsLayer", "DeviceStager", "UpdateCoordinator"]
