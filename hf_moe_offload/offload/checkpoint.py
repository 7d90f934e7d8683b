"""Streaming, atomic checkpoints of offloaded experts (never all experts in memory at once).

- `write_safetensors_streaming`: writes a safetensors file tensor by tensor, chunk by chunk, to a temporary name,
  fsyncs and renames it, so a crash or a full disk never leaves a half-written checkpoint under the final name.
- `save_offloaded_pretrained` / `load_offloaded_pretrained`: a transformers-compatible sharded checkpoint
  (`model-*.safetensors` + `model.safetensors.index.json` + config + remote code) written and read expert by expert,
  so a model whose experts exceed host RAM loads straight into the disk tier.
- `save_expert_state` / `load_expert_state`: fp32 master weights and Adam moments of every expert plus step counts,
  for Trainer checkpoints (`expert_state.safetensors`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from .api import enable_expert_offload, find_expert_modules, get_offload_engine
from .config import OffloadConfig
from .store import ExpertStoreError

logger = logging.getLogger(__name__)

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32"}
EXPERT_STATE_FILE = "expert_state.safetensors"


class CheckpointError(RuntimeError):
    pass


def _raise_io(err: OSError, path: str) -> None:
    if err.errno == errno.ENOSPC:
        raise CheckpointError(
            f"disk full while writing {path}; nothing was replaced (the previous checkpoint is intact). Free space "
            "and save again"
        ) from err
    raise CheckpointError(f"could not write {path}: {err}") from err


def write_safetensors_streaming(
    path: str,
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    chunks: Callable[[str], Iterable[torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a safetensors file whose tensor `name` is the concatenation of `chunks(name)` (in `specs` order)."""
    header: dict = {}
    offset = 0
    for name, dtype, shape in specs:
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, dtype, shape in specs:
                written = 0
                for chunk in chunks(name):
                    data = chunk.detach().to("cpu", dtype).contiguous()
                    f.write(memoryview(data.view(torch.uint8).numpy()))
                    written += data.numel()
                if written != torch.Size(shape).numel():
                    raise CheckpointError(f"tensor {name}: wrote {written} elements, expected {torch.Size(shape).numel()}")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        _silent_remove(tmp)
        _raise_io(err, path)
    except BaseException:
        _silent_remove(tmp)
        raise


def _silent_remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


class SafetensorsReader:
    """Reads tensors, or one leading-dim slice of a tensor, with plain file reads (no mmap).

    NOTE: not `safe_open`: its mmap keeps every touched page of a multi-GB shard resident until the file is closed,
    which would make "stream one expert at a time" a fiction in RSS terms.
    """

    _FROM = {v: k for k, v in _DTYPES.items()}

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{path} is truncated or not a safetensors file (header of {n} bytes)")
            self.header = json.loads(f.read(n))
        self.base = 8 + n
        self.metadata = self.header.pop("__metadata__", None) or {}
        end = max((v["data_offsets"][1] for v in self.header.values()), default=0)
        if self.base + end > size:
            raise CheckpointError(f"{path} is truncated ({size} bytes, the header promises {self.base + end})")

    def keys(self) -> list[str]:
        return list(self.header)

    def _read(self, name: str, start: int, nbytes: int) -> bytearray:
        buf = bytearray(nbytes)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.base + start)
            if f.readinto(buf) != nbytes:
                raise CheckpointError(f"{self.path}: tensor {name} is truncated")
        return buf

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor `name`, or its `index`-th slice along the leading dimension."""
        info = self.header[name]
        dtype, shape = self._FROM[info["dtype"]], list(info["shape"])
        begin, end = info["data_offsets"]
        if index is not None:
            per = (end - begin) // shape[0]
            begin, end, shape = begin + index * per, begin + (index + 1) * per, shape[1:]
        data = self._read(name, begin, end - begin)
        return torch.frombuffer(data, dtype=dtype).reshape(shape) if end > begin else torch.empty(shape, dtype=dtype)


# --- expert optimizer state (Trainer checkpoints) ---
def save_expert_state(engine, folder: str, optimizer_state: dict | None = None) -> str:
    """fp32 master weights + Adam moments of every expert (rows [param, exp_avg, exp_avg_sq]) and step counts."""
    engine.synchronize()
    store = engine.store
    specs = [(f"expert.{l}.{e}", torch.float32, (3, store.numel)) for l, e in store.keys()]

    def chunks(name: str) -> Iterator[torch.Tensor]:
        _, l, e = name.split(".")
        key = (int(l), int(e))
        record = store.acquire(key)
        try:
            yield record.param
            yield record.exp_avg
            yield record.exp_avg_sq
        finally:
            store.release(key)

    meta = {"format": "hf_moe_offload.expert_state.v1", "numel": str(store.numel),
            "optimizer": json.dumps(optimizer_state or {}),
            "steps": json.dumps({f"{k[0]}.{k[1]}": v for k, v in store.steps.items()})}
    path = os.path.join(folder, EXPERT_STATE_FILE)
    write_safetensors_streaming(path, specs, chunks, meta)
    return path


def load_expert_state(engine, folder: str) -> dict:
    """Restore what `save_expert_state` wrote; returns the optimizer state dict stored with it."""
    path = os.path.join(folder, EXPERT_STATE_FILE)
    store = engine.store
    try:
        f = SafetensorsReader(path)
        meta = f.metadata
        if meta.get("format") != "hf_moe_offload.expert_state.v1" or int(meta.get("numel", -1)) != store.numel:
            raise CheckpointError(f"{path} does not hold expert state of this model (format or expert size differ)")
        names = set(f.keys())
        for key in store.keys():
            name = f"expert.{key[0]}.{key[1]}"
            if name not in names:
                raise CheckpointError(f"{path} has no state for expert {key}; was it saved from another model?")
            rows = f.get(name)
            record = store.acquire(key)
            try:
                record.param.copy_(rows[0])
                record.exp_avg.copy_(rows[1])
                record.exp_avg_sq.copy_(rows[2])
                record.grad.zero_()
                record.refresh_compute()
            finally:
                store.release(key, dirty=True)
            store.has_grad[key] = False
    except FileNotFoundError as err:
        raise CheckpointError(f"{path} is missing: the checkpoint was not saved with the expert optimizer") from err
    for name, v in json.loads(meta["steps"]).items():
        l, e = (int(x) for x in name.split("."))
        store.steps[(l, e)] = int(v)
    store.flush()
    return json.loads(meta.get("optimizer", "{}"))


# --- whole models ---
def _expert_param_names(model: nn.Module) -> dict[str, tuple[int, str]]:
    """Full state-dict name -> (MoE layer ordinal, tensor name) for every expert tensor."""
    out = {}
    for layer, (prefix, module) in enumerate(find_expert_modules(model)):
        names = module._offloaded_meta if hasattr(module, "_offloaded_meta") else dict(module.named_parameters(recurse=False))
        for n in names:
            out[f"{prefix}.{n}"] = (layer, n)
    return out


def save_offloaded_pretrained(model: nn.Module, save_directory: str, safe_serialization: bool = True) -> None:
    """`save_pretrained` for an offloaded model that streams experts one at a time (bounded host memory).

    Writes one shard of non-expert weights and one shard per MoE layer, an index, the config, the generation config
    and the remote-code files. Everything is written into a temporary folder first and moved in only when complete
    (index last), so a failure (e.g. a full disk) leaves what was in `save_directory` untouched.
    """
    engine = get_offload_engine(model)
    if engine is None or engine.store is None:
        model.save_pretrained(save_directory)
        return
    engine.synchronize()
    from transformers.dynamic_module_utils import custom_object_save

    expert_names = _expert_param_names(model)
    os.makedirs(save_directory, exist_ok=True)
    tmp_dir = os.path.join(save_directory, f".tmp-save-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    try:
        engine._state_dict_experts = False
        try:
            base = {k: v for k, v in model.state_dict().items() if k not in expert_names}
        finally:
            engine._state_dict_experts = True
        tied = getattr(model, "_tied_weights_keys", None) or {}
        if getattr(model.config, "tie_word_embeddings", False):
            for k in list(tied):
                base.pop(k, None)
        num_layers = len(engine.layers)
        total = num_layers + 1
        weight_map = {}
        shard = f"model-00001-of-{total:05d}.safetensors"
        try:
            save_file({k: v.contiguous() for k, v in base.items()}, os.path.join(tmp_dir, shard), metadata={"format": "pt"})
        except OSError as err:
            _raise_io(err, os.path.join(tmp_dir, shard))
        weight_map.update({k: shard for k in base})
        for layer in tqdm(engine.layers, desc="saving experts", unit="layer"):
            shard = f"model-{layer.layer + 2:05d}-of-{total:05d}.safetensors"
            names = [(full, n) for full, (l, n) in expert_names.items() if l == layer.layer]
            specs = []
            for full, n in names:
                shape, dtype = layer.module._offloaded_meta[n]
                specs.append((full, dtype, tuple(shape)))
            idx = {n: layer.layout.names().index(n) for _, n in names}
            by_full = dict(names)

            def chunks(full: str, layer=layer, idx=idx, by_full=by_full):
                i = idx[by_full[full]]
                spec, off = layer.layout.tensors[i], layer.layout.offsets[i]
                for e in range(layer.layout.num_experts):
                    key = (layer.layer, e)
                    record = engine.store.acquire(key)
                    try:
                        yield record.param[off : off + spec.numel].clone()
                    finally:
                        engine.store.release(key)

            write_safetensors_streaming(os.path.join(tmp_dir, shard), specs, chunks, {"format": "pt"})
            weight_map.update({full: shard for full, _ in names})
        index = {"metadata": {"total_size": sum(os.path.getsize(os.path.join(tmp_dir, f)) for f in set(weight_map.values()))},
                 "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(tmp_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
        if getattr(model, "_auto_class", None) is not None:
            custom_object_save(model, tmp_dir, config=model.config)
        model.config.save_pretrained(tmp_dir)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(tmp_dir)
        index_name = "model.safetensors.index.json"
        for name in sorted(os.listdir(tmp_dir), key=lambda n: n == index_name):  # the index goes in last
            os.replace(os.path.join(tmp_dir, name), os.path.join(save_directory, name))
        stale = os.path.join(save_directory, "model.safetensors")  # a previous unsharded save would shadow the index
        if os.path.exists(stale):
            os.remove(stale)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("saved offloaded model to %s (%d expert shards, streamed)", save_directory, len(engine.layers))


def _checkpoint_files(path: str) -> dict[str, str]:
    """tensor name -> file, from an index or a single model.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    return {k: single for k in SafetensorsReader(single).keys()}


def load_offloaded_pretrained(path: str, offload_config: OffloadConfig, model_class=None, **config_kwargs) -> nn.Module:
    """Build a model from `path` with its experts streamed straight into the offload store.

    Non-expert weights are loaded normally; each expert's slices are read from the safetensors files one expert at
    a time, so host memory holds at most the non-expert weights, the store's cache and one expert.
    """
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoConfig, AutoModelForCausalLM

    model_class = model_class or AutoModelForCausalLM
    if offload_config.mode not in ("host", "disk"):
        raise ValueError("load_offloaded_pretrained needs OffloadConfig(mode='host' or 'disk')")
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    with init_empty_weights():
        model = model_class.from_config(config)
    files = _checkpoint_files(path)
    engine = enable_expert_offload(model, offload_config, _initialize=False)
    expert_names = _expert_param_names(model)
    readers: dict[str, SafetensorsReader] = {}

    def reader(file: str) -> SafetensorsReader:
        if file not in readers:
            readers[file] = SafetensorsReader(file)
        return readers[file]

    missing = [k for k in expert_names if k not in files]
    if missing:
        raise CheckpointError(f"{path} lacks expert tensors {missing[:3]}...; is it a checkpoint of this model?")
    for layer in tqdm(engine.layers, desc="loading experts", unit="layer"):
        fulls = {n: full for full, (l, n) in expert_names.items() if l == layer.layer}
        flat = torch.empty(layer.layout.numel)
        for e in range(layer.layout.num_experts):
            tensors = [reader(files[fulls[n]]).get(fulls[n], e).float() for n in layer.layout.names()]
            engine.store.write_param((layer.layer, e), layer.layout.pack(tensors, flat))
    engine.store.flush()
    # As from_pretrained does, a checkpoint of another head of the same base model loads: tensors outside the base
    # model that this class lacks (e.g. a causal-LM `lm_head`) are skipped, and head parameters the checkpoint lacks
    # (e.g. a new classifier `score`) are initialised. Anything missing inside the base model is still an error.
    base_prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else None
    own = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}

    def is_head(name: str) -> bool:
        return base_prefix is not None and not name.startswith(base_prefix)

    unused = []
    for name, file in files.items():
        if name in expert_names:
            continue
        if name not in own and is_head(name):
            unused.append(name)
            continue
        try:
            set_module_tensor_to_device(model, name, "cpu", value=reader(file).get(name))
        except (AttributeError, KeyError) as err:
            raise CheckpointError(f"{path}: tensor {name} does not belong to this model ({err})") from err
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
    if unused:
        logger.info("%s: checkpoint tensors not used by %s: %s", path, type(model).__name__, unused)
    model.eval()
    return model


__all__ = [
    "write_safetensors_streaming",
    "save_expert_state",
    "load_expert_state",
    "save_offloaded_pretrained",
    "load_offloaded_pretrained",
    "CheckpointError",
    "SafetensorsReader",
    "EXPERT_STATE_FILE",
]
