"""Saving a model with offloaded experts through the documented entries (issue 36, item 4).

`OffloadTrainer` saves checkpoints and `save_model` through `save_offloaded_pretrained` (one expert at a time) and a
PEFT model's adapters from a state dict without the experts; `model.save_pretrained` is transformers' own (no patched
method on the instance) and assembles the experts through `state_dict()`, saying so once for large models. Every
save here is checked by loading it where hf_moe_offload plays no part and comparing logits (fp32, same weights:
2e-6, the summation-order difference between the streamed and the resident layer).
"""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainingArguments

import hf_moe_offload  # noqa: F401  (registers the Auto classes)
from hf_moe_offload import (
    ExpertOptimizerCallback,
    MoEGPTConfig,
    MoEGPTForCausalLM,
    OffloadConfig,
    OffloadTrainer,
    enable_expert_offload,
)
from hf_moe_offload.offload import api

ATOL = 2e-6


def small_model(seed: int = 0) -> MoEGPTForCausalLM:
    torch.manual_seed(seed)
    config = MoEGPTConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=48, num_experts=4, moe_layer_frequency=1, hidden_dropout=0.0,
                          attention_dropout=0.0, max_position_embeddings=64)
    return MoEGPTForCausalLM(config)


def _data() -> Dataset:
    ids = torch.randint(0, 101, (8, 11), generator=torch.Generator().manual_seed(3))
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def _args(out, **extra) -> TrainingArguments:
    return TrainingArguments(output_dir=str(out), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                             report_to=[], use_cpu=True, seed=0, disable_tqdm=True, **extra)


@pytest.fixture
def no_assembly(monkeypatch):
    """Fails any `state_dict()` that would assemble offloaded experts in host memory."""
    def refuse(layer, name):
        raise AssertionError(f"expert tensor {name} of layer {layer.layer} assembled through state_dict()")

    monkeypatch.setattr(api, "_expert_tensor", refuse)


def _logits_equal(folder, model) -> None:
    plain = AutoModelForCausalLM.from_pretrained(folder)
    x = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(5))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(x).logits, model(x).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_offload_trainer_checkpoints_and_save_model_stream_the_experts(tier, tmp_path, no_assembly):
    """A trained offloaded model's checkpoint and `save_model` folders are transformers checkpoints (index, shards,
    training args) that load without this package and give the trained model's logits, and no expert was assembled
    through `state_dict()` for them."""
    model = small_model()
    enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=str(tmp_path / "e"), host_cache_experts=3))
    trainer = OffloadTrainer(model=model, args=_args(tmp_path / "out", save_strategy="steps", save_steps=2),
                             train_dataset=_data(), callbacks=[ExpertOptimizerCallback()])
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    for folder in (tmp_path / "out" / "checkpoint-2", tmp_path / "final"):
        files = set(os.listdir(folder))
        assert {"model.safetensors.index.json", "training_args.bin", "config.json"} <= files, files
        _logits_equal(folder, model)


def test_offload_trainer_saves_peft_adapters_without_the_experts(tmp_path, no_assembly):
    """LoRA on attention over frozen offloaded experts (what `--method lora` runs): the Trainer's save writes a
    standard peft adapter, taken from a state dict without the experts, and stock peft puts it on a resident copy of
    the base model with the trained model's logits."""
    from peft import LoraConfig, PeftModel, get_peft_model

    base = small_model(seed=1)
    resident = copy.deepcopy(base)
    for _, module in api.find_expert_modules(base):
        module.requires_grad_(False)
    enable_expert_offload(base, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "e"), host_cache_experts=3,
                                              train_experts=False))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                            init_lora_weights=False))
    trainer = OffloadTrainer(model=model, args=_args(tmp_path / "out", save_strategy="no"), train_dataset=_data())
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "adapter"))
    loaded = PeftModel.from_pretrained(resident, str(tmp_path / "adapter")).eval()
    model.eval()
    x = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=ATOL, rtol=0)


def test_save_pretrained_is_transformers_own_and_says_once_that_it_assembles(tmp_path, monkeypatch, caplog):
    """`enable_expert_offload` puts no method on the model: `save_pretrained` is the class's, writes a correct
    checkpoint through `state_dict()`, and above `ASSEMBLY_WARNING_BYTES` of experts the first assembly names the
    streaming entries (once per engine)."""
    model = small_model(seed=2)
    engine = enable_expert_offload(model, OffloadConfig(mode="host"))
    assert "save_pretrained" not in model.__dict__
    monkeypatch.setattr(api, "ASSEMBLY_WARNING_BYTES", 0)
    with caplog.at_level(logging.WARNING, logger=api.logger.name):
        model.save_pretrained(tmp_path / "plain")
        model.state_dict()
    warnings = [r.getMessage() for r in caplog.records if "assembles all" in r.getMessage()]
    assert len(warnings) == 1 and "save_offloaded_pretrained" in warnings[0] and "OffloadTrainer" in warnings[0]
    _logits_equal(tmp_path / "plain", model)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=api.logger.name), engine.experts_left_out_of_state_dict():
        model.state_dict()  # a streaming save's base shard: nothing assembled, nothing said
    assert not caplog.records
