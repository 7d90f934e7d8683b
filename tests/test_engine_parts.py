"""The offload engine's parts receive what they use when the engine composes them (offload/engine.py,
offload/resources.py): no part holds the engine or reaches another part through it, and a replaced store reaches
every part at once."""

from __future__ import annotations

import contextlib
import copy
import inspect

import pytest
import torch

from hf_moe_offload import OffloadConfig, enable_expert_offload
from hf_moe_offload.offload import OffloadEngine
from hf_moe_offload.offload.copies import copy_store
from hf_moe_offload.runtime import use_runtime
from hf_moe_offload.runtime.simulated import SimulatedRuntime

from test_offload import ATOL, small_model, store_grads_vs_reference

PARTS = ("sources", "gradients", "decoding", "pins")
# The engine's own calls a part may be handed (bound methods): record releases, its host worker, its in-flight wait.
ENGINE_CALLS = {"release_after", "submit_host", "wait_in_flight"}


def _offloaded(tier: str, tmp_path, cache: int = 8):
    reference = small_model()
    model = copy.deepcopy(reference)
    engine = enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=str(tmp_path / "experts"),
                                                        host_cache_experts=cache, prefetch_depth=1,
                                                        pin_fraction=0.25))
    return reference, model, engine


def _step(reference, model, seed: int) -> None:
    x = torch.randint(0, 101, (3, 11), generator=torch.Generator().manual_seed(seed))
    for m in (reference, model):
        m(x, labels=x).loss.backward()


def _held(value):
    """What one attribute of a part holds: itself, a container's items (one level), a bound method's object (with the
    method's name), what a function's closure holds."""
    items = list(value.values()) if isinstance(value, dict) else list(value) if isinstance(
        value, (list, tuple, set, frozenset)) else [value]
    for item in items:
        yield item, None
        if inspect.ismethod(item):
            yield item.__self__, item.__name__
        elif inspect.isfunction(item):
            yield from ((cell.cell_contents, None) for cell in item.__closure__ or ())


@pytest.mark.parametrize("device", ["cpu", "simulated"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_no_part_holds_the_engine(tier, device, tmp_path):
    """Every part of a bound engine (a training step and an inference forward ran): none of its attributes is the
    engine, and the engine's calls it holds are the ones the engine hands out."""
    runtime = SimulatedRuntime(seed=0, max_delay=0.0) if device == "simulated" else None
    with use_runtime(runtime) if runtime is not None else contextlib.nullcontext():
        reference, model, engine = _offloaded(tier, tmp_path)
        _step(reference, model, 0)
        engine.end_window()  # the pins chosen: on the simulated device, device pins hold state
        with torch.no_grad():
            model.eval()(torch.randint(0, 101, (2, 5)))
        engine.synchronize()
        if device == "simulated":
            assert engine.plan.waits_for_device and engine.stager is not None
        for name in (*PARTS, "resources"):  # the resources too: a part reaches nothing of the engine through them
            part = getattr(engine, name)
            assert part is not None, name
            for attr, value in vars(part).items():
                for held, method in _held(value):
                    if method is None:
                        assert not isinstance(held, OffloadEngine), f"engine.{name}.{attr} holds the engine"
                    elif isinstance(held, OffloadEngine):
                        assert method in ENGINE_CALLS, f"engine.{name}.{attr} is the engine's {method}"


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_replaced_store_reaches_every_part(tier, tmp_path):
    """On the simulated device (slab, stager, device pins): after `replace_store` no part touches the old store, and
    the gradients accumulated over the swap equal the resident model's."""
    with use_runtime(SimulatedRuntime(seed=1, max_delay=0.0)):
        reference, model, engine = _offloaded(tier, tmp_path)
        _step(reference, model, 0)
        engine.pins.update()  # device pins take their state up at the next forward
        _step(reference, model, 1)
        engine.synchronize()
        old = engine.store
        engine.replace_store(copy_store(old, engine.stats, 2))

        def used(*args, **kwargs):
            raise AssertionError("a part used the replaced store")

        for call in ("acquire", "try_acquire", "release", "prefetch", "grouped_weights", "set_pinned"):
            setattr(old, call, used)
        _step(reference, model, 2)  # the device pins come up again, from the new store
        engine.synchronize()
        assert store_grads_vs_reference(engine, reference) <= ATOL
