"""The `device` tier's engine: the experts stay ordinary resident parameters (still dropless and mask-free), and the
engine's calls that apply to them (barriers) keep their meaning."""

from __future__ import annotations

import torch

from .telemetry import OffloadStats


class ResidentEngine:
    """The `device` tier: experts stay ordinary resident parameters (still dropless and mask-free)."""

    tier = "device"
    store = None
    plan = None
    layers: list = []

    def __init__(self, stats: OffloadStats):
        self.stats = stats

    def synchronize(self) -> None:
        pass

    def step_barrier(self) -> None:
        """The resident experts have nothing in flight on the host: the device's work is all there is to wait for."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
