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
3. write — sharded payloads by every rank through DCP (which agrees on its
   own failures), then plain payloads by the chief alone;
4. ``write`` — all-gather of each rank's write outcome;
5. ``outcome`` — broadcast from the chief after it placed and committed the
   boundary, or rolled it back: the committed records or the error.

Every rank then returns the same records or raises the same exception type,
naming the failing rank(s). Steps 3-5 are skipped by every rank alike when
the plan says stop, since every rank learnt that from the same broadcast.
A collective that fails (a rank died, the group's timeout expired) raises
:class:`~ckptdb.errors.RankAgreementError` instead of hanging; the chief then
rolls back anything pending.

Errors travel as :class:`RankError` (plain data: type name, message and the
attributes the type needs), not as pickled exceptions, so every rank rebuilds
the same type even for exceptions that cannot be pickled.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from . import errors as e

T = TypeVar("T")


@dataclass(frozen=True)
class RankError:
    """One rank's failure, as data every rank can turn back into the same exception."""

    rank: int
    kind: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)
    ranks: tuple[int, ...] = ()  # the ranks that failed, when one error speaks for several


def capture(
    rank: int, exc: BaseException, fallback: str = "PublishError", **fields: Any
) -> RankError:
    """``exc`` as a :class:`RankError`; a non-ckptdb error becomes ``fallback``."""
    own = dict(fields)
    ranks: tuple[int, ...] = (rank,)
    if isinstance(exc, CheckpointException):  # DCP names the ranks that failed inside it
        ranks = tuple(sorted(exc.failures)) or ranks
        message = "; ".join(
            f"rank {r}: {type(err[0]).__name__}: {err[0]}"
            for r, err in sorted(exc.failures.items())
        )
        return RankError(rank, fallback, message or str(exc), own, ranks)
    if isinstance(exc, e.CkptDBError):
        kind = type(exc).__name__
        for name in ("phase", "step", "parameters", "holder", "stage"):
            if hasattr(exc, name):
                own.setdefault(name, getattr(exc, name))
        for name in ("path",):
            value = getattr(exc, name, None)
            if value is not None:
                own.setdefault(name, str(value))
        failures = getattr(exc, "cleanup_failures", None)
        if failures:
            own["cleanup_failures"] = [
                (str(f.path), type(f.error).__name__, str(f.error), f.action) for f in failures
            ]
        base = super(e.PublishError, exc).__str__() if isinstance(exc, e.PublishError) else str(exc)
        ranks = tuple(getattr(exc, "ranks", ()) or ranks)
        return RankError(rank, kind, base, own, ranks)
    return RankError(rank, fallback, f"{type(exc).__name__}: {exc}", own, ranks)


def rebuild(chosen: RankError) -> e.CkptDBError:
    """The exception every rank raises for ``chosen`` (same type, same message)."""
    cls = getattr(e, chosen.kind, None)
    if not (isinstance(cls, type) and issubclass(cls, e.CkptDBError)):
        cls = e.PublishError
    ranks = chosen.ranks or (chosen.rank,)
    where = ", ".join(str(r) for r in ranks)
    # name the failing rank(s) unless the message already does
    message = chosen.message if "rank " in chosen.message else f"rank {where}: {chosen.message}"
    f = chosen.fields
    exc: e.CkptDBError
    if cls is e.PublishError or issubclass(cls, e.PublishError):
        failures = [
            e.CleanupFailure(Path(path), _os_error(kind, text), action)
            for path, kind, text, action in f.get("cleanup_failures", [])
        ]
        exc = cls(
            message,
            phase=f.get("phase", "write"),
            step=f.get("step", -1),
            path=Path(f["path"]) if f.get("path") else None,
            stream=f.get("stream"),
            cleanup_failures=failures,
        )
    elif cls is e.NonFiniteGradientError:
        exc = cls(message, step=f.get("step", -1), parameters=f.get("parameters"))
    elif cls is e.LedgerLockedError:
        exc = cls(message, holder=f.get("holder"))
    else:
        exc = cls(message)
    exc.ranks = list(ranks)  # type: ignore[attr-defined]
    return exc


def _os_error(kind: str, text: str) -> BaseException:
    """An error of the built-in type named ``kind`` (OSError subclasses), else RuntimeError."""
    cls = getattr(builtins, kind, None)
    if isinstance(cls, type) and issubclass(cls, OSError):
        return cls(text)
    return RuntimeError(f"{kind}: {text}")


def first_error(found: Sequence[RankError | None]) -> RankError | None:
    """The error all ranks agree to raise, naming every failing rank.

    The earliest check wins (``stage``: bad input, then the guard, then a
    non-finite ranking metric, as in a single process), then the lowest rank.
    """
    present = sorted(
        (x for x in found if x is not None), key=lambda x: (x.fields.get("stage", 0), x.rank)
    )
    if not present:
        return None
    ranks = tuple(sorted({r for x in present for r in (x.ranks or (x.rank,))}))
    head = present[0]
    if len(present) == 1:
        return RankError(head.rank, head.kind, head.message, head.fields, ranks)
    # ranks that report the same failure (DCP raises one rank's error on all) say it once
    others = "; ".join(
        f"rank {x.rank}: {x.message}" for x in present[1:] if x.message != head.message
    )
    message = f"{head.message} (also {others})" if others else head.message
    return RankError(head.rank, head.kind, message, head.fields, ranks)


def objection_of(
    verdicts: Sequence[tuple[object, list[str], list[str], bool, RankError | None]],
) -> RankError | None:
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
            return RankError(0, "InvalidArgumentError", message, {}, every)
    return None


def raise_agreed(chosen: RankError, local: BaseException | None, rank: int) -> NoReturn:
    """Raise the agreed error here: the same type and message on every rank, caused
    by this rank's own failure (with its traceback) where it had one."""
    raise rebuild(chosen) from local


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
        failure: RankError | None = None
        local: BaseException | None = None
        if self.is_chief:
            try:
                result = work()
            except Exception as exc:
                local = exc
                failure = capture(self.rank, exc, fallback)
        result, failure = self.share(name, (result, failure))
        if failure is not None:
            raise_agreed(failure, local, self.rank)
        return result  # type: ignore[no-any-return]

    def agree(self, name: str, local: BaseException | None, fallback: str = "PublishError") -> None:
        """All-gather every rank's outcome of a local step; raise the same error everywhere."""
        mine = capture(self.rank, local, fallback) if local is not None else None
        chosen = first_error(self.gather(name, mine))
        if chosen is not None:
            raise_agreed(chosen, local, self.rank)


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
