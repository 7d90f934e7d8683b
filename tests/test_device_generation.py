"""Generation on a device (issue 37): `load_for_inference(..., device=)` / `hf-moe-offload generate --device` compute
on the device, the offloaded experts uploaded as decoding needs them and the ones it uses most kept in the device
expert cache (offload/inference/device_cache.py). CI has no GPU: the device is the simulated one (hf_moe_offload/runtime/
simulated.py), whose copies land late and whose vector clocks raise on a missing wait.

Greedy decoding in fp32 must give the resident model's tokens exactly: the offloaded experts compute each expert's
rows with the same GEMMs as transformers' eager experts (the tests' families run `experts_implementation="eager"`).
"""

from __future__ import annotations

import pytest
import torch

from hf_moe_offload.cli.generate import load_for_inference
from hf_moe_offload.families.moe_path import experts_layers
from hf_moe_offload.offload import get_offload_engine
from hf_moe_offload.offload.inference.device_cache import DeviceExpertCache
from hf_moe_offload.runtime import HappensBeforeError, aligned_nbytes, use_runtime
from hf_moe_offload.runtime.simulated import SimulatedRuntime

from moe_families import tiny_model
from test_offload import small_model

FAMILIES = ["moe_gpt", "qwen3_moe", "mixtral", "gpt_oss"]
NEW_TOKENS = 8


def _saved(family: str, path) -> dict:
    """A tiny causal LM of `family` saved at `path`, its resident greedy tokens and its expert sizes."""
    model = small_model(7, num_experts=8) if family == "moe_gpt" else tiny_model(family, seed=7)
    model.config.use_cache = True
    model.save_pretrained(path)
    model.eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    layers = experts_layers(model)
    numel = layers[0][2].numel
    return {"path": str(path), "prompt": prompt, "tokens": tokens, "expert_bytes": aligned_nbytes(numel, torch.float32),
            "experts": sum(layout.num_experts for _, _, layout in layers)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: _saved(family, root / family) for family in FAMILIES}


def _generate(lm: dict, tier: str, tmp_path, cache_bytes, pregate=None, host_cache=3,
              **runtime) -> tuple[torch.Tensor, object]:
    with use_runtime(SimulatedRuntime(seed=3, max_delay=runtime.pop("max_delay", 0.001), **runtime)):
        model = load_for_inference(lm["path"], tier, str(tmp_path / tier),
                                   host_cache_experts=host_cache if tier == "disk" else None, device="cpu",
                                   device_cache_bytes=cache_bytes, pregate=pregate)
        engine = get_offload_engine(model)
        with torch.no_grad():
            out = model.generate(lm["prompt"], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        engine.store.close()
    return out, engine


@pytest.mark.parametrize("cache", ["off", "quarter"])
@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_on_the_device_gives_the_resident_greedy_tokens(saved, family, tier, cache, tmp_path):
    """fp32, batch of 2: the same tokens as the resident model, with the device cache off and holding a quarter of
    the experts (it then serves hits, evicts, and never holds more than its budget)."""
    lm = saved[family]
    budget = 0 if cache == "off" else lm["experts"] // 4 * lm["expert_bytes"]
    out, engine = _generate(lm, tier, tmp_path, budget)
    assert engine.runtime.asynchronous and engine.stats.h2d_bytes > 0
    assert torch.equal(out, lm["tokens"])
    if cache == "off":
        assert engine.decoding.device_cache is None and engine.stats.device_cache_hits == 0
        return
    cached = engine.decoding.device_cache
    assert cached.capacity == lm["experts"] // 4 and cached.nbytes <= budget
    assert len(cached.slot_of) <= cached.capacity
    assert engine.stats.device_cache_hits > 0 and engine.stats.device_cache_evictions > 0


def test_the_default_device_cache_takes_half_the_free_device_memory(saved, tmp_path):
    """No budget given: half the device memory free when decoding starts, at most every expert."""
    lm = saved["qwen3_moe"]
    free = 6 * lm["expert_bytes"] + 5
    out, engine = _generate(lm, "host", tmp_path, None, free_memory=free)
    assert torch.equal(out, lm["tokens"])
    assert engine.decoding.device_cache.capacity == 3 and engine.decoding.device_cache.nbytes <= free // 2
    out, engine = _generate(lm, "host", tmp_path, None, free_memory=10**12)
    assert engine.decoding.device_cache.capacity == lm["experts"]  # everything fits: after the first uses, no uploads
    assert engine.stats.device_cache_evictions == 0
    # Uploads into the cache are enqueued for a layer's routed experts at once, not `prefetch_depth` ahead.
    assert engine.sources.peak_in_flight > engine.depth + 1


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_pregating_uploads_the_next_layers_guess_into_the_device_cache(saved, tier, tmp_path):
    """While a layer computes, pre-gating's guess of the next layer's experts is uploaded into the device cache
    after the layer's own uploads (those in host memory and admitted: a cache with room for every expert, since a
    guessed expert not used yet never outscores a cached one); the tokens stay the resident model's (the guess never
    decides the output). The disk tier's host cache holds every expert too: a guess is uploaded only from host
    memory, where layer l's own experts would otherwise keep the guessed ones out."""
    lm = saved["qwen3_moe"]
    out, engine = _generate(lm, tier, tmp_path, lm["experts"] * lm["expert_bytes"], pregate=True,
                            host_cache=lm["experts"])
    assert torch.equal(out, lm["tokens"])
    assert engine.decoding.pregate is not None and engine.stats.pregate_uploads > 0
    out, engine = _generate(lm, tier, tmp_path, lm["experts"] * lm["expert_bytes"], pregate=False)
    assert engine.decoding.pregate is None and engine.stats.pregate_uploads == 0


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("family,room", [("moe_gpt", 4), ("qwen3_moe", None)], ids=["evicting", "all-fit"])
def test_training_after_decoding_gives_the_cache_back(saved, family, room, autocast, tmp_path):
    """The cache lives while the engine decodes: a training call frees it (its memory is the training's), after
    compute's reads of its slots are done: the simulated device's `free` raises otherwise (the allocator could hand
    the memory to the copy stream at once). A cache that evicts and one every expert fits in (its copy stream then
    never waits for compute), pre-gating on; fp32 and bf16 autocast."""
    lm = saved[family]
    with use_runtime(SimulatedRuntime(seed=5, max_delay=0.001)), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model = load_for_inference(lm["path"], "host", str(tmp_path / "h"), None, device="cpu", pregate=True,
                                   device_cache_bytes=(room or lm["experts"]) * lm["expert_bytes"])
        engine = get_offload_engine(model)
        with torch.no_grad():
            model(lm["prompt"])
        assert engine.decoding.device_cache is not None
        model.train()
        loss = model(lm["prompt"], labels=lm["prompt"]).loss
        loss.backward()
        assert engine.decoding.device_cache is None and torch.isfinite(loss)
        engine.synchronize()
        engine.store.close()


def _no_slot_reuse_wait(self, slot):  # `_done` without its event: the next upload into the slot waits too early
    self.in_flight[slot] -= 1


def _no_upload_wait(self, key, version, src):  # a fresh upload handed to compute without its event
    kept = _original_upload(self, key, version, src)
    return None if kept is None else (kept[0], None, kept[2])


_original_upload = DeviceExpertCache.upload


@pytest.mark.parametrize("deleted", [("_done", _no_slot_reuse_wait), ("upload", _no_upload_wait)],
                         ids=["slot-reuse", "upload"])
def test_deleting_a_wait_of_the_device_cache_fails(saved, deleted, tmp_path, monkeypatch):
    """Each wait of the cache's pipeline is needed: without the slot-reuse wait an upload overwrites weights compute
    has not read yet; without the upload's wait compute reads a slot the copy has not filled. (A hit's wait for the
    slot's upload is one compute already did at the expert's first use.) The simulated device
    raises (or the late copy shows as NaN and the tokens change)."""
    lm = saved["moe_gpt"]
    monkeypatch.setattr(DeviceExpertCache, *deleted)
    with pytest.raises((HappensBeforeError, AssertionError)):
        out, _ = _generate(lm, "host", tmp_path, 3 * lm["expert_bytes"], max_delay=0.003)
        assert torch.equal(out, lm["tokens"])


def test_generate_command_on_the_device(tmp_path, capsys):
    """`hf-moe-offload generate --device` prints the device and the device cache's figures, and keeps the engine's
    log lines out of the streamed text."""
    from hf_moe_offload.cli.main import main
    from hf_moe_offload.data import gpt2_tokenizer

    tok = gpt2_tokenizer()
    small_model(7, vocab_size=len(tok), num_experts=6).save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    with use_runtime(SimulatedRuntime(seed=0, max_delay=0.0)):
        assert main(["generate", "--model-path", str(tmp_path / "lm"), "--prompt", "Once", "--max-new-tokens", "4",
                     "--offload", "host", "--device", "cpu", "--device-cache-mb", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("Once") and "on cpu" in captured.out
    assert "device cache hit rate" in captured.out
    assert "expert offload" not in captured.out + captured.err


def test_trainer_evaluation_on_the_device_uses_the_device_cache(tmp_path):
    """The recipes' and the main job's evaluation (`Trainer.evaluate`, under no_grad) decode-mode on the device too:
    the device cache serves it, and the loss is the resident model's."""
    import copy

    from datasets import Dataset
    from transformers import Trainer, TrainingArguments, default_data_collator

    from hf_moe_offload import OffloadConfig, enable_expert_offload

    reference = small_model(seed=5)
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 101, (6, 12), generator=torch.Generator().manual_seed(21))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    losses = []
    with use_runtime(SimulatedRuntime(seed=2, max_delay=0.0)):
        engine = enable_expert_offload(model, OffloadConfig(mode="host", device_cache_bytes=2**20))
        for m in (reference, model):
            args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_eval_batch_size=3, use_cpu=True,
                                     report_to=[])
            losses.append(Trainer(model=m, args=args, eval_dataset=data,
                                  data_collator=default_data_collator).evaluate()["eval_loss"])
    assert engine.decoding.device_cache is not None and engine.stats.device_cache_hits > 0
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)


def test_an_interrupted_decoding_call_gives_its_slots_back(saved, tmp_path, monkeypatch):
    """A call whose expert compute raises hands back what its stream had in flight: ring slots and device-cache slots
    (their uses never came), so the next calls decode the resident tokens with the full pipeline."""
    from hf_moe_offload.offload.streaming.streamed import OffloadedExpertsLayer

    lm = saved["qwen3_moe"]
    original = OffloadedExpertsLayer._compute
    failures = iter([True])

    def compute(self, *args):
        if next(failures, False):
            raise RuntimeError("expert compute failed")
        return original(self, *args)

    monkeypatch.setattr(OffloadedExpertsLayer, "_compute", compute)
    with use_runtime(SimulatedRuntime(seed=4, max_delay=0.001)):
        model = load_for_inference(lm["path"], "host", str(tmp_path / "h"), None, device="cpu",
                                   device_cache_bytes=2 * lm["expert_bytes"])
        engine = get_offload_engine(model)
        with torch.no_grad(), pytest.raises(RuntimeError, match="expert compute failed"):
            model(lm["prompt"])
        assert engine.stager.ring_in_flight == 0 and not any(engine.decoding.device_cache.in_flight)
        with torch.no_grad():
            out = model.generate(lm["prompt"], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        engine.store.close()
    assert torch.equal(out, lm["tokens"])


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("family", ["moe_gpt", "qwen3_moe"])
def test_decoding_under_autocast_with_the_device_cache(saved, family, tier, tmp_path):
    """Under CPU bf16 autocast (what a GPU user decodes with), the device cache holding a quarter of the experts: the
    experts go up as bf16 copies (the store's compute dtype: the weights autocast would cast) and every step's logits
    are the resident model's under the same autocast. Both sides run the same bf16 GEMMs on the same rows, so they
    agree to bf16 rounding of the logits (2^-7 of their largest magnitude, a few ulps); the greedy tokens equal."""
    from transformers import AutoModelForCausalLM

    lm = saved[family]
    resident = AutoModelForCausalLM.from_pretrained(lm["path"], experts_implementation="eager").eval()
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = resident.generate(lm["prompt"], **kwargs)
        with use_runtime(SimulatedRuntime(seed=3, max_delay=0.001)):
            model = load_for_inference(lm["path"], tier, str(tmp_path / tier), host_cache_experts=3 if tier == "disk"
                                       else None, device="cpu",
                                       device_cache_bytes=lm["experts"] // 4 * lm["expert_bytes"])
            engine = get_offload_engine(model)
            out = model.generate(lm["prompt"], **kwargs)
            engine.store.close()
    assert engine.store.compute_dtype == torch.bfloat16
    assert engine.stats.device_cache_hits > 0 and engine.stats.h2d_bytes > 0
    assert torch.equal(out.sequences, expected.sequences)
    for got, want in zip(out.scores, expected.scores):
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2**-7 * want.float().abs().max().item())


def test_the_device_cache_and_the_stagers_pinned_copies_take_turns(tmp_path):
    """While the device cache is open it holds decoding's device copies and the stager keeps none, even after a
    `synchronize()` (a save during evaluation); when training resumes the stager's pinned copies (ES-MoE §4.3's
    pins whose state is not on the device) come back at once, not at the next window's pin choice."""
    model = small_model(seed=3)
    # No device memory to spare for device pins: every pin is the stager's copy.
    with use_runtime(SimulatedRuntime(seed=1, max_delay=0.0, free_memory=1)):
        from hf_moe_offload import OffloadConfig, enable_expert_offload

        engine = enable_expert_offload(model, OffloadConfig(mode="host", pin_fraction=0.5, device_cache_bytes=2**20))
        x = torch.randint(0, 101, (4, 12), generator=torch.Generator().manual_seed(4))
        model(x, labels=x).loss.backward()
        engine.zero_grad()
        engine.pins.update()
        stager_pins = set(engine.stager.pinned_keys)
        assert engine.pins.pinned and stager_pins  # copies kept for pins whose state is not on the device
        model.eval()
        with torch.no_grad():
            model(x)
        assert engine.decoding.device_cache is not None and engine.stager.pinned_keys == set()
        engine.synchronize()
        assert engine.stager.pinned_keys == set()
        model.train()
        model(x, labels=x).loss.backward()
        assert engine.decoding.device_cache is None and engine.stager.pinned_keys == stager_pins
        engine.zero_grad()
        engine.synchronize()
