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

import json
import math
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError, InvalidArgumentError
from ..ledger import evaluations
from ..reader import RunReader
from ..record import Checkpoint

#: The placeholders a command may use.
FIELDS = ("path", "step", "id", "stream")


def command_for(template: list[str], ckpt: Checkpoint) -> list[str]:
    values = {"path": str(ckpt.path), "step": str(ckpt.step), "id": str(ckpt.id)}
    values["stream"] = ckpt.stream
    out = []
    for arg in template:
        for name, value in values.items():
            arg = arg.replace("{" + name + "}", value)
        out.append(arg)
    return out


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
    return {
        str(k): float(v)
        for k, v in found.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and str(k)
    }


def resume_cursor(reader: RunReader, evaluator: str, stream: str) -> int:
    """Where this evaluator continues: after the newest checkpoint it recorded (else 0:
    every checkpoint the stream still has, oldest first)."""
    with reader._db.transaction(read=True) as session:
        found = evaluations.last_evaluated_id(session, reader.run_id, evaluator, stream)
    return found or 0


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
) -> int:
    """Run ``template`` for each new checkpoint; the number of checkpoints handled."""
    if not template:
        raise InvalidArgumentError("ckptdb follow needs a command after --, e.g. -- eval.sh {path}")
    cursor = resume_cursor(reader, evaluator, stream) if since is None else since
    handled = 0
    with reader.follow(stream, since=cursor, timeout=timeout, poll=poll) as followed:
        for ckpt in followed:
            handled += _one(reader, template, ckpt, evaluator, ttl, echo)
    return handled


def _one(
    reader: RunReader,
    template: list[str],
    ckpt: Checkpoint,
    evaluator: str,
    ttl: float,
    echo: Callable[[str], None],
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
        done = subprocess.run(command_for(template, ckpt), capture_output=True, text=True)
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
INTERPRETERS = ("python", "bash", "sh", "node", "Rscript", "uv", "torchrun")


def default_evaluator(template: list[str]) -> str:
    """The command's name (``eval.sh``), or its script's (``python eval.py``: eval.py)."""
    names = [Path(arg).name for arg in template]
    if not names:
        return "follow"
    if names[0].startswith(INTERPRETERS) and len(names) > 1 and not names[1].startswith("-"):
        return names[1][:255]
    return names[0][:255]
