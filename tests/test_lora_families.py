"""peft's LoRA on streamed experts for every MoE family of the installed transformers (table-driven, as
tests/test_families.py; the comparison is tests/lora_cases.py's).

For each family: its tiny causal LM (tests/moe_families.py), and on it peft's LoRA with `target_parameters` on the
family's 3-D expert tensors (`expert_target_parameters`: gate_up_proj or up_proj, down_proj) and `target_modules` on
its attention projections where it has any, once on the stock model (peft's resident path on transformers' "eager"
experts) and once with the frozen experts offloaded: the host tier (each layer's experts as one grouped GEMM per
matmul), and the disk tier with a host cache of 3 experts reading 1 ahead (expert by expert, ES-MoE's pipeline;
experts evicted and read again within each pass). 2 AdamW steps of lr 1e-2 on fresh random tokens, fp32 and bf16 CPU
autocast: the first step's logits and adapter gradients and the adapters after the 2 steps agree within
tests/lora_cases.py's tolerances (fp32 1e-5; bf16 5e-2; the adapters within Adam's drift bound), and the stored
experts stay bit-unchanged. Under autocast the model keeps one MoE layer (as in tests/test_expert_lora.py: a second
layer's router can pick other experts for a token on the first layer's bf16 rounding alone, which is no error of
either path).

Families the generic shrink cannot build are skipped with its reason; `test_lora_family_table` prints the table.
`OUTSIDE_THE_TABLE` adds model types outside it: the expert layouts no family of the table has (a norm after each
expert; transposed experts without biases; transposed biased experts in an encoder), and the text models of families
the table skips (composite configs, no causal-LM head) that the shrink builds.
"""

from __future__ import annotations

import copy
import re
from functools import cache

import pytest
import torch
from torch import nn

import hf_moe_offload  # noqa: F401
from hf_moe_offload import OffloadConfig, enable_expert_offload, expert_target_parameters
from hf_moe_offload.families.moe_path import experts_layers

from lora_cases import assert_streamed_lora_equals_resident, lm_forward, lora_model, probe_forward
from moe_families import Unshrinkable, experts_families, tiny_config, tiny_model

FAMILIES = experts_families()
STEPS = 2
# peft maps these target_modules names of v5 MoE families onto the fused expert tensors (its v4 -> v5 conversion:
# `gate_proj` + `up_proj` -> `gate_up_proj`), so an attention projection of that name (afmoe's and beam's gated
# attention) cannot be targeted by name; the experts are targeted through target_parameters instead.
PEFT_EXPERT_NAMES = {"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"}


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """One intra-op thread for this file's tiny models: their matrices gain nothing from a second thread, and on a
    2-core machine where another process is busy two threads wait on each other at every op (measured: the file took
    4x as long)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def attention_targets(model: nn.Module) -> list[str]:
    """The full names of the attention blocks' plain `nn.Linear` projections (peft's LoRA `Linear` computes
    `linear(x, W) + s * B(A(x))`, which a `Linear` subclass with its own forward, e.g. deepseek_v4's grouped output
    projection, does not compute)."""
    return sorted(n for n, m in model.named_modules()
                  if type(m) is nn.Linear and any(k in n.rpartition(".")[0] for k in ("attn", "attention"))
                  and n.rpartition(".")[2] not in PEFT_EXPERT_NAMES)


@cache
def _base(family: str, layers: int, causal_lm: bool = True, overrides: tuple = ()) -> nn.Module:
    """The family's tiny model with every weight frozen (built once per test session; callers deep-copy it);
    `overrides`: (config field, value) pairs the generic shrink does not know."""
    model = tiny_model(family, causal_lm=causal_lm, num_hidden_layers=layers, **dict(overrides))
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@cache
def _one_moe_layer(family: str, causal_lm: bool = True, overrides: tuple = ()) -> int:
    """The fewest layers that keep one MoE layer: the first one's index + 1 (dense or mamba layers come first in
    some families' patterns)."""
    first = experts_layers(_base(family, 2, causal_lm, overrides))[0][0]
    return int(re.search(r"(?:^|\.)layers\.(\d+)\.", first).group(1)) + 1


@cache
def _eager_fails_under_autocast(family: str) -> bool:
    """Whether transformers' own eager experts of the family's one-MoE-layer model raise under bf16 CPU autocast
    (ergo's, in transformers 5.25, index_put a bf16 product into an fp32 buffer); probed once per family."""
    probe = copy.deepcopy(_base(family, _one_moe_layer(family)))
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            probe(torch.zeros(1, 4, dtype=torch.long))
    except RuntimeError:
        return True
    return False


def _pair(base: nn.Module, tier: str, tmp_path, resident_experts: str = "eager"):
    """(resident LoRA model, streamed LoRA model, its engine) from copies of `base`; the resident model on
    transformers' `resident_experts` implementation."""
    resident, offloaded = copy.deepcopy(base), copy.deepcopy(base)
    if resident_experts != "eager":
        resident.set_experts_implementation(resident_experts)
    config = OffloadConfig(mode=tier, offload_dir=str(tmp_path / "experts"), train_experts=False,
                           **({"host_cache_experts": 3, "prefetch_depth": 1} if tier == "disk" else {}))
    engine = enable_expert_offload(offloaded, config)
    params, modules = expert_target_parameters(base), attention_targets(base)
    return lora_model(resident, params, modules), lora_model(offloaded, params, modules), engine


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_lora_on_streamed_experts_equals_resident_lora(family, tier, autocast, tmp_path):
    try:
        tiny_config(family)
    except Unshrinkable as err:
        pytest.skip(f"{family}: {err}")
    # transformers' eager experts, or its batched_mm kernel under autocast where the eager ones raise there
    experts = "batched_mm" if autocast and _eager_fails_under_autocast(family) else "eager"
    resident, streamed, engine = _pair(_base(family, _one_moe_layer(family) if autocast else 2), tier, tmp_path,
                                       experts)
    lora = [n for n, p in streamed.named_parameters() if p.requires_grad]
    assert any(".experts." in n for n in lora), f"{family}: no adapter on the experts"
    assert_streamed_lora_equals_resident(resident, streamed, engine, autocast, steps=STEPS)
    if tier == "disk":
        assert engine.stats.evictions > 0  # the cache bound was met: experts were read from the files again


# Model types outside the table (their modeling file is another model's, or they have no causal-LM head and are built
# as their base model, `causal_lm=False`): model type -> (causal LM, config fields the generic shrink leaves large,
# the flags of its experts' layout, what it is). First the layouts the table lacks, then the text models of the
# families the table skips. dots3_note_text is left out: its attention keeps 38 M parameters through the shrink.
OUTSIDE_THE_TABLE = {
    "aria_text": (True, {}, {"is_transposed": True, "has_bias": False}, "transposed experts (aria's text model)"),
    "muse_spark_text": (False, {"moe_hidden_size": 32}, {"has_post_expert_norm": True},
                        "a norm after each expert (muse_spark's text model)"),
    "openai_privacy_filter": (False, {}, {"is_transposed": True, "has_bias": True},
                              "transposed experts with biases, a bidirectional encoder"),
    "inkling_text": (True, {"swa_head_dim": 8}, {}, "inkling's text model"),
    "inkling2_text": (True, {"unpadded_vocab_size": 96, "swa_head_dim": 8}, {}, "inkling2's text model"),
    "inkling2_loop_text": (True, {"unpadded_vocab_size": 96, "swa_head_dim": 8}, {}, "inkling2_loop's text model"),
    "minimax_m3_vl_text": (True, {"dense_intermediate_size": 48, "shared_intermediate_size": 24, "index_head_dim": 8},
                           {}, "minimax_m3_vl's text model"),
    "qwen3_5_moe_text": (True, {"linear_key_head_dim": 8, "linear_value_head_dim": 8}, {}, "qwen3_5_moe's text model"),
    "qwen3_vl_moe_text": (False, {}, {}, "qwen3_vl_moe's text model"),
}


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("model_type", list(OUTSIDE_THE_TABLE))
def test_outside_the_table_lora_on_streamed_experts_equals_resident_lora(model_type, tier, autocast, tmp_path):
    """The table's comparison for the model types above, the base models on their last hidden states and a fixed
    random probe (`probe_forward`)."""
    causal_lm, overrides, flags, _ = OUTSIDE_THE_TABLE[model_type]
    overrides = tuple(sorted(overrides.items()))
    base = _base(model_type, _one_moe_layer(model_type, causal_lm, overrides) if autocast else 2, causal_lm, overrides)
    experts = [module for _, module, _ in experts_layers(base)]
    assert experts and all(getattr(m, flag) == value for m in experts for flag, value in flags.items())
    resident, streamed, engine = _pair(base, tier, tmp_path)
    assert_streamed_lora_equals_resident(resident, streamed, engine, autocast, steps=STEPS,
                                         forward=lm_forward if causal_lm else probe_forward)
    if tier == "disk":
        assert engine.stats.evictions > 0


def test_lora_family_table():
    """Which families LoRA on streamed experts was tested on, with the adapted tensors, and why the others were
    skipped. Every family the generic shrink builds is in the comparison: none is skipped for LoRA's sake."""
    rows = []
    for f in FAMILIES:
        try:
            tiny_config(f)
        except Unshrinkable as err:
            rows.append((f, f"skipped: {err}"))
            continue
        base = _base(f, 2)
        attention = sorted({n.rpartition(".")[2] for n in attention_targets(base)})
        rows.append((f, f"runs: {', '.join(expert_target_parameters(base))}; attention: {', '.join(attention) or '-'}"))
    ran = [f for f, r in rows if r.startswith("runs")]
    print(f"\nLoRA on streamed experts: {len(ran)} of {len(FAMILIES)} transformers MoE families")
    for f, r in rows:
        print(f"  {f:24s} {r}")
    print("and model types outside the table: the layouts it lacks, the text models of families it skips:")
    for f, (*_, what) in OUTSIDE_THE_TABLE.items():
        print(f"  {f:24s} runs: {what}")
    for must in ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3", "glm4_moe", "granitemoe", "nemotron_h"):
        assert must in ran, must
