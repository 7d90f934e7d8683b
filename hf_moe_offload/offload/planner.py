"""Adaptive offload (ES-MoE §4.3): estimate training memory and choose device / host / disk.

The estimate follows MPMoE §2.2's accounting of model states: fp32 parameters, gradients and two Adam moments
(16 bytes per parameter), plus activations for the batch. Experts are the part that moves; non-expert state and
activations stay on the device.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import psutil
import torch
from torch import nn

logger = logging.getLogger(__name__)

ADAM_BYTES_PER_PARAM = 16  # fp32 param + grad + exp_avg + exp_avg_sq
HEADROOM = 0.9  # of a memory budget a plan may fill
FROZEN_BYTES_PER_PARAM = 4  # frozen experts (LoRA): the weights-only store's fp32 row


@dataclass
class MemoryEstimate:
    expert_params: int
    non_expert_params: int
    num_experts_total: int
    activation_bytes: int
    # ADAM_BYTES_PER_PARAM for trained experts; frozen ones: their storage's (2 for bf16, 0.5625 for nf4, ...)
    expert_bytes_per_param: float = ADAM_BYTES_PER_PARAM

    @property
    def expert_state_bytes(self) -> int:
        return int(self.expert_params * self.expert_bytes_per_param)

    @property
    def non_expert_state_bytes(self) -> int:
        return self.non_expert_params * ADAM_BYTES_PER_PARAM

    @property
    def bytes_per_expert(self) -> int:
        return self.expert_state_bytes // max(1, self.num_experts_total)


def estimate_memory(model: nn.Module, expert_modules: list[nn.Module], tokens_per_batch: int = 0,
                    trained_experts: bool = True, frozen_bytes_per_param: float = FROZEN_BYTES_PER_PARAM
                    ) -> MemoryEstimate:
    """Parameter counts and bytes of state. `trained_experts=False` (LoRA): the experts' state is their weights only,
    `frozen_bytes_per_param` each (fp32: a quarter of a trained expert's; bf16 or quantized: less)."""
    expert_ids = {id(p) for m in expert_modules for p in m.parameters(recurse=False)}
    expert_params = sum(p.numel() for m in expert_modules for p in m.parameters(recurse=False))
    non_expert = sum(p.numel() for p in model.parameters() if id(p) not in expert_ids)
    num_experts = sum(next(m.parameters(recurse=False)).shape[0] for m in expert_modules)
    cfg = getattr(model, "config", None)
    act = 0
    if cfg is not None and tokens_per_batch:
        # Per layer and token: ~ attention (q,k,v,out, 2 LN inputs) + FFN input/middle/output, fp32, kept for backward.
        inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        per_token_layer = 8 * cfg.hidden_size + 2 * inter
        act = tokens_per_batch * cfg.num_hidden_layers * per_token_layer * 4
    return MemoryEstimate(expert_params, non_expert, num_experts, act,
                          ADAM_BYTES_PER_PARAM if trained_experts else frozen_bytes_per_param)


def local_process_count() -> int:
    """Processes of this job on this machine (accelerate / torchrun set LOCAL_WORLD_SIZE): they share its RAM."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def detect_budgets(device: torch.device) -> tuple[int, int]:
    """(device bytes free, host bytes available to this process). On CPU-only machines the device budget is host
    memory. The device budget counts memory PyTorch's caching allocator holds but does not use (`mem_get_info` sees
    it as taken); the host budget is shared by the processes of this job on this machine."""
    host = psutil.virtual_memory().available // local_process_count()
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cached_free = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached_free, host
    return host, host


def choose_tier(est: MemoryEstimate, device_budget: int, host_budget: int, headroom: float = HEADROOM
                ) -> tuple[str, str]:
    """(tier, reason). Device if everything fits, host if experts fit in host memory, disk otherwise."""
    need_device_all = est.expert_state_bytes + est.non_expert_state_bytes + est.activation_bytes
    share = f"{headroom:.0%} of "
    if need_device_all <= headroom * device_budget:
        return "device", (
            f"all state ({need_device_all / 2**30:.2f} GiB) fits {share}the device budget ({device_budget / 2**30:.2f} "
            "GiB)"
        )
    if est.expert_state_bytes <= headroom * host_budget:
        return "host", (
            f"all state ({need_device_all / 2**30:.2f} GiB) exceeds {share}the device budget ({device_budget / 2**30:.2f} "
            f"GiB); the expert state ({est.expert_state_bytes / 2**30:.2f} GiB) fits {share}host memory "
            f"({host_budget / 2**30:.2f} GiB)"
        )
    return "disk", (
        f"expert state ({est.expert_state_bytes / 2**30:.2f} GiB) exceeds {share}host memory ({host_budget / 2**30:.2f} "
        "GiB)"
    )


def offloaded_device_bytes(est: MemoryEstimate, resident_experts: int, compute_bytes: int) -> int:
    """Device memory an offloaded tier still needs: non-expert state, activations, and the expert copies it keeps
    on the device (pinned experts, ES-MoE §4.3, plus the upload slots), `compute_bytes` per parameter."""
    per_expert = est.expert_params // max(1, est.num_experts_total)
    return est.non_expert_state_bytes + est.activation_bytes + resident_experts * per_expert * compute_bytes


__all__ = ["HEADROOM", "MemoryEstimate", "choose_tier", "detect_budgets", "estimate_memory", "local_process_count",
           "offloaded_device_bytes"]
