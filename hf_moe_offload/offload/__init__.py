"""ES-MoE expert offload (§4.1, §4.3): the experts in host memory or on disk, streamed a chunk at a time to where they
compute, stepped on the host.

Here: the user's settings (`config`) resolved once at bind into a plan (`plan`), the engine that owns the shared
resources (`resources`) and composes the parts (`engine`; `resident` for the device tier, `copies` for deep copies),
what the expert optimizer sees of it (`updates`, `ledger`), enabling and disabling (`api`), loading and saving whole
models (`checkpoint`, `saving`), the tier for a memory budget (`planner`) and the counters (`telemetry`). The parts,
each in its subpackage: `stores` (the tiers and their files), `streaming` (a chunk and its gradients), `pins`,
`inference`, `lora`. A part receives what it uses from the engine when the engine composes it (the shared resources,
the other parts it calls, the engine's calls it needs), never the engine itself.

May import: `errors`, `families`, `host_threads`, `models`, `precision`, `rng`, `runtime`.
"""

from .api import disable_expert_offload, enable_expert_offload, find_expert_modules, get_offload_engine, reference_copy
from .config import OffloadConfig
from .engine import OffloadEngine
from ..families.layouts import ExpertLayout, ExpertTensor, layout_for
from .planner import choose_tier, estimate_memory
from .stores.disk_store import DiskExpertStore
from .stores.store import (
    CorruptExpertFileError,
    ExpertStore,
    ExpertStoreError,
    ExpertStoreFullError,
    HostExpertStore,
)
from .telemetry import OffloadStats

__all__ = [
    "OffloadConfig",
    "OffloadEngine",
    "OffloadStats",
    "enable_expert_offload",
    "disable_expert_offload",
    "get_offload_engine",
    "find_expert_modules",
    "reference_copy",
    "ExpertLayout",
    "ExpertTensor",
    "layout_for",
    "estimate_memory",
    "choose_tier",
    "ExpertStore",
    "HostExpertStore",
    "DiskExpertStore",
    "ExpertStoreError",
    "ExpertStoreFullError",
    "CorruptExpertFileError",
]
