"""The runtime interface (see the package docstring) and its inline CPU implementation."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from typing import Any

import torch


class HappensBeforeError(RuntimeError):
    """A buffer was used, reused or overwritten without an ordering edge (simulated runtime)."""


class _Host:
    """Marker for `DeviceRuntime.access(..., stream=HOST)`: the calling host thread, not a device stream."""

    def __repr__(self) -> str:
        return "HOST"


HOST = _Host()


class Event:
    """What `DeviceRuntime.record` returns."""

    def synchronize(self) -> None:
        """Block the calling host thread until the event has happened."""

    def query(self) -> bool:
        return True


class DeviceRuntime(abc.ABC):
    """Streams, events, asynchronous copies and page-locked memory of one device (see the package docstring).
    The abstract methods are what each implementation (inline, CUDA, simulated) provides."""

    name = "?"
    device = torch.device("cpu")
    asynchronous = False  # False: host memory is the compute memory; nothing is copied or waited for

    # --- streams ---
    @abc.abstractmethod
    def current_stream(self) -> Any:
        ...

    @abc.abstractmethod
    def new_stream(self) -> Any:
        ...

    def side_stream(self) -> Any | None:
        """A new stream for work that overlaps compute (host copies, exchanges), or None where nothing can overlap on
        a stream (host memory is the compute memory and every operation is complete when it returns): the caller then
        runs that work where it is, or on a thread of its own."""
        return self.new_stream() if self.asynchronous else None

    @abc.abstractmethod
    def run_on(self, stream, fn: Callable[[], Any]) -> Any:
        """Run `fn` with `stream` current (its kernels are ordered on `stream`); returns fn's result."""
        ...

    # --- events and ordering ---
    @abc.abstractmethod
    def record(self, stream=None) -> Event:
        """An event that happens once everything enqueued on `stream` (default: current) so far has run."""
        ...

    @abc.abstractmethod
    def wait_event(self, event: Event | None, stream=None) -> None:
        """Make `stream` (default: current) wait for `event` (None: nothing to wait for)."""
        ...

    def wait_stream(self, stream, other) -> None:
        """Make `stream` wait for everything enqueued on `other` so far."""
        self.wait_event(self.record(other), stream)

    # --- memory ---
    @abc.abstractmethod
    def copy_(self, dst: torch.Tensor, src: torch.Tensor, stream=None) -> None:
        """Asynchronous `dst.copy_(src)` on `stream` (default: current). Host memory involved must be page-locked
        (`pinned_empty` / `pin_`) and must stay alive until the copy has run."""
        ...

    @abc.abstractmethod
    def empty(self, shape, dtype: torch.dtype, stream=None, persistent: bool = False) -> torch.Tensor:
        """Device memory for use on `stream` (default: current). `persistent`: kept for the owner's whole life (no
        `record_stream` needed when used on other streams, whose ordering the owner manages with events)."""
        ...

    def pinned_empty(self, shape, dtype: torch.dtype, cached: bool = False) -> torch.Tensor:
        """Page-locked host memory. Default: exactly this size (no power-of-two rounding), for long-lived buffers.
        `cached=True`: from the caching host allocator (rounded up, but reused without re-registering), for
        short-lived buffers such as saved activations."""
        return self.pin_(torch.empty(shape, dtype=dtype))

    def pin_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-lock the memory of a host tensor in place (for as long as the tensor lives); returns it."""
        return tensor

    def free_memory(self) -> int | None:
        """Bytes of device memory free now (what a buffer sized at bind may take a share of); None: not bounded here
        (the host is the device, or a simulation without a set size)."""
        return None

    def free(self, tensor: torch.Tensor) -> None:
        """The owner of a `persistent` buffer is done with it (it drops its references next): the caching allocator may
        hand its memory to the allocating stream's next allocation, so every use of it on other streams must be
        ordered before the host by now (the caller synchronized them). Checked by the simulation; nothing to do on
        a real device."""

    def release_cached_memory(self) -> None:
        """Give device memory the allocator caches but nothing uses back (after dropping a large buffer allocated for
        a side stream, whose cached blocks other streams cannot reuse). The caller has synchronized its streams."""

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """`tensor` (allocated for another stream) is used on `stream`: do not reuse its memory before that use."""

    def access(self, tensor: torch.Tensor, write: bool = False, stream=None) -> None:
        """Declare a use of `tensor` on `stream` (default: current; `HOST`: the calling thread). Checked by the
        simulation; free elsewhere."""

    # --- timing ---
    @abc.abstractmethod
    def elapsed(self, start: Event, end: Event) -> float:
        """Seconds between two recorded events (both must have happened)."""
        ...

    def now_event(self, stream=None) -> Event:
        """An event for timing (may be a cheaper kind than `record`'s)."""
        return self.record(stream)


class _DoneEvent(Event):
    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = time.perf_counter()


class InlineRuntime(DeviceRuntime):
    """CPU, no simulation: one stream (the calling thread), every operation complete when it returns."""

    name = "inline"
    asynchronous = False

    def current_stream(self):
        return None

    def new_stream(self):
        return None

    def run_on(self, stream, fn):
        return fn()

    def record(self, stream=None):
        return _DoneEvent()

    def wait_event(self, event, stream=None):
        pass

    def wait_stream(self, stream, other):
        pass

    def copy_(self, dst, src, stream=None):
        dst.copy_(src)

    def empty(self, shape, dtype, stream=None, persistent=False):
        return torch.empty(shape, dtype=dtype)

    def elapsed(self, start, end):
        return max(0.0, end.t - start.t)


def aligned_nbytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes of one expert's row in a device buffer: `numel` elements rounded up to 16 bytes (the grouped GEMM's
    alignment; also each device-cache slot's size)."""
    return -(-numel * dtype.itemsize // 16) * 16


__all__ = ["DeviceRuntime", "Event", "HOST", "HappensBeforeError", "InlineRuntime", "aligned_nbytes"]
