"""The decoding path: what the engine does in an inference call (generation, evaluation), offload/inference/policies.py's
parts put to work.

`DecodePath` keeps the mode of the current call (`enter_call`), decoding's use scores (`DecodeCache`: the disk tier's
eviction, the hot experts to keep on a device), the device expert cache (offload/inference/device_cache.py) while a model
decodes on a device, pre-gating's uploads of the next layer's guessed experts (`upload_ahead`), and Fiddler's choice
to run a missed expert on the host (`compute_on_host`). The plan (offload/plan.py) says at bind which of these exist.
The engine hands the path what it uses: the shared resources (offload/resources.py: the store, runtime, plan, stager and
device pins), the layers, the user's settings, the counters, the update ledger and the engine's record release, and at
bind the pins (offload/pins/pinning.py), through which it keeps the hot experts on a device.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ...runtime import aligned_nbytes
from .device_cache import DeviceExpertCache
from .policies import DecodeCache, PlacementCostModel, PreGate
from ..stores.store import WEIGHTS, ExpertKey

logger = logging.getLogger(__name__)


class DecodePath:
    decode_pin_interval = 16  # tokens between two choices of the hot experts to keep on the device

    def __init__(self, resources, layers: list, config, stats, ledger, pin_fraction: float, release_after,
                 pregate: PreGate | None, scored: int):
        self.res = resources  # the store, runtime, plan, stager and device pins decoding uses (offload/resources.py)
        self.layers = layers  # the engine's OffloadedExpertsLayers, by index
        self.config = config  # the engine's OffloadConfig: `inference`, `device_cache_bytes`
        self.stats = stats
        self.ledger = ledger  # pending updates: a guessed expert waiting for one is not uploaded ahead
        self.pin_fraction = pin_fraction  # decoding keeps device copies of each layer's hottest experts when set
        self.release_after = release_after  # the engine's: a record back to the store once its upload happened
        self.pins = None  # the pins (offload/pins/pinning.py), at bind: what exists of decoding's device copies
        self.inference = False  # the mode of the current call
        # Decoding's use scores (OffloadConfig.decode_cache_decay): the disk tier's eviction and, on a device, which
        # experts keep a device copy (`pin_hot_experts`).
        self.decode_cache = DecodeCache(len(layers), scored, config.decode_cache_decay)
        self.device_cache: DeviceExpertCache | None = None  # decoding on a device (offload/inference/device_cache.py)
        self._device_cache_tried = False  # opened (or found no room) since inference began
        self.pregate = pregate  # OffloadConfig.pregate: dropped at bind where the plan says so
        self._guessed: list[ExpertKey] = []  # pre-gating's guess of the next layer, to upload after this layer's own
        # Fiddler's compute-on-host choice: measured at bind where the plan says so, or given.
        self.cost_model: PlacementCostModel | None = None

    def bind(self, plan, pins) -> None:
        """The engine bound to its device: the plan says what decoding does there; `pins` keep its hot experts."""
        res = self.res
        self.pins = pins
        if not plan.pregate:
            self.pregate = None
        if plan.measure_host_compute and self.cost_model is None:
            self.cost_model = PlacementCostModel.measure(res.runtime, res.store.numel, res.store.compute_dtype)

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
        res = self.res
        if inference != self.inference:
            self.inference = inference
            set_policy = getattr(res.store, "set_decode_cache", None)
            if set_policy is not None:
                set_policy(self.decode_cache if inference else None)
            if not inference:
                self.close_device_cache()
                self._device_cache_tried = False
        if inference and not self._device_cache_tried and (evaluating or self.config.inference):
            self._device_cache_tried = True
            self._open_device_cache()
        if inference and layer == 0:
            self.decode_cache.next_token()
            if (res.plan is not None and res.plan.decode_device_copies and self.pin_fraction
                    and self.device_cache is None and self.decode_cache.tick % self.decode_pin_interval == 1):
                self.pin_hot_experts()
        return inference

    def _open_device_cache(self) -> None:
        """Decoding starts on an asynchronous device (one process): the device expert cache (offload/inference/device_cache.py),
        `OffloadConfig.device_cache_bytes` of device memory, by default half of what is free now; capacity at most
        every expert."""
        res = self.res
        if res.plan is None or not res.plan.decode_device_copies or res.coordinator is not None:
            return
        budget = self.config.device_cache_bytes
        if budget is None:
            free = res.runtime.free_memory()
            budget = 0 if free is None else free // 2
        dtype = res.store.compute_dtype
        capacity = min(len(res.store), budget // aligned_nbytes(res.store.numel, dtype))
        if capacity < 1:
            return
        self.device_cache = DeviceExpertCache(res.runtime, res.store.numel, dtype, capacity, res.stager.stream,
                                              self.decode_cache.score, self.stats)
        self.pins.sync_stager()
        logger.debug("expert offload: device expert cache of %d experts (%.1f MiB)", capacity,
                     self.device_cache.nbytes / 2**20)

    def upload_ahead(self, keys: list[ExpertKey]) -> None:
        """Pre-gating on a device: upload the next layer's guessed experts into the device cache while this layer
        computes, once this layer's own uploads are enqueued (`stream`: one copy stream, first in first out): those
        whose weights are in host memory by then (the disk tier's reads ahead are the host cache's `prefetch`) and
        that the cache admits (offload/inference/device_cache.py)."""
        self._guessed = keys if self.device_cache is not None else []

    def upload_guessed(self) -> None:
        """Pre-gating's guessed experts into the device cache, behind the uploads of the layer that guessed them."""
        res = self.res
        keys, self._guessed = self._guessed, []
        cache = self.device_cache
        for key in keys:
            version = res.store.versions[key]
            if self.ledger.is_pending(key) or res.on_device(key) or cache.holds(key, version):
                continue
            record = res.store.try_acquire(key, WEIGHTS)
            if record is None:
                continue
            kept = cache.upload(key, version, record.upload_source())
            if kept is None:
                res.store.release(key)
                continue
            _, ready, done = kept
            done()  # no compute use: the slot's next upload waits for this point only
            self.release_after(key, ready)
            self.stats.pregate_uploads += 1

    def close_device_cache(self) -> None:
        """Training resumes: the cache's memory goes back (once compute is done with it)."""
        res = self.res
        if self.device_cache is not None:
            self.device_cache.close()
            self.device_cache = None
            pins = res.device_pins
            self.pins.sync_stager(set() if pins is None else set(pins.keys()) | pins.pending)
            res.runtime.release_cached_memory()

    def pin_hot_experts(self) -> None:
        """Decoding on an asynchronous device: keep a device copy of each layer's `pin_fraction` hottest experts by
        decoding's use scores (mixtral-offloading's per-layer expert cache on the GPU; ES-MoE §4.3's pinning, chosen
        by recent use instead of the last training step's load). Their uploads are then reused across tokens."""
        self.pins.set(self.pins.pin_choice.top(self.layers, self.decode_cache.score))

    def compute_on_host(self, key: ExpertKey, tokens: int, x: torch.Tensor) -> bool:
        """The cost model's choice for one expert of an inference call: host compute, unless a current device copy
        (a pinned expert) makes its upload free."""
        res = self.res
        if (key in res.stager.pinned_keys or res.on_device(key)
                or self.device_cache is not None and key in self.device_cache):
            return False
        layout = self.layers[key[0]].layout
        weight_bytes = res.store.numel * res.store.compute_dtype.itemsize
        return self.cost_model.compute_on_host(tokens, 2.0 * layout.decay_numel, weight_bytes,
                                               x.shape[-1] * x.element_size())
