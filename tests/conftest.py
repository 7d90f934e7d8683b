"""Suite-wide: list the tests that ran longer than SLOW_SECONDS without the `slow` marker, so that the marker keeps
meaning what pytest.ini says (the suite must stay under ~20 minutes on 2 cores; issue 34). A report, not a
failure: timings are the machine's, not the code's."""

from __future__ import annotations

SLOW_SECONDS = 10.0


def pytest_terminal_summary(terminalreporter):
    unmarked = []
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        if report.when == "call" and report.duration > SLOW_SECONDS and "slow" not in report.keywords:
            unmarked.append((report.duration, report.nodeid))
    if unmarked:
        terminalreporter.section(f"over {SLOW_SECONDS:.0f} s without @pytest.mark.slow")
        for duration, nodeid in sorted(unmarked, reverse=True):
            terminalreporter.write_line(f"{duration:6.1f}s {nodeid}")
