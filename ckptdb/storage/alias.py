"""Aliases: names such as Lightning's ``last.ckpt`` that other tools open.

An alias is derived from the ledger and never read by ckptdb to decide
anything. It is written only after the commit of what it names, and swapped
in atomically: a new hard link (the same inode as the committed file, so it
stays whole even after retention removes the file it was linked from) is
made under a temporary name and renamed over the alias, then the directory is
fsynced. Where hard links are not possible (a filesystem without them) the
alias is a durable copy. A directory checkpoint is aliased by a tree of hard
links; it is swapped in two renames (a directory cannot be renamed over a
non-empty one), so a crash between them leaves no alias until the next one
is made. ckptdb's own aliases are never symlinks: they break on Windows, in
cloud backups and when their target is evicted. A framework that uses a
symlink itself (DeePMD's ``model.ckpt.pt``) keeps one: :func:`point_symlink`
swaps a new relative symlink in the same way, and :func:`write_pointer`
replaces a small pointer file (DeePMD's ``checkpoint``) with a new one. The
temporary names are fixed (``.<alias>.ckptdb-alias``, ``.<alias>.ckptdb-old``):
a crash's leftover is removed by the next update.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from .files import fsync_dir, fsync_file

_NO_LINKS = {errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}


def point_alias(target: Path, alias: Path) -> None:
    """Make ``alias`` name the same bytes as ``target``, atomically and durably."""
    if target.is_file() and alias.is_file() and os.path.samefile(target, alias):
        return  # already the same inode (renaming a link over itself would do nothing)
    tmp = alias.with_name(f".{alias.name}.ckptdb-alias")  # fixed: a crash's leftover is
    old = alias.with_name(f".{alias.name}.ckptdb-old")  # found and removed next time
    _remove(tmp)
    _remove(old)
    try:
        if target.is_dir():
            _link_tree(target, tmp)
        else:
            _link_or_copy(target, tmp)
        if alias.is_dir() and not alias.is_symlink():
            os.replace(alias, old)  # a directory cannot be renamed over a non-empty one
            os.replace(tmp, alias)
            # The swap durable before the old tree goes: else a power cut could keep
            # the old tree at the alias's name with some of its files already removed.
            fsync_dir(alias.parent)
            shutil.rmtree(old)
        else:
            os.replace(tmp, alias)
    except BaseException:
        _remove(tmp)
        raise
    fsync_dir(alias.parent)


def point_symlink(target: Path, alias: Path) -> None:
    """Make ``alias`` a symlink to ``target`` (relative to the alias's directory),
    atomically and durably: a new link under a temporary name, renamed over it."""
    link = os.path.relpath(target, alias.parent)
    if alias.is_symlink() and os.readlink(alias) == link:
        return
    tmp = alias.with_name(f".{alias.name}.ckptdb-alias")
    _remove(tmp)
    try:
        os.symlink(link, tmp)
        os.replace(tmp, alias)
    except BaseException:
        _remove(tmp)
        raise
    fsync_dir(alias.parent)


def write_pointer(path: Path, text: str) -> None:
    """Replace the small text file ``path`` with ``text``, atomically and durably
    (written and fsynced under a temporary name, renamed over it)."""
    if path.is_file() and not path.is_symlink() and path.read_text(errors="replace") == text:
        return
    tmp = path.with_name(f".{path.name}.ckptdb-alias")
    _remove(tmp)
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    fsync_dir(path.parent)


def remove_alias(alias: Path) -> None:
    _remove(alias)
    fsync_dir(alias.parent)


def _link_or_copy(source: Path, dest: Path) -> None:
    try:
        os.link(source, dest)
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        shutil.copyfile(source, dest)
        fsync_file(dest)


def _link_tree(source: Path, dest: Path) -> None:
    dest.mkdir()
    for path in sorted(source.rglob("*")):
        target = dest / path.relative_to(source)
        if path.is_dir():
            target.mkdir()
        else:
            _link_or_copy(path, target)
    for directory in [p for p in dest.rglob("*") if p.is_dir()] + [dest]:
        fsync_dir(directory)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
