"""Checkpoints released quantized, dequantized expert by expert while they stream into the store.

Two formats: MXFP4 (gpt-oss: each expert tensor as `*_blocks`, two E2M1 values per byte in blocks of 32 along the
input dimension, and `*_scales`, one E8M0 exponent per block; OCP Microscaling Formats v1.0) and fine-grained FP8
(DeepSeek-V3/R1, Qwen3 and GLM "-FP8" releases: float8_e4m3fn weights with one fp32 `weight_scale_inv` per
128 x 128 block; DeepSeek-V3 report §3.3.2). Their dequantization is transformers' own: the checkpoint's
`quantization_config` builds transformers' quantizer with `dequantize=True`, whose weight conversions
(`Mxfp4Dequantize`, `Fp8Dequantize`, run ahead of the family's merge of per-expert tensors) hub_layout.py applies to
one expert at a time. So host memory holds one expert's packed bytes and its dequantized tensors at once, never a
whole layer's, and the store receives each expert at full width, as it would from a bf16 release.

One change to transformers' FP8 op: `Fp8Dequantize` derives the block from the scale grid (rows // grid rows), which
is wrong where a dimension is not a multiple of the block and the grid was rounded up (DeepSeek-V3's
`kv_a_proj_with_mqa`, 576 rows in 5 blocks of 128: transformers 5.24's op raises on it). `BlockFp8Dequantize` pads
such a weight with zeros to whole blocks, lets transformers' op dequantize it, and crops the padding off again.
"""

from __future__ import annotations

import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize
from transformers.quantizers.auto import AutoQuantizationConfig
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer

from ...errors import CheckpointError

SUPPORTED_METHODS = ("mxfp4", "fp8")


def _way_out(path: str) -> str:
    return (f"Use the model's bf16 release, or dequantize it once with transformers (AutoModelForCausalLM."
            f"from_pretrained({path!r}, quantization_config=<its config class>(dequantize=True)), then "
            "save_pretrained) and load that folder")


class BlockFp8Dequantize(Fp8Dequantize):
    """transformers' `Fp8Dequantize`, also right on weights whose last row or column block is partial."""

    def _dequantize_one(self, quantized: torch.Tensor, scales: torch.Tensor,
                        output_dtype: torch.dtype | None = None) -> torch.Tensor:
        block = self.hf_quantizer.quantization_config.weight_block_size
        if block is None or quantized.dtype != torch.float8_e4m3fn or scales.dim() < 2:
            return super()._dequantize_one(quantized, scales, output_dtype=output_dtype)
        rows, cols = quantized.shape[-2:]
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        if (rows % block[0] == 0 and cols % block[1] == 0) or tuple(scales.shape[-2:]) != grid:
            return super()._dequantize_one(quantized, scales, output_dtype=output_dtype)
        # Zeros in the padding: each real value keeps its block's scale, and the padding is cropped off below.
        padded = quantized.new_zeros(*quantized.shape[:-2], grid[0] * block[0], grid[1] * block[1])
        padded[..., :rows, :cols] = quantized
        full = super()._dequantize_one(padded, scales, output_dtype=output_dtype)
        return full[..., :rows, :cols].contiguous()


class _FineGrainedFP8Dequantizer(FineGrainedFP8HfQuantizer):
    """transformers' FP8 quantizer whose load-time dequantization pads partial blocks (`BlockFp8Dequantize`)."""

    def get_load_operations(self) -> dict:
        return {"dequantize": BlockFp8Dequantize}


def method_name(quant_method) -> str:
    """'mxfp4', 'fp8', ...: transformers' `QuantizationMethod` or the config's string."""
    return str(getattr(quant_method, "value", quant_method))


def dequantizing_quantizer(path: str, config) -> HfQuantizer | None:
    """transformers' quantizer for the checkpoint's `quantization_config`, set to dequantize while loading, or None
    for a full-width checkpoint. Formats other than MXFP4 and fine-grained FP8 (float8_e4m3fn weights with fp32
    block scales) raise CheckpointError naming what is supported and the way out."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = method_name(quant.get("quant_method", "?"))
    if method not in SUPPORTED_METHODS:
        raise CheckpointError(
            f"{path} is stored quantized with {method!r} (its config's quantization_config): load_offloaded_pretrained "
            f"dequantizes only MXFP4 ('mxfp4', gpt-oss) and fine-grained FP8 ('fp8', DeepSeek-V3/R1, Qwen3 "
            f"and GLM -FP8 releases) checkpoints while it streams their experts. {_way_out(path)}")
    qconfig = AutoQuantizationConfig.from_dict(dict(quant))
    if method == "fp8":
        read = {"scale_fmt": "float", "expert_dtype": "fp8"}
        unsupported = {k: getattr(qconfig, k) for k, v in read.items() if getattr(qconfig, k) != v}
        if unsupported:
            raise CheckpointError(
                f"{path} is an FP8 checkpoint with {unsupported}: load_offloaded_pretrained reads float8_e4m3fn "
                f"weights with fp32 block scales (scale_fmt 'float', expert_dtype 'fp8') only. {_way_out(path)}")
    qconfig.dequantize = True
    quantizer_class = _FineGrainedFP8Dequantizer if method == "fp8" else Mxfp4HfQuantizer
    return quantizer_class(qconfig, pre_quantized=True)


__all__ = ["SUPPORTED_METHODS", "BlockFp8Dequantize", "dequantizing_quantizer", "method_name"]
