"""A pytest plugin: per test, the device work it issues on the simulated device and where the engine issues it.

The census behind the simulated-device re-runs' selection (tests/test_simulated_device.py, NO_DEVICE_WORK and
SAME_WAITS): a test that issues no device work runs the CPU run's code again; a parametrization that reaches no
runtime call site the kept ones of its test do not reach adds no stream wait. Run it over a suite's files:

    HF_MOE_OFFLOAD_RUNTIME=simulated DEVICE_WORK_CENSUS=census.jsonl PYTHONPATH=.:benchmarks \\
        python3 -m pytest -q -p device_work_census tests/test_offload.py

Each line of the log: the test's node id, the copies and checks the process's simulated runtime counted during its
call, and the engine's call sites (`op@file:line`, the first frame in hf_moe_offload outside runtime/) of every
wait, event, copy, `record_stream` and free.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

LOG = os.environ.get("DEVICE_WORK_CENSUS")
OPS = {"SimulatedRuntime": ("wait_event", "wait_stream", "record_stream", "free", "copy_", "record", "run_on"),
       "_SimEvent": ("synchronize", "query")}
_sites: set[str] = set()


def _call_site() -> str:
    frame = sys._getframe(2)  # past the wrapper
    while frame is not None:
        name = frame.f_code.co_filename
        if "hf_moe_offload" in name and f"{os.sep}runtime{os.sep}" not in name:
            return f"{name.split('hf_moe_offload' + os.sep)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _wrap(cls, op: str) -> None:
    original = getattr(cls, op)

    def recorded(self, *args, **kwargs):
        _sites.add(f"{op}@{_call_site()}")
        return original(self, *args, **kwargs)

    setattr(cls, op, recorded)


def pytest_configure(config):
    from hf_moe_offload.runtime import simulated  # noqa: PLC0415

    for cls, ops in OPS.items():
        for op in ops:
            _wrap(getattr(simulated, cls), op)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    from hf_moe_offload import runtime  # noqa: PLC0415

    def counts() -> tuple[int, int]:
        rt = runtime._simulated  # the runtime HF_MOE_OFFLOAD_RUNTIME=simulated made for this process
        return (rt.copies, rt.checks) if rt is not None else (0, 0)

    _sites.clear()
    before = counts()
    yield
    after = counts()
    if LOG:
        with open(LOG, "a", encoding="utf-8") as f:
            f.write(json.dumps({"id": item.nodeid, "copies": after[0] - before[0], "checks": after[1] - before[1],
                                "sites": sorted(_sites)}) + "\n")
