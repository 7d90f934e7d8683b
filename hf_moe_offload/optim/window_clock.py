"""The expert optimizer's accumulation windows: which one is open, the experts already claimed in it, the learning rate
its steps use, and how long its expert steps ran, in all and before `step()` was called (the part hidden behind
backward: ES-MoE §4.1's overlap).

A window's timing is complete only once the next window closes: every forward waits for its experts' updates, so
by then each of the previous window's steps has ended."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import contextmanager


def accelerate_sync_gradients() -> bool:
    """True on the micro-step that closes an accumulation window, as accelerate (and the Trainer) set it."""
    try:
        from accelerate.state import GradientState
    except ImportError:  # pragma: no cover
        return True
    return bool(GradientState().sync_gradients)


class WindowClock:
    """Counts windows and times the expert steps of each. `stepped`: the experts stepped in the open window (or on
    their way); `measured`: those whose norm is being or was taken (deferred mode). `step_seconds`,
    `overlapped_seconds`: the previous window's busy seconds of expert steps and the part of them that ran before
    `step()` was called."""

    def __init__(self):
        self.window = 0
        self.stepped: set = set()
        self.measured: set = set()
        self.step_seconds = 0.0
        self.overlapped_seconds = 0.0
        self._lock = threading.Lock()  # gradient hooks claim experts, and jobs end, on other threads
        self._nesting = threading.local()  # `timed` bodies open on this thread
        self._jobs: list[tuple[int, float, float]] = []  # (window, start, end) of each expert step
        self._step_called: dict[int, float] = {}
        self._lr: float | None = None

    def claim(self, keys, measure: bool) -> list:
        """Those of `keys` neither stepped nor measured yet in the open window, now marked measured (`measure`) or
        stepped: an expert's final gradient is taken once per window."""
        claimed = []
        with self._lock:
            for key in keys:
                if key not in self.stepped and key not in self.measured:
                    (self.measured if measure else self.stepped).add(key)
                    claimed.append(key)
        return claimed

    def lr(self, read: Callable[[], float]) -> float:
        """The open window's learning rate, `read` at its first step: a scheduler stepping meanwhile changes the
        next window's, never one expert's against another's."""
        if self._lr is None:
            self._lr = read()
        return self._lr

    @contextmanager
    def timed(self, window: int):
        """Time the body as an expert step of `window` (the window it was submitted in). Nested (a job that steps
        the queue's experts while it waits for room: `StepQueue.help`), only the outer one counts."""
        depth = getattr(self._nesting, "depth", 0)
        self._nesting.depth = depth + 1
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self._nesting.depth = depth
            if depth == 0:
                with self._lock:
                    self._jobs.append((window, start, end))

    def step_called(self) -> None:
        """`step()` was called for the open window: steps after this moment no longer overlap its backward."""
        self._step_called[self.window] = time.perf_counter()

    def close(self) -> None:
        """Close the open window: the next one opens with no expert claimed and its own learning rate, and the one before the closing window
        (all of whose steps have ended) gives `step_seconds` and `overlapped_seconds`."""
        with self._lock:
            closing = self.window
            self.window += 1
            previous = [(start, end) for w, start, end in self._jobs if w == closing - 1]
            self._jobs = [job for job in self._jobs if job[0] >= closing]
            self.stepped.clear()
            self.measured.clear()
        self._lr = None
        called = self._step_called.pop(closing - 1, None)
        if called is not None:
            self.step_seconds = sum(end - start for start, end in previous)
            self.overlapped_seconds = sum(max(0.0, min(end, called) - start) for start, end in previous)


__all__ = ["WindowClock", "accelerate_sync_gradients"]
