"""Rank agreement for distributed runs: one fixed sequence of collectives per call.

Under ``torch.distributed`` every rank constructs the manager and calls
``save``/``load``/``latest``/``best``/``checkpoints`` collectively; only the
chief (rank 0 of the group) opens the ledger, holds the writer lock and
reconciles. A boundary runs exactly this sequence on every rank, whatever
happened locally, so a failure on one rank can never leave another waiting in
a different collective:

1. ``preflight`` — all-gather of each rank's verdict on its inputs and its
   guard (a non-finite gradient on any rank stops the boundary everywhere);
2. ``plan`` — broadcast from the chief: the streams it admitted (top-K) and
   recorded as ``pending``, with their temporary paths, or the error that
   stops the boundary (a preflight objection, a failed intent);
3. write — payloads every rank writes (sharded ones through DCP, which
   agrees on its own failures and returns when every rank has written; a
   framework's through its own saver), then ``wrote`` when the plan has a
   framework's payload: an all-gather of each rank's outcome, so the chief
   seals nothing before the last rank has finished (a framework's saver may
   end without a barrier); then plain payloads by the chief alone, and the
   chief seals;
4. ``write`` — all-gather of each rank's write outcome;
5. ``outcome`` — broadcast from the chief after it placed and committed the
   boundary, or rolled it back: the committed records or the error.

Every rank then returns the same records or raises the same exception type,
naming the failing rank(s). Steps 3-5 are skipped by every rank alike when
the plan says stop, since every rank learnt that from the same broadcast.
A collective that fails (a rank died, the group's timeout expired) raises
:class:`~ckptdb.errors.RankAgreementError` instead of hanging; the chief then
rolls back anything pending.

Errors travel as :class:`~ckptdb.errors.WireError` (plain data: type name,
message and the error's declared fields), not as pickled exceptions, so every
rank rebuilds the same type even for exceptions that cannot be pickled.

:class:`DistCoordinator` is this sequence behind the
:class:`~ckptdb.coord.base.Coordinator` protocol the boundary talks to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from .. import errors as e
from ..errors import WireError
from .base import Coordinator, LocalCoordinator, Objection, Verdict, attach_rollback

T = TypeVar("T")


def capture(rank: int, exc: BaseException, fallback: str = "PublishError") -> WireError:
    """``exc`` as a :class:`WireError`; a non-ckptdb error becomes ``fallback``.

    DCP's ``CheckpointException`` names the ranks that failed inside it.
    """
    if isinstance(exc, CheckpointException):
        ranks = tuple(sorted(exc.failures)) or (rank,)
        message = "; ".join(
            f"rank {r}: {type(err[0]).__name__}: {err[0]}"
            for r, err in sorted(exc.failures.items())
        )
        return WireError(rank, fallback, message or str(exc), {}, ranks)
    return e.encode(rank, exc, fallback)


def first_error(found: Sequence[WireError | None]) -> WireError | None:
    """The error all ranks agree to raise, naming every failing rank.

    The earliest check wins (``stage``: bad input, then the guard, then a
    non-finite ranking metric, as in a single process), then the lowest rank.
    """
    present = sorted((x for x in found if x is not None), key=lambda x: (x.stage, x.rank))
    if not present:
        return None
    ranks = tuple(sorted({r for x in present for r in (x.ranks or (x.rank,))}))
    head = present[0]
    if len(present) == 1:
        return WireError(head.rank, head.kind, head.message, head.fields, ranks)
    # ranks that report the same failure say it once: DCP raises one rank's error on
    # all; the chief relays another rank's agreed write failure that the rank reports too
    seen = {_said(head)}
    others = []
    for x in present[1:]:
        if _said(x) not in seen:
            seen.add(_said(x))
            others.append(_said(x))
    message = f"{head.message} (also {'; '.join(others)})" if others else head.message
    return WireError(head.rank, head.kind, message, head.fields, ranks)


def _said(error: WireError) -> str:
    """``error``'s message naming the rank it is about (a relayed one names it already)."""
    return (
        error.message
        if error.message.startswith("rank ")
        else f"rank {error.rank}: {error.message}"
    )


def objection_of(
    verdicts: Sequence[tuple[object, list[str], list[str], bool, WireError | None]],
) -> WireError | None:
    """The preflight objection, if any, from every rank's (step, streams, sharded,
    blocking, error).

    Ranks must also agree on the step and on which streams they save (and
    which are sharded): a rank out of step is a bug that must not publish.
    """
    chosen = first_error([v[4] for v in verdicts])
    if chosen is not None:
        return chosen
    every = tuple(range(len(verdicts)))
    for index, what in ((0, "step"), (1, "streams"), (2, "sharded streams"), (3, "blocking")):
        seen = [v[index] for v in verdicts]
        if any(x != seen[0] for x in seen):
            listed = ", ".join(f"rank {r}: {x!r}" for r, x in enumerate(seen))
            message = f"ranks disagree on the {what} of save() ({listed})"
            return WireError(0, "InvalidArgumentError", message, {}, every)
    return None


def raise_agreed(chosen: WireError, local: BaseException | None) -> NoReturn:
    """Raise the agreed error here: the same type and message on every rank, caused
    by this rank's own failure (with its traceback) where it had one."""
    raise e.decode(chosen) from local


def raise_previous(
    previous: BaseException | None, gathered: Sequence[tuple[Any, bool]]
) -> NoReturn:
    """Some rank has not fetched the last asynchronous boundary's error: every rank
    raises it (each its own copy; the boundary's outcome was agreed)."""
    ranks = [r for r, (_, unfetched) in enumerate(gathered) if unfetched]
    if previous is not None:
        raise previous
    raise e.PublishError(
        f"the previous asynchronous boundary failed (its error is unfetched on rank(s) "
        f"{', '.join(map(str, ranks))}); this save did not run",
        phase="write",
        step=-1,
    )


class RankGroup:
    """The manager's process group: object collectives, named and counted.

    ``log`` lists the collectives this rank ran, in order; the tests compare
    it across ranks (it must be identical for every call, success or not).
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank: int = dist.get_rank(group)
        self.size: int = dist.get_world_size(group)
        self.log: list[str] = []

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    def gather(self, name: str, obj: T) -> list[T]:
        """Every rank's ``obj``, indexed by rank."""
        out: list[Any] = [None] * self.size
        here = (name, len(self.log))
        self._run(name, lambda: dist.all_gather_object(out, (*here, obj), group=self.group))
        return [self._untag(here, got) for got in out]

    def share(self, name: str, obj: T) -> T:
        """The chief's ``obj`` on every rank (what other ranks pass is ignored)."""
        here = (name, len(self.log))
        box: list[Any] = [(*here, obj)]
        self._run(name, lambda: dist.broadcast_object_list(box, group=self.group, group_src=0))
        return self._untag(here, box[0])  # type: ignore[no-any-return]

    def _untag(self, here: tuple[str, int], got: Any) -> Any:
        """Each message carries its collective's name and position, so ranks that
        have drifted apart fail loudly instead of reading each other's data."""
        if not (isinstance(got, tuple) and len(got) == 3 and got[:2] == here):
            theirs = got[:2] if isinstance(got, tuple) else type(got).__name__
            raise e.RankAgreementError(
                f"rank {self.rank}: ranks are out of step: here {here}, another rank {theirs}"
            )
        return got[2]

    def _run(self, name: str, collective: Callable[[], object]) -> None:
        self.log.append(name)
        try:
            collective()
        except Exception as exc:
            raise e.RankAgreementError(
                f"rank {self.rank}: the {name!r} collective failed (a rank died, diverged or "
                f"timed out): {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            ) from exc

    def shared_call(self, name: str, work: Callable[[], T], fallback: str = "LedgerError") -> T:
        """The chief runs ``work`` and shares its result (or its error) with every rank."""
        result: Any = None
        failure: WireError | None = None
        local: BaseException | None = None
        if self.is_chief:
            try:
                result = work()
            except Exception as exc:
                local = exc
                failure = capture(self.rank, exc, fallback)
        result, failure = self.share(name, (result, failure))
        if failure is not None:
            raise_agreed(failure, local)
        return result  # type: ignore[no-any-return]

    def agree(self, name: str, local: BaseException | None, fallback: str = "PublishError") -> None:
        """All-gather every rank's outcome of a local step; raise the same error everywhere."""
        mine = capture(self.rank, local, fallback) if local is not None else None
        chosen = first_error(self.gather(name, mine))
        if chosen is not None:
            raise_agreed(chosen, local)


class DistCoordinator:
    """The :class:`~ckptdb.coord.base.Coordinator` of a torch.distributed group.

    Each method is one named collective (or a fixed pair) of the sequence in
    the module docstring; every rank calls the same methods in the same order.
    """

    def __init__(self, ranks: RankGroup) -> None:
        self.ranks = ranks
        self.rank = ranks.rank
        self.size = ranks.size
        self.is_chief = ranks.is_chief
        self.group = ranks.group
        self._background: DistCoordinator | None = None

    @property
    def log(self) -> list[str]:
        return self.ranks.log

    def shared(self, name: str, work: Callable[[], T], fallback: str = "LedgerError") -> T:
        return self.ranks.shared_call(name, work, fallback)

    def preflight(
        self, verdict: Verdict, previous: BaseException | None, unfetched: bool
    ) -> Objection | None:
        local, mine = _verdict_error(self.rank, verdict)
        shown = verdict.step if isinstance(verdict.step, int) else repr(verdict.step)
        summary = (
            shown,
            sorted(verdict.streams),
            sorted(verdict.every_rank_streams),
            verdict.blocking,
            mine,
        )
        gathered = self.ranks.gather("preflight", (summary, unfetched))
        if any(flag for _, flag in gathered):
            raise_previous(previous, gathered)
        chosen = objection_of([v for v, _ in gathered])
        if chosen is None:
            return None
        return Objection(e.decode(chosen), chosen.stage, local)

    def agree(self, name: str, local: BaseException | None, fallback: str = "PublishError") -> None:
        self.ranks.agree(name, local, fallback)

    def failure(self, name: str, local: BaseException | None) -> BaseException | None:
        mine = capture(self.rank, local) if local is not None else None
        chosen = first_error(self.ranks.gather(name, mine))
        return e.decode(chosen) if chosen is not None else None

    def abandon(
        self,
        error: BaseException,
        local: BaseException | None,
        rollback: Callable[[], None] | None,
    ) -> NoReturn:
        if rollback is not None:
            attach_rollback(error, rollback)
        raise error from local

    def written(self, local: BaseException | None) -> None:
        problem = first_error(self.ranks.gather("write", capture(0, local) if local else None))
        if problem is not None:
            raise_agreed(problem, local)

    def committed(self, records: dict[str, Any]) -> None:
        self.ranks.share("outcome", (records, None))

    def rolled_back(self, error: Exception, cause: BaseException) -> None:
        if isinstance(error, e.CkptDBError):
            error.ranks = list(getattr(cause, "ranks", None) or [0])
        self.ranks.share("outcome", (None, capture(0, error)))

    def outcome(self, local: BaseException | None) -> dict[str, Any]:
        self.ranks.gather("write", capture(self.rank, local) if local else None)
        nothing: tuple[dict[str, Any] | None, WireError | None] = (None, None)
        records, failure = self.ranks.share("outcome", nothing)
        if failure is not None:
            raise_agreed(failure, local)
        return records or {}

    def background(self, make: Callable[[Any], Any]) -> Coordinator:
        """The coordinator on the dedicated group ``make(self.ranks)`` opens for the
        background thread (collectives of two threads on one group would interleave)."""
        if self._background is None or self._background.ranks is not make(self.ranks):
            self._background = DistCoordinator(make(self.ranks))
        return self._background


def _verdict_error(rank: int, verdict: Verdict) -> tuple[e.CkptDBError | None, WireError | None]:
    """This rank's objection, and as data; a failure that is not ours (reading the
    guard raised, say) is a :class:`RankFailedError` of the same stage, caused by it."""
    error = verdict.error
    if error is None:
        return None, None
    if not isinstance(error, e.CkptDBError):
        wrapped = e.RankFailedError(f"reading the guard failed: {type(error).__name__}: {error}")
        wrapped.__cause__ = error
        error = wrapped
    error.stage = verdict.stage
    return error, capture(rank, error, "InvalidArgumentError")


def coordinator_for(process_group: Any) -> Coordinator:
    """The coordinator of ``process_group``: the default group when torch.distributed
    is initialized, a :class:`LocalCoordinator` in a single process."""
    ranks = resolve_group(process_group)
    return LocalCoordinator() if ranks is None else DistCoordinator(ranks)


def resolve_group(process_group: Any) -> RankGroup | None:
    """``process_group``, or the default group when torch.distributed is initialized."""
    if not dist.is_available():
        if process_group is not None:
            raise e.ArgumentTypeError("process_group given but torch.distributed is unavailable")
        return None
    if process_group is None:
        return RankGroup(dist.group.WORLD) if dist.is_initialized() else None
    if not dist.is_initialized():
        raise e.InvalidArgumentError(
            "process_group given but torch.distributed is not initialized "
            "(call torch.distributed.init_process_group first)"
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise e.ArgumentTypeError(f"process_group must be a ProcessGroup, got {process_group!r}")
    return RankGroup(process_group)
