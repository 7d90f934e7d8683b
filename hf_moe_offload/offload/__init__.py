"""ES-MoE expert offload: expert store tiers, chunked streaming of the experts, pinning, adaptive mode."""

from .api import disable_expert_offload, enable_expert_offload, find_expert_modules, get_offload_engine, reference_copy
from .config import OffloadConfig
from .engine import OffloadEngine
from ..layouts import ExpertLayout, ExpertTensor, layout_for
from .planner import choose_tier, estimate_memory
from .disk_store import DiskExpertStore
from .store import (
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
