"""One AdamW step over experts' tensors, with no store, engine or thread in sight (ES-MoE §4.1: the host step).

Every path that steps an expert (a worker's fused batch, the per-expert clipped step, device-pinned experts in
`ExpertOptimizer.step()`) runs the same two stages on per-tensor views of each expert:

1. `prepare_grads_`: unscale (fp16 loss scaling), clip each expert by its own norm (`clip_mode="per_expert"`), clip
   by the window's global coefficient, in that order, each a multiplication in place;
2. `adamw_update_`: weight decay (decoupled, or L2 folded into the gradient) and the Adam update, through torch's fused
   kernel per decay group, or the one-pass kernel that also writes the compute copy (optim/fused_adam.py): one call,
   one parallel region for every expert handed over together, unscale and the global clip read in the same pass.

The arithmetic is that of `torch.optim.AdamW(fused=True)` per tensor, each tensor with its own step count. Stepping
per tensor matters even where one expert's tensors share a flat row: the fused kernel's vectorized body and scalar tail
would otherwise round some elements differently where a tensor boundary falls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adam import adam

from .fused_adam import adamw_many, fits


@dataclass(frozen=True)
class AdamWSettings:
    """The hyperparameters of a step that are not read per window (the learning rate is)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = True


@dataclass
class ExpertTensors:
    """One expert's tensors for a step, each list per tensor in layout order. `step`: the updates it had before this
    one. `copies`: the compute-dtype copy's views where the expert has one (None: no copy, or one refreshed later)."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    decay: list[bool]
    step: int
    copies: list[torch.Tensor] | None = None


def clip_coefficient(norm: float, max_norm: float) -> float:
    """`clip_grad_norm_`'s coefficient: scale a gradient of norm `norm` down to `max_norm`, never up."""
    return min(1.0, max_norm / (norm + 1e-6))


def prepare_grads_(grads: list[list[torch.Tensor]], grad_scale: float | None = None, clip_coef: float | None = None,
                   max_norm: float | None = None, rows: list[torch.Tensor] | None = None) -> None:
    """Unscale and clip `grads` (per expert, its gradient per tensor) in place. `grad_scale`: the loss scale the
    gradients still carry; `max_norm`: clip each expert by its own norm, taken over its flat gradient row in `rows`
    (the tensor the expert's `grads` view) once unscaled; `clip_coef`: the global coefficient, applied last. Each
    stage rounds once per element, whatever the tensors' split."""
    flat = [g for expert in grads for g in expert]
    if grad_scale is not None:
        torch._foreach_mul_(flat, 1.0 / grad_scale)
    if max_norm is not None:
        for expert, row in zip(grads, rows, strict=True):
            torch._foreach_mul_(expert, clip_coefficient(float(torch.linalg.vector_norm(row)), max_norm))
    if clip_coef is not None:
        torch._foreach_mul_(flat, clip_coef)


def adamw_update_(experts: list[ExpertTensors], lr: float, settings: AdamWSettings, grad_scale: float | None = None,
                  clip_coef: float | None = None) -> bool:
    """Unscale and clip by the global coefficient (`prepare_grads_`'s first and last stage), weight decay and the Adam
    update of `experts`, in place. Where every expert has a compute copy the one-pass kernel can write, one call steps
    them all, the gradients read unscaled and clipped in the same pass (left as they were): returns True then (the
    copies are current). Otherwise `prepare_grads_` and torch's fused kernel, two calls (the decayed tensors, the
    others): False, the copies still to be refreshed. The caller counts the step (`ExpertTensors.step` is not
    moved)."""
    if all(e.copies is not None for e in experts) and _update_with_copies(experts, lr, settings, grad_scale,
                                                                          clip_coef):
        return True
    if grad_scale is not None or clip_coef is not None:
        prepare_grads_([e.grads for e in experts], grad_scale, clip_coef)
    beta1, beta2 = settings.betas
    for decayed in (True, False):
        params, grads, avgs, avg_sqs, counts = [], [], [], [], []
        for e in experts:
            for decay, p, g, m, v in zip(e.decay, e.params, e.grads, e.exp_avgs, e.exp_avg_sqs):
                if decay == decayed:
                    params.append(p), grads.append(g), avgs.append(m), avg_sqs.append(v)
                    counts.append(float(e.step))
        if params:
            # One step count per tensor (the kernel increments each), beside the parameters (device pins).
            counts = torch.tensor(counts, device=params[0].device).unbind()
            adam(params, grads, avgs, avg_sqs, [], counts, fused=True, amsgrad=False, beta1=beta1, beta2=beta2,
                 lr=lr, weight_decay=settings.weight_decay if decayed else 0.0, eps=settings.eps, maximize=False,
                 decoupled_weight_decay=settings.decoupled)
    return False


def _update_with_copies(experts: list[ExpertTensors], lr: float, settings: AdamWSettings, grad_scale: float | None,
                        clip_coef: float | None) -> bool:
    """`adamw_update_` through the one-pass kernel, every tensor in one call; False (nothing touched) where it does
    not apply."""
    columns = ([], [], [], [], [], [], [])  # params, grads, moments, second moments, copies, steps, decays
    for e in experts:
        for row in zip(e.params, e.grads, e.exp_avgs, e.exp_avg_sqs, e.copies, [e.step + 1] * len(e.params), e.decay):
            for column, t in zip(columns, row):
                column.append(t)
    if not fits(*columns[:5]) or len({c.dtype for c in columns[4]}) > 1:
        return False
    beta1, beta2 = settings.betas
    adamw_many(*columns, lr=lr, beta1=beta1, beta2=beta2, eps=settings.eps, weight_decay=settings.weight_decay,
               decoupled=settings.decoupled, grad_scale=grad_scale, clip_coef=clip_coef)
    return True


__all__ = ["AdamWSettings", "ExpertTensors", "adamw_update_", "clip_coefficient", "prepare_grads_"]
