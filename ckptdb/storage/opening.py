"""Opening a payload store: the one place that decides which store a location gets.

A local path gets a :class:`~ckptdb.storage.local.LocalStore`; an object
location (an :class:`~ckptdb.location.ObjectPath`) the store of its scheme,
from :data:`OBJECT_STORES`, which holds one entry per scheme of
:data:`ckptdb.location.OBJECT_SCHEMES`. Every part that needs a store (the
manager, the reader, the integrations, the ``ckptdb`` command) opens it here,
so a new object store is its scheme in that table, its entry in this one and
its class, and no caller learns which class it is.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import (
    CheckpointLostError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
)
from ..location import ObjectPath, location_of, relative_within
from .base import LOST, PayloadStore
from .local import LocalStore
from .s3client import parse_options

__all__ = ["OBJECT_STORES", "check_options", "open_store", "open_verified_payload"]

#: A store's options (``storage_options``), as the caller gave them.
Options = Mapping[str, object] | None


@dataclass(frozen=True)
class ObjectStoreEntry:
    """How one object-store scheme's store is checked and opened."""

    #: Refuses bad options (raises) without contacting anything.
    check: Callable[[Options], object]
    #: The store at a location of the scheme (``probe``: check the store's guarantees).
    open: Callable[[ObjectPath, Options, bool], PayloadStore]


def _open_s3(location: ObjectPath, options: Options, probe: bool) -> PayloadStore:
    from .s3 import S3Store  # boto3 is an optional extra: imported only for an s3 location

    return S3Store(location, parse_options(options), probe=probe)


#: {scheme: its store}, for every scheme of :data:`ckptdb.location.OBJECT_SCHEMES`.
OBJECT_STORES: dict[str, ObjectStoreEntry] = {"s3": ObjectStoreEntry(parse_options, _open_s3)}


def check_options(location: Path, options: Options) -> None:
    """Refuse ``options`` that cannot apply to ``location`` before anything is opened:
    any at all for a local path (they configure an object store, and would be
    silently ignored), and bad ones for an object store (never contacted here)."""
    if isinstance(location, ObjectPath):
        OBJECT_STORES[location.scheme].check(options)
    elif options is not None:
        raise InvalidArgumentError(
            f"storage_options are for an object-store save_dir (s3://...), not {location}"
        )


def open_store(
    location: str | os.PathLike[str], options: Options = None, *, probe: bool = True
) -> PayloadStore:
    """The payload store at ``location``: a local directory, or an object-store location
    (an :class:`~ckptdb.location.ObjectPath`, or its URL as text).

    ``options`` configure an object store and are refused for a local path
    (:func:`check_options`). ``probe``: an object store checks at once that it
    honours conditional writes (unless its options waive them), which a writer
    relies on; a reader, which writes nothing, opens it with ``probe=False``.
    """
    path = location if isinstance(location, Path) else location_of(os.fspath(location))
    if not isinstance(path, ObjectPath):
        check_options(path, options)
        return LocalStore(path)
    return OBJECT_STORES[path.scheme].open(path, options, probe)


def open_verified_payload(
    save_dir: Path,
    path: Path,
    size: int | None,
    digest: str | None,
    options: Options = None,
    *,
    keep: bool = True,
) -> tuple[PayloadStore, str]:
    """The store of a run and the name in it of a committed payload, after checking the
    payload against its row (size and hash; with ``keep``, a file's bytes are kept for
    the read that follows). For readers: confined to ``save_dir``, nothing probed or
    written.

    Raises :class:`~ckptdb.errors.CheckpointLostError` (gone),
    :class:`~ckptdb.errors.CorruptCheckpointError` (changed) or
    :class:`~ckptdb.errors.CheckpointNotFoundError` (outside ``save_dir``).
    """
    # storage_options are for a run on object storage; a local save_dir is read without
    # them (not refused)
    store = open_store(save_dir, options if isinstance(save_dir, ObjectPath) else None, probe=False)
    rel = _within(save_dir, path)
    finding = store.verify(rel, size, digest, full=True, keep=keep)
    if finding is None:
        return store, rel
    if finding.state == LOST and finding.missing:
        raise CheckpointLostError(
            f"{path} is gone (its run's writer marks it lost at its next load or reconcile)"
        ) from finding.error
    if finding.state == LOST:
        assert finding.error is not None
        raise finding.error  # unreadable now (a permission?) is not proof that it is gone
    raise CorruptCheckpointError(
        f"{path}: {finding.detail}; refusing to load it (its run's writer marks it "
        "corrupt at its next load or reconcile --verify)"
    )


def _within(save_dir: Path, path: Path) -> str:
    if isinstance(save_dir, ObjectPath):
        found = relative_within(path, save_dir)
        if found is None:
            raise CheckpointNotFoundError(f"{path} is not in {save_dir}")
        return found
    try:  # as recorded: save_dir / rel (the store then refuses what escapes it)
        return Path(os.path.abspath(path)).relative_to(os.path.abspath(save_dir)).as_posix()
    except ValueError:
        raise CheckpointNotFoundError(f"{path} is not in {save_dir}") from None
