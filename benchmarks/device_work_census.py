"""A pytest plugin: per test, the device work it issues on the simulated device and where the engine issues it; and
the selection of the simulated-device re-runs made from its log (`selection`).

The re-runs (tests/test_simulated_device.py) keep what the log shows adds stream waits to check: a test that issues
no device work runs the CPU run's code again, and a parametrization that reaches no runtime call site the kept ones
of its test (and of its cell of tiers and dtypes) do not reach checks no wait they do not. Run it over the re-run
suites' files after adding tests or parametrizations there, and commit the log (benchmarks/device_work_census.jsonl):

    HF_MOE_OFFLOAD_RUNTIME=simulated HF_MOE_OFFLOAD_RUNTIME_MAX_DELAY=0.001 DEVICE_WORK_CENSUS=census.jsonl \
        PYTHONPATH=.:benchmarks:tests python3 -m pytest -q -p device_work_census tests/test_offload.py ...
    python3 benchmarks/device_work_census.py census.jsonl     # what the re-runs keep, and their share of the time

Each line of the log: the test's node id, the copies and checks the process's simulated runtime counted during its
call, its seconds, and the engine's call sites (`op@file:line`, the first frame in hf_moe_offload outside runtime/)
of every wait, event, copy, `record_stream` and free.
"""

from __future__ import annotations

import json
import os
import sys
import time

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
    before, start = counts(), time.perf_counter()
    yield
    after, seconds = counts(), time.perf_counter() - start
    if LOG:
        with open(LOG, "a", encoding="utf-8") as f:
            f.write(json.dumps({"id": item.nodeid, "copies": after[0] - before[0], "checks": after[1] - before[1],
                                "seconds": round(seconds, 2), "sites": sorted(_sites)}) + "\n")



def _cover(rows: list[dict]) -> set[str]:
    """The fewest seconds (greedy, by seconds per new call site) of `rows` that reach every call site they reach."""
    left = {site for row in rows for site in row["sites"]}
    chosen = set()
    while left:
        best = min((r for r in rows if set(r["sites"]) & left),
                   key=lambda r: max(r.get("seconds", 1.0), 0.01) / len(set(r["sites"]) & left))
        chosen.add(best["id"])
        left -= set(best["sites"])
    return chosen


def cell(test_id: str) -> tuple[str, str]:
    """The tier and compute dtype a test's id names ("-" and fp32 where it names none: the default model)."""
    tier = "disk" if "disk" in test_id else "host" if "host" in test_id else "-"
    return tier, "bf16" if "bf16" in test_id else "fp16" if "fp16" in test_id else "fp32"


def selection(rows: list[dict]) -> list[str]:
    """The tests the simulated-device re-runs keep: for every test function that issues device work, the
    parametrizations that together reach every call site its parametrizations reach; and in every cell of tiers and
    dtypes (`cell`), the tests that reach every call site the cell's tests reach. A test with no device work reaches
    no site and is never kept: its CPU run is its cover."""
    groups: dict = {}
    for row in rows:
        if row["sites"]:
            groups.setdefault(row["id"].split("[")[0], []).append(row)
            groups.setdefault(cell(row["id"]), []).append(row)
    return sorted(set().union(*(_cover(group) for group in groups.values())))


if __name__ == "__main__":  # python benchmarks/device_work_census.py census.jsonl: the ids `selection` keeps
    with open(sys.argv[1], encoding="utf-8") as f:
        census = [json.loads(line) for line in f]
    kept = selection(census)
    total = sum(r.get("seconds", 0.0) for r in census)
    spent = sum(r.get("seconds", 0.0) for r in census if r["id"] in kept)
    print(f"{len(kept)} of {len(census)} tests, {spent:.0f} of {total:.0f} s")
    for test_id in kept:
        print(test_id)
