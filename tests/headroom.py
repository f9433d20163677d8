"""How close each test runs to its timeout: a record written as the suite goes.

Every long test needs 3x headroom under its timeout on a loaded 2-core machine
(docs/development.md says how to measure it: the suite beside a second copy of
itself). The record is one JSON line per test, appended the moment the test ends
to a file per xdist worker, so a run cut short keeps everything it measured (a
JUnit report is written only at the end).

Set ``CKPTDB_TEST_TIMINGS`` to a directory to record (tests/conftest.py calls
:func:`register`); ``python tests/headroom.py DIR [DIR ...]`` reads the
records of one or more runs and lists the tests with less than 3x headroom.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

TIMINGS_VARIABLE = "CKPTDB_TEST_TIMINGS"
#: The headroom every test needs under its timeout on a loaded machine.
REQUIRED = 3.0


def register(config: pytest.Config) -> None:
    """Record this process's tests when ``CKPTDB_TEST_TIMINGS`` names a directory.

    Not on xdist's controller, which only relays its workers' reports (and never
    sees a test's setup, so it would write each test again without its timeout).
    """
    directory = os.environ.get(TIMINGS_VARIABLE)
    runs_tests = hasattr(config, "workerinput") or not config.getoption("numprocesses", None)
    if directory and runs_tests:
        config.pluginmanager.register(Recorder(Path(directory)), "ckptdb-headroom")


class Recorder:
    """A pytest plugin: appends each finished test's seconds, outcome and timeout."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.path = directory / f"{worker}.jsonl"
        self.timeouts: dict[str, float] = {}
        self.running: dict[str, dict[str, Any]] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self.timeouts[item.nodeid] = timeout_of(item)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.running.setdefault(report.nodeid, {"seconds": 0.0, "outcome": "passed"})
        entry["seconds"] += report.duration
        if report.failed or (report.when == "call" and report.skipped):
            entry["outcome"] = "failed" if report.failed else "skipped"
        if report.failed:  # what failed, in a line: a cut-off run has no summary to read
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else report.longreprtext
            entry.setdefault("error", f"{report.when}: " + " ".join(message.split())[:500])
        if report.when != "teardown":
            return
        self.running.pop(report.nodeid)
        line = {"test": report.nodeid, **entry, "timeout": self.timeouts.pop(report.nodeid, None)}
        with self.path.open("a", encoding="utf-8") as out:  # one line, written whole
            out.write(json.dumps(line) + "\n")


def timeout_of(item: pytest.Item) -> float:
    """The test's timeout in seconds: its ``timeout`` marker's, else the ini default."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        found = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
        if found is not None:
            return float(found)
    return float(item.config.getini("timeout") or 0)


def read(directories: Iterable[Path]) -> dict[str, list[dict[str, Any]]]:
    """Every record of the runs in ``directories``, by test."""
    found: dict[str, list[dict[str, Any]]] = {}
    for directory in directories:
        for path in sorted(directory.glob("*.jsonl")):
            for line in path.read_text(encoding="utf-8").splitlines():
                record = json.loads(line)
                found.setdefault(record["test"], []).append(record)
    return found


def short_of_headroom(
    records: dict[str, list[dict[str, Any]]], required: float = REQUIRED
) -> list[tuple[str, float, float]]:
    """The tests whose slowest run took more than ``1/required`` of their timeout, as
    (test, slowest seconds, timeout), the closest to it first."""
    short = []
    for test, runs in records.items():
        slowest = max(r["seconds"] for r in runs)
        timeout = runs[0]["timeout"]
        if timeout and slowest * required > timeout:
            short.append((test, slowest, timeout))
    return sorted(short, key=lambda s: s[1] / s[2], reverse=True)


def main(argv: list[str]) -> int:
    """Print the runs' failures and the tests short of headroom; exit 1 if any."""
    if not argv:
        print(__doc__)
        return 2
    records = read(Path(a) for a in argv)
    failed = sorted({t for t, runs in records.items() for r in runs if r["outcome"] == "failed"})
    slowest = sorted(((max(r["seconds"] for r in runs), t) for t, runs in records.items()))
    print(f"{len(records)} tests, {sum(len(r) for r in records.values())} runs")
    for test in failed:
        errors = {r["error"] for r in records[test] if r.get("error")}
        print(f"FAILED {test}", *(f"\n  {e}" for e in sorted(errors)))
    print("slowest:")
    for seconds, test in slowest[-15:][::-1]:
        print(f"  {seconds:8.1f} s  {test}")
    short = short_of_headroom(records)
    for test, seconds, timeout in short:
        print(f"SHORT {seconds:8.1f} s of {timeout:g} s ({timeout / seconds:.1f}x)  {test}")
    print(f"{len(short)} test(s) with less than {REQUIRED:g}x headroom")
    return 1 if short or failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
