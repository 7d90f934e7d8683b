"""Host memory allocator settings for a training process on the CPU (issue 14, the main job's system time).

PyTorch's CPU tensors come from `malloc`. glibc's malloc serves a large request with a fresh `mmap` (above its mmap
threshold, which starts at 128 KiB and rises, as such blocks are freed, to at most 32 MiB) and hands the free memory
at the top of its heap back to the kernel once it exceeds the trim threshold (twice the mmap threshold). A training
step allocates and frees the same activation- and gradient-sized blocks every step, so each step's memory came back
as fresh pages: a page fault per 4 KiB and the kernel zeroing each page. The default `hf-moe-offload train`, in two
interleaved pairs of runs: 6.6-6.8 M minor faults and 20-21 s of system time with glibc's defaults, 0.31 M and
8.8-9.2 s with the two thresholds raised; the same perplexity; peak RSS 1.24 -> 1.30-1.31 GB (freed blocks now stay
in a heap that fragments); training time within the machine's noise (benchmarks/RESULTS.md).

`retain_freed_memory()` raises them once for the process (`mallopt`, the same as glibc's `MALLOC_MMAP_THRESHOLD_`
and `MALLOC_TRIM_THRESHOLD_` environment variables): blocks up to 32 MiB come from the heap, and up to 1 GiB of freed
heap stays mapped for the next step. The cost: a few percent more peak RSS, and the process's RSS no longer falls
back after its peak. The jobs (`hf-moe-offload train`, the recipes) call it unless `--no-malloc-retain`;
the library never does: a process-wide setting is the application's choice.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt(3) parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest allowed mmap threshold on 64-bit systems
TRIM_THRESHOLD = 2**30
# Set by the user: their settings win (glibc reads them when the process starts).
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def retain_freed_memory() -> bool:
    """Raise glibc malloc's mmap and trim thresholds for this process (see the module docstring). Returns whether
    they were set: False off Linux/glibc, where `mallopt` refuses, and where the user set one of `USER_SETTINGS`."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    given = [name for name in USER_SETTINGS if name in os.environ]
    if given:
        logger.info("malloc: keeping the environment's %s", ", ".join(given))
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success, 0 on a refused value.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
