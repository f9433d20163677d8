"""The save phases: how one boundary becomes a published checkpoint.

A **boundary** is the point in training where the manager saves one or more
streams' checkpoints and commits them in one ledger transaction: one call of
``CheckpointManager.save`` (or of a preemption's save). Every kind of save runs
the same six phases, in this order, through this module's ``Publisher``:

- a blocking save in one process, where every agreement between ranks is the
  local outcome itself and errors propagate as themselves;
- a save under ``torch.distributed``, where every rank runs the phases and the
  ranks agree at fixed points (``preflight``, ``plan``, ``wrote``, ``write``,
  ``outcome``), so a checkpoint is published on every rank or on none, and
  every rank raises the same error;
- an asynchronous save (``save(blocking=False)``), which runs phases 1 and 2
  and a snapshot of the payloads to host memory during the call (agreed as
  ``snapshot``), and phases 3 to 6 on a background thread with the same code
  (``ckptdb.protocol.asyncsave``).

The ledger alone says what is published: a checkpoint exists for ``latest``,
the top-K, ``load`` and every reader once its row is ``committed``, and not
before; ckptdb never takes the newest checkpoint from file names, links or
file times. The chief (rank 0; the only process in a single-process run) runs
the ledger's work: the intent, the placing, the commit and the clean-up.

1. **Preflight** (every rank; ``ckptdb.protocol.preflight``). The input is
    checked first: the step, the stream names, the metrics (a ranking metric
    present, names and numbers the ledger can hold), ``blocking``, and the
    payloads (an ``External`` payload is refused with ``blocking=False``, two
    streams cannot publish one name). Then the guard is read, once (one host
    sync); then a non-finite ranking metric is refused. The first check that
    objects decides, and the ranks agree on the verdict (``preflight``). A
    guard trip records a ``guard_tripped`` event and raises
    ``NonFiniteGradientError``. Bad input records nothing, not even the
    boundary's metrics, and leaves the guard as it was; any other refusal
    keeps the metrics (buffered, written with the next commit: a NaN loss at
    a diverged step is history too). Every boundary that read the guard
    resets it, whatever happens next. An error of an earlier asynchronous
    save that nobody fetched takes precedence: it is raised here, and this
    boundary does not run.

    *A crash here* leaves nothing in the ledger or the store.

    *Why first*: a boundary that will be refused costs nothing and writes
    nothing. Bad input comes before the guard, so a typo never resets it; the
    guard comes before the ranking metric, because a tripped guard is the
    cause of a NaN validation loss, and the more useful error.

2. **Intent** (the chief). The writer lock is verified (taken back if only
    its session ended), a boundary whose commit's answer was lost is settled
    (phase 5), and one short transaction then checks the fence (a writer
    that another writer's open fenced off records nothing, ever again:
    ``WriterLockLostError``), decides top-K admission (a candidate that would
    not enter its stream's top-K is dropped, never written), refuses a save
    directory or stream directory that vanished while the ledger records
    committed checkpoints in it, creates the directories the payloads go into
    (durably), and inserts one ``pending`` row per admitted stream with its
    metrics, its final name and its temporary name. A final name in ckptdb's naming
    (``<stream>/step-000000100.pt``) that a live row or a file already holds
    gets a versioned one (``step-000000100.v42.pt``); a store without rename
    (object storage) gets a name unique to the row, the temporary name equal
    to the final one; an ``External`` payload keeps the framework's name,
    refused if anything exists there, and gets a hidden temporary name beside
    it (``.<name>.ckptdb-tmp-<row id>``). Every rank learns the plan
    (``plan``). When no stream is admitted, the boundary ends here and
    returns no checkpoint.

    *A crash here* leaves ``pending`` rows (and possibly empty temporary
    directories). The next open's reconcile removes whatever they name and
    marks them ``aborted``. The intent commits without an fsync of the ledger
    (SQLite ``synchronous=NORMAL``): a power cut may lose it, and then any
    file it named has no row: a temporary of ckptdb's is removed, a file in
    ckptdb's naming is moved into the quarantine (never deleted), a file
    under a framework's name is left alone.

    *Why before any byte is written*: every payload the boundary writes is
    named by a row first, so a crash at any later point leaves a row that
    says what to remove, and reconcile never guesses. Admission is decided
    here, against the committed members, so a rejected candidate costs no
    write.

3. **Write** (payloads written by every rank, then the chief's). Each payload
    goes to its temporary name through the payload store and its kind: a
    ``Sharded`` payload by every rank inside ``torch.distributed.checkpoint``,
    an ``External`` one by its writer on every rank, then, on the chief, a
    ``torch.save`` file streamed into the store, hashed (xxh3-128) and counted
    as it is written. Where a framework's writer may return on one rank while
    another still writes, the ranks first agree that every part is written
    (``wrote``). Each payload is then sealed: made durable (``fsync``, every
    file and directory of a tree included) and measured. The ranks agree on
    the outcome (``write``). A blocking save with a deadline (a preemption's
    grace period) that has passed by now is rolled back here (phase
    ``deadline``) rather than cut short during its commit.

    *A crash here* leaves ``pending`` rows and partial temporaries, which the
    next reconcile removes. Nothing is visible under a final name. An fsync
    error fails the boundary; it is never retried into a success.

    *Why before the placing*: only complete, durable bytes get a final name,
    and the row records the size and hash of what is on disk.

4. **Place** (the chief). Each temporary is moved onto its final name
    atomically (``os.replace``, never delete-then-rename; a store without
    rename moves nothing) and the directories are fsynced. Something that
    appeared at an ``External`` payload's name since the intent is not
    published over (phase ``replace``).

    *A crash here* leaves ``pending`` rows whose payloads may sit at their
    final names: reconcile removes them by their rows and marks the rows
    ``aborted``. Nothing reads them as checkpoints meanwhile, since no row
    publishes them. A live checkpoint is never overwritten: a step saved
    again got a versioned name at the intent.

    *Why before the commit*: a committed row always names a payload that is
    already at its final name, durably.

5. **Commit** (the chief; the single commit point). The writer lock is
    verified again, and one transaction, fsynced (SQLite
    ``synchronous=FULL``), checks the fence (the check that counts), turns
    the rows ``committed`` with their sizes and hashes, applies each stream's
    retention (evicted rows become ``deleting``; saving a step at or before a
    ``Keep`` stream's newest evicts its checkpoints from that step on, the
    timeline rule;
    a row protected as the one this attempt resumed from becomes ``deleted``
    at once, its file kept), moves the latest pointers, writes the buffered
    metrics and wakes followers (PostgreSQL ``NOTIFY``). An evicted row that
    a reader has pinned, or whose copy to a registered remote tier is not
    whole yet, stays ``deleting`` with its file until no pin holds it; rows
    held back this way whose pins are gone are removed with this commit's
    evictions. The rest is queued
    behind the COMMIT (``ckptdb.ledger.after_commit``): it runs once COMMIT
    returned, never after a rollback. The other ranks then learn the
    outcome (``outcome``).

    *A crash here*, before COMMIT returns, is a crash in phase 4: all of the
    boundary's rows are committed, or none is. After it, the boundary is
    published and the evicted rows are ``deleting`` with their files, which
    reconcile removes. A COMMIT whose answer was lost (the connection
    dropped after it was sent) raises ``CommitOutcomeUnknownError``: the
    files are kept, and the boundary is settled by reading its rows back
    once the ledger answers (the next boundary's intent, the close, or the
    next open's reconcile): committed, it stands; still pending, it is
    rolled back.

    *Why one transaction*: every stream of the boundary, its retention, its
    pointers and its metrics change together, so ``latest``, the top-K and
    retention always describe payloads that are complete on disk.

6. **Clean up** (the chief, after the commit and after the other ranks were
    told). Evicted payloads are removed through the store, then their rows
    marked ``deleted`` (without an fsync of the ledger). An error in an
    earlier post-commit step does not skip this one; an interrupt (Ctrl-C)
    does.

    *A crash here*, or a removal that fails, leaves rows ``deleting``: a
    failure records a ``cleanup_failed`` event and emits a ``CleanupWarning``
    naming the file, and the next reconcile retries. It never fails the
    save, and never undoes the commit.

    *Why last*: a payload is removed only once the commit that evicted it is
    durable, so a crash never leaves a run without the checkpoints its
    ledger publishes.

**A failure in phases 2 to 5** rolls the boundary back
(``ckptdb.protocol.disposal``): the temporaries are removed, and a final name
only if this boundary placed it (before that, whatever is there is not
ckptdb's); the rows become ``aborted`` with the error, and a
``publish_failed`` event is recorded; pointers, the top-K and committed rows
are exactly as before. The error is a ``PublishError`` naming the phase, the
path and the stream (``LedgerUnavailableError``, a ``PublishError`` too, when
the ledger could not be reached: training can go on, the next boundary tries
again). A payload the intent refuses (a framework's name already taken, a
kind the store cannot hold) is bad input (``InvalidArgumentError``): nothing
is recorded, not even the metrics. If a removal fails too, the error lists
it in ``cleanup_failures``, a ``CleanupWarning`` is emitted and the row stays
``pending`` for the next reconcile. An interrupt is rolled back the same way
and then propagates as itself. Under ``torch.distributed`` a broken group
(``RankAgreementError``) propagates as itself, and the chief rolls back what
the boundary recorded. Nothing that fails
after COMMIT returned undoes it.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from .. import faults
from ..coord.base import Coordinator, Objection, attach_rollback
from ..errors import (
    CkptDBError,
    CommitOutcomeUnknownError,
    DatabaseError,
    InvalidArgumentError,
    LedgerUnavailableError,
    NonFiniteGradientError,
    ObjectStoreError,
    PhaseError,
    PhaseFailure,
    PublishError,
    RankAgreementError,
    RunDirectoryError,
    WriterLockLostError,
)
from ..guard import NonFiniteGradGuard
from ..ledger import after_commit, boundary_rows, pins, tiers
from ..ledger import models as m
from ..ledger import rows as ledger_rows
from ..ledger.engine import driver_message, is_unreachable, one_line, unreachable
from ..ledger.follow import notify_commit
from ..policies import Entry
from ..record import Checkpoint
from ..storage import topology
from ..storage.external import External, temp_for
from ..storage.kinds import PayloadKind, kind_named, kind_of
from ..storage.naming import checkpoint_name, object_name, temp_name
from . import disposal
from .absence import absent_directories, in_streams_directory
from .asyncsave import BackgroundWriter, InFlight, SaveHandle, Snapshotter, finished
from .context import RunContext
from .inputs import validate_step
from .preflight import Preflight
from .share import PlanItem, Share

log = logging.getLogger("ckptdb.boundary")

NAME_TRIES = 8  # salted names tried on a store without rename (one clash is already rare)


@dataclass
class _Progress:
    """How far the commit got: once ``committed``, nothing may roll the boundary back."""

    committed: bool = False
    commit_sent: bool = False  # COMMIT was on its way: a lost answer leaves it unknown
    flushed: int = 0  # buffered metric points the commit transaction inserted
    evicted: list[Any] = field(default_factory=list)
    records: dict[str, Checkpoint] = field(default_factory=dict)


@dataclass
class _Unsettled:
    """A boundary whose COMMIT's answer was lost: settled once the ledger answers."""

    step: int
    shares: list[Share]
    progress: _Progress


class Publisher:
    """Runs the boundaries of one open run (see the module docstring)."""

    def __init__(
        self,
        ctx: RunContext,
        coord: Coordinator,
        guard: NonFiniteGradGuard | None,
        writer: BackgroundWriter,
        snapshots: Snapshotter,
        inflight: InFlight,
    ) -> None:
        self.ctx, self.coord, self.guard = ctx, coord, guard
        self.unsettled: list[_Unsettled] = []
        self.writer, self.snapshots, self.inflight = writer, snapshots, inflight

    # ------------------------------------------------------------ the machine

    def save(
        self,
        step: object,
        metrics: object,
        payloads: dict[str, Any],
        blocking: object,
        deadline: float | None = None,
    ) -> dict[str, Checkpoint] | SaveHandle:
        """One boundary. ``deadline`` (``time.time()``; a blocking save only): a boundary
        still before its commit when it passes is rolled back (phase ``deadline``)."""
        previous, unfetched = self.inflight.settle()
        reset_guard = False  # a typo, or a boundary that never ran, keeps the guard
        shares: list[Share] = []
        rolls_back_itself = False
        try:
            verdict = Preflight(self.ctx.policies, self.guard).verdict(
                step, metrics, payloads, blocking
            )
            try:
                objection = self.coord.preflight(verdict, previous, unfetched)
            except RankAgreementError:
                reset_guard = True  # the guard was read; the boundary ran into a broken group
                raise
            reset_guard = objection is None or objection.stage != 0
            plan = self.coord.shared(
                "plan",
                lambda: self._plan(step, verdict.values, payloads, objection, shares),
                fallback="PublishError",
            )
            if plan is None:
                assert objection is not None
                objection.raise_()
            at = validate_step(step)
            if blocking is False:
                return self._launch(at, verdict.values, shares, plan, payloads)
            if not plan:
                return {}  # no top-K stream admitted the candidate, on any rank
            if not self.coord.is_chief:
                return self._follow(self.coord, plan, payloads)
            rolls_back_itself = True
            return self._finish(self.coord, at, verdict.values, shares, deadline=deadline)
        except RankAgreementError as broken:  # the group broke between intent and write
            if shares and not rolls_back_itself:
                at = validate_step(step)
                attach_rollback(broken, functools.partial(self._roll_back, at, shares, broken))
            raise
        finally:
            if reset_guard and self.guard is not None:
                self.guard.reset()

    # ------------------------------------------------------------ 2. intent

    def _plan(
        self,
        step: object,
        values: dict[str, float],
        payloads: dict[str, Any],
        objection: Objection | None,
        shares: list[Share],
    ) -> list[PlanItem] | None:
        """The chief's answer to the preflight: None (stop) or the admitted streams.

        Bad input records nothing, not even the metrics. Any other objection
        keeps the boundary's metrics (a NaN loss at a diverged step is history
        too) and a guard trip is recorded as an event.
        """
        if objection is not None and objection.stage == 0:
            return None
        at = validate_step(step)
        if objection is not None:
            self.ctx.metrics.add(at, values)
            self._record_objection(objection)
            return None
        try:
            shares.extend(self._intent(at, values, payloads))
        except InvalidArgumentError:
            raise  # a name that cannot be published is bad input: nothing is recorded
        except BaseException:
            self.ctx.metrics.add(at, values)
            raise
        self.ctx.metrics.add(at, values)
        return [PlanItem(s.stream, s.tmp, s.kind.name) for s in shares]

    def _record_objection(self, objection: Objection) -> None:
        error = objection.error
        if isinstance(error, NonFiniteGradientError):
            detail: dict[str, object] = {"parameters": error.parameters} if error.parameters else {}
            if error.ranks is not None:
                detail["ranks"] = error.ranks
            self.ctx.event("guard_tripped", step=error.step, detail=detail or None)

    def _intent(
        self, step: int, values: dict[str, float], payloads: Mapping[str, Any]
    ) -> list[Share]:
        """One transaction: decide top-K admission, insert a pending row per admitted stream.

        The writer lock is checked first (and taken back if only its session ended),
        then the fence: a writer another one fenced off records nothing more."""
        try:
            assert self.ctx.lock is not None
            self.ctx.lock.verify()
            self.settle()  # a boundary whose COMMIT's answer was lost, decided first
            with self.ctx.ledger.transaction(durable=False) as session:
                self._check_fence(session, lock=False)
                admitted = self._admitted(session, step, values, payloads)
                self._refuse_vanished_directories(session, step, admitted)
                for stream, payload in admitted.items():
                    if isinstance(payload, External):  # under the framework's own name
                        self._check_free(session, stream, payload.name)
                        self.ctx.store.prepare_parent(payload.name)
                    else:
                        self.ctx.store.prepare_stream(stream)
                return self._intent_rows(session, step, values, admitted)
        except PhaseError as exc:
            raise PublishError(
                f"step {step}: could not create {exc.path}: {exc.error}",
                phase="intent",
                step=step,
                path=exc.path,
            ) from exc.error
        except DatabaseError as exc:
            cause = exc.original or exc
            if is_unreachable(exc):
                raise LedgerUnavailableError(
                    f"step {step} not published: {unreachable(self.ctx.ledger.safe_url, exc)}",
                    phase="intent",
                    step=step,
                ) from cause
            raise PublishError(
                f"step {step}: could not record the intent in the ledger: {driver_message(cause)}",
                phase="intent",
                step=step,
            ) from cause
        except ObjectStoreError as exc:  # a name could not be checked in the store
            raise PublishError(
                f"step {step}: could not check the names to write: {exc}", phase="intent", step=step
            ) from exc

    def _refuse_vanished_directories(
        self, session: Any, step: int, admitted: Mapping[str, Any]
    ) -> None:
        """The save directory, or the directory of a stream this boundary writes into,
        gone under the running job (unmounted, moved) while the ledger records
        committed checkpoints in it, is not made again (see
        :mod:`~ckptdb.protocol.absence`). Checked for every stream before any
        directory is made; one ``stat`` per stream, and the ledger is read only
        when one is missing."""
        store = self.ctx.store
        streams = [
            stream
            for stream, payload in admitted.items()
            if not isinstance(payload, External) or in_streams_directory(stream, payload.name)
        ]
        try:
            if not store.absent() and not any(store.absent(s) for s in streams):
                return
            committed = boundary_rows.committed_paths(session, self.ctx.run_id)
            refusal = absent_directories(store, committed, "Nothing was saved.", streams)
        except RunDirectoryError as exc:  # a directory that cannot be looked at
            refusal = exc
        if refusal is not None:
            raise PublishError(
                f"step {step}: {refusal}", phase="intent", step=step, path=store.location
            ) from refusal

    def _admitted(
        self, session: Any, step: int, values: dict[str, float], payloads: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The payloads worth writing: a ranked stream's candidate that would not enter
        its top-K is dropped (the policy decides from the stream's members)."""
        admitted = dict(payloads)
        for stream in payloads:
            policy = self.ctx.policies[stream]
            metric = policy.ranking_metric
            if metric is None or policy.writes_every_candidate:
                continue  # every candidate is written: no members to read
            members = boundary_rows.committed_members(session, self.ctx.run_id, stream)
            if not policy.admits(
                boundary_rows.entries(members), Entry(id=-1, step=step, metric=values[metric])
            ):
                del admitted[stream]
        return admitted

    def _intent_rows(
        self, session: Any, step: int, values: dict[str, float], admitted: Mapping[str, Any]
    ) -> list[Share]:
        """The admitted streams' ``pending`` rows and names: one insert for all of them,
        one read of the names already taken, one update recording the names."""
        ctx, store = self.ctx, self.ctx.store
        kinds = {stream: self._kind(stream, payload) for stream, payload in admitted.items()}
        metric_of = {stream: self._ranking_value(stream, values) for stream in admitted}
        topology_of = {stream: topology.describe(payload) for stream, payload in admitted.items()}
        ids = boundary_rows.add_pending(
            session,
            ctx.run_id,
            ctx.attempt_id,
            step,
            values,
            metric_of,
            ctx.world_size,
            topology_of,
            ctx.progress.blocked(),
        )
        own = [s for s, p in admitted.items() if not isinstance(p, External)]
        taken = boundary_rows.live_paths(session, ctx.run_id, step, own) if store.renames else set()
        shares = []
        for stream, payload in admitted.items():
            kind, row_id = kinds[stream], ids[stream]
            if isinstance(payload, External):
                rel, tmp = self._external_names(payload.name, row_id)
            else:
                rel, tmp = self._own_names(taken, stream, step, kind.suffix, row_id)
            if kind.temp_dir_first:  # made here, before any rank enters the collective write
                store.make_temp_dir(tmp)
            shares.append(Share(stream, kind, payload, row_id, rel, tmp, metric_of[stream]))
        boundary_rows.set_paths(session, [(s.row_id, s.final, s.tmp) for s in shares])
        return shares

    def _kind(self, stream: str, payload: Any) -> PayloadKind:
        kind = kind_of(payload)
        if kind.name not in self.ctx.store.kinds:
            raise InvalidArgumentError(
                f"stream {stream!r}: a {kind.name!r} payload cannot be saved to "
                f"{self.ctx.save_dir} (this store holds {sorted(self.ctx.store.kinds)} payloads)"
            )
        return kind

    def _ranking_value(self, stream: str, values: dict[str, float]) -> float | None:
        metric_name = self.ctx.policies[stream].ranking_metric
        return values.get(metric_name) if metric_name is not None else None

    def _own_names(
        self, taken: set[str], stream: str, step: int, suffix: str, row_id: int
    ) -> tuple[str, str]:
        """Final and temporary name in ckptdb's naming (versioned if the name is taken:
        by a live row, in ``taken``, or by an object in the store)."""
        if not self.ctx.store.renames:
            return self._unique_name(stream, step, suffix, row_id)
        name = checkpoint_name(step, suffix=suffix)
        rel = f"{stream}/{name}"
        if rel in taken or self.ctx.store.exists(rel):
            name = checkpoint_name(step, version=row_id, suffix=suffix)
            rel = f"{stream}/{name}"
        return rel, f"{stream}/{temp_name(name, row_id)}"

    def _unique_name(self, stream: str, step: int, suffix: str, row_id: int) -> tuple[str, str]:
        """A store without rename writes in place, under a name no other row uses: the
        run's token and the row id are in it, and the temporary name is the final
        one. Should it exist all the same (a row id reused after an intent that
        never reached the disk, its object left behind), a random salt makes
        another: a name clash is never a reason to fail a save."""
        store = self.ctx.store
        if store.run_token is None:
            raise InvalidArgumentError(
                f"{store.location}: no run token (the store is not a writer's)"
            )
        salt = ""
        for _ in range(NAME_TRIES):
            rel = f"{stream}/{object_name(step, store.run_token, row_id, suffix, salt)}"
            if not store.exists(rel):
                return rel, rel
            salt = secrets.token_hex(4)
        raise ObjectStoreError(
            f"stream {stream!r}: {NAME_TRIES} names for step {step} in {store.location} all exist"
        )

    def _check_free(self, session: Any, stream: str, name: str) -> None:
        """A framework's name is used as given, never versioned by us and never
        published over something that exists (a live checkpoint, or a file
        that may be the user's): that is bad input, and the intent is undone."""
        owner = ledger_rows.path_in_use(session, self.ctx.run_id, name)
        if owner or self.ctx.store.exists(name):
            held = "a live checkpoint of this run" if owner else "a file ckptdb does not own"
            raise InvalidArgumentError(
                f"stream {stream!r}: {name!r} already exists in {self.ctx.save_dir} "
                f"({held}); ckptdb never publishes over an existing name"
            )

    def _external_names(self, name: str, row_id: int) -> tuple[str, str]:
        """The framework's name, and a temporary path that surely does not exist:
        a leftover under that name (ckptdb's own, e.g. from a ledger that was
        recreated, or a link planted there) is removed, never written through."""
        tmp = temp_for(name, row_id)
        self.ctx.store.remove(tmp)
        return name, tmp

    # ------------------------------------------------------ asynchronous launch

    def _launch(
        self,
        step: int,
        values: dict[str, float],
        shares: list[Share],
        plan: list[PlanItem],
        payloads: Mapping[str, Any],
    ) -> SaveHandle:
        """Snapshot now (and agree on it), then phases 3-6 in the background."""
        if not plan:
            return finished(step, {})
        mine = self._snapshot(step, shares, plan, payloads)
        coord = self.coord.background(self.writer.rank_group)
        limit = len(self.ctx.metrics)  # this boundary's metrics; later ones wait for a flush

        def work() -> dict[str, Checkpoint]:
            if coord.is_chief:
                return self._finish(coord, step, values, shares, limit)
            return self._follow(coord, plan, mine)

        handle = self.writer.submit(step, work)
        self.inflight.start(handle, frozenset(i.stream for i in plan))
        return handle

    def _snapshot(
        self, step: int, shares: list[Share], plan: list[PlanItem], payloads: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Copy what this rank writes to host memory; a failure anywhere rolls back.

        The chief copies every admitted payload; other ranks only those every
        rank writes. Returns this rank's copies by stream.
        """
        local: BaseException | None = None
        mine: dict[str, Any] = {}
        try:
            if self.coord.is_chief:
                for s in shares:
                    s.payload = self.snapshots.snapshot(s.stream, s.payload, s.kind)
            else:
                for item in plan:
                    kind = kind_named(item.kind)
                    if kind.every_rank_writes:
                        mine[item.stream] = self.snapshots.snapshot(
                            item.stream, payloads[item.stream], kind
                        )
        except Exception as exc:
            local = exc
        except BaseException as exc:  # Ctrl-C stays Ctrl-C, after the rollback
            if self.coord.is_chief:
                self._roll_back(step, shares, exc)
            raise
        failure = self.coord.failure("snapshot", local)
        if failure is not None:
            self.coord.abandon(failure, local, self._rollback_of(step, shares, "snapshot", failure))
        return mine

    def _rollback_of(self, step: int, shares: list[Share], phase: str, error: BaseException) -> Any:
        if not self.coord.is_chief:
            return None
        return lambda: self._roll_back(step, shares, PhaseFailure(phase, error))

    # ------------------------------------------------------ 3-6 on the chief

    def _finish(
        self,
        coord: Coordinator,
        step: int,
        values: dict[str, float],
        shares: list[Share],
        metric_limit: int | None = None,
        *,
        deadline: float | None = None,
    ) -> dict[str, Checkpoint]:
        """Write, place, commit, clean up: everything after the intent, on the chief.
        Past ``deadline`` before the placing, the boundary is rolled back instead."""
        progress = _Progress()

        def announce(committed_at: dt.datetime) -> None:
            """Tell the other ranks, before the clean-up (queued behind it) runs."""
            progress.records = {
                s.stream: self._record(s, step, values, committed_at) for s in shares
            }
            coord.committed(progress.records)

        try:
            coord.written(self._write_here(coord, shares))
            _check_deadline(deadline)
            self._place(shares)
            self._commit(step, shares, metric_limit, progress, announce)
        except RankAgreementError as broken:  # the group is broken: roll back, share nothing
            if not progress.committed:
                attach_rollback(broken, functools.partial(self._roll_back, step, shares, broken))
            raise
        except BaseException as exc:
            if progress.committed:
                raise  # an error after COMMIT never undoes it
            if progress.commit_sent and is_unreachable(exc):
                unknown = self._unknown_outcome(step, shares, progress, exc)
                coord.rolled_back(unknown, exc)
                raise unknown from exc
            try:
                self._roll_back(step, shares, exc)
            except Exception as failed:  # the PublishError, or the rollback's own failure
                coord.rolled_back(failed, exc)
                raise
            raise  # an interrupt: rolled back (other ranks time out)
        return progress.records

    def _unknown_outcome(
        self, step: int, shares: list[Share], progress: _Progress, exc: BaseException
    ) -> CommitOutcomeUnknownError:
        """A COMMIT whose answer was lost: nothing is removed (its files may be a
        committed checkpoint's); it is remembered, to be settled by reading the
        ledger back once it answers (:meth:`settle`)."""
        self.unsettled.append(_Unsettled(step, shares, progress))
        cause = exc.error if isinstance(exc, PhaseFailure) else exc
        cause = getattr(cause, "original", None) or cause  # a DatabaseError's driver error
        return CommitOutcomeUnknownError(
            f"step {step}: the ledger stopped answering during its commit "
            f"({one_line(cause)}), so whether it is published is not known yet; its files "
            "are kept, and it is settled when the ledger answers again (the next "
            "checkpoint, the close, or the next open's reconcile); training can go on",
            phase="commit",
            step=step,
        )

    def settle(self) -> None:
        """Decide each boundary whose COMMIT's answer was lost, by reading its rows back:
        committed, it stands (its evictions are cleaned up, its metrics are not
        written again); still pending, it is rolled back now. Raises the ledger's
        error while it cannot be read (the next call tries again)."""
        ctx = self.ctx
        while self.unsettled:
            found = self.unsettled[0]
            ids = [s.row_id for s in found.shares]
            with ctx.ledger.transaction(read=True) as session:
                states = boundary_rows.states_of(session, ids)
            if all(states.get(i) == m.COMMITTED for i in ids):
                ctx.metrics.drop(found.progress.flushed)
                self.unsettled.pop(0)
                log.warning("ckptdb: step %d was committed after all", found.step)
                ctx.event("commit_settled", step=found.step, detail={"committed": True})
                self.clean_up(found.step, found.progress.evicted)
                continue
            self.unsettled.pop(0)
            lost = ConnectionError("the ledger stopped answering during the COMMIT")
            try:
                self._roll_back(found.step, found.shares, PhaseFailure("commit", lost))
            except PublishError as report:  # the rollback's own report: said, not raised
                log.warning("ckptdb: settled as not committed, rolled back: %s", report)

    def _write_here(self, coord: Coordinator, shares: list[Share]) -> BaseException | None:
        """Phase 3 on the chief; its error is returned for the ``write`` agreement.

        Payloads every rank writes come first, with every rank inside the
        collective write: nothing fallible runs before them, so no rank waits
        there for a chief that failed early. Then every rank reports that its
        part is written (``wrote``), before anything is sealed: a framework's
        saver may return on the chief while another rank is still writing.
        """
        local: BaseException | None = None
        try:
            for s in shares:
                if s.kind.every_rank_writes:
                    s.written = s.kind.write(self.ctx.store, s.payload, s.tmp, coord.group)
        except (Exception, CheckpointException) as exc:
            local = exc
        if any(s.kind.agree_written for s in shares):
            local = coord.failure("wrote", local)
        if local is not None:
            return local
        try:
            faults.point("after_intent")
            for s in sorted(shares, key=lambda s: not s.kind.every_rank_writes):
                if not s.kind.every_rank_writes:
                    s.written = s.kind.write(self.ctx.store, s.payload, s.tmp, coord.group)
                s.info = s.kind.seal(self.ctx.store, s.tmp, s.written)
            faults.point("after_fsync")
        except (Exception, CheckpointException) as exc:
            return exc
        return None

    def _follow(
        self, coord: Coordinator, plan: list[PlanItem], payloads: Mapping[str, Any]
    ) -> dict[str, Checkpoint]:
        """Phases 3-6 on a rank other than the chief: write its part, learn the outcome."""
        local: BaseException | None = None
        kinds = [kind_named(item.kind) for item in plan]
        try:
            for item, kind in zip(plan, kinds, strict=True):
                if kind.every_rank_writes:
                    kind.write(self.ctx.store, payloads[item.stream], item.tmp, coord.group)
        except (Exception, CheckpointException) as exc:
            local = exc
        if any(kind.agree_written for kind in kinds):
            coord.failure("wrote", local)  # the chief seals only after this
        return coord.outcome(local)

    def _place(self, shares: list[Share]) -> None:
        store = self.ctx.store
        for s in shares:
            if isinstance(s.payload, External) and store.exists(s.final):
                raise PhaseError(
                    "replace",
                    store.location / s.final,
                    FileExistsError(17, "appeared after the intent; not published over"),
                )
            store.place(s.tmp, s.final)
            s.placed = True
        faults.point("after_replace")
        store.sync_placed([s.final for s in shares])
        faults.point("after_fsync_dir")

    def _commit(
        self,
        step: int,
        shares: list[Share],
        metric_limit: int | None,
        progress: _Progress,
        announce: Callable[[dt.datetime], None],
    ) -> None:
        """Phase 5, the single commit point. Queued behind its COMMIT: the outcome is
        announced (to the other ranks), then phase 6 removes what retention evicted."""
        assert self.ctx.lock is not None
        self.ctx.lock.verify()  # a PostgreSQL lock session may have died with its connection
        now = m.utcnow()
        ctx = self.ctx
        try:
            with ctx.ledger.transaction() as session:
                self._check_fence(session, lock=True)
                written = [(s.row_id, s.info.size, s.info.hash) for s in shares if s.info]
                assert len(written) == len(shares), "every share was sealed"
                boundary_rows.mark_committed(session, written, now)
                doomed = [r for s in shares for r in self._retention(session, s, step)]
                progress.evicted.extend(self._evict(session, doomed))
                latest = [(s.stream, s.row_id) for s in shares]
                boundary_rows.point_latest(session, ctx.run_id, latest)
                progress.evicted.extend(self.unpinned(session, progress.evicted))
                flushed = ctx.metrics.insert_into(session, ctx.run_id, ctx.attempt_id, metric_limit)
                progress.flushed = flushed
                notify_commit(session, ctx.run_id)  # delivered to followers once COMMIT returns

                def committed() -> None:
                    progress.committed = True
                    ctx.metrics.drop(flushed)

                after_commit(session, committed)
                after_commit(session, lambda: faults.point("after_commit"))
                after_commit(session, lambda: announce(now))
                after_commit(session, lambda: self.clean_up(step, progress.evicted))
                # last statement before COMMIT: a failure here finds the work queued,
                # and must leave it unrun (the rows are still pending, nothing evicted)
                faults.point("in_commit")
                progress.commit_sent = True  # from here on, a lost connection is no answer
        except CkptDBError:
            raise
        except Exception as exc:  # whatever it is, it failed the commit phase
            if progress.committed:
                raise
            raise PhaseFailure("commit", exc) from exc

    def _check_fence(self, session: Any, *, lock: bool) -> None:
        """Write only while this writer's attempt is the run's newest: a writer whose
        lock session ended, and that took the lock back after another writer had
        opened the run (and maybe closed it again), stops here, for good. The
        commit's check (``lock``) is the one that counts; the intent's keeps a
        fenced writer from recording even a pending row."""
        ctx = self.ctx
        newest = boundary_rows.newest_attempt(session, ctx.run_id, lock=lock)
        if newest == ctx.attempt_id:
            return
        assert ctx.lock is not None
        ctx.lock.give_up(
            f"lost the writer lock of run {ctx.root}: another writer opened it (attempt "
            f"{newest}) after this one (attempt {ctx.attempt_id}); this manager never "
            "commits again: close it"
        )
        raise WriterLockLostError(ctx.lock.lost)

    def _retention(self, session: Any, s: Share, step: int) -> list[boundary_rows.Member]:
        """The committed rows of ``s``'s stream its policy evicts now that ``s`` commits."""
        policy = self.ctx.policies[s.stream]
        # only the rows the policy could evict are read (keep-all: what the new step
        # supersedes; Keep(last, every): not the kept multiples), whatever the history
        found = boundary_rows.committed_members(
            session, self.ctx.run_id, s.stream, policy.reads(step), step
        )
        others = [r.entry for r in found if r.id != s.row_id]
        new = Entry(id=s.row_id, step=step, metric=s.metric)
        doomed = {e.id for e in policy.evictions(others, new)}
        return [r for r in found if r.id in doomed]

    def _evict(self, session: Any, chosen: list[Any]) -> list[Any]:
        """Mark ``chosen`` evicted; the rows whose files are to be removed after COMMIT.

        ``deleted_at`` records the eviction (the file goes later, maybe at a
        reconcile). A protected row (the checkpoint this attempt resumed from)
        leaves its stream the same way, but its file stays: the row becomes
        ``deleted`` at once, saying so, and the file is the user's from then on.
        """
        now = m.utcnow()
        kept = [r.id for r in chosen if r.id in self.ctx.protected]
        ledger_rows.set_state(
            session, kept, m.DELETED, deleted_at=now, error=ledger_rows.KEPT_ON_DISK
        )
        evicted = [r for r in chosen if r.id not in self.ctx.protected]
        boundary_rows.mark_evicted(session, [r.id for r in evicted], now)
        # a pinned row stays 'deleting' with its file until its last pin goes (read after
        # the update above: a reader's pin either committed before it or is refused)
        ids = [r.id for r in evicted]
        held, tiered = boundary_rows.pinned_ids(session, self.ctx.run_id, ids, now)
        if tiered:  # a replicated stream's file also stays until its copy is whole
            held |= tiers.hold_for_copy(session, self.ctx.run_id, ids, now)
        if held:
            self.ctx.pins_waiting = True
        return [r for r in evicted if r.id not in held]

    def unpinned(self, session: Any, already: list[Any]) -> list[Any]:
        """Evicted rows kept for a pin that is gone (released, expired): removed now
        (besides ``already``, the rows this transaction evicted). No query at all once
        nothing is waiting: the common case, where nobody pins."""
        ctx = self.ctx
        if not ctx.pins_waiting:
            return []
        waiting = pins.held_back(session, ctx.run_id)
        live = pins.pinned_ids(session, ctx.run_id, [r.id for r in waiting], m.utcnow())
        found = [r for r in waiting if r.id not in live]
        pins.drop(session, [r.id for r in found])
        still = bool(live)  # rows this transaction held back are among them too
        after_commit(session, lambda: setattr(ctx, "pins_waiting", still))
        known = {r.id for r in already}
        return [r for r in found if r.id not in known]

    def _record(
        self, s: Share, step: int, values: dict[str, float], committed_at: dt.datetime
    ) -> Checkpoint:
        assert s.info is not None
        return Checkpoint(
            stream=s.stream,
            step=step,
            path=self.ctx.save_dir / s.final,
            size=s.info.size,
            hash=s.info.hash,
            metric=s.metric,
            state=m.COMMITTED,
            committed_at=committed_at,
            id=s.row_id,
            attempt_id=self.ctx.attempt_id,
            metrics=dict(values),
            world_size=self.ctx.world_size,
        )

    # ------------------------------------------------------------ rollback, clean-up

    def _roll_back(self, step: int, shares: list[Share], exc: BaseException) -> None:
        disposal.roll_back(self.ctx, step, shares, exc)

    def clean_up(self, step: int | None, evicted: list[Any]) -> None:
        disposal.clean_up(self.ctx, step, evicted)

    def gc(self) -> list[Checkpoint]:
        """Apply every stream's stored retention policy now (e.g. after lowering ``last``).

        Same two steps as a boundary: one transaction marks the evicted rows
        ``deleting`` (and moves a latest pointer off them); the removal is
        queued behind its COMMIT. A pinned row keeps its file until its pins
        are gone; released and expired pins are cleared.
        """
        ctx = self.ctx
        evicted: list[Any] = []
        with ctx.ledger.transaction() as session:
            for stream, policy in ctx.policies.items():
                found, entries = ledger_rows.committed_entries(session, ctx.run_id, stream)
                doomed = {e.id for e in policy.window_evictions(entries)}
                evicted.extend(self._evict(session, [r for r in found if r.id in doomed]))
                ledger_rows.repoint_latest(session, ctx.run_id, stream)
            evicted.extend(self.unpinned(session, evicted))
            pins.clear_stale(session, ctx.run_id, m.utcnow())
            after_commit(session, lambda: self.clean_up(None, evicted))
        return [ledger_rows.to_record(r, ctx.save_dir) for r in evicted]


def _check_deadline(deadline: float | None) -> None:
    """Raise (as a failure of phase ``deadline``) once ``deadline`` has passed: a
    preemption's grace period is over, so the boundary is rolled back before it
    places anything, rather than killed half-way through its commit."""
    now = time.time()
    if deadline is not None and now > deadline:
        raise PhaseFailure(
            "deadline",
            TimeoutError(f"the grace period ended {now - deadline:.1f} s before the commit"),
        )
