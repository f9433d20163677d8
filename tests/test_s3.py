"""Checkpoints on object storage, against a real S3-compatible server (SeaweedFS).

The server is started once per session (``s3_server``, see ``s3lib``); each
test writes under a prefix of its own, with the credentials, region and
endpoint taken from the environment (the standard AWS chain). Faults are
injected through botocore's event hooks on the clients ckptdb makes
(``s3client.set_client_hook``): an error response instead of sending the
request, a retry forced after a response that succeeded (a lost response),
a body whose bits flip on the way in, a header stripped (a store that
ignores conditional writes). Everything else is the real server.
"""

from __future__ import annotations

import os
import re
import signal
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import s3lib
import torch
import xxhash
from botocore.awsrequest import AWSResponse
from crashlib import (
    Boundary,
    Reference,
    fork_running,
    ledger_rows,
    policies,
    tail,
    wait_child,
)
from helpers import LedgerClient, state
from test_crash import SWEEP, WARMUP, absorb, assert_recovers, crash, spec

from ckptdb import CheckpointManager, External, Keep, RunReader, faults
from ckptdb.errors import (
    CheckpointNotFoundError,
    ConditionalWritesUnsupportedError,
    CorruptCheckpointError,
    InvalidArgumentError,
    LedgerLockedError,
    ObjectStoreError,
    PublishError,
)
from ckptdb.location import ObjectPath
from ckptdb.storage import s3 as s3store
from ckptdb.storage import s3client

MiB = 1 << 20
PART = 5 * MiB  # the smallest part size S3 allows: big payloads take several parts


def big_state(value: float, mib: int = 12) -> dict[str, Any]:
    """A payload of about ``mib`` MiB: several 5 MiB parts."""
    return {"w": torch.full((mib * MiB // 4,), float(value)), "tag": value}


def rows(db: LedgerClient) -> list[tuple[Any, ...]]:
    return db.rows("SELECT id, stream, step, state, path FROM checkpoints ORDER BY id")


@pytest.fixture
def hooks() -> Iterator[list[Callable[[Any], None]]]:
    """Install botocore event handlers on every client ckptdb makes (append to the list)."""
    installed: list[Callable[[Any], None]] = []

    def hook(client: Any) -> None:
        for install in installed:
            install(client)

    previous = s3client.set_client_hook(hook)
    yield installed
    s3client.set_client_hook(previous)


@pytest.fixture
def open_s3(
    root: Path, s3_url: str, open_manager: Callable[..., CheckpointManager]
) -> Callable[..., CheckpointManager]:
    """Open a manager on ``root`` saving to this test's prefix (small parts)."""

    def factory(**kwargs: Any) -> CheckpointManager:
        kwargs.setdefault("save_dir", s3_url)
        kwargs.setdefault("storage_options", {"part_size": PART})
        kwargs.setdefault("streams", {"model": Keep(last=2)})
        return open_manager(**kwargs)

    return factory


# --------------------------------------------------------------- fault injection


class _Raw:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.body


def error_response(request: Any, status: int, code: str) -> AWSResponse:
    body = f"<Error><Code>{code}</Code><Message>injected {code}</Message></Error>".encode()
    headers = {"Content-Type": "application/xml", "Content-Length": str(len(body))}
    return AWSResponse(request.url, status, headers, _Raw(body))


def fail(operation: str, status: int, code: str, times: int, seen: list[str]) -> Any:
    """An installer: the first ``times`` ``operation`` requests get an error response."""

    def install(client: Any) -> None:
        def before_send(request: Any, **_: Any) -> AWSResponse | None:
            if len(seen) < times:
                seen.append(code)
                return error_response(request, status, code)
            return None

        client.meta.events.register(f"before-send.s3.{operation}", before_send)

    return install


class FlippingBody:
    """A response body whose first byte at ``offset`` arrives with one bit flipped."""

    def __init__(self, inner: Any, offset: int) -> None:
        self.inner, self.offset, self.position = inner, offset, 0

    def _flipped(self, chunk: bytes) -> bytes:
        start, self.position = self.position, self.position + len(chunk)
        if not start <= self.offset < self.position:
            return chunk
        data = bytearray(chunk)
        data[self.offset - start] ^= 0x10
        return bytes(data)

    def read(self, amount: int | None = None) -> bytes:
        return self._flipped(self.inner.read(amount))

    def iter_chunks(self, size: int) -> Iterator[bytes]:
        for chunk in self.inner.iter_chunks(size):
            yield self._flipped(chunk)


# ------------------------------------------------------------------ round trips


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mib", [0, 12], ids=["one_put", "multipart"])
def test_save_latest_load_round_trip(
    open_s3: Callable[..., CheckpointManager], client: Any, s3_url: str, mib: int
) -> None:
    payload = big_state(3.0, mib) if mib else state(3.0)
    mgr = open_s3()
    out = mgr.save(10, model=payload)["model"]
    latest = mgr.latest()
    assert latest is not None and latest.id == out.id
    assert isinstance(out.path, ObjectPath) and str(out.path).startswith(s3_url + "/model/")
    token = mgr._ctx.store.run_token  # type: ignore[attr-defined]
    assert out.path.name == f"step-000000010.{token}.v{out.id}.pt"  # unique to run and row
    # the row's size and hash are the object's, as a local file's would be
    stored = client.get_object(Bucket=s3lib.BUCKET, Key=f"{out.path.key}")["Body"].read()
    assert (len(stored), xxhash.xxh3_128(stored).hexdigest()) == (out.size, out.hash)
    loaded = mgr.load("latest")
    assert torch.equal(loaded["w"], payload["w"])
    assert mgr.load(out)["w"].shape == payload["w"].shape  # by record too
    assert s3lib.uploads_under(client, s3_url) == []
    assert mgr.check(load=True) == []
    with RunReader(mgr.root) as reader:  # a follower, without the writer lock
        assert torch.equal(reader.load("latest")["w"], payload["w"])
    mgr.close()
    again = open_s3()
    assert again.last_reconcile.actions == []
    assert again.save_dir == ObjectPath("s3:", *s3_url[len("s3://") :].split("/"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checksum", ["crc64nvme", "off"])
def test_reused_part_buffers_carry_only_their_own_part(
    open_s3: Callable[..., CheckpointManager], client: Any, checksum: str
) -> None:
    """One part in flight: two buffers take turns, so the third part (a short last one)
    is written into the first part's buffer and must not carry its stale tail."""
    mgr = open_s3(storage_options={"part_size": PART, "max_concurrency": 1, "checksum": checksum})
    payload = {"w": torch.arange(3 * MiB, dtype=torch.float32)}  # 12 MiB: parts of 5, 5, ~2
    out = mgr.save(1, model=payload)["model"]
    stored = client.get_object(Bucket=s3lib.BUCKET, Key=out.path.key)["Body"].read()
    assert 10 * MiB < len(stored) < 15 * MiB
    assert (len(stored), xxhash.xxh3_128(stored).hexdigest()) == (out.size, out.hash)
    assert torch.equal(mgr.load(1)["w"], payload["w"])


@pytest.mark.timeout(60)
def test_evicted_objects_are_deleted_after_the_commit(
    open_s3: Callable[..., CheckpointManager], client: Any, s3_url: str, db: LedgerClient
) -> None:
    mgr = open_s3(streams={"model": Keep(last=1)})
    first = mgr.save(1, model=state(1.0))["model"]
    second = mgr.save(2, model=state(2.0))["model"]
    assert s3lib.keys_under(client, s3_url) == [second.path.key]  # type: ignore[attr-defined]
    assert [(r[0], r[3]) for r in rows(db)] == [(first.id, "deleted"), (second.id, "committed")]


@pytest.mark.timeout(60)
def test_bad_input_is_refused_and_nothing_is_recorded(
    open_s3: Callable[..., CheckpointManager],
    root: Path,
    s3_url: str,
    db: LedgerClient,
    client: Any,
) -> None:
    for save_dir, options in [
        ("s3://Bad_Bucket/x", None),
        ("s3://ckpt//x", None),
        (s3_url, {"no_such_option": 1}),
        (s3_url, {"part_size": 1024}),
        (s3_url, {"checksum": "md5"}),
        (s3_url, {"require_conditional_writes": "no"}),
        (s3_url, {"aws_secret_access_key": "a secret without its key id"}),
        (str(root / "local"), {"endpoint_url": "http://x"}),
    ]:
        with pytest.raises(InvalidArgumentError):
            CheckpointManager(root, save_dir=save_dir, storage_options=options)
    assert not root.exists()
    mgr = open_s3(streams={"model": Keep(last=2), "shards": Keep(last=1)})
    for bad in [{"shards": External(lambda p: p.write_bytes(b"x"), name="shards/x.bin")}]:
        with pytest.raises(InvalidArgumentError, match="cannot be saved"):
            mgr.save(5, model=state(1.0), **bad)
    assert rows(db) == []
    assert s3lib.keys_under(client, s3_url) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mib", [0, 12], ids=["one_put", "multipart"])
def test_an_object_that_appears_before_the_completion_is_never_overwritten(
    open_s3: Callable[..., CheckpointManager], client: Any, db: LedgerClient, mib: int
) -> None:
    """Someone else's object appears under the key between the intent's check and
    the completion: the completion (If-None-Match: *) fails, the boundary rolls back,
    and that object is neither overwritten nor removed."""
    mgr = open_s3()
    payload = big_state(1.0, mib) if mib else state(1.0)
    planted: list[str] = []

    def plant(name: str) -> None:
        if name == "s3_before_complete":
            (path,) = db.rows("SELECT path FROM checkpoints WHERE state = 'pending'")[0]
            key = f"{mgr.save_dir.key}/{path}"  # type: ignore[attr-defined]
            client.put_object(Bucket=s3lib.BUCKET, Key=key, Body=b"not ours")
            planted.append(key)

    previous = faults.set_hook(plant)
    try:
        with pytest.raises(PublishError) as raised:
            mgr.save(1, model=payload)
    finally:
        faults.set_hook(previous)
    assert raised.value.phase == "complete" and "PreconditionFailed" in str(raised.value)
    body = client.get_object(Bucket=s3lib.BUCKET, Key=planted[0])["Body"].read()
    assert body == b"not ours"
    assert [r[3] for r in rows(db)] == ["aborted"]
    assert mgr.latest() is None
    mgr.close()  # what this process knew in memory is gone: the ledger remembers it
    again = open_s3()
    assert again.last_reconcile.actions == []
    assert client.get_object(Bucket=s3lib.BUCKET, Key=planted[0])["Body"].read() == b"not ours"
    assert again.reconcile().actions == [] and again.check() == []
    assert client.get_object(Bucket=s3lib.BUCKET, Key=planted[0])["Body"].read() == b"not ours"


@pytest.mark.timeout(90)
def test_two_ledgers_under_one_prefix_never_touch_each_others_objects(
    tmp_path: Path, s3_url: str, client: Any
) -> None:
    """Two runs (two SQLite ledgers, both at row id 1) save under one prefix: the
    first's save fails, the second commits the same step with the same row id; the
    first's reopen (reconcile of its rolled-back row) leaves the second's object."""
    options = {"part_size": PART}
    first = CheckpointManager(tmp_path / "a", save_dir=s3_url, storage_options=options)
    with pytest.raises(PublishError), _failing_save(first):
        first.save(1, model=state(1.0))
    first.close()
    with CheckpointManager(tmp_path / "b", save_dir=s3_url, storage_options=options) as second:
        theirs = second.save(1, model=state(2.0))["model"]
        other = put(client, s3_url, "model/step-000000007.0123456789.v1.pt")  # a third run's
    assert theirs.id == 1
    with CheckpointManager(tmp_path / "a", storage_options=options) as first:
        assert first.last_reconcile.actions == []
        assert first.check() == []
    keys = s3lib.keys_under(client, s3_url)
    assert theirs.path.key in keys and other in keys  # type: ignore[attr-defined]
    with CheckpointManager(tmp_path / "b", storage_options=options) as second:
        assert second.last_reconcile.actions == []
        assert torch.equal(second.load(theirs)["w"], state(2.0)["w"])


@pytest.mark.timeout(60)
def test_a_name_taken_before_the_intent_gets_another_name(
    open_s3: Callable[..., CheckpointManager], client: Any, db: LedgerClient, s3_url: str
) -> None:
    """The key the next row would use exists (our own object of a row id that is
    reused: its intent never reached the disk, a power loss): the save goes on
    under a salted name, the object there is left alone, and the next open
    quarantines it in place as ours (the run token is the same after a reopen)."""
    mgr = open_s3()
    mgr.save(1, model=state(1.0))
    token = mgr._ctx.store.run_token
    assert token is not None
    taken = put(client, s3_url, f"model/step-000000002.{token}.v2.pt", b"a lost intent's")
    saved = mgr.save(2, model=state(2.0))["model"]
    assert saved.id == 2 and re.fullmatch(
        rf"step-000000002\.{token}\.v2-[0-9a-f]{{8}}\.pt", saved.path.name
    )
    assert [r[3] for r in rows(db)] == ["committed", "committed"]
    assert client.get_object(Bucket=s3lib.BUCKET, Key=taken)["Body"].read() == b"a lost intent's"
    assert torch.equal(mgr.load("latest")["w"], state(2.0)["w"])
    mgr.close()
    again = open_s3()
    assert again.last_reconcile.counts == {"quarantined": 1}
    assert again.last_reconcile.actions[0].path == taken.split("/", 1)[1]
    assert again.reconcile().actions == [] and again.check() == []


# ------------------------------------------------------------------ reconcile


def put(client: Any, url: str, rel: str, body: bytes = b"x") -> str:
    key = f"{url.split('/', 3)[3]}/{rel}"
    client.put_object(Bucket=s3lib.BUCKET, Key=key, Body=body)
    return key


@pytest.mark.timeout(90)
def test_reconcile_on_object_storage(
    open_s3: Callable[..., CheckpointManager], client: Any, s3_url: str, db: LedgerClient
) -> None:
    """Orphans in our naming stay (recorded once), objects of rolled-back rows and
    uploads nobody owns go, a vanished committed object is lost (by HEAD), foreign
    keys are never touched, and a second reconcile does nothing."""
    mgr = open_s3(streams={"model": Keep(last=3)})
    kept = mgr.save(1, model=state(1.0))["model"]
    gone = mgr.save(2, model=state(2.0))["model"]
    with pytest.raises(PublishError), _failing_save(mgr):  # an aborted row (object planted)
        mgr.save(3, model=state(3.0))
    aborted = db.rows("SELECT path FROM checkpoints WHERE state = 'aborted'")[0][0]
    mgr.close()
    foreign = [put(client, s3_url, rel) for rel in ("notes.txt", "model/step-1.pt", "x/y/z")]
    orphan = put(client, s3_url, "model/step-000000099.v999.pt")
    put(client, s3_url, aborted)
    upload_key = f"{s3_url.split('/', 3)[3]}/model/step-000000098.v998.pt"
    client.create_multipart_upload(Bucket=s3lib.BUCKET, Key=upload_key)
    client.delete_object(Bucket=s3lib.BUCKET, Key=gone.path.key)  # type: ignore[attr-defined]

    mgr = open_s3(streams={"model": Keep(last=3)})
    report = mgr.last_reconcile
    assert report.counts == {"lost": 1, "quarantined": 1, "removed_temp": 2, "repointed": 1}
    state_of = {r[0]: r[3] for r in rows(db)}
    assert state_of[gone.id] == "lost" and state_of[kept.id] == "committed"
    latest = mgr.latest()
    assert latest is not None and latest.id == kept.id
    keys = s3lib.keys_under(client, s3_url)
    assert set(foreign) <= set(keys) and orphan in keys  # left where they are
    assert f"{s3_url.split('/', 3)[3]}/{aborted}" not in keys
    assert s3lib.uploads_under(client, s3_url) == []
    assert mgr.reconcile().actions == []
    assert mgr.check() == []


class _failing_save:
    """Every CompleteMultipartUpload/PutObject of the store fails with a 400."""

    def __init__(self, mgr: CheckpointManager) -> None:
        self.events = mgr._ctx.store.calls.client.meta.events  # type: ignore[attr-defined]

    def _fail(self, request: Any, **_: Any) -> AWSResponse:
        return error_response(request, 400, "InvalidRequest")

    def __enter__(self) -> None:
        self.events.register("before-send.s3.PutObject", self._fail, unique_id="fail-put")

    def __exit__(self, *exc: object) -> None:
        self.events.unregister("before-send.s3.PutObject", unique_id="fail-put")


# ------------------------------------------------------------------ crashes

S3_POINTS = [p for p in faults.POINTS if p != "mid_reconcile"]
S3_POINTS += ["s3_before_complete", "s3_after_complete"]
S3_BEFORE_COMMIT = {"after_intent", "mid_write", "after_fsync", "after_replace"}
S3_BEFORE_COMMIT |= {"after_fsync_dir", "in_commit", "s3_before_complete", "s3_after_complete"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", S3_POINTS)
def test_crash_at_point_on_object_storage(tmp_path: Path, s3_url: str, point: str) -> None:
    """The local crash sweep's schedule on S3, every model payload ~10 MiB (a
    multipart upload): a child dies at the point, the parent reopens (reconcile),
    checks every invariant and saves once more. No upload is left in progress."""
    plan = [Boundary(i, s, v, big=True) for i, (s, v) in enumerate(SWEEP)]
    ref = Reference(policies(), {b.index: b for b in plan})
    child = spec(tmp_path, "child", plan, crash_point=point, arm_after=WARMUP, save_dir=s3_url)
    context = f"point={point} on S3"
    crash(child, context)
    problems = absorb(ref, child)
    before = s3lib.uploads_under(s3lib_client(), s3_url)
    counts = assert_recovers(tmp_path / "run", ref, context, problems, None)
    if point in S3_BEFORE_COMMIT:
        assert ref.unacked_commits == 0, f"{context}: committed before the commit point"
        assert counts.get("rolled_back", 0) >= 2, f"{context}: nothing rolled back: {counts}"
    else:
        assert ref.unacked_commits == 1, f"{context}: boundary lost after its commit"
    if point == "s3_before_complete":
        assert before, f"{context}: no upload in progress at the crash"
    assert s3lib.uploads_under(s3lib_client(), s3_url) == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [1, 2])
def test_a_crash_inside_reconcile_on_object_storage(
    tmp_path: Path, s3_url: str, client: Any, n: int
) -> None:
    """Damage stacked by two crashes (A: mid-cleanup, rows left ``deleting``; B:
    reopened without reconcile, killed before Complete, a row ``pending`` with its
    upload in progress), an orphan in our naming and a foreign key; then C dies in
    the n-th reconcile (the one at open, or an on-demand one two boundaries later),
    after its object work and before its ledger update. The next open finishes the
    job: every invariant holds, no upload is left, the orphan is recorded once and
    left in place, the foreign key is untouched."""
    context = f"mid_reconcile n={n} on S3"
    plan = [Boundary(i, s, v, big=True) for i, (s, v) in enumerate(SWEEP)]
    ref = Reference(policies(), {b.index: b for b in plan})
    a = spec(tmp_path, "a", plan, crash_point="mid_cleanup", arm_after=WARMUP, save_dir=s3_url)
    crash(a, f"{context} (child A)")
    problems = absorb(ref, a)
    b = spec(
        tmp_path,
        "b",
        plan[ref.next_index :],
        crash_point="s3_before_complete",
        maintenance=True,
        save_dir=s3_url,
    )
    crash(b, f"{context} (child B)")
    problems += absorb(ref, b)
    states = {r.state for r in ledger_rows(tmp_path / "run")}
    assert {"pending", "deleting"} <= states, f"{context}: damage not staged: {states}"
    assert s3lib.uploads_under(client, s3_url), f"{context}: no upload left in progress"
    foreign = put(client, s3_url, "model/notes.txt", b"not ours")
    orphan = put(client, s3_url, "model/step-000999999.v999999.pt", b"no row owns me")
    c = spec(
        tmp_path,
        "c",
        plan[ref.next_index :],
        crash_point="mid_reconcile",
        crash_n=n,
        reconcile_every=2,
        save_dir=s3_url,
    )
    crash(c, f"{context} (child C)")
    problems += absorb(ref, c)
    counts = assert_recovers(tmp_path / "run", ref, context, problems, None)
    if n == 1:  # the crash undid the open's repairs: the next open redoes them
        assert counts.get("rolled_back", 0) >= 1, f"{context}: nothing rolled back: {counts}"
    states = {r.state for r in ledger_rows(tmp_path / "run")}
    assert "aborted" in states and not states & {"pending", "deleting"}, f"{context}: {states}"
    assert s3lib.uploads_under(client, s3_url) == [], context
    keys = s3lib.keys_under(client, s3_url)
    assert foreign in keys and orphan in keys, f"{context}: a key not ours was removed"
    body = client.get_object(Bucket=s3lib.BUCKET, Key=foreign)["Body"].read()
    assert body == b"not ours", context


def s3lib_client() -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=os.environ["CKPTDB_S3_ENDPOINT_URL"])


@pytest.mark.timeout(90)
def test_sigkill_during_a_multipart_upload(tmp_path: Path, s3_url: str, client: Any) -> None:
    """Killed while parts upload: nothing is visible, and the next open aborts the upload."""
    root = tmp_path / "run"
    options = {"part_size": PART, "max_concurrency": 1}

    def body() -> int:
        with CheckpointManager(root, save_dir=s3_url, storage_options=options) as mgr:
            mgr.save(1, model=state(1.0))
            mgr.save(2, model=big_state(2.0, mib=200))
        return 0

    pid = fork_running(root, tmp_path / "child.log", body)
    deadline = time.monotonic() + 30
    while not [u for u in s3lib.uploads_under(client, s3_url) if "/model/" in u]:  # not the probe
        assert time.monotonic() < deadline, tail(tmp_path / "child.log")
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    assert wait_child(pid, 10) == -signal.SIGKILL
    states = {r.step: r.state for r in ledger_rows(root)}
    assert states == {1: "committed", 2: "pending"}
    assert len(s3lib.keys_under(client, s3_url)) == 1  # step 1 only: nothing partial visible
    with CheckpointManager(root, storage_options=options) as mgr:
        assert mgr.last_reconcile.counts == {"rolled_back": 1}
        latest = mgr.latest()
        assert latest is not None and latest.step == 1
        assert mgr.check(load=True) == []
    assert s3lib.uploads_under(client, s3_url) == []
    assert {r.step: r.state for r in ledger_rows(root)} == {1: "committed", 2: "aborted"}


# ------------------------------------------------------------------ injected faults


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("operation", "status", "code"),
    [
        ("UploadPart", 503, "SlowDown"),
        ("UploadPart", 500, "InternalError"),
        ("CompleteMultipartUpload", 503, "SlowDown"),
        ("CompleteMultipartUpload", 500, "InternalError"),
    ],
)
def test_throttling_and_server_errors_are_retried(
    open_s3: Callable[..., CheckpointManager],
    hooks: list[Any],
    operation: str,
    status: int,
    code: str,
) -> None:
    seen: list[str] = []
    hooks.append(fail(operation, status, code, times=2, seen=seen))
    mgr = open_s3()
    out = mgr.save(1, model=big_state(1.0))["model"]
    assert seen == [code, code]
    assert torch.equal(mgr.load(out)["w"], big_state(1.0)["w"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("operation", "phase"), [("UploadPart", "write"), ("CompleteMultipartUpload", "complete")]
)
def test_a_failure_that_survives_the_retries_rolls_back(
    open_s3: Callable[..., CheckpointManager],
    hooks: list[Any],
    client: Any,
    s3_url: str,
    db: LedgerClient,
    operation: str,
    phase: str,
) -> None:
    mgr = open_s3(storage_options={"part_size": PART, "max_attempts": 3})
    first = mgr.save(1, model=state(1.0))["model"]
    seen: list[str] = []
    mgr._ctx.store.calls.client.meta.events.register(  # type: ignore[attr-defined]
        f"before-send.s3.{operation}",
        lambda request, **_: seen.append("x") or error_response(request, 503, "SlowDown"),
    )
    with pytest.raises(PublishError) as raised:
        mgr.save(2, model=big_state(2.0))
    assert raised.value.phase == phase
    assert "SlowDown" in str(raised.value)
    assert len(seen) >= 3  # botocore's standard mode tried 3 times (max_attempts)
    assert [r[3] for r in rows(db)] == ["committed", "aborted"]
    latest = mgr.latest()
    assert latest is not None and latest.id == first.id
    assert s3lib.keys_under(client, s3_url) == [first.path.key]  # type: ignore[attr-defined]
    assert s3lib.uploads_under(client, s3_url) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mib", [0, 12], ids=["one_put", "multipart"])
def test_a_lost_response_after_a_successful_completion_is_settled_by_head(
    open_s3: Callable[..., CheckpointManager], hooks: list[Any], mib: int
) -> None:
    """The completion succeeds, its response is 'lost' (botocore retries it): the retry
    meets 412 (If-None-Match, the object exists) or NoSuchUpload; a HEAD that
    matches size and CRC64NVME accepts the object."""
    operation = "CompleteMultipartUpload" if mib else "PutObject"
    retried: list[int] = []

    def install(client: Any) -> None:
        def lose(response: Any, attempts: int, request_dict: Any, **_: Any) -> int | None:
            ours = "/model/" in request_dict["url"]  # not the probe at open
            if ours and response is not None and response[0].status_code == 200 and not retried:
                retried.append(attempts)
                return 0  # retry at once, as after a timeout
            return None

        client.meta.events.register_first(f"needs-retry.s3.{operation}", lose)

    hooks.append(install)
    mgr = open_s3()
    payload = big_state(1.0, mib) if mib else state(1.0)
    out = mgr.save(1, model=payload)["model"]
    assert retried == [1]
    assert torch.equal(mgr.load(out)["w"], payload["w"])


@pytest.mark.timeout(60)
def test_expired_credentials_are_refreshed_once(
    open_s3: Callable[..., CheckpointManager], hooks: list[Any]
) -> None:
    seen: list[str] = []
    hooks.append(fail("UploadPart", 400, "ExpiredToken", times=1, seen=seen))
    mgr = open_s3()
    out = mgr.save(1, model=big_state(1.0))["model"]
    assert seen == ["ExpiredToken"]
    assert mgr._ctx.store.calls.refreshes == 1  # type: ignore[attr-defined]
    assert torch.equal(mgr.load(out)["w"], big_state(1.0)["w"])


def test_a_new_client_reads_the_credentials_again_but_not_the_service_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Clients share botocore's loader of service models (parsing it costs more than
    the rest of an open), while each one still reads the credential chain afresh:
    a refresh after an expired token must see the new keys."""
    options = s3client.parse_options({"endpoint_url": "http://127.0.0.1:9", "region_name": "x"})
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "first-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "first-secret")
    first = s3client.make_client(options)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "second-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "second-secret")
    second = s3client.make_client(options)
    assert first._request_signer._credentials.access_key == "first-key"
    assert second._request_signer._credentials.access_key == "second-key"
    assert first._loader is second._loader


@pytest.mark.timeout(60)
def test_a_bit_flipped_on_download_is_corrupt_and_latest_falls_back(
    open_s3: Callable[..., CheckpointManager], hooks: list[Any], db: LedgerClient
) -> None:
    mgr = open_s3()
    first = mgr.save(1, model=state(1.0))["model"]
    second = mgr.save(2, model=big_state(2.0))["model"]

    def flip(parsed: Any, **_: Any) -> None:
        parsed["Body"] = FlippingBody(parsed["Body"], offset=7 * MiB)

    mgr._ctx.store.calls.client.meta.events.register(  # type: ignore[attr-defined]
        "after-call.s3.GetObject", flip, unique_id="flip"
    )
    with pytest.raises(CorruptCheckpointError, match="hash"):
        mgr.load("latest")
    mgr._ctx.store.calls.client.meta.events.unregister(  # type: ignore[attr-defined]
        "after-call.s3.GetObject", unique_id="flip"
    )
    assert {r[0]: r[3] for r in rows(db)} == {first.id: "committed", second.id: "corrupt"}
    latest = mgr.latest()
    assert latest is not None and latest.id == first.id
    assert torch.equal(mgr.load("latest")["w"], state(1.0)["w"])


@pytest.mark.timeout(60)
def test_a_store_without_conditional_writes_is_refused(
    root: Path, s3_url: str, hooks: list[Any], client: Any
) -> None:
    def install(client: Any) -> None:
        def strip(request: Any, **_: Any) -> None:
            if "If-None-Match" in request.headers:
                del request.headers["If-None-Match"]

        client.meta.events.register("before-sign.s3", strip)

    hooks.append(install)
    with pytest.raises(ConditionalWritesUnsupportedError, match="require_conditional_writes"):
        CheckpointManager(root, save_dir=s3_url)
    assert not (root / "ckptdb.sqlite").exists()  # refused before the ledger recorded anything
    assert s3lib.keys_under(client, s3_url) == []  # the probe cleaned up
    options = {"require_conditional_writes": False}
    with CheckpointManager(root, save_dir=s3_url, storage_options=options) as mgr:
        mgr.save(1, model=state(1.0))


@pytest.mark.timeout(60)
def test_two_writers_of_one_run_on_postgres(
    root: Path, s3_url: str, pg_url: str, client: Any
) -> None:
    with CheckpointManager(root, save_dir=s3_url, db_url=pg_url) as first:
        saved = first.save(1, model=state(1.0))["model"]
        with pytest.raises(LedgerLockedError):
            CheckpointManager(root, save_dir=s3_url, db_url=pg_url)
        saved_again = first.save(2, model=state(2.0))["model"]
        assert torch.equal(first.load(saved)["w"], state(1.0)["w"])
    keys = s3lib.keys_under(client, s3_url)
    assert keys == sorted([saved.path.key, saved_again.path.key])  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mib", [0, 12], ids=["one_put", "multipart"])
def test_a_completed_object_that_does_not_verify_is_rolled_back(
    open_s3: Callable[..., CheckpointManager],
    client: Any,
    s3_url: str,
    db: LedgerClient,
    mib: int,
) -> None:
    """The HEAD after the completion reports another size: the row never commits and
    the object is deleted."""
    mgr = open_s3()

    def shrink(parsed: Any, **_: Any) -> None:
        parsed["ContentLength"] = parsed.get("ContentLength", 0) - 1

    mgr._ctx.store.calls.client.meta.events.register(  # type: ignore[attr-defined]
        "after-call.s3.HeadObject", shrink
    )
    with pytest.raises(PublishError) as raised:
        mgr.save(1, model=big_state(1.0, mib) if mib else state(1.0))
    assert raised.value.phase == "verify"
    assert [r[3] for r in rows(db)] == ["aborted"]
    assert s3lib.keys_under(client, s3_url) == []


@pytest.mark.timeout(60)
def test_a_head_that_fails_at_reconcile_marks_nothing_lost(
    open_s3: Callable[..., CheckpointManager], hooks: list[Any], db: LedgerClient
) -> None:
    """A committed object the store cannot answer for (503 after the retries) is not
    known to be gone: reported as failed, the row stays committed."""
    mgr = open_s3()
    saved = mgr.save(1, model=state(1.0))["model"]
    mgr.close()
    seen: list[str] = []
    hooks.append(fail("HeadObject", 503, "SlowDown", times=1000, seen=seen))
    with pytest.warns(UserWarning, match="could not repair"):
        mgr = open_s3(storage_options={"part_size": PART, "max_attempts": 1})
    assert mgr.last_reconcile.counts == {"failed": 1}
    assert [(r[0], r[3]) for r in rows(db)] == [(saved.id, "committed")]


# ------------------------------------------------------------------ secrets


@pytest.mark.timeout(90)
def test_secrets_never_appear_in_errors_logs_events_status_or_the_ledger(
    root: Path,
    s3_url: str,
    caplog: pytest.LogCaptureFixture,
    runner: Any,
) -> None:
    from ckptdb.cli import main

    caplog.set_level("DEBUG")
    texts: list[str] = []
    explicit = {
        "part_size": PART,
        "aws_access_key_id": s3lib.ACCESS_KEY,
        "aws_secret_access_key": s3lib.SECRET_KEY,
    }
    with CheckpointManager(root, save_dir=s3_url, storage_options=explicit) as mgr:
        mgr.save(1, model=big_state(1.0))
        mgr._ctx.store.calls.client.meta.events.register(  # type: ignore[attr-defined]
            "before-send.s3.PutObject", lambda request, **_: error_response(request, 403, "X")
        )
        with pytest.raises(PublishError) as failed:
            mgr.save(2, model=state(2.0))
        texts += [str(failed.value), repr(failed.value), repr(mgr._ctx.store)]
        texts.append(repr(mgr._ctx.store.calls.options))  # type: ignore[attr-defined]
        mgr.load("latest")
    wrong = {"aws_access_key_id": s3lib.ACCESS_KEY, "aws_secret_access_key": s3lib.SECRET_KEY + "!"}
    with pytest.raises(Exception) as refused:
        CheckpointManager(tmp := root.parent / "other", save_dir=s3_url, storage_options=wrong)
    assert isinstance(refused.value, ObjectStoreError)
    assert "SignatureDoesNotMatch" in str(refused.value)  # the real server refused it
    texts += [str(refused.value), repr(refused.value), str(refused.value.__cause__)]
    assert not tmp.exists()
    status = runner.invoke(main, ["status", str(root)]).output
    assert f"{s3_url}/model/" in status  # status did show the run's objects
    texts += [status, runner.invoke(main, ["sql", str(root), "SELECT * FROM events"]).output]
    texts.append(caplog.text)
    texts.append((root / "ckptdb.sqlite").read_bytes().decode("latin-1"))
    for text in texts:
        assert s3lib.SECRET_KEY not in text


# ------------------------------------------------------------------ review fixes


def _two_rank_save_and_load(rank: int, world: int, root: str, url: str) -> list[float]:
    """Every rank saves (collectively) and loads twice: latest, and by record."""
    with CheckpointManager(root, save_dir=url, streams={"model": Keep(last=2)}) as mgr:
        saved = mgr.save(1, model={"w": torch.ones(4) * 3})
        record = mgr.latest()
        assert record is not None and (not saved or saved["model"].id == record.id)
        return [float(mgr.load("latest")["w"].sum()), float(mgr.load(record)["w"].sum())]


@pytest.mark.timeout(90)
def test_every_rank_loads_from_object_storage(tmp_path: Path, s3_url: str) -> None:
    """Under torch.distributed only the chief verifies for the ledger; every other rank
    does its own hash-checked GET before reading (it has no bytes of the chief's)."""
    from distlib import run_ranks

    outcomes = run_ranks(
        _two_rank_save_and_load, 2, tmp_path, str(tmp_path / "run"), s3_url, timeout=60
    )
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
        assert outcome.value == [12.0, 12.0]


@pytest.mark.timeout(60)
def test_verify_and_check_keep_no_payload_in_memory(
    open_s3: Callable[..., CheckpointManager],
) -> None:
    mgr = open_s3()
    saved = mgr.save(1, model=big_state(1.0))["model"]
    store = mgr._ctx.store
    assert mgr.verify("latest").id == saved.id
    assert store._verified is None  # type: ignore[attr-defined]
    assert mgr.check() == []
    assert store._verified is None  # type: ignore[attr-defined]
    assert mgr.check(load=True) == []
    assert store._verified is None  # type: ignore[attr-defined]
    assert torch.equal(mgr.load("latest")["w"], big_state(1.0)["w"])
    assert store._verified is None  # type: ignore[attr-defined]


def traced_peak(call: Callable[[], Any]) -> int:
    """The peak of Python's allocations (every buffer of bytes) while ``call`` runs."""
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.timeout(120)
def test_a_save_holds_the_part_buffers_not_the_payload(
    open_s3: Callable[..., CheckpointManager],
) -> None:
    """A 40 MiB save in 5 MiB parts, 2 in flight: its allocations peak at the 3 part
    buffers (2 uploading, 1 filling; a buffer may be overallocated by 1/8 as it grows),
    plus botocore's read blocks; never the payload, nor a second copy of a part."""
    concurrency = 2
    mgr = open_s3(storage_options={"part_size": PART, "max_concurrency": concurrency})
    payload = big_state(1.0, mib=40)
    mgr.save(1, model=payload)  # the client, its connections and threads exist from here
    saved: list[Any] = []
    peak = traced_peak(lambda: saved.append(mgr.save(2, model=payload)["model"]))
    assert saved[0].size > 40 * MiB  # 9 parts: the buffers were reused
    bound = (concurrency + 1) * PART * 9 // 8 + 4 * MiB
    assert peak <= bound, f"peak {peak / MiB:.1f} MiB > {bound / MiB:.1f} MiB"
    assert torch.equal(mgr.load(2)["w"], payload["w"])


@pytest.mark.timeout(120)
def test_verify_and_check_hash_the_object_a_chunk_at_a_time(
    open_s3: Callable[..., CheckpointManager], db: LedgerClient
) -> None:
    """Without a load nothing needs the bytes after the hash: a 40 MiB object is hashed
    as it streams in, one read chunk in memory at a time; a bit flipped on the way is
    still found by the same size-and-hash check (check reports it, verify marks the row
    corrupt)."""
    mgr = open_s3()
    saved = mgr.save(1, model=big_state(1.0, mib=40))["model"]
    chunk = s3store.READ_CHUNK + 2 * MiB
    assert traced_peak(lambda: mgr.verify("latest")) <= chunk
    assert traced_peak(lambda: mgr.check()) <= chunk
    mgr._ctx.store.calls.client.meta.events.register(  # type: ignore[attr-defined]
        "after-call.s3.GetObject",
        lambda parsed, **_: parsed.update(Body=FlippingBody(parsed["Body"], offset=33 * MiB)),
    )
    problems = mgr.check()  # reports, changes nothing
    assert len(problems) == 1 and "hash" in problems[0], problems
    with pytest.raises(CorruptCheckpointError, match="hash"):
        mgr.verify("latest")
    assert {r[0]: r[3] for r in rows(db)} == {saved.id: "corrupt"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["load", "verify"])
def test_a_bit_flipped_under_botocores_checksum_is_corrupt_not_unreadable(
    open_s3: Callable[..., CheckpointManager], db: LedgerClient, how: str
) -> None:
    """The flip happens below botocore's CRC64NVME check of the GET (in the HTTP
    stream), so botocore would raise at the end of the body: reads stop at the
    Content-Length, and the object's own size and hash find it corrupt."""
    mgr = open_s3()
    saved = mgr.save(1, model=big_state(1.0, mib=12))["model"]

    def flip(parsed: Any, **_: Any) -> None:
        checked = parsed["Body"]  # botocore's StreamingChecksumBody
        checked._raw_stream = FlippingBody(checked._raw_stream, offset=11 * MiB)

    mgr._ctx.store.calls.client.meta.events.register("after-call.s3.GetObject", flip)  # type: ignore[attr-defined]
    with pytest.raises(CorruptCheckpointError, match="hash"):
        mgr.load("latest") if how == "load" else mgr.verify("latest")
    assert {r[0]: r[3] for r in rows(db)} == {saved.id: "corrupt"}


class CutBody:
    """A GET body that ends early without an error of its own (a dropped connection
    that the HTTP layer did not notice)."""

    def __init__(self, inner: Any, after: int) -> None:
        self.inner, self.left = inner, after

    def read(self, amount: int | None = None) -> bytes:
        data = self.inner.read(self.left if amount is None else min(amount, self.left))
        self.left -= len(data)
        return data


@pytest.mark.timeout(120)
def test_a_body_cut_short_is_unreadable_not_corrupt(
    open_s3: Callable[..., CheckpointManager], db: LedgerClient
) -> None:
    mgr = open_s3()
    saved = mgr.save(1, model=big_state(1.0, mib=12))["model"]
    mgr._ctx.store.calls.client.meta.events.register(  # type: ignore[attr-defined]
        "after-call.s3.GetObject",
        lambda parsed, **_: parsed.update(Body=CutBody(parsed["Body"], after=9 * MiB)),
    )
    with pytest.raises(ObjectStoreError, match=f"ended at {9 * MiB} of {saved.size} bytes"):
        mgr.load("latest")
    problems = mgr.check()
    assert len(problems) == 1 and "ended at" in problems[0], problems
    assert {r[0]: r[3] for r in rows(db)} == {saved.id: "committed"}  # not marked corrupt


@pytest.mark.timeout(120)
def test_a_load_holds_the_payload_once(open_s3: Callable[..., CheckpointManager]) -> None:
    """The object is read into one buffer that is hashed and then unpickled as it is:
    no second copy (torch's own tensors are not Python allocations)."""
    mgr = open_s3()
    saved = mgr.save(1, model=big_state(2.0, mib=24))["model"]
    loaded: list[Any] = []
    peak = traced_peak(lambda: loaded.append(mgr.load(1)))
    assert torch.equal(loaded[0]["w"], big_state(2.0, mib=24)["w"])
    assert saved.size <= peak <= saved.size + 4 * MiB, f"peak {peak / MiB:.1f} MiB"


@pytest.mark.timeout(60)
def test_a_reader_loads_records_and_urls_of_object_storage(
    open_s3: Callable[..., CheckpointManager], root: Path
) -> None:
    """A reader resolves an object's record or URL through its ledger (an object has no
    run directory above it and no local file to look at)."""
    from ckptdb import resolve

    mgr = open_s3()
    saved = [mgr.save(step, model=state(float(step)))["model"] for step in (1, 2)]
    with RunReader(root) as reader, reader.follow("model", since=0, timeout=0.5) as followed:
        records = list(followed)
        assert [r.id for r in records] == [c.id for c in saved]
        for record in records:
            assert torch.equal(reader.load(record)["w"], state(float(record.step))["w"])
            assert torch.equal(reader.load(str(record.path))["w"], state(float(record.step))["w"])
            assert reader.resolve(record.path).id == record.id
        assert resolve(str(saved[0].path), root=root).id == saved[0].id
        with pytest.raises(CheckpointNotFoundError):
            reader.load("s3://ckpt/elsewhere/model/step-000000001.pt")
    with pytest.raises(InvalidArgumentError, match="root="):
        resolve(str(saved[0].path))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mib", [0, 12], ids=["one_put", "multipart"])
def test_a_retried_completion_that_meets_another_object_leaves_it_alone(
    open_s3: Callable[..., CheckpointManager],
    hooks: list[Any],
    client: Any,
    db: LedgerClient,
    mib: int,
) -> None:
    """Our completion gets a 503 (not applied); meanwhile someone else's object appears;
    botocore's retry meets 412 and the HEAD that settles it sees another size: that
    object is someone else's, so the rollback (and every later reconcile) leaves it."""
    operation = "CompleteMultipartUpload" if mib else "PutObject"
    planted: list[str] = []

    def install(s3: Any) -> None:
        def before_send(request: Any, **_: Any) -> AWSResponse | None:
            if "/model/" not in request.url or planted:  # not the probe at open
                return None
            key = request.url.split(f"/{s3lib.BUCKET}/", 1)[1].split("?", 1)[0]
            client.put_object(Bucket=s3lib.BUCKET, Key=key, Body=b"someone else's")
            planted.append(key)
            return error_response(request, 503, "SlowDown")

        s3.meta.events.register(f"before-send.s3.{operation}", before_send)

    hooks.append(install)
    mgr = open_s3()
    with pytest.raises(PublishError) as raised:
        mgr.save(1, model=big_state(1.0, mib) if mib else state(1.0))
    assert s3lib.keys_under(client, "s3://ckpt/" + planted[0].split("/")[0]) == planted
    assert "someone else's object" in str(raised.value)
    assert [r[3] for r in rows(db)] == ["aborted"]
    mgr.close()
    again = open_s3()
    assert again.last_reconcile.actions == []
    body = client.get_object(Bucket=s3lib.BUCKET, Key=planted[0])["Body"].read()
    assert body == b"someone else's"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failure", ["refused", "timeout"])
def test_credentials_in_urls_never_appear_in_errors(
    tmp_path: Path, s3_url: str, s3_env: s3lib.S3Server, failure: str
) -> None:
    """``s3://KEY:SECRET@bucket`` is refused without being repeated; an endpoint URL
    with ``user:password@`` is kept out of reprs, and a connection refused or a
    timeout (botocore repeats the endpoint URL in both) reports it redacted, in the
    whole exception chain as a traceback prints it."""
    import socket
    import traceback

    secret = s3lib.SECRET_KEY
    root = tmp_path / "run"
    with pytest.raises(InvalidArgumentError, match="credentials") as refused:
        CheckpointManager(root, save_dir=f"s3://{s3lib.ACCESS_KEY}:{secret}@{s3lib.BUCKET}/x")
    texts = ["".join(traceback.format_exception(refused.value))]
    with socket.socket() as listener:  # accepts, never answers: a read timeout
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        if failure == "timeout":
            listener.listen(8)
        else:
            listener.close()  # nothing listens: connection refused
        options = {
            "endpoint_url": f"http://{s3lib.ACCESS_KEY}:{secret}@127.0.0.1:{port}",
            "max_attempts": 1,
            "connect_timeout": 1.0,
            "read_timeout": 0.5,
        }
        with pytest.raises(ObjectStoreError) as failed:
            CheckpointManager(root, save_dir=s3_url, storage_options=options)
    assert "127.0.0.1" in str(failed.value)  # it does say where
    texts.append("".join(traceback.format_exception(failed.value)))
    texts.append(repr(s3client.parse_options(options)))
    assert not root.exists()
    for text in texts:
        assert secret not in text, text


@pytest.mark.timeout(60)
def test_an_object_store_url_as_a_run_root_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run root (the ledger's directory) given as s3://...: refused with what to do,
    nothing created on disk (it used to become a local ./s3:/... tree)."""
    monkeypatch.chdir(tmp_path)
    for root in ("s3://ckpt/x", Path("s3://ckpt/x"), ObjectPath("s3:", "ckpt", "x")):
        with pytest.raises(InvalidArgumentError, match="save_dir='s3://"):
            CheckpointManager(root)  # type: ignore[arg-type]
    accelerate = pytest.importorskip("accelerate")
    from ckptdb.integrations.accelerate import Checkpoints

    with pytest.raises(InvalidArgumentError, match="save_dir='s3://"):
        Checkpoints(accelerate.Accelerator(cpu=True), "s3://ckpt/acc")
    transformers = pytest.importorskip("transformers")
    from ckptdb.integrations.transformers import ledger_trainer

    args = transformers.TrainingArguments(output_dir="s3://ckpt/hf", report_to=[])
    with pytest.raises(InvalidArgumentError, match="save_dir='s3://"):
        ledger_trainer(transformers.Trainer)(model=torch.nn.Linear(2, 2), args=args)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_adopt_move_into_an_object_store_run_is_refused(
    open_s3: Callable[..., CheckpointManager], root: Path, runner: Any
) -> None:
    from ckptdb.cli import main

    mgr = open_s3()
    mgr.save(1, model=state(1.0))
    mgr.close()
    torch.save(state(5.0), root / "ckpt-5.pt")
    args = ["adopt", str(root), "--layout", "glob", "--pattern", "ckpt-*.pt"]
    result = runner.invoke(main, [*args, "--step-regex", r"ckpt-(\d+)", "--move"])
    assert result.exit_code != 0
    assert "object storage" in result.output and "unexpected" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert (root / "ckpt-5.pt").exists()


@pytest.mark.timeout(60)
def test_a_dry_adopt_of_an_object_store_run_contacts_no_store(
    open_s3: Callable[..., CheckpointManager],
    root: Path,
    runner: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dry run only reads the ledger: opening the run's object store (whose probe
    writes test objects) would be a write, so it must not happen without --move."""
    from dataclasses import replace

    from ckptdb.cli import main
    from ckptdb.storage import opening

    mgr = open_s3()
    mgr.save(1, model=state(1.0))
    mgr.close()
    torch.save(state(5.0), root / "ckpt-5.pt")

    def never(*args: Any) -> Any:
        raise AssertionError("a dry adopt opened the object store")

    entry = replace(opening.OBJECT_STORES["s3"], open=never)
    monkeypatch.setitem(opening.OBJECT_STORES, "s3", entry)
    args = ["adopt", str(root), "--layout", "glob", "--pattern", "ckpt-*.pt"]
    result = runner.invoke(main, [*args, "--step-regex", r"ckpt-(\d+)", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "outside the run's save directory" in result.output
    assert "nothing was written" in result.output


@pytest.mark.timeout(60)
def test_a_store_that_ignores_the_condition_on_completion_is_refused(
    root: Path, s3_url: str, hooks: list[Any], client: Any
) -> None:
    """If-None-Match honoured on PutObject but ignored on CompleteMultipartUpload (big
    payloads): the probe completes a one-part upload twice and refuses the store."""

    def install(s3: Any) -> None:
        def strip(request: Any, **_: Any) -> None:
            if "If-None-Match" in request.headers:
                del request.headers["If-None-Match"]

        s3.meta.events.register("before-sign.s3.CompleteMultipartUpload", strip)

    hooks.append(install)
    with pytest.raises(ConditionalWritesUnsupportedError, match="CompleteMultipartUpload"):
        CheckpointManager(root, save_dir=s3_url)
    assert not (root / "ckptdb.sqlite").exists()
    assert s3lib.keys_under(client, s3_url) == []  # the probe cleaned up
    assert s3lib.uploads_under(client, s3_url) == []


@pytest.mark.timeout(60)
def test_probe_leftovers_are_removed_by_reconcile_once_stale(
    open_s3: Callable[..., CheckpointManager], client: Any, s3_url: str
) -> None:
    """A process killed mid-probe leaves a probe object or upload in ckptdb.probe/:
    reconcile removes those older than an hour, never a probe that may be running."""
    old, fresh = int(time.time()) - 2 * 3600, int(time.time())
    stale = put(client, s3_url, f"ckptdb.probe/{old}-{'a' * 32}")
    running = put(client, s3_url, f"ckptdb.probe/{fresh}-{'b' * 32}")
    upload_key = f"{s3_url.split('/', 3)[3]}/ckptdb.probe/{old}-{'c' * 32}.mpu"
    client.create_multipart_upload(Bucket=s3lib.BUCKET, Key=upload_key)
    mgr = open_s3()
    assert mgr.last_reconcile.counts == {"removed_temp": 2}
    assert s3lib.keys_under(client, s3_url) == [running]
    assert s3lib.uploads_under(client, s3_url) == []
    assert stale not in s3lib.keys_under(client, s3_url)


@pytest.mark.timeout(60)
def test_a_missing_bucket_marks_nothing_lost(
    open_s3: Callable[..., CheckpointManager], hooks: list[Any], db: LedgerClient
) -> None:
    """A HEAD 404 without a body (and NoSuchBucket on a GET) when the bucket itself is
    gone or mistyped: unreadable, reported, the row stays committed."""
    mgr = open_s3()
    saved = mgr.save(1, model=state(1.0))["model"]
    mgr.close()
    seen: list[str] = []
    hooks.append(fail("HeadObject", 404, "404", times=1000, seen=seen))
    hooks.append(fail("HeadBucket", 404, "NoSuchBucket", times=1000, seen=seen))
    hooks.append(fail("GetObject", 404, "NoSuchBucket", times=1000, seen=seen))
    with pytest.warns(UserWarning, match="could not repair"):
        mgr = open_s3(storage_options={"part_size": PART, "max_attempts": 1})
    assert mgr.last_reconcile.counts == {"failed": 1}
    with pytest.raises(ObjectStoreError, match="NoSuchBucket"):
        mgr.load("latest")
    assert [(r[0], r[3]) for r in rows(db)] == [(saved.id, "committed")]


@pytest.mark.timeout(60)
def test_listings_page_through_the_retrying_calls(
    open_s3: Callable[..., CheckpointManager], hooks: list[Any], client: Any, s3_url: str
) -> None:
    """Reconcile's listings go through the same calls as everything else: an expired
    token on ListObjectsV2 or ListMultipartUploads is refreshed, not a failed open;
    and more keys than one page still list whole."""
    mgr = open_s3()
    mgr.save(1, model=state(1.0))
    mgr.close()
    orphans = [put(client, s3_url, f"model/step-{i:09d}.v{i}.pt") for i in range(100, 103)]
    listed: list[str] = []
    uploads: list[str] = []
    hooks.append(fail("ListObjectsV2", 400, "ExpiredToken", times=1, seen=listed))
    hooks.append(fail("ListMultipartUploads", 400, "ExpiredToken", times=1, seen=uploads))
    mgr = open_s3()
    assert listed == uploads == ["ExpiredToken"]
    assert mgr._ctx.store.calls.refreshes == 2  # type: ignore[attr-defined]
    assert mgr.last_reconcile.counts == {"quarantined": 3}
    store = mgr._ctx.store
    store.calls.client.meta.events.register(  # type: ignore[attr-defined]
        "before-parameter-build.s3.ListObjectsV2", lambda params, **_: params.update(MaxKeys=2)
    )
    assert sorted(store._list_keys()) == sorted([*orphans, mgr.latest().path.key])  # type: ignore[attr-defined,union-attr]
