"""peft's LoRA on streamed experts against peft's LoRA on resident experts: the comparison that
tests/test_expert_lora.py and tests/test_lora_families.py run, in one place.

Both models start from the same base weights and get the same peft config under the same seed; the streamed one has
its frozen experts offloaded (stand-ins on the module, the values in the store). `assert_streamed_lora_equals_resident`
trains both with torch AdamW on fresh random tokens and compares the first step's logits (a base model's last hidden
states) and adapter gradients and the adapters after the last step. Tolerances (derived in tests/test_expert_lora.py's
docstring): fp32 logits 1e-5 and gradients 1e-5 relative to their largest element; bf16 autocast 5e-2 for both (bf16's
2^-8 rounding of the activations, which the two paths round at different points); every weight within
`assert_within_adam_drift`'s bound, with at most 1% (fp32) or 10% (bf16) of the model's weights, frozen ones included,
beyond lr / 10.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from peft import LoraConfig, get_peft_model

from numerics import assert_within_adam_drift

LR = 1e-2
WEIGHT_DECAY = 0.01  # torch AdamW's default, both sides
VOCAB = 96  # the tiny models' vocabulary (tests/moe_families.py, MoE-GPT's tiny config)


def lora_model(model, target_parameters: list[str], target_modules: list[str] | None = None, seed: int = 1):
    """peft's LoRA r=4 on `model`; `init_lora_weights=False` makes lora_B random too (seeded), so the adapters change
    the output from the first step."""
    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=target_modules or [],
                                            target_parameters=target_parameters, init_lora_weights=False))


def lm_forward(model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal LM on `x` with `x` as its labels: (logits, loss)."""
    out = model(x, labels=x)
    return out.logits, out.loss


def probe_forward(model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A model without an LM head: (last hidden states, their inner product with a fixed random probe). The probe
    gives every weight a gradient of the output's own size (a sum of squares after the final RMSNorm would be nearly
    constant, its gradient rounding noise)."""
    h = model(x).last_hidden_state
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(11))
    return h, (h.float() * probe).sum()


def adapter_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_relative(a: dict, b: dict, rtol: float) -> None:
    """Every tensor of `b` within `rtol` of the largest element of `a`'s, by name (the same names, at least one)."""
    assert a.keys() == b.keys() and a, sorted(set(a) ^ set(b))
    for name in a:
        scale = a[name].abs().max().clamp_min(1e-12)
        err = (a[name] - b[name]).abs().max() / scale
        assert err <= rtol, f"{name}: {err:.2e} of its largest element"


def assert_streamed_lora_equals_resident(resident, streamed, engine, autocast: bool, steps: int = 3, seed: int = 7,
                                         forward: Callable = lm_forward) -> None:
    """`steps` AdamW steps of both models on the same fresh random batches (2 x 11 tokens), under bf16 CPU autocast
    with `autocast`: the module docstring's comparisons (of `forward`'s output and loss: `lm_forward` or
    `probe_forward`), and the stored experts unchanged bit for bit."""
    stored = {k: engine.store.read_param(k).clone() for k in engine.store.keys()}
    trainable = [n for n, p in streamed.named_parameters() if p.requires_grad]
    assert trainable == [n for n, p in resident.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY)
            for m in (resident, streamed)]
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randint(0, VOCAB, (2, 11), generator=g)  # fresh inputs every step
        outs = []
        for model in (resident, streamed):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out, loss = forward(model, x)
            loss.backward()
            outs.append(out.detach().float())
        if step == 0:
            tol = 5e-2 if autocast else 1e-5
            torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=0)
            assert_close_relative(adapter_grads(resident), adapter_grads(streamed), tol)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert_within_adam_drift(streamed, resident, LR, steps, weight_decay=WEIGHT_DECAY,
                             outliers=0.1 if autocast else 0.01)
    assert all(torch.equal(engine.store.read_param(k), v) for k, v in stored.items())  # the base, bit for bit
