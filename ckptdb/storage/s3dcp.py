"""Sharded (``torch.distributed.checkpoint``) payloads on object storage.

A DCP checkpoint on S3 is the same flat set of files as a local one (each
rank's ``__<rank>_<n>.distcp`` shard files and the coordinator's
``.metadata``), each one an object under the boundary's unique prefix
``<stream>/step-<step>.<run token>.v<row id>.dcp/`` (see
:mod:`~ckptdb.storage.naming`): never reused, never overwritten.

DCP's own ``FileSystemWriter``/``FileSystemReader`` are kept (their planning,
file layout and ``_StorageInfo`` records: the objects, downloaded into a
directory, load with a plain ``FileSystemReader``); only their file system
is replaced by :class:`ObjectFiles`, whose write streams are our multipart
writer (:class:`~ckptdb.storage.s3upload.ObjectWriter`, completed with
``If-None-Match: *``). A stream whose body raised is aborted, never
completed: torch's fsspec writer removes the file on an exception *before*
the stream's close, and that close then commits the partial object.

There is no rename: ``.metadata`` is written directly under its final key
(DCP's writer writes a temporary and renames it). The ledger row, not
``.metadata``, makes the checkpoint visible.

The manifest: every rank hashes its shard files as they stream out, and
their (size, hash) travel to DCP's coordinator with its write results,
which pickles them into ``.metadata`` (``Metadata.ckptdb_files``). The chief
seals by reading ``.metadata`` back (one GET), checking that every file DCP's
metadata names is in the manifest, and HEADing each shard (its size must be
what was written). The row gets the total size and the digest of every file
(``.metadata`` included): the digest a local directory of the same files has
(:func:`~ckptdb.storage.files.hash_checkpoint`). ``.metadata`` is read before
the row can authenticate it, so only DCP's metadata classes may be unpickled
from it, and every object read whole is read to at most its expected size
and one byte more.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystemBase,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import faults
from ..errors import CorruptCheckpointError, InvalidArgumentError, ObjectStoreError, PhaseError
from .base import CORRUPT, Finding, verdict
from .files import FileInfo, combine
from .s3client import Calls, store_error
from .s3upload import ObjectWriter


class S3Store(Protocol):
    """What this module uses of :class:`~ckptdb.storage.s3.S3Store` (which uses this
    module: a structural type instead of an import keeps the two out of a cycle)."""

    bucket: str
    calls: Calls

    def key(self, rel: str) -> str: ...
    def url(self, key: str) -> str: ...
    def local_path(self, rel: str) -> Path: ...
    def exists(self, rel: str) -> bool: ...
    def head_size(self, key: str) -> FileInfo: ...
    def abandon(self, writer: ObjectWriter) -> None: ...
    def unreadable(self, exc: ObjectStoreError, name: str) -> Finding: ...


METADATA = ".metadata"
#: The attribute of DCP's ``Metadata`` that holds the manifest: {file name: (size, hash)}.
MANIFEST_ATTR = "ckptdb_files"
# The index of the write result that carries a rank's manifest to the coordinator
# (taken out before DCP's storage data is built from the results).
_MANIFEST_INDEX = MetadataIndex("ckptdb.files")
READ_CHUNK = 8 << 20
# What a ``.metadata`` may name (DCP's metadata classes, ``torch.Size``, layouts; dtypes
# are checked by value): it is unpickled before the row can authenticate it.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # DCP's own storage_meta (a path, no I/O)
}


class _Stream:
    """One shard file being written: what DCP's file writer needs of a stream."""

    def __init__(self, writer: ObjectWriter) -> None:
        self.writer = writer
        self.info: FileInfo | None = None

    def write(self, data: Any) -> int:
        return self.writer.write(data)

    def tell(self) -> int:
        return self.writer.size

    def flush(self) -> None:
        """Nothing to do: parts leave as they fill."""

    def close(self) -> None:
        """Complete the object (once): DCP closes a shard file when all of it is written."""
        if self.info is None:
            self.info = self.writer.finish()


class ObjectFiles(FileSystemBase):
    """DCP's file operations on the objects under one checkpoint prefix.

    A DCP checkpoint is flat, so a path is known by its last component, the
    file's name. ``expected``: for reading, the verified manifest, against
    which every object read is checked before DCP sees a byte of it.
    """

    def __init__(
        self, store: S3Store, rel: str, expected: Mapping[str, FileInfo] | None = None
    ) -> None:
        self.store, self.rel, self.expected = store, rel, expected
        #: The files this writer completed: {name: (size, hash)}.
        self.written: dict[str, FileInfo] = {}

    def key(self, path: str | os.PathLike[str]) -> str:
        return self.store.key(f"{self.rel}/{Path(path).name}")

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if mode == "rb":
            yield self._read(path)
            return
        if mode != "wb":
            raise InvalidArgumentError(f"object storage cannot open {path} with mode {mode!r}")
        writer = ObjectWriter(self.store.calls, self.store.bucket, self.key(path))
        stream = _Stream(writer)
        try:
            yield stream
            stream.close()
        except BaseException:
            self.store.abandon(writer)  # abort, never complete what may be partial
            raise
        assert stream.info is not None
        self.written[Path(path).name] = stream.info

    def _read(self, path: str | os.PathLike[str]) -> io.BytesIO:
        """The whole object, hashed and checked against the verified manifest first."""
        name = Path(path).name
        known = (self.expected or {}).get(name)
        if known is None:
            raise CorruptCheckpointError(f"{self.store.url(self.key(path))} is not in the manifest")
        info, data = _get(self.store, self.key(path), known.size)
        if info != known:
            raise CorruptCheckpointError(
                f"{self.store.url(self.key(path))}: size {info.size}, hash {info.hash} "
                f"!= verified {known.size}, {known.hash}; refusing to load it"
            )
        return io.BytesIO(data)

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str | os.PathLike[str]:
        return Path(path) / suffix

    def init_path(self, path: str | os.PathLike[str]) -> str | os.PathLike[str]:
        return path

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """Nothing to create: a prefix needs no directory."""

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self.store.exists(f"{self.rel}/{Path(path).name}")

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        raise InvalidArgumentError(f"object storage cannot rename {path} to {new_path}")

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        raise InvalidArgumentError(f"{path}: DCP never removes an object of ours")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen by DCP itself: always passed as the writer/reader


class ShardWriter(FileSystemWriter):
    """DCP's file writer over :class:`ObjectFiles` (see the module docstring)."""

    def __init__(self, store: S3Store, rel: str) -> None:
        # sync_files=False: an object is durable once completed (DCP would os.sync()
        # the whole machine for a stream without a file descriptor)
        super().__init__(store.local_path(rel), sync_files=False, overwrite=False)
        self.files = ObjectFiles(store, rel)
        self.fs = self.files  # type: ignore[assignment]  # DCP's file system seam
        self.path = store.local_path(rel)

    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        """This rank's shard files, and their manifest as one more write result."""
        faults.point("mid_shard_write")
        self.files.written.clear()
        results = list(super().write_data(plan, planner).value())
        files = {name: (info.size, info.hash) for name, info in self.files.written.items()}
        results.append(WriteResult(index=_MANIFEST_INDEX, size_in_bytes=0, storage_data=files))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """``.metadata`` with every rank's manifest, under its final key (no rename)."""
        files: dict[str, tuple[int, str]] = {}
        storage: dict[Any, Any] = {}
        for result in (r for rank in results for r in rank):
            if result.index == _MANIFEST_INDEX:
                files.update(result.storage_data)
            else:
                storage[result.index] = result.storage_data
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        setattr(metadata, MANIFEST_ATTR, files)
        with self.files.create_stream(self.files.concat_path(self.path, METADATA), "wb") as stream:
            pickle.dump(metadata, stream)

    def storage_meta(self) -> StorageMeta | None:
        # the URL, not an ObjectPath: the metadata unpickles without ckptdb
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)


class ShardReader(FileSystemReader):
    """DCP's file reader over :class:`ObjectFiles`: every object it reads is one GET,
    hashed and checked against the manifest that ``verify`` just checked."""

    def __init__(self, store: S3Store, rel: str, expected: Mapping[str, FileInfo]) -> None:
        super().__init__(store.local_path(rel))
        self.fs = ObjectFiles(store, rel, expected)  # type: ignore[assignment]
        self.path = store.local_path(rel)


# ---------------------------------------------------------------- the manifest


def read_manifest(
    store: S3Store, rel: str, limit: int | None = None
) -> tuple[dict[str, FileInfo], Metadata]:
    """Every file of the checkpoint (``.metadata`` too, as read now) and DCP's metadata.

    ``limit``: the most ``.metadata`` may hold (the row's size: every file's).
    Raises :class:`ObjectStoreError` if ``.metadata`` cannot be read and
    :class:`CorruptCheckpointError` if it is larger, not a manifest of ours, or
    if a file that DCP's metadata names is not in it.
    """
    key = store.key(f"{rel}/{METADATA}")
    info, data = _get(store, key, limit)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        listed = getattr(metadata, MANIFEST_ATTR)
        files = {str(n): FileInfo(int(s), str(h)) for n, (s, h) in listed.items()}
        named = {str(v.relative_path) for v in metadata.storage_data.values()}
    except Exception as exc:
        raise CorruptCheckpointError(f"{store.url(key)}: not a ckptdb manifest ({exc})") from exc
    unlisted = sorted(named - set(files))
    if unlisted or METADATA in files:
        raise CorruptCheckpointError(f"{store.url(key)}: files not in the manifest: {unlisted}")
    files[METADATA] = info
    return files, metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata and nothing else: ``.metadata`` holds the manifest that
    authenticates it (the row's digest covers the hashes inside it), so it is read
    before it can be trusted; a planted one must not run code in whoever verifies it."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not DCP metadata")


def seal(store: S3Store, rel: str) -> FileInfo:
    """The chief, after DCP returned on every rank: every file of the manifest is there
    with the size its writer wrote (HEAD each); the size and digest for the row.

    Raises :class:`PhaseError` naming ``verify``.
    """
    try:
        files, _ = read_manifest(store, rel)
        for name, info in sorted(files.items()):
            actual = store.head_size(store.key(f"{rel}/{name}"))
            if actual.size != info.size:
                raise ObjectStoreError(
                    f"{store.url(store.key(f'{rel}/{name}'))}: size {actual.size} "
                    f"!= written {info.size}"
                )
    except (ObjectStoreError, CorruptCheckpointError) as exc:
        raise PhaseError("verify", store.local_path(rel), exc) from exc
    return combine(files.items())


def verify(
    store: S3Store, rel: str, size: int | None, digest: str | None, *, full: bool
) -> tuple[Finding | None, dict[str, FileInfo] | None]:
    """Check a sharded checkpoint against its row; the finding, and the manifest it holds.

    The manifest (``.metadata`` and the sizes and hashes in it) must give the
    row's size and digest; then every file is HEADed (its size), or with
    ``full`` read and hashed. A file gone: ``lost`` (missing); one that differs
    from the manifest, or a manifest that differs from the row: ``corrupt``.
    """
    try:
        files, _ = read_manifest(store, rel, size)
    except ObjectStoreError as exc:
        return store.unreadable(exc, METADATA), None
    except CorruptCheckpointError as exc:
        return Finding(CORRUPT, str(exc), error=exc), None
    recorded = combine(files.items())
    if recorded != FileInfo(size or 0, digest or ""):
        detail = f"manifest {recorded.size} bytes, {recorded.hash} != recorded {size}, {digest}"
        return Finding(CORRUPT, detail, recorded), None
    for name, info in sorted(files.items()):
        if name == METADATA:
            continue  # read (and hashed) just now
        key = store.key(f"{rel}/{name}")
        try:
            actual = _hash_object(store, key) if full else store.head_size(key)
        except ObjectStoreError as exc:
            return store.unreadable(exc, name), None
        finding = verdict(actual, info.size, info.hash, full=full, part=name)
        if finding is not None:
            return finding, None
    return None, files


def _get(store: S3Store, key: str, limit: int | None = None) -> tuple[FileInfo, bytes]:
    """One whole object (a shard file DCP reads, or ``.metadata``), measured and hashed.

    At most ``limit`` bytes (what the object may hold) and one more are read: an
    object replaced by a far larger one is refused, never held whole in memory.
    """
    try:
        body = store.calls("get_object", Bucket=store.bucket, Key=key)["Body"]
        data = body.read() if limit is None else body.read(limit + 1)
    except Exception as exc:
        raise store_error("GetObject", store.url(key), exc) from exc
    if limit is not None and len(data) > limit:
        raise CorruptCheckpointError(
            f"{store.url(key)}: more than the {limit} bytes it may hold; refusing to read it"
        )
    return FileInfo(len(data), xxhash.xxh3_128(data).hexdigest()), data


def _hash_object(store: S3Store, key: str) -> FileInfo:
    """Size and hash of one object, streamed (a shard is never held whole to verify it)."""
    digest, size = xxhash.xxh3_128(), 0
    try:
        body = store.calls("get_object", Bucket=store.bucket, Key=key)["Body"]
        for chunk in body.iter_chunks(READ_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    except Exception as exc:
        raise store_error("GetObject", store.url(key), exc) from exc
    return FileInfo(size, digest.hexdigest())


__all__ = [
    "METADATA",
    "ObjectFiles",
    "ShardReader",
    "ShardWriter",
    "read_manifest",
    "seal",
    "verify",
]
