"""``python -m benchmarks --check``: the key figures against the thresholds recorded here.

A change that touches the boundary, the load path or the command line runs
this before it lands. Each :class:`Threshold` names one figure of one
comparison (a contender's ratio to its baseline, or a note such as the SQL
statements per boundary) and the most it may be. The check runs the cases
those figures come from (default sizes), prints one line per figure (its
value, the recorded threshold, the target it serves) and exits 1 when any
figure is above its threshold or was not measured.

The thresholds are the figures accepted on the reference machine (2 cores,
the date is in docs/performance.md) plus the run-to-run noise measured
there; a target not met yet (the 100 MB publish aims at 1.05) is shown
beside its figure, so the line says both "no worse than accepted" and "how
far from the goal". A threshold moves only by an edit of this file, with the
new figures in the changelog.
"""

from __future__ import annotations

from dataclasses import dataclass

from .harness import Comparison

#: A figure that is a note of the comparison, not a contender's ratio.
NOTE = "note:"


@dataclass(frozen=True)
class Threshold:
    case: str  # the suite's case that measures it (``--case NAME``)
    comparison: str  # the comparison's name in the report
    figure: str  # a contender (its ratio to the baseline), or NOTE + a note's key
    most: float  # the recorded threshold: above it, the figure regressed
    target: float  # the goal the figure serves
    unit: str = "x"


THRESHOLDS: tuple[Threshold, ...] = (
    Threshold("publish", "publish 100 MB", "ckptdb save", 1.12, 1.05),
    Threshold("publish", "publish 10 MB", "ckptdb save", 1.25, 1.10),
    Threshold("publish", "publish 1 MB", "ckptdb save", 2.10, 1.5),
    Threshold(
        "floor",
        "3-stream boundary of tiny payloads vs its physical minimum",
        "ckptdb save (3 streams, evicting)",
        1.95,
        1.25,
    ),
    Threshold(
        "floor",
        "3-stream boundary of tiny payloads vs its physical minimum",
        NOTE + "statements_per_boundary",
        20,
        20,
        " statements",
    ),
    # 30 samples since 2026-12-07: torch.load against itself 1.00-1.03, ckptdb 1.21-1.38
    Threshold("load", "load 100 MB", "ckptdb load (verified)", 1.60, 1.10),
    # answered from the standard library (ckptdb/quickread.py): 64-66 ms; a latest that
    # fell back to the full command (0.45 s) is the regression this catches
    Threshold(
        "cold",
        "cold read-only command, 10000 checkpoints",
        NOTE + "ckptdb latest (s)",
        0.15,
        0.30,
        " s",
    ),
    # ``sql`` takes the quick read's path too (1.1x latest's time): a fall back costs 0.43 s
    Threshold(
        "cold",
        "cold read-only command, 10000 checkpoints",
        NOTE + "ckptdb sql (s)",
        0.15,
        0.30,
        " s",
    ),
    # ``status`` is a quick read too (about latest's time): the full command took 0.44 s
    Threshold(
        "cold",
        "cold read-only command, 10000 checkpoints",
        NOTE + "ckptdb status (s)",
        0.15,
        0.30,
        " s",
    ),
    # ``list`` prints all 10k rows, the slowest command (0.33 s, 3.2x latest, 2026-12-07
    # 19:45 UTC); the full command it falls back to took 0.76 s on a fast machine
    Threshold(
        "cold",
        "cold read-only command, 10000 checkpoints",
        NOTE + "slowest command (s)",
        0.60,
        0.30,
        " s",
    ),
    # ``check`` hashes the 10k files (0.97 s, 2026-12-07 22:30 UTC, quiet; its floor is in
    # docs/performance.md); torch imported on its path (1.4 s more) is what this catches.
    # On the machine's slow afternoons (2.2-2.7x) it reads REGRESSED, as latest's does:
    # rerun it quiet before believing it
    Threshold(
        "cold",
        "cold read-only command, 10000 checkpoints",
        NOTE + "ckptdb check (s)",
        1.80,
        0.30,
        " s",
    ),
)


@dataclass(frozen=True)
class Verdict:
    threshold: Threshold
    value: float | None  # None: the figure was not in the results

    @property
    def regressed(self) -> bool:
        return self.value is None or self.value > self.threshold.most

    def line(self) -> str:
        t = self.threshold
        where = f"{t.comparison}: {t.figure.removeprefix(NOTE)}"
        if self.value is None:
            return f"NOT MEASURED  {where} (run --case {t.case} at the default sizes)"
        status = "REGRESSED" if self.regressed else "ok"
        goal = "" if self.value <= t.target else f"; target {t.target:g}{t.unit} not met yet"
        return (
            f"{status:<13} {where} = {self.value:.3g}{t.unit} (threshold {t.most:g}{t.unit}{goal})"
        )


def figure_of(result: Comparison, figure: str) -> float | None:
    if figure.startswith(NOTE):
        value = result.notes.get(figure.removeprefix(NOTE))
        return float(value) if isinstance(value, int | float) else None
    return result.ratios().get(figure)


def verdicts(results: list[Comparison], cases: list[str] | None = None) -> list[Verdict]:
    """Each threshold (of ``cases`` only, when given) against ``results``."""
    by_name = {r.name: r for r in results}
    found = []
    for t in THRESHOLDS:
        if cases is not None and t.case not in cases:
            continue
        result = by_name.get(t.comparison)
        found.append(Verdict(t, None if result is None else figure_of(result, t.figure)))
    return found


def checked_cases() -> list[str]:
    """The cases the thresholds come from, each once, in the thresholds' order."""
    return list(dict.fromkeys(t.case for t in THRESHOLDS))
