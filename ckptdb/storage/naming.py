"""How ckptdb names what it writes.

Checkpoint files live in ``<save_dir>/<stream>/`` and are named
``step-<step:09d>.pt`` (``step-<step:09d>.v<row id>.pt`` when that name is
taken by a live checkpoint); a temporary file is
``.step-<step:09d>.pt.tmp-<row id>`` in the same directory. A sharded
(``torch.distributed.checkpoint``) checkpoint is a directory named the same
way with the suffix ``.dcp`` instead of ``.pt``. Reconcile quarantines a file
in this naming that no row owns, and removes a temporary one.

On object storage (no rename) a payload is written under its final name,
``step-<step:09d>.<run token>.v<row id>.pt``: the run token (:func:`run_token`)
makes it the run's own, the row id the row's. Should that name exist all the
same (a row id reused after an intent that never reached the disk), a random
``-<8 hex>`` follows the row id. Only names with the run's token, and those
written before tokens (``step-<step:09d>.v<row id>.pt``), are the run's. A
sharded payload there is a key prefix named the same way with ``.dcp``, its
files the objects under it (``<name>.dcp/.metadata``, ``<name>.dcp/__0_0.distcp``).
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import xxhash

# Our names always carry at least 9 step digits; a user's "step-1.pt" is not ours.
CHECKPOINT_NAME = re.compile(r"step-(\d{9,})(?:\.v(\d+))?\.(?:pt|dcp)")
TEMP_NAME = re.compile(r"\.step-\d{9,}(?:\.v\d+)?\.(?:pt|dcp)\.tmp-(\d+)")
SHARDED_SUFFIX = ".dcp"
TOKEN_LENGTH = 10
# An object-store name: step, run token, row id, and a salt when the plain name was taken.
OBJECT_NAME = re.compile(r"step-(\d{9,})\.([0-9a-f]{10})\.v(\d+)(?:-[0-9a-f]{8})?\.(?:pt|dcp)")


def object_name(step: int, token: str, row_id: int, suffix: str, salt: str = "") -> str:
    """The name of a payload on a store without rename (see the module docstring)."""
    return f"step-{step:09d}.{token}.v{row_id}{'-' + salt if salt else ''}{suffix}"


def checkpoint_name(step: int, version: int | None = None, *, suffix: str = ".pt") -> str:
    """The final name of a checkpoint; ``suffix`` is its payload kind's."""
    return f"step-{step:09d}{suffix}" if version is None else f"step-{step:09d}.v{version}{suffix}"


def run_token(name: str, run_id: int, created_at: dt.datetime) -> str:
    """A short token unique to one run, from what its ledger keeps (no schema change):
    put in the names of a store without rename, so that two ledgers writing under
    one prefix (or one run that reuses a row id) never name the same object, and a
    reconcile can tell its run's objects from everyone else's. Stable across
    reopens and moves of the run directory (the root is not part of it)."""
    stamp = created_at.astimezone(dt.timezone.utc).replace(tzinfo=None).isoformat()
    return xxhash.xxh3_64_hexdigest(f"{name}\0{run_id}\0{stamp}".encode())[:TOKEN_LENGTH]


def is_sharded(path: str | Path) -> bool:
    """Whether a checkpoint path (by our naming) is a sharded directory checkpoint."""
    return str(path).endswith(SHARDED_SUFFIX)


def temp_name(final_name: str, row_id: int) -> str:
    return f".{final_name}.tmp-{row_id}"


def is_own_name(rel: str | Path) -> bool:
    """Whether a stored path is in ckptdb's own naming (not a framework's name)."""
    return CHECKPOINT_NAME.fullmatch(Path(rel).name) is not None
