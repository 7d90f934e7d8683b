"""Saving an offloaded model as a transformers checkpoint, one expert at a time (bounded host memory).

`save_offloaded_pretrained` writes a transformers-compatible sharded checkpoint (`model-*.safetensors` +
`model.safetensors.index.json` + config + remote code) whose experts are read from the store expert by expert. It is
the documented entry for saving an offloaded model: `OffloadTrainer` (hf_moe_offload/trainer.py) saves checkpoints
through it, and the jobs save their final model with it. `model.save_pretrained` stays transformers' own: it takes
`state_dict()`, which assembles the experts in host memory (correct, but the whole expert width at once).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import CheckpointError
from ..families.moe_path import attached_path, find_experts_modules
from .stores.safetensors_io import (
    _SHARD_PATTERN,
    INDEX_FILE,
    _raise_io,
    _silent_remove,
    fsync_directory,
    read_weight_map,
    write_safetensors_streaming,
)
from .lora.expert_lora import active_expert_lora
from .stores.store import WEIGHTS

logger = logging.getLogger(__name__)


def _offload_engine(model: nn.Module):
    path = attached_path(model)
    return path.engine if path is not None else None


def _offloaded_meta(model: nn.Module, layer: int) -> dict | None:
    engine = _offload_engine(model)
    return engine.layers[layer].meta if engine is not None and engine.store is not None else None


def _expert_param_names(model: nn.Module) -> dict[str, tuple[int, str]]:
    """Full state-dict name -> (MoE layer ordinal, tensor name) for every expert tensor."""
    out = {}
    for layer, (prefix, module) in enumerate(find_experts_modules(model)):
        names = _offloaded_meta(model, layer) or dict(module.named_parameters(recurse=False))
        for n in names:
            out[f"{prefix}.{n}"] = (layer, n)
    return out


def save_offloaded_pretrained(model: nn.Module, save_directory: str, safe_serialization: bool = True,
                              expert_deltas: dict | None = None) -> None:
    """`save_pretrained` for an offloaded model that streams experts one at a time (bounded host memory).

    Writes one shard of non-expert weights and one shard per MoE layer (each tensor with its CRC32), an index, the
    config, the generation config and the remote-code files. Everything is written into a temporary folder first;
    the index, which says which shards make up the model, is moved in last, atomically. A re-save over an earlier
    save writes shards under new names while the old index still points to the old ones, so whatever happens
    (a kill, a full disk) `save_directory` holds the old save or the new one, never a mix of their weights. The
    superseded shards and leftovers of interrupted saves are removed after the switch. `expert_deltas`: {layer:
    {tensor name: [LoraTerm]}}, LoRA terms added to each expert as it is written (`save_merged_lora`).
    """
    engine = _offload_engine(model)
    if engine is None or engine.store is None:
        model.save_pretrained(save_directory)
        return
    engine.synchronize()
    expert_names = _expert_param_names(model)
    tmp_dir = _fresh_tmp_dir(save_directory)
    shard_names = _shard_names(save_directory, len(engine.layers) + 1)
    try:
        weight_map = _write_base_shard(model, engine, expert_names, os.path.join(tmp_dir, shard_names[0]))
        for layer in tqdm(engine.layers, desc="saving experts", unit="layer"):
            weight_map.update(_write_expert_shard(engine, layer, expert_names, tmp_dir, shard_names[layer.layer + 1],
                                                  (expert_deltas or {}).get(layer.layer, {})))
        _switch_to_new_save(model, tmp_dir, save_directory, weight_map)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("saved offloaded model to %s (%d expert shards, streamed)", save_directory, len(engine.layers))


def _fresh_tmp_dir(save_directory: str) -> str:
    """The temporary folder of this save, after removing those of saves that were killed."""
    os.makedirs(save_directory, exist_ok=True)
    for name in os.listdir(save_directory):  # leftovers of a save that was killed
        if name.startswith(".tmp-save-"):
            shutil.rmtree(os.path.join(save_directory, name), ignore_errors=True)
    tmp_dir = os.path.join(save_directory, f".tmp-save-{os.getpid()}")
    os.makedirs(tmp_dir)
    return tmp_dir


def _shard_names(save_directory: str, total: int) -> list[str]:
    """The Hub's shard names, or names with a save token where the live save in `save_directory` uses those."""
    try:
        live = set((read_weight_map(save_directory) or {}).values())
    except CheckpointError:  # a corrupt index points to nothing: its shards are not live
        live = set()
    token = uuid.uuid4().hex[:8]
    shard_names = [f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1)]
    if live & set(shard_names):  # the live save uses these names: write beside them, switch by the index
        shard_names = [f"model-{i:05d}-of-{total:05d}-{token}.safetensors" for i in range(1, total + 1)]
    return shard_names


def _write_base_shard(model: nn.Module, engine, expert_names: dict, path: str) -> dict[str, str]:
    """The non-expert weights (tied ones once) into one shard; returns their part of the weight map."""
    with engine.experts_left_out_of_state_dict():
        base = {k: v for k, v in model.state_dict().items() if k not in expert_names}
    tied = getattr(model, "_tied_weights_keys", None) or {}
    if getattr(model.config, "tie_word_embeddings", False):
        for k in list(tied):
            base.pop(k, None)
    write_safetensors_streaming(path, [(k, v.dtype, tuple(v.shape)) for k, v in base.items()], lambda k: [base[k]],
                                {"format": "pt"})
    shard = os.path.basename(path)
    return {k: shard for k in base}


def _write_expert_shard(engine, layer, expert_names: dict, tmp_dir: str, shard: str,
                        deltas: dict) -> dict[str, str]:
    """One MoE layer's (E, ...) tensors into one shard, each assembled expert by expert from the store (plus the
    LoRA terms `deltas` has for it); returns their part of the weight map."""
    names = [(full, n) for full, (l, n) in expert_names.items() if l == layer.layer]
    specs = []
    for full, n in names:
        shape, dtype = layer.meta[n]
        specs.append((full, dtype, tuple(shape)))
    idx = {n: layer.layout.names().index(n) for _, n in names}
    by_full = dict(names)

    def chunks(full: str):
        i = idx[by_full[full]]
        spec, off = layer.layout.tensors[i], layer.layout.offsets[i]
        for e in range(layer.layout.num_experts):
            key = (layer.layer, e)
            record = engine.store.acquire(key, WEIGHTS)
            try:
                value = record.weights(torch.float32, off, spec.numel)
            finally:
                engine.store.release(key)
            for term in deltas.get(by_full[full], ()):
                value += term.delta(e).reshape(-1).float()
            yield value

    write_safetensors_streaming(os.path.join(tmp_dir, shard), specs, chunks, {"format": "pt"})
    return {full: shard for full, _ in names}


def _switch_to_new_save(model: nn.Module, tmp_dir: str, save_directory: str, weight_map: dict[str, str]) -> None:
    """Index, config and remote code beside the shards, then everything moved into `save_directory` with the index
    last (the one atomic switch), then the superseded files removed."""
    from transformers.dynamic_module_utils import custom_object_save

    index = {"metadata": {"total_size": sum(os.path.getsize(os.path.join(tmp_dir, f)) for f in set(weight_map.values()))},
             "weight_map": dict(sorted(weight_map.items()))}
    try:
        with open(os.path.join(tmp_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        if getattr(model, "_auto_class", None) is not None:
            custom_object_save(model, tmp_dir, config=model.config)
        model.config.save_pretrained(tmp_dir)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(tmp_dir)
        # Shards first (new names: the live index does not see them), then the small files, the index last: the
        # single atomic switch from the old save to the new one.
        for name in sorted(os.listdir(tmp_dir), key=lambda n: (n == INDEX_FILE, not n.endswith(".safetensors"))):
            os.replace(os.path.join(tmp_dir, name), os.path.join(save_directory, name))
        fsync_directory(save_directory)
    except OSError as err:
        _raise_io(err, save_directory)
    new = set(weight_map.values())
    for name in os.listdir(save_directory):
        # A previous unsharded save would shadow the index (removed only now: until the switch it was the live
        # save); shards of earlier saves are superseded.
        if name == "model.safetensors" or (_SHARD_PATTERN.match(name) and name not in new):
            _silent_remove(os.path.join(save_directory, name))


def save_merged_lora(model: nn.Module, save_directory: str) -> nn.Module:
    """Save a peft LoRA model whose experts are offloaded as one plain transformers checkpoint with the adapters
    merged in, the experts streamed (each expert's `W + scaling * lhs @ rhs` formed as it is written, never the
    whole layer). 1. the terms of the adapters on expert tensors are taken from peft's wrappers; 2. every other LoRA
    layer merges itself (peft's `merge`); 3. peft's `unload()` takes the wrappers off, which leaves the merged layers
    and the experts module in place (peft cannot merge into offloaded experts: their values are in the store);
    4. `save_offloaded_pretrained` writes the model with the expert terms added. Returns the unwrapped model (`model`
    is consumed, as by peft's `merge_and_unload`)."""
    path = attached_path(model)
    if path is None or path.engine is None or path.engine.store is None:
        merged = model.merge_and_unload()
        merged.save_pretrained(save_directory)
        return merged
    terms = {}
    with torch.no_grad():
        for layer, route in zip(path.engine.layers, path.layers):
            if path.engine.config.lora_in_store:  # the factors' masters in the store (lora_store.py)
                found = path.engine.lora.active(layer.layer, route.place(), layer.module)
                found = found.whole() if found is not None else None
            else:
                found = active_expert_lora(route.place(), layer.module)
            if found is not None:
                terms[layer.layer] = {name: [term.detached() for term in ts] for name, ts in found.terms.items()}
        for module in model.modules():
            if hasattr(module, "lora_A") and hasattr(module, "merge") and not hasattr(module, "parameter_name"):
                module.merge()
    base = model.unload()
    save_offloaded_pretrained(base, save_directory, expert_deltas=terms)
    return base


__all__ = ["save_merged_lora", "save_offloaded_pretrained"]
