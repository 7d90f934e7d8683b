"""Adapters between an experts module and the flat per-expert records of the store.

The store and the streaming engine know nothing of module names: an `ExpertLayout` says which leading-expert-dim
tensors make up an expert, how they pack into one flat fp32 vector (weights first, then the tensors that get no weight
decay, so the optimizer sees two contiguous segments), and which function computes one expert. MoE-GPT's layout is
below, and transformers' 3-D `gate_up_proj` (E, 2I, H) / `down_proj` (E, H, I) experts (Mixtral, Qwen3-MoE, OLMoE)
have theirs (`transformers_3d_layout`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ExpertTensor:
    name: str  # attribute name on the experts module, e.g. "fc1_weight"
    shape: tuple[int, ...]  # per-expert shape (without the leading expert dim)
    decay: bool  # gets weight decay (matrices yes, biases no: transformers' Trainer grouping)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ExpertLayout:
    """Packing of one expert's tensors into a flat vector: [decayed tensors | non-decayed tensors]."""

    def __init__(self, tensors: list[ExpertTensor], num_experts: int, expert_forward: Callable[..., torch.Tensor]):
        self.tensors = sorted(tensors, key=lambda t: not t.decay)  # stable: decayed first
        self.num_experts = num_experts
        self.expert_forward = expert_forward
        self.offsets: list[int] = []
        offset = 0
        for t in self.tensors:
            self.offsets.append(offset)
            offset += t.numel
        self.numel = offset
        self.decay_numel = sum(t.numel for t in self.tensors if t.decay)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-tensor views of one expert's flat vector, in `self.tensors` order."""
        return [flat[o : o + t.numel].view(t.shape) for o, t in zip(self.offsets, self.tensors)]

    def pack(self, tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        for view, t in zip(self.views(out), tensors):
            view.copy_(t)
        return out

    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def forward(self, x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        return self.expert_forward(x, *weights)


def moe_gpt_layout(experts: nn.Module) -> ExpertLayout:
    """Layout of `MoEGPTExperts` (fc1_weight (E,I,H), fc1_bias (E,I), fc2_weight (E,H,I), fc2_bias (E,H))."""
    E, I, H = experts.fc1_weight.shape

    def forward(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias):
        return experts.expert_forward(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias)

    tensors = [
        ExpertTensor("fc1_weight", (I, H), True),
        ExpertTensor("fc2_weight", (H, I), True),
        ExpertTensor("fc1_bias", (I,), False),
        ExpertTensor("fc2_bias", (H,), False),
    ]
    return ExpertLayout(tensors, E, forward)


def transformers_3d_layout(experts: nn.Module) -> ExpertLayout:
    """Layout of transformers v5 MoE experts (Mixtral, Qwen3-MoE, OLMoE, ...): `gate_up_proj` (E, 2I, H),
    `down_proj` (E, H, I), `act_fn`; expert e computes `down(act(gate) * up)`."""
    E, two_i, H = experts.gate_up_proj.shape
    I = two_i // 2

    def forward(x, gate_up_proj, down_proj):
        gate, up = F.linear(x, gate_up_proj).chunk(2, dim=-1)
        return F.linear(experts.act_fn(gate) * up, down_proj)

    tensors = [ExpertTensor("gate_up_proj", (two_i, H), True), ExpertTensor("down_proj", (H, I), True)]
    return ExpertLayout(tensors, E, forward)


def layout_for(experts: nn.Module) -> ExpertLayout:
    """The layout adapter of a known experts module."""
    if all(hasattr(experts, n) for n in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias", "expert_forward")):
        return moe_gpt_layout(experts)
    if all(hasattr(experts, n) for n in ("gate_up_proj", "down_proj", "act_fn")) and experts.gate_up_proj.dim() == 3:
        return transformers_3d_layout(experts)
    raise TypeError(
        f"no expert layout adapter for {type(experts).__name__}; write an ExpertLayout for it (see "
        "hf_moe_offload/offload/layout.py)"
    )


def uses_routing_signature(experts: nn.Module) -> bool:
    """transformers' experts are called as `experts(hidden, top_k_index, top_k_weights)` and combine themselves;
    MoE-GPT's as `experts(x_sorted, counts, expert_ids)` on tokens already sorted by expert."""
    return hasattr(experts, "gate_up_proj")
