"""``ckptdb follow --to mlflow|wandb``: a run mirrored into an experiment tracker.

The work is :class:`ckptdb.trackers.Mirror`'s; this module turns the
command's options into a sink and reports each pass in one line.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from ..trackers import POLL, Mirror, Pass, Sink
from .interrupts import Interrupts

MLFLOW_ONLY = ("tracking_uri", "experiment", "model_name", "artifact_location")
WANDB_ONLY = ("project", "entity", "wandb_dir", "offline")


def mirror(
    root: Path,
    streams: tuple[str, ...],
    timeout: float | None,
    poll: float | None,
    db_url: str | None,
    **options: Any,
) -> None:
    to = options.pop("to")
    on_evict, once = options.pop("on_evict"), options.pop("once")
    sink = _sink(to, options)
    with Interrupts() as interrupts:  # SIGTERM stops as Ctrl-C does: cleanly
        try:
            with Mirror(
                root, sink, db_url=db_url, streams=streams or None, on_evict=on_evict
            ) as mirrored:
                click.echo(f"mirroring {root} into {to} run {mirrored.tracker_run_id}")
                if once:
                    _report(mirrored.sync())
                    return
                while True:
                    done = mirrored.sync()
                    _report(done)
                    interrupts.raise_if_set()  # one the interpreter dropped
                    if done or timeout is None:
                        continue
                    if _idle(mirrored, timeout, poll, interrupts):
                        return
        except KeyboardInterrupt:
            click.echo(
                "stopped; the next `ckptdb follow --to` continues where this one left off",
                err=True,
            )
            sys.exit(130)


def _idle(mirrored: Mirror, timeout: float, poll: float | None, interrupts: Interrupts) -> bool:
    """Wait up to ``timeout`` for news, a pass every ``poll`` seconds; True: none came."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(min(poll or POLL, max(deadline - time.monotonic(), 0)))
        done = mirrored.sync()
        interrupts.raise_if_set()
        if done:
            _report(done)
            return False
    return True


def _sink(to: str, options: dict[str, Any]) -> Sink:
    other = WANDB_ONLY if to == "mlflow" else MLFLOW_ONLY
    given = [f"--{name.replace('_', '-')}" for name in other if options.get(name)]
    if given:
        raise click.UsageError(f"{', '.join(given)} do(es) not go with --to {to}")
    if to == "mlflow":
        from ..trackers.mlflow import MlflowSink

        if not options["tracking_uri"]:
            raise click.UsageError("--to mlflow needs --tracking-uri")
        return MlflowSink(
            options["tracking_uri"],
            experiment=options["experiment"] or "ckptdb",
            model_name=options["model_name"],
            artifact_location=options["artifact_location"],
        )
    from ..trackers.wandb import WandbSink

    if not options["project"]:
        raise click.UsageError("--to wandb needs --project")
    return WandbSink(
        options["project"],
        entity=options["entity"],
        directory=options["wandb_dir"],
        offline=options["offline"],
    )


def _report(done: Pass) -> None:
    for ident, reason in sorted(done.refused.items()):
        click.echo(f"not mirrored (checkpoint {ident}): {reason}", err=True)
    if not done:
        return
    parts = []
    if done.metrics:
        parts.append(f"{done.metrics} metric point(s)")
    if done.checkpoints:
        steps = ", ".join(f"{c.stream}@{c.step}" for c in done.checkpoints)
        parts.append(f"checkpoints {steps}")
    if done.aliases:
        parts.append("aliases " + ", ".join(sorted(done.aliases)))
    if done.evicted:
        parts.append(f"{len(done.evicted)} evicted")
    click.echo("mirrored " + "; ".join(parts))
