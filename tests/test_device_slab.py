"""Layer-granular streaming on an asynchronous device (issue 35; hf_moe_offload/offload/streaming/slab.py), proven on the CPU
with the simulated device: a training call uploads a layer's routed experts into one device block per chunk, runs
each chunk as one grouped GEMM per matmul and sends its gradients down as one block.

(a) the work dispatched per training step does not grow with the number of experts (`GemmCounter.ops`, a
    TorchDispatchMode count);
(b) bytes up: the routed experts' weights in the compute dtype once, plus what backward uploads again (counted);
    bytes down: the routed experts' gradients once, in the dtype autocast produced them in;
(c) deleting any one wait of the pipeline fails;
(d) training equals torch.optim.AdamW, fp32 and bf16 autocast, accumulation and global clipping, MoE-GPT and
    Qwen3-MoE, host and disk tier;
(e) pinned experts live on the device and step there (offload/pins/device_pins.py): no transfers, no host Adam.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, enable_expert_offload
from hf_moe_offload.offload.streaming.streamed import OffloadedExpertsLayer
from hf_moe_offload.offload.streaming.transfers import GradRing
from hf_moe_offload.offload.streaming.slab import DeviceSlab
from hf_moe_offload.precision import GemmCounter
from hf_moe_offload.runtime import HappensBeforeError, use_runtime
from hf_moe_offload.runtime.base import InlineRuntime
from hf_moe_offload.runtime.simulated import SimulatedRuntime

from moe_families import VOCAB, tiny_model
from numerics import assert_within_adam_drift
from test_benchmarks import bench
from test_expert_optimizer import count_expert_paths, param_groups, step_both
from test_offload import small_model


def _qwen3(num_experts: int, layers: int = 2, seed: int = 0):
    return tiny_model("qwen3_moe", seed=seed, num_experts=num_experts, num_hidden_layers=layers)


def _slab_calls(monkeypatch) -> dict[str, int]:
    return count_expert_paths(monkeypatch, ("_slab_forward", "_slab_backward", "run_forward", "run_backward"))


def _routed(model, engine) -> list[int]:
    return [sum(1 for n in layer.last_counts if n) for layer in engine.layers]


# --- (a) ---
def test_work_per_training_step_does_not_grow_with_the_number_of_experts(monkeypatch):
    """Qwen3-MoE with 8, 32 and 128 experts per layer, host tier, 8 rows per expert (every expert routed): the
    forward and backward of a training step dispatch the same ops, the same number of times, on the compute thread
    (the per-expert loop: ~60 more per expert and layer, benchmarks/slab_dispatch.py), and copy the same number of
    times. (Experts without rows between routed ones split the upload into one copy per run of adjacent routed
    experts.)"""
    calls = _slab_calls(monkeypatch)
    counts, copies = {}, {}
    for experts in (8, 32, 128):
        with use_runtime(SimulatedRuntime(seed=1, max_delay=0.0)) as rt:
            model = _qwen3(experts)
            bench("slab_dispatch").round_robin_routing(model, experts)
            engine = enable_expert_offload(model, OffloadConfig(mode="host", pin_fraction=0.0))
            x = torch.randint(0, VOCAB, (experts // 4, 16), generator=torch.Generator().manual_seed(2))
            with torch.no_grad():
                model(x[:1, :4])  # binds the engine (and its slab) outside the count
            before = rt.copies
            with GemmCounter() as mode:
                model(x, labels=x).loss.backward()
            engine.synchronize()
            assert all(n == experts for n in _routed(model, engine))
            assert engine.slab.experts == experts  # the whole layer in one chunk
            counts[experts], copies[experts] = mode.ops, rt.copies - before
    assert calls["run_backward"] == 0 and calls["_slab_forward"] == calls["_slab_backward"] == 3 * 2
    assert counts[8] == counts[32] == counts[128], {e: sum(c.values()) for e, c in counts.items()}
    # Per layer: the weights up in one copy (the backward finds both layers still in the slab's two blocks), the
    # gradients down in one.
    assert copies[8] == copies[32] == copies[128] == 2 * 2


# --- (b) ---
@pytest.mark.parametrize("autocast,compute_dtype,streamed", [
    (None, None, torch.float32),
    (torch.bfloat16, None, torch.bfloat16),  # the default under autocast on a device: the autocast dtype
    (torch.bfloat16, torch.float32, torch.float32),  # set: fp32 weights up, autocast casts them on the device
])
def test_bytes_moved_are_the_routed_experts_once(autocast, compute_dtype, streamed):
    """Three layers, so that the slab's two blocks no longer hold layer 0's experts when its backward comes: H2D is
    every routed expert's weights once in the streamed dtype plus layer 0's again in backward
    (`h2d_reupload_bytes`); D2H is every routed expert's gradient once, in the dtype the GEMMs produced it in (that of
    the streamed weights). Under autocast the copies default to the autocast dtype (issue 35)."""
    with use_runtime(SimulatedRuntime(seed=2, max_delay=0.001)):
        model = _qwen3(8, layers=3)
        engine = enable_expert_offload(model, OffloadConfig(mode="host", pin_fraction=0.0,
                                                            compute_dtype=compute_dtype))
        x = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(3))
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(x, labels=x).loss
        loss.backward()
        engine.synchronize()
        assert engine.store.compute_dtype == streamed
        width = streamed.itemsize * engine.store.numel
        routed = _routed(model, engine)
        assert engine.stats.h2d_reupload_bytes == routed[0] * width
        assert engine.stats.h2d_bytes == (sum(routed) + routed[0]) * width
        assert engine.stats.d2h_bytes == sum(routed) * width
        assert set(engine.gradients.rings) == {streamed}
        record = engine.store.acquire((0, 0))
        assert record.param.dtype == torch.float32 and torch.equal(record.compute_param(), record.param.to(streamed))
        engine.store.release((0, 0))


@pytest.mark.parametrize("pin_fraction,chunk,checkpointing", [
    (0.0, None, False), (0.25, None, True), (0.0, 3, False), (0.0, 3, True)])
def test_uploads_per_training_step_are_at_their_floor(pin_fraction, chunk, checkpointing):
    """Bytes uploaded per training step (bf16 copies, 3 layers x 8 experts, all routed, the second step: pins up)
    against what each pass needs. F = the routed experts not pinned on the device, all layers. The forward uploads
    F; a backward (or checkpointing's recompute) uploads them again except what a slab block still holds from the
    pass before: the last two chunks (two whole layers, where a chunk is a layer). With checkpointing the backward
    of each layer finds its recompute's last two chunks. The floor the engine is held to, each routed expert once per
    pass that computes it (2F; 3F with the recompute), is then met within 1.3x (here below it)."""
    layers, experts = 3, 8
    with use_runtime(SimulatedRuntime(seed=3, max_delay=0.0)):
        model = _qwen3(experts, layers=layers)
        bench("slab_dispatch").round_robin_routing(model, experts)
        if checkpointing:
            model.gradient_checkpointing_enable()
        config = OffloadConfig(mode="host", pin_fraction=pin_fraction, compute_dtype=torch.bfloat16,
                               **({} if chunk is None else {"stage_experts": chunk}))
        engine = enable_expert_offload(model, config)
        model.train()
        opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), ExpertOptimizer(engine, lr=1e-3))
        x = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(4))
        for _ in range(2):
            engine.stats.reset()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, labels=x).loss
            pinned = [sum(1 for key in (engine.device_pins.keys() if engine.device_pins else ()) if key[0] == layer)
                      for layer in range(layers)]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            engine.step_barrier()
        assert _routed(model, engine) == [experts] * layers
        assert sum(pinned) == (layers * 2 if pin_fraction else 0)
        u = [experts - p for p in pinned]  # uploaded per layer and pass
        k = chunk or experts
        tail = k + (experts % k or k) if k < experts else None  # rows in a layer's last two chunks
        held = u[-1] + u[-2] if tail is None else tail  # what the turnaround finds in the slab's two blocks
        if not checkpointing:
            expected = 2 * sum(u) - held
        elif tail is None:  # the recompute finds the last two layers; each backward its recompute's layer
            expected = 2 * sum(u) - held
        else:  # the recompute runs its chunks in forward order: each backward finds that layer's last two
            expected = 3 * sum(u) - layers * tail
        width = 2 * engine.store.numel
        assert engine.stats.h2d_bytes == expected * width, (engine.stats.h2d_bytes / width, expected)
        floor = (3 if checkpointing else 2) * sum(u) * width
        assert engine.stats.h2d_bytes <= 1.3 * floor


def test_compute_copies_default_to_the_autocast_dtype_on_both_tiers(tmp_path):
    """The switch at the first forward on a device under autocast (`ExpertStore.use_compute_dtype`): host and disk
    tier records get bf16 copies equal to their fp32 weights cast (what autocast computes with), the disk tier's
    cached records included; on the CPU's inline runtime nothing changes (the host computes there: no upload)."""
    for tier in ("host", "disk"):
        with use_runtime(SimulatedRuntime(seed=4, max_delay=0.0)):
            model = _qwen3(6)
            engine = enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=str(tmp_path / tier),
                                                                host_cache_experts=12, prefetch_depth=1))
            x = torch.randint(0, VOCAB, (2, 7))
            with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
                model(x)
            assert engine.store.compute_dtype == torch.bfloat16
            for key in engine.store.keys():
                record = engine.store.acquire(key)
                assert torch.equal(record.compute_param(), record.param.to(torch.bfloat16)), key
                engine.store.release(key)
    with use_runtime(InlineRuntime()):  # the CPU's own runtime, also where the suite runs simulated
        model = _qwen3(6)
        engine = enable_expert_offload(model, OffloadConfig(mode="host"))
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            model(torch.randint(0, VOCAB, (2, 7)))
    assert engine.store.compute_dtype == torch.float32


def test_the_slab_takes_a_quarter_of_the_free_device_memory():
    """Two blocks of k experts, k bounded by a quarter of the memory the device reports free at bind (here the
    simulated device's), or by `device_budget_bytes` when set; where not even chunks of two fit, no slab (the
    per-expert loop)."""
    def slab_experts(free_memory, budget=None):
        with use_runtime(SimulatedRuntime(seed=0, max_delay=0.0, free_memory=free_memory)):
            model = _qwen3(8)
            engine = enable_expert_offload(model, OffloadConfig(mode="host", pin_fraction=0.0,
                                                                device_budget_bytes=budget))
            with torch.no_grad():
                model(torch.randint(0, VOCAB, (1, 4)))
            per_expert = 2 * engine.store.numel * engine.store.compute_dtype.itemsize  # a row in each block
            return engine.slab.experts if engine.slab is not None else None, per_expert

    _, per_expert = slab_experts(None)
    assert slab_experts(None)[0] == 8  # unbounded: the whole layer
    assert slab_experts(4 * 3 * per_expert)[0] == 3
    assert slab_experts(4 * 3 * per_expert, budget=5 * per_expert)[0] == 5
    assert slab_experts(4 * per_expert)[0] is None


# --- (c) ---
def _train_step(tier: str, tmp_path, rt) -> None:
    """Two training steps, chunks of 2 experts (3 per layer: each block is reused within a layer's pass)."""
    with use_runtime(rt):
        reference = small_model()
        model = copy.deepcopy(reference)
        engine = enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=str(tmp_path / "e"),
                                                            host_cache_experts=8, prefetch_depth=1,
                                                            pin_fraction=0.0, stage_experts=2))
        opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), ExpertOptimizer(engine, lr=1e-2))
        for seed in (0, 1):
            x = torch.randint(0, 101, (3, 11), generator=torch.Generator().manual_seed(seed))
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        engine.synchronize()
        assert engine.slab is not None and engine.stats.d2h_bytes > 0


def _no_upload_wait(self, index, rows):  # DeviceSlab.wait minus its wait_event
    self.rt.access(rows)


def _no_reuse_event(self, index):  # DeviceSlab.done minus its record: the next upload into the block waits for nothing
    pass


def _no_download_order(self, flat):  # GradRing.send minus `wait_stream`: the copy may read before compute wrote
    with self._cond:
        i = self._free.pop()
    buffer = self.buffers[i][: flat.numel()]
    self.rt.copy_(buffer, flat, self.stream)
    from hf_moe_offload.offload.streaming.transfers import GradArrival

    return GradArrival(self.rt, buffer, self.rt.record(self.stream), lambda: self._give_back(i))


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("target,name,deleted", [
    (DeviceSlab, "wait", _no_upload_wait),
    (DeviceSlab, "done", _no_reuse_event),
    (GradRing, "send", _no_download_order),
])
def test_deleting_a_wait_of_the_slab_pipeline_fails(target, name, deleted, tier, tmp_path, monkeypatch):
    _train_step(tier, tmp_path / "ok", SimulatedRuntime(seed=5, max_delay=0.002))  # intact: it runs
    monkeypatch.setattr(target, name, deleted)
    with pytest.raises(HappensBeforeError):
        _train_step(tier, tmp_path / "cut", SimulatedRuntime(seed=5, max_delay=0.002))


def _frozen_backward(tmp_path, rt, stage_experts: int | None, cache: int) -> None:
    """Two backwards of frozen experts (LoRA's case) on the disk tier with a tight cache: each record the backward's
    stream hands over goes back through `DeviceGradients.release_record`, and its memory is soon read into again."""
    with use_runtime(rt):
        model = tiny_model("qwen3_moe", num_hidden_layers=3, num_experts=8)
        engine = enable_expert_offload(model, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "e"),
                                                            host_cache_experts=cache, prefetch_depth=1,
                                                            pin_fraction=0.0, stage_experts=stage_experts,
                                                            train_experts=False))
        for seed in (0, 1):
            x = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(seed))
            model(x, labels=x).loss.backward()
        engine.synchronize()
        assert (engine.slab is not None) == (stage_experts is not None)


def _release_at_once(self, key, record):  # DeviceGradients.release_record minus its event
    if record is not None:
        self.release_after(key, None)


@pytest.mark.parametrize("stage_experts,cache", [(2, 6), (None, 3)], ids=["slab", "expert by expert"])
def test_deleting_the_release_wait_of_frozen_experts_fails(stage_experts, cache, tmp_path, monkeypatch):
    """A record handed back after a backward used it waits for the compute enqueued so far (and so for its upload):
    released at once, the disk tier reads another expert into it while the upload may still be reading it (the upload
    reads the record's row through a view made for the copy: the simulation's `track_views` remembers that read)."""
    from hf_moe_offload.offload.streaming.gradients import DeviceGradients

    _frozen_backward(tmp_path / "ok", SimulatedRuntime(seed=5, max_delay=0.002, track_views=True), stage_experts,
                     cache)
    monkeypatch.setattr(DeviceGradients, "release_record", _release_at_once)
    with pytest.raises(HappensBeforeError, match="reused while still in use"):
        _frozen_backward(tmp_path / "cut", SimulatedRuntime(seed=5, max_delay=0.002, track_views=True),
                         stage_experts, cache)


# --- (d) ---
FAMILIES = {"moe_gpt": lambda seed: small_model(seed=seed), "qwen3_moe": lambda seed: _qwen3(6, seed=seed)}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("autocast,clip", [(None, None), (None, 0.05), (torch.bfloat16, 0.05)])
def test_slab_training_equals_torch_adamw(family, tier, autocast, clip, tmp_path, monkeypatch):
    """3 optimizer steps x 2 accumulated micro-steps on fresh random batches, weight decay, global clipping
    (deferred expert steps) or none (eager), pins on: losses and weights against torch.optim.AdamW on the resident
    model (biases and norms not decayed, as the expert optimizer does). The slab computes each layer's experts as
    grouped GEMMs where the resident model loops or groups them otherwise, so the two round differently: weights within what Adam can move an element, all but 1% within 2e-6
    in fp32 (lr/10 under bf16, 10%; tests/numerics.py), losses 1e-5 apart in fp32 and 2e-3 under bf16."""
    calls = _slab_calls(monkeypatch)
    vocab = 101 if family == "moe_gpt" else VOCAB
    with use_runtime(SimulatedRuntime(seed=6, max_delay=0.001)):
        reference = FAMILIES[family](7)
        model = copy.deepcopy(reference)
        engine = enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=str(tmp_path / "e"),
                                                            host_cache_experts=8, prefetch_depth=1,
                                                            pin_fraction=0.25))
        ref_opt = torch.optim.AdamW(param_groups(reference, 0.1), lr=1e-2)
        last_micro_step = [False]
        experts = ExpertOptimizer(engine, lr=1e-2, weight_decay=0.1, max_grad_norm=clip,
                                  boundary_fn=lambda: last_micro_step[0])
        opt = ExpertAwareOptimizer(torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2), experts)
        g = torch.Generator().manual_seed(8)
        for _ in range(3):
            for micro in range(2):
                last_micro_step[0] = micro == 1
                x = torch.randint(0, vocab, (2, 11), generator=g)
                losses = []
                for m in (reference, model):
                    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                        loss = m(x, labels=x).loss / 2
                    loss.backward()
                    losses.append(loss.item())
                assert abs(losses[0] - losses[1]) <= (1e-5 if autocast is None else 2e-3)
            step_both(reference, ref_opt, opt, clip)
            engine.pins.update()
        if tier == "host":  # the disk tier's cache of 8 leaves no room for pins beside the slab's chunks
            assert len(engine.device_pins) > 0  # pinned experts trained on the device
        engine.synchronize()
        assert set(engine.store.steps.values()) == {3}
        assert calls["run_forward"] == 0 and calls["_slab_forward"] > 0
        if autocast is None:
            assert_within_adam_drift(model, reference, 1e-2, 3, weight_decay=0.1, atol=2e-6, outliers=0.01)
        else:
            assert_within_adam_drift(model, reference, 1e-2, 3, weight_decay=0.1, outliers=0.1)
        experts.close()


def _slow_steps_then_forward(tmp_path, monkeypatch) -> None:
    """Each expert step takes 20 ms more (the host Adam still running when the next forward starts): after one
    eager step, the next forward's loss equals the reference's (plain AdamW) within 1e-5."""
    from hf_moe_offload.optim.expert_optimizer import ExpertOptimizer as Opt

    original = Opt._adam_many

    def slow(self, steps, lr, *scaling):
        time.sleep(0.02)
        return original(self, steps, lr, *scaling)

    monkeypatch.setattr(Opt, "_adam_many", slow)
    with use_runtime(SimulatedRuntime(seed=9, max_delay=0.001)):
        reference = small_model(seed=3)
        model = copy.deepcopy(reference)
        engine = enable_expert_offload(model, OffloadConfig(mode="host", pin_fraction=0.0))
        opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0),
                                   ExpertOptimizer(engine, lr=1e-2, workers=1))
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
        x = torch.randint(0, 101, (3, 11), generator=torch.Generator().manual_seed(4))
        try:
            for m, o in ((reference, ref_opt), (model, opt)):
                m(x, labels=x).loss.backward()
                o.step()  # the expert steps run on the worker, 20 ms each
                o.zero_grad()
            calls = _slab_calls(monkeypatch)
            loss = model(x, labels=x).loss  # a training call: through the slab
            assert calls["_slab_forward"] == len(engine.layers)
            assert abs(loss.item() - reference(x, labels=x).loss.item()) <= 1e-5
        finally:
            opt.expert_optimizer.close()  # its worker done before the next test (whatever failed here)


def test_the_next_forward_waits_for_each_experts_update(tmp_path, monkeypatch):
    """No staleness (DESIGN.md): a training forward's upload waits for the expert's pending update. Deleting that
    wait (UpdateLedger.wait_for_update) makes the upload read weights the host Adam is still writing: the simulated
    device raises, or the loss is the stale weights'."""
    from hf_moe_offload.offload.ledger import UpdateLedger

    _slow_steps_then_forward(tmp_path, monkeypatch)
    monkeypatch.setattr(UpdateLedger, "wait_for_update", lambda self, key: None)
    with pytest.raises((HappensBeforeError, AssertionError)):
        _slow_steps_then_forward(tmp_path, monkeypatch)


# --- (e) ---
def test_device_pinned_experts_move_no_bytes_and_step_on_the_device(monkeypatch):
    """At a first window's close the best-loaded quarter of each layer's experts is pinned; the next forward brings
    their whole state to the device. In that window's step: the bytes up are the other routed experts' weights only,
    the bytes down their gradients only; the host Adam never sees a pinned expert and every pinned expert steps once,
    from its device record; the stores' rows of pinned experts are left alone until they come home (`synchronize`), holding then what
    the device computed."""
    from hf_moe_offload.optim.expert_optimizer import ExpertOptimizer as Opt

    stepped: list = []
    original = Opt._adam_many
    mine: list = []

    def spy(self, steps, lr, *scaling):
        if self in mine:  # (not a worker some earlier test left running)
            stepped.extend((key, record) for key, record, _ in steps)
        return original(self, steps, lr, *scaling)

    monkeypatch.setattr(Opt, "_adam_many", spy)
    with use_runtime(SimulatedRuntime(seed=3, max_delay=0.001)):
        model = _qwen3(8)
        engine = enable_expert_offload(model, OffloadConfig(mode="host", pin_fraction=0.25))
        opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), ExpertOptimizer(engine, lr=1e-2))
        mine.append(opt.expert_optimizer)
        g = torch.Generator().manual_seed(5)
        for window in range(2):
            x = torch.randint(0, VOCAB, (4, 16), generator=g)
            engine.stats.reset()
            stepped.clear()
            host_rows = {key: engine.store.read_param(key) for key in engine.store.keys()} if window else None
            model(x, labels=x).loss.backward()
            pins = set(engine.device_pins.keys())  # those chosen at the last close: up since this forward
            if window == 1:
                assert len(pins) == 4  # 2 of 8 experts in each of 2 layers
                width = engine.store.numel * 4
                routed = [(layer.layer, e) for layer in engine.layers for e, n in enumerate(layer.last_counts) if n]
                host_routed = [key for key in routed if key not in pins]
                assert len(host_routed) < len(routed)
                assert engine.stats.h2d_bytes == len(host_routed) * width  # both layers stay in the slab's blocks
                assert engine.stats.d2h_bytes == len(host_routed) * width
            opt.step()
            opt.zero_grad()
            engine.wait_in_flight()
            if window == 1:
                keys = [key for key, _ in stepped]
                assert sorted(keys) == sorted(set(keys))  # each expert once
                assert {key for key, record in stepped if record is engine.device_pins.records.get(key)} == pins
                assert set(engine.store.steps.values()) == {2}
                device = {key: engine.device_pins.record(key).param.clone() for key in pins}
                for key in pins:  # the store's copy is the one from before this window's step
                    assert torch.equal(engine.store.read_param(key), host_rows[key])
                engine.synchronize()
                assert len(engine.device_pins) == 0
                for key in pins:
                    assert torch.equal(engine.store.read_param(key), device[key])
        opt.expert_optimizer.close()


@pytest.mark.parametrize("clip", [None, 0.05])
def test_pins_coming_home_mid_training_change_nothing(clip):
    """`synchronize()` (what a save does) between windows sends the device pins' state home; the next forward brings
    it up again. Three windows with a synchronize after the first two equal torch.optim.AdamW (fp32:
    all but 1% of the weights within 2e-6, every one within what Adam can move it)."""
    with use_runtime(SimulatedRuntime(seed=8, max_delay=0.001)):
        reference = small_model(seed=2)
        model = copy.deepcopy(reference)
        engine = enable_expert_offload(model, OffloadConfig(mode="host", pin_fraction=0.5))
        ref_opt = torch.optim.AdamW(param_groups(reference, 0.1), lr=1e-2)
        opt = ExpertAwareOptimizer(torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2),
                                   ExpertOptimizer(engine, lr=1e-2, weight_decay=0.1, max_grad_norm=clip))
        g = torch.Generator().manual_seed(11)
        moved = []
        for window in range(3):
            x = torch.randint(0, 101, (3, 11), generator=g)
            for m in (reference, model):
                m(x, labels=x).loss.backward()
            moved.append(len(engine.device_pins))  # pins up since this forward
            step_both(reference, ref_opt, opt, clip)
            if window < 2:
                engine.synchronize()
                assert len(engine.device_pins) == 0
        assert moved == [0, 6, 6]  # ceil(0.5 x 6) per layer, chosen at the first close, up again after each home
        assert_within_adam_drift(model, reference, 1e-2, 3, weight_decay=0.1, atol=2e-6, outliers=0.01)
        opt.expert_optimizer.close()


def test_device_pins_fit_beside_the_slab_in_the_device_budget():
    """The pins' state (16 bytes per parameter, and the compute copy's) shares the device budget with the slab's
    two blocks: as many pins as fit beside them; none where the slab takes it all."""
    numel = enable_expert_offload(_qwen3(8), OffloadConfig(mode="host")).store.numel

    def pins(budget_experts: float | None):
        with use_runtime(SimulatedRuntime(seed=0, max_delay=0.0)):
            model = _qwen3(8)
            slab = 2 * 2 * numel * 4  # two blocks of two experts (set below), fp32
            budget = None if budget_experts is None else int(slab + budget_experts * 16 * numel)
            engine = enable_expert_offload(model, OffloadConfig(mode="host", pin_fraction=0.25, stage_experts=2,
                                                                device_budget_bytes=budget))
            with torch.no_grad():
                model(torch.randint(0, VOCAB, (1, 4)))
            return None if engine.device_pins is None else engine.device_pins.capacity

    assert pins(None) == 4  # unbounded: every pin (2 of 8 experts in each of 2 layers)
    assert pins(3.5) == 3
    assert pins(0) is None


def test_evaluation_between_steps_leaves_device_pins_out_of_the_device_cache():
    """Evaluation between training steps on a device (the Trainer's order: step, evaluate, next step): the experts
    pinned with their state on the device are neither looked up in nor uploaded into the device cache (pre-gating's
    guesses skip them too: their host rows are stale while pinned); evaluation gives the same loss as with the device
    cache off, every cache slot comes back, and training resumes with the cache closed."""
    losses = []
    for cache_bytes in (0, 2**22):
        with use_runtime(SimulatedRuntime(seed=6, max_delay=0.001)):
            model = _qwen3(8, seed=2)
            engine = enable_expert_offload(model, OffloadConfig(mode="host", pin_fraction=0.25, pregate=True,
                                                                device_cache_bytes=cache_bytes))
            opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                       ExpertOptimizer(engine, lr=1e-2))
            g = torch.Generator().manual_seed(7)
            for _ in range(3):
                x = torch.randint(0, VOCAB, (4, 16), generator=g)
                model(x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
            pins = set(engine.device_pins.keys())  # up since the last training forward, stepped on the device
            assert pins
            model.eval()
            with torch.no_grad():
                losses.append(model(x, labels=x).loss.item())
            if cache_bytes:
                cache = engine.decoding.device_cache
                assert cache is not None and cache.slot_of and not pins & set(cache.slot_of)
                assert not any(cache.in_flight)
            model.train()
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            assert engine.decoding.device_cache is None
            engine.synchronize()
    assert losses[0] == losses[1]


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_evaluating_between_backward_and_step_on_a_device(autocast, clip):
    """An evaluation between a backward and its optimizer step (uploads that no gradient download orders) is
    followed by a step whose host writes wait for them (`OffloadEngine.wait_for_uploads`): without that wait the
    simulated device raises at the first host write to a record an evaluation upload read. Training with such
    evaluations equals torch.optim.AdamW on the resident model, fp32 and under bf16 autocast, eager (no clipping)
    and deferred (global clipping) expert steps; 3 steps on fresh batches. Deferred, the evaluation's loss equals the
    reference's too (eager steps the experts during the backward: the evaluation sees them stepped, as documented in
    docs/expert-optimizer.md). Weights as in `test_slab_training_equals_torch_adamw` (all but 1% within 2e-6 in
    fp32; lr/10, 10% under bf16), losses 1e-5 apart in fp32, 2e-3 under bf16."""
    tol = 1e-5 if autocast is None else 2e-3
    with use_runtime(SimulatedRuntime(seed=6, max_delay=0.001)):
        reference = _qwen3(8, seed=2)
        model = copy.deepcopy(reference)
        engine = enable_expert_offload(model, OffloadConfig(mode="host", pin_fraction=0.25))
        ref_opt = torch.optim.AdamW(param_groups(reference, 0.0), lr=1e-2, weight_decay=0.0)
        experts = ExpertOptimizer(engine, lr=1e-2, weight_decay=0.0, max_grad_norm=clip)
        opt = ExpertAwareOptimizer(torch.optim.AdamW(param_groups(model, 0.0), lr=1e-2, weight_decay=0.0), experts)
        assert experts.eager == (clip is None)
        g = torch.Generator().manual_seed(7)
        for step in range(3):
            x = torch.randint(0, VOCAB, (4, 16), generator=g)
            losses = []
            for m in (reference, model):
                with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                    loss = m(x, labels=x).loss
                loss.backward()
                losses.append(loss.item())
            assert abs(losses[0] - losses[1]) <= tol
            if step >= 1:
                evaluated = []
                for m in (reference, model):
                    m.eval()
                    with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                                                         enabled=autocast is not None):
                        evaluated.append(m(x, labels=x).loss.item())
                    m.train()
                if clip is not None:
                    assert abs(evaluated[0] - evaluated[1]) <= tol
            step_both(reference, ref_opt, opt, clip)
        engine.synchronize()
        if autocast is None:
            assert_within_adam_drift(model, reference, 1e-2, 3, atol=2e-6, outliers=0.01)
        else:
            assert_within_adam_drift(model, reference, 1e-2, 3, outliers=0.1)
        experts.close()


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_timing_a_step_with_the_step_barrier_leaves_the_device_pins_in_place(tier, autocast, tmp_path):
    """A loop that waits at every step (to time or log it) with `engine.step_barrier()` moves no pinned expert's
    state once the pins are placed: only the routed experts go up and their gradients down (with bf16 copies under
    CPU autocast too). `synchronize()` (saves, loads) sends the pins' whole state home and the next forward brings it
    back: the contrast shows what is counted. The resident engine's barrier (the GPU's synchronize) is a no-op
    without a GPU, checked last."""
    model = _qwen3(16, layers=2)
    with use_runtime(SimulatedRuntime(seed=4, max_delay=0.0005)):
        engine = enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=str(tmp_path / "experts"),
                                                            host_cache_experts=16, pin_fraction=0.25))
        opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   ExpertOptimizer(engine, lr=1e-3))
        gen = torch.Generator().manual_seed(2)

        def step(barrier) -> int:
            before = engine.stats.pin_move_bytes
            ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            barrier()
            return engine.stats.pin_move_bytes - before

        for _ in range(3):  # the pins are chosen from the first step's counts and come up at the next forward
            step(engine.step_barrier)
        assert engine.device_pins is not None and len(engine.device_pins) > 0
        moved = [step(engine.step_barrier) for _ in range(3)]
        assert moved == [0, 0, 0]
        with_synchronize = [step(engine.synchronize) for _ in range(2)]
        assert all(m > 0 for m in with_synchronize), with_synchronize
        if autocast:  # the streamed copies were the autocast dtype's
            assert engine.store.compute_dtype == torch.bfloat16
    from hf_moe_offload.offload.resident import ResidentEngine
    from hf_moe_offload.offload.telemetry import OffloadStats

    ResidentEngine(OffloadStats()).step_barrier()
