"""Goodput: where a run's wall-clock time went, over all its attempts.

Every second between the first attempt's start and the last one's end is in
exactly one bucket (docs/goodput.md has the definitions and a worked example):

- ``restart_s``: from an attempt's start (its process's, where the system
  says) to its first reported step: imports, the open, the resume's load;
- ``saving_s``: the loop blocked in saves;
- ``lost_s``: training on steps that were redone: past the checkpoint the
  next attempt resumed from, or a whole attempt no later one resumed from;
- ``productive_s``: the rest of training: steps that survive into the final
  timeline;
- ``idle_s``: between an attempt's end and the next one's start.

The final timeline is found backwards: the last attempt keeps all its steps
if it closed (or still runs), else those up to the run's newest committed
checkpoint (what a restart would resume from); the attempt that saved the
checkpoint it resumed from keeps its steps up to that checkpoint; and so on.

Times come from the heartbeat each attempt writes (:mod:`ckptdb.protocol.progress`).
An attempt that never reported a step (opened before the ledger recorded
heartbeats, or a loop that reports none) is counted from its open to its
last sign of life, all of it training, and marked ``measured: false``.
"""

from __future__ import annotations

import datetime as dt
import math
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .errors import InvalidArgumentError
from .ledger import Ledger, open_ledger
from .ledger import progress as progress_rows
from .ledger.engine import normalize_url
from .ledger.progress import FAILED_ENDS, AttemptTimes, BoundaryMark
from .ledger.runs import check_readable

#: End states after which an attempt's steps past its last checkpoint may still count:
#: a closed attempt finished its work, a running one is still doing it.
_KEEPS_ALL = ("closed", "running")

#: The defaults of ``interval="auto"`` (seconds): never checkpoint more often than
#: every minute, and checkpoint within 30 minutes while no failure was seen.
DEFAULT_MIN_INTERVAL = 60.0
DEFAULT_MAX_INTERVAL = 1800.0


@dataclass(frozen=True)
class Breakdown:
    """Where the seconds went, in five buckets (docs/goodput.md defines each).

    Attributes:
        productive_s: Training whose steps survive in the final timeline.
        saving_s: The training loop blocked in saves.
        lost_s: Training redone after a crash or preemption (steps past the
            checkpoint the next attempt resumed from).
        restart_s: From a process's start to its first step.
        idle_s: Gaps in which no attempt ran.
    """

    productive_s: float
    saving_s: float
    lost_s: float
    restart_s: float
    idle_s: float

    @property
    def total_s(self) -> float:
        """The sum of the five buckets: the wall-clock time accounted for."""
        return self.productive_s + self.saving_s + self.lost_s + self.restart_s + self.idle_s

    @property
    def goodput(self) -> float:
        """``productive_s / total_s`` (0 for a run without time yet)."""
        total = self.total_s
        return self.productive_s / total if total > 0 else 0.0

    def figures(self) -> dict[str, float]:
        """The buckets, ``total_s`` and ``goodput``, by name (what ``--json`` prints).

        Returns:
            A dict of the seven figures.
        """
        return {**asdict(self), "total_s": self.total_s, "goodput": self.goodput}


@dataclass(frozen=True)
class AttemptGoodput:
    """One attempt's share of the run's time.

    Attributes:
        attempt_id: The attempt's id in the ledger (``attempts.id``).
        end_state: How it ended: ``closed``, ``failed``, ``crashed``,
            ``preempted`` or ``running``.
        started_at: Its start (its process's start where that was recorded).
        ended_at: Its end, or its last sign of life for one that crashed.
        measured: False for an attempt that never reported a step (no
            heartbeat): counted from its open to its last sign of life, all of
            it training.
        breakdown: Its seconds by bucket; its ``idle_s`` is the gap before it.
    """

    attempt_id: int
    end_state: str
    started_at: dt.datetime
    ended_at: dt.datetime
    measured: bool
    breakdown: Breakdown

    def as_dict(self) -> dict[str, Any]:
        """The attempt as ``ckptdb goodput --json`` prints it.

        Returns:
            Its id, end state, times (ISO 8601), ``measured`` and its figures.
        """
        return {
            "attempt": self.attempt_id,
            "end_state": self.end_state,
            "started_at": self.started_at.isoformat(),
            "ended_at": self.ended_at.isoformat(),
            "measured": self.measured,
            **self.breakdown.figures(),
        }


@dataclass(frozen=True)
class IntervalChoice:
    """The checkpoint interval Young/Daly gives for a measured save cost and failure
    rate, within the bounds, and why.

    Attributes:
        seconds: The interval ``due()`` uses, in seconds.
        cost_s: C, the mean seconds the loop blocked per save; None before any
            save was measured.
        mtbf_s: M, training seconds per crash or preemption; None when no
            failure was seen.
        failures: The crashes and preemptions counted.
        training_s: The training seconds they were counted over.
        why: Which rule decided (Young/Daly, a bound, no save measured yet...).
    """

    seconds: float
    cost_s: float | None
    mtbf_s: float | None
    failures: int
    training_s: float
    why: str

    def as_dict(self) -> dict[str, Any]:
        """The choice by field name (what the ``interval`` event records).

        Returns:
            A dict of the six fields.
        """
        return asdict(self)


@dataclass(frozen=True)
class GoodputReport:
    """A run's goodput: the totals, each attempt's, and the interval ``auto`` would pick.

    Attributes:
        run: The run's name.
        total: The run's seconds by bucket, over every attempt.
        attempts: Each attempt's share, oldest first.
        interval: The interval ``interval="auto"`` would choose now.
    """

    run: str
    total: Breakdown
    attempts: list[AttemptGoodput]
    interval: IntervalChoice

    def as_json(self) -> dict[str, Any]:
        """The report as ``ckptdb goodput --json`` prints it.

        Returns:
            The total figures, ``run``, ``attempts`` and ``interval``.
        """
        return {
            **self.total.figures(),
            "run": self.run,
            "attempts": [a.as_dict() for a in self.attempts],
            "interval": self.interval.as_dict(),
        }


# --------------------------------------------------------------------- the interval


@dataclass(frozen=True)
class History:
    """What earlier attempts measured: their saves and their failures."""

    saving_s: float = 0.0
    saves: int = 0
    failures: int = 0
    training_s: float = 0.0


def history_of(
    own: Sequence[AttemptTimes],
    failures_seen: Sequence[AttemptTimes],
    alive: Mapping[int, dt.datetime],
    current: int | None = None,
) -> History:
    """The saves of the run's attempts (``own``) and the failure rate of the ended ones
    (``failures_seen``), the ``current`` attempt left out (it measures itself live)."""
    saving, saves = save_cost([a for a in own if a.id != current])
    failures, seconds = failure_rate([a for a in failures_seen if a.id != current], alive)
    return History(saving, saves, failures, seconds)


def check_bounds(min_interval: object, max_interval: object) -> tuple[float, float]:
    """The bounds as floats (None: the default, or the other bound where that one would
    cross it); a negative, zero, non-finite or crossed pair is refused."""
    given: dict[str, float] = {}
    for name, value in (("min_interval", min_interval), ("max_interval", max_interval)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgumentError(f"{name} must be a number of seconds, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise InvalidArgumentError(f"{name} must be a positive number of seconds, got {value}")
        given[name] = float(value)
    high = given.get("max_interval")
    low = given.get("min_interval", min(DEFAULT_MIN_INTERVAL, high or DEFAULT_MIN_INTERVAL))
    high = high if high is not None else max(DEFAULT_MAX_INTERVAL, low)
    if low > high:
        raise InvalidArgumentError(
            f"min_interval ({low:g} s) is larger than max_interval ({high:g} s)"
        )
    return low, high


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """The checkpoint interval that minimises expected waste: sqrt(2·C·M)."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def choose_interval(
    cost_s: float | None,
    failures: int,
    training_s: float,
    low: float = DEFAULT_MIN_INTERVAL,
    high: float = DEFAULT_MAX_INTERVAL,
) -> IntervalChoice:
    """Young/Daly from a measured cost and ``failures`` over ``training_s``, bounded.

    Without a failure there is nothing to trade against (``max_interval``);
    without a measured save the cost is unknown (``max_interval`` too: the first
    save measures it).
    """
    mtbf = training_s / failures if failures else None
    if mtbf is None:
        return IntervalChoice(high, cost_s, None, 0, training_s, "no failure seen: max_interval")
    if cost_s is None:
        return IntervalChoice(high, None, mtbf, failures, training_s, "no save measured yet")
    best = young_daly(cost_s, mtbf)
    if best < low:
        return IntervalChoice(low, cost_s, mtbf, failures, training_s, "min_interval")
    if best > high:
        return IntervalChoice(high, cost_s, mtbf, failures, training_s, "max_interval")
    return IntervalChoice(best, cost_s, mtbf, failures, training_s, "sqrt(2*C*M)")


def failure_rate(
    history: Sequence[AttemptTimes], alive: Mapping[int, dt.datetime]
) -> tuple[int, float]:
    """(failures, training seconds) of ended attempts: those that ended crashed or
    preempted, over the time every attempt ran."""
    failures = sum(1 for a in history if a.end_state in FAILED_ENDS)
    seconds = 0.0
    previous_end: dict[int, dt.datetime] = {}
    for a in sorted(history, key=lambda a: a.id):
        start, end = _start_of(a), _end_of(a, alive)
        before = previous_end.get(a.run_id)
        if before is not None:  # a process older than its run's previous attempt's end
            start = min(max(start, before), a.started_at)  # (it waited): as in breakdown
        seconds += max(0.0, (end - start).total_seconds())
        previous_end[a.run_id] = max(end, start)
    return failures, seconds


def save_cost(attempts: Sequence[AttemptTimes]) -> tuple[float, int]:
    """(seconds blocked, saves) over the attempts that measured them."""
    return (
        sum(a.saving_s or 0.0 for a in attempts if a.saves),
        sum(a.saves or 0 for a in attempts),
    )


# --------------------------------------------------------------------- the breakdown


def breakdown(
    attempts: Sequence[AttemptTimes],
    marks: Sequence[BoundaryMark],
    alive: Mapping[int, dt.datetime],
) -> tuple[Breakdown, list[AttemptGoodput]]:
    """The run's totals and each attempt's share (``attempts`` oldest first, training only)."""
    kept = _final_timeline(attempts, marks)
    signs = signs_of_life(alive, marks)
    tails = _after_last_heartbeat(attempts, marks)
    found: list[AttemptGoodput] = []
    previous_end: dt.datetime | None = None
    for i, attempt in enumerate(attempts):
        start, end = _start_of(attempt), _end_of(attempt, signs)
        if previous_end is not None:
            start = min(max(start, previous_end), attempt.started_at)
        end, extra = max(end, start), 0.0
        tail = tails.get(attempt.id)
        if tail is not None:
            later = _start_of(attempts[i + 1]) if i + 1 < len(attempts) else None
            end, extra = tail.end_and_saving(attempt, end, later)
        idle = (start - previous_end).total_seconds() if previous_end is not None else 0.0
        previous_end = end
        cut = kept.get(attempt.id, _NONE)
        found.append(_share(attempt, start, end, max(idle, 0.0), cut, extra))
    total = Breakdown(*(sum(getattr(a.breakdown, f) for a in found) for f in _FIELDS))
    return total, found


def signs_of_life(
    alive: Mapping[int, dt.datetime], marks: Sequence[BoundaryMark]
) -> dict[int, dt.datetime]:
    """Per attempt, the newest time it is known alive: its newest event (``alive``) or
    the newest commit (else intent) of a checkpoint it saved."""
    signs = dict(alive)
    for mark in marks:
        when = mark.committed_at or mark.created_at
        if mark.attempt_id not in signs or signs[mark.attempt_id] < when:
            signs[mark.attempt_id] = when
    return signs


@dataclass
class _Tail:
    """What an attempt that did not end cleanly did after its last heartbeat (written
    between steps, never inside a save): boundaries that committed (intent -> commit,
    each once), and the newest one, never committed, that a crash cut short."""

    committed: dict[dt.datetime, dt.datetime]
    cut_short: dt.datetime | None = None

    def end_and_saving(
        self, attempt: AttemptTimes, end: dt.datetime, later: dt.datetime | None
    ) -> tuple[dt.datetime, float]:
        """The attempt's end and the seconds of saving after its last heartbeat. A save
        cut short ran about half a mean save: the kill is equally likely anywhere in
        it (never past the next attempt's start)."""
        extra = sum((done - began).total_seconds() for began, done in self.committed.items())
        if self.committed:
            end = max(end, *self.committed.values())
        began = self.cut_short
        if began is None:
            return end, extra
        mean = (attempt.saving_s or 0.0) / attempt.saves if attempt.saves else 0.0
        guess = began + dt.timedelta(seconds=mean / 2)
        if later is not None:
            guess = min(guess, later)
        guess = max(guess, began, end)
        return guess, extra + (guess - began).total_seconds()


def _after_last_heartbeat(
    attempts: Sequence[AttemptTimes], marks: Sequence[BoundaryMark]
) -> dict[int, _Tail]:
    ended_badly = {a.id: a.seen_at for a in attempts if a.end_state not in _KEEPS_ALL and a.seen_at}
    tails: dict[int, _Tail] = {}
    for mark in marks:
        seen = ended_badly.get(mark.attempt_id)
        if seen is None or mark.created_at <= seen:
            continue
        tail = tails.setdefault(mark.attempt_id, _Tail({}))
        if mark.committed_at is not None:
            tail.committed[mark.created_at] = mark.committed_at
        elif tail.cut_short is None or mark.created_at > tail.cut_short:
            tail.cut_short = mark.created_at
    for tail in tails.values():  # only the newest boundary can have been cut short
        if tail.cut_short is not None and tail.committed and max(tail.committed) > tail.cut_short:
            tail.cut_short = None
    return tails


_FIELDS = ("productive_s", "saving_s", "lost_s", "restart_s", "idle_s")
_ALL = "all"
_NONE = "none"


def _share(
    attempt: AttemptTimes,
    start: dt.datetime,
    end: dt.datetime,
    idle: float,
    cut: BoundaryMark | str,
    extra_saving: float = 0.0,
) -> AttemptGoodput:
    measured = attempt.first_step_at is not None
    first = attempt.first_step_at if measured else max(start, attempt.started_at)
    assert first is not None
    first = min(max(first, start), end)
    active = (end - first).total_seconds()
    saving = min(max(attempt.saving_s or 0.0, 0.0) + extra_saving, active)
    training = active - saving
    if cut == _ALL:
        productive = training
    elif isinstance(cut, BoundaryMark):
        before = (cut.created_at - first).total_seconds() - (cut.saving_before_s or 0.0)
        productive = min(max(before, 0.0), training)
    else:
        productive = 0.0
    figures = Breakdown(
        productive_s=productive,
        saving_s=saving,
        lost_s=training - productive,
        restart_s=(first - start).total_seconds(),
        idle_s=idle,
    )
    return AttemptGoodput(attempt.id, attempt.end_state, start, end, measured, figures)


def _final_timeline(
    attempts: Sequence[AttemptTimes], marks: Sequence[BoundaryMark]
) -> dict[int, BoundaryMark | str]:
    """Per attempt on the final timeline, how much of it survives: all of it, or its
    steps up to a checkpoint (the one a later attempt resumed from)."""
    if not attempts:
        return {}
    by_id = {mark.id: mark for mark in marks}
    owners = {a.id for a in attempts}
    last = attempts[-1]
    kept: dict[int, BoundaryMark | str] = {}
    if last.end_state in _KEEPS_ALL:
        kept[last.id] = _ALL
        resume = last.resumed_from_id
    else:  # a restart would resume from the newest committed checkpoint
        committed = [k for k in marks if k.committed_at is not None]
        resume = max(committed, key=lambda k: (k.committed_at, k.id)).id if committed else None
    resumed_by = {a.id: a.resumed_from_id for a in attempts}
    while resume is not None and resume in by_id:
        mark = by_id[resume]
        if mark.attempt_id in kept or mark.attempt_id not in owners:
            break  # a loop in bad data, or a checkpoint no training attempt saved (adopted)
        kept[mark.attempt_id] = mark
        resume = resumed_by[mark.attempt_id]
    return kept


def _start_of(attempt: AttemptTimes) -> dt.datetime:
    """Its process's start where known (never after its open), else its open."""
    launched = attempt.launched_at
    return min(launched, attempt.started_at) if launched is not None else attempt.started_at


def _end_of(attempt: AttemptTimes, alive: Mapping[int, dt.datetime]) -> dt.datetime:
    """Its last heartbeat (its close writes one), else its close, else its last sign of
    life (``alive``: its newest event or checkpoint): a crash's ``ended_at`` is the next
    open's time, not its death."""
    if attempt.seen_at is not None:
        return attempt.seen_at
    if attempt.end_state in ("closed", "failed") and attempt.ended_at is not None:
        return attempt.ended_at
    sign = alive.get(attempt.id)
    return max(sign, attempt.started_at) if sign is not None else attempt.started_at


# --------------------------------------------------------------------- from the ledger


def report(db: Ledger, run_id: int, run: str) -> GoodputReport:
    """The goodput of the run ``run_id`` of ``db``, and the interval ``auto`` would pick
    for its next attempt (on its last attempt's host, within the default bounds)."""
    with db.transaction(read=True) as session:
        attempts = progress_rows.attempts_of(session, run_id)
        marks = progress_rows.marks_of(session, run_id)
        alive = progress_rows.last_signs_of_life(session, run_id)
        host = attempts[-1].host if attempts else socket.gethostname()
        seen = progress_rows.failure_history(session, run_id, host)
    total, per_attempt = breakdown(attempts, marks, alive)
    past = history_of(attempts, seen, signs_of_life(alive, marks))
    cost = past.saving_s / past.saves if past.saves else None
    return GoodputReport(
        run, total, per_attempt, choose_interval(cost, past.failures, past.training_s)
    )


def history(db: Ledger, run_id: int, attempt_id: int) -> History:
    """What the run's earlier attempts (and this host's other runs') measured."""
    with db.transaction(read=True) as session:
        own = progress_rows.attempts_of(session, run_id)
        seen = progress_rows.failure_history(session, run_id, socket.gethostname())
        alive = progress_rows.last_signs_of_life(session, run_id)
        marks = progress_rows.marks_of(session, run_id)
    return history_of(own, seen, signs_of_life(alive, marks), attempt_id)


def every_run(db_url: str) -> list[tuple[str, GoodputReport]]:
    """Every run of the ledger at ``db_url`` (a shared PostgreSQL ledger), with its
    root and its goodput, oldest run first; opened read-only, never migrated."""
    db = open_ledger(normalize_url(db_url), readonly=True)
    try:
        check_readable(db, db.safe_url)
        with db.transaction(read=True) as session:
            found = progress_rows.run_ids(session)
        return [(root, report(db, run_id, name)) for run_id, name, root in found]
    finally:
        db.dispose()
