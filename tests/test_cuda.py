"""CUDA paths of the offload engine (side-stream uploads, events, pinned memory, bf16 compute copies).

Skipped where no GPU exists (CI is CPU-only); run them on a GPU machine with `pytest tests/test_cuda.py`.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, enable_expert_offload

from test_offload import small_model, store_grads_vs_reference

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
