"""Shared fixtures: a run directory, a manager factory, small state dicts, ledger peeks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptdb import CheckpointManager, Keep, TopK


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def open_manager(root: Path) -> Iterator[Callable[..., CheckpointManager]]:
    """Open managers on ``root`` (or another directory); all are closed at teardown."""
    opened: list[CheckpointManager] = []

    def factory(path: Path | None = None, **kwargs: Any) -> CheckpointManager:
        mgr = CheckpointManager(path or root, **kwargs)
        opened.append(mgr)
        return mgr

    yield factory
    for mgr in opened:
        mgr.close()


@pytest.fixture
def streams() -> dict[str, Any]:
    return {"model": Keep(last=3), "ema": Keep(last=2), "best": TopK(2, "val_loss")}
