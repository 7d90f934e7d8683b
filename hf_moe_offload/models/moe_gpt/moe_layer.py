"""One MoE-GPT MoE layer: the router (top-1/top-2, fp32 softmax), the experts module (transformers' experts signature,
so that hf_moe_offload reaches it through its one entry) and the block that joins them with the router losses.

Saved next to models as remote code with modeling_moe_gpt.py: imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.integrations import use_experts_implementation

from .configuration_moe_gpt import MoEGPTConfig
from .moe_ops import DispatchPlan, GroupedLinear, run_moe, run_sorted_experts


class MoEGPTRouter(nn.Module):
    """Top-1/top-2 gate (fairseq `wg`, no bias). Logits in the model dtype, softmax in fp32 (fairseq, ST-MoE)."""

    def __init__(self, config: MoEGPTConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.normalize_top2 = config.normalize_top2_weights
        self.normalize_before_dropping = getattr(config, "normalize_top2_before_dropping", False)
        self.drop_tokens = config.drop_tokens
        self.eval_capacity_token_fraction = config.eval_capacity_token_fraction
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (S, C) -> logits (S, E) fp32, combine weights (S, k) fp32, expert ids (S, k) int64.

        A dropped assignment (only with `drop_tokens`) has weight 0 and expert id `num_experts`.
        """
        logits = F.linear(x, self.weight).float()
        probs = logits.softmax(dim=-1)
        top1 = probs.argmax(dim=-1)
        if self.top_k == 1:
            experts = top1.unsqueeze(-1)
        else:
            # Second expert, policy "all": best logit once the first is masked out (fairseq top2gate).
            top2 = logits.masked_fill(F.one_hot(top1, self.num_experts).bool(), float("-inf")).argmax(dim=-1)
            experts = torch.stack([top1, top2], dim=-1)
        weights = probs.gather(-1, experts)
        normalize = self.top_k == 2 and self.normalize_top2
        if normalize and self.drop_tokens and self.normalize_before_dropping:
            weights, normalize = _normalized(weights), False
        if self.drop_tokens:
            kept = self._capacity_keep_mask(experts)
            weights = weights * kept
            experts = experts.masked_fill(~kept, self.num_experts)
        if normalize:
            weights = _normalized(weights)
        return logits, weights, experts

    def _capacity_keep_mask(self, experts: torch.Tensor) -> torch.Tensor:
        """fairseq capacity semantics: top-1 choices outrank top-2, earlier tokens win, slot >= capacity drops."""
        S, E = experts.shape[0], self.num_experts
        if not self.training and self.eval_capacity_token_fraction > 0:
            capacity = math.ceil(self.eval_capacity_token_fraction * S)
        else:
            capacity = self.top_k * math.ceil(S / E)
        kept = []
        taken = torch.zeros(E, dtype=torch.long, device=experts.device)
        for j in range(self.top_k):
            mask = F.one_hot(experts[:, j], E)  # (S, E)
            slot = (torch.cumsum(mask, dim=0) - 1 + taken) * mask
            kept.append((slot.sum(dim=-1) < capacity))
            taken = taken + mask.sum(dim=0)
        return torch.stack(kept, dim=-1)


def _normalized(weights: torch.Tensor) -> torch.Tensor:
    return weights / weights.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)


def load_balancing_loss(probs: torch.Tensor, top1: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch/fairseq aux loss `E * sum_e mean_s(p[s, e]) * mean_s(1[top1(s) = e])` (top-1 mask, all tokens)."""
    me = probs.mean(dim=0)
    ce = F.one_hot(top1, num_experts).float().mean(dim=0)
    return num_experts * torch.sum(me * ce)


@use_experts_implementation(has_bias=True, has_gate=False)
class MoEGPTExperts(nn.Module):
    """All experts of one layer as leading-expert-dimension tensors.

    NOTE: one 3-D tensor per weight (not a ModuleList) so that expert `e` is the contiguous block `W[e]` of each
    tensor: the offload engine copies whole experts with single memcpys, and the layout matches transformers' MoE
    models (`gate_up_proj` (E, 2I, H) / `down_proj` (E, H, I)). The names stay fairseq's (`fc1_weight`, ...), so only
    "eager" and implementations that take their layout from `hf_moe_offload` serve it.
    """

    def __init__(self, config: MoEGPTConfig):
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
        self.num_experts = E
        self.fc1_weight = nn.Parameter(torch.empty(E, I, H))
        self.fc1_bias = nn.Parameter(torch.empty(E, I))
        self.fc2_weight = nn.Parameter(torch.empty(E, H, I))
        self.fc2_bias = nn.Parameter(torch.empty(E, H))
        self.act = ACT2FN[config.activation_function]
        self.activation_dropout = nn.Dropout(config.activation_dropout)

    def expert_forward(self, x: torch.Tensor, fc1_w, fc1_b, fc2_w, fc2_b, linear=F.linear) -> torch.Tensor:
        """One expert's FFN on its tokens: (n, C) -> (n, C). With `linear` a `GroupedLinear` and the (E, ...)
        tensors, every expert's FFN at once."""
        return linear(self.activation_dropout(self.act(linear(x, fc1_w, fc1_b))), fc2_w, fc2_b)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' experts signature: (S, C) tokens, (S, k) expert ids (`num_experts` = dropped), (S, k)
        combine weights -> (S, C)."""
        plan = DispatchPlan.build(top_k_weights, top_k_index, self.num_experts)
        return run_moe(hidden_states, plan, self.sorted_forward)

    def sorted_forward(
        self, x_sorted: torch.Tensor, counts: list[int], expert_ids: list[int] | None = None
    ) -> torch.Tensor:
        """x_sorted: (N, C) tokens grouped by expert; counts[i] tokens go to expert `expert_ids[i]` (default i)."""
        tensors = [self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias]
        return run_sorted_experts(
            x_sorted, counts, expert_ids, tensors, [self.fc1_weight, self.fc2_weight], self,
            expert_fn=lambda x, weights: self.expert_forward(x, *weights),
            grouped_fn=lambda x, full: self.expert_forward(x, *tensors, linear=GroupedLinear(full, x)),
        )


class MoEGPTSparseMoeBlock(nn.Module):
    """Router + experts (dispatch, sequential experts and dropless combine, through the experts implementation)."""

    def __init__(self, config: MoEGPTConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.router = MoEGPTRouter(config)
        self.experts = MoEGPTExperts(config)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, C = hidden_states.shape
        x = hidden_states.reshape(-1, C)  # (S, C)
        logits, weights, experts = self.router(x)
        probs = logits.softmax(dim=-1)
        aux_loss = load_balancing_loss(probs, probs.argmax(dim=-1), self.num_experts)
        z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
        out = self.experts(x, experts, weights)
        return out.view(B, T, C), logits, aux_loss, z_loss


__all__ = ["MoEGPTRouter", "MoEGPTExperts", "MoEGPTSparseMoeBlock", "load_balancing_loss"]
