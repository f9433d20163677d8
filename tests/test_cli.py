"""The ``ckptdb`` command line.

Most tests drive the click group in-process through ``CliRunner``; a few run
the installed console script as a real subprocess (a shell's view: exit status,
stdout, stderr). Every command is checked on its happy path and, mostly, on
its failure paths: one line on stderr and exit 1 (never a traceback unless
``--debug``), exit 2 for usage errors, and a ledger that no reader and no
refused statement changes.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shlex
import sqlite3
import struct
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import click
import pytest
import torch
from click.testing import CliRunner, Result
from helpers import cli_subprocess, files, invoke, rows, sha256, state

import ckptdb.ledger.boundary_rows
import ckptdb.ledger.rows
from ckptdb import CheckpointManager, Keep, TopK, cli
from ckptdb.cli import main
from ckptdb.errors import CkptDBError, PublishError

Opener = Callable[..., CheckpointManager]

# Every command, read from the click group (a new command cannot be forgotten): the
# top-level names, and every path to a command, through a group (`db upgrade`) too.
COMMANDS = tuple(sorted(main.commands))
COMMAND_PATHS = sorted(
    [(name,) for name in main.commands]
    + [
        (name, sub)
        for name, command in main.commands.items()
        if isinstance(command, click.Group)
        for sub in command.commands
    ]
)
STREAMS = {"model": Keep(last=3), "ema": Keep(last=2), "best": TopK(3, "val_loss")}
VAL_LOSS = [3.0, 1.0, 4.0, 0.5, 2.0]  # steps 0..4; top-3 afterwards: steps 3, 1, 4
BEST_ORDER = [3, 1, 4]
ORPHAN = "model/step-000000099.pt"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("no_db_url_from_environment")


# --------------------------------------------------------------------- helpers


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    return result


def one_line_error(result: Result, code: int = 1) -> str:
    """Exit ``code``, no traceback, exactly one non-empty line on stderr, nothing on stdout."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception  # handled, not a crash
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert result.stdout.strip() == ""
    return lines[0]


def save_dir_of(root: Path) -> Path:
    return Path(rows(root, "SELECT save_dir FROM runs")[0][0])


def path_of(root: Path, stream: str, step: int, state_: str = "committed") -> Path:
    found = rows(
        root,
        "SELECT path FROM checkpoints WHERE stream = ? AND step = ? AND state = ? ORDER BY id",
        stream,
        step,
        state_,
    )
    assert len(found) == 1, found
    return save_dir_of(root) / found[0][0]


def checkpoint_rows(root: Path) -> list[tuple[Any, ...]]:
    return rows(
        root,
        "SELECT id, stream, step, state, path, size, hash, error, deleted_at "
        "FROM checkpoints ORDER BY id",
    )


def states(root: Path, stream: str) -> dict[int, str]:
    return dict(
        rows(root, "SELECT step, state FROM checkpoints WHERE stream = ? ORDER BY id", stream)
    )


def ledger_image(root: Path) -> dict[str, Any]:
    """The whole ledger through a read-only connection: schema, every row, journal mode."""
    con = sqlite3.connect(f"file:{root / 'ckptdb.sqlite'}?mode=ro", uri=True)
    try:
        schema = con.execute(
            "SELECT type, name, sql FROM sqlite_master ORDER BY type, name"
        ).fetchall()
        tables = [name for kind, name, _ in schema if kind == "table"]
        image: dict[str, Any] = {
            "schema": schema,
            "journal_mode": con.execute("PRAGMA journal_mode").fetchone(),
            "user_version": con.execute("PRAGMA user_version").fetchone(),
        }
        for table in tables:
            image[table] = sorted(con.execute(f'SELECT * FROM "{table}"').fetchall(), key=repr)
            image[f"count:{table}"] = con.execute(f'SELECT COUNT(*) FROM "{table}"').fetchone()
        return image
    finally:
        con.close()


def refuse_save(*args: Any, **kwargs: Any) -> None:
    raise OSError(28, "No space left on device (injected)")


def build_run(root: Path) -> Path:
    """Five boundaries of three streams, loss logged each step, then one failed save.

    Afterwards: model 2,3,4 committed (0,1 deleted), ema 3,4 committed, best
    3,1,4 (best first; 0 and 2 deleted), model 5 aborted; one closed attempt.
    """
    with CheckpointManager(root, streams=STREAMS) as mgr:
        for step, val in enumerate(VAL_LOSS):
            mgr.log_metrics(step, {"loss": 10.0 - step})
            mgr.save(
                step,
                metrics={"val_loss": val},
                model=state(step),
                ema=state(step + 0.5),
                best=state(step + 0.25),
            )
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "save", refuse_save)
            with pytest.raises(PublishError):
                mgr.save(5, model=state(5))
    return root


@pytest.fixture
def run(root: Path) -> Path:
    return build_run(root)


# ------------------------------------------------------------------ --help


def test_main_help_lists_every_command_with_a_description(runner: CliRunner) -> None:
    result = ok(invoke(runner, "--help"))
    assert "Example" in result.output
    listed = result.output.split("Commands:", 1)[1].splitlines()
    for name in COMMANDS:
        line = next((ln for ln in listed if ln.split()[:1] == [name]), None)
        assert line is not None, f"{name} missing from ckptdb --help"
        assert len(line.split()) > 1, f"{name} has no one-line description"


@pytest.mark.parametrize("path", COMMAND_PATHS, ids=" ".join)
def test_every_command_help_has_a_description_and_an_example(
    runner: CliRunner, path: tuple[str, ...]
) -> None:
    result = ok(invoke(runner, *path, "--help"))
    assert "Usage:" in result.output
    assert "Example" in result.output, f"`ckptdb {' '.join(path)} --help` shows no example"


def test_db_group_has_upgrade_and_current(runner: CliRunner) -> None:
    result = ok(invoke(runner, "db", "--help"))
    assert "upgrade" in result.output
    assert "current" in result.output


# -------------------------------------------------------- errors and usage


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["latest"],
        ["sql", "{root}"],
        ["sql", "{root}", "SELECT 1", "--format", "xml"],
        ["history", "{root}"],
        ["list", "{root}", "--bogus"],
        ["no-such-command"],
        ["status", "{file}"],
        ["demo", "{root}", "--steps", "many"],
    ],
    ids=lambda a: " ".join(a),
)
def test_usage_errors_exit_2(runner: CliRunner, run: Path, tmp_path: Path, args: list[str]) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    before = checkpoint_rows(run)
    result = invoke(runner, *(a.format(root=run, file=a_file) for a in args))
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Usage:" in result.output
    assert "Traceback" not in result.output
    assert checkpoint_rows(run) == before


READ_COMMANDS = [
    ["status"],
    ["status", "--json"],
    ["list"],
    ["list", "--all"],
    ["latest"],
    ["best"],
    ["best", "--by", "eval/acc"],
    ["pins"],
    ["history", "--metric", "loss"],
    ["sql", "SELECT 1"],
    ["goodput"],
    ["goodput", "--json"],
    ["db", "current"],
]
WRITE_COMMANDS = [
    ["reconcile"],
    ["reconcile", "--dry-run"],
    ["gc"],
    ["db", "upgrade"],
    ["check"],  # reads under the writer lock (a trainer holding it is named)
    ["restore", "--from", "s3://ckpt/nowhere"],  # the lock is taken before the store is reached
]
# Commands deliberately left out of the parametrized tests of READ_COMMANDS and
# WRITE_COMMANDS (a directory that is not a run, a trainer holding the lock), and why.
NOT_RUN_ON_A_RUN = {
    ("demo",): "creates its own run (--fresh removes a previous one): tested end to end below",
    ("db",): "a group: its commands (db upgrade, db current) are in the lists",
    ("adopt",): "takes a framework's checkpoint directory (its ledger may not exist yet): "
    "tests/test_adopt.py covers it, bad input and a trainer holding the lock included",
    ("follow",): "runs a command per checkpoint and records evaluations (a reader's own rows): "
    "tests/test_evaluations.py covers it end to end, with a trainer running and Ctrl-C",
    ("export",): "writes a directory outside the run and records it (a reader's own rows): "
    "tests/test_export.py covers it, a directory that is not a run and a trainer included",
    ("replicate",): "copies to object storage beside a trainer (a reader's own rows): "
    "tests/test_replication.py covers it against SeaweedFS, bad input included",
}


def test_every_command_is_read_write_or_excluded_with_a_reason() -> None:
    """A new command must join READ_COMMANDS or WRITE_COMMANDS (or say why not)."""
    listed = {tuple(args[: 2 if args[0] == "db" else 1]) for args in READ_COMMANDS + WRITE_COMMANDS}
    assert not listed & set(NOT_RUN_ON_A_RUN)
    assert listed | set(NOT_RUN_ON_A_RUN) == set(COMMAND_PATHS)


def _with_root(args: list[str], root: Path) -> list[str]:
    """Insert ROOT after the command name (after both words of ``db current``)."""
    n = 2 if args[0] == "db" else 1
    return [*args[:n], str(root), *args[n:]]


@pytest.mark.parametrize("where", ["empty", "missing", "other_files"])
@pytest.mark.parametrize("args", READ_COMMANDS + WRITE_COMMANDS, ids=lambda a: " ".join(a))
def test_a_directory_that_is_not_a_run_is_one_line_and_untouched(
    runner: CliRunner, tmp_path: Path, args: list[str], where: str
) -> None:
    target = tmp_path / "not_a_run"
    if where != "missing":
        target.mkdir()
    if where == "other_files":
        (target / "notes.txt").write_text("keep me")
        (target / "data").mkdir()
    before = files(tmp_path)
    line = one_line_error(invoke(runner, *_with_root(args, target)))
    assert str(target) in line or target.name in line
    assert files(tmp_path) == before  # no ledger, lock or directory created
    assert target.exists() == (where != "missing")


READERS_OF_A_LEDGER = [
    ["status"],
    ["latest"],
    ["sql", "SELECT 1"],
    ["history", "--metric", "x"],
    ["goodput"],
]


@pytest.mark.parametrize(
    ("content", "args"),
    [
        *((b"this is not a database" * 100, a) for a in (*READERS_OF_A_LEDGER, ["db", "current"])),
        # an empty file is an empty SQLite database: no run (`db current` says "none")
        *((b"", a) for a in READERS_OF_A_LEDGER),
    ],
    ids=lambda v: "empty" if v == b"" else "garbage" if isinstance(v, bytes) else " ".join(v),
)
def test_a_broken_ledger_file_is_one_line(
    runner: CliRunner, root: Path, content: bytes, args: list[str]
) -> None:
    root.mkdir()
    (root / "ckptdb.sqlite").write_bytes(content)
    one_line_error(invoke(runner, *_with_root(args, root)))
    assert (root / "ckptdb.sqlite").read_bytes() == content


@pytest.mark.parametrize(
    "args",
    [
        ["latest", "--stream", "nope"],
        ["best", "--stream", "nope"],
        ["list", "--stream", "nope"],
        ["best", "--stream", "model"],  # a Keep stream has no top-K
    ],
    ids=lambda a: " ".join(a),
)
def test_unknown_or_wrong_stream_is_one_line(runner: CliRunner, run: Path, args: list[str]) -> None:
    line = one_line_error(invoke(runner, args[0], run, *args[1:]))
    assert args[-1] in line


def test_debug_lets_the_exception_propagate(runner: CliRunner, tmp_path: Path) -> None:
    plain = invoke(runner, "status", tmp_path)
    one_line_error(plain)
    debug = invoke(runner, "--debug", "status", tmp_path)
    assert debug.exit_code == 1
    assert isinstance(debug.exception, CkptDBError), debug.exception
    assert str(tmp_path) in str(debug.exception)


def test_subprocess_errors_are_one_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    plain = cli_subprocess("latest", tmp_path)
    assert plain.returncode == 1, plain
    assert plain.stdout == ""
    assert "Traceback" not in plain.stderr
    assert len(plain.stderr.strip().splitlines()) == 1, plain.stderr
    debug = cli_subprocess("--debug", "latest", tmp_path)
    assert debug.returncode != 0
    assert "Traceback" in debug.stderr
    assert str(tmp_path) in debug.stderr


def test_subprocess_latest_prints_just_the_path_for_the_shell(run: Path, tmp_path: Path) -> None:
    result = cli_subprocess("latest", run, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{path_of(run, 'model', 4)}\n"


# ------------------------------------------------------------------ status


def test_status_table_shows_streams_latest_topk_states_attempts_events(
    runner: CliRunner, run: Path
) -> None:
    out = ok(invoke(runner, "status", run)).output
    lines = out.splitlines()
    for stream, policy, latest in [
        ("model", "keep last 3", 4),
        ("ema", "keep last 2", 4),
        ("best", "top-3 by val_loss (min)", 4),
    ]:
        line = next(ln for ln in lines if ln.split()[:1] == [stream])
        assert policy in line
        assert str(latest) in line.replace(policy, "")
    for step in BEST_ORDER:
        assert str(path_of(run, "best", step)) in out
    assert out.index(str(path_of(run, "best", 3))) < out.index(str(path_of(run, "best", 1)))
    assert out.index(str(path_of(run, "best", 1))) < out.index(str(path_of(run, "best", 4)))
    assert "8 committed" in out
    assert "7 deleted" in out
    assert "1 aborted" in out
    assert "closed" in out  # the attempt
    assert "attempt_started" in out  # an event
    assert "\x1b[" not in out


def test_status_json(runner: CliRunner, run: Path) -> None:
    data = json.loads(ok(invoke(runner, "status", run, "--json")).stdout)
    assert data["run"] == run.name
    streams = {s["name"]: s for s in data["streams"]}
    assert set(streams) == {"model", "ema", "best"}
    assert streams["model"]["policy"] == "keep last 3"
    assert streams["best"]["policy"] == "top-3 by val_loss (min)"
    assert streams["model"]["latest_step"] == 4
    assert streams["model"]["latest_path"] == str(path_of(run, "model", 4))
    assert {n: s["committed"] for n, s in streams.items()} == {"model": 3, "ema": 2, "best": 3}
    assert [c["step"] for c in data["best"]["best"]] == BEST_ORDER
    assert [c["metric"] for c in data["best"]["best"]] == [VAL_LOSS[s] for s in BEST_ORDER]
    assert data["states"] == {"committed": 8, "deleted": 7, "aborted": 1}
    assert [(a["end_state"], a["kind"], a["pid"]) for a in data["attempts"]] == [
        ("closed", "train", os.getpid())
    ]
    kinds = [e["kind"] for e in data["events"]]
    assert "attempt_started" in kinds
    assert "publish_failed" in kinds


def test_status_of_a_run_with_no_checkpoints(runner: CliRunner, root: Path) -> None:
    CheckpointManager(root, streams=STREAMS).close()
    data = json.loads(ok(invoke(runner, "status", root, "--json")).stdout)
    assert all(s["latest_step"] is None and s["committed"] == 0 for s in data["streams"])
    assert data["states"] == {}
    ok(invoke(runner, "status", root))


# -------------------------------------------------------------------- list


def _listed(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines()[1:] if line.strip()]


def test_list_shows_committed_checkpoints_aligned(runner: CliRunner, run: Path) -> None:
    out = ok(invoke(runner, "list", run)).output
    got = {(r[0], int(r[1]), r[2]) for r in _listed(out)}
    expected = {
        (s, step, "committed")
        for s, step in rows(run, "SELECT stream, step FROM checkpoints WHERE state = 'committed'")
    }
    assert got == expected
    header, *body = out.splitlines()
    column = header.index("path")
    assert all(line[column] == "/" for line in body), out  # paths start in one column


def test_list_all_shows_aborted_and_deleted_rows(runner: CliRunner, run: Path) -> None:
    out = ok(invoke(runner, "list", run, "--all")).output
    got = sorted((r[0], int(r[1]), r[2]) for r in _listed(out))
    assert got == sorted(rows(run, "SELECT stream, step, state FROM checkpoints"))
    assert ("model", 5, "aborted") in got
    assert ("model", 0, "deleted") in got


@pytest.mark.parametrize("all_states", [False, True])
@pytest.mark.parametrize("stream", ["model", "ema", "best"])
def test_list_stream_json(runner: CliRunner, run: Path, stream: str, all_states: bool) -> None:
    args = ["list", run, "--stream", stream, "--json"] + (["--all"] if all_states else [])
    data = json.loads(ok(invoke(runner, *args)).stdout)
    where = "" if all_states else " AND state = 'committed'"
    expected = rows(
        run, f"SELECT step, state, size, hash FROM checkpoints WHERE stream = ?{where}", stream
    )
    assert sorted((d["step"], d["state"], d["size"], d["hash"]) for d in data) == sorted(expected)
    assert {d["stream"] for d in data} == {stream}
    for d in data:
        if d["state"] == "committed":
            assert Path(d["path"]).is_file()
            assert Path(d["path"]).stat().st_size == d["size"]


# ---------------------------------------------------------- latest and best


@pytest.mark.parametrize("stream", ["model", "ema", "best"])
def test_latest_prints_just_the_path(runner: CliRunner, run: Path, stream: str) -> None:
    args = ["latest", run] if stream == "model" else ["latest", run, "--stream", stream]
    result = ok(invoke(runner, *args))
    assert result.stdout == f"{path_of(run, stream, 4)}\n"
    assert result.stderr == ""


def test_latest_follows_publication_not_the_highest_step(
    runner: CliRunner, root: Path, open_manager: Opener
) -> None:
    mgr = open_manager(streams={"model": Keep(last=5)})
    for step in (0, 5, 9):
        mgr.save(step, model=state(step))
    published = mgr.save(3, model=state(33))["model"].path  # a rollback: 5 and 9 superseded
    mgr.close()
    assert ok(invoke(runner, "latest", root)).stdout == f"{published}\n"


def test_best_prints_topk_paths_best_first(runner: CliRunner, run: Path) -> None:
    result = ok(invoke(runner, "best", run))
    assert result.stdout.splitlines() == [str(path_of(run, "best", s)) for s in BEST_ORDER]
    assert ok(invoke(runner, "best", run, "--stream", "best")).stdout == result.stdout


@pytest.mark.parametrize(
    ("streams", "expected"),
    [
        ({"best": TopK(2, "loss"), "acc": TopK(2, "acc", "max")}, "best"),
        ({"model": Keep(), "acc": TopK(2, "acc", "max")}, "acc"),
        ({"acc": TopK(2, "acc", "max"), "loss": TopK(2, "loss")}, None),  # ambiguous
        ({"model": Keep()}, None),  # no top-K stream at all
    ],
    ids=["best-wins", "only-topk", "ambiguous", "no-topk"],
)
def test_best_default_stream(
    runner: CliRunner, root: Path, streams: dict[str, Any], expected: str | None
) -> None:
    with CheckpointManager(root, streams=streams) as mgr:
        for step, (loss, acc) in enumerate([(0.5, 0.1), (0.2, 0.9), (0.9, 0.5)]):
            mgr.save(step, metrics={"loss": loss, "acc": acc}, **{s: state(step) for s in streams})
    result = invoke(runner, "best", root)
    if expected is None:
        one_line_error(result)
        return
    order = {"best": [1, 0], "acc": [1, 2]}[expected]  # by loss (min) / by acc (max)
    assert ok(result).stdout.splitlines() == [str(path_of(root, expected, s)) for s in order]


@pytest.mark.parametrize("command", ["latest", "best"])
def test_latest_and_best_with_no_checkpoint_exit_1(
    runner: CliRunner, root: Path, command: str
) -> None:
    CheckpointManager(root, streams=STREAMS).close()
    line = one_line_error(invoke(runner, command, root))
    # the stream the command looked in: latest's default, best's only top-K stream
    (topk,) = (name for name, policy in STREAMS.items() if isinstance(policy, TopK))
    stream = {"latest": "model", "best": topk}[command]
    others = [name for name in STREAMS if name != stream]
    # (the test's tmp_path contains "best": the stream is checked quoted, as it is named)
    assert f"stream {stream!r} of {root} " in line, line
    assert line.endswith("has no checkpoint yet"), line
    assert not any(repr(name) in line for name in others), line


def test_latest_when_every_checkpoint_was_aborted_exits_1(
    runner: CliRunner, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with CheckpointManager(root, streams={"model": Keep()}) as mgr:
        monkeypatch.setattr(torch, "save", refuse_save)
        with pytest.raises(PublishError):
            mgr.save(0, model=state(0))
    assert states(root, "model") == {0: "aborted"}
    one_line_error(invoke(runner, "latest", root))


# ----------------------------------------------------------------- history


@pytest.fixture
def two_attempts(root: Path) -> tuple[Path, int, int]:
    with CheckpointManager(root, streams={"model": Keep(last=3)}) as mgr:
        for step in range(3):
            mgr.log_metrics(step, {"loss": 1.0 + step})
        mgr.save(1, model=state(1))
        first = mgr.attempt_id
    with CheckpointManager(root) as mgr:
        for step in (2, 3):
            mgr.log_metrics(step, {"loss": 10.0 + step, "acc": 0.5})
        second = mgr.attempt_id
    return root, first, second


def test_history_table_by_step_and_attempt(
    runner: CliRunner, two_attempts: tuple[Path, int, int]
) -> None:
    root, a1, a2 = two_attempts
    out = ok(invoke(runner, "history", root, "--metric", "loss")).stdout
    header, *body = out.splitlines()
    assert header.split() == ["step", "loss", "attempt"]
    got = [(int(s), float(v), int(a)) for s, v, a in (line.split() for line in body)]
    assert got == [(0, 1.0, a1), (1, 2.0, a1), (2, 3.0, a1), (2, 12.0, a2), (3, 13.0, a2)]


def test_history_json(runner: CliRunner, two_attempts: tuple[Path, int, int]) -> None:
    root, _, a2 = two_attempts
    data = json.loads(ok(invoke(runner, "history", root, "--metric", "acc", "--json")).stdout)
    assert data == [
        {"step": 2, "value": 0.5, "attempt": a2},
        {"step": 3, "value": 0.5, "attempt": a2},
    ]


def test_history_unknown_metric_lists_the_known_ones(
    runner: CliRunner, two_attempts: tuple[Path, int, int]
) -> None:
    root, _, _ = two_attempts
    line = one_line_error(invoke(runner, "history", root, "--metric", "accuracy"))
    assert "accuracy" in line
    assert "loss" in line
    assert "acc" in line.replace("accuracy", "")


def test_history_plot_writes_a_png(runner: CliRunner, run: Path, tmp_path: Path) -> None:
    out = tmp_path / "loss.png"
    ok(invoke(runner, "history", run, "--metric", "loss", "--plot", out))
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100
    assert height > 100


def test_history_plot_into_a_missing_directory_is_one_line(
    runner: CliRunner, run: Path, tmp_path: Path
) -> None:
    target = tmp_path / "no" / "such" / "dir" / "loss.png"
    one_line_error(invoke(runner, "history", run, "--metric", "loss", "--plot", target))
    assert not target.exists()


# --------------------------------------------------------------------- sql

QUERY = (
    "SELECT stream, step, metric, size FROM checkpoints "
    "WHERE state = 'committed' ORDER BY stream, step"
)
QUERY_COLUMNS = ["stream", "step", "metric", "size"]


def test_sql_table(runner: CliRunner, run: Path) -> None:
    expected = rows(run, QUERY)
    header, *body = ok(invoke(runner, "sql", run, QUERY)).stdout.splitlines()
    assert header.split() == QUERY_COLUMNS
    assert len(body) == len(expected)
    for line, (stream, step, metric, size) in zip(body, expected, strict=True):
        cells = line.split()
        assert cells[0] == stream
        assert int(cells[1]) == step
        assert cells[2] == "-" if metric is None else float(cells[2]) == pytest.approx(metric)
        assert int(cells[3]) == size


def test_sql_csv_parses(runner: CliRunner, run: Path) -> None:
    out = ok(invoke(runner, "sql", run, QUERY, "--format", "csv")).stdout
    parsed = list(csv.reader(io.StringIO(out)))
    assert parsed[0] == QUERY_COLUMNS
    expected = [["" if v is None else str(v) for v in r] for r in rows(run, QUERY)]
    assert parsed[1:] == expected


def test_sql_json_values(runner: CliRunner, run: Path) -> None:
    data = json.loads(ok(invoke(runner, "sql", run, QUERY, "--format", "json")).stdout)
    assert data == [dict(zip(QUERY_COLUMNS, r, strict=True)) for r in rows(run, QUERY)]
    assert any(d["metric"] is None for d in data)
    assert {d["metric"] for d in data if d["stream"] == "best"} == {0.5, 1.0, 2.0}


@pytest.mark.parametrize("fmt", ["table", "csv", "json"])
def test_sql_with_no_matching_rows(runner: CliRunner, run: Path, fmt: str) -> None:
    statement = "SELECT id, step FROM checkpoints WHERE step > 1000"
    out = ok(invoke(runner, "sql", run, statement, "--format", fmt)).stdout
    if fmt == "json":
        assert json.loads(out) == []
    else:
        assert out.replace(",", " ").split() == ["id", "step"]


WRITES = [
    # each of these changes the ledger when run through a writable connection
    "DELETE FROM checkpoints",
    "DELETE FROM checkpoints WHERE state = 'aborted'",
    "DELETE FROM metrics",
    "UPDATE checkpoints SET state = 'deleted'",
    "INSERT INTO runs (name, root, save_dir, created_at) VALUES ('x', '/x', '/x', '2020-01-01')",
    "REPLACE INTO pointers (run_id, name, checkpoint_id) VALUES (1, 'latest:model', 1)",
    "DROP TABLE checkpoints",
    "DROP TABLE metrics",
    "CREATE TABLE evil (a INTEGER)",
    "CREATE VIEW v AS SELECT 1",
    "PRAGMA journal_mode=DELETE",
    "PRAGMA user_version = 7",
    "VACUUM",
    "SELECT 1; DELETE FROM checkpoints",
    "SELECT 1; DELETE FROM metrics",
    # statements that write *and* return rows
    "UPDATE checkpoints SET state = 'deleted' RETURNING id",
    "DELETE FROM metrics RETURNING id",
    "INSERT INTO runs (name, root, save_dir, created_at) "
    "VALUES ('x', '/x', '/x', '2020-01-01') RETURNING id",
    "WITH doomed AS (SELECT id FROM metrics) "
    "DELETE FROM metrics WHERE id IN (SELECT id FROM doomed) RETURNING id",
]


@pytest.mark.parametrize(
    "statement", WRITES, ids=[f"{i:02d}:{w[:40]}" for i, w in enumerate(WRITES)]
)
def test_sql_refuses_writes_and_leaves_the_ledger_unchanged(
    runner: CliRunner, run: Path, statement: str
) -> None:
    image, digest, listing = ledger_image(run), sha256(run / "ckptdb.sqlite"), files(run)
    one_line_error(invoke(runner, "sql", run, statement))
    assert sha256(run / "ckptdb.sqlite") == digest
    assert ledger_image(run) == image
    assert files(run) == listing


@pytest.mark.parametrize("dry_run", [False, True])
def test_reconcile_of_a_run_whose_stream_directory_is_absent_is_refused_in_one_line(
    runner: CliRunner, run: Path, tmp_path: Path, dry_run: bool
) -> None:
    """A stream directory not there (not mounted?) is not its checkpoints lost: one
    line naming it, and nothing in the ledger or on disk changes."""
    ema = save_dir_of(run) / "ema"
    ema.rename(tmp_path / "ema")

    def checkpoints_and_pointers() -> tuple[Any, Any]:
        image = ledger_image(run)  # the refused open is an attempt (failed) of its own
        return image["checkpoints"], image["pointers"]

    before, listing = checkpoints_and_pointers(), files(run)
    line = one_line_error(invoke(runner, "reconcile", run, *(["--dry-run"] if dry_run else [])))
    assert f"{ema} (2 committed)" in line and "not mounted" in line
    assert checkpoints_and_pointers() == before
    assert files(run) == listing


def test_check_of_a_run_whose_stream_directory_is_absent_reports_the_refusal(
    runner: CliRunner, run: Path, tmp_path: Path
) -> None:
    ema = save_dir_of(run) / "ema"
    ema.rename(tmp_path / "ema")
    result = invoke(runner, "check", run)
    assert result.exit_code == 1
    refused = [ln for ln in result.stdout.splitlines() if ln.startswith("reconcile would refuse")]
    assert len(refused) == 1 and f"{ema} (2 committed)" in refused[0]


def test_sql_attach_creates_no_database_file(runner: CliRunner, run: Path, tmp_path: Path) -> None:
    """ATTACH of a new file would create it: a read-only query must not write anywhere."""
    target = tmp_path / "attached.db"
    result = invoke(runner, "sql", run, f"ATTACH DATABASE '{target}' AS extra")
    assert result.exit_code == 1
    assert not target.exists(), "`ckptdb sql` created a database file"


def test_sql_syntax_error_is_one_line(runner: CliRunner, run: Path) -> None:
    line = one_line_error(invoke(runner, "sql", run, "SELEKT * FROM checkpoints"))
    assert "SELEKT" in line or "syntax" in line


def test_sql_views_latest_and_best_agree_with_the_commands(runner: CliRunner, run: Path) -> None:
    latest = json.loads(
        ok(
            invoke(
                runner,
                "sql",
                run,
                "SELECT stream, step, path FROM latest_checkpoints ORDER BY stream",
                "--format",
                "json",
            )
        ).stdout
    )
    assert [(d["stream"], d["step"]) for d in latest] == [("best", 4), ("ema", 4), ("model", 4)]
    model = next(d for d in latest if d["stream"] == "model")
    assert ok(invoke(runner, "latest", run)).stdout == f"{save_dir_of(run) / model['path']}\n"
    best = json.loads(
        ok(
            invoke(
                runner,
                "sql",
                run,
                "SELECT rank, step, metric FROM best_checkpoints WHERE stream = 'best' "
                "ORDER BY rank",
                "--format",
                "json",
            )
        ).stdout
    )
    assert [(d["rank"], d["step"]) for d in best] == [(1, 3), (2, 1), (3, 4)]


def test_sql_view_run_restarts_counts_train_opens(runner: CliRunner, root: Path) -> None:
    for _ in range(2):
        CheckpointManager(root, streams=STREAMS).close()
    statement = "SELECT attempts, restarts, crashes FROM run_restarts"
    data = json.loads(ok(invoke(runner, "sql", root, statement, "--format", "json")).stdout)
    assert data == [{"attempts": 2, "restarts": 1, "crashes": 0}]


def test_sql_view_attempt_summary_steps_lost(runner: CliRunner, root: Path) -> None:
    with CheckpointManager(root, streams={"model": Keep(last=3)}) as mgr:
        for step in range(8):
            mgr.log_metrics(step, {"loss": 1.0 / (step + 1)})
            if step == 4:
                mgr.save(step, model=state(step))
        crashed = mgr.attempt_id
    # What a killed process leaves in the ledger: its attempt still 'running'.
    con = sqlite3.connect(root / "ckptdb.sqlite")
    with con:
        con.execute(
            "UPDATE attempts SET end_state = 'running', ended_at = NULL WHERE id = ?", [crashed]
        )
    con.close()
    with CheckpointManager(root) as mgr:
        mgr.log_metrics(5, {"loss": 0.1})
        restarted = mgr.attempt_id
    statement = (
        "SELECT attempt_id, end_state, last_step_seen, last_committed_step, steps_lost "
        "FROM attempt_summary ORDER BY attempt_id"
    )
    data = json.loads(ok(invoke(runner, "sql", root, statement, "--format", "json")).stdout)
    assert data == [
        {
            "attempt_id": crashed,
            "end_state": "crashed",
            "last_step_seen": 7,
            "last_committed_step": 4,
            "steps_lost": 3,
        },
        {
            "attempt_id": restarted,
            "end_state": "closed",
            "last_step_seen": 5,
            "last_committed_step": None,
            "steps_lost": None,
        },
    ]
    restarts = json.loads(
        ok(
            invoke(
                runner,
                "sql",
                root,
                "SELECT restarts, crashes FROM run_restarts",
                "--format",
                "json",
            )
        ).stdout
    )
    assert restarts == [{"restarts": 1, "crashes": 1}]


# ------------------------------------------------- readers beside a trainer

READERS: list[tuple[list[str], Callable[[str, Path], None]]] = [
    (
        ["status"],
        lambda out, root: _assert_in(
            "6", next(ln for ln in out.splitlines() if ln.startswith("model ")).split()
        ),
    ),
    (
        ["status", "--json"],
        lambda out, root: _assert_eq(
            {s["name"]: s["latest_step"] for s in json.loads(out)["streams"]}["model"], 6
        ),
    ),
    (["list"], lambda out, root: _assert_in(str(path_of(root, "model", 6)), out)),
    (["list", "--all"], lambda out, root: _assert_in("aborted", out)),
    (["latest"], lambda out, root: _assert_eq(out, f"{path_of(root, 'model', 6)}\n")),
    (
        ["best"],
        lambda out, root: _assert_eq(
            out.splitlines(), [str(path_of(root, "best", s)) for s in (6, 3, 1)]
        ),
    ),
    (["history", "--metric", "loss"], lambda out, root: _assert_eq(len(out.splitlines()), 8)),
    (
        [
            "sql",
            "SELECT COUNT(*) AS n FROM checkpoints WHERE state = 'committed'",
            "--format",
            "csv",
        ],
        lambda out, root: _assert_eq(out.split(), ["n", "8"]),
    ),
    (["db", "current"], lambda out, root: _assert_in(_head(), out)),
]


def _assert_in(needle: str, haystack: str) -> None:
    assert needle in haystack


def _assert_eq(a: Any, b: Any) -> None:
    assert a == b


@pytest.mark.parametrize(("args", "check"), READERS, ids=[" ".join(a) for a, _ in READERS])
def test_readers_work_while_a_trainer_holds_the_writer_lock(
    runner: CliRunner,
    run: Path,
    open_manager: Opener,
    args: list[str],
    check: Callable[[str, Path], None],
) -> None:
    trainer = open_manager()
    trainer.log_metrics(5, {"loss": 5.0})
    trainer.log_metrics(6, {"loss": 4.0})
    trainer.save(6, metrics={"val_loss": 0.1}, model=state(6), ema=state(6), best=state(6))
    trainer.log_metrics(7, {"loss": 3.0})  # buffered, not committed: invisible
    check(ok(invoke(runner, *_with_root(args, run))).stdout, run)
    # the trainer is still open and still works afterwards
    trainer.save(7, metrics={"val_loss": 9.0}, model=state(7))
    assert trainer.latest("model").step == 7


def test_readers_never_see_an_uncommitted_boundary(
    runner: CliRunner, root: Path, open_manager: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = open_manager(streams={"model": Keep(last=3)})
    mgr.log_metrics(0, {"loss": 1.0})
    old = mgr.save(0, model=state(0))["model"].path
    seen: dict[str, Result] = {}
    real_point_latest = ckptdb.ledger.boundary_rows.point_latest

    def point_latest_then_look(session: Any, run_id: int, latest: Any) -> None:
        real_point_latest(session, run_id, latest)
        if not seen:  # the commit transaction is still open here
            seen["latest"] = invoke(runner, "latest", root)
            seen["list"] = invoke(runner, "list", root, "--all", "--json")
            seen["sql"] = invoke(
                runner,
                "sql",
                root,
                "SELECT step, state FROM checkpoints ORDER BY id",
                "--format",
                "json",
            )
            seen["history"] = invoke(runner, "history", root, "--metric", "loss", "--json")
            seen["status"] = invoke(runner, "status", root, "--json")

    monkeypatch.setattr(ckptdb.ledger.boundary_rows, "point_latest", point_latest_then_look)
    mgr.log_metrics(1, {"loss": 0.5})
    new = mgr.save(1, model=state(1))["model"].path
    assert seen, "point_latest was not called inside the commit"
    assert ok(seen["latest"]).stdout == f"{old}\n"
    listed = json.loads(ok(seen["list"]).stdout)
    assert [(d["step"], d["state"]) for d in listed] == [(0, "committed"), (1, "pending")]
    assert json.loads(ok(seen["sql"]).stdout) == [
        {"step": 0, "state": "committed"},
        {"step": 1, "state": "pending"},
    ]
    assert [p["step"] for p in json.loads(ok(seen["history"]).stdout)] == [0]
    status = json.loads(ok(seen["status"]).stdout)
    assert status["streams"][0]["latest_step"] == 0
    assert status["states"] == {"committed": 1, "pending": 1}
    # after the commit returned, readers see the new boundary
    assert ok(invoke(runner, "latest", root)).stdout == f"{new}\n"
    assert [
        p["step"]
        for p in json.loads(
            ok(invoke(runner, "history", root, "--metric", "loss", "--json")).stdout
        )
    ] == [0, 1]


# --------------------------------------------------------------- reconcile


def test_reconcile_on_a_clean_run_reports_nothing_to_do(runner: CliRunner, run: Path) -> None:
    before = checkpoint_rows(run)
    out = ok(invoke(runner, "reconcile", run)).stdout
    assert "reconcile" in out
    assert "quarantined" not in out
    assert checkpoint_rows(run) == before
    data = json.loads(ok(invoke(runner, "reconcile", run, "--json")).stdout)
    assert data["actions"] == []
    assert data["counts"] == {}
    assert data["dry_run"] is False


def test_reconcile_dry_run_lists_an_orphan_and_changes_nothing(
    runner: CliRunner, run: Path
) -> None:
    orphan = save_dir_of(run) / ORPHAN
    orphan.write_bytes(b"left behind by someone")
    before_rows = rows(run, "SELECT * FROM checkpoints ORDER BY id")
    before_pointers = rows(run, "SELECT * FROM pointers ORDER BY name")
    before_files = files(run / "checkpoints")
    out = ok(invoke(runner, "reconcile", run, "--dry-run")).stdout
    assert ORPHAN in out
    assert "quarantined" in out
    assert orphan.read_bytes() == b"left behind by someone"
    assert not (run / "ckptdb.quarantine").exists()
    assert rows(run, "SELECT * FROM checkpoints ORDER BY id") == before_rows
    assert rows(run, "SELECT * FROM pointers ORDER BY name") == before_pointers
    assert files(run / "checkpoints") == before_files
    data = json.loads(ok(invoke(runner, "reconcile", run, "--dry-run", "--json")).stdout)
    assert data["dry_run"] is True
    assert data["counts"] == {"quarantined": 1}
    assert [(a["kind"], a["path"]) for a in data["actions"]] == [("quarantined", ORPHAN)]
    assert orphan.exists()


def test_reconcile_quarantines_an_orphan(runner: CliRunner, run: Path) -> None:
    orphan = save_dir_of(run) / ORPHAN
    orphan.write_bytes(b"left behind by someone")
    before = checkpoint_rows(run)
    out = ok(invoke(runner, "reconcile", run)).stdout
    assert ORPHAN in out
    assert not orphan.exists()
    moved = [run / "ckptdb.quarantine" / name for name in files(run / "ckptdb.quarantine")]
    assert [p.read_bytes() for p in moved] == [b"left behind by someone"]
    assert checkpoint_rows(run) == before
    again = json.loads(ok(invoke(runner, "reconcile", run, "--json")).stdout)
    assert again["actions"] == []


def test_reconcile_verify_finds_a_same_size_byte_flip_with_progress(
    runner: CliRunner, run: Path
) -> None:
    victim = path_of(run, "model", 4)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    plain = ok(invoke(runner, "reconcile", run))
    assert states(run, "model")[4] == "committed"  # same size: only a re-hash sees it
    assert plain.stderr == ""
    result = ok(invoke(runner, "reconcile", run, "--verify"))
    assert "corrupt" in result.stdout
    assert "model/step-000000004.pt" in result.stdout
    assert "verif" in result.stderr.lower()  # the progress bar (its label off a terminal)
    assert states(run, "model")[4] == "corrupt"
    # latest falls back to the newest healthy checkpoint
    assert ok(invoke(runner, "latest", run)).stdout == f"{path_of(run, 'model', 3)}\n"


def test_reconcile_json_parses(runner: CliRunner, run: Path) -> None:
    path_of(run, "ema", 4).unlink()
    data = json.loads(ok(invoke(runner, "reconcile", run, "--json")).stdout)
    assert data["dry_run"] is False
    assert data["counts"]["lost"] == 1
    lost = [a for a in data["actions"] if a["kind"] == "lost"]
    assert [a["path"] for a in lost] == ["ema/step-000000004.pt"]
    assert states(run, "ema")[4] == "lost"


def test_maintenance_commands_are_not_training_restarts(runner: CliRunner, run: Path) -> None:
    ok(invoke(runner, "reconcile", run))
    ok(invoke(runner, "reconcile", run, "--dry-run", "--verify"))
    ok(invoke(runner, "gc", run))
    assert rows(run, "SELECT kind, end_state FROM attempts ORDER BY id") == [
        ("train", "closed"),
        ("maintenance", "closed"),
        ("maintenance", "closed"),
        ("maintenance", "closed"),
    ]
    assert rows(run, "SELECT attempts, restarts, crashes FROM run_restarts") == [(1, 0, 0)]
    assert len(rows(run, "SELECT * FROM attempt_summary")) == 1


@pytest.mark.parametrize("args", WRITE_COMMANDS, ids=lambda a: " ".join(a))
def test_writers_are_refused_while_a_trainer_holds_the_lock(
    runner: CliRunner, run: Path, open_manager: Opener, args: list[str]
) -> None:
    trainer = open_manager()
    (save_dir_of(run) / ORPHAN).write_bytes(b"orphan")
    before = checkpoint_rows(run)
    attempts = rows(run, "SELECT id, kind, end_state FROM attempts ORDER BY id")
    line = one_line_error(invoke(runner, *_with_root(args, run)))
    assert f"pid {os.getpid()}" in line
    assert checkpoint_rows(run) == before
    assert rows(run, "SELECT id, kind, end_state FROM attempts ORDER BY id") == attempts
    assert (save_dir_of(run) / ORPHAN).exists()
    trainer.save(9, model=state(9))  # the trainer's lock was not disturbed


# ---------------------------------------------------------------------- gc


def test_gc_applies_a_lowered_keep_last(runner: CliRunner, root: Path) -> None:
    with CheckpointManager(root, streams={"model": Keep(last=5)}) as mgr:
        for step in range(5):
            mgr.save(step, model=state(step))
    paths = {step: path_of(root, "model", step) for step in range(5)}
    CheckpointManager(root, streams={"model": Keep(last=2)}).close()  # lower it, save nothing
    assert all(p.exists() for p in paths.values())
    out = ok(invoke(runner, "gc", root)).stdout
    for step in (0, 1, 2):
        assert str(paths[step]) in out
        assert not paths[step].exists()
    for step in (3, 4):
        assert str(paths[step]) not in out
        assert paths[step].exists()
    assert states(root, "model") == {
        0: "deleted",
        1: "deleted",
        2: "deleted",
        3: "committed",
        4: "committed",
    }
    assert ok(invoke(runner, "latest", root)).stdout == f"{paths[4]}\n"
    before = checkpoint_rows(root)
    again = ok(invoke(runner, "gc", root)).stdout
    assert not any(str(p) in again for p in paths.values())
    assert checkpoint_rows(root) == before
    assert files(save_dir_of(root)) == ["model/step-000000003.pt", "model/step-000000004.pt"]


def test_gc_with_nothing_to_evict_changes_nothing(runner: CliRunner, run: Path) -> None:
    before, listing = checkpoint_rows(run), files(save_dir_of(run))
    out = ok(invoke(runner, "gc", run)).stdout
    assert out.strip()  # it says so
    assert "step-" not in out  # and names no checkpoint
    assert checkpoint_rows(run) == before
    assert files(save_dir_of(run)) == listing


# ---------------------------------------------------------------------- db


def _head() -> str:
    from alembic.script import ScriptDirectory

    from ckptdb.ledger.engine import alembic_config

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def test_db_current_prints_the_revision_and_the_newest_known(runner: CliRunner, run: Path) -> None:
    out = ok(invoke(runner, "db", "current", run)).stdout
    assert rows(run, "SELECT version_num FROM alembic_version") == [(_head(),)]
    assert out.count(_head()) == 2  # the ledger's revision and the newest known


def test_db_upgrade_on_an_up_to_date_ledger(runner: CliRunner, run: Path) -> None:
    before = ledger_image(run)
    ok(invoke(runner, "db", "upgrade", run))
    assert ledger_image(run) == before
    assert rows(run, "SELECT version_num FROM alembic_version") == [(_head(),)]
    assert ok(invoke(runner, "db", "current", run)).stdout.count(_head()) == 2


# -------------------------------------------------------------------- demo


@pytest.mark.timeout(300)
def test_demo_runs_end_to_end(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "demo"
    result = cli_subprocess("demo", directory, "--steps", 80, cwd=tmp_path, timeout=280)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "Traceback" not in out
    assert "guard" in out  # the guard refused a boundary
    assert "rolled_back" in out  # the reconcile report after the restart
    assert "keep last 3" in out  # the status table
    assert "best_checkpoints" in out  # the SQL ...
    assert "\x1b[" not in result.stdout  # colours only on a terminal
    best = rows(
        directory,
        "SELECT c.path FROM best_checkpoints b JOIN checkpoints c ON c.id = b.checkpoint_id "
        "WHERE b.stream = 'best' AND b.rank = 1",
    )
    assert best
    assert best[0][0] in out  # ... and its answer

    train = rows(directory, "SELECT end_state FROM attempts WHERE kind = 'train' ORDER BY id")
    assert train == [("crashed",), ("closed",)]
    assert rows(directory, "SELECT COUNT(*) FROM attempts") == [(2,)]
    assert rows(directory, "SELECT COUNT(*) FROM events WHERE kind = 'guard_tripped'")[0][0] >= 1
    assert rows(directory, "SELECT COUNT(*) FROM checkpoints WHERE state = 'aborted'")[0][0] >= 1
    assert rows(directory, "SELECT restarts, crashes FROM run_restarts") == [(1, 1)]
    assert {s for (s,) in rows(directory, "SELECT name FROM streams")} == {"model", "ema", "best"}

    # consistency: every committed row's file exists with its size; no other file remains
    save_dir = save_dir_of(directory)
    committed = rows(directory, "SELECT path, size FROM checkpoints WHERE state = 'committed'")
    assert committed
    for rel, size in committed:
        assert (save_dir / rel).stat().st_size == size, rel
    assert files(save_dir) == sorted(rel for rel, _ in committed)

    # the run answers the other commands
    history = json.loads(
        ok(invoke(runner, "history", directory, "--metric", "loss", "--json")).stdout
    )
    assert {p["attempt"] for p in history} == {1, 2}
    assert ok(invoke(runner, "latest", directory)).stdout.strip().endswith(".pt")

    # the closing hint is a command that runs, with matplotlib here and without it
    monkeypatch.chdir(tmp_path)
    [hint] = [line[6:] for line in result.stdout.splitlines() if line.startswith("next: ")]
    assert hint == cli.demo_hint(directory)
    for plotting in (True, False):
        if not plotting:
            no_matplotlib = lambda name, *a: None if name == "matplotlib" else find_spec(name, *a)  # noqa: E731
            monkeypatch.setattr(cli.importlib.util, "find_spec", no_matplotlib)
            hint = cli.demo_hint(directory)
            assert "--plot" not in hint.split("(")[0] and "ckptdb[plot]" in hint
        command = shlex.split(hint.split("   (")[0])
        assert command[0] == "ckptdb"
        ok(invoke(runner, *command[1:]))
    assert (tmp_path / "loss.png").stat().st_size > 0


@pytest.mark.parametrize("content", ["file", "directory"])
def test_demo_refuses_a_non_empty_directory_that_is_not_a_run(
    runner: CliRunner, tmp_path: Path, content: str
) -> None:
    directory = tmp_path / "precious"
    directory.mkdir()
    if content == "file":
        (directory / "thesis.tex").write_text("five years of work")
    else:
        (directory / "data").mkdir()
        (directory / "data" / "x.bin").write_bytes(b"\0" * 10)
    before = {name: (directory / name).read_bytes() for name in files(directory)}
    line = one_line_error(invoke(runner, "demo", directory, "--steps", 80))
    assert str(directory) in line
    assert {name: (directory / name).read_bytes() for name in files(directory)} == before


def test_demo_with_too_few_steps_is_one_line(runner: CliRunner, tmp_path: Path) -> None:
    directory = tmp_path / "demo"
    one_line_error(invoke(runner, "demo", directory, "--steps", 10))
    assert not directory.exists()
