"""Output formatting for the ckptdb command: aligned tables, CSV, JSON.

Outside the CLI package so that the quick read (:mod:`ckptdb.quickread`) prints
with the very functions the full command uses, without importing click.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .record import Checkpoint


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dt.datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    return str(value)


def human_size(size: int) -> str:
    """``size`` bytes for people: 512 B, 3.1 MiB, 12.4 GiB."""
    if size < 1024:
        return f"{size} B"
    value = size / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned."""
    text_rows = [[cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text_rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    numeric = [
        all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) and bool(rows)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(list(headers)), *(line(r) for r in text_rows)])


def jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    return value


def to_json(data: Any) -> str:
    return json.dumps(data, default=jsonable, indent=2)


def to_csv(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(headers)
    writer.writerows(rows)
    return buffer.getvalue().rstrip("\n")


CHECKPOINT_COLUMNS = (
    "stream",
    "step",
    "state",
    "metric",
    "size",
    "ranks",
    "committed_at",
    "path",
)


def checkpoint_row(ckpt: Checkpoint) -> list[Any]:
    return [
        ckpt.stream,
        ckpt.step,
        ckpt.state,
        ckpt.metric,
        ckpt.size,
        ckpt.world_size,
        ckpt.committed_at,
        str(ckpt.path),
    ]


def checkpoint_dict(ckpt: Checkpoint) -> dict[str, Any]:
    return {
        "stream": ckpt.stream,
        "step": ckpt.step,
        "state": ckpt.state,
        "path": str(ckpt.path),
        "size": ckpt.size,
        "hash": ckpt.hash,
        "metric": ckpt.metric,
        "committed_at": jsonable(ckpt.committed_at),
        "metrics": ckpt.metrics,
        "world_size": ckpt.world_size,
    }
