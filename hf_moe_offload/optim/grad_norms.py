"""Expert gradient norms for global clipping, and the inf/nan check of fp16 loss scaling.

Both need every gradient of a window before any expert steps, so the optimizer defers its steps then (ES-MoE §4.1
loses its overlap to them). To take back part of that cost the norms are measured during backward, on the workers,
as each expert's gradient becomes final; whatever was not measured is read once here. Each expert's norm is fp32 (one
multi-tensor call, as `clip_grad_norm_`), squared and summed in float64 with the other gradients' float64 sums of
squares. An overflowed gradient has a non-finite norm, so the measured norms also answer the overflow check."""

from __future__ import annotations

import math
from collections.abc import Iterable
from concurrent.futures import Future
from contextlib import ExitStack, closing

import torch

from ..offload.stores.store import GRAD, WEIGHTS_AND_GRAD, ExpertKey
from .adamw_step import clip_coefficient
from .store_steps import Entry, StoreSteps


def squared_norms(grads: list[torch.Tensor]) -> list[float]:
    """The squared L2 norm of each gradient: fp32 norms in one multi-tensor call and one read back, squared in float64
    (exactly: an fp32 value's square fits a float64)."""
    return [n**2 for n in torch.stack(torch._foreach_norm(grads)).tolist()]


def non_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether any of `tensors` holds an inf or a nan (one read back per device)."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        flags.setdefault(t.device, []).append(torch.isfinite(t).all())
    return any(not bool(torch.stack(same).all()) for same in flags.values())


def global_clip(expert_sq: float, params: list[torch.nn.Parameter], grad_scale: float | None,
                max_norm: float, other_sq: float = 0.0) -> tuple[float, float]:
    """(total norm, clip coefficient) of `clip_grad_norm_` over the experts (their summed squared norms, `expert_sq`,
    still carrying the loss scale `grad_scale`), `params` (unscaled gradients) and the gradients whose squared norms
    sum to `other_sq` (those the dense host optimizer took off the device)."""
    scale = 1.0 / grad_scale if grad_scale else 1.0
    sq = expert_sq * scale * scale
    sq += other_sq
    sq += sum(float(p.grad.double().pow(2).sum()) for p in params)
    total = math.sqrt(sq)
    return total, clip_coefficient(total, max_norm)


def unscale_non_experts_(scaler: torch.amp.GradScaler, optimizer, expert_overflow: bool) -> None:
    """`scaler.unscale_` the non-expert optimizer (an accelerate `AcceleratedOptimizer` or a plain one), an expert
    overflow handed to it first as an inf in one non-expert gradient: the scaler then skips the non-expert step and
    backs the scale off, as for an overflow of its own."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if expert_overflow:
        first = next((p for g in inner.param_groups for p in g["params"] if p.grad is not None), None)
        if first is not None:
            first.grad.view(-1)[0] = float("inf")
    scaler.unscale_(inner)


class GradNorms:
    """The squared norms of a window's expert gradients, in the store `records` hold. A shared store counts each
    expert once, on the process that updates it (`ExpertUpdates.owns`); device-pinned experts are read there."""

    def __init__(self, records: StoreSteps):
        self._records, self.updates, self.store = records, records.updates, records.store
        self._measuring: dict[ExpertKey, Future] = {}  # {key: its measuring job ({key: norm^2} of its batch)}

    def measure(self, entries: list[Entry]) -> dict[ExpertKey, float]:
        """A job, during backward: land these final gradients and return their squared norms, {key: norm^2}."""
        with ExitStack() as stack:
            helds = [stack.enter_context(self._records.landed(key, record, arrival, WEIGHTS_AND_GRAD,
                                                              dirty=(GRAD,) if arrival is not None else False))
                     for key, record, arrival in entries]
            return dict(zip((key for key, _, _ in entries), squared_norms([h.record.current_grad() for h in helds])))

    def track(self, keys: Iterable[ExpertKey], job: Future) -> None:
        """`job` measures the squared norms of `keys`' gradients."""
        for key in keys:
            self._measuring[key] = job

    def clear(self) -> None:
        """The window closed: its measurements are spent."""
        self._measuring = {}

    def measured(self) -> dict[ExpertKey, float]:
        """The squared norms measured during backward (waits for the measuring jobs)."""
        return {key: fut.result()[key] for key, fut in self._measuring.items()}

    def _unmeasured(self, measured: dict[ExpertKey, float]) -> list[ExpertKey]:
        """This process's experts with a gradient not measured, once every gradient in flight has landed."""
        self.updates.wait_in_flight()
        return [key for key in self.store.keys()
                if key not in measured and self.store.has_grad[key] and self.updates.owns(key)]

    def _host_grads(self, keys: list[ExpertKey], on_device: set[ExpertKey]):
        """Each host expert's gradient row among `keys`, its record held while the caller looks."""
        for key in keys:
            if key not in on_device:
                record = self.store.acquire(key, WEIGHTS_AND_GRAD)
                try:
                    yield record.current_grad()
                finally:
                    self.store.release(key)

    def _device_grads(self, on_device: set[ExpertKey]) -> list[torch.Tensor]:
        return [self.updates.device_record(key).current_grad() for key in sorted(on_device)]

    def expert_sq_norm(self) -> float:
        """The sum of squared expert gradient norms (after backward). With a shared store (hf_moe_offload.distributed)
        each process sums the experts it owns and the sums are all-reduced: every process must call it."""
        measured = self.measured()
        total = sum(measured.values())
        keys = self._unmeasured(measured)
        on_device = self.updates.on_device(keys)
        if on_device:
            total += sum(squared_norms(self._device_grads(on_device)))
        for grad in self._host_grads(keys, on_device):
            total += squared_norms([grad])[0]
        return self.updates.all_reduce_sum(total)

    def overflow(self) -> bool:
        """True when any expert gradient (of this process's updates; all processes agree) holds inf/nan. Collective
        under expert parallelism."""
        measured = self.measured()
        found = any(not math.isfinite(v) for v in measured.values())
        keys = self._unmeasured(measured)
        # Every pinned expert with a gradient is checked: an overflow anywhere skips the whole window.
        on_device = self.updates.on_device(key for key in self.store.keys() if self.store.has_grad[key])
        found = found or non_finite(self._device_grads(on_device))
        if not found:
            with closing(self._host_grads(keys, on_device)) as grads:  # the record held at the first overflow released
                found = any(non_finite([grad]) for grad in grads)
        return self.updates.all_reduce_max(float(found)) > 0


__all__ = ["GradNorms", "global_clip", "non_finite", "squared_norms", "unscale_non_experts_"]
