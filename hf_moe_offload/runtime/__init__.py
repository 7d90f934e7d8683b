"""The small device runtime every asynchronous path goes through: streams, events, async copies, pinned memory.

The offload engine (expert uploads, gradient downloads), MPMoE's partitioned executor (side-stream dispatch and
combine) and its restore strategies (host copies) never call `torch.cuda` for streams, events, copies or page-locked
memory: they call a `DeviceRuntime`, chosen by `runtime_for(device)`:

- `CudaRuntime` (runtime/cuda.py): a thin wrapper over `torch.cuda` streams and events, `copy_(non_blocking=True)`,
  `record_stream`, and `cudaHostRegister` for page-locked host memory of exact size.
- `SimulatedRuntime` (runtime/simulated.py): the same ordering contract on CPU. Side streams are worker threads with
  seeded, injectable delays; a copy's destination reads as NaN until the copy has run; vector clocks check that
  every declared access to a buffer happens after the previous writes (and a write after the previous reads), and
  a buffer read on another stream than it was allocated for needs `record_stream`. A missing `wait` raises
  `HappensBeforeError` (or shows up as NaN), deterministically. This is how CI, which has no GPU, tests the GPU
  code paths. Enable it with `HF_MOE_OFFLOAD_RUNTIME=simulated` or `use_runtime(SimulatedRuntime(...))`.
- `InlineRuntime`: CPU without simulation. Host memory is device memory, so nothing is copied or waited for; the
  engine uses host records in place (`asynchronous = False`).

Contract (what callers must do, and what the simulation checks):
1. Work is enqueued on a stream: the current (compute) stream by default, a side stream via `run_on` / `copy_`.
2. Before a stream uses what another stream produced, it waits for an event recorded after the producer
   (`wait_event`) or for the other stream (`wait_stream`); the host waits with `Event.synchronize()`.
3. Before a stream overwrites a buffer that another stream read, it waits in the same way (slot reuse).
4. A device buffer allocated for one stream and used on another gets `record_stream(t, other)` (caching-allocator
   reuse), unless it is allocated `persistent=True` (owned for the runtime's whole life: rings, slots).
5. Buffers touched on several streams are declared with `access(t, write=...)` at the point of use, so the
   simulation can check 2-4; on CUDA the declaration costs nothing.

May import: nothing of the package.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading

import torch

from .base import HOST, DeviceRuntime, Event, HappensBeforeError, InlineRuntime, aligned_nbytes

_override: list[DeviceRuntime] = []
_lock = threading.Lock()
_cuda: dict[int, DeviceRuntime] = {}
_inline = InlineRuntime()
_simulated: DeviceRuntime | None = None

ENV_VAR = "HF_MOE_OFFLOAD_RUNTIME"


def runtime_for(device: torch.device | str) -> DeviceRuntime:
    """The runtime of `device`: CUDA's for a CUDA device; for the CPU the simulation when it is enabled
    (`use_runtime`, or `HF_MOE_OFFLOAD_RUNTIME=simulated`), the inline one otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        with _lock:
            if index not in _cuda:
                from .cuda import CudaRuntime  # noqa: PLC0415

                _cuda[index] = CudaRuntime(torch.device("cuda", index))
            return _cuda[index]
    if device.type != "cpu":
        raise ValueError(f"hf_moe_offload has no device runtime for {device.type!r} devices (cuda and cpu only)")
    if _override:
        return _override[-1]
    if os.environ.get(ENV_VAR, "").lower() == "simulated":
        return _env_simulated()
    return _inline


def _env_simulated() -> DeviceRuntime:
    global _simulated
    with _lock:
        if _simulated is None:
            from .simulated import SimulatedRuntime  # noqa: PLC0415

            seed = int(os.environ.get(ENV_VAR + "_SEED", "0"))
            delay = float(os.environ.get(ENV_VAR + "_MAX_DELAY", "0.002"))
            _simulated = SimulatedRuntime(seed=seed, max_delay=delay)
            report = os.environ.get(ENV_VAR + "_REPORT")
            if report:  # tests: proof that the simulation ran in this process
                atexit.register(_write_report, _simulated, f"{report}-{os.getpid()}.json")
        return _simulated


def _write_report(runtime, path: str) -> None:
    with open(path, "w") as f:
        json.dump({"copies": runtime.copies, "checks": runtime.checks}, f)


@contextlib.contextmanager
def use_runtime(runtime: DeviceRuntime):
    """Make `runtime` the CPU runtime inside the block (tests: `use_runtime(SimulatedRuntime(seed=3))`).

    Engines and executors bind their runtime when they first run on a device, so create (or first run) them inside
    the block."""
    _override.append(runtime)
    try:
        yield runtime
    finally:
        _override.remove(runtime)


__all__ = ["DeviceRuntime", "Event", "HOST", "HappensBeforeError", "InlineRuntime", "aligned_nbytes", "runtime_for",
           "use_runtime"]
