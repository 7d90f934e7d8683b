"""The random-number state a recompute replays: the streamed experts' backward recomputes a forward that may draw
dropout masks (offload/engine.py), and so does an MPMoE partition restored by recomputation (pipelining/restore.py);
each records the generators' state before the forward and sets it again around the recompute."""

from __future__ import annotations

import torch


def rng_devices(device: torch.device) -> list:
    """The devices whose generators `torch.random.fork_rng` must save around a recompute on `device`."""
    return [device] if device.type == "cuda" else []


def get_rng(device: torch.device):
    """The CPU generator's state and, on a GPU, `device`'s."""
    return (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def set_rng(device: torch.device, state) -> None:
    """Set what `get_rng` recorded."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


__all__ = ["get_rng", "rng_devices", "set_rng"]
