"""The scenarios on object storage: a run whose ``save_dir`` is a prefix of the real
S3-compatible server of the tests (SeaweedFS, ``tests/s3lib.py``).

The streams and the reference model are those of :mod:`.scenarios`. The
``model`` payload of each recorded boundary is just over one 5 MiB part
(S3's smallest), so it goes up as a multipart upload (create, two parts,
complete); ``ema`` and ``best`` are small, one ``PutObject`` each. History
is saved small, before the recording. The environment must name the server
(``CKPTDB_S3_ENDPOINT_URL`` and the credentials: the ``s3_env`` fixture).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import s3lib
import torch
from botocore.awsrequest import AWSResponse
from crashlib import STREAM_CODE, Boundary, ledger_rows, payload, policies

from ckptdb import CheckpointManager
from ckptdb.errors import PublishError
from ckptdb.storage import s3client

from .explorer import ReferenceCheck
from .objects import ObjectRecorder, store_problems
from .recording import Recorder
from .scenarios import Recorded, Run, Scenario, _paths

PART = s3client.MIN_PART_SIZE
#: Elements of a ``model`` tensor whose ``torch.save`` is just over one part.
MULTIPART_ELEMENTS = (PART + (64 << 10)) // 4


def payloads(big_from: int) -> Any:
    """The crash tests' payloads; ``model`` multipart from boundary ``big_from`` on."""

    def make(b: Boundary) -> dict[str, Any]:
        out = {s: payload(b, s) for s in STREAM_CODE}
        if b.index >= big_from:
            out["model"] = {
                "tag": torch.tensor([b.index, STREAM_CODE["model"], b.step]),
                "w": torch.full((MULTIPART_ELEMENTS,), float(b.index)),
            }
        return out

    return make


class FailingCompletions:
    """While armed, the store answers every CompleteMultipartUpload with a 500 (the
    request never reaches it): a completion whose outcome the client cannot know."""

    def __init__(self) -> None:
        self.armed = False

    def install(self, client: Any) -> None:
        client.meta.events.register("before-send.s3.CompleteMultipartUpload", self._send)

    def _send(self, request: Any, **_: Any) -> AWSResponse | None:
        if not self.armed:
            return None
        body = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
        headers = {"Content-Type": "application/xml", "Content-Length": str(len(body))}
        return AWSResponse(request.url, 500, headers, _Raw(body))


class _Raw:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.body


@contextlib.contextmanager
def client_hook(failing: FailingCompletions | None) -> Iterator[None]:
    previous = s3client.set_client_hook(None if failing is None else failing.install)
    try:
        yield
    finally:
        s3client.set_client_hook(previous)


def _options(failing: FailingCompletions | None) -> dict[str, Any]:
    """Parts of S3's smallest size; no retry where a failure is injected (botocore
    would retry a 500 with backoff, and the outcome is the same)."""
    return {"part_size": PART, **({"max_attempts": 1} if failing else {})}


def _recorded_s3(
    name: str,
    tmp: Path,
    run: Run,
    *,
    new: bool = False,
    fail: int | None = None,
) -> Recorded:
    """``run`` on a fresh prefix: history, then the recorded boundaries (``new``: the
    open recorded too). ``fail``: the boundary whose completions are answered 500."""
    url = s3lib.unique_prefix()
    world, root = _paths(tmp)
    failing = FailingCompletions() if fail is not None else None
    kwargs: dict[str, Any] = {"save_dir": url, "streams": policies()}
    kwargs["storage_options"] = _options(failing)
    with client_hook(failing):
        if new:
            with (
                Recorder(world, root, ObjectRecorder(url)) as rec,
                CheckpointManager(root, **kwargs) as mgr,
            ):
                _save_recorded(run, mgr, rec, failing, fail)
        else:
            with CheckpointManager(root, **kwargs) as mgr:
                run.save_history(mgr)
                with Recorder(world, root, ObjectRecorder(url)) as rec:
                    _save_recorded(run, mgr, rec, failing, fail)
    leftovers = store_problems(url, ledger_rows(root))
    return Recorded(name, rec.trace(), ReferenceCheck(run.ref), leftovers)


def _save_recorded(
    run: Run,
    mgr: CheckpointManager,
    rec: Recorder,
    failing: FailingCompletions | None,
    fail: int | None,
) -> None:
    """Like :meth:`Run.save_recorded`; the failing boundary is marked ``failed`` when
    its save raises (and acknowledged as usual if it does not: a mutation)."""
    for b in run.recorded:
        rec.mark({"begin": b.index})
        if failing is not None:
            failing.armed = b.index == fail
        try:
            out = run._save(mgr, b)
        except PublishError as exc:
            if b.index != fail:
                raise
            rec.mark({"failed": b.index, "phase": exc.phase})
            continue
        finally:
            if failing is not None:
                failing.armed = False
        rec.mark({"ack": b.index, "rows": {s: c.id for s, c in out.items()}})


# ------------------------------------------------------------------ the scenarios


def s3_new_run(tmp: Path, deep: bool) -> Recorded:
    """A run created inside the recording on a fresh prefix (its conditional-write
    probe included) and its first boundaries."""
    spec = [(10, 0.5)] + ([(20, 0.3), (30, 0.7)] if deep else [])
    return _recorded_s3("s3_new_run", tmp, Run(spec, 0, payloads(0)), new=True)


def s3_history(tmp: Path, deep: bool) -> Recorded:
    """A boundary that evicts from every stream: DeleteObject after the commit."""
    spec = [(10, 0.5), (20, 0.3), (30, 0.7), (40, 0.2), (50, 0.1)]
    spec += [(60, 0.6), (70, 0.05)] if deep else []
    return _recorded_s3("s3_history", tmp, Run(spec, 4, payloads(4)))


def s3_resave(tmp: Path, deep: bool) -> Recorded:
    """A step saved again: new keys (never reused), the old objects evicted."""
    spec = [(10, 0.5), (20, 0.6), (30, 0.2), (30, 0.1)]
    spec += [(20, 0.3)] if deep else []
    return _recorded_s3("s3_resave", tmp, Run(spec, 3, payloads(3)))


def s3_failed_complete(tmp: Path, deep: bool) -> Recorded:
    """A completion answered 500 (its outcome unknown to the client): the HEAD finds no
    object, the upload is aborted and the boundary rolled back; the next one publishes."""
    spec = [(10, 0.5), (20, 0.3), (30, 0.7)] + ([(40, 0.2)] if deep else [])
    return _recorded_s3("s3_failed_complete", tmp, Run(spec, 1, payloads(1)), fail=1)


S3_SCENARIOS = {
    s.name: s
    for s in (
        Scenario("s3_new_run", "model+ema+top-K on S3, a new run (the open included)", s3_new_run),
        Scenario("s3_history", "model+ema+top-K on S3 with history: evictions", s3_history),
        Scenario("s3_resave", "a re-save of the same step on S3", s3_resave),
        Scenario(
            "s3_failed_complete", "a completion answered 500 on S3, rolled back", s3_failed_complete
        ),
    )
}
