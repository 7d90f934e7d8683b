"""Frozen experts kept quantized in the store: 8-bit or 4-bit through bitsandbytes, dequantized where they compute.

Frozen experts (LoRA, `OffloadConfig(train_experts=False)`) need only their weights, and those can be kept
in 8 or 4 bits: Qwen3-30B-A3B's 29 B expert parameters are 58 GB in bf16, ~16 GB in NF4. The weights-only store then
holds each expert as one row of bytes in the library's format, made once when the store is filled (`write_param`:
the experts come in one at a time, from the model or straight from a checkpoint, so no full-width copy of the model
exists in host memory), and turned back into the compute dtype per chunk where the experts compute: on the CPU into
the chunk's buffer, on a GPU after the upload (a quarter of bf16's bytes cross PCIe for NF4, half for int8).

Why bitsandbytes: its formats are the ones QLoRA users already train with (NF4 from the QLoRA paper, LLM.int8's
row-wise int8, what transformers' `BitsAndBytesConfig` and peft's QLoRA use), it is maintained, and since 0.46 its
quantize and dequantize run on the CPU as well as on CUDA, so the same rows serve both. hqq and torchao were the other
candidates; torchao's int8/int4 weight-only tensors are built for its own matmul kernels and their CPU paths vary by
version, hqq adds a grouping of its own that no Hub checkpoint uses.

The formats, per expert (its tensors as the layout packs them):
- "nf4": the flat row in blocks of 64 values, NF4 codes two per byte and one fp32 absmax per block
  (`bitsandbytes.functional.quantize_4bit(..., quant_type="nf4", blocksize=64)`): 0.5625 bytes per parameter.
- "int8": each tensor as a 2-D matrix (its first dim the rows), LLM.int8's row-wise absmax int8
  (`int8_vectorwise_quant`): 1 byte per parameter and one fp32 scale per row.
The row's bytes are the library's own outputs laid end to end, nothing else (`ExpertQuantization.nbytes`).
"""

from __future__ import annotations

import functools
import math

import torch

EXPERT_STORAGES = ("auto", "bf16", "int8", "nf4")  # what `--expert-storage` and OffloadConfig.expert_storage take
QUANTIZED_STORAGES = ("int8", "nf4")
NF4_BLOCK = 64


def _bnb():
    try:
        import bitsandbytes.functional as bnb_f
    except ImportError as err:  # pragma: no cover - bitsandbytes is a dependency
        raise ImportError("quantized expert storage needs bitsandbytes (pip install bitsandbytes>=0.46)") from err
    return bnb_f


# Parameters per dequantization call on the CPU (`ExpertQuantization.decode`): a multiple of NF4_BLOCK whose fp32
# temporaries stay under glibc's 1 MiB mmap threshold of `host_allocator.return_freed_memory`.
DECODE_SLICE = 1 << 17


def _align(n: int, to: int = 16) -> int:
    return -(-n // to) * to


class ExpertQuantization:
    """How one store keeps its experts: `encode(flat) -> row` and `decode(row, dtype) -> flat`, on any device.

    `shapes`: the expert's tensors in the layout's packing order (each a per-expert shape); `numel`: their total.
    """

    def __init__(self, storage: str, shapes: list[tuple[int, ...]]):
        if storage not in QUANTIZED_STORAGES:
            raise ValueError(f"quantized expert storage is one of {', '.join(QUANTIZED_STORAGES)}; got {storage!r}")
        self.storage = storage
        self.shapes = [tuple(s) for s in shapes]
        self.numel = sum(math.prod(s) for s in self.shapes)
        if storage == "nf4":
            self.padded = _align(self.numel, NF4_BLOCK)
            self.data_bytes = self.padded // 2  # two codes per byte
            self.scale_count = self.padded // NF4_BLOCK  # one absmax per block
        else:
            # int8: every tensor a (rows, cols) matrix, rows = its first dim (a 1-D tensor, a bias: one row)
            self.matrices = [(s[0], math.prod(s[1:])) if len(s) > 1 else (1, s[0]) for s in self.shapes]
            self.data_bytes = _align(self.numel, 4)  # the scales after it stay 4-byte aligned
            self.scale_count = sum(rows for rows, _ in self.matrices)
        self.nbytes = self.data_bytes + 4 * self.scale_count

    def __repr__(self) -> str:
        return f"ExpertQuantization({self.storage!r}, {self.numel} parameters -> {self.nbytes} bytes)"

    @property
    def bytes_per_parameter(self) -> float:
        return self.nbytes / self.numel

    def encode(self, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Quantize one expert's flat weights (any float dtype) into `out`, a (nbytes,) uint8 row."""
        F = _bnb()
        flat = flat.detach().reshape(-1)
        if flat.numel() != self.numel:
            raise ValueError(f"an expert has {self.numel} parameters; got {flat.numel()}")
        data, scales = self._split(out)
        # bitsandbytes quantizes fp16/bf16/fp32 alike; the weights come in the model's dtype (bf16 on the Hub)
        src = flat if flat.dtype in (torch.float32, torch.bfloat16, torch.float16) else flat.float()
        if self.storage == "nf4":
            if self.padded != self.numel:
                src = torch.cat([src, src.new_zeros(self.padded - self.numel)])
            codes, state = F.quantize_4bit(src.contiguous(), blocksize=NF4_BLOCK, quant_type="nf4")
            data.copy_(codes.view(-1))
            scales.copy_(state.absmax.view(-1).float())
            return out
        offset, row = 0, 0
        for (rows, cols) in self.matrices:
            codes, stats, _ = F.int8_vectorwise_quant(src[offset : offset + rows * cols].view(rows, cols).contiguous())
            data[offset : offset + rows * cols].copy_(codes.view(torch.uint8).view(-1))
            scales[row : row + rows].copy_(stats.view(-1))
            offset += rows * cols
            row += rows
        return out

    def decode(self, row: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """One expert's flat weights in `dtype` from its (nbytes,) uint8 `row`, on the row's device (into `out`, a
        (numel,) tensor, where given): bitsandbytes' dequantization, then a cast where its output dtype differs.
        On the CPU a slice of `DECODE_SLICE` parameters at a time (blocks and rows are independent, so the values
        are the same): the library's temporaries then stay small and recycle in malloc's heap, where a whole
        expert's would be a fresh mapping per call, page-faulted in, once freed memory is returned to the kernel
        (`host_allocator.return_freed_memory`)."""
        F = _bnb()
        data, scales = self._split(row)
        whole = row.device.type != "cpu"
        if self.storage == "nf4":
            code, step = _nf4_code(row.device), self.padded if whole else DECODE_SLICE
            for a in range(0, self.padded, step):
                b = min(a + step, self.padded)
                state = F.QuantState(absmax=scales[a // NF4_BLOCK : b // NF4_BLOCK], shape=torch.Size([b - a]),
                                     code=code, blocksize=NF4_BLOCK, quant_type="nf4", dtype=dtype)
                values = F.dequantize_4bit(data[a // 2 : b // 2].view(-1, 1), state).view(-1)
                end = min(b, self.numel)
                if out is None and whole:
                    return values[: self.numel]
                if out is None:
                    out = torch.empty(self.numel, dtype=dtype, device=row.device)
                out[a:end].copy_(values[: end - a])
            return out
        if out is None:
            out = torch.empty(self.numel, dtype=dtype, device=row.device)
        offset, r = 0, 0
        for (rows, cols) in self.matrices:
            step = rows if whole else max(1, DECODE_SLICE // cols)
            for i in range(0, rows, step):
                n = min(step, rows - i)
                begin = offset + i * cols
                codes = data[begin : begin + n * cols].view(torch.int8).view(n, cols)
                out[begin : begin + n * cols].view(n, cols).copy_(
                    F.int8_vectorwise_dequant(codes, scales[r + i : r + i + n]))
            offset += rows * cols
            r += rows
        return out

    def _split(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if row.dtype != torch.uint8 or row.numel() != self.nbytes:
            raise ValueError(f"a {self.storage} expert row is {self.nbytes} uint8 bytes; got {row.numel()} "
                             f"{row.dtype}")
        data = row[: self.data_bytes]
        scales = row[self.data_bytes :].view(torch.float32)
        return data, scales


@functools.cache
def _nf4_code(device: torch.device) -> torch.Tensor:
    """bitsandbytes' 16 NF4 levels on `device` (made once per device)."""
    return _bnb().get_4bit_type("nf4", device=device)


class EncodedWeights:
    """A quantized expert on its way to a device: its host `row` of bytes, what the upload copies (`upload_weights`
    decodes it on the device after the copy)."""

    __slots__ = ("row", "quantization", "dtype")

    def __init__(self, row: torch.Tensor, quantization: ExpertQuantization, dtype: torch.dtype):
        self.row, self.quantization, self.dtype = row, quantization, dtype


def upload_weights(rt, dst: torch.Tensor, src, stream) -> int:
    """Enqueue `dst` (device, compute dtype) <- `src` on `stream`: a copy of a host tensor, or for `EncodedWeights`
    the copy of its bytes into a staging buffer of `stream` and their dequantization into `dst`, on `stream` too (so
    compute waits for one event either way). -> the bytes moved over the bus."""
    if not isinstance(src, EncodedWeights):
        rt.copy_(dst, src, stream)
        return src.numel() * src.element_size()
    staging = rt.empty((src.row.numel(),), torch.uint8, stream=stream)  # only `stream` uses it: freed in its order
    rt.copy_(staging, src.row, stream)

    def decode():
        rt.access(staging)
        rt.access(dst, write=True)
        src.quantization.decode(staging, src.dtype, out=dst.view(-1))

    rt.run_on(stream, decode)
    return src.row.numel()


def store_quantization(storage: str, model_dtype: torch.dtype,
                       shapes: list[tuple[int, ...]]) -> ExpertQuantization | None:
    """The quantization a store keeps its experts in, for `OffloadConfig.expert_storage` (validated there): None for
    auto / bf16 (the model's own dtype)."""
    if storage == "bf16" and model_dtype != torch.bfloat16:
        raise ValueError(f"expert_storage='bf16' keeps the experts as the model holds them: load the model in "
                         f"bfloat16 (it is {model_dtype})")
    return ExpertQuantization(storage, shapes) if storage in QUANTIZED_STORAGES else None


__all__ = ["EXPERT_STORAGES", "QUANTIZED_STORAGES", "EncodedWeights", "ExpertQuantization", "store_quantization",
           "upload_weights"]
