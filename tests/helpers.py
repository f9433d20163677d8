"""Small helpers shared by the tests (importable as ``helpers``)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import torch


def state(value: float, n: int = 4) -> dict[str, torch.Tensor]:
    return {"w": torch.full((n,), float(value)), "b": torch.tensor([float(value)])}


def rows(root: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Query the run's SQLite ledger directly, as any SQL client would."""
    con = sqlite3.connect(root / "ckptdb.sqlite")
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def files(directory: Path) -> list[str]:
    """Every file under ``directory``, relative, sorted (symlinks included)."""
    if not directory.exists():
        return []
    return sorted(
        str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() or p.is_symlink()
    )
