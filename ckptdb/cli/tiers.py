"""``ckptdb replicate`` and ``ckptdb restore``: a run's second tier on object storage.

Registered on the ``ckptdb`` group when the package loads (see ``__init__``);
the work is :class:`~ckptdb.replication.Replicator`'s and
:meth:`~ckptdb.CheckpointManager.restore`'s.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Literal

import click

from .. import textout as clifmt
from ..errors import InvalidArgumentError
from ..location import is_object_url
from ..policies import Keep, Policy, TopK
from ..record import Checkpoint, Replica
from . import DB_URL, JSON, ROOT, _writer, main

FAILED = "failed"


@main.command()
@ROOT
@click.option("--to", "to", metavar="URL", help="Where the copies go: s3://bucket/prefix.")
@click.option(
    "--stream", "streams", multiple=True, help="Only this stream (repeatable; default: all)."
)
@click.option(
    "--keep",
    "keep",
    multiple=True,
    metavar="STREAM:RULES",
    help="How long a stream's copies stay on the remote tier (repeatable; default: every "
    "copy), e.g. model:last=10 or best:best=3,metric=loss,last=10 (see docs/replication.md).",
)
@click.option("--follow", is_flag=True, help="Keep copying new checkpoints until interrupted.")
@click.option(
    "--poll",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Seconds between passes (--follow).",
)
@click.option(
    "--retry-failed",
    is_flag=True,
    help="The first pass also tries again the checkpoints whose copies failed 3 times.",
)
@click.option(
    "--detach",
    is_flag=True,
    help="Stop replicating the run instead: local retention stops waiting for copies.",
)
@click.option(
    "--ledger-interval",
    type=click.FloatRange(min=0, min_open=True),
    default=60.0,  # ledgercopy.DEFAULT_INTERVAL (compared in tests/test_ledger_replica.py)
    show_default=True,
    help="A SQLite ledger is copied too: at most this often (seconds) while only metrics "
    "change, at once after a pass that copied a checkpoint.",
)
@DB_URL
@JSON
def replicate(
    root: Path,
    to: str | None,
    streams: tuple[str, ...],
    keep: tuple[str, ...],
    follow: bool,
    poll: float,
    retry_failed: bool,
    detach: bool,
    ledger_interval: float,
    db_url: str | None,
    as_json: bool,
) -> None:
    """Copy each committed checkpoint to object storage, once (a second tier).

    Beside a running trainer; one replicator per run at a time. From the first
    run on, local retention keeps an evicted checkpoint of a copied stream until
    its copy is whole (--detach ends that). Exits 1 if a copy failed (it is
    retried by the next pass, at most 3 times in all).

    \b
    Example:
      ckptdb replicate runs/exp1 --to s3://bucket/replicas --keep model:last=10 --follow
    """
    if detach:
        options: dict[str, object] = {
            "--to": to,
            "--stream": streams,
            "--keep": keep,
            "--follow": follow,
            "--retry-failed": retry_failed,
        }
        given = [name for name, value in options.items() if value]
        if given:
            raise click.UsageError(f"--detach takes none of {', '.join(given)}")
        from ..replication import detach as detach_tier

        released = detach_tier(root, db_url=db_url)
        click.echo(f"detached: {released} local file(s) no longer wait for their copy")
        return
    if to is None:
        raise click.UsageError("--to is required (or --detach)")
    policies = {}
    for stream, policy in map(parse_keep, keep):
        if stream in policies:
            raise InvalidArgumentError(f"--keep names stream {stream!r} twice")
        policies[stream] = policy
    from ..replication import Replicator  # the manager's (torch): only a copy needs it

    stop = threading.Event()
    failed = False
    with Replicator(
        root,
        to,
        db_url=db_url,
        streams=streams or None,
        keep=policies,
        ledger_interval=ledger_interval,
    ) as replicator:
        _show([*replicator.swept], as_json)

        def stopping(*_: object) -> None:  # after the copy in progress
            stop.set()
            replicator.stop()

        previous = {s: signal.signal(s, stopping) for s in _SIGNALS} if follow else {}
        try:
            retry = retry_failed
            while True:
                done = replicator.replicate(retry_failed=retry)
                retry = False
                failed = failed or any(r.state == FAILED for r in done)
                _show(done + replicator.expired, as_json)
                if not follow or stop.wait(poll):
                    break
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
    if failed:
        sys.exit(1)


def parse_keep(spec: str) -> tuple[str, Policy]:
    """``STREAM:RULES`` as a remote policy: ``last=N``, ``every=N`` (a Keep), or
    ``best=K,metric=NAME[,mode=max][,last=N]`` (a TopK)."""
    stream, sep, rules = spec.partition(":")
    pairs = [part.partition("=") for part in rules.split(",")] if rules else []
    if not sep or not stream or not pairs or any(not k or not eq or not v for k, eq, v in pairs):
        raise InvalidArgumentError(
            f"--keep {spec!r}: expected STREAM:RULE=VALUE[,...], e.g. model:last=10"
        )
    values = {k.strip(): v.strip() for k, _, v in pairs}
    if len(values) != len(pairs):
        raise InvalidArgumentError(f"--keep {spec!r}: a rule is given twice")
    unknown = sorted(set(values) - {"last", "every", "best", "metric", "mode"})
    if unknown:
        raise InvalidArgumentError(
            f"--keep {spec!r}: unknown rule {unknown[0]!r} (last, every, best, metric, mode)"
        )
    numbers = {}
    for key in ("last", "every", "best"):
        if key in values:
            if not re.fullmatch(r"[0-9]+", values[key]):
                raise InvalidArgumentError(f"--keep {spec!r}: {key} must be a positive int")
            numbers[key] = int(values[key])
    if "best" in values or "metric" in values:
        if "metric" not in values or "best" not in values or "every" in values:
            raise InvalidArgumentError(
                f"--keep {spec!r}: best=K needs metric=NAME (and takes last=N, not every)"
            )
        if values.get("mode", "min") not in ("min", "max"):
            raise InvalidArgumentError(f"--keep {spec!r}: mode must be min or max")
        mode: Literal["min", "max"] = "max" if values.get("mode") == "max" else "min"
        best = TopK(numbers["best"], values["metric"], mode, last=numbers.get("last"))
        return stream, best
    if "mode" in values:
        raise InvalidArgumentError(f"--keep {spec!r}: mode goes with best=K,metric=NAME")
    if "last" not in numbers:  # every=N alone would keep every copy: not what it says
        raise InvalidArgumentError(f"--keep {spec!r}: every=N goes with last=N")
    return stream, Keep(last=numbers.get("last"), every=numbers.get("every"))


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _show(done: list[Replica], as_json: bool) -> None:
    if not done:
        return
    if as_json:
        for r in done:
            click.echo(clifmt.to_json(_replica_dict(r)))
        return
    click.echo(clifmt.table(["stream", "step", "state", "copy"], [_replica_row(r) for r in done]))


def _replica_row(r: Replica) -> list[Any]:
    return [r.stream, r.step, r.state, r.error if r.state == FAILED else r.location]


def _replica_dict(r: Replica) -> dict[str, Any]:
    return {
        "stream": r.stream,
        "step": r.step,
        "tier": r.tier,
        "state": r.state,
        "location": r.location,
        "size": r.size,
        "hash": r.hash,
        "error": r.error,
    }


@main.command()
@click.argument("first", metavar="ROOT | URL")
@click.argument("target", metavar="[DIR]", required=False, type=click.Path(path_type=Path))
@click.option(
    "--from",
    "source",
    metavar="URL",
    help="Where the copies are (the URL given to ckptdb replicate --to), for a run whose "
    "ledger is here (ROOT, or --db-url).",
)
@click.option(
    "--run",
    "run",
    metavar="NAME",
    help="With URL DIR: the run to bring back, when URL holds the ledgers of several.",
)
@click.option(
    "--all", "every", is_flag=True, help="Every checkpoint with a copy, not only the newest."
)
@DB_URL
@JSON
def restore(
    first: str,
    target: Path | None,
    source: str | None,
    run: str | None,
    every: bool,
    db_url: str | None,
    as_json: bool,
) -> None:
    """Bring a run back from its copies: a lost machine, a corrupt local copy.

    URL DIR: a new machine. The newest sound copy of the run's SQLite ledger
    and the newest whole copy of every stream come back into DIR (new or
    empty); checkpoints whose copy never completed are marked lost. Then train
    with CheckpointManager(DIR, remote=URL).

    ROOT --from URL: the run's ledger is here (ROOT's, or --db-url); the newest
    checkpoint of each stream with a whole copy is downloaded, verified and put
    in place if its local copy is missing or damaged.

    \b
    Example:
      ckptdb restore s3://bucket/replicas runs/exp1
      ckptdb restore runs/exp1 --from s3://bucket/replicas --db-url postgresql+psycopg://db/ckpt
    """
    if is_object_url(first):
        if target is None:
            raise click.UsageError("ckptdb restore URL DIR: DIR is missing")
        if source is not None:
            raise click.UsageError("ckptdb restore URL DIR takes no --from")
        if db_url is not None:
            raise click.UsageError(
                "ckptdb restore URL DIR brings back a SQLite ledger; with --db-url (or "
                "CKPTDB_DB_URL) the ledger is elsewhere: ckptdb restore ROOT --from URL"
            )
        from ..recovery import restore_run

        outcome = restore_run(first, target, run=run, every=every)
        _show_restored(outcome.restored, as_json)
        if not as_json:
            ledger = outcome.ledger
            click.echo(
                f"ledger: the copy of {ledger.run} made at {ledger.copied_at} ({ledger.location}); "
                f"{outcome.lost} committed checkpoint(s) had no whole copy and are lost"
            )
        return
    if target is not None or run is not None:
        raise click.UsageError("DIR and --run go with a URL: ckptdb restore URL DIR")
    if source is None:
        raise click.UsageError("ckptdb restore ROOT needs --from URL (or: ckptdb restore URL DIR)")
    root = Path(first)
    with _writer(root, db_url) as mgr:
        restored = mgr.restore(source, every=every)
    _show_restored(restored, as_json)


def _show_restored(restored: list[Checkpoint], as_json: bool) -> None:
    if as_json:
        click.echo(clifmt.to_json([clifmt.checkpoint_dict(c) for c in restored]))
        return
    if not restored:
        click.echo("nothing restored: no copy, or each newest copy's checkpoint is whole here")
        return
    click.echo(clifmt.table(["stream", "step", "path"], [_restored_row(c) for c in restored]))


def _restored_row(c: Checkpoint) -> list[Any]:
    return [c.stream, c.step, str(c.path)]


def newest_copy(replicas: list[Replica], stream: str) -> Replica | None:
    """The copy of the newest checkpoint of ``stream`` that has a whole one."""
    whole = [r for r in replicas if r.stream == stream and r.state == "replicated"]
    return max(whole, key=lambda r: r.checkpoint_id, default=None)
