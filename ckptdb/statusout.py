"""What ``ckptdb status`` prints, from the plain data both of its readers gather.

The full command (:mod:`ckptdb.cli`, through :class:`ckptdb.RunReader`) and the
quick read (:mod:`ckptdb.quickread`, through ``sqlite3``) each gather a run's
status as the same dict of plain values; this module turns the run's events
into its parts (what each preemption cost, the interval in force) and the dict
into text, so the two print the same lines. Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from . import textout

#: The event kinds :func:`preemption_summary` reads.
PREEMPTION_EVENTS = ("preempted", "preemption_saved", "resumed")


class EventLike(Protocol):
    """An event row as either reader holds it (the ledger's model, or a plain tuple)."""

    @property
    def kind(self) -> str: ...

    @property
    def attempt_id(self) -> int | None: ...

    @property
    def step(self) -> int | None: ...

    @property
    def detail(self) -> str | None: ...


def preemption_summary(events: Iterable[EventLike]) -> list[dict[str, Any]]:
    """Per ``preempted`` event (oldest first, with the ``preemption_saved`` and
    ``resumed`` events of the run): what the preemption cost.

    ``resumed_from`` is the step the next attempt resumed from (its ``resumed``
    event), else the preemption checkpoint's step when it was saved, else None
    (nothing known yet); ``lost`` is the agreed step minus that.

    Args:
        events: The run's events of :data:`PREEMPTION_EVENTS`, oldest first.

    Returns:
        One dict per preempted attempt (see :meth:`ckptdb.RunReader.preemptions`).
    """
    events = list(events)
    summary = []
    for told in (e for e in events if e.kind == "preempted"):
        detail = json.loads(told.detail or "{}")
        saved = [
            json.loads(e.detail or "{}")
            for e in events
            if e.kind == "preemption_saved" and e.attempt_id == told.attempt_id
        ]
        later = [
            e.step
            for e in events
            if e.kind == "resumed" and (e.attempt_id or 0) > (told.attempt_id or 0)
        ]
        was_saved = bool(saved and saved[-1].get("saved"))
        resumed_from = later[0] if later else (told.step if was_saved else None)
        summary.append(
            {
                "attempt": told.attempt_id,
                "step": told.step,
                "signal": detail.get("signal"),
                "ranks": detail.get("ranks"),
                "saved": was_saved if saved else None,
                "why": saved[-1].get("why") if saved and not was_saved else None,
                "resumed_from": resumed_from,
                "lost": _lost(told.step, resumed_from),
            }
        )
    return summary


def _lost(agreed: int | None, resumed_from: int | None) -> int | None:
    return agreed - resumed_from if agreed is not None and resumed_from is not None else None


def interval_now(newest: EventLike | None) -> dict[str, Any] | None:
    """The interval ``due`` uses, as its newest ``interval`` event (``newest``) recorded it."""
    if newest is None:
        return None
    detail = json.loads(newest.detail or "{}")
    return {**detail, "since_step": newest.step, "attempt": newest.attempt_id}


def render(data: dict[str, Any], bold: Callable[[str], str]) -> str:
    """The status as ``ckptdb status`` prints it (without ``--json``).

    Args:
        data: The status as the readers gather it (the keys of ``ckptdb
            status --json``).
        bold: How to embolden the run's name (the terminal's escape, or nothing).

    Returns:
        The lines, without the final newline.
    """
    lines = [bold(f"run {data['run']}") + f"  ({data['root']})", ""]
    streams = [[s["name"], s["policy"], s["latest_step"], s["committed"]] for s in data["streams"]]
    lines.append(textout.table(["stream", "policy", "latest step", "committed"], streams))
    for name, members in data["best"].items():
        ranked = [[i, c["step"], c["metric"], c["path"]] for i, c in enumerate(members, 1)]
        table = textout.table(["rank", "step", "metric", "path"], ranked)
        lines += ["", f"top-K of {name}:", table]
    counts = ", ".join(f"{n} {s}" for s, n in sorted(data["states"].items())) or "none"
    lines += ["", f"checkpoints by state: {counts}"]
    ends = ", ".join(f"{a['id']}:{a['end_state']}" for a in data["attempts"])
    lines.append(f"attempts: {len(data['attempts'])} ({ends})")
    if data["interval"] is not None:
        lines.append(_interval_line(data["interval"]))
    for tier in data["tiers"]:
        lines += _tier_lines(tier)
    for tier, copies in data["replicas"].items():
        states = ", ".join(f"{n} {s}" for s, n in sorted(copies["states"].items()))
        newest = ", ".join(f"{s} {step}" for s, step in sorted(copies["newest"].items()))
        lines.append(f"copies on {tier}: {states}; newest whole copy by stream: {newest or '-'}")
    if data["preemptions"]:
        headers = ["attempt", "step", "signal", "ranks", "saved", "resumed from", "steps lost"]
        rows = [_preemption_row(p) for p in data["preemptions"]]
        lines += ["", "preemptions:", textout.table(headers, rows)]
    if data["events"]:
        events = [[e["time"], e["kind"], e["step"], e["detail"]] for e in data["events"]]
        lines += ["", "last events:", textout.table(["time", "kind", "step", "detail"], events)]
    return "\n".join(lines)


def _tier_lines(tier: dict[str, Any]) -> list[str]:
    copied = ", ".join(tier["streams"]) if tier["streams"] is not None else "every stream"
    kept = "; ".join(f"{s}: {p}" for s, p in tier["keep"].items()) or "every copy"
    lines = [f"tier {tier['tier']}: {tier['location']} ({copied}; keeps {kept})"]
    if tier["waiting"]:
        size = textout.human_size(tier["waiting_bytes"])
        lines.append(f"  {tier['waiting']} evicted local file(s), {size}, wait for their copy")
    lines.append(f"  {tier['uncopied']} committed checkpoint(s) have no whole copy yet")
    if tier["ledger_copy"] is not None:
        ledger = tier["ledger_copy"]
        lines.append(f"  ledger last copied at {ledger['copied_at']} ({ledger['location']})")
    return lines


def _interval_line(chosen: dict[str, Any]) -> str:
    cost, mtbf = chosen.get("cost_s"), chosen.get("mtbf_s")
    why = chosen["why"]
    if cost is not None or mtbf is not None:
        c = f"{cost:.3g} s" if cost is not None else "-"
        m = f"{mtbf:.4g} s" if mtbf is not None else "-"
        why = f"{why}; C {c}, M {m}, {chosen['failures']} failure(s)"
    return f"interval: {chosen['seconds']:.4g} s ({why}) since step {chosen['since_step']}"


def _preemption_row(p: dict[str, Any]) -> Sequence[Any]:
    saved = {True: "yes", False: f"no ({p['why']})", None: "-"}[p["saved"]]
    ranks = ",".join(map(str, p["ranks"] or [])) or "-"
    return [p["attempt"], p["step"], p["signal"], ranks, saved, p["resumed_from"], p["lost"]]
