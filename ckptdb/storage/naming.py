"""How ckptdb names what it writes.

Checkpoint files live in ``<save_dir>/<stream>/`` and are named
``step-<step:09d>.pt`` (``step-<step:09d>.v<row id>.pt`` when that name is
taken by a live checkpoint); a temporary file is
``.step-<step:09d>.pt.tmp-<row id>`` in the same directory. A sharded
(``torch.distributed.checkpoint``) checkpoint is a directory named the same
way with the suffix ``.dcp`` instead of ``.pt``. Reconcile quarantines a file
in this naming that no row owns, and removes a temporary one.
"""

from __future__ import annotations

import re
from pathlib import Path

# Our names always carry at least 9 step digits; a user's "step-1.pt" is not ours.
CHECKPOINT_NAME = re.compile(r"step-(\d{9,})(?:\.v(\d+))?\.(?:pt|dcp)")
TEMP_NAME = re.compile(r"\.step-\d{9,}(?:\.v\d+)?\.(?:pt|dcp)\.tmp-(\d+)")
SHARDED_SUFFIX = ".dcp"


def checkpoint_name(step: int, version: int | None = None, *, suffix: str = ".pt") -> str:
    """The final name of a checkpoint; ``suffix`` is its payload kind's."""
    return f"step-{step:09d}{suffix}" if version is None else f"step-{step:09d}.v{version}{suffix}"


def is_sharded(path: str | Path) -> bool:
    """Whether a checkpoint path (by our naming) is a sharded directory checkpoint."""
    return str(path).endswith(SHARDED_SUFFIX)


def temp_name(final_name: str, row_id: int) -> str:
    return f".{final_name}.tmp-{row_id}"


def is_own_name(rel: str | Path) -> bool:
    """Whether a stored path is in ckptdb's own naming (not a framework's name)."""
    return CHECKPOINT_NAME.fullmatch(Path(rel).name) is not None
