"""Where a run's payloads live: a local directory, or an ``s3://bucket/prefix`` URL.

The ledger, the public records (``Checkpoint.path``) and the messages speak of
payload locations as :class:`~pathlib.Path` values. An object-store location
is an :class:`ObjectPath`: a ``Path`` whose ``str`` is the ``s3://`` URL, which
joins and relativizes like any path, and which refuses to be opened as a
local file (``os.fspath`` raises), so that no code can silently read or write
a local file named ``s3:/bucket/...`` instead of the object.

This module imports nothing of ckptdb: the ledger (which stores the URL as
text) and the storage layer (which writes the objects) both build on it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PosixPath, PurePosixPath
from typing import Any

from .errors import ArgumentTypeError, InvalidArgumentError

#: The ``user:password@`` of a URL, kept out of messages.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s\"']*@")

#: The object-store schemes: every function here that tells an object location
#: from a local path reads this table, and :func:`~ckptdb.storage.open_store`
#: maps each entry to its store, so a new object store is one entry here (and
#: one store class there).
OBJECT_SCHEMES: tuple[str, ...] = ("s3",)

_URL_PREFIXES = tuple(f"{scheme}://" for scheme in OBJECT_SCHEMES)
#: A URL's first part as a path (``Path("s3://b")`` folds it to ``s3:/b``).
_FOLDED_PREFIXES = tuple(f"{scheme}:/" for scheme in OBJECT_SCHEMES)
_SCHEME_PARTS = frozenset(f"{scheme}:" for scheme in OBJECT_SCHEMES)


class ObjectPath(PosixPath):
    """An object key (or prefix) in a bucket, as a path: ``s3://bucket/prefix/name``.

    Its first part is the scheme (``s3:``) and the second the bucket; ``str``
    gives the URL back. It is absolute (nothing resolves it against a working
    directory) and never a local file.
    """

    def __str__(self) -> str:
        if not self._is_url():
            return super().__str__()  # a part of one (``relative_to`` gives these)
        return f"{self.parts[0]}//" + "/".join(self.parts[1:])

    def _is_url(self) -> bool:
        return bool(self.parts) and self.parts[0] in _SCHEME_PARTS

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __fspath__(self) -> str:
        if not self._is_url():
            return super().__str__()
        raise ArgumentTypeError(
            f"{self} is an object in object storage, not a local file: read it through "
            "ckptdb (mgr.load, RunReader.load)"
        )

    def __hash__(self) -> int:
        return hash(str(self))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and str(self) == str(other)

    def is_absolute(self) -> bool:
        return self._is_url()

    def resolve(self, strict: bool = False) -> ObjectPath:
        return self

    def absolute(self) -> ObjectPath:
        return self

    @property
    def scheme(self) -> str:
        """The object store's scheme (an entry of :data:`OBJECT_SCHEMES`), without ``://``."""
        return self.parts[0].removesuffix(":")

    @property
    def bucket(self) -> str:
        return self.parts[1]

    @property
    def key(self) -> str:
        """The key (or prefix) inside the bucket, without a trailing slash."""
        return "/".join(self.parts[2:])


def is_object_url(text: object) -> bool:
    """Whether ``text`` (a string or a path) names an object-store location."""
    return isinstance(text, ObjectPath) or (
        isinstance(text, str) and text.startswith(_URL_PREFIXES)
    )


def redacted(url: str) -> str:
    """``url`` without the ``user:password@`` it may carry (for errors and logs)."""
    return _USERINFO.sub(r"\1", url)


def check_remote_url(remote: object) -> None:
    """``remote=``: None or an object-storage URL, else :class:`InvalidArgumentError`
    (shown without the ``user:password@`` a URL may carry)."""
    if remote is None or (isinstance(remote, str) and is_object_url(remote)):
        return
    shown = repr(redacted(remote)) if isinstance(remote, str) else "a " + type(remote).__name__
    raise InvalidArgumentError(
        f"remote must be an object-storage URL (s3://bucket/prefix), got {shown}"
    )


def looks_like_object_url(text: str) -> bool:
    """Whether ``text`` starts like an object URL, one that ``Path`` folded included
    (``str(Path("s3://b"))`` is ``s3:/b``): a local path that must not be taken for one."""
    return text.startswith(_FOLDED_PREFIXES)


def object_path(url: str) -> ObjectPath:
    """The :class:`ObjectPath` of ``s3://bucket[/prefix]``; InvalidArgumentError if malformed.

    A bucket is 3-63 lowercase letters, digits, dots and hyphens; the prefix
    has no empty, ``.`` or ``..`` segment (the keys would not round-trip).
    Credentials (``s3://KEY:SECRET@bucket``) are refused without repeating them.
    """
    scheme = next((s for s in _URL_PREFIXES if url.startswith(s)), None)
    if scheme is None:
        raise InvalidArgumentError(f"{url!r} is not an {' or '.join(_URL_PREFIXES)} URL")
    rest = url[len(scheme) :].rstrip("/")
    bucket, _, prefix = rest.partition("/")
    if "@" in bucket:  # s3://KEY:SECRET@bucket: never echoed, never stored in the ledger
        raise InvalidArgumentError(
            f"credentials inside an {scheme} URL are refused (the URL is stored in the ledger "
            "and shown in messages): pass them in storage_options or the standard AWS chain"
        )
    if not _valid_bucket(bucket):
        raise InvalidArgumentError(f"{url!r}: {bucket!r} is not a valid bucket name")
    segments = prefix.split("/") if prefix else []
    if any(s in ("", ".", "..") for s in segments):
        raise InvalidArgumentError(f"{url!r}: the prefix has an empty, '.' or '..' segment")
    return ObjectPath(scheme.removesuffix("//"), bucket, *segments)


def _valid_bucket(name: str) -> bool:
    allowed = set("abcdefghijklmnopqrstuvwxyz0123456789.-")
    return 3 <= len(name) <= 63 and set(name) <= allowed and name[0].isalnum()


def location_of(text: str) -> Path:
    """A stored location (the ledger's text) as a path: an :class:`ObjectPath` or a local one."""
    return object_path(text) if is_object_url(text) else Path(text)


def rebased(stored: str, old_root: str, root: Path) -> Path:
    """A run's stored save directory, following its root to ``root`` when it was inside
    the old one (a moved run); an object-store location stays what it is."""
    where, before = location_of(stored), Path(old_root)
    if is_object_url(where):
        return where
    if where == before or before in where.parents:
        return root / where.relative_to(before)
    return where


def relative_within(path: Any, base: Path) -> str | None:
    """``path`` relative to ``base`` (posix), or None when it is not inside it.

    Local paths are resolved against the working directory first; an object
    path is compared as it is (a URL never resolves to a local file).
    """
    if isinstance(base, ObjectPath) or is_object_url(path) or isinstance(path, ObjectPath):
        text = str(path)
        prefix = str(base) + "/"
        return text[len(prefix) :] if text.startswith(prefix) else None
    resolved = (Path.cwd() / Path(os.fspath(path))).resolve()
    base_resolved = base.resolve()
    if not resolved.is_relative_to(base_resolved):
        return None
    return PurePosixPath(resolved.relative_to(base_resolved)).as_posix()
