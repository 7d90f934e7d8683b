"""Mixed precision across recomputation: backward re-runs forward work under the autocast state of the forward.

Autograd runs backward outside the user's `torch.autocast` block, so anything a backward recomputes (the offload
engine's expert FFNs, MPMoE's S3/S4 restore, a comm stage's re-dispatch) re-enters the state its forward recorded;
otherwise the recomputed GEMMs (and the gradient GEMMs after them) would run in fp32.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

AutocastState = tuple[bool, torch.dtype, bool]


def autocast_state(device_type: str) -> AutocastState:
    """The current autocast state of `device_type` (record it in forward)."""
    return (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled())


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype GEMMs on `x` run in: the autocast dtype of its device where autocast is on, else its own."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def restore_autocast(device_type: str, state: AutocastState) -> torch.autocast:
    """A context that re-enters a recorded autocast state (use it around backward-time recomputation)."""
    enabled, dtype, cache = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache)


_GEMMS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm,
          torch.ops.aten._addmm_activation}
if hasattr(torch.ops.aten, "_grouped_mm"):  # the grouped expert GEMM (torch >= 2.8)
    _GEMMS.add(torch.ops.aten._grouped_mm)


class GemmCounter(TorchDispatchMode):
    """Counts the matrix multiplications that run inside the block, by dtype (a diagnostic: e.g. no float32 GEMM
    should run in the backward of an autocast forward), and every aten op dispatched on this thread by name (`ops`:
    on a GPU each is a kernel launch or a view; e.g. the work of a streamed layer must not grow with its experts).

    ```python
    >>> with GemmCounter() as gemms:
    ...     loss.backward()
    >>> gemms.by_dtype[torch.float32]
    0
    ```
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_dtype: Counter[torch.dtype] = Counter()
        self.ops: Counter[str] = Counter()

    @property
    def gemms(self) -> int:
        return sum(self.by_dtype.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[str(func.overloadpacket)] += 1
        if func.overloadpacket in _GEMMS:
            self.by_dtype[out.dtype] += 1
        return out


__all__ = ["AutocastState", "GemmCounter", "autocast_state", "restore_autocast"]
