"""Validation of what a caller passes to a boundary: steps and metric values.

Bad input is refused before anything else happens (before the guard is read,
so a typo never resets it), with an error that also inherits the natural
built-in (``TypeError``, ``ValueError``).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping

import torch

from ..errors import ArgumentTypeError, InvalidArgumentError
from ..ledger.models import MAX_METRIC_NAME, MAX_STEP


def validate_step(step: object) -> int:
    """``step`` if it is an int the ledger can hold (0 to 2**63 - 2), else the typed error."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise ArgumentTypeError(f"step must be a non-negative int, got {step!r}")
    if step < 0:
        raise InvalidArgumentError(f"step must be >= 0, got {step}")
    if step > MAX_STEP:  # the driver would refuse it mid-transaction (OverflowError)
        raise InvalidArgumentError(f"step must be at most 2**63 - 2, got {step}")
    return step


def fits_metric_name(name: str) -> bool:
    """Whether the ledger can hold ``name``: ``metrics.name`` is VARCHAR(255), PostgreSQL's
    text holds no NUL, every driver sends UTF-8. Why here: a name buffered that no insert
    can write failed every later flush and commit of the run (and its close)."""
    if len(name) > MAX_METRIC_NAME or "\x00" in name:
        return False
    try:  # a lone surrogate: no driver can encode it (UnicodeEncodeError at the flush)
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validate_metrics(metrics: object) -> dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ArgumentTypeError(f"metrics must be a dict name -> number, got {metrics!r}")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise ArgumentTypeError(f"metric names must be non-empty str, got {name!r}")
        if not fits_metric_name(name):
            raise InvalidArgumentError(
                f"metric names hold at most {MAX_METRIC_NAME} characters, no NUL and no "
                f"lone surrogate, got {name[:40]!r}... ({len(name)} characters)"
            )
        out[name] = _real(name, value)
    return out


def _real(name: str, value: object) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"metric {name!r} must be a real number, got {value!r}")
    return float(value)
