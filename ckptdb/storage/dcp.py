"""Sharded payloads: ``torch.distributed.checkpoint`` (DCP) behind the ledger.

A :class:`Sharded` payload is written by every rank into one temporary
directory with DCP (each rank its own shard files, the coordinator the
``.metadata``), then placed and committed by the chief like a file checkpoint.
DCP runs its own collectives and its own agreement: an exception on any rank
inside ``dcp.save``/``dcp.load`` is raised on every rank as a
``CheckpointException``, which is why these calls are safe inside the fixed
collective sequence of :mod:`ckptdb.coord.dist`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from .. import faults
from ..errors import ArgumentTypeError, PhaseError


@dataclass(frozen=True)
class Sharded:
    """Marks a state dict to be saved with ``torch.distributed.checkpoint``.

    ``mgr.save(step, model=ckptdb.Sharded(model.state_dict()))``: every rank
    passes its own (possibly sharded, e.g. DTensor/FSDP) state dict and writes
    its own shards into one directory checkpoint (``.dcp``); the boundary commits
    only when every rank's shards are written. Load it back in place with
    ``mgr.load(..., into=state_dict)``, on the same or another number of ranks
    (see docs/distributed.md). A top-level ``Stateful`` value (DCP's app-state
    pattern) is replaced by its state dict before the write.

    Attributes:
        state_dict: This rank's state dict, a dict.

    Raises:
        ArgumentTypeError: ``state_dict`` is not a dict.
    """

    state_dict: dict[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.state_dict, dict):
            raise ArgumentTypeError(
                f"Sharded() takes a state dict (a dict), got {type(self.state_dict).__name__}"
            )

    def resolved(self) -> Sharded:
        """The payload with each ``Stateful`` value replaced by its state dict.

        DCP would call those ``state_dict()`` inside ``save`` before its first
        collective, where a failure on one rank is not agreed on; the manager
        calls this in its preflight instead, so such a failure is bad input that
        every rank reports.

        Returns:
            A new :class:`Sharded` whose top-level ``Stateful`` values are their
                state dicts (other values as they are).
        """
        return Sharded(resolve_stateful(self.state_dict))


def resolve_stateful(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Replace each top-level ``Stateful`` value (DCP's app-state pattern) by its state dict.

    For a load target the objects are only asked for their state dict (DCP
    asks again and calls ``load_state_dict`` afterwards); the dict is returned.
    """
    return {
        k: v.state_dict() if isinstance(v, Stateful) and not isinstance(v, dict) else v
        for k, v in state_dict.items()
    }


class _FaultPointWriter(FileSystemWriter):
    """DCP's file writer with a fault point inside DCP's protected write step."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        faults.point("mid_shard_write")
        return super().write_data(plan, planner)


def file_writer(directory: Path) -> FileSystemWriter:
    """DCP's writer into a local directory, fsyncing every file it writes."""
    return _FaultPointWriter(directory, sync_files=True)


def file_reader(directory: Path) -> FileSystemReader:
    return FileSystemReader(directory)


def write_sharded(state_dict: dict[str, Any], writer: Any, group: Any) -> None:
    """Every rank writes its shards of ``state_dict`` through DCP's ``writer``.

    Under torch.distributed a failure on any rank raises DCP's
    ``CheckpointException`` (a BaseException naming the failing ranks) on
    every rank; in a single process it becomes ``PhaseError("write")``.
    """
    where = getattr(writer, "path", "")
    directory = where if isinstance(where, Path) else Path(str(where))  # an ObjectPath stays one
    try:
        with _single_process_is_intended(group):
            dcp_save(state_dict, storage_writer=writer, process_group=group, no_dist=group is None)
    except CheckpointException as exc:
        if group is not None:
            raise
        raise PhaseError("write", directory, _only_failure(exc)) from exc


def load_sharded(into: dict[str, Any], reader: Any, group: Any, planner: Any = None) -> None:
    """Every rank loads its part of the checkpoint behind ``reader`` into ``into``, in place
    (``planner``: DCP's load planner, None for its default).

    In a single process DCP's wrapper is removed: the caller gets the error
    itself (a shape mismatch, say), as ``torch.load`` would raise it.
    """
    try:
        with _single_process_is_intended(group):
            dcp_load(
                into,
                storage_reader=reader,
                process_group=group,
                no_dist=group is None,
                planner=planner,
            )
    except CheckpointException as exc:
        if group is not None:
            raise
        raise _only_failure(exc) from exc


def _only_failure(exc: CheckpointException) -> BaseException:
    """The one rank's error inside a single-process ``CheckpointException``."""
    failures = list(exc.failures.values())
    if len(failures) == 1 and isinstance(failures[0][0], BaseException):
        return failures[0][0]
    return RuntimeError(str(exc))


@contextlib.contextmanager
def _single_process_is_intended(group: Any) -> Iterator[None]:
    """DCP warns that it "assumes" a single process without torch.distributed; here
    that is the manager's decision (no process group), not a guess."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


__all__ = ["Sharded", "file_reader", "file_writer", "load_sharded", "write_sharded"]
