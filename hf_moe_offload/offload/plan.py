"""The offload engine's settings, resolved once when it binds to the compute device.

`resolve_plan` is a pure function of the user's `OffloadConfig`, what the device offers (`Machine`), what the store
is (`StoreFacts`) and the layers' expert counts; it returns a frozen `OffloadPlan` that names each choice the engine
and the layers then follow: which chunk source a grouped training call uses, how gradients come home, which device
parts exist and how large, thread and decoding policies. It is the one place that asks where the experts compute
(`Machine.asynchronous`); after it, code reads the choice, not the device. The same rules size the estimate
(hf_moe_offload.planning.estimate), which calls `clamp_depth`, `stage_chunk` and `pin_room` instead of restating them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch

from ..host_threads import DEVICE_THREADS, optimizer_threads
from .config import OffloadConfig
from .pins.device_pins import pins_within_budget
from .streaming.slab import default_chunk, slab_nbytes

# A staged chunk's records are held from its backward's stream until the optimizer has stepped them, while the next
# chunk's are acquired: 2 chunks and the reads ahead, beside the pins, each of which saves an expert's I/O every step.
# A grouped call has a fixed cost, so chunks of 8 (the fastest of 2 / 4 / 8 measured); staging pays where most experts
# are cached, and with a quarter cached it runs no faster while its chunks take cache records from the pins (more bytes
# written), so by default a cache of less than half the experts streams them one at a time (benchmarks/RESULTS.md,
# "staged chunks on the disk tier").
STAGE_MAX = 8
# The expert optimizer's worker threads where the plan does not ask for none (and before the engine binds).
OPTIMIZER_WORKERS = 2

class Source(str, Enum):
    """Where a chunk's weights come from (offload/streaming/chunk_sources.py; `ChunkPlan.source`)."""

    SLAB = "slab"  # a device's two blocks of k experts (offload/streaming/slab.py)
    LAYER = "layer"  # the host tier's (E, P) block: a whole layer's experts
    STAGED = "staged"  # one by one, copied into the host staging block (the disk tier on the CPU)
    EXPERT = "expert"  # one by one, k = 1


class Phase(str, Enum):
    """What a stream of chunks serves, and so what comes next for the store's schedule."""

    FORWARD = "forward"  # a training forward (its backward follows)
    BACKWARD = "backward"
    INFERENCE = "inference"


# Gradient paths (`OffloadPlan.gradients`).
GRADS_IN_PLACE = "in-place"  # the host computes: autograd's gradients land in the records on the thread that has them
GRADS_DOWNLOADED = "downloaded"  # a device: one block per chunk down a ring of page-locked buffers, landed off-thread


@dataclass(frozen=True)
class Machine:
    """What the compute device offers at bind: its runtime's name, whether it computes apart from the host (a GPU,
    the simulated device), its free memory (None: unbounded) and the autocast dtype in force (None: off)."""

    runtime: str
    asynchronous: bool
    free_memory: int | None
    autocast_dtype: torch.dtype | None = None

    @classmethod
    def of(cls, runtime, device: torch.device) -> Machine:
        """`runtime` (hf_moe_offload.runtime) for `device`, with the autocast state of the first forward."""
        autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        return cls(runtime.name, runtime.asynchronous, runtime.free_memory(), autocast)


@dataclass(frozen=True)
class StoreFacts:
    """What the plan needs of the expert store (offload/stores/store.py, offload/stores/disk_store.py)."""

    tier: str
    experts: int
    numel: int
    compute_dtype: torch.dtype
    row_dtype: torch.dtype
    cache: int | None = None  # the disk tier's host cache, in records
    switches_compute_dtype: bool = False
    trainable: bool = True
    quantized: bool = False
    mappable: bool = False

    @classmethod
    def of(cls, store) -> StoreFacts:
        return cls(tier=store.tier, experts=len(store), numel=store.numel, compute_dtype=store.compute_dtype,
                   row_dtype=store.row_dtype, cache=getattr(store, "cache_experts", None),
                   switches_compute_dtype=store.switches_compute_dtype, trainable=store.trainable,
                   quantized=store.quantization is not None, mappable=getattr(store, "mappable", False))


@dataclass(frozen=True)
class OffloadPlan:
    """Every choice the engine makes at bind. `grouped_source`: where a grouped training call's chunks come from
    (streamed.ChunkPlan: "slab", "layer", "staged"; None: expert by expert); `gradients`: GRADS_IN_PLACE or
    GRADS_DOWNLOADED."""

    device: str  # the runtime's name
    compute_dtype: torch.dtype  # the store's compute copies (switched at bind under autocast: `_compute_dtype`)
    grouped_source: Source | None
    stage_experts: int  # the disk tier on the host: experts per staged chunk
    slab_experts: int  # a device: experts per slab chunk (0: no slab)
    device_pins: int  # a device: pinned experts whose whole training state stays there (0: none)
    pin_limit: int | None  # pins the disk tier's cache has room for (None: no bound)
    gradients: str
    keep_activations: bool  # OffloadConfig.keep_activations, decided
    map_files: bool  # OffloadConfig.mmap_weights, decided: a forward computes from mapped files
    pregate: bool  # OffloadConfig.pregate, decided
    measure_host_compute: bool  # OffloadConfig.compute_on_host, decided: measure Fiddler's cost model at bind
    decode_device_copies: bool  # decoding keeps device copies: the device expert cache, the hot experts' pins
    limit_compute_threads: bool  # a training call's experts take `compute_threads` of the host's cores
    reuse_views: bool  # per-expert weights come from long-lived host buffers: cache their views
    optimizer_workers: int  # ExpertOptimizer's default worker count
    optimizer_threads: int  # the expert optimizer's OpenMP threads, all workers' teams together (host_threads.py)
    lora_in_store: bool = False  # OffloadConfig.lora_in_store: the experts' LoRA factors with them (lora_store.py)

    @property
    def waits_for_device(self) -> bool:
        """Whether uploads, downloads and releases run on the device's streams (and barriers wait for them)."""
        return self.gradients == GRADS_DOWNLOADED


def clamp_depth(prefetch_depth: int, cache: int | None) -> int:
    """Records in flight must fit the disk tier's cache: the lookahead leaves the one computing and one more (a cache
    of 1 expert streams with no lookahead)."""
    return prefetch_depth if cache is None else max(0, min(prefetch_depth, cache - 2))


def stage_chunk(cache: int, depth: int, experts: int, setting: int | None = None) -> int:
    """The disk tier computing on the host: experts per staged chunk. `OffloadConfig.stage_experts`, else, where the
    cache holds at least half the experts, a third of the cache left beside the reads ahead (at most `STAGE_MAX`),
    else 1. Raises where two chunks and the reads ahead do not fit the cache."""
    room = cache - depth - 1
    k = setting if setting is not None else (min(STAGE_MAX, room // 3) if 2 * cache >= experts else 1)
    if 2 * k > room and k > 1:
        raise ValueError(
            f"OffloadConfig.stage_experts={k} needs a host cache of at least {2 * k + depth + 1} experts "
            f"(two chunks and prefetch_depth={depth} reads ahead); the cache holds {cache}: lower stage_experts or "
            "raise host_cache_experts/host_cache_bytes")
    return max(1, k)


def pin_room(cache: int | None, depth: int, stage_experts: int = 1, slab_experts: int = 0) -> int | None:
    """Pins take host-cache records for good: the disk tier's cache keeps room for the records in flight (the one
    computing, `depth` read ahead, and two staged or slab chunks), or the stream evicts pinned records and pinning
    saves nothing. None: no bound (the host tier)."""
    if cache is None:
        return None
    chunks = 2 * slab_experts if slab_experts else (2 * stage_experts if stage_experts > 1 else 0)
    return max(0, cache - depth - 1 - chunks)


def device_pin_count(pin_fraction: float, layer_experts: list[int], limit: int | None, numel: int,
                     dtype: torch.dtype, budget: int | None, slab_experts: int) -> int:
    """Training through the slab: the pins (`pin_fraction` of each layer's experts, within the cache's `limit`) keep
    their whole state on the device and step there (offload/pins/device_pins.py), as many as the device `budget` leaves
    beside the slab's two blocks."""
    pins = sum(math.ceil(pin_fraction * n) for n in layer_experts)
    if limit is not None:
        pins = min(pins, limit)
    return max(0, pins_within_budget(pins, numel, dtype, budget, slab_nbytes(slab_experts, numel, dtype)))


def dense_device_bytes(numel: int, weight_dtype: torch.dtype, on_host: bool) -> int:
    """Device bytes of `numel` non-expert parameters' training state. Resident (`torch.optim.AdamW`): fp32 weights,
    fp32 gradients and two fp32 moments, 16 bytes a parameter. Stepped on the host (optim/dense_host.py): the weights
    and gradients in `weight_dtype` only (bf16: 4 bytes)."""
    return numel * 2 * weight_dtype.itemsize if on_host else numel * 16


def dense_on_host(setting: bool | None, numel: int, weight_dtype: torch.dtype, budget: int | None,
                  asynchronous: bool) -> bool:
    """`OffloadConfig.dense_optimizer_on_host`, decided: `setting` where given; else on where the device computes
    apart from the host (`asynchronous`) with a bounded `budget` (bytes) and the resident state of `numel` parameters
    would take more than half of it (the rest is left to activations, the slab and the pins). The estimate calls this
    with the same figures."""
    if setting is not None:
        return setting
    if not asynchronous or budget is None:
        return False
    return dense_device_bytes(numel, weight_dtype, on_host=False) > budget // 2


def dense_on_host_at(config: OffloadConfig, runtime, numel: int, weight_dtype: torch.dtype) -> bool:
    """`dense_on_host` for the device of `runtime` (hf_moe_offload.runtime), its budget `device_budget_bytes` or the
    memory free now: the optimizer is built before the first forward binds the engine."""
    budget = config.device_budget_bytes if config.device_budget_bytes is not None else runtime.free_memory()
    return dense_on_host(config.dense_optimizer_on_host, numel, weight_dtype, budget, runtime.asynchronous)


def device_budget(config: OffloadConfig, free_memory: int | None) -> int | None:
    """Device memory the slab and the device pins may take together: `OffloadConfig.device_budget_bytes`, else a
    quarter of the memory free at bind; None: unbounded (a simulated device without a size)."""
    if config.device_budget_bytes is not None:
        return config.device_budget_bytes
    return None if free_memory is None else free_memory // 4


def resolve_plan(config: OffloadConfig, machine: Machine, store: StoreFacts, layer_experts: list[int], depth: int,
                 shared_store: bool = False, where: str = "") -> OffloadPlan:
    """The plan for `store`'s experts computing on `machine` (`where` names the device in errors). `shared_store`:
    several processes share the store (hf_moe_offload.distributed), which keeps pins' state on the host."""
    on_host = not machine.asynchronous
    where = where or machine.runtime
    # Kept forward graphs cost what a resident model saves (T_M per expert); on the CPU that memory is the host's
    # either way. On a device ES-MoE keeps only the expert inputs there.
    if config.keep_activations and not on_host:
        raise ValueError(
            f"OffloadConfig.keep_activations=True needs the experts computing on the CPU (here: {where}): on a device "
            "the kept activations would take device memory that ES-MoE leaves to the experts in flight. Leave it "
            "unset (the engine then recomputes each expert's middle activation in backward)")
    # On a device under autocast, copies stream in the autocast dtype unless OffloadConfig.compute_dtype says
    # otherwise: the values autocast would cast the fp32 weights to on the device, half the bytes up, and gradients
    # down in that dtype (the GEMMs produce them so).
    dtype = store.compute_dtype
    if (config.compute_dtype is None and not on_host and machine.autocast_dtype is not None
            and store.switches_compute_dtype and store.compute_dtype == store.row_dtype):
        dtype = machine.autocast_dtype
    cache = store.cache
    stage, slab = 1, 0
    if not on_host:
        slab = _slab_chunk(config, machine, store, layer_experts, dtype, depth)
        source = Source.SLAB if slab else None
    elif cache is None and store.quantized:
        # The host tier's quantized rows are no (E, P) weights to compute from: a chunk's experts are dequantized
        # into the staging block (memory: the block, not the layer)
        stage, source = config.stage_experts or STAGE_MAX, Source.STAGED
    elif cache is None:
        if config.stage_experts not in (None, 1):
            raise ValueError(
                f"OffloadConfig.stage_experts={config.stage_experts} applies to the disk tier computing on the CPU "
                f"(here: {store.tier} tier on {where}); leave it unset")
        source = Source.LAYER
    else:
        stage = stage_chunk(cache, depth, store.experts, config.stage_experts)
        source = Source.STAGED if stage > 1 else None
    limit = pin_room(cache, depth, stage, slab)
    pins = 0
    if slab and store.trainable and not shared_store:  # (ranks sharing a store pin device copies of weights only)
        pins = device_pin_count(config.pin_fraction, layer_experts, limit, store.numel, dtype,
                                device_budget(config, machine.free_memory), slab)
    # On the CPU the host is the device: an expert's file in the page cache is as close to the compute as a cache
    # record, so a forward computes from the mapped file instead of copying it into one (a training backward still
    # reads the record: the optimizer updates it). A device needs the weights in its own memory (uploaded from
    # page-locked cache records): there the cache stays.
    can_map = store.mappable and on_host
    if config.mmap_weights and not can_map:
        raise ValueError(
            f"OffloadConfig.mmap_weights=True needs the disk tier computing on the CPU with rows in the compute dtype "
            f"(here: {store.tier} tier on {where}); leave it unset")
    # Compute-on-host pays off where weights cross a link (a GPU); `True` also turns it on for the simulated device
    # (tests). On the inline CPU runtime the host is the device.
    host_compute = machine.runtime == "cuda" if config.compute_on_host is None else config.compute_on_host
    # The factors' masters are each process's own: ranks sharing a store would step the same experts' factors apart.
    if config.lora_in_store and shared_store:
        raise ValueError("OffloadConfig.lora_in_store=True is for one process's store; with a store shared between "
                         "processes (hf_moe_offload.distributed) leave it False (the factors stay device parameters)")
    return OffloadPlan(
        device=machine.runtime,
        compute_dtype=dtype,
        grouped_source=source,
        stage_experts=stage,
        slab_experts=slab,
        device_pins=pins,
        pin_limit=limit,
        gradients=GRADS_IN_PLACE if on_host else GRADS_DOWNLOADED,
        keep_activations=on_host if config.keep_activations is None else config.keep_activations,
        map_files=can_map if config.mmap_weights is None else config.mmap_weights,
        # Pre-gating: on the CPU early reads compete with the compute for the cores, and the host tier has nothing
        # to read early; on a device it also uploads into the device cache.
        pregate=not (on_host and (config.pregate is None or store.tier == "host")),
        measure_host_compute=bool(host_compute) and not on_host,
        decode_device_copies=not on_host,
        limit_compute_threads=on_host,
        # A device's slot or copy, or a quantized expert dequantized for one use, is a new tensor each time: cached
        # views would keep every one alive.
        reuse_views=on_host and not store.quantized,
        # With the disk tier on the host, the store's I/O threads already share the other cores with the compute:
        # the optimizer's workers, stepping each expert as its gradient arrives, queued behind the I/O while the
        # backward waited for both (benchmarks/RESULTS.md). On a device the workers overlap its backward (ES-MoE
        # §4.1).
        optimizer_workers=0 if store.tier == "disk" and on_host else OPTIMIZER_WORKERS,
        optimizer_threads=optimizer_threads(config.optimizer_threads, reserved=compute_threads(config) if on_host
                                            else DEVICE_THREADS),
        lora_in_store=config.lora_in_store,
    )


def compute_threads(config: OffloadConfig) -> int:
    """The intra-op threads of a training call's experts computing on the CPU (`OffloadConfig.compute_threads`, else
    one fewer than the calling thread's, at least 1)."""
    return config.compute_threads if config.compute_threads is not None else max(1, torch.get_num_threads() - 1)


def _slab_chunk(config: OffloadConfig, machine: Machine, store: StoreFacts, layer_experts: list[int],
                dtype: torch.dtype, depth: int) -> int:
    """The slab's experts per chunk: `OffloadConfig.stage_experts`, else a whole layer's experts within the device
    budget and, on the disk tier, the host cache (offload/streaming/slab.py `default_chunk`); 0: no room for two chunks of two,
    expert by expert through the stager's slots."""
    cache = store.cache
    if config.stage_experts is not None:
        if cache is not None and 2 * config.stage_experts > cache - depth - 1:
            raise ValueError(
                f"OffloadConfig.stage_experts={config.stage_experts} needs a host cache of at least "
                f"{2 * config.stage_experts + depth + 1} experts (two chunks in flight and "
                f"prefetch_depth={depth} reads ahead); the cache holds {cache}")
        return config.stage_experts
    budget = device_budget(config, machine.free_memory)
    return default_chunk(max(layer_experts), store.numel, dtype, budget, cache, depth)
