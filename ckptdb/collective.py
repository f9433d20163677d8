"""The collective side of the manager under torch.distributed (a mixin).

The sequence of collectives and why it is fixed are described in
:mod:`ckptdb.distributed`; this module runs it for ``save`` (blocking or
not) and ``load``. The chief holds the ledger; other ranks only take part
in the agreements and, for sharded payloads, write their own shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.api import CheckpointException

from . import faults
from .asyncsave import SaveHandle, finished
from .boundary import Pending, PhaseFailure, PlanItem, validate_step
from .distributed import (
    RankError,
    RankGroup,
    capture,
    first_error,
    objection_of,
    raise_agreed,
    raise_previous,
    rebuild,
)
from .errors import (
    ArgumentTypeError,
    CkptDBError,
    NonFiniteGradientError,
    PublishError,
    RankAgreementError,
    RankFailedError,
)
from .loading import check_into, read_checkpoint
from .record import Checkpoint
from .sharded import Sharded, resolve_stateful, write_sharded
from .storage import confine

if TYPE_CHECKING:
    import datetime as dt

    from . import models as m
    from .asyncsave import BackgroundWriter, Snapshotter


class CollectiveMixin:
    """``save``/``load`` under torch.distributed; mixed into CheckpointManager."""

    if TYPE_CHECKING:  # provided by CheckpointManager
        save_dir: Path
        guard: Any
        _metric_buffer: list[tuple[int, str, float, float]]
        _inflight: SaveHandle | None
        _inflight_streams: frozenset[str]
        _writer: BackgroundWriter
        _snapshots: Snapshotter

        def _validate_boundary(
            self,
            step: object,
            metrics: object,
            payloads: Mapping[str, Any],
            *,
            buffer: bool = True,
        ) -> dict[str, float]: ...
        def _buffer_boundary_metrics(self, step: int, values: dict[str, float]) -> None: ...
        def _guard_verdict(self, step: int) -> NonFiniteGradientError | None: ...
        def _check_finite_metrics(
            self, payloads: Mapping[str, Any], values: dict[str, float]
        ) -> None: ...
        def _record_guard_trip(
            self, step: int, params: list[str], ranks: list[int] | None = None
        ) -> None: ...
        def _record_intent(
            self, step: int, values: dict[str, float], payloads: Mapping[str, Any]
        ) -> list[Pending]: ...
        def _write_payloads(self, pending: list[Pending], group: RankGroup | None) -> None: ...
        def _place(self, pending: list[Pending]) -> None: ...
        def _commit(
            self, step: int, pending: list[Pending], metric_limit: int | None = None
        ) -> tuple[list[m.Checkpoint], dt.datetime, int]: ...
        def _drop_flushed(self, count: int) -> None: ...
        def _record(
            self, p: Pending, step: int, values: dict[str, float], committed_at: dt.datetime
        ) -> Checkpoint: ...
        def _clean_up(self, step: int | None, evicted: list[m.Checkpoint]) -> None: ...
        def _roll_back(self, step: int, pending: list[Pending], exc: BaseException) -> None: ...
        def _verified(self, which: object, stream: str | None) -> tuple[Checkpoint, Path]: ...
        def _note_resume(self, target: Checkpoint) -> None: ...

    def _save_collective(
        self,
        group: RankGroup,
        step: object,
        metrics: object,
        payloads: dict[str, Any],
        blocking: object,
        previous: BaseException | None,
        unfetched: bool,
    ) -> dict[str, Checkpoint] | SaveHandle:
        """One boundary under torch.distributed: the fixed sequence in ckptdb.distributed.

        ``previous`` is the last asynchronous boundary's error (the same on
        every rank: its outcome was agreed); if any rank has not fetched it,
        every rank raises it and this boundary does not run.
        """
        keep_guard = False
        pending: list[Pending] = []
        rolls_back_itself = False  # _chief_boundary rolls back its own failures
        try:
            values, local = self._preflight_here(step, metrics, payloads, blocking)
            sharded = sorted(s for s, p in payloads.items() if isinstance(p, Sharded))
            mine = capture(group.rank, local, "InvalidArgumentError") if local else None
            shown = step if isinstance(step, int) else repr(step)  # always picklable
            verdict = (shown, sorted(payloads), sharded, blocking is True, mine)
            gathered = group.gather("preflight", (verdict, unfetched))
            if any(unfetched for _, unfetched in gathered):
                keep_guard = True  # this boundary never ran
                raise_previous(previous, gathered)
            objection = objection_of([v for v, _ in gathered])
            keep_guard = objection is not None and objection.fields.get("stage", 0) == 0

            def plan() -> list[PlanItem] | RankError:
                if objection is not None and keep_guard:
                    return objection  # bad input: nothing recorded, not even the metrics
                self._buffer_boundary_metrics(validate_step(step), values)
                if objection is not None:
                    self._record_objection(objection)
                    return objection
                pending.extend(self._record_intent(validate_step(step), values, payloads))
                return [PlanItem(p.stream, self._relative(p.tmp), p.sharded) for p in pending]

            items = group.shared_call("plan", plan, fallback="PublishError")
            if isinstance(items, RankError):
                raise_agreed(items, local, group.rank)
            step = validate_step(step)
            if blocking is False:
                return self._launch_collective(group, step, values, pending, items, payloads)
            if not items:
                return {}  # no top-K stream admitted the candidate, on any rank
            if group.is_chief:
                rolls_back_itself = True
                return self._chief_boundary(group, step, values, pending)
            return self._follower_boundary(group, items, payloads)
        except RankAgreementError as broken:  # the group broke between the intent and the write
            if pending and not rolls_back_itself:
                self._roll_back_quietly(validate_step(step), pending, broken)
            raise
        finally:
            if self.guard is not None and not keep_guard:  # a typo must not reset the guard
                self.guard.reset()

    def _launch_collective(
        self,
        group: RankGroup,
        step: int,
        values: dict[str, float],
        pending: list[Pending],
        items: list[PlanItem],
        payloads: Mapping[str, Any],
    ) -> SaveHandle:
        """An asynchronous distributed boundary: snapshot now (and agree on it), then
        ``write`` and ``outcome`` on the dedicated group, in the background."""
        if not items:
            return finished(step, {})
        local: BaseException | None = None
        mine: dict[str, Any] = {}
        try:
            if group.is_chief:
                for p in pending:
                    p.payload = self._snapshots.snapshot(p.stream, p.payload)
            else:
                for item in items:
                    if item.sharded:
                        mine[item.stream] = self._snapshots.snapshot(
                            item.stream, payloads[item.stream]
                        )
        except Exception as exc:
            local = exc
        problem = first_error(
            group.gather("snapshot", capture(group.rank, local) if local else None)
        )
        if problem is not None:
            if group.is_chief:
                self._roll_back_quietly(step, pending, PhaseFailure("snapshot", rebuild(problem)))
            raise_agreed(problem, local, group.rank)
        background = self._writer.rank_group(group)
        limit = len(self._metric_buffer)

        def work() -> dict[str, Checkpoint]:
            if background.is_chief:
                return self._chief_boundary(background, step, values, pending, limit)
            return self._follower_boundary(background, items, mine)

        handle = self._writer.submit(step, work)
        self._inflight, self._inflight_streams = handle, frozenset(i.stream for i in items)
        return handle

    def _preflight_here(
        self, step: object, metrics: object, payloads: Mapping[str, Any], blocking: object
    ) -> tuple[dict[str, float], CkptDBError | None]:
        """This rank's preflight verdict (input, guard, finite ranking metric), not raised:
        whatever fails here is agreed on in the ``preflight`` all-gather."""
        try:
            if not isinstance(blocking, bool):
                raise ArgumentTypeError(f"blocking must be True or False, got {blocking!r}")
            values = self._validate_boundary(step, metrics, payloads, buffer=False)
        except CkptDBError as exc:
            exc.stage = 0  # type: ignore[attr-defined]
            return {}, exc
        try:
            trip = self._guard_verdict(validate_step(step))
        except Exception as exc:  # e.g. a CUDA error while reading the guard's flag
            failed = RankFailedError(f"reading the guard failed: {type(exc).__name__}: {exc}")
            failed.__cause__ = exc
            failed.stage = 1  # type: ignore[attr-defined]
            return values, failed
        if trip is not None:
            trip.stage = 1  # type: ignore[attr-defined]
            return values, trip
        try:
            self._check_finite_metrics(payloads, values)
        except CkptDBError as exc:
            exc.stage = 2  # type: ignore[attr-defined]
            return values, exc
        return values, None

    def _record_objection(self, objection: RankError) -> None:
        if objection.kind == NonFiniteGradientError.__name__:
            self._record_guard_trip(
                objection.fields.get("step", -1),
                list(objection.fields.get("parameters") or []),
                ranks=list(objection.ranks),
            )

    def _relative(self, path: Path) -> str:
        return path.relative_to(self.save_dir).as_posix()

    def _chief_boundary(
        self,
        group: RankGroup,
        step: int,
        values: dict[str, float],
        pending: list[Pending],
        metric_limit: int | None = None,
    ) -> dict[str, Checkpoint]:
        try:
            local = self._write_here(group, pending)
            problem = first_error(group.gather("write", capture(0, local) if local else None))
            if problem is not None:
                raise_agreed(problem, local, 0)
            self._place(pending)
            evicted, committed_at, flushed = self._commit(step, pending, metric_limit)
        except RankAgreementError as broken:  # the group is broken: roll back, share nothing
            self._roll_back_quietly(step, pending, broken)
            raise
        except BaseException as exc:
            try:
                self._roll_back(step, pending, exc)
            except Exception as failed:  # PublishError, or the rollback's own failure
                failed.ranks = list(getattr(exc, "ranks", None) or [0])  # type: ignore[attr-defined]
                group.share("outcome", (None, capture(0, failed)))
                raise
            raise  # an interrupt: rolled back, and the other ranks time out
        # Committed: the evicted files go even if sharing the outcome fails.
        try:
            self._drop_flushed(flushed)
            faults.point("after_commit")
            records = {p.stream: self._record(p, step, values, committed_at) for p in pending}
            group.share("outcome", (records, None))
        finally:
            self._clean_up(step, evicted)
        return records

    def _write_here(self, group: RankGroup, pending: list[Pending]) -> BaseException | None:
        """The chief's write phase; its error is returned for the ``write`` agreement.

        Sharded payloads first, with every rank in DCP; nothing fallible runs
        before them, so no rank waits in DCP for a chief that failed early.
        """
        try:
            for p in pending:
                if p.sharded:
                    write_sharded(p.payload.state_dict, p.tmp, group.group)
            faults.point("after_intent")
            self._write_payloads(pending, group)
        except (Exception, CheckpointException) as exc:
            return exc
        return None

    def _follower_boundary(
        self, group: RankGroup, items: list[PlanItem], payloads: Mapping[str, Any]
    ) -> dict[str, Checkpoint]:
        local: BaseException | None = None
        try:
            for item in items:
                if item.sharded:
                    write_sharded(
                        payloads[item.stream].state_dict, self.save_dir / item.tmp, group.group
                    )
        except (Exception, CheckpointException) as exc:
            local = exc
        group.gather("write", capture(group.rank, local) if local else None)
        nothing: tuple[dict[str, Checkpoint] | None, RankError | None] = (None, None)
        records, failure = group.share("outcome", nothing)
        if failure is not None:
            raise_agreed(failure, local, group.rank)
        return records or {}

    def _roll_back_quietly(self, step: int, pending: list[Pending], exc: BaseException) -> None:
        """Roll back for an error that must propagate as itself (the rollback's own
        error, with any cleanup failure, is attached as ``exc.rollback``)."""
        try:
            self._roll_back(step, pending, exc)
        except PublishError as failed:
            exc.rollback = failed  # type: ignore[attr-defined]

    def _load_collective(
        self,
        group: RankGroup,
        which: object,
        stream: str | None,
        map_location: Any,
        weights_only: bool,
        into: dict[str, Any] | None,
    ) -> Any:
        """Three collectives: ``resolve`` (the chief's verified target), ``ready``
        (every rank can load it: a sharded load is itself collective, so no rank
        may skip it) and ``loaded`` (every rank's outcome)."""
        target = group.shared_call("resolve", lambda: self._verified(which, stream)[0])
        problem: BaseException | None = None
        path = target.path
        try:  # everything that could fail on one rank only, before DCP's collectives
            check_into(target, into)
            path = confine(self.save_dir, target.path.relative_to(self.save_dir))
            if into is not None:
                resolve_stateful(into)
        except Exception as exc:
            problem = exc
        group.agree("ready", problem, fallback="InvalidArgumentError")
        state: Any = None
        try:
            state = read_checkpoint(target, path, map_location, weights_only, into, group)
            if group.is_chief:
                self._note_resume(target)
        except (Exception, CheckpointException) as exc:
            problem = exc
        group.agree("loaded", problem, fallback="RankFailedError")
        return state
