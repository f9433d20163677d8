"""Evaluations recorded after the fact, ``ckptdb best --by`` and ``ckptdb follow``.

``ckptdb follow`` is tested end to end: a real trainer process commits
checkpoints while the follower runs an evaluation command (a real process
that loads each checkpoint) and records the JSON it prints; a follower
interrupted with Ctrl-C continues where it stopped, without repeating.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers import LedgerClient, invoke, raise_a_dropped_interrupt, state

from ckptdb import CheckpointManager, Keep, RunReader
from ckptdb.errors import (
    ArgumentTypeError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    LedgerError,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_db_url_from_environment")]


ENV = {k: v for k, v in os.environ.items() if k != "CKPTDB_DB_URL"}


def evaluation_rows(root: Path, db_url: str | None = None) -> list[tuple[Any, ...]]:
    client = LedgerClient(root, db_url)
    try:
        return client.rows(
            "SELECT c.step, e.evaluator, e.name, e.value FROM evaluations e "
            "JOIN checkpoints c ON c.id = e.checkpoint_id ORDER BY c.step, e.evaluator, e.name"
        )
    finally:
        client.close()


def test_evaluations_rank_checkpoints_after_the_fact(root: Path, backend: str | None) -> None:
    with CheckpointManager(root, streams={"model": Keep(last=3)}, db_url=backend) as mgr:
        saved = [mgr.save(step, model=state(float(step)))["model"] for step in (1, 2, 3, 4)]
    with RunReader(root, db_url=backend) as reader:
        for ckpt, acc in zip(saved[1:], [0.7, 0.9, 0.8], strict=True):
            reader.record_evaluation(ckpt, {"eval/acc": acc, "eval/loss": 1 - acc}, evaluator="a")
        reader.record_evaluation(saved[1], {"eval/acc": 0.95}, evaluator="b")
        reader.record_evaluation(saved[2], {"eval/acc": math.nan}, evaluator="b")
        reader.record_evaluation(saved[3].id, {"eval/acc": 0.85}, evaluator="a")  # replaces 0.8
        ranked = [(c.step, v, who) for c, v, who in reader.best_by("eval/acc", mode="max")]
        assert ranked == [(2, 0.95, "b"), (3, 0.9, "a"), (4, 0.85, "a")]  # step 2 once, at best
        by_a = reader.best_by("eval/loss", mode="min", evaluator="a")
        assert [c.step for c, _, _ in by_a] == [3, 4, 2]
        assert reader.evaluations(saved[2]) == {
            "a": {"eval/acc": 0.9, "eval/loss": pytest.approx(0.1)},
            "b": {"eval/acc": None},
        }
        with pytest.raises(InvalidArgumentError):
            reader.best_by("eval/acc", mode="best")  # type: ignore[arg-type]


def test_an_evicted_checkpoint_keeps_its_evaluations_but_no_longer_ranks(root: Path) -> None:
    with CheckpointManager(root, streams={"model": Keep(last=1)}) as mgr:
        first = mgr.save(1, model=state(1.0))["model"]
        with RunReader(root) as reader:
            reader.record_evaluation(first, {"acc": 0.9}, evaluator="a")
            mgr.save(2, model=state(2.0))
            reader.record_evaluation(mgr.latest(), {"acc": 0.1}, evaluator="a")
            assert [c.step for c, _, _ in reader.best_by("acc")] == [2]
            assert reader.evaluations(first) == {"a": {"acc": 0.9}}


@pytest.mark.parametrize(
    ("values", "evaluator", "error"),
    [
        ({}, "a", InvalidArgumentError),
        ({"acc": "high"}, "a", ArgumentTypeError),
        ({"acc": True}, "a", ArgumentTypeError),
        ({"": 1.0}, "a", ArgumentTypeError),
        ([("acc", 1.0)], "a", ArgumentTypeError),
        ({"acc": 1.0}, "", InvalidArgumentError),
        ({"acc": 1.0}, "x" * 256, InvalidArgumentError),
    ],
)
def test_bad_evaluations_are_refused_and_nothing_is_written(
    root: Path, values: Any, evaluator: str, error: type[Exception]
) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(1, model=state(1.0))
    with RunReader(root) as reader, pytest.raises(error):
        reader.record_evaluation(reader.latest(), values, evaluator=evaluator)  # type: ignore[arg-type]
    assert evaluation_rows(root) == []


def test_an_evaluation_of_another_runs_checkpoint_is_refused(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "a") as mgr:
        mgr.save(1, model=state(1.0))
    with RunReader(tmp_path / "a") as reader, pytest.raises(CheckpointNotFoundError):
        reader.record_evaluation(99, {"acc": 1.0}, evaluator="x")
    assert evaluation_rows(tmp_path / "a") == []


def test_ckptdb_best_by_prints_paths_best_first(root: Path, runner: CliRunner) -> None:
    with CheckpointManager(root) as mgr:
        saved = [mgr.save(step, model=state(float(step)))["model"] for step in (1, 2, 3)]
    with RunReader(root) as reader:
        for ckpt, loss in zip(saved, [0.3, 0.1, 0.2], strict=True):
            reader.record_evaluation(ckpt, {"eval/loss": loss}, evaluator="e")
    done = invoke(runner, "best", root, "--by", "eval/loss", "--mode", "min")
    assert done.exit_code == 0, done.output
    assert done.stdout.split() == [str(saved[i].path) for i in (1, 2, 0)]
    missing = invoke(runner, "best", root, "--by", "eval/nothing")
    assert missing.exit_code == 1 and "no checkpoint" in missing.output
    usage = invoke(runner, "best", root, "--evaluator", "e")
    assert usage.exit_code == 2


TRAINER = """
    import sys, time
    import torch
    from ckptdb import CheckpointManager, Keep
    with CheckpointManager(sys.argv[1], streams={"model": Keep(last=2)}) as mgr:
        for step in range(1, int(sys.argv[2]) + 1):
            mgr.save(step, model={"w": torch.full((4,), float(step))})
            print("saved", step, flush=True)
            time.sleep(float(sys.argv[3]))
"""

EVALUATOR = """
    import json, sys, time
    import torch
    state = torch.load(sys.argv[1], weights_only=True)
    time.sleep(float(sys.argv[3]))
    print("evaluating", sys.argv[2])
    print(json.dumps({"eval/acc": float(state["w"][0]) / 100, "note": "text is ignored"}))
"""


def scripts(tmp_path: Path) -> tuple[Path, Path]:
    trainer, evaluator = tmp_path / "trainer.py", tmp_path / "evaluate.py"
    trainer.write_text(textwrap.dedent(TRAINER))
    evaluator.write_text(textwrap.dedent(EVALUATOR))
    return trainer, evaluator


def follow_cmd(root: Path, evaluator: Path, *extra: str, pause: str = "0") -> list[str]:
    return [
        sys.executable,
        "-m",
        "ckptdb.cli",
        "follow",
        str(root),
        "--poll",
        "0.1",
        *extra,
        "--",
        sys.executable,
        str(evaluator),
        "{path}",
        "{step}",
        pause,
    ]


def test_ckptdb_follow_evaluates_every_checkpoint_of_a_running_trainer(
    tmp_path: Path, runner: CliRunner
) -> None:
    root = tmp_path / "run"
    trainer_py, evaluator_py = scripts(tmp_path)
    with CheckpointManager(root, streams={"model": Keep(last=2)}):
        pass  # the run exists before the follower starts
    trainer = subprocess.Popen(
        [sys.executable, str(trainer_py), str(root), "6", "0.3"], stdout=subprocess.PIPE, text=True
    )
    try:
        # the follower's idle clock starts once the trainer saves: its import (3 s of torch
        # on a slow machine) would otherwise use up the follower's 3 idle seconds
        assert trainer.stdout is not None and trainer.stdout.readline().split() == ["saved", "1"]
        follower = subprocess.run(
            follow_cmd(root, evaluator_py, "--timeout", "3"),
            capture_output=True,
            text=True,
            timeout=120,
            env=ENV,
        )
    finally:
        assert trainer.wait(timeout=60) == 0
    assert follower.returncode == 0, follower.stderr
    lines = [line for line in follower.stdout.splitlines() if line.startswith("step ")]
    assert [int(line.split()[1]) for line in lines] == [1, 2, 3, 4, 5, 6]  # in order, once
    skipped = {int(line.split()[1]) for line in lines if "skipped" in line}
    rows = evaluation_rows(root)
    acc = [(step, value) for step, who, name, value in rows if name == "eval/acc"]
    evaluated = [s for s in range(1, 7) if s not in skipped]
    assert acc == [(s, pytest.approx(s / 100)) for s in evaluated]
    assert 6 in evaluated  # the last one is never evicted before it is read
    # each evaluation took longer than the trainer's next two saves: the pin kept
    # the file the trainer evicted meanwhile, and every evaluation could load it
    exits = [(step, value) for step, _, name, value in rows if name == "exit_status"]
    assert exits == [(s, 0.0) for s in evaluated]
    assert {who for _, who, _, _ in rows} == {"evaluate.py"}
    best = invoke(runner, "best", root, "--by", "eval/acc")
    assert best.exit_code == 0 and best.stdout.split()[0].endswith("step-000000006.pt")
    with RunReader(root) as reader:
        assert [p for p, _ in reader.pins() if p.released_at is None] == []


def test_ctrl_c_stops_the_follower_and_the_next_run_continues(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _, evaluator_py = scripts(tmp_path)
    with CheckpointManager(root, streams={"model": Keep(last=None)}) as mgr:
        for step in range(1, 5):
            mgr.save(step, model=state(float(step)))
    first = subprocess.Popen(
        follow_cmd(root, evaluator_py, "--timeout", "30", pause="1.0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert first.stdout is not None
    started = time.monotonic()
    seen = []
    while time.monotonic() < started + 60:
        line = first.stdout.readline()
        if not line:
            break  # the follower ended: what it printed is the finding
        seen.append(line)
        if line.startswith("step 1 "):
            break
    alive = first.poll() is None  # a follower already gone gets no signal
    first.send_signal(signal.SIGINT)
    signalled = time.monotonic() - started
    rest, err = first.communicate(timeout=60)
    assert first.returncode == 130, (first.returncode, alive, signalled, seen, rest, err)
    assert "continues where this one left off" in err
    done_first = [s for s, _, name, _ in evaluation_rows(root) if name == "exit_status"]
    assert done_first and done_first == list(range(1, len(done_first) + 1))
    second = subprocess.run(
        follow_cmd(root, evaluator_py, "--timeout", "1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 0, second.stderr
    statuses = [s for s, _, name, _ in evaluation_rows(root) if name == "exit_status"]
    assert statuses == [1, 2, 3, 4]  # each once: nothing repeated, nothing missed


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_the_interpreter_drops_still_stops_the_follower(
    tmp_path: Path, runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python drops an exception raised in a weakref callback ("Exception ignored in"):
    a Ctrl-C landing while the evaluation's pin and its thread are freed was lost, and
    the follower went on. Here the signal comes from inside such a callback, right after
    the first evaluation: the follower stops before the second, exit status 130."""
    from ckptdb.cli import following

    root = tmp_path / "run"
    _, evaluator_py = scripts(tmp_path)
    with CheckpointManager(root, streams={"model": Keep(last=None)}) as mgr:
        for step in range(1, 4):
            mgr.save(step, model=state(float(step)))
    real_one = following._one

    def one_then_dropped_interrupt(*args: Any) -> int:
        handled = real_one(*args)
        raise_a_dropped_interrupt()
        return handled

    monkeypatch.setattr(following, "_one", one_then_dropped_interrupt)
    result = invoke(runner, *follow_cmd(root, evaluator_py, "--timeout", "2")[3:])
    assert result.exit_code == 130, (result.exit_code, result.output)
    assert "continues where this one left off" in result.output
    statuses = [s for s, _, name, _ in evaluation_rows(root) if name == "exit_status"]
    assert statuses == [1]  # stopped before the second checkpoint
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back


def test_a_failing_evaluation_records_its_exit_status_only(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, model=state(1.0))
    failing = tmp_path / "fail.py"
    failing.write_text('import json; print(json.dumps({"acc": 1.0})); raise SystemExit(3)\n')
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptdb.cli",
            "follow",
            str(root),
            "--timeout",
            "1",
            "--poll",
            "0.1",
            "--since",
            "0",
            "--",
            sys.executable,
            str(failing),
            "{path}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert evaluation_rows(root) == [(1, "fail.py", "exit_status", 3.0)]  # no "acc"
    assert "exit 3" in done.stdout


def test_follow_needs_a_command(root: Path, runner: CliRunner) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(1, model=state(1.0))
    done = invoke(runner, "follow", root)
    assert done.exit_code == 2 and "COMMAND" in done.output


def test_evaluations_of_one_name_are_unique_under_concurrent_recorders(
    root: Path, backend: str | None
) -> None:
    import threading

    with CheckpointManager(root, db_url=backend) as mgr:
        mgr.save(1, model=state(1.0))
    errors: list[BaseException] = []

    def record(value: float) -> None:
        try:
            with RunReader(root, db_url=backend) as reader:
                for _ in range(20):
                    reader.record_evaluation(reader.latest(), {"acc": value}, evaluator="e")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=record, args=(v,)) for v in (0.1, 0.2, 0.3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert len(evaluation_rows(root, backend)) == 1


def test_a_checkpoint_scored_by_several_evaluators_ranks_once(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        one = mgr.save(1, model=state(1.0))["model"]
        two = mgr.save(2, model=state(2.0))["model"]
    with RunReader(root) as reader:
        reader.record_evaluation(one, {"acc": 0.5}, evaluator="a")
        reader.record_evaluation(one, {"acc": 0.9}, evaluator="b")
        reader.record_evaluation(two, {"acc": 0.7}, evaluator="a")
        ranked = [(c.step, v, who) for c, v, who in reader.best_by("acc")]
    assert ranked == [(1, 0.9, "b"), (2, 0.7, "a")]


@pytest.mark.parametrize(
    ("command", "name"),
    [
        (["./eval.sh", "{path}"], "eval.sh"),
        (["python", "eval.py", "{path}"], "eval.py"),
        (["python3.11", "-u", "/x/eval.py", "{path}"], "eval.py"),
        (["python", "-m", "pkg.evaluate", "{path}"], "pkg.evaluate"),
        (["torchrun", "--nproc-per-node", "2", "dist_eval.py", "{path}"], "dist_eval.py"),
        (["uv", "run", "score.py"], "score.py"),
        (["shasum", "{path}"], "shasum"),
    ],
)
def test_the_default_evaluator_name_is_the_command_or_its_script(
    command: list[str], name: str
) -> None:
    from ckptdb.cli.following import default_evaluator

    assert default_evaluator(command) == name


@pytest.mark.parametrize("command", [["python", "-c", "print(1)"], ["bash", "-lc", "true"]])
def test_an_ambiguous_evaluator_name_must_be_given(command: list[str]) -> None:
    from ckptdb.cli.following import default_evaluator

    with pytest.raises(InvalidArgumentError, match="--evaluator"):
        default_evaluator(command)


def test_placeholders_are_replaced_once(tmp_path: Path) -> None:
    from ckptdb.cli.following import command_for
    from ckptdb.record import Checkpoint

    ckpt = Checkpoint(
        stream="model",
        step=7,
        path=Path("/data/sweep-{id}/step-7.pt"),
        size=1,
        hash="h",
        metric=None,
        state="committed",
        committed_at=None,  # type: ignore[arg-type]
        id=42,
        attempt_id=1,
        metrics={},
    )
    assert command_for(["x", "{path}", "--id={id}", "{step}{stream}"], ckpt) == [
        "x",
        "/data/sweep-{id}/step-7.pt",
        "--id=42",
        "7model",
    ]


def test_undecodable_output_and_huge_numbers_are_survived(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, model=state(1.0))
    noisy = tmp_path / "noisy.py"
    noisy.write_text(
        "import sys\n"
        "sys.stdout.buffer.write(b'\\xff\\xfe not utf-8\\n')\n"
        "print('{\"acc\": 0.5, \"n\": ' + '9' * 400 + '}')\n"
    )
    done = subprocess.run(
        [*follow_prefix(root), "--since", "0", "--", sys.executable, str(noisy)],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr
    assert evaluation_rows(root) == [
        (1, "noisy.py", "acc", 0.5),
        (1, "noisy.py", "exit_status", 0.0),
    ]


def follow_prefix(root: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ckptdb.cli",
        "follow",
        str(root),
        "--timeout",
        "1",
        "--poll",
        "0.1",
    ]


def test_a_hanging_evaluation_is_killed_and_recorded_as_timed_out(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, model=state(1.0))
        mgr.save(2, model=state(2.0))
    hang = tmp_path / "hang.py"
    hang.write_text(
        "import sys, time\nif sys.argv[1] == '1':\n    time.sleep(600)\nprint('{\"acc\": 1}')\n"
    )
    done = subprocess.run(
        [
            *follow_prefix(root),
            "--since",
            "0",
            "--command-timeout",
            "1",
            "--",
            sys.executable,
            str(hang),
            "{step}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr
    assert evaluation_rows(root) == [
        (1, "hang.py", "exit_status", 124.0),
        (2, "hang.py", "acc", 1.0),
        (2, "hang.py", "exit_status", 0.0),
    ]


def test_sigterm_stops_the_follower_and_its_evaluation(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, model=state(1.0))
    pidfile = tmp_path / "child.pid"
    slow = tmp_path / "slow.py"
    slow.write_text(
        f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    )
    follower = subprocess.Popen(
        [*follow_prefix(root), "--since", "0", "--", sys.executable, str(slow)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline and follower.poll() is None
        time.sleep(0.05)
    child = int(pidfile.read_text())
    follower.send_signal(signal.SIGTERM)
    _, err = follower.communicate(timeout=30)
    assert follower.returncode == 130, err
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    assert evaluation_rows(root) == []  # interrupted: nothing recorded, it runs again next time
    with RunReader(root) as reader:
        assert all(p.released_at is not None for p, _ in reader.pins())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not running
        return f.read().split()[2] != "Z"


def test_the_pin_keeps_the_file_the_trainer_evicts_while_the_command_runs(
    tmp_path: Path,
) -> None:
    """Deterministic: the evaluation starts, the trainer evicts its checkpoint, and only
    then does the evaluation load it; it succeeds because the follower pinned it."""
    import threading

    from ckptdb.cli import following

    root = tmp_path / "run"
    started, go = tmp_path / "started", tmp_path / "go"
    script = tmp_path / "late.py"
    script.write_text(
        "import json, pathlib, sys, time, torch\n"
        f"pathlib.Path({str(started)!r}).touch()\n"
        f"while not pathlib.Path({str(go)!r}).exists():\n    time.sleep(0.02)\n"
        "w = torch.load(sys.argv[1], weights_only=True)['w']\n"
        "print(json.dumps({'w': float(w[0])}))\n"
    )
    with CheckpointManager(root, streams={"model": Keep(last=1)}) as mgr:
        first = mgr.save(1, model=state(1.0))["model"]
        lines: list[str] = []

        def evict_while_it_runs() -> None:
            deadline = time.monotonic() + 60
            while not started.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            mgr.save(2, model=state(2.0))  # evicts step 1 while its evaluation runs
            assert first.path.exists()
            go.touch()

        helper = threading.Thread(target=evict_while_it_runs)
        helper.start()
        with RunReader(root) as reader:
            following.follow(
                reader,
                [sys.executable, str(script), "{path}"],
                stream="model",
                since=0,
                evaluator="late",
                ttl=60,
                timeout=2,
                poll=0.1,
                echo=lines.append,
            )
        helper.join(timeout=60)
        mgr.save(3, model=state(3.0))  # the released pin lets the file go now
        assert not first.path.exists()
    rows = evaluation_rows(root)
    assert (1, "late", "w", 1.0) in rows and (1, "late", "exit_status", 0.0) in rows


def test_last_evaluated_is_the_newest_checkpoint_an_evaluator_scored(root: Path) -> None:
    """Where a restarted ``ckptdb follow`` continues: per evaluator and per stream."""
    streams = {"model": Keep(last=None), "ema": Keep(last=None)}
    with CheckpointManager(root, streams=streams) as mgr:
        saved = [mgr.save(step, model=state(1.0), ema=state(2.0)) for step in (1, 2, 3)]
    with RunReader(root) as reader:
        assert reader.last_evaluated("a") is None
        reader.record_evaluation(saved[1]["model"], {"acc": 0.5}, evaluator="a")
        reader.record_evaluation(saved[0]["model"], {"acc": 0.4}, evaluator="a")  # later, older
        reader.record_evaluation(saved[2]["ema"], {"acc": 0.6}, evaluator="a")
        reader.record_evaluation(saved[2]["model"], {"acc": 0.7}, evaluator="b")
        assert reader.last_evaluated("a") == saved[1]["model"].id
        assert reader.last_evaluated("a", stream="ema") == saved[2]["ema"].id
        assert reader.last_evaluated("b") == saved[2]["model"].id
        assert reader.last_evaluated("c") is None
    with pytest.raises(LedgerError, match="closed"):
        reader.last_evaluated("a")
