"""Several GPUs under `accelerate launch`: token exchange, static expert parallelism, ES-MoE dynamic expert placement
(§4.2) with a node-shared expert store, and Pipeline-MoE dispatch (PPMoE §3.3).

May import: `families`, `offload`, `pipelining`.
"""

from .callback import ExpertParallelCallback
from .exchange import (
    ExchangePlan,
    all_gather_counts,
    all_to_all,
    copy_to_group,
    end_process_groups,
    reduce_from_group,
    scale_grad,
)
from .expert_parallel import (
    ExpertParallelCoordinator,
    clip_grad_norm_,
    disable_expert_parallel,
    enable_expert_parallel,
    get_expert_parallel,
    sync_expert_parameters,
)
from .placement import Placement, PlacementCost, plan_placement, static_owner, static_placement
from .shared_store import SharedDiskExpertStore, SharedHostExpertStore, create_node_shared_store

__all__ = [
    "all_to_all",
    "copy_to_group",
    "reduce_from_group",
    "scale_grad",
    "all_gather_counts",
    "ExchangePlan",
    "end_process_groups",
    "PlacementCost",
    "Placement",
    "plan_placement",
    "static_placement",
    "static_owner",
    "SharedHostExpertStore",
    "SharedDiskExpertStore",
    "create_node_shared_store",
    "ExpertParallelCoordinator",
    "enable_expert_parallel",
    "disable_expert_parallel",
    "get_expert_parallel",
    "sync_expert_parameters",
    "clip_grad_norm_",
    "ExpertParallelCallback",
]
