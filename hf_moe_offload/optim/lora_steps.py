"""The experts' LoRA factors kept in the store (offload/lora/lora_store.py), stepped by the expert optimizer.

A layer's factors are stepped once its gradients are final, as its experts are: during backward on the window's
last micro-step (ES-MoE §4.1's overlap, on the thread that finishes the layer's backward: the factors are small
beside the experts), or in `ExpertOptimizer.step()` where global clipping or loss scaling needs every gradient
first; their squared norms count in the global norm and their values in the overflow check. The arithmetic is the
experts' (`adamw_update_`: torch's fused AdamW per tensor, lora_A and lora_B of each adapter one tensor each, as a
resident model's), every factor decayed as transformers' Trainer decays LoRA matrices.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..offload.lora.lora_store import EXP_AVG, EXP_AVG_SQ, GRAD, PARAM, LoraStore
from .adamw_step import AdamWSettings, ExpertTensors, adamw_update_
from .grad_norms import non_finite, squared_norms


class LoraSteps:
    """Steps, norms and overflow checks of the factors in `lora`."""

    def __init__(self, lora: LoraStore):
        self.lora = lora

    def pending(self) -> list[int]:
        """The layers whose factors have a gradient not stepped yet."""
        return self.lora.with_grad()

    def step(self, layers: Iterable[int], lr: float, settings: AdamWSettings, grad_scale: float | None,
             clip_coef: float | None, max_norm: float | None) -> None:
        """Step `layers`' factors that have a gradient: unscaled, each expert's clipped by its own norm to `max_norm`
        (clip_mode="per_expert"), clipped by the window's `clip_coef`, then AdamW; their gradients zeroed."""
        for layer in layers:
            factors = self.lora.layers.get(layer)
            if factors is None or not factors.has_grad:  # no factors adopted there, or no gradient since the step
                continue
            grads = factors.tensors(GRAD)
            if max_norm is not None:
                if grad_scale is not None:
                    torch._foreach_mul_(grads, 1.0 / grad_scale)
                _clip_each_expert(grads, max_norm)
                grad_scale = None
            expert = ExpertTensors(factors.tensors(PARAM), grads, factors.tensors(EXP_AVG),
                                   factors.tensors(EXP_AVG_SQ), [True] * len(grads), factors.steps)
            adamw_update_([expert], lr, settings, grad_scale, clip_coef)
            self.lora.stepped(layer)

    def sq_norm(self) -> float:
        """The sum of the squared norms of the factors' gradients (each tensor's fp32 norm, squared in float64)."""
        grads = [g for layer in self.pending() for g in self.lora.layers[layer].tensors(GRAD)]
        return sum(squared_norms(grads)) if grads else 0.0

    def overflow(self) -> bool:
        return non_finite([g for layer in self.pending() for g in self.lora.layers[layer].tensors(GRAD)])


def _clip_each_expert(grads: list[torch.Tensor], max_norm: float) -> None:
    """Scale each expert's factor gradients (dim 0 of every (E, ...) tensor) by `clip_coefficient` of its own norm."""
    sq = sum(g.reshape(g.shape[0], -1).double().pow(2).sum(1) for g in grads)
    coef = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0).float()
    for g in grads:
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))


__all__ = ["LoraSteps"]
