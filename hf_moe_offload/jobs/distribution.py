"""Several processes under a launcher: the offloaded experts in one node-shared store with ES-MoE dynamic
placement (§4.2), then MPMoE micro-batch pipelining of the MoE layers (`--pipelining`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import torch
from torch import nn

from .arguments import offload_dir


def world() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment (accelerate launch / torchrun)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def distribute(model: nn.Module, engine, args: argparse.Namespace, trainable_experts: bool = True) -> dict:
    """Under `accelerate launch` with several processes: offloaded, trained experts move to one node-shared store
    with ES-MoE dynamic placement (§4.2); resident experts (device tier) stay data-parallel under DDP; frozen
    offloaded experts (LoRA) stay in per-process stores (they never change, so the copies cannot drift).
    Returns what the card reports."""
    rank, world_size = world()
    info: dict[str, Any] = {"world_size": world_size, "expert_parallel": None,
                            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None}
    if world_size == 1 or engine is None or engine.store is None or not trainable_experts:
        return info
    from ..distributed import enable_expert_parallel

    # The engine's own settings (every offload flag, e.g. --io-threads), with the tier it resolved and the node's
    # shared directory.
    shared = dataclasses.replace(
        engine.config, mode=engine.tier,
        offload_dir=os.path.join(offload_dir(args), "node") if engine.tier == "disk" else None,
        host_cache_experts=getattr(engine.store, "cache_experts", None), host_cache_bytes=None,
    )
    enable_expert_parallel(model, mode="dynamic", offload_config=shared)
    info["expert_parallel"] = "dynamic placement over a node-shared store (ES-MoE §4.2)"
    return info


def pipeline(model: nn.Module, args: argparse.Namespace):
    """`--pipelining`: MPMoE micro-batch pipelining on every MoE layer (after `distribute`, so that partitions use the
    expert-parallel exchange). Returns the executor, or None when off."""
    if getattr(args, "pipelining", "off") == "off":
        return None
    from ..pipelining import enable_micro_batch_pipelining

    return enable_micro_batch_pipelining(model, n=args.pipelining, strategy=args.restore_strategy)


def pipelining_summary(executor) -> dict[str, Any] | None:
    """What the card and metrics.json report about `--pipelining`."""
    if executor is None:
        return None
    conf = executor.configurator
    if conf is None:
        return {"partitions": executor.n, "restore_strategy": executor.strategy.name,
                "communication_stage": repr(executor.comm)}
    return {
        "partitions": conf.n,  # "auto" or the fixed n
        "restore_strategy": "auto" if len(conf.strategies) > 1 else conf.strategies[0],
        "communication_stage": repr(executor.comm),
        "chosen": "; ".join(f"{B} rows -> n={n}, {S}" for B, (n, S) in sorted(conf.choices.items())) or "none",
    }
