"""``ckptdb latest``/``best``/``sql``/``history``/``list``/``status`` from the standard
library: the full command's output, or none.

:mod:`ckptdb.quickread` answers the plain forms of ``ckptdb latest|best ROOT
[--stream S]``, ``ckptdb sql ROOT STATEMENT [--format F]``, ``ckptdb history
ROOT --metric M [--json]``, ``ckptdb list ROOT [--stream S] [--all] [--json]``
and ``ckptdb status ROOT [--json]`` with ``sqlite3`` alone and declines
everything else.
What it must never do is print a line the full command would not: each test
here builds a run in some state, asks both, and requires the quick answer to be
either the full command's own output or None (the full command then answers,
its errors included). The plain cases must be answered quickly, or the
shortcut would be dead code.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptdb import CheckpointManager, Keep, TopK
from ckptdb.cli import main as full_command
from ckptdb.ledger import engine
from ckptdb.quickread import LEDGER_FILE, answer

pytestmark = pytest.mark.usefixtures("no_db_url_from_environment")

REPO = Path(__file__).resolve().parents[1]
STREAMS = {"model": Keep(last=2), "best": TopK(2, "val_loss"), "ema": Keep(last=1)}


def make_run(root: Path, save_dir: Path | None = None, steps: int = 3) -> Path:
    """model and best saved at each step; ema configured but never saved."""
    with CheckpointManager(root, streams=STREAMS, save_dir=save_dir) as mgr:
        for step in range(steps):
            tensor = {"w": torch.full((2,), float(step))}
            mgr.save(step, metrics={"val_loss": 5.0 - step}, model=tensor, best=tensor)
    return root


def full(argv: list[str]) -> tuple[int, str]:
    """The full command's exit code and output (stdout, or its one-line error)."""
    result = CliRunner().invoke(full_command, argv)
    return result.exit_code, result.output.strip()


def agree(argv: list[str], *, answered: bool) -> None:
    """The quick answer is the full command's line (``answered``) or None."""
    quick = answer(argv, {})
    code, out = full(argv)
    if answered:
        assert (code, quick) == (0, out), (argv, out)
    else:
        assert quick is None, (argv, quick, out)


def sql(root: Path, statement: str) -> None:
    with sqlite3.connect(root / LEDGER_FILE) as db:
        db.execute(statement)


@pytest.mark.parametrize(
    "args",
    [
        ["ROOT"],
        ["ROOT", "--stream", "best"],
        ["--stream", "best", "ROOT"],
        ["ROOT", "--stream=model"],
    ],
    ids=["default", "stream", "stream-first", "stream-equals"],
)
def test_the_plain_question_gets_the_full_commands_line(tmp_path: Path, args: list[str]) -> None:
    root = make_run(tmp_path / "run")
    agree(["latest", *[str(root) if a == "ROOT" else a for a in args]], answered=True)


def test_a_relative_root_and_a_moved_run_answer_as_the_full_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_run(tmp_path / "run")
    moved = tmp_path / "elsewhere"
    (tmp_path / "run").rename(moved)  # the stored root and save dir are the old ones
    monkeypatch.chdir(tmp_path)
    agree(["latest", "elsewhere"], answered=True)
    assert str(answer(["latest", "elsewhere"], {})).startswith(str(moved / "checkpoints"))


def test_a_save_directory_outside_the_root_is_the_stored_one(tmp_path: Path) -> None:
    root = make_run(tmp_path / "run", save_dir=tmp_path / "fast-disk")
    agree(["latest", str(root)], answered=True)
    assert str(answer(["latest", str(root)], {})).startswith(str(tmp_path / "fast-disk"))


@pytest.mark.parametrize(
    "args",
    [["ROOT"], ["ROOT", "--stream", "best"], ["--stream=best", "ROOT"]],
    ids=["default", "stream", "stream-equals-first"],
)
def test_best_gets_the_full_commands_lines(tmp_path: Path, args: list[str]) -> None:
    root = make_run(tmp_path / "run", steps=4)
    argv = ["best", *[str(root) if a == "ROOT" else a for a in args]]
    agree(argv, answered=True)
    assert len(str(answer(argv, {})).splitlines()) == 2  # TopK(2): two lines, best first


def test_best_ranks_ties_and_a_missing_metric_as_the_policy_does(tmp_path: Path) -> None:
    """Equal metrics (the earlier step wins), a save without the metric (kept by
    ``last``, never ranked), a stream not named ``best`` chosen as the only top-K one."""
    streams = {"model": Keep(last=1), "val": TopK(2, "acc", mode="max", last=4)}
    root = tmp_path / "run"
    with CheckpointManager(root, streams=streams) as mgr:
        for step, acc in enumerate([0.5, 0.9, 0.9, None, 0.7]):
            metrics = {} if acc is None else {"acc": acc}
            mgr.save(step, metrics=metrics, model={"w": torch.ones(1)}, val={"w": torch.ones(1)})
    agree(["best", str(root)], answered=True)
    agree(["best", str(root), "--stream", "val"], answered=True)
    lines = str(answer(["best", str(root)], {})).splitlines()
    assert [Path(line).name for line in lines][:2] == [
        "step-000000001.pt",
        "step-000000002.pt",
    ]


def test_best_declines_what_the_full_command_refuses(tmp_path: Path) -> None:
    streams = {"model": Keep(last=1), "a": TopK(1, "x"), "b": TopK(1, "x")}
    root = tmp_path / "run"
    with CheckpointManager(root, streams=streams) as mgr:
        mgr.save(0, metrics={"x": 1.0}, model={"w": torch.ones(1)}, a={"w": 1}, b={"w": 2})
    agree(["best", str(root)], answered=False)  # two top-K streams, none named best
    agree(["best", str(root), "--stream", "model"], answered=False)  # not a top-K stream
    agree(["best", str(root), "--stream", "a"], answered=True)
    for extra in (["--by", "eval/acc"], ["--mode", "min"], ["--evaluator", "e"], ["--json"]):
        agree(["best", str(root), "--stream", "a", *extra], answered=False)


@pytest.mark.parametrize(
    "args",
    [
        ["ROOT", "--stream", "nope"],  # no such stream: the full command names the streams
        ["ROOT", "--stream", "ema"],  # configured, nothing saved yet
        ["ROOT", "--tier", "remote"],
        ["ROOT", "--tier", "local"],
        ["ROOT", "--db-url", "sqlite:///elsewhere.sqlite"],
        ["ROOT", "--help"],
        ["ROOT", "ROOT"],
        ["ROOT", "--stream"],
        ["ROOT", "--stream="],
    ],
    ids=lambda args: " ".join(args),
)
def test_anything_but_the_plain_question_is_declined(tmp_path: Path, args: list[str]) -> None:
    root = make_run(tmp_path / "run")
    agree(["latest", *[str(root) if a == "ROOT" else a for a in args]], answered=False)


def test_other_commands_and_global_options_are_declined(tmp_path: Path) -> None:
    root = str(make_run(tmp_path / "run"))
    for argv in (["--debug", "latest", root], ["latest"], ["best"], [], ["pins", root]):
        assert answer(argv, {}) is None, argv
    assert answer(["latest", root], {"CKPTDB_DB_URL": "postgresql://h/db"}) is None


@pytest.mark.parametrize(
    "damage",
    [
        "UPDATE checkpoints SET state = 'lost' WHERE id = (SELECT checkpoint_id FROM pointers"
        " WHERE name = 'latest:model')",
        "UPDATE alembic_version SET version_num = '0009'",
        "UPDATE runs SET save_dir = 's3://bucket/run'",
        "INSERT INTO runs (name, root, save_dir, created_at)"
        " VALUES ('b', '/b', '/b/c', '2026-01-01')",
        "DELETE FROM pointers",
    ],
    ids=["latest-lost", "older-schema", "object-storage", "two-runs-root-moved", "no-pointer"],
)
def test_a_ledger_the_quick_read_cannot_vouch_for_is_declined(tmp_path: Path, damage: str) -> None:
    root = make_run(tmp_path / "run")
    sql(root, damage)
    moved = tmp_path / "moved"
    root.rename(moved)  # with two runs, neither is rooted here: no run to adopt
    agree(["latest", str(moved)], answered=False)


def test_no_ledger_and_an_unreadable_one_are_declined(tmp_path: Path) -> None:
    assert answer(["latest", str(tmp_path)], {}) is None
    (tmp_path / LEDGER_FILE).write_bytes(b"not a database, but a file of that name" * 100)
    assert answer(["latest", str(tmp_path)], {}) is None


def test_the_quick_read_knows_the_ledgers_revision() -> None:
    """A new migration moves the revision in one place; both readers see it."""
    from ckptdb import record

    assert engine.HEAD_REVISION == record.LEDGER_REVISION


ENTRY = """
import sys
sys.argv = ["ckptdb", *sys.argv[1:]]
from ckptdb.__main__ import main
try:
    main()
finally:
    loaded = sorted({m.split(".")[0] for m in sys.modules} & {"sqlalchemy", "click", "torch"})
    print("LOADED", *loaded, flush=True)
"""


def entry(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CKPTDB_DB_URL", None)
    return subprocess.run(
        [sys.executable, "-c", ENTRY, *args], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.mark.parametrize(
    "args",
    [
        ["latest", "ROOT"],
        ["best", "ROOT"],
        ["sql", "ROOT", "SELECT stream, step FROM latest_checkpoints", "--format", "json"],
        ["history", "ROOT", "--metric", "val_loss"],
        ["list", "ROOT", "--all"],
        ["status", "ROOT"],
    ],
    ids=lambda args: args[0],
)
def test_the_command_answers_without_sqlalchemy_or_click(tmp_path: Path, args: list[str]) -> None:
    root = make_run(tmp_path / "run")
    argv = [str(root) if a == "ROOT" else a for a in args]
    done = entry(*argv)
    assert done.returncode == 0, done.stderr
    *printed, loaded = done.stdout.splitlines()
    code, out = full(argv)
    assert (code, "\n".join(printed)) == (0, out)
    assert loaded == "LOADED", "the quick read imported the full command's libraries"


def test_a_declined_question_is_the_full_commands(tmp_path: Path) -> None:
    root = make_run(tmp_path / "run")
    done = entry("latest", str(root), "--stream", "nope")
    assert done.returncode == 1
    assert "no stream 'nope' is configured" in done.stderr
    assert "click" in done.stdout.splitlines()[-1]
    goodput = entry("goodput", str(root), "--json")
    assert goodput.returncode == 0, goodput.stderr
    assert "click" in goodput.stdout.splitlines()[-1]  # the full command ran
    assert json.loads("\n".join(goodput.stdout.splitlines()[:-1]))["run"] == "run"


def exactly(argv: list[str]) -> str:
    """The quick answer, required to be the full command's output to the byte (a table's
    right-aligned header starts with spaces, which ``full`` would strip)."""
    quick = answer(argv, {})
    result = CliRunner().invoke(full_command, argv)
    assert result.exit_code == 0, result.output
    assert quick is not None, (argv, result.output)
    assert quick + "\n" == result.output, argv
    return quick


QUERIES = {
    "view": "SELECT stream, step, rank, metric FROM best_checkpoints",
    "literal-percent": "SELECT name, checkpoint_id FROM pointers WHERE name LIKE 'latest:%'",
    "null-blob-float": "SELECT NULL AS missing, x'00ff' AS raw, 1.0 / 3 AS third, 10000 AS big",
    "no-rows": "SELECT * FROM runs WHERE id = -1",
    "same-name-twice": "SELECT 1 AS a, 2 AS a",
}


@pytest.mark.parametrize("query", QUERIES.values(), ids=QUERIES.keys())
@pytest.mark.parametrize(
    "form",
    [[], ["--format", "csv"], ["--format=json"], ["--format", "json", "--format", "table"]],
    ids=["table", "csv", "json", "last-format-counts"],
)
def test_sql_gets_the_full_commands_output(tmp_path: Path, query: str, form: list[str]) -> None:
    root = make_run(tmp_path / "run")
    exactly(["sql", str(root), query, *form])


def test_sql_takes_its_options_before_the_arguments_too(tmp_path: Path) -> None:
    root = make_run(tmp_path / "run")
    printed = exactly(["sql", "--format", "csv", str(root), QUERIES["view"]])
    assert printed.splitlines()[0] == "stream,step,rank,metric"


@pytest.mark.parametrize(
    "statement",
    [
        "DELETE FROM checkpoints",
        "UPDATE runs SET name = 'x'",
        "CREATE TABLE t (a)",
        "ATTACH DATABASE 'ATTACHED' AS other",
        "PRAGMA query_only = OFF",
        "PRAGMA foreign_keys",  # answers, but from the connection's own settings
        "SELECT * FROM nope",
        "SELECT 1; SELECT 2",
        "SELECT ?",
        "",
        "VACUUM INTO 'ATTACHED'",
    ],
)
def test_sql_declines_what_it_cannot_answer_as_the_full_command_and_changes_nothing(
    tmp_path: Path, statement: str
) -> None:
    root = make_run(tmp_path / "run")
    attached = tmp_path / "attached.sqlite"
    statement = statement.replace("ATTACHED", str(attached))
    before = (root / LEDGER_FILE).read_bytes()
    assert answer(["sql", str(root), statement], {}) is None
    assert (root / LEDGER_FILE).read_bytes() == before
    assert not attached.exists()


@pytest.mark.parametrize(
    "args",
    [
        ["ROOT", "SELECT 1", "--format", "xml"],
        ["ROOT", "SELECT 1", "--format="],
        ["ROOT", "SELECT 1", "--db-url", "sqlite:///elsewhere.sqlite"],
        ["ROOT"],
        ["ROOT", "SELECT 1", "SELECT 2"],
        ["ROOT", "--", "SELECT 1"],
    ],
    ids=lambda args: " ".join(args),
)
def test_sql_declines_any_other_form(tmp_path: Path, args: list[str]) -> None:
    root = make_run(tmp_path / "run")
    agree(["sql", *[str(root) if a == "ROOT" else a for a in args]], answered=False)


def make_history(root: Path) -> Path:
    """A metric over two attempts: the second redoes step 2 after a crash, and logs a NaN."""
    make_run(root)
    with CheckpointManager(root, streams=STREAMS) as mgr:
        mgr.log_metrics(2, {"val_loss": 2.5})
        mgr.log_metrics(3, {"val_loss": float("nan"), "lr": 1e-4})
        mgr.log_metrics(10_000, {"val_loss": 1.25})
    return root


@pytest.mark.parametrize(
    "form",
    [["--metric", "val_loss"], ["--metric=val_loss", "--json"], ["--json", "--metric", "lr"]],
    ids=["table", "json", "flag-first"],
)
def test_history_gets_the_full_commands_output(tmp_path: Path, form: list[str]) -> None:
    root = make_history(tmp_path / "run")
    printed = exactly(["history", str(root), *form])
    assert str(10_000) in printed or "lr" in form


def test_history_shows_each_attempts_redone_step_and_a_nan(tmp_path: Path) -> None:
    root = make_history(tmp_path / "run")
    points = json.loads(exactly(["history", str(root), "--metric", "val_loss", "--json"]))
    redone = [p for p in points if p["step"] == 2]
    assert [p["value"] for p in redone] == [3.0, 2.5]
    assert redone[0]["attempt"] < redone[1]["attempt"]
    assert [math.isnan(p["value"]) for p in points if p["step"] == 3] == [True]


@pytest.mark.parametrize(
    "args",
    [
        ["ROOT", "--metric", "nope"],  # the full command names the metrics there are
        ["ROOT"],
        ["ROOT", "--metric", "val_loss", "--plot", "PLOT"],
        ["ROOT", "--metric", "val_loss", "--json=yes"],
        ["ROOT", "--metric", ""],
    ],
    ids=lambda args: " ".join(args),
)
def test_history_declines_any_other_form(tmp_path: Path, args: list[str]) -> None:
    root = make_history(tmp_path / "run")
    plot = tmp_path / "curve.png"
    argv = [
        "history",
        *[str(root) if a == "ROOT" else str(plot) if a == "PLOT" else a for a in args],
    ]
    assert answer(argv, {}) is None
    assert not plot.exists()


def make_listing(root: Path) -> Path:
    """Checkpoints in every state a listing shows: evicted (deleted), lost, one without
    its metric or timestamp (aborted), one saved by 2 ranks; metrics on each."""
    make_run(root, steps=4)
    with CheckpointManager(root, streams=STREAMS) as mgr:
        mgr.save(4, model={"w": torch.zeros(1)})  # no val_loss: best is not saved
    sql(root, "UPDATE checkpoints SET world_size = 2 WHERE stream = 'model' AND step = 4")
    sql(root, "UPDATE checkpoints SET state = 'lost' WHERE stream = 'best' AND step = 3")
    sql(
        root,
        "UPDATE checkpoints SET state = 'aborted', committed_at = NULL, metric = NULL"
        " WHERE stream = 'model' AND step = 0",
    )
    return root


@pytest.mark.parametrize(
    "form",
    [
        [],
        ["--all"],
        ["--stream", "best", "--all"],
        ["--stream=model"],
        ["--json"],
        ["--all", "--json"],
        ["--stream", "ema"],  # configured, nothing saved: the table's header alone
        ["--stream", "ema", "--json"],
    ],
    ids=lambda form: " ".join(form) or "plain",
)
def test_list_gets_the_full_commands_output(tmp_path: Path, form: list[str]) -> None:
    root = make_listing(tmp_path / "run")
    exactly(["list", str(root), *form])
    exactly(["list", *form, str(root)])  # options first


def test_list_shows_every_state_and_what_each_row_holds(tmp_path: Path) -> None:
    root = make_listing(tmp_path / "run")
    listed = json.loads(exactly(["list", str(root), "--all", "--json"]))
    by_key = {(c["stream"], c["step"]): c for c in listed}
    assert [(c["stream"], c["step"]) for c in listed] == sorted(by_key)
    states = {key: c["state"] for key, c in by_key.items()}
    assert states[("model", 0)] == "aborted" and states[("best", 3)] == "lost"
    assert {states[("model", 1)], states[("best", 0)]} == {"deleted"}  # evicted
    assert by_key[("model", 0)]["committed_at"] is None
    assert by_key[("model", 4)]["world_size"] == 2 and by_key[("model", 4)]["metric"] is None
    assert by_key[("best", 2)]["metrics"] == {"val_loss": 3.0}
    assert by_key[("model", 4)]["committed_at"].endswith("+00:00")  # aware, UTC
    assert all(c["remote"] is None and c["exports"] == [] for c in listed)
    shown = exactly(["list", str(root)]).splitlines()
    assert len(shown) == 1 + sum(s == "committed" for s in states.values())


def test_list_of_a_moved_run_shows_its_files_where_they_are_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = make_listing(tmp_path / "run")
    moved = tmp_path / "moved"
    root.rename(moved)
    monkeypatch.chdir(tmp_path)
    listed = json.loads(exactly(["list", "moved", "--json"]))
    assert listed and all(Path(c["path"]).is_relative_to(moved) for c in listed)


@pytest.mark.parametrize(
    "form",
    [
        ["ROOT", "--stream", "nope"],  # the full command names the streams
        ["ROOT", "--stream"],
        ["ROOT", "--db-url", "sqlite:///elsewhere.sqlite"],
        ["ROOT", "--all=yes"],
        ["ROOT", "ROOT"],
        ["ROOT", "--tier", "remote"],
    ],
    ids=lambda args: " ".join(args),
)
def test_list_declines_any_other_form(tmp_path: Path, form: list[str]) -> None:
    root = make_run(tmp_path / "run")
    agree(["list", *[str(root) if a == "ROOT" else a for a in form]], answered=False)


@pytest.mark.parametrize(
    "change",
    [
        "INSERT INTO replicas (run_id, checkpoint_id, tier, location, state, started_at)"
        " SELECT run_id, id, 'remote', 's3://b/x', 'replicated', '2026-01-01 00:00:00.000000'"
        " FROM checkpoints LIMIT 1",
        "INSERT INTO exports (run_id, checkpoint_id, format, path, size, hash, manifest, tensors,"
        " created_at) SELECT run_id, id, 'safetensors', '/x', 1, 'h', '[]', 1,"
        " '2026-01-01 00:00:00.000000' FROM checkpoints LIMIT 1",
        "UPDATE runs SET save_dir = 's3://bucket/run'",
    ],
    ids=["a-copy-on-a-tier", "an-export", "object-storage"],
)
def test_list_leaves_the_columns_it_does_not_draw_to_the_full_command(
    tmp_path: Path, change: str
) -> None:
    root = make_run(tmp_path / "run")
    sql(root, change)
    assert answer(["list", str(root)], {}) is None


def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path: Path) -> None:
    """``ckptdb sql ROOT ... | head -1``: the pipe closes while the command writes."""
    root = make_run(tmp_path / "run")
    rows = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 200000)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CKPTDB_DB_URL", None)
    command = [sys.executable, "-c", ENTRY, "sql", str(root), rows + " SELECT x FROM c"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        assert process.stdout.readline().strip() == "x"
        process.stdout.close()  # what head does after its line
        errors = process.stderr.read()
        code = process.wait(timeout=60)
    assert "Traceback" not in errors and "BrokenPipeError" not in errors, errors
    assert code == 1  # as click's own commands end on a closed pipe
