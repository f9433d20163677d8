"""``ckptdb goodput``: where a run's wall-clock time went, and the interval to use.

Registered on the ``ckptdb`` group when the package loads (see ``__init__``);
the figures are :mod:`ckptdb.goodput`'s.
"""

from __future__ import annotations

from pathlib import Path

import click

from .. import textout as clifmt
from ..errors import InvalidArgumentError
from ..goodput import GoodputReport, every_run
from ..reader import RunReader
from . import DB_URL, JSON, main, plot_option

FIGURES = ("productive_s", "saving_s", "lost_s", "restart_s", "idle_s", "total_s")


@main.command()
@click.argument("root", type=click.Path(file_okay=False, path_type=Path), required=False)
@click.option(
    "--all", "every", is_flag=True, help="Every run of the ledger (--db-url), one line each."
)
@plot_option("Write a PNG: a stacked bar per attempt (needs the 'plot' extra).")
@DB_URL
@JSON
def goodput(
    root: Path | None, every: bool, plot_file: Path | None, db_url: str | None, as_json: bool
) -> None:
    """Split a run's time into productive, saving, lost, restart and idle seconds.

    Over all its attempts: training that survived, time blocked in saves,
    steps redone after a crash or preemption, restarts (process start to
    first step) and gaps between attempts; with the checkpoint interval
    interval="auto" would choose from the measured save cost and failure rate.

    \b
    Example:
      ckptdb goodput runs/exp1
      ckptdb goodput --all --db-url postgresql+psycopg://user@host/db
    """
    if every:
        _every_run(root, plot_file, db_url, as_json)
        return
    if root is None:
        raise click.UsageError("give a run's ROOT, or --all with --db-url")
    with RunReader(root, db_url=db_url) as reader:
        report = reader.goodput()
    if plot_file is not None:
        from .plot import plot_goodput

        plot_goodput(report, plot_file)
    if as_json:
        click.echo(clifmt.to_json(report.as_json()))
        return
    _show(report)
    if plot_file is not None:
        click.echo(f"\n{len(report.attempts)} attempt(s) plotted to {plot_file}")


def _every_run(
    root: Path | None, plot_file: Path | None, db_url: str | None, as_json: bool
) -> None:
    if root is not None:
        raise click.UsageError("--all reads every run of --db-url; give no ROOT with it")
    if db_url is None:
        raise click.UsageError("--all needs --db-url (the ledger many runs share)")
    if plot_file is not None:
        raise InvalidArgumentError("--plot draws one run's attempts; give a ROOT instead of --all")
    found = every_run(db_url)
    if as_json:
        click.echo(clifmt.to_json([{"root": r, **report.as_json()} for r, report in found]))
        return
    click.echo(
        clifmt.table(
            ["run", "attempts", "goodput", *FIGURES, "interval (s)", "root"],
            [
                [
                    report.run,
                    len(report.attempts),
                    f"{report.total.goodput:.1%}",
                    *(_seconds(report.total.figures()[f]) for f in FIGURES),
                    _seconds(report.interval.seconds),
                    r,
                ]
                for r, report in found
            ],
        )
    )


def _show(report: GoodputReport) -> None:
    total = report.total
    click.echo(
        click.style(f"run {report.run}", bold=True)
        + f": goodput {total.goodput:.1%} of {_seconds(total.total_s)} s"
    )
    rows = [
        [
            a.attempt_id,
            a.end_state,
            *(_seconds(a.breakdown.figures()[f]) for f in FIGURES),
            "" if a.measured else "no heartbeat",
        ]
        for a in report.attempts
    ]
    rows.append(["all", "", *(_seconds(total.figures()[f]) for f in FIGURES), ""])
    click.echo("\n" + clifmt.table(["attempt", "end", *FIGURES, ""], rows))
    choice = report.interval
    cost = f"{choice.cost_s:.3g} s" if choice.cost_s is not None else "not measured"
    mtbf = f"{choice.mtbf_s:.4g} s" if choice.mtbf_s is not None else "no failure seen"
    click.echo(
        f"\ninterval='auto' would checkpoint every {_seconds(choice.seconds)} s "
        f"({choice.why}; save cost C {cost}, mean time between failures M {mtbf}, "
        f"{choice.failures} failure(s) in {_seconds(choice.training_s)} s)"
    )


def _seconds(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"
