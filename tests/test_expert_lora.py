"""peft's LoRA on the experts' tensors while the experts stream (issue 38, item 1).

The same peft config and seed on a resident model and on one whose frozen experts are offloaded (host and disk tier):
logits, adapter gradients and the adapters after 3 torch AdamW steps agree, in fp32 and under bf16 autocast, for
MoE-GPT, Qwen3-MoE, Mixtral and gpt-oss (transposed and biased experts, a clamped gate), on the grouped path and
expert by expert; the stored experts never change. The streamed layer adds `s * linear(linear(x, first), second)` to
each adapted matmul where peft's resident path computes with `W + s * lhs @ rhs`: the same function, other rounding.

Tolerances. fp32: logits 1e-5 and gradients 1e-5 relative to their largest element (summation order); the adapters
after 3 steps within `assert_within_adam_drift` (Adam turns rounding noise in a near-zero gradient into up to lr per
step). bf16 autocast: the resident path rounds `W + s * lhs @ rhs` to bf16 before its GEMM, the streamed one rounds W
and the low-rank term apart, so they differ by bf16's rounding of the activations (2^-8 relative): logits within 5e-2
of each other at |logits| ~ 1, gradients within 5e-2 relative, adapters within the Adam bound but for 10% of their
elements; one MoE layer there (a second layer's router could pick other experts for a token on rounding alone).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hf_moe_offload import MoEGPTConfig, MoEGPTForCausalLM, OffloadConfig, disable_expert_offload, enable_expert_offload
from hf_moe_offload.offload.lora.stand_ins import is_stand_in
from hf_moe_offload.offload.streaming.streamed import OffloadedExpertsLayer
from hf_moe_offload.runtime import use_runtime
from hf_moe_offload.runtime.simulated import SimulatedRuntime

from lora_cases import LR, adapter_grads, assert_close_relative, assert_streamed_lora_equals_resident, lora_model
from moe_families import tiny_model
from numerics import assert_within_adam_drift

FAMILIES = ["moe_gpt", "qwen3_moe", "mixtral", "gpt_oss"]


def _model(family: str, seed: int = 0, layers: int = 2):
    if family == "moe_gpt":
        torch.manual_seed(seed)
        return MoEGPTForCausalLM(MoEGPTConfig(vocab_size=96, hidden_size=32, num_hidden_layers=layers,
                                              num_attention_heads=4, intermediate_size=48, num_experts=4,
                                              moe_layer_frequency=1, hidden_dropout=0.0, attention_dropout=0.0,
                                              max_position_embeddings=64))
    return tiny_model(family, seed=seed, num_hidden_layers=layers)


def _targets(family: str) -> list[str]:
    return ["experts.fc1_weight", "experts.fc2_weight"] if family == "moe_gpt" else [
        "experts.gate_up_proj", "experts.down_proj"]


def _lora(family: str, model, seed: int = 1):
    return lora_model(model, _targets(family), seed=seed)


def _pair(family: str, tier: str, tmp_path, layers: int = 2, staged: bool = True, **config):
    """(resident LoRA model, offloaded LoRA model, its engine): the same base weights and adapters. `staged`: the
    disk tier in chunks of 2 experts (on the CPU; a device has its slab)."""
    base = _model(family, layers=layers)
    for p in base.parameters():
        p.requires_grad_(False)
    offloaded = copy.deepcopy(base)
    stage = {"stage_experts": 2} if tier == "disk" and staged else {}
    engine = enable_expert_offload(offloaded, OffloadConfig(mode=tier, offload_dir=str(tmp_path / "experts"),
                                                            train_experts=False, host_cache_experts=6, prefetch_depth=1,
                                                            **stage, **config))
    return _lora(family, base), _lora(family, offloaded), engine


def _train(model, steps: int, seed: int) -> torch.Generator:
    """`steps` AdamW steps on fresh random batches -> the generator, for the inputs that follow."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 96, (2, 11), generator=g)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return g


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_streamed_experts_equals_lora_on_resident_experts(family, tier, autocast, tmp_path):
    # Under autocast one MoE layer: a second layer's router sees the first's outputs, whose bf16 rounding differs
    # between the two paths, and a near tie there picks other experts for a token (gpt-oss: 4% of the logits).
    resident, streamed, engine = _pair(family, tier, tmp_path, layers=1 if autocast else 2)
    assert_streamed_lora_equals_resident(resident, streamed, engine, autocast, steps=3)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_lora_on_the_simulated_device_equals_lora_on_resident_experts(tier, autocast, tmp_path):
    """The device path (CUDA's ordering, simulated: asynchronous copies with random delays): training through the
    slab and evaluation through the device expert cache, Qwen3-MoE, equal peft's resident LoRA as on the CPU (same
    tolerances), after 3 AdamW steps."""
    with use_runtime(SimulatedRuntime(seed=5, max_delay=0.001)):
        resident, streamed, engine = _pair("qwen3_moe", tier, tmp_path, layers=1 if autocast else 2, staged=False,
                                           device_cache_bytes=1 << 20)
        opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR) for m in (resident, streamed)]
        g = torch.Generator().manual_seed(8)
        for _ in range(3):
            x = torch.randint(0, 96, (2, 11), generator=g)
            for model, opt in zip((resident, streamed), opts):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    model(x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
        assert engine.slab is not None
        x = torch.randint(0, 96, (2, 9), generator=g)
        logits = []
        for model in (resident, streamed):
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits.append(model(x).logits.float())
        engine.synchronize()
        assert engine.stats.device_cache_misses > 0  # evaluation read its experts through the device cache
    torch.testing.assert_close(logits[1], logits[0], atol=5e-2 if autocast else 1e-5, rtol=0)
    assert_within_adam_drift(streamed, resident, LR, 3, weight_decay=0.01, outliers=0.1 if autocast else 0.01)


@pytest.mark.parametrize("family", ["gpt_oss", "moe_gpt"])
def test_lora_expert_by_expert_equals_the_grouped_pass(family, tmp_path, monkeypatch):
    """One expert per chunk (a device's decode path, dropout in the experts, no grouped GEMM) gives the grouped
    pass's logits and adapter gradients (fp32, 1e-5)."""
    grouped, _, _ = _pair(family, "host", tmp_path / "a")
    _, per_expert, _ = _pair(family, "host", tmp_path / "b")
    x = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(3))
    a = grouped(x, labels=x)
    a.loss.backward()
    monkeypatch.setattr(OffloadedExpertsLayer, "grouped_counts", lambda self, *args: None)
    b = per_expert(x, labels=x)
    b.loss.backward()
    torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=0)
    assert_close_relative(adapter_grads(grouped), adapter_grads(per_expert), 1e-5)


class _NewTensorShapes(TorchDispatchMode):
    """The shapes of the tensors the ops run under it make (not views, not in-place results)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if not schema.name.endswith("_") and not any(r.alias_info is not None for r in schema.returns):
            self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.parametrize("staged", [False, True], ids=["expert-by-expert", "chunks-of-2"])
def test_the_backward_makes_each_factor_gradient_once_per_layer(staged, tmp_path):
    """Streaming expert by expert (or in chunks), the adapters' gradients are added per chunk into one gradient per
    factor and layer: the backward makes no tensor of a whole factor's shape per chunk (differentiating by the whole
    factors had autograd's select backward make zeros of that shape and an add for every expert: O(experts^2) bytes
    per layer). Qwen3-MoE, 6 experts, the disk tier."""
    _, streamed, engine = _pair("qwen3_moe", "disk", tmp_path, layers=1, staged=staged)
    layer = engine.layers[0]
    x = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(3))
    loss = streamed(x, labels=x).loss
    factors = {tuple(t.shape) for t in layer._lora.tensors()}
    assert len(factors) >= 2 and layer.num_experts == 6
    with _NewTensorShapes() as made:
        loss.backward()
    whole = sum(1 for shape in made.shapes if shape in factors)
    # one per factor (4 factors: two matrices x first/second), and peft's own reshape of each from lora_A/lora_B
    assert whole <= 2 * len(layer._lora.tensors()), whole


def test_frozen_offloaded_experts_leave_stand_ins_that_refuse_a_merge(tmp_path):
    """Frozen offloaded experts keep a frozen parameter of one element per tensor (what peft targets); the state
    dict shows the stored experts, and loading one writes them to the store; peft's `disable_adapter()` turns the
    streamed adapters off; peft's merge is refused with the reason; once offload is disabled, peft's own
    resident LoRA computes what the streamed one did."""
    model = _model("qwen3_moe")
    engine = enable_expert_offload(model, OffloadConfig(mode="host", train_experts=False))
    experts = engine.layers[0].module
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(experts, name)
        assert is_stand_in(p) and not p.requires_grad
        with torch._C.DisableTorchFunctionSubclass():
            assert p.untyped_storage().nbytes() == p.element_size()
        assert not is_stand_in(model.state_dict()[f"model.layers.0.mlp.experts.{name}"])
    # load_state_dict writes the experts through to the store; the stand-ins count as loaded, or missing once.
    other = _model("qwen3_moe", seed=3)
    assert not model.load_state_dict(other.state_dict()).missing_keys
    x = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, other(x).logits, atol=1e-5, rtol=0)
    partial = {k: v for k, v in other.state_dict().items() if ".experts." not in k}
    missing = model.load_state_dict(partial, strict=False).missing_keys
    assert sorted(missing) == sorted(n for n in other.state_dict() if ".experts." in n)
    peft_model = _lora("qwen3_moe", model)
    with torch.no_grad():
        streamed = peft_model(x).logits
        with peft_model.disable_adapter():  # peft's rule: no adapter applies meanwhile
            torch.testing.assert_close(peft_model(x).logits, other(x).logits, atol=1e-5, rtol=0)
        assert (streamed - other(x).logits).abs().max() > 1e-3
    with pytest.raises(RuntimeError, match="offloaded experts"):
        peft_model.merge_and_unload()
    disable_expert_offload(model)
    assert not any(is_stand_in(p) for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(peft_model(x).logits, streamed, atol=1e-5, rtol=0)


def test_saved_adapter_loads_with_stock_peft_onto_the_resident_model(tmp_path):
    """An adapter trained on streamed Qwen3-MoE experts (2 AdamW steps), saved by peft, loads with stock peft +
    transformers (a process that never imports hf_moe_offload) onto the resident base model and gives the trained
    model's logits (fp32, 1e-5)."""
    base = _model("qwen3_moe")
    base.save_pretrained(tmp_path / "base")
    engine = enable_expert_offload(base, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "experts"),
                                                       train_experts=False, host_cache_experts=3))
    model = _lora("qwen3_moe", base)
    g = _train(model, steps=2, seed=5)
    with engine.experts_left_out_of_state_dict():  # what OffloadTrainer hands peft: no expert assembled
        model.save_pretrained(tmp_path / "adapter", state_dict=model.state_dict())
    x = torch.randint(0, 96, (2, 9), generator=g)
    model.eval()
    with torch.no_grad():
        expected = model(x).logits
    script = (
        "import json, sys, torch\n"
        "from peft import PeftModel\n"
        "from transformers import AutoModelForCausalLM\n"
        f"base = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'base')!r})\n"
        f"model = PeftModel.from_pretrained(base, {str(tmp_path / 'adapter')!r}).eval()\n"
        f"x = torch.tensor({x.tolist()})\n"
        "with torch.no_grad():\n"
        "    logits = model(x).logits\n"
        "assert not any(m.startswith('hf_moe_offload') for m in sys.modules)\n"
        "print(json.dumps(logits.tolist()))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    logits = torch.tensor(json.loads(out.stdout.strip().splitlines()[-1]))
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "moe_gpt"])
def test_merged_save_streams_the_expert_terms_into_a_plain_checkpoint(family, tmp_path, monkeypatch):
    """LoRA on the streamed experts and on attention, trained 2 steps, saved merged (`save_merged_lora`: each
    expert's W + s * lhs @ rhs formed as it is written): transformers loads the folder as a plain model (no peft, no
    offload) with the trained model's logits (fp32, 1e-5); no expert went through `state_dict()`."""
    from transformers import AutoModelForCausalLM

    from hf_moe_offload.offload import api
    from hf_moe_offload.offload.saving import save_merged_lora

    base = _model(family)
    enable_expert_offload(base, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "experts"), train_experts=False,
                                              host_cache_experts=3))
    torch.manual_seed(1)
    attention = ["q_proj", "v_proj"]
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=attention,
                                            target_parameters=_targets(family), init_lora_weights=False))
    g = _train(model, steps=2, seed=6)
    x = torch.randint(0, 96, (2, 9), generator=g)
    model.eval()
    with torch.no_grad():
        expected = model(x).logits

    def refuse(layer, name):
        raise AssertionError("an expert tensor was assembled through state_dict()")

    monkeypatch.setattr(api, "_expert_tensor", refuse)
    save_merged_lora(model, str(tmp_path / "merged"))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in n for n, _ in plain.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(plain(x).logits, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_offload_trainer_under_accelerate_launch_keeps_the_stand_ins_out_of_ddp(tmp_path):
    """Two gloo processes: DDP wraps the model, ignores the 8 stand-ins (2 layers x 4 expert tensors) that it would
    otherwise broadcast into (an error: they hold one element), and the adapters, trained 3 steps on each rank's
    batches, end the same on both ranks (the gradients were averaged)."""
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    script = os.path.join(os.path.dirname(__file__), "scripts", "lora_experts_ddp.py")
    res = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--main_process_port", "0", "--mixed_precision", "no",
                          "--dynamo_backend", "no", script, str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["wrapper"] == "DistributedDataParallel" and r["ignored"] == 8 for r in ranks), ranks[0]["ignored"]
    a, b = ranks[0]["adapters"], ranks[1]["adapters"]
    assert a.keys() == b.keys() and any("experts" in n for n in a)
    for name in a:
        torch.testing.assert_close(torch.tensor(a[name]), torch.tensor(b[name]), atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("strategy", ["S1", "S2", "S3", "S4"])
def test_lora_on_streamed_experts_under_mpmoe_partitions(strategy, tmp_path):
    """MPMoE's two partitions over the streamed experts with LoRA, every memory-reuse strategy (S3/S4 recompute the
    streamed layer in backward, which takes the adapters again): logits and adapter gradients equal peft's resident
    LoRA without partitions (fp32, 1e-5)."""
    from hf_moe_offload.pipelining import enable_micro_batch_pipelining

    resident, streamed, _ = _pair("qwen3_moe", "host", tmp_path)
    enable_micro_batch_pipelining(streamed.get_base_model(), n=2, strategy=strategy)
    x = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(9))
    outs = [m(x, labels=x) for m in (resident, streamed)]
    for out in outs:
        out.loss.backward()
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-5, rtol=0)
    assert_close_relative(adapter_grads(resident), adapter_grads(streamed), 1e-5)
