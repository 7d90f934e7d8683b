"""Measured vs theoretical activation-memory saving of memory reuse (MPMoE §3.3, Eq. 4-6; §5.4, Fig. 12).

What is counted (bytes, each storage once):

- baseline `keep_bytes`: everything autograd saves for backward while the unpartitioned layer (`run_moe`) runs,
  excluding parameters: T_DI, T_M (what the experts save: ReLU's output, saved by ReLU and fc2, counts once), T_DO
  and the combine weights (saved by the weighting), the row index (saved by dispatch and combine).
- with n partitions and strategy S (`reuse_bytes`): what stays on the device for backward (saved outside the
  partition hooks: the row indices; inside: nothing for S1-S4) PLUS the buffers the partitions share while they run,
  with the multiplicities of §3.3 / Fig. 6: two buffers for T_DI and T_DO (communication + computation), one for T_M,
  each the size of the largest partition's tensors as actually saved.
- saving = keep_bytes - reuse_bytes, compared with Eq. 5, B (2M (n-2)/n + H (n-1)/n) elements, with B = the number
  of dispatched rows (tokens x top-k), M = hidden size, H = expert intermediate size.

NOTE: the paper assumes an in-place activation (T_M is one (B, H) tensor); measure with ReLU to match it (GELU saves
its input too, so T_M counts twice and the measured saving exceeds the bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.moe_gpt.moe_ops import run_moe
from .partition import PartitionedExecutor


def _count_saved(fn, exclude: set[int]) -> tuple[torch.Tensor, int]:
    seen: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key not in exclude:
            seen[key] = t  # held until the end: no address reuse while counting
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(t.untyped_storage().nbytes() for t in seen.values())


def eq5_saving_elements(rows: int, hidden: int, intermediate: int, n: int) -> float:
    """Eq. 5: Delta M_act = B (2M (n-2)/n + H (n-1)/n) elements."""
    return rows * (2 * hidden * (n - 2) / n + intermediate * (n - 1) / n)


def eq6_saving_ratio(
    rows: int, hidden: int, intermediate: int, num_experts: int, n: int, saving_elements: float
) -> float:
    """Eq. 6: phi = (dM_act + dM_buf) / (M_ms + M_act^pipe + M_buf^pipe), with dM_buf = dM_act (elements)."""
    m_ms = 4 * (num_experts * hidden + 2 * intermediate * hidden)  # Eq. 1
    m_act = 4 * rows * hidden + rows * intermediate  # Eq. 2 = Eq. 4
    return 2 * saving_elements / (m_ms + 2 * m_act)


@dataclass
class SavingMeasurement:
    keep_bytes: int
    reuse_bytes: int
    theory_bytes: float

    @property
    def saving_bytes(self) -> int:
        return self.keep_bytes - self.reuse_bytes

    @property
    def fraction_of_bound(self) -> float:
        return self.saving_bytes / self.theory_bytes if self.theory_bytes else float("nan")


def measure_saving(x: torch.Tensor, plan, experts, n: int, strategy: str) -> SavingMeasurement:
    """Run the layer unpartitioned and as (n, strategy), count what is saved for backward (see module docstring).
    `experts`: resident experts in the sorted signature (`hf_moe_offload.families.moe_path.sorted_experts(module)`). `plan`:
    built with `gathers=False`, the partitions' own index_add_ combine (the unpartitioned layer's gathering combine
    saves no copy of T_DO, a smaller baseline than the one Eq. 5 counts from)."""
    params = {p.untyped_storage().data_ptr() for p in experts.expert_parameters()}
    _, keep = _count_saved(lambda: run_moe(x, plan, experts), params)
    ex = PartitionedExecutor(n, strategy)
    _, outside = _count_saved(lambda: ex(x, plan, experts), params)
    st = ex.last_stats
    buffers = 2 * st.max_partition["tdi"] + st.max_partition["tm"] + 2 * st.max_partition["tdo"]
    reuse = outside + st.total(fate="device") + (buffers if strategy != "keep" else 0)
    hidden = x.shape[1]
    intermediate = experts.layout.intermediate_size
    theory = eq5_saving_elements(plan.token_index.numel(), hidden, intermediate, n) * x.element_size()
    return SavingMeasurement(keep, reuse, theory)


__all__ = ["SavingMeasurement", "eq5_saving_elements", "eq6_saving_ratio", "measure_saving"]
