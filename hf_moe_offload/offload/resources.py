"""The resources the offload engine's parts share (ES-MoE §4.1): the expert store, what binding to the compute device
resolves (the runtime, the plan, the slab, the stager, the device pins), and the two settings that change while a
model runs (whether the experts train, and the coordinator of processes sharing the store).

The engine (offload/engine.py) owns one `EngineResources` and changes it only through its methods: `bind` once the
plan is resolved, `replace_store` when the store is swapped (hf_moe_offload.distributed), `freeze_experts` and
`set_coordinator`.
Each part (offload/streaming/chunk_sources.py, offload/streaming/gradients.py, offload/inference/decoding.py,
offload/pins/pinning.py) is handed this object with the rest of what it uses when the engine composes it, and reads
the resources where it uses them: a bind or a replaced store reaches every part at once, and no part holds the engine.
"""

from __future__ import annotations

from .plan import pin_room


class EngineResources:
    """The store and the device resources shared by the engine's parts; unbound (`runtime`, `plan`, `slab`, `stager`,
    `device_pins` None) until the engine binds to its compute device."""

    def __init__(self, store, depth: int, cache: int | None, train_experts: bool):
        self.store = store  # the expert store (offload/stores/store.py), replaced by `replace_store`
        self.depth = depth  # experts read and uploaded ahead of the one computing (offload/plan.py `clamp_depth`)
        self.cache = cache  # the disk tier's host cache in experts (None: the host tier)
        self.train_experts = train_experts  # False (frozen experts, e.g. LoRA): input gradients only
        self.coordinator = None  # several processes sharing the store (hf_moe_offload.distributed)
        # --- resolved at bind (offload/plan.py) ---
        self.runtime = None  # the compute device's runtime (hf_moe_offload.runtime)
        self.plan = None  # the OffloadPlan
        self.slab = None  # a device's training calls (offload/streaming/slab.py)
        self.stager = None  # per-expert uploads (offload/streaming/transfers.py)
        self.device_pins = None  # training on a device: pins' whole state there (offload/pins/device_pins.py)

    def bind(self, runtime, plan, slab, stager, device_pins) -> None:
        """What the engine built for its compute device, taken in one step."""
        self.runtime, self.plan, self.slab, self.stager, self.device_pins = runtime, plan, slab, stager, device_pins

    def replace_store(self, store) -> None:
        """The store swapped (the engine has sent the device pins' state home and waited for what was in flight)."""
        self.store = store
        if self.device_pins is not None:
            self.device_pins.use_store(store)

    def freeze_experts(self) -> None:
        self.train_experts = False

    def set_coordinator(self, coordinator) -> None:
        """Several processes share the store from now on (`coordinator`), or none does (None)."""
        self.coordinator = coordinator

    def on_device(self, key) -> bool:
        """A device-pinned expert (offload/pins/device_pins.py): neither acquired nor uploaded; compute places it."""
        return self.device_pins is not None and key in self.device_pins

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
        return pin_room(self.cache, self.depth) if self.plan is None else self.plan.pin_limit


__all__ = ["EngineResources"]
