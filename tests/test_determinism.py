"""A run's weights do not depend on thread scheduling: the same seed and data give bit-identical weights whether or
not other processes load the CPU, and whatever order the worker threads finish in (docs/numerics.md, "Deterministic
runs").

The threads these runs exercise: the disk tier's read-ahead and write-back threads behind a small host cache, the
expert-wise optimizer's two workers measuring gradient norms for global clipping and stepping experts, and, on the
simulated asynchronous device (`SimulatedRuntime`, the documented seam for timing: seeded random delays on every side
stream), the engine's host worker landing gradients downloaded in arrival order.
"""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch

from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, enable_expert_offload
from hf_moe_offload.runtime import use_runtime
from hf_moe_offload.runtime.simulated import SimulatedRuntime

from test_offload import offload_cfg, small_model


@contextmanager
def competing_load(processes: int = 2):
    """`processes` other processes spinning on the CPU (the 2-core machines: every core busy twice over)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def short_run(tmp_path, name: str) -> dict[str, torch.Tensor]:
    """3 optimizer steps x 2 accumulated micro-steps of a tiny MoE-GPT (2 MoE layers x 8 experts) on the disk tier
    with a host cache of 6 of its 16 experts, the expert optimizer on 2 workers with global clipping (deferred
    mode: norms measured on the workers as gradients land, steps after backward) -> every weight (experts from the
    store, by their standard names)."""
    model = small_model(num_experts=8, hidden_size=32, intermediate_size=96)
    engine = enable_expert_offload(model, offload_cfg("disk", tmp_path / name, depth=2, cache=6))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    boundary = {"now": False}
    experts = ExpertOptimizer(engine, lr=1e-2, weight_decay=0.1, max_grad_norm=0.05, workers=2,
                              lr_fn=lambda: opt.param_groups[0]["lr"], boundary_fn=lambda: boundary["now"])
    wrapped = ExpertAwareOptimizer(opt, experts)
    data = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            for micro in range(2):
                boundary["now"] = micro == 1
                x = torch.randint(0, 101, (4, 16), generator=data)
                (model(x, labels=x).loss / 2).backward()
            wrapped.step()
            wrapped.zero_grad()
        assert experts.last_grad_norm > 0.05  # the clip coefficient took part in every update
    finally:
        experts.close()
    state = model.state_dict()
    engine.store.close()
    return {k: v.detach().clone() for k, v in state.items()}


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ, e.g. {differ[:3]}"


@pytest.mark.slow
def test_weights_are_bit_identical_under_a_competing_cpu_load(tmp_path):
    # Inline CPU runtime: the experts compute on the calling thread, the store's I/O and the optimizer's workers
    # beside it.
    quiet = short_run(tmp_path, "quiet")
    with competing_load():
        loaded = short_run(tmp_path, "loaded")
    assert_bit_identical(quiet, loaded)


@pytest.mark.slow
def test_weights_are_bit_identical_whatever_order_the_threads_finish_in(tmp_path):
    # Simulated asynchronous device: gradients come down on a side stream and are landed by the engine's host worker
    # or the optimizer's workers in arrival order; two seeds give two different timings of every side-stream
    # operation (uploads, gradient downloads), the second one with longer delays and under a competing load.
    with use_runtime(SimulatedRuntime(seed=1, max_delay=0.002)):
        first = short_run(tmp_path, "first")
    with competing_load(), use_runtime(SimulatedRuntime(seed=2, max_delay=0.006)):
        second = short_run(tmp_path, "second")
    assert_bit_identical(first, second)
