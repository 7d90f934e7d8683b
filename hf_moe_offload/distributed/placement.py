"""Dynamic expert placement (ES-MoE §4.2): which rank runs which expert of one MoE layer for one batch.

ES-MoE §4.2 decouples placement from routing: experts stream from host memory, so every batch's experts can be placed
to balance the load instead of sitting on a fixed rank. Placing n experts on k ranks to minimise the finishing time
of the busiest rank is minimum-makespan scheduling (strongly NP-hard); ES-MoE uses Graham's (1969) greedy
longest-processing-time (LPT) rule, a 4/3-approximation (precisely 4/3 - 1/(3k)):

    cost(e)  = tokens(e) * seconds_per_token + upload_seconds       # ES-MoE §4.2 "upload time plus processing time"
    sort experts by cost, largest first; give each to the rank with the lowest accumulated cost.

Experts pinned on a rank (ES-MoE §4.3) stay on that rank and cost no upload there; they are placed first, so LPT
starts from the ranks' pinned loads. Experts that received no token anywhere are not placed (nothing to upload or
run). Every rank computes the same placement from the same all-gathered token counts: the rule is deterministic
(ties go to the lower expert id, then to the lower rank), so no placement message is ever sent.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PlacementCost:
    """Cost model of one expert on one rank: `tokens * seconds_per_token + upload_seconds` (ES-MoE §4.2).

    Only the ratio matters to the planner, so the default (1 token = 1 unit, free uploads) balances tokens, which is
    right where experts are used in place (CPU host tier) or already resident. On GPUs `enable_expert_parallel`
    measures both (`PlacementCost.measure`, MAX-reduced over the ranks); or give them from the hardware's data sheet
    with `PlacementCost.from_hardware`. Every rank must use the same values (they decide the placement
    independently).

    Example:

    ```python
    >>> cost = PlacementCost.from_hardware(expert_params=2 * 1024 * 4096, bytes_per_param=2,
    ...                                    device_flops=200e12, upload_bytes_per_s=25e9)
    >>> round(cost.upload_seconds / cost.seconds_per_token)  # an upload costs as much as this many tokens
    2667
    ```
    """

    seconds_per_token: float = 1.0
    upload_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not self.seconds_per_token > 0:
            raise ValueError(f"PlacementCost.seconds_per_token must be positive, got {self.seconds_per_token}")
        if self.upload_seconds < 0:
            raise ValueError(f"PlacementCost.upload_seconds must be >= 0, got {self.upload_seconds}")

    @classmethod
    def from_hardware(cls, expert_params: int, bytes_per_param: int, device_flops: float,
                      upload_bytes_per_s: float, training: bool = True) -> "PlacementCost":
        """Per-token compute of an FFN expert is 2 FLOPs per weight forward (x3 with backward); an upload moves the
        expert's weights once (forward; backward re-streams them, which doubles both terms alike)."""
        flops_per_token = 2 * expert_params * (3 if training else 1)
        return cls(seconds_per_token=flops_per_token / device_flops,
                   upload_seconds=expert_params * bytes_per_param / upload_bytes_per_s)

    @classmethod
    def measure(cls, hidden: int, intermediate: int, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", group=None, training: bool = True,
                rows: int = 512, reps: int = 5) -> "PlacementCost":
        """Both terms timed on this machine: one expert FFN on `rows` tokens (x3 for backward when training) and,
        on a GPU, one upload of the expert's weights from pinned host memory. On a CPU-only machine uploads cost
        nothing (the host is the device), which makes the plan balance tokens. The timings are MAX-reduced over
        `group` when torch.distributed is initialised, so that every rank plans with the same costs."""
        from ..pipelining.configurator import all_reduce_max, time_best  # noqa: PLC0415 (keeps placement light)

        device = torch.device(device)
        x = torch.randn(rows, hidden, dtype=dtype, device=device)
        w1 = torch.randn(intermediate, hidden, dtype=dtype, device=device)
        w2 = torch.randn(hidden, intermediate, dtype=dtype, device=device)
        per_token = time_best(lambda: F.linear(F.gelu(F.linear(x, w1)), w2), device, reps) / rows
        upload = 0.0
        if device.type == "cuda":
            host = torch.empty(2 * hidden * intermediate, dtype=dtype, pin_memory=True)
            dev = torch.empty_like(host, device=device)
            upload = time_best(lambda: dev.copy_(host, non_blocking=True), device, reps)
        per_token, upload = all_reduce_max([per_token * (3 if training else 1), upload], device, group)
        return cls(seconds_per_token=max(per_token, 1e-12), upload_seconds=upload)

    def expert_cost(self, tokens: int, resident: bool) -> float:
        return tokens * self.seconds_per_token + (0.0 if resident else self.upload_seconds)


@dataclass
class Placement:
    """Result of `plan_placement`: `rank_of[e]` is the rank running expert e (-1: no token, not placed)."""

    rank_of: list[int]
    load: list[float]  # modelled cost per rank
    tokens: list[int] = field(default_factory=list)  # tokens per rank

    @property
    def world_size(self) -> int:
        return len(self.load)

    def experts_of(self, rank: int) -> list[int]:
        """Experts placed on `rank`, in ascending id order (the order the rank runs them)."""
        return [e for e, r in enumerate(self.rank_of) if r == rank]

    @property
    def makespan(self) -> float:
        return max(self.load) if self.load else 0.0


def plan_placement(
    tokens: Sequence[int],
    world_size: int,
    cost: PlacementCost | None = None,
    pinned: Mapping[int, int] | None = None,
) -> Placement:
    """Greedy LPT placement of experts on `world_size` ranks (Graham 1969; ES-MoE §4.2).

    Args:
        tokens: global tokens routed to each expert in this batch (summed over ranks), length E.
        world_size: number of ranks.
        cost: the cost model (default: tokens only).
        pinned: expert -> rank for experts resident on a rank (ES-MoE §4.3); they stay there and cost no upload.

    O(E log E + E log k), a few tens of microseconds in Python for hundreds of experts.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    cost = cost or PlacementCost()
    pinned = dict(pinned or {})
    for e, r in pinned.items():
        if not 0 <= r < world_size:
            raise ValueError(f"expert {e} is pinned on rank {r}, outside 0..{world_size - 1}")
        if not 0 <= e < len(tokens):
            raise ValueError(f"pinned expert {e} does not exist (the layer has {len(tokens)} experts)")
    rank_of = [-1] * len(tokens)
    load = [0.0] * world_size
    rank_tokens = [0] * world_size
    for e in sorted(pinned):
        if tokens[e] > 0:
            r = pinned[e]
            rank_of[e] = r
            load[r] += cost.expert_cost(tokens[e], resident=True)
            rank_tokens[r] += tokens[e]
    # ES-MoE §4.2: LPT, 4/3-approximation. Sort by cost (largest first); ties by expert id for determinism.
    jobs = sorted(
        ((cost.expert_cost(n, resident=False), e) for e, n in enumerate(tokens) if n > 0 and e not in pinned),
        key=lambda j: (-j[0], j[1]),
    )
    heap = [(load[r], r) for r in range(world_size)]
    heapq.heapify(heap)
    for c, e in jobs:
        lo, r = heapq.heappop(heap)
        rank_of[e] = r
        load[r] = lo + c
        rank_tokens[r] += tokens[e]
        heapq.heappush(heap, (load[r], r))
    return Placement(rank_of=rank_of, load=load, tokens=rank_tokens)


def static_placement(tokens: Sequence[int], world_size: int, cost: PlacementCost | None = None) -> Placement:
    """Static expert parallelism: expert e lives on rank `static_owner(e, E, world_size)` whatever the load."""
    cost = cost or PlacementCost()
    E = len(tokens)
    rank_of = [static_owner(e, E, world_size) if n > 0 else -1 for e, n in enumerate(tokens)]
    load = [0.0] * world_size
    rank_tokens = [0] * world_size
    for e, r in enumerate(rank_of):
        if r >= 0:
            load[r] += cost.expert_cost(tokens[e], resident=True)
            rank_tokens[r] += tokens[e]
    return Placement(rank_of=rank_of, load=load, tokens=rank_tokens)


def static_owner(expert: int, num_experts: int, world_size: int) -> int:
    """Contiguous blocks of experts per rank (the first `E mod k` ranks get one more), as in fairseq/DeepSpeed EP."""
    base, extra = divmod(num_experts, world_size)
    cut = extra * (base + 1)
    if expert < cut:
        return expert // (base + 1)
    return extra + (expert - cut) // base if base else world_size - 1


def makespan_lower_bound(costs: Sequence[float], world_size: int) -> float:
    """max(mean load, largest job): no placement can beat it (used by the benchmark)."""
    costs = list(costs)
    if not costs:
        return 0.0
    return max(sum(costs) / world_size, max(costs))


def lpt_bound(world_size: int) -> float:
    """Graham's worst-case ratio of LPT to the optimum: 4/3 - 1/(3k)."""
    return 4.0 / 3.0 - 1.0 / (3.0 * world_size)


def optimal_makespan(costs: Sequence[float], world_size: int, initial: Sequence[float] | None = None) -> float:
    """Exact minimum makespan by branch and bound (exponential: for tests and small benchmarks only, <= ~14 jobs)."""
    jobs = sorted(costs, reverse=True)
    loads = list(initial) if initial is not None else [0.0] * world_size
    best = [math.inf]
    lb = makespan_lower_bound([*jobs], world_size) if initial is None else 0.0

    def search(i: int, current: float) -> None:
        if current >= best[0]:
            return
        if i == len(jobs):
            best[0] = current
            return
        seen: set[float] = set()
        for r in range(world_size):
            if loads[r] in seen:  # symmetric ranks: trying one is enough
                continue
            seen.add(loads[r])
            loads[r] += jobs[i]
            search(i + 1, max(current, loads[r]))
            loads[r] -= jobs[i]
            if best[0] <= lb:
                return

    search(0, max(loads) if loads else 0.0)
    return best[0]


__all__ = [
    "PlacementCost",
    "Placement",
    "plan_placement",
    "static_placement",
    "static_owner",
    "makespan_lower_bound",
    "lpt_bound",
    "optimal_makespan",
]
