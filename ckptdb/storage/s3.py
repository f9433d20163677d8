"""The payload store on S3 and S3-compatible object storage: the second implementation.

Object storage has no rename, so nothing is renamed: a payload is written
directly under its final key, which is unique to its run and ledger row
(``<prefix>/<stream>/step-<step>.<run token>.v<row id>.pt``, see
:mod:`~ckptdb.storage.naming`) and never reused, and the ledger row is the
commit marker. The seam's steps map as follows:

1. ``prepare_stream``: nothing (a key needs no directory);
2. ``write_object``: stream ``torch.save`` into a multipart upload
   (:mod:`~ckptdb.storage.s3upload`), completed with ``If-None-Match: *``
   and HEAD-verified; any failure aborts the upload;
3. ``place`` / ``sync_placed``: nothing: the temporary and the final name
   are the same key, and a completed object is already durable;
4. ``remove``: ``DeleteObject`` (idempotent), after aborting any upload of
   the key still in progress.

Reads: ``verify`` HEADs the object (size), or with ``full`` GETs it once and
hashes it; the verified bytes are what :meth:`S3Store.open_verified`
hands to ``torch.load``, so what is unpickled is exactly what was hashed.
Reconcile lists the prefix and the multipart uploads in progress; only keys
with the run's token (or none: written before tokens) are the run's, anything
else (another ledger's, under the same prefix) is never touched. A checkpoint
of ours that no row owns cannot be moved aside (a move is a copy and a
delete), so ``quarantine`` leaves it where it is.

A sharded (DCP) payload is a prefix, ``<stream>/step-<step>.<run token>.v<row id>.dcp/``,
with one object per file of the checkpoint (:mod:`~ckptdb.storage.s3dcp`):
every rank writes its shard files there, ``seal`` HEADs each file of the
manifest in ``.metadata``, ``verify`` checks every file against it, and
``remove`` aborts every upload under the prefix and deletes every object
under it (``DeleteObjects``). External payloads (a framework's own writer,
which writes local files) are refused with
:class:`~ckptdb.errors.InvalidArgumentError`.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from ..errors import InvalidArgumentError, ObjectStoreError, PhaseError
from ..location import ObjectPath
from ..policies import STREAM_NAME
from . import s3dcp
from .base import LOST, Finding, Found, verdict
from .files import FileInfo, _in_chain
from .naming import CHECKPOINT_NAME, OBJECT_NAME, SHARDED_SUFFIX, is_sharded
from .s3client import (
    PROBE_DIR,
    PROBE_MAX_AGE,
    PROBE_NAME,
    Calls,
    S3Options,
    is_missing,
    probe_conditional_writes,
    store_error,
)
from .s3upload import ObjectWriter

READ_CHUNK = 8 << 20
DELETE_BATCH = 1000  # the most keys one DeleteObjects takes
EXTERNAL = (
    "an External payload (a framework's own writer, as the Lightning, Hugging Face and "
    "Accelerate integrations use, which writes local files)"
)


class S3Store:
    """Payloads under ``s3://bucket/prefix/<stream>/`` (see the module docstring)."""

    #: No rename: a payload is written under its final key (the protocol names it so).
    renames = False
    #: Payload kinds this store holds.
    kinds = frozenset({"torch", "dcp"})
    #: A load reads the bytes its own verify hashed: every rank that loads verifies.
    reads_verified_bytes = True

    def __init__(self, location: ObjectPath, options: S3Options, *, probe: bool = True) -> None:
        self._location = location
        self.bucket, self.prefix = location.bucket, location.key
        self.calls = Calls(options)
        self._uploads: dict[str, list[str]] | None = None  # one pass's listing (reconcile)
        self._unaborted: dict[str, list[str]] = {}  # uploads whose abort failed
        self._foreign: set[str] = set()  # keys a conditional write found taken
        self.run_token: str | None = None  # set by the writer (see PayloadStore.run_token)
        self._loading = threading.local()  # a verify's held bytes or manifest, per thread
        if probe and options.require_conditional_writes:
            probe_conditional_writes(self.calls, self.bucket, self.prefix)

    def __repr__(self) -> str:
        return f"S3Store({str(self._location)!r})"

    @property
    def location(self) -> Path:
        return self._location

    def absent(self, directory: str = "") -> bool:
        return False  # a prefix: there as soon as the bucket is (which the open checked)

    def key(self, rel: str) -> str:
        """The key of ``rel``; refused unless it is ``<segment>/...`` with plain segments."""
        segments = rel.split("/")
        if any(s in ("", ".", "..") for s in segments):
            raise InvalidArgumentError(f"{rel!r} is not a name inside {self._location}")
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def local_path(self, rel: str) -> Path:
        """The object's location (an :class:`ObjectPath`, never a local file)."""
        self.key(rel)
        return self._location / rel

    def memoized(self) -> AbstractContextManager[Any]:
        """A pass (reconcile): the uploads in progress are listed once, at its start."""
        return _Pass(self)

    # ------------------------------------------------------------------ writing

    def prepare_stream(self, stream: str) -> None:
        """Nothing to prepare: a key needs no directory."""

    def prepare_parent(self, rel: str) -> None:
        raise _unsupported(EXTERNAL)

    def make_temp_dir(self, rel: str) -> None:
        """Nothing to create: a sharded payload's prefix needs no directory."""
        self.key(rel)

    def dcp_writer(self, rel: str) -> Any:
        """DCP's writer of this rank's shard files (and, on its coordinator, ``.metadata``)."""
        return s3dcp.ShardWriter(self, rel)

    def dcp_reader(self, rel: str) -> Any:
        """DCP's reader of ``rel``, checking every object against the manifest that the
        full :meth:`verify` of ``rel`` just before it checked (refused without one)."""
        held, self._manifest = self._manifest, None
        if held is None or held[0] != rel:
            raise InvalidArgumentError(f"{rel} was not verified just before it was read")
        return s3dcp.ShardReader(self, rel, held[1])

    def seal(self, rel: str) -> FileInfo:
        """HEAD every file of the manifest DCP's coordinator wrote; the row's size and hash."""
        return s3dcp.seal(self, rel)

    def seal_written(self, rel: str) -> FileInfo:
        raise _unsupported(EXTERNAL)

    def exists(self, rel: str) -> bool:
        """Whether the object exists (a sharded payload: any object under its prefix)."""
        key = self.key(rel)
        if is_sharded(rel):
            return next(self._list_keys(f"{key}/", limit=1), None) is not None
        try:
            self.calls("head_object", Bucket=self.bucket, Key=key)
        except Exception as exc:
            if is_missing(exc):
                return False
            raise store_error("HeadObject", self.url(key), exc) from exc
        return True

    def write_object(self, rel: str, serialize: Callable[[Any], object]) -> FileInfo:
        """``serialize(writer)`` into a new object at ``rel``, completed only if all went well.

        Raises :class:`PhaseError` naming ``write`` (serialization or a part),
        ``complete`` or ``verify`` (the HEAD after it); an interrupt propagates
        as itself. The upload is aborted first in every case.
        """
        writer = ObjectWriter(self.calls, self.bucket, self.key(rel))
        try:
            serialize(writer)
            return writer.finish()
        except BaseException as exc:
            self.abandon(writer)
            interrupt = _in_chain(exc, lambda e: not isinstance(e, Exception))
            if interrupt is not None:
                raise interrupt from None  # Ctrl-C stays Ctrl-C, not a write error
            cause = _in_chain(exc, lambda e: isinstance(e, OSError)) or exc
            raise PhaseError(writer.phase, self.local_path(rel), cause) from cause

    def abandon(self, writer: ObjectWriter) -> None:
        """Abort the upload; an abort that fails is remembered for :meth:`remove`."""
        if writer.conflict:
            self._foreign.add(writer.key)  # someone else's object: never removed by us
        upload_id = writer.upload_id
        try:
            writer.abort()
        except ObjectStoreError:
            assert upload_id is not None
            self._unaborted.setdefault(writer.key, []).append(upload_id)

    def place(self, tmp: str, final: str) -> None:
        """Nothing to move: the object was written under its final key."""
        if tmp != final:
            raise InvalidArgumentError(f"object storage cannot rename {tmp} to {final}")

    def sync_placed(self, finals: list[str]) -> None:
        """Nothing to sync: a completed object is durable (and was HEAD-verified)."""

    # ------------------------------------------------------------------ reading

    def verify(
        self, rel: str, size: int | None, digest: str | None, *, full: bool, keep: bool = False
    ) -> Finding | None:
        """HEAD (size), or with ``full`` one GET, hashed before anything reads it (size and hash).

        404: ``lost`` (missing). Any other failure to read: ``lost``, not
        missing (unreadable now is not gone). A size or hash that differs: ``corrupt``.
        With ``keep`` (a load follows) the verified bytes are held for
        :meth:`open_verified`; without it they are dropped at once, so a check or a
        ``verify`` that loads nothing never keeps a payload in memory.
        """
        self._verified = self._manifest = None
        if is_sharded(rel):
            return self._verify_sharded(rel, size, digest, full=full, keep=keep)
        key = self.key(rel)
        try:
            actual, data = self._fetch(key, size, keep) if full else (self.head_size(key), None)
        except ObjectStoreError as exc:
            return self.unreadable(exc)
        finding = verdict(actual, size, digest, full=full)
        if finding is None and data is not None:
            self._verified = (rel, data)
        return finding

    def _verify_sharded(
        self, rel: str, size: int | None, digest: str | None, *, full: bool, keep: bool
    ) -> Finding | None:
        """Every file of the manifest (see :func:`s3dcp.verify`); with ``keep`` the verified
        manifest is held for :meth:`dcp_reader` (only the manifest, never the bytes), which
        hashes every file it reads against it: a load may skip ``full`` (a rank that
        only loads its own shards need not download every file to check it)."""
        finding, files = s3dcp.verify(self, rel, size, digest, full=full)
        if finding is None and files is not None and keep:
            self._manifest = (rel, files)
        return finding

    def unreadable(self, exc: ObjectStoreError, name: str | None = None) -> Finding:
        """The finding for an object that could not be read: missing (404, and the bucket
        answers), or unreadable now (not proof that it is gone). ``name``: a file of a
        sharded payload, named in the detail (None: the payload's own object)."""
        where = "" if name is None else f"{name}: "
        doubt = self._bucket_doubt() if is_missing(exc.__cause__ or exc) else ""
        if doubt is None:
            return Finding(LOST, f"{where}object missing", missing=True, error=exc)
        return Finding(LOST, f"{where}unreadable: {exc}{doubt}", error=exc)

    def _bucket_doubt(self) -> str | None:
        """A HEAD's 404 has no body, so a missing bucket looks like a missing key: before
        a 404 marks a row lost, the bucket must answer (a typo'd or deleted bucket is
        unreadable, not proof that the checkpoints are gone). None: it answers; else
        why the 404 is not trusted (the HeadBucket error, for the finding's text)."""
        try:
            self.calls("head_bucket", Bucket=self.bucket)
        except Exception as exc:
            return f"; and {store_error('HeadBucket', f's3://{self.bucket}', exc)}"
        return None

    def head_size(self, key: str) -> FileInfo:
        try:
            head = self.calls("head_object", Bucket=self.bucket, Key=key)
        except Exception as exc:
            raise store_error("HeadObject", self.url(key), exc) from exc
        return FileInfo(int(head["ContentLength"]), "")

    def _fetch(
        self,
        key: str,
        expected: int | None,
        keep: bool,
        sink: Callable[[bytes], object] | None = None,
    ) -> tuple[FileInfo, bytes | None]:
        """One GET of the whole object, hashed; with ``keep`` its bytes too.

        With ``keep`` (a load) at most the recorded size plus one byte is read
        into memory, in one read (a third faster than chunked reads), and that
        buffer is what is hashed and later unpickled. Anything else is read in
        chunks, hashed and dropped (without ``keep``, one chunk in memory at a
        time, whatever the payload's size). Reading stops at the response's
        Content-Length, never one read further: botocore checks the CRC64NVME
        of a stream at its end, and a corrupt object must be found corrupt by
        its size and hash here, not be an unreadable error there. ``sink`` gets each
        chunk as it is hashed (a download); its own failure propagates as itself.
        """
        digest, data, size = xxhash.xxh3_128(), None, 0
        try:
            response = self.calls("get_object", Bucket=self.bucket, Key=key)
            body, length = response["Body"], int(response["ContentLength"])
            if keep:
                data = body.read(min(length, (expected or 0) + 1))
                digest.update(data)
                size = len(data)
            while size < length:
                chunk = body.read(min(READ_CHUNK, length - size))
                if not chunk:
                    raise ObjectStoreError(f"the body ended at {size} of {length} bytes")
                digest.update(chunk)
                size += len(chunk)
                if sink is not None:
                    _Sinking.call(sink, chunk)
                del chunk  # before the next read: one chunk in memory, not two
        except _Sinking as failed:
            raise failed.error from failed.error.__cause__
        except Exception as exc:
            raise store_error("GetObject", self.url(key), exc) from exc
        return FileInfo(size, digest.hexdigest()), data

    # ------------------------------------------------------------------ a second tier

    def download(self, rel: str, sink: Callable[[bytes], object]) -> FileInfo:
        """The object at ``rel``, chunk by chunk into ``sink`` (one GET); the size and
        hash of what was read. A failure of ``sink`` (the local disk) is raised as itself."""
        return self._fetch(self.key(rel), None, False, sink)[0]

    def remove_tree(self, rel: str) -> bool:
        """Every object and upload in progress under ``rel/`` (a copy of a checkpoint
        made by the replicator); idempotent."""
        return self._remove_prefix(f"{self.key(rel)}/")

    def list_under(self, rel: str) -> list[str]:
        """Every object under ``rel/``, each as a name inside this store (the ledger's
        replicas: :mod:`ckptdb.ledgercopy`)."""
        head = f"{self.key(rel)}/"
        start = len(self.prefix) + 1 if self.prefix else 0
        # a key found taken by someone else is never ours to report, nor to remove
        return [key[start:] for key in self._list_keys(head) if key not in self._foreign]

    def abort_uploads_under(self, rel: str) -> int:
        """Abort every multipart upload in progress under ``rel/`` (a copy of the ledger
        whose writer died: :mod:`ckptdb.ledgercopy`); how many were aborted."""
        uploads = self._uploads_under(f"{self.key(rel)}/")
        aborted = 0
        for key, ids in sorted(uploads.items()):
            for upload_id in dict.fromkeys(ids):
                self._abort(key, upload_id)
                aborted += 1
        return aborted

    def url_of(self, rel: str) -> str:
        """The URL of ``rel`` inside this store."""
        return self.url(self.key(rel))

    @property
    def url_prefix(self) -> str:
        """What the URL of everything inside this store starts with."""
        return self.url(f"{self.prefix}/") if self.prefix else self.url("")

    def rel_of(self, url: str) -> str | None:
        """``url`` relative to this store (None: not inside it)."""
        head = self.url_prefix
        if not url.startswith(head) or url == head:
            return None
        rel = url[len(head) :]
        try:
            self.key(rel)
        except InvalidArgumentError:
            return None
        return rel

    @property
    def _verified(self) -> tuple[str, bytes] | None:
        """The last full verify's bytes in this thread (see :class:`LocalStore`)."""
        held: tuple[str, bytes] | None = getattr(self._loading, "verified", None)
        return held

    @_verified.setter
    def _verified(self, value: tuple[str, bytes] | None) -> None:
        self._loading.verified = value

    @property
    def _manifest(self) -> tuple[str, dict[str, FileInfo]] | None:
        """The last sharded verify's manifest in this thread."""
        held: tuple[str, dict[str, FileInfo]] | None = getattr(self._loading, "manifest", None)
        return held

    @_manifest.setter
    def _manifest(self, value: tuple[str, dict[str, FileInfo]] | None) -> None:
        self._loading.manifest = value

    def forget_verified(self) -> None:
        self._verified = self._manifest = None

    def open_verified(self, rel: str) -> BinaryIO | None:
        """The bytes the last full :meth:`verify` of ``rel`` hashed (read once, then dropped)."""
        held, self._verified = self._verified, None
        if held is None or held[0] != rel:
            raise InvalidArgumentError(f"{rel} was not verified just before it was read")
        return io.BytesIO(held[1])  # shares the bytes, no copy

    def list_ours(self) -> Iterator[Found]:
        """Objects in our naming under the prefix, then uploads in progress of keys
        in our naming that have no object (``temp``). Anything else is foreign."""
        seen: set[str] = set()
        found = []
        for key in self._list_keys():
            entry = self._ours(key)
            if entry is not None and entry.rel not in seen:  # a prefix: once
                seen.add(entry.rel)
                found.append(entry)
        for key in self._list_uploads():
            entry = self._ours(key, "temp")
            if entry is not None and entry.rel not in seen:
                seen.add(entry.rel)
                found.append(entry)
        yield from sorted(found, key=lambda f: (f.stream, f.name))

    def _ours(self, key: str, role: str = "checkpoint") -> Found | None:
        head = f"{self.prefix}/" if self.prefix else ""
        if not key.startswith(head):
            return None
        stream, _, name = key[len(head) :].partition("/")
        if stream == PROBE_DIR:
            return _stale_probe(name)
        if not STREAM_NAME.fullmatch(stream) or stream.startswith("ckptdb."):
            return None
        name, slash, inside = name.partition("/")
        sharded = name.endswith(SHARDED_SUFFIX)
        if sharded != bool(slash) or (slash and not inside):
            return None  # a sharded payload is a prefix of objects, any other one an object
        mine = OBJECT_NAME.fullmatch(name)
        if mine is not None and mine.group(2) != self.run_token:
            return None  # another run's (another ledger under this prefix)
        if mine is None and (sharded or not CHECKPOINT_NAME.fullmatch(name)):
            return None  # not in our naming (CHECKPOINT_NAME: keys from before tokens)
        return Found(stream, name, "temp" if role == "temp" else "checkpoint")

    def _list_keys(self, head: str | None = None, limit: int | None = None) -> Iterator[str]:
        """Keys under ``head`` (the store's prefix by default), ``limit`` a page's size."""
        if head is None:
            head = f"{self.prefix}/" if self.prefix else ""
        params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": head}
        if limit is not None:
            params["MaxKeys"] = limit
        while True:  # pages through Calls (not a paginator): expired credentials refresh
            try:
                page = self.calls("list_objects_v2", **params)
            except Exception as exc:
                raise store_error("ListObjectsV2", self.url(head), exc) from exc
            yield from (o["Key"] for o in page.get("Contents", []))
            if not page.get("IsTruncated"):
                return
            where = f"ListObjectsV2 {self.url(head)}"
            params["ContinuationToken"] = _marker(page, "NextContinuationToken", where)

    def _list_uploads(self) -> dict[str, list[str]]:
        if self._uploads is not None:
            return self._uploads
        return self._uploads_under(f"{self.prefix}/" if self.prefix else "")

    def _uploads_under(self, head: str) -> dict[str, list[str]]:
        """The multipart uploads in progress under ``head``: {key: [upload id]}, listed now."""
        uploads: dict[str, list[str]] = {}
        params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": head}
        while True:  # pages through Calls (not a paginator): expired credentials refresh
            try:
                page = self.calls("list_multipart_uploads", **params)
            except Exception as exc:
                raise store_error("ListMultipartUploads", self.url(head), exc) from exc
            for upload in page.get("Uploads", []):
                uploads.setdefault(upload["Key"], []).append(upload["UploadId"])
            if not page.get("IsTruncated"):
                return uploads
            where = f"ListMultipartUploads {self.url(head)}"
            params["KeyMarker"] = _marker(page, "NextKeyMarker", where)
            params["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    # ------------------------------------------------------------------ removing

    def disowned(self, rel: str) -> bool:
        """Whether our completion found ``rel`` taken (If-None-Match: * refused it); a
        sharded payload: any object under its prefix."""
        key = self.key(rel)
        if is_sharded(rel):
            return any(k.startswith(f"{key}/") for k in self._foreign)
        return key in self._foreign

    def remove(self, rel: str) -> bool:
        """Abort the key's uploads in progress (as far as known), then delete the object.

        Idempotent; returns True (``DeleteObject`` does not say whether the
        object existed). A key found taken by someone else is never removed.
        """
        key = self.key(rel)
        if is_sharded(rel):
            return self._remove_prefix(f"{key}/")
        if key in self._foreign:
            return False
        known = [*self._unaborted.get(key, []), *(self._uploads or {}).get(key, [])]
        for upload_id in known:
            self._abort(key, upload_id)
        self._unaborted.pop(key, None)
        try:
            self.calls("delete_object", Bucket=self.bucket, Key=key)
        except Exception as exc:
            raise store_error("DeleteObject", self.url(key), exc) from exc
        return True

    def _remove_prefix(self, head: str) -> bool:
        """A sharded payload: abort every upload under ``head`` (listed now, and those whose
        abort failed here), then delete every object under it, a thousand per
        ``DeleteObjects``. Idempotent; keys found taken by someone else are left alone."""
        uploads = self._uploads_under(head)
        for key in [k for k in self._unaborted if k.startswith(head)]:
            uploads.setdefault(key, []).extend(self._unaborted.pop(key))
        for key, ids in sorted(uploads.items()):
            for upload_id in dict.fromkeys(ids):
                self._abort(key, upload_id)
        keys = [k for k in self._list_keys(head) if k not in self._foreign]
        for start in range(0, len(keys), DELETE_BATCH):
            self._delete_objects(head, keys[start : start + DELETE_BATCH])
        return True

    def _delete_objects(self, head: str, keys: list[str]) -> None:
        objects = [{"Key": k} for k in keys]
        try:
            done = self.calls(
                "delete_objects", Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True}
            )
        except Exception as exc:
            raise store_error("DeleteObjects", self.url(head), exc) from exc
        errors = [e for e in done.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        if errors:
            first = errors[0]
            raise ObjectStoreError(
                f"DeleteObjects under {self.url(head)}: {len(errors)} keys not deleted "
                f"(first: {first.get('Key')}: {first.get('Code')})"
            )

    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self.calls("abort_multipart_upload", Bucket=self.bucket, Key=key, UploadId=upload_id)
        except Exception as exc:
            if not is_missing(exc):
                raise store_error("AbortMultipartUpload", self.url(key), exc) from exc

    def move_in(self, source: Path, rel: str) -> Callable[[], None]:
        """Adopting local files into object storage would be an upload, not a move."""
        raise _unsupported(f"adopting {source} with --move")

    def quarantine(self, rel: str, into: Path) -> Path:
        """Leave the object where it is (a move would be a copy and a delete); its location."""
        return self.local_path(rel)

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"


class _Sinking(Exception):
    """Carries a failure of a download's sink through the read loop (it is not the store's)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error

    @classmethod
    def call(cls, sink: Callable[[bytes], object], chunk: bytes) -> None:
        try:
            sink(chunk)
        except Exception as exc:
            raise cls(exc) from exc


def _marker(page: dict[str, Any], name: str, where: str) -> str:
    """The marker a truncated page names to go on from. Without one the listing cannot
    go on: starting over would list the same page forever, and stopping would take
    part of the listing for all of it."""
    marker = page.get(name)
    if not marker:
        raise ObjectStoreError(f"{where}: a truncated page without {name}; cannot go on")
    return str(marker)


def _stale_probe(name: str) -> Found | None:
    """A leftover of the conditional-write probe (a process killed mid-probe), old
    enough that no probe still runs on it: a temporary of ours (reconcile removes it)."""
    found = PROBE_NAME.fullmatch(name)
    if found is None or time.time() - int(found.group(1)) < PROBE_MAX_AGE:
        return None
    return Found(PROBE_DIR, name, "temp")


def _unsupported(what: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{what} cannot be saved to object storage yet: use a local save_dir for it"
    )


class _Pass:
    def __init__(self, store: S3Store) -> None:
        self.store = store

    def __enter__(self) -> S3Store:
        self.store._uploads = None
        self.store._uploads = self.store._list_uploads()
        return self.store

    def __exit__(self, *exc: object) -> None:
        self.store._uploads = None
        self.store._verified = self.store._manifest = None
