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

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import s3lib
import torch
from helpers import LedgerClient

from ckptdb import CheckpointManager, Keep, Sharded
from ckptdb.location import ObjectPath
from ckptdb.storage import s3client
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
def client(s3_env: s3lib.S3Server) -> Any:
    return s3_env.client()


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


def prefix_key(url: str) -> str:
    return url.split("/", 3)[3]


def names_under(client: Any, path: ObjectPath) -> list[str]:
    return [k.rsplit("/", 1)[1] for k in s3lib.keys_under(client, str(path))]


@pytest.mark.timeout(60)
def test_round_trip_on_object_storage(
    open_s3: Callable[..., CheckpointManager], client: Any, s3_url: str, tmp_path: Path
) -> None:
    mgr = open_s3()
    out = mgr.save(10, model=Sharded(sd(3.0)))["model"]
    token = mgr._ctx.store.run_token  # type: ignore[attr-defined]
    assert isinstance(out.path, ObjectPath)
    assert out.path.name == f"step-000000010.{token}.v{out.id}.dcp"
    assert names_under(client, out.path) == [".metadata", "__0_0.distcp"]
    target = zeroed()
    assert mgr.load("latest", into=target) is target
    assert_same(target, sd(3.0))
