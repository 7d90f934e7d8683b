"""Where expert steps run: a pool of worker threads (or the submitting thread), and the queue of experts handed over
during backward that wait for a worker (ES-MoE §4.1: host updates overlap the rest of backward).

Experts waiting together are stepped together, several per fused call: the fused kernel's per-call cost (an OpenMP
fork and join) made one expert per call 0.6-0.8x torch's fused AdamW on 2 cores, and a per-expert loop hands experts
over one at a time, often faster than a worker steps them (benchmarks/RESULTS.md)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ..host_threads import set_thread_team, team_size


class InlineExecutor:
    """`ExpertOptimizer(workers=0)`: a job runs at once on the thread that submits it; its Future comes back done
    (an error is kept in it, as a worker's would be, and raised where the result is waited for)."""

    def submit(self, fn, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as err:
            future.set_exception(err)
        return future

    def shutdown(self, wait: bool = True) -> None:
        pass


def batch_size(ready: int, workers: int, room: int | None = None) -> int:
    """Experts per job (one fused call): `ready` experts split evenly over `workers` (>= 1). A job holds all its
    records at once, so where only `room` records fit beside what else is held (the disk tier's cache), each worker
    gets its share of that room."""
    size = max(1, -(-ready // workers))
    if room is not None:
        size = min(size, max(1, room // workers))
    return size


class StepQueue:
    """The workers, and the experts handed over with their records waiting for one.

    `workers()`: the pool's size, read at the first job (0: jobs run inline); `threads()`: the OpenMP threads of all
    workers together, split evenly into their teams. `run(entries, *step)`: steps a batch,
    `step` the arguments every entry of a batch shares, the window last. `share(ready, workers, held=True)`: experts
    per job. `pending(key, future)`: an expert's update, done once a worker stepped it."""

    def __init__(self, workers: Callable[[], int], run: Callable, share: Callable[..., int],
                 pending: Callable[[object, Future], None], threads: Callable[[], int] | None = None):
        self._workers, self._run, self._share_of, self._pending = workers, run, share, pending
        self._threads = threads  # the workers' OpenMP threads, all teams together (None: as the process sets)
        self.executor: ThreadPoolExecutor | InlineExecutor | None = None  # made at the first job (`pool`)
        self._lock = threading.Lock()
        self._ready: deque = deque()  # (entry, its update's Future, step) of experts waiting for a worker
        self._share = 1  # experts per job from `_ready`

    @property
    def pool(self) -> ThreadPoolExecutor | InlineExecutor:
        if self.executor is None:
            workers = self._workers()
            if workers == 0:
                self.executor = InlineExecutor()
            else:
                # Each worker sizes its own team in its own thread: all teams together within the budget.
                team = None if self._threads is None else team_size(self._threads(), workers)
                self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="expert-adam",
                                                   initializer=None if team is None else set_thread_team,
                                                   initargs=() if team is None else (team,))
        return self.executor

    def submit(self, fn, *args) -> Future:
        return self.pool.submit(fn, *args)

    def batches(self, entries: list, one_each: bool) -> list[list]:
        """`entries` split into jobs: an even share per worker (inline: one job), or `one_each` alone."""
        size = 1 if one_each else self._share_of(len(entries), max(1, self._workers()))
        return [entries[i : i + size] for i in range(0, len(entries), size)]

    def start(self, entries: list, step: tuple, run: Callable, one_each: bool) -> None:
        """Submit `run(batch, *step)` for each batch of `entries` (key first); each expert's pending update is its
        batch's job."""
        for batch in self.batches(entries, one_each):
            job = self.pool.submit(run, batch, *step)
            for entry in batch:
                self._pending(entry[0], job)

    def put(self, entries: list, step: tuple) -> None:
        """Queue `entries` (key first) to be stepped with `step`. Each job steps every expert waiting when it starts
        (up to an even share per worker; inline, all of them at once), so experts arriving faster than a worker steps
        them are stepped together; each expert's pending update is its own Future."""
        if not entries:
            return
        with self._lock:
            for entry in entries:
                done: Future = Future()
                self._ready.append((entry, done, step))
                self._pending(entry[0], done)
            # Each job's share of what waits now (a job that took its share does not shrink the next one's).
            workers = max(1, self._workers())
            self._share = self._share_of(len(self._ready), workers, held=True)
        for _ in range(min(len(entries), workers)):
            self.pool.submit(self._drain)

    def waiting(self) -> bool:
        """Whether handed-over experts wait for a worker."""
        with self._lock:
            return bool(self._ready)

    def help(self) -> None:
        """Step the handed-over experts waiting, on this thread (a job that cannot get a record for lack of room:
        `StoreSteps.landed`)."""
        self._drain()

    def order_for_next_forward(self) -> None:
        """Backward is over: the experts still waiting go in the order the next forward uses them (layer 0 first; it
        arrived last), so that it starts a layer once that layer's experts are stepped. Windows stay in order."""
        with self._lock:
            self._ready = deque(sorted(self._ready, key=lambda item: (item[2][-1], item[0][0])))

    def _drain(self) -> None:
        """A worker's job: until the queue is empty, take the experts at its head (one `step`, at most a share),
        step them and complete their Futures (with the error, should a step fail). Every job drains the queue:
        however many experts one job takes, none is left behind."""
        while True:
            with self._lock:
                if not self._ready:
                    return
                step = self._ready[0][2]
                batch = []
                while self._ready and self._ready[0][2] == step and len(batch) < self._share:
                    batch.append(self._ready.popleft())
            try:
                self._run([entry for entry, _, _ in batch], *step)
            except Exception as err:  # raised where each expert's update is waited for; the queue drains on
                for _, done, _ in batch:
                    done.set_exception(err)
            else:
                for _, done, _ in batch:
                    done.set_result(None)

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True)


__all__ = ["InlineExecutor", "StepQueue", "batch_size"]
