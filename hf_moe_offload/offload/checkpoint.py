"""Streaming, atomic checkpoints of offloaded experts (never all experts in memory at once).

- `write_safetensors_streaming` (offload/stores/safetensors_io.py): writes a safetensors file tensor by tensor, chunk by chunk, to a temporary name,
  fsyncs and renames it, so a crash or a full disk never leaves a half-written checkpoint under the final name.
- `save_offloaded_pretrained` (offload/saving.py) / `load_offloaded_pretrained`: a transformers-compatible sharded checkpoint
  (`model-*.safetensors` + `model.safetensors.index.json` + config + remote code) written and read expert by expert,
  so a model whose experts exceed host RAM loads straight into the disk tier. Checkpoints released in MXFP4 or
  fine-grained FP8 are dequantized expert by expert on the way in (offload/stores/prequantized.py).
- `save_expert_state` / `load_expert_state`: fp32 master weights and Adam moments of every expert plus step counts,
  for Trainer checkpoints (`expert_state.safetensors`).
"""

from __future__ import annotations

import dataclasses

import json
import logging
import os
import re
import zlib
from collections.abc import Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import CheckpointError
from .api import enable_expert_offload
from .config import OffloadConfig
from .stores.hub_layout import TensorsView, plan_checkpoint
from .stores.prequantized import dequantizing_quantizer, method_name
from .stores.safetensors_io import (
    INDEX_FILE,
    SafetensorsReader,
    missing_shards,
    read_weight_map,
    write_safetensors_streaming,
)
from .saving import _expert_param_names
from .stores.store import EXP_AVG, EXP_AVG_SQ, PARAM, tensor_bytes

logger = logging.getLogger(__name__)

EXPERT_STATE_FILE = "expert_state.safetensors"
EXPERT_STATE_FORMAT = "hf_moe_offload.expert_state.v1"


# --- expert optimizer state (Trainer checkpoints) ---
def save_expert_state(engine, folder: str, optimizer_state: dict | None = None, global_step: int | None = None) -> str:
    """fp32 master weights + Adam moments of every expert (rows [param, exp_avg, exp_avg_sq], one tensor per expert
    with its CRC32) and step counts, written atomically to `folder/expert_state.safetensors`; the experts' LoRA
    factors kept in the store (`OffloadConfig.lora_in_store`) likewise, one tensor per MoE layer."""
    engine.synchronize()
    store = engine.store
    lora = engine.lora.state()  # the experts' LoRA factors kept in the store (lora_store.py)
    if not store.trainable and not lora:
        raise ValueError("frozen experts (train_experts=False) have no optimizer state to save; their weights are "
                         "in the model's own save")
    keys = store.keys() if store.trainable else []
    specs = [(f"expert.{l}.{e}", torch.float32, (3, store.numel)) for l, e in keys]
    specs += [(f"lora.{layer}", torch.float32, tuple(rows.shape)) for layer, (rows, _) in sorted(lora.items())]

    def chunks(name: str) -> Iterator[torch.Tensor]:
        if name.startswith("lora."):
            yield lora[int(name.split(".")[1])][0]
            return
        _, l, e = name.split(".")
        key = (int(l), int(e))
        record = store.acquire(key, (PARAM, EXP_AVG, EXP_AVG_SQ))
        try:
            yield record.param
            yield record.exp_avg
            yield record.exp_avg_sq
        finally:
            store.release(key)

    meta = {"format": EXPERT_STATE_FORMAT, "numel": str(store.numel),
            "optimizer": json.dumps(optimizer_state or {}),
            "steps": json.dumps({f"{k[0]}.{k[1]}": store.steps[k] for k in keys}),
            "lora_steps": json.dumps({str(layer): steps for layer, (_, steps) in lora.items()})}
    if global_step is not None:
        meta["global_step"] = str(global_step)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, EXPERT_STATE_FILE)
    write_safetensors_streaming(path, specs, chunks, meta)
    return path


def read_expert_state_header(folder: str) -> dict[str, str]:
    """The metadata of `folder/expert_state.safetensors` (format, numel, global_step, ...); raises CheckpointError
    when the file is missing, truncated or not an expert state."""
    path = os.path.join(folder, EXPERT_STATE_FILE)
    meta = SafetensorsReader(path).metadata
    if meta.get("format") != EXPERT_STATE_FORMAT:
        raise CheckpointError(f"{path} is not an expert state written by hf_moe_offload")
    return meta


def load_expert_state(engine, folder: str) -> dict:
    """Restore what `save_expert_state` wrote (every expert checked against its CRC32 before any is written into the
    store); returns the optimizer state dict stored with it."""
    path = os.path.join(folder, EXPERT_STATE_FILE)
    store = engine.store
    f = SafetensorsReader(path)
    meta = f.metadata
    if meta.get("format") != EXPERT_STATE_FORMAT or int(meta.get("numel", -1)) != store.numel:
        raise CheckpointError(f"{path} does not hold expert state of this model (format or expert size differ)")
    names = set(f.keys())
    keys = store.keys() if store.trainable else []
    missing = [key for key in keys if f"expert.{key[0]}.{key[1]}" not in names]
    if missing:
        raise CheckpointError(f"{path} has no state for experts {missing[:4]}{'...' if len(missing) > 4 else ''}; "
                              "was it saved from another model?")
    lora_steps = json.loads(meta.get("lora_steps", "{}"))
    if engine.lora.layers and not lora_steps:
        raise CheckpointError(f"{path} holds no LoRA factors, but this model keeps its experts' LoRA factors in the "
                              "store (OffloadConfig.lora_in_store): was it saved without them?")
    for key in keys:  # verify every expert first (get checks CRCs): no half-restored store on corruption
        f.get(f"expert.{key[0]}.{key[1]}")
    lora = {int(layer): (f.get(f"lora.{layer}"), int(steps)) for layer, steps in lora_steps.items()}
    engine.synchronize()  # device-pinned state into the store first: written over below
    try:
        engine.lora.load(lora)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from None
    for key in keys:
        rows = f.get(f"expert.{key[0]}.{key[1]}")
        record = store.acquire(key)
        try:
            store.note_host_write(record)
            record.param.copy_(rows[0])
            record.exp_avg.copy_(rows[1])
            record.exp_avg_sq.copy_(rows[2])
            record.clear_grad(lazy=False)
            record.refresh_compute()
        finally:
            store.release(key, dirty=True, grad_zeroed=True)
        store.has_grad[key] = False
    for name, v in json.loads(meta["steps"]).items():
        l, e = (int(x) for x in name.split("."))
        store.steps[(l, e)] = int(v)
    store.flush()
    return json.loads(meta.get("optimizer", "{}"))


# --- whole models ---
def _checkpoint_files(path: str) -> dict[str, str]:
    """tensor name -> file, from an index or a single model.safetensors; every file must be there."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a directory with a saved model")
    weight_map = read_weight_map(path)
    if weight_map is not None:
        missing = missing_shards(path, weight_map)
        if missing:
            raise CheckpointError(
                f"{path} is incomplete: {INDEX_FILE} names {len(missing)} shard file(s) that are missing: "
                f"{', '.join(missing)}; copy them in, or use a complete checkpoint"
            )
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise CheckpointError(f"{path} has neither model.safetensors nor {INDEX_FILE}: not a saved model")
    return {k: single for k in SafetensorsReader(single).keys()}


def load_offloaded_pretrained(path: str, offload_config: OffloadConfig, model_class=None,
                              dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                              **config_kwargs) -> nn.Module:
    """Build a model from `path` with its experts streamed straight into the offload store.

    Non-expert weights are loaded normally; each expert's slices are read from the safetensors files one expert at
    a time, so host memory holds at most the non-expert weights, the store's cache and one expert. `dtype`: the
    model's dtype (default fp32); with `OffloadConfig(train_experts=False)` a bf16/fp16 model's store keeps the
    experts in that dtype only. `device`: where the model computes (its non-expert weights move there; the experts
    are uploaded as they are needed); default `OffloadConfig.device`, else the CPU.

    A checkpoint released quantized, MXFP4 (gpt-oss) or fine-grained FP8 (DeepSeek-V3/R1, Qwen3/GLM -FP8),
    is dequantized to `dtype` by transformers' own conversion ops as it streams, one expert at a time (non-expert
    weights whole), as `from_pretrained(path, quantization_config=<its config>(dequantize=True))` would; the model's
    config then carries no `quantization_config`, so a save writes a plain checkpoint. Other formats raise
    CheckpointError (offload/stores/prequantized.py).
    """
    if device is not None:
        offload_config = dataclasses.replace(offload_config, device=device)
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    model_class = model_class or AutoModelForCausalLM
    if offload_config.mode not in ("host", "disk"):
        raise ValueError("load_offloaded_pretrained needs OffloadConfig(mode='host' or 'disk')")
    # First: a missing folder or shard is named before anything is built.
    files = _CheckpointFiles(_checkpoint_files(path))
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    quantizer = dequantizing_quantizer(path, config)
    if quantizer is not None:  # the model holds dequantized weights, as transformers leaves it with dequantize=True
        del config.quantization_config
    with init_empty_weights():
        model = model_class.from_config(config, **({"dtype": dtype} if dtype is not None else {}))
    engine = enable_expert_offload(model, offload_config, _initialize=False)
    expert_names = _expert_param_names(model)
    # Keys in the layout transformers saves (per-expert tensors, renamed modules) map onto the model through
    # transformers' own conversion rules for the family (hub_layout.py); our own saves map one to one.
    own = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    plan = plan_checkpoint(model, files.files, own | set(expert_names), hf_quantizer=quantizer)
    missing = [k for k in expert_names if not plan.covers(k)]
    if missing:
        raise CheckpointError(f"{path} lacks expert tensors {missing[:3]}...; is it a checkpoint of this model?")
    # The conversion ops look the target tensor up for its dtype: offloaded experts are shown to them as meta tensors.
    view = TensorsView(model, {full: engine.layers[l].meta[n] for full, (l, n) in expert_names.items()})
    what = (f"dequantizing {method_name(quantizer.quantization_config.quant_method)} experts" if quantizer
            else "loading experts")
    with tqdm(total=sum(layer.layout.num_experts for layer in engine.layers), desc=what, unit="expert") as bar:
        for layer in engine.layers:
            _load_expert_layer(view, engine, layer, expert_names, plan, files, bar)
    engine.store.flush()
    unused = _load_non_expert_weights(model, path, plan, files, own, expert_names, view)
    if unused:
        logger.info("%s: checkpoint tensors not used by %s: %s", path, type(model).__name__, unused)
    model.eval()
    return model.to(offload_config.device) if offload_config.device is not None else model


class _CheckpointFiles:
    """tensor name -> file of a checkpoint, with one open reader per file."""

    def __init__(self, files: dict[str, str]):
        self.files = files
        self._readers: dict[str, SafetensorsReader] = {}

    def reader(self, key: str) -> SafetensorsReader:
        file = self.files[key]
        if file not in self._readers:
            self._readers[file] = SafetensorsReader(file)
        return self._readers[file]

    def read_whole(self, key: str) -> torch.Tensor:
        return self.reader(key).get(key)


def _load_expert_layer(view: TensorsView, engine, layer, expert_names: dict, plan, files: _CheckpointFiles,
                       bar: tqdm) -> None:
    """One MoE layer's experts into the store, one expert at a time; fused (E, ...) tensors are CRC-checked over
    their slices."""
    fulls = {n: full for full, (l, n) in expert_names.items() if l == layer.layer}
    flat = torch.empty(layer.layout.numel)
    fused = {full: plan.direct[full] for full in fulls.values() if full in plan.direct}
    converted = {full: plan.converted[full] for full in fulls.values() if full in plan.converted}
    # over the slices in order = the CRC32 of the whole tensor
    crcs = dict.fromkeys([*fused.values(), *(k for c in converted.values() for k in c.keys.values())], 0)

    def read_slice(key: str, e: int) -> torch.Tensor:
        piece = files.reader(key).get(key, e)
        crcs[key] = zlib.crc32(tensor_bytes(piece), crcs[key])
        return piece

    for e in range(layer.layout.num_experts):
        tensors = []
        for n in layer.layout.names():
            full = fulls[n]
            if full in fused:  # one (E, ...) tensor: read expert e's slice
                piece = read_slice(fused[full], e)
            elif full in converted:  # (E, ...) quantized tensors (MXFP4 blocks and scales): e's slices, dequantized
                piece = converted[full].expert(e, read_slice, view)
            else:  # one tensor per expert and projection: fuse (and dequantize) expert e's alone
                piece = plan.per_expert[full].expert(e, files.read_whole, view)
            tensors.append(piece.float())
        engine.store.write_param((layer.layer, e), layer.layout.pack(tensors, flat))
        bar.update(1)
    for key, crc in crcs.items():
        files.reader(key).check_crc(key, crc)


def _load_non_expert_weights(model: nn.Module, path: str, plan, files: _CheckpointFiles, own: set[str],
                             expert_names: dict, view: TensorsView) -> list[str]:
    """The non-expert weights into the (empty-initialised) model; returns the checkpoint keys left unused.

    As from_pretrained does, a checkpoint of another head of the same base model loads: tensors outside the base
    model that this class lacks (e.g. a causal-LM `lm_head`) are skipped, and head parameters the checkpoint lacks
    (e.g. a new classifier `score`) are initialised. Anything missing inside the base model is still an error.
    """
    from accelerate.utils import set_module_tensor_to_device

    base_prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else None

    def is_head(name: str) -> bool:
        return base_prefix is not None and not name.startswith(base_prefix)

    # Tensors the model's class declares it does not hold (DeepSeek-V3's multi-token-prediction layer 61, GLM-4.5's
    # layer 92): left unused, as from_pretrained leaves them.
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    ignored = re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None
    unused = [t for t in plan.per_expert if t not in expert_names]
    sources = {**plan.direct, **plan.converted}  # a converted one (an FP8 weight) is dequantized from its sources
    for name, source in sources.items():
        if name in expert_names:
            continue
        key = source if isinstance(source, str) else min(source.keys.values())
        if (name not in own and is_head(name)) or (ignored is not None and ignored.search(name) is not None):
            unused.append(key)
            continue
        value = files.read_whole(source) if isinstance(source, str) else source.whole(files.read_whole, view)
        try:
            set_module_tensor_to_device(model, name, "cpu", value=value)
        except (AttributeError, KeyError) as err:
            raise CheckpointError(f"{path}: tensor {key} does not belong to this model ({err})") from err
    model.tie_weights()
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if meta and all(is_head(n) for n in meta):
        modules = {n.rsplit(".", 1)[0] for n in meta}
        for n in meta:
            p = model.get_parameter(n)
            set_module_tensor_to_device(model, n, "cpu", value=torch.empty(p.shape, dtype=p.dtype))
        for m in sorted(modules):
            model._init_weights(model.get_submodule(m))
        logger.warning("%s: newly initialised %s (not in the checkpoint); train them before use", path, sorted(meta))
        meta = []
    if meta:
        raise CheckpointError(f"{path} is missing weights for {meta[:5]}")
    return unused


__all__ = [
    "save_expert_state",
    "read_expert_state_header",
    "load_expert_state",
    "load_offloaded_pretrained",
    "EXPERT_STATE_FILE",
]
