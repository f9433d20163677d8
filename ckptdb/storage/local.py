"""The payload store on a local (POSIX) filesystem: the first implementation of the seam.

Temporary objects are created exclusively next to their final name, fsynced,
moved into place with ``os.replace`` and made durable by fsyncing their
directory; nothing is ever deleted-then-renamed. Every relative name is
confined to the save directory (no ``..``, no symlinked directory out of it).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ForeignEntryError, InvalidArgumentError, PhaseError, RunDirectoryError
from ..policies import STREAM_NAME
from . import external, files
from .base import CORRUPT, LOST, Finding, Found, verdict
from .files import FileInfo
from .naming import CHECKPOINT_NAME, SHARDED_SUFFIX, TEMP_NAME

if TYPE_CHECKING:
    from .heldfile import HeldFile

#: A name confined in a stream's directory to check the directory itself.
_PROBE = "step-000000000.pt"


class LocalStore:
    """Payloads in ``<save_dir>/<stream>/``, as files or DCP directories."""

    renames = True
    #: A directory (a sharded checkpoint) is read by its path. A file verified with
    #: ``keep`` is loaded from the bytes that were hashed (:mod:`~ckptdb.storage.heldfile`),
    #: so every rank that loads a file verifies its own read (see the loader).
    reads_verified_bytes = False
    #: Local names are made free by rename and the ledger: no token in them.
    run_token: str | None = None
    kinds = frozenset({"torch", "dcp", "external"})

    def __init__(self, save_dir: Path) -> None:
        self.save_dir = save_dir
        self._pass = threading.local()  # directory resolutions, per thread in a pass
        self._loading = threading.local()  # a verify's held bytes, per loading thread

    @property
    def location(self) -> Path:
        return self.save_dir

    def path(self, rel: str | Path) -> Path:
        """The confined path of ``rel`` (see :func:`files.confine`)."""
        return files.confine(self.save_dir, rel, self._resolved)

    def local_path(self, rel: str) -> Path:
        return self.path(rel)

    def disowned(self, rel: str) -> bool:
        """Never: a local file is published by rename, so a write never meets another's."""
        return False

    @property
    def _resolved(self) -> dict[Any, Path] | None:
        """Directory resolutions memoized while this thread's pass walks many rows
        (reconcile, check); None outside one. Per thread: a save in another thread
        during a long check confines each of its names afresh, so a stream directory
        swapped for a link meanwhile is still refused."""
        resolved: dict[Any, Path] | None = getattr(self._pass, "resolved", None)
        return resolved

    @_resolved.setter
    def _resolved(self, value: dict[Any, Path] | None) -> None:
        self._pass.resolved = value

    @property
    def _held(self) -> tuple[str, HeldFile] | None:
        """The last full verify's bytes (``keep``) in this thread: threads that load
        through one manager at once never take (or drop) each other's bytes."""
        held: tuple[str, HeldFile] | None = getattr(self._loading, "held", None)
        return held

    @_held.setter
    def _held(self, value: tuple[str, HeldFile] | None) -> None:
        self._loading.held = value

    def forget_verified(self) -> None:
        self._held = None

    def open_verified(self, rel: str) -> HeldFile | None:
        """The bytes the last full :meth:`verify` of ``rel`` with ``keep`` hashed (handed
        out once, then dropped); None for a directory, which is read by its path."""
        held, self._held = self._held, None
        if held is not None and held[0] == rel:
            return held[1]
        if self.path(rel).is_dir():
            return None
        raise InvalidArgumentError(f"{rel} was not verified just before it was read")

    def memoized(self) -> AbstractContextManager[Any]:
        """A pass over many rows: directory resolutions are cached until it ends, for the
        thread that runs it (see :attr:`_resolved`)."""
        return _Memo(self)

    # ------------------------------------------------------------------ writing

    def prepare_stream(self, stream: str) -> None:
        """The stream's directory, created durably if missing; refused if it leads out of
        the save directory (a link put in its place): what lies outside is never ours to
        write, nor to evict or reconcile later, so nothing is written through it."""
        directory = self.save_dir / stream
        files.make_dir(directory)
        try:
            files.confine(self.save_dir, f"{stream}/{_PROBE}")
        except InvalidArgumentError as exc:
            raise PhaseError("mkdir", directory, exc) from exc

    def absent(self, directory: str = "") -> bool:
        """Not there, a link to nowhere (or a loop), or not a directory. A directory
        that cannot be looked at (no permission) is neither there nor absent: its
        error is raised, typed, rather than guessed either way."""
        path = self.save_dir / directory
        try:
            return not stat.S_ISDIR(os.stat(path).st_mode)  # follows a link
        except (FileNotFoundError, NotADirectoryError):
            return True
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return True
            raise RunDirectoryError(f"cannot look at the directory {path}: {exc}") from exc

    def prepare_parent(self, rel: str) -> None:
        files.make_dir(self.path(rel).parent)

    def exists(self, rel: str) -> bool:
        return os.path.lexists(self.save_dir / rel)

    def make_temp_dir(self, rel: str) -> None:
        files.make_dir(self._within(rel, "mkdir"))

    def write_object(self, rel: str, serialize: Callable[[Any], object]) -> FileInfo:
        return files.write_stream(serialize, self._within(rel, "write"))

    def dcp_writer(self, rel: str) -> Any:
        from . import dcp  # torch's: imported by a store that writes DCP, not by a reader

        return dcp.file_writer(self._within(rel, "write"))

    def dcp_reader(self, rel: str) -> Any:
        from . import dcp

        return dcp.file_reader(self.path(rel))

    def seal(self, rel: str) -> FileInfo:
        return files.seal_directory(self._within(rel, "fsync"))

    def seal_written(self, rel: str) -> FileInfo:
        return external.seal_written(self._within(rel, "fsync"))

    def place(self, tmp: str, final: str) -> None:
        files.place(self._within(tmp, "replace"), self._within(final, "replace"))

    def sync_placed(self, finals: list[str]) -> None:
        for directory in sorted({self._within(rel, "fsync_dir", parent=True) for rel in finals}):
            files.fsync_dir(directory)

    def _within(self, rel: str, phase: str, *, parent: bool = False) -> Path:
        """``rel``'s path, confined again at every step of a boundary (one ``lstat`` per
        directory part): a stream directory swapped for a link since the intent (or
        since the write) is never written, sealed, renamed or synced through."""
        try:
            path = self.path(rel)
        except InvalidArgumentError as exc:
            where = self.save_dir / rel
            raise PhaseError(phase, where.parent if parent else where, exc) from exc
        return path.parent if parent else path

    # ------------------------------------------------------------------ reading

    def verify(
        self, rel: str, size: int | None, digest: str | None, *, full: bool, keep: bool = False
    ) -> Finding | None:
        """The one place that sorts a bad payload into lost or corrupt.

        Gone: ``lost``. Unreadable (a permission, a path that escapes the save
        directory): ``lost`` too, since its bytes cannot be had. A link or
        special file inside a checkpoint directory, a size or (``full``) a
        hash that differs from the row: ``corrupt``. With ``full`` and ``keep`` a
        file is read once, hashed as it is read, and its bytes are held for
        :meth:`open_verified` (only if they match), so what is loaded is what
        was hashed, even if the file changes afterwards.
        """
        self._held = None
        try:
            actual, held = self._measure(rel, full=full, keep=keep)
        except FileNotFoundError as exc:
            return Finding(LOST, "file missing", missing=True, error=exc)
        except ForeignEntryError as exc:
            return Finding(CORRUPT, str(exc), error=exc)
        except (OSError, InvalidArgumentError) as exc:
            return Finding(LOST, f"unreadable: {exc}", error=exc)
        finding = verdict(actual, size, digest, full=full)
        if finding is None and held is not None:
            self._held = (rel, held)
        return finding

    def _measure(self, rel: str, *, full: bool, keep: bool) -> tuple[FileInfo, HeldFile | None]:
        """Size (and with ``full`` hash) of ``rel``; with ``keep`` a file's bytes, held."""
        if keep and full:
            path = self.path(rel)
            if not path.is_dir():
                from . import heldfile  # torch's reader: only for a load

                held = heldfile.read_held(path)
                return held.info, held
            return files.hash_checkpoint(path), None
        # by the path's text: reconcile measures, and check hashes, every committed file
        name = files.confined_name(self.save_dir, rel, self._resolved)
        if not full:
            return FileInfo(files.checkpoint_size(name), ""), None
        return files.hash_checkpoint(name), None

    def list_ours(self) -> Iterator[Found]:
        """Every entry named like ours, by stream then name.

        Only real directories with valid stream names are entered. A ``.pt``
        name counts only as a regular file and a sharded ``.dcp`` name only as
        a real directory: symlinks and anything else are never ours to touch.
        A directory that a stream's link in the save directory leads to is
        listed under the link's name, as the ledger names its files (listed
        under its own, they had no rows and were quarantined).
        """
        if not self.save_dir.is_dir():
            return
        linked = self._linked_streams()
        for stream_dir in sorted(os.scandir(self.save_dir), key=lambda e: e.name):
            name = stream_dir.name
            if stream_dir.is_symlink() or not stream_dir.is_dir():
                continue
            if not STREAM_NAME.fullmatch(name) or name.startswith("ckptdb."):
                continue
            listed = linked.get(name, name)
            for entry in sorted(os.scandir(stream_dir.path), key=lambda e: e.name):
                if entry.is_symlink() or not _right_kind(entry):
                    continue
                if CHECKPOINT_NAME.fullmatch(entry.name):  # the common case: one match
                    yield Found(listed, entry.name, "checkpoint")
                elif TEMP_NAME.fullmatch(entry.name):
                    yield Found(listed, entry.name, "temp")

    def _linked_streams(self) -> dict[str, str]:
        """{directory: stream} for each stream directory that is a link to another
        directory directly in the save directory (the first link by name wins)."""
        found: dict[str, str] = {}
        base = self.save_dir.resolve()
        for entry in sorted(os.scandir(self.save_dir), key=lambda e: e.name):
            if not entry.is_symlink() or not STREAM_NAME.fullmatch(entry.name):
                continue
            try:
                target = Path(entry.path).resolve(strict=True)
            except (OSError, RuntimeError):  # dangling, or a loop of links
                continue
            if target.parent == base and target.is_dir():
                found.setdefault(target.name, entry.name)
        return found

    # ------------------------------------------------------------------ removing

    def remove(self, rel: str) -> bool:
        return files.remove(self.path(rel))

    def quarantine(self, rel: str, into: Path) -> Path:
        return files.move_aside(self.save_dir / rel, into)

    def move_in(self, source: Path, rel: str) -> Callable[[], None]:
        """A rename on one filesystem (``EXDEV`` across two: nothing is copied), never
        over an existing name; both directories are fsynced."""
        target = self.path(rel)
        if os.path.lexists(target):
            raise PhaseError(
                "move", target, FileExistsError(17, "a file of that name exists", str(target))
            )
        files.make_dir(target.parent)
        files.rename_durably(source, target)
        return lambda: files.rename_durably(target, source)


def _right_kind(entry: os.DirEntry[str]) -> bool:
    sharded = entry.name.endswith(SHARDED_SUFFIX) or f"{SHARDED_SUFFIX}.tmp-" in entry.name
    return entry.is_dir(follow_symlinks=False) if sharded else entry.is_file(follow_symlinks=False)


class _Memo:
    def __init__(self, store: LocalStore) -> None:
        self.store = store

    def __enter__(self) -> LocalStore:
        self.store._resolved = {}
        return self.store

    def __exit__(self, *exc: object) -> None:
        self.store._resolved = None
        self.store._held = None
