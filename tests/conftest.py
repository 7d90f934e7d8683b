"""Suite-wide: the cores shared among pytest-xdist's workers, the `quick` edit loop's selection, and a report of the
tests that ran longer than SLOW_SECONDS without the `slow` marker (so that the marker keeps meaning what pytest.ini
says). The report is not a failure: timings are the machine's, not the code's."""

from __future__ import annotations

import os

import pytest

SLOW_SECONDS = 10.0

# The edit loop (`pytest -m quick`, under 3 minutes on 2 cores): per test file, the tests that make up its quick
# share, by function name (every parametrization) or by full name with its id. A file not listed contributes its
# first test that is not `slow`, so a new file is in the loop without an entry here (a file of slow tests only is
# collected, its imports checked, and runs nothing).
# Listed where the first test pays for a large fixture or sweeps every family (a run of `-m quick` with `--durations`
# finds them).
QUICK = {
    "test_adapter_export.py": ("test_import_refuses_separate_gate_and_up_lora_a",),
    "test_device_generation.py": ("test_generate_command_on_the_device",),
    "test_device_slab.py": ("test_the_slab_takes_a_quarter_of_the_free_device_memory",),
    "test_estimate.py": ("test_the_largest_batch_per_gpu_size_grows_with_the_gpu",),  # also reaches batch_fit
    "test_families.py": ("test_unservable_experts_fail_with_the_family_and_the_missing_piece",),
    "test_import_graph.py": ("test_no_import_cycles",),
    "test_model_shapes.py": ("test_an_unknown_name_fails_with_the_way_out",),
    "test_routing.py": ("test_load_balancing_loss_counts_whenever_its_coefficient_is_set",),
}


def pytest_configure(config):
    """Under pytest-xdist (`-n N`), each worker computes on its share of the cores, and so do the processes its tests
    start (OMP_NUM_THREADS, where a test does not set its own): with every worker on every core, OpenMP threads spin
    waiting for each other at every op (measured on the 2-core machine: the suite 9:51 -> 8:40, its in-process files
    up to a third faster; benchmarks/RESULTS.md)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 0:
        import torch  # noqa: PLC0415

        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def _quick_names(path: str) -> tuple[str, ...] | None:
    return QUICK.get(os.path.basename(path))


@pytest.hookimpl(tryfirst=True)  # before pytest's own `-m` selection reads the markers
def pytest_collection_modifyitems(config, items):
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(str(item.path), []).append(item)
    unmatched = []
    for path, file_items in by_file.items():
        names = _quick_names(path)
        if names is None:
            first = next((i for i in file_items if i.get_closest_marker("slow") is None), None)
            if first is not None:
                first.add_marker(pytest.mark.quick)
            continue
        matched = set()
        for item in file_items:
            for name in names:
                if name in (item.name, getattr(item, "originalname", None)):
                    item.add_marker(pytest.mark.quick)
                    matched.add(name)
        unmatched += [f"{os.path.basename(path)}: {n}" for n in names if n not in matched]
    whole_files = not any("::" in arg for arg in config.args) and not config.option.keyword
    if unmatched and "quick" in (config.option.markexpr or "") and whole_files:
        # A renamed test would leave the loop silently (a run narrowed to node ids or by -k may not collect them).
        raise pytest.UsageError("tests/conftest.py QUICK names tests that were not collected: " + ", ".join(unmatched))


def pytest_terminal_summary(terminalreporter):
    unmarked = []
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        if report.when == "call" and report.duration > SLOW_SECONDS and "slow" not in report.keywords:
            unmarked.append((report.duration, report.nodeid))
    if unmarked:
        terminalreporter.section(f"over {SLOW_SECONDS:.0f} s without @pytest.mark.slow")
        for duration, nodeid in sorted(unmarked, reverse=True):
            terminalreporter.write_line(f"{duration:6.1f}s {nodeid}")
