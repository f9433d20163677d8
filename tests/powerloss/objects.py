"""A run on object storage in the explorer: its requests recorded, its crash states rebuilt.

The client machine loses power; the S3 server does not. So what a cut leaves
in the store is decided by the requests the client had sent, and by whether
their responses came back (:class:`~powerloss.persistence.ObjectStore`):
a request answered before the cut took effect, one sent and not answered
may or may not have. :class:`ObjectRecorder` turns the requests that
change the store (seen through :mod:`ckptdb.trace`'s ``s3_request`` and
``s3_response``, copied when made and replayed in their place among the
system calls) into ops of the trace:

- ``s3_create`` (CreateMultipartUpload): an upload in progress, no object;
- ``s3_complete`` (CompleteMultipartUpload) and ``s3_put`` (PutObject):
  the object visible with the bytes it was sent (``blob``), the upload gone;
- ``s3_abort`` (AbortMultipartUpload): the upload gone;
- ``s3_delete`` (DeleteObject, and each key of a DeleteObjects, whose one
  response answers them all): the object gone;
- ``s3_part`` (an UploadPart answered: its bytes, no visible effect) and
  ``s3_done`` (the response of a request above: the request is then durable).

Reads change nothing and are left out, and so are the objects of the
conditional-write probe (``ckptdb.probe/``, removed by reconcile only once
an hour old). :func:`persisted_store` says what one crash state holds,
:func:`materialize_store` builds it under a fresh prefix of the real server
(or, for a trace recorded ``in_place``, under the recording's own prefix,
emptied first: a replicator's copies are recorded in the ledger by their
whole URL), :func:`store_problems` checks what a run left there.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckptdb.storage.s3client import PROBE_DIR

from .persistence import S3_REQUESTS, CrashSpace, CrashState
from .recording import Op, Recorder, Trace, TraceError

#: The requests that change the store, and the op each becomes.
REQUESTS = {
    "create_multipart_upload": "s3_create",
    "complete_multipart_upload": "s3_complete",
    "put_object": "s3_put",
    "abort_multipart_upload": "s3_abort",
    "delete_object": "s3_delete",
}
#: Requests the store does not make: a trace that has one cannot be followed.
UNFOLLOWED = frozenset({"copy_object", "upload_part_copy"})
NAMES = {
    "create_multipart_upload": "CreateMultipartUpload",
    "complete_multipart_upload": "CompleteMultipartUpload",
    "put_object": "PutObject",
    "abort_multipart_upload": "AbortMultipartUpload",
    "delete_object": "DeleteObject",
    "delete_objects": "DeleteObjects",
    "upload_part": "UploadPart",
}
REQUEST_KINDS = S3_REQUESTS
assert frozenset(REQUESTS.values()) == REQUEST_KINDS
IN_PROGRESS_PART = b"a part of an upload never completed"
TOKEN = "_powerloss_request"  # a copied request's pairing with its response


def client() -> Any:
    """A boto3 client of the server the environment names (the standard AWS chain),
    made once per endpoint (a client takes longer to make than a request)."""
    return _client(os.environ.get("CKPTDB_S3_ENDPOINT_URL"))


@functools.cache
def _client(endpoint: str | None) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint)


def body_bytes(body: Any) -> bytes:
    """A request's body as bytes: bytes-like, or a file read whole from its start (the
    writer hands each part to botocore as its reused ``BytesIO`` buffer, read in place;
    at the part's response that buffer still holds the part, and only that)."""
    if hasattr(body, "getvalue"):
        return bytes(body.getvalue())
    if hasattr(body, "read"):
        position = body.tell()
        body.seek(0)
        try:
            return bytes(body.read())
        finally:
            body.seek(position)
    return bytes(body)


def split(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix)."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return bucket, prefix.strip("/")


def listing(s3: Any, url: str) -> tuple[list[str], dict[str, str]]:
    """The keys under ``url`` (relative to it) and its uploads in progress (id -> key)."""
    bucket, prefix = split(url)
    keys: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys += [o["Key"][len(prefix) + 1 :] for o in page.get("Contents", [])]
    uploads: dict[str, str] = {}
    for page in s3.get_paginator("list_multipart_uploads").paginate(
        Bucket=bucket, Prefix=prefix + "/"
    ):
        for upload in page.get("Uploads", []):
            uploads[upload["UploadId"]] = upload["Key"][len(prefix) + 1 :]
    return sorted(keys), uploads


class ObjectRecorder:
    """Follows the requests to the store under ``url`` (give it to a :class:`Recorder`).

    What is under the prefix when it is made is the start of the trace,
    durable (a run's history): its objects, with their bytes, and its uploads.
    ``in_place``: the crash states are built under ``url`` itself (see
    :func:`materialize_store`).
    """

    def __init__(self, url: str, *, in_place: bool = False) -> None:
        self.url, self.in_place = url, in_place
        self.bucket, self.prefix = split(url)
        self.blobs: list[bytes] = []
        self.parts: dict[str, dict[int, bytes]] = {}  # upload id -> part number -> bytes
        self.pending: dict[int, list[int]] = {}  # a request's token -> its ops
        s3 = client()
        keys, self.uploads = listing(s3, url)
        self.objects = {
            rel: self._blob(s3.get_object(Bucket=self.bucket, Key=self._key(rel))["Body"].read())
            for rel in keys
            if not rel.startswith(f"{PROBE_DIR}/")
        }
        self.uploads = {i: k for i, k in self.uploads.items() if not k.startswith(f"{PROBE_DIR}/")}

    def trace_fields(self) -> dict[str, Any]:
        return {
            "store": self.url,
            "objects": dict(self.objects),
            "uploads": dict(self.uploads),
            "blobs": list(self.blobs),
            "store_in_place": self.in_place,
        }

    @staticmethod
    def capture(params: Mapping[str, Any], token: int) -> dict[str, Any]:
        """What the replay needs of a request, copied when it is made (its ``Body`` is a
        buffer the writer reuses): ``token`` pairs the request with its response."""
        copied = dict(params)
        if "Body" in copied:
            copied["Body"] = body_bytes(copied["Body"])
        copied[TOKEN] = token
        return copied

    def request(self, rec: Recorder, operation: str, params: Mapping[str, Any]) -> None:
        """A request about to be sent: an op if it changes the store under the prefix."""
        if operation == "delete_objects":
            self._request_deletes(rec, params)
            return
        rel = self._rel(params)
        if rel is None or (operation not in REQUESTS and operation not in UNFOLLOWED):
            return
        if operation in UNFOLLOWED:
            raise TraceError(f"{operation} of {rel}: the explorer does not follow it")
        blob = None
        if operation == "put_object":
            blob = self._blob(body_bytes(params["Body"]))
        elif operation == "complete_multipart_upload":
            blob = self._blob(self._assembled(params))
        text = f"{NAMES[operation]} {rel} (sent)"
        op = Op(0, REQUESTS[operation], text, key=rel, upload=params.get("UploadId"), blob=blob)
        self.pending[params[TOKEN]] = [rec.append(op)]

    def _request_deletes(self, rec: Recorder, params: Mapping[str, Any]) -> None:
        """A DeleteObjects: one ``s3_delete`` per key under the prefix (sent unanswered,
        any of them may have taken effect; its response answers them all)."""
        ops = []
        for entry in params["Delete"]["Objects"]:
            rel = self._rel({"Bucket": params.get("Bucket"), "Key": entry["Key"]})
            if rel is not None:
                op = Op(0, "s3_delete", f"DeleteObjects {rel} (sent)", key=rel)
                ops.append(rec.append(op))
        if ops:
            self.pending[params[TOKEN]] = ops

    def response(
        self, rec: Recorder, operation: str, params: Mapping[str, Any], answer: Any
    ) -> None:
        """A request answered: its part's bytes kept, or its ops marked answered."""
        rel = self._rel(params)
        if rel is None and operation != "delete_objects":  # that one names its keys inside
            return
        if operation == "upload_part":
            upload, number = str(params["UploadId"]), int(params["PartNumber"])
            self.parts.setdefault(upload, {})[number] = body_bytes(params["Body"])
            rec.append(Op(0, "s3_part", f"UploadPart {number} of {rel}", key=rel, upload=upload))
            return
        indexes = self.pending.pop(params[TOKEN], None)
        if indexes is None:
            return  # a read
        if operation == "delete_objects" and answer.get("Errors"):
            raise TraceError(f"a DeleteObjects answered with errors: {answer['Errors']}")
        first = rec.ops[indexes[0]]
        upload = str(answer["UploadId"]) if operation == "create_multipart_upload" else first.upload
        text = f"{NAMES[operation]} {first.key} answered" + (
            f" (+{len(indexes) - 1} keys)" if len(indexes) > 1 else ""
        )
        done = rec.append(Op(0, "s3_done", text, key=first.key, upload=upload))
        for index in indexes:
            rec.ops[index] = replace(rec.ops[index], upload=upload, answered=done)

    def _assembled(self, params: Mapping[str, Any]) -> bytes:
        parts = self.parts.get(str(params["UploadId"]), {})
        numbers = [int(p["PartNumber"]) for p in params["MultipartUpload"]["Parts"]]
        missing = [n for n in numbers if n not in parts]
        if missing:
            raise TraceError(f"a completion lists parts {missing} never uploaded")
        return b"".join(parts[n] for n in numbers)

    def _rel(self, params: Mapping[str, Any]) -> str | None:
        """The key relative to the prefix; None: outside it, or the probe's."""
        key = params.get("Key")
        head = f"{self.prefix}/"
        if params.get("Bucket") != self.bucket or not isinstance(key, str):
            return None
        if not key.startswith(head) or key[len(head) :].startswith(f"{PROBE_DIR}/"):
            return None
        return key[len(head) :]

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}"

    def _blob(self, data: bytes) -> int:
        self.blobs.append(data)
        return len(self.blobs) - 1


# ------------------------------------------------------------------ crash states


@dataclass(frozen=True)
class StoreState:
    """What the store holds in a crash state: objects (name, blob), uploads in progress."""

    objects: tuple[tuple[str, int], ...] = ()
    uploads: tuple[str, ...] = ()  # the key of each upload in progress

    def digest_parts(self, trace: Trace) -> Iterable[bytes]:
        for rel, blob in self.objects:
            yield f"o:{rel}:{len(trace.blobs[blob])}:{blob}".encode()
        for rel in self.uploads:
            yield f"u:{rel}".encode()


def persisted_store(trace: Trace, space: CrashSpace, state: CrashState) -> StoreState:
    """The store after the requests of the cut that took effect, in the order sent."""
    if trace.store is None:
        return StoreState()
    objects = dict(trace.objects)
    uploads = dict(trace.uploads)
    for op in trace.ops[: state.prefix]:
        if op.kind not in REQUEST_KINDS:
            continue
        if op.index not in space.pinned and op.index not in state.kept:
            continue
        assert op.key is not None
        if op.kind == "s3_create":
            uploads[op.upload or f"never answered {op.index}"] = op.key
        elif op.kind in ("s3_complete", "s3_put"):
            assert op.blob is not None
            objects[op.key] = op.blob
            uploads.pop(op.upload or "", None)
        elif op.kind == "s3_abort":
            uploads.pop(op.upload or "", None)
        elif op.kind == "s3_delete":
            objects.pop(op.key, None)
    return StoreState(tuple(sorted(objects.items())), tuple(sorted(uploads.values())))


def materialize_store(trace: Trace, store: StoreState, n: int) -> str:
    """Build ``store`` under a fresh prefix (the recording's, suffixed ``-s<n>``), or under
    the recording's own prefix, emptied first, for a trace recorded ``in_place``; its URL."""
    assert trace.store is not None
    bucket, prefix = split(trace.store)
    s3 = client()
    if trace.store_in_place:
        empty(s3, trace.store)
    else:
        prefix = f"{prefix}-s{n:05d}"
    for rel, blob in store.objects:
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=trace.blobs[blob])
    for rel in store.uploads:
        key = f"{prefix}/{rel}"
        upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        s3.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=IN_PROGRESS_PART)
    return f"s3://{bucket}/{prefix}"


def empty(s3: Any, url: str) -> None:
    """Every object and upload in progress under ``url`` removed."""
    bucket, prefix = split(url)
    keys, uploads = listing(s3, url)
    for start in range(0, len(keys), 1000):
        chunk = [{"Key": f"{prefix}/{rel}"} for rel in keys[start : start + 1000]]
        s3.delete_objects(Bucket=bucket, Delete={"Objects": chunk, "Quiet": True})
    for upload, rel in uploads.items():
        s3.abort_multipart_upload(Bucket=bucket, Key=f"{prefix}/{rel}", UploadId=upload)


def store_problems(url: str, rows: Iterable[Any]) -> list[str]:
    """What must never be left in the store once a run was reopened (or closed): an
    upload in progress, or an object of a rolled-back or deleted row."""
    keys, uploads = listing(client(), url)
    present = set(keys)
    problems = [f"multipart upload of {rel} left in progress" for rel in sorted(uploads.values())]
    for row in rows:
        if row.state in ("aborted", "deleted") and row.path in present:
            problems.append(f"object {row.path} of a row {row.state} (row {row.id}) left")
    return problems
