"""What transformers, peft, TRL and users do to models, done to an offloaded one: copies, implementation switches,
dtype and device moves, meta-device models, state dicts and save/load round trips.

Tolerances: a copy, or a model after a round trip, computes with the same weights through the same kernels as the
original, so outputs are compared exactly (atol=rtol=0). Against a resident model: fp32 1e-5 (grouped vs per-expert
GEMMs sum in another order), bf16/fp16 0 where both sides compute the same rounded weights the same way, else stated.
"""

from __future__ import annotations

import copy
import gc
import os

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import hf_moe_offload  # noqa: F401  (registers experts implementation "hf_moe_offload")
from hf_moe_offload import (ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, disable_expert_offload,
                            enable_expert_offload, get_offload_engine, reference_copy)
from hf_moe_offload.families.moe_path import attached_path
from hf_moe_offload.offload.plan import resolve_plan
from hf_moe_offload.runtime import use_runtime
from hf_moe_offload.runtime.simulated import SimulatedRuntime

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
VOCAB = 99


def tiny(dtype=torch.float32, seed: int = 0, layers: int = 2) -> Qwen3MoeForCausalLM:
    """The issue's shape: moe_intermediate_size 12 (24 bytes in bf16: not a multiple of 16, which transformers'
    grouped_mm on the CPU refuses: resident models here run the package's resident grouped path, the same kernels
    as the offloaded host tier)."""
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=37, moe_intermediate_size=12, num_experts=8,
                         num_experts_per_tok=2, use_cache=False)
    model = Qwen3MoeForCausalLM(cfg).to(dtype)
    model.set_attn_implementation("sdpa")
    model.set_experts_implementation("hf_moe_offload")
    return model


def offload(model, tier: str, tmp_path, **kw):
    return enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=str(tmp_path / "experts"),
                                                      host_cache_experts=5, **kw))


def logits(model, x) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


def tokens(seed: int = 1, shape=(3, 7)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


# --- copies ---
@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("first", ["copy", "original"])
def test_a_deep_copy_works_on_its_own(tier, dtype, first, tmp_path):
    model = tiny(dtype)
    offload(model, tier, tmp_path)
    model.eval()
    x = tokens()
    before = logits(model, x) if first == "original" else None
    clone = copy.deepcopy(model)
    got = logits(clone, x)  # binds the copy's own engine, whichever ran first
    want = logits(model, x)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    if before is not None:
        torch.testing.assert_close(before, want, atol=0, rtol=0)
    a, b = get_offload_engine(model), get_offload_engine(clone)
    assert b is not a and b.store is not a.store and b.ledger is not a.ledger
    assert all(layer.engine is b for layer in b.layers)
    if tier == "disk":
        assert os.path.dirname(b.store.dir) == os.path.dirname(a.store.dir) and b.store.dir != a.store.dir


def test_a_disk_copy_removes_its_files_when_collected(tmp_path):
    model = tiny()
    offload(model, "disk", tmp_path)
    clone = copy.deepcopy(model)
    directory = get_offload_engine(clone).store.dir
    assert os.listdir(directory)
    disable_expert_offload(clone)
    del clone
    gc.collect()
    assert not os.path.exists(directory)
    assert os.listdir(tmp_path / "experts")  # the original's files stay


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("make_reference", ["trl", "reference_copy"])
def test_a_copy_is_a_frozen_reference_while_the_original_trains(tier, make_reference, tmp_path):
    """TRL's `create_reference_model` (TRL is not a dependency: reproduced here as it does it: a deep copy, every
    parameter requires_grad=False, eval) and `reference_copy`: three expert-optimizer steps of the original change its
    outputs and not the reference's, and the reference holds its weights as they were."""
    model = tiny()
    engine = offload(model, tier, tmp_path)
    if make_reference == "trl":
        ref = copy.deepcopy(model)
        for p in ref.parameters():
            p.requires_grad_(False)
        ref = ref.eval()
    else:
        ref = reference_copy(model)
        ref_store = get_offload_engine(ref).store
        assert ref_store.state_rows == 1 and not get_offload_engine(ref).train_experts
        assert ref_store.record_bytes() * 4 == engine.store.record_bytes()  # fp32 weights only vs 4 fp32 rows
    x = tokens()
    ref_before, model_before = logits(ref, x), logits(model.eval(), x)
    torch.testing.assert_close(ref_before, model_before, atol=0, rtol=0)
    opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), ExpertOptimizer(engine, lr=1e-2))
    model.train()
    for step in range(3):
        batch = tokens(10 + step)
        model(batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
        assert not ref.training
        logits(ref, x)  # the reference runs between the policy's steps, as TRL's loss does
    engine.synchronize()
    assert (logits(model.eval(), x) - model_before).abs().max() > 1e-3  # the original did train
    torch.testing.assert_close(logits(ref, x), ref_before, atol=0, rtol=0)
    assert all(not p.requires_grad for p in ref.parameters())


def test_a_bf16_reference_copy_keeps_bf16_weights_only(tmp_path):
    model = tiny(torch.bfloat16)
    engine = offload(model, "host", tmp_path)
    ref = reference_copy(model)
    store = get_offload_engine(ref).store
    assert store.row_dtype == torch.bfloat16 and store.state_rows == 1
    assert store.record_bytes() * 8 == engine.store.record_bytes()  # 2 bytes per parameter instead of 16
    x = tokens()
    torch.testing.assert_close(logits(ref, x), logits(model.eval(), x), atol=0, rtol=0)


def test_a_copy_binds_on_the_simulated_device(tmp_path):
    """The copy's engine binds its own runtime (an asynchronous device: slab-less streaming, stager ring, host
    worker) and trains there while the original, bound first on the same device, stays as it was."""
    with use_runtime(SimulatedRuntime(seed=5, max_delay=0.0005)):
        model = tiny()
        engine = offload(model, "host", tmp_path)
        x = tokens()
        before = logits(model.eval(), x)
        clone = copy.deepcopy(model).train()
        torch.testing.assert_close(logits(clone.eval(), x), before, atol=0, rtol=0)
        copied = get_offload_engine(clone)
        assert copied.runtime.asynchronous and copied.stager is not engine.stager
        opt = ExpertAwareOptimizer(torch.optim.AdamW(clone.parameters(), lr=1e-2), ExpertOptimizer(copied, lr=1e-2))
        clone.train()
        clone(x, labels=x).loss.backward()
        opt.step()
        copied.synchronize()
        torch.testing.assert_close(logits(model.eval(), x), before, atol=0, rtol=0)
        assert (logits(clone.eval(), x) - before).abs().max() > 1e-3


def test_bind_takes_its_settings_at_once_or_not_at_all(tmp_path, monkeypatch):
    model = tiny(torch.bfloat16).eval()
    engine = offload(model, "host", tmp_path)
    import hf_moe_offload.offload.engine as engine_module

    def failing(*args, **kwargs):
        raise RuntimeError("injected: the plan could not be resolved")

    monkeypatch.setattr(engine_module, "resolve_plan", failing)
    with pytest.raises(RuntimeError, match="injected"):
        logits(model, tokens())
    assert engine.device is None and engine.plan is None and engine.stager is None
    monkeypatch.setattr(engine_module, "resolve_plan", resolve_plan)
    want = logits(model, tokens())  # binds afresh
    assert engine.device == torch.device("cpu") and engine.stager is not None
    torch.testing.assert_close(logits(copy.deepcopy(model), tokens()), want, atol=0, rtol=0)


# --- experts implementations ---
@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("other", ["eager", "grouped_mm"])
def test_switching_the_implementation_of_offloaded_experts_is_refused_with_the_way_out(tier, other, tmp_path):
    model = tiny().eval()
    offload(model, tier, tmp_path)
    x = tokens()
    want = logits(model, x)
    model.set_experts_implementation(other)
    with pytest.raises(RuntimeError, match="disable_expert_offload"):
        logits(model, x)
    model.set_experts_implementation("hf_moe_offload")
    torch.testing.assert_close(logits(model, x), want, atol=0, rtol=0)
    disable_expert_offload(model)
    model.set_experts_implementation("eager")
    torch.testing.assert_close(logits(model, x), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_moe_offload_is_an_implementation_like_any_other(dtype, tmp_path):
    """`from_pretrained(..., experts_implementation="hf_moe_offload")` and `set_experts_implementation` run the
    resident experts through the package's grouped path (sizes grouped_mm refuses on the CPU included); offloading
    such a model and disabling it again gives that implementation back. fp32: 1e-5 against eager (summation
    order); bf16/fp16: one rounding of each GEMM apart, 2e-2 (logits of magnitude ~1)."""
    model = tiny(dtype).eval()
    model.save_pretrained(tmp_path / "m")
    x = tokens()
    model.set_experts_implementation("eager")
    want = logits(model, x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    loaded = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "m", dtype=dtype, experts_implementation="hf_moe_offload")
    assert loaded.config._experts_implementation == "hf_moe_offload"
    torch.testing.assert_close(logits(loaded.eval(), x), want, atol=tol, rtol=0)
    model.set_experts_implementation("hf_moe_offload")
    torch.testing.assert_close(logits(model, x), want, atol=tol, rtol=0)
    offload(model, "host", tmp_path)
    torch.testing.assert_close(logits(model, x), want, atol=tol, rtol=0)
    disable_expert_offload(model)
    assert model.config._experts_implementation == "hf_moe_offload"
    torch.testing.assert_close(logits(model, x), want, atol=tol, rtol=0)


# --- the rest of the model API ---
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_model_on_the_meta_device_is_refused_with_the_way_out(tier, tmp_path):
    with torch.device("meta"):
        model = tiny()
    with pytest.raises(ValueError, match="meta device.*load_offloaded_pretrained"):
        offload(model, tier, tmp_path)
    assert get_offload_engine(model) is None and attached_path(model) is None  # nothing installed
    assert not os.path.exists(tmp_path / "experts")  # nothing created


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("move", ["to_bf16", "half", "float"])
def test_dtype_moves_follow_the_model(tier, move, tmp_path):
    """`.to(dtype)`, `.half()`, `.float()`: the offloaded experts compute and show in the model's new dtype, as
    resident ones would (their store keeps its rows; each call casts the streamed copy). Exact against the resident
    model moved the same way: both round the same fp32 weights once."""
    start = torch.float16 if move == "float" else torch.float32
    resident = tiny(start).eval()
    model = copy.deepcopy(resident)
    offload(model, tier, tmp_path)
    x = tokens()
    logits(model, x)  # bound before the move: the move must not need a fresh engine
    for m in (resident, model):
        {"to_bf16": lambda: m.to(torch.bfloat16), "half": m.half, "float": m.float}[move]()
    want = logits(resident, x)
    got = logits(model, x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=1e-5 if want.dtype == torch.float32 else 0, rtol=0)
    state = model.state_dict()
    ref_state = resident.state_dict()
    for name, value in ref_state.items():
        assert state[name].dtype == value.dtype, name
        torch.testing.assert_close(state[name], value, atol=0, rtol=0)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_device_round_trip_train_eval_and_requires_grad(tier, tmp_path):
    model = tiny()
    engine = offload(model, tier, tmp_path)
    x = tokens()
    want = logits(model.eval(), x)
    model.to("cpu").to(torch.device("cpu"))
    torch.testing.assert_close(logits(model, x), want, atol=0, rtol=0)
    model.train()
    assert all(layer.training for layer in engine.layers)
    model.eval()
    assert not any(layer.training for layer in engine.layers)
    model.requires_grad_(False)
    assert not any(p.requires_grad for p in model.parameters())
    torch.testing.assert_close(logits(model, x), want, atol=0, rtol=0)


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_state_dict_round_trips(tier, dtype, tmp_path):
    """`torch.save(model.state_dict())` into a resident model, and back into a second offloaded model; the store is
    the loaded one afterwards (nothing left of the old weights)."""
    model = tiny(dtype, seed=0)
    offload(model, tier, tmp_path / "a")
    x = tokens()
    want = logits(model.eval(), x)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    state = torch.load(tmp_path / "sd.pt")
    resident = tiny(dtype, seed=3).eval()
    resident.load_state_dict(state)
    torch.testing.assert_close(logits(resident, x), want, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)
    other = tiny(dtype, seed=4).eval()
    offload(other, tier, tmp_path / "b")
    result = other.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    torch.testing.assert_close(logits(other, x), want, atol=0, rtol=0)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_save_pretrained_round_trip(tier, tmp_path):
    """transformers' own `save_pretrained` of an offloaded bf16 model loads anywhere with every tensor as it was, and
    offloaded again computes what the original did (exactly: same weights, same tier, same kernels)."""
    tiny().save_pretrained(tmp_path / "src")  # loaded in bf16 as a user would (rotary buffers stay fp32)
    model = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16,
                                                experts_implementation="hf_moe_offload").eval()
    offload(model, tier, tmp_path / "a")
    x = tokens()
    want = logits(model, x)
    model.save_pretrained(tmp_path / "saved")
    back = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16,
                                               experts_implementation="hf_moe_offload").eval()
    state = model.state_dict()
    for name, value in back.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=0, rtol=0)
    offload(back, tier, tmp_path / "b")
    torch.testing.assert_close(logits(back, x), want, atol=0, rtol=0)


# --- torch.compile ---
# One inductor rounding apart from eager (fusions reorder the attention's and norms' sums): fp32 1e-5; bf16 and
# fp16 two ulps at the logits' magnitude (~1).
COMPILE_ATOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_compiled_offloaded_model_gives_the_eager_outputs_and_compiles_once(tier, dtype, tmp_path):
    """The experts run eagerly (a graph break around each MoE layer's experts, moe_path.experts_forward); the graphs
    between compile once for a shape: calls with other tokens (other routing, other disk-tier cache and decode-cache
    bookkeeping) add none."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny(dtype, layers=1).eval()  # one layer: compile time is per graph
    offload(model, tier, tmp_path)
    compiled = torch.compile(model)
    for seed in range(3):
        x = tokens(seed)
        want = logits(model, x)
        torch.testing.assert_close(logits(compiled, x), want, atol=COMPILE_ATOL[dtype], rtol=0)
        if seed == 0:
            graphs = counters["stats"]["unique_graphs"]
            assert graphs > 0
    assert counters["stats"]["unique_graphs"] == graphs and not counters["recompiles"]


# --- peft and the Trainer ---
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_peft_lora_on_attention_merges_and_unloads_on_an_offloaded_model(tier, tmp_path):
    """`get_peft_model` and `merge_and_unload` on an offloaded model: LoRA on attention merges into the resident
    layers, the experts stay offloaded, and the merged model computes what the adapted one did (fp32: 1e-5, the
    merged weight rounds W + BA once)."""
    from peft import LoraConfig, get_peft_model

    model = tiny()
    offload(model, tier, tmp_path)
    x = tokens()
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False)).eval()
    want = logits(peft_model, x)
    merged = peft_model.merge_and_unload()
    assert get_offload_engine(merged) is not None
    torch.testing.assert_close(logits(merged, x), want, atol=1e-5, rtol=0)


def test_merging_lora_into_offloaded_expert_tensors_is_refused_with_the_way_out(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = tiny()
    offload(model, "host", tmp_path, train_experts=False)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=[],
                                                  target_parameters=["mlp.experts.gate_up_proj"]))
    logits(peft_model, tokens())
    with pytest.raises(RuntimeError, match="disable_expert_offload"):
        peft_model.merge_and_unload()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_the_stock_trainer_trains_and_saves_an_offloaded_model(tier, tmp_path):
    """transformers' own `Trainer` (its accelerate wrapping, its `save_model`) with the expert optimizer's callback:
    the saved folder loads without hf_moe_offload and computes the trained model's logits (1e-5: streamed against
    transformers' eager experts)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from hf_moe_offload import ExpertOptimizerCallback

    model = tiny()
    offload(model, tier, tmp_path)
    ids = torch.randint(0, VOCAB, (8, 9), generator=torch.Generator().manual_seed(3)).tolist()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    x = tokens()
    before = logits(model.eval(), x)
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}),
                      callbacks=[ExpertOptimizerCallback()])
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    get_offload_engine(model).synchronize()
    after = logits(model.eval(), x)
    assert (after - before).abs().max() > 1e-3
    plain = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "final", experts_implementation="eager").eval()
    torch.testing.assert_close(logits(plain, x), after, atol=1e-5, rtol=0)
