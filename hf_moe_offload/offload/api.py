"""Turning expert offload on and off for a model, and keeping `state_dict()` whole while it is on.

`enable_expert_offload(model, OffloadConfig(...))` moves every experts module's weights into an expert store and
puts the streamed experts on the model's MoE path (hf_moe_offload.families.moe_path: transformers' experts implementation
"hf_moe_offload"; the module object and its name stay; its expert tensors are no longer `nn.Parameter`s, so
Trainer/DDP optimizers never see them). `state_dict()` and `load_state_dict()` still show the
experts under their standard names, whatever the tier. `disable_expert_offload(model)` puts everything back.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import os
import weakref
from collections.abc import Callable

import torch
from torch import nn

from ..families.moe_path import (IMPLEMENTATION, MoELayer, attached_path, experts_layers, find_experts_modules, holding_path,
                        moe_path)
from .config import OffloadConfig
from .copies import copy_engine
from .engine import OffloadEngine
from .resident import ResidentEngine
from .inference.policies import PreGate, Router, find_router
from .lora.stand_ins import stand_in_parameter
from .streaming.streamed import DTYPE_BUFFER
from .stores.quantized import store_quantization
from .planner import HEADROOM, MemoryEstimate, choose_tier, detect_budgets, estimate_memory, offloaded_device_bytes
from .stores.disk_store import DiskExpertStore
from .stores.store import STATE_ROWS, ExpertStore, ExpertStoreError, HostExpertStore
from .telemetry import OffloadStats

logger = logging.getLogger(__name__)


def find_expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Experts modules in forward order (see `hf_moe_offload.families.moe_path.find_experts_modules`)."""
    return find_experts_modules(model)


def get_offload_engine(model: nn.Module) -> OffloadEngine | None:
    """The model's offload engine (held by its MoE path), or None where expert offload is off."""
    path = attached_path(model)  # DDP-wrapped models too
    return path.engine if path is not None else None


def enable_expert_offload(
    model: nn.Module, config: OffloadConfig | None = None, tokens_per_batch: int = 0, _initialize: bool = True,
    store_factory: Callable[..., ExpertStore] | None = None,
) -> OffloadEngine:
    """Offload the experts of `model` per `config`; returns the engine (also at `get_offload_engine(model)`).

    `store_factory(tier, keys, numel, compute_dtype, stats, cache_experts)`, if given, builds the store of the host
    or disk tier instead of the per-process one (hf_moe_offload.distributed passes its node-shared stores).
    """
    config = config or OffloadConfig()
    if get_offload_engine(model) is not None:
        raise RuntimeError("expert offload is already enabled on this model; call disable_expert_offload first")
    found = experts_layers(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no experts module that hf_moe_offload can serve: it needs an experts module "
            "decorated with transformers' @use_experts_implementation whose tensors an ExpertLayout describes "
            "(hf_moe_offload/families/layouts.py)"
        )
    modules = [module for _, module, _ in found]
    if _initialize:
        _refuse_meta_experts(found)
    device = config.resolved_device()
    layouts = [layout for _, _, layout in found]
    model_dtype = getattr(modules[0], layouts[0].tensors[0].name).dtype
    quantization = store_quantization(config.expert_storage, model_dtype, [t.shape for t in layouts[0].tensors])
    est = estimate_memory(model, modules, tokens_per_batch, trained_experts=config.train_experts,
                          frozen_bytes_per_param=_frozen_bytes_per_param(model_dtype, quantization))
    tier = _resolve_tier(config, device, est, modules[0])
    if tier == "device" and quantization is not None:  # mode="auto" (config refuses "device"): quantized = stored
        tier = "host"
    stats = OffloadStats()
    store = (None if tier == "device"
             else _build_store(tier, config, layouts, model_dtype, stats, store_factory, quantization))
    if store is None:
        engine = ResidentEngine(stats)
        holding_path(model).engine = engine
        logger.info("expert offload: device tier (all experts resident, dropless sequential execution)")
        return engine

    # The compute device is bound on the first forward, from the inputs (or checked against OffloadConfig.device).
    path = moe_path(model)  # the engine's layers and the path's share one layout per module
    engine = _build_engine(model, path.layers, store, config, stats)
    for streamed, route in zip(engine.layers, path.layers):
        _put_layer_in_store(streamed, route, store, _initialize)
    store.flush()
    path.engine = engine
    return engine


def _refuse_meta_experts(found: list) -> None:
    """Experts with no values (a model built on the meta device) cannot fill a store, on any tier."""
    empty = [name for name, module, layout in found
             if any(getattr(module, t.name).device.type == "meta" for t in layout.tensors)]
    if empty:
        raise ValueError(
            f"the experts of {empty[0]} are on the meta device (the model was built without weights): nothing to put "
            "in the expert store. Load the weights first (from_pretrained, or load_state_dict(state, assign=True)), "
            "or build the model with its experts streamed straight into the store: "
            "hf_moe_offload.load_offloaded_pretrained(path, OffloadConfig(...))")


def _resolve_tier(config: OffloadConfig, device: torch.device, est: MemoryEstimate, first_experts: nn.Module) -> str:
    """The tier: `config.mode`, or for mode="auto" the one the memory budgets allow (ES-MoE §4.3 adaptive offload)."""
    if config.mode != "auto":
        return config.mode
    dev_budget, host_budget = detect_budgets(device)
    dev_budget = config.device_budget_bytes or dev_budget
    host_budget = config.host_budget_bytes or host_budget
    tier, why = choose_tier(est, dev_budget, host_budget)
    logger.info("expert offload mode=auto chose %r: %s", tier, why)
    if tier != "device":
        # Device copies every offloaded tier keeps: pinned experts (ES-MoE §4.3) and the upload slots.
        resident = math.ceil(config.pin_fraction * est.num_experts_total) + config.prefetch_depth + 1
        compute_bytes = (config.compute_dtype.itemsize if config.compute_dtype is not None
                         else next(first_experts.parameters()).element_size())
        need = offloaded_device_bytes(est, resident, compute_bytes)
        if need > HEADROOM * dev_budget:
            logger.warning(
                "even offloaded, training needs ~%.2f GiB on %s (non-expert state, activations, %d resident "
                "expert copies) of %.2f GiB free: lower pin_fraction, prefetch_depth or the batch size",
                need / 2**30, device, resident, dev_budget / 2**30)
    if tier == "disk" and not config.offload_dir:
        raise ValueError(
            f"mode='auto' chose the disk tier ({why}); set OffloadConfig.offload_dir to a directory on a fast disk"
        )
    return tier


def weights_only_row_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The row dtype of a weights-only store (frozen experts) unquantized: a bf16/fp16 model's own (nothing is updated,
    so there is no master to keep), else fp32."""
    return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.float32


def default_cache_experts(num_experts: int, prefetch_depth: int) -> int:
    """The disk tier's host cache when none is set: a quarter of the experts, at least prefetch_depth + 2."""
    return max(prefetch_depth + 2, num_experts // 4)


def _frozen_bytes_per_param(model_dtype: torch.dtype, quantization) -> float:
    """Bytes per parameter of a weights-only store (frozen experts): its format's, or the row dtype's."""
    if quantization is not None:
        return quantization.bytes_per_parameter
    return weights_only_row_dtype(model_dtype).itemsize


def _build_store(tier: str, config: OffloadConfig, layouts: list, model_dtype: torch.dtype, stats: OffloadStats,
                 store_factory: Callable[..., ExpertStore] | None, quantization=None) -> ExpertStore:
    """The host or disk tier's store, one record per (layer, expert); `quantization`: frozen experts kept in 8 or 4
    bits (offload/stores/quantized.py)."""
    compute_dtype = config.compute_dtype or model_dtype
    numel = layouts[0].numel
    if any(lay.numel != numel for lay in layouts):
        raise ValueError("all MoE layers must have experts of the same size to share one store")
    if quantization is not None and any([t.shape for t in lay.tensors] != list(quantization.shapes) for lay in layouts):
        raise ValueError("quantized expert storage needs every MoE layer's experts to have the same tensors")
    keys = [(i, e) for i, lay in enumerate(layouts) for e in range(lay.num_experts)]
    state_rows = STATE_ROWS if config.train_experts else 1  # frozen experts: weights only
    if store_factory is not None and not config.train_experts:
        raise ValueError("frozen experts (train_experts=False) stay in per-process stores; do not share them")
    # A weights-only store keeps the model's own dtype (a bf16 model: bf16 rows, no fp32 copy: nothing is updated,
    # so there is no master to keep); training keeps fp32 masters, gradients and moments.
    row_dtype = weights_only_row_dtype(model_dtype) if state_rows == 1 else torch.float32
    if tier == "host":
        return (HostExpertStore(keys, numel, compute_dtype, stats, state_rows, row_dtype, quantization)
                if store_factory is None else store_factory("host", keys, numel, compute_dtype, stats, None))
    record_bytes = quantization.nbytes if quantization is not None else state_rows * numel * row_dtype.itemsize
    cache = config.host_cache_experts
    if config.host_cache_bytes is not None:
        cache = config.host_cache_bytes // record_bytes
        if cache < 1:
            raise ExpertStoreError(
                f"host_cache_bytes={config.host_cache_bytes} is smaller than one expert's state ({record_bytes} "
                "bytes: fp32 weights, and unless the experts are frozen its gradient and two Adam moments); "
                "raise it"
            )
    if cache is None:  # default: a quarter of the experts, at least prefetch_depth + 2
        cache = default_cache_experts(len(keys), config.prefetch_depth)
    if store_factory is None:
        store = DiskExpertStore(
            keys, numel, compute_dtype, stats, os.path.join(config.offload_dir), cache, config.io_threads,
            state_rows=state_rows, row_dtype=row_dtype, quantization=quantization,
        )
    else:
        store = store_factory("disk", keys, numel, compute_dtype, stats, cache)
    logger.info(
        "disk tier: %d experts x %.1f MiB in %s, host cache %d experts (%.1f MiB)",
        len(keys), record_bytes / 2**20, config.offload_dir, cache, cache * record_bytes / 2**20,
    )
    return store


def _build_engine(model: nn.Module, layers: list[MoELayer], store: ExpertStore, config: OffloadConfig,
                  stats: OffloadStats) -> OffloadEngine:
    pregate = None
    if config.pregate is not False:  # dropped at bind where it has nothing to do early (`OffloadEngine.bind`)
        pregate = PreGate([_router(model, route) for route in layers], stats)
    return OffloadEngine(store, [(layer.module, layer.layout) for layer in layers], config, stats, pregate)


def _put_layer_in_store(streamed, route: MoELayer, store: ExpertStore, initialize: bool) -> None:
    """Move one layer's experts into the store (unless `initialize` is False: the caller fills the store), take the
    tensors off the module, keep `state_dict()` / `load_state_dict()` whole through the store, and stream the layer."""
    module, layout = route.module, route.layout
    if initialize:
        with torch.no_grad():
            flat = torch.empty(layout.numel)
            for e in range(layout.num_experts):
                tensors = [getattr(module, t.name)[e].detach().float() for t in layout.tensors]
                store.write_param((streamed.layer, e), layout.pack(tensors, flat))
    first = module._parameters[layout.tensors[0].name]
    streamed.meta = _detach_parameters(module, layout, stand_ins=not store.trainable)
    module.register_buffer(DTYPE_BUFFER, torch.empty(0, dtype=first.dtype, device=first.device if first.device.type
                                                     != "meta" else "cpu"), persistent=False)
    loaded: set[str] = set()  # state-dict keys the last load wrote into the store
    streamed.handles = [
        module._register_state_dict_hook(functools.partial(_state_dict_hook, layer=streamed)),
        module._register_load_state_dict_pre_hook(functools.partial(_load_state_dict_pre_hook, layer=streamed,
                                                                    loaded=loaded)),
        # Frozen experts' stand-ins are parameters whose values the pre-hook took from the state dict into the
        # store: not missing.
        module.register_load_state_dict_post_hook(functools.partial(_load_state_dict_post_hook, loaded=loaded)),
        module.register_forward_pre_hook(_require_offload_implementation),
    ]
    route.set_streamed(streamed)


def _require_offload_implementation(module: nn.Module, args) -> None:
    """Offloaded experts compute only through experts implementation "hf_moe_offload": another one (set with
    `set_experts_implementation`) would look for tensors that are in the store now."""
    chosen = getattr(getattr(module, "config", None), "_experts_implementation", IMPLEMENTATION)
    if chosen != IMPLEMENTATION:
        raise RuntimeError(
            f"the experts of this {type(module).__name__} are offloaded to the expert store, which only "
            f"experts_implementation={IMPLEMENTATION!r} computes from, but the model was switched to {chosen!r}. To "
            f"use {chosen!r}, call hf_moe_offload.disable_expert_offload(model) first (the experts come back as "
            f"parameters), then model.set_experts_implementation({chosen!r}); to keep the experts offloaded, call "
            f"model.set_experts_implementation({IMPLEMENTATION!r})")


def _router(model: nn.Module, route) -> Router | None:
    """The router of one MoE layer, for pre-gating: found in the experts module's parent block."""
    parent = route.name.rpartition(".")[0]
    block = getattr(model, "module", model).get_submodule(parent) if parent else None
    if block is None or not route.layout.hidden_size:
        return None
    found = find_router(block, route.module, route.layout.num_experts, route.layout.hidden_size)
    if found is None:
        logger.info("pre-gating: no single router found next to %s; its experts are not guessed", route.name)
    return found


def _detach_parameters(module: nn.Module, layout, stand_ins: bool) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Take the expert tensors off the module; returns their (shape, dtype) in registration order, so that
    disable_expert_offload restores the same parameter order. Frozen experts (`stand_ins`) leave a frozen
    `ExpertStandIn` parameter in each one's place, for peft's LoRA on expert tensors (offload/lora/stand_ins.py)."""
    names = set(layout.names())
    meta = {n: (p.shape, p.dtype) for n, p in module._parameters.items() if n in names}
    for t in layout.tensors:
        param = module._parameters.pop(t.name)
        if stand_ins:  # on the CPU where the model was built empty (load_offloaded_pretrained): where it computes
            device = param.device if param.device.type != "meta" else torch.device("cpu")
            module.register_parameter(t.name, stand_in_parameter(param.shape, param.dtype, device))
    return meta


def _expert_tensor(layer, name: str) -> torch.Tensor:
    """One (E, ...) tensor of a layer assembled from the store, in the model's dtype."""
    engine, layout = layer.engine, layer.layout
    idx = layout.names().index(name)
    spec = layout.tensors[idx]
    shape, dtype = layer.meta[name]
    out = torch.empty(shape, dtype=dtype)
    for e in range(layout.num_experts):
        out[e] = engine.store.read_param((layer.layer, e))[layout.offsets[idx] : layout.offsets[idx] + spec.numel].view(spec.shape)
    return out


# Above this many bytes of experts, the first `state_dict()` that assembles them says how to save without doing so.
ASSEMBLY_WARNING_BYTES = 1 << 30
_checked_engines: "weakref.WeakSet" = weakref.WeakSet()


def _warn_of_assembly(engine) -> None:
    if engine in _checked_engines:  # said once (or found small) for this engine: each layer's hook asks
        return
    _checked_engines.add(engine)
    nbytes = sum(math.prod(shape) * dtype.itemsize for layer in engine.layers for shape, dtype in layer.meta.values())
    if nbytes >= ASSEMBLY_WARNING_BYTES:
        logger.warning(
            "state_dict() of a model with offloaded experts assembles all %.1f GB of them in host memory. To save "
            "the model, use save_offloaded_pretrained(model, folder) or hf_moe_offload.OffloadTrainer, which write "
            "them from the store one expert at a time", nbytes / 1e9)


def _state_dict_hook(module, state_dict, prefix, local_metadata, layer):
    if not layer.engine.experts_in_state_dict:  # a streaming save writes the experts itself
        for name in layer.layout.names():
            state_dict.pop(prefix + name, None)  # frozen experts' stand-ins
        return state_dict
    _warn_of_assembly(layer.engine)
    layer.engine.synchronize()
    for name in layer.layout.names():
        state_dict[prefix + name] = _expert_tensor(layer, name)
    return state_dict


def _load_state_dict_pre_hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs,
                              layer, loaded: set[str]):
    layout = layer.layout
    names = layout.names()
    present = [n for n in names if prefix + n in state_dict]
    if not present:
        missing_keys.extend(prefix + n for n in names)
        return
    if len(present) != len(names):
        missing_keys.extend(prefix + n for n in names if n not in present)
    layer.engine.synchronize()
    tensors = {n: state_dict.pop(prefix + n) for n in present}
    loaded.update(prefix + n for n in present)
    flat = torch.empty(layout.numel)
    for e in range(layout.num_experts):
        key = (layer.layer, e)
        cur = layer.engine.store.read_param(key)
        for n in present:
            i = names.index(n)
            spec = layout.tensors[i]
            if tuple(tensors[n].shape[1:]) != spec.shape or tensors[n].shape[0] != layout.num_experts:
                error_msgs.append(f"size mismatch for {prefix + n}: copying {tuple(tensors[n].shape)}")
                return
            cur[layout.offsets[i] : layout.offsets[i] + spec.numel] = tensors[n][e].reshape(-1).float()
        flat.copy_(cur)
        layer.engine.store.write_param(key, flat, reset_state=False)


def _load_state_dict_post_hook(module, incompatible_keys, loaded: set[str]) -> None:
    # (a stand-in's key the state dict lacks is reported by the pre-hook and by torch: once is enough)
    incompatible_keys.missing_keys[:] = dict.fromkeys(k for k in incompatible_keys.missing_keys if k not in loaded)
    loaded.clear()


def reference_copy(model: nn.Module) -> nn.Module:
    """A frozen copy of `model` to compare against while `model` trains (what TRL's `create_reference_model` makes:
    a deep copy, no parameter requiring gradients, in eval mode). Where the experts are offloaded, the copy's are
    frozen and kept weights only, in the model's dtype (bf16: 2 bytes per expert parameter, where `copy.deepcopy`
    copies a trained store's 16: fp32 weights, gradient and two Adam moments); it never sees `model`'s updates."""
    engine = get_offload_engine(model)
    memo: dict = {}
    if engine is not None and engine.store is not None:
        model_dtype = next(iter(engine.layers[0].meta.values()))[1]
        copy_engine(engine, memo, weights_only_row_dtype(model_dtype))
    ref = copy.deepcopy(model, memo)
    for param in ref.parameters():
        param.requires_grad_(False)
    return ref.eval()


def disable_expert_offload(model: nn.Module) -> None:
    """Bring every expert back as an ordinary `nn.Parameter` and drop the store (reverses enable_expert_offload)."""
    engine = get_offload_engine(model)
    if engine is None:
        raise RuntimeError("expert offload is not enabled on this model")
    path = attached_path(model)
    if engine.store is not None:
        engine.synchronize()
        for layer, route in zip(engine.layers, path.layers):
            module = layer.module
            tensors = {n: _expert_tensor(layer, n) for n in layer.meta}
            for handle in layer.handles:
                handle.remove()
            module._buffers.pop(DTYPE_BUFFER, None)
            for n, t in tensors.items():
                module.register_parameter(n, nn.Parameter(t))
            route.set_streamed(None)
        engine.store.close()
    path.engine = None
    path.remove_if_idle()


__all__ = [
    "enable_expert_offload",
    "reference_copy",
    "disable_expert_offload",
    "get_offload_engine",
    "find_expert_modules",
]
