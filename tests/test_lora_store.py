"""The experts' LoRA factors kept in the expert store (`OffloadConfig.lora_in_store`), stepped by the ExpertOptimizer.

Against peft's resident LoRA trained with `torch.optim.AdamW` (attention LoRA on both sides stepped by it): the same
base weights, peft config and seed, 3 steps on fresh random tokens, Qwen3-MoE's tiny model. The streamed side's expert
factors live in the store (the module shows stand-ins), its attention LoRA stays a device parameter stepped by torch
AdamW; with `max_grad_norm` the resident side clips with `clip_grad_norm_` over every adapter parameter and the
streamed side with the expert optimizer's global clip, which counts the stored factors' gradients in the norm.
Tolerances are tests/lora_cases.py's (derived in tests/test_expert_lora.py's docstring): fp32 logits 1e-5 at the
first step, bf16 autocast 5e-2; the adapters after the last step within Adam's drift bound, at most 1% (fp32) or 10%
(bf16) of the elements beyond lr/10. Both orders (LoRA before offload and after), the CPU (host tier: one chunk of
every expert; disk tier: expert by expert) and the simulated device (the slab's chunks).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os

import pytest
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

from hf_moe_offload import ExpertOptimizer, OffloadConfig, enable_expert_offload
from hf_moe_offload.offload.checkpoint import load_expert_state, save_expert_state
from hf_moe_offload.offload.lora.stand_ins import is_stand_in
from hf_moe_offload.runtime import use_runtime
from hf_moe_offload.runtime.simulated import SimulatedRuntime

from lora_cases import LR, VOCAB, WEIGHT_DECAY, lora_model
from moe_families import tiny_model
from numerics import assert_within_adam_drift

TARGETS = ["experts.gate_up_proj", "experts.down_proj"]
ATTENTION = ["q_proj", "v_proj"]


def _models(order: str, layers: int, tier: str = "host", folder=None):
    """(resident peft model, streamed peft model with the factors in the store, its engine). The disk tier with a
    host cache of 3 experts reading 1 ahead streams expert by expert (one expert's factors per chunk)."""
    base = tiny_model("qwen3_moe", num_hidden_layers=layers)
    for p in base.parameters():
        p.requires_grad_(False)
    twin = copy.deepcopy(base)
    disk = {"offload_dir": str(folder), "host_cache_experts": 3, "prefetch_depth": 1} if tier == "disk" else {}
    config = OffloadConfig(mode=tier, train_experts=False, lora_in_store=True, **disk)
    resident = lora_model(base, TARGETS, ATTENTION)
    if order == "lora-first":
        streamed = lora_model(twin, TARGETS, ATTENTION)
        engine = enable_expert_offload(streamed, config)
    else:
        engine = enable_expert_offload(twin, config)
        streamed = lora_model(twin, TARGETS, ATTENTION)
    return resident, streamed, engine


def _trainers(resident, streamed, engine, clip: float | None):
    dense = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY)
             for m in (resident, streamed)]
    experts = ExpertOptimizer(engine, lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=clip)
    return dense, experts


def _step(models, dense, experts, x, autocast: bool, clip: float | None) -> list[torch.Tensor]:
    """One step of each model on `x` -> their logits; with `clip`, the two global gradient norms agree (the stored
    factors' gradients counted: the expert tensors' LoRA is most of the adapter)."""
    logits = []
    for i, model in enumerate(models):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x, labels=x)
        out.loss.backward()
        logits.append(out.logits.detach().float())
        params = [p for p in model.parameters() if p.requires_grad]
        if i == 0:
            norm = float(torch.nn.utils.clip_grad_norm_(params, clip)) if clip is not None else None
        else:
            experts.step(params)  # the window closes: the factors stepped (clipped with the dense gradients)
            if clip is not None:
                assert abs(experts.last_grad_norm - norm) <= (5e-2 if autocast else 1e-5) * norm
        dense[i].step()
        dense[i].zero_grad()
    return logits


@pytest.mark.parametrize("device,autocast,order,clip", [
    pytest.param("cpu-disk", False, "lora-after", None, marks=pytest.mark.slow),  # ~15 s on 2 shared cores
    ("cpu", True, "lora-first", 0.5),
    ("simulated", False, "lora-first", 0.5),
    ("simulated", True, "lora-after", None),
], ids=["cpu-disk-fp32-after", "cpu-bf16-first-clipped", "simulated-fp32-first-clipped", "simulated-bf16-after"])
def test_lora_factors_in_the_store_train_as_resident_lora(device, autocast, order, clip, tmp_path):
    runtime = SimulatedRuntime(seed=4, max_delay=0.001) if device == "simulated" else None
    with use_runtime(runtime) if runtime is not None else contextlib.nullcontext():
        # one MoE layer under autocast (tests/test_expert_lora.py: a router's near ties) and on the disk tier (time)
        resident, streamed, engine = _models(order, layers=1 if autocast or device == "cpu-disk" else 2,
                                             tier="disk" if device == "cpu-disk" else "host", folder=tmp_path)
        dense, experts = _trainers(resident, streamed, engine, clip)
        g = torch.Generator().manual_seed(7)
        for step in range(3):
            x = torch.randint(0, VOCAB, (2, 11), generator=g)
            logits = _step((resident, streamed), dense, experts, x, autocast, clip)
            if step == 0:
                torch.testing.assert_close(logits[1], logits[0], atol=5e-2 if autocast else 1e-5, rtol=0)
                # the factors left the module: stand-ins there, nothing of them in the dense optimizer's state
                factors = [n for n, p in streamed.named_parameters() if "experts" in n and "lora_" in n]
                assert factors and all(is_stand_in(p) and not p.requires_grad for n, p in streamed.named_parameters()
                                       if n in factors)
                assert all(not is_stand_in(p) for group in dense[1].param_groups for p in group["params"]
                           if dense[1].state.get(p))
                if device == "simulated":
                    assert engine.slab is not None  # the device path: factors sent with their chunk
        if device == "cpu-disk":
            assert engine.plan.grouped_source is None  # expert by expert
        experts.close()
    assert engine.lora.layers and all(f.steps == 3 for f in engine.lora.layers.values())
    ours, theirs = get_peft_model_state_dict(streamed), get_peft_model_state_dict(resident)
    assert ours.keys() == theirs.keys()
    assert all(ours[k].shape == theirs[k].shape and ours[k].dtype == theirs[k].dtype for k in ours)
    assert_within_adam_drift(streamed, resident, LR, 3, weight_decay=WEIGHT_DECAY,
                             outliers=0.1 if autocast else 0.01)



def _streamed(seed: int):
    base = tiny_model("qwen3_moe", num_hidden_layers=2)
    for p in base.parameters():
        p.requires_grad_(False)
    engine = enable_expert_offload(base, OffloadConfig(mode="host", train_experts=False, lora_in_store=True))
    model = lora_model(base, TARGETS, ATTENTION, seed=seed)
    dense = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY)
    return model, engine, dense, ExpertOptimizer(engine, lr=LR, weight_decay=WEIGHT_DECAY)


def _train_step(model, dense, experts, x) -> None:
    model(x, labels=x).loss.backward()
    experts.step()
    dense.step()
    dense.zero_grad()


def test_resume_from_the_expert_state_is_bit_exact_and_the_saved_adapter_keeps_peft_s_format(tmp_path):
    """2 steps, then the adapter (`save_pretrained`), the expert state (`save_expert_state`: the factors' masters,
    moments and step counts) and the dense optimizer saved; a fresh model with other adapter values loads them
    (before its first forward: the state waits for the layers' adoption) and its third step equals the first
    model's bit for bit. The saved adapter has the keys, shapes, dtypes and config of peft's resident adapter, and
    `export_adapter` writes the same files from both."""
    from hf_moe_offload import export_adapter

    model, engine, dense, experts = _streamed(seed=1)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, VOCAB, (2, 11), generator=g) for _ in range(3)]
    for x in batches[:2]:
        _train_step(model, dense, experts, x)
    model.save_pretrained(tmp_path / "adapter")
    at_save = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    save_expert_state(engine, str(tmp_path / "ckpt"), experts.state_dict(), global_step=2)
    dense_state = copy.deepcopy(dense.state_dict())

    other, other_engine, other_dense, other_experts = _streamed(seed=5)
    set_peft_model_state_dict(other, load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    other_experts.load_state_dict(load_expert_state(other_engine, str(tmp_path / "ckpt")))
    other_dense.load_state_dict(dense_state)
    for m, d, e in ((model, dense, experts), (other, other_dense, other_experts)):
        _train_step(m, d, e, batches[2])
    ours, theirs = get_peft_model_state_dict(model), get_peft_model_state_dict(other)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for layer, factors in engine.lora.layers.items():
        assert torch.equal(factors.rows, other_engine.lora.layers[layer].rows) and factors.steps == 3
    set_peft_model_state_dict(other, at_save)  # loading once adopted: into the masters
    assert all(torch.equal(v, at_save[k]) for k, v in get_peft_model_state_dict(other).items())

    base = tiny_model("qwen3_moe", num_hidden_layers=2)
    resident = lora_model(base, TARGETS, ATTENTION)
    resident.save_pretrained(tmp_path / "resident")
    saved = [load_file(tmp_path / d / "adapter_model.safetensors") for d in ("adapter", "resident")]
    assert {k: (v.shape, v.dtype) for k, v in saved[0].items()} == {k: (v.shape, v.dtype) for k, v in saved[1].items()}
    configs = [json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("adapter", "resident")]
    assert configs[0] == configs[1]
    assert all(torch.equal(saved[0][k], at_save[k]) for k in saved[0])  # the masters' values, as trained
    assert any(not torch.equal(saved[0][k], saved[1][k]) for k in saved[0] if "experts" in k)
    for d in ("adapter", "resident"):
        export_adapter(str(tmp_path / d), str(tmp_path / f"{d}-vllm"), base_model=base.config)
    exported = [load_file(tmp_path / f"{d}-vllm" / "adapter_model.safetensors") for d in ("adapter", "resident")]
    assert {k: v.shape for k, v in exported[0].items()} == {k: v.shape for k, v in exported[1].items()}
    assert sorted(os.listdir(tmp_path / "adapter-vllm")) == sorted(os.listdir(tmp_path / "resident-vllm"))


def test_a_merged_save_takes_the_factors_from_the_store(tmp_path):
    """`save_merged_lora` of a model trained with the factors in the store writes the checkpoint peft's own
    `merge_and_unload` gives from the same adapter on the resident model (fp32: each expert's W + s * B @ A formed
    once per side, summation order apart: 1e-6)."""
    from transformers import AutoModelForCausalLM

    from hf_moe_offload import save_merged_lora

    model, _, dense, experts = _streamed(seed=1)
    x = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    _train_step(model, dense, experts, x)
    adapter = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    resident = lora_model(tiny_model("qwen3_moe", num_hidden_layers=2), TARGETS, ATTENTION, seed=9)
    set_peft_model_state_dict(resident, adapter)
    expected = resident.merge_and_unload().state_dict()
    save_merged_lora(model, str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert merged.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, atol=1e-6, rtol=0, msg=name)
