"""The ``ckptdb`` command: inspect, query and maintain runs.

Read-only commands (status, list, latest, best, history, sql) open the ledger
read-only and work while a trainer holds the run. Errors print one line on
stderr and exit 1 (``--debug`` shows the traceback); usage errors exit 2.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from .. import statusout
from .. import textout as clifmt
from ..errors import CkptDBError, InvalidArgumentError
from ..policies import default_ranked_stream, policy_from_record
from ..quickread import DB_URL_VARIABLE
from ..reader import RunReader

DB_URL = click.option(
    "--db-url",
    envvar=DB_URL_VARIABLE,
    default=None,
    metavar="URL",
    help=(
        "Ledger URL (default: ROOT/ckptdb.sqlite), e.g. postgresql+psycopg://user@host/db "
        "for a ledger shared by many runs. Env: CKPTDB_DB_URL."
    ),
)
ROOT = click.argument("root", type=click.Path(file_okay=False, path_type=Path))
JSON = click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output.")


def plot_option(what: str) -> Callable[[Any], Any]:
    """``--plot FILE`` (the ``plot_file`` parameter), ``what`` its help."""
    return click.option(
        "--plot",
        "plot_file",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help=what,
    )


class CkptDBGroup(click.Group):
    """Turns ckptdb errors into one line on stderr and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as exc:
            if ctx.params.get("debug"):
                raise
            message = " ".join(str(exc).split()) or type(exc).__name__
            if not isinstance(exc, (CkptDBError, OSError)):
                message = f"unexpected {type(exc).__name__}: {message} (--debug for details)"
            raise click.ClickException(message) from exc


@click.group(cls=CkptDBGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.version_option(package_name="ckptdb")
def main(debug: bool) -> None:
    """ckptdb: a transactional checkpoint ledger for PyTorch training.

    \b
    Example:
      ckptdb demo runs/demo && ckptdb status runs/demo
    """


def topk_stream(reader: RunReader, stream: str | None) -> str:
    """The stream `best` reports: the one asked for, else 'best', else the only TopK one."""
    if stream is not None:
        return stream
    chosen = default_ranked_stream(reader.policies)
    if chosen is not None:
        return chosen
    topk = [name for name, p in reader.policies.items() if p.ranking_metric is not None]
    return _ambiguous(topk) if topk else "best"  # none: the error names the streams


def _ambiguous(names: list[str]) -> str:
    raise InvalidArgumentError(f"several top-K streams ({', '.join(names)}); pass --stream")


@main.command()
@ROOT
@DB_URL
@JSON
def status(root: Path, db_url: str | None, as_json: bool) -> None:
    """Summarize a run: streams, latest and best checkpoints, attempts, events.

    \b
    Example:
      ckptdb status runs/exp1
    """
    with RunReader(root, db_url=db_url) as reader:
        data = _status_data(reader)
    if as_json:
        click.echo(clifmt.to_json(data))
        return
    click.echo(statusout.render(data, bold=lambda text: click.style(text, bold=True)))


def _replica_summary(reader: RunReader) -> dict[str, Any]:
    """Per tier: copies by state, and the newest step of each stream with a whole copy."""
    summary: dict[str, Any] = {}
    for r in reader.replicas():
        tier = summary.setdefault(r.tier, {"states": {}, "newest": {}})
        tier["states"][r.state] = tier["states"].get(r.state, 0) + 1
        if r.state == "replicated":
            tier["newest"][r.stream] = max(tier["newest"].get(r.stream, r.step), r.step)
    return summary


def _tier_summary(reader: RunReader) -> list[dict[str, Any]]:
    """Per registered tier: where, which streams, each stream's retention there, and
    the evicted local files still waiting for their copy."""
    tiers = reader.tiers()
    if not tiers:  # a run never replicated: nothing to read (nor 10k records to build)
        return []
    waiting = reader.waiting_for_copy()
    whole = {(r.tier, r.checkpoint_id) for r in reader.replicas() if r.state == "replicated"}
    committed = reader.checkpoints()
    summary = []
    for t in tiers:
        mine = [c for c, tier in waiting if tier == t.tier]
        copied = [c for c in committed if t.streams is None or c.stream in t.streams]
        keep = {s: policy_from_record(r).describe() for s, r in sorted(t.policies.items())}
        summary.append(
            {
                "tier": t.tier,
                "location": t.location,
                "streams": None if t.streams is None else list(t.streams),
                "keep": keep,
                "waiting": len(mine),
                "waiting_bytes": sum(c.size or 0 for c in mine),
                "uncopied": sum((t.tier, c.id) not in whole for c in copied),
                "ledger_copy": _ledger_copy(reader),
            }
        )
    return summary


def _ledger_copy(reader: RunReader) -> dict[str, Any] | None:
    """The last copy of the run's SQLite ledger this machine made (its replicator's)."""
    from ..ledgercopy import read_state

    last = (read_state(reader.root) or {}).get("last_copy")
    if not isinstance(last, dict):
        return None
    return {k: last.get(k) for k in ("copied_at", "location", "epoch", "seq", "size")}


def _status_data(reader: RunReader) -> dict[str, Any]:
    streams, best = [], {}
    counts = reader.committed_counts()
    for name, policy in reader.policies.items():
        latest = reader.latest(name)
        streams.append(
            {
                "name": name,
                "policy": policy.describe(),
                "latest_step": latest.step if latest else None,
                "latest_path": str(latest.path) if latest else None,
                "committed": counts.get(name, 0),
            }
        )
        if policy.ranking_metric is not None:
            best[name] = [clifmt.checkpoint_dict(c) for c in reader.best(name)]
    return {
        "run": reader.run_name,
        "root": str(reader.root),
        "streams": streams,
        "best": best,
        "states": reader.state_counts(),
        "attempts": [
            {
                "id": a.id,
                "started_at": clifmt.jsonable(a.started_at),
                "end_state": a.end_state,
                "kind": a.kind,
                "host": a.host,
                "pid": a.pid,
            }
            for a in reader.attempts()
        ],
        "preemptions": reader.preemptions(),
        "interval": statusout.interval_now(next(reversed(reader.events_of("interval")), None)),
        "tiers": _tier_summary(reader),
        "replicas": _replica_summary(reader),
        "events": [
            {"time": clifmt.cell(e.time), "kind": e.kind, "step": e.step, "detail": e.detail}
            for e in reader.events(8)
        ],
    }


@main.command(name="list")
@ROOT
@click.option("--stream", default=None, help="Only this stream.")
@click.option("--all", "all_states", is_flag=True, help="Every state, not only committed.")
@DB_URL
@JSON
def list_(
    root: Path, stream: str | None, all_states: bool, db_url: str | None, as_json: bool
) -> None:
    """List checkpoints (committed ones; every state with --all).

    \b
    Example:
      ckptdb list runs/exp1 --stream model --all
    """
    from ..record import STATES

    with RunReader(root, db_url=db_url) as reader:
        found = reader.checkpoints(stream, states=STATES if all_states else ("committed",))
        copies = copy_states(reader.replicas())
        exported: dict[int, list[str]] = {}
        for export in reader.exports():
            exported.setdefault(export.checkpoint_id, []).append(str(export.path))
    if as_json:
        click.echo(
            clifmt.to_json(
                [
                    {
                        **clifmt.checkpoint_dict(c),
                        "remote": copies.get(c.id),
                        "exports": exported.get(c.id, []),
                    }
                    for c in found
                ]
            )
        )
        return
    columns, rows = list(clifmt.CHECKPOINT_COLUMNS), [clifmt.checkpoint_row(c) for c in found]
    if copies:  # a replicated run: each checkpoint's copy on the remote tier
        columns.insert(3, "remote")
        for row, c in zip(rows, found, strict=True):
            row.insert(3, copies.get(c.id))
    if exported:  # where each exported checkpoint went (ckptdb export)
        columns.append("exports")
        for row, c in zip(rows, found, strict=True):
            row.append(", ".join(exported.get(c.id, [])) or None)
    click.echo(clifmt.table(columns, rows))


def copy_states(replicas: list[Any]) -> dict[int, str]:
    """Each copied checkpoint's state on the remote tier: ``replicated`` if it has a
    whole copy, else its newest copy's state (uploading, failed, deleting, deleted)."""
    states: dict[int, str] = {}
    for r in replicas:  # oldest first: a later copy's state replaces an earlier one's
        if states.get(r.checkpoint_id) != "replicated":
            states[r.checkpoint_id] = r.state
    return states


@main.command()
@ROOT
@click.option("--stream", default="model", show_default=True, help="Stream to look in.")
@click.option(
    "--tier",
    type=click.Choice(["local", "remote"]),
    default="local",
    show_default=True,
    help="remote: the copy (ckptdb replicate) of the newest checkpoint that has one.",
)
@DB_URL
def latest(root: Path, stream: str, tier: str, db_url: str | None) -> None:
    """Print the path of the latest committed checkpoint (for shell scripts).

    \b
    Example:
      python train.py --resume "$(ckptdb latest runs/exp1)"
    """
    from .tiers import newest_copy

    with RunReader(root, db_url=db_url) as reader:
        found = reader.latest(stream)
        copy = newest_copy(reader.replicas("remote"), stream) if tier == "remote" else None
    if tier == "remote":
        if copy is None:
            raise click.ClickException(f"stream {stream!r} of {root} has no whole copy yet")
        click.echo(copy.location)
        return
    if found is None:
        raise click.ClickException(f"stream {stream!r} of {root} has no checkpoint yet")
    click.echo(str(found.path))


@main.command()
@ROOT
@click.option("--stream", default=None, help="Top-K stream (default: 'best' or the only one).")
@click.option(
    "--by",
    "by",
    default=None,
    metavar="NAME",
    help="Rank committed checkpoints by a recorded evaluation instead (e.g. eval/acc).",
)
@click.option(
    "--mode",
    type=click.Choice(["min", "max"]),
    default="max",
    show_default=True,
    help="With --by: whether lower or higher is better.",
)
@click.option("--evaluator", default=None, help="With --by: only this evaluator's values.")
@DB_URL
def best(
    root: Path,
    stream: str | None,
    by: str | None,
    mode: str,
    evaluator: str | None,
    db_url: str | None,
) -> None:
    """Print the paths of the top-K checkpoints, best first.

    With --by, the committed checkpoints ranked by a value an evaluator
    recorded after the fact (see ckptdb follow), best first.

    \b
    Example:
      ckptdb best runs/exp1 | head -n 1
      ckptdb best runs/exp1 --by eval/acc --mode max
    """
    if by is None and evaluator is not None:
        raise click.UsageError("--evaluator goes with --by")
    with RunReader(root, db_url=db_url) as reader:
        if by is not None:
            ranked = reader.best_by(by, mode=mode, evaluator=evaluator, stream=stream)  # type: ignore[arg-type]
            found = [ckpt for ckpt, _, _ in ranked]
            name = f"evaluation {by!r}"
        else:
            chosen = topk_stream(reader, stream)
            found, name = reader.best(chosen), f"stream {chosen!r}"
    if not found:
        raise click.ClickException(f"{name} of {root} has no checkpoint yet")
    for ckpt in found:
        click.echo(str(ckpt.path))


@main.command()
@ROOT
@DB_URL
@JSON
def pins(root: Path, db_url: str | None, as_json: bool) -> None:
    """List the pins readers hold on checkpoints (live, released or expired).

    A pinned checkpoint that retention evicted stays on disk, its state
    'deleting', until its last pin is released or expires.

    \b
    Example:
      ckptdb pins runs/exp1
    """
    from ..record import utcnow

    now = utcnow()
    with RunReader(root, db_url=db_url) as reader:
        found = reader.pins()
    rows = []
    for pin, ckpt in found:
        status = (
            "released"
            if pin.released_at is not None
            else "expired"
            if pin.expires_at <= now
            else "live"
        )
        rows.append(
            [
                pin.id,
                ckpt.stream,
                ckpt.step,
                ckpt.state,
                status,
                pin.holder,
                pin.expires_at,
                ckpt.path,
            ]
        )
    headers = ["pin", "stream", "step", "state", "lease", "holder", "expires", "path"]
    if as_json:
        click.echo(clifmt.to_json([dict(zip(headers, r, strict=True)) for r in rows]))
    else:
        click.echo(clifmt.table(headers, rows))


def tracker_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``ckptdb follow``'s options for mirroring a run into an experiment tracker."""
    options = [
        click.option(
            "--to",
            "to",
            type=click.Choice(["mlflow", "wandb"]),
            default=None,
            help="Mirror the run into this tracker instead of running a command.",
        ),
        click.option("--tracking-uri", default=None, help="With --to mlflow: the tracking URI."),
        click.option(
            "--experiment", default=None, help="With --to mlflow: the experiment (default: ckptdb)."
        ),
        click.option(
            "--artifact-location",
            default=None,
            help="With --to mlflow: where a new experiment stores artifacts.",
        ),
        click.option(
            "--model-name",
            default=None,
            help="With --to mlflow: register each checkpoint as a version of this model.",
        ),
        click.option("--project", default=None, help="With --to wandb: the W&B project."),
        click.option("--entity", default=None, help="With --to wandb: the W&B entity."),
        click.option(
            "--wandb-dir", default=None, help="With --to wandb: where W&B writes its run files."
        ),
        click.option(
            "--offline", is_flag=True, help="With --to wandb: log offline (wandb sync uploads)."
        ),
        click.option(
            "--on-evict",
            type=click.Choice(["mark", "delete"]),
            default="mark",
            show_default=True,
            help="With --to: tag an evicted checkpoint's copy, or remove it from the tracker.",
        ),
        click.option("--once", is_flag=True, help="With --to: one pass, then exit."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@main.command(context_settings={"ignore_unknown_options": True})
@ROOT
@click.argument("command", nargs=-1, required=False, type=click.UNPROCESSED)
@click.option(
    "--stream",
    "streams",
    multiple=True,
    help="Stream to follow (default: model; with --to, every stream; repeatable with --to).",
)
@click.option(
    "--since",
    type=int,
    default=None,
    metavar="ID",
    help="Start after this checkpoint id (default: after the last one this evaluator recorded).",
)
@click.option(
    "--evaluator",
    default=None,
    help="Name the results are recorded under (default: the command's name).",
)
@click.option("--ttl", type=float, default=600.0, show_default=True, help="Pin lease, seconds.")
@click.option(
    "--timeout",
    type=float,
    default=None,
    help=(
        "Stop after waiting this many seconds with no new checkpoint"
        " (time spent running the command does not count)."
    ),
)
@click.option(
    "--command-timeout",
    type=float,
    default=None,
    help="Kill an evaluation (its whole process group) after this many seconds; "
    "exit_status 124 is recorded.",
)
@click.option(
    "--poll", type=float, default=0.5, show_default=True, help="SQLite polling interval, seconds."
)
@tracker_options
@DB_URL
def follow(
    root: Path,
    command: tuple[str, ...],
    streams: tuple[str, ...],
    since: int | None,
    evaluator: str | None,
    ttl: float,
    timeout: float | None,
    command_timeout: float | None,
    poll: float,
    db_url: str | None,
    **tracking: Any,
) -> None:
    """Run a command for each new checkpoint, or mirror the run into MLflow or W&B.

    {path}, {step}, {id} and {stream} in the command are replaced. Its exit
    status is recorded as an evaluation (exit_status), and so is the JSON
    object on the last line of its output if it succeeded. Ctrl-C (or
    SIGTERM) stops it and the running evaluation; the next run continues
    after the last checkpoint it recorded. The evaluator's name (--evaluator;
    default: the command's, or its script's) is also that cursor.

    With --to mlflow (or wandb) the run is mirrored instead, into one tracker
    run however many restarts it has: its metrics, each committed checkpoint
    of the streams followed, and latest/best as the ledger has them. The
    ledger keeps the cursor: a follower restarted never logs anything twice.

    \b
    Example:
      ckptdb follow runs/exp1 -- python eval.py --ckpt {path} --step {step}
      ckptdb follow runs/exp1 --to mlflow --tracking-uri sqlite:///mlflow.db
      ckptdb follow runs/exp1 --to wandb --project my-project
    """
    from . import following

    if tracking["to"] is not None:
        if command:
            raise click.UsageError("give a COMMAND or --to, not both")
        from .tracking import mirror

        mirror(root, streams, timeout, poll, db_url, **tracking)
        return
    if not command:
        raise click.UsageError("give a COMMAND to run for each checkpoint (or --to mlflow|wandb)")
    given = [f"--{k.replace('_', '-')}" for k, v in tracking.items() if v and k != "on_evict"]
    if given or tracking["on_evict"] != "mark":
        raise click.UsageError(f"{', '.join(given) or '--on-evict'} go(es) with --to")
    if len(streams) > 1:
        raise click.UsageError("a command follows one --stream")
    stream = streams[0] if streams else "model"
    template = list(command)
    name = evaluator or following.default_evaluator(template)
    from .interrupts import Interrupts

    with Interrupts() as interrupts:  # SIGTERM stops as Ctrl-C does: cleanly
        try:
            with RunReader(root, db_url=db_url) as reader:
                following.follow(
                    reader,
                    template,
                    stream=stream,
                    since=since,
                    evaluator=name,
                    ttl=ttl,
                    timeout=timeout,
                    poll=poll,
                    echo=click.echo,
                    command_timeout=command_timeout,
                    stop=interrupts.is_set,
                )
            interrupts.raise_if_set()  # one the interpreter dropped ended the follow
        except KeyboardInterrupt:
            click.echo(
                "stopped; the next `ckptdb follow` continues where this one left off", err=True
            )
            sys.exit(130)


@main.command()
@ROOT
@click.option("--metric", required=True, help="Metric name, as given to log_metrics/save.")
@plot_option("Write a PNG of the curve (needs the 'plot' extra).")
@DB_URL
@JSON
def history(
    root: Path, metric: str, plot_file: Path | None, db_url: str | None, as_json: bool
) -> None:
    """Show a metric over steps, by attempt; optionally plot it with markers.

    \b
    Example:
      ckptdb history runs/exp1 --metric loss --plot loss.png
    """
    with RunReader(root, db_url=db_url) as reader:
        points = reader.metric_history(metric)
        if not points:
            known = ", ".join(reader.metric_names()) or "none logged"
            raise InvalidArgumentError(f"no metric {metric!r} in {root} (metrics: {known})")
        if plot_file is not None:
            from .plot import plot_history

            plot_history(reader, metric, points, plot_file)
    if as_json:
        click.echo(clifmt.to_json([{"step": s, "value": v, "attempt": a} for s, v, a in points]))
    elif plot_file is not None:
        click.echo(f"{len(points)} points of {metric} plotted to {plot_file}")
    else:
        click.echo(clifmt.table(["step", metric, "attempt"], points))


@main.command()
@ROOT
@click.argument("statement")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "csv", "json"]),
    default="table",
    show_default=True,
)
@DB_URL
def sql(root: Path, statement: str, fmt: str, db_url: str | None) -> None:
    """Run a read-only SQL query over the ledger; writes are refused.

    \b
    Example:
      ckptdb sql runs/exp1 "SELECT stream, step, rank, metric FROM best_checkpoints"
    """
    with RunReader(root, db_url=db_url) as reader:
        headers, rows = reader.sql(statement)
    if fmt == "json":
        click.echo(clifmt.to_json([dict(zip(headers, r, strict=True)) for r in rows]))
    elif fmt == "csv":
        click.echo(clifmt.to_csv(headers, rows))
    else:
        click.echo(clifmt.table(headers, rows))


def _writer(root: Path, db_url: str | None, *, remote: str | None = None) -> Any:
    from ..maintenance import require_run
    from ..manager import CheckpointManager

    require_run(root, db_url)
    return CheckpointManager(root, db_url=db_url, maintenance=True, remote=remote)


@main.command()
@ROOT
@click.option("--dry-run", is_flag=True, help="Only report what would be repaired.")
@click.option("--verify", is_flag=True, help="Re-hash every committed file.")
@DB_URL
@JSON
def reconcile(root: Path, dry_run: bool, verify: bool, db_url: str | None, as_json: bool) -> None:
    """Compare the ledger with the disk and repair; print the report.

    \b
    Example:
      ckptdb reconcile runs/exp1 --verify
    """
    with _writer(root, db_url) as mgr:
        report = _with_progress(
            verify,
            lambda progress: mgr.reconcile(verify=verify, dry_run=dry_run, progress=progress),
        )
    if as_json:
        click.echo(
            clifmt.to_json(
                {
                    "dry_run": report.dry_run,
                    "counts": report.counts,
                    "actions": [vars(a) for a in report.actions],
                }
            )
        )
    else:
        click.echo(str(report))
    if report.failures:
        sys.exit(1)


def _with_progress(show: bool, work: Callable[[Callable[[int, int], None] | None], Any]) -> Any:
    if not show:
        return work(None)
    state: dict[str, Any] = {}

    def progress(done: int, total: int) -> None:
        if "bar" not in state:
            state["bar"] = click.progressbar(length=total, label="verifying", file=sys.stderr)
            state["bar"].__enter__()
        state["bar"].update(1)

    try:
        return work(progress)
    finally:
        if "bar" in state:
            state["bar"].__exit__(None, None, None)


@main.command()
@ROOT
@click.option(
    "--load",
    "load_files",
    is_flag=True,
    help="Also unpickle every committed file (weights_only=True).",
)
@click.option(
    "--remote",
    metavar="URL",
    default=None,
    help="Where a replicator copies the run: also report the objects failed copies left there.",
)
@DB_URL
def check(root: Path, load_files: bool, remote: str | None, db_url: str | None) -> None:
    """Check the run's consistency invariants; exit 1 and one line per violation.

    \b
    Example:
      ckptdb check runs/exp1 --load
    """
    if load_files or remote is not None:  # unpickling needs torch; a remote, the manager's tier
        with _writer(root, db_url, remote=remote) as mgr:
            problems = mgr.check(load=load_files)
    else:
        from ..maintenance import require_run

        require_run(root, db_url)  # a mistyped root: "no ckptdb run at", and nothing created
        with RunReader(root, db_url=db_url) as reader:
            problems = reader.check()
    for problem in problems:
        click.echo(problem)
    if problems:
        raise click.ClickException(f"{len(problems)} violation(s) in {root}")
    click.echo(f"{root}: consistent")


@main.command()
@ROOT
@DB_URL
def gc(root: Path, db_url: str | None) -> None:
    """Apply the stored retention policies now (e.g. after lowering keep-last).

    \b
    Example:
      ckptdb gc runs/exp1
    """
    with _writer(root, db_url) as mgr:
        evicted = mgr.gc()
    for ckpt in evicted:
        click.echo(f"evicted {ckpt.stream} step {ckpt.step}: {ckpt.path}")
    click.echo(f"{len(evicted)} checkpoint(s) evicted")


_ADOPT_HELP = """Register the checkpoints of an existing run in a new or existing ledger.

    \b
    Example:
      ckptdb adopt runs/exp/checkpoints --layout lightning --dry-run

    Every complete checkpoint ROOT holds is hashed (size and hash, as a save
    records them) and committed with its step and the metrics its framework
    stored. Partial or unreadable ones are listed and skipped, never deleted.
    One line per checkpoint (adopted, already, skipped: why), then a summary.
    Running it again adopts nothing and changes nothing. No file changes,
    except with --move and DeePMD's aliases.

    \b
    Layouts: ROOT; where the ledger goes (the integration's place); stream
{layouts}

    A stream adopt creates keeps everything (keep all). Adopting only appends
    steps after a stream's newest and never evicts: a checkpoint that a
    stream's stored policy would not hold now (a full top-K) is skipped, as is
    one lacking the metric a top-K stream ranks by. Details: docs/api.md.
    """


class _LayoutsHelp(click.Command):
    """``adopt``: its help lists the layouts, made only when shown. Finding the layouts
    imports every integration's layout module, and through them torch, which no other
    command needs: a read-only command stays a fraction of a second."""

    @property
    def help(self) -> str:
        from ..integrations.layouts import help_table

        return _ADOPT_HELP.format(layouts=help_table(indent=6, width=92))

    @help.setter
    def help(self, value: str | None) -> None:
        """Click sets it from the docstring; the help is always _ADOPT_HELP's."""


@main.command(cls=_LayoutsHelp)
@click.argument("root", type=click.Path(path_type=Path))  # a file or nothing: adopt says so
@click.option(
    "--layout",
    required=True,
    metavar="LAYOUT",
    help="Whose checkpoints ROOT holds: one of the layouts listed above.",
)
@click.option(
    "--pattern",
    default=None,
    help="glob layout: the checkpoints, relative to ROOT (e.g. 'ckpt_*.pt', 'old/**/*.pt').",
)
@click.option(
    "--step-regex",
    default=None,
    metavar="REGEX",
    help="glob layout: the step is this regex's group (its only one, or the one named "
    "'step') in the file name. Default: the name's first integer.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Only report what would be done; write nothing, create no ledger.",
)
@click.option(
    "--move",
    is_flag=True,
    help="Move checkpoints outside the run's save directory into it, under their own "
    "names (a rename: same filesystem only). Without it they are skipped.",
)
@DB_URL
def adopt(
    root: Path,
    layout: str,
    pattern: str | None,
    step_regex: str | None,
    dry_run: bool,
    move: bool,
    db_url: str | None,
) -> None:
    """Adopt a run (the help text is generated from the layouts' registry: _ADOPT_HELP)."""
    from ..integrations.adopt import AdoptReport
    from ..integrations.adopt import adopt as adopt_run

    base = root.resolve()
    verbs = {"adopted": "would adopt" if dry_run else "adopted", "already": "already"}

    def show(outcome: Any) -> None:
        source = outcome.candidate.source
        shown = source.relative_to(base) if source.is_relative_to(base) else source
        if outcome.status == "skipped":
            click.echo(f"{'skipped':<12} {shown}: {outcome.detail}")
        else:
            click.echo(f"{verbs[outcome.status]:<12} {shown}  ({outcome.detail})")

    result: AdoptReport = adopt_run(
        root,
        layout,
        pattern=pattern,
        step_regex=step_regex,
        dry_run=dry_run,
        move=move,
        db_url=db_url,
        report=show,
    )
    for change in result.aliases:
        click.echo(f"{'would point' if dry_run else 'pointed':<12} {change}")
    counts = (
        f"{result.count('adopted')} {'to adopt' if dry_run else 'adopted'}, "
        f"{result.count('already')} already in the ledger, {result.count('skipped')} skipped"
    )
    if dry_run:
        click.echo(f"dry run: {counts}; nothing was written (ledger: {result.ledger})")
    else:
        click.echo(f"{counts} (ledger: {result.ledger})")


@main.group()
def db() -> None:
    """Show or run ledger migrations.

    \b
    Example:
      ckptdb db current runs/exp1
    """


@db.command()
@ROOT
@DB_URL
def upgrade(root: Path, db_url: str | None) -> None:
    """Migrate the ledger to this ckptdb's schema (under the writer lock).

    \b
    Example:
      ckptdb db upgrade runs/exp1
    """
    from ..maintenance import upgrade as migrate

    root = root.resolve()
    migrate(root, db_url)
    click.echo(f"{root}: ledger at schema {_current(root, db_url)}")


@db.command()
@ROOT
@DB_URL
def current(root: Path, db_url: str | None) -> None:
    """Print the ledger's schema revision and this ckptdb's newest one.

    \b
    Example:
      ckptdb db current runs/exp1
    """
    from ..maintenance import newest_revision

    head = newest_revision()
    click.echo(f"ledger {_current(root.resolve(), db_url)}; newest known {head}")


def _current(root: Path, db_url: str | None) -> str:
    from ..maintenance import schema_revisions

    return ", ".join(schema_revisions(root, db_url)) or "none"


@main.command()
@click.argument(
    "directory",
    required=False,
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("runs/demo"),
)
@click.option("--steps", default=300, show_default=True, help="Training steps.")
@click.option(
    "--fresh/--keep",
    default=True,
    show_default=True,
    help="Start from an empty directory (removes a previous demo run there).",
)
def demo(directory: Path, steps: int, fresh: bool) -> None:
    """Train a small model with ckptdb: guard trip, crash, restart, report.

    \b
    Example:
      ckptdb demo runs/demo
    """
    from .demo import BEST_SQL, run_demo

    run_demo(directory, steps=steps, fresh=fresh)
    click.echo("")
    status.main([str(directory)], standalone_mode=False)
    click.echo("\nwhich checkpoint is best, and how many restarts did it take?\n")
    click.echo(BEST_SQL + ";\n")
    with RunReader(directory) as reader:
        headers, rows = reader.sql(BEST_SQL)
    click.echo(clifmt.table(headers, rows))
    click.echo(f"\nnext: {demo_hint(directory)}")


def demo_hint(directory: Path) -> str:
    """The command the demo suggests next: one that runs on the install the demo ran on.

    ``--plot`` needs matplotlib (the ``plot`` extra), which the README's first
    command does not install, so without it the hint is the table form and says
    how to get the plot.
    """
    if importlib.util.find_spec("matplotlib") is not None:
        return f"ckptdb history {directory} --metric loss --plot loss.png"
    return (
        f"ckptdb history {directory} --metric loss"
        "   (pip install -e '.[plot]' in a checkout, or 'ckptdb[plot]', to add --plot loss.png)"
    )


# registers replicate, restore, goodput and export on main (they use the options above)
from . import export, goodput, tiers  # noqa: E402

__all__ = ["export", "goodput", "main", "tiers"]
