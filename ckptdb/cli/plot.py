"""``ckptdb history --plot``: a metric curve with the run's story marked on it;
``ckptdb goodput --plot``: each attempt's time as a stacked bar.

Markers: committed checkpoints (dots), current top-K members (stars), guard
trips (red crosses) and restarts (dashed vertical lines, one per attempt after
the first). Needs matplotlib (``pip install 'ckptdb[plot]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import CkptDBError
from ..goodput import GoodputReport
from ..reader import RunReader
from ..record import COMMITTED, DELETED, DELETING


class PlotUnavailableError(CkptDBError, ImportError):
    """matplotlib is not installed."""


def plot_history(
    reader: RunReader, metric: str, points: list[tuple[int, float, int]], out: Path
) -> None:
    plt = _pyplot()
    value_at = {s: v for s, v, _ in points}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    by_attempt: dict[int, list[tuple[int, float]]] = {}
    for s, v, a in points:
        by_attempt.setdefault(a, []).append((s, v))
    for attempt, series in by_attempt.items():
        ax.plot([s for s, _ in series], [v for _, v in series], lw=1, label=f"attempt {attempt}")
    for attempt, series in list(by_attempt.items())[1:]:
        ax.axvline(series[0][0], color="grey", ls="--", lw=1)
        ax.annotate(
            f"restart (attempt {attempt})",
            (series[0][0], ax.get_ylim()[1]),
            fontsize=8,
            rotation=90,
            va="top",
            ha="right",
        )
    _mark(ax, reader, value_at)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{reader.run_name}: {metric}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailableError("plotting needs matplotlib: pip install 'ckptdb[plot]'") from exc
    return plt


def _mark(ax: Any, reader: RunReader, value_at: dict[int, float]) -> None:
    published = {c.step for c in reader.checkpoints(states=(COMMITTED, DELETING, DELETED))}
    steps = sorted(s for s in published if s in value_at)
    ax.scatter(
        steps,
        [value_at[s] for s in steps],
        s=14,
        color="black",
        zorder=3,
        label="checkpoint committed",
    )
    best = {
        c.step
        for name, p in reader.policies.items()
        if p.ranking_metric is not None
        for c in reader.best(name)
    }
    steps = sorted(s for s in best if s in value_at)
    ax.scatter(
        steps,
        [value_at[s] for s in steps],
        s=120,
        marker="*",
        color="gold",
        edgecolor="black",
        zorder=4,
        label="top-K member",
    )
    trips = sorted(
        {
            e.step
            for e in reader.events(10_000)
            if e.kind == "guard_tripped" and e.step is not None and e.step in value_at
        }
    )
    ax.scatter(
        trips,
        [value_at[s] for s in trips],
        s=80,
        marker="x",
        color="red",
        zorder=5,
        label="guard tripped",
    )


def plot_goodput(report: GoodputReport, out: Path) -> None:
    """A stacked bar per attempt: its restart, productive, saving, lost seconds and the
    idle gap before it, so a run's waste is seen attempt by attempt."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(report.attempts) + 3), 4.5))
    labels = [str(a.attempt_id) for a in report.attempts]
    bottoms = [0.0] * len(labels)
    for field, colour in _GOODPUT_COLOURS:
        heights = [getattr(a.breakdown, field) for a in report.attempts]
        ax.bar(labels, heights, bottom=bottoms, color=colour, label=field.removesuffix("_s"))
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_xlabel("attempt")
    ax.set_ylabel("seconds")
    ax.set_title(f"{report.run}: goodput {report.total.goodput:.1%}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


_GOODPUT_COLOURS = (
    ("idle_s", "#bbbbbb"),
    ("restart_s", "#f0a030"),
    ("productive_s", "#3a923a"),
    ("saving_s", "#3070c0"),
    ("lost_s", "#d03030"),
)
