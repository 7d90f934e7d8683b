"""Adapters as vLLM and SGLang load them (hf_moe_offload/hub/adapter_serving.py) and the checker of their rules
(hf_moe_offload/hub/adapter_check.py).

The served delta is computed here by each server's rules as read from its loader (shared notes, vLLM main 7ca49fbe,
SGLang main 18e6c61c), independently of the export: the global `lora_alpha / r` times `lora_B @ lora_A` of each
per-expert module (gate rows first then up rows; gpt-oss interleaved, gate even); for vLLM's fused gpt-oss layout
`lora_A.reshape(E, r, in)[e]`, `lora_B.reshape(out, r, E)[:, :, e]`, gate rows 0::2 and up rows 1::2. The reference is
peft's own delta (`get_delta_weight`) of the trained adapter, computed by peft on a float64 copy of the model (its
rounding, ~1e-16 relative, is negligible here).

Tolerance of the fold. The export multiplies lora_B by each module's scaling ratio in float64 and rounds once to
fp32: each element of lora_B is within 2^-24 of its exact value (relative). So, elementwise,
|served - peft| <= s * 2^-24 * (|lora_B| @ |lora_A|) (s the server's scaling), plus 1e-12 of the delta's largest
element for float64's own rounding. The test also shows that the bound bites: the adapter as peft saved it, read by
the server's rules, is far outside it.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from hf_moe_offload import check_adapter, export_adapter, export_per_expert_adapter
from hf_moe_offload.hub.adapter_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX
from hf_moe_offload.cli.main import main
from hf_moe_offload.errors import UserError

from moe_families import tiny_model

FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "gpt_oss"]
TARGETS = ["experts.gate_up_proj", "experts.down_proj"]
# Rank and alpha patterns and rsLoRA: every module's scaling differs from lora_alpha / r, by ratios that are not
# powers of two (so the fold rounds).
PATTERNED = dict(r=4, lora_alpha=8, use_rslora=True, rank_pattern={"experts.down_proj": 2, "q_proj": 6},
                 alpha_pattern={"q_proj": 24})


def _adapter(family: str, tmp_path, **lora):
    """(the peft model, its adapter folder): LoRA on q_proj and every expert matrix, lora_B random."""
    base = tiny_model(family).eval()
    base_dir = str(tmp_path / "base")
    base.save_pretrained(base_dir)
    torch.manual_seed(1)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(target_modules=["q_proj"], target_parameters=TARGETS,
                                                           init_lora_weights=False, **(lora or PATTERNED)))
    model.peft_config["default"].base_model_name_or_path = base_dir
    adapter_dir = str(tmp_path / "adapter")
    model.save_pretrained(adapter_dir)
    return model, adapter_dir


def _peft_deltas(model) -> dict[str, torch.Tensor]:
    """peft's delta of every LoRA module in float64, (out, in) (experts: (E, out, in)), by module path."""
    model = copy.deepcopy(model).double()
    out = {}
    for name, module in model.named_modules():
        if not hasattr(module, "get_delta_weight") or not hasattr(module, "lora_A"):
            continue
        with torch.no_grad():
            delta = module.get_delta_weight("default")
        if hasattr(module, "parameter_name") and not module._did_swap_in_out_features:
            delta = delta.transpose(1, 2)  # gpt-oss stores (E, in, out)
        out[name.removeprefix(PEFT_PREFIX)] = delta
    return out


def _served(folder: str, family: str, server: str):
    """[(module, expert or None, rows, served delta, error bound)] by the server's rules from the folder's files."""
    with open(os.path.join(folder, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    s = config["lora_alpha"] / config["r"]  # both servers: the global scaling, patterns and rsLoRA ignored
    t = {k.removeprefix(PEFT_PREFIX): v.double() for k, v in load_file(os.path.join(folder, ADAPTER_WEIGHTS)).items()}
    u = 2.0 ** -24

    def product(a, b):
        return s * b @ a, s * u * b.abs() @ a.abs()

    out = []
    for layer in range(2):
        attn = f"model.layers.{layer}.self_attn.q_proj"
        out.append((attn, None, None, *product(t[f"{attn}.lora_A.weight"], t[f"{attn}.lora_B.weight"])))
        experts = f"model.layers.{layer}.mlp.experts"
        if family == "gpt_oss" and server == "vllm":
            for key, parts in ((f"{experts}.base_layer", ((0, 2), (1, 2))), (experts, ((0, 1),))):
                a, b = t[f"{key}.lora_A.weight"], t[f"{key}.lora_B.weight"]
                E = 6
                r = a.shape[0] // E
                a, b = a.reshape(E, r, -1), b.reshape(b.shape[0], r, E)
                for e in range(E):
                    for start, step in parts:
                        rows = torch.arange(start, b.shape[0], step)
                        out.append((key, e, rows, *product(a[e], b[rows, :, e])))
            continue
        hub = f"model.layers.{layer}.block_sparse_moe.experts" if family == "mixtral" else experts
        names = ("w1", "w3", "w2") if family == "mixtral" and server == "vllm" else ("gate_proj", "up_proj",
                                                                                      "down_proj")
        for e in range(6):
            a_g, b_g = t[f"{hub}.{e}.{names[0]}.lora_A.weight"], t[f"{hub}.{e}.{names[0]}.lora_B.weight"]
            a_u, b_u = t[f"{hub}.{e}.{names[1]}.lora_A.weight"], t[f"{hub}.{e}.{names[1]}.lora_B.weight"]
            n = b_g.shape[0]
            gate, up = (torch.arange(0, 2 * n, 2), torch.arange(1, 2 * n, 2)) if family == "gpt_oss" else (
                torch.arange(n), torch.arange(n, 2 * n))
            out.append((f"{experts}.base_layer", e, gate, *product(a_g, b_g)))
            out.append((f"{experts}.base_layer", e, up, *product(a_u, b_u)))
            a_d, b_d = t[f"{hub}.{e}.{names[2]}.lora_A.weight"], t[f"{hub}.{e}.{names[2]}.lora_B.weight"]
            out.append((experts, e, None, *product(a_d, b_d)))
    return out


@pytest.mark.parametrize("server", ["vllm", "sglang"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_served_delta_is_the_trained_one_and_the_export_passes_the_checker(family, server, tmp_path):
    model, adapter_dir = _adapter(family, tmp_path)
    done = export_adapter(adapter_dir, str(tmp_path / server), server=server)
    assert done.layout == ("fused" if family == "gpt_oss" and server == "vllm" else "per-expert")
    assert done.folded  # every module: rsLoRA, and the patterns
    assert check_adapter(done.out_dir, server) == []
    with open(os.path.join(done.out_dir, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    assert not config["rank_pattern"] and not config["alpha_pattern"] and config["use_rslora"] is False
    assert config["r"] == 6 and config["lora_alpha"] == 8  # padded to the largest rank, alpha kept

    peft = _peft_deltas(model)
    served = _served(done.out_dir, family, server)
    assert len(served) == 2 * (1 + 6 * 3)  # per layer: q_proj, and each expert's gate, up and down
    for module, expert, rows, delta, bound in served:
        want = peft[module] if expert is None else peft[module][expert]
        want = want if rows is None else want[rows]
        err = (delta - want).abs()
        assert bool((err <= bound + 1e-12 * want.abs().max()).all()), (module, expert, float(err.max()))
        assert want.abs().max() > 1e-3  # a real delta
    # The same rules on the adapter as peft saved it (patterns and rsLoRA left to the server) are far off: the
    # comparison above can fail.
    raw = export_adapter(adapter_dir, str(tmp_path / "raw"), server="peft",
                         layout="fused" if family == "gpt_oss" and server == "vllm" else "per-expert")
    with open(os.path.join(raw.out_dir, ADAPTER_CONFIG)) as f:
        raw_config = json.load(f)
    raw_config.update(rank_pattern={}, alpha_pattern={}, use_rslora=False, r=4)  # what the server reads of it
    with open(os.path.join(raw.out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(raw_config, f)
    names_ok = not (family == "mixtral" and server == "sglang")
    if names_ok:
        worst = max(float(((d - (peft[m] if e is None else peft[m][e])[slice(None) if r is None else r]).abs()
                           / (b + 1e-30)).max()) for m, e, r, d, b in _served(raw.out_dir, family, server))
        assert worst > 1e3


@pytest.mark.parametrize("family", FAMILIES)
def test_no_pattern_no_rslora_keeps_every_factor_bit_for_bit(family, tmp_path):
    """Scaling already the server's: lora_B is not touched (no rounding at all)."""
    _, adapter_dir = _adapter(family, tmp_path, r=4, lora_alpha=8)
    done = export_adapter(adapter_dir, str(tmp_path / "out"), server="vllm", layout=None)
    assert done.folded == ()
    original = load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
    exported = load_file(os.path.join(done.out_dir, ADAPTER_WEIGHTS))
    plain = [k for k in original if "q_proj" in k]
    assert plain and all(torch.equal(exported[k], original[k]) for k in plain)
    if family == "gpt_oss":  # vLLM's fused layout: the adapter as peft saved it
        assert exported.keys() == original.keys() and all(torch.equal(exported[k], original[k]) for k in original)


def _good(tmp_path, family="qwen3_moe", server="vllm"):
    _, adapter_dir = _adapter(family, tmp_path, r=4, lora_alpha=8)
    return adapter_dir, export_adapter(adapter_dir, str(tmp_path / "good"), server=server).out_dir


def _edit(folder, config=None, tensors=None):
    """Change the folder's config (a function of the dict) and tensors (a function of the dict)."""
    if config:
        path = os.path.join(folder, ADAPTER_CONFIG)
        with open(path) as f:
            c = json.load(f)
        config(c)
        with open(path, "w") as f:
            json.dump(c, f)
    if tensors:
        path = os.path.join(folder, ADAPTER_WEIGHTS)
        t = load_file(path)
        tensors(t)
        save_file(t, path, metadata={"format": "pt"})


Q = f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj"
UP3 = f"{PEFT_PREFIX}model.layers.1.mlp.experts.3.up_proj"


def _rename(t, old, new):
    for x in "AB":
        t[f"{new}.lora_{x}.weight"] = t.pop(f"{old}.lora_{x}.weight")


def _old_transposed(t, prefix="base_model.model.model.layers.0.mlp.experts.base_layer"):
    """peft <= 0.19.0's layout of a fused tensor: lora_A (E*r, out), lora_B (in, E*r)."""
    a, b = t[f"{prefix}.lora_A.weight"], t[f"{prefix}.lora_B.weight"]
    t[f"{prefix}.lora_A.weight"] = torch.randn(a.shape[0], b.shape[0])
    t[f"{prefix}.lora_B.weight"] = torch.randn(a.shape[1], b.shape[1])


def _with_adapter_name(t, module):
    """Keys as peft holds them in memory (`lora_A.default.weight`), not as it saves them."""
    for x in "AB":
        t[f"{module}.lora_{x}.default.weight"] = t.pop(f"{module}.lora_{x}.weight")


def _drop(t, *keys):
    for k in keys:
        del t[k]


# (rule, family, server, which folder: the export or peft's own, config edit, tensor edit, extra rules also due)
BROKEN = [
    ("config-file", "qwen3_moe", "vllm", "good", None, None, set()),
    ("config-fields", "qwen3_moe", "vllm", "good", lambda c: c.pop("target_modules"), None, set()),
    ("rank", "qwen3_moe", "vllm", "good", lambda c: c.update(r=32), None, {"rank-mismatch"}),
    ("unsupported", "qwen3_moe", "vllm", "good", lambda c: c.update(use_dora=True), None, set()),
    ("unsupported", "qwen3_moe", "sglang", "good", lambda c: c.update(bias="all"), None, set()),
    ("peft-type", "qwen3_moe", "sglang", "good", lambda c: c.update(peft_type="LOHA"), None, set()),
    ("patterns", "qwen3_moe", "vllm", "good", lambda c: c.update(alpha_pattern={"q_proj": 16}), None, set()),
    ("patterns", "mixtral", "sglang", "good", lambda c: c.update(rank_pattern={"q_proj": 2}), None, set()),
    ("rslora", "olmoe", "vllm", "good", lambda c: c.update(use_rslora=True), None, set()),
    ("rslora", "gpt_oss", "sglang", "good", lambda c: c.update(use_rslora=True), None, set()),
    ("target-modules", "qwen3_moe", "sglang", "good", lambda c: c.update(target_modules=["q_proj"]), None, set()),
    ("key-name", "qwen3_moe", "vllm", "good", None, lambda t: _with_adapter_name(t, Q), set()),
    ("key-name", "qwen3_moe", "vllm", "good", None, lambda t: t.update({f"{Q}.lora_B.bias": torch.zeros(32)}), set()),
    ("dtype", "qwen3_moe", "vllm", "good", None,
     lambda t: t.update({f"{Q}.lora_A.weight": t[f"{Q}.lora_A.weight"].to(torch.int32)}), set()),
    ("pairs", "qwen3_moe", "vllm", "good", None, lambda t: _drop(t, f"{Q}.lora_B.weight"), set()),
    ("module", "qwen3_moe", "vllm", "good", None, lambda t: _rename(t, Q, Q.replace("layers.0", "layers.7")), set()),
    ("module", "qwen3_moe", "vllm", "good", None,
     lambda t: _rename(t, Q, Q.replace("model.layers", "model.language_model.layers")), set()),
    ("module", "mixtral", "vllm", "sglang-export", None, None, set()),  # SGLang's names on vLLM
    ("layout", "qwen3_moe", "vllm", "peft", None, None, set()),
    ("layout", "qwen3_moe", "sglang", "peft", None, None, {"target-modules"}),
    ("layout", "gpt_oss", "vllm", "sglang-export", None, None, set()),
    ("completeness", "qwen3_moe", "vllm", "good", None,
     lambda t: _drop(t, f"{UP3}.lora_A.weight", f"{UP3}.lora_B.weight"), set()),
    ("shape", "olmoe", "vllm", "good", None,
     lambda t: t.update({f"{UP3}.lora_B.weight": torch.zeros(47, 4)}), set()),
    ("rank-mismatch", "qwen3_moe", "vllm", "good", None, lambda t: t.update(
        {f"{Q}.lora_A.weight": t[f"{Q}.lora_A.weight"][:2],
         f"{Q}.lora_B.weight": t[f"{Q}.lora_B.weight"][:, :2].contiguous()}), set()),
    ("transposed", "gpt_oss", "vllm", "good", None, _old_transposed, set()),
    ("transposed", "qwen3_moe", "vllm", "peft", None, _old_transposed, {"layout"}),
]


@pytest.mark.parametrize("rule,family,server,source,config,tensors,also", BROKEN,
                         ids=[f"{b[0]}-{b[1]}-{b[2]}" for b in BROKEN])
def test_the_checker_catches_each_rule(rule, family, server, source, config, tensors, also, tmp_path):
    adapter_dir, good = _good(tmp_path, family, server)
    if source == "peft":
        folder = adapter_dir
    elif source == "sglang-export":
        folder = export_adapter(adapter_dir, str(tmp_path / "sg"), server="sglang").out_dir
    else:
        folder = good
    assert check_adapter(good, server) == []  # the export is clean
    if rule == "config-file":
        with open(os.path.join(folder, ADAPTER_CONFIG), "w") as f:
            f.write("{not json")
    _edit(folder, config, tensors)
    problems = check_adapter(folder, server)
    found = {p.rule for p in problems}
    assert found == {rule} | also, [str(p) for p in problems]
    assert all(p.error and p.fix for p in problems)


def test_key_name_problems_say_what_the_key_is(tmp_path):
    _, good = _good(tmp_path)
    _edit(good, tensors=lambda t: (_with_adapter_name(t, Q), t.update({f"{UP3}.lora_B.bias": torch.zeros(24)})))
    said = [("lora_bias" in p.message, "adapter name" in p.message) for p in check_adapter(good, "vllm")]
    assert sorted(said) == [(False, True), (False, True), (True, False)]  # q_proj's two keys, the bias


def test_without_a_base_model_names_and_shapes_are_unchecked_and_said(tmp_path):
    _, good = _good(tmp_path)
    _edit(good, config=lambda c: c.update(base_model_name_or_path=None))
    (problem,) = check_adapter(good, "vllm")
    assert problem.rule == "base-model" and not problem.error and "not checked" in problem.message
    assert check_adapter(good, "vllm", base_model=str(tmp_path / "base")) == []


def test_the_command_lines(tmp_path, capsys):
    _, adapter_dir = _adapter("gpt_oss", tmp_path)
    out = str(tmp_path / "vllm")
    assert main(["export-adapter", adapter_dir, out]) == 0  # --server vllm by default
    said = capsys.readouterr().out
    assert "fused layout for vllm" in said and "folded the scaling" in said
    assert main(["check-adapter", out, "--server", "vllm"]) == 0
    assert "no problem found for vllm" in capsys.readouterr().out
    # The per-expert export of the same adapter, back to vLLM's fused layout: the same tensors bit for bit.
    sg = str(tmp_path / "sglang")
    assert main(["export-adapter", adapter_dir, sg, "--server", "sglang"]) == 0
    assert main(["export-adapter", sg, str(tmp_path / "again"), "--server", "vllm"]) == 0
    a, b = (load_file(os.path.join(d, ADAPTER_WEIGHTS)) for d in (out, str(tmp_path / "again")))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    capsys.readouterr()
    # A layout the server does not load: refused with the reason and the ways out.
    assert main(["export-adapter", adapter_dir, str(tmp_path / "x"), "--layout", "per-expert"]) == 2
    err = capsys.readouterr().err
    assert "vllm does not load the per-expert expert layout for gpt_oss" in err and "--layout fused" in err
    assert "sglang loads per-expert here" in err and not os.path.exists(tmp_path / "x")
    # The checker: each problem with its fix on stdout, exit code 2.
    assert main(["check-adapter", sg, "--server", "vllm"]) == 2
    captured = capsys.readouterr()
    assert "error [layout]" in captured.out and "fix: hf-moe-offload export-adapter" in captured.out
    assert "1 problem(s)" in captured.err
    assert main(["check-adapter", adapter_dir, "--server", "sglang", "--max-lora-rank", "8"]) == 2
    captured = capsys.readouterr().out
    assert "[patterns]" in captured and "[rslora]" in captured and "[layout]" in captured


def test_the_export_names_peft_0_19_0s_transposed_layout(tmp_path):
    _, adapter_dir = _adapter("qwen3_moe", tmp_path, r=4, lora_alpha=8)
    _edit(adapter_dir, tensors=_old_transposed)
    with pytest.raises(UserError, match=r"peft <= 0.19.0.*peft >= 0.19.1"):
        export_per_expert_adapter(adapter_dir, str(tmp_path / "out"))


@pytest.mark.parametrize("dtype,u", [(torch.float32, 2.0 ** -24), (torch.bfloat16, 2.0 ** -8),
                                     (torch.float16, 2.0 ** -11)])
def test_the_fold_rounds_lora_b_once_in_its_dtype(dtype, u, tmp_path):
    """q_proj (rank 6 = the largest, so not padded) under rsLoRA and alpha 24: peft's scaling 24 / sqrt(6), the
    server's 8 / 6. The exported lora_B is the exact product rounded once to the factor's dtype (round to nearest:
    relative error at most u, 2^-(mantissa bits + 1)); lora_A is unchanged."""
    _, adapter_dir = _adapter("gpt_oss", tmp_path)  # vLLM: peft's fused layout, the keys unchanged
    _edit(adapter_dir, tensors=lambda t: t.update({k: v.to(dtype) for k, v in t.items()}))
    done = export_adapter(adapter_dir, str(tmp_path / "out"), server="vllm")
    before = load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
    after = load_file(os.path.join(done.out_dir, ADAPTER_WEIGHTS))
    ratio = (24 / 6 ** 0.5) / (8 / 6)
    b, folded = before[f"{Q}.lora_B.weight"], after[f"{Q}.lora_B.weight"]
    exact = b.double() * ratio
    assert folded.dtype == dtype and torch.equal(folded, exact.to(dtype))
    assert bool(((folded.double() - exact).abs() <= u * exact.abs()).all())
    assert not torch.equal(folded.double(), exact)  # the ratio is no power of two: it rounds
    assert torch.equal(after[f"{Q}.lora_A.weight"], before[f"{Q}.lora_A.weight"])


def test_sglangs_mixtral_names_export_back_to_vllms(tmp_path):
    """An SGLang export (Mixtral: gate_proj / up_proj / down_proj) read again and written for vLLM (w1 / w3 / w2) is
    the direct vLLM export, bit for bit."""
    _, adapter_dir = _adapter("mixtral", tmp_path)
    sglang = export_adapter(adapter_dir, str(tmp_path / "sglang"), server="sglang").out_dir
    direct = load_file(os.path.join(export_adapter(adapter_dir, str(tmp_path / "vllm")).out_dir, ADAPTER_WEIGHTS))
    again = load_file(os.path.join(export_adapter(sglang, str(tmp_path / "again")).out_dir, ADAPTER_WEIGHTS))
    assert any(".w1." in k for k in direct) and not any(".w1." in k for k in load_file(
        os.path.join(sglang, ADAPTER_WEIGHTS)))
    assert again.keys() == direct.keys() and all(torch.equal(again[k], direct[k]) for k in direct)
