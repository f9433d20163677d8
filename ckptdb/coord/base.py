"""The coordinator: the fixed points where a boundary or a load talks to the other ranks.

The publication protocol (:mod:`ckptdb.protocol`) is written once. At each
point where ranks must agree it asks its :class:`Coordinator`, in a fixed
order that does not depend on what happened locally. In a single process
:class:`LocalCoordinator` answers every agreement at once: the local outcome
*is* the agreement, and an error propagates as itself (as torch DCP's
``_DistWrapper`` turns collectives into no-ops without torch.distributed).
Under torch.distributed :class:`~ckptdb.coord.dist.DistCoordinator` runs the
collectives described in that module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar

from ..errors import CkptDBError, PublishError

T = TypeVar("T")


@dataclass(frozen=True)
class Verdict:
    """This rank's preflight: its validated metrics, or the first check that objected.

    ``stage`` orders the checks (0 bad input, 1 guard, 2 ranking metric) so
    that ranks agree on the earliest objection, as a single process would.
    """

    values: dict[str, float]
    error: BaseException | None = None
    stage: int = 0
    step: object = None
    streams: Sequence[str] = ()
    every_rank_streams: Sequence[str] = ()
    blocking: bool = True


@dataclass(frozen=True)
class Objection:
    """The agreed reason a boundary stops at its preflight.

    ``error`` is what every rank raises; ``local`` this rank's own failure
    (its cause), when it had one.
    """

    error: BaseException
    stage: int
    local: BaseException | None = None

    def raise_(self) -> NoReturn:
        if self.local is None or self.local is self.error:
            raise self.error
        raise self.error from self.local


class Coordinator(Protocol):
    """What the protocol asks of the ranks, point by point (see the module docstring)."""

    rank: int
    size: int  # the number of ranks (the world size the ledger records)
    is_chief: bool
    group: Any  # the process group DCP runs in (None: a single process)

    def shared(self, name: str, work: Callable[[], T], fallback: str = "LedgerError") -> T:
        """The chief runs ``work``; every rank gets its result or raises its error."""

    def preflight(
        self, verdict: Verdict, previous: BaseException | None, unfetched: bool
    ) -> Objection | None:
        """Agree on the preflight; first raise a previous boundary's unfetched error."""

    def agree(self, name: str, local: BaseException | None, fallback: str = "PublishError") -> None:
        """Raise the same error on every rank if any rank failed a local step."""

    def failure(self, name: str, local: BaseException | None) -> BaseException | None:
        """The agreed failure of a local step, returned instead of raised."""

    def abandon(
        self,
        error: BaseException,
        local: BaseException | None,
        rollback: Callable[[], None] | None,
    ) -> NoReturn:
        """Roll back (the chief) and raise ``error``, the same on every rank."""

    def written(self, local: BaseException | None) -> None:
        """The ``write`` agreement: the chief raises the agreed write failure."""

    def committed(self, records: dict[str, Any]) -> None:
        """Tell the other ranks the boundary committed (``outcome``)."""

    def rolled_back(self, error: Exception, cause: BaseException) -> None:
        """Tell the other ranks the boundary was rolled back (``outcome``)."""

    def outcome(self, local: BaseException | None) -> dict[str, Any]:
        """A non-chief rank's ``write`` report, then the chief's ``outcome``."""

    def background(self, make: Callable[[Any], Any]) -> Coordinator:
        """The coordinator for work in the background thread; ``make(ranks)`` opens the
        dedicated group it runs on (collectives of two threads on one group interleave)."""


class LocalCoordinator:
    """A single process: every agreement is the local outcome itself."""

    rank = 0
    size = 1
    is_chief = True
    group: Any = None

    def shared(self, name: str, work: Callable[[], T], fallback: str = "LedgerError") -> T:
        return work()

    def preflight(
        self, verdict: Verdict, previous: BaseException | None, unfetched: bool
    ) -> Objection | None:
        if unfetched and previous is not None:
            raise previous
        if verdict.error is None:
            return None
        return Objection(verdict.error, verdict.stage)

    def agree(self, name: str, local: BaseException | None, fallback: str = "PublishError") -> None:
        if local is not None:
            raise local

    def failure(self, name: str, local: BaseException | None) -> BaseException | None:
        return local

    def abandon(
        self,
        error: BaseException,
        local: BaseException | None,
        rollback: Callable[[], None] | None,
    ) -> NoReturn:
        if rollback is not None:
            rollback()  # raises the rollback's PublishError for an ordinary error
        raise error

    def written(self, local: BaseException | None) -> None:
        self.agree("write", local)

    def committed(self, records: dict[str, Any]) -> None:
        return None

    def rolled_back(self, error: Exception, cause: BaseException) -> None:
        return None

    def outcome(self, local: BaseException | None) -> dict[str, Any]:
        raise AssertionError("a single process is always the chief")

    def background(self, make: Callable[[Any], Any]) -> Coordinator:
        return self


def attach_rollback(error: BaseException, rollback: Callable[[], None]) -> None:
    """Roll back for an error that must propagate as itself: the rollback's own
    failure (with any cleanup failure) is attached as ``error.rollback``."""
    try:
        rollback()
    except PublishError as failed:
        if isinstance(error, CkptDBError):
            error.rollback = failed
