"""Retention and top-K policies: small, pure, free of I/O.

Each policy answers one question over plain :class:`Entry` values — which
committed checkpoints of a stream must go when a new one commits — so it can
be tested exhaustively without a ledger or a disk. The manager applies the
answer inside its commit transaction.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from .errors import ArgumentTypeError, InvalidArgumentError

STREAM_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


@dataclass(frozen=True)
class Entry:
    """What a policy needs to know about one checkpoint of its stream."""

    id: int
    step: int
    metric: float | None = None


def _positive_int(name: str, value: Any, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise InvalidArgumentError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class Keep:
    """Keep the newest ``last`` checkpoints (None: all); steps divisible by ``every`` forever.

    Timeline rule: a new checkpoint at step ``s`` supersedes every checkpoint
    of the stream with step ``>= s`` (they belong to an abandoned timeline), so
    the window never throws away the checkpoint just written.
    """

    last: int | None = 5
    every: int | None = None

    kind = "keep"

    def __post_init__(self) -> None:
        _positive_int("Keep(last=...)", self.last, allow_none=True)
        _positive_int("Keep(every=...)", self.every, allow_none=True)

    @classmethod
    def from_ratio(cls, ratio: float, num_steps: int, save_freq: int) -> Keep:
        """Keep the last ``ceil(ratio * ceil(num_steps / save_freq))`` saves, at least one."""
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
            raise ArgumentTypeError(f"ratio must be a real number, got {ratio!r}")
        if not 0 < ratio <= 1:
            raise InvalidArgumentError(f"ratio must be in (0, 1], got {ratio}")
        _positive_int("num_steps", num_steps, allow_none=False)
        _positive_int("save_freq", save_freq, allow_none=False)
        saves = -(-num_steps // save_freq)
        # exact arithmetic: 0.07 * 100 saves is 7, not the float 7.000000000000001
        exact = ratio if isinstance(ratio, (int, Fraction)) else Fraction(repr(float(ratio)))
        return cls(last=max(1, math.ceil(exact * saves)))

    def evictions(self, committed: Sequence[Entry], new: Entry) -> list[Entry]:
        superseded = [e for e in committed if e.step >= new.step and e.id != new.id]
        remaining = [e for e in committed if e.step < new.step] + [new]
        return superseded + self.window_evictions(remaining)

    def window_evictions(self, committed: Sequence[Entry]) -> list[Entry]:
        """The entries outside the retention window (used by ``gc`` too)."""
        if self.last is None:
            return []
        newest_first = sorted(committed, key=lambda e: (e.step, e.id), reverse=True)
        every = self.every
        return [e for e in newest_first[self.last :] if every is None or e.step % every != 0]


@dataclass(frozen=True)
class TopK:
    """Keep the ``k`` best checkpoints by ``metrics[metric]``; ties go to the earlier step.

    Exempt from the timeline rule: a best model from an abandoned branch is
    still a good model. Re-saving a step already in the top-K replaces it.
    """

    k: int
    metric: str
    mode: Literal["min", "max"] = "min"

    kind = "topk"

    def __post_init__(self) -> None:
        _positive_int("TopK(k=...)", self.k, allow_none=False)
        if not isinstance(self.metric, str):
            raise ArgumentTypeError(f"TopK(metric=...) must be a str, got {self.metric!r}")
        if not self.metric:
            raise InvalidArgumentError(
                f"TopK(metric=...) must be a non-empty str, got {self.metric!r}"
            )
        if self.mode not in ("min", "max"):
            raise InvalidArgumentError(f"TopK(mode=...) must be 'min' or 'max', got {self.mode!r}")

    def _key(self, entry: Entry) -> tuple[float, int, int]:
        assert entry.metric is not None
        value = entry.metric if self.mode == "min" else -entry.metric
        return (value, entry.step, entry.id)

    def _ranked(self, members: Sequence[Entry], candidate: Entry) -> list[Entry]:
        others = [m for m in members if m.step != candidate.step]
        return sorted([*others, candidate], key=self._key)

    def admits(self, members: Sequence[Entry], candidate: Entry) -> bool:
        """Whether ``candidate`` would enter the top-K (decided before writing)."""
        return candidate in self._ranked(members, candidate)[: self.k]

    def evictions(self, committed: Sequence[Entry], new: Entry) -> list[Entry]:
        replaced = [m for m in committed if m.step == new.step and m.id != new.id]
        return replaced + self._ranked(committed, new)[self.k :]

    def window_evictions(self, committed: Sequence[Entry]) -> list[Entry]:
        return sorted(committed, key=self._key)[self.k :]

    def ranked(self, members: Sequence[Entry]) -> list[Entry]:
        """Members best first."""
        return sorted(members, key=self._key)


Policy = Keep | TopK


def validate_stream_name(name: object) -> str:
    if not isinstance(name, str):
        raise ArgumentTypeError(f"stream names are str, got {name!r}")
    if not STREAM_NAME.fullmatch(name) or name in (".", "..") or name.startswith("ckptdb."):
        raise InvalidArgumentError(
            f"invalid stream name {name!r}: use 1-64 letters, digits, '_', '-', '.' "
            "(not '.', '..' or a name starting with 'ckptdb.')"
        )
    return name


def validate_policies(streams: object) -> dict[str, Policy]:
    if not isinstance(streams, dict) or not streams:
        raise ArgumentTypeError(f"streams must be a non-empty dict name -> policy, got {streams!r}")
    for name, policy in streams.items():
        validate_stream_name(name)
        if not isinstance(policy, (Keep, TopK)):
            raise ArgumentTypeError(
                f"policy of stream {name!r} must be Keep or TopK, got {policy!r}"
            )
    return dict(streams)
