"""The rows goodput is computed from: attempts' heartbeats, boundaries' places, failures.

An attempt writes its heartbeat (the newest step, when it was seen alive, its
blocked seconds) now and then, and once more when it ends; the goodput report
(:mod:`ckptdb.goodput`) and the automatic interval read them back here. Every
function takes an open session and never commits, like :mod:`~ckptdb.ledger.rows`.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from . import models as m

#: End states of an attempt that did not finish its work: the failures goodput counts.
FAILED_ENDS = ("crashed", "preempted")


@dataclass(frozen=True)
class Heartbeat:
    """What an attempt reports of itself (None: not known yet)."""

    first_step_at: dt.datetime | None
    last_step: int | None
    seen_at: dt.datetime
    saving_s: float
    saves: int
    #: The process's start, when this attempt is its first to train (else None).
    launched_at: dt.datetime | None = None


@dataclass(frozen=True)
class AttemptTimes:
    """One attempt as goodput reads it."""

    id: int
    run_id: int
    host: str
    kind: str
    end_state: str
    started_at: dt.datetime
    ended_at: dt.datetime | None
    launched_at: dt.datetime | None
    first_step_at: dt.datetime | None
    seen_at: dt.datetime | None
    last_step: int | None
    saving_s: float | None
    saves: int | None
    resumed_from_id: int | None


@dataclass(frozen=True)
class BoundaryMark:
    """Where a checkpoint sits in its attempt's time: what a resume point cuts at."""

    id: int
    attempt_id: int
    step: int
    state: str
    created_at: dt.datetime
    committed_at: dt.datetime | None
    saving_before_s: float | None


_ATTEMPT_COLUMNS = (
    m.Attempt.id,
    m.Attempt.run_id,
    m.Attempt.host,
    m.Attempt.kind,
    m.Attempt.end_state,
    m.Attempt.started_at,
    m.Attempt.ended_at,
    m.Attempt.launched_at,
    m.Attempt.first_step_at,
    m.Attempt.seen_at,
    m.Attempt.last_step,
    m.Attempt.saving_s,
    m.Attempt.saves,
    m.Attempt.resumed_from_id,
)


def _attempt(row: Any) -> AttemptTimes:
    return AttemptTimes(*row)


def process_started_at() -> dt.datetime | None:
    """When this process started (Linux: ``/proc``), else None.

    A restart's cost begins when the scheduler starts the process, not when
    it opens the ledger: importing torch alone takes seconds. The process's
    age is the boot clock now (``CLOCK_BOOTTIME``, else ``/proc/uptime``)
    less its start in clock ticks after boot (field 22 of
    ``/proc/self/stat``, on the same clock); subtracted from now: within a
    clock tick (10 ms). (``btime`` of ``/proc/stat`` plus the start
    is off by seconds on machines whose wall clock was stepped since boot.)
    """
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            stat = f.read()
        uptime = _boot_clock()
        ticks = int(stat.rpartition(")")[2].split()[19])  # after "(comm)": field 22
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return dt.datetime.fromtimestamp(time.time() - max(age, 0.0), dt.timezone.utc)


def _boot_clock() -> float:
    """Seconds since boot, suspended time included (the clock of a process's start)."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if boottime is not None:
        return time.clock_gettime(boottime)
    with open("/proc/uptime", encoding="ascii") as f:
        return float(f.read().split()[0])


_claimed_by: int | None = None  # the process whose first attempt took its start


def launch_of_first_attempt() -> dt.datetime | None:
    """The process's start for the first attempt this process opens, None for the next
    ones (a process that opens a run again restarts nothing: its start is its open). A
    forked child is a new process: its first attempt has its own start."""
    global _claimed_by
    if _claimed_by == os.getpid():
        return None
    _claimed_by = os.getpid()
    return process_started_at()


def write_heartbeat(session: Session, attempt_id: int, beat: Heartbeat) -> None:
    """Record ``beat`` on a running attempt (never on one another writer already ended)."""
    session.execute(
        update(m.Attempt)
        .where(m.Attempt.id == attempt_id, m.Attempt.end_state == "running")
        .values(**beat_values(beat))
    )


def beat_values(beat: Heartbeat) -> dict[str, Any]:
    """The attempt's columns a heartbeat sets."""
    values: dict[str, Any] = {
        "first_step_at": beat.first_step_at,
        "last_step": beat.last_step,
        "seen_at": beat.seen_at,
        "saving_s": beat.saving_s,
        "saves": beat.saves,
    }
    if beat.launched_at is not None:
        values["launched_at"] = beat.launched_at
    return values


def attempts_of(session: Session, run_id: int) -> list[AttemptTimes]:
    """The run's training attempts, oldest first (maintenance attempts are not training)."""
    found = session.execute(
        select(*_ATTEMPT_COLUMNS)
        .where(m.Attempt.run_id == run_id, m.Attempt.kind == "train")
        .order_by(m.Attempt.id)
    )
    return [_attempt(row) for row in found]


def marks_of(session: Session, run_id: int) -> list[BoundaryMark]:
    """Every checkpoint row of the run with its place in its attempt's time."""
    found = session.execute(
        select(
            m.Checkpoint.id,
            m.Checkpoint.attempt_id,
            m.Checkpoint.step,
            m.Checkpoint.state,
            m.Checkpoint.created_at,
            m.Checkpoint.committed_at,
            m.Checkpoint.saving_before_s,
        )
        .where(m.Checkpoint.run_id == run_id)
        .order_by(m.Checkpoint.id)
    )
    return [BoundaryMark(*row) for row in found]


def last_signs_of_life(session: Session, run_id: int) -> dict[int, dt.datetime]:
    """Per attempt, its newest event: when an attempt without a heartbeat (opened before
    revision 0009, or one that never reported a step) was last known alive."""
    found = session.execute(
        select(m.Event.attempt_id, func.max(m.Event.time))
        .where(m.Event.run_id == run_id, m.Event.attempt_id.is_not(None))
        .group_by(m.Event.attempt_id)
    )
    return {int(a): t for a, t in found if a is not None}


def failure_history(session: Session, run_id: int, host: str) -> list[AttemptTimes]:
    """The ended training attempts whose failures predict this run's: the run's own, on
    any host, and every other run's on ``host`` (a shared PostgreSQL ledger holds a
    fleet's history; a SQLite ledger, one run's)."""
    found = session.execute(
        select(*_ATTEMPT_COLUMNS)
        .where(
            m.Attempt.kind == "train",
            m.Attempt.end_state != "running",
            or_(m.Attempt.run_id == run_id, m.Attempt.host == host),
        )
        .order_by(m.Attempt.id)
    )
    return [_attempt(row) for row in found]


def run_ids(session: Session) -> Sequence[tuple[int, str, str]]:
    """Every run of the ledger: (id, name, root), oldest first."""
    found = session.execute(select(m.Run.id, m.Run.name, m.Run.root).order_by(m.Run.id))
    return [(int(i), str(n), str(r)) for i, n, r in found]
