"""Frozen experts kept in 8 or 4 bits by bitsandbytes in the offloaded store (issue 38, item 2).

The claim: a model whose frozen experts are stored quantized computes what the same model computes resident with its
experts replaced by the library's dequantization of them (`bitsandbytes.functional` quantize then dequantize, done
here in the test with the library's own calls, per expert as the store packs it), on every tier (host, disk, the
simulated device), with and without LoRA on the experts; and the store's bytes are the library's size for the format.

Tolerances: both sides compute with bit-identical weights, so only the summation order differs (grouped GEMM per
chunk vs the resident experts' path): fp32 logits within 1e-5; under bf16 autocast within 5e-2 at |logits| ~ 1
(bf16's rounding of activations, one MoE layer as in tests/test_expert_lora.py); adapters after 3 AdamW steps within
`assert_within_adam_drift`.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from peft import LoraConfig, get_peft_model

import bitsandbytes.functional as bnb_f
from hf_moe_offload import OffloadConfig, enable_expert_offload
from hf_moe_offload.families.moe_path import experts_layers
from hf_moe_offload.offload.stores.quantized import ExpertQuantization
from hf_moe_offload.runtime import use_runtime
from hf_moe_offload.runtime.simulated import SimulatedRuntime

from moe_families import tiny_model
from numerics import assert_within_adam_drift

FAMILIES = ["moe_gpt", "qwen3_moe", "mixtral", "gpt_oss"]
LR = 1e-2


def _model(family: str, layers: int = 2):
    if family == "moe_gpt":
        from hf_moe_offload import MoEGPTConfig, MoEGPTForCausalLM
        torch.manual_seed(0)
        return MoEGPTForCausalLM(MoEGPTConfig(vocab_size=96, hidden_size=32, num_hidden_layers=layers,
                                              num_attention_heads=4, intermediate_size=48, num_experts=4,
                                              moe_layer_frequency=1, hidden_dropout=0.0, attention_dropout=0.0,
                                              max_position_embeddings=64))
    return tiny_model(family, seed=0, num_hidden_layers=layers)


def _dequantized_by_the_library(model, storage: str) -> None:
    """Replace each expert of `model` (in place) by bitsandbytes' quantize-then-dequantize of it, as the store packs
    an expert (its tensors end to end, nf4 in blocks of 64 over that row; int8 per tensor row-wise), with the
    library's calls directly (not through ExpertQuantization)."""
    with torch.no_grad():
        for _, module, layout in experts_layers(model):
            for e in range(layout.num_experts):
                tensors = [getattr(module, t.name)[e] for t in layout.tensors]
                if storage == "nf4":
                    flat = torch.cat([t.reshape(-1) for t in tensors])
                    pad = -flat.numel() % 64
                    codes, state = bnb_f.quantize_4bit(torch.cat([flat, flat.new_zeros(pad)]), blocksize=64,
                                                       quant_type="nf4")
                    flat = bnb_f.dequantize_4bit(codes, state).reshape(-1)[: flat.numel()]
                    for t, v in zip(tensors, layout.views(flat)):
                        t.copy_(v)
                else:
                    for t in tensors:
                        m = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(1, -1)
                        codes, stats, _ = bnb_f.int8_vectorwise_quant(m.contiguous())
                        t.copy_(bnb_f.int8_vectorwise_dequant(codes, stats).view(t.shape))


def _pair(family, storage, tier, tmp_path, layers=2, **config):
    """(resident model with the library-dequantized experts, the offloaded quantized model, its engine)."""
    base = _model(family, layers)
    for p in base.parameters():
        p.requires_grad_(False)
    offloaded = copy.deepcopy(base)
    engine = enable_expert_offload(offloaded, OffloadConfig(
        mode=tier, offload_dir=str(tmp_path / "experts"), train_experts=False, expert_storage=storage,
        host_cache_experts=6, prefetch_depth=1, **config))
    _dequantized_by_the_library(base, storage)
    return base, offloaded, engine


@pytest.mark.parametrize("storage", ["nf4", "int8"])
def test_a_stored_expert_is_the_library_format_and_its_size(storage):
    shapes = [(6, 64), (32, 12), (7,)]  # a bias too; 7 + ... makes the nf4 row need padding
    q = ExpertQuantization(storage, shapes)
    flat = torch.randn(q.numel, generator=torch.Generator().manual_seed(0)).bfloat16()
    row = q.encode(flat, torch.empty(q.nbytes, dtype=torch.uint8))
    if storage == "nf4":
        padded = torch.cat([flat, flat.new_zeros(-q.numel % 64)])
        codes, state = bnb_f.quantize_4bit(padded, blocksize=64, quant_type="nf4")
        expected = codes.numel() + 4 * state.absmax.numel()
        assert torch.equal(row[: codes.numel()], codes.view(-1))
        assert torch.equal(row[q.data_bytes :].view(torch.float32), state.absmax.float())
        library = bnb_f.dequantize_4bit(codes, state).reshape(-1)[: q.numel]
    else:
        parts, expected, library = [], 0, []
        offset = 0
        for shape in shapes:
            n = int(torch.tensor(shape).prod())
            m = flat[offset : offset + n].view(shape[0], -1) if len(shape) > 1 else flat[offset : offset + n].view(1, -1)
            codes, stats, _ = bnb_f.int8_vectorwise_quant(m.contiguous())
            expected += codes.numel() + 4 * stats.numel()
            library.append(bnb_f.int8_vectorwise_dequant(codes, stats).view(-1))
            offset += n
        library = torch.cat(library)
    # the row is the library's bytes plus at most 15 bytes of alignment between codes and scales
    assert expected <= q.nbytes < expected + 16
    # bit-identical to the library's dequantization (nf4 gives the input's dtype, int8 fp32)
    torch.testing.assert_close(q.decode(row, library.dtype), library, atol=0, rtol=0)


@pytest.mark.parametrize("storage", ["nf4", "int8"])
@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_experts_compute_what_the_library_dequantized_experts_compute(family, tier, storage, tmp_path):
    resident, offloaded, engine = _pair(family, storage, tier, tmp_path)
    q = engine.store.quantization
    assert q is not None and engine.store.record_bytes() == q.nbytes
    if tier == "disk":  # each expert's file: its row of bytes and the trailer, nothing at full width
        files = [os.path.join(engine.store.dir, f) for f in os.listdir(engine.store.dir) if f.endswith(".bin")]
        assert files and {os.path.getsize(f) for f in files} == {engine.store.files.size}
        assert engine.store.files.size - q.nbytes <= 64  # the trailer: checksums and identity
    g = torch.Generator().manual_seed(11)
    for _ in range(2):  # fresh inputs, a training-mode forward and backward (the input gradients flow through)
        x = torch.randint(0, 96, (2, 11), generator=g)
        outs = [m(x, labels=x) for m in (resident, offloaded)]
        torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-5, rtol=0)
    for m in (resident, offloaded):
        m.eval()
    x = torch.randint(0, 96, (2, 9), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(offloaded(x).logits, resident(x).logits, atol=1e-5, rtol=0)


def _lora(family, model):
    torch.manual_seed(1)
    targets = (["experts.fc1_weight", "experts.fc2_weight"] if family == "moe_gpt"
               else ["experts.gate_up_proj", "experts.down_proj"])
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=targets,
                                            init_lora_weights=False))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("tier,storage", [("host", "nf4"), ("disk", "int8"), ("disk", "nf4")])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_lora_on_quantized_experts_equals_lora_on_the_dequantized_resident_model(family, tier, storage, autocast,
                                                                                 tmp_path):
    resident, offloaded, engine = _pair(family, storage, tier, tmp_path, layers=1 if autocast else 2)
    resident, offloaded = _lora(family, resident), _lora(family, offloaded)
    rows = {}
    for k in engine.store.keys():
        rows[k] = engine.store.acquire(k).param.clone()
        engine.store.release(k)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR) for m in (resident, offloaded)]
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        x = torch.randint(0, 96, (2, 11), generator=g)
        logits = []
        for model, opt in zip((resident, offloaded), opts):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x, labels=x)
            out.loss.backward()
            logits.append(out.logits.float())
            opt.step()
            opt.zero_grad()
        if step == 0:  # later, Adam turns rounding noise into up to lr per step: the adapters' bound below
            torch.testing.assert_close(logits[1], logits[0], atol=5e-2 if autocast else 1e-5, rtol=0)
    assert_within_adam_drift(offloaded, resident, LR, 3, weight_decay=0.01, outliers=0.1 if autocast else 0.01)
    for k, row in rows.items():  # the stored bytes never change
        assert torch.equal(engine.store.acquire(k).param, row)
        engine.store.release(k)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("storage", ["nf4", "int8"])
def test_quantized_experts_on_the_simulated_device_upload_their_bytes_and_dequantize_there(storage, autocast,
                                                                                             tmp_path):
    """The device path (CUDA's ordering, simulated): the slab in training, the device expert cache in evaluation;
    what crosses the bus is the quantized rows (h2d bytes a multiple of the row size), dequantized on the copy
    stream (`upload_weights`), in fp32 and under bf16 autocast (one MoE layer there, tolerances as above)."""
    with use_runtime(SimulatedRuntime(seed=3, max_delay=0.001)):
        resident, offloaded, engine = _pair("qwen3_moe", storage, "disk", tmp_path, layers=1 if autocast else 2,
                                            device_cache_bytes=1 << 20)
        resident, offloaded = _lora("qwen3_moe", resident), _lora("qwen3_moe", offloaded)
        opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR)
                for m in (resident, offloaded)]
        g = torch.Generator().manual_seed(9)
        for _ in range(2):
            x = torch.randint(0, 96, (2, 11), generator=g)
            for model, opt in zip((resident, offloaded), opts):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    model(x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
        assert engine.slab is not None
        x = torch.randint(0, 96, (2, 9), generator=g)
        logits = []
        for model in (resident, offloaded):
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits.append(model(x).logits.float())
        engine.synchronize()
        assert engine.stats.device_cache_misses > 0
        q = engine.store.quantization
        assert engine.stats.h2d_bytes > 0 and engine.stats.h2d_bytes % q.nbytes == 0
    torch.testing.assert_close(logits[1], logits[0], atol=5e-2 if autocast else 1e-5, rtol=0)
    assert_within_adam_drift(offloaded, resident, LR, 2, weight_decay=0.01, outliers=0.1 if autocast else 0.01)


def test_quantized_storage_refuses_what_it_cannot_keep(tmp_path):
    with pytest.raises(ValueError, match="train_experts=False"):
        OffloadConfig(mode="host", expert_storage="nf4")
    with pytest.raises(ValueError, match="offloaded store"):
        OffloadConfig(mode="device", expert_storage="int8", train_experts=False)
    with pytest.raises(ValueError, match="expert_storage must be one of"):
        OffloadConfig(mode="host", expert_storage="fp8", train_experts=False)
    model = _model("qwen3_moe")
    with pytest.raises(ValueError, match="bfloat16"):  # bf16 storage of an fp32 model would be a silent cast
        enable_expert_offload(model, OffloadConfig(mode="host", expert_storage="bf16", train_experts=False))


def test_mode_auto_keeps_quantized_experts_in_the_store(tmp_path):
    """Quantized storage is the store's format: even where everything would fit the device, mode='auto' offloads."""
    model = _model("qwen3_moe")
    engine = enable_expert_offload(model, OffloadConfig(mode="auto", expert_storage="nf4", train_experts=False,
                                                        device_budget_bytes=1 << 40, host_budget_bytes=1 << 40))
    assert engine.store is not None and engine.store.tier == "host" and engine.store.quantization.storage == "nf4"


@pytest.mark.parametrize("storage", ["nf4", "int8"])
def test_loading_a_checkpoint_quantizes_expert_by_expert(storage, tmp_path):
    """`load_offloaded_pretrained` with quantized storage: the store is filled from the checkpoint's files one
    expert at a time (quantized as each is written) and computes what the resident model with library-dequantized
    experts computes (fp32, 1e-5)."""
    from hf_moe_offload.offload.checkpoint import load_offloaded_pretrained
    from transformers import AutoModelForCausalLM

    _model("qwen3_moe").save_pretrained(tmp_path / "ckpt")
    resident = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", experts_implementation="eager").eval()
    _dequantized_by_the_library(resident, storage)
    offloaded = load_offloaded_pretrained(str(tmp_path / "ckpt"), OffloadConfig(
        mode="disk", offload_dir=str(tmp_path / "experts"), train_experts=False, expert_storage=storage,
        host_cache_experts=4, prefetch_depth=1)).eval()
    x = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(offloaded(x).logits, resident(x).logits, atol=1e-5, rtol=0)


def test_dequantized_experts_are_not_kept_between_uses(tmp_path):
    """Evaluation goes expert by expert, each dequantized for that use: nothing keeps those tensors alive (the
    layer's cache of views is for fixed buffers only), so repeated calls do not grow host memory."""
    _, offloaded, engine = _pair("qwen3_moe", "nf4", "host", tmp_path)
    offloaded.eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for _ in range(4):
            offloaded(torch.randint(0, 96, (1, 5), generator=g))
    assert all(key[2] for layer in engine.layers for key in layer._view_cache)  # grouped (staging block) views only
    # nor does a training forward keep its graphs (they would hold every dequantized expert until the backward)
    x = torch.randn(3, 4)
    assert engine.keep_activations and not any(layer.keeps_activations(x) for layer in engine.layers)
