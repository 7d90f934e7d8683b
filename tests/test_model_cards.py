"""Model cards describe the run that made them: the method and its targets, what was trained and what was frozen, how
the frozen experts were stored, whether the expert-wise CPU optimizer stepped experts, activation checkpointing, the
offload tier, and the MoE layers of any family (hf_moe_offload/hub/cards.py, model_cards/TEMPLATE.md).

A full run's card (the expert-wise optimizer named, checkpointing on):
test_main_job.py::test_main_job_with_activation_checkpointing_on_the_disk_tier."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_moe_offload.hub.cards import EXPERT_WISE, card_values, describe_model, moe_layer_indices

from moe_families import tiny_config


@pytest.fixture(scope="module")
def lora_nf4_run(tmp_path_factory):
    """`hf-moe-offload train --method lora --lora-targets experts,attention --expert-storage nf4` on a Hub-layout
    Qwen3-MoE checkpoint (transformers' own save_pretrained) whose layer 1 is dense: MoE layers 0 and 2."""
    from hf_moe_offload.cli.main import main
    from hf_moe_offload.data import gpt2_tokenizer

    root = tmp_path_factory.mktemp("card")
    tokenizer = gpt2_tokenizer()
    config = tiny_config("qwen3_moe")
    config.num_hidden_layers, config.mlp_only_layers = 3, [1]
    config.layer_types = None  # re-derived for three layers
    config.vocab_size, config.max_position_embeddings = len(tokenizer), 128
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "hub")
    tokenizer.save_pretrained(root / "hub")
    out = root / "run"
    assert main(["train", "--short", "--steps", "1", "--batch-size", "2", "--block-size", "64", "--max-eval-blocks",
                 "2", "--model-path", str(root / "hub"), "--method", "lora", "--lora-targets", "experts,attention",
                 "--expert-storage", "nf4", "--offload", "disk", "--output-dir", str(out)]) == 0
    return json.loads((out / "metrics.json").read_text()), (out / "README.md").read_text()


@pytest.mark.slow
def test_lora_card_on_frozen_nf4_experts(lora_nf4_run):
    record, card = lora_nf4_run
    experts = record["training"]["experts"]
    assert experts == {"trained": False, "stepped_by": None, "storage": "nf4", "stored": experts["stored"],
                       "tier": "disk"}, experts
    assert EXPERT_WISE not in card  # no expert was stepped
    assert "| MoE layers | 2 (layers 0, 2) |" in card
    assert "| method | LoRA (r=8" in card and "experts.gate_up_proj (every expert, streamed)" in card
    assert "| trained | the LoRA adapters only" in card
    assert "| frozen | every weight of the base model, the experts included (stored as nf4" in card
    assert "| experts | frozen, stored as nf4, never stepped |" in card
    assert "| expert tier | experts on the disk tier" in card
    assert "| activation checkpointing | off |" in card and record["gradient_checkpointing"] is False
    assert "Trained with `hf_moe_offload`: LoRA; experts on the disk tier" in card
    assert "`qwen3_moe` (Qwen3MoeForCausalLM) |" in card  # no MoE-GPT description for another family


@pytest.mark.slow
def test_a_record_without_the_experts_summary_renders_the_same(lora_nf4_run):
    """Cards re-rendered from an older metrics.json (`push`) derive the experts' treatment from the method and the
    tier, as the jobs do; it agrees with what the run recorded."""
    record, _ = lora_nf4_run
    older = copy.deepcopy(record)
    del older["training"]["experts"]
    for field in ("technique_line", "trained", "frozen", "experts_treatment", "tier", "offload"):
        assert card_values(older)[field] == card_values(record)[field], field


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss", "olmoe"])
def test_moe_layer_indices_from_the_experts_modules(model_type):
    """Every family: the indices of the decoder layers holding experts, read from the experts modules (one dense
    layer between two MoE layers where the family's config allows it)."""
    config = tiny_config(model_type)
    expected = list(range(config.num_hidden_layers))
    if model_type == "qwen3_moe":
        config.num_hidden_layers, config.mlp_only_layers, config.layer_types = 3, [1], None
        expected = [0, 2]
    model = AutoModelForCausalLM.from_config(config)
    described = describe_model(model)
    assert described["moe_layer_indices"] == expected, described["moe_layer_names"]
    assert described["moe_layers"] == len(expected)


def test_moe_layer_indices_need_one_number_per_layer():
    assert moe_layer_indices(["model.layers.1.moe.experts", "model.layers.3.moe.experts"]) == [1, 3]
    assert moe_layer_indices(["encoder.block.1.mlp.experts", "decoder.block.1.mlp.experts"]) == []  # two stacks
    assert moe_layer_indices(["experts"]) == []
