"""Offloaded inference (hf_moe_offload/offload/inference/policies.py, issue 15): generation with the experts on the host or
disk tier gives the resident model's tokens (MoE-GPT and two transformers families, with and without pre-gating,
batched with left padding), the decode cache keeps within its budget, the compute-on-host choice follows its cost
model, and the user surface (`hf-moe-offload generate`, `pipeline("text-generation")`, Trainer evaluation) runs in
inference mode. Greedy tokens are compared exactly; fp32 throughout."""

from __future__ import annotations

import copy
import os
from collections import Counter

import pytest
import torch

from hf_moe_offload import OffloadConfig, enable_expert_offload
from hf_moe_offload.offload.inference.policies import DecodeCache, PlacementCostModel, find_router
from hf_moe_offload.offload.stores.store import PARAM
from hf_moe_offload.runtime import use_runtime
from hf_moe_offload.runtime.simulated import SimulatedRuntime

from moe_families import tiny_model
from test_offload import small_model

FAMILIES = ["moe_gpt", "qwen3_moe", "mixtral"]


def make_model(family: str, seed: int = 0):
    if family == "moe_gpt":
        return small_model(seed, num_hidden_layers=3, num_experts=8).eval()
    model = tiny_model(family, seed=seed, num_experts=8).eval()
    model.config.use_cache = True
    return model


def left_padded_batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fresh random prompts of 7 and 4 tokens, the shorter one left-padded (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


def greedy(model, ids, mask, n: int = 10) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0, use_cache=True)


# (tier, pre-gating, mmap_weights): the host tier; the disk tier's default on the CPU (uncached experts computed
# from their mapped files), with pre-gating (its guesses become the kernel's read-ahead); the disk tier reading
# every expert through its cache (as on a GPU), without and with pre-gating.
VARIANTS = {"host": ("host", None, None), "disk-mapped": ("disk", None, None), "disk-mapped-pregate": ("disk", True, None),
            "disk-cache": ("disk", None, False), "disk-cache-pregate": ("disk", True, False)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_the_resident_model(family, variant, tmp_path):
    tier, pregate, mmap = VARIANTS[variant]
    resident = make_model(family)
    offloaded = copy.deepcopy(resident)
    cache = 4  # of 24 experts: every token misses some
    engine = enable_expert_offload(offloaded, OffloadConfig(
        mode=tier, offload_dir=str(tmp_path / "experts"), host_cache_experts=cache if tier == "disk" else None,
        pregate=pregate, mmap_weights=mmap, train_experts=False))
    ids, mask = left_padded_batch(resident.config.vocab_size, seed=hash((family, variant)) % 1000)
    expected = greedy(resident, ids, mask)
    got = greedy(offloaded, ids, mask)
    assert torch.equal(got, expected)
    assert engine.decoding.inference  # chosen automatically under no_grad
    if tier == "disk":
        assert len(engine.store.resident_keys()) <= cache
        if mmap is False:
            assert engine.stats.cache_misses > 0  # the cache was too small for the experts: reads happened
            assert engine.stats.disk_mapped_bytes == 0
        else:  # the experts that were not cached were used from their files, never read into the cache
            assert engine.map_files and engine.stats.disk_mapped_bytes > 0
            assert engine.stats.cache_misses == 0 and engine.stats.disk_read_bytes == 0
            assert engine.stats.disk_mapped_experts > 0 and engine.stats.cache_hit_rate < 1.0  # mapped: not served
        # Pre-gating guessed (and was scored) on every layer after the first, only when on (by default not on the
        # CPU: its early reads compete with the compute there).
        assert (engine.stats.pregate_routed > 0) == bool(pregate)
    else:
        assert engine.decoding.pregate is None and not engine.map_files  # nothing to read early or to map on the host tier


def test_the_decode_cache_never_holds_more_than_its_slots_and_reads_only_weights(tmp_path):
    model = make_model("qwen3_moe")
    cache = 5
    engine = enable_expert_offload(model, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "e"),
                                                        host_cache_experts=cache, mmap_weights=False))
    store = engine.store
    peak = []
    for layer in model.model.layers:  # checked at every layer of every decoded token
        layer.register_forward_hook(lambda *_: peak.append(len(store.resident_keys())))
    ids, mask = left_padded_batch(model.config.vocab_size, seed=3)
    greedy(model, ids, mask, n=12)
    assert peak and max(peak) <= cache
    assert store.eviction.decode is engine.decoding.decode_cache  # the disk tier evicted by decoding's scores
    # A trainable store read for inference: only the weights row of each expert, never gradients or moments.
    assert engine.stats.disk_read_bytes > 0 and engine.stats.disk_read_bytes % (store.numel * 4) == 0
    assert all(store._entries[k].valid == {PARAM} for k in store.resident_keys())


def test_decode_cache_scores_and_budgets():
    dc = DecodeCache(num_layers=2, capacity=4, decay=0.5)
    assert dc.budget == 2
    for _ in range(3):  # (0, 1) used on three tokens long ago ...
        dc.touch((0, 1))
        dc.next_token()
    for _ in range(4):
        dc.next_token()
    dc.touch((0, 2))  # ... (0, 2) once, now
    assert dc.score((0, 1)) < dc.score((0, 2))  # 1.75 * 0.5**4 < 1
    held = Counter({0: 3, 1: 2})  # layer 0 is over its budget of 2 (the incoming expert counted)
    # The incoming layer over budget gives its own coldest.
    assert dc.victim([(0, 1), (0, 2), (1, 0)], held, incoming=(0, 5), speculative=False) == (0, 1)
    # Another layer's incoming expert takes from the layer over budget, even from a hotter expert than its own.
    dc.touch((0, 3))
    held = Counter({0: 3, 1: 2})
    assert dc.victim([(0, 2), (0, 3), (1, 0)], held, incoming=(1, 4), speculative=False) in {(0, 2), (0, 3)}
    # Nobody over budget: a blocking read takes the coldest of all; a guess (speculative) takes nothing.
    held = Counter({0: 2, 1: 2})
    assert dc.victim([(0, 2), (1, 0)], held, incoming=(1, 4), speculative=False) == (1, 0)
    assert dc.victim([(0, 2), (1, 0)], held, incoming=(1, 4), speculative=True) is None
    with pytest.raises(ValueError, match="decay"):
        DecodeCache(2, 4, decay=0.0)


def test_pregate_learns_co_activations_and_previous_tokens_scores_its_guesses_and_stops_acting_when_they_miss():
    from torch import nn

    from hf_moe_offload.offload.inference.policies import PreGate, Router
    from hf_moe_offload.offload.telemetry import OffloadStats

    E, d = 12, 4
    gates = [nn.Linear(d, E, bias=False) for _ in range(2)]
    with torch.no_grad():
        gates[1].weight.zero_()
        gates[1].weight[0, 0], gates[1].weight[1, 0] = 10.0, 5.0  # layer 1's router prefers experts 0, then 1
    stats = OffloadStats()
    pg = PreGate([Router(g, "weight", None) for g in gates], stats, min_hit_rate=0.5, smoothing=0.5)
    h = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    assert set(pg.guess(1, h, top_k=2)) == {0, 1}  # no history yet: the router alone
    pg.observe(1, torch.tensor([[0, 1]]), E)
    assert (stats.pregate_hits, stats.pregate_routed) == (2, 2)
    for _ in range(3):  # every token: layer 0 picks (3, 4), then layer 1 picks (5, 0)
        pg.observe(0, torch.tensor([[3, 4]]), E)
        pg.guess(1, h, top_k=2)
        pg.observe(1, torch.tensor([[5, 0]]), E)
    assert pg.coactivation[0][3, 5] == 3 and pg.coactivation[0][4, 0] == 3
    pg.observe(0, torch.tensor([[3, 4]]), E)
    # The co-activation (and the previous token's experts) outweigh the router's second choice: both have been
    # right lately (each source's own guess is scored), the router only half right.
    assert pg.source_recent["router"] < min(pg.source_recent["co-activation"], pg.source_recent["previous token"])
    assert set(pg.guess(1, h, top_k=2)) == {0, 5}
    assert pg.acting
    for pair in ([6, 7], [8, 9], [10, 11]):  # routing changes to unseen experts: guesses miss, reads stop
        pg.observe(1, torch.tensor([pair]), E)
        pg.observe(0, torch.tensor([[3, 4]]), E)
        pg.guess(1, h, top_k=2)
    assert not pg.acting
    # A dropped choice (id E, families that drop) is not an expert.
    assert pg.observe(0, torch.tensor([[2, E]]), E) == {2}
    # The experts a layer picked for the previous token count too (consecutive tokens share experts): with a router
    # that cannot tell the experts apart and no co-activation to go by, they are the guess.
    with torch.no_grad():
        gates[1].weight.zero_()
    pg = PreGate([Router(g, "weight", None) for g in gates], OffloadStats())
    pg.observe(1, torch.tensor([[6, 2]]), E)
    assert set(pg.guess(1, h, top_k=2)) == {2, 6}


def test_pregate_follows_the_source_that_has_been_right():
    """Layer 1's experts follow layer 0's (1, 2) -> (5, 6), (3, 4) -> (7, 8) and layer 0 alternates, so the previous
    token's experts are always wrong and the co-activation right; the router leans to (7, 8). Summed with equal
    weights, the previous token and the router would outvote the co-activation every other token; weighted by their
    own hit rates, the co-activation leads and every guess after the first rounds is right."""
    from torch import nn

    from hf_moe_offload.offload.inference.policies import PreGate, Router
    from hf_moe_offload.offload.telemetry import OffloadStats

    E, d = 10, 4
    gates = [nn.Linear(d, E, bias=False) for _ in range(2)]
    with torch.no_grad():
        gates[1].weight.zero_()
        gates[1].weight[7, 0] = gates[1].weight[8, 0] = 0.5
    stats = OffloadStats()
    pg = PreGate([Router(g, "weight", None) for g in gates], stats)
    h = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    follows = {(1, 2): {5, 6}, (3, 4): {7, 8}}
    right = []
    for token in range(40):
        first = (1, 2) if token % 2 == 0 else (3, 4)
        pg.observe(0, torch.tensor([first]), E)
        right.append(set(pg.guess(1, h, top_k=2)) == follows[first])
        pg.observe(1, torch.tensor([sorted(follows[first])]), E)
    assert pg.source_recent["co-activation"] > 0.9 > 0.1 > pg.source_recent["previous token"]
    assert all(right[10:])


def test_compute_on_host_decision_for_given_speeds():
    cm = PlacementCostModel(host_flops=1e11, link_bytes_per_s=1e10)
    flops, weights, act = 4e6, 8_000_000, 4096  # per token; expert weight bytes; activation bytes per token
    # host: t * (4e-5 + 8.192e-7) s; upload: 8e-4 s -> the host wins up to 19 tokens.
    assert cm.max_host_tokens(flops, weights, act) == 19
    assert cm.compute_on_host(19, flops, weights, act)
    assert not cm.compute_on_host(20, flops, weights, act)
    slow_host = PlacementCostModel(host_flops=1e8, link_bytes_per_s=1e10)
    assert slow_host.max_host_tokens(flops, weights, act) == 0 and not slow_host.compute_on_host(1, flops, weights, act)


def test_compute_on_host_on_the_simulated_device_gives_the_same_tokens():
    resident = make_model("moe_gpt")
    ids, mask = left_padded_batch(resident.config.vocab_size, seed=11)
    expected = greedy(resident, ids, mask)
    moved = {}
    for on_host in (False, True):
        model = copy.deepcopy(resident)
        with use_runtime(SimulatedRuntime(seed=5, max_delay=0.001)):
            engine = enable_expert_offload(model, OffloadConfig(mode="host", compute_on_host=on_host,
                                                                train_experts=False))
            if on_host:  # given speeds: an expert with at most 2 tokens runs on the host (decoding), more upload
                engine.decoding.cost_model = PlacementCostModel(host_flops=1.0, link_bytes_per_s=1.0)
                layout = engine.layers[0].layout
                per_token = 2.0 * layout.decay_numel + 2 * layout.hidden_size * 4
                engine.decoding.cost_model.host_flops = per_token / (engine.store.numel * 4 / 2.5)
                assert engine.decoding.cost_model.max_host_tokens(2.0 * layout.decay_numel, engine.store.numel * 4,
                                                         layout.hidden_size * 4) == 2
            got = greedy(model, ids, mask)
            engine.synchronize()
        assert torch.equal(got, expected)
        moved[on_host] = (engine.stats.h2d_bytes, engine.stats.host_computed_experts)
    assert moved[False][1] == 0
    assert moved[True][1] > 0 and moved[True][0] < moved[False][0]  # fewer uploads: decoding's experts ran on host
    assert moved[True][0] > 0  # the prompt's experts (many tokens each) were still uploaded


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compute_on_host_under_cpu_autocast_equals_the_device_path(dtype):
    """Under autocast (CPU autocast: the dtype logic of CUDA's) an expert run on the host gives what its upload and
    device compute give, bit for bit, in the autocast dtype: one forward on the simulated device where the experts
    with few rows run on the host and the others are uploaded, against all uploaded."""
    resident = make_model("moe_gpt")
    x = torch.randint(1, resident.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(23))
    logits, used = {}, {}
    for on_host in (False, True):
        model = copy.deepcopy(resident)
        with use_runtime(SimulatedRuntime(seed=6, max_delay=0.001)):
            engine = enable_expert_offload(model, OffloadConfig(mode="host", compute_on_host=on_host,
                                                                train_experts=False))
            if on_host:  # experts with at most 2 rows run on the host, the rest are uploaded
                layout = engine.layers[0].layout
                engine.decoding.cost_model = PlacementCostModel(host_flops=1.0, link_bytes_per_s=1.0)
                per_token = 2.0 * layout.decay_numel + 2 * layout.hidden_size * 4
                engine.decoding.cost_model.host_flops = per_token / (engine.store.numel * 4 / 2.5)
            with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
                logits[on_host] = model(x).logits
            engine.synchronize()
        used[on_host] = (engine.stats.host_computed_experts, engine.stats.h2d_bytes)
    assert used[True][0] > 0 and used[True][1] > 0  # both paths ran
    assert logits[True].dtype == logits[False].dtype
    assert torch.equal(logits[True], logits[False])


def test_pregate_is_on_by_default_on_an_asynchronous_device(tmp_path):
    """On the simulated device (a GPU's ordering) the disk tier pre-gates by default; same tokens as resident."""
    resident = make_model("moe_gpt")
    ids, mask = left_padded_batch(resident.config.vocab_size, seed=13)
    model = copy.deepcopy(resident)
    with use_runtime(SimulatedRuntime(seed=2, max_delay=0.001)):
        engine = enable_expert_offload(model, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "e"),
                                                            host_cache_experts=5, train_experts=False))
        got = greedy(model, ids, mask)
        engine.synchronize()
    assert torch.equal(got, greedy(resident, ids, mask))
    assert engine.decoding.pregate is not None and engine.stats.pregate_routed > 0


def test_decoding_on_a_device_keeps_the_hot_experts_there(tmp_path):
    """On an asynchronous device (simulated) decoding keeps a device copy of each layer's pin_fraction hottest experts
    by use score, so their uploads are reused: fewer bytes uploaded than without pins, the same tokens."""
    resident = make_model("moe_gpt")
    ids, mask = left_padded_batch(resident.config.vocab_size, seed=17)
    expected = greedy(resident, ids, mask, n=16)
    uploaded = {}
    for pin in (0.0, 0.5):
        model = copy.deepcopy(resident)
        with use_runtime(SimulatedRuntime(seed=4, max_delay=0.001)):
            engine = enable_expert_offload(model, OffloadConfig(mode="host", pin_fraction=pin, train_experts=False))
            engine.decoding.decode_pin_interval = 2  # re-chosen every other token (16 by default)
            got = greedy(model, ids, mask, n=16)
            engine.synchronize()
        assert torch.equal(got, expected)
        uploaded[pin] = engine.stats.h2d_bytes
        if pin:
            engine.decoding.pin_hot_experts()  # chosen again from the final scores, to check the choice
            per_layer = Counter(layer for layer, _ in engine.pins.pinned)
            assert engine.pins.pinned and max(per_layer.values()) <= 4  # ceil(0.5 x 8) per layer
            scores = engine.decoding.decode_cache
            for layer, e in engine.pins.pinned:  # the pinned ones are the layer's best scored
                others = [scores.score((layer, o)) for o in range(8) if (layer, o) not in engine.pins.pinned]
                assert scores.score((layer, e)) >= max(others, default=0.0)
    assert uploaded[0.5] < uploaded[0.0]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_cost_model_measures_this_machine(autocast):
    """Its timed copies run through the runtime's streams (simulated here), also inside a user's autocast block."""
    with use_runtime(SimulatedRuntime(seed=0)) as rt, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        cm = PlacementCostModel.measure(rt, numel=4096, dtype=torch.bfloat16 if autocast else torch.float32,
                                        repeats=2)
    assert cm.host_flops > 0 and cm.link_bytes_per_s > 0


def test_inference_mode_follows_grad_and_eval_unless_forced(tmp_path):
    model = small_model(0, num_experts=4)
    engine = enable_expert_offload(model, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "e"),
                                                        host_cache_experts=4))
    x = torch.randint(0, 101, (2, 6))
    model.train()
    model(x, labels=x).loss.backward()
    assert not engine.decoding.inference and engine.store.eviction.decode is None
    with torch.no_grad():
        model(x)
    assert engine.decoding.inference and engine.store.eviction.decode is engine.decoding.decode_cache
    model.eval()
    model(x)  # eval with grad on (e.g. a probe): inference's cache policy, still differentiable
    assert engine.decoding.inference
    engine.config.inference = False
    with torch.no_grad():
        model(x)
    assert not engine.decoding.inference and engine.store.eviction.decode is None
    engine.zero_grad()


@pytest.mark.parametrize("family", ["moe_gpt", "qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"])
def test_pregate_finds_the_router_of_every_family(family):
    model = make_model(family) if family in FAMILIES else tiny_model(family).eval()
    from hf_moe_offload.families.moe_path import experts_layers

    for name, module, layout in experts_layers(model):
        block = model.get_submodule(name.rpartition(".")[0])
        router = find_router(block, module, layout.num_experts, layout.hidden_size)
        assert router is not None, name
        assert router.logits(torch.randn(3, layout.hidden_size)).shape == (3, layout.num_experts)


# --- the user surface ---
def _save_with_gpt2_tokenizer(family: str, path) -> tuple[str, object]:
    """A tiny model of `family` over GPT-2's vocabulary (offline tokenizer), saved with its tokenizer."""
    from hf_moe_offload.data import gpt2_tokenizer

    tok = gpt2_tokenizer()
    tok.pad_token = tok.eos_token
    if family == "moe_gpt":
        model = small_model(7, vocab_size=len(tok), num_experts=6)
    else:
        model = tiny_model(family, seed=7, vocab_size=len(tok))
        model.config.use_cache = True
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), tok


@pytest.fixture(scope="module")
def saved_lm(tmp_path_factory):
    return _save_with_gpt2_tokenizer("moe_gpt", tmp_path_factory.mktemp("lm"))


def test_pipeline_text_generation_on_an_offloaded_model(saved_lm, tmp_path):
    from transformers import AutoModelForCausalLM, pipeline

    from hf_moe_offload.cli.generate import load_for_inference

    path, tok = saved_lm
    prompts = ["The history of", "In the early years of the city, the"]
    runs = {}
    for offload in ("none", "disk"):
        model = load_for_inference(path, offload, str(tmp_path / offload), host_cache_experts=3)
        generator = pipeline("text-generation", model=model, tokenizer=tok)
        runs[offload] = [r[0]["generated_text"] for r in generator(prompts, max_new_tokens=6, do_sample=False,
                                                                       pad_token_id=tok.eos_token_id)]
    assert isinstance(model, type(AutoModelForCausalLM.from_pretrained(path)))
    assert runs["disk"] == runs["none"] and all(t.startswith(p) for t, p in zip(runs["disk"], prompts))


@pytest.mark.parametrize("family", ["moe_gpt", "qwen3_moe"])
def test_generate_command_gives_the_resident_models_text_batched_with_left_padding(family, saved_lm, tmp_path,
                                                                                    capsys):
    from hf_moe_offload.cli.main import build_parser

    path = saved_lm[0] if family == "moe_gpt" else _save_with_gpt2_tokenizer(family, tmp_path / "lm")[0]
    common = ["generate", "--model-path", path, "--prompt", "Hello", "--prompt", "The history of the city",
              "--max-new-tokens", "6"]
    figures = {}
    for offload in ("none", "host", "disk"):
        args = build_parser().parse_args(common + ["--offload", offload, "--host-cache-experts", "3",
                                                   "--offload-dir", str(tmp_path / offload)])
        figures[offload] = args.func(args)
    assert figures["host"]["texts"] == figures["none"]["texts"] == figures["disk"]["texts"]
    assert figures["disk"]["new_tokens"] == 6 and figures["disk"]["cache_hit_rate"] is not None
    out = capsys.readouterr().out
    assert "[generate] 6 new tokens x 2 prompt(s)" in out and "disk tier: cache hit rate" in out


def test_generate_command_streams_one_prompt_and_reports_a_missing_model(saved_lm, tmp_path, capsys):
    from hf_moe_offload.cli.main import main

    path, _ = saved_lm
    assert main(["generate", "--model-path", path, "--prompt", "Once", "--max-new-tokens", "4",
                 "--offload-dir", str(tmp_path / "e")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Once") and "[generate] 4 new tokens x 1 prompt(s)" in out
    assert main(["generate", "--model-path", str(tmp_path / "nothing-here")]) == 2
    assert "nothing-here" in capsys.readouterr().err


def test_trainer_evaluation_runs_in_inference_mode_with_the_resident_loss(tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments, default_data_collator

    reference = small_model(seed=5)
    model = copy.deepcopy(reference)
    engine = enable_expert_offload(model, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "e"),
                                                        host_cache_experts=3))
    ids = torch.randint(0, 101, (6, 12), generator=torch.Generator().manual_seed(21))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    losses = []
    for m in (reference, model):
        args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_eval_batch_size=3, use_cpu=True,
                                 report_to=[])
        losses.append(Trainer(model=m, args=args, eval_dataset=data,
                              data_collator=default_data_collator).evaluate()["eval_loss"])
    assert engine.decoding.inference and engine.store.eviction.decode is engine.decoding.decode_cache
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("family", ["moe_gpt", "qwen3_moe"])
def test_a_bf16_model_keeps_bf16_experts_only_and_generates_the_resident_tokens(family, tier, tmp_path):
    """Weights-only store of a bf16 model: bf16 rows, no fp32 master, no second compute copy (2 bytes per weight);
    greedy tokens equal to the resident bf16 model's, and state_dict() gives back the very same bf16 weights."""
    resident = make_model(family).to(torch.bfloat16)
    offloaded = copy.deepcopy(resident)
    engine = enable_expert_offload(offloaded, OffloadConfig(
        mode=tier, offload_dir=str(tmp_path / "e"), host_cache_experts=4 if tier == "disk" else None,
        train_experts=False))
    store = engine.store
    assert store.row_dtype == torch.bfloat16 and store.record_bytes() == 2 * store.numel
    record = store.acquire((0, 0))
    assert record.compute is None and record.compute_param().dtype == torch.bfloat16
    store.release((0, 0))
    ids, mask = left_padded_batch(resident.config.vocab_size, seed=5)
    assert torch.equal(greedy(offloaded, ids, mask), greedy(resident, ids, mask))
    expected, got = resident.state_dict(), offloaded.state_dict()
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in expected.items())


def test_only_a_weights_only_store_leaves_fp32():
    from hf_moe_offload.offload.stores.store import HostExpertStore
    from hf_moe_offload.offload.telemetry import OffloadStats

    with pytest.raises(ValueError, match="fp32 masters"):
        HostExpertStore([(0, 0)], 8, torch.bfloat16, OffloadStats(), state_rows=4, row_dtype=torch.bfloat16)


def written_disk_store(tmp_path, num_experts: int, value=lambda key: torch.randn(64)):
    """A disk store of `num_experts` experts of 64 weights (weights row only, a cache of one expert), each written
    with `value(key)` and flushed to its file; returns the store and the values."""
    from hf_moe_offload.offload.stores.disk_store import DiskExpertStore
    from hf_moe_offload.offload.telemetry import OffloadStats

    store = DiskExpertStore([(0, e) for e in range(num_experts)], 64, torch.float32, OffloadStats(),
                            str(tmp_path / "e"), cache_experts=1, state_rows=1)
    values = {k: value(k) for k in store.keys()}
    for k, v in values.items():
        store.write_param(k, v)
    store.flush()
    return store, values


def test_while_decoding_each_row_is_checked_on_its_first_read_only(tmp_path, monkeypatch):
    """A corrupt expert file is still caught while decoding (the first read of each row checks its checksum); a row
    read and checked before is not checked again until it is written."""
    from hf_moe_offload.offload.stores import expert_files as store_module
    from hf_moe_offload.offload.stores.store import CorruptExpertFileError, WEIGHTS

    store, values = written_disk_store(tmp_path, 4)
    keys = list(values)
    store.set_decode_cache(DecodeCache(1, 1))
    checks = []
    original = store_module._row_hash
    monkeypatch.setattr(store_module, "_row_hash", lambda b: checks.append(1) or original(b))
    for _ in range(2):  # cache of one expert: every acquire reads its file
        for k in keys[:3]:
            store.acquire(k, WEIGHTS)
            store.release(k)
    assert len(checks) == 3  # three rows, each checked once over six reads
    with open(store.path(keys[3]), "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises(CorruptExpertFileError, match="checksum"):
        store.acquire(keys[3], WEIGHTS)
    store.close()


def test_mapped_weights_are_checked_once_per_write_and_follow_in_place_writes(tmp_path, monkeypatch):
    """`map_weights` (inference on the CPU): the view holds the file's weights row; its checksum is matched at the
    first use after each write only; a write that rewrites the file in place shows through the same mapping; an
    expert with a cache entry is not mapped (the cache is current for it); a corrupt file is refused."""
    from hf_moe_offload.offload.stores import expert_files as store_module
    from hf_moe_offload.offload.stores.store import CorruptExpertFileError

    store, values = written_disk_store(tmp_path, 3)
    keys = list(values)
    cached = store.resident_keys()
    assert cached and store.map_weights(cached[0]) is None  # has an entry: acquire it instead
    mapped = next(k for k in keys if k not in cached)
    checks = []
    original = store_module._row_hash
    monkeypatch.setattr(store_module, "_row_hash", lambda b: checks.append(1) or original(b))
    view = store.map_weights(mapped)
    assert torch.equal(view, values[mapped]) and len(checks) == 1
    assert torch.equal(store.map_weights(mapped), values[mapped]) and len(checks) == 1  # checked once
    new = torch.randn(64)
    store.write_param(mapped, new)  # into the cache, then written back in place when evicted
    other = next(k for k in keys if k != mapped)
    store.acquire(other)
    store.release(other)
    assert mapped not in store.resident_keys() and torch.equal(view, new)  # the old view sees the new bytes
    checks.clear()
    assert torch.equal(store.map_weights(mapped), new) and len(checks) == 1  # written since: checked again
    corrupt = next(k for k in keys if k not in store.resident_keys() and k != mapped)
    with open(store.path(corrupt), "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises(CorruptExpertFileError, match="checksum"):
        store.map_weights(corrupt)
    store.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_mapped_weights_keep_no_file_open(tmp_path):
    """A model with thousands of experts must not run out of file descriptors while decoding from mapped files (a
    Python `mmap` keeps one open per mapping)."""
    store, values = written_disk_store(tmp_path, 16)
    keys = list(values)
    opened = len(os.listdir("/proc/self/fd"))
    views = {k: store.map_weights(k) for k in keys if k not in store.resident_keys()}
    store.advise(keys)
    assert len(views) == 15 and len(os.listdir("/proc/self/fd")) == opened
    assert all(torch.equal(v, values[k]) for k, v in views.items())
    store.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="read-ahead of mapped files is posix_fadvise")
def test_mapped_read_ahead_asks_once_per_expert_and_token(tmp_path, monkeypatch):
    """The engine's lookahead windows overlap, and a layer's plan and its stream both read ahead: the kernel is asked
    to read an expert's weights once per token, not for every overlapping request (like the cache's prefetch)."""
    store, values = written_disk_store(tmp_path, 6)
    keys = list(values)
    policy = DecodeCache(1, 1)
    store.set_decode_cache(policy)
    asked = []
    original = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: asked.append(length) or
                        original(fd, offset, length, advice))
    uncached = [k for k in keys if k not in store.resident_keys()]
    store.advise(uncached[:3])
    store.advise(uncached[1:4])  # the next window: one new expert
    assert len(asked) == 4 and all(policy.expecting(k) for k in uncached[:4])
    store.map_weights(uncached[0])
    policy.touch(uncached[0])  # used: a later request asks again
    store.advise(uncached[:1])
    assert len(asked) == 5
    policy.next_token()  # a new token: every expert may have left the page cache since
    store.advise(uncached[:3])
    assert len(asked) == 8 and set(asked) == {64 * 4}
    store.close()


def test_decoding_from_mapped_files_after_training_uses_the_updated_experts(tmp_path):
    """Train (AdamW on every parameter, the expert-wise optimizer on the disk tier's experts, a cache of 3 of 12),
    evaluate under no_grad, train again, evaluate again: each evaluation computes the uncached experts from their
    mapped files and the cached ones (some of them newer than their files) from the cache, and gives the logits of
    the resident model trained the same way with torch.optim.AdamW. fp32; atol 1e-5 on logits of unit scale."""
    from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer

    reference = small_model(seed=7)
    model = copy.deepcopy(reference)
    engine = enable_expert_offload(model, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "e"),
                                                        host_cache_experts=3, prefetch_depth=1))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    experts = ExpertOptimizer(engine, lr=1e-2, weight_decay=0.0)
    opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0), experts)
    g = torch.Generator().manual_seed(8)
    for _ in range(2):
        for _ in range(2):
            x = torch.randint(0, 101, (2, 9), generator=g)
            reference(x, labels=x).loss.backward()
            model(x, labels=x).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            opt.step()
            opt.zero_grad()
        engine.synchronize()
        assert engine.store.dirty_keys()  # cached experts newer than their files: the cache must serve those
        before = engine.stats.disk_mapped_bytes
        x = torch.randint(0, 101, (3, 10), generator=g)
        with torch.no_grad():
            expected = reference(x).logits
            got = model(x).logits
        assert engine.decoding.inference and engine.stats.disk_mapped_bytes > before
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert engine.store.steps and set(engine.store.steps.values()) == {4}
    experts.close()


def test_mmap_weights_is_refused_where_it_cannot_apply():
    model = make_model("moe_gpt")
    enable_expert_offload(model, OffloadConfig(mode="host", mmap_weights=True, train_experts=False))
    ids, mask = left_padded_batch(model.config.vocab_size, seed=2)
    with pytest.raises(ValueError, match="mmap_weights=True needs the disk tier"):
        greedy(model, ids, mask, n=1)
