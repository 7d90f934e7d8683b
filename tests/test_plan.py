"""The engine's settings resolved once at bind (offload/plan.py): table-driven cases of `resolve_plan`, the errors it
raises, the plan an engine binds against its own attributes, and that nothing in the package asks the runtime whether
it is asynchronous except the resolver and the runtime itself."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch

from hf_moe_offload.offload.config import OffloadConfig
from hf_moe_offload.offload.plan import (GRADS_DOWNLOADED, GRADS_IN_PLACE, STAGE_MAX, Machine, StoreFacts,
                                         clamp_depth, resolve_plan)

CPU = Machine("cpu", asynchronous=False, free_memory=None)
SIMULATED = Machine("simulated", asynchronous=True, free_memory=None)
CUDA = Machine("cuda", asynchronous=True, free_memory=80 << 30)
NUMEL = 3 * 64 * 32  # a tiny expert's parameters


def host(**kw) -> StoreFacts:
    return StoreFacts("host", experts=32, numel=NUMEL, compute_dtype=torch.float32, row_dtype=torch.float32,
                      switches_compute_dtype=True, **kw)


def disk(cache: int, **kw) -> StoreFacts:
    return StoreFacts("disk", experts=32, numel=NUMEL, compute_dtype=torch.float32, row_dtype=torch.float32,
                      cache=cache, mappable=True, **kw)


def plan(machine, store, layer_experts=(16, 16), **config):
    cfg = OffloadConfig(**config)
    return resolve_plan(cfg, machine, store, list(layer_experts), clamp_depth(cfg.prefetch_depth, store.cache))


# (name, machine, store, config, what the plan must say)
CASES = [
    ("cpu host tier", CPU, host(), {}, dict(
        grouped_source="layer", stage_experts=1, slab_experts=0, device_pins=0, pin_limit=None,
        gradients=GRADS_IN_PLACE, keep_activations=True, map_files=False, pregate=False, measure_host_compute=False,
        decode_device_copies=False, limit_compute_threads=True, reuse_views=True, optimizer_workers=2)),
    ("cpu host tier, quantized rows", CPU, host(quantized=True, trainable=False), {}, dict(
        grouped_source="staged", stage_experts=STAGE_MAX, reuse_views=False)),
    ("cpu disk tier, half cached: staged chunks of a third of the room", CPU, disk(16), {}, dict(
        grouped_source="staged", stage_experts=(16 - 2 - 1) // 3, pin_limit=16 - 2 - 1 - 8, map_files=True,
        optimizer_workers=0, pregate=False, gradients=GRADS_IN_PLACE)),
    ("cpu disk tier, 3/8 cached: expert by expert", CPU, disk(12), {}, dict(
        grouped_source=None, stage_experts=1, pin_limit=12 - 2 - 1)),
    ("cpu disk tier, a cache of 3: no lookahead beyond one", CPU, disk(3), {}, dict(
        grouped_source=None, stage_experts=1, pin_limit=3 - 1 - 1)),
    ("cpu disk tier, pregate asked", CPU, disk(12), {"pregate": True, "mmap_weights": False}, dict(
        pregate=True, map_files=False)),
    ("simulated device, host tier: a whole layer per chunk", SIMULATED, host(), {}, dict(
        grouped_source="slab", slab_experts=16, device_pins=2 * 4, pin_limit=None, gradients=GRADS_DOWNLOADED,
        keep_activations=False, map_files=False, pregate=True, measure_host_compute=False,
        decode_device_copies=True, limit_compute_threads=False, reuse_views=False, optimizer_workers=2)),
    ("simulated device, compute on host asked", SIMULATED, host(), {"compute_on_host": True}, dict(
        measure_host_compute=True)),
    ("cuda, disk tier: the cache bounds the slab and the pins", CUDA, disk(12), {}, dict(
        grouped_source="slab", slab_experts=(12 - 2 - 1) // 2, pin_limit=12 - 2 - 1 - 8, device_pins=1,
        measure_host_compute=True, optimizer_workers=2)),
    ("cuda, a budget too small for two chunks of two", CUDA, host(), {"device_budget_bytes": 3 * NUMEL * 4}, dict(
        grouped_source=None, slab_experts=0, device_pins=0)),
    ("cuda, budget for the slab and one pin", CUDA, host(),
     {"device_budget_bytes": 2 * 16 * NUMEL * 4 + 20 * NUMEL}, dict(slab_experts=16, device_pins=1)),
    ("cuda, frozen experts: no device pins", CUDA, host(trainable=False), {}, dict(slab_experts=16, device_pins=0)),
    ("cuda, no pinning", CUDA, host(), {"pin_fraction": 0.0}, dict(slab_experts=16, device_pins=0)),
    ("cuda, stage_experts sets the slab's chunk", CUDA, host(), {"stage_experts": 4}, dict(slab_experts=4)),
]


@pytest.mark.parametrize("name, machine, store, config, want", CASES, ids=[c[0] for c in CASES])
def test_resolve_plan(name, machine, store, config, want):
    got = dataclasses.asdict(plan(machine, store, **config))
    assert {k: got[k] for k in want} == want


def test_shared_store_keeps_pins_state_on_the_host():
    cfg = OffloadConfig()
    assert resolve_plan(cfg, CUDA, host(), [16, 16], 2, shared_store=True).device_pins == 0
    assert resolve_plan(cfg, CUDA, host(), [16, 16], 2).device_pins == 8


def test_autocast_switches_the_streamed_copies_on_a_device_only():
    bf16 = dataclasses.replace(CUDA, autocast_dtype=torch.bfloat16)
    assert plan(bf16, host()).compute_dtype == torch.bfloat16
    assert plan(bf16, host(), compute_dtype=torch.float32).compute_dtype == torch.float32  # the user's setting stands
    assert plan(dataclasses.replace(CPU, autocast_dtype=torch.bfloat16), host()).compute_dtype == torch.float32
    assert plan(bf16, disk(12)).compute_dtype == torch.float32  # the disk tier's rows do not switch


@pytest.mark.parametrize("machine, store, config, message", [
    (CUDA, host(), {"keep_activations": True}, "keep_activations=True needs the experts computing on the CPU"),
    (CUDA, disk(12), {"mmap_weights": True}, "mmap_weights=True needs the disk tier computing on the CPU"),
    (CPU, host(), {"mmap_weights": True}, "mmap_weights=True needs the disk tier"),
    (CPU, host(), {"stage_experts": 2}, "applies to the disk tier computing on the CPU"),
    (CPU, disk(10), {"stage_experts": 4}, "needs a host cache of at least 11 experts"),
    (CUDA, disk(8), {"stage_experts": 3}, "needs a host cache of at least 9 experts"),
], ids=["keep-activations-on-device", "mmap-on-device", "mmap-host-tier", "stage-host-tier", "stage-disk-cpu",
        "stage-disk-device"])
def test_resolve_plan_refuses(machine, store, config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        plan(machine, store, **config)


def test_bound_engine_follows_its_plan(tmp_path):
    """The engine's parts are the plan's: a disk tier on the simulated device gets a slab of the plan's chunk and a
    device stager; on the CPU a host stager and staged chunks."""
    from hf_moe_offload import enable_expert_offload
    from hf_moe_offload.offload.streaming.transfers import DeviceStager, HostStager
    from hf_moe_offload.runtime import use_runtime
    from hf_moe_offload.runtime.simulated import SimulatedRuntime
    from moe_families import tiny_model

    for simulated in (False, True):
        model = tiny_model("qwen3_moe", num_hidden_layers=2)
        engine = enable_expert_offload(model, OffloadConfig(mode="disk", offload_dir=str(tmp_path / str(simulated)),
                                                            host_cache_experts=10))
        x = torch.randint(0, 96, (2, 7))
        runtime = SimulatedRuntime(seed=0) if simulated else None
        with use_runtime(runtime) if simulated else torch.enable_grad():
            model(x, labels=x).loss.backward()
            engine.synchronize()
        p = engine.plan
        assert isinstance(engine.stager, DeviceStager if simulated else HostStager)
        assert (engine.slab.experts if engine.slab is not None else 0) == p.slab_experts
        assert engine.stage_experts == p.stage_experts and engine.pin_limit == p.pin_limit
        assert p.grouped_source == ("slab" if simulated else "staged")


def test_only_the_resolver_and_the_runtime_ask_whether_the_device_is_asynchronous():
    """Everything after bind follows the plan's choices, and the pipelining asks the runtime for a side stream
    (`DeviceRuntime.side_stream`): the package reads `asynchronous` in offload/plan.py and runtime/ only."""
    root = pathlib.Path(__file__).resolve().parents[1] / "hf_moe_offload"
    allowed = {root / "offload" / "plan.py", *(root / "runtime").glob("*.py")}
    found = [f"{path.relative_to(root)}:{i}" for path in root.rglob("*.py") if path not in allowed
             for i, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\.asynchronous\b", line)]
    assert found == []
