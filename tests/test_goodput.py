"""Goodput and the automatic interval, against real processes killed at random times.

The truth is what the test measured with its own clock and the children's
(tests/goodputlib.py); the ledger's figures come from ``ckptdb goodput
--json``, a separate process reading the ledger.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import goodputlib as gp
import pytest
import torch
from distlib import run_ranks
from helpers import cli_subprocess, rows

from ckptdb import CheckpointManager, RunReader, TopK
from ckptdb.errors import CkptDBError, InvalidArgumentError, LedgerError
from ckptdb.goodput import breakdown, failure_rate, young_daly
from ckptdb.integrations.contract import LedgerOptions
from ckptdb.interval import Interval, IntervalSetting, interval_of
from ckptdb.ledger.progress import AttemptTimes, BoundaryMark
from ckptdb.protocol.progress import Progress

pytestmark = pytest.mark.timeout(180)

#: What a ledger can know of a kill's time: it lands up to one step and one heartbeat
#: after the last heartbeat written.
RESOLUTION = gp.STEP_S + gp.HEARTBEAT_S

FIGURES = ("productive_s", "saving_s", "lost_s", "restart_s", "idle_s", "total_s")


def goodput_json(root: Path) -> dict:
    result = cli_subprocess("goodput", str(root), "--json")
    assert result.returncode == 0, result.stderr
    found: dict = json.loads(result.stdout)
    return found


def test_every_figure_matches_the_wall_clock_of_a_killed_preempted_and_finished_run(
    tmp_path: Path,
) -> None:
    seed = random.randrange(2**32)
    chance = random.Random(seed)
    root = tmp_path / "run"
    attempts = []
    # 1: SIGKILLed at a random time; 2: preempted (SIGTERM, agreed save); 3: finishes
    for i, (startup, gap) in enumerate([(0.6, 1.6), (0.4, 1.2), (0.5, 0.0)]):
        final = 10**6 if i < 2 else attempts[-1].last_step() + 40  # the last one finishes
        proc, attempt = gp.start(root, tmp_path / f"a{i}.log", startup, final_step=final)
        attempts.append(attempt)
        if i < 2:
            gp.wait_for(attempt, "resumed")
            time.sleep(chance.uniform(1.2, 2.2))
            gp.kill(proc, attempt, signal.SIGKILL if i == 0 else signal.SIGTERM)
            time.sleep(gap)
        else:
            assert gp.finish(proc) == 0
    assert rows(root, "SELECT end_state FROM attempts ORDER BY id") == [
        ("crashed",),
        ("preempted",),
        ("closed",),
    ]
    truth = gp.truth(attempts)
    ranges = gp.bounds(attempts)
    found = goodput_json(root)
    # within 3% of the truth's range (a point, but for the process's start, which the test
    # knows only to within the fork); a figure so small that 3% of it is below what the
    # ledger can know (a kill lands up to one step and one heartbeat after the last
    # heartbeat) within that resolution (the seed, for a rerun, is in the message)
    for figure in FIGURES:
        low, high = ranges[figure]
        short, excess = max(0.03 * low, RESOLUTION), max(0.03 * high, RESOLUTION)
        assert low - short <= found[figure] <= high + excess, (figure, seed, found, ranges)
    assert found["goodput"] == pytest.approx(truth["productive_s"] / truth["total_s"], rel=0.03)
    assert [a["end_state"] for a in found["attempts"]] == ["crashed", "preempted", "closed"]
    assert all(a["measured"] for a in found["attempts"])
    # the preempted attempt saved the step it stopped at: it lost nothing
    assert found["attempts"][1]["lost_s"] <= RESOLUTION
    assert sum(a["total_s"] for a in found["attempts"]) == pytest.approx(found["total_s"])


def test_a_crash_before_any_save_loses_the_whole_attempt(tmp_path: Path) -> None:
    root = tmp_path / "run"
    first, attempt = gp.start(root, tmp_path / "a.log", 0.0, final_step=10**6)
    gp.wait_for(attempt, "resumed")
    time.sleep(0.15)  # fewer steps than SAVE_EVERY: nothing committed
    gp.kill(first, attempt, signal.SIGKILL)
    second, again = gp.start(root, tmp_path / "b.log", 0.0, final_step=5)
    assert gp.finish(second) == 0
    truth = gp.truth([attempt, again])
    with RunReader(root) as reader:
        report = reader.goodput()
    crashed, closed = report.attempts
    assert crashed.breakdown.productive_s == 0.0
    assert crashed.breakdown.lost_s == pytest.approx(truth["lost_s"], abs=0.05)
    assert closed.breakdown.lost_s == 0.0 and closed.breakdown.productive_s > 0


def test_auto_interval_approaches_young_daly_for_failures_at_a_known_rate(tmp_path: Path) -> None:
    root = tmp_path / "run"
    mtbf = 1.5  # every attempt is killed this long after it started
    attempts = []
    for i in range(6):
        proc, attempt = gp.start(root, tmp_path / f"a{i}.log", 0.0, final_step=10**6)
        attempts.append(attempt)
        gp.wait_for(attempt, "resumed")
        time.sleep(max(0.0, attempt.launched + mtbf - time.time()))
        gp.kill(proc, attempt, signal.SIGKILL)
    for a in attempts:
        a.read()
    durations = [s["end"] - s["start"] for a in attempts for s in a.of("save")]
    cost = sum(durations) / len(durations)  # C, as the test measured every save
    true_mtbf = sum(a.ended - a.launched for a in attempts if a.ended) / len(attempts)
    expected = young_daly(cost, true_mtbf)
    with CheckpointManager(
        root, interval="auto", min_interval=0.001, max_interval=100.0, heartbeat=0.02
    ) as mgr:
        assert mgr.interval is None  # nothing chosen before the first due()
        mgr.due(1)
        chosen = mgr.interval
        assert chosen is not None and chosen.why == "sqrt(2*C*M)"
        assert chosen.failures == 6
        assert chosen.seconds == pytest.approx(expected, rel=0.30), (chosen, cost, true_mtbf)
    events = rows(root, "SELECT detail FROM events WHERE kind = 'interval'")
    assert json.loads(events[-1][0])["seconds"] == pytest.approx(chosen.seconds)
    status = cli_subprocess("status", str(root))
    assert f"interval: {chosen.seconds:.4g} s (sqrt(2*C*M)" in status.stdout


def test_with_no_failure_the_interval_stays_at_max_and_due_follows_it(tmp_path: Path) -> None:
    with CheckpointManager(
        tmp_path / "run", interval="auto", min_interval=0.01, max_interval=0.25
    ) as mgr:
        answers, saved_at = [], []
        started = time.monotonic()
        for step in range(1, 80):
            time.sleep(0.01)
            answers.append(mgr.due(step))
            if answers[-1]:
                mgr.save(step, model={"w": torch.zeros(4)})
                saved_at.append(time.monotonic() - started)
        assert mgr.interval is not None
        assert mgr.interval.seconds == 0.25 and mgr.interval.why.startswith("no failure")
    assert len(saved_at) >= 2
    gaps = [b - a for a, b in zip([0.0, *saved_at], saved_at, strict=False)]
    assert all(g >= 0.25 for g in gaps), gaps  # never before the interval has passed


def test_a_fixed_interval_is_due_once_its_seconds_passed(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run", interval=0.2) as mgr:
        assert mgr.due(1) is False
        time.sleep(0.22)
        assert mgr.due(2) is True
        mgr.save(2, model={"w": torch.zeros(4)})
        assert mgr.due(3) is False
        assert mgr.interval is not None and mgr.interval.why == "fixed"


def _due_on_ranks(rank: int, world: int, root: str) -> list[bool]:
    with CheckpointManager(root, interval="auto", min_interval=0.01, max_interval=0.1) as mgr:
        answers = []
        for step in range(1, 60):
            time.sleep(0.005 * (rank + 1))  # ranks run at different speeds
            answers.append(mgr.due(step))
            if answers[-1]:
                mgr.save(step, model={"w": torch.zeros(4)})
        return answers


def test_two_gloo_ranks_always_get_the_same_answer(tmp_path: Path) -> None:
    outcomes = run_ranks(_due_on_ranks, 2, tmp_path, str(tmp_path / "run"), timeout=60)
    assert all(o.error is None for o in outcomes), [o.trace for o in outcomes]
    first, second = (o.value for o in outcomes)
    assert first == second and sum(first) >= 2


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"interval": "auto", "min_interval": -1.0}, "min_interval must be a positive"),
        ({"interval": "auto", "max_interval": 0}, "max_interval must be a positive"),
        ({"interval": "auto", "min_interval": 10.0, "max_interval": 5.0}, "larger than"),
        ({"interval": "sometimes"}, "interval must be a number"),
        ({"interval": -5}, "interval must be a positive"),
        ({"interval": math.inf}, "interval must be a positive"),
        ({"interval": "auto", "min_interval": "1"}, "min_interval must be a number"),
        ({"heartbeat": 0.0}, "heartbeat must be a positive"),
        ({"interval": 5.0, "maintenance": True}, "maintenance"),
    ],
)
def test_bad_pacing_is_refused_before_anything_is_created(
    tmp_path: Path, options: dict, match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match) as caught:
        CheckpointManager(tmp_path / "run", **options)
    assert isinstance(caught.value, (CkptDBError, ValueError))
    assert not (tmp_path / "run").exists()


def test_due_without_an_interval_or_on_a_maintenance_manager_is_a_typed_error(
    tmp_path: Path,
) -> None:
    with (
        CheckpointManager(tmp_path / "run") as mgr,
        pytest.raises(InvalidArgumentError, match="due\\(\\) needs interval="),
    ):
        mgr.due(1)
    with CheckpointManager(tmp_path / "run", interval=5.0) as mgr:
        for bad in (-3, 1.5, "7"):
            with pytest.raises(CkptDBError, match="step"):
                mgr.due(bad)  # type: ignore[arg-type]
        with pytest.raises(CkptDBError, match="step"):
            mgr.heartbeat(-1)
    with CheckpointManager(tmp_path / "run", maintenance=True) as tool:
        with pytest.raises(InvalidArgumentError, match="due\\(\\) needs interval="):
            tool.due(1)
        with pytest.raises(InvalidArgumentError, match="maintenance"):
            tool.heartbeat(1)
    with RunReader(tmp_path / "run") as reader:  # a reader never decides when to save
        assert not hasattr(reader, "due")


def test_a_run_without_heartbeats_is_counted_and_said_unmeasured(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run") as mgr:  # a loop that never reports steps
        mgr.save(1, model={"w": torch.zeros(4)})
    with RunReader(tmp_path / "run") as reader:
        report = reader.goodput()
    (attempt,) = report.attempts
    assert attempt.measured is False
    assert report.total.total_s > 0 and report.total.productive_s > 0
    assert report.total.saving_s > 0  # the save was still timed


def test_goodput_all_lists_every_run_of_a_shared_ledger(tmp_path: Path, pg_url: str) -> None:
    for name in ("a", "b"):
        with CheckpointManager(tmp_path / name, db_url=pg_url) as mgr:
            mgr.heartbeat(1)
            mgr.save(1, model={"w": torch.zeros(4)})
    result = cli_subprocess("goodput", "--all", "--db-url", pg_url, "--json")
    assert result.returncode == 0, result.stderr
    found = {r["root"]: r for r in json.loads(result.stdout)}
    for name in ("a", "b"):
        run = found[str((tmp_path / name).resolve())]
        assert run["total_s"] > 0 and len(run["attempts"]) == 1
    table = cli_subprocess("goodput", "--all", "--db-url", pg_url)
    assert str((tmp_path / "a").resolve()) in table.stdout
    bad = cli_subprocess("goodput", str(tmp_path / "a"), "--all", "--db-url", pg_url)
    assert bad.returncode == 2 and "give no ROOT" in bad.stderr


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.heartbeat(1)
        mgr.save(1, model={"w": torch.zeros(4)})
    out = tmp_path / "goodput.png"
    result = cli_subprocess("goodput", str(tmp_path / "run"), "--plot", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------ the timeline, in isolation

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def attempt(i: int, start: float, first: float, seen: float, end: str, **kw: Any) -> AttemptTimes:
    values: dict[str, Any] = {
        "id": i,
        "run_id": 1,
        "host": "h",
        "kind": "train",
        "end_state": end,
        "started_at": at(start),
        "ended_at": at(seen + 100),  # a crash's ended_at is the next open's: never used
        "launched_at": at(start),
        "first_step_at": at(first),
        "seen_at": at(seen),
        "last_step": None,
        "saving_s": 0.0,
        "saves": 0,
        "resumed_from_id": None,
    }
    values.update(kw)
    return AttemptTimes(**values)


def mark(
    i: int, attempt_id: int, step: int, created: float, committed: float | None
) -> BoundaryMark:
    state = "committed" if committed is not None else "aborted"
    when = at(committed) if committed is not None else None
    return BoundaryMark(i, attempt_id, step, state, at(created), when, 0.0)


def test_an_attempt_off_the_final_timeline_lost_all_its_training() -> None:
    # 1 saves step 10 at t=20 and crashes at 30; 2 resumes from it and crashes at 60
    # before saving; 3 resumes from 1's checkpoint again and closes at 100
    attempts = [
        attempt(1, 0, 5, 30, "crashed", saving_s=1.0, saves=1),
        attempt(2, 40, 45, 60, "crashed", resumed_from_id=1),
        attempt(3, 70, 75, 100, "closed", resumed_from_id=1),
    ]
    total, per = breakdown(attempts, [mark(1, 1, 10, 20, 21)], {})
    first, second, third = (a.breakdown for a in per)
    assert first.productive_s == pytest.approx(15) and first.lost_s == pytest.approx(9)
    assert second.productive_s == 0 and second.lost_s == pytest.approx(15)
    assert third.productive_s == pytest.approx(25) and third.lost_s == 0
    assert [b.idle_s for b in (first, second, third)] == [0, 10, 10]
    assert total.total_s == pytest.approx(100)


def test_a_crash_inside_a_save_counts_half_a_mean_save() -> None:
    # mean save 2 s; a save began at 30 (after the last heartbeat, at 29) and never committed
    attempts = [
        attempt(1, 0, 1, 29, "crashed", saving_s=4.0, saves=2),
        attempt(2, 50, 51, 60, "closed", resumed_from_id=1),
    ]
    marks = [mark(1, 1, 10, 10, 12), mark(2, 1, 20, 30, None)]
    _, (crashed, _closed) = breakdown(attempts, marks, {})
    assert crashed.ended_at == at(31)  # the save's start + half the mean save
    assert crashed.breakdown.saving_s == pytest.approx(4.0 + 1.0)
    assert _closed.breakdown.idle_s == pytest.approx(19)  # from that end to the next start


def test_a_save_committed_after_the_last_heartbeat_ends_the_crashed_attempt() -> None:
    # heartbeat at 29; a 5 s save began at 30 and committed at 35; killed before the next
    attempts = [
        attempt(1, 0, 1, 29, "crashed", saving_s=2.0, saves=1),
        attempt(2, 50, 51, 60, "closed", resumed_from_id=2),
    ]
    marks = [mark(1, 1, 10, 10, 12), mark(2, 1, 20, 30, 35)]
    _, (crashed, closed) = breakdown(attempts, marks, {})
    assert crashed.ended_at == at(35)
    assert crashed.breakdown.saving_s == pytest.approx(2.0 + 5.0)
    assert crashed.breakdown.lost_s == pytest.approx(0.0)  # it resumed from that save
    assert closed.breakdown.idle_s == pytest.approx(15)


def test_an_attempt_without_heartbeats_ends_at_its_last_sign_of_life() -> None:
    old = attempt(1, 0, 0, 0, "crashed", first_step_at=None, seen_at=None, launched_at=None)
    _, (found,) = breakdown([old], [mark(1, 1, 10, 20, 22)], {1: at(25)})
    assert found.measured is False
    assert found.ended_at == at(25) and found.breakdown.restart_s == 0


def test_on_a_shared_ledger_a_new_run_learns_from_this_hosts_failures(
    tmp_path: Path, pg_url: str
) -> None:
    other = tmp_path / "other"
    proc, attempt = gp.start(other, tmp_path / "a.log", 0.0, 10**6, db_url=pg_url)
    gp.wait_for(attempt, "resumed")
    time.sleep(0.5)
    gp.kill(proc, attempt, signal.SIGKILL)
    CheckpointManager(other, db_url=pg_url).close()  # its next open marks the crash
    with CheckpointManager(
        tmp_path / "new", db_url=pg_url, interval="auto", min_interval=0.01, max_interval=1e6
    ) as mgr:
        mgr.due(1)
        assert mgr.interval is not None and mgr.interval.failures == 1
        assert mgr.interval.why == "no save measured yet"  # C is this run's own
        mgr.save(1, model={"w": torch.zeros(4)})
        mgr.due(2)
        assert mgr.interval.why == "sqrt(2*C*M)" and mgr.interval.cost_s > 0
    with CheckpointManager(tmp_path / "alone", interval="auto") as mgr:  # its own SQLite file
        mgr.due(1)
        assert mgr.interval is not None and mgr.interval.failures == 0


# ------------------------------------------------------------ what is measured, and how


def saves_recorded(root: Path) -> list[tuple[Any, ...]]:
    return rows(root, "SELECT saves, saving_s FROM attempts ORDER BY id")


def test_a_candidate_no_top_k_admits_is_no_save_and_an_initial_save_is_the_restarts(
    tmp_path: Path,
) -> None:
    streams = {"best": TopK(1, "loss")}
    with CheckpointManager(tmp_path / "run", streams=streams) as mgr:
        mgr.save(0, metrics={"loss": 0.5}, best={"w": torch.zeros(4)})  # before the first step
        mgr.heartbeat(1)
        assert mgr.save(1, metrics={"loss": 0.1}, best={"w": torch.zeros(4)})
        assert mgr.save(2, metrics={"loss": 0.9}, best={"w": torch.zeros(4)}) == {}
    ((saves, saving),) = saves_recorded(tmp_path / "run")
    assert saves == 1  # step 1's; step 0's was before training, step 2's wrote nothing
    assert saving > 0


def test_heartbeats_that_fail_never_raise_and_back_off() -> None:
    calls: list[float] = []

    def broken(beat: Any) -> None:  # fault injection: a ledger that cannot be written
        calls.append(time.monotonic())
        raise OSError("disk I/O error")

    progress = Progress(every=0.05)
    progress.write_with(broken, busy=lambda: False)
    for step in range(1, 40):
        progress.step(step)
        time.sleep(0.01)
    assert len(calls) >= 2  # tried at once, then after 0.05 s, 0.1 s, 0.2 s...: not every step
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert all(gap >= 0.05 * 2**i for i, gap in enumerate(gaps)), gaps


def test_no_heartbeat_is_written_while_a_save_commits_in_the_background() -> None:
    written: list[Any] = []
    busy = [True]
    progress = Progress(every=0.0)
    progress.write_with(written.append, busy=lambda: busy[0])
    progress.step(1)
    assert written == []
    busy[0] = False
    progress.step(2)
    assert [b.last_step for b in written] == [2]


def test_a_history_that_cannot_be_read_never_breaks_due(tmp_path: Path) -> None:
    def unreadable() -> Any:  # fault injection: the chief's read of the ledger fails
        raise LedgerError("the ledger went away")

    setting = IntervalSetting.of("auto", 0.01, 0.2)
    clock = Interval(
        setting, Progress(), is_chief=True, flag=None, history=unreadable, record=lambda *a: None
    )
    assert clock.due(1) is False
    assert clock.current is not None and clock.current.failures == 0


@pytest.mark.parametrize(
    ("options", "bounds"),
    [
        ({"interval": "auto", "max_interval": 30.0}, (30.0, 30.0)),  # min follows max down
        ({"interval": "auto", "min_interval": 3600.0}, (3600.0, 3600.0)),  # max follows min up
        ({"interval": "auto"}, (60.0, 1800.0)),
    ],
)
def test_one_bound_moves_the_other_default(options: dict, bounds: tuple[float, float]) -> None:
    setting = interval_of(
        options["interval"], options.get("min_interval"), options.get("max_interval")
    )
    assert setting is not None and (setting.low, setting.high) == bounds


def test_bounds_without_an_interval_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="go with interval="):
        CheckpointManager(tmp_path / "run", max_interval=60.0)
    with pytest.raises(InvalidArgumentError, match="go with interval="):
        LedgerOptions.of(min_interval=-1)
    assert not (tmp_path / "run").exists()


def _two_opens(root: str) -> None:
    CheckpointManager(root + "/helper").close()  # a helper's open: no step reported
    with CheckpointManager(root + "/train") as mgr:
        mgr.heartbeat(1)
    os._exit(0)


def test_the_process_start_goes_to_the_first_attempt_that_trains(tmp_path: Path) -> None:
    proc = multiprocessing.get_context("fork").Process(target=_two_opens, args=(str(tmp_path),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert rows(tmp_path / "helper", "SELECT launched_at FROM attempts") == [(None,)]
    ((launched, started),) = rows(
        tmp_path / "train", "SELECT launched_at, started_at FROM attempts"
    )
    assert launched is not None and launched < started


def test_the_failure_rate_never_counts_a_waiting_process_twice() -> None:
    # the demo's case: the parent process (started at 0) opens its attempt only after
    # a child's attempt (10 to 20) crashed; its own is counted from that end (as the
    # breakdown counts its restart) to 30, never from 0
    attempts = [
        attempt(1, 10, 11, 20, "crashed"),
        attempt(2, 21, 22, 30, "closed", launched_at=at(0)),
    ]
    assert failure_rate(attempts, {}) == (1, pytest.approx(10.0 + 10.0))
