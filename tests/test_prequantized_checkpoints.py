"""Checkpoints released quantized stream into the offload store, dequantized expert by expert
(hf_moe_offload/offload/stores/prequantized.py).

The checkpoints are fabricated as the Hub releases lay them out: a tiny model of the family saved by transformers,
then its weights replaced by the release's tensors, from reference quantizers written here from the formats'
definitions, and the release's `quantization_config` added to config.json:

- gpt-oss, MXFP4 (OCP Microscaling spec v1.0): each expert tensor, transposed to (E, out, in), as `*_blocks` (uint8,
  (E, out, in/32, 16): 32 E2M1 codes per block, two per byte, the first in the low nibble) and `*_scales` (uint8,
  (E, out, in/32): the block's E8M0 exponent, biased by 127);
- DeepSeek-V3 and Qwen3-MoE, fine-grained FP8: every linear weight but the router's (attention, dense MLP, shared
  and routed experts, one tensor per expert and projection) as float8_e4m3fn with an fp32 `weight_scale_inv` per block
  (block amax / 448). The tiny models use blocks of 16 (`weight_block_size` [16, 16]; the releases use 128).
  DeepSeek-V3's release also holds its multi-token-prediction layer (`model.layers.61.*`), which the model skips.

What is shown, all in fp32:
- our streamed load gives transformers' own dequantized load's logits (`from_pretrained(path, quantization_config=
  Mxfp4Config / FineGrainedFP8Config(dequantize=True))`) within 1e-5 (only the order of the experts' sums differs),
  and every weight equal to the formats' reference decoding of the release's tensors, exactly (each value is one
  product of a code and a scale in fp32, the same product on either side);
- a DeepSeek-V3 whose `kv_a_proj_with_mqa` has a partial last block (24 rows in blocks of 16, as the release's 576 in
  blocks of 128) loads to the reference decoding too (transformers 5.24's `Fp8Dequantize` takes 24 // 2 = 12 rows
  per block there; on the release's shape it stops with an error);
- loaded in bf16 with frozen experts, the store holds exactly transformers' bf16 dequantization;
- the loaded model carries no `quantization_config`: its save is a plain checkpoint;
- full training (ExpertAwareOptimizer, 2 AdamW steps) from a release equals torch's AdamW on transformers' dequantized
  load (weights within lr/10, eps 1e-6, as tests/test_families.py argues), and LoRA on nf4 frozen experts trains;
- loading an MXFP4 release whose experts (130 MiB dequantized) exceed the bound keeps the peak RSS within the host
  cache + the non-expert weights + slack;
- formats other than MXFP4 and FP8, and FP8 variants not read, are refused with the way out; a release missing an
  expert's scales is refused naming the tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, load_offloaded_pretrained
from hf_moe_offload.errors import CheckpointError
from hf_moe_offload.offload import get_offload_engine

from moe_families import VOCAB, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 16
E4M3_MAX = 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_SIGNED = torch.cat([E2M1, -E2M1])  # codes 8-15: the sign bit set
LR, EPS = 1e-3, 1e-6


# --- reference quantizers and decoders, from the formats' definitions ---
def fp8_quantize(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) -> float8_e4m3fn weight and fp32 `weight_scale_inv` of ceil(out/block) x ceil(in/block) blocks."""
    rows, cols = w.shape
    grid = (-(-rows // block), -(-cols // block))
    padded = w.new_zeros(grid[0] * block, grid[1] * block)
    padded[:rows, :cols] = w
    tiles = padded.reshape(grid[0], block, grid[1], block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (tiles / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(padded.shape)[:rows, :cols].contiguous(), scale_inv.float()


def fp8_decode(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    rows, cols = q.shape
    scale = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return q.float() * scale


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) -> blocks (..., K/32, 16) and scales (..., K/32): per block of 32, the shared exponent
    floor(log2(amax)) - 2 (E2M1's largest exponent), each element rounded to the nearest E2M1 value, saturating at 6."""
    groups = w.contiguous().reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1)
    exp = (torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - 2).clamp(-127, 127)
    scaled = groups / torch.exp2(exp)[..., None]
    code = torch.bucketize(scaled.abs().clamp(max=6.0), (E2M1[1:] + E2M1[:-1]) / 2) + 8 * (scaled < 0)
    code = code.to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def mxfp4_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2).long()  # (..., K/32, 32)
    return (E2M1_SIGNED[codes] * torch.exp2(scales.float() - 127)[..., None]).flatten(-2)


# --- releases ---
def quantize_tensor(fmt: str, key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """One saved tensor as the release holds it."""
    if fmt == "mxfp4":
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_quantize(value.float().transpose(1, 2))
            return {f"{key}_blocks": blocks, f"{key}_scales": scales}
        return {key: value}
    kept_wide = key.endswith("mlp.gate.weight") or "embed_tokens" in key or "lm_head" in key  # router, embeddings
    if value.dim() == 2 and key.endswith(".weight") and not kept_wide:
        q, scale_inv = fp8_quantize(value.float())
        return {key: q, f"{key}_scale_inv": scale_inv}
    return {key: value}


def decode_tensors(fmt: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The release's tensors decoded back to full width under the names transformers saves."""
    out = {}
    for key, value in tensors.items():
        if fmt == "mxfp4" and key.endswith("_blocks"):
            name = key.removesuffix("_blocks")
            out[name] = mxfp4_decode(value, tensors[f"{name}_scales"]).transpose(1, 2).contiguous()
        elif fmt == "fp8" and f"{key}_scale_inv" in tensors:
            out[key] = fp8_decode(value, tensors[f"{key}_scale_inv"])
        elif not key.endswith(("_scales", "_scale_inv")):
            out[key] = value
    return out


def quantization_config(model) -> dict:
    """The release's `quantization_config` (gpt-oss; DeepSeek-V3; Qwen3's -FP8 releases list what they keep wide)."""
    if model.config.model_type == "gpt_oss":
        return {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
    config = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
    if model.config.model_type == "qwen3_moe":
        config["modules_to_not_convert"] = ["lm_head"] + [f"model.layers.{i}.mlp.gate"
                                                          for i in range(model.config.num_hidden_layers)]
    return config


def write_release(model, folder, max_shard_size: str = "5GB", decoded: bool = True) -> str:
    """`model` saved by transformers, its tensors then rewritten as the quantized release holds them; next to it
    (`folder` + "-decoded", unless not `decoded`) the release decoded back to full width by the reference decoders,
    a plain checkpoint."""
    fmt = "mxfp4" if model.config.model_type == "gpt_oss" else "fp8"
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    if decoded:
        model.save_pretrained(f"{folder}-decoded", max_shard_size=max_shard_size)
    index_path = os.path.join(folder, "model.safetensors.index.json")
    index = json.load(open(index_path)) if os.path.exists(index_path) else None
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        quantized = {}
        for key, value in load_file(os.path.join(folder, name)).items():
            quantized.update(quantize_tensor(fmt, key, value.contiguous()))
            if model.config.model_type == "deepseek_v3" and key.startswith("model.layers.1."):
                # The release's multi-token-prediction layer (DeepSeek-V3 report §2.2), layer 61, which transformers'
                # model does not hold and from_pretrained skips: a copy of the last layer stands in for it here.
                quantized.update(quantize_tensor(fmt, key.replace(".layers.1.", ".layers.61."), value.clone()))
        save_file(quantized, os.path.join(folder, name), metadata={"format": "pt"})
        if decoded:
            save_file(decode_tensors(fmt, quantized), os.path.join(f"{folder}-decoded", name),
                      metadata={"format": "pt"})
        if index is not None:
            index["weight_map"].update({k: name for k in quantized})
    if index is not None:
        json.dump(index, open(index_path, "w"))
    config_path = os.path.join(folder, "config.json")
    config = json.load(open(config_path))
    config["quantization_config"] = quantization_config(model)
    json.dump(config, open(config_path, "w"), indent=2)
    return str(folder)


RELEASES = {  # family -> the tiny model's sizes: multiples of the block (the ragged case has its own test)
    "gpt_oss": dict(intermediate_size=32),
    "deepseek_v3": dict(moe_intermediate_size=32, intermediate_size=32, first_k_dense_replace=1, kv_lora_rank=8),
    "qwen3_moe": dict(moe_intermediate_size=32),
}


def release(family: str, tmp_path, **overrides) -> str:
    return write_release(tiny_model(family, **{**RELEASES[family], **overrides}).eval(), tmp_path / family,
                         max_shard_size="40KB" if family == "qwen3_moe" else "5GB")


def transformers_dequantized(path: str):
    """transformers' own load of the release, dequantized (fp32, the eager experts)."""
    quant = json.load(open(os.path.join(path, "config.json")))["quantization_config"]["quant_method"]
    config = Mxfp4Config(dequantize=True) if quant == "mxfp4" else FineGrainedFP8Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.float32,
                                                experts_implementation="eager")


def assert_equals_decoded(ours, path: str) -> None:
    """Every tensor of `ours` equal to the reference decoding of the release (a plain checkpoint, loaded stock)."""
    decoded = AutoModelForCausalLM.from_pretrained(f"{path}-decoded", dtype=torch.float32).state_dict()
    got = ours.state_dict()
    assert got.keys() == decoded.keys()
    for name, tensor in decoded.items():
        torch.testing.assert_close(got[name], tensor, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", sorted(RELEASES))
def test_release_streams_into_the_store_as_transformers_dequantizes_it(family, tmp_path):
    path = release(family, tmp_path)
    ours = load_offloaded_pretrained(path, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "experts"),
                                                         host_cache_experts=2))
    assert not hasattr(ours.config, "quantization_config")
    assert_equals_decoded(ours, path)
    reference = transformers_dequantized(path)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)
    # ... and a save of it is a plain checkpoint
    ours.save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in json.load(open(tmp_path / "saved" / "config.json"))


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_bf16_load_of_a_release_equals_transformers_bf16_dequantized_load(family, tmp_path):
    """`dtype=torch.bfloat16` with frozen experts (the LoRA setting): the store keeps the experts in bf16, dequantized
    to bf16 as transformers does (weights equal exactly); logits within 2e-2 (a few bf16 roundings, 2^-8 relative
    each, of logits of magnitude ~1; the computations are the same ones, in another order)."""
    path = release(family, tmp_path)
    ours = load_offloaded_pretrained(path, OffloadConfig(mode="host", train_experts=False), dtype=torch.bfloat16)
    quant = Mxfp4Config(dequantize=True) if family == "gpt_oss" else FineGrainedFP8Config(dequantize=True)
    reference = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.bfloat16,
                                                     experts_implementation="eager")
    got = ours.state_dict()
    assert get_offload_engine(ours).store.row_dtype == torch.bfloat16
    for name, tensor in reference.state_dict().items():
        assert got[name].dtype == torch.bfloat16
        torch.testing.assert_close(got[name], tensor, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits.float(), reference(ids).logits.float(), atol=2e-2, rtol=0)


def test_fp8_weight_with_a_partial_last_block_is_dequantized_block_by_block(tmp_path):
    """DeepSeek-V3's kv_a_proj_with_mqa: kv_lora_rank + qk_rope_head_dim rows (576 = 4.5 blocks of 128 in the
    release; 16 + 8 = 24 = 1.5 blocks of 16 here): each row takes the scale of the block it is in."""
    path = release("deepseek_v3", tmp_path, kv_lora_rank=16)
    scale_inv = load_file(os.path.join(path, "model.safetensors"))[
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    assert scale_inv.shape == (2, 2)  # 24 x 32 in blocks of 16
    ours = load_offloaded_pretrained(path, OffloadConfig(mode="host"))
    assert_equals_decoded(ours, path)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_full_training_from_a_release_equals_adamw_on_the_dequantized_model(family, tmp_path):
    path = release(family, tmp_path)
    model = load_offloaded_pretrained(path, OffloadConfig(mode="host", pin_fraction=0.0)).train()
    reference = transformers_dequantized(path).train()
    engine = get_offload_engine(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0),
                               ExpertOptimizer(engine, lr=LR, eps=EPS, weight_decay=0.0))
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
        reference(ids, labels=ids).loss.backward()
        model(ids, labels=ids).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    engine.synchronize()
    got, want = model.state_dict(), reference.state_dict()
    before = load_offloaded_pretrained(path, OffloadConfig(mode="host")).state_dict()
    assert max((got[n] - before[n]).abs().max().item() for n in got if "experts" in n) > LR / 2  # experts trained
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=LR / 10, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_lora_on_nf4_frozen_experts_from_a_release(family, tmp_path):
    from peft import LoraConfig, get_peft_model

    from hf_moe_offload import expert_target_parameters

    path = release(family, tmp_path)
    model = load_offloaded_pretrained(path, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "experts"),
                                                          train_experts=False, expert_storage="nf4"))
    engine = get_offload_engine(model)
    assert engine.store.quantization is not None and not engine.store.trainable
    stored = [engine.store.read_param(k).clone() for k in engine.store.keys()]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"],
                                             target_parameters=expert_target_parameters(model))).train()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert any("experts" in n for n in trainable) and any("o_proj" in n for n in trainable)
    lora_b = {n: p.detach().clone() for n, p in trainable.items() if "lora_B" in n}
    opt = torch.optim.AdamW(trainable.values(), lr=1e-2)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all((trainable[n] != b).any() for n, b in lora_b.items())  # every adapter moved
    for key, before in zip(engine.store.keys(), stored):  # the frozen experts did not
        assert torch.equal(engine.store.read_param(key), before)


@pytest.mark.slow
def test_loading_an_mxfp4_release_stays_within_the_rss_bound(tmp_path):
    """2 MoE layers x 16 experts of 1.06 M parameters: 130 MiB of experts once dequantized (fp32), 17 MiB packed.
    Loaded into the disk tier with frozen experts and a host cache of 4 experts (16 MiB), the peak RSS growth stays
    within the cache + the non-expert weights + 64 MiB of slack for the rest: one expert's conversion temporaries (a
    few times its 4 MiB), the disk tier's buffers, allocator slack (all of it measured ~30 MiB here). Holding the
    experts at full width, or converting a whole layer at once (65 MiB, and its transposed copy), does not fit."""
    config = AutoConfig.for_model("gpt_oss", vocab_size=128, hidden_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4, head_dim=32, intermediate_size=2752,
                                  num_local_experts=16, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    expert_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "experts" in n)
    path = write_release(model, tmp_path / "gpt_oss", decoded=False)
    del model
    res = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "scripts", "prequantized_load_rss.py"), path,
         str(tmp_path / "offload"), "4"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert res.returncode == 0, res.stderr[-4000:]
    d = json.loads(res.stdout.strip().splitlines()[-1])
    assert not d["quantization_config"]
    assert d["expert_bytes"] == pytest.approx(expert_bytes, rel=0.01)
    bound = d["cache_bytes"] + d["non_expert_bytes"] + 64 * 2**20
    assert bound < expert_bytes  # a load holding the experts at full width fails it
    assert d["peak_after_load"] - d["baseline"] <= bound, d


@pytest.mark.parametrize("quant, match", [
    ({"quant_method": "gptq", "bits": 4}, r"'gptq'.*only MXFP4 \('mxfp4'.*fine-grained FP8 \('fp8'.*dequantize=True"),
    ({"quant_method": "awq", "bits": 4}, r"'awq'.*only MXFP4"),
    ({"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK], "scale_fmt": "ue8m0"},
     r"scale_fmt.*ue8m0.*fp32 block scales.*dequantize=True"),
])
def test_unsupported_formats_are_refused_with_the_way_out(quant, match, tmp_path):
    tiny_model("qwen3_moe").save_pretrained(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["quantization_config"] = quant
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match):
        load_offloaded_pretrained(str(tmp_path / "ckpt"), OffloadConfig(
            mode="disk", offload_dir=str(tmp_path / "experts"), train_experts=False, expert_storage="nf4"))
    assert not (tmp_path / "experts").exists()  # refused before anything was built


@pytest.mark.parametrize("family, dropped", [
    ("gpt_oss", "model.layers.1.mlp.experts.down_proj_scales"),
    ("qwen3_moe", "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"),
])
def test_a_release_missing_scales_is_refused(family, dropped, tmp_path):
    path = release(family, tmp_path)
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path)) if os.path.exists(index_path) else None  # the Qwen3-MoE release is sharded
    file = os.path.join(path, index["weight_map"].pop(dropped) if index else "model.safetensors")
    tensors = load_file(file)
    del tensors[dropped]
    save_file(tensors, file, metadata={"format": "pt"})
    if index:
        json.dump(index, open(index_path, "w"))
    with pytest.raises(CheckpointError, match=f"lacks .*{dropped.split('.')[-1]}"):
        load_offloaded_pretrained(path, OffloadConfig(mode="host"))
