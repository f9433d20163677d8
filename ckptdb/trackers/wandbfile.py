"""What an offline W&B run logged, read back from its transaction log.

An offline run has no server to ask what it holds; its ``run-<id>.wandb``
file is the record of everything it logged. The file is a LevelDB-style
log (a 7-byte ``:W&B`` header, then 32 KiB blocks of records, each with a
7-byte header: CRC, length, fragment type) of ``wandb`` protocol-buffer
``Record`` messages. A follower restarted in offline mode reads the files of
the earlier offline runs of its run id for two things: the last metric point
it logged (each history row it writes carries ``ckptdb/metric_id``) and the
checkpoints it logged as artifacts.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
MAGIC = b":W&B"
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
#: The history key each row carries: the id of the last ledger point in the row.
METRIC_ID = "ckptdb/metric_id"


def raw_records(path: Path) -> Iterator[bytes]:
    """Each record's bytes, fragments joined; a torn tail (a killed writer) ends it."""
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        return
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        if len(chunk) < length:
            return
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""


@dataclass
class Logged:
    """What earlier offline runs of one run id logged."""

    last_metric_id: int = 0
    #: ckptdb checkpoint id -> the artifact's aliases, each time it was logged
    checkpoints: dict[int, list[list[str]]] = field(default_factory=dict)


def logged_offline(directory: Path, run_id: str) -> Logged:
    """Read every offline run of ``run_id`` under ``directory`` (W&B's ``dir``)."""
    from wandb.proto import wandb_internal_pb2

    found = Logged()
    paths = sorted(directory.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    _settled(paths)
    for path in paths:
        for raw in raw_records(path):
            record: Any = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                for item in record.history.item:
                    if (item.key or "/".join(item.nested_key)) == METRIC_ID:
                        found.last_metric_id = max(
                            found.last_metric_id, int(json.loads(item.value_json))
                        )
            elif kind == "artifact" and record.artifact.metadata:
                ident = json.loads(record.artifact.metadata).get("ckptdb_id")
                if ident is not None:
                    found.checkpoints.setdefault(int(ident), []).append(
                        list(record.artifact.aliases)
                    )
    return found


#: How long to wait for an earlier run's log to stop growing (seconds), and how often to look.
SETTLE_TIMEOUT, SETTLE_POLL = 30.0, 0.5


def _settled(paths: list[Path]) -> None:
    """Wait until the logs stop growing: W&B's own writer (``wandb-core``, a process of
    its own) may still be writing a log its follower handed it before it died or
    returned, and what is read here decides what is logged again."""
    if not paths:
        return
    deadline = time.monotonic() + SETTLE_TIMEOUT
    sizes = [_size(p) for p in paths]
    while time.monotonic() < deadline:
        time.sleep(SETTLE_POLL)
        now = [_size(p) for p in paths]
        if now == sizes:
            return
        sizes = now


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1
