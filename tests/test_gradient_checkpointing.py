"""Activation checkpointing (transformers' `gradient_checkpointing_enable`) with offloaded experts.

Each checkpointed decoder layer runs its forward twice: once without keeping activations, once again in the backward
(the streamed experts are uploaded or read again for it, and their backward follows). Whatever the tier or the
device, the run must be the resident checkpointed run: 3 AdamW steps of a tiny Qwen3-MoE, the stock model on
transformers' eager experts and torch AdamW against ours (ExpertAwareOptimizer), fresh random tokens each step.

Tolerances: fp32 as tests/test_families.py (losses and logits 1e-5 before an update; 1e-4 = lr / 10 for the weights
after the steps, Adam's eps 1e-6 there, for the reason its docstring gives). bf16 autocast: the losses within the
bound tests/test_mixed_precision.py measured between two correct runs under the same autocast (2e-3), the weights
within Adam's drift bound (tests/numerics.py: roundings that differ move a noise-only element by up to ~lr a step).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, enable_expert_offload
from hf_moe_offload.runtime import use_runtime
from hf_moe_offload.runtime.simulated import SimulatedRuntime

from moe_families import VOCAB, tiny_model
from numerics import assert_within_adam_drift

LR, EPS, STEPS = 1e-3, 1e-6, 3
TOL = dict(atol=1e-5, rtol=0)
WEIGHT_TOL = dict(atol=1e-4, rtol=0)
BF16_LOSS_TOL = 2e-3


def checkpointing(model, reentrant: bool) -> None:
    """transformers' activation checkpointing on `model` (its name since 5.24; `gradient_checkpointing_enable`
    before)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


def _train(model, opt, precision: str, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext())
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("runtime", ["cpu", "simulated"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_checkpointed_offloaded_training_equals_the_checkpointed_resident_run(tier, runtime, precision, tmp_path):
    reference = tiny_model("qwen3_moe")
    model = copy.deepcopy(reference)
    for m in (reference, model):
        checkpointing(m, reentrant=False)
        m.train()
    sim = use_runtime(SimulatedRuntime(seed=3, max_delay=0.0005)) if runtime == "simulated" else contextlib.nullcontext()
    with sim:
        engine = enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=str(tmp_path / "experts"),
                                                            host_cache_experts=4, pin_fraction=0.25))
        ref_losses = _train(reference, torch.optim.AdamW(reference.parameters(), lr=LR, eps=EPS, weight_decay=0.0),
                            precision, seed=11)
        opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0),
                                   ExpertOptimizer(engine, lr=LR, eps=EPS, weight_decay=0.0))
        losses = _train(model, opt, precision, seed=11)
        engine.synchronize()
        if runtime == "simulated":  # the recompute streamed the experts a second time in each step
            assert engine.stats.h2d_bytes > 0
    if precision == "fp32":
        assert abs(losses[0] - ref_losses[0]) <= TOL["atol"], (losses, ref_losses)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= WEIGHT_TOL["atol"], (losses, ref_losses)
        got, want = model.state_dict(), reference.state_dict()
        assert got.keys() == want.keys()
        for name, t in want.items():
            torch.testing.assert_close(got[name], t, **WEIGHT_TOL, msg=lambda m: f"{name}: {m}")
    else:
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= BF16_LOSS_TOL, (losses, ref_losses)
        assert_within_adam_drift(model, reference, lr=LR, steps=STEPS)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_both_checkpoint_flavours_give_the_gradients_of_the_plain_model(reentrant, tmp_path):
    """torch's two checkpoint implementations (transformers passes `use_reentrant` through) around the streamed
    experts: the gradients of every parameter and of every expert equal the plain model's (fp32, 1e-5)."""
    from hf_moe_offload.families.moe_path import get_moe_path

    from test_families import expert_grads_of

    reference = tiny_model("qwen3_moe")
    model = copy.deepcopy(reference)
    engine = enable_expert_offload(model, OffloadConfig(mode="host", pin_fraction=0.0))
    checkpointing(model, reentrant)
    model.train()
    reference.train()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    reference(input_ids=ids, labels=ids).loss.backward()
    model(input_ids=ids, labels=ids).loss.backward()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if ref_params[name].grad is not None:
            torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL, msg=name)
    want = expert_grads_of(reference, get_moe_path(model))
    assert want
    for key, grad in want:
        torch.testing.assert_close(engine.expert_grad(key), grad, **TOL, msg=str(key))
