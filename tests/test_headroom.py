"""tests/headroom.py: each test's seconds and timeout recorded as it ends, and the
tests short of 3x headroom found in the records (docs/development.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import headroom
import pytest

HERE = Path(__file__).resolve().parent

SUITE = """
import os, time
import pytest

@pytest.mark.timeout(2)
def test_a_near_its_timeout():
    time.sleep(0.9)

@pytest.mark.timeout(timeout=60)
def test_b_quick():
    pass

def test_c_fails():
    assert False

def test_d_the_run_is_cut_short():
    os._exit(3)
"""

CONFTEST = """
import headroom

def pytest_configure(config):
    headroom.register(config)
"""


@pytest.mark.timeout(60)
def test_a_cut_short_run_keeps_each_finished_tests_record(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 30\n")
    records = tmp_path / "records"
    env = {**os.environ, headroom.TIMINGS_VARIABLE: str(records), "PYTHONPATH": str(HERE)}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 3, done.stdout + done.stderr  # killed by the last test
    lines = [json.loads(line) for line in (records / "main.jsonl").read_text().splitlines()]
    by_name = {line["test"].split("::")[1]: line for line in lines}
    assert sorted(by_name) == ["test_a_near_its_timeout", "test_b_quick", "test_c_fails"]
    assert [by_name[n]["timeout"] for n in sorted(by_name)] == [2.0, 60.0, 30.0]
    assert [by_name[n]["outcome"] for n in sorted(by_name)] == ["passed", "passed", "failed"]
    assert by_name["test_a_near_its_timeout"]["seconds"] >= 0.9
    assert by_name["test_c_fails"]["error"] == "call: assert False"
    assert "error" not in by_name["test_b_quick"]

    short = headroom.short_of_headroom(headroom.read([records]))
    assert [s[0].split("::")[1] for s in short] == ["test_a_near_its_timeout"]


def test_the_slowest_of_several_runs_counts(tmp_path: Path) -> None:
    for copy, seconds in (("a", 10.0), ("b", 45.0)):
        (tmp_path / copy).mkdir()
        record = {"test": "t.py::slow", "seconds": seconds, "outcome": "passed", "timeout": 120.0}
        (tmp_path / copy / "gw0.jsonl").write_text(json.dumps(record) + "\n")
    records = headroom.read([tmp_path / "a", tmp_path / "b"])
    assert headroom.short_of_headroom(records) == [("t.py::slow", 45.0, 120.0)]
    assert headroom.short_of_headroom(records, required=2.5) == []
    assert headroom.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
