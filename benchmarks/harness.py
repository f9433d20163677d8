"""Side-by-side timing: interleaved rounds, warm-up, medians, ratios to a baseline.

These machines are shared and noisy, so every comparison runs its
contenders in the same process, alternating (A B C, B C A, C A B, ...) after a
warm-up, and reports medians and the ratio of each median to the baseline's.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A contender runs once and returns the seconds that count (a float: it may
# exclude its own setup); any other return value means the whole call is timed.
Contender = Callable[[], Any]


@dataclass
class Comparison:
    name: str
    baseline: str
    samples: dict[str, list[float]] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def medians(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.samples.items()}

    def ratios(self) -> dict[str, float]:
        med = self.medians()
        base = med[self.baseline]
        return {k: (v / base if base else float("nan")) for k, v in med.items()}

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "baseline": self.baseline,
            "median_s": self.medians(),
            "ratio_to_baseline": self.ratios(),
            "repetitions": {k: len(v) for k, v in self.samples.items()},
            "notes": self.notes,
        }


def run_once(contender: Contender) -> float:
    start = time.perf_counter()
    counted = contender()
    elapsed = time.perf_counter() - start
    return counted if isinstance(counted, float) else elapsed


#: The name given to the baseline's second run when a comparison measures its noise.
AGAIN = " (again: the noise floor)"


def compare(
    name: str,
    contenders: dict[str, Contender],
    *,
    baseline: str,
    reps: int,
    warmup: int = 1,
    noise_floor: bool = False,
) -> Comparison:
    """Run every contender ``warmup + reps`` times, interleaved, rotating the order.

    ``noise_floor`` runs the baseline a second time as a contender of its own: its
    ratio (ideally 1.00) is how far two runs of the same code differ here, which is
    what a target of a few percent has to be read against.
    """
    if noise_floor:
        contenders = {**contenders, baseline + AGAIN: contenders[baseline]}
    result = Comparison(name, baseline, {k: [] for k in contenders})
    order = list(contenders)
    for round_ in range(warmup + reps):
        shift = round_ % len(order)
        for key in order[shift:] + order[:shift]:
            elapsed = run_once(contenders[key])
            if round_ >= warmup:
                result.samples[key].append(elapsed)
    return result


def markdown(comparisons: list[Comparison]) -> str:
    """The ratios to each case's baseline, the one figure comparable across machines
    and runs; the absolute medians (and every sample count) are in the JSON report."""
    lines = ["| case | contender | ratio to baseline |", "| --- | --- | ---: |"]
    for c in comparisons:
        for key, ratio in c.ratios().items():
            mark = " (baseline)" if key == c.baseline else ""
            lines.append(f"| {c.name} | {key}{mark} | {ratio:.2f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ memory


def settle() -> None:
    """Garbage and the allocator's free pages gone, so a peak is this call's alone."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        ctypes.CDLL(None).malloc_trim(0)


def rss_peak_growth(contender: Callable[[], Any]) -> int | None:
    """The resident set's peak during the call minus its size before (None: not Linux)."""
    settle()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        return None
    before = status_kib("VmRSS")
    result = contender()
    peak = status_kib("VmHWM")
    del result
    return (peak - before) * 1024


def anon_peak_growth(contender: Callable[[], Any], every: float = 0.002) -> int:
    """The peak of anonymous resident memory (``RssAnon``: the heap, tensors) during the
    call minus its size before, sampled every ``every`` seconds. Unlike ``VmHWM`` it
    leaves out file pages a process maps (an mmap'd file being hashed), which the
    kernel reclaims at will."""
    settle()
    before = status_kib("RssAnon")
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(every):
            peak[0] = max(peak[0], status_kib("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = contender()
    finally:
        done.set()
        sampler.join()
    peak[0] = max(peak[0], status_kib("RssAnon"))
    del result
    return (peak[0] - before) * 1024


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise LookupError(field)
