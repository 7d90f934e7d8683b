"""safetensors files written and read a tensor at a time, atomically (the format layer of offloaded checkpoints).

- `write_safetensors_streaming`: writes a safetensors file tensor by tensor, chunk by chunk, to a temporary name,
  fsyncs and renames it, so a crash or a full disk never leaves a half-written checkpoint under the final name; each
  tensor's CRC32 goes into the header's metadata.
- `SafetensorsReader`: reads one tensor at a time (memory-mapped), checking the CRC32 it was written with.
- `read_weight_map` / `missing_shards`: a sharded checkpoint's index.
"""

from __future__ import annotations

import errno
import json
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterable

import torch

from ...errors import CheckpointError
from .store import tensor_bytes

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
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


__all__ = ["INDEX_FILE", "SafetensorsReader", "fsync_directory", "missing_shards", "read_weight_map",
           "write_safetensors_streaming"]
