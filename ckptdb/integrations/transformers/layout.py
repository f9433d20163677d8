"""The Hugging Face Trainer's checkpoints on disk: the adopt layout.

Imports nothing of transformers: adopting a run must not need it installed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import ClassVar

from ...protocol.adopt import Candidate
from ..layouts import Layout, kind_problem, mtime, number, numbered, register, tree_damage

__all__ = ["CHECKPOINT_PREFIX", "STREAM", "TRAINER_STATE_NAME", "TransformersLayout"]

#: The ledger stream that holds the Trainer's ``checkpoint-N`` directories.
STREAM = "checkpoints"
#: The Trainer's name for its checkpoint directories (``checkpoint-<step>``).
CHECKPOINT_PREFIX = "checkpoint"
#: The file the Trainer writes last into a checkpoint directory.
TRAINER_STATE_NAME = "trainer_state.json"


@register
class TransformersLayout(Layout):
    """``checkpoint-<N>/`` directories of a Hugging Face ``Trainer`` ``output_dir``.

    Complete: ``trainer_state.json`` (the Trainer writes it last) says
    ``global_step`` N; model weights are there (``model.safetensors``,
    ``pytorch_model.bin``, an adapter, or a sharded index with all its
    shards); every ``torch.save`` and safetensors file in it is whole.
    Metrics: the ``log_history`` entries at step N (``eval_loss``...).
    """

    name: ClassVar[str] = "transformers"
    summary: ClassVar[str] = "a Trainer output_dir with checkpoint-<N>/; ROOT; 'checkpoints'"
    PATTERN = re.compile(rf"{CHECKPOINT_PREFIX}-(\d+)")
    WEIGHTS = (
        "model.safetensors",
        "pytorch_model.bin",
        "adapter_model.safetensors",
        "adapter_model.bin",
    )
    INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

    def scan(self, root: Path) -> list[Candidate]:
        return numbered(root, self.PATTERN, self._read)

    def _read(self, path: Path, step: int) -> Candidate:
        problem = kind_problem(path, want_dir=True)
        if problem is not None:
            return Candidate(path, step=step, problem=problem)
        state_file = path / TRAINER_STATE_NAME
        if not state_file.is_file():
            return Candidate(
                path,
                step=step,
                problem="no trainer_state.json (the Trainer writes it last: an unfinished save)",
            )
        try:
            state = json.loads(state_file.read_text(encoding="utf-8"))
            if not isinstance(state, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            return Candidate(path, step=step, problem=f"trainer_state.json unreadable: {exc}")
        if state.get("global_step") != step:
            return Candidate(
                path,
                step=step,
                problem=f"trainer_state.json says global_step {state.get('global_step')!r}, "
                f"its name says {step}",
            )
        problem = self._weights_problem(path) or tree_damage(path)
        if problem is not None:
            return Candidate(path, step=step, problem=problem)
        metrics: dict[str, float] = {}
        for entry in state.get("log_history") or []:
            if isinstance(entry, dict) and entry.get("step") == step:
                for key, value in entry.items():
                    found = number(value)
                    if key != "step" and found is not None:
                        metrics[str(key)] = found
        return Candidate(path, STREAM, step, metrics, written_at=mtime(state_file))

    def _weights_problem(self, path: Path) -> str | None:
        if any((path / name).is_file() for name in self.WEIGHTS):
            return None
        for index in self.INDEXES:
            if (path / index).is_file():
                try:
                    shards = set(json.loads((path / index).read_text())["weight_map"].values())
                except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                    return f"{index} unreadable: {exc}"
                missing = sorted(str(s) for s in shards if not (path / str(s)).is_file())
                return f"model shards missing: {', '.join(missing)}" if missing else None
        return "no model weights (model.safetensors, pytorch_model.bin or a sharded index)"
