"""peft LoRA on fused experts re-laid out per expert (for vLLM / SGLang) and back (hf_moe_offload/hub/adapter_export.py).

Tolerances. The export and the import only slice and scatter the factors, so every comparison of factors is bit for
bit (torch.equal), in fp32. Products: each per-expert `scaling * B @ A` is compared with the same rows of peft's own
fused delta (`ParamWrapper.get_delta_weight`, an einsum over the same rank-4 sums) with torch.equal; the merged model
built from the export (base per-expert weight + scaling * B @ A) is compared with `save_merged_lora`'s checkpoint
(which forms `W + scaling * B_e @ A_e` expert by expert the same way) with torch.equal. Logits of stock peft loading
the per-expert adapter (it fuses the factors again, block-diagonally) against the fused adapter: fp32, atol 1e-5
(the same sums in another order at most).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_moe_offload import (OffloadConfig, enable_expert_offload, export_per_expert_adapter,
                            import_per_expert_adapter)
from hf_moe_offload.hub.adapter_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LAYOUT_METADATA_KEY, PEFT_PREFIX
from hf_moe_offload.cli.main import main
from hf_moe_offload.errors import UserError
from hf_moe_offload.jobs import save_lora_run

from moe_families import tiny_model

TARGETS = ["experts.gate_up_proj", "experts.down_proj"]


def _adapter(family: str, tmp_path, seed: int = 1):
    """(the base model, the peft model, the adapter folder, the base model's folder): LoRA r=4 on q_proj and on
    every expert matrix, lora_B random (init_lora_weights=False) so that every delta is non-zero."""
    base = tiny_model(family).eval()
    base_dir = str(tmp_path / "base")
    base.save_pretrained(base_dir)
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                           target_parameters=TARGETS, init_lora_weights=False))
    model.peft_config["default"].base_model_name_or_path = base_dir
    adapter_dir = str(tmp_path / "adapter")
    model.save_pretrained(adapter_dir)
    return base, model, adapter_dir, base_dir


def _linear_delta(wrapper) -> torch.Tensor:
    """peft's fused delta of one wrapper, (E, out, in) in nn.Linear's orientation."""
    delta = wrapper.get_delta_weight("default")
    return delta if wrapper._did_swap_in_out_features else delta.transpose(1, 2)


def _config_semantics(path: str) -> dict:
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        c = json.load(f)
    return {"r": c["r"], "lora_alpha": c["lora_alpha"], "use_rslora": c["use_rslora"], "task_type": c["task_type"],
            "target_modules": sorted(c["target_modules"] or []),
            "target_parameters": sorted(c["target_parameters"] or []),
            "base_model_name_or_path": c["base_model_name_or_path"]}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "gpt_oss"])
def test_per_expert_factors_give_each_experts_delta_exactly_and_round_trip(family, tmp_path):
    _, model, adapter_dir, _ = _adapter(family, tmp_path)
    per_expert = export_per_expert_adapter(adapter_dir, str(tmp_path / "per_expert"))
    exported = load_file(os.path.join(per_expert, ADAPTER_WEIGHTS))
    scaling = 8 / 4
    names = {"mixtral": ("w1", "w3", "w2")}.get(family, ("gate_proj", "up_proj", "down_proj"))
    checked = 0
    for name, wrapper in model.named_modules():
        if not hasattr(wrapper, "parameter_name"):
            continue
        delta = _linear_delta(wrapper)  # (E, out, in)
        E, out = delta.shape[:2]
        layer = name.removeprefix(PEFT_PREFIX).split(".mlp.")[0]
        hub = f"{layer}.block_sparse_moe.experts" if family == "mixtral" else f"{layer}.mlp.experts"
        if wrapper.parameter_name == "gate_up_proj":
            half = torch.arange(out // 2)
            # Gate rows first then up rows (transformers' Concatenate), gpt-oss interleaved (its `_apply_gate`).
            rows = {names[0]: 2 * half, names[1]: 2 * half + 1} if family == "gpt_oss" else {
                names[0]: half, names[1]: half + out // 2}
        else:
            rows = {names[2]: torch.arange(out)}
        for e in range(E):
            a_of = []
            for proj, r in rows.items():
                a = exported[f"{PEFT_PREFIX}{hub}.{e}.{proj}.lora_A.weight"]
                b = exported[f"{PEFT_PREFIX}{hub}.{e}.{proj}.lora_B.weight"]
                assert torch.equal(scaling * b @ a, delta[e, r]), f"{hub}.{e}.{proj}"
                a_of.append(a)
                checked += 1
            assert all(torch.equal(a, a_of[0]) for a in a_of)  # gate and up share the fused A_e
    assert checked == 2 * 6 * 3
    # Attention LoRA passes through unchanged.
    original = load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
    plain = [k for k in original if "q_proj" in k]
    assert plain and all(torch.equal(exported[k], original[k]) for k in plain)
    with open(os.path.join(per_expert, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    assert config["target_parameters"] is None and sorted(config["target_modules"]) == sorted(names + ("q_proj",))
    with safe_open(os.path.join(per_expert, ADAPTER_WEIGHTS), framework="pt") as f:
        assert f.metadata()[LAYOUT_METADATA_KEY] == "per-expert"

    # Back to peft's fused layout: every tensor bit for bit, the same config.
    fused = import_per_expert_adapter(per_expert, str(tmp_path / "fused"))
    back = load_file(os.path.join(fused, ADAPTER_WEIGHTS))
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) and back[k].dtype == original[k].dtype for k in original)
    assert _config_semantics(fused) == _config_semantics(adapter_dir)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_stock_peft_loads_the_per_expert_adapter_onto_the_fused_model(family, tmp_path):
    """peft 0.21 converts per-expert adapters of these families (Hub names) onto transformers v5's fused experts: the
    exported adapter gives the fused adapter's logits."""
    base, model, adapter_dir, _ = _adapter(family, tmp_path)
    per_expert = export_per_expert_adapter(adapter_dir, str(tmp_path / "per_expert"))
    x = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(x).logits
        plain = base(x).logits
        got = PeftModel.from_pretrained(copy.deepcopy(base), per_expert).eval()(x).logits
    assert (want - plain).abs().max() > 1e-2  # the adapter changes the output
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_merging_the_per_expert_adapter_gives_save_merged_lora_checkpoint(family, tmp_path):
    """Offloaded experts (host tier), LoRA saved as the jobs save it (`save_lora_run`: adapter/ + merged model).
    The merge of the per-expert export into the base's Hub checkpoint (per-expert weights) equals it bit for bit."""
    base = tiny_model(family).eval()
    base_dir = str(tmp_path / "base")
    base.save_pretrained(base_dir)
    offloaded = copy.deepcopy(base)
    enable_expert_offload(offloaded, OffloadConfig(mode="host", train_experts=False))
    torch.manual_seed(1)
    model = get_peft_model(offloaded, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                 target_parameters=TARGETS, init_lora_weights=False))
    run_dir = str(tmp_path / "run")
    save_lora_run(model, run_dir)
    per_expert = export_per_expert_adapter(os.path.join(run_dir, "adapter"), str(tmp_path / "per_expert"),
                                           base_model=base_dir)
    factors = load_file(os.path.join(per_expert, ADAPTER_WEIGHTS))
    hub = {}
    for name in sorted(os.listdir(base_dir)):
        if name.endswith(".safetensors"):
            hub.update(load_file(os.path.join(base_dir, name)))
    merged = dict(hub)
    modules = {k.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for k in factors}
    assert len(modules) == 2 * (6 * 3 + 1)
    for module in modules:
        a, b = (factors[f"{PEFT_PREFIX}{module}.lora_{x}.weight"] for x in "AB")
        merged[f"{module}.weight"] = hub[f"{module}.weight"] + 2.0 * (b @ a)
    merged_dir = tmp_path / "merged_from_per_expert"
    merged_dir.mkdir()
    base.config.save_pretrained(merged_dir)
    save_file(merged, str(merged_dir / "model.safetensors"), metadata={"format": "pt"})
    ours = AutoModelForCausalLM.from_pretrained(merged_dir).state_dict()
    reference = AutoModelForCausalLM.from_pretrained(run_dir).state_dict()
    assert ours.keys() == reference.keys()
    for k in reference:
        assert torch.equal(ours[k], reference[k]), k
    assert any(not torch.equal(reference[k], v) for k, v in base.state_dict().items())  # something was merged


def test_cli_exports_and_imports(tmp_path, capsys):
    _, _, adapter_dir, base_dir = _adapter("qwen3_moe", tmp_path)
    per_expert, fused = str(tmp_path / "pe"), str(tmp_path / "fused")
    assert main(["export-adapter", adapter_dir, per_expert, "--layout", "per-expert", "--base-model", base_dir]) == 0
    assert main(["export-adapter", per_expert, fused, "--server", "peft", "--layout", "fused"]) == 0
    original, back = (load_file(os.path.join(d, ADAPTER_WEIGHTS)) for d in (adapter_dir, fused))
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    # Writing again over an earlier adapter replaces it whole.
    assert main(["export-adapter", per_expert, fused, "--server", "peft", "--layout", "fused"]) == 0
    assert sorted(os.listdir(fused)) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n or ".old-" in n]
    capsys.readouterr()

    def error(*argv) -> str:
        assert main(["export-adapter", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("hf-moe-offload: error:")
        return err

    assert "is not a folder" in error(str(tmp_path / "nowhere"), str(tmp_path / "x"), "--layout", "per-expert")
    # An adapter without LoRA on the experts.
    plain = get_peft_model(tiny_model("qwen3_moe"), LoraConfig(r=4, target_modules=["q_proj"]))
    plain.save_pretrained(str(tmp_path / "plain"))
    # An adapter without LoRA on the experts: written with its scaling folded, no expert layout to choose.
    assert main(["export-adapter", str(tmp_path / "plain"), str(tmp_path / "y"), "--base-model", base_dir]) == 0
    assert "no expert layout for vllm" in capsys.readouterr().out
    assert "does not name its base model" in error(str(tmp_path / "plain"), str(tmp_path / "x"), "--server", "peft")
    assert "is the input adapter's folder" in error(adapter_dir, adapter_dir, "--layout", "per-expert")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert "holds something other than an adapter" in error(adapter_dir, str(tmp_path / "busy"), "--layout",
                                                            "per-expert")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    # vLLM does not load peft's fused layout on Qwen3-MoE: refused, with the layout it loads and peft's way out.
    refused = error(adapter_dir, str(tmp_path / "x"), "--layout", "fused")
    assert "vllm does not load the fused expert layout for qwen3_moe" in refused and "--server peft" in refused


def test_a_family_without_per_expert_names_is_refused_with_the_supported_ones(tmp_path):
    from hf_moe_offload import MoEGPTConfig, MoEGPTForCausalLM

    config = MoEGPTConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                          intermediate_size=48, num_experts=4, moe_layer_frequency=1, max_position_embeddings=64)
    base_dir = str(tmp_path / "base")
    MoEGPTForCausalLM(config).save_pretrained(base_dir)
    model = get_peft_model(MoEGPTForCausalLM(config), LoraConfig(
        r=4, target_modules=[], target_parameters=["experts.fc1_weight", "experts.fc2_weight"]))
    model.save_pretrained(str(tmp_path / "adapter"))
    with pytest.raises(UserError, match=r"no per-expert layout for 'moe_gpt'.*gpt_oss.*mixtral.*qwen3_moe"):
        export_per_expert_adapter(str(tmp_path / "adapter"), str(tmp_path / "out"), base_model=base_dir)
    assert not os.path.exists(tmp_path / "out")


def test_import_refuses_separate_gate_and_up_lora_a(tmp_path):
    _, _, adapter_dir, _ = _adapter("qwen3_moe", tmp_path)
    per_expert = export_per_expert_adapter(adapter_dir, str(tmp_path / "per_expert"))
    path = os.path.join(per_expert, ADAPTER_WEIGHTS)
    tensors = load_file(path)
    key = f"{PEFT_PREFIX}model.layers.1.mlp.experts.2.up_proj.lora_A.weight"
    tensors[key] = tensors[key] + 1
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(UserError, match="share lora_A"):
        import_per_expert_adapter(per_expert, str(tmp_path / "fused"))
    del tensors[key]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(UserError, match="lacks .*experts.2.up_proj.lora_A"):
        import_per_expert_adapter(per_expert, str(tmp_path / "fused"))
