"""Smoke test: the benchmark suite runs end to end at tiny sizes (no timing asserts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.__main__ import main


@pytest.mark.timeout(300)
def test_quick_benchmark_run_writes_every_case(tmp_path: Path, capsys) -> None:
    out = tmp_path / "results.json"
    assert main(["--quick", "--out", str(out), "--work", str(tmp_path)]) == 0
    report = json.loads(out.read_text())
    names = [r["name"] for r in report["results"]]
    for expected in (
        "publish",
        "ledger overhead",
        "3-stream boundary of tiny payloads",
        "restart",
        "log_metrics",
        "best 5 steps",
        "training step with clipping",
        "load",
        "async save",
        "Lightning checkpoint",
        "Lightning fit",
    ):
        assert any(n.startswith(expected) for n in names), (expected, names)
    for result in report["results"]:
        assert result["ratio_to_baseline"][result["baseline"]] == pytest.approx(1.0)
        assert all(v > 0 for v in result["median_s"].values())
    overhead = next(r for r in report["results"] if r["name"].startswith("ledger overhead"))
    assert 2 <= overhead["notes"]["transactions_per_boundary"] <= 3
    floor = next(r for r in report["results"] if r["name"].startswith("3-stream boundary"))
    # intent, commit, clean-up; the statements are those test_boundary_sql.py pins
    assert floor["notes"]["transactions_per_boundary"] == 3
    assert floor["notes"]["statements_per_boundary"] == 18
    assert report["machine"]["torch"]
    table = capsys.readouterr().out
    assert "| case | contender | median | ratio to baseline |" in table
