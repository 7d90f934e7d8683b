"""`--method lora`: peft's LoRA on the job's model, the offloaded experts frozen, and what such a run saves."""

from __future__ import annotations

import argparse
import os

from torch import nn

from ..planning.estimate import LORA_ATTENTION
from ..offload.lora.expert_lora import expert_target_parameters
from ..offload.saving import save_merged_lora
from ..quiet import peft_wrapping


def apply_lora(model: nn.Module, engine, args: argparse.Namespace, task_type) -> tuple[nn.Module, str]:
    """`--method lora`: peft's LoRA on `--lora-targets`, the offloaded experts frozen -> (the peft model, what the
    card says of it)."""
    from peft import LoraConfig, get_peft_model

    modules = LORA_ATTENTION if "attention" in args.lora_targets else []
    parameters = expert_target_parameters(model) if "experts" in args.lora_targets else []
    lora = LoraConfig(task_type=task_type, r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                      target_modules=modules, target_parameters=parameters or None)
    with peft_wrapping():
        model = get_peft_model(model, lora)
    freeze_offloaded_experts(engine)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    streamed = ", streamed" if engine is not None and engine.store is not None else ""
    on = "/".join([m for m in modules if any(n.endswith(f".{m}") for n, _ in model.named_modules())]
                  + [f"{p} (every expert{streamed})" for p in parameters])
    return model, f"r={args.lora_r}, alpha={args.lora_alpha} on {on}; {trainable:,} trainable parameters"


def save_lora_run(model: nn.Module, folder: str) -> None:
    """A LoRA run's output: the adapter alone in `adapter/` (from the trainable tensors: the experts are never
    gathered) and the model with the adapters merged in, loadable without peft (`save_merged_lora`: each offloaded
    expert's W + BA formed as it is written)."""
    adapter = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    model.save_pretrained(os.path.join(folder, "adapter"), state_dict=adapter)
    save_merged_lora(model, folder)


def freeze_offloaded_experts(engine) -> None:
    """Offloaded experts that are not trained (LoRA): gradients still flow through them to the layers below, but
    their own weight gradients are not computed (and no optimizer is needed)."""
    if engine is None or engine.store is None:
        return
    engine.freeze_experts()
