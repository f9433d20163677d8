"""Reconciliation: make the ledger and the payload store agree again.

Runs under the writer lock, at open and on demand. It repairs in an order
that never makes things worse:

=============================================  ===========================================
found                                           action
=============================================  ===========================================
``pending`` row (crash before commit)           remove its temporary/final payload, ``aborted``
``deleting`` row                                remove the payload, ``deleted`` (not while pinned)
``committed`` row, payload missing              ``lost``
``committed`` row, size (``verify``: hash) off  ``corrupt``
``lost`` row, payload back whole                ``committed`` again (``restored``), unless
                                                its stream saved anything since
latest pointer on a lost/corrupt row            moved to the newest healthy committed row
temporary payload of ours, no row               removed
payload in our naming, no row                   moved to ``<root>/ckptdb.quarantine``
                                                (no rename: left in place, remembered)
object another writer took first (no rename)    untouched, remembered (``foreign`` event)
registered alias not naming its stream's latest re-pointed (``aliased``), after the commit;
                                                a stream with nothing committed: left as
                                                it is (``alias_left``)
anything else                                   untouched
=============================================  ===========================================

Payload work happens first and the ledger is updated afterwards in one
transaction, so a crash in the middle only leaves work that the next
reconcile redoes; a second run does nothing. Only names inside the save
directory are touched, symlinks never, and nothing unowned is deleted.
Registered aliases (:mod:`.aliases`) are names under the run root: each is
replaced atomically, never followed, and never where its directory leads out
of the root.
"""

from __future__ import annotations

import gc
import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import faults
from ..errors import InvalidArgumentError
from ..ledger import Ledger, pins
from ..ledger import models as m
from ..ledger import rows as ledger_rows
from ..ledger.follow import notify_commit
from ..ledger.scan import LiveRow, live_rows
from ..storage.base import LOST, Finding, PayloadStore
from ..storage.naming import is_own_name
from .absence import absent_directories
from .aliases import AliasKeeper
from .report import Action as Action
from .report import ReconcileReport as ReconcileReport

log = logging.getLogger("ckptdb.reconcile")  # the name users configure (kept across moves)

QUARANTINE_NAME = "ckptdb.quarantine"


@dataclass
class _Plan:
    """Row changes decided by the file phase, applied in one transaction."""

    state: dict[int, str] = field(default_factory=dict)
    errors: dict[int, str | None] = field(default_factory=dict)  # None: cleared
    #: ``lost`` rows whose file is back: their newest id by stream (the new latest)
    restored: dict[str, int] = field(default_factory=dict)


class Reconciler:
    def __init__(
        self,
        db: Ledger,
        run_id: int,
        attempt_id: int | None,
        root: Path,
        store: PayloadStore,
    ) -> None:
        self.db, self.run_id, self.attempt_id = db, run_id, attempt_id
        self.root, self.store = root, store
        self._pinned: set[int] = set()
        self._aborted: set[str] = set()  # (no rename) names of rolled-back rows
        self._disowned: set[str] = set()  # (no rename) names another writer took first

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
        with _cyclic_gc_paused():
            return self._run(verify=verify, dry_run=dry_run, progress=progress)

    def _run(
        self, *, verify: bool, dry_run: bool, progress: Callable[[int, int], None] | None
    ) -> ReconcileReport:
        report = ReconcileReport(dry_run=dry_run)
        with self.db.transaction(read=True) as session:
            rows = live_rows(session, self.run_id)
            streams = ledger_rows.stream_names(session, self.run_id)
            kept = ledger_rows.kept_on_disk(session, self.run_id)
            self._pinned = pins.live_pinned(session, self.run_id, m.utcnow())
            if not self.store.renames:
                kept |= ledger_rows.quarantined_in_place(session, self.run_id)
                self._disowned = ledger_rows.disowned_paths(session, self.run_id)
                kept |= self._disowned
                self._aborted = ledger_rows.paths_in_state(session, self.run_id, (m.ABORTED,))
        self._refuse_an_absent_store(rows)
        plan = _Plan()
        keep_paths: set[str] = set(kept)  # protected files stay where they are
        lost: list[LiveRow] = []
        with self.store.memoized():  # each stream directory is resolved once per pass
            for done, row in enumerate(rows, 1):
                if row.state == m.LOST:
                    lost.append(row)
                self._check_row(row, plan, report, keep_paths, verify=verify, dry_run=dry_run)
                if progress is not None:
                    progress(done, len(rows))
            if lost:
                self._restore(lost, rows, plan, report)
            self._scan(keep_paths, report, dry_run=dry_run)
        faults.point("mid_reconcile")
        chosen = None
        if not dry_run:
            self._apply(plan, report, streams)
        else:
            chosen = self._preview_pointers(plan, report, streams)
        self._rederive_aliases(report, dry_run, chosen)
        for failure in report.failures:
            warnings.warn(
                f"ckptdb reconcile could not repair {failure.path}: {failure.detail}", stacklevel=3
            )
        return report

    def _refuse_an_absent_store(self, rows: list[LiveRow]) -> None:
        """Refused before anything changes: committed checkpoints in a directory that
        is not there are storage not mounted, not checkpoints lost (see
        :mod:`~ckptdb.protocol.absence`)."""
        committed = [(row.stream, row.path) for row in rows if row.state == m.COMMITTED]
        refusal = absent_directories(self.store, committed, "No checkpoint was marked.")
        if refusal is not None:
            raise refusal

    def _check_row(
        self,
        row: LiveRow,
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
        if row.state == m.COMMITTED:  # nearly every row: one measurement each
            finding = self.store.verify(row.path, row.size, row.hash, full=verify)
            if finding is not None and self._unsure(finding):
                report.actions.append(Action("failed", row.path, finding.detail, row.id, row.step))
            elif finding is not None:
                plan.state[row.id] = finding.state
                plan.errors[row.id] = finding.detail
                report.actions.append(
                    Action(finding.state, row.path, finding.detail, row.id, row.step)
                )
        elif row.state == m.PENDING:
            doomed = list(dict.fromkeys([row.tmp_path, row.path]))  # one name without rename
            if not is_own_name(row.path) and row.tmp_path and self.store.exists(row.tmp_path):
                # a framework's name not yet placed onto: what is there is not ours
                doomed = [row.tmp_path]
            doomed = [p for p in doomed if p not in self._disowned]  # another writer's
            if self._remove(row, doomed, report, dry_run):
                plan.state[row.id] = m.ABORTED
                plan.errors[row.id] = row.error or "crashed before commit"
                report.actions.append(
                    Action("rolled_back", row.path, f"step {row.step}", row.id, row.step)
                )
        elif row.state == m.DELETING:
            if row.id in self._pinned:
                return  # a reader holds it: the file goes once the last pin is gone
            if self._remove(row, [row.path], report, dry_run):
                plan.state[row.id] = m.DELETED
                report.actions.append(
                    Action("deleted", row.path, "evicted by policy", row.id, row.step)
                )

    def _restore(
        self, lost: list[LiveRow], rows: list[LiveRow], plan: _Plan, report: ReconcileReport
    ) -> None:
        """``lost`` rows whose file is back, whole, become ``committed`` again.

        Why: a stream's directory missing for a while (moved and moved back, a
        mount late) made its rows ``lost`` for good, and ``latest`` stayed None
        with the checkpoints on disk. Only when nothing can have moved past them:
        no other live row of the stream is newer (no save since, committed or
        not), no live row names its path (a later save at the same step may
        reuse the name), and the file's size and hash are the ones committed
        (read in full). A store that cannot answer (an object store's error after
        retries) is reported as a failure, with the path, and the row stays
        ``lost``: as for a committed row, the open goes on.
        """
        newest: dict[str, int] = {}
        named: set[str] = set()
        for row in rows:
            if row.state != m.LOST:
                named.add(row.path)
                newest[row.stream] = max(newest.get(row.stream, -1), row.id)
        for row in lost:
            if newest.get(row.stream, -1) > row.id or row.path in named:
                continue
            try:
                if not self.store.exists(row.path):
                    continue
            except (OSError, InvalidArgumentError) as exc:
                detail = f"could not look for it again: {type(exc).__name__}: {exc}"
                report.actions.append(Action("failed", row.path, detail, row.id, row.step))
                continue
            if self.store.verify(row.path, row.size, row.hash, full=True) is not None:
                continue
            named.add(row.path)  # a second lost row of the same path stays lost
            plan.state[row.id], plan.errors[row.id] = m.COMMITTED, None
            plan.restored[row.stream] = max(plan.restored.get(row.stream, -1), row.id)
            detail = "its file is back, size and hash as committed"
            report.actions.append(Action("restored", row.path, detail, row.id, row.step))

    def _unsure(self, finding: Finding) -> bool:
        """An object that could not be read (a store error after retries) is not known to
        be lost: reported, the row left as it is. (A local file that cannot be read is
        lost: its bytes cannot be had.)"""
        return not self.store.renames and finding.state == LOST and not finding.missing

    def _remove(
        self, row: Any, paths: list[str | None], report: ReconcileReport, dry_run: bool
    ) -> bool:
        for rel in paths:
            if rel is None:
                continue
            try:
                if dry_run:
                    self.store.local_path(rel)  # refused all the same if it escapes
                else:
                    self.store.remove(rel)
            except (OSError, InvalidArgumentError) as exc:
                report.actions.append(Action("failed", rel, f"{type(exc).__name__}: {exc}", row.id))
                return False
        return True

    def _scan(self, keep: set[str], report: ReconcileReport, *, dry_run: bool) -> None:
        for found in self.store.list_ours():
            rel = found.rel
            if rel in keep:
                continue
            if found.role == "temp" or rel in self._aborted:
                detail = "no ledger row" if found.role == "temp" else "of a rolled-back row"
                self._act(
                    report, "removed_temp", rel, dry_run, lambda r=rel: self.store.remove(r), detail
                )
            elif not self.store.renames:  # no move: left in place, and remembered
                report.actions.append(
                    Action("quarantined", rel, "no ledger row; left in place", in_place=True)
                )
            else:
                quarantine = self.root / QUARANTINE_NAME / found.stream
                self._act(
                    report,
                    "quarantined",
                    rel,
                    dry_run,
                    lambda r=rel, q=quarantine: self.store.quarantine(r, q),
                )

    def _act(
        self,
        report: ReconcileReport,
        kind: str,
        rel: str,
        dry_run: bool,
        work: object,
        detail: str = "no ledger row",
    ) -> None:
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
            if plan.state:  # a rolled-back pending row unblocks followers waiting on it
                notify_commit(session, self.run_id)
            for row_id, state in plan.state.items():
                extra: dict[str, object] = {}
                if row_id in plan.errors:
                    extra["error"] = plan.errors[row_id]
                if state == m.DELETED:  # keep the eviction time a commit recorded
                    ledger_rows.mark_deleted(session, [row_id], now, **extra)
                else:
                    ledger_rows.set_state(session, [row_id], state, **extra)
            pins.clear_stale(session, self.run_id, now)
            for stream in streams:
                old, new = ledger_rows.repoint_latest(session, self.run_id, stream)
                if old != new:
                    report.actions.append(
                        Action("repointed", f"latest:{stream}", f"{old} -> {new}", new)
                    )
            self._record(session, report.actions)
        _log(report.actions)

    def _record(self, session: Any, actions: list[Action]) -> None:
        """One event per action, in the caller's transaction."""
        for action in actions:
            ledger_rows.add_event(
                session,
                self.run_id,
                self.attempt_id,
                action.kind,
                checkpoint_id=action.checkpoint_id,
                step=action.step,
                detail=_event_detail(action),
            )

    def _preview_pointers(
        self, plan: _Plan, report: ReconcileReport, streams: list[str]
    ) -> dict[str, int | None]:
        """The dry run's pointer moves; returns where each ``latest`` would point."""
        chosen: dict[str, int | None] = {}
        with self.db.transaction(read=True) as session:
            for stream in streams:
                pointer = ledger_rows.latest_row(session, self.run_id, stream)
                new = plan.restored.get(stream) or ledger_rows.newest_committed_id(
                    session, self.run_id, stream, excluding=plan.state
                )
                chosen[stream] = new
                old = pointer.id if pointer is not None else None
                if old != new:
                    report.actions.append(
                        Action("repointed", f"latest:{stream}", f"{old} -> {new}")
                    )
        return chosen

    def _rederive_aliases(
        self, report: ReconcileReport, dry_run: bool, chosen: dict[str, int | None] | None
    ) -> None:
        """After the pointers are repaired (and committed): every registered alias
        names the latest of its stream again (:mod:`.aliases`), one event per action."""
        keeper = AliasKeeper(self.db, self.run_id, self.root, self.store.location)
        actions = keeper.rederive(dry_run=dry_run, chosen=chosen)
        report.actions.extend(actions)
        if actions and not dry_run:
            with self.db.transaction() as session:
                self._record(session, actions)
            _log(actions)


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """No cyclic garbage collection during one pass (restored after, as it was).

    A pass over 100k rows allocates a few hundred thousand small objects, which
    triggers full collections, and each one walks every object of the process
    (torch's and SQLAlchemy's too): about a third of an open with 100k
    checkpoints. Reference counting still frees everything as usual."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _log(actions: list[Action]) -> None:
    for action in actions:
        log.info("ckptdb reconcile: %s", action)


def _event_detail(action: Action) -> dict[str, object]:
    detail: dict[str, object] = {"path": action.path, "detail": action.detail, "reconcile": True}
    if action.in_place:
        detail["in_place"] = True
    return detail
