"""The host's cores during a training step: who runs how many OpenMP threads.

Each Python thread that runs an intra-op-parallel torch op gets an OpenMP team of its own, sized from that thread's
setting: `torch.set_num_threads` called on a thread sizes its team (and, as a side effect, the team of every thread
that starts its first torch op later); nothing a thread calls sizes another's. Left alone, each expert-optimizer worker
would run a team of the process's full size beside the threads that launch the device's work and run autograd: on 16
cores, two workers ran 32 threads, past the core count, where libgomp stops spinning and every parallel region waits
for a descheduled thread (../shared/notes/host-adam.md; benchmarks/RESULTS.md, the H200 host Adam).

So one budget is resolved at bind (offload/plan.py, from `OffloadConfig.optimizer_threads`): the cores this process may
run on, less those the step's other work keeps busy (on a device, the launching thread and autograd's; on the CPU, the
experts' own compute threads). The workers split it evenly, each sizing its own team inside its own thread
(`set_thread_team`), so all teams together stay within it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

# Threads a step keeps busy beside the optimizer when a device computes: the one launching its work and autograd's.
DEVICE_THREADS = 2
_OPENMP_RUNTIMES = ("libgomp", "libiomp5", "libomp")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one; else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def optimizer_threads(setting: int | None, reserved: int) -> int:
    """The expert optimizer's threads, all workers' teams together: `setting` where the user gave one, else the
    available cores less `reserved` (the step's other busy threads), at least 1."""
    return setting if setting is not None else max(1, available_cores() - reserved)


def team_size(budget: int, workers: int) -> int:
    """One worker's team: an even share of `budget` (at least one thread, so more workers than the budget run teams
    of one)."""
    return max(1, budget // max(1, workers))


@functools.cache
def _omp_set_num_threads():
    """`omp_set_num_threads` of the OpenMP runtime torch's ops run on (the one loaded in this process), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(_OPENMP_RUNTIMES):
            try:
                return ctypes.CDLL(path).omp_set_num_threads
            except (OSError, AttributeError):
                continue
    return None


def set_thread_team(threads: int) -> None:
    """Size the calling thread's intra-op team (the OpenMP threads its torch ops run on) to `threads`, leaving the
    count other threads start with as it was. Where the OpenMP runtime cannot be reached directly (not Linux, no
    OpenMP build), `torch.set_num_threads` does it, which also sets the count of threads that start later."""
    torch.get_num_threads()  # torch sizes a new thread's team at its first use: first, so that it does not undo this
    setter = _omp_set_num_threads() if torch.backends.openmp.is_available() else None
    if setter is None:
        torch.set_num_threads(threads)
        return
    setter(int(threads))
    if torch.get_num_threads() != threads:  # another runtime than torch's answered: fall back
        logger.debug("omp_set_num_threads did not size torch's team; using torch.set_num_threads")
        torch.set_num_threads(threads)


__all__ = ["DEVICE_THREADS", "available_cores", "optimizer_threads", "set_thread_team", "team_size"]
