"""Payloads that something else writes: a framework's own files and directories.

Frameworks write checkpoints themselves, under names of their own: Lightning's
``epoch=3-step=40.ckpt``, Hugging Face's ``checkpoint-500/``. An
:class:`External` payload hands such a writer a temporary path that ckptdb
chose; the writer creates a file or a directory there, and ckptdb does the
rest exactly as for its own payloads (intent row first, fsync of every file
and directory, size and hash, placement under the framework's name, one
commit). The name is the framework's, so the files look as its users expect;
the ledger row, not the name, decides visibility.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import ArgumentTypeError, InvalidArgumentError, PhaseError
from .files import (
    FileInfo,
    fsync_dir,
    fsync_file,
    hash_checkpoint,
    hash_open_file,
    sync_data,
    tree_files,
)
from .naming import CHECKPOINT_NAME, SHARDED_SUFFIX, TEMP_NAME

#: The temporary name's marker: ``.<name>.ckptdb-tmp-<row id>`` next to the final name.
EXTERNAL_TEMP = re.compile(r"\..+\.ckptdb-tmp-(\d+)")


@dataclass(frozen=True)
class External:
    """A payload written by ``write(path)`` and published as ``name``.

    ``mgr.save(step, model=ckptdb.External(lambda p: trainer.save_checkpoint(p),
    name="epoch=3-step=40.ckpt"))``. For frameworks that write their checkpoints
    themselves, under their own names, with the guarantees of ``mgr.save``: the
    intent row is recorded first, then ``write`` creates the payload under a
    temporary name (``<dir of name>/.<name>.ckptdb-tmp-<row id>``; a leftover there
    is removed first, never written through), and ckptdb fsyncs it (every file and
    directory of a tree), measures its size and hash, renames it to ``name`` and
    commits the row. The name is the framework's, so the files look as its users
    expect; the ledger row, not the name, decides visibility.

    A writer that raises, or that created nothing (or a link or special file),
    fails the boundary with ``PublishError(phase="write")`` and nothing is
    published. Something that appears at ``name`` while the writer runs is neither
    replaced (``PublishError(phase="replace")``) nor removed by the rollback. An
    External payload is written during the call, so ``blocking=False`` is refused,
    and two streams of one boundary cannot publish the same name. A published file
    loads with ``mgr.load`` like any ``torch.save`` file; a directory is verified
    but not unpickled: load it with its framework from ``checkpoint.path``.

    Attributes:
        write: Called with a path that does not exist yet; must create a file or a
            directory there. It runs on every rank (as framework savers with
            barriers inside need), so a writer that only the chief should run
            checks its rank itself. ckptdb fsyncs what was written; the writer need
            not. (A writer that wrote a single file through ckptdb's own durable
            writer, :func:`ckptdb.storage.files.write_stream`, which fsyncs and
            hashes as the bytes stream out, returns its ``FileInfo``; ckptdb then
            skips the second pass.)
        name: Where the payload is published, relative to the save directory; it
            may contain subdirectories. Checked at ``save`` (see :meth:`checked`).

    Raises:
        ArgumentTypeError: ``write`` is not callable, or ``name`` is not a str.
    """

    write: Callable[[Path], object]
    name: str

    def __post_init__(self) -> None:
        if not callable(self.write):
            raise ArgumentTypeError(f"External(write=...) must be callable, got {self.write!r}")
        if not isinstance(self.name, str):
            raise ArgumentTypeError(f"External(name=...) must be a str, got {self.name!r}")

    def checked(self) -> External:
        """Itself, once its name is known to be a name ckptdb may publish.

        ``save`` calls it in its preflight, so a bad name is refused before anything
        is recorded, not even the boundary's metrics.

        Returns:
            This payload, unchanged.

        Raises:
            InvalidArgumentError: ``name`` is not a usable file name (empty,
                surrounding spaces, a backslash or a NUL), escapes the save
                directory (absolute, or a ``..`` component), has an empty or
                ``.``-leading component, starts a component with ``ckptdb.``, is
                in ckptdb's own naming (``step-….pt``, its temporaries), or ends in
                ``.dcp``.
        """
        check_name(self.name)
        return self


def check_name(name: str) -> str:
    """Refuse a name that escapes the save directory or that ckptdb keeps for itself.

    Allowed: relative names of plain components (``epoch=3-step=40.ckpt``,
    ``run1/checkpoint-500``). Refused: absolute names, ``..``, empty or
    hidden components (ckptdb's temporaries start with a dot), ``ckptdb.*``
    (the ledger's own files), ckptdb's own naming scheme (``step-….pt``) and
    its sharded suffix ``.dcp``.
    """
    if not name or name != name.strip() or "\\" in name or "\x00" in name:
        raise InvalidArgumentError(f"External name {name!r} is not a usable file name")
    path = PurePosixPath(name)
    if path.is_absolute() or name.endswith("/"):
        raise InvalidArgumentError(f"External name {name!r} must be relative to the save directory")
    for part in name.split("/"):
        if part in ("", ".", "..") or part.startswith("."):
            raise InvalidArgumentError(
                f"External name {name!r}: {part!r} is not allowed (no '..', empty or "
                "hidden components: they could leave the save directory or look like "
                "ckptdb's temporaries)"
            )
        if part.startswith("ckptdb."):
            raise InvalidArgumentError(f"External name {name!r}: 'ckptdb.*' names are ckptdb's")
    if CHECKPOINT_NAME.fullmatch(path.name) or TEMP_NAME.fullmatch(path.name):
        raise InvalidArgumentError(
            f"External name {name!r} is in ckptdb's own naming; choose another name"
        )
    if path.name.endswith(SHARDED_SUFFIX):
        raise InvalidArgumentError(
            f"External name {name!r}: the suffix {SHARDED_SUFFIX!r} marks ckptdb's own "
            "sharded checkpoints, which are read back differently; choose another name"
        )
    return name


def temp_for(name: str, row_id: int) -> str:
    """The temporary name of an external payload: hidden, next to its final name."""
    path = PurePosixPath(name)
    return str(path.with_name(f".{path.name}.ckptdb-tmp-{row_id}"))


def seal_written(path: Path) -> FileInfo:
    """Make what a writer created at ``path`` durable and measure it.

    A file is fsynced; a directory has every file and every directory in it
    fsynced (a framework's writer may have synced nothing). A writer that
    created nothing, or a link or special file, fails the write phase.
    """
    try:
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            exists = os.path.lexists(path)
            raise FileNotFoundError(
                0,
                "the writer created a link or special file, not a file or directory"
                if exists
                else "the writer created nothing at the path it was given",
                str(path),
            )
        if path.is_file():
            with open(path, "rb", buffering=0) as f:
                sync_data(f.fileno(), path)
                return hash_open_file(f)
        for _, file in tree_files(path):
            fsync_file(file)
        for sub in [p for p in path.rglob("*") if p.is_dir()]:
            fsync_dir(sub)
        fsync_dir(path)
        return hash_checkpoint(path)
    except PhaseError:
        raise
    except OSError as exc:
        raise PhaseError("write", path, exc) from exc
