"""Adapters between an experts module and the flat per-expert records of the store.

The store and the streaming engine know nothing of module names: an `ExpertLayout` says which leading-expert-dim
tensors make up an expert, how they pack into one flat fp32 vector (weights first, then the tensors that get no weight
decay, so the optimizer sees two contiguous segments), and which function computes one expert. MoE-GPT's layout is
below; every experts module of transformers' `ExpertsInterface` (`@use_experts_implementation`) gets its layout from
its own flags (`experts_interface_layout`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..models.moe_gpt.moe_ops import GroupedLinear


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

    def __init__(self, tensors: list[ExpertTensor], num_experts: int, expert_forward: Callable[..., torch.Tensor],
                 hidden_size: int | None = None, linear: Callable[..., torch.Tensor] = F.linear):
        self.tensors = sorted(tensors, key=lambda t: not t.decay)  # stable: decayed first
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.expert_forward = expert_forward  # (x, *tensors in layout order, linear=...) -> y
        self.linear = linear  # the `linear` expert_forward uses for one expert's tensors (its default)
        self.offsets: list[int] = []
        offset = 0
        for t in self.tensors:
            self.offsets.append(offset)
            offset += t.numel
        self.numel = offset
        self.decay_numel = sum(t.numel for t in self.tensors if t.decay)
        # Width of a two-GEMM FFN with this many weights (MoE-GPT: its ffn size; gated: 1.5x the gate/up width),
        # for the FLOP and activation models (MPMoE configurator, memory estimates).
        self.intermediate_size = self.decay_numel // (2 * hidden_size) if hidden_size else None

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-tensor views of one expert's flat vector, in `self.tensors` order."""
        return [flat[o : o + t.numel].view(t.shape) for o, t in zip(self.offsets, self.tensors)]

    def grouped_views(self, block: torch.Tensor) -> list[torch.Tensor]:
        """Per-tensor (E, ...) views of every expert's flat vector, `block` (E, numel) (rows may be strided apart)."""
        E = block.shape[0]
        return [block[:, o : o + t.numel].view(E, *t.shape) for o, t in zip(self.offsets, self.tensors)]

    def pack(self, tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        for view, t in zip(self.views(out), tensors):
            view.copy_(t)
        return out

    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def forward(self, x: torch.Tensor, weights: list[torch.Tensor],
                adapt: Callable[[Callable], Callable] | None = None) -> torch.Tensor:
        """One expert. `adapt(linear) -> linear`: what the matmuls run through instead (LoRA on streamed experts)."""
        return self.expert_forward(x, *weights, linear=adapt(self.linear) if adapt else self.linear)

    def grouped_forward(self, x: torch.Tensor, counts: list[int], tensors: list[torch.Tensor],
                        adapt: Callable[[Callable], Callable] | None = None) -> torch.Tensor:
        """Every expert at once from the module's (E, ...) tensors (layout order), each matmul one grouped GEMM over
        the rows of each expert (`counts`, all E in expert order)."""
        linear = GroupedLinear(counts, x)
        return self.expert_forward(x, *tensors, linear=adapt(linear) if adapt else linear)

    def matrices(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The weight matrices among `tensors` (layout order): the decayed ones."""
        return [t for t, spec in zip(tensors, self.tensors) if spec.decay]


def moe_gpt_layout(experts: nn.Module) -> ExpertLayout:
    """Layout of `MoEGPTExperts` (fc1_weight (E,I,H), fc1_bias (E,I), fc2_weight (E,H,I), fc2_bias (E,H))."""
    E, I, H = experts.fc1_weight.shape

    def forward(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias, linear=F.linear):
        return experts.expert_forward(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, linear=linear)

    tensors = [
        ExpertTensor("fc1_weight", (I, H), True),
        ExpertTensor("fc2_weight", (H, I), True),
        ExpertTensor("fc1_bias", (I,), False),
        ExpertTensor("fc2_bias", (H,), False),
    ]
    return ExpertLayout(tensors, E, forward, H)


def experts_interface_layout(experts: nn.Module) -> ExpertLayout:
    """Layout of an experts module decorated with transformers' `@use_experts_implementation` (Mixtral, Qwen3-MoE,
    OLMoE, gpt-oss, DeepSeek, GLM, Granite, Nemotron-H, ...), built from the module's own flags:

    - `has_gate`: `gate_up_proj` feeds the module's own `_apply_gate` (the family's SwiGLU variant, clamps and
      interleaving included: `is_concatenated` is its business), else `up_proj` feeds `act_fn`;
    - `is_transposed`: weights are stored (E, in, out) instead of (E, out, in);
    - `has_bias`: `<name>_bias` (E, out) next to each weight;
    - `has_post_expert_norm`: the module's `post_expert_norm` (shared by all experts, so an ordinary parameter that
      stays on the module) runs after the down projection.
    """
    up_name = "gate_up_proj" if experts.has_gate else "up_proj"
    names = [up_name, "down_proj"]
    if experts.has_bias:
        names += [f"{up_name}_bias", "down_proj_bias"]
    missing = [n for n in names if not isinstance(getattr(experts, n, None), torch.Tensor)]
    if missing:
        raise TypeError(f"{type(experts).__name__} is on transformers' experts interface but has no {', '.join(missing)} "
                        "(the expert tensors its flags promise); write an ExpertLayout for it")
    E = getattr(experts, up_name).shape[0]
    tensors = [ExpertTensor(n, tuple(getattr(experts, n).shape[1:]), not n.endswith("_bias")) for n in names]
    transposed = experts.is_transposed
    gate = experts._apply_gate if experts.has_gate else experts.act_fn
    post_norm = experts.post_expert_norm if experts.has_post_expert_norm else None

    def expert_linear(x, w, b, transposed):
        return (x @ w + b if b is not None else x @ w) if transposed else F.linear(x, w, b)

    def forward(x, w_up, w_down, b_up=None, b_down=None, linear=expert_linear):
        y = linear(gate(linear(x, w_up, b_up, transposed)), w_down, b_down, transposed)
        return post_norm(y) if post_norm is not None else y

    down = getattr(experts, "down_proj")  # (E, H, I), or (E, I, H) transposed
    return ExpertLayout(tensors, E, forward, down.shape[2] if transposed else down.shape[1], linear=expert_linear)


def layout_for(experts: nn.Module) -> ExpertLayout:
    """The layout adapter of a known experts module."""
    if all(hasattr(experts, n) for n in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias", "expert_forward")):
        return moe_gpt_layout(experts)
    if is_experts_interface_module(experts):
        return experts_interface_layout(experts)
    raise TypeError(
        f"no expert layout adapter for {type(experts).__name__}; write an ExpertLayout for it (see "
        "hf_moe_offload/families/layouts.py)"
    )


def is_experts_interface_module(module: nn.Module) -> bool:
    """Decorated with transformers' `@use_experts_implementation` (its __init__ sets these flags)."""
    return all(hasattr(module, f) for f in ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm"))
