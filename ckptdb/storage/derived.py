"""Derived aliases on disk: where one is, whether it names its checkpoint, making it so.

A derived alias (DeePMD's ``model.ckpt.pt`` symlink and ``checkpoint`` pointer
file, a hard-linked ``last.ckpt``) is a name under the run root that other
tools open. The ledger says what it should name; this module only looks at
the disk and changes it with the atomic primitives of :mod:`.alias`.

Why it is this careful: an alias is written by reconcile too, at every open,
so it must never become a way to touch what is not ckptdb's. Its directories
must stay inside the run root (:func:`alias_path`, through
:func:`~ckptdb.storage.files.confine`); the alias itself is never followed (it
is read with ``lstat``/``readlink`` and replaced by a rename onto it); and what
stands there that an alias of its kind never is (a directory, a symbolic link
where a pointer file or a hard link belongs, a FIFO) is left alone
(:func:`obstacle`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .alias import point_alias, point_symlink, write_pointer
from .files import confine

__all__ = ["alias_path", "named_now", "names", "obstacle", "point", "pointer_text"]

# The kinds (ckptdb.record.ALIAS_KINDS; storage imports nothing of the record).
SYMLINK, POINTER, LINK = "symlink", "pointer", "link"


def alias_path(root: Path, rel: str) -> Path:
    """``root / rel``, refused (:class:`~ckptdb.errors.InvalidArgumentError`) when a
    directory on the way is a link out of ``root``; the last part is not followed."""
    return confine(root, rel)


def pointer_text(alias: Path, target: Path) -> str:
    """What a pointer file (or a symlink) at ``alias`` says to name ``target``: its path
    relative to the alias's directory (DeePMD's ``checkpoint``: relative to the run root)."""
    return os.path.relpath(target, alias.parent)


def names(alias: Path, kind: str, target: Path) -> bool:
    """Whether ``alias`` already names ``target`` as an alias of ``kind`` does."""
    try:
        if kind == SYMLINK:
            return alias.is_symlink() and os.readlink(alias) == pointer_text(alias, target)
        if alias.is_symlink():
            return False
        if kind == POINTER:
            return alias.is_file() and alias.read_text(errors="replace") == pointer_text(
                alias, target
            )
        return _same_bytes(alias, target)
    except OSError:
        return False


def named_now(alias: Path, kind: str) -> str | None:
    """What the alias names now, for a report line: a symlink's or a pointer's text."""
    try:
        if alias.is_symlink():
            return os.readlink(alias)
        if kind == POINTER and alias.is_file() and alias.stat().st_size <= 4096:
            return alias.read_text(errors="replace")
    except OSError:
        return None
    return None


def obstacle(alias: Path, kind: str, *, dir_ok: bool) -> str | None:
    """Why what stands at ``alias`` is not an alias ckptdb may replace (None: it may).

    A symbolic link is replaced only by a symlink alias (as a link, its target
    untouched); a directory only by a hard-link alias of a directory checkpoint
    (``dir_ok``: a tree of links ckptdb made); a regular file by any kind.
    """
    try:
        mode = os.lstat(alias).st_mode
    except FileNotFoundError:
        return None if alias.parent.is_dir() else f"its directory {alias.parent} is not there"
    except OSError as exc:
        return f"it cannot be looked at ({type(exc).__name__}: {exc})"
    if stat.S_ISLNK(mode):
        if kind == SYMLINK:
            return None
        return f"a symbolic link (to {os.readlink(alias)}), not a {kind} ckptdb writes"
    if stat.S_ISDIR(mode):
        return None if kind == LINK and dir_ok else "a directory"
    return None if stat.S_ISREG(mode) else "not a regular file"


def point(alias: Path, kind: str, target: Path) -> None:
    """Make ``alias`` name ``target``: atomically and durably, never through a link."""
    if kind == SYMLINK:
        point_symlink(target, alias)
    elif kind == POINTER:
        write_pointer(alias, pointer_text(alias, target))
    else:
        point_alias(target, alias)


def _same_bytes(alias: Path, target: Path) -> bool:
    """A hard link of ``target`` (or, where links are not possible, a copy of the same
    bytes: compared in full only when the sizes match), for a file or a tree."""
    mine, theirs = os.lstat(alias), os.lstat(target)
    if stat.S_ISREG(mine.st_mode) and stat.S_ISREG(theirs.st_mode):
        if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino):
            return True
        return mine.st_size == theirs.st_size and _same_content(alias, target)
    if stat.S_ISDIR(mine.st_mode) and stat.S_ISDIR(theirs.st_mode):
        entries = sorted(os.listdir(alias))
        if entries != sorted(os.listdir(target)):
            return False
        return all(_same_bytes(alias / name, target / name) for name in entries)
    return False


def _same_content(a: Path, b: Path, chunk: int = 1 << 20) -> bool:
    """Byte for byte (no cache keyed by mtime, as :mod:`filecmp` keeps)."""
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            left, right = fa.read(chunk), fb.read(chunk)
            if left != right:
                return False
            if not left:
                return True
