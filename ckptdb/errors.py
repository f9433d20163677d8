"""One error hierarchy for everything ckptdb raises.

Every error derives from :class:`CkptDBError` *and* from the built-in a user
would naturally catch (``ValueError`` for bad input, ``OSError`` for a file
that is not what the ledger says, ...), so both ``except CkptDBError`` and
``except ValueError`` work.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class CkptDBError(Exception):
    """Base class of every error raised by ckptdb."""


class InvalidArgumentError(CkptDBError, ValueError):
    """An argument has a bad value (policy, stream name, step, path...)."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type (a float step, a bool metric...)."""


class InvalidMetricError(InvalidArgumentError):
    """A metric a top-K stream ranks by is missing or not a finite real number."""


class UnknownStreamError(InvalidArgumentError):
    """A payload or query names a stream that is not configured for the run."""


class LedgerError(CkptDBError, RuntimeError):
    """The ledger cannot be used (closed manager, unreachable database...)."""


class LedgerLockedError(LedgerError):
    """Another process holds the run's writer lock."""

    def __init__(self, message: str, holder: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.holder = holder or {}


class WriterLockLostError(LedgerError):
    """The connection holding a PostgreSQL run's writer lock was lost; reopen the run."""


class NetworkFilesystemError(InvalidArgumentError):
    """A SQLite ledger would live on a network filesystem, where its locking is unsafe."""


class RunDirectoryError(CkptDBError, OSError):
    """The run root cannot hold a run (a file, not writable, lock file unusable)."""


class SchemaVersionError(LedgerError):
    """The ledger's schema is unknown to (newer than) this version of ckptdb."""


@dataclass(frozen=True)
class CleanupFailure:
    """A leftover that could not be removed (or recorded) after a failure, and why."""

    path: Path
    error: BaseException
    action: str = "remove"

    def __str__(self) -> str:
        return f"{self.action} {self.path}: {type(self.error).__name__}: {self.error}"


class PublishError(CkptDBError, RuntimeError):
    """A boundary failed before its commit; the ledger is as it was before.

    ``phase`` names the protocol phase that failed (``intent``, ``write``,
    ``fsync``, ``replace``, ``fsync_dir``, ``commit``), ``path`` the file it
    was working on, and ``cleanup_failures`` any leftover that could not be
    removed afterwards (those are recorded for the next reconcile).
    The original exception is ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        phase: str,
        step: int,
        path: Path | None = None,
        stream: str | None = None,
        cleanup_failures: list[CleanupFailure] | None = None,
    ) -> None:
        super().__init__(message)
        self.phase = phase
        self.step = step
        self.path = path
        self.stream = stream
        self.cleanup_failures: list[CleanupFailure] = list(cleanup_failures or [])

    def __str__(self) -> str:
        text = super().__str__()
        if self.cleanup_failures:
            leftovers = "; ".join(str(f) for f in self.cleanup_failures)
            text += f" (cleanup also failed, left for the next reconcile: {leftovers})"
        return text


class NonFiniteGradientError(CkptDBError, FloatingPointError):
    """The non-finite gradient guard tripped: the boundary was not published."""

    def __init__(self, message: str, *, step: int, parameters: list[str] | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.parameters = list(parameters or [])


class CheckpointNotFoundError(CkptDBError, LookupError):
    """No committed checkpoint matches the request."""


class CheckpointLostError(CheckpointNotFoundError, FileNotFoundError):
    """A committed checkpoint's file is gone (the row is marked ``lost``)."""


class CorruptCheckpointError(CkptDBError, OSError):
    """A checkpoint file's size or hash differs from its ledger row."""


class RankAgreementError(CkptDBError, RuntimeError):
    """A collective among the ranks failed: a rank died, diverged or timed out.

    Raised instead of hanging; the chief rolls back anything pending.
    """


class RankFailedError(CkptDBError, RuntimeError):
    """A collective operation failed on some rank(s) with an error of their own.

    ``ranks`` names them; on a failing rank the original error is ``__cause__``.
    """


class ChiefOnlyError(CkptDBError, RuntimeError):
    """A ledger-maintenance call (reconcile, gc, check) made on a rank other than the chief."""


__all__ = [
    "ArgumentTypeError",
    "CheckpointLostError",
    "CheckpointNotFoundError",
    "ChiefOnlyError",
    "CkptDBError",
    "CleanupFailure",
    "CorruptCheckpointError",
    "InvalidArgumentError",
    "InvalidMetricError",
    "LedgerError",
    "LedgerLockedError",
    "NetworkFilesystemError",
    "NonFiniteGradientError",
    "PublishError",
    "RankAgreementError",
    "RankFailedError",
    "RunDirectoryError",
    "SchemaVersionError",
    "UnknownStreamError",
    "WriterLockLostError",
]
