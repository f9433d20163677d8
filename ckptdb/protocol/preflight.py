"""Phase 1 of a boundary: this rank's verdict on its input, its guard and its metrics.

The checks run in a fixed order, and the first that objects decides the
verdict's ``stage``: bad input (0) before the guard (1), so a typo never
resets it; a non-finite ranking metric (2) after the guard, since a tripped
guard is the root cause of a NaN validation loss and the more useful error.
Nothing here raises: the coordinator agrees on the verdict across ranks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

from ..coord.base import Verdict
from ..errors import (
    ArgumentTypeError,
    CkptDBError,
    InvalidArgumentError,
    InvalidMetricError,
    NonFiniteGradientError,
)
from ..guard import NonFiniteGradGuard
from ..policies import Policy, policy_of
from ..storage.external import External
from ..storage.kinds import kind_of
from .inputs import validate_metrics, validate_step


class Preflight:
    """The checks of phase 1 for one run's policies and guard."""

    def __init__(
        self,
        policies: Mapping[str, Policy],
        guard: NonFiniteGradGuard | None,
    ) -> None:
        self.policies, self.guard = policies, guard

    def verdict(
        self, step: object, metrics: object, payloads: dict[str, Any], blocking: object
    ) -> Verdict:
        """This rank's verdict (input, guard, finite ranking metric), never raised here:
        the coordinator agrees on it, and the earliest failing check wins."""
        every_rank = sorted(s for s, p in payloads.items() if kind_of(p).every_rank_writes)
        shape = functools.partial(
            Verdict,
            step=step,
            streams=sorted(payloads),
            every_rank_streams=every_rank,
            blocking=blocking is True,
        )
        try:
            if not isinstance(blocking, bool):
                raise ArgumentTypeError(f"blocking must be True or False, got {blocking!r}")
            values = self.validate(step, metrics, payloads)
            check_external(payloads, blocking is True)
        except CkptDBError as exc:
            return shape({}, exc, 0)
        try:
            trip = self.guard_verdict(validate_step(step))
        except Exception as exc:  # e.g. a CUDA error while reading the guard's flag
            return shape(values, exc, 1)
        if trip is not None:
            return shape(values, trip, 1)
        try:
            self.check_finite_metrics(payloads, values)
        except CkptDBError as exc:
            return shape(values, exc, 2)
        return shape(values, None, 0)

    def validate(self, step: object, metrics: object, payloads: dict[str, Any]) -> dict[str, float]:
        """Bad input, checked before the guard (which a typo must not reset)."""
        validate_step(step)
        values = validate_metrics(metrics)
        if not payloads:
            raise InvalidArgumentError(
                "save() needs at least one payload, e.g. save(step, model=sd)"
            )
        for stream in payloads:
            policy = policy_of(self.policies, stream)
            metric = policy.ranking_metric
            if metric is not None and policy.requires_metric and metric not in values:
                raise InvalidMetricError(
                    f"stream {stream!r} ranks by metric {metric!r}, which is missing "
                    f"from save(metrics=...) (got {sorted(values)})"
                )
        for stream, payload in payloads.items():  # the ``**payloads`` of this call: ours
            try:
                payloads[stream] = kind_of(payload).prepared(payload)
            except CkptDBError:
                raise
            except Exception as exc:
                raise InvalidArgumentError(
                    f"stream {stream!r}: the Sharded state dict could not be resolved "
                    f"(a Stateful's state_dict() raised {type(exc).__name__}: {exc})"
                ) from exc
        return values

    def guard_verdict(self, step: int) -> NonFiniteGradientError | None:
        """This process's guard verdict for the boundary (one host sync), not yet recorded."""
        if self.guard is None or not self.guard.tripped():
            return None
        params = self.guard.nonfinite_parameters()
        which = f" in {', '.join(params)}" if params else ""
        return NonFiniteGradientError(
            f"non-finite gradient seen{which} since the last boundary; step {step} not published",
            step=step,
            parameters=params,
        )

    def check_finite_metrics(self, payloads: Mapping[str, Any], values: dict[str, float]) -> None:
        """A non-finite ranking metric (checked after the guard: a tripped guard is the
        root cause of a NaN validation loss, and the more useful error)."""
        for stream in payloads:
            metric = self.policies[stream].ranking_metric
            if metric is not None and metric in values and not math.isfinite(values[metric]):
                raise InvalidMetricError(
                    f"stream {stream!r} ranks by metric {metric!r}, which must be "
                    f"finite; got {values[metric]!r}"
                )


def check_external(payloads: Mapping[str, Any], blocking: bool) -> None:
    """External payloads are written during the call, each under a name of its own."""
    names: dict[str, str] = {}
    for stream, payload in payloads.items():
        if not isinstance(payload, External):
            continue
        if not blocking:
            raise InvalidArgumentError(
                f"stream {stream!r}: an External payload is written by its writer during "
                "save(); it cannot be saved with blocking=False"
            )
        if payload.name in names:
            raise InvalidArgumentError(
                f"streams {names[payload.name]!r} and {stream!r} both publish {payload.name!r}"
            )
        names[payload.name] = stream
