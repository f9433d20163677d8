"""Exports: a committed checkpoint handed to the ecosystem as Hugging Face safetensors.

An export is a derivative of one checkpoint, recorded in the ledger like the
checkpoint itself: it is written through a temporary directory beside its
target, every file fsynced and measured, moved into place by one rename, and
recorded (source checkpoint, files, sizes, hashes, format) in one
transaction. A crash before the rename leaves only the hidden temporary
(removed by the next export to the same target); a failed record removes the
placed directory again. So a recorded export is always whole, and nothing
recorded names a partial one. The source checkpoint is verified against its
row before a byte of it is read.

:meth:`ckptdb.RunReader.export` and ``ckptdb export`` are the entry points;
:mod:`.sources` reads the checkpoint, :mod:`.writing` lays out the files,
:mod:`.safetensors` writes the format one tensor at a time.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ExportTargetError, InvalidArgumentError, note_on
from ..location import ObjectPath
from ..record import Export, ExportedFile
from ..storage import files
from ..storage.base import PayloadStore
from .writing import DEFAULT_MAX_SHARD_SIZE, size_in_bytes, write_export

#: The formats an export writes.
FORMATS = ("safetensors",)
#: The hidden temporary an export is written into, beside its target.
TEMP_MARK = ".ckptdb-export-"


@dataclass(frozen=True)
class Written:
    """A complete export in place, before its row is recorded."""

    path: Path
    files: list[ExportedFile]
    size: int
    hash: str
    tensors: int


@dataclass(frozen=True)
class ExportResult:
    """What :meth:`~ckptdb.RunReader.export` did.

    Attributes:
        export: The export as the ledger recorded it (its path, files, size, hash
            and number of tensors).
        skipped: The checkpoint's entries that are not tensors, left out.
        aliases: Names that alias a tensor already written (tied weights), each
            written once: ``{name left out: name kept}``.
    """

    export: Export
    skipped: tuple[str, ...]
    aliases: dict[str, str]


@dataclass(frozen=True)
class Options:
    """How to export (checked before anything is read or written)."""

    to: Path
    format: str = "safetensors"
    key: str | None = None
    max_shard_size: int = size_in_bytes(DEFAULT_MAX_SHARD_SIZE)
    trust_pickle: bool = False

    @classmethod
    def of(
        cls,
        to: str | os.PathLike[str],
        fmt: str,
        key: str | None,
        max_shard_size: int | str,
        trust_pickle: bool,
    ) -> Options:
        if fmt not in FORMATS:
            raise InvalidArgumentError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        if key is not None and (not isinstance(key, str) or not key):
            raise InvalidArgumentError(f"key must be a non-empty str, got {key!r}")
        if not isinstance(to, (str, os.PathLike)):
            raise InvalidArgumentError(f"to must be a directory path, got {to!r}")
        return cls(
            Path(os.path.abspath(Path(to).expanduser())),
            fmt,
            key,
            size_in_bytes(max_shard_size),
            bool(trust_pickle),
        )


def check_target(to: Path, save_dir: Path) -> None:
    """Refuse a target that is not absent or an empty directory, or lies in the run."""
    if not isinstance(save_dir, ObjectPath):
        base = os.path.abspath(save_dir)
        if os.path.commonpath([str(to), base]) == base:
            raise ExportTargetError(
                f"{to} is inside the run's save directory {save_dir}: export elsewhere"
            )
    if to.is_symlink() or (to.exists() and not to.is_dir()):
        raise ExportTargetError(f"{to} exists and is not a directory; an export never overwrites")
    if to.is_dir() and any(to.iterdir()):
        raise ExportTargetError(f"{to} is not empty; an export never overwrites files")


def export_payload(
    store: PayloadStore,
    rel: str,
    options: Options,
    record: Callable[[Written], Export],
) -> ExportResult:
    """Export the verified payload ``rel`` of ``store`` into ``options.to`` and record it
    with ``record`` (one transaction); see the module doc for what a crash leaves."""
    from .sources import open_source  # torch: only an export needs it, not a reader

    source = open_source(store, rel, options.key, options.trust_pickle)
    if not source.specs:
        raise InvalidArgumentError(f"{rel} holds no tensors to export")
    files.make_dir(options.to.parent)
    given_empty = options.to.is_dir()  # the user's own empty directory: put back on undo
    _remove_stale_temps(options.to)
    tmp = options.to.parent / f".{options.to.name}{TEMP_MARK}{socket.gethostname()}-{os.getpid()}"
    files.remove(tmp)  # this very process's, from an export it was interrupted in
    tmp.mkdir()
    try:
        written = write_export(source, tmp, options.max_shard_size)
        files.fsync_dir(tmp)
        files.rename_durably(tmp, options.to)  # onto an empty directory too
    except BaseException as exc:
        _undo(tmp, exc)
        raise
    total = files.combine((f.name, files.FileInfo(f.size, f.hash)) for f in written)
    try:
        export = record(Written(options.to, written, total.size, total.hash, len(source.specs)))
    except BaseException as exc:
        _undo(options.to, exc)  # nothing recorded names it: it must not stay
        if given_empty:
            options.to.mkdir(exist_ok=True)
        raise
    return ExportResult(export, tuple(source.skipped), dict(source.aliases))


def _undo(path: Path, primary: BaseException) -> None:
    try:
        files.remove(path)
        files.fsync_dir(path.parent)
    except BaseException as cleanup:
        note_on(primary, f"and {path} could not be removed: {cleanup!r}")


def _remove_stale_temps(to: Path) -> None:
    """Temporaries an export to ``to`` left on this host when its process died."""
    host = socket.gethostname()
    prefix = f".{to.name}{TEMP_MARK}{host}-"
    try:
        found = [p for p in to.parent.iterdir() if p.name.startswith(prefix)]
    except FileNotFoundError:
        return
    for path in found:
        pid = path.name[len(prefix) :]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            files.remove(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


__all__ = ["FORMATS", "ExportResult", "Options", "Written", "check_target", "export_payload"]
