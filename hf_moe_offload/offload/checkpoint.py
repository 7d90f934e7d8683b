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
import re
import shutil
import struct
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import CheckpointError
from .api import enable_expert_offload, find_expert_modules, get_offload_engine
from .hub_layout import plan_checkpoint
from .config import OffloadConfig
from .store import EXP_AVG, EXP_AVG_SQ, PARAM, WEIGHTS, ExpertStoreError, tensor_bytes

logger = logging.getLogger(__name__)

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
EXPERT_STATE_FILE = "expert_state.safetensors"
EXPERT_STATE_FORMAT = "hf_moe_offload.expert_state.v1"
CRC_METADATA_KEY = "hf_moe_offload.crc32"
INDEX_FILE = "model.safetensors.index.json"
# Shards written by save_offloaded_pretrained: the Hub's names, or with a save token when a re-save must not
# overwrite the shards the live index still points to.
_SHARD_PATTERN = re.compile(r"^model-\d{5}-of-\d{5}(-[0-9a-f]{8})?\.safetensors$")


def _raise_io(err: OSError, path: str) -> None:
    if err.errno == errno.ENOSPC:
        raise CheckpointError(
            f"disk full while writing {path}; nothing was replaced (the previous checkpoint is intact). Free space "
            "and save again"
        ) from err
    raise CheckpointError(f"could not write {path}: {err}") from err


def fsync_directory(path: str) -> None:
    """Make renames inside `path` durable (a crash after `os.replace` keeps the new name)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()


def _crc_field(crcs: dict[str, int]) -> str:
    """The CRC metadata value: fixed-width hex, so the header written before the tensors (every CRC 0) and the one
    written after them (the real CRCs) have the same length."""
    return json.dumps({name: f"{crc:08x}" for name, crc in crcs.items()})


def _header_blob(header: dict) -> bytes:
    blob = json.dumps(header, separators=(",", ":")).encode()
    return blob + b" " * (-len(blob) % 8)


def write_safetensors_streaming(
    path: str,
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    chunks: Callable[[str], Iterable[torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> dict[str, int]:
    """Write a safetensors file whose tensor `name` is the concatenation of `chunks(name)` (in `specs` order).

    Atomic: written under a temporary name, fsynced, renamed. The header's metadata carries a CRC32 of every tensor
    (`CRC_METADATA_KEY`; stock loaders ignore it, `SafetensorsReader` checks it). Returns the CRCs."""
    header: dict = {}
    offset = 0
    for name, dtype, shape in specs:
        nbytes = _nbytes(dtype, shape)
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    meta = dict(metadata or {})
    # The CRCs are known only once the tensors have streamed through: the header goes out first with zeros of the
    # same width and is rewritten in place, with the real values, after the last tensor (before the fsync).
    meta[CRC_METADATA_KEY] = _crc_field(dict.fromkeys((name for name, _, _ in specs), 0))
    header["__metadata__"] = meta
    blob = _header_blob(header)
    crcs: dict[str, int] = {}
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, dtype, shape in specs:
                written, crc = 0, 0
                for chunk in chunks(name):
                    data = tensor_bytes(chunk.detach().to("cpu", dtype))
                    f.write(data)
                    crc = zlib.crc32(data, crc)
                    written += data.nbytes
                want = _nbytes(dtype, shape)
                if written != want:
                    raise CheckpointError(f"tensor {name}: wrote {written} bytes, expected {want}")
                crcs[name] = crc
            meta[CRC_METADATA_KEY] = _crc_field(crcs)  # the same width as the zeros: the header keeps its length
            f.seek(8)
            f.write(_header_blob(header))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_directory(os.path.dirname(os.path.abspath(path)))
    except OSError as err:
        _silent_remove(tmp)
        _raise_io(err, path)
    except BaseException:
        _silent_remove(tmp)
        raise
    return crcs


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
        try:
            size = os.path.getsize(path)
        except FileNotFoundError as err:
            raise CheckpointError(f"{path} is missing") from err
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{path} is truncated or not a safetensors file (header of {n} bytes)")
            try:
                self.header = json.loads(f.read(n))
            except ValueError as err:
                raise CheckpointError(f"{path} is corrupt (its safetensors header is not valid JSON)") from err
        self.base = 8 + n
        self.metadata = self.header.pop("__metadata__", None) or {}
        self.crc32s = {k: int(v, 16) for k, v in json.loads(self.metadata.get(CRC_METADATA_KEY, "{}")).items()}
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

    def check_crc(self, name: str, crc: int) -> None:
        """Compare a CRC32 of all of `name`'s bytes with the one written with it (if the file has one)."""
        want = self.crc32s.get(name)
        if want is not None and want != crc:
            raise CheckpointError(
                f"{self.path}: tensor {name} is corrupt (CRC32 {crc:08x}, written as {want:08x}): the file changed "
                "after it was saved. Use another checkpoint (or re-save this one from a good copy)"
            )

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor `name` (checked against its CRC32 when the file has one), or its `index`-th slice along the
        leading dimension (unchecked: callers that read every slice in order check with `check_crc`)."""
        if name not in self.header:
            raise CheckpointError(f"{self.path} has no tensor {name}")
        info = self.header[name]
        dtype, shape = self._FROM[info["dtype"]], list(info["shape"])
        begin, end = info["data_offsets"]
        if index is not None:
            per = (end - begin) // shape[0]
            begin, end, shape = begin + index * per, begin + (index + 1) * per, shape[1:]
        data = self._read(name, begin, end - begin)
        if index is None:
            self.check_crc(name, zlib.crc32(data))
        return torch.frombuffer(data, dtype=dtype).reshape(shape) if end > begin else torch.empty(shape, dtype=dtype)


# --- expert optimizer state (Trainer checkpoints) ---
def save_expert_state(engine, folder: str, optimizer_state: dict | None = None, global_step: int | None = None) -> str:
    """fp32 master weights + Adam moments of every expert (rows [param, exp_avg, exp_avg_sq], one tensor per expert
    with its CRC32) and step counts, written atomically to `folder/expert_state.safetensors`."""
    engine.synchronize()
    store = engine.store
    if not store.trainable:
        raise ValueError("frozen experts (train_experts=False) have no optimizer state to save; their weights are "
                         "in the model's own save")
    specs = [(f"expert.{l}.{e}", torch.float32, (3, store.numel)) for l, e in store.keys()]

    def chunks(name: str) -> Iterator[torch.Tensor]:
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
            "steps": json.dumps({f"{k[0]}.{k[1]}": v for k, v in store.steps.items()})}
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
    missing = [key for key in store.keys() if f"expert.{key[0]}.{key[1]}" not in names]
    if missing:
        raise CheckpointError(f"{path} has no state for experts {missing[:4]}{'...' if len(missing) > 4 else ''}; "
                              "was it saved from another model?")
    for key in store.keys():  # verify every expert first (get checks CRCs): no half-restored store on corruption
        f.get(f"expert.{key[0]}.{key[1]}")
    engine.synchronize()  # device-pinned state into the store first: written over below
    for key in store.keys():
        rows = f.get(f"expert.{key[0]}.{key[1]}")
        record = store.acquire(key)
        try:
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
def _offloaded_meta(model: nn.Module, layer: int) -> dict | None:
    engine = get_offload_engine(model)
    return engine.layers[layer].meta if engine is not None and engine.store is not None else None


def _expert_param_names(model: nn.Module) -> dict[str, tuple[int, str]]:
    """Full state-dict name -> (MoE layer ordinal, tensor name) for every expert tensor."""
    out = {}
    for layer, (prefix, module) in enumerate(find_expert_modules(model)):
        names = _offloaded_meta(model, layer) or dict(module.named_parameters(recurse=False))
        for n in names:
            out[f"{prefix}.{n}"] = (layer, n)
    return out


def read_weight_map(directory: str) -> dict[str, str] | None:
    """tensor name -> shard file of the safetensors index in `directory` (None without an index)."""
    index = os.path.join(directory, INDEX_FILE)
    if not os.path.exists(index):
        return None
    try:
        with open(index) as f:
            return json.load(f)["weight_map"]
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"{index} is corrupt ({err}); re-save the model") from err


def missing_shards(directory: str, weight_map: dict[str, str]) -> list[str]:
    return sorted({v for v in weight_map.values() if not os.path.exists(os.path.join(directory, v))})


def save_offloaded_pretrained(model: nn.Module, save_directory: str, safe_serialization: bool = True) -> None:
    """`save_pretrained` for an offloaded model that streams experts one at a time (bounded host memory).

    Writes one shard of non-expert weights and one shard per MoE layer (each tensor with its CRC32), an index, the
    config, the generation config and the remote-code files. Everything is written into a temporary folder first;
    the index, which says which shards make up the model, is moved in last, atomically. A re-save over an earlier
    save writes shards under new names while the old index still points to the old ones, so whatever happens
    (a kill, a full disk) `save_directory` holds the old save or the new one, never a mix of their weights. The
    superseded shards and leftovers of interrupted saves are removed after the switch.
    """
    engine = get_offload_engine(model)
    if engine is None or engine.store is None:
        model.save_pretrained(save_directory)
        return
    engine.synchronize()
    from transformers.dynamic_module_utils import custom_object_save

    expert_names = _expert_param_names(model)
    os.makedirs(save_directory, exist_ok=True)
    for name in os.listdir(save_directory):  # leftovers of a save that was killed
        if name.startswith(".tmp-save-"):
            shutil.rmtree(os.path.join(save_directory, name), ignore_errors=True)
    tmp_dir = os.path.join(save_directory, f".tmp-save-{os.getpid()}")
    os.makedirs(tmp_dir)
    try:
        live = set((read_weight_map(save_directory) or {}).values())
    except CheckpointError:  # a corrupt index points to nothing: its shards are not live
        live = set()
    num_layers = len(engine.layers)
    total = num_layers + 1
    token = uuid.uuid4().hex[:8]
    shard_names = [f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1)]
    if live & set(shard_names):  # the live save uses these names: write beside them, switch by the index
        shard_names = [f"model-{i:05d}-of-{total:05d}-{token}.safetensors" for i in range(1, total + 1)]
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
        weight_map = {}
        shard = shard_names[0]
        write_safetensors_streaming(
            os.path.join(tmp_dir, shard), [(k, v.dtype, tuple(v.shape)) for k, v in base.items()],
            lambda k: [base[k]], {"format": "pt"})
        weight_map.update({k: shard for k in base})
        for layer in tqdm(engine.layers, desc="saving experts", unit="layer"):
            shard = shard_names[layer.layer + 1]
            names = [(full, n) for full, (l, n) in expert_names.items() if l == layer.layer]
            specs = []
            for full, n in names:
                shape, dtype = layer.meta[n]
                specs.append((full, dtype, tuple(shape)))
            idx = {n: layer.layout.names().index(n) for _, n in names}
            by_full = dict(names)

            def chunks(full: str, layer=layer, idx=idx, by_full=by_full):
                i = idx[by_full[full]]
                spec, off = layer.layout.tensors[i], layer.layout.offsets[i]
                for e in range(layer.layout.num_experts):
                    key = (layer.layer, e)
                    record = engine.store.acquire(key, WEIGHTS)
                    try:
                        yield record.param[off : off + spec.numel].clone()
                    finally:
                        engine.store.release(key)

            write_safetensors_streaming(os.path.join(tmp_dir, shard), specs, chunks, {"format": "pt"})
            weight_map.update({full: shard for full, _ in names})
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
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("saved offloaded model to %s (%d expert shards, streamed)", save_directory, len(engine.layers))


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
                              dtype: torch.dtype | None = None, **config_kwargs) -> nn.Module:
    """Build a model from `path` with its experts streamed straight into the offload store.

    Non-expert weights are loaded normally; each expert's slices are read from the safetensors files one expert at
    a time, so host memory holds at most the non-expert weights, the store's cache and one expert. `dtype`: the
    model's dtype (default fp32); with `OffloadConfig(train_experts=False)` a bf16/fp16 model's store keeps the
    experts in that dtype only.
    """
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoConfig, AutoModelForCausalLM

    model_class = model_class or AutoModelForCausalLM
    if offload_config.mode not in ("host", "disk"):
        raise ValueError("load_offloaded_pretrained needs OffloadConfig(mode='host' or 'disk')")
    files = _checkpoint_files(path)  # first: a missing folder or shard is named before anything is built
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    with init_empty_weights():
        model = model_class.from_config(config, **({"dtype": dtype} if dtype is not None else {}))
    engine = enable_expert_offload(model, offload_config, _initialize=False)
    expert_names = _expert_param_names(model)
    readers: dict[str, SafetensorsReader] = {}

    def reader(file: str) -> SafetensorsReader:
        if file not in readers:
            readers[file] = SafetensorsReader(file)
        return readers[file]

    # Keys in the layout transformers saves (per-expert tensors, renamed modules) map onto the model through
    # transformers' own conversion rules for the family (hub_layout.py); our own saves map one to one.
    own = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    plan = plan_checkpoint(model, files, own | set(expert_names))
    missing = [k for k in expert_names if not plan.covers(k)]
    if missing:
        raise CheckpointError(f"{path} lacks expert tensors {missing[:3]}...; is it a checkpoint of this model?")

    def read_whole(key: str) -> torch.Tensor:
        return reader(files[key]).get(key)

    for layer in tqdm(engine.layers, desc="loading experts", unit="layer"):
        fulls = {n: full for full, (l, n) in expert_names.items() if l == layer.layer}
        flat = torch.empty(layer.layout.numel)
        fused = {full: plan.direct[full] for full in fulls.values() if full in plan.direct}
        crcs = dict.fromkeys(fused.values(), 0)  # over the slices in order = the CRC32 of the whole tensor
        for e in range(layer.layout.num_experts):
            tensors = []
            for n in layer.layout.names():
                full = fulls[n]
                if full in fused:  # one (E, ...) tensor: read expert e's slice
                    key = fused[full]
                    piece = reader(files[key]).get(key, e)
                    crcs[key] = zlib.crc32(tensor_bytes(piece), crcs[key])
                else:  # one tensor per expert and projection: fuse expert e's alone
                    piece = plan.per_expert[full].expert(e, read_whole, model)
                tensors.append(piece.float())
            engine.store.write_param((layer.layer, e), layer.layout.pack(tensors, flat))
        for key, crc in crcs.items():
            reader(files[key]).check_crc(key, crc)
    engine.store.flush()
    # As from_pretrained does, a checkpoint of another head of the same base model loads: tensors outside the base
    # model that this class lacks (e.g. a causal-LM `lm_head`) are skipped, and head parameters the checkpoint lacks
    # (e.g. a new classifier `score`) are initialised. Anything missing inside the base model is still an error.
    base_prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else None

    def is_head(name: str) -> bool:
        return base_prefix is not None and not name.startswith(base_prefix)

    unused = [t for t in plan.per_expert if t not in expert_names]
    for name, key in plan.direct.items():
        if name in expert_names:
            continue
        if name not in own and is_head(name):
            unused.append(key)
            continue
        try:
            set_module_tensor_to_device(model, name, "cpu", value=read_whole(key))
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
    "read_weight_map",
    "missing_shards",
    "EXPERT_STATE_FILE",
]
