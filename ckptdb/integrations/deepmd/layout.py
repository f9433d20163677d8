"""DeePMD-kit's checkpoints on disk (PyTorch backend): the adopt layout.

Imports nothing of DeePMD-kit: adopting a run must not need it installed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

from ...protocol.adopt import Candidate
from ...record import LINK, SYMLINK, DerivedAlias
from ...record import POINTER as POINTER_KIND
from ..layouts import (
    Layout,
    kind_problem,
    mtime,
    number,
    numbered,
    register,
    torch_load,
    unreadable,
)

__all__ = [
    "ALIAS",
    "BEST_EMA_STREAM",
    "BEST_STREAM",
    "EMA_STREAM",
    "POINTER",
    "STREAM",
    "DeepmdLayout",
]

#: The stream of DeePMD's ``model.ckpt-<N>.pt`` checkpoints.
STREAM = "model"
#: The stream of its EMA checkpoints, ``model_ema.ckpt-<N>.pt`` (``enable_ema``).
EMA_STREAM = "model_ema"
#: The top-K streams of its validation-best checkpoints (``validating.save_best``).
BEST_STREAM = "best"
BEST_EMA_STREAM = "best_ema"
#: DeePMD's alias of the newest checkpoint, and its pointer file.
ALIAS = "model.ckpt.pt"
POINTER = "checkpoint"


@register
class DeepmdLayout(Layout):
    """DeePMD-kit (PyTorch backend): ``model.ckpt-<N>.pt`` files in the training directory.

    A file is ``torch.save({"model": state_dict, "optimizer": ...})``; its
    ``model["_extra_state"]["train_infos"]["step"]`` must be N or N - 1
    (DeePMD stores the index of the step it had just done), and the step
    recorded is N, the one in the name that DeePMD's ``checkpoint`` file
    names. After the commit, the ``model.ckpt.pt`` alias (a symlink stays a
    symlink) and the ``checkpoint`` pointer name the newest committed one.
    """

    name: ClassVar[str] = "deepmd"
    summary: ClassVar[str] = (
        "a directory with model.ckpt-<N>.pt; ROOT; 'model'; then model.ckpt.pt and "
        "'checkpoint' name the newest committed one"
    )
    alias_stream: ClassVar[str | None] = STREAM
    PATTERN = re.compile(r"model\.ckpt-(\d+)\.pt")
    ALIAS = ALIAS
    POINTER = POINTER

    def scan(self, root: Path) -> list[Candidate]:
        return numbered(root, self.PATTERN, self._read)

    def _read(self, path: Path, step: int) -> Candidate:
        problem = kind_problem(path, want_dir=False)
        if problem is not None:
            return Candidate(path, step=step, problem=problem)
        try:
            ckpt = torch_load(path)
        except Exception as exc:
            return Candidate(path, step=step, problem=unreadable(exc))
        infos = _dig(ckpt, "model", "_extra_state", "train_infos")
        stored = infos.get("step") if isinstance(infos, dict) else None
        if not isinstance(stored, int) or isinstance(stored, bool):
            return Candidate(
                path,
                step=step,
                problem="not a DeePMD checkpoint (no model._extra_state.train_infos.step)",
            )
        if stored not in (step, step - 1):
            return Candidate(
                path,
                step=step,
                problem=f"the step stored in it ({stored}) does not match its name (step {step})",
            )
        assert isinstance(infos, dict)
        lr = number(infos.get("lr"))
        metrics = {"lr": lr} if lr is not None else {}
        return Candidate(path, STREAM, step, metrics, written_at=mtime(path))

    def aliases(self, root: Path) -> list[DerivedAlias]:
        """``model.ckpt.pt`` (a symlink, as DeePMD makes it; a regular file there, a copy
        or hard link where symlinks are not possible, stays one) and ``checkpoint``."""
        alias = root / self.ALIAS
        kind = LINK if alias.is_file() and not alias.is_symlink() else SYMLINK
        return [
            DerivedAlias(self.ALIAS, STREAM, kind),
            DerivedAlias(self.POINTER, STREAM, POINTER_KIND),
        ]


def _dig(value: Any, *keys: str) -> Any:
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value
