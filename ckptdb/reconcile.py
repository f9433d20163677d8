"""Reconciliation: make the ledger and the disk agree again (design section 4).

Runs under the writer lock. File work happens first and the ledger is updated
afterwards in one transaction, so a crash in the middle only leaves work that
the next reconcile redoes; a second run does nothing. Only files inside the
save directory are touched, symlinks never, and files in our naming that no
row owns are moved to ``<root>/ckptdb.quarantine`` rather than deleted.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import func, literal, select

from . import faults, ledger
from . import models as m
from .db import Ledger
from .errors import InvalidArgumentError
from .policies import STREAM_NAME
from .storage import (
    CHECKPOINT_NAME,
    SHARDED_SUFFIX,
    TEMP_NAME,
    ForeignEntryError,
    checkpoint_size,
    confine,
    hash_checkpoint,
    move_aside,
    remove,
)

log = logging.getLogger(__name__)

QUARANTINE_NAME = "ckptdb.quarantine"


@dataclass(frozen=True)
class Action:
    """One repair (or, in a dry run, one repair that would be made)."""

    # rolled_back | deleted | lost | corrupt | repointed | removed_temp | quarantined | failed
    kind: str
    path: str
    detail: str = ""
    checkpoint_id: int | None = None
    step: int | None = None

    def __str__(self) -> str:
        return f"{self.kind:<12} {self.path}" + (f"  ({self.detail})" if self.detail else "")


@dataclass
class ReconcileReport:
    dry_run: bool = False
    actions: list[Action] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(a.kind for a in self.actions))

    @property
    def failures(self) -> list[Action]:
        return [a for a in self.actions if a.kind == "failed"]

    def __str__(self) -> str:
        if not self.actions:
            return "reconcile: ledger and disk agree; nothing to do"
        head = "reconcile (dry run)" if self.dry_run else "reconcile"
        counts = ", ".join(f"{n} {k}" for k, n in sorted(self.counts.items()))
        return "\n".join([f"{head}: {counts}", *(f"  {a}" for a in self.actions)])


@dataclass
class _Plan:
    """Row changes decided by the file phase, applied in one transaction."""

    state: dict[int, str] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)


def files_in_our_naming(save_dir: Path) -> Iterator[tuple[str, os.DirEntry[str], str]]:
    """(stream dir, entry, "temp" | "checkpoint") for every checkpoint named like ours.

    Only real directories with valid stream names are entered. A ``.pt`` name
    counts only as a regular file and a sharded ``.dcp`` name only as a real
    directory: symlinks and anything else are never ours to touch.
    """
    if not save_dir.is_dir():
        return
    for stream_dir in sorted(os.scandir(save_dir), key=lambda e: e.name):
        name = stream_dir.name
        if stream_dir.is_symlink() or not stream_dir.is_dir():
            continue
        if not STREAM_NAME.fullmatch(name) or name.startswith("ckptdb."):
            continue
        for entry in sorted(os.scandir(stream_dir.path), key=lambda e: e.name):
            if entry.is_symlink() or not _right_kind(entry):
                continue
            if TEMP_NAME.fullmatch(entry.name):
                yield name, entry, "temp"
            elif CHECKPOINT_NAME.fullmatch(entry.name):
                yield name, entry, "checkpoint"


def _right_kind(entry: os.DirEntry[str]) -> bool:
    sharded = entry.name.endswith(SHARDED_SUFFIX) or f"{SHARDED_SUFFIX}.tmp-" in entry.name
    return entry.is_dir(follow_symlinks=False) if sharded else entry.is_file(follow_symlinks=False)


class Reconciler:
    def __init__(
        self, db: Ledger, run_id: int, attempt_id: int | None, root: Path, save_dir: Path
    ) -> None:
        self.db, self.run_id, self.attempt_id = db, run_id, attempt_id
        self.root, self.save_dir = root, save_dir
        self._resolved: dict[Path, Path] = {}

    def run(
        self,
        *,
        verify: bool = False,
        dry_run: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> ReconcileReport:
        """Repair (or with ``dry_run`` only list) every disagreement.

        ``progress(done, total)`` is called after each ledger row is checked
        (``verify`` re-hashes every committed file, which can take a while).
        """
        report = ReconcileReport(dry_run=dry_run)
        self._resolved = {}  # directory resolutions are memoized for this pass only
        with self.db.transaction() as session:
            rows = ledger.rows_in_state(session, self.run_id, ledger.LIVE_STATES)
            streams = list(
                session.scalars(select(m.Stream.name).where(m.Stream.run_id == self.run_id))
            )
        plan = _Plan()
        keep_paths: set[str] = set()
        for done, row in enumerate(rows, 1):
            self._check_row(row, plan, report, keep_paths, verify=verify, dry_run=dry_run)
            if progress is not None:
                progress(done, len(rows))
        self._scan(keep_paths, report, dry_run=dry_run)
        faults.point("mid_reconcile")
        if not dry_run:
            self._apply(plan, report, streams)
        else:
            self._preview_pointers(plan, report, streams)
        for failure in report.failures:
            warnings.warn(
                f"ckptdb reconcile could not repair {failure.path}: {failure.detail}", stacklevel=3
            )
        return report

    def _check_row(
        self,
        row: m.Checkpoint,
        plan: _Plan,
        report: ReconcileReport,
        keep: set[str],
        *,
        verify: bool,
        dry_run: bool,
    ) -> None:
        keep.add(row.path)
        if row.tmp_path:
            keep.add(row.tmp_path)
        if row.state == m.PENDING:
            if self._remove(row, [row.tmp_path, row.path], report, dry_run):
                plan.state[row.id] = m.ABORTED
                plan.errors[row.id] = row.error or "crashed before commit"
                report.actions.append(
                    Action("rolled_back", row.path, f"step {row.step}", row.id, row.step)
                )
        elif row.state == m.DELETING:
            if self._remove(row, [row.path], report, dry_run):
                plan.state[row.id] = m.DELETED
                report.actions.append(
                    Action("deleted", row.path, "evicted by policy", row.id, row.step)
                )
        elif row.state == m.COMMITTED:
            problem = self._inspect(row, verify)
            if problem is not None:
                kind, detail = problem
                plan.state[row.id] = kind
                plan.errors[row.id] = detail
                report.actions.append(Action(kind, row.path, detail, row.id, row.step))

    def _remove(
        self, row: m.Checkpoint, paths: list[str | None], report: ReconcileReport, dry_run: bool
    ) -> bool:
        for rel in paths:
            if rel is None:
                continue
            try:
                target = confine(self.save_dir, rel, self._resolved)
                if not dry_run:
                    remove(target)
            except (OSError, InvalidArgumentError) as exc:
                report.actions.append(Action("failed", rel, f"{type(exc).__name__}: {exc}", row.id))
                return False
        return True

    def _inspect(self, row: m.Checkpoint, verify: bool) -> tuple[str, str] | None:
        try:
            path = confine(self.save_dir, row.path, self._resolved)
            size = checkpoint_size(path)
        except FileNotFoundError:
            return m.LOST, "file missing"
        except ForeignEntryError as exc:
            return m.CORRUPT, str(exc)
        except (OSError, InvalidArgumentError) as exc:
            return m.LOST, f"unreadable: {exc}"
        if size != row.size:
            return m.CORRUPT, f"size {size} != recorded {row.size}"
        if verify:
            try:
                actual = hash_checkpoint(path)
            except ForeignEntryError as exc:
                return m.CORRUPT, str(exc)
            except OSError as exc:
                return m.LOST, f"unreadable: {exc}"
            if actual.hash != row.hash:
                return m.CORRUPT, f"hash {actual.hash} != recorded {row.hash}"
        return None

    def _scan(self, keep: set[str], report: ReconcileReport, *, dry_run: bool) -> None:
        for name, entry, kind in files_in_our_naming(self.save_dir):
            rel = f"{name}/{entry.name}"
            if rel in keep:
                continue
            if kind == "temp":
                self._act(
                    report, "removed_temp", rel, dry_run, lambda p=Path(entry.path): remove(p)
                )
            else:
                quarantine = self.root / QUARANTINE_NAME / name
                self._act(
                    report,
                    "quarantined",
                    rel,
                    dry_run,
                    lambda p=Path(entry.path), q=quarantine: move_aside(p, q),
                )

    def _act(
        self, report: ReconcileReport, kind: str, rel: str, dry_run: bool, work: object
    ) -> None:
        detail = "no ledger row"
        if not dry_run:
            try:
                result = work()  # type: ignore[operator]
            except OSError as exc:
                report.actions.append(Action("failed", rel, f"{kind}: {type(exc).__name__}: {exc}"))
                return
            if isinstance(result, Path):
                detail = f"no ledger row; moved to {result}"
        report.actions.append(Action(kind, rel, detail))

    def _apply(self, plan: _Plan, report: ReconcileReport, streams: list[str]) -> None:
        now = m.utcnow()
        with self.db.transaction() as session:
            for row_id, state in plan.state.items():
                extra: dict[str, object] = {}
                if state == m.DELETED:  # keep the eviction time a commit recorded
                    extra["deleted_at"] = func.coalesce(
                        m.Checkpoint.deleted_at, literal(now, type_=m.UTCDateTime())
                    )
                if row_id in plan.errors:
                    extra["error"] = plan.errors[row_id]
                ledger.set_state(session, [row_id], state, **extra)
            for stream in streams:
                old, new = ledger.repoint_latest(session, self.run_id, stream)
                if old != new:
                    report.actions.append(
                        Action("repointed", f"latest:{stream}", f"{old} -> {new}", new)
                    )
            for action in report.actions:
                ledger.add_event(
                    session,
                    self.run_id,
                    self.attempt_id,
                    action.kind,
                    checkpoint_id=action.checkpoint_id,
                    step=action.step,
                    detail={"path": action.path, "detail": action.detail, "reconcile": True},
                )
        for action in report.actions:
            log.info("ckptdb reconcile: %s", action)

    def _preview_pointers(self, plan: _Plan, report: ReconcileReport, streams: list[str]) -> None:
        with self.db.transaction() as session:
            for stream in streams:
                pointer = ledger.latest_row(session, self.run_id, stream)
                rows = [
                    r
                    for r in ledger.rows_in_state(session, self.run_id, [m.COMMITTED], stream)
                    if r.id not in plan.state
                ]
                new = max((r.id for r in rows), default=None)
                old = pointer.id if pointer is not None else None
                if old != new:
                    report.actions.append(
                        Action("repointed", f"latest:{stream}", f"{old} -> {new}")
                    )
