"""glibc malloc's thresholds for a training process (`hf_moe_offload.host_allocator`, issue 14): with them raised a
step's freed memory serves the next step without fresh page faults; without, glibc returns it to the kernel. Each
case runs in its own interpreter: the setting is process-wide."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

import pytest

from hf_moe_offload.host_allocator import USER_SETTINGS
from hf_moe_offload.train import add_arguments

glibc_linux = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                 reason="mallopt thresholds are glibc's")

# Three "steps", each allocating 48 activation-sized tensors (2 MiB, written through) and freeing them all; prints
# whether the thresholds were set and the minor page faults of the last step.
STEPS = """
import json, resource, sys, torch
from hf_moe_offload.host_allocator import retain_freed_memory
applied = retain_freed_memory() if sys.argv[1] == "retain" else None
for step in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = [torch.empty(2**19).fill_(1.0) for _ in range(48)]
    del held
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults": faults}))
"""
PAGES = 48 * 2 * 2**20 // 4096  # the pages one step writes


def run_steps(mode: str, **env) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    res = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120,
                         env=dict(clean, OMP_NUM_THREADS="1", **env))
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@glibc_linux
def test_retained_memory_serves_the_next_step_and_the_environments_settings_win():
    """With the thresholds raised, the last step faults in (nearly) nothing. With the user's MALLOC_MMAP_THRESHOLD_ at
    glibc's initial 128 KiB the call leaves glibc alone, and every step's tensors are fresh mappings. (glibc's dynamic
    default lies in between and depends on the heap's layout: 512 or 24,545 faults in repeated runs here.)"""
    retained = run_steps("retain")
    assert retained["applied"] is True
    assert retained["faults"] < PAGES // 20, retained
    users = run_steps("retain", MALLOC_MMAP_THRESHOLD_="131072")
    assert users["applied"] is False
    assert users["faults"] > PAGES // 2, users


def test_jobs_retain_by_default_and_can_opt_out():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).malloc_retain is True
    assert parser.parse_args(["--no-malloc-retain"]).malloc_retain is False
