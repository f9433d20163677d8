"""Preemption through ckptdb's ``dp --pt train``, with the real DeePMD-kit on the CPU.

``--ckptdb-preemption TERM``: a real SIGTERM (the process sends it to itself
after a chosen step's optimizer step, on a chosen rank) becomes DeePMD's own
periodic checkpoint of the agreed step, committed through the ledger; the job
exits 143, and ``--restart latest`` resumes from that step. Every run is a
subprocess with a hard timeout.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("deepmd")

from deepmdlib import dp, left_alive, make_run_dir, output, torchrun

from ckptdb import RunReader
from ckptdb.errors import InvalidArgumentError
from ckptdb.integrations.deepmd import train

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_db_url_from_environment")]

PREEMPT = ("--ckptdb-preemption", "TERM", "--ckptdb-grace", "60")


def committed(root: Path, stream: str = "model") -> list[int]:
    with RunReader(root) as reader:
        return sorted(c.step for c in reader.checkpoints(stream, states=("committed", "deleted")))


def events(root: Path, kind: str) -> list[tuple[int, dict[str, Any]]]:
    with RunReader(root) as reader:
        found = [e for e in reader.events(limit=500) if e.kind == kind]
    return sorted((e.step, json.loads(e.detail or "{}")) for e in found)


def attempts(root: Path) -> list[str]:
    with RunReader(root) as reader:
        return [a.end_state for a in reader.attempts()]


#: DeePMD-kit's two PyTorch backends, as ``dp`` takes them.
BACKENDS = [pytest.param("--pt", id="pt"), pytest.param("--pt-expt", id="pt-expt")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sigterm_checkpoints_that_step_exits_143_and_restart_latest_resumes_from_it(
    tmp_path: Path, backend: str
) -> None:
    root = make_run_dir(tmp_path / "run", enable_ema=True)
    # the signal comes after step 33's check (torch runs global optimizer hooks after an
    # optimizer's own): it is seen at the next one, step 34
    proc = dp(root, backend, "train", "input.json", *PREEMPT, env={"CKPTDB_TEST_SIGNAL_AT": "33"})
    assert proc.returncode == 143, output(proc)
    assert committed(root) == [20, 34] and committed(root, "model_ema") == [20, 34]
    assert os.readlink(root / "model.ckpt.pt") == "model.ckpt-34.pt"  # DeePMD's own names
    assert (root / "checkpoint").read_text() == "model.ckpt-34.pt"
    assert events(root, "preempted") == [(34, {"signal": "SIGTERM", "ranks": [0]})]
    assert events(root, "preemption_saved") == [(34, {"saved": True})]
    assert attempts(root) == ["preempted"]

    again = dp(root, backend, "train", "input.json", "--restart", "latest")
    assert again.returncode == 0, output(again)
    assert [s for s, _ in events(root, "resumed")] == [34]
    assert committed(root)[-1] == 100
    with RunReader(root) as reader:
        (summary,) = reader.preemptions()
    assert summary["resumed_from"] == 34 and summary["lost"] == 0


def test_a_guard_trip_before_the_signal_refuses_the_preemption_checkpoint(
    tmp_path: Path,
) -> None:
    root = make_run_dir(tmp_path / "run")
    env = {"CKPTDB_TEST_SIGNAL_AT": "33", "CKPTDB_TEST_NAN_STEP": "30"}
    proc = dp(root, "--pt", "train", "input.json", *PREEMPT, env=env)
    assert proc.returncode == 143, output(proc)
    assert committed(root) == [20]  # the last good checkpoint stands
    assert not (root / "model.ckpt-34.pt").exists()
    assert os.readlink(root / "model.ckpt.pt") == "model.ckpt-20.pt"
    ((step, why),) = events(root, "preemption_saved")
    assert step == 34 and why["saved"] is False and "guard" in why["why"]
    assert attempts(root) == ["preempted"]


def test_a_signal_at_the_last_step_lets_the_finished_run_end_as_it_does(tmp_path: Path) -> None:
    """Training is over at step 100: DeePMD saves it anyway and ends normally (exit 0),
    with nothing preempted, rather than a 143 that would make the scheduler retry it."""
    root = make_run_dir(tmp_path / "run")
    proc = dp(root, "--pt", "train", "input.json", *PREEMPT, env={"CKPTDB_TEST_SIGNAL_AT": "100"})
    assert proc.returncode == 0, output(proc)
    assert "TEST: SIGTERM at step 100" in proc.stderr
    assert committed(root)[-1] == 100
    assert events(root, "preempted") == [] and attempts(root) == ["closed"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_a_signal_on_rank_1_only_checkpoints_one_agreed_step(
    tmp_path: Path, backend: str
) -> None:
    root = make_run_dir(tmp_path / "run")
    env = {"CKPTDB_TEST_SIGNAL_AT": "33:1"}
    proc = torchrun(root, backend, "train", "input.json", *PREEMPT, env=env)
    assert proc.returncode != 0, output(proc)  # torchrun reports its ranks' exit 143
    pattern = (
        r"TEST: rank (\d) raised (Preempted: preempted at step \d+ \(exit status \d+\); saved: \S+)"
    )
    ranks = dict(re.findall(pattern, proc.stderr))
    # seen after step 33's check, launched at 34, read one step later:
    # both ranks stop at step 35, and both saved it
    assert ranks == {
        r: f"Preempted: preempted at step 35 (exit status 143); saved: {root / 'model.ckpt-35.pt'}"
        for r in ("0", "1")
    }, output(proc)
    assert committed(root) == [20, 35]
    assert events(root, "preempted") == [(35, {"signal": "SIGTERM", "ranks": [1]})]
    assert attempts(root) == ["preempted"]
    # ended by Preempted, the trainer was collected all the same before each rank exited
    assert left_alive(proc.stderr) == {0: "[]", 1: "[]"}, output(proc)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ckptdb-preemption", "TERMINATE"], "not a signal name"),
        (["--ckptdb-preemption", "KILL"], "cannot be handled"),
        (["--ckptdb-preemption=TERM", "--ckptdb-grace", "soon"], "must be seconds"),
        (["--ckptdb-preemption=TERM", "--ckptdb-grace=-3"], "grace must be"),
        (["--ckptdb-grace", "30"], "needs --ckptdb-preemption"),
        (["--ckptdb-preemption"], "needs a value"),
    ],
)
def test_bad_preemption_options_are_refused(args: list[str], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        train._take_preemption(["--pt", "train", "input.json", *args])


def test_the_preemption_options_are_taken_out_of_dps_arguments() -> None:
    rest, settings = train._take_preemption(
        ["--pt", "train", "--ckptdb-preemption=TERM,usr1", "input.json", "--ckptdb-grace", "25"]
    )
    assert rest == ["--pt", "train", "input.json"]
    assert settings is not None and [s.name for s in settings.signals] == ["SIGTERM", "SIGUSR1"]
    assert settings.grace == 25.0
