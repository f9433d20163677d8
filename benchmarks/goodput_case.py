"""The goodput cases: what the heartbeat costs a loop, and what ``interval="auto"`` earns.

**Heartbeat.** A training loop of small steps (a 64x64 matmul, tens of
microseconds: far shorter than any real step, so the call's cost shows), side
by side: no report; ``mgr.heartbeat(step)`` at every step with the default
10-second heartbeat (two assignments per call, a write at most every 10 s);
and with a heartbeat every 10 ms (a non-durable UPDATE of the attempt's row
every few steps), the worst case the tests use.

**Interval.** A run that must do ``WORK_H`` hours of training, on a machine
that fails at random (exponential, mean ``mtbf_h``), each save blocking the
loop ``cost_s`` (two :data:`SCENARIOS`), each restart costing ``RESTART_S``, simulated in virtual
time (seconds of the simulated run are the samples: the same seeds for every
contender). Contenders: fixed intervals around the Young/Daly optimum
sqrt(2·C·M) (which a user would have to know C and M to pick), the 30-minute
default ``max_interval``, and ``auto``: ckptdb's own ``choose_interval``, fed
only what the run has seen so far (no failure yet: ``max_interval``; then
the failures and training time observed). The baseline is the oracle: the
fixed optimum. The notes give each contender's goodput (useful work over
wall-clock time).
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from .harness import Comparison, compare

RESTART_S = 300.0
WORK_H = 500.0
#: (mean hours between failures, seconds per save): a large job on a flaky fleet, whose
#: optimum is near the 30-minute default, and a cheap save on a very flaky one, far from it
SCENARIOS = ((4.0, 60.0), (0.5, 10.0))

NO_REPORT = "no step report"
DEFAULT = "heartbeat() per step (default heartbeat=10)"
EVERY_10MS = "heartbeat() per step (heartbeat=0.01)"


def heartbeat(work: Path, steps: int, reps: int) -> Comparison:
    from ckptdb import CheckpointManager

    work.mkdir(parents=True, exist_ok=True)
    a = torch.randn(64, 64)
    managers = {
        DEFAULT: CheckpointManager(work / "default"),
        EVERY_10MS: CheckpointManager(work / "fast", heartbeat=0.01),
    }
    counter = {"step": 0}

    def loop(report: Any) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            counter["step"] += 1
            torch.mm(a, a)
            if report is not None:
                report(counter["step"])
        return time.perf_counter() - start

    try:
        result = compare(
            f"training loop with heartbeats, {steps} steps",
            {
                NO_REPORT: lambda: loop(None),
                DEFAULT: lambda: loop(managers[DEFAULT].heartbeat),
                EVERY_10MS: lambda: loop(managers[EVERY_10MS].heartbeat),
            },
            baseline=NO_REPORT,
            reps=reps,
            noise_floor=True,
        )
    finally:
        for mgr in managers.values():
            mgr.close()
    medians = result.medians()
    result.notes["per_step_us"] = {
        k: (v - medians[NO_REPORT]) / steps * 1e6 for k, v in medians.items() if k != NO_REPORT
    }
    result.notes["loop_step_us"] = medians[NO_REPORT] / steps * 1e6
    return result


def intervals(reps: int, work_h: float = WORK_H) -> list[Comparison]:
    return [interval(reps, work_h, mtbf_h, cost_s) for mtbf_h, cost_s in SCENARIOS]


def interval(reps: int, work_h: float, mtbf_h: float, cost_s: float) -> Comparison:
    from ckptdb.goodput import DEFAULT_MAX_INTERVAL, DEFAULT_MIN_INTERVAL, young_daly

    best = young_daly(cost_s, mtbf_h * 3600)
    fixed = {
        f"fixed {f:g}x the optimum ({best * f / 60:.0f} min)": best * f
        for f in (0.25, 0.5, 2.0, 4.0)
    }
    fixed[f"fixed {DEFAULT_MAX_INTERVAL / 60:.0f} min (the default max_interval)"] = (
        DEFAULT_MAX_INTERVAL
    )
    oracle = f"fixed at sqrt(2CM) ({best / 60:.0f} min, the oracle)"
    seeds: dict[str, int] = {}

    def contender(name: str, pick: Any) -> Any:
        def run() -> float:
            seeds[name] = seeds.get(name, 0) + 1
            return simulate(random.Random(seeds[name]), pick, work_h * 3600, mtbf_h, cost_s)

        return run

    def auto(seen: tuple[int, float]) -> float:
        from ckptdb.goodput import choose_interval

        failures, training = seen
        low, high = DEFAULT_MIN_INTERVAL, DEFAULT_MAX_INTERVAL
        return choose_interval(cost_s, failures, training, low, high).seconds

    contenders = {oracle: contender(oracle, lambda seen: best)}
    contenders["auto"] = contender("auto", auto)
    for name, seconds in fixed.items():
        contenders[name] = contender(name, lambda seen, s=seconds: s)
    result = compare(
        f"checkpoint interval: {work_h:g} h of work, failures every {mtbf_h:g} h on average, "
        f"saves of {cost_s:g} s, restarts of {RESTART_S:g} s (simulated)",
        contenders,
        baseline=oracle,
        reps=reps,
        warmup=0,
    )
    result.notes["goodput"] = {k: round(work_h * 3600 / v, 4) for k, v in result.medians().items()}
    result.notes["optimum_s"] = best
    return result


def simulate(
    chance: random.Random, pick: Any, work_s: float, mtbf_h: float, cost_s: float
) -> float:
    """Wall-clock seconds to finish ``work_s`` of training: train ``pick(seen)`` seconds,
    save (``cost_s``, committed at its end), repeat; a failure loses everything since the
    last commit and costs a restart. ``seen`` is (failures so far, seconds run so far)."""
    clock = done = 0.0
    failures = 0
    next_failure = chance.expovariate(1 / (mtbf_h * 3600))
    while done < work_s:
        segment = min(pick((failures, clock)), work_s - done)
        finish = clock + segment + cost_s
        if finish <= next_failure:
            clock, done = finish, done + segment
            continue
        failures += 1
        clock = next_failure + RESTART_S
        next_failure = clock + chance.expovariate(1 / (mtbf_h * 3600))
    return clock if math.isfinite(clock) else float("inf")
