"""Same-invocation timing for the benchmarks: variants interleaved round by round.

On the project's shared 2-core machine the speed drifts by more than most differences measured (torch's fused AdamW
moved 1.6x between invocations), so a baseline timed before ours is no baseline. Every variant runs once per round,
in an order that rotates by one each round, and a ratio is the median over rounds of the per-round ratio.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved_rounds(runs: dict[str, Callable[[], object]], rounds: int, warmup: int = 0,
                       setup: Callable[[str], object] = lambda name: None) -> dict[str, list[float]]:
    """name -> seconds of `runs[name]()` in each of `rounds` rounds (after `warmup` untimed rounds); `setup(name)`
    runs untimed before each call (e.g. fresh gradients, a device sync)."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            setup(name)
            t0 = time.perf_counter()
            runs[name]()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def median_ratio(times: list[float], base: list[float]) -> float:
    """The median over rounds of times[i] / base[i]."""
    return statistics.median(t / b for t, b in zip(times, base))
