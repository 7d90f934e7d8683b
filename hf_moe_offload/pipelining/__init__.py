"""MPMoE for every MoE family on the model's MoE path (hf_moe_offload.families.moe_path): micro-batch pipelining of the MoE layer
(§3.2), memory reuse with the restore strategies S1-S4 (§3.3, Table 2) and the adaptive (n, S) configurator (§4).

    >>> from hf_moe_offload.pipelining import enable_micro_batch_pipelining, disable_micro_batch_pipelining
    >>> enable_micro_batch_pipelining(model, n="auto", strategy="auto")   # or n=4, strategy="S4"
    >>> ...train...
    >>> disable_micro_batch_pipelining(model)

References: MPMoE (Zhang et al., IEEE TPDS 2024; MPipeMoE, IPDPS 2023).

May import: `families`, `models`, `precision`, `rng`, `runtime`.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from ..models.moe_gpt.moe_ops import DispatchPlan
from ..families.moe_path import get_moe_path, moe_path
from .configurator import (
    GranularitySearch,
    PerformanceModel,
    PipelineConfigurator,
    Speeds,
    measure_speeds,
    op_counts,
)
from .partition import CommStage, LocalComm, PartitionedExecutor, PartPlan, split_plan
from .restore import RESTORE_STRATEGIES, RestoreStrategy, SavedBytes, restore_strategy

logger = logging.getLogger(__name__)


def make_layer_profiler(layer, top_k: int, executor_kwargs: dict | None = None):
    """profile_fn(B, n, S) -> seconds of one forward+backward of a MoE layer's resident experts through a
    PartitionedExecutor on B random balanced rows (Algorithm 1's "profile the execution time"). Only input gradients
    are computed, so parameter `.grad`s are untouched. `layer`: a `MoELayer` of the model's path."""
    experts = layer.experts
    if hasattr(experts, "prefetch"):
        raise ValueError("method='profile' needs resident experts (streamed experts would accumulate gradients); "
                         "use method='model' with expert offload")
    p = experts.expert_parameters()[0]
    num_experts = layer.num_experts
    hidden = layer.layout.hidden_size

    def profile(B: int, n: int, strategy: str) -> float:
        S = max(1, B // top_k)
        x = torch.randn(S, hidden, dtype=p.dtype, device=p.device, requires_grad=True)
        ids = torch.randint(0, num_experts, (S, top_k), device=p.device)
        w = torch.rand(S, top_k, device=p.device)
        plan = DispatchPlan.build(w, ids, num_experts, gathers=False)  # partitions combine with index_add_
        ex = PartitionedExecutor(n, strategy, **(executor_kwargs or {}))
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            out = ex(x, plan, experts)
            torch.autograd.grad(out, x, torch.ones_like(out))
            if p.is_cuda:
                torch.cuda.synchronize(p.device)
            best = min(best, time.perf_counter() - t0)
        return best

    return profile


def enable_micro_batch_pipelining(
    model: nn.Module,
    n: int | str = "auto",
    strategy: str = "auto",
    comm: CommStage | None = None,
    method: str = "model",
    strategies: tuple[str, ...] = ("S1", "S2", "S3", "S4"),
    n_max: int = 8,
    speeds: Speeds | None = None,
    overlap: bool = True,
) -> PartitionedExecutor:
    """Run every MoE block of `model` as n token partitions with restore strategy `strategy` (MPMoE).

    n: int >= 1 or "auto"; strategy: "S1".."S4", "keep" (partitioning without memory reuse) or "auto" (choose among
    `strategies`). With either on "auto", a `PipelineConfigurator` (performance model by default, `method="profile"`
    for Algorithm 1 over real timings) picks (n, S) per token count and logs the choice. `comm` is the communication
    stage: by default `LocalComm` (single process), or, on a model with expert parallelism
    (`hf_moe_offload.distributed.enable_expert_parallel`, called first), that mode's stage (`AllToAllComm` /
    `PPMoEComm`: partitions exchange tokens with one micro all-to-all, or index-select + all-reduce, each). Returns the
    executor shared by all blocks; reversible with `disable_micro_batch_pipelining`. `overlap=False` runs every
    exchange synchronously, in line (the baseline of the overlap measurement).
    """
    path = moe_path(model)
    layers = path.layers
    parallel = any(layer.parallel is not None for layer in layers)
    if parallel:
        if comm is not None:
            raise ValueError("this model runs expert parallelism, which brings its own communication stage; "
                             "leave comm=None")
        comm = path.expert_parallel.comm_stage(overlap=overlap)
    if strategy != "auto":
        restore_strategy(strategy)  # validates the name
    configurator = None
    if n == "auto" or strategy == "auto":
        hidden, intermediate = layers[0].layout.hidden_size, layers[0].layout.intermediate_size
        profile_fn = None
        if method == "profile" and parallel:
            raise ValueError("method='profile' is for a single process; use method='model' with expert parallelism")
        if method == "profile":
            top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", 1)
            profile_fn = make_layer_profiler(layers[0], top_k, {"comm": comm} if comm is not None else None)
        configurator = PipelineConfigurator(hidden, intermediate, n=n, strategy=strategy, strategies=strategies,
                                            method=method, n_max=n_max, speeds=speeds, profile_fn=profile_fn,
                                            comm_fn=getattr(comm, "benchmark_fn", None))
        executor = PartitionedExecutor(1, "keep", comm=comm, configurator=configurator, overlap=overlap)
    elif not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int or 'auto', got {n!r}")
    else:
        executor = PartitionedExecutor(n, strategy, comm=comm, overlap=overlap)
    for layer in layers:
        layer.set_pipelined(executor)
    logger.info("micro-batch pipelining on %d MoE layers: %r", len(layers), executor)
    return executor


def disable_micro_batch_pipelining(model: nn.Module) -> None:
    """Restore the unpartitioned MoE path (plain, or expert parallelism's exchange) on every layer."""
    path = get_moe_path(model)
    if path is None:
        return
    for layer in path.layers:
        layer.set_pipelined(None)
    path.remove_if_idle()


__all__ = [
    "CommStage",
    "GranularitySearch",
    "LocalComm",
    "PartPlan",
    "PartitionedExecutor",
    "PerformanceModel",
    "PipelineConfigurator",
    "RESTORE_STRATEGIES",
    "RestoreStrategy",
    "SavedBytes",
    "Speeds",
    "disable_micro_batch_pipelining",
    "enable_micro_batch_pipelining",
    "make_layer_profiler",
    "measure_speeds",
    "op_counts",
    "restore_strategy",
    "split_plan",
]
