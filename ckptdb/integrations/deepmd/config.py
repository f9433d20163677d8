"""What a DeePMD-kit training configuration means for the ledger: its streams, their
policies, the directories they are written to, and what is refused.

Shared by both PyTorch backends (``--pt`` and ``--pt-expt``), which read the
same ``training`` and ``validating`` sections. DeePMD-kit writes a run's
checkpoints in up to two directories: the periodic ones (and their EMA twins)
in ``training.save_dir`` (else beside ``save_ckpt``), the validation-best ones
in ``validating.save_best_dir`` (else beside ``save_ckpt``). The ledger names
every file relative to one save directory, so a run's save directory is the
nearest directory holding both (:func:`ledger_save_dir`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ...errors import InvalidArgumentError
from ...policies import Keep, Policy, TopK
from . import compat
from .layout import BEST_EMA_STREAM, BEST_STREAM, EMA_STREAM, STREAM

__all__ = [
    "aliases",
    "best_metric",
    "ledger_save_dir",
    "refuse_unsupported",
    "stream_directories",
    "streams",
]


def refuse_unsupported(config: dict[str, Any], root: Path) -> None:
    """What this integration does not guard yet is refused before anything is opened.

    Sharded training (``zero_stage`` above 0 on several ranks) assembles a
    checkpoint from every rank's shard inside DeePMD's own write, which a
    ckptdb boundary does not drive yet. A ``save_ckpt`` outside the working
    directory (``root``) would put DeePMD's aliases (``model.ckpt.pt``) where
    the ledger, which writes them after each commit, keeps no file of the run.
    """
    prefix = Path(config["training"].get("save_ckpt", "model.ckpt"))
    if not (root / prefix.parent).resolve().is_relative_to(root):
        raise InvalidArgumentError(
            f"training.save_ckpt ({prefix}) is outside the working directory ({root}): "
            "DeePMD writes its model.ckpt.pt alias there, which ckptdb re-points after each "
            "commit inside the run only; keep save_ckpt a name in the working directory "
            "and put the checkpoints elsewhere with training.save_dir"
        )
    dist = torch.distributed
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    stage = int(config["training"].get("zero_stage", 0) or 0)
    if several and stage > 0:
        raise InvalidArgumentError(
            f"ckptdb's DeePMD-kit integration does not support training.zero_stage={stage} "
            "(sharded optimizer or parameters) yet: train with zero_stage 0 (DDP)"
        )


def stream_directories(config: Mapping[str, Any], root: Path) -> dict[str, Path]:
    """Each stream of the run and the directory DeePMD-kit writes its files to."""
    params = config["training"]
    periodic = periodic_dir(params, root)
    found = {STREAM: periodic}
    if params.get("enable_ema"):
        found[EMA_STREAM] = periodic
    best = (root / best_dir(config)).resolve()
    for stream in _best_streams(config):
        found[stream] = best
    return found


def ledger_save_dir(directories: Mapping[str, Path], root: Path, stored: Path | None) -> Path:
    """The run's save directory: one directory holding every stream's.

    ``stored`` is the save directory the ledger already records for this run
    (None for a new one); it stays when it holds every stream's directory, so
    the names of the run's checkpoints keep meaning the same files. Otherwise it
    is the nearest directory holding them all: the periodic directory when the
    best one is inside it (wherever ``save_dir`` is), else their common
    directory, which must lie in the run's working directory (``root``): the
    common directory of ``/scratch/ckpts`` and the working directory could be
    ``/``, and the ledger would answer for files that are not the run's.
    """
    if stored is not None and all(d.is_relative_to(stored) for d in directories.values()):
        return stored
    periodic = directories[STREAM]
    common = Path(os.path.commonpath([os.fspath(d) for d in directories.values()]))
    if common != periodic and not common.is_relative_to(root):
        apart = ", ".join(f"{stream} in {d}" for stream, d in sorted(directories.items()))
        raise InvalidArgumentError(
            f"this run's checkpoints would be written to directories that share no directory "
            f"of the run ({apart}; the working directory is {root}): put "
            "validating.save_best_dir inside training.save_dir, or both under the working "
            "directory"
        )
    return common


def periodic_dir(params: Mapping[str, Any], root: Path) -> Path:
    """Where DeePMD writes ``model.ckpt-N.pt``: ``save_dir``, else the directory of
    ``save_ckpt`` (as DeePMD's ``build_checkpoint_stores``)."""
    save_dir = params.get("save_dir")
    where = Path(save_dir) if save_dir else Path(params.get("save_ckpt", "model.ckpt")).parent
    return (root / where).resolve()


def best_dir(config: Mapping[str, Any]) -> Path:
    """Where DeePMD writes best checkpoints (``save_best_dir``, else beside ``save_ckpt``;
    DeePMD's ``resolve_best_checkpoint_dir``), relative to the working directory."""
    validating = config.get("validating") or {}
    where = validating.get("save_best_dir")
    return Path(where) if where else Path(config["training"].get("save_ckpt", "model.ckpt")).parent


def best_metric(config: Mapping[str, Any]) -> str | None:
    """DeePMD's ``validation_metric`` (lower is better) when validation keeps best
    checkpoints (``full_validation`` or ``ema_full_validation`` with ``save_best``)."""
    validating = config.get("validating") or {}
    full = validating.get("full_validation") or (
        config["training"].get("enable_ema") and validating.get("ema_full_validation")
    )
    if not (full and validating.get("save_best", True)):
        return None
    return str(validating.get("validation_metric", "E:MAE"))


def _best_streams(config: Mapping[str, Any]) -> list[str]:
    if best_metric(config) is None:
        return []
    validating = config["validating"]
    found = [BEST_STREAM] if validating.get("full_validation") else []
    if config["training"].get("enable_ema") and validating.get("ema_full_validation"):
        found.append(BEST_EMA_STREAM)
    return found


def streams(config: dict[str, Any]) -> dict[str, Policy]:
    """``model``: DeePMD's ``max_ckpt_keep`` (or ``ckpt_keep_ratio``);
    ``model_ema``: its ``ema_ckpt_keep`` (default: the same), when EMA is on;
    ``best``/``best_ema``: top-``max_best_ckpt`` by the validation metric."""
    params = config["training"]
    keep = params.get("max_ckpt_keep", 5)
    ema_keep = params.get("ema_ckpt_keep")
    ema_keep = keep if ema_keep is None else ema_keep
    ratio = params.get("ckpt_keep_ratio")
    if ratio is not None:
        if params.get("numb_steps") is None:
            raise InvalidArgumentError(
                "training.ckpt_keep_ratio with num_epoch is not yet supported by ckptdb's "
                "DeePMD-kit integration: set max_ckpt_keep (or numb_steps)"
            )
        keep = ema_keep = compat.keep_count_from_ratio(
            ratio, int(params["numb_steps"]), int(params.get("save_freq", 1000))
        )
    found: dict[str, Policy] = {STREAM: Keep(last=_keep(keep))}
    if params.get("enable_ema"):
        found[EMA_STREAM] = Keep(last=_keep(ema_keep))
    metric = best_metric(config)
    if metric is not None:
        k = int(config["validating"].get("max_best_ckpt", 1))
        for stream in _best_streams(config):
            found[stream] = TopK(k, metric, "min")
    return found


def _keep(value: object) -> int | None:
    """DeePMD's keep count as the ledger's ``Keep(last=...)``: below one keeps all."""
    count = int(value)  # type: ignore[call-overload]  # DeePMD's argcheck made it an int
    return count if count >= 1 else None


def aliases(config: dict[str, Any]) -> dict[str, str]:
    """DeePMD's alias names (relative to the run root) and their streams."""
    prefix = str(config["training"].get("save_ckpt", "model.ckpt"))
    return {prefix + ".pt": STREAM, compat.ema_checkpoint_prefix(prefix) + ".pt": EMA_STREAM}
