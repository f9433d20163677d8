"""Streaming ``torch.save`` into one new object: a multipart upload we drive ourselves.

:class:`ObjectWriter` is the write-only file object ``torch.save`` writes into.
Bytes are hashed (xxh3-128, the same :class:`FileInfo` hash as a local file),
counted, checksummed (a full-object CRC64NVME) and cut into parts that upload
on a few threads while serialization goes on; at most ``max_concurrency``
parts are in flight and one more fills, so memory is bounded by the part
buffers, never by the payload. A payload smaller than one part is sent as one
``PutObject`` instead (one request instead of three, just as atomic).

Every byte is copied once, from ``torch.save`` into a part buffer (a
``BytesIO``), and the buffers are reused part after part. botocore reads a
part's ``BytesIO`` in place: its SigV4 signer, its checksum and the socket
take file bodies as they are, where a ``bytearray`` body is first copied
whole into a new ``BytesIO`` by the signer, so every part in flight would
exist twice.

The object appears only at :meth:`ObjectWriter.finish`: ``CompleteMultipartUpload``
(or the single ``PutObject``) with ``If-None-Match: *``, so an existing object
is never overwritten. Any failure before that aborts the upload: nothing
partial ever exists under the key. A completion whose outcome is unknown
(a timeout or 5xx after it was sent, a 412 or NoSuchUpload on a retry of our
own request) is settled by a HEAD: the object is accepted only if its size,
and its CRC64NVME when the store reports one, are ours.
"""

from __future__ import annotations

import base64
import io
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xxhash

from .. import faults
from ..errors import ObjectStoreError
from .files import FileInfo
from .s3client import Calls, describe, http_status, is_missing, store_error, was_retried

MAX_PARTS = 10_000
PARTS_PER_SIZE_STEP = 1_000  # the part size doubles every 1,000 parts (S3 allows 10,000)


def crc64nvme(data: Any, previous: int) -> int:
    from awscrt import checksums

    return int(checksums.crc64nvme(data, previous))


def b64_crc(value: int) -> str:
    return base64.b64encode(value.to_bytes(8, "big")).decode()


class ObjectWriter:
    """One new object at ``bucket/key``, written by ``write`` calls (see the module doc)."""

    def __init__(self, calls: Calls, bucket: str, key: str) -> None:
        self.calls, self.bucket, self.key = calls, bucket, key
        self.options = calls.options
        self.checksum = self.options.checksum == "crc64nvme"
        self.upload_id: str | None = None
        self.size = 0
        self._hash = xxhash.xxh3_128()
        self._crc = 0
        self._part = io.BytesIO()  # the part filling
        self._spare: list[io.BytesIO] = []  # buffers of parts already uploaded, to reuse
        self._parts: list[Future[dict[str, Any]]] = []
        self._in_flight: deque[tuple[Future[dict[str, Any]], io.BytesIO]] = deque()
        self._pool: ThreadPoolExecutor | None = None
        #: The key was taken before our completion: not ours, never to be removed by us.
        self.conflict = False
        #: The protocol phase a failure belongs to: write, complete, then verify.
        self.phase = "write"

    @property
    def where(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    # ------------------------------------------------------------------ writing

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        self._hash.update(view)
        if self.checksum:
            self._crc = crc64nvme(view, self._crc)
        self.size += n
        while view.nbytes:
            view = self._fill(view)
        faults.point("mid_write")
        return n

    def _fill(self, view: memoryview) -> memoryview:
        """Copy what fits of ``view`` into the part filling (shipped once full); the rest."""
        room = self._part_size(len(self._parts) + 1) - self._part.tell()
        self._part.write(view[:room])
        if view.nbytes >= room:
            self._ship()
        return view[room:]

    def flush(self) -> None:
        """Nothing to do: parts leave when they are full (``torch.save`` calls it)."""

    def _part_size(self, number: int) -> int:
        return int(self.options.part_size) << ((number - 1) // PARTS_PER_SIZE_STEP)

    def _ship(self) -> None:
        """Hand the full buffer to an upload thread and fill a spare one (a buffer whose
        upload has returned) or a new one; wait while too many are in flight."""
        if self.upload_id is None:
            self._create()
        number = len(self._parts) + 1
        if number > MAX_PARTS:
            raise ObjectStoreError(f"{self.where}: more than {MAX_PARTS} parts")
        while len(self._in_flight) >= self.options.max_concurrency:
            done, buffer = self._in_flight.popleft()
            done.result()  # an upload error surfaces here
            self._spare.append(buffer)  # botocore is done with it: reused
        body = self._part
        body.truncate(body.tell())  # a reused buffer may hold more: the last part is shorter
        body.seek(0)
        self._part = self._spare.pop() if self._spare else io.BytesIO()
        self._part.seek(0)
        assert self._pool is not None
        future = self._pool.submit(self._upload_part, number, body)
        self._parts.append(future)
        self._in_flight.append((future, body))

    def _create(self) -> None:
        params: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key}
        if self.checksum:
            params.update(ChecksumAlgorithm="CRC64NVME", ChecksumType="FULL_OBJECT")
        try:
            self.upload_id = self.calls("create_multipart_upload", **params)["UploadId"]
        except Exception as exc:
            raise store_error("CreateMultipartUpload", self.where, exc) from exc
        self._pool = ThreadPoolExecutor(
            max_workers=self.options.max_concurrency, thread_name_prefix="ckptdb-s3-part"
        )

    def _upload_part(self, number: int, body: io.BytesIO) -> dict[str, Any]:
        params: dict[str, Any] = {}
        if self.checksum:
            params["ChecksumAlgorithm"] = "CRC64NVME"
        try:
            done = self.calls(
                "upload_part",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                PartNumber=number,
                Body=body,  # read in place (a file body is never copied)
                **params,
            )
        except Exception as exc:
            raise store_error(f"UploadPart {number} of", self.where, exc) from exc
        part = {"PartNumber": number, "ETag": done["ETag"]}
        if self.checksum and done.get("ChecksumCRC64NVME"):
            part["ChecksumCRC64NVME"] = done["ChecksumCRC64NVME"]
        return part

    # ------------------------------------------------------------------ finishing

    def finish(self) -> FileInfo:
        """Make the object exist (conditionally), then check it is ours; its size and hash."""
        if self.upload_id is None:
            self.phase = "complete"
            self._put_whole()
        else:
            if self._part.tell():
                self._ship()
            parts = [future.result() for future in self._parts]  # a part's error: write
            self._close_pool()
            self.phase = "complete"
            faults.point("s3_before_complete")
            self._complete(parts)
        faults.point("s3_after_complete")
        self.phase = "verify"
        self.confirm(settling=False)
        return FileInfo(self.size, self._hash.hexdigest())

    def _checksum_params(self) -> dict[str, Any]:
        if not self.checksum:
            return {}
        return {"ChecksumCRC64NVME": b64_crc(self._crc), "ChecksumType": "FULL_OBJECT"}

    def _put_whole(self) -> None:
        body, self._part = self._part.getvalue(), io.BytesIO()  # bytes: the signer shares them
        params = self._checksum_params()
        params.pop("ChecksumType", None)
        faults.point("s3_before_complete")
        try:
            self.calls(
                "put_object", Bucket=self.bucket, Key=self.key, Body=body, IfNoneMatch="*", **params
            )
        except Exception as exc:
            self._settle("PutObject", exc)

    def _complete(self, parts: list[dict[str, Any]]) -> None:
        try:
            self.calls(
                "complete_multipart_upload",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
                IfNoneMatch="*",
                **self._checksum_params(),
            )
        except Exception as exc:
            self._settle("CompleteMultipartUpload", exc)
        self.upload_id = None  # completed: nothing left to abort

    def _settle(self, operation: str, exc: Exception) -> None:
        """A completion that failed: ours after all (HEAD matches), or the error.

        A 412 on the first try means the key was taken by something else: not
        ours, and never touched again (``conflict``). Anything else that could
        have completed on the server (a retried 412 or NoSuchUpload, a 5xx or
        a timeout) is settled by a HEAD of the key: an object that is there but
        does not match is someone else's (``conflict`` too).
        """
        status = http_status(exc)
        if status == 412 and not was_retried(exc):
            self.conflict = True
            raise store_error(f"{operation} (If-None-Match: *)", self.where, exc) from exc
        if status is not None and status < 500 and not (status in (404, 412) and was_retried(exc)):
            raise store_error(operation, self.where, exc) from exc
        try:
            self.confirm(settling=True)
        except ObjectStoreError as unsettled:
            first = store_error(operation, self.where, exc)
            raise ObjectStoreError(f"{first}; and then {unsettled}") from exc

    def confirm(self, *, settling: bool) -> None:
        """HEAD the new object: its size (and CRC64NVME, if reported) must be ours."""
        params = {"ChecksumMode": "ENABLED"} if self.checksum else {}
        try:
            head = self.calls("head_object", Bucket=self.bucket, Key=self.key, **params)
        except Exception as exc:
            what = "is missing" if is_missing(exc) else f"HEAD failed: {describe(exc)}"
            raise ObjectStoreError(f"{self.where} {what}") from exc
        problems = []
        if head.get("ContentLength") != self.size:
            problems.append(f"size {head.get('ContentLength')} != written {self.size}")
        reported = head.get("ChecksumCRC64NVME")
        if self.checksum and reported and reported != b64_crc(self._crc):
            problems.append("CRC64NVME differs from what was written")
        if problems:
            context = " after an unsettled completion" if settling else ""
            if settling:
                # an object is there and it is not what we sent: someone else's
                # (ours would match), so the rollback must leave it alone
                self.conflict = True
                context += " (someone else's object: left alone)"
            raise ObjectStoreError(f"{self.where}{context}: {'; '.join(problems)}")

    # ------------------------------------------------------------------ aborting

    def abort(self) -> None:
        """Stop the part uploads and abort the multipart upload (idempotent).

        Raises :class:`ObjectStoreError` if the abort itself fails (the
        caller keeps the upload id for a later try; reconcile finds it too).
        """
        self._close_pool()
        if self.upload_id is None:
            return
        try:
            self.calls(
                "abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id
            )
        except Exception as exc:
            if not is_missing(exc):
                raise store_error("AbortMultipartUpload", self.where, exc) from exc
        self.upload_id = None

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._in_flight.clear()
        self._spare.clear()
