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
    """Base class of every error raised by ckptdb.

    Catch it to handle any ckptdb failure at once; each subclass also derives
    from the built-in exception it naturally is (``ValueError``, ``OSError``,
    ``RuntimeError``...), so an existing ``except`` clause keeps working. The
    fields below are declared on every error, never attached after the fact,
    and travel with it between the ranks of a distributed run (see
    :func:`encode` and :func:`decode`).
    """

    #: The ranks whose failure this is (set when ranks agreed on the error).
    ranks: list[int] | None = None
    #: Which preflight check objected: 0 bad input, 1 guard, 2 ranking metric.
    stage: int | None = None
    #: The rollback's own failure, when the error must propagate as itself.
    rollback: CkptDBError | None = None

    def wire_fields(self) -> dict[str, Any]:
        """This error's fields as plain data, for sending to other ranks.

        :func:`encode` calls it; a subclass with fields of its own adds them
        here, and :meth:`from_wire` reads them back, so that every rank raises
        the same error with the same fields even where the original could not
        be pickled.

        Returns:
            The fields as a dict of plain (picklable, JSON-like) values: here
            ``stage`` when it is set, else an empty dict.
        """
        return {} if self.stage is None else {"stage": self.stage}

    @classmethod
    def from_wire(cls, message: str, fields: dict[str, Any]) -> CkptDBError:
        """Rebuild an error of this class from its message and :meth:`wire_fields`.

        :func:`decode` calls it on the class the wire names; a subclass whose
        constructor takes fields overrides it to pass them back in.

        Args:
            message: The error's message, as :meth:`wire_message` gave it
                (with the failing ranks prefixed by :func:`decode`).
            fields: What :meth:`wire_fields` returned on the failing rank; the
                base class uses none of them (:func:`decode` restores
                ``stage`` and ``ranks`` itself).

        Returns:
            A new error of this class, not yet raised.
        """
        return cls(message)

    def wire_message(self) -> str:
        """The message to send to other ranks.

        It leaves out any text that :meth:`from_wire` adds back from the
        fields, so that a decoded error does not say it twice.

        Returns:
            The message: here ``str(self)``.
        """
        return str(self)


class InvalidArgumentError(CkptDBError, ValueError):
    """An argument has a bad value (policy, stream name, step, path...).

    Bad input is refused where it is checked, up front wherever it can be,
    so the call can be made again with a corrected argument. Also a
    ``ValueError``.
    """


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type (a float step, a bool metric...).

    An :class:`InvalidArgumentError` that is also a ``TypeError``, so either
    ``except`` clause catches it.
    """


class InvalidMetricError(InvalidArgumentError):
    """A metric a top-K stream ranks by is missing or not a finite real number.

    Raised by the save's preflight checks, before anything is written, so a
    bad metric never enters a ranking (``stage`` 2). Also a ``ValueError``.
    """


class LayoutMismatchError(InvalidArgumentError):
    """What a sharded load asks for does not match the checkpoint.

    A key the checkpoint lacks (a per-rank entry of a rank the saving job did
    not have), a tensor of another global shape, or a tensor where it saved
    something else. Raised on every rank before anything loads, naming each
    rank (``ranks``), what it lacks and both world sizes (see
    :mod:`ckptdb.storage.topology`). A missing key is accepted with
    ``load(..., missing_keys="keep")``; a shape mismatch never is.
    """


class UnknownStreamError(InvalidArgumentError):
    """A payload or query names a stream that is not configured for the run.

    The message lists the run's streams, so a typo is easy to spot. Also a
    ``ValueError``.
    """


class LedgerError(CkptDBError, RuntimeError):
    """The ledger cannot be used (closed manager, unreachable database...).

    Also raised when a root holds no ckptdb run, or a ledger URL cannot be
    opened (a missing driver names the extra to install). Also a
    ``RuntimeError``.
    """


class DatabaseError(LedgerError):
    """A database operation failed (a locked SQLite file, a lost connection...).

    The ledger package raises it for every driver error, in one place, so a
    bare driver exception never escapes ckptdb.

    Args:
        message: What failed, with the ledger's URL stripped of credentials.
        original: The driver's error (also ``__cause__``); None when there is
            none. Kept as the ``original`` attribute.
    """

    def __init__(self, message: str, original: BaseException | None = None) -> None:
        super().__init__(message)
        self.original = original


class LedgerLockedError(LedgerError):
    """Another process holds the run's writer lock.

    A run has one writer at a time: the lock file ``<root>/ckptdb.lock``
    (with a PostgreSQL ledger, a session advisory lock). Raised by a second
    writer's open, by :meth:`ckptdb.RunReader.check` while a trainer runs, and
    by a second replicator or tracker follower of the same run. Readers never
    need the lock.

    Args:
        message: Who holds the lock, as far as it is known.
        holder: What is known of the holder (``pid``, ``host``; ``since`` for
            the file lock, ``backend_pid`` and ``client_addr`` on PostgreSQL);
            None or empty when nothing is. Kept as the ``holder`` attribute.
    """

    def __init__(self, message: str, holder: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.holder = holder or {}

    def wire_fields(self) -> dict[str, Any]:
        """This error's fields as plain data, for sending to other ranks.

        Returns:
            The base fields and ``holder``.
        """
        return {**super().wire_fields(), "holder": self.holder}

    @classmethod
    def from_wire(cls, message: str, fields: dict[str, Any]) -> CkptDBError:
        """Rebuild the error from its message and :meth:`wire_fields`.

        Args:
            message: The error's message.
            fields: The sent fields; ``holder`` is read from them.

        Returns:
            A new :class:`LedgerLockedError` (or subclass), not yet raised.
        """
        return cls(message, holder=fields.get("holder"))


class RunTakenOverError(LedgerLockedError):
    """The run was restored on another machine: a replicator on this one stops.

    Its copies would collide with the new machine's, and its removals could
    remove them, so it stops before it copies or removes anything (see
    docs/replication.md, "Never back in time").
    """


class WriterLockLostError(LedgerError):
    """The connection holding a PostgreSQL run's writer lock was lost; reopen the run.

    Without the lock another writer may have taken the run, so this manager
    is fenced off and commits nothing more; close it and open the run again.
    """


class NetworkFilesystemError(InvalidArgumentError):
    """A SQLite ledger would live on a network filesystem, where its locking is unsafe.

    SQLite's locking is unreliable there and the ledger can be corrupted.
    Use a PostgreSQL ledger, or keep the checkpoints there and put the ledger
    on a local disk; the message names the opt-out for those who accept the
    risk. Readers are refused it too for their own rows (pins, evaluations).
    """


class RunDirectoryError(CkptDBError, OSError):
    """The run root cannot hold a run, or its save directory is missing.

    The root is a file, is not writable, or its lock file is unusable; or the
    save directory (or a stream directory in it) is not there while the
    ledger records checkpoints in it (not mounted?). Also an ``OSError``.
    """


class SchemaVersionError(LedgerError):
    """The ledger's schema is not the one this version of ckptdb reads.

    A ledger written by a newer ckptdb needs a newer ckptdb. One written by
    an older release is refused to a reader, which never migrates: the
    message names what to run (``ckptdb db upgrade ROOT``, or open the run
    once with a :class:`~ckptdb.CheckpointManager`).
    """


@dataclass(frozen=True)
class CleanupFailure:
    """A leftover that could not be removed (or recorded) after a failure, and why.

    Listed in :attr:`PublishError.cleanup_failures`; the leftovers are
    recorded for the next reconcile, which removes them.

    Attributes:
        path: The file or directory left behind.
        error: Why removing (or recording) it failed.
        action: What was attempted: ``"remove"`` by default, or a
            ``"record..."`` action when the ledger could not record it.
    """

    path: Path
    error: BaseException
    action: str = "remove"

    def __str__(self) -> str:
        return f"{self.action} {self.path}: {type(self.error).__name__}: {self.error}"


class PublishError(CkptDBError, RuntimeError):
    """A boundary failed before its commit; the ledger is as it was before.

    Nothing of the boundary was published, so the previous checkpoints stand
    and the save can be retried. The original exception is ``__cause__``;
    ``str()`` adds the cleanup failures, if any.

    Args:
        message: What failed.
        phase: The protocol phase that failed: ``intent``, ``snapshot``,
            ``mkdir``, ``write``, ``fsync``, ``complete`` and ``verify`` (object
            storage), ``deadline`` (a preemption's grace period ran out before
            the commit), ``replace``, ``fsync_dir`` or ``commit``.
        step: The step of the boundary.
        path: The file it was working on; None for a phase without one.
        stream: The stream of that file; None when the failure is not one
            stream's.
        cleanup_failures: Any leftover that could not be removed afterwards
            (those are recorded for the next reconcile); None for none.
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
        """The message to send to other ranks, without the cleanup failures.

        Returns:
            The bare message: the cleanup failures travel as fields.
        """
        return Exception.__str__(self)  # the cleanup failures travel as fields

    def wire_fields(self) -> dict[str, Any]:
        """This error's fields as plain data, for sending to other ranks.

        Returns:
            The base fields with ``phase``, ``step``, ``stream``, ``path``
            (when set) and ``cleanup_failures`` (when any, as tuples of path,
            error type name, error text and action).
        """
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
        """Rebuild the error from its message and :meth:`wire_fields`.

        A cleanup failure's error comes back as the built-in ``OSError``
        subclass it named, else as a ``RuntimeError`` carrying its type's name.

        Args:
            message: The error's message.
            fields: The sent fields; a missing ``phase`` reads as ``write``,
                a missing ``step`` as -1.

        Returns:
            A new :class:`PublishError` (or subclass), not yet raised.
        """
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
    """A boundary failed because the ledger could not be reached.

    A PostgreSQL server restarting or failing over, a network blip, a SQLite
    file locked past its busy timeout. Nothing was published; training can go
    on, and the next boundary tries again (the manager reconnects, and takes
    its writer lock back when no other writer took the run). ``__cause__`` is
    the driver's error. Also a ``ConnectionError``.
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
    """The ledger stopped answering while a boundary's COMMIT was on its way.

    The boundary may be committed or not, and no one can tell until the
    ledger answers again. Its files are left in place. The manager settles it
    by reading the ledger back at its next boundary (or at close; else the
    next open's reconcile does): committed, it stands; not, it is rolled back.
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
    """A link or special file inside a checkpoint directory: it was not written by us.

    ckptdb never follows it (it could point anywhere), and the checkpoint
    counts as corrupt. Also an ``OSError``.
    """


class NonFiniteGradientError(CkptDBError, FloatingPointError):
    """The non-finite gradient guard tripped: the boundary was not published.

    The previous checkpoints stand, so a resume starts from weights that
    were still finite. Also a ``FloatingPointError``.

    Args:
        message: What the guard found.
        step: The step whose boundary was refused.
        parameters: The names of the parameters with non-finite gradients;
            None for none named. Kept as the ``parameters`` attribute (a list).
    """

    def __init__(self, message: str, *, step: int, parameters: list[str] | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.parameters = list(parameters or [])

    def wire_fields(self) -> dict[str, Any]:
        """This error's fields as plain data, for sending to other ranks.

        Returns:
            The base fields with ``step`` and ``parameters``.
        """
        return {**super().wire_fields(), "step": self.step, "parameters": self.parameters}

    @classmethod
    def from_wire(cls, message: str, fields: dict[str, Any]) -> CkptDBError:
        """Rebuild the error from its message and :meth:`wire_fields`.

        Args:
            message: The error's message.
            fields: The sent fields; a missing ``step`` reads as -1.

        Returns:
            A new :class:`NonFiniteGradientError`, not yet raised.
        """
        return cls(message, step=fields.get("step", -1), parameters=fields.get("parameters"))


class CheckpointNotFoundError(CkptDBError, LookupError):
    """No committed checkpoint matches the request.

    Raised for ``"latest"`` or ``"best"`` of a stream with nothing committed,
    a step or path the ledger has no committed checkpoint for, and a
    checkpoint whose row is not ``committed`` (evicted, lost, corrupt) where
    only a committed one will do. Also a ``LookupError``.
    """


class NoCheckpointToResumeError(CheckpointNotFoundError, ValueError):
    """A resume was asked for and the ledger has no committed checkpoint that fits.

    Also a ``ValueError``: the Hugging Face Trainer raises one when
    ``resume_from_checkpoint=True`` finds nothing, and callers catch that.
    """


class CheckpointLostError(CheckpointNotFoundError, FileNotFoundError):
    """A committed checkpoint's file is gone.

    The run's writer marks the row ``lost`` (at its next load or reconcile;
    a reader never writes the row), and ``latest`` falls back to the newest
    checkpoint still there. Also a ``FileNotFoundError``.
    """


class CorruptCheckpointError(CkptDBError, OSError):
    """A checkpoint file's size or hash differs from its ledger row.

    Raised before anything is unpickled, so a damaged file is never loaded.
    The run's writer marks the row ``corrupt`` (at its next load of it or
    ``reconcile --verify``; a reader never writes the row). Also an
    ``OSError``.
    """


class LedgerReplicaNotFoundError(CkptDBError, FileNotFoundError):
    """A remote tier holds no copy of the ledger to restore (of the run asked for).

    When the URL holds other runs' ledgers, the message names them. Nothing
    was written. Also a ``FileNotFoundError``.
    """


class CorruptLedgerReplicaError(CkptDBError, OSError):
    """A copy of the ledger on a remote tier is damaged.

    Not the bytes its manifest records, or not a sound SQLite database. A
    restore never uses one; it raises this when every copy is damaged, each
    reason noted on it. Also an ``OSError``.
    """


class RestoreTargetError(CkptDBError, FileExistsError):
    """A restore from a URL alone would write into a directory that is not empty.

    Raised before anything is written, so no existing file is overwritten.
    Also a ``FileExistsError``.
    """


class ExportTargetError(CkptDBError, FileExistsError):
    """An export would write where it must not: an export never overwrites files.

    Raised when the target is a directory that is not empty, an existing
    file or link, or lies inside the run's save directory; before anything
    is read or written. Also a ``FileExistsError``.
    """


class ObjectStoreError(CkptDBError, OSError):
    """An object-store request failed after its retries (or the store cannot be used).

    The message names the operation, the key and the store's error code;
    it never carries credentials. Inside a boundary it is the ``__cause__``
    of a :class:`PublishError`. Also an ``OSError``.
    """


class ConditionalWritesUnsupportedError(ObjectStoreError):
    """The object store ignores ``If-None-Match: *``: a write could overwrite an object.

    Found by the probe when a run opens on object storage; the opt-out is
    ``storage_options={"require_conditional_writes": False}``.
    """


class MissingExtraError(CkptDBError, ImportError):
    """An optional dependency is missing (e.g. ``pip install 'ckptdb[s3]'``).

    The message names the extra that installs it. Also an ``ImportError``.
    """


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
    """A ledger-maintenance call (reconcile, gc, check) made on a rank other than the chief.

    Only the chief (rank 0) holds the ledger, so only it may maintain the
    run; guard such calls with ``mgr.is_chief``. Also a ``RuntimeError``.
    """


class CleanupWarning(UserWarning):
    """An evicted or leftover file could not be removed (the next reconcile retries).

    A warning, not an error: the call that met it succeeded. It points at
    the caller's line (the first frame outside ckptdb), wherever inside the
    protocol the clean-up ran.
    """


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
    """One rank's failure, as data every rank can turn back into the same exception.

    Made by :func:`encode` and turned back by :func:`decode`; it holds only
    plain data, so it crosses ``torch.distributed`` collectives even where
    the original exception could not be pickled.

    Attributes:
        rank: The rank that failed.
        kind: The name of the error class (a :class:`CkptDBError` subclass).
        message: The error's message (:meth:`CkptDBError.wire_message`).
        fields: The error's fields (:meth:`CkptDBError.wire_fields`).
        ranks: The ranks that failed, when one error speaks for several;
            empty means ``rank`` alone.
    """

    rank: int
    kind: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)
    ranks: tuple[int, ...] = ()  # the ranks that failed, when one error speaks for several

    @property
    def stage(self) -> int:
        """Which preflight check objected: 0 (also when unset) bad input, 1 guard, 2 metric."""
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
    """Turn an exception into a :class:`WireError` that every rank can decode.

    A :class:`CkptDBError` keeps its class, message and fields, and the ranks
    it already names. Any other exception is sent as ``fallback``, its
    message prefixed with its type's name, so every rank raises a typed
    ckptdb error for it.

    Args:
        rank: The rank the error happened on.
        exc: The exception to send.
        fallback: The name of the :class:`CkptDBError` class that stands for an
            exception that is not ckptdb's (default ``"PublishError"``).

    Returns:
        The error as plain data.
    """
    if isinstance(exc, CkptDBError):
        ranks = tuple(exc.ranks or (rank,))
        return WireError(rank, type(exc).__name__, exc.wire_message(), exc.wire_fields(), ranks)
    return WireError(rank, fallback, f"{type(exc).__name__}: {exc}", {}, (rank,))


def decode(wire: WireError) -> CkptDBError:
    """The exception every rank raises for ``wire``.

    The same type, message and fields on every rank, with the failing
    rank(s) named in the message (unless it already names a rank) and in
    ``ranks``; ``stage`` is restored too. A kind this module does not know,
    or an internal one, comes back as :class:`PublishError`.

    Args:
        wire: What :func:`encode` made on the failing rank.

    Returns:
        A new exception, not yet raised.
    """
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
