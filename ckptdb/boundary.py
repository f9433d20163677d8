"""The pieces of one boundary shared by the manager's modules: input
validation, a stream's pending share, the distributed plan, and how a failure
inside a boundary is described."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sqlalchemy.exc import SQLAlchemyError

from .errors import ArgumentTypeError, InvalidArgumentError, LedgerError
from .sharded import Sharded
from .storage import FileInfo, PhaseError


@dataclass
class Pending:
    """One stream's share of a boundary between intent and commit."""

    stream: str
    payload: Any
    row_id: int
    final: Path
    tmp: Path
    metric: float | None
    info: FileInfo | None = None

    @property
    def sharded(self) -> bool:
        return isinstance(self.payload, Sharded)


@dataclass(frozen=True)
class PlanItem:
    """One admitted stream of a distributed boundary, as the chief recorded it."""

    stream: str
    tmp: str  # relative to save_dir
    sharded: bool


def validate_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise ArgumentTypeError(f"step must be a non-negative int, got {step!r}")
    if step < 0:
        raise InvalidArgumentError(f"step must be >= 0, got {step}")
    return step


def validate_metrics(metrics: object) -> dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ArgumentTypeError(f"metrics must be a dict name -> number, got {metrics!r}")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise ArgumentTypeError(f"metric names must be non-empty str, got {name!r}")
        out[name] = _real(name, value)
    return out


def _real(name: str, value: object) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"metric {name!r} must be a real number, got {value!r}")
    return float(value)


class PhaseFailure(Exception):
    """Internal: an unexpected error in a phase that has no file path (commit, snapshot)."""

    def __init__(self, phase: str, error: BaseException) -> None:
        super().__init__(str(error))
        self.phase = phase
        self.error = error


def describe(exc: BaseException) -> tuple[str, Path | None, BaseException]:
    """(phase, path, underlying error) of a failure inside a boundary."""
    if isinstance(exc, PhaseFailure):
        return exc.phase, None, exc.error
    if isinstance(exc, PhaseError):
        return exc.phase, exc.path, exc.error
    if isinstance(exc, (SQLAlchemyError, LedgerError)):
        return "commit", None, exc
    return "write", None, exc
