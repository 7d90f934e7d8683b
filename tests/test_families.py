"""Every MoE family of the installed transformers through the whole offload stack (table-driven, tests/moe_families.py).

For each family: its tiny causal LM (generic shrink of the default config), a copy offloaded to the host or disk tier
(disk: a host cache of 2 experts, so experts are evicted and re-read every step), and 3 AdamW steps on fresh random
tokens, compared with the stock model on transformers' "eager" experts:

- logits before any update within 1e-5 (fp32; only the summation order of the combine differs), after 1 and 2
  updates within 1e-4 (see below);
- the gradient of every parameter, expert gradients read back from the store, within 1e-5 at the first step;
- after the 3 steps (torch AdamW for the stock model, ExpertAwareOptimizer = AdamW + the expert-wise optimizer for
  ours, lr 1e-3, eps 1e-6), every weight within 1e-4 = lr / 10. Adam normalises each gradient element, so a ~1e-9
  rounding difference on a gradient element that is zero in exact arithmetic becomes a step of up to ~lr in either
  direction with the default eps 1e-8 (measured: 1.2e-4 on deepseek_v4's hyper-connection weights at lr 1e-3); eps
  1e-6 damps such noise-only elements to ~lr/100 and leaves real gradients' steps as they are, while a wrong, missed
  or doubled expert step still moves whole experts by ~lr.

Families the generic shrink cannot build are skipped with the reason (composite vision/audio configs, families
without a causal-LM head, configs whose validators need family-specific sizes); `test_family_table` prints the table.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hf_moe_offload  # noqa: F401
from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, enable_expert_offload
from hf_moe_offload.families.moe_path import IMPLEMENTATION, get_moe_path

from moe_families import VOCAB, Unshrinkable, experts_families, tiny_config, tiny_model

FAMILIES = experts_families()
TOL = dict(atol=1e-5, rtol=0)
WEIGHT_TOL = dict(atol=1e-4, rtol=0)
LR = 1e-3
EPS = 1e-6  # Adam's epsilon, both sides (see the module docstring)


def test_family_table():
    """How many families of the installed transformers ran, and why the others were skipped."""
    rows = []
    for f in FAMILIES:
        try:
            tiny_config(f)
            rows.append((f, "runs"))
        except Unshrinkable as err:
            rows.append((f, f"skipped: {err}"))
    ran = [f for f, r in rows if r == "runs"]
    print(f"\n{len(ran)} of {len(FAMILIES)} transformers MoE families run through the offload stack:")
    for f, r in rows:
        print(f"  {f:24s} {r}")
    assert len(FAMILIES) >= 60  # the decorated families of the installed transformers (63 in 5.23)
    for must in ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3", "glm4_moe", "granitemoe", "nemotron_h"):
        assert must in ran, must


def expert_grads_of(reference, path) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """(store key, packed gradient) of every expert of the stock model that got a gradient."""
    out = []
    modules = dict(reference.named_modules())
    for layer in path.layers:
        lay, module = layer.layout, modules[layer.name]
        grads = [getattr(module, t.name).grad for t in lay.tensors]
        if any(g is None for g in grads):
            continue
        for e in range(lay.num_experts):
            out.append(((layer.index, e), lay.pack([g[e] for g in grads], torch.empty(lay.numel))))
    return out


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_offloaded_equals_stock(family, tier, tmp_path):
    offloaded_equals_stock(family, tier, tmp_path)


def offloaded_equals_stock(family: str, tier: str, tmp_path, device: str = "cpu") -> None:
    """The module docstring's comparison, both models on `device` (tests/test_cuda.py runs it on a GPU)."""
    try:
        reference = tiny_model(family)
    except Unshrinkable as err:
        pytest.skip(f"{family}: {err}")
    model = copy.deepcopy(reference)
    config = OffloadConfig(mode=tier, offload_dir=str(tmp_path / "experts"), host_cache_experts=2, pin_fraction=0.0)
    engine = enable_expert_offload(model, config)
    reference.to(device)
    model.to(device)  # the non-expert weights; the experts stay in the store
    assert model.config._experts_implementation == IMPLEMENTATION
    path = get_moe_path(model)
    assert not any(p.dim() == 3 and p.shape[0] == layer.num_experts for layer in path.layers
                   for p in layer.module.parameters(recurse=False)), "expert tensors left on the module"
    gen = torch.Generator().manual_seed(len(family))
    # Gradients of one backward, before any optimizer exists (an attached ExpertOptimizer steps experts as their
    # gradients land).
    ids = torch.randint(0, VOCAB, (2, 12), generator=gen).to(device)
    reference(ids, labels=ids).loss.backward()
    model(ids, labels=ids).loss.backward()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        ref_grad = ref_params[name].grad
        assert (p.grad is None) == (ref_grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, ref_grad, **TOL, msg=f"{family} grad {name}")
    want = expert_grads_of(reference, path)
    assert want, f"{family}: no expert received a gradient"
    for key, grad in want:
        torch.testing.assert_close(engine.expert_grad(key), grad, **TOL, msg=f"{family} expert {key}")
    reference.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    engine.zero_grad()

    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0),
                               ExpertOptimizer(engine, lr=LR, eps=EPS, weight_decay=0.0))
    for step in range(3):
        ids = torch.randint(0, VOCAB, (2, 12), generator=gen).to(device)
        ref_out, out = reference(ids, labels=ids), model(ids, labels=ids)
        torch.testing.assert_close(out.logits, ref_out.logits, **(TOL if step == 0 else WEIGHT_TOL),
                                   msg=lambda m: f"{family} logits after {step} steps: {m}")
        ref_out.loss.backward()
        out.loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    engine.synchronize()
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for name, t in want.items():
        torch.testing.assert_close(got[name].cpu(), t.cpu(), **WEIGHT_TOL, msg=lambda m: f"{family} weight {name} after 3 AdamW steps: {m}")


def test_unservable_experts_fail_with_the_family_and_the_missing_piece():
    """An experts module on transformers' interface whose tensors no layout describes: a clear error, not a silent
    fallback."""
    from hf_moe_offload.families.moe_path import find_experts_modules

    model = tiny_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    experts.register_parameter("weird_proj", torch.nn.Parameter(experts.gate_up_proj.detach().clone()))
    del experts._parameters["gate_up_proj"]
    with pytest.raises(ValueError, match=r"'qwen3_moe' \(model\.layers\.0\.mlp\.experts\).*has no gate_up_proj"):
        find_experts_modules(model)


@pytest.mark.parametrize("strategy", ["S1", "S2", "S3", "S4"])
@pytest.mark.parametrize("tier", ["device", "host"])
def test_qwen3_moe_micro_batch_pipelining_equals_stock(tier, strategy):
    """MPMoE partitions (3 of them, each restore strategy) on a Qwen3-MoE model, resident or streamed experts: same
    logits and gradients as the stock eager model (1e-5)."""
    from hf_moe_offload.pipelining import disable_micro_batch_pipelining, enable_micro_batch_pipelining

    reference = tiny_model("qwen3_moe")
    model = copy.deepcopy(reference)
    engine = enable_expert_offload(model, OffloadConfig(mode="host")) if tier == "host" else None
    executor = enable_micro_batch_pipelining(model, n=3, strategy=strategy)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(7))
    ref_out, out = reference(ids, labels=ids), model(ids, labels=ids)
    assert executor.last_choice == (3, strategy)
    torch.testing.assert_close(out.logits, ref_out.logits, **TOL)
    ref_out.loss.backward()
    out.loss.backward()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL, msg=name)
    if engine is not None:
        for key, grad in expert_grads_of(reference, get_moe_path(model)):
            torch.testing.assert_close(engine.expert_grad(key), grad, **TOL, msg=str(key))
        engine.zero_grad()
    disable_micro_batch_pipelining(model)
    path = get_moe_path(model)
    assert (path is None) == (tier == "device")  # the path stays while the experts are offloaded
    assert model.config._experts_implementation == ("eager" if tier == "device" else IMPLEMENTATION)


def test_peft_target_parameters_lora_on_resident_experts_through_the_path():
    """peft's `target_parameters` LoRA on Qwen3-MoE's expert tensors (a parametrization: the experts read as W + BA):
    the resident experts on the MoE path read the effective weights, so MPMoE partitions (S1, S2) give the same loss
    and LoRA gradients as the plain model (1e-6). S3/S4 recompute refuses parametrized experts with a clear error."""
    from peft import LoraConfig, get_peft_model

    from hf_moe_offload.pipelining import disable_micro_batch_pipelining, enable_micro_batch_pipelining

    model = get_peft_model(tiny_model("qwen3_moe"), LoraConfig(
        r=4, target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    with torch.no_grad():  # a non-zero adapter, so that the delta matters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(1))
    lora = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert lora and all("lora" in n for n, _ in lora)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in lora}
    model.zero_grad()
    for strategy in ("S1", "S2"):
        enable_micro_batch_pipelining(model.base_model.model, n=2, strategy=strategy)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.testing.assert_close(loss, ref, atol=1e-6, rtol=0)
        for n, p in lora:
            torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-6, rtol=0, msg=f"{strategy} {n}")
        model.zero_grad()
        disable_micro_batch_pipelining(model.base_model.model)
    enable_micro_batch_pipelining(model.base_model.model, n=2, strategy="S4")
    with pytest.raises(RuntimeError, match="use strategy S1/S2"):
        model(input_ids=ids, labels=ids).loss.backward()
