"""What every framework integration does the same way, written once.

An integration hands a framework's own writer to the ledger: the writer
fills a temporary path (an :class:`~ckptdb.External` payload), ckptdb
commits it as one boundary. Around that boundary each framework needs the
same small decisions, and they must not drift apart between frameworks:

- its extra arguments (``guard``, ``ledger``, ``db_url``, ``stream``) are
  checked the same way, with the same errors (:func:`check_guard`,
  :func:`check_path`, :func:`check_db_url`, :func:`check_stream`);
- resuming before a process group exists takes the newest committed
  checkpoint that is still whole, read-only (:func:`newest_whole_read_only`);
- a step the GradScaler skipped changed no weights and does not trip the
  guard (:func:`skipped_by_scaler`);
- a non-finite value of a ranking metric follows one policy
  (:func:`rankable_metrics`, documented there).

What an integration does with an open run (a boundary, the resume source,
free names, protection, rank agreement) is the contract's
(:mod:`ckptdb.integrations.contract`): no integration runs collectives of
its own. Nothing here imports a framework, so it is importable (and
testable) without any of them.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor

from ..errors import ArgumentTypeError, InvalidArgumentError, UnsupportedVersionError
from ..ledger.engine import LEDGER_FILE
from ..ledgercopy import replica_for
from ..location import check_remote_url
from ..manager import refuse_object_root
from ..policies import Policy, TopK, validate_stream_name
from ..reader import RunReader, ledger_url, run_exists
from ..record import Checkpoint
from ..storage import open_store

GuardSetting: TypeAlias = bool | Literal["raise"]

#: The longest stream name the ledger stores.
STREAM_NAME_LIMIT = 64


def release_of(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string (``"2.6.0rc1"`` is ``(2, 6)``), else None."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match is not None else None


def check_release(
    found: str,
    tested: tuple[tuple[int, int], tuple[int, int]],
    *,
    framework: str,
    integration: str,
    extra: str,
) -> str:
    """``found``, or :class:`~ckptdb.errors.UnsupportedVersionError` (one line, the range
    named) when it is outside ``tested``: the oldest release supported and the first one
    that is not. An integration that overrides a framework's private methods refuses
    the releases it was not checked against rather than run with them unguarded."""
    oldest, first_unsupported = tested
    release = release_of(found)
    if release is None or not oldest <= release < first_unsupported:
        low, high = (".".join(map(str, r)).removesuffix(".0") for r in tested)
        raise UnsupportedVersionError(
            f"{integration} supports {framework} >={low},<{high}; this is {framework} "
            f"{found}: pip install 'ckptdb[{extra}]'"
        )
    return found


def framework_missing(module: str, framework: str, extra: str) -> ImportError:
    """The error an integration raises at import when its framework is not installed."""
    return ImportError(f"{module} needs {framework}: pip install 'ckptdb[{extra}]'")


# ------------------------------------------------------------------- arguments


def check_guard(guard: object) -> GuardSetting:
    """``guard=``: True (warn and go on), ``"raise"`` (stop training) or False
    (compared by equality, so ``1`` and ``0`` count as True and False)."""
    if guard in (True, False, "raise"):
        return guard
    raise InvalidArgumentError(f"guard must be True, False or 'raise', got {guard!r}")


def check_path(value: object, what: str) -> str | None:
    """``ledger=``/``root=``: a path (or None), as a string."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ArgumentTypeError(f"{what} must be a path, got {value!r}")
    return os.fspath(value)


def check_local_root(value: object, what: str) -> None:
    """A run root holds the ledger and the writer lock, so an ``s3://`` URL is refused,
    saying what to do (it would silently become a local ``./s3:/...`` tree)."""
    refuse_object_root(value, what)


def check_db_url(db_url: object) -> str | None:
    """``db_url=``: a SQLAlchemy URL string (or None: SQLite in the run root)."""
    if db_url is not None and not isinstance(db_url, str):
        raise ArgumentTypeError(f"db_url must be a str, got a {type(db_url).__name__}")
    return db_url


def check_remote(remote: object) -> str | None:
    """``remote=``: where a replicator copies the run (an object-storage URL), or None;
    checked when the integration is made, not at its first checkpoint."""
    check_remote_url(remote)
    return remote if isinstance(remote, str) else None


def check_stream(stream: object, *, suffix: str = "") -> str | None:
    """``stream=``: a valid stream name (or None), with room for ``suffix`` (the
    name of a companion stream the integration derives from it)."""
    if stream is None:
        return None
    name = validate_stream_name(stream)
    if len(name) > STREAM_NAME_LIMIT - len(suffix):
        raise InvalidArgumentError(
            f"stream {name!r} is too long: its '{suffix}' stream must fit in "
            f"{STREAM_NAME_LIMIT} characters"
        )
    return name


# -------------------------------------------------------------------- resuming


def run_recorded(root: Path, db_url: str | None) -> bool:
    """Whether the ledger records a run rooted at ``root`` (creates nothing)."""
    if db_url is None and not (root / LEDGER_FILE).exists():
        return False
    return run_exists(root, ledger_url(root, db_url, readonly=True))


def ledger_copied(
    root: Path, db_url: str | None, remote: str | None, options: Mapping[str, object] | None
) -> bool:
    """Whether a lost machine's SQLite ledger waits under ``remote`` for ``root`` (an open
    with ``remote=`` brings it back first: :mod:`ckptdb.ledgercopy`); creates nothing."""
    if db_url is not None or remote is None or (root / LEDGER_FILE).exists():
        return False
    return replica_for(remote, options, root.resolve()) is not None


def newest_whole_read_only(
    root: str | os.PathLike[str], *, db_url: str | None, log: logging.Logger
) -> Checkpoint | None:
    """The newest committed checkpoint of any stream whose payload is whole (size and hash).

    Read-only: it never takes the writer lock nor marks anything, so every
    rank may ask before a process group exists. A bad one is skipped with a
    warning and left as it is (a writer's verified load, or ``reconcile
    --verify``, marks it).
    """
    root = Path(root).resolve()
    if not run_recorded(root, db_url):
        return None  # a first run: nothing to resume from
    with RunReader(root, db_url=db_url) as reader:
        save_dir = reader.save_dir
        # a reader writes nothing: an object store is not probed (no test objects)
        found, store = reader.checkpoints(), open_store(save_dir, probe=False)
    for record in sorted(found, key=lambda c: (c.committed_at, c.id), reverse=True):
        rel = os.path.relpath(record.path, save_dir)
        finding = store.verify(rel, record.size, record.hash, full=True)  # the one sorter
        if finding is None:
            return record
        log.warning("not resuming from %s: %s", record.path, finding.detail)
    return None


# ----------------------------------------------------------------------- guard


def optimizer_params(optimizer: Any) -> list[Tensor]:
    """Every parameter an optimizer step updates (the gradients the guard sees)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def skipped_by_scaler(scaler: Any, optimizer: Any = None) -> Tensor | None:
    """A boolean tensor: the GradScaler found inf/NaN and will skip this step.

    ``optimizer``: only that optimizer's flags (None: every optimizer the
    scaler unscaled). None when there is no scaler or it checked nothing, so
    the guard judges the gradients themselves. No host sync: the flags stay
    on their device.
    """
    if scaler is None:
        return None
    states = getattr(scaler, "_per_optimizer_states", {})
    chosen = [states.get(id(optimizer))] if optimizer is not None else list(states.values())
    flags = [f for s in chosen if s for f in (s.get("found_inf_per_device") or {}).values()]
    if not flags:
        return None
    return torch.stack([f.to(flags[0].device) for f in flags]).sum() > 0


# --------------------------------------------------------------------- metrics


def scalars(values: Mapping[str, Any], *, tensors: bool = True) -> Iterator[tuple[str, float]]:
    """The real-valued entries of a framework's metrics: ints and floats, and with
    ``tensors`` one-element real tensors (strings, lists, bools and the rest left out).

    ``tensors=False`` where a framework's values are plain numbers and reading
    a tensor would cost a host sync per logged step (the Hugging Face Trainer's
    logs).
    """
    for name, value in values.items():
        if isinstance(value, Tensor):
            if tensors and value.numel() == 1 and not value.is_complex():
                yield str(name), float(value.item())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield str(name), float(value)


def _real(value: object) -> float | None:
    """A ranking metric's value as a float (any real number, a one-element tensor)."""
    if isinstance(value, Tensor):
        return float(value.item()) if value.numel() == 1 and not value.is_complex() else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def rankable_metrics(
    metrics: Mapping[str, Any] | None,
    policy: Policy | None,
    *,
    step: int,
    log: logging.Logger,
) -> Mapping[str, Any] | None:
    """``metrics`` with a non-finite value of ``policy``'s ranking metric made rankable.

    The one policy for non-finite metrics: a NaN or infinite evaluation is an
    outcome of training, not a mistake in the call, so the checkpoint is
    still saved, and it never outranks a finite value it should not:

    - a stream that lets a save go without its metric (``TopK(..., last=N)``:
      the best kept beside the newest) stores it without that value: saved,
      never among the best (a warning says so);
    - a stream that ranks every checkpoint (``TopK`` alone) stores NaN as the
      worst finite number of its mode, and an infinity as the largest finite
      number of its sign (it ranks where the infinity would).

    Other metrics, and anything that is not a real number, are left as they
    are: ckptdb's own checks refuse the latter with a typed error.
    """
    metric = policy.ranking_metric if policy is not None else None
    if metric is None or not isinstance(metrics, Mapping) or metric not in metrics:
        return metrics
    value = _real(metrics[metric])
    if value is None or math.isfinite(value):
        return metrics
    assert policy is not None
    if not policy.requires_metric:
        log.warning(
            "ckptdb: step %d: %s is %s; this checkpoint is never the best", step, metric, value
        )
        return {name: v for name, v in metrics.items() if name != metric}
    return {**metrics, metric: _finite_rank(value, policy)}


def _finite_rank(value: float, policy: Policy) -> float:
    largest = sys.float_info.max
    if math.isnan(value):
        worst_is_high = not (isinstance(policy, TopK) and policy.mode == "max")
        return largest if worst_is_high else -largest
    return math.copysign(largest, value)
