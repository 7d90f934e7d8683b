"""What the expert optimizer sees of an offload engine (offload/updates.py, `ExpertUpdates`): the settings it reads
from the plan, which experts it steps where, the window's close, and that optim/ reaches the engine through nothing
else."""

from __future__ import annotations

import pathlib
import re

import torch

from hf_moe_offload import OffloadConfig, enable_expert_offload
from hf_moe_offload.offload.plan import OPTIMIZER_WORKERS
from hf_moe_offload.optim import ExpertOptimizer
from hf_moe_offload.runtime import use_runtime
from hf_moe_offload.runtime.simulated import SimulatedRuntime
from moe_families import tiny_model


class _Coordinator:
    """Two processes sharing the store, this one owning the even experts (what distributed's coordinator says)."""

    def __init__(self) -> None:
        self.closed = 0
        self.reduced: list[float] = []

    def owns_update(self, key) -> bool:
        return key[1] % 2 == 0

    def all_reduce_sum(self, value: float) -> float:
        self.reduced.append(value)
        return 2 * value

    def all_reduce_max(self, value: float) -> float:
        self.reduced.append(value)
        return max(value, 1.0)

    def pinned_keys(self):
        return []

    def window_closed(self) -> None:
        self.closed += 1


def _step(model, runtime=None):
    x = torch.randint(0, 96, (2, 7))
    with use_runtime(runtime) if runtime is not None else torch.enable_grad():
        model(x, labels=x).loss.backward()


def test_settings_come_from_the_plan(tmp_path):
    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    engine = enable_expert_offload(model, OffloadConfig(mode="disk", offload_dir=str(tmp_path), host_cache_experts=10))
    updates = engine.updates
    assert updates.default_workers() == OPTIMIZER_WORKERS  # before the first forward binds the engine
    assert updates.cache_room() == 10 - engine.depth - 1
    _step(model)
    engine.synchronize()
    assert updates.default_workers() == engine.plan.optimizer_workers == 0  # the disk tier computing on the CPU
    assert ExpertOptimizer(engine).workers == 0
    assert updates.layout(1) is engine.layers[1].layout

    host = tiny_model("qwen3_moe", num_hidden_layers=2)
    assert enable_expert_offload(host, OffloadConfig(mode="host")).updates.cache_room() is None


def test_a_shared_store_steps_only_what_this_process_owns():
    """With a coordinator, the optimizer steps the experts this process owns, reduces its norms through it and closes
    the window through it; the others' records stay untouched."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    engine = enable_expert_offload(model, OffloadConfig(mode="host"))
    coordinator = _Coordinator()
    engine.set_coordinator(coordinator)
    updates = engine.updates
    assert updates.shared and updates.owns((0, 2)) and not updates.owns((0, 3))
    before = {key: engine.store.read_param(key).clone() for key in engine.store.keys()}
    opt = ExpertOptimizer(engine, lr=1e-2, max_grad_norm=1.0)  # deferred: the norm is all-reduced
    _step(model)
    opt.step([])
    opt.synchronize()
    assert coordinator.closed == 1 and coordinator.reduced  # the window closed and the norm reduced through it
    for key in engine.store.keys():
        changed = not torch.equal(engine.store.read_param(key), before[key])
        assert changed == (updates.owns(key) and key in _used(engine)), key
    opt.close()


def _used(engine) -> set:
    return {(layer, e) for layer, state in enumerate(engine.layers) for e, n in enumerate(state.last_counts) if n}


def test_device_pinned_experts_step_on_the_device():
    """On an asynchronous device the optimizer asks the engine which experts live there and steps those in `step()`
    from their device records."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    engine = enable_expert_offload(model, OffloadConfig(mode="host", pin_fraction=0.25))
    opt = ExpertOptimizer(engine, lr=1e-2)
    runtime = SimulatedRuntime(seed=0)
    for _ in range(3):  # the pins follow the first windows' loads
        _step(model, runtime)
        with use_runtime(runtime):
            opt.step()
    keys = list(engine.store.keys())
    on_device = engine.updates.on_device(keys)
    assert on_device, "no device pins after three windows"
    key = sorted(on_device)[0]
    assert engine.updates.device_record(key) is engine.device_pins.record(key)
    opt.close()
    engine.synchronize()


def test_the_optimizer_reaches_the_engine_only_through_its_surface():
    """optim/ reads `engine.updates` (and, for the Trainer's glue, the store, the barrier and the counters): not the
    engine's parts, plan, pins or coordinator."""
    root = pathlib.Path(__file__).resolve().parents[1] / "hf_moe_offload" / "optim"
    public = {"updates", "store", "synchronize", "stats"}
    found = {f"{path.name}:{i}: engine.{name}" for path in root.glob("*.py")
             for i, line in enumerate(path.read_text().splitlines(), 1)
             for name in re.findall(r"\bengine\.(\w+)", line) if name not in public}
    assert found == set()
