"""Accelerate's checkpoints on disk: the adopt layout, and where the ckptdb
``Checkpoints`` keeps them (one definition for the writer and the reader).

Imports nothing of Accelerate: adopting a run must not need it installed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

from ...protocol.adopt import Candidate
from ..layouts import Layout, kind_problem, mtime, numbered, register, tree_damage

__all__ = ["STREAM", "AccelerateLayout", "checkpoint_name"]

#: The one ledger stream; also the save directory's name under the root.
STREAM = "checkpoints"


def checkpoint_name(step: int) -> str:
    """Accelerate's automatic name for a save, with the training step as its number."""
    return f"checkpoint_{step}"


@register
class AccelerateLayout(Layout):
    """``checkpoints/checkpoint_<N>/`` of an Accelerate ``project_dir`` (automatic naming).

    Step: N from the name (Accelerate's automatic naming counts saves; the ckptdb
    integration's ``checkpoint_<step>[-v<n>]`` names carry the training step). Complete: what
    ``Accelerator.save_state`` writes: the model (``model.safetensors``,
    ``pytorch_model.bin``, or FSDP's ``pytorch_model_fsdp_0``), the optimizer
    (``optimizer.bin``, or FSDP's ``optimizer_0``) and the random states of
    every process (``random_states_<i>.pkl``, i = 0.., written last), every
    file whole.
    """

    name: ClassVar[str] = "accelerate"
    summary: ClassVar[str] = "a project_dir with checkpoints/checkpoint_<N>/; ROOT; 'checkpoints'"
    PATTERN = re.compile(r"checkpoint_(\d+)(?:-v\d+)?")
    RANDOM_STATES = re.compile(r"random_states_(\d+)\.pkl")

    def save_dir(self, root: Path) -> Path:
        return root / STREAM

    def scan(self, root: Path) -> list[Candidate]:
        directory = self.save_dir(root)
        if not directory.is_dir():
            return []
        return numbered(directory, self.PATTERN, self._read)

    def _read(self, path: Path, step: int) -> Candidate:
        problem = kind_problem(path, want_dir=True) or self._missing(path) or tree_damage(path)
        if problem is not None:
            return Candidate(path, step=step, problem=problem)
        return Candidate(path, STREAM, step, written_at=mtime(path))

    def _missing(self, path: Path) -> str | None:
        names = {p.name for p in path.iterdir()}
        model = names & {"model.safetensors", "pytorch_model.bin"} or {
            n for n in names if n.startswith("pytorch_model_fsdp_0")
        }
        if not model:
            return "no model weights (model.safetensors or pytorch_model.bin)"
        if not ("optimizer.bin" in names or any(n.startswith("optimizer_0") for n in names)):
            return "no optimizer.bin"
        ranks = sorted(int(m.group(1)) for n in names if (m := self.RANDOM_STATES.fullmatch(n)))
        if not ranks:
            return "no random_states_0.pkl (save_state writes it last: an unfinished save)"
        if ranks != list(range(len(ranks))):
            return f"random states of some processes missing (found {ranks})"
        return None
