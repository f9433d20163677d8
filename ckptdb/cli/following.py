"""``ckptdb follow ROOT -- CMD {path} {step}``: run a command for each new checkpoint.

A sidecar evaluator in one line. For every checkpoint the stream commits, in
commit order and once: pin it (retention keeps its file while the command
runs), run the command with ``{path}``, ``{step}``, ``{id}`` and ``{stream}``
replaced, and record what it reported as an evaluation: its exit status
always, and the JSON object on the last line of its output if it succeeded.
The cursor is the evaluations themselves (the newest checkpoint this
evaluator recorded something for), so a follower stopped with Ctrl-C, or
killed, continues where it left off.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError, InvalidArgumentError
from ..reader import RunReader
from ..record import Checkpoint

#: The placeholders a command may use.
FIELDS = ("path", "step", "id", "stream")


PLACEHOLDER = re.compile(r"\{(path|step|id|stream)\}")


def command_for(template: list[str], ckpt: Checkpoint) -> list[str]:
    """The command for ``ckpt``: each placeholder replaced once (a path that itself
    contains ``{id}`` stays as it is)."""
    values = {"path": str(ckpt.path), "step": str(ckpt.step), "id": str(ckpt.id)}
    values["stream"] = ckpt.stream
    return [PLACEHOLDER.sub(lambda found: values[found.group(1)], arg) for arg in template]


def reported(output: str) -> dict[str, float]:
    """The numbers of a JSON object on the output's last non-empty line (else nothing)."""
    lines = [line for line in output.splitlines() if line.strip()]
    if not lines:
        return {}
    try:
        found = json.loads(lines[-1])
    except ValueError:
        return {}
    if not isinstance(found, dict):
        return {}
    values: dict[str, float] = {}
    for key, value in found.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not key:
            continue
        try:
            values[str(key)] = float(value)
        except OverflowError:  # an integer too large for a float: not a score
            continue
    return values


def resume_cursor(reader: RunReader, evaluator: str, stream: str) -> int:
    """Where this evaluator continues: after the newest checkpoint it recorded (else 0:
    every checkpoint the stream still has, oldest first)."""
    return reader.last_evaluated(evaluator, stream) or 0


def follow(
    reader: RunReader,
    template: list[str],
    *,
    stream: str,
    since: int | None,
    evaluator: str,
    ttl: float,
    timeout: float | None,
    poll: float,
    echo: Callable[[str], None],
    command_timeout: float | None = None,
    stop: Callable[[], bool] | None = None,
) -> int:
    """Run ``template`` for each new checkpoint; the number of checkpoints handled.
    ``stop`` (asked before each checkpoint and between waits) ends the follow."""
    if not template:
        raise InvalidArgumentError("ckptdb follow needs a command after --, e.g. -- eval.sh {path}")
    cursor = resume_cursor(reader, evaluator, stream) if since is None else since
    handled = 0
    with reader.follow(stream, since=cursor, timeout=timeout, poll=poll, stop=stop) as followed:
        for ckpt in followed:
            handled += _one(reader, template, ckpt, evaluator, ttl, echo, command_timeout)
    return handled


def run_command(command: list[str], timeout: float | None) -> subprocess.CompletedProcess[str]:
    """Run one evaluation in a process group of its own, killed whole when it runs past
    ``timeout`` (exit status 124, as timeout(1) reports it) or when the follower is
    interrupted or terminated; output decoded leniently (it is only shown and parsed)."""
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    ) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(child)
            out, err = child.communicate()
            err += f"\nckptdb follow: killed after {timeout:g} s (--command-timeout)"
            return subprocess.CompletedProcess(command, TIMED_OUT, out, err)
        except BaseException:
            _kill_group(child)
            raise
    return subprocess.CompletedProcess(command, child.returncode, out, err)


#: The exit status recorded for a command killed by --command-timeout.
TIMED_OUT = 124


def _kill_group(child: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _one(
    reader: RunReader,
    template: list[str],
    ckpt: Checkpoint,
    evaluator: str,
    ttl: float,
    echo: Callable[[str], None],
    command_timeout: float | None,
) -> int:
    where = f"step {ckpt.step} (id {ckpt.id})"
    if ckpt.state != "committed":
        echo(f"{where}: skipped, {ckpt.state} before it could be read")
        return 0
    try:
        pin = reader.pin(ckpt, ttl=ttl, holder=f"ckptdb follow {evaluator}")
    except CheckpointNotFoundError:
        echo(f"{where}: skipped, evicted before it could be pinned")
        return 0
    with pin:
        done = run_command(command_for(template, ckpt), command_timeout)
    if done.stdout:
        echo(done.stdout.rstrip("\n"))
    if done.stderr:
        echo(done.stderr.rstrip("\n"))
    values: dict[str, Any] = reported(done.stdout) if done.returncode == 0 else {}
    values = {k: v for k, v in values.items() if len(k) <= 255 and not math.isinf(v)}
    values["exit_status"] = float(done.returncode)
    reader.record_evaluation(ckpt, values, evaluator=evaluator)
    shown = ", ".join(f"{k}={v:g}" for k, v in values.items() if k != "exit_status")
    echo(f"{where}: exit {done.returncode}" + (f", recorded {shown}" if shown else ""))
    return 1


#: Commands that run a script: the script names the evaluator, not the interpreter.
INTERPRETER = re.compile(r"(python|pypy)[0-9.]*|bash|sh|zsh|node|Rscript|torchrun|accelerate|uv")
SCRIPT_SUFFIXES = (".py", ".sh", ".bash", ".js", ".R", ".r")


def default_evaluator(template: list[str]) -> str:
    """The command's name (``eval.sh``), or its script's (``python -u eval.py``:
    ``eval.py``; ``python -m pkg.eval``: ``pkg.eval``). Ambiguous ones (``python -c``)
    need ``--evaluator``: the name is also the follower's cursor."""
    if not template:
        raise InvalidArgumentError("ckptdb follow needs a command after --")
    head = Path(template[0]).name
    if not INTERPRETER.fullmatch(head):
        return head[:255]
    args = template[1:]
    for flag, value in itertools.pairwise(args):
        if flag == "-m":
            return value[:255]
    scripts = [arg for arg in args if Path(arg).suffix in SCRIPT_SUFFIXES]
    if scripts:
        return Path(scripts[0]).name[:255]
    raise InvalidArgumentError(
        f"cannot name the evaluator of {' '.join(template)!r} (its name is also where a "
        "restarted follower continues): pass --evaluator NAME"
    )
