"""Durable POSIX file work: write, place, remove, hash, and path confinement.

The primitives of :class:`~ckptdb.storage.local.LocalStore`. Every function
does one step of the publication protocol and raises the OS error it met
(as :class:`~ckptdb.errors.PhaseError` where a phase is named); the boundary
decides what that means for the ledger. No function deletes or moves anything
outside the directory it is confined to, and symlinks are never followed out
of it. A sharded checkpoint's size is the sum of its files' sizes and its
hash covers every file's relative name, size and content.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from .. import faults
from ..errors import ForeignEntryError, InvalidArgumentError, PhaseError

READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileInfo:
    size: int
    hash: str


#: A write smaller than this is gathered in the writer's buffer (torch's zip writer
#: makes ~40 writes of a few bytes per file: headers, names, padding) ...
SMALL_WRITE = 64 << 10
#: ... which goes to the OS once it holds this much, before a large write, and at flush.
WRITE_BUFFER = 1 << 20


class HashingWriter:
    """A write-only file object that hashes and counts bytes as they stream out.

    Small writes are gathered and reach the OS together (:data:`SMALL_WRITE`,
    :data:`WRITE_BUFFER`); a large one goes straight through once what was
    gathered before it is out, so the file's bytes are in the order they were
    given. Without that, each of the ~40 tiny writes of a small ``torch.save``
    was a syscall of its own, with its hash update and fault point (most of
    the write's CPU at a boundary of small payloads).

    What the OS receives is what counts: the hash is updated with exactly the
    bytes handed to the file, in order, and ``mid_write`` is visited after
    each real write (``path`` names the file in errors). :meth:`flush` (torch calls
    it at the end of a save; :func:`write_stream` once more) sends what is
    gathered; until then :attr:`size` counts bytes accepted, not yet written.
    """

    def __init__(self, fileobj: Any, path: Path | None = None) -> None:
        self._file = fileobj
        self._path = path
        self._hash = xxhash.xxh3_128()
        self._pending = bytearray()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        size = view.nbytes
        if size < SMALL_WRITE:
            self._pending += view  # a copy: torch's buffer is only valid during the call
            if len(self._pending) >= WRITE_BUFFER:
                self._drain()
        else:
            self._drain()
            self._send(view)
        self.size += size
        return size

    def flush(self) -> None:
        self._drain()
        self._file.flush()

    @property
    def pending(self) -> int:
        """Bytes accepted but not yet handed to the OS (0 after :meth:`flush`)."""
        return len(self._pending)

    def info(self) -> FileInfo:
        """Size and hash of every byte written; only meaningful once nothing is pending."""
        return FileInfo(self.size, self._hash.hexdigest())

    def _drain(self) -> None:
        if not self._pending:
            return
        with memoryview(self._pending) as view:
            self._send(view)
        self._pending.clear()

    def _send(self, view: memoryview) -> None:
        """Hash ``view`` and hand all of it to the OS: a short write is continued
        (each part is one real write, then ``mid_write``)."""
        if view.itemsize != 1 or view.ndim != 1:
            view = view.cast("B")  # a short write counts bytes: slice by bytes
        self._hash.update(view)
        while view.nbytes:
            written: int | None = self._file.write(view)
            if not written:  # a regular file never accepts nothing; a loop must not spin
                raise OSError(errno.EIO, "the file accepted no bytes", str(self._path))
            view = view[written:]
            faults.point("mid_write")


def write_stream(serialize: Callable[[Any], object], tmp: Path) -> FileInfo:
    """Run ``serialize(file)`` into a new file ``tmp``, hashing as bytes stream out; fsync.

    The file is created exclusively (a leftover is never overwritten).
    Raises :class:`PhaseError` naming ``write`` or ``fsync``; an interrupt
    raised inside ``serialize`` propagates as itself.
    """
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        raise PhaseError("write", tmp, exc) from exc
    with os.fdopen(fd, "wb", buffering=0) as raw:
        writer = HashingWriter(raw, tmp)
        try:
            serialize(writer)
            writer.flush()  # a serializer that never flushed leaves bytes gathered
        except Exception as exc:
            interrupt = _in_chain(exc, lambda e: not isinstance(e, Exception))
            if interrupt is not None:
                raise interrupt from None  # Ctrl-C stays Ctrl-C, not a write error
            cause = _in_chain(exc, lambda e: isinstance(e, OSError)) or exc
            raise PhaseError("write", tmp, cause) from cause
        try:
            sync_data(raw.fileno(), tmp)
        except OSError as exc:
            raise PhaseError("fsync", tmp, exc) from exc
    return writer.info()


def sync_data(fd: int, path: Path) -> None:
    """fsync the open file ``fd`` (``path``): its data and size become durable.

    Its name is not: that takes an fsync of its directory (:func:`fsync_dir`)
    after it was created or renamed.
    """
    os.fsync(fd)


def _in_chain(exc: BaseException, wanted: Callable[[BaseException], bool]) -> BaseException | None:
    """The first exception behind ``exc`` that is ``wanted``: torch's zip writer turns
    anything raised by ``write()`` (ENOSPC, even KeyboardInterrupt) into a RuntimeError."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if wanted(current):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def place(tmp: Path, final: Path) -> None:
    """Atomically move ``tmp`` onto ``final`` (never delete-then-rename)."""
    try:
        os.replace(tmp, final)
    except OSError as exc:
        raise PhaseError("replace", final, exc) from exc


def rename_durably(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` (same filesystem; nothing is copied) and fsync
    both directories; a rename that could not be made durable is renamed back (and
    that made durable).
    Raises :class:`PhaseError` naming ``move`` (or ``fsync_dir``)."""
    try:
        os.rename(source, target)
    except OSError as exc:
        raise PhaseError("move", source, exc) from exc
    try:
        fsync_dir(target.parent)
        if source.parent != target.parent:
            fsync_dir(source.parent)
    except PhaseError as exc:
        try:  # back where it was, durably: a power cut must not leave it moved after all
            os.rename(target, source)
            fsync_dir(source.parent)
            if source.parent != target.parent:
                fsync_dir(target.parent)
        except OSError as undo:
            exc.cleanup_error = undo
        raise


def fsync_file(path: Path) -> None:
    """Make a file's data durable (one that something else wrote and closed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        sync_data(fd, path)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise PhaseError("fsync_dir", directory, exc) from exc


def make_dir(directory: Path) -> None:
    """Create ``directory`` (and parents) durably: each new entry's parent is fsynced."""
    missing = []
    current = directory
    while not current.exists():
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        try:
            path.mkdir(exist_ok=True)
        except OSError as exc:
            raise PhaseError("mkdir", path, exc) from exc
        try:
            fsync_dir(path.parent)
        except PhaseError as exc:
            # A directory whose entry is not durable must not stay: a later call
            # would find it and skip the fsync. Remove it (and the error says so).
            _remove_created(path, exc)
            raise


def _remove_created(path: Path, failure: PhaseError) -> None:
    try:
        path.rmdir()
    except OSError as cleanup_exc:
        failure.cleanup_error = cleanup_exc


def seal_directory(directory: Path) -> FileInfo:
    """Make a written sharded checkpoint durable and measure it.

    Every file is fsynced here, then every directory. DCP's own fsync
    (``sync_files``) is not enough: its writer fsyncs ``.metadata`` before
    the pickled bytes leave Python's buffer (torch 2.13), so after a power
    cut a committed checkpoint could be left with an empty ``.metadata``
    (found by ``tests/test_powerloss.py``). Raises :class:`PhaseError`
    naming ``fsync``, ``fsync_dir`` or ``write``.
    """
    try:
        written = tree_files(directory)
    except OSError as exc:
        raise PhaseError("write", directory, exc) from exc
    for _, file in written:
        try:
            fsync_file(file)
        except OSError as exc:
            raise PhaseError("fsync", file, exc) from exc
    subdirs = [p for p in directory.rglob("*") if p.is_dir() and not p.is_symlink()]
    for sub in [*subdirs, directory]:
        fsync_dir(sub)
    try:
        return hash_checkpoint(directory)
    except OSError as exc:
        raise PhaseError("write", directory, exc) from exc


#: From this size a whole file is hashed through a memory map; below it one read is
#: faster (a map and an unmap cost more than copying a small file: 12 against 25
#: microseconds at 1.5 KB, even at 1 MiB, 3.7x faster for the map at 16 MiB).
MMAP_FROM = 1 << 20


def hash_file(path: Path | str) -> FileInfo:
    with open(path, "rb", buffering=0) as f:
        return hash_open_file(f)


def hash_open_file(f: Any) -> FileInfo:
    """Hash an open binary file from its current position to the end.

    A whole regular file of :data:`MMAP_FROM` bytes or more is hashed through
    a read-only memory map (no copy into Python buffers: about 3x faster on a
    checkpoint in the page cache); a smaller one is read at once.
    """
    if f.tell() == 0:
        size = os.fstat(f.fileno()).st_size
        if size >= MMAP_FROM:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                digest = xxhash.xxh3_128(mapped)
                f.seek(size)
                return FileInfo(size, digest.hexdigest())
        if size > 0:
            data = f.read()  # to the end, even if the file grew since the fstat
            return FileInfo(len(data), xxhash.xxh3_128(data).hexdigest())
    digest = xxhash.xxh3_128()
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    size = 0
    while True:
        n = f.readinto(buffer)
        if not n:
            break
        digest.update(view[:n])
        size += n
    return FileInfo(size, digest.hexdigest())


def confine(base: Path, relative: str | Path, resolved: dict[Any, Path] | None = None) -> Path:
    """``base / relative``, refused if it escapes ``base`` (``..``, absolute, symlinked dirs).

    The last component may itself be a symlink: removing or renaming it acts
    on the link, never on its target, so that stays inside ``base`` too. A
    plain name (a stream's file) is checked with one ``lstat`` per directory
    part, on every call (:func:`_plain_child`); anything else is resolved.
    ``resolved`` memoizes directory resolutions for one pass over many rows
    (a reconcile of 100k checkpoints confines each stream directory once, by
    its text, and then only joins names to it).
    """
    if resolved is None:
        return _confine(base, relative, {})
    joined = _memoized(base, relative, resolved)
    return Path(joined) if joined is not None else _confine(base, relative, resolved)


def confined_name(base: Path, relative: str, resolved: dict[Any, Path] | None) -> str:
    """:func:`confine` as text: what a pass over 100k rows stats, without a Path per row."""
    joined = None if resolved is None else _memoized(base, relative, resolved)
    return joined if joined is not None else str(_confine(base, relative, resolved or {}))


def _memoized(base: Path, relative: str | Path, resolved: dict[Any, Path]) -> str | None:
    """The confined text of ``relative`` when its directory part was confined before
    in this pass (confined now, by the full check, if not); None: use the full check."""
    if not isinstance(relative, str):
        return None
    head, _, name = relative.rpartition("/")
    if not head or name in ("", ".", ".."):
        return None
    key = (base, head)
    parent = resolved.get(key)
    if parent is None:  # the full check, on this very name (its error names it)
        confined = _confine(base, relative, resolved)
        resolved[key] = confined.parent
        return str(confined)
    return f"{parent}/{name}"


def _confine(base: Path, relative: str | Path, cache: dict[Any, Path]) -> Path:
    plain = _plain_child(base, relative)
    if plain is not None:
        return plain
    candidate = base / relative
    parent = _resolve(candidate.parent, cache)
    resolved_base = _resolve(base, cache)
    if parent != resolved_base and resolved_base not in parent.parents:
        raise InvalidArgumentError(f"{candidate} is outside {base}; refusing to touch it")
    if candidate.name in ("", ".", ".."):
        raise InvalidArgumentError(f"{candidate} does not name a file")
    return parent / candidate.name


def _plain_child(base: Path, relative: str | Path) -> Path | None:
    """``base / relative`` when it plainly stays in ``base``, checked with one ``lstat``
    per directory part; None: the full check (two ``realpath``) decides.

    Plain: an absolute ``base`` and a relative name without an empty, ``.`` or
    ``..`` part, each directory part of which is a real directory, not a link
    (a link is never followed here, even one that stays inside). Nothing is
    cached: a stream directory swapped for a link since the last call is seen.
    The full check lstats every component of both paths (~20 on a typical
    save directory) for the same answer, which a boundary paid for each file
    it removed.
    """
    root, text = os.fspath(base), os.fspath(relative)
    parts = text.split("/")
    if not os.path.isabs(root) or any(p in ("", ".", "..") for p in parts):
        return None
    directory = root
    for part in parts[:-1]:
        directory = f"{directory}/{part}"
        try:
            mode = os.lstat(directory).st_mode
        except OSError:
            return None  # missing or unreadable: the full check names the error
        if not stat.S_ISDIR(mode):
            return None
    return Path(f"{root}/{text}")


def _resolve(path: Path, cache: dict[Any, Path]) -> Path:
    found = cache.get(path)
    if found is None:
        try:
            found = cache[path] = path.resolve()
        except RuntimeError as exc:  # Python 3.11-3.12: a loop of links (3.13: OSError)
            raise InvalidArgumentError(f"{path} is a loop of links; refusing to touch it") from exc
    return found


def remove(path: Path) -> bool:
    """Unlink ``path`` (a file or a link, never a link's target). False if it was absent.

    A real directory (a sharded checkpoint) is removed with its contents;
    links inside it are unlinked, never followed.
    """
    try:
        os.unlink(path)  # a file or a link: the common case, one syscall
    except FileNotFoundError:
        return False
    except (IsADirectoryError, PermissionError) as exc:  # Linux: EISDIR; macOS: EPERM
        return _remove_dir(path, exc)
    return True


def _remove_dir(path: Path, refused: OSError) -> bool:
    """``path``, which ``unlink`` refused: a real directory (``lstat``, not a link's
    target) is removed with its contents; anything else raises ``refused``."""
    try:
        is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False
    if not is_dir:
        raise refused
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return False
    return True


def tree_files(directory: Path) -> list[tuple[str, Path]]:
    """(relative posix name, path) of every regular file under ``directory``, sorted.

    A link or special file inside a checkpoint directory is not ours: refused
    (never followed), and the checkpoint counts as corrupt.
    """
    found: list[tuple[str, Path]] = []
    for path in directory.rglob("*"):
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise ForeignEntryError(
                errno.EINVAL, "a link or special file in a checkpoint directory", str(path)
            )
        if path.is_file():
            found.append((path.relative_to(directory).as_posix(), path))
    return sorted(found)


def checkpoint_size(path: Path | str) -> int:
    """Bytes of a checkpoint: a file's size, or the sum over a sharded directory.

    One ``lstat`` for a file (reconcile measures every committed file at open);
    a link is followed, as a read would follow it."""
    info = os.lstat(path)
    if stat.S_ISDIR(info.st_mode):
        return sum(p.stat().st_size for _, p in tree_files(Path(path)))
    if stat.S_ISLNK(info.st_mode):
        return os.stat(path).st_size
    return info.st_size


def hash_checkpoint(path: Path | str) -> FileInfo:
    """Size and hash of a checkpoint file or sharded directory (see the module doc).

    A real directory (``lstat``: never a link to one) is a sharded checkpoint;
    anything else is opened as a file, a link followed as a read would follow it.
    """
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        return hash_file(path)
    return combine((name, hash_file(file)) for name, file in tree_files(Path(path)))


def combine(files: Iterable[tuple[str, FileInfo]]) -> FileInfo:
    """The size and hash of a checkpoint made of ``files`` (relative name, measured file):
    the total size, and one hash over every file's name, size and hash, by name.
    A sharded checkpoint has the same one on every store."""
    digest = xxhash.xxh3_128()
    total = 0
    for name, info in sorted(files):
        digest.update(f"{name}\0{info.size}\0{info.hash}\n".encode())
        total += info.size
    return FileInfo(total, digest.hexdigest())


def move_aside(path: Path, quarantine: Path) -> Path:
    """Move ``path`` into ``quarantine`` under a free name; returns where it went."""
    make_dir(quarantine)
    target = quarantine / path.name
    n = 1
    while target.exists() or target.is_symlink():
        target = quarantine / f"{path.name}.{n}"
        n += 1
    try:
        os.replace(path, target)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        shutil.move(str(path), str(target))
    fsync_dir(quarantine)
    return target
