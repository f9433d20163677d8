"""The S3 client of an object-store run: options, retries, error text, the probe.

Credentials come from boto3's standard chain (environment, config files,
instance and container roles) unless ``storage_options`` names them; the
endpoint and region from ``storage_options`` or ``CKPTDB_S3_ENDPOINT_URL``
(S3-compatible stores). Nothing here keeps a secret anywhere but inside the
boto3 session: options print without them, and error text is built from the
store's error code and message only.

Retries are botocore's ``standard`` mode (503 SlowDown, 500, throttling,
timeouts and dropped connections, with exponential backoff and jitter). An
expired-credentials error is retried once more, after a fresh session has
re-read the credential chain (:class:`Calls`).
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .. import trace
from ..errors import (
    ArgumentTypeError,
    ConditionalWritesUnsupportedError,
    InvalidArgumentError,
    MissingExtraError,
    ObjectStoreError,
)

ENDPOINT_ENV = "CKPTDB_S3_ENDPOINT_URL"
MIN_PART_SIZE = 5 << 20  # S3's smallest part (but the last)
EXPIRED_CODES = frozenset(
    {"ExpiredToken", "ExpiredTokenException", "TokenRefreshRequired", "RequestExpired"}
)
CHECKSUM_MODES = ("crc64nvme", "off")
# ``scheme://user:password@``: the credentials part of a URL, never to be shown
USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s\"']*@")

# Installed by tests (fault injection through botocore's event hooks), applied to
# every client made here, including one made to refresh credentials.
_client_hook: Callable[[Any], None] | None = None


def set_client_hook(hook: Callable[[Any], None] | None) -> Callable[[Any], None] | None:
    """Install ``hook(client)``, run on every new S3 client (None removes it); the previous one."""
    global _client_hook
    previous, _client_hook = _client_hook, hook
    return previous


@dataclass(frozen=True)
class S3Options:
    """How to reach the store. The secrets are kept out of ``repr``.

    ``checksum``: ``crc64nvme`` sends a full-object CRC64NVME with every part
    and with the completion, and lets botocore add its default request
    checksums; ``off`` sends checksums only where an operation requires one
    (for S3-compatible stores that reject boto3's defaults since 1.36).
    ``require_conditional_writes``: refuse a store that ignores
    ``If-None-Match: *`` (the probe at open).
    """

    endpoint_url: str | None = field(default=None, repr=False)  # may carry user:password@
    region_name: str | None = None
    profile_name: str | None = None
    checksum: str = "crc64nvme"
    require_conditional_writes: bool = True
    part_size: int = 8 << 20
    max_concurrency: int = 4
    max_attempts: int = 5
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    aws_access_key_id: str | None = field(default=None, repr=False)
    aws_secret_access_key: str | None = field(default=None, repr=False)
    aws_session_token: str | None = field(default=None, repr=False)


_TYPES: dict[str, tuple[type, ...]] = {
    "checksum": (str,),
    "require_conditional_writes": (bool,),
    "part_size": (int,),
    "max_concurrency": (int,),
    "max_attempts": (int,),
    "connect_timeout": (int, float),
    "read_timeout": (int, float),
}


def parse_options(given: Mapping[str, object] | None) -> S3Options:
    """Checked :class:`S3Options` from ``storage_options`` (and the endpoint variable).

    An unknown key, a wrong type or a value out of range is refused before
    anything is contacted (the message never repeats a value: it may be a secret).
    """
    if given is None:
        given = {}
    if not isinstance(given, Mapping):
        raise ArgumentTypeError(f"storage_options must be a dict, got {type(given).__name__}")
    known = {f.name for f in fields(S3Options)}
    unknown = sorted(str(k) for k in given if k not in known)
    if unknown:
        raise InvalidArgumentError(
            f"unknown storage_options {unknown}; known: {', '.join(sorted(known))}"
        )
    for name, value in given.items():
        wanted = _TYPES.get(name, (str, type(None)))
        if (isinstance(value, bool) and bool not in wanted) or not isinstance(value, wanted):
            raise ArgumentTypeError(f"storage_options[{name!r}] has the wrong type")
    values = dict(given)
    values.setdefault("endpoint_url", os.environ.get(ENDPOINT_ENV) or None)
    options = S3Options(**values)  # type: ignore[arg-type]
    _check_ranges(options)
    return options


def _check_ranges(options: S3Options) -> None:
    if options.checksum not in CHECKSUM_MODES:
        raise InvalidArgumentError(
            f"storage_options['checksum'] must be one of {CHECKSUM_MODES}, got {options.checksum!r}"
        )
    if options.part_size < MIN_PART_SIZE:
        raise InvalidArgumentError(f"storage_options['part_size'] must be >= {MIN_PART_SIZE}")
    if not 1 <= options.max_concurrency <= 64 or not 1 <= options.max_attempts <= 20:
        raise InvalidArgumentError(
            "storage_options: max_concurrency must be 1-64 and max_attempts 1-20"
        )
    if not (options.connect_timeout > 0 and options.read_timeout > 0):
        raise InvalidArgumentError("storage_options: timeouts must be positive")
    if (options.aws_access_key_id is None) != (options.aws_secret_access_key is None):
        raise InvalidArgumentError(
            "storage_options: aws_access_key_id and aws_secret_access_key go together"
        )


def make_client(options: S3Options) -> Any:
    """A low-level boto3 S3 client for ``options`` (a fresh session: credentials re-read)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:
        raise MissingExtraError("object storage needs boto3: pip install 'ckptdb[s3]'") from exc
    when = "when_required" if options.checksum == "off" else "when_supported"
    config = Config(
        retries={"mode": "standard", "max_attempts": options.max_attempts},
        request_checksum_calculation=when,
        response_checksum_validation=when,
        max_pool_connections=options.max_concurrency + 4,
        connect_timeout=options.connect_timeout,
        read_timeout=options.read_timeout,
    )
    session = boto3.session.Session(
        profile_name=options.profile_name,
        aws_access_key_id=options.aws_access_key_id,
        aws_secret_access_key=options.aws_secret_access_key,
        aws_session_token=options.aws_session_token,
    )
    try:
        client = session.client(
            "s3", endpoint_url=options.endpoint_url, region_name=options.region_name, config=config
        )
    except ValueError as exc:  # botocore's text repeats the endpoint, credentials and all
        raise InvalidArgumentError(
            f"storage_options: the endpoint is not a URL boto3 accepts: {redact(str(exc))}"
        ) from None
    if _client_hook is not None:
        _client_hook(client)
    return client


class Calls:
    """Requests to the store: botocore's retries, then one retry after a credential refresh."""

    def __init__(self, options: S3Options) -> None:
        self.options = options
        self.client = make_client(options)
        self.refreshes = 0

    def __call__(self, operation: str, **params: Any) -> Any:
        trace.record("s3_request", operation=operation, params=params)
        try:
            answer = getattr(self.client, operation)(**params)
        except Exception as exc:
            if error_code(exc) not in EXPIRED_CODES:
                raise
            self.client = make_client(self.options)  # the chain is read again
            self.refreshes += 1
            answer = getattr(self.client, operation)(**params)
        trace.record("s3_response", operation=operation, params=params, answer=answer)
        return answer


# ------------------------------------------------------------------ error text


def error_code(exc: BaseException) -> str | None:
    """The store's error code of a botocore ClientError (None for anything else)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    code = response.get("Error", {}).get("Code")
    return str(code) if code is not None else None


def http_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status is not None else None


def was_retried(exc: BaseException) -> bool:
    """Whether botocore sent the request more than once before this error."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return False
    return int(response.get("ResponseMetadata", {}).get("RetryAttempts") or 0) > 0


def is_missing(exc: BaseException) -> bool:
    """Whether the key is not there. A missing bucket (a typo, a bucket not reachable
    with these credentials) is not a missing object: nothing may be marked lost for it."""
    if error_code(exc) == "NoSuchBucket":
        return False
    return http_status(exc) == 404 or error_code(exc) in ("404", "NoSuchKey", "NotFound")


def redact(text: str) -> str:
    """``text`` without the ``user:password@`` of any URL in it."""
    return USERINFO.sub(r"\1", text)


def redact_chain(exc: BaseException) -> None:
    """Take URL credentials out of ``exc`` and the exceptions it chains, in place.

    botocore's connection errors and timeouts repeat the endpoint URL (an
    endpoint with ``user:password@`` included) in their text and their
    ``kwargs``; they stay chained (nothing is swallowed), with that text redacted.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.args = tuple(redact(a) if isinstance(a, str) else a for a in current.args)
        kwargs = getattr(current, "kwargs", None)
        if isinstance(kwargs, dict):
            for name, value in kwargs.items():
                if isinstance(value, str):
                    kwargs[name] = redact(value)
        current = current.__cause__ or current.__context__


def describe(exc: BaseException) -> str:
    """Safe text for an error from the store: code, status and the store's message
    (and for anything else its text, URL credentials redacted in it and its chain)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error", {})
        code, message = error.get("Code", "?"), error.get("Message", "")
        text = f"{code} (HTTP {http_status(exc)}){': ' + message if message else ''}"
        return redact(text)
    redact_chain(exc)
    return redact(f"{type(exc).__name__}: {exc}")


def store_error(operation: str, where: str, exc: BaseException) -> ObjectStoreError:
    """The :class:`ObjectStoreError` for ``operation`` on ``where`` that failed with ``exc``."""
    return ObjectStoreError(f"{operation} {redact(where)} failed: {describe(exc)}")


# ------------------------------------------------------------------ the probe


#: The probe's objects: ``<prefix>/ckptdb.probe/<unix time>-<uuid>[.mpu]``, a place
#: reconcile knows: leftovers (a process killed mid-probe) older than PROBE_MAX_AGE
#: are removed there, never a probe that may still be running.
PROBE_DIR = "ckptdb.probe"
PROBE_NAME = re.compile(r"(\d+)-[0-9a-f]{32}(?:\.mpu)?")
PROBE_MAX_AGE = 3600


def probe_conditional_writes(calls: Calls, bucket: str, prefix: str) -> None:
    """Refuse a store that ignores ``If-None-Match: *`` (or that we cannot write to).

    Two probes under the run's prefix, each writing one key twice with
    ``If-None-Match: *``: the second write must fail with 412. One with
    ``PutObject`` (small payloads), one with ``CompleteMultipartUpload`` (big
    ones; a store may honour the condition on one and not the other). Costs
    two PUTs, two small multipart uploads and two DELETEs per open. Raises
    :class:`ConditionalWritesUnsupportedError`, or :class:`ObjectStoreError`
    when the bucket cannot be written at all.
    """
    name = f"{PROBE_DIR}/{int(time.time())}-{uuid.uuid4().hex}"
    key = f"{prefix}/{name}" if prefix else name
    where = f"s3://{bucket}/{key}"
    try:
        calls("put_object", Bucket=bucket, Key=key, Body=b"ckptdb probe", IfNoneMatch="*")
    except Exception as exc:
        if not (http_status(exc) == 412 and was_retried(exc)):  # else: our own, retried
            raise store_error("PutObject (probe)", where, exc) from exc
    try:
        overwrote = "write (PutObject)" if _second_write(calls, bucket, key, where) else ""
    finally:
        _delete_probe(calls, bucket, key, where)
    if not overwrote:
        overwrote = _probe_multipart(calls, bucket, f"{key}.mpu", f"{where}.mpu")
    if overwrote:
        raise ConditionalWritesUnsupportedError(
            f"the object store at s3://{bucket} ignores If-None-Match: * (a second "
            f"conditional {overwrote} overwrote the probe object): it cannot refuse to "
            "overwrite an object. Pass storage_options={'require_conditional_writes': False} "
            "to use it anyway (a completion retried after a lost response, or a second "
            "ledger writing under the same prefix, could then overwrite an object unnoticed)"
        )


def _probe_multipart(calls: Calls, bucket: str, key: str, where: str) -> str:
    """Complete a one-part multipart upload of ``key`` twice with ``If-None-Match: *``:
    "" if the second completion was refused (412), else what overwrote the object."""
    try:
        _complete_once(calls, bucket, key, where, first=True)
        try:
            _complete_once(calls, bucket, key, where, first=False)
        except _Refused:
            return ""
        return "completion (CompleteMultipartUpload)"
    finally:
        _delete_probe(calls, bucket, key, where)


class _Refused(Exception):
    """The probe's second completion was refused, as it should be."""


def _complete_once(calls: Calls, bucket: str, key: str, where: str, *, first: bool) -> None:
    """One multipart upload of ``key`` (one small part), completed conditionally;
    aborted whenever it did not complete. The second raises :class:`_Refused` on 412."""
    operation = "CreateMultipartUpload (probe)"
    try:
        upload_id = calls("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    except Exception as exc:
        raise store_error(operation, where, exc) from exc
    completed = False
    try:
        operation = "UploadPart (probe)"
        part = calls(
            "upload_part",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=1,
            Body=b"ckptdb probe",
        )
        operation = "CompleteMultipartUpload (probe)"
        try:
            calls(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": [_part_entry(part)]},
                IfNoneMatch="*",
            )
        except Exception as exc:
            status = http_status(exc)
            if first and status in (404, 412) and was_retried(exc):
                completed = True  # our own completion, retried after a lost response
                return
            if not first and status == 412:  # (retried: a 5xx first, refused then)
                raise _Refused() from None
            raise
        completed = True
    except _Refused:
        raise
    except Exception as exc:
        raise store_error(operation, where, exc) from exc
    finally:
        if not completed:
            _abort_probe(calls, bucket, key, upload_id, where)


def _part_entry(part: Mapping[str, Any]) -> dict[str, Any]:
    """The completion's entry for the probe's part, with any checksum botocore added
    to it (a store that recorded one may require it back, as for real payloads)."""
    entry = {"PartNumber": 1, "ETag": part["ETag"]}
    entry.update(
        {k: v for k, v in part.items() if k.startswith("Checksum") and k != "ChecksumType"}
    )
    return entry


def _abort_probe(calls: Calls, bucket: str, key: str, upload_id: str, where: str) -> None:
    try:
        calls("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
    except Exception as exc:
        if not is_missing(exc):
            raise store_error("AbortMultipartUpload (probe)", where, exc) from exc


def _second_write(calls: Calls, bucket: str, key: str, where: str) -> bool:
    try:
        calls("put_object", Bucket=bucket, Key=key, Body=b"ckptdb probe 2", IfNoneMatch="*")
    except Exception as exc:
        if http_status(exc) == 412:
            return False
        raise store_error("PutObject (probe)", where, exc) from exc
    return True


def _delete_probe(calls: Calls, bucket: str, key: str, where: str) -> None:
    try:
        calls("delete_object", Bucket=bucket, Key=key)
    except Exception as exc:
        raise store_error("DeleteObject (probe)", where, exc) from exc
