"""DeePMD-kit's idiom of the interval, ``dp --pt train --ckptdb-interval``, with the real
DeePMD-kit on the CPU: DeePMD saves its periodic checkpoints its own way at its
``save_freq``, and also whenever the ledger says one is due; every step is reported.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("deepmd")

from deepmdlib import dp, make_run_dir, output
from helpers import rows

from ckptdb.errors import InvalidArgumentError
from ckptdb.integrations.deepmd import train

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_db_url_from_environment")]

BACKENDS = [pytest.param("--pt", id="pt"), pytest.param("--pt-expt", id="pt-expt")]


def steps_saved(root: Path) -> list[int]:
    found = rows(root, "SELECT DISTINCT step FROM checkpoints WHERE stream = 'model' ORDER BY step")
    return [s for (s,) in found]


@pytest.mark.parametrize("backend", BACKENDS)
def test_due_saves_come_on_top_of_save_freq(tmp_path: Path, backend: str) -> None:
    root = make_run_dir(tmp_path / "run")  # 100 steps, save_freq 20
    interval = ("--ckptdb-interval", "auto", "--ckptdb-min-interval", "0.01")
    proc = dp(root, backend, "train", "input.json", *interval, "--ckptdb-max-interval", "0.1")
    assert proc.returncode == 0, output(proc)
    saved = steps_saved(root)
    assert {20, 40, 60, 80, 100} <= set(saved)  # DeePMD's own save_freq came back after each
    assert [s for s in saved if s % 20], saved  # and the ledger's due saves came between
    ((detail,),) = rows(root, "SELECT detail FROM events WHERE kind = 'interval' LIMIT 1")
    assert json.loads(detail)["seconds"] == 0.1
    assert rows(root, "SELECT end_state, last_step FROM attempts") == [("closed", 100)]


def test_without_an_interval_every_step_is_reported(tmp_path: Path) -> None:
    root = make_run_dir(tmp_path / "run")
    proc = dp(root, "--pt", "train", "input.json")
    assert proc.returncode == 0, output(proc)
    assert steps_saved(root) == [20, 40, 60, 80, 100]
    ((first, last, saves),) = rows(root, "SELECT first_step_at, last_step, saves FROM attempts")
    assert first is not None and last == 100 and saves >= 5
    assert rows(root, "SELECT COUNT(*) FROM events WHERE kind = 'interval'") == [(0,)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ckptdb-interval", "soon"], "must be seconds"),
        (["--ckptdb-min-interval", "5"], "need --ckptdb-interval"),
        (["--ckptdb-interval"], "needs a value"),
        (["--ckptdb-interval", "auto", "--ckptdb-max-interval", "x"], "must be seconds"),
    ],
)
def test_bad_interval_options_are_refused(args: list[str], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        train._take_interval(["--pt", "train", "input.json", *args])


@pytest.mark.parametrize(
    "args",
    [
        ["--ckptdb-interval", "-5"],
        ["--ckptdb-interval", "auto", "--ckptdb-min-interval", "9", "--ckptdb-max-interval", "3"],
    ],
)
def test_out_of_range_intervals_are_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    root = make_run_dir(tmp_path / "run")
    monkeypatch.chdir(root)
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(InvalidArgumentError, match="interval"):
        train.main(["--pt", "train", "input.json", *args])
    assert sorted(p.name for p in root.iterdir()) == before  # no ledger, nothing trained


def test_the_interval_options_are_taken_out_of_dps_arguments() -> None:
    rest, pacing = train._take_interval(
        ["--pt", "train", "--ckptdb-interval=auto", "input.json", "--ckptdb-max-interval", "600"]
    )
    assert rest == ["--pt", "train", "input.json"]
    assert pacing == {"interval": "auto", "max_interval": 600.0}
