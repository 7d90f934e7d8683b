"""Per-step counters of the offload engine: bytes moved, stalls, cache behaviour, tokens per expert."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class OffloadStats:
    h2d_bytes: int = 0  # expert weights uploaded to the device
    h2d_reupload_bytes: int = 0  # ... of which a training backward uploaded again (the slab no longer held them)
    d2h_bytes: int = 0  # expert gradients sent back to the store
    pin_move_bytes: int = 0  # training state of experts pinned on or unpinned from the device, both ways
    disk_read_bytes: int = 0
    disk_write_bytes: int = 0
    disk_mapped_bytes: int = 0  # expert weights computed on straight from their memory-mapped files (no copy)
    disk_mapped_experts: int = 0  # ... and how many expert uses that was (uses that bypassed the cache)
    stall_seconds: float = 0.0  # compute waiting for an expert (upload, disk read or its optimizer step)
    compute_seconds: float = 0.0  # wall time inside the streamed expert loops
    cache_hits: int = 0
    cache_misses: int = 0
    evictions: int = 0
    # Inference (offload/inference/policies.py): routed experts of calls that had a pre-gating guess, and how many it had;
    # experts run on the host instead of uploaded.
    pregate_routed: int = 0
    pregate_hits: int = 0
    host_computed_experts: int = 0
    # Decoding on a device (offload/inference/device_cache.py): uses served by the device cache, uses it missed, its evictions.
    device_cache_hits: int = 0
    device_cache_misses: int = 0
    device_cache_evictions: int = 0
    pregate_uploads: int = 0  # ... experts uploaded into it ahead, on pre-gating's guess
    tokens_per_expert: dict[str, list[int]] = field(default_factory=dict)  # "layer" -> counts (last forward)

    def __post_init__(self) -> None:
        self._run: OffloadStats | None = None  # `start_run`: the counters of the intervals reset so far

    def reset(self) -> None:
        """Zero the counters (an interval ends: `ExpertOptimizerCallback` logs and resets them); inside a run
        (`start_run`) they are added to its totals first."""
        if self._run is not None:
            self._run.add(self)
        fresh = OffloadStats()
        for k, v in asdict(fresh).items():
            setattr(self, k, v)

    def add(self, other: "OffloadStats") -> None:
        """Add `other`'s counters into these (the tokens per expert are the last forward's, not summed)."""
        for f in fields(OffloadStats):
            if f.name != "tokens_per_expert":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def start_run(self) -> None:
        """Count a run from here (zeroed: work done before it, loading or warm-up, is not the run's), however often
        the counters are reset meanwhile; `end_run` returns the totals."""
        self._run = None
        self.reset()
        self._run = OffloadStats()

    def run_totals(self) -> "OffloadStats":
        """The run's totals so far (since `start_run`; this interval included), the counters left as they are."""
        totals = OffloadStats()
        if self._run is not None:
            totals.add(self._run)
        totals.add(self)
        return totals

    def end_run(self) -> "OffloadStats":
        """The run's totals since `start_run` (this interval included); the counters start again from zero."""
        totals = self._run if self._run is not None else OffloadStats()
        self._run = None
        totals.add(self)
        self.reset()
        return totals

    @property
    def cache_hit_rate(self) -> float | None:
        """The fraction of the disk tier's expert uses that the cache served: its hits over its lookups and the uses
        computed from mapped files (which bypass the cache); None before any use."""
        uses = self.cache_hits + self.cache_misses + self.disk_mapped_experts
        return self.cache_hits / uses if uses else None

    @property
    def device_cache_hit_rate(self) -> float | None:
        """The fraction of decoding's expert uses on a device that the device cache served; None: no lookup."""
        uses = self.device_cache_hits + self.device_cache_misses
        return self.device_cache_hits / uses if uses else None

    def as_log_dict(self, prefix: str = "offload/") -> dict[str, float]:
        """Scalars for `Trainer.log` (tokens per expert summarised as max/mean load imbalance)."""
        out = {
            f"{prefix}h2d_MB": self.h2d_bytes / 2**20,
            f"{prefix}d2h_MB": self.d2h_bytes / 2**20,
            f"{prefix}disk_read_MB": self.disk_read_bytes / 2**20,
            f"{prefix}disk_write_MB": self.disk_write_bytes / 2**20,
            f"{prefix}stall_s": self.stall_seconds,
            f"{prefix}stall_fraction": self.stall_seconds / self.compute_seconds if self.compute_seconds else 0.0,
            f"{prefix}cache_hit_rate": 1.0 if self.cache_hit_rate is None else self.cache_hit_rate,
        }
        if self.disk_mapped_bytes:
            out[f"{prefix}disk_mapped_MB"] = self.disk_mapped_bytes / 2**20
        if self.pregate_routed:
            out[f"{prefix}pregate_hit_rate"] = self.pregate_hits / self.pregate_routed
        if self.device_cache_hit_rate is not None:
            out[f"{prefix}device_cache_hit_rate"] = self.device_cache_hit_rate
        imbalance = [max(c) / (sum(c) / len(c)) for c in self.tokens_per_expert.values() if sum(c)]
        if imbalance:
            out[f"{prefix}expert_load_max_over_mean"] = sum(imbalance) / len(imbalance)
        return out


def add_to_logs(state, logs: dict, values: dict) -> None:
    """Add `values` to a Trainer log from a callback's `on_log`: to `logs` (what later callbacks, e.g. the printer,
    see) and to the entry the Trainer already appended to `state.log_history` (it copies `logs` before `on_log`).

    NOTE: `report_to` integrations are registered before user callbacks, so they have sent `logs` already.
    """
    logs.update(values)
    if state.log_history and state.log_history[-1].get("step") == state.global_step:
        state.log_history[-1].update(values)


def remove_from_logs(state, logs: dict, key: str) -> None:
    """Remove `key` from a Trainer log from a callback's `on_log` (from `logs` and the `log_history` entry)."""
    logs.pop(key, None)
    if state.log_history and state.log_history[-1].get("step") == state.global_step:
        state.log_history[-1].pop(key, None)
