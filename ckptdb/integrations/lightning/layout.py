"""Lightning's checkpoints on disk: the adopt layout, and the stream names the
ckptdb ``ModelCheckpoint`` gives them (one definition for the writer and the reader).

Imports nothing of Lightning: adopting a run must not need it installed.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from ...errors import InvalidArgumentError
from ...ledger.runs import ledger_beside
from ...policies import RESERVED_STREAM_NAMES
from ...protocol.adopt import Candidate
from ..layouts import Layout, kind_problem, mtime, number, register, torch_load, unreadable

__all__ = ["LAST_SUFFIX", "LIGHTNING_ALIAS", "LightningLayout", "stream_for_monitor"]

#: A callback's ``last`` checkpoints go to ``<main stream>.last``.
LAST_SUFFIX = ".last"
#: Lightning's ``last`` alias names (``last.ckpt``, ``last-v1.ckpt``).
LIGHTNING_ALIAS = re.compile(r"last(-v\d+)?\.ckpt")


def stream_for_monitor(monitor: str | None) -> str:
    """The top-k stream of a ``ModelCheckpoint`` monitoring ``monitor`` (without ``stream=``).

    The monitor's name made a valid stream name (56 characters at most, so
    its ``.last`` companion fits), ``by_<name>`` where that is a reserved
    name, ``checkpoints`` without a monitor.
    """
    if monitor is None:
        return "checkpoints"
    name = re.sub(r"[^A-Za-z0-9_.\-]", "_", monitor).strip(".")[:56] or "monitor"
    return f"by_{name}" if name in RESERVED_STREAM_NAMES else name


class _Ambiguous(Exception):
    pass


@register
class LightningLayout(Layout):
    """``*.ckpt`` files in a ``ModelCheckpoint`` dirpath; the ledger beside it.

    Step: ``global_step`` in the file. Stream: the monitor of the
    ``ModelCheckpoint`` whose state (inside the file) names it, as the ckptdb
    ``ModelCheckpoint`` names its streams; a ``last*.ckpt`` file goes to its
    ``<stream>.last`` stream; ``last.ckpt`` / ``last-vN.ckpt`` are alias names
    and never adopted. Metric: the file's score in that state's
    ``best_k_models`` (or ``current_score``), stored under the monitor's name.
    """

    name: ClassVar[str] = "lightning"
    summary: ClassVar[str] = (
        "a ModelCheckpoint dirpath; <parent>/.<name>.ckptdb beside it; the monitor's name "
        "(else 'checkpoints'), last*.ckpt in '<stream>.last'; last.ckpt is an alias, "
        "never adopted"
    )

    def ledger_root(self, root: Path) -> Path:
        if root.parent == root:
            raise InvalidArgumentError(f"dirpath {root} has no parent to hold its ledger")
        return ledger_beside(root)

    def scan(self, root: Path) -> list[Candidate]:
        return [
            self._read(entry)
            for entry in sorted(root.iterdir())
            if entry.name.endswith(".ckpt") and not entry.name.startswith(".")
        ]

    def _read(self, path: Path) -> Candidate:
        if LIGHTNING_ALIAS.fullmatch(path.name):
            return Candidate(
                path,
                problem="the 'last' alias name: the ckptdb ModelCheckpoint re-points it after "
                "every save, so it is never a checkpoint of its own (copy it to another name "
                "to adopt what it holds)",
            )
        problem = kind_problem(path, want_dir=False)
        if path.is_dir() and not path.is_symlink():
            problem = "a directory (sharded) checkpoint: the lightning layout reads single files"
        if problem is not None:
            return Candidate(path, problem=problem)
        try:
            ckpt = torch_load(path)
        except Exception as exc:
            return Candidate(path, problem=unreadable(exc))
        step = ckpt.get("global_step") if isinstance(ckpt, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            return Candidate(path, problem="not a Lightning checkpoint (no global_step)")
        try:
            state = _writer_of(_callback_states(ckpt), path.name)
        except _Ambiguous:
            return Candidate(
                path,
                step=step,
                problem="several ModelCheckpoint callbacks, none of which names this file",
            )
        monitor = state.get("monitor") if state is not None else None
        monitor = monitor if isinstance(monitor, str) and monitor else None
        stream = stream_for_monitor(monitor)
        metrics: dict[str, float] = {}
        if path.name.startswith("last"):
            stream += LAST_SUFFIX
        elif monitor is not None and state is not None:
            score = _score_in(state, path.name)
            if score is not None:
                # the ledger ranks by finite numbers: the integration stores +-inf as the
                # largest float of that sign (Lightning's score for a NaN monitor)
                metrics[monitor] = (
                    score
                    if math.isnan(score)
                    else max(min(score, sys.float_info.max), -sys.float_info.max)
                )
        return Candidate(path, stream, step, metrics, written_at=mtime(path))


def _callback_states(ckpt: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    callbacks = ckpt.get("callbacks")
    return [
        state
        for key, state in (callbacks if isinstance(callbacks, dict) else {}).items()
        if isinstance(key, str) and key.startswith("ModelCheckpoint") and isinstance(state, dict)
    ]


def _names_in(state: Mapping[str, Any]) -> set[str]:
    keys = [*(state.get("best_k_models") or {}), state.get("best_model_path")]
    keys.append(state.get("last_model_path"))
    return {Path(str(k)).name for k in keys if k}


def _writer_of(states: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any] | None:
    """The ModelCheckpoint state that wrote ``name``: the one naming it, or the only one."""
    naming = [s for s in states if name in _names_in(s)]
    if len(naming) == 1:
        return naming[0]
    if not naming and len(states) == 1:
        return states[0]
    if not states:
        return None
    raise _Ambiguous


def _score_in(state: Mapping[str, Any], name: str) -> float | None:
    for key, value in (state.get("best_k_models") or {}).items():
        if Path(str(key)).name == name:
            return number(value)
    if Path(str(state.get("best_model_path") or "")).name == name:
        return number(state.get("best_model_score"))
    return number(state.get("current_score"))
