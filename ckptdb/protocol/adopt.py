"""Adoption: ledger rows for checkpoints that already sit at their final names.

``ckptdb adopt`` registers the checkpoints of a run trained without ckptdb (or
before it used ckptdb). Each one is a file or a directory that a framework
wrote and named itself; adopting it is a boundary without the write, one
checkpoint at a time, under the writer lock:

1. **Decide** (a read transaction, :func:`decide`): the ledger does not know
   the name yet (no live row owns it, no evicted row left it on disk); the
   layout found the checkpoint complete; it lies in the save directory (or
   ``move`` may bring it there); its step is after the newest committed step
   of its stream (adoption only appends, so "latest" stays the newest step);
   a ranked stream gets its metric, would admit it and has room (adopting
   never evicts anything).
2. **Move** (``move=True``, for a checkpoint outside the save directory only):
   one rename onto its own name in the save directory, both directories
   fsynced. Nothing is copied: another filesystem is refused.
3. **Measure**: fsync it (every file and directory of a tree) and take its
   size and hash, exactly as a boundary seals an ``External`` payload.
4. **Commit**: one short transaction inserts its row directly as
   ``committed`` (the file is complete and already at its name: there is no
   pending phase to roll back), creates its stream as ``Keep(last=None)`` if
   the run has no stream of that name, moves the stream's latest pointer to
   it, writes its metrics and an ``adopted`` event and wakes followers.
   Retention does not run. Later saves apply the stream's stored policy to
   adopted checkpoints exactly as to the ones they wrote (they are the run's
   checkpoints from then on).

Each checkpoint commits on its own: an interrupted adoption is finished by
running it again, which adopts only what is still missing. A failed commit
moves a moved checkpoint back; a crash between 2 and 4 leaves it under its
framework's name in the save directory, with no row, which reconcile never
touches. :func:`preview` runs step 1 alone, read-only, for a dry run (or for
a run that does not exist yet: then without a ledger at all).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import InvalidArgumentError, LedgerError, PhaseError, note_on
from ..ledger import Ledger, RunQueries, after_commit, open_ledger
from ..ledger import aliases as ledger_aliases
from ..ledger import models as m
from ..ledger import rows as ledger_rows
from ..ledger.engine import LEDGER_FILE
from ..ledger.follow import notify_commit
from ..ledger.runs import ledger_url, open_as_reader
from ..location import ObjectPath
from ..policies import Entry, Keep, Policy, Reads, validate_stream_name
from ..record import Checkpoint, DerivedAlias
from ..storage.base import FileInfo, PayloadStore
from ..storage.external import check_name
from .context import RunContext

__all__ = [
    "ADOPTED",
    "ALREADY",
    "NEW_STREAM_POLICY",
    "SKIPPED",
    "Adopter",
    "Candidate",
    "Outcome",
    "RecordedRun",
    "decide",
    "preview",
    "preview_recorded",
]

Status = Literal["adopted", "already", "skipped"]
ADOPTED: Status = "adopted"
ALREADY: Status = "already"
SKIPPED: Status = "skipped"

#: The policy of a stream that adoption creates: keep everything (adopting never evicts).
NEW_STREAM_POLICY: Policy = Keep(last=None)

#: The event each adopted checkpoint records.
EVENT = "adopted"


@dataclass(frozen=True)
class Candidate:
    """One checkpoint a layout found, and what the layout read from it.

    ``source`` is where it is now (a file or a directory). ``problem`` says
    why the layout refuses it (partial, unreadable...); then ``stream`` and
    ``step`` may be unknown. ``written_at`` (the file's mtime) dates its
    metrics in the ledger's ``metrics`` table.
    """

    source: Path
    stream: str | None = None
    step: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    problem: str | None = None
    written_at: float | None = None


@dataclass(frozen=True)
class Outcome:
    """What happened to one candidate (in a preview: what would happen).

    Attributes:
        candidate: The checkpoint the layout found (its ``source`` path, and the
            ``stream``, ``step`` and ``metrics`` read from it, or the
            ``problem`` that made the layout refuse it).
        status: ``adopted`` (committed now), ``already`` (a live row owns its
            name already) or ``skipped`` (refused; ``detail`` says why).
        detail: Why it was skipped, or what was done.
        name: Its name in the save directory; None for a checkpoint outside it
            that is not moved.
        checkpoint: The committed record (adopted, not in a preview); None
            otherwise.
    """

    candidate: Candidate
    status: Status
    detail: str = ""
    name: str | None = None
    checkpoint: Checkpoint | None = None


@dataclass(frozen=True)
class _Plan:
    """A decision to adopt: the name it gets, its ranking metric, whether it must move."""

    name: str
    metric: float | None
    move: bool


class _View:
    """What a decision reads: the ledger in one transaction (none for a run that does
    not exist yet), plus, in a preview, what this pass decided to adopt before."""

    def __init__(
        self,
        session: Any,
        run_id: int,
        policies: Mapping[str, Policy],
        store: PayloadStore | None,
    ) -> None:
        """``session`` None (with any ``run_id``): a run that does not exist yet;
        ``store`` None: a preview without ``move`` (nothing is looked up in it)."""
        self.session, self.run_id, self.store = session, run_id, store
        self.policies = dict(policies)
        self.kept = ledger_rows.kept_on_disk(session, run_id) if session is not None else set()
        self.planned: dict[str, list[Entry]] = {}
        self.planned_names: set[str] = set()

    def known(self, name: str) -> bool:
        """Whether the ledger owns ``name`` (a live row, or a file evicted but kept)."""
        if name in self.kept or name in self.planned_names:
            return True
        return self.session is not None and ledger_rows.path_in_use(self.session, self.run_id, name)

    def committed(self, stream: str, from_step: int | None = None) -> list[Entry]:
        found: list[Entry] = []
        if self.session is not None:
            _, found = ledger_rows.committed_entries(
                self.session,
                self.run_id,
                stream,
                reads=None if from_step is None else Reads(),  # at from_step or later
                step=from_step,
            )
        planned = self.planned.get(stream, [])
        return found + [e for e in planned if from_step is None or e.step >= from_step]

    def plan(self, stream: str, step: int, plan: _Plan) -> None:
        """A preview's note that this pass adopts ``plan`` (later decisions see it)."""
        self.planned.setdefault(stream, []).append(Entry(-1, step, plan.metric))
        self.planned_names.add(plan.name)
        self.policies.setdefault(stream, NEW_STREAM_POLICY)


def name_in(save_dir: Path, source: Path) -> str | None:
    """``source`` relative to the save directory (posix), or None if it is outside.

    The last component is not resolved (a link there stays the link itself).
    """
    try:
        rel = (source.parent.resolve() / source.name).relative_to(save_dir.resolve())
    except ValueError:
        return None
    text = rel.as_posix()
    return None if text in ("", ".") else text


def decide(view: _View, candidate: Candidate, save_dir: Path, move: bool) -> Outcome | _Plan:
    """Step 1: an outcome that adopts nothing (already, skipped), or the plan to adopt."""
    name = name_in(save_dir, candidate.source)

    def skipped(reason: str) -> Outcome:
        return Outcome(candidate, SKIPPED, reason, name)

    if name is not None and view.known(name):
        return Outcome(candidate, ALREADY, "in the ledger", name)
    if candidate.problem is not None:
        return skipped(candidate.problem)
    stream, step = candidate.stream, candidate.step
    if stream is None or step is None or step < 0:
        return skipped("the layout found no stream and step for it")
    try:
        validate_stream_name(stream)
    except InvalidArgumentError as exc:
        return skipped(str(exc))
    moving = name is None
    if name is None:
        if not move:
            return skipped(f"outside the run's save directory {save_dir} (--move moves it there)")
        name = candidate.source.name
        assert view.store is not None, "a move is previewed with its store"
        if view.known(name) or view.store.exists(name):
            return skipped(f"{name!r} already exists in the run's save directory {save_dir}")
    try:
        check_name(name)
    except InvalidArgumentError as exc:
        return skipped(str(exc))
    policy = view.policies.get(stream, NEW_STREAM_POLICY)
    metric_name = policy.ranking_metric
    metric: float | None = None
    if metric_name is not None:
        value = candidate.metrics.get(metric_name)
        # a TopK(last=...) stream ranks a checkpoint saved without its metric last
        required = bool(getattr(policy, "requires_metric", True))
        if value is None and required:
            return skipped(
                f"stream {stream!r} ranks by {metric_name!r} ({policy.describe()}), and the "
                f"layout recorded no {metric_name!r} for this checkpoint"
            )
        if value is not None and not math.isfinite(value):
            return skipped(f"stream {stream!r} ranks by {metric_name!r}, which is {value} here")
        metric = value
    newer = view.committed(stream, from_step=step)
    if newer:
        newest = max(e.step for e in newer)
        return skipped(
            f"stream {stream!r} already has a checkpoint at step {newest}; adopting only "
            "appends steps after a stream's newest"
        )
    limit = policy.capacity
    if metric_name is not None and limit is not None:
        members = view.committed(stream)
        if not policy.admits(members, Entry(-1, step, metric)):
            return skipped(f"not among the {policy.describe()} of stream {stream!r}")
        if len(members) >= limit:
            return skipped(
                f"stream {stream!r} is full ({policy.describe()}): adopting would evict "
                "one of its checkpoints, and adopting never evicts"
            )
    return _Plan(name, metric, moving)


def describe(candidate: Candidate) -> str:
    """``stream val_loss, step 8, val_loss=1.0``: one outcome's line, after its name."""
    text = f"stream {candidate.stream}, step {candidate.step}"
    # a few metrics, losses first (a Trainer logs runtimes and rates as well)
    shown = sorted(candidate.metrics.items(), key=lambda kv: "loss" not in kv[0])[:2]
    return text + "".join(f", {k}={v:.6g}" for k, v in shown)


def preview(
    candidates: Iterable[Candidate],
    *,
    save_dir: Path,
    store: PayloadStore | None,
    policies: Mapping[str, Policy],
    db: Ledger | None = None,
    run_id: int | None = None,
    move: bool = False,
) -> list[Outcome]:
    """Step 1 for every candidate, read-only: what :meth:`Adopter.run` would do now.

    ``db`` None: the run does not exist yet (nothing is read). ``store`` may be
    None unless ``move`` is set: only a move looks at it. A candidate
    planned for adoption counts for the later ones (its stream's newest step,
    its name), as its commit would.
    """

    def each(view: _View) -> list[Outcome]:
        outcomes = []
        for candidate in candidates:
            decision = decide(view, candidate, save_dir, move)
            if isinstance(decision, _Plan):
                assert candidate.stream is not None and candidate.step is not None
                view.plan(candidate.stream, candidate.step, decision)
                decision = Outcome(candidate, ADOPTED, describe(candidate), decision.name)
            outcomes.append(decision)
        return outcomes

    if db is None or run_id is None:
        return each(_View(None, -1, policies, store))
    with db.transaction(read=True) as session:
        return each(_View(session, run_id, policies, store))


class Adopter:
    """Adopts candidates into one open run (see the module docstring)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def run(
        self,
        candidates: Iterable[Candidate],
        *,
        move: bool = False,
        report: Callable[[Outcome], None] | None = None,
    ) -> list[Outcome]:
        """Adopt each candidate in turn (give them oldest first); ``report`` hears each
        outcome as soon as it is final, so an error later leaves a truthful account."""
        outcomes = []
        for candidate in candidates:
            outcome = self._one(candidate, move)
            if report is not None:
                report(outcome)
            outcomes.append(outcome)
        return outcomes

    def _one(self, candidate: Candidate, move: bool) -> Outcome:
        ctx = self.ctx
        with ctx.ledger.transaction(read=True) as session:
            view = _View(session, ctx.run_id, ctx.policies, ctx.store)
            decision = decide(view, candidate, ctx.save_dir, move)
        if isinstance(decision, Outcome):
            return decision
        undo: Callable[[], None] | None = None
        try:
            if decision.move:
                undo = ctx.store.move_in(candidate.source, decision.name)
            info = ctx.store.seal_written(decision.name)
        except PhaseError as exc:
            verb = "move" if exc.phase == "move" else "read"
            reason = f"cannot {verb} it: {type(exc.error).__name__}: {exc.error}"
            return Outcome(candidate, SKIPPED, reason + _undone(undo), decision.name)
        try:
            assert ctx.lock is not None
            ctx.lock.verify()  # a PostgreSQL lock session may have died with its connection
            record = self._commit(candidate, decision, info)
        except BaseException as exc:
            note = _undone(undo)
            if note:
                note_on(exc, f"ckptdb adopt: {candidate.source}{note}")
            raise
        return Outcome(candidate, ADOPTED, describe(candidate), decision.name, record)

    def _commit(self, candidate: Candidate, plan: _Plan, info: FileInfo) -> Checkpoint:
        """Step 4: one transaction; the row is committed as it is inserted."""
        ctx = self.ctx
        stream, step = candidate.stream, candidate.step
        assert stream is not None and step is not None
        metrics = dict(candidate.metrics)
        wall = candidate.written_at if candidate.written_at is not None else time.time()
        now = m.utcnow()
        with ctx.ledger.transaction() as session:
            if stream not in ctx.policies:
                stored = ledger_rows.sync_streams(
                    session, ctx.run_id, {stream: NEW_STREAM_POLICY}, {}
                )
                after_commit(session, lambda: ctx.policies.update(stored))
            row = ledger_rows.add_pending(
                session, ctx.run_id, ctx.attempt_id, stream, step, plan.metric, metrics
            )
            row_id: int = row.id
            ledger_rows.set_state(
                session,
                [row_id],
                m.COMMITTED,
                path=plan.name,
                size=info.size,
                hash=info.hash,
                committed_at=now,
            )
            ledger_rows.set_latest(session, ctx.run_id, stream, row_id)
            points = [(step, key, value, wall) for key, value in metrics.items()]
            ledger_rows.insert_metrics(session, ctx.run_id, ctx.attempt_id, points)
            detail: dict[str, object] = {"path": plan.name, "size": info.size}
            if plan.move:
                detail["moved_from"] = str(candidate.source)
            ledger_rows.add_event(
                session,
                ctx.run_id,
                ctx.attempt_id,
                EVENT,
                checkpoint_id=row_id,
                step=step,
                detail=detail,
            )
            notify_commit(session, ctx.run_id)
        return Checkpoint(
            stream=stream,
            step=step,
            path=ctx.save_dir / plan.name,
            size=info.size,
            hash=info.hash,
            metric=plan.metric,
            state=m.COMMITTED,
            committed_at=now,
            id=row_id,
            attempt_id=ctx.attempt_id,
            metrics=metrics,
        )


def _undone(undo: Callable[[], None] | None) -> str:
    """Move a moved checkpoint back; what to add to the message ('' when nothing moved)."""
    if undo is None:
        return ""
    try:
        undo()
    except (OSError, PhaseError) as exc:
        return f" (moving it back failed: {exc}; it stays in the save directory, without a row)"
    return " (moved back)"


@dataclass(frozen=True)
class RecordedRun:
    """What a dry look at an existing run found (:func:`preview_recorded`)."""

    save_dir: Path
    policies: dict[str, Policy]
    outcomes: list[Outcome]
    #: The newest committed checkpoint of the stream the layout's aliases follow.
    alias_target: Path | None
    #: The derived aliases the run has registered (``aliases`` table).
    aliases: tuple[DerivedAlias, ...] = ()


def preview_recorded(
    ledger_root: Path,
    db_url: str | None,
    candidates: Iterable[Candidate],
    *,
    store_of: Callable[[Path], PayloadStore],
    move: bool,
    alias_stream: str | None,
) -> RecordedRun | None:
    """:func:`preview` against the run already recorded for ``ledger_root``, read-only
    (no writer lock, nothing written); None when there is no such run yet.

    ``store_of`` opens the store of the run's save directory, only for ``move``
    (nothing else looks at the store, so a dry run contacts none). A ledger with an
    older schema is refused (upgrading is ``ckptdb db upgrade``'s, never a
    side effect of a dry run); ``move`` into a run on object storage is
    refused (moving a local file there would be an upload).
    """
    if db_url is None and not (ledger_root / LEDGER_FILE).is_file():
        return None
    db = open_ledger(ledger_url(ledger_root, db_url, readonly=True), readonly=True)
    try:
        schema = db.schema()
        if schema == "empty":
            return None
        if schema != "current":
            raise LedgerError(
                f"the ledger of {ledger_root} uses an older schema; run "
                f"`ckptdb db upgrade {ledger_root}` first"
            )
        try:
            run = open_as_reader(db, ledger_root, adopt_single=db_url is None)
        except LedgerError:  # a current schema without this run: a new run
            return None
        if isinstance(run.save_dir, ObjectPath) and move:
            raise InvalidArgumentError(
                f"adopt --move: the run saves to object storage ({run.save_dir}), and moving "
                "a local file there would be an upload; adopt it into a run with a local "
                "save_dir"
            )
        outcomes = preview(
            candidates,
            save_dir=run.save_dir,
            store=store_of(run.save_dir) if move else None,
            policies=run.policies,
            db=db,
            run_id=run.run_id,
            move=move,
        )
        target = None
        if alias_stream in run.policies:
            queries = RunQueries(db, run.run_id, run.save_dir, run.policies)
            latest = queries.latest(alias_stream)
            target = latest.path if latest is not None else None
        with db.transaction(read=True) as session:
            aliases = tuple(ledger_aliases.registered(session, run.run_id))
        return RecordedRun(run.save_dir, run.policies, outcomes, target, aliases)
    finally:
        db.dispose()
