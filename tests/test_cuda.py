"""CUDA paths (side-stream uploads, events, pinned memory, bf16 compute copies, grouped GEMM, CUDA autocast), each
against the plain model on the same GPU.

Skipped where no GPU exists (CI is CPU-only); run them on a GPU machine with `pytest tests/test_cuda.py`. The CPU
tests' own comparisons run here on the GPU through their helpers, with the tolerances their modules state:
the seven core MoE families offloaded vs stock (test_families.py), autocast bf16/fp16 on every tier and MPMoE strategy
(test_mixed_precision.py), MPMoE partitions vs the unpartitioned model (test_pipelining.py), and the Trainer.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, enable_expert_offload

from test_families import offloaded_equals_stock
from test_mixed_precision import autocast_trains, trainer_run
from test_offload import small_model, store_grads_vs_reference
from test_pipelining import causal_lm_equals_unpartitioned

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("depth", [1, 3])
def test_cuda_streamed_equals_resident(tier, depth, tmp_path):
    reference = small_model().cuda()
    model = copy.deepcopy(reference).cpu()
    engine = enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=str(tmp_path / "e"),
                                                        host_cache_experts=4, prefetch_depth=depth))
    model.cuda()  # moves the non-expert weights only
    for _ in range(2):
        x = torch.randint(0, 101, (3, 11), device="cuda")
        ref_out, out = reference(x, labels=x), model(x, labels=x)
        torch.testing.assert_close(out.logits, ref_out.logits, atol=1e-5, rtol=1e-5)
        ref_out.loss.backward()
        out.loss.backward()
    assert engine.runtime.name == "cuda" and engine.device.type == "cuda"  # bound to the inputs' device
    assert store_grads_vs_reference(engine, reference.cpu()) <= 1e-5
    assert engine.stats.h2d_bytes > 0 and engine.stats.d2h_bytes > 0


def test_cuda_bf16_compute_copies_stay_current(tmp_path):
    model = small_model()
    engine = enable_expert_offload(model, OffloadConfig(mode="host", compute_dtype=torch.bfloat16, pin_fraction=0.5))
    model.cuda().to(torch.bfloat16)
    opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), ExpertOptimizer(engine, lr=1e-2))
    x = torch.randint(0, 101, (3, 11), device="cuda")
    for _ in range(3):
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    engine.synchronize()
    for key in engine.store.keys():
        record = engine.store.acquire(key)
        torch.testing.assert_close(record.compute.float(), record.param.to(torch.bfloat16).float())
        engine.store.release(key)
        assert record.compute.is_pinned() and not record.grad.is_pinned()  # only the DMA source is page-locked


def test_cuda_grouped_gemm_experts_equal_the_loop():
    """Issue 14, item 4 on a GPU: resident experts under bf16 autocast take the grouped GEMM (one per matmul) and
    equal the per-expert loop within bf16 rounding of the largest value (2e-2 relative; stated)."""
    from hf_moe_offload.models.moe_gpt.moe_layer import MoEGPTExperts
    from hf_moe_offload.models.moe_gpt.moe_ops import GroupedLinear

    if not GroupedLinear.cuda_supports(torch.bfloat16, torch.cuda.get_device_capability()):
        pytest.skip("grouped GEMM needs compute capability 8.0+")
    model = small_model(num_experts=6).cuda()
    module = next(m for m in model.modules() if isinstance(m, MoEGPTExperts))
    counts = [5, 0, 7, 3, 0, 9]
    x = torch.randn(sum(counts), module.fc1_weight.shape[2], device="cuda")
    results = []
    for grouped in (True, False):
        usable = GroupedLinear.usable
        if not grouped:
            GroupedLinear.usable = staticmethod(lambda *a: False)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = module.sorted_forward(x, counts)
        finally:
            GroupedLinear.usable = usable
        results.append(y.float())
    scale = max(1.0, results[1].abs().max().item())
    assert (results[0] - results[1]).abs().max().item() <= 2e-2 * scale


CORE_FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3", "glm4_moe", "granitemoe"]


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 comparisons at 1e-5 need fp32 GEMMs: TF32 (10-bit mantissa) would differ at ~1e-3."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("family", CORE_FAMILIES)
def test_cuda_family_offloaded_equals_stock(family, tier, tmp_path):
    offloaded_equals_stock(family, tier, tmp_path, device="cuda")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("strategy", [None, "S1", "S4"])
@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_cuda_autocast_trains_on_every_tier(tier, strategy, precision, tmp_path):
    autocast_trains(tier, strategy, precision, tmp_path, device="cuda")


@pytest.mark.parametrize("strategy", ["keep", "S1", "S2", "S3", "S4"])
@pytest.mark.parametrize("factory", ["resident", "offload-host"])
def test_cuda_micro_batch_pipelining_equals_unpartitioned(factory, strategy, tmp_path):
    causal_lm_equals_unpartitioned(factory, strategy, 3, tmp_path, device="cuda")


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_cuda_trainer_with_expert_optimizer_equals_plain_adamw(tier, tmp_path):
    """The Trainer on the GPU (accelerate places the model; the engine keeps the experts): fp32 with
    ExpertOptimizerCallback logs the losses of the resident model with torch AdamW (1e-5; the expert-wise optimizer
    runs torch's AdamW arithmetic per expert on the CPU, the resident one on the GPU), and bf16 (CUDA autocast)
    follows it within bf16 rounding (2e-2), stepping every expert every step."""
    plain, _, _ = trainer_run("device", False, tmp_path, use_cpu=False)
    losses32, _, _ = trainer_run(tier, False, tmp_path, use_cpu=False)
    assert len(plain) == 4 and all(abs(a - b) <= 1e-5 for a, b in zip(losses32, plain)), (losses32, plain)
    losses16, engine, gemms = trainer_run(tier, True, tmp_path, use_cpu=False)
    assert engine.device.type == "cuda" and gemms.by_dtype[torch.bfloat16] > 0
    assert set(engine.store.steps.values()) == {4}
    assert all(abs(a - b) <= 2e-2 for a, b in zip(losses16, plain)), (losses16, plain)


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("compute_dtype", [None, torch.float32])
def test_cuda_slab_trains_like_resident_under_bf16(tier, compute_dtype, tmp_path):
    """Issue 35 on the GPU: under bf16 autocast a training call streams each layer's routed experts through the slab
    (grouped GEMMs on the device, one gradient block per chunk down), bf16 copies uploaded (the default under
    autocast) or fp32 weights (set); on the host tier the pins (a quarter of each layer) keep their state on the GPU
    and step there (offload/pins/device_pins.py). 3 steps of Qwen3-MoE train like the resident model with torch AdamW:
    losses within 2e-2 (bf16), weights within what Adam can move an element (tests/numerics.py), bytes down in the
    dtype the GEMMs produced."""
    from hf_moe_offload.offload.streaming.streamed import OffloadedExpertsLayer
    from test_device_slab import _qwen3
    from numerics import assert_within_adam_drift

    reference = _qwen3(8, seed=1).cuda()
    model = copy.deepcopy(reference).cpu()
    engine = enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=str(tmp_path / "e"),
                                                        host_cache_experts=12, prefetch_depth=1,
                                                        compute_dtype=compute_dtype))
    model.cuda()
    calls = []
    original = OffloadedExpertsLayer.run_forward
    OffloadedExpertsLayer.run_forward = lambda self, x, plan, *a: (calls.append(plan.source == "slab")
                                                                   or original(self, x, plan, *a))
    try:
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
        opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0),
                                   ExpertOptimizer(engine, lr=1e-2))
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            x = torch.randint(0, 96, (4, 16), generator=g).cuda()
            losses = []
            for m, o in ((reference, ref_opt), (model, opt)):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = m(x, labels=x).loss
                loss.backward()
                o.step()
                o.zero_grad()
                losses.append(loss.item())
            assert abs(losses[0] - losses[1]) <= 2e-2, losses
        if tier == "host":  # (the disk tier's cache of 12 leaves no room for pins beside two chunks of 5)
            assert len(engine.device_pins) > 0 and engine.device_pins.state.is_cuda
        engine.synchronize()
    finally:
        OffloadedExpertsLayer.run_forward = original
    assert engine.slab is not None and any(calls)
    assert set(engine.gradients.rings) == {compute_dtype or torch.bfloat16}
    assert_within_adam_drift(model.cpu(), reference.cpu(), 1e-2, 3, outliers=0.1)


@pytest.mark.parametrize("placement", ["upload", "cost-model"])
@pytest.mark.parametrize("cache", ["off", "quarter"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_cuda_generation_gives_the_resident_greedy_tokens(tier, cache, placement, tmp_path):
    """`load_for_inference(..., device="cuda")` decodes with the experts uploaded as needed (the device cache holding
    a quarter of them, or none) and gives the resident model's greedy tokens on the same GPU (fp32, Qwen3-MoE).
    "upload": every missed expert goes up (`compute_on_host=False`); "cost-model": the default, where the measured
    cost model may run a missed expert on the host instead (these tiny experts mostly compute there)."""
    from hf_moe_offload.cli.generate import load_for_inference
    from hf_moe_offload.offload import get_offload_engine
    from test_device_generation import NEW_TOKENS, _saved

    lm = _saved("qwen3_moe", tmp_path / "lm")
    resident = load_for_inference(lm["path"], "none", None, None, device="cuda")
    prompt = lm["prompt"].cuda()
    with torch.no_grad():
        want = resident.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    budget = 0 if cache == "off" else lm["experts"] // 4 * lm["expert_bytes"]
    model = load_for_inference(lm["path"], tier, str(tmp_path / tier), 3 if tier == "disk" else None, device="cuda",
                               device_cache_bytes=budget, compute_on_host=False if placement == "upload" else None)
    with torch.no_grad():
        got = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    engine = get_offload_engine(model)
    assert engine.runtime.name == "cuda" and (engine.decoding.cost_model is None) == (placement == "upload")
    if placement == "upload":
        assert engine.stats.h2d_bytes > 0 and engine.stats.host_computed_experts == 0
    else:  # every routed expert ran somewhere: uploaded, or computed on the host
        assert engine.stats.h2d_bytes > 0 or engine.stats.host_computed_experts > 0
    assert (engine.decoding.device_cache is None) == (cache == "off")


def _cuda_lora_pair(tier, layers, tmp_path, storage="auto", prepare_resident=None):
    """([resident peft model, streamed peft model], their AdamW optimizers, the engine): Qwen3-MoE with peft's LoRA
    (r=4, random lora_B) on the expert tensors, the frozen experts offloaded per `tier` / `storage` (the device expert
    cache on), both on the GPU; `prepare_resident(model)` runs on the resident base first. The disk tier's host cache
    of 9 records holds the slab's two chunks of 3 beside 2 reads ahead (slab.default_chunk): a smaller one streams
    expert by expert, without the slab."""
    from peft import LoraConfig, get_peft_model
    from moe_families import tiny_model

    resident = tiny_model("qwen3_moe", num_hidden_layers=layers)
    for p in resident.parameters():
        p.requires_grad_(False)
    streamed = copy.deepcopy(resident)
    engine = enable_expert_offload(streamed, OffloadConfig(mode=tier, offload_dir=str(tmp_path / "e"),
                                                           train_experts=False, expert_storage=storage,
                                                           host_cache_experts=9, device_cache_bytes=1 << 20))
    if prepare_resident is not None:
        prepare_resident(resident)
    resident.cuda()
    streamed.cuda()  # the non-expert weights and the stand-ins (the adapters are made beside them)
    models = []
    for model in (resident, streamed):
        torch.manual_seed(1)
        models.append(get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=[], init_lora_weights=False,
                                                       target_parameters=["experts.gate_up_proj", "experts.down_proj"])))
    return models, [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in models], engine


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_cuda_lora_on_streamed_experts_equals_resident_lora(tier, autocast, tmp_path):
    """Issue 38 on the GPU: peft's LoRA on Qwen3-MoE's expert tensors, the frozen experts streamed through the slab
    (training) and the device expert cache (evaluation), the adapters on the GPU, against peft's resident LoRA on the
    same GPU: the adapters after 3 AdamW steps and the evaluation logits, with test_expert_lora.py's tolerances (one
    MoE layer under autocast, where a second layer's router could pick other experts on rounding alone)."""
    from numerics import assert_within_adam_drift

    models, opts, engine = _cuda_lora_pair(tier, layers=1 if autocast else 2, tmp_path=tmp_path)
    g = torch.Generator().manual_seed(8)
    for _ in range(3):
        x = torch.randint(0, 96, (2, 11), generator=g).cuda()
        for model, opt in zip(models, opts):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
    assert engine.device.type == "cuda" and engine.slab is not None
    x = torch.randint(0, 96, (2, 9), generator=g).cuda()
    logits = []
    for model in models:
        model.eval()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits.append(model(x).logits.float())
    engine.synchronize()
    assert engine.stats.device_cache_misses > 0
    torch.testing.assert_close(logits[1], logits[0], atol=5e-2 if autocast else 1e-5, rtol=0)
    assert_within_adam_drift(models[1], models[0], 1e-2, 3, weight_decay=0.01, outliers=0.1 if autocast else 0.01)


@pytest.mark.parametrize("storage", ["nf4", "int8"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_cuda_quantized_experts_dequantize_on_the_device(storage, tier, tmp_path):
    """Issue 38 item 2 on the GPU: quantized frozen experts go up as their bytes and are dequantized by bitsandbytes'
    CUDA kernels on the copy stream (slab in training, device cache in evaluation); the model computes what the
    resident model with the library-dequantized experts computes on the same GPU (fp32, 1e-5; the first step's
    logits, then evaluation after 2 AdamW steps of LoRA on the experts within the Adam bound)."""
    pytest.importorskip("bitsandbytes")
    from numerics import assert_within_adam_drift
    from test_quantized_experts import _dequantized_by_the_library

    models, opts, engine = _cuda_lora_pair(tier, layers=2, tmp_path=tmp_path, storage=storage,
                                           prepare_resident=lambda m: _dequantized_by_the_library(m, storage))
    g = torch.Generator().manual_seed(8)
    for step in range(2):
        x = torch.randint(0, 96, (2, 11), generator=g).cuda()
        outs = []
        for model, opt in zip(models, opts):
            out = model(x, labels=x)
            out.loss.backward()
            outs.append(out.logits)
            opt.step()
            opt.zero_grad()
        if step == 0:
            torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=0)
    assert engine.slab is not None
    x = torch.randint(0, 96, (2, 9), generator=g).cuda()
    logits = []
    for model in models:
        model.eval()
        with torch.no_grad():
            logits.append(model(x).logits)
    engine.synchronize()
    assert engine.stats.h2d_bytes % engine.store.quantization.nbytes == 0  # whole quantized rows went up
    assert_within_adam_drift(models[1], models[0], 1e-2, 2, weight_decay=0.01, outliers=0.01)
