"""The pure expert AdamW step (hf_moe_offload/optim/adamw_step.py) against torch.optim.AdamW, and the inf/nan checks of
optim/grad_norms.py, on bare tensors: no engine, store or worker.

Each expert here is three tensors (a decayed matrix, an undecayed bias, a decayed matrix) viewing one flat fp32 row, as
the store lays them out; the reference is one torch parameter per tensor, in param groups that decay the matrices only.
Gradients are fresh random draws every step, multiplied by a loss scale of 2**10 (a power of two: scaling and
unscaling are exact, so both sides see the same unscaled gradient) for our side only.

Tolerances, fp32 (eps = 2**-23, one ulp relative):
- against `AdamW(fused=True)`: 0. The step runs torch's own fused kernel per tensor with the same per-tensor step
  counts, and both sides multiply the gradient by the same clip coefficient (a Python float, rounded once to fp32).
- against torch's default `AdamW` (its for-loop implementation): each step's update is computed in another operation
  order, which moves it by a few ulps of the update's own size (lr); the parameter's rounding after the update then
  differs by at most one ulp of the parameter. Per step: 1 ulp of |p| plus 8 ulps of lr; after `STEPS` steps, `STEPS`
  times that (the moments see identical gradients, so the differences do not compound through them beyond rounding).
- per-expert clipping against `clip_grad_norm_` per expert: torch's coefficient is an fp32 division of an fp32 norm,
  ours a float64 division of the same fp32 norm: the two coefficients differ by at most one fp32 ulp, so each clipped
  gradient element by at most 2 ulps, and Adam's normalized update (m / sqrt(v), scale-invariant) by a few ulps of lr.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_moe_offload.optim.adamw_step import (AdamWSettings, ExpertTensors, adamw_update_, clip_coefficient,
                                             prepare_grads_)
from hf_moe_offload.optim.grad_norms import global_clip, non_finite, squared_norms

SHAPES = [(6, 5), (5,), (5, 6)]
DECAY = [True, False, True]
EPS32 = torch.finfo(torch.float32).eps
LR, WD, SCALE, STEPS, EXPERTS = 1e-2, 0.1, 2.0**10, 4, 3


class _Expert:
    """One expert's flat rows (weights, gradient, moments) and their per-tensor views."""

    def __init__(self, weights: torch.Tensor):
        self.rows = [weights.clone(), torch.zeros_like(weights), torch.zeros_like(weights), torch.zeros_like(weights)]
        self.views = [self._split(row) for row in self.rows]
        self.steps = 0

    @staticmethod
    def _split(row: torch.Tensor) -> list[torch.Tensor]:
        out, offset = [], 0
        for shape in SHAPES:
            n = math.prod(shape)
            out.append(row[offset : offset + n].view(shape))
            offset += n
        return out

    def tensors(self) -> ExpertTensors:
        params, grads, avgs, avg_sqs = self.views
        return ExpertTensors(params, grads, avgs, avg_sqs, DECAY, self.steps)


def _pair(seed: int) -> tuple[list[_Expert], list[list[torch.nn.Parameter]]]:
    numel = sum(math.prod(s) for s in SHAPES)
    g = torch.Generator().manual_seed(seed)
    ours = [_Expert(torch.randn(numel, generator=g)) for _ in range(EXPERTS)]
    ref = [[torch.nn.Parameter(v.clone()) for v in e.views[0]] for e in ours]
    return ours, ref


def _reference(ref: list[list[torch.nn.Parameter]], **kwargs) -> torch.optim.AdamW:
    decayed = [p for ps in ref for p, d in zip(ps, DECAY) if d]
    plain = [p for ps in ref for p, d in zip(ps, DECAY) if not d]
    return torch.optim.AdamW([{"params": decayed, "weight_decay": WD}, {"params": plain, "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, 0.999), eps=1e-8, **kwargs)


def _step(ours: list[_Expert], ref, opt, g: torch.Generator, clip_coef: float | None = None,
          max_norm: float | None = None) -> None:
    """One step on both sides, with fresh gradients: ours scaled by SCALE, unscaled and clipped by `prepare_grads_`;
    the reference's clipped as torch does it (`clip_coef` applied, or `clip_grad_norm_` per expert)."""
    for expert, params in zip(ours, ref):
        for view, p in zip(expert.views[1], params):
            grad = torch.randn(view.shape, generator=g)
            p.grad = grad.clone()
            view.copy_(grad * SCALE)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        elif clip_coef is not None:
            torch._foreach_mul_([p.grad for p in params], clip_coef)
    prepare_grads_([e.views[1] for e in ours], grad_scale=SCALE, clip_coef=clip_coef, max_norm=max_norm,
                   rows=[e.rows[1] for e in ours])
    copied = adamw_update_([e.tensors() for e in ours], LR, AdamWSettings((0.9, 0.999), 1e-8, WD, True))
    assert copied is False  # no compute copies here
    for e in ours:
        e.steps += 1
    opt.step()


def _assert_params(ours: list[_Expert], ref, rtol: float, atol: float) -> None:
    for expert, params in zip(ours, ref):
        for view, p in zip(expert.views[0], params):
            torch.testing.assert_close(view, p.detach(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("clip_coef", [None, 0.37])
def test_step_equals_torch_fused_adamw_bit_for_bit(clip_coef):
    """Unscale (2**10), a global clip coefficient < 1 and decoupled weight decay on the matrices: every weight and
    moment equals `AdamW(fused=True)`'s after 4 steps (tolerance 0: the same kernel, see the module docstring)."""
    ours, ref = _pair(seed=1)
    opt = _reference(ref, fused=True)
    g = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        _step(ours, ref, opt, g, clip_coef=clip_coef)
    _assert_params(ours, ref, rtol=0.0, atol=0.0)
    for expert, params in zip(ours, ref):
        for m, v, p in zip(expert.views[2], expert.views[3], params):
            assert torch.equal(m, opt.state[p]["exp_avg"]) and torch.equal(v, opt.state[p]["exp_avg_sq"])


def test_step_matches_torch_default_adamw_within_ulps():
    """Against torch's default AdamW implementation (another operation order), with unscaling, clipping (0.37) and
    weight decay: within STEPS x (1 ulp of |p| + 8 ulps of lr) (see the module docstring)."""
    ours, ref = _pair(seed=3)
    opt = _reference(ref)
    g = torch.Generator().manual_seed(4)
    for _ in range(STEPS):
        _step(ours, ref, opt, g, clip_coef=0.37)
    _assert_params(ours, ref, rtol=STEPS * EPS32, atol=STEPS * 8 * EPS32 * LR)


def test_per_expert_clipping_matches_clip_grad_norm_per_expert():
    """Each expert clipped by its own norm (a max norm well below the gradients': the coefficient is < 1) equals
    `clip_grad_norm_` over that expert's tensors then `AdamW(fused=True)`, within a few ulps (the two coefficients'
    roundings; see the module docstring)."""
    ours, ref = _pair(seed=5)
    opt = _reference(ref, fused=True)
    g = torch.Generator().manual_seed(6)
    for _ in range(STEPS):
        _step(ours, ref, opt, g, max_norm=0.5)
        # The gradients (71 standard normals: norm about 8.4) were clipped to 0.5.
        assert all(float(torch.linalg.vector_norm(e.rows[1])) == pytest.approx(0.5, rel=1e-5) for e in ours)
    _assert_params(ours, ref, rtol=STEPS * 2 * EPS32, atol=STEPS * 8 * EPS32 * LR)


def test_clip_coefficient_and_global_clip_follow_clip_grad_norm():
    """`clip_coefficient` never scales up; `global_clip` over expert squares (still carrying the loss scale) and
    non-expert gradients gives `clip_grad_norm_`'s total norm and coefficient within 4 fp32 ulps (its norm is fp32, ours
    a float64 sum of squares)."""
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(4.0, 1.0) == pytest.approx(0.25, rel=1e-6)
    g = torch.Generator().manual_seed(7)
    experts = [torch.randn(40, generator=g) for _ in range(3)]
    others = [torch.nn.Parameter(torch.randn(5, 5, generator=g)) for _ in range(2)]
    for p in others:
        p.grad = torch.randn(p.shape, generator=g)
    expert_sq = sum(squared_norms([e * SCALE for e in experts]))
    total, coef = global_clip(expert_sq, others, SCALE, max_norm=1.0)
    params = [torch.nn.Parameter(torch.zeros_like(e)) for e in experts] + [torch.nn.Parameter(p.detach().clone())
                                                                          for p in others]
    for p, grad in zip(params, experts + [p.grad for p in others]):
        p.grad = grad.clone()
    expected = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    assert total == pytest.approx(expected, rel=4 * EPS32)
    assert coef < 1.0 and coef == pytest.approx(1.0 / (expected + 1e-6), rel=4 * EPS32)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_inf_and_nan_gradients_are_detected(bad):
    """An overflowed gradient element is found by `non_finite` (the fp16 skip check) and gives a non-finite squared
    norm (the check the norms measured during backward answer); finite gradients pass both."""
    g = torch.Generator().manual_seed(8)
    grads = [torch.randn(7, 3, generator=g), torch.randn(11, generator=g)]
    assert not non_finite(grads) and all(math.isfinite(v) for v in squared_norms(grads))
    assert not non_finite([])
    grads[1][4] = bad
    assert non_finite(grads)
    sq = squared_norms(grads)
    assert math.isfinite(sq[0]) and not math.isfinite(sq[1])
