"""Expert parallelism for a few GPUs under `accelerate launch`: static EP, ES-MoE dynamic placement, PPMoE dispatch.

Each process runs the model on its own micro-batch (data parallel: non-expert parameters go through DDP as usual) and
the MoE layers exchange tokens so that every expert runs on exactly one rank. `enable_expert_parallel` sets an executor
on every layer of the model's MoE path (families/moe_path.py: any family served through transformers' experts
signature). One MoE layer, from router to combine, on rank r of k:

    router -> DispatchPlan (local tokens sorted by expert, counts c_r)
      -> all-gather counts: C (k x E)                                   [one small collective]
      -> placement: rank_of[e]                                          static: fixed blocks
                                                                        dynamic: LPT on sum_r C[r, e] (ES-MoE §4.2)
      -> prefetch the first experts this rank will run                  (ES-MoE §4.1: overlaps the exchange)
      -> all_to_all(tokens, splits)  -> regroup expert-major            [exchange.py]
      -> experts(x, counts, expert_ids)   resident, or streamed from the node-shared store
      -> weighting (expert side) -> all_to_all back -> combine (index_add_)

The exchange is implemented once, as the communication stage of MPMoE's partitioned executor (comm_stages.py): a
layer under expert parallelism alone runs as one partition (`PartitionedExecutor(1, "keep", comm=stage)`), and
micro-batch pipelining runs n partitions over the same stage.

`mode="ppmoe"` (PPMoE §3.3, Algorithm 1) is for inputs replicated across the group (a tensor-parallel region): no
all-to-all; each rank index-selects its local experts' tokens, and one all-reduce sums the partial outputs.

Gradient scaling. DDP averages the non-expert gradients over k ranks, each computed from its rank's mean loss: the
result is the gradient of (1/k) sum_r L_r, the loss of one process on the concatenated batch. An expert's gradient
from an all-to-all backward is sum_r dL_r/dW_e (every rank's tokens flow back to the one rank that ran it): 1/k is
applied to it (`scale_grad` on the expert output, undone on the token gradient going back), so experts get exactly the
gradient DDP gives everything else. PPMoE needs no scaling: every rank's loss is the same replicated loss.

Who updates an offloaded expert (dynamic placement, the host optimizer of hf_moe_offload.optim). All ranks of a
node share one copy of every expert (shared_store.py). In an accumulation window an expert may run on different
ranks in different micro-steps; within a micro-step it runs on exactly one rank, which adds the complete gradient of
that micro-step to the shared fp32 gradient: no expert all-reduce. The owner of expert e's update in a window is
    the rank that runs e in the window's last micro-step, if e gets tokens then;
    else the rank that pins e (ES-MoE §4.3), else the home rank (layer * E + e) mod k.
All ranks compute the same owner from the same all-gathered counts. No locks are needed, because each MoE layer's
count all-gather orders the ranks: a gradient added in micro-step t (during backward of layer l on rank p) happens
before p joins the all-gather of layer l in micro-step t+1, and whoever adds to or steps e after that point has
passed that all-gather too. So contributions of different ranks are summed sequentially into the shared fp32 gradient
row, the owner steps e once (eagerly during backward, as ES-MoE §4.1, or in `step()`), and at the window's close every
rank waits for its own updates, writes back what the disk tier changed (`publish`) and meets the others at a barrier
before anyone touches an expert again. The Adam step counts and record versions live in shared memory too.

Pinning (ES-MoE §4.3) is per rank: at each window's close, every rank pins the top `pin_fraction` of the experts it
ran (by tokens, at least one), computed identically on all ranks, and placement keeps a pinned expert on its rank at no
upload cost: pins never contradict the placement.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..families.moe_path import attached_path, moe_path
from ..pipelining.partition import PartitionedExecutor
from ..offload.api import enable_expert_offload, get_offload_engine
from ..offload.config import OffloadConfig
from ..offload.engine import OffloadEngine
from ..offload.stores.store import ExpertKey
from .comm_stages import AllToAllComm, PPMoEComm
from .placement import Placement, PlacementCost, plan_placement, static_owner, static_placement
from .shared_store import create_node_shared_store, private_copy

logger = logging.getLogger(__name__)

MODES = ("static", "dynamic", "ppmoe")


def _require_distributed() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "expert parallelism needs torch.distributed: start the script with `accelerate launch --num_processes N "
            "...` (CPU: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu ...) and create the Accelerator (or "
            "TrainingArguments) before calling enable_expert_parallel"
        )


class ExpertParallelCoordinator:
    """Per-process state of expert parallelism: placements, update ownership, pins, fences (see module docstring).

    Also the `UpdateCoordinator` of the offload engine (hf_moe_offload.offload.ledger) in the offloaded tiers.
    """

    def __init__(self, mode: str, group, num_experts: Sequence[int], engine: OffloadEngine | None,
                 cost: PlacementCost, pin_fraction: float, validate_replicated: bool):
        self.mode = mode
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # DDP averages over the default group (accelerate's); expert gradients from all-to-all get the same divisor.
        self.ddp_world_size = dist.get_world_size()
        self.num_experts = list(num_experts)
        self.engine = engine
        self.cost = cost
        self.pin_fraction = pin_fraction
        self.validate_replicated = validate_replicated
        self.device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
                       else torch.device("cpu"))
        self.placements: dict[int, Placement] = {}  # last training forward of each layer
        self.expert_tokens: dict[int, list[int]] = {}  # global tokens per expert in that forward
        self.pins: dict[int, dict[int, int]] = {}  # layer -> {expert: rank}
        self.layers: list = []  # the MoELayers of the model's path this coordinator runs
        self.ppmoe_validated: set[int] = set()  # layers whose replicated input was checked (mode="ppmoe")
        # Telemetry: tokens each rank ran in the last forward of each layer, and the running max/mean ratio.
        self.rank_tokens: dict[int, list[int]] = {}
        self._imbalance_sum = 0.0
        self._imbalance_n = 0

    # --- placement (ES-MoE §4.2) ---
    def place(self, layer: int, counts: torch.Tensor, training: bool) -> Placement:
        tokens = counts.sum(0).tolist()
        if self.mode == "dynamic":
            placement = plan_placement(tokens, self.world_size, self.cost, pinned=self.pins.get(layer))
        else:
            placement = static_placement(tokens, self.world_size, self.cost)
        if training:
            self.placements[layer] = placement
            self.expert_tokens[layer] = tokens
        self.rank_tokens[layer] = placement.tokens
        total = sum(placement.tokens)
        if total:
            self._imbalance_sum += max(placement.tokens) / (total / self.world_size)
            self._imbalance_n += 1
        return placement

    def load_imbalance(self, reset: bool = True) -> float:
        """Mean over MoE-layer forwards of (max tokens on a rank) / (mean tokens per rank); 1.0 is perfect."""
        value = self._imbalance_sum / self._imbalance_n if self._imbalance_n else 1.0
        if reset:
            self._imbalance_sum, self._imbalance_n = 0.0, 0
        return value

    # --- ownership of expert updates (UpdateCoordinator) ---
    def owner(self, layer: int, expert: int) -> int:
        placement = self.placements.get(layer)
        if placement is not None and placement.rank_of[expert] >= 0:
            return placement.rank_of[expert]
        pinned = self.pins.get(layer, {}).get(expert)
        if pinned is not None:
            return pinned
        if self.mode != "dynamic":
            return static_owner(expert, self.num_experts[layer], self.world_size)
        return (layer * self.num_experts[layer] + expert) % self.world_size

    def owns_update(self, key: ExpertKey) -> bool:
        return self.owner(*key) == self.rank

    def all_reduce_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return float(t)

    def all_reduce_max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t)

    def pinned_keys(self) -> list[ExpertKey]:
        """This rank's pinned experts (the engine keeps them resident: disk cache, device copies)."""
        return [(layer, e) for layer, pins in self.pins.items() for e, r in pins.items() if r == self.rank]

    def _recompute_pins(self) -> None:
        """ES-MoE §4.3: each GPU pins its top n_p experts of the previous iteration, n_p = pin_fraction of the
        experts it ran. Computed from the window's last placements, identically on every rank."""
        self.pins = {}
        if self.mode != "dynamic" or not self.pin_fraction:
            return
        for layer, placement in self.placements.items():
            tokens = self.expert_tokens[layer]
            pins: dict[int, int] = {}
            for r in range(self.world_size):
                ran = placement.experts_of(r)
                for e in sorted(ran, key=lambda e: (-tokens[e], e))[: math.ceil(self.pin_fraction * len(ran))]:
                    pins[e] = r
            self.pins[layer] = pins

    def window_closed(self) -> None:
        """Fence at the end of an optimizer step (called by every rank's ExpertOptimizer): this rank's expert updates
        are done and visible (disk tier: written back); once the barrier returns, so are every other rank's. Then the
        pins for the next window are chosen and applied."""
        if self.engine is None:
            return
        self.engine.synchronize()
        publish = getattr(self.engine.store, "publish", None)
        if publish is not None:
            publish()
        self._recompute_pins()
        self.engine.pins.update()
        dist.barrier(group=self.group)

    def comm_stage(self, overlap: bool = True):
        """The communication stage of MPMoE's partitioned layer for this mode (hf_moe_offload.pipelining)."""
        return (PPMoEComm if self.mode == "ppmoe" else AllToAllComm)(self, overlap=overlap)

    def on_layer_backward_done(self, layer: int) -> None:
        """Engine hook: the gradients this rank just added to layer `layer`'s experts must reach the node-shared files
        before the next micro-step may place those experts elsewhere (disk tier; a no-op on the host tier)."""
        publish = getattr(self.engine.store, "publish", None)
        if publish is not None:
            keys = [(layer, e) for e in range(self.num_experts[layer])]
            for key in keys:  # gradients still landing on the host worker (asynchronous runtimes) first
                self.engine.ledger.wait_for_grad(key)
            publish(keys)


def get_expert_parallel(model: nn.Module) -> ExpertParallelCoordinator | None:
    """The model's coordinator (held by its MoE path), or None where expert parallelism is off."""
    path = attached_path(model)  # DDP-wrapped models too
    return path.expert_parallel if path is not None else None


def enable_expert_parallel(
    model: nn.Module,
    mode: str = "dynamic",
    group=None,
    offload_config: OffloadConfig | None = None,
    placement_cost: PlacementCost | None = None,
    pin_fraction: float | None = None,
    shared_dir: str = "/dev/shm",
    validate_replicated: bool = True,
) -> ExpertParallelCoordinator:
    """Distribute the experts of `model` over the ranks of `group` (default: all processes). Collective: every rank
    calls it, after the Accelerator / TrainingArguments exist and before `accelerator.prepare` / `Trainer(...)`.

    - `mode="static"`: experts in fixed contiguous blocks per rank, all-to-all exchange. Device tier (resident
      experts): expert parameters are kept out of DDP; run `sync_expert_parameters(model)` before saving from one rank.
    - `mode="dynamic"`: ES-MoE §4.2 placement per layer and batch. Needs offloaded experts: pass
      `offload_config=OffloadConfig(mode="host"|"disk", ...)` (for the disk tier its `offload_dir` must be the same
      path on every rank of the node), or offload the model first (its store then becomes node-shared).
    - `mode="ppmoe"`: PPMoE §3.3 index-select + all-reduce, for MoE inputs identical across the group.

    `placement_cost` (dynamic): the LPT cost model; must be identical on every rank (default: measured on GPUs,
    token balance on CPUs, see `PlacementCost`). `pin_fraction`: experts pinned
    per rank (default: the offload config's). Create the `ExpertOptimizer` (or the Trainer with
    `ExpertOptimizerCallback`) after this call.
    """
    _require_distributed()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError("enable_expert_parallel must run before accelerator.prepare / Trainer wraps the model in DDP "
                         "(expert parameters have to be excluded from DDP first)")
    if get_expert_parallel(model) is not None:
        raise RuntimeError("expert parallelism is already enabled on this model; call disable_expert_parallel first")
    path = moe_path(model)
    for layer in path.layers:
        if layer.parallel is not None or layer.pipelined is not None:
            raise ValueError(
                f"MoE layer {layer.name} already runs {layer.executor!r}; enable expert parallelism first and "
                "micro-batch pipelining after it (it then runs over this exchange)"
            )
    if mode == "dynamic" and not _offloaded(model) and not _wants_offload(offload_config):
        raise ValueError(_NO_STORE)
    if group is None:
        # A communicator of its own: token exchanges never interleave with DDP's gradient all-reduces.
        group = dist.new_group(list(range(dist.get_world_size())))
    engine = _node_shared_engine(model, mode, offload_config, group, shared_dir)
    offloaded = engine is not None and engine.store is not None
    num_experts = [layer.num_experts for layer in path.layers]
    if pin_fraction is None:
        pin_fraction = engine.pin_fraction if offloaded else 0.0
    if placement_cost is None:
        placement_cost = _default_placement_cost(model, mode, group, engine if offloaded else None)
    coordinator = ExpertParallelCoordinator(mode, group, num_experts, engine if offloaded else None,
                                            placement_cost, pin_fraction, validate_replicated)
    if offloaded:
        engine.set_coordinator(coordinator)
        coordinator.layer_hook = engine.ledger.add_layer_done_hook(coordinator.on_layer_backward_done)
    else:
        _exclude_from_ddp(model, path.layers)
    # One exchange implementation: the layer is one partition of MPMoE's partitioned executor over this mode's
    # communication stage (comm_stages.py); micro-batch pipelining later runs n partitions over the same stage.
    executor = PartitionedExecutor(1, "keep", comm=coordinator.comm_stage())
    for layer in path.layers:
        layer.set_parallel(executor)
    coordinator.layers = list(path.layers)
    path.expert_parallel = coordinator
    logger.info("expert parallelism: mode=%s, %d MoE layers, rank %d of %d, experts %s", mode, len(path.layers),
                coordinator.rank, coordinator.world_size, "offloaded (node-shared store)" if offloaded else "resident")
    return coordinator


_NO_STORE = (
    "mode='dynamic' places experts per batch, so they must stream from a store: pass "
    "offload_config=OffloadConfig(mode='host') (or 'disk' with offload_dir), or use mode='static' for resident "
    "experts"
)


def _offloaded(model: nn.Module) -> bool:
    engine = get_offload_engine(model)
    return engine is not None and engine.store is not None


def _wants_offload(config: OffloadConfig | None) -> bool:
    return config is not None and config.mode in ("host", "disk", "auto")


def _node_shared_engine(model: nn.Module, mode: str, offload_config: OffloadConfig | None, group,
                        shared_dir: str) -> OffloadEngine | None:
    """The model's offload engine over a node-shared store: the experts offloaded straight into one (when
    `offload_config` asks for offload), or the existing store replaced by one; None or a device-tier engine where
    the experts stay resident."""
    engine = get_offload_engine(model)
    offloaded = _offloaded(model)
    if not offloaded and _wants_offload(offload_config):
        engine = _offload_into_shared_store(model, offload_config, group, shared_dir)
    elif offloaded:
        _share_existing_store(engine, offload_config, group, shared_dir)
    if mode == "dynamic" and not (engine is not None and engine.store is not None):  # "auto" chose the device tier
        raise ValueError(_NO_STORE)
    return engine


def _default_placement_cost(model: nn.Module, mode: str, group, engine: OffloadEngine | None) -> PlacementCost:
    """ES-MoE §4.2 cost for dynamic placement: measured on GPUs (expert compute per token + one upload); token
    balance elsewhere (on a CPU the experts are used in place, so uploads cost nothing)."""
    cfg = getattr(model, "config", None)
    if mode != "dynamic" or dist.get_backend(group) != "nccl" or not hasattr(cfg, "intermediate_size"):
        return PlacementCost()
    dtype = engine.store.compute_dtype if engine is not None else torch.float32
    cost = PlacementCost.measure(cfg.hidden_size, cfg.intermediate_size, dtype,
                                 torch.device("cuda", torch.cuda.current_device()), group=group)
    logger.info("placement cost measured: %.3g s per token, %.3g s per expert upload (= %.0f tokens)",
                cost.seconds_per_token, cost.upload_seconds, cost.upload_seconds / cost.seconds_per_token)
    return cost


def _node_store_factory(group, shared_dir: str, offload_dir: str | None, io_threads: int):
    def factory(tier, keys, numel, compute_dtype, stats, cache_experts):
        store, _leader = create_node_shared_store(tier, keys, numel, compute_dtype, stats, group=group,
                                                  shared_dir=shared_dir, offload_dir=offload_dir,
                                                  cache_experts=cache_experts, io_threads=io_threads)
        return store

    return factory


def _is_leader(group) -> bool:
    ranks = dist.get_process_group_ranks(group)
    return dist.get_rank() == ranks[0]


def _offload_into_shared_store(model: nn.Module, config: OffloadConfig, group, shared_dir: str):
    """Offload the experts straight into a node-shared store; only the node leader writes them (one copy)."""
    leader = _is_leader(group)
    factory = _node_store_factory(group, shared_dir, config.offload_dir, config.io_threads)
    engine = enable_expert_offload(model, config, _initialize=leader, store_factory=factory)
    dist.barrier(group=group)  # the leader's copy is complete (disk: flushed) before anyone reads it
    return engine


def _share_existing_store(engine: OffloadEngine, config: OffloadConfig | None, group, shared_dir: str) -> None:
    """Replace an offloaded model's per-process store by a node-shared copy of the leader's (weights, moments and
    step counts). The ExpertOptimizer, which holds the store, must be created afterwards."""
    if engine.ledger.has_hooks():
        raise RuntimeError(
            "an ExpertOptimizer (or another hook) is already attached to this model's offload engine: call "
            "enable_expert_parallel before creating the ExpertOptimizer / the Trainer with ExpertOptimizerCallback"
        )
    old = engine.store
    offload_dir = None
    if old.tier == "disk":
        if config is None or not config.offload_dir:
            raise ValueError(
                "sharing a disk-tier store needs a node-shared directory: pass "
                "offload_config=OffloadConfig(mode='disk', offload_dir=...) with the same offload_dir on every rank"
            )
        offload_dir = config.offload_dir
        if os.path.abspath(offload_dir) == os.path.abspath(old.dir):
            raise ValueError(f"offload_dir {offload_dir!r} is this rank's private store; choose a new directory")
    engine.synchronize()
    store, leader = create_node_shared_store(
        old.tier, old.keys(), old.numel, old.compute_dtype, engine.stats, group=group, shared_dir=shared_dir,
        offload_dir=offload_dir, cache_experts=getattr(old, "cache_experts", None),
        io_threads=config.io_threads if config is not None else 2,
    )
    if leader:
        store.copy_experts_from(old)
        store.flush()
    dist.barrier(group=group)
    engine.replace_store(store)
    old.close()


def _expert_parameter_ids(layers) -> set[int]:
    return {id(p) for layer in layers for p in layer.resident.expert_parameters()}


def _expert_parameter_names(model: nn.Module, layers) -> list[str]:
    ids = _expert_parameter_ids(layers)
    return [n for n, p in model.named_parameters() if id(p) in ids]


def _exclude_from_ddp(model: nn.Module, layers) -> None:
    """Resident experts are not replicas: each rank's gradient is complete for its experts and zero elsewhere, so DDP
    must not average them (torch DDP reads `_ddp_params_and_buffers_to_ignore` when it wraps the model)."""
    names = _expert_parameter_names(model, layers)
    existing = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    model._ddp_params_and_buffers_to_ignore = existing + [n for n in names if n not in existing]


def sync_expert_parameters(model: nn.Module) -> None:
    """Device tier (static / ppmoe): copy every expert's weights from the rank that trains it to all ranks, so that
    any rank (e.g. rank 0 saving a checkpoint) holds the trained model. Collective."""
    coordinator = get_expert_parallel(model)
    if coordinator is None:
        raise RuntimeError("expert parallelism is not enabled on this model")
    if coordinator.engine is not None:
        return  # offloaded: one node-shared copy, nothing to gather
    src_ranks = dist.get_process_group_ranks(coordinator.group)
    with torch.no_grad():
        for layer in coordinator.layers:
            E = layer.num_experts
            for p in layer.resident.expert_parameters():
                for r in range(coordinator.world_size):
                    owned = [e for e in range(E) if static_owner(e, E, coordinator.world_size) == r]
                    if owned:  # a contiguous block: a contiguous slice of the (E, ...) tensor
                        dist.broadcast(p.data[owned[0] : owned[-1] + 1], src=src_ranks[r], group=coordinator.group)


def clip_grad_norm_(model: nn.Module, max_norm: float, parameters=None) -> float:
    """`torch.nn.utils.clip_grad_norm_` over all parameters for the device tier under static / ppmoe expert
    parallelism: expert gradients live on the rank that ran the expert, so their squared norms are all-reduced.
    Non-expert gradients (replicated after DDP) count once. Returns the total norm. Collective."""
    coordinator = get_expert_parallel(model)
    if coordinator is None:
        raise RuntimeError("expert parallelism is not enabled on this model")
    inner = getattr(model, "module", model)
    expert_ids = _expert_parameter_ids(coordinator.layers)
    params = [p for p in (parameters if parameters is not None else inner.parameters()) if p.grad is not None]
    local = sum(float(p.grad.double().pow(2).sum()) for p in params if id(p) in expert_ids)
    shared = sum(float(p.grad.double().pow(2).sum()) for p in params if id(p) not in expert_ids)
    total = math.sqrt(coordinator.all_reduce_sum(local) + shared)
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef)
    return total


def disable_expert_parallel(model: nn.Module, offload_dir: str | None = None) -> None:
    """Remove the executors; every rank then holds the whole model again. Collective.

    Device tier: gathers the experts first (`sync_expert_parameters`). Offloaded tiers: the node-shared store is
    copied into a private store of this process (host tier: host memory; disk tier: files in `offload_dir`, a
    directory of this rank's own), since processes training independently must not share expert state. Close any
    ExpertOptimizer first (it holds the shared store).
    """
    coordinator = get_expert_parallel(model)
    if coordinator is None:
        raise RuntimeError("expert parallelism is not enabled on this model")
    if any(layer.pipelined is not None for layer in coordinator.layers):
        raise RuntimeError("micro-batch pipelining runs over this model's expert parallelism: call "
                           "hf_moe_offload.pipelining.disable_micro_batch_pipelining(model) first")
    engine = coordinator.engine
    if engine is None:
        sync_expert_parameters(model)
        names = set(_expert_parameter_names(model, coordinator.layers))
        model._ddp_params_and_buffers_to_ignore = [
            n for n in getattr(model, "_ddp_params_and_buffers_to_ignore", []) if n not in names
        ]
    else:
        shared = engine.store
        if shared.tier == "disk" and not offload_dir:
            raise ValueError("disable_expert_parallel on the disk tier needs offload_dir: a directory of this rank's "
                             "own for its private copy of the experts")
        engine.synchronize()
        dist.barrier(group=coordinator.group)  # every rank's updates are in the shared copy
        private = private_copy(shared, engine.stats, offload_dir)
        dist.barrier(group=coordinator.group)  # nobody reads the shared copy any more
        engine.replace_store(private)
        shared.close()
        engine.set_coordinator(None)
        coordinator.layer_hook.remove()
    for layer in coordinator.layers:
        layer.set_parallel(None)
    path = attached_path(model)
    path.expert_parallel = None
    path.remove_if_idle()


__all__ = [
    "MODES",
    "ExpertParallelCoordinator",
    "enable_expert_parallel",
    "disable_expert_parallel",
    "get_expert_parallel",
    "sync_expert_parameters",
    "clip_grad_norm_",
]
