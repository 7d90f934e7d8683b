"""Host memory allocator settings for a training process on the CPU (the main job's system time).

PyTorch's CPU tensors come from `malloc`. glibc's malloc serves a large request with a fresh `mmap` (above its mmap
threshold, which starts at 128 KiB and rises, as such blocks are freed, to at most 32 MiB) and hands the free memory
at the top of its heap back to the kernel once it exceeds the trim threshold (twice the mmap threshold). A training
step allocates and frees the same activation- and gradient-sized blocks every step, so each step's memory came back
as fresh pages: a page fault per 4 KiB and the kernel zeroing each page. The default `hf-moe-offload train`, in two
interleaved pairs of runs: 6.6-6.8 M minor faults and 20-21 s of system time with glibc's defaults, 0.31 M and
8.8-9.2 s with the two thresholds raised; the same perplexity; peak RSS 1.24 -> 1.30-1.31 GB (freed blocks now stay
in a heap that fragments); training time within the machine's noise (benchmarks/RESULTS.md).

Two policies, set once for the process (`mallopt`, the same as glibc's `MALLOC_MMAP_THRESHOLD_` and
`MALLOC_TRIM_THRESHOLD_` environment variables):

- `retain_freed_memory()` ("retain"): blocks up to 32 MiB come from the heap, and up to 1 GiB of freed heap stays
  mapped for the next step. The cost: a few percent more peak RSS in a small job, and the process's RSS no longer
  falls back after its peak. It pays where a step is short and the memory plentiful (the main job).
- `return_freed_memory()` ("return"): the mmap threshold fixed at 1 MiB (a fixed value also stops glibc's dynamic
  raising), so every block of 1 MiB or more is its own mapping and goes back to the kernel when freed. The process's
  RSS is then what it holds, and its peak what `hf-moe-offload estimate` counts: for a run sized to the host's memory
  (LoRA on a 30B model's streamed experts). With glibc's dynamic threshold a step's many ~10 MB transient tensors
  came from the heap, and the freed gaps between live blocks stayed: at Qwen3-30B-A3B's shape the peak grew 10.7 ->
  13.2 GiB over three steps while the live set stayed at 8.3 GiB (benchmarks/RESULTS.md, real_shape_lora). The
  cost: each step faults its large transients in afresh (system time).

The jobs (`hf-moe-offload train`, the recipes) take `--malloc {retain,return,glibc}` (default retain); the library
never sets one: a process-wide setting is the application's choice.
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
RETURN_MMAP_THRESHOLD = 2**20  # "return": blocks from 1 MiB up are mappings of their own
RETURN_TRIM_THRESHOLD = 4 * 2**20
POLICIES = ("retain", "return", "glibc")
# Set by the user: their settings win (glibc reads them when the process starts).
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def retain_freed_memory() -> bool:
    """Raise glibc malloc's mmap and trim thresholds for this process (see the module docstring). Returns whether
    they were set: False off Linux/glibc, where `mallopt` refuses, and where the user set one of `USER_SETTINGS`."""
    return _set_thresholds(MMAP_THRESHOLD, TRIM_THRESHOLD)


def return_freed_memory() -> bool:
    """Fix glibc malloc's mmap threshold at 1 MiB for this process, so that freed blocks from 1 MiB up go back to
    the kernel at once (see the module docstring). Returns whether it was set, as `retain_freed_memory`."""
    return _set_thresholds(RETURN_MMAP_THRESHOLD, RETURN_TRIM_THRESHOLD)


def set_policy(policy: str) -> bool:
    """Apply one of `POLICIES` ("glibc": leave malloc as it is); returns whether a setting was made."""
    if policy not in POLICIES:
        raise ValueError(f"malloc policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    return {"retain": retain_freed_memory, "return": return_freed_memory, "glibc": lambda: False}[policy]()


def _set_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
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
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
