"""Sharded (torch.distributed.checkpoint) payloads on object storage, against a real
S3-compatible server (SeaweedFS, see ``s3lib``) and real gloo process groups.

A ``Sharded`` payload saved to ``s3://bucket/prefix`` is a key prefix unique to
its run and row (``<stream>/step-<step>.<token>.v<row id>.dcp/``) holding one
object per DCP file: each rank's shard files and the coordinator's
``.metadata``, which carries the manifest (every file's size and hash). These
tests check the round trip (one process, and 2 ranks bit for bit, a model with
its optimizer too), that the row's size and hash are those of the files, that
eviction, rollback and reconcile leave no object and no upload under the
prefix, that a fault on one rank's shard rolls back on every rank, that a shard
deleted or changed after the commit is found (lost/corrupt, latest falls back),
and that a process killed mid-save is cleaned up at the next open. Faults are
injected with botocore event hooks (``s3client.set_client_hook``) and
:mod:`ckptdb.faults`; everything else is the real server.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import re
import signal
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import s3lib
import torch
from botocore.awsrequest import AWSResponse
from crashlib import fork_running, tail, wait_child
from distlib import run_ranks
from helpers import LedgerClient, rows
from test_s3 import FlippingBody, error_response
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save

from ckptdb import CheckpointManager, External, Keep, RunReader, Sharded, faults
from ckptdb.errors import (
    CheckpointLostError,
    CorruptCheckpointError,
    InvalidArgumentError,
    PublishError,
)
from ckptdb.location import ObjectPath
from ckptdb.storage import s3client, s3dcp
from ckptdb.storage.files import hash_checkpoint

MiB = 1 << 20
PART = 5 * MiB


def sd(value: float, rank: int = 0) -> dict[str, Any]:
    """A state dict of several dtypes and shapes, and a non-tensor value."""
    return {
        "w": torch.full((64,), float(value)),
        "m": torch.arange(6, dtype=torch.float32).reshape(2, 3) * value,
        "n": torch.tensor([int(value) + rank] * 3, dtype=torch.int64),
        "epoch": int(value) + 1000,
    }


def zeroed() -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd(1).items()}


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


@pytest.fixture
def open_s3(
    root: Path, s3_url: str, open_manager: Callable[..., CheckpointManager]
) -> Callable[..., CheckpointManager]:
    def factory(**kwargs: Any) -> CheckpointManager:
        kwargs.setdefault("save_dir", s3_url)
        kwargs.setdefault("storage_options", {"part_size": PART})
        kwargs.setdefault("streams", {"model": Keep(last=2)})
        return open_manager(**kwargs)

    return factory


def big(value: float, mib: int = 6) -> torch.Tensor:
    """A tensor of ``mib`` MiB: a shard file of it takes two 5 MiB parts."""
    return torch.full((mib * MiB // 4,), float(value))


def names_under(client: Any, path: object) -> list[str]:
    """The file names under a sharded checkpoint's prefix."""
    return [k.rsplit("/", 1)[1] for k in s3lib.keys_under(client, str(path))]


def shard_key(path: object, name: str = "__0_0.distcp") -> str:
    assert isinstance(path, ObjectPath)
    return f"{path.key}/{name}"


def download(client: Any, path: object, into: Path) -> Path:
    """Every object under the checkpoint's prefix, as files of a local directory."""
    into.mkdir(parents=True)
    for name in names_under(client, path):
        body = client.get_object(Bucket=s3lib.BUCKET, Key=shard_key(path, name))["Body"]
        (into / name).write_bytes(body.read())
    return into


def states(db: LedgerClient) -> dict[int, str]:
    return dict(db.rows("SELECT step, state FROM checkpoints"))


def forked_rank() -> None:
    """In a forked rank: the parent's intra-op thread pool does not survive fork (a
    large tensor op would wait on it forever), so the rank computes on one thread."""
    torch.set_num_threads(1)


def s3_manager(root: str, url: str, **kwargs: Any) -> CheckpointManager:
    kwargs.setdefault("streams", {"model": Keep(last=2)})
    return CheckpointManager(root, save_dir=url, storage_options={"part_size": PART}, **kwargs)


def report(work: Callable[[], Any]) -> dict[str, Any]:
    """Run ``work`` on a rank; its value, or its error as data."""
    try:
        return {"value": work(), "error": None}
    except Exception as exc:
        return {
            "value": None,
            "error": type(exc).__name__,
            "phase": getattr(exc, "phase", None),
            "ranks": getattr(exc, "ranks", None),
            "message": str(exc),
        }


# ------------------------------------------------------------------ one process


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mib", [0, 6], ids=["one_put", "multipart"])
def test_round_trip_on_object_storage(
    open_s3: Callable[..., CheckpointManager],
    client: Any,
    s3_url: str,
    tmp_path: Path,
    db: LedgerClient,
    mib: int,
) -> None:
    """One process: the shards and ``.metadata`` are objects under a prefix unique to
    run and row, the row's size and hash are those of the files (as a local DCP
    directory of them would have), and they load back in place, bit for bit."""
    payload = {**sd(3.0), "big": big(3.0, mib)} if mib else sd(3.0)
    mgr = open_s3()
    out = mgr.save(10, model=Sharded(payload))["model"]
    token = mgr._ctx.store.run_token  # type: ignore[attr-defined]
    assert isinstance(out.path, ObjectPath) and str(out.path).startswith(s3_url + "/model/")
    assert out.path.name == f"step-000000010.{token}.v{out.id}.dcp"
    assert names_under(client, out.path) == [".metadata", "__0_0.distcp"]  # no temp, no rename
    local = download(client, out.path, tmp_path / "copy")
    assert hash_checkpoint(local) == type(hash_checkpoint(local))(out.size, out.hash)
    assert s3lib.uploads_under(client, s3_url) == []
    assert db.rows("SELECT path, state, tmp_path FROM checkpoints") == [
        (f"model/{out.path.name}", "committed", None)
    ]
    target = {**zeroed(), "big": torch.zeros_like(payload["big"])} if mib else zeroed()
    assert mgr.load("latest", into=target) is target
    assert_same(target, payload)
    plain = {**zeroed(), "big": torch.zeros_like(payload["big"])} if mib else zeroed()
    with warnings.catch_warnings():  # DCP warns that no process group means one process
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(plain, storage_reader=FileSystemReader(local), no_dist=True)  # DCP's format
    assert_same(plain, payload)
    assert mgr.check(load=True) == []
    assert mgr.reconcile(verify=True).actions == []
    mgr.close()
    assert open_s3().last_reconcile.actions == []


def key_errors(request: Any) -> AWSResponse:
    """A ``DeleteObjects`` answer (200) that reports every key as not deleted."""
    keys = re.findall(rb"<Key>([^<]+)</Key>", request.body)
    errors = b"".join(
        b"<Error><Key>%s</Key><Code>AccessDenied</Code><Message>injected</Message></Error>" % k
        for k in keys
    )
    body = b"<DeleteResult>" + errors + b"</DeleteResult>"
    headers = {"Content-Type": "application/xml", "Content-Length": str(len(body))}
    return AWSResponse(request.url, 200, headers, _Body(body))


class _Body:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_: Any) -> Any:
        yield self.body


@pytest.mark.timeout(90)
@pytest.mark.parametrize("failure", ["request", "per_key"])
def test_eviction_deletes_every_shard_object_and_a_failed_delete_is_retried(
    open_s3: Callable[..., CheckpointManager],
    client: Any,
    s3_url: str,
    db: LedgerClient,
    failure: str,
) -> None:
    """Eviction deletes the whole prefix after the commit; a ``DeleteObjects`` that fails
    (the request, or only some keys in its answer) leaves the row ``deleting`` and its
    objects, and the next open finishes it."""
    mgr = open_s3(streams={"model": Keep(last=1)})
    first = mgr.save(1, model=Sharded(sd(1.0)))["model"]
    second = mgr.save(2, model=Sharded(sd(2.0)))["model"]
    assert s3lib.keys_under(client, s3_url) == [
        shard_key(second.path, ".metadata"),
        shard_key(second.path),
    ]
    assert states(db) == {1: "deleted", 2: "committed"}
    events = mgr._ctx.store.calls.client.meta.events  # type: ignore[attr-defined]

    def refuse(request: Any, **_: Any) -> AWSResponse:
        return (
            error_response(request, 403, "AccessDenied")
            if failure == "request"
            else key_errors(request)
        )

    events.register("before-send.s3.DeleteObjects", refuse, unique_id="refuse")
    with pytest.warns(UserWarning, match="AccessDenied"):  # after the commit: warned, kept
        third = mgr.save(3, model=Sharded(sd(3.0)))["model"]
    events.unregister("before-send.s3.DeleteObjects", unique_id="refuse")
    assert states(db) == {1: "deleted", 2: "deleting", 3: "committed"}
    assert names_under(client, second.path) == [".metadata", "__0_0.distcp"]
    mgr.close()
    again = open_s3(streams={"model": Keep(last=1)})
    assert again.last_reconcile.counts == {"deleted": 1}
    assert states(db) == {1: "deleted", 2: "deleted", 3: "committed"}
    keys = s3lib.keys_under(client, s3_url)
    assert keys == [shard_key(third.path, ".metadata"), shard_key(third.path)]
    assert first.path != second.path


@pytest.mark.timeout(60)
def test_external_payloads_are_refused_with_a_clear_message(
    open_s3: Callable[..., CheckpointManager], client: Any, s3_url: str, db: LedgerClient
) -> None:
    mgr = open_s3(streams={"model": Keep(last=1), "hf": Keep(last=1)})
    external = External(lambda p: p.write_bytes(b"x"), name="hf/ckpt.bin")
    with pytest.raises(InvalidArgumentError, match=r"framework's own writer.*local save_dir"):
        mgr.save(1, model=Sharded(sd(1.0)), hf=external)
    assert db.rows("SELECT id FROM checkpoints") == []
    assert s3lib.keys_under(client, s3_url) == []


# ------------------------------------------------------------- found after commit


def _replace(client: Any, key: str, change: str) -> None:
    if change == "deleted":
        client.delete_object(Bucket=s3lib.BUCKET, Key=key)
        return
    data = bytearray(client.get_object(Bucket=s3lib.BUCKET, Key=key)["Body"].read())
    if change == "flipped":
        data[len(data) // 2] ^= 0x10
    else:
        del data[-1]
    client.put_object(Bucket=s3lib.BUCKET, Key=key, Body=bytes(data))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("name", "change", "state", "error"),
    [
        ("__0_0.distcp", "deleted", "lost", CheckpointLostError),
        ("__0_0.distcp", "flipped", "corrupt", CorruptCheckpointError),
        ("__0_0.distcp", "truncated", "corrupt", CorruptCheckpointError),
        (".metadata", "deleted", "lost", CheckpointLostError),
        (".metadata", "flipped", "corrupt", CorruptCheckpointError),
    ],
)
def test_a_shard_changed_after_the_commit_is_found_at_load_and_latest_falls_back(
    open_s3: Callable[..., CheckpointManager],
    client: Any,
    db: LedgerClient,
    name: str,
    change: str,
    state: str,
    error: type[Exception],
) -> None:
    mgr = open_s3()
    mgr.save(1, model=Sharded(sd(1.0)))
    second = mgr.save(2, model=Sharded(sd(2.0)))["model"]
    _replace(client, shard_key(second.path, name), change)
    with pytest.raises(error):
        mgr.load("latest", into=zeroed())
    assert states(db) == {1: "committed", 2: state}
    latest = mgr.latest()
    assert latest is not None and latest.step == 1
    target = zeroed()
    mgr.load("latest", into=target)
    assert_same(target, sd(1.0))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("change", "state", "verify"),
    [
        ("deleted", "lost", False),
        ("truncated", "corrupt", False),
        ("flipped", "corrupt", True),
        ("other_manifest", "corrupt", False),
    ],
)
def test_reconcile_checks_every_file_of_the_manifest(
    open_s3: Callable[..., CheckpointManager],
    client: Any,
    db: LedgerClient,
    change: str,
    state: str,
    verify: bool,
) -> None:
    """A committed row's files are HEADed one by one (by the manifest, never by a
    listing); a changed byte needs ``verify`` (a GET and a hash per file)."""
    mgr = open_s3(streams={"model": Keep(last=3)})
    mgr.save(0, model=Sharded(sd(0.0)))
    first = mgr.save(1, model=Sharded({**sd(1.0), "big": big(1.0)}))["model"]
    second = mgr.save(2, model=Sharded({**sd(2.0), "big": big(2.0)}))["model"]
    if change == "other_manifest":  # a valid manifest, of other files of the same sizes
        client.copy_object(
            Bucket=s3lib.BUCKET,
            Key=shard_key(second.path, ".metadata"),
            CopySource={"Bucket": s3lib.BUCKET, "Key": shard_key(first.path, ".metadata")},
        )
    else:
        _replace(client, shard_key(second.path), change)
    if verify:
        assert mgr.reconcile().actions == []  # sizes agree: only a hash finds it
    report = mgr.reconcile(verify=verify)
    assert report.counts == {state: 1, "repointed": 1}
    assert ("manifest" if change == "other_manifest" else "__0_0.distcp") in report.actions[
        0
    ].detail
    assert states(db) == {0: "committed", 1: "committed", 2: state}
    latest = mgr.latest()
    assert latest is not None and latest.step == 1
    assert mgr.reconcile(verify=True).actions == []


# ------------------------------------------------------------------ reconcile


def put(client: Any, url: str, rel: str, body: bytes = b"x") -> str:
    key = f"{url.split('/', 3)[3]}/{rel}"
    client.put_object(Bucket=s3lib.BUCKET, Key=key, Body=body)
    return key


@pytest.mark.timeout(90)
def test_reconcile_of_sharded_prefixes_without_a_row(
    open_s3: Callable[..., CheckpointManager], client: Any, s3_url: str, db: LedgerClient
) -> None:
    """A rolled-back row's prefix (planted again) and an upload with no row are removed;
    an orphan prefix of ours stays where it is (quarantined in place, reported once);
    names that are not ours (no token, another run's token, a ``.dcp`` object) are never
    touched; a second reconcile does nothing."""
    mgr = open_s3(streams={"model": Keep(last=3)})
    kept = mgr.save(1, model=Sharded(sd(1.0)))["model"]
    events = mgr._ctx.store.calls.client.meta.events  # type: ignore[attr-defined]

    def refuse(request: Any, **_: Any) -> AWSResponse:
        return error_response(request, 400, "InvalidRequest")

    events.register("before-send.s3.PutObject", refuse, unique_id="refuse")
    with pytest.raises(PublishError):
        mgr.save(2, model=Sharded(sd(2.0)))
    events.unregister("before-send.s3.PutObject", unique_id="refuse")
    (aborted,) = db.rows("SELECT path FROM checkpoints WHERE state = 'aborted'")[0]
    token = mgr._ctx.store.run_token  # type: ignore[attr-defined]
    mgr.close()
    planted = [put(client, s3_url, f"{aborted}/{n}") for n in (".metadata", "__0_0.distcp")]
    orphan = put(client, s3_url, f"model/step-000000009.{token}.v99.dcp/.metadata")
    foreign = [
        put(client, s3_url, rel)
        for rel in (
            "model/step-000000009.dcp/.metadata",  # no token (never sharded on S3)
            "model/step-000000009.0123456789.v98.dcp/.metadata",  # another run's
            f"model/step-000000009.{token}.v97.dcp",  # an object, not a prefix
            f"model/step-000000009.{token}.v96.pt/x",  # a prefix, not an object
        )
    ]
    upload = f"{s3_url.split('/', 3)[3]}/model/step-000000008.{token}.v95.dcp/__1_0.distcp"
    client.create_multipart_upload(Bucket=s3lib.BUCKET, Key=upload)

    mgr = open_s3(streams={"model": Keep(last=3)})
    assert mgr.last_reconcile.counts == {"removed_temp": 2, "quarantined": 1}
    keys = s3lib.keys_under(client, s3_url)
    assert not set(planted) & set(keys)
    assert orphan in keys and set(foreign) <= set(keys)
    assert shard_key(kept.path) in keys
    assert s3lib.uploads_under(client, s3_url) == []
    assert mgr.reconcile().actions == []
    assert states(db) == {1: "committed", 2: "aborted"}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("visit", [1, 2], ids=["upload_in_progress", "shard_completed"])
def test_sigkill_mid_sharded_save_is_cleaned_up_at_the_next_open(
    tmp_path: Path, s3_url: str, client: Any, visit: int
) -> None:
    """Killed before the shard's completion (an upload in progress under the prefix) or
    before ``.metadata``'s (the shard complete): the next open aborts the upload,
    deletes the partial prefix and rolls the row back."""
    root = tmp_path / "run"

    def body() -> int:
        with s3_manager(str(root), s3_url) as mgr:
            mgr.save(1, model=Sharded(sd(1.0)))
            seen: list[str] = []

            def kill(name: str) -> None:
                seen.append(name)
                if name == "s3_before_complete" and seen.count(name) == visit:
                    os.kill(os.getpid(), signal.SIGKILL)

            faults.set_hook(kill)
            mgr.save(2, model=Sharded({**sd(2.0), "big": big(2.0)}))
        return 0

    pid = fork_running(root, tmp_path / "child.log", body)
    assert wait_child(pid, 60) == -signal.SIGKILL, tail(tmp_path / "child.log")
    (pending,) = rows(root, "SELECT path FROM checkpoints WHERE state = 'pending'")[0]
    partial = f"{s3_url.split('/', 3)[3]}/{pending}/"
    keys = [k for k in s3lib.keys_under(client, s3_url) if k.startswith(partial)]
    uploads = [k for k in s3lib.uploads_under(client, s3_url) if k.startswith(partial)]
    if visit == 1:
        assert (keys, uploads) == ([], [partial + "__0_0.distcp"])
    else:
        assert (keys, uploads) == ([partial + "__0_0.distcp"], [])
    with s3_manager(str(root), s3_url) as mgr:
        assert mgr.last_reconcile.counts == {"rolled_back": 1}
        latest = mgr.latest()
        assert latest is not None and latest.step == 1
        assert mgr.check(load=True) == []
    assert not [k for k in s3lib.keys_under(client, s3_url) if k.startswith(partial)]
    assert s3lib.uploads_under(client, s3_url) == []
    assert dict(rows(root, "SELECT step, state FROM checkpoints")) == {
        1: "committed",
        2: "aborted",
    }


@pytest.mark.timeout(90)
def test_a_shard_stream_that_raised_is_aborted_never_completed(
    open_s3: Callable[..., CheckpointManager], client: Any, s3_url: str, db: LedgerClient
) -> None:
    """A failure inside DCP's write of a shard file, its upload under way: the upload is
    aborted and no completion is ever sent for it (torch's fsspec writer would complete
    the partial object at the stream's close); the boundary rolls back, nothing left."""
    mgr = open_s3()
    mgr.save(1, model=Sharded(sd(1.0)))
    sent: list[tuple[str, str]] = []
    events = mgr._ctx.store.calls.client.meta.events  # type: ignore[attr-defined]
    for operation in ("PutObject", "CompleteMultipartUpload", "AbortMultipartUpload"):

        def record(params: Any, operation: str = operation, **_: Any) -> None:
            sent.append((operation, params["Key"].rsplit("/", 1)[1]))

        events.register(f"provide-client-params.s3.{operation}", record)

    def full_disk(name: str) -> None:
        if name == "mid_write" and s3lib.uploads_under(client, s3_url):  # a part is out
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    faults.set_hook(full_disk)
    try:
        with pytest.raises(PublishError, match=f"write failed at {s3_url}/model/") as raised:
            mgr.save(2, model=Sharded({**sd(2.0), "big": big(2.0)}))
    finally:
        faults.set_hook(None)
    assert raised.value.phase == "write"
    assert sent == [("AbortMultipartUpload", "__0_0.distcp")]
    assert states(db) == {1: "committed", 2: "aborted"}
    (aborted,) = db.rows("SELECT path FROM checkpoints WHERE step = 2")[0]
    assert not [k for k in s3lib.keys_under(client, s3_url) if aborted in k]
    assert s3lib.uploads_under(client, s3_url) == []


@pytest.mark.timeout(60)
def test_a_shard_that_changes_between_the_verify_and_the_read_is_refused(
    open_s3: Callable[..., CheckpointManager], db: LedgerClient
) -> None:
    """DCP reads each shard in one GET, checked against the manifest just verified before
    a byte reaches it: the bytes of a shard flipped after the verify are refused."""
    mgr = open_s3()
    mgr.save(1, model=Sharded(sd(1.0)))
    gets: list[str] = []

    def flip_the_read(parsed: Any, model: Any, context: Any, **_: Any) -> None:
        key = context.get("input_params", {}).get("Key", "") if context else ""
        gets.append(key)
        if key.endswith("__0_0.distcp") and gets.count(key) == 2:  # verify's, then DCP's
            parsed["Body"] = FlippingBody(parsed["Body"], offset=100)

    events = mgr._ctx.store.calls.client.meta.events  # type: ignore[attr-defined]
    events.register("before-parameter-build.s3.GetObject", _keep_params)
    events.register("after-call.s3.GetObject", flip_the_read)
    target = zeroed()
    with pytest.raises(CorruptCheckpointError, match="verified"):
        mgr.load("latest", into=target)
    assert_same(target, zeroed())  # nothing was loaded
    assert [k.rsplit("/", 1)[1] for k in gets].count("__0_0.distcp") == 2
    assert states(db) == {1: "committed"}  # found at the read: raised, not recorded


def _keep_params(params: Any, context: Any, **_: Any) -> None:
    context["input_params"] = dict(params)


@pytest.mark.timeout(60)
def test_a_prefix_taken_before_the_intent_gets_another_name(
    open_s3: Callable[..., CheckpointManager], client: Any, s3_url: str
) -> None:
    """Any object under the prefix the next row would use (a lost intent's) makes the
    save go under a salted prefix, and leaves that object alone."""
    mgr = open_s3()
    mgr.save(1, model=Sharded(sd(1.0)))
    token = mgr._ctx.store.run_token  # type: ignore[attr-defined]
    taken = put(client, s3_url, f"model/step-000000002.{token}.v2.dcp/__0_0.distcp", b"old")
    saved = mgr.save(2, model=Sharded(sd(2.0)))["model"]
    assert saved.id == 2
    assert re.fullmatch(rf"step-000000002\.{token}\.v2-[0-9a-f]{{8}}\.dcp", saved.path.name)
    assert client.get_object(Bucket=s3lib.BUCKET, Key=taken)["Body"].read() == b"old"
    target = zeroed()
    mgr.load("latest", into=target)
    assert_same(target, sd(2.0))


@pytest.mark.timeout(60)
def test_an_asynchronous_save_and_a_reader_on_object_storage(
    open_s3: Callable[..., CheckpointManager], root: Path
) -> None:
    mgr = open_s3()
    handle = mgr.save(1, blocking=False, model=Sharded(sd(1.0)))
    saved = handle.result()["model"]
    assert saved.step == 1
    with RunReader(root) as reader:  # a follower, without the writer lock
        target = zeroed()
        reader.load("latest", into=target)
    assert_same(target, sd(1.0))


# ------------------------------------------------------------------ two ranks


def _dtensor_round_trip(rank: int, world: int, root: str, url: str) -> dict[str, Any]:
    forked_rank()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(world * 4, 3, generator=torch.Generator().manual_seed(7))
    state = {
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        f"own_{rank}": torch.randn(5, generator=torch.Generator().manual_seed(rank)),
        "step": 7,
    }
    with s3_manager(root, url) as mgr:
        saved = mgr.save(7, model=Sharded(state))["model"]
        target = {
            "sharded": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]),
            f"own_{rank}": torch.zeros(5),
            "step": 0,
        }
        gets: list[str] = []

        def count(params: Any, **_: Any) -> None:
            gets.append(params["Key"].rsplit("/", 1)[1])

        events = mgr._ctx.store.calls.client.meta.events  # type: ignore[attr-defined]
        events.register("provide-client-params.s3.GetObject", count)
        loaded = mgr.load(into=target)
        return {
            "saved": saved,
            "same_object": loaded is target,
            "local": target["sharded"].to_local().clone(),
            "expected_local": state["sharded"].to_local().clone(),
            "full": target["sharded"].full_tensor(),
            "own": target[f"own_{rank}"].clone(),
            "expected_own": state[f"own_{rank}"].clone(),
            "step": target["step"],
            "gets": gets,
        }


@pytest.mark.timeout(90)
def test_two_ranks_save_and_resume_bit_for_bit(tmp_path: Path, s3_url: str, client: Any) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_dtensor_round_trip, 2, tmp_path, str(root), s3_url, timeout=75)
    for o in outcomes:
        assert o.error is None, o.trace
    full = torch.randn(8, 3, generator=torch.Generator().manual_seed(7))
    for o in outcomes:
        v = o.value
        assert v["same_object"] and v["step"] == 7
        assert torch.equal(v["local"], v["expected_local"]) and torch.equal(v["full"], full)
        assert torch.equal(v["own"], v["expected_own"])
        assert v["saved"] == outcomes[0].value["saved"]
    saved = outcomes[0].value["saved"]
    # every rank wrote its shard file under the one prefix; the coordinator the metadata
    files = [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert names_under(client, saved.path) == files
    # the chief hashed every file for the ledger, then read what it loads; the other rank
    # checked the manifest and read each file it loads once (hashed as it was read)
    chief, other = (Counter(o.value["gets"]) for o in outcomes)
    assert set(chief) == set(files) and chief["__0_0.distcp"] == 2
    assert other["__1_0.distcp"] == 1 and max(other.values()) == 2  # .metadata: verify, DCP
    local = download(client, saved.path, tmp_path / "copy")
    assert hash_checkpoint(local) == type(hash_checkpoint(local))(saved.size, saved.hash)
    assert s3lib.uploads_under(client, s3_url) == []
    with s3_manager(str(root), s3_url) as mgr:  # one process: reconcile and check accept it
        assert mgr.last_reconcile.actions == []
        assert mgr.reconcile(verify=True).actions == []


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()


def _model_and_optimizer(rank: int, world: int, root: str, url: str) -> dict[str, Any]:
    """Train, save model and optimizer, train on; a fresh pair resumed from the
    checkpoint then trains exactly like the original."""
    forked_rank()
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def pair(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, optim = pair(0)
    for step in range(3):
        _train(model, optim, step)
    with s3_manager(root, url) as mgr:
        msd, osd = get_state_dict(model, optim)
        mgr.save(3, model=Sharded({"model": msd, "optim": osd}))
        resumed_model, resumed_optim = pair(1)  # other weights, no optimizer state yet
        msd2, osd2 = get_state_dict(resumed_model, resumed_optim)
        target = {"model": msd2, "optim": osd2}
        mgr.load("latest", into=target)
        set_state_dict(
            resumed_model,
            resumed_optim,
            model_state_dict=target["model"],
            optim_state_dict=target["optim"],
        )
    for step in range(3, 6):
        _train(model, optim, step)
        _train(resumed_model, resumed_optim, step)
    original = [p.detach().clone() for p in model.parameters()]
    resumed = [p.detach().clone() for p in resumed_model.parameters()]
    moments = [
        (optim.state[a]["exp_avg_sq"], resumed_optim.state[b]["exp_avg_sq"])
        for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True)
    ]
    return {
        "same_weights": all(torch.equal(a, b) for a, b in zip(original, resumed, strict=True)),
        "same_moments": all(torch.equal(a, b) for a, b in moments),
        "weights": original,
    }


@pytest.mark.timeout(90)
def test_two_ranks_resume_model_and_optimizer_bit_for_bit(tmp_path: Path, s3_url: str) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_model_and_optimizer, 2, tmp_path, str(root), s3_url, timeout=75)
    for o in outcomes:
        assert o.error is None, o.trace
        assert o.value["same_weights"] and o.value["same_moments"]
    first, second = (o.value["weights"] for o in outcomes)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def _corrupt_latest(rank: int, world: int, root: str, url: str) -> dict[str, Any]:
    forked_rank()
    import boto3
    import torch.distributed as dist

    def state(value: float) -> dict[str, Any]:  # replicated values, and one of this rank's own
        return {**sd(value), f"own_{rank}": torch.full((4,), value + rank)}

    def blank() -> dict[str, Any]:
        return {**zeroed(), f"own_{rank}": torch.zeros(4)}

    with s3_manager(root, url) as mgr:
        mgr.save(1, model=Sharded(state(1.0)))
        second = mgr.save(2, model=Sharded(state(2.0)))
        if rank == 0:  # rank 1's shard of step 2 changes after the commit
            s3 = boto3.client("s3", endpoint_url=os.environ[s3client.ENDPOINT_ENV])
            _replace(s3, shard_key(second["model"].path, "__1_0.distcp"), "flipped")
        dist.barrier()
        first = report(lambda: mgr.load("latest", into=blank()))
        target = blank()
        mgr.load("latest", into=target)
        return {"first": first, "loaded": target, "want": state(1.0), "latest": mgr.latest()}


@pytest.mark.timeout(90)
def test_a_shard_corrupted_after_the_commit_fails_every_rank_and_latest_falls_back(
    tmp_path: Path, s3_url: str
) -> None:
    """The chief's full verify finds another rank's shard changed: every rank raises
    ``CorruptCheckpointError``, the row is corrupt, and every rank resumes from the
    previous checkpoint, its own shard bit for bit."""
    root = tmp_path / "run"
    outcomes = run_ranks(_corrupt_latest, 2, tmp_path, str(root), s3_url, timeout=75)
    for rank, o in enumerate(outcomes):
        assert o.error is None, o.trace
        assert o.value["first"]["error"] == "CorruptCheckpointError", o.value["first"]
        assert "__1_0.distcp" in o.value["first"]["message"]
        assert o.value["latest"].step == 1
        assert_same(o.value["loaded"], o.value["want"])
        assert torch.equal(o.value["loaded"][f"own_{rank}"], torch.full((4,), 1.0 + rank))
    assert dict(rows(root, "SELECT step, state FROM checkpoints")) == {
        1: "committed",
        2: "corrupt",
    }


def _shard_fault(rank: int, world: int, root: str, url: str, operation: str) -> dict[str, Any]:
    forked_rank()
    with s3_manager(root, url) as mgr:
        mgr.save(1, model=Sharded(sd(1.0, rank)))
        if rank == world - 1:  # this rank's shard is multipart: the fault hits its upload
            events = mgr._ctx.store.calls.client.meta.events  # type: ignore[attr-defined]

            def refuse(request: Any, **_: Any) -> AWSResponse:
                return error_response(request, 400, "InvalidRequest")

            events.register(f"before-send.s3.{operation}", refuse)
        own = big(float(rank)) if rank == world - 1 else torch.ones(3)
        result = report(lambda: mgr.save(2, model=Sharded({**sd(2.0, rank), f"own_{rank}": own})))
        result["latest"] = mgr.latest()
        return result


@pytest.mark.timeout(90)
@pytest.mark.parametrize("operation", ["UploadPart", "CompleteMultipartUpload"])
def test_a_shard_write_failing_on_one_rank_rolls_back_on_every_rank(
    tmp_path: Path, s3_url: str, client: Any, operation: str
) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_shard_fault, 2, tmp_path, str(root), s3_url, operation, timeout=75)
    for o in outcomes:
        assert o.error is None, o.trace
        r = o.value
        assert r["error"] == "PublishError", r
        assert r["ranks"] == [1] and "InvalidRequest" in r["message"], r
        assert r["latest"].step == 1
    step1, step2 = rows(root, "SELECT path, state FROM checkpoints ORDER BY step")
    assert step1[1] == "committed" and step2[1] == "aborted"
    assert not [k for k in s3lib.keys_under(client, s3_url) if step2[0] in k]
    assert s3lib.uploads_under(client, s3_url) == []


def _seal_fails(rank: int, world: int, root: str, url: str, change: str) -> dict[str, Any]:
    forked_rank()
    with s3_manager(root, url) as mgr:
        if rank == 0:  # the chief: rank 1's shard changes between DCP's write and the seal
            import boto3

            s3 = boto3.client("s3", endpoint_url=os.environ[s3client.ENDPOINT_ENV])

            def meddle(name: str) -> None:
                if name == "after_intent":
                    (path,) = rows(Path(root), "SELECT path FROM checkpoints")[0]
                    key = f"{url.split('/', 3)[3]}/{path}/__1_0.distcp"
                    _replace(s3, key, change)

            faults.set_hook(meddle)
        own = {f"own_{rank}": torch.ones(3)}  # so that every rank writes a shard file
        result = report(lambda: mgr.save(1, model=Sharded({**sd(1.0), **own})))
        faults.set_hook(None)
        return result


@pytest.mark.timeout(90)
@pytest.mark.parametrize("change", ["deleted", "truncated"])
def test_a_shard_missing_or_short_at_the_seal_rolls_back_on_every_rank(
    tmp_path: Path, s3_url: str, client: Any, change: str
) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_seal_fails, 2, tmp_path, str(root), s3_url, change, timeout=75)
    for o in outcomes:
        assert o.error is None, o.trace
        r = o.value
        assert (r["error"], r["phase"]) == ("PublishError", "verify"), r
        assert "__1_0.distcp" in r["message"], r
    assert rows(root, "SELECT state FROM checkpoints") == [("aborted",)]
    assert s3lib.keys_under(client, s3_url) == []
    assert s3lib.uploads_under(client, s3_url) == []


class _Planted:
    """A pickle that runs code when it is loaded: ``os.mkdir(path)``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["load", "reconcile"])
def test_a_planted_manifest_is_refused_before_it_is_unpickled(
    open_s3: Callable[..., CheckpointManager],
    client: Any,
    db: LedgerClient,
    tmp_path: Path,
    how: str,
) -> None:
    """``.metadata`` is read before the row authenticates it (the row's digest covers
    the manifest's own hashes), so its bytes are unpickled with DCP's metadata classes
    only: a ``.metadata`` planted in the bucket cannot run code in whoever verifies it;
    it is a corrupt checkpoint, and latest falls back."""
    mgr = open_s3()
    mgr.save(1, model=Sharded(sd(1.0)))
    second = mgr.save(2, model=Sharded(sd(2.0)))["model"]
    ran = tmp_path / "the planted pickle ran"
    client.put_object(
        Bucket=s3lib.BUCKET,
        Key=shard_key(second.path, ".metadata"),
        Body=pickle.dumps(_Planted(ran)),
    )
    if how == "load":
        with pytest.raises(CorruptCheckpointError, match="not a ckptdb manifest"):
            mgr.load("latest", into=zeroed())
    else:
        report = mgr.reconcile()
        assert report.counts == {"corrupt": 1, "repointed": 1}
        assert "posix.mkdir" in report.actions[0].detail
    assert not ran.exists()
    assert states(db) == {1: "committed", 2: "corrupt"}
    target = zeroed()
    mgr.load("latest", into=target)
    assert_same(target, sd(1.0))


class _CountingBody:
    """A response body that counts the bytes read from it."""

    def __init__(self, inner: Any, counts: Counter[str], key: str) -> None:
        self.inner, self.counts, self.key = inner, counts, key

    def read(self, amount: int | None = None) -> bytes:
        data: bytes = self.inner.read(amount)
        self.counts[self.key] += len(data)
        return data

    def iter_chunks(self, size: int) -> Any:
        for chunk in self.inner.iter_chunks(size):
            self.counts[self.key] += len(chunk)
            yield chunk


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_an_object_larger_than_the_checkpoint_is_refused_unread(
    open_s3: Callable[..., CheckpointManager], client: Any, db: LedgerClient, name: str
) -> None:
    """Every object read whole into memory (``.metadata`` at the verify, a shard when
    DCP reads it) is read to at most one byte more than it may hold: one replaced by
    a far larger object (after the commit, or between the verify and the read) is
    refused without being held in memory."""
    mgr = open_s3()
    mgr.save(1, model=Sharded(sd(1.0)))
    second = mgr.save(2, model=Sharded(sd(2.0)))["model"]
    key = shard_key(second.path, name)
    huge = b"\0" * (8 * MiB)
    read: Counter[str] = Counter()
    gets: list[str] = []

    def count_the_reads(parsed: Any, model: Any, context: Any, **_: Any) -> None:
        got = context.get("input_params", {}).get("Key", "") if context else ""
        gets.append(got)
        if got == key and name == "__0_0.distcp" and gets.count(got) == 1:
            # verify's GET of the shard is done: now it is replaced before DCP's read
            client.delete_object(Bucket=s3lib.BUCKET, Key=key)
            client.put_object(Bucket=s3lib.BUCKET, Key=key, Body=huge)
        elif got == key:
            parsed["Body"] = _CountingBody(parsed["Body"], read, got)

    if name == ".metadata":
        client.put_object(Bucket=s3lib.BUCKET, Key=key, Body=huge)
    events = mgr._ctx.store.calls.client.meta.events  # type: ignore[attr-defined]
    events.register("before-parameter-build.s3.GetObject", _keep_params)
    events.register("after-call.s3.GetObject", count_the_reads)
    with pytest.raises(CorruptCheckpointError):
        mgr.load("latest", into=zeroed())
    assert second.size is not None and 0 < read[key] <= second.size + 1
    assert states(db) == {1: "committed", 2: "corrupt" if name == ".metadata" else "committed"}


def test_the_manifest_unpickler_takes_every_metadata_dcp_writes(tmp_path: Path) -> None:
    """The allow-list is wide enough for what DCP puts in ``.metadata``: every dtype
    class (float, bfloat16, bool, complex, int), a non-contiguous and a channels-last
    tensor, an optimizer's state and plain values, read back equal to DCP's own."""
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    state = {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "t": torch.arange(6).reshape(2, 3).t(),
        "c": torch.ones(1, 2, 2, 2).to(memory_format=torch.channels_last),
        "z": torch.zeros(3, dtype=torch.complex64),
        "b": torch.ones(2, dtype=torch.bool),
        "h": torch.ones(2, dtype=torch.float16),
        "epoch": 3,
        "names": ["a", "b"],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_save(state, checkpoint_id=tmp_path, no_dist=True)
    data = (tmp_path / ".metadata").read_bytes()
    got = s3dcp._MetadataUnpickler(io.BytesIO(data)).load()
    assert got.state_dict_metadata == pickle.loads(data).state_dict_metadata
    assert len(got.state_dict_metadata) > 10


@pytest.mark.timeout(60)
@pytest.mark.parametrize("listing", ["ListMultipartUploads", "ListObjectsV2"])
def test_a_truncated_listing_without_a_marker_fails_the_eviction_never_loops(
    open_s3: Callable[..., CheckpointManager],
    client: Any,
    s3_url: str,
    db: LedgerClient,
    listing: str,
) -> None:
    """A page that says it is truncated but names no marker to go on from cannot be
    followed: starting over would list the same page forever, and stopping would
    take part of the prefix for all of it (objects left behind a row marked deleted).
    The eviction fails instead (the row stays ``deleting``), and the next open,
    whose listings are whole, finishes it."""
    mgr = open_s3(streams={"model": Keep(last=1)})
    first = mgr.save(1, model=Sharded(sd(1.0)))["model"]
    events = mgr._ctx.store.calls.client.meta.events  # type: ignore[attr-defined]
    pages: list[str] = []

    def truncate(parsed: Any, context: Any, **_: Any) -> None:
        if context.get("input_params", {}).get("Prefix") != f"{shard_key(first.path, '')}":
            return  # only the eviction's listings of the first checkpoint's prefix
        pages.append(listing)
        parsed["IsTruncated"] = True
        for marker in ("NextKeyMarker", "NextUploadIdMarker", "NextContinuationToken"):
            parsed.pop(marker, None)

    events.register(f"before-parameter-build.s3.{listing}", _keep_params)
    events.register(f"after-call.s3.{listing}", truncate, unique_id="truncate")
    with pytest.warns(UserWarning, match="truncated"):
        mgr.save(2, model=Sharded(sd(2.0)))
    events.unregister(f"after-call.s3.{listing}", unique_id="truncate")
    assert pages == [listing]
    assert states(db) == {1: "deleting", 2: "committed"}
    assert names_under(client, first.path) == [".metadata", "__0_0.distcp"]
    mgr.close()
    again = open_s3(streams={"model": Keep(last=1)})
    assert again.last_reconcile.counts == {"deleted": 1}
    assert names_under(client, first.path) == []
