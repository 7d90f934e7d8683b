"""The largest batch that fits a GPU, per training method and offload tier, as `hf-moe-offload estimate` predicts it
(`--gpu-sizes`, docs/hardware.md, the README's table): one estimate per method and GPU size, since the slab and the
pins take a share of the memory free when the engine binds."""

from __future__ import annotations

import dataclasses

from .estimate import Workload, estimate

# (label, the Workload fields that make the method); LoRA adapts attention and every expert matrix
METHODS = (
    ("full fine-tune", {"method": "full"}),
    ("full, dense optimizer on the host", {"method": "full", "dense_optimizer_on_host": True}),
    ("LoRA, factors on the GPU", {"method": "lora-experts"}),
    ("LoRA, factors in the store", {"method": "lora-experts", "lora_in_store": True}),
)
TIERS = ("host", "disk")
HOST_BUDGET = 2**40  # mode='auto' alone reads it; the batch depends on the GPU only


@dataclasses.dataclass(frozen=True)
class Fit:
    label: str
    tier: str
    device_gib: dict[float, float]  # GPU GB -> the device figure at the workload's batch
    batch: dict[float, tuple[int, int]]  # GPU GB -> (with, without activation checkpointing)


def largest_batches(config, workload: Workload, gpu_gb: list[float], lora_storage: str = "nf4") -> list[Fit]:
    """For each method and tier: the largest batch of `workload.seq_len` tokens within each GPU size (GB)."""
    out = []
    for label, fields in METHODS:
        storage = "auto" if fields["method"] == "full" else lora_storage
        w = dataclasses.replace(workload, **{"expert_storage": storage, "dense_optimizer_on_host": False,
                                             "lora_in_store": False, **fields})
        per_gb = {gb: estimate(config, w, device_budget=int(gb * 1e9), host_budget=HOST_BUDGET) for gb in gpu_gb}
        for tier in TIERS:
            out.append(Fit(label, tier, {gb: e.tiers[tier].device_bytes / 2**30 for gb, e in per_gb.items()},
                           {gb: (e.tiers[tier].largest_batch["with checkpointing"],
                                 e.tiers[tier].largest_batch["without checkpointing"]) for gb, e in per_gb.items()}))
    return out


def render(fits: list[Fit], seq_len: int) -> list[str]:
    """A markdown table: the largest batch with activation checkpointing (without it in brackets)."""
    sizes = list(fits[0].batch)
    lines = [f"| method | tier | {' | '.join(f'{gb:g} GB' for gb in sizes)} |",
             "|---|---|" + "---:|" * len(sizes)]
    for fit in fits:
        cells = [f"{fit.batch[gb][0]} ({fit.batch[gb][1]})" for gb in sizes]
        lines.append(f"| {fit.label} | {fit.tier} | {' | '.join(cells)} |")
    lines.append(f"\nSequences of {seq_len:,} tokens per micro-batch with activation checkpointing (without it in "
                 "brackets); 0: not even one fits.")
    return lines


__all__ = ["Fit", "METHODS", "largest_batches", "render"]
