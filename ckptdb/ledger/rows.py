"""Operations on ledger rows and pointers.

Every function takes an open session (from :meth:`Ledger.transaction`) and
never commits: the caller decides what one transaction contains.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, insert, literal, select, text, update
from sqlalchemy.orm import Session

from ..errors import InvalidArgumentError
from ..location import rebased
from ..policies import Entry, Policy, PolicyRecord, Reads, policy_from_record
from ..record import END_STATES, EVENT_KINDS, Checkpoint
from . import driver
from . import models as m
from .held import connection_of
from .progress import Heartbeat, beat_values

LIVE_STATES = (m.PENDING, m.COMMITTED, m.DELETING, m.LOST, m.CORRUPT)
#: The event kind that records a name another writer took first (see disowned_paths).
FOREIGN = "foreign"  # one of record.EVENT_KINDS

log = logging.getLogger(__name__)


def latest_pointer(stream: str) -> str:
    return f"latest:{stream}"


def find_run(session: Session, root: str, *, adopt_single: bool) -> m.Run | None:
    """The run rooted at ``root``; with ``adopt_single``, the only run of the ledger.

    A ledger file that lives in its run's root belongs to that run even after
    the directory is moved or renamed; adopting it (instead of starting a new
    run) keeps reconcile from quarantining every checkpoint it finds.
    """
    run = session.scalars(select(m.Run).where(m.Run.root == root)).one_or_none()
    if run is None and adopt_single:
        runs = list(session.scalars(select(m.Run).limit(2)))
        run = runs[0] if len(runs) == 1 else None
    return run


def rebased_save_dir(run: m.Run, root: Path) -> Path:
    """The run's stored save dir, following the root if it was inside the root
    (an object-store location stays what it is)."""
    return rebased(run.save_dir, run.root, root)


def open_run(session: Session, root: Path, save_dir: Path | None, *, adopt_single: bool) -> m.Run:
    """Find or create the run; record where it lives now. ``save_dir`` None keeps the stored one."""
    run = find_run(session, str(root), adopt_single=adopt_single)
    if run is None:
        target = save_dir or root / "checkpoints"
        run = m.Run(name=root.name, root=str(root), save_dir=str(target), created_at=m.utcnow())
        session.add(run)
        session.flush()
        return run
    target = save_dir or rebased_save_dir(run, root)
    run.root, run.save_dir = str(root), str(target)
    return run


def policy_from_row(row: m.Stream) -> Policy:
    return policy_from_record(
        PolicyRecord(row.kind, row.keep_last, row.keep_every, row.k, row.metric, row.mode)
    )


def _write_policy(row: m.Stream, policy: Policy) -> None:
    record = policy.to_record()
    row.kind, row.keep_last, row.keep_every = record.kind, record.keep_last, record.keep_every
    row.k, row.metric, row.mode = record.k, record.metric, record.mode


def sync_streams(
    session: Session, run_id: int, requested: dict[str, Policy] | None, default: dict[str, Policy]
) -> dict[str, Policy]:
    """Store the requested policies; return every stream's policy.

    Streams the caller does not name keep their stored policy (and their
    checkpoints); a run with no stored streams gets ``default``.
    """
    rows = {r.name: r for r in session.scalars(select(m.Stream).where(m.Stream.run_id == run_id))}
    wanted = requested if requested is not None else ({} if rows else default)
    for name, policy in wanted.items():
        row = rows.get(name)
        if row is None:
            row = rows[name] = m.Stream(run_id=run_id, name=name)
            session.add(row)
        elif policy.ranking_metric is not None and (
            row.kind != policy.kind
            or row.metric != policy.ranking_metric
            or (policy.requires_metric and not policy_from_row(row).requires_metric)
        ):
            _rerank(session, run_id, name, policy.ranking_metric, policy.requires_metric)
        _write_policy(row, policy)
    session.flush()
    return {name: policy_from_row(row) for name, row in sorted(rows.items())}


def _rerank(session: Session, run_id: int, stream: str, metric: str, required: bool) -> None:
    """A stream now ranks by ``metric``: take each checkpoint's value from its metrics.

    Ranking old checkpoints by another metric's stored values would evict the
    real best; a checkpoint saved without the new metric makes the change
    impossible, and it is refused (use a new stream name instead), unless the
    policy lets saves omit the metric (``TopK(last=...)``): such a checkpoint
    then ranks as one saved without it.
    """
    for row in rows_in_state(session, run_id, (m.COMMITTED, m.DELETING), stream):
        value = json.loads(row.metrics).get(metric) if row.metrics else None
        if value is None and not required:
            row.metric = None
            continue
        if (
            not isinstance(value, (int, float))
            or value != value
            or value in (float("inf"), float("-inf"))
        ):
            raise InvalidArgumentError(
                f"stream {stream!r} cannot rank by {metric!r}: its checkpoint at step "
                f"{row.step} was saved without a finite {metric!r}; use a new stream name"
            )
        row.metric = float(value)


def start_attempt(
    session: Session, run_id: int, kind: str = "train", world_size: int = 1
) -> m.Attempt:
    """Close attempts a crash left running, then open this process's attempt.

    One that had been told it was preempted (a ``preempted`` event) and died
    before it closed, killed at the end of its grace period, ended
    ``preempted``: the scheduler took it, it did not crash.
    """
    # the run's row, locked until COMMIT: a commit of the previous writer that is
    # checking its fence (boundary_rows.newest_attempt) lands before this, or sees it
    session.execute(select(m.Run.id).where(m.Run.id == run_id).with_for_update(key_share=True))
    now = m.utcnow()
    told = select(m.Event.attempt_id).where(m.Event.run_id == run_id, m.Event.kind == "preempted")
    session.execute(
        update(m.Attempt)
        .where(
            m.Attempt.run_id == run_id,
            m.Attempt.end_state == "running",
            m.Attempt.id.in_(told),
        )
        .values(end_state="preempted", ended_at=now)
    )
    session.execute(
        update(m.Attempt)
        .where(m.Attempt.run_id == run_id, m.Attempt.end_state == "running")
        .values(end_state="crashed", ended_at=now)
    )
    attempt = m.Attempt(
        run_id=run_id,
        started_at=now,
        host=socket.gethostname(),
        pid=os.getpid(),
        end_state="running",
        kind=kind,
        world_size=world_size,
    )
    session.add(attempt)
    session.flush()
    return attempt


def end_attempt(
    session: Session, attempt_id: int, state: str, beat: Heartbeat | None = None
) -> None:
    """End the attempt as ``state``; ``beat`` is its last heartbeat (its end, for goodput)."""
    if state not in END_STATES:
        raise InvalidArgumentError(
            f"unknown attempt end state {state!r} (ckptdb.record.END_STATES)"
        )
    now = m.utcnow()
    values: dict[str, Any] = {"end_state": state, "ended_at": now}
    if beat is not None:
        values.update(beat_values(beat), seen_at=now)
    session.execute(update(m.Attempt).where(m.Attempt.id == attempt_id).values(**values))


def newest_event_of(session: Session, run_id: int, kinds: tuple[str, ...]) -> str | None:
    """The kind of the run's newest event among ``kinds`` (None: none of them)."""
    found = session.scalar(
        select(m.Event.kind)
        .where(m.Event.run_id == run_id, m.Event.kind.in_(kinds))
        .order_by(m.Event.id.desc())
        .limit(1)
    )
    return None if found is None else str(found)


def add_event(
    session: Session,
    run_id: int,
    attempt_id: int | None,
    kind: str,
    *,
    checkpoint_id: int | None = None,
    step: int | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    """One event row. ``kind`` must be one of ``EVENT_KINDS``: docs/ledger.md lists
    them for the users who query ``events``, and a kind missing there is a bug."""
    if kind not in EVENT_KINDS:
        raise InvalidArgumentError(f"unknown event kind {kind!r} (ckptdb.record.EVENT_KINDS)")
    session.add(
        m.Event(
            run_id=run_id,
            attempt_id=attempt_id,
            time=m.utcnow(),
            kind=kind,
            checkpoint_id=checkpoint_id,
            step=step,
            detail=json.dumps(detail, default=str) if detail else None,
        )
    )


def rows_in_state(
    session: Session, run_id: int, states: Iterable[str], stream: str | None = None
) -> list[m.Checkpoint]:
    query = select(m.Checkpoint).where(
        m.Checkpoint.run_id == run_id, m.Checkpoint.state.in_(tuple(states))
    )
    if stream is not None:
        query = query.where(m.Checkpoint.stream == stream)
    return list(
        session.scalars(query.order_by(m.Checkpoint.stream, m.Checkpoint.step, m.Checkpoint.id))
    )


def entries(rows: Sequence[m.Checkpoint]) -> list[Entry]:
    return [Entry(id=r.id, step=r.step, metric=r.metric) for r in rows]


#: The error note of an evicted row whose file was kept (``mgr.protect``).
KEPT_ON_DISK = "evicted; its file was kept on disk (protected)"


def kept_on_disk(session: Session, run_id: int) -> set[str]:
    """Paths of evicted rows whose files were kept (protected): the user's now,
    never quarantined or reported as unowned."""
    found = session.scalars(
        select(m.Checkpoint.path).where(
            m.Checkpoint.run_id == run_id,
            m.Checkpoint.state == m.DELETED,
            m.Checkpoint.error == KEPT_ON_DISK,
        )
    )
    return set(found)


def paths_in_state(session: Session, run_id: int, states: Sequence[str]) -> set[str]:
    """The paths of the run's rows in ``states``."""
    query = select(m.Checkpoint.path).where(
        m.Checkpoint.run_id == run_id, m.Checkpoint.state.in_(states)
    )
    return set(session.scalars(query))


def quarantined_in_place(session: Session, run_id: int) -> set[str]:
    """Paths a reconcile quarantined without moving them (a store without rename).

    Remembered in their ``quarantined`` events (``"in_place": true``), so a
    later reconcile leaves them alone instead of reporting them again.
    """
    query = select(m.Event.detail).where(m.Event.run_id == run_id, m.Event.kind == "quarantined")
    found = set()
    for stored in session.scalars(query):
        detail = json.loads(stored) if stored else {}
        if isinstance(detail, dict) and detail.get("in_place"):
            found.add(str(detail.get("path")))
    return found


def disowned_paths(session: Session, run_id: int) -> set[str]:
    """Paths a write of this run found taken by someone else (a store without rename):
    recorded by the rollback in ``foreign`` events, so no later reconcile removes them."""
    query = select(m.Event.detail).where(m.Event.run_id == run_id, m.Event.kind == FOREIGN)
    found = set()
    for stored in session.scalars(query):
        detail = json.loads(stored) if stored else {}
        if isinstance(detail, dict) and detail.get("path"):
            found.add(str(detail["path"]))
    return found


def path_in_use(
    session: Session, run_id: int, path: str, *, stream: str | None = None, step: int | None = None
) -> bool:
    """Whether a live row (anything not deleted or aborted) owns ``path``.

    A name in ckptdb's own naming can only belong to its stream and step:
    given them, the ``(run_id, stream, state, step)`` index answers without
    reading the run's history (a framework's name is checked run-wide).
    """
    query = select(func.count()).select_from(m.Checkpoint)
    query = query.where(m.Checkpoint.run_id == run_id)
    if stream is not None and step is not None:
        query = query.where(m.Checkpoint.stream == stream, m.Checkpoint.step == step)
    found = session.scalar(
        query.where(m.Checkpoint.state.in_(LIVE_STATES), m.Checkpoint.path == path)
    )
    return bool(found)


def set_state(session: Session, ids: Sequence[int], state: str, **values: Any) -> None:
    if ids:
        session.execute(
            update(m.Checkpoint).where(m.Checkpoint.id.in_(ids)).values(state=state, **values)
        )


def set_latest(session: Session, run_id: int, stream: str, checkpoint_id: int | None) -> None:
    name = latest_pointer(stream)
    pointer = session.get(m.Pointer, (run_id, name))
    if checkpoint_id is None:
        if pointer is not None:
            session.execute(
                delete(m.Pointer).where(m.Pointer.run_id == run_id, m.Pointer.name == name)
            )
    elif pointer is None:
        session.add(m.Pointer(run_id=run_id, name=name, checkpoint_id=checkpoint_id))
    else:
        pointer.checkpoint_id = checkpoint_id


def newest_committed_id(
    session: Session, run_id: int, stream: str, excluding: Iterable[int] = ()
) -> int | None:
    """The newest (most recently published) healthy checkpoint of a stream.

    The one definition of "latest" (the pointer follows it; ``check`` and a
    dry-run reconcile compare against it), ``excluding`` rows about to change.
    """
    where = (
        m.Checkpoint.run_id == run_id,
        m.Checkpoint.stream == stream,
        m.Checkpoint.state == m.COMMITTED,
    )
    skipped = set(excluding)
    if not skipped:
        return session.scalar(select(func.max(m.Checkpoint.id)).where(*where))
    # newest first, past the excluded ones (no bind parameter per excluded id)
    newest_first = session.scalars(
        select(m.Checkpoint.id).where(*where).order_by(m.Checkpoint.id.desc())
    )
    return next((i for i in newest_first if i not in skipped), None)


def latest_row(session: Session, run_id: int, stream: str) -> m.Checkpoint | None:
    pointer = session.get(m.Pointer, (run_id, latest_pointer(stream)))
    if pointer is None:
        return None
    row = session.get(m.Checkpoint, pointer.checkpoint_id)
    return row if row is not None and row.state == m.COMMITTED else None


def repoint_latest(session: Session, run_id: int, stream: str) -> tuple[int | None, int | None]:
    """Point ``latest:<stream>`` at the newest healthy row; returns (old id, new id)."""
    pointer = session.get(m.Pointer, (run_id, latest_pointer(stream)))
    old = pointer.checkpoint_id if pointer is not None else None
    new = newest_committed_id(session, run_id, stream)
    if old != new:
        set_latest(session, run_id, stream, new)
    return old, new


def insert_metrics(
    session: Session, run_id: int, attempt_id: int, points: Sequence[tuple[int, str, float, float]]
) -> None:
    """Insert (step, name, value, wall_time) points in one executemany (see insert_metric_calls)."""
    if points:
        rows = [(run_id, attempt_id, s, n, None if v != v else v, t) for s, n, v, t in points]
        _insert_metric_rows(session, rows)


def insert_metric_calls(
    session: Session,
    run_id: int,
    attempt_id: int,
    steps: Sequence[int],
    values: Sequence[dict[str, float]],
    walls: Sequence[float],
) -> None:
    """Insert buffered calls (the i-th: ``steps[i]``, ``values[i]``, ``walls[i]``), a row
    per point, in call order.

    The rows are made here, once, so that ``log_metrics`` only keeps its call
    at every step, and they are made in C (``zip`` of the columns, the driver
    consuming one row at a time): a comprehension over the calls cost more
    than the call saved at one point per call. Call order is the rows' id
    order, which ``metric_history`` uses to order a step logged twice.
    NaN is stored as NULL (SQLite has no NaN); readers turn it back into NaN.
    """
    names = list(chain.from_iterable(values))
    if not names:
        return
    floats = list(chain.from_iterable(map(dict.values, values)))
    total = sum(floats)
    numbers: Sequence[float | None] = floats
    if total != total:  # a NaN among them (or inf and -inf): only then a pass in Python
        numbers = [None if v != v else v for v in floats]
    count = len(names)
    sizes = list(map(len, values))
    row_steps: Iterable[int] = steps
    row_walls: Iterable[float] = walls
    if sizes.count(1) != len(sizes):  # some call logged several points: repeat its step, time
        row_steps = chain.from_iterable(map(repeat, steps, sizes))
        row_walls = chain.from_iterable(map(repeat, walls, sizes))
    rows = zip(
        repeat(run_id, count),
        repeat(attempt_id, count),
        row_steps,
        names,
        numbers,
        row_walls,
        strict=True,
    )
    _insert_metric_rows(session, rows)


_METRIC_COLUMNS = ("run_id", "attempt_id", "step", "name", "value", "wall_time")
_PLACEHOLDER = {"qmark": "?", "format": "%s", "pyformat": "%s"}


def _insert_metric_rows(session: Session, rows: Iterable[tuple[Any, ...]]) -> None:
    """One executemany of plain tuples (at least one): about four times the throughput
    of ORM/Core dictionaries, which matters at a point per step; a driver with
    another parameter style goes through Core."""
    connection = connection_of(session)
    marker = _PLACEHOLDER.get(connection.dialect.paramstyle)
    if marker is None:
        dicts = [dict(zip(_METRIC_COLUMNS, r, strict=True)) for r in rows]
        session.execute(insert(m.Metric), dicts)
        return
    placeholders = ", ".join([marker] * len(_METRIC_COLUMNS))
    columns = ", ".join(_METRIC_COLUMNS)
    driver.executemany(connection, f"INSERT INTO metrics ({columns}) VALUES ({placeholders})", rows)


def to_record(row: m.Checkpoint, save_dir: Path) -> Checkpoint:
    """The public, immutable view of a checkpoint row (``path`` made absolute)."""
    return Checkpoint(
        stream=row.stream,
        step=row.step,
        path=save_dir / row.path,
        size=row.size,
        hash=row.hash,
        metric=row.metric,
        state=row.state,
        committed_at=row.committed_at,
        id=row.id,
        attempt_id=row.attempt_id,
        metrics=json.loads(row.metrics) if row.metrics else {},
        world_size=row.world_size,
    )


# --------------------------------------------------------------- the boundary's rows


def add_pending(
    session: Session,
    run_id: int,
    attempt_id: int,
    stream: str,
    step: int,
    metric: float | None,
    metrics: dict[str, float],
) -> m.Checkpoint:
    """Insert the ``pending`` row of one stream's share of a boundary (path set later)."""
    row = m.Checkpoint(
        run_id=run_id,
        stream=stream,
        step=step,
        attempt_id=attempt_id,
        path="",
        state=m.PENDING,
        metric=metric,
        metrics=json.dumps(metrics) if metrics else None,
        created_at=m.utcnow(),
    )
    session.add(row)
    session.flush()
    return row


def committed_after(
    session: Session, run_id: int, stream: str, after_id: int
) -> list[m.Checkpoint]:
    """The stream's committed rows newer than ``after_id``, newest first."""
    query = (
        select(m.Checkpoint)
        .where(m.Checkpoint.run_id == run_id, m.Checkpoint.stream == stream)
        .where(m.Checkpoint.state == m.COMMITTED, m.Checkpoint.id > after_id)
        .order_by(m.Checkpoint.id.desc())
    )
    return list(session.scalars(query))


def left_behind(session: Session, run_id: int, stream: str, checkpoint_id: int, step: int) -> bool:
    """Whether a later commit of the stream at a step at or before ``step`` made the
    checkpoint part of an abandoned timeline (the timeline rule evicted it): such a
    checkpoint is never the stream's newest again, whatever copies it has."""
    query = (
        select(m.Checkpoint.id)
        .where(m.Checkpoint.run_id == run_id, m.Checkpoint.stream == stream)
        .where(m.Checkpoint.id > checkpoint_id, m.Checkpoint.step <= step)
        .where(m.Checkpoint.committed_at.is_not(None))
        .limit(1)
    )
    return session.scalars(query).first() is not None


def committed_entries(
    session: Session,
    run_id: int,
    stream: str,
    *,
    reads: Reads | None = None,
    step: int | None = None,
) -> tuple[list[m.Checkpoint], list[Entry]]:
    """A stream's committed rows, all of them or those ``reads`` selects for a commit at
    ``step`` (through the ``(run_id, stream, state, step)`` index), and the policy's view."""
    if reads is None or reads.everything or step is None:
        found = rows_in_state(session, run_id, [m.COMMITTED], stream)
        return found, entries(found)
    base = select(m.Checkpoint).where(
        m.Checkpoint.run_id == run_id,
        m.Checkpoint.stream == stream,
        m.Checkpoint.state == m.COMMITTED,
    )
    chosen = {r.id: r for r in session.scalars(base.where(m.Checkpoint.step >= step))}
    if reads.newest_below:
        newest = base.where(m.Checkpoint.step < step).order_by(
            m.Checkpoint.step.desc(), m.Checkpoint.id.desc()
        )
        chosen.update((r.id, r) for r in session.scalars(newest.limit(reads.newest_below)))
    if reads.not_multiple_of is not None:
        odd = base.where(m.Checkpoint.step % reads.not_multiple_of != 0)
        chosen.update((r.id, r) for r in session.scalars(odd))
    found = sorted(chosen.values(), key=lambda r: (r.step, r.id))
    return found, entries(found)


def stream_names(session: Session, run_id: int) -> list[str]:
    return list(session.scalars(select(m.Stream.name).where(m.Stream.run_id == run_id)))


def mark_deleted(session: Session, ids: Sequence[int], now: Any, **values: Any) -> None:
    """Rows whose files are gone: ``deleted``, keeping the eviction time a commit recorded."""
    deleted_at = func.coalesce(m.Checkpoint.deleted_at, literal(now, type_=m.UTCDateTime()))
    set_state(session, ids, m.DELETED, deleted_at=deleted_at, **values)


def integrity(session: Session) -> str:
    """SQLite's ``PRAGMA integrity_check`` (``ok`` on other backends, which keep their own)."""
    if session.get_bind().dialect.name != "sqlite":
        return "ok"
    return str(session.execute(text("PRAGMA integrity_check")).scalar())


def note_resume(session: Session, attempt_id: int, checkpoint_id: int) -> None:
    """Record the checkpoint this attempt resumed from (the first one it loaded)."""
    attempt = session.get(m.Attempt, attempt_id)
    if attempt is not None and attempt.resumed_from_id is None:
        attempt.resumed_from_id = checkpoint_id
