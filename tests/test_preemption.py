"""Preemption: a signal becomes one agreed, guarded save (``mgr.preemption()``).

A real training loop (``tests/preempt_loop.py``) in a subprocess gets a real
SIGTERM at a step the test picks; ranks are forked gloo processes whose
non-chief rank signals itself. Every run has a hard timeout.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from distlib import run_ranks

from ckptdb import CheckpointManager, Keep, RunReader
from ckptdb.cli import main as ckptdb_cli
from ckptdb.errors import ArgumentTypeError, InvalidArgumentError

pytestmark = pytest.mark.timeout(120)

LOOP = Path(__file__).resolve().parent / "preempt_loop.py"
REPO = LOOP.parents[1]
EXIT_SIGTERM = 128 + signal.SIGTERM


def start_loop(root: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
    full_env.pop("CKPTDB_DB_URL", None)
    return subprocess.Popen(
        [sys.executable, str(LOOP), str(root), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
    )


def signal_at(proc: subprocess.Popen[str], step: int, timeout: float = 60) -> str:
    """Read the loop's output until it starts ``step``, SIGTERM it, then the rest."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.strip() == f"STEP {step}":
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=timeout)
    return "".join(seen) + rest


def value_after(output: str, key: str) -> str:
    found = [line.split(" ", 1)[1] for line in output.splitlines() if line.startswith(key + " ")]
    assert found, output[-2000:]
    return found[-1]


def committed(root: Path) -> list[int]:
    with RunReader(root) as reader:
        return sorted(c.step for c in reader.checkpoints("model"))


def attempts(root: Path) -> list[str]:
    with RunReader(root) as reader:
        return [a.end_state for a in reader.attempts() if a.kind == "train"]


def check_clean(root: Path) -> None:
    result = CliRunner().invoke(ckptdb_cli, ["check", str(root)])
    assert result.exit_code == 0 and "consistent" in result.output, result.output
    leftovers = [p for p in (root / "checkpoints").rglob("*") if "tmp" in p.name]
    assert leftovers == []


def test_sigterm_at_a_random_step_saves_that_step_then_resume_loses_nothing(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    step = random.Random().randrange(3, 40)
    proc = start_loop(root)
    out = signal_at(proc, step)
    assert proc.returncode == EXIT_SIGTERM, out
    # the step being trained when the signal came (or, had it come just after that
    # step's check, the next one): a flag checked every step never misses it
    agreed = int(value_after(out, "PREEMPTED"))
    assert agreed in (step, step + 1), out
    assert value_after(out, "SAVED") == "['model']"
    assert committed(root)[-1] == agreed
    assert attempts(root) == ["preempted"]
    with RunReader(root) as reader:
        [summary] = reader.preemptions()
    assert summary["step"] == agreed and summary["signal"] == "SIGTERM"
    assert (summary["ranks"], summary["saved"], summary["lost"]) == ([0], True, 0)
    check_clean(root)

    again = start_loop(root, "--steps", str(agreed + 5))
    rest, _ = again.communicate(timeout=60)
    assert again.returncode == 0, rest
    assert value_after(rest, "START") == str(agreed + 1)  # nothing lost beyond the step
    with RunReader(root) as reader:
        [summary] = reader.preemptions()
    assert (summary["resumed_from"], summary["lost"]) == (agreed, 0)
    assert attempts(root) == ["preempted", "closed"]
    status = CliRunner().invoke(ckptdb_cli, ["status", str(root)])
    assert "preemptions:" in status.output and "SIGTERM" in status.output, status.output


@pytest.mark.parametrize("point", ["after_intent", "after_fsync"])
def test_a_second_signal_during_the_save_interrupts_nothing(tmp_path: Path, point: str) -> None:
    root = tmp_path / "run"
    proc = start_loop(root, env={"PREEMPT_SIGNAL_AT": point})
    out = signal_at(proc, 15)
    assert f"SIGNAL AGAIN at {point}" in out
    assert proc.returncode == EXIT_SIGTERM, out
    agreed = int(value_after(out, "PREEMPTED"))
    assert committed(root)[-1] == agreed  # the commit went through
    check_clean(root)


def test_the_guard_tripped_before_the_signal_refuses_the_preemption_checkpoint(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    proc = start_loop(root, env={"PREEMPT_NAN_AT": "12"})
    out = signal_at(proc, 15)
    assert proc.returncode == EXIT_SIGTERM, out  # refused, but still told to stop
    agreed = int(value_after(out, "PREEMPTED"))
    assert value_after(out, "SAVED") == "None"
    assert committed(root) == [0, 10]  # the last good checkpoint stands
    with RunReader(root) as reader:
        kinds = [(e.kind, e.step) for e in reader.events(limit=50)]
        [summary] = reader.preemptions()
    assert ("guard_tripped", agreed) in kinds
    assert summary["saved"] is False and summary["why"].startswith("guard: ")
    assert summary["resumed_from"] is None and summary["lost"] is None  # not known yet
    assert attempts(root) == ["preempted"]
    check_clean(root)

    again = start_loop(root, "--steps", "12")
    rest, _ = again.communicate(timeout=60)
    assert again.returncode == 0 and value_after(rest, "START") == "11", rest
    with RunReader(root) as reader:
        [summary] = reader.preemptions()
    assert (summary["resumed_from"], summary["lost"]) == (10, agreed - 10)


def test_past_the_grace_period_the_save_is_rolled_back(tmp_path: Path) -> None:
    root = tmp_path / "run"
    env = {"PREEMPT_SLEEP_AT": "after_intent:2.0"}  # a write slower than the grace period
    proc = start_loop(root, "--grace", "1.0", env=env)
    out = signal_at(proc, 15)
    assert proc.returncode == EXIT_SIGTERM, out
    agreed = int(value_after(out, "PREEMPTED"))
    assert value_after(out, "SAVED") == "None"
    assert committed(root) == [0, 10]
    with RunReader(root) as reader:
        aborted = reader.checkpoints("model", states=("aborted",))
        [summary] = reader.preemptions()
    assert [c.step for c in aborted] == [agreed]
    assert not aborted[0].path.exists()  # never half-done
    assert summary["saved"] is False and "grace period" in summary["why"]
    assert "deadline failed" in summary["why"]
    check_clean(root)


def test_killed_in_the_preemption_save_the_attempt_is_preempted_not_crashed(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    proc = start_loop(root, env={"PREEMPT_KILL_AT": "after_fsync"})
    out = signal_at(proc, 15)
    assert proc.returncode == -signal.SIGKILL, out
    with CheckpointManager(root) as mgr:  # the next writer: reconcile, and the attempt
        assert [c.step for c in mgr.checkpoints("model")] == [0, 10]
    assert attempts(root)[0] == "preempted"
    check_clean(root)


# ----------------------------------------------------------------- the API


def test_bad_arguments_are_refused_and_leave_the_handlers_alone(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with CheckpointManager(tmp_path / "run") as mgr:
        cases: list[tuple[dict[str, Any], type[Exception]]] = [
            ({"signals": "SIGTERM"}, ArgumentTypeError),
            ({"signals": [signal.SIGTERM, "USR1"]}, ArgumentTypeError),
            ({"signals": []}, InvalidArgumentError),
            ({"signals": [signal.SIGKILL]}, InvalidArgumentError),
            ({"signals": [999]}, InvalidArgumentError),
            ({"grace": 0}, InvalidArgumentError),
            ({"grace": -5.0}, InvalidArgumentError),
            ({"grace": float("inf")}, InvalidArgumentError),
            ({"grace": float("nan")}, InvalidArgumentError),
            ({"grace": "90"}, ArgumentTypeError),
            ({"every": 0}, InvalidArgumentError),
            ({"every": 2.5}, ArgumentTypeError),
        ]
        for kwargs, error in cases:
            with pytest.raises(error):
                mgr.preemption(**kwargs)
            assert signal.getsignal(signal.SIGTERM) is before, kwargs
        stop = mgr.preemption(signals=[signal.SIGTERM, signal.SIGUSR1], grace=30)
        assert signal.getsignal(signal.SIGTERM) is not before
        with pytest.raises(InvalidArgumentError, match="already handles"):
            mgr.preemption()
        assert not stop.requested(0) and stop.exit_code == 0
    assert signal.getsignal(signal.SIGTERM) is before  # the manager's close restored it
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_handlers_need_the_main_thread(tmp_path: Path) -> None:
    caught: list[BaseException] = []
    with CheckpointManager(tmp_path / "run") as mgr:

        def elsewhere() -> None:
            try:
                mgr.preemption()
            except BaseException as exc:
                caught.append(exc)

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join(10)
    assert len(caught) == 1 and isinstance(caught[0], InvalidArgumentError)
    assert "main thread" in str(caught[0])


def test_in_one_process_the_signal_is_seen_at_the_next_call(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run", streams={"model": Keep(last=2)}) as mgr:
        stop = mgr.preemption(signals=[signal.SIGUSR1])
        assert not stop.requested(1)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal changes nothing
        assert stop.requested(2) and stop.requested(3)  # stays True
        assert (stop.agreed_step, stop.count, stop.exit_code) == (2, 2, 128 + signal.SIGUSR1)
        saved = stop.save(2, model={"w": torch.ones(2)})
        assert saved is not None and saved["model"].step == 2
    with RunReader(tmp_path / "run") as reader:
        [attempt] = reader.attempts()
        detail = json.loads(reader.events_of("preempted")[0].detail or "{}")
    assert attempt.end_state == "preempted"
    assert detail == {"signal": "SIGUSR1", "ranks": [0]}


CLOSE_UNDER_SIGTERM = """
import os, signal, sys, torch
from ckptdb import CheckpointManager, Keep
from ckptdb import manager as manager_module

end_attempt = manager_module.CheckpointManager._end_attempt

def signalled_while_ending(self, end_state):  # fault injection: SIGTERM in the close
    print("ENDING", end_state, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    end_attempt(self, end_state)
    print("ENDED", flush=True)

manager_module.CheckpointManager._end_attempt = signalled_while_ending
with CheckpointManager(sys.argv[1], streams={"model": Keep(last=2)}) as mgr:
    stop = mgr.preemption()
    assert not stop.requested(1)
    mgr.save(1, model={"w": torch.ones(2)})
print("AFTER CLOSE", flush=True)
"""


def test_a_sigterm_while_the_attempt_ends_never_leaves_it_running(tmp_path: Path) -> None:
    """The attempt ends first, under ckptdb's handler: a SIGTERM then is recorded, not
    fatal, so the attempt is never left ``running`` (the stock handler, back too early,
    killed the process in the middle). Training was over: the run ends as it would have,
    saying so in a warning."""
    root = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CKPTDB_DB_URL", None)
    done = subprocess.run(
        [sys.executable, "-c", CLOSE_UNDER_SIGTERM, str(root)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ENDED" in done.stdout and "AFTER CLOSE" in done.stdout, done.stdout
    assert attempts(root) == ["closed"]
    assert committed(root) == [1]
    assert "SIGTERM was received but no preemption agreement acted on it" in done.stderr


def test_two_ledgers_in_one_process_both_hear_the_signal_and_put_everything_back(
    tmp_path: Path,
) -> None:
    """Two managers (two runs) handle SIGUSR1: the second's handler replaced the
    first's and passes the signal on. Closed in either order, the original handler
    is back."""
    original = signal.getsignal(signal.SIGUSR1)
    for first_closes_first in (True, False):
        a = CheckpointManager(tmp_path / f"a{first_closes_first}", streams={"model": Keep(last=1)})
        b = CheckpointManager(tmp_path / f"b{first_closes_first}", streams={"model": Keep(last=1)})
        stop_a = a.preemption(signals=[signal.SIGUSR1])
        stop_b = b.preemption(signals=[signal.SIGUSR1])
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop_a.requested(1) and stop_b.requested(1)
        for mgr in (a, b) if first_closes_first else (b, a):
            mgr.close()
        assert signal.getsignal(signal.SIGUSR1) == original


def _meta_device_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    """The agreement under an ambient device (DeePMD steps inside ``torch.device``)."""
    with CheckpointManager(root, streams={"model": Keep(last=2)}) as mgr:
        stop = mgr.preemption()
        for step in range(50):
            if rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            with torch.device("meta"):  # a buffer made here would be unusable
                agreed = stop.requested(step)
            if agreed:
                return {"step": step}
    return {"step": None}


def test_the_agreement_stays_on_the_cpu_whatever_the_ambient_device(tmp_path: Path) -> None:
    ranks = run_ranks(_meta_device_ranks, 2, tmp_path, str(tmp_path / "run"), timeout=60)
    assert [o.error for o in ranks] == [None, None], [o.trace for o in ranks]
    assert [o.value for o in ranks] == [{"step": 4}, {"step": 4}]


# ------------------------------------------------------------------- ranks


def _preempted_ranks(rank: int, world: int, root: str, every: int) -> dict[str, Any]:
    signalled = world - 1  # a rank other than the chief
    with CheckpointManager(root, streams={"model": Keep(last=2)}) as mgr:
        stop = mgr.preemption(every=every)
        for step in range(200):
            if rank == signalled and step == 7:
                os.kill(os.getpid(), signal.SIGTERM)
            if stop.requested(step):
                saved = stop.save(step, model={"w": torch.full((2,), float(step))})
                assert saved is not None
                return {
                    "step": step,
                    "saved": saved["model"].step,
                    "ranks": stop.ranks,
                    "exit": stop.exit_code,
                    "count": stop.count,
                }
    return {"step": None}


@pytest.mark.parametrize(
    ("world", "every", "stop_at"),
    [
        (2, 1, 8),  # signalled during step 7: launched at 7, read at 8
        (3, 1, 8),
        (2, 3, 10),  # launched at calls 0, 3, 6, 9: the signal rides on 9's, read at 10
    ],
)
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(
    tmp_path: Path, world: int, every: int, stop_at: int
) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_preempted_ranks, world, tmp_path, str(root), every, timeout=60)
    assert [o.error for o in outcomes] == [None] * world, [o.trace for o in outcomes]
    values = [o.value for o in outcomes]
    # every rank learns it at the same step, saves that step, and exits as
    # terminated by SIGTERM (the agreement runs one call behind the launch)
    assert {v["step"] for v in values} == {stop_at}
    assert {v["saved"] for v in values} == {stop_at}
    assert all(v["ranks"] == [world - 1] for v in values)
    assert all(v["exit"] == EXIT_SIGTERM for v in values)
    assert [v["count"] for v in values] == [0] * (world - 1) + [1]
    with RunReader(root) as reader:
        [summary] = reader.preemptions()
        [attempt] = reader.attempts()
    assert (summary["step"], summary["ranks"], summary["saved"]) == (stop_at, [world - 1], True)
    assert attempt.end_state == "preempted"


def test_an_event_that_cannot_be_recorded_never_changes_the_outcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The ledger fails while recording ``preempted`` and ``preemption_saved`` (fault
    injection): the answer and the committed checkpoint stand, the failures are logged."""
    with CheckpointManager(tmp_path / "run", streams={"model": Keep(last=2)}) as mgr:
        stop = mgr.preemption(signals=[signal.SIGUSR1])

        def unreachable(*args: Any, **kwargs: Any) -> None:
            raise OSError("the ledger is unreachable")

        monkeypatch.setattr(mgr._ctx, "event", unreachable)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested(4)
        saved = stop.save(4, model={"w": torch.ones(2)})
        assert saved is not None and saved["model"].step == 4
        monkeypatch.undo()
    logged = [r.getMessage() for r in caplog.records if r.name == "ckptdb.preemption"]
    assert any("'preempted' event of step 4 was not recorded" in m for m in logged), logged
    assert any("'preemption_saved' event of step 4" in m for m in logged), logged
    with RunReader(tmp_path / "run") as reader:
        assert [c.step for c in reader.checkpoints("model")] == [4]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_under_torchrun_a_sigterm_to_the_last_rank_alone_stops_every_rank_at_one_step(
    tmp_path: Path, world: int
) -> None:
    """torchrun starts ``world`` ranks of the real loop; the test sends SIGTERM to the
    last rank's process only, from outside, at step 30. Every rank agrees on one step,
    saves it once, and exits 143; none hangs."""
    root, last = tmp_path / "run", world - 1
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("CKPTDB_DB_URL", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={world}", str(LOOP), str(root), "--pace", "0.05"]
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    ) as proc:
        assert proc.stdout is not None
        seen, pid = [], None
        try:
            for line in proc.stdout:  # a line may carry another process's text before ours
                seen.append(line)
                if found := re.search(rf"RANK {last} PID (\d+)", line):
                    pid = int(found[1])
                if re.search(rf"RANK {last} STEP 30\b", line):
                    assert pid is not None
                    os.kill(pid, signal.SIGTERM)
                    break
            rest, _ = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(seen) + rest
    agreed = {int(r): int(s) for r, s in re.findall(r"RANK (\d) PREEMPTED (\d+)", output)}
    assert sorted(agreed) == list(range(world)), output[-3000:]
    (step,) = set(agreed.values())  # every rank the same step
    (received,) = map(int, re.findall(rf"RANK {last} RECEIVED (\d+)", output))
    # launched with the flag at the first call after the signal, read at the next one
    # (the signal may land between the loop's look and that call: then the same step)
    assert received >= 30 and step in (received, received + 1), output[-3000:]
    assert proc.returncode != 0  # torchrun reports its ranks' 143
    assert output.count("SAVED ['model']") == world, output[-3000:]
    assert committed(root)[-1] == step
    with RunReader(root) as reader:
        (told,) = reader.events_of("preempted")
    assert told.step == step and json.loads(told.detail)["ranks"] == [last]
    assert attempts(root) == ["preempted"]
    check_clean(root)
