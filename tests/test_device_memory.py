"""The estimate's device figure against the bytes a training step holds on the simulated device.

On the simulated device the "device" is the CPU, so its memory is counted, not read: `DeviceBytes` is a dispatch
mode on the compute thread that adds every tensor storage an operator creates (once per storage: views and in-place
results share their input's) to a live total when it is made and takes it off when the storage is freed (a weakref
finalizer), and keeps the peak. It starts with the model's parameters (the non-expert weights; the offloaded experts
are meta stand-ins and live in the store). What it leaves out is host memory: the store (built before), the
page-locked buffers (`pinned_empty`, not counted), and whatever the runtime's stream workers and the expert
optimizer's threads allocate (dispatch modes are per thread). So it counts the weights, gradients, AdamW's moments,
peft's adapters, the slab, the stager's slots, the streamed chunks' gradients and every activation: what the device
would hold. Within 10% of `estimate`'s device figure for the host tier, batch 2 x 64, activation checkpointing, the
chunked LM loss.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoConfig, AutoModelForCausalLM

from hf_moe_offload import OffloadConfig, enable_expert_offload
from hf_moe_offload.planning.estimate import LORA_ATTENTION, Workload, estimate
from hf_moe_offload.families.lm_loss import chunked_causal_lm_loss
from hf_moe_offload.offload.lora.expert_lora import expert_target_parameters
from hf_moe_offload.optim.expert_optimizer import ExpertAwareOptimizer, ExpertOptimizer
from hf_moe_offload.runtime import use_runtime
from hf_moe_offload.runtime.simulated import SimulatedRuntime

BATCH, SEQ, LOSS_CHUNK = 2, 64, 32


class DeviceBytes(TorchDispatchMode):
    """Live and peak bytes of the storages operators create on this thread (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = self.paused = 0

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor) and t.device.type != "meta"}
            for t in tree_flatten(out)[0]:
                if (isinstance(t, torch.Tensor) and t.device.type != "meta"
                        and t.untyped_storage().data_ptr() not in inputs):  # views and in-place results are not new
                    self.add(t)
        return out


class _Runtime(SimulatedRuntime):
    """The simulated device whose page-locked host buffers the counter leaves out."""

    counter: DeviceBytes

    def pinned_empty(self, *args, **kwargs):
        self.counter.paused += 1
        try:
            return super().pinned_empty(*args, **kwargs)
        finally:
            self.counter.paused -= 1


def _config():
    # an untied head and a vocabulary that makes the LM loss's chunks count beside the layers
    return AutoConfig.for_model("qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
                                moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                max_position_embeddings=128, tie_word_embeddings=False)


def _peak(config, method: str, dtype: torch.dtype) -> int:
    """Three training steps (the AdamW moments exist from the first) on the simulated device -> the peak bytes."""
    torch.manual_seed(0)
    counter = DeviceBytes()
    runtime = _Runtime(seed=2, max_delay=0.0)
    runtime.counter = counter
    with use_runtime(runtime):
        model = AutoModelForCausalLM.from_config(config, experts_implementation="eager", dtype=dtype)
        frozen = method != "full"
        engine = enable_expert_offload(model, OffloadConfig(mode="host", train_experts=not frozen, pin_fraction=0.0))
        if frozen:
            for p in model.parameters():
                p.requires_grad_(False)
            names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
            model = get_peft_model(model, LoraConfig(
                r=8, lora_alpha=16, target_modules=[m for m in LORA_ATTENTION if m in names],
                target_parameters=expert_target_parameters(model) if method == "lora-experts" else None))
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        else:
            opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                       ExpertOptimizer(engine, lr=1e-3))
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        for p in model.parameters():
            if p.device.type != "meta":
                counter.add(p)
        g = torch.Generator().manual_seed(1)
        with counter:
            for _ in range(3):
                x = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g)
                chunked_causal_lm_loss(model, {"input_ids": x, "labels": x}, LOSS_CHUNK).loss.backward()
                opt.step()
                opt.zero_grad()
                engine.step_barrier()
        engine.synchronize()
    return counter.peak


@pytest.mark.parametrize("method,dtype", [("full", torch.bfloat16), ("lora-experts", torch.bfloat16),
                                          ("lora", torch.float32)], ids=lambda v: str(v).removeprefix("torch."))
def test_the_device_figure_agrees_with_the_bytes_a_step_holds(method, dtype):
    config = _config()
    w = Workload(method=method, dtype=dtype, batch_size=BATCH, seq_len=SEQ, lora_r=8, device="cuda", pin_fraction=0.0,
                 gradient_checkpointing=True, loss_chunk_tokens=LOSS_CHUNK)
    figure = estimate(config, w, device_budget=1 << 40, host_budget=1 << 40).tiers["host"].device_bytes
    measured = _peak(config, method, dtype)
    assert abs(measured - figure) <= 0.10 * figure, (measured, figure)


def test_qwen3_30b_a3b_fits_a_12_gb_card_with_lora_and_a_16_gb_card_fully_trained():
    """The bundled Qwen3-30B-A3B shape, 1 x 2048 tokens with checkpointing, host tier: LoRA on every expert (nf4,
    factors in the store) within 8 GiB of a 12 GB card, a full fine-tune with the dense optimizer on the host within
    16 GiB of a 16 GB card (predictions: what the estimate counts, its parts summing to the figure)."""
    from hf_moe_offload.planning.model_shapes import SHAPES

    config = SHAPES["Qwen/Qwen3-30B-A3B"].config()
    common = dict(batch_size=1, seq_len=2048, gradient_checkpointing=True, device="cuda")
    lora = estimate(config, Workload(method="lora-experts", expert_storage="nf4", lora_in_store=True, **common),
                    device_budget=12 * 10**9, host_budget=1 << 40).tiers["host"]
    full = estimate(config, Workload(method="full", dense_optimizer_on_host=True, **common),
                    device_budget=16 * 10**9, host_budget=1 << 40).tiers["host"]
    for needs, limit in ((lora, 8), (full, 16)):
        assert needs.device_bytes <= limit * 2**30, needs.parts
        assert needs.device_bytes == sum(needs.parts[k] for k in needs.device_parts)
        assert needs.parts["activations"] == sum(needs.activations.values())
        assert needs.largest_batch["with checkpointing"] >= 1
    assert "LoRA adapters (fp32 state)" in lora.parts and "expert LoRA factors (fp32 state, in the store)" not in (
        lora.device_parts)
    assert "dense optimizer (fp32 masters, gradients, Adam moments)" not in full.device_parts
