"""One error hierarchy for everything ckptdb raises, with declared fields.

Every error derives from :class:`CkptDBError` *and* from the built-in a user
would naturally catch (``ValueError`` for bad input, ``OSError`` for a file
that is not what the ledger says, ...), so both ``except CkptDBError`` and
``except ValueError`` work.

Fields are declared, never attached after the fact: every error may carry
``ranks`` (the ranks that failed, under torch.distributed), ``stage`` (which
preflight check failed, so that ranks agree on the earliest one) and
``rollback`` (the rollback's own failure, when an error must propagate as
itself). Each error encodes itself as a :class:`WireError` (plain data) and is
rebuilt from one with :func:`decode`, so every rank of a distributed run can
raise the same type with the same message and fields, even where the original
exception could not be pickled.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class CkptDBError(Exception):
    """Base class of every error raised by ckptdb."""

    #: The ranks whose failure this is (set when ranks agreed on the error).
    ranks: list[int] | None = None
    #: Which preflight check objected: 0 bad input, 1 guard, 2 ranking metric.
    stage: int | None = None
    #: The rollback's own failure, when the error must propagate as itself.
    rollback: CkptDBError | None = None

    def wire_fields(self) -> dict[str, Any]:
        """This error's fields as plain data (see :func:`encode`)."""
        return {} if self.stage is None else {"stage": self.stage}

    @classmethod
    def from_wire(cls, message: str, fields: dict[str, Any]) -> CkptDBError:
        """The error rebuilt from :meth:`wire_fields` (see :func:`decode`)."""
        return cls(message)

    def wire_message(self) -> str:
        """The message to send: without text that :meth:`from_wire` adds back."""
        return str(self)


class InvalidArgumentError(CkptDBError, ValueError):
    """An argument has a bad value (policy, stream name, step, path...)."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type (a float step, a bool metric...)."""


class InvalidMetricError(InvalidArgumentError):
    """A metric a top-K stream ranks by is missing or not a finite real number."""


class LayoutMismatchError(InvalidArgumentError):
    """What a sharded load asks for does not match the checkpoint: a key it lacks (a
    per-rank entry of a rank the saving job did not have) or a tensor of another
    global shape, a tensor where it saved something else. Raised on every rank
    before anything loads (see ckptdb.storage.topology)."""


class UnknownStreamError(InvalidArgumentError):
    """A payload or query names a stream that is not configured for the run."""


class LedgerError(CkptDBError, RuntimeError):
    """The ledger cannot be used (closed manager, unreachable database...)."""


class DatabaseError(LedgerError):
    """A database operation failed (a locked SQLite file, a lost connection...).

    The ledger package raises it for every driver error, in one place;
    ``original`` is the driver's error (also ``__cause__``).
    """

    def __init__(self, message: str, original: BaseException | None = None) -> None:
        super().__init__(message)
        self.original = original


class LedgerLockedError(LedgerError):
    """Another process holds the run's writer lock."""

    def __init__(self, message: str, holder: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.holder = holder or {}

    def wire_fields(self) -> dict[str, Any]:
        return {**super().wire_fields(), "holder": self.holder}

    @classmethod
    def from_wire(cls, message: str, fields: dict[str, Any]) -> CkptDBError:
        return cls(message, holder=fields.get("holder"))


class RunTakenOverError(LedgerLockedError):
    """The run was restored on another machine: a replicator on this one stops, since
    its copies would collide with the new machine's and its removals could remove
    them (see docs/replication.md, "Never back in time")."""


class WriterLockLostError(LedgerError):
    """The connection holding a PostgreSQL run's writer lock was lost; reopen the run."""


class NetworkFilesystemError(InvalidArgumentError):
    """A SQLite ledger would live on a network filesystem, where its locking is unsafe."""


class RunDirectoryError(CkptDBError, OSError):
    """The run root cannot hold a run (a file, not writable, lock file unusable), or its
    save directory (or a stream directory in it) is missing while the ledger records
    checkpoints in it."""


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

    ``phase`` names the protocol phase that failed (``intent``, ``snapshot``,
    ``write``, ``fsync``, ``complete`` and ``verify`` (object storage), ``replace``,
    ``fsync_dir``, ``commit``), ``path``
    the file it was working on, and ``cleanup_failures`` any leftover that
    could not be removed afterwards (those are recorded for the next
    reconcile). The original exception is ``__cause__``.
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

    def wire_message(self) -> str:
        return Exception.__str__(self)  # the cleanup failures travel as fields

    def wire_fields(self) -> dict[str, Any]:
        failures = [
            (str(f.path), type(f.error).__name__, str(f.error), f.action)
            for f in self.cleanup_failures
        ]
        own: dict[str, Any] = {"phase": self.phase, "step": self.step, "stream": self.stream}
        if self.path is not None:
            own["path"] = str(self.path)
        if failures:
            own["cleanup_failures"] = failures
        return {**super().wire_fields(), **own}

    @classmethod
    def from_wire(cls, message: str, fields: dict[str, Any]) -> CkptDBError:
        failures = [
            CleanupFailure(Path(path), _builtin_error(kind, text), action)
            for path, kind, text, action in fields.get("cleanup_failures", [])
        ]
        return cls(
            message,
            phase=fields.get("phase", "write"),
            step=fields.get("step", -1),
            path=Path(fields["path"]) if fields.get("path") else None,
            stream=fields.get("stream"),
            cleanup_failures=failures,
        )


class LedgerUnavailableError(PublishError, ConnectionError):
    """A boundary failed because the ledger could not be reached: a PostgreSQL server
    restarting or failing over, a network blip, a SQLite file locked past its busy
    timeout. Nothing was published; training can go on, and the next boundary
    tries again (the manager reconnects, and takes its writer lock back when no
    other writer took the run). ``__cause__`` is the driver's error.
    """

    def __str__(self) -> str:
        # the rollback could not be recorded either (the rows stay pending for the next
        # reconcile, which is the expected outcome here): only other leftovers are said
        text = Exception.__str__(self)
        others = [f for f in self.cleanup_failures if not f.action.startswith("record")]
        if others:
            leftovers = "; ".join(str(f) for f in others)
            text += f" (cleanup also failed, left for the next reconcile: {leftovers})"
        return text


class CommitOutcomeUnknownError(LedgerUnavailableError):
    """The ledger stopped answering while a boundary's COMMIT was on its way: the
    boundary may be committed or not, and no one can tell until the ledger
    answers again. Its files are left in place. The manager settles it by
    reading the ledger back at its next boundary (or at close; else the next
    open's reconcile does): committed, it stands; not, it is rolled back.
    """


class PhaseError(CkptDBError, OSError):
    """An OS-level failure in one protocol phase, before the boundary wraps it.

    ``cleanup_error`` is set when a half-made directory could not be removed.
    """

    def __init__(self, phase: str, path: Path, error: BaseException) -> None:
        super().__init__(f"{phase} failed at {path}: {type(error).__name__}: {error}")
        self.phase = phase
        self.path = path
        self.error = error
        self.cleanup_error: OSError | None = None

    def __str__(self) -> str:
        text = super().__str__()
        if self.cleanup_error is not None:
            text += f" (and removing it failed: {self.cleanup_error})"
        return text

    def wire_fields(self) -> dict[str, Any]:
        return {**super().wire_fields(), "phase": self.phase, "path": str(self.path)}


class PhaseFailure(Exception):
    """Internal: an unexpected error in a phase that has no file path (commit, snapshot).

    Never escapes a boundary: the rollback turns it into a :class:`PublishError`.
    """

    def __init__(self, phase: str, error: BaseException) -> None:
        super().__init__(str(error))
        self.phase = phase
        self.error = error


class ForeignEntryError(CkptDBError, OSError):
    """A link or special file inside a checkpoint directory: it was not written by us."""


class NonFiniteGradientError(CkptDBError, FloatingPointError):
    """The non-finite gradient guard tripped: the boundary was not published."""

    def __init__(self, message: str, *, step: int, parameters: list[str] | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.parameters = list(parameters or [])

    def wire_fields(self) -> dict[str, Any]:
        return {**super().wire_fields(), "step": self.step, "parameters": self.parameters}

    @classmethod
    def from_wire(cls, message: str, fields: dict[str, Any]) -> CkptDBError:
        return cls(message, step=fields.get("step", -1), parameters=fields.get("parameters"))


class CheckpointNotFoundError(CkptDBError, LookupError):
    """No committed checkpoint matches the request."""


class NoCheckpointToResumeError(CheckpointNotFoundError, ValueError):
    """A resume was asked for and the ledger has no committed checkpoint that fits.

    Also a ``ValueError``: the Hugging Face Trainer raises one when
    ``resume_from_checkpoint=True`` finds nothing, and callers catch that.
    """


class CheckpointLostError(CheckpointNotFoundError, FileNotFoundError):
    """A committed checkpoint's file is gone (the row is marked ``lost``)."""


class CorruptCheckpointError(CkptDBError, OSError):
    """A checkpoint file's size or hash differs from its ledger row."""


class LedgerReplicaNotFoundError(CkptDBError, FileNotFoundError):
    """A remote tier holds no copy of the ledger to restore (of the run asked for)."""


class CorruptLedgerReplicaError(CkptDBError, OSError):
    """A copy of the ledger on a remote tier is damaged: not the bytes its manifest
    records, or not a sound SQLite database. A restore never uses one."""


class RestoreTargetError(CkptDBError, FileExistsError):
    """A restore from a URL alone would write into a directory that is not empty."""


class ExportTargetError(CkptDBError, FileExistsError):
    """An export would write into a directory that is not empty (or is a checkpoint's
    own save directory): an export never overwrites files."""


class ObjectStoreError(CkptDBError, OSError):
    """An object-store request failed after its retries (or the store cannot be used).

    The message names the operation, the key and the store's error code;
    it never carries credentials.
    """


class ConditionalWritesUnsupportedError(ObjectStoreError):
    """The object store ignores ``If-None-Match: *``: a write could overwrite an object.

    Found by the probe when a run opens on object storage; the opt-out is
    ``storage_options={"require_conditional_writes": False}``.
    """


class MissingExtraError(CkptDBError, ImportError):
    """An optional dependency is missing (e.g. ``pip install 'ckptdb[s3]'``)."""


class UnsupportedVersionError(CkptDBError, RuntimeError):
    """A framework version the integration was not built and tested against.

    An integration that reaches into a framework's internals (DeePMD-kit's
    ``Trainer``) refuses other versions rather than run unguarded; the
    message names the supported range.
    """


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


class CleanupWarning(UserWarning):
    """An evicted or leftover file could not be removed (the next reconcile retries)."""


def note_on(primary: BaseException, note: str) -> None:
    """Attach a secondary failure's ``note`` to ``primary``, the error the caller gets.

    Why one helper: a failure met while handling another (a close, a rollback, a
    second clean-up) must never replace the first, nor be dropped. Python 3.10
    has no exception notes, so there the note goes to the log instead.
    """
    add_note = getattr(primary, "add_note", None)
    if add_note is not None:
        add_note(note)
    else:
        log.error("ckptdb: %s (while raising %s)", note, type(primary).__name__)


def warn_cleanup(message: str) -> None:
    """Report a clean-up that failed: it does not fail the call (the next reconcile retries).

    The warning points at the caller's line (the first frame outside ckptdb),
    wherever inside the protocol the clean-up ran.
    """
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and _inside(frame.f_code.co_filename, package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, CleanupWarning, stacklevel=level + 1)


def _inside(filename: str, package: str) -> bool:
    """Whether a frame belongs to ckptdb (its own files, or the context managers
    its transactions run their post-commit work from)."""
    return os.path.abspath(filename).startswith(package) or filename == contextlib.__file__


# ------------------------------------------------------------------ wire form


@dataclass(frozen=True)
class WireError:
    """One rank's failure, as data every rank can turn back into the same exception."""

    rank: int
    kind: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)
    ranks: tuple[int, ...] = ()  # the ranks that failed, when one error speaks for several

    @property
    def stage(self) -> int:
        return int(self.fields.get("stage") or 0)


# Internal errors never reach a caller as themselves: they decode as PublishError
# (with their phase and path), the error a failed boundary raises.
_INTERNAL = ("PhaseError",)


def _error_kinds() -> dict[str, type[CkptDBError]]:
    """Every public error class of this module, by name."""
    found: dict[str, type[CkptDBError]] = {}
    for value in globals().values():
        if isinstance(value, type) and issubclass(value, CkptDBError):
            found[value.__name__] = value
    for name in _INTERNAL:
        del found[name]
    return found


def encode(rank: int, exc: BaseException, fallback: str = "PublishError") -> WireError:
    """``exc`` as a :class:`WireError`; an error that is not ours becomes ``fallback``."""
    if isinstance(exc, CkptDBError):
        ranks = tuple(exc.ranks or (rank,))
        return WireError(rank, type(exc).__name__, exc.wire_message(), exc.wire_fields(), ranks)
    return WireError(rank, fallback, f"{type(exc).__name__}: {exc}", {}, (rank,))


def decode(wire: WireError) -> CkptDBError:
    """The exception every rank raises for ``wire``: the same type, message and fields,
    with the failing rank(s) named in the message and in ``ranks``."""
    cls = _error_kinds().get(wire.kind, PublishError)
    ranks = wire.ranks or (wire.rank,)
    where = ", ".join(str(r) for r in ranks)
    message = wire.message if "rank " in wire.message else f"rank {where}: {wire.message}"
    exc = cls.from_wire(message, wire.fields)
    exc.ranks = list(ranks)
    exc.stage = wire.fields.get("stage")  # declared on every error, restored for all
    return exc


def _builtin_error(kind: str, text: str) -> BaseException:
    """An error of the built-in type named ``kind`` (OSError subclasses), else RuntimeError."""
    cls = getattr(builtins, kind, None)
    if isinstance(cls, type) and issubclass(cls, OSError):
        return cls(text)
    return RuntimeError(f"{kind}: {text}")


__all__ = [
    "ArgumentTypeError",
    "CheckpointLostError",
    "CheckpointNotFoundError",
    "ChiefOnlyError",
    "CkptDBError",
    "CleanupFailure",
    "CleanupWarning",
    "ConditionalWritesUnsupportedError",
    "CorruptCheckpointError",
    "CorruptLedgerReplicaError",
    "DatabaseError",
    "ExportTargetError",
    "ForeignEntryError",
    "InvalidArgumentError",
    "InvalidMetricError",
    "LayoutMismatchError",
    "LedgerError",
    "LedgerLockedError",
    "LedgerReplicaNotFoundError",
    "MissingExtraError",
    "NetworkFilesystemError",
    "NonFiniteGradientError",
    "ObjectStoreError",
    "PublishError",
    "RankAgreementError",
    "RankFailedError",
    "RestoreTargetError",
    "RunDirectoryError",
    "RunTakenOverError",
    "SchemaVersionError",
    "UnknownStreamError",
    "UnsupportedVersionError",
    "WireError",
    "WriterLockLostError",
    "decode",
    "encode",
]
