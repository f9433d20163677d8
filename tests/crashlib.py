"""Crash-test machinery: child processes that save and die, and a reference model.

A *child* opens a run, publishes a schedule of boundaries (model + ema + best
at each) and records every boundary it begins and every save that returned
("acknowledged") in an append-only JSON-lines file, fsynced line by line. It
dies by ``os._exit(CRASH_EXIT)`` at a fault point (crash-point sweep) or by
SIGKILL from the parent (random kills). Children are forked from the test
process (torch already imported, so a child costs milliseconds) or, for a
sanity check that fork is not hiding anything, started as a fresh interpreter.

The parent then feeds the ack file and the ledger to :class:`Reference`, a
plain-Python model of the stream policies, and :func:`verify` reopens the run
(reconcile), runs the invariant checker and compares the committed rows with
what the reference says must be committed (invariant 5 and more).

The ledger is the run's SQLite file, or the PostgreSQL database of
``ChildSpec.db_url`` (the same URL for the child and for the parent's checks).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from helpers import LedgerClient, await_sessions_gone, child_app_name
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ckptdb import CheckpointManager, Keep, TopK, faults
from ckptdb.location import ObjectPath, is_object_url
from ckptdb.policies import Policy
from ckptdb.storage import dcp
from ckptdb.storage.naming import SHARDED_SUFFIX

CRASH_EXIT = 17
STREAM_CODE = {"model": 0, "ema": 1, "best": 2}
BIG_ELEMENTS = 10 * 2**20 // 4  # a ~10 MiB float32 tensor
TESTS_DIR = Path(__file__).resolve().parent
HEALTHY_STATES = {"committed", "deleted", "aborted"}
EXTERNAL_DIR_STATE = "state.pt"  # what a framework's directory checkpoint holds, in these tests


def policies() -> dict[str, Policy]:
    return {"model": Keep(last=2), "ema": Keep(last=1), "best": TopK(2, "val_loss")}


# ------------------------------------------------------------------ schedules


@dataclass(frozen=True)
class Boundary:
    """One ``save`` call: its position in the schedule, step, metric, payload size."""

    index: int
    step: int
    val_loss: float
    big: bool = False


def boundaries(
    spec: list[tuple[int, float]] | None = None, *, seed: int = 0, big_every: int = 0
) -> Iterator[Boundary]:
    """The boundaries of ``spec`` (step, val_loss), or an endless seeded random schedule.

    The random schedule mostly advances by 10 steps and, one time in five,
    goes back in time (by 0-30 steps: a resume from an older checkpoint or a
    re-save of the same step). Losses come from a coarse grid so ties on the
    metric happen and top-K must break them by step.
    """
    if spec is not None:
        yield from (Boundary(i, s, v) for i, (s, v) in enumerate(spec))
        return
    rng = random.Random(seed)
    step = 0
    index = 0
    while True:
        if index >= 3 and rng.random() < 0.2:
            step = max(0, step - rng.choice((0, 10, 20, 30)))
        else:
            step += 10
        big = big_every > 0 and rng.random() < 1 / big_every
        yield Boundary(index, step, rng.randrange(10) / 10, big)
        index += 1


def payload(b: Boundary, stream: str) -> dict[str, torch.Tensor]:
    """A state dict tagged with (boundary index, stream, step), so a file proves its origin."""
    n = BIG_ELEMENTS if b.big and stream == "model" else 8
    return {
        "tag": torch.tensor([b.index, STREAM_CODE[stream], b.step]),
        "w": torch.full((n,), float(b.index)),
    }


# --------------------------------------------------------------------- children


@dataclass
class ChildSpec:
    """What one child does. ``arm_after``: boundaries completed before the crash
    hook is armed (0: armed before the manager opens, so the reconcile at open
    counts). ``maintenance``: open without reconcile (to stack the damage of two
    crashes). ``reconcile_every``: after every R boundaries, drop a stray
    temporary file and call ``reconcile()``. ``db_url``: the ledger (None: the
    run's own SQLite file)."""

    root: str
    ack: str
    log: str
    boundaries: list[Boundary]
    crash_point: str | None = None
    crash_n: int = 1
    arm_after: int = 0
    maintenance: bool = False
    reconcile_every: int = 0
    db_url: str | None = None
    save_dir: str | None = None  # an s3:// URL (credentials from the environment)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ChildSpec:
        data = json.loads(text)
        data["boundaries"] = [Boundary(**b) for b in data["boundaries"]]
        return cls(**data)


def _record(fd: int, entry: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(entry) + "\n").encode())
    os.fsync(fd)


def plant_stray_temp(save_dir: Path, stream: str = "model", tag: int = 999_999) -> Path:
    """A temporary file in our naming that no row owns (a crash leftover)."""
    path = save_dir / stream / f".step-{tag:09d}.pt.tmp-{tag}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"partial")
    return path


def exit_at_point() -> None:
    os._exit(CRASH_EXIT)


def run_child(spec: ChildSpec, die: Callable[[], None] = exit_at_point) -> int:
    """The child's whole life; returns its exit status (0: schedule done, no crash).

    ``die`` is called at the crash point: ``os._exit`` in a child process; a
    test running this in-process passes one that raises instead (the manager
    is then closed on the way out, as a trainer's ``with`` block would).
    """
    hook_state = {"armed": spec.arm_after == 0, "visits": 0}

    def hook(name: str) -> None:
        if hook_state["armed"] and name == spec.crash_point:
            hook_state["visits"] += 1
            if hook_state["visits"] == spec.crash_n:
                die()

    previous = faults.set_hook(hook if spec.crash_point else None)
    fd = os.open(spec.ack, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        with CheckpointManager(
            spec.root,
            streams=policies(),
            maintenance=spec.maintenance,
            db_url=spec.db_url,
            save_dir=spec.save_dir,
        ) as mgr:
            _record(fd, {"opened": os.getpid()})
            for done, b in enumerate(spec.boundaries):
                if done == spec.arm_after:
                    hook_state["armed"] = True
                _record(fd, {"begin": b.index})
                out = mgr.save(
                    b.step,
                    metrics={"val_loss": b.val_loss},
                    **{s: payload(b, s) for s in STREAM_CODE},
                )
                _record(fd, {"ack": b.index, "rows": {s: c.id for s, c in out.items()}})
                if spec.reconcile_every and (done + 1) % spec.reconcile_every == 0:
                    if not is_object_url(mgr.save_dir):  # object storage has no temp files
                        plant_stray_temp(mgr.save_dir)
                    mgr.reconcile()
    finally:
        os.close(fd)
        faults.set_hook(previous)
    return 0


def open_files_under(root: Path) -> list[str]:
    """Files under ``root`` this process holds open (Linux; [] where /proc is absent)."""
    found = []
    fd_dir = Path("/proc/self/fd")
    if not fd_dir.is_dir():
        return found
    prefix = str(root.resolve())
    for entry in fd_dir.iterdir():
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith(prefix):
            found.append(target)
    return found


def fork_child(spec: ChildSpec) -> int:
    """Fork a child running ``spec``; returns its pid. The child never returns."""
    return fork_running(Path(spec.root), Path(spec.log), lambda: run_child(spec))


def fork_running(root: Path, log_path: Path, body: Callable[[], int]) -> int:
    """Fork a child that runs ``body`` (its exit code) with stdout and stderr in
    ``log_path``; returns its pid. The child never returns: it ``os._exit``s."""
    held = open_files_under(root)
    assert not held, f"the parent holds {held} open; a forked child would inherit them"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid != 0:
        return pid
    code = 1
    try:
        log = open(log_path, "a", buffering=1)  # noqa: SIM115 (the process ends below)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
        os.environ["PGAPPNAME"] = child_app_name(os.getpid())  # see await_sessions_gone
        torch.set_num_threads(1)  # the parent's intra-op pool does not survive fork
        code = body()
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stderr.flush()
        finally:
            os._exit(code)


def wait_child(pid: int, timeout: float) -> int:
    """Exit status of ``pid`` (negative: killed by that signal); kills it if it hangs."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"child {pid} still running after {timeout} s (hang?)")
        time.sleep(0.002)


def run_forked(spec: ChildSpec, timeout: float = 60) -> int:
    """Run ``spec`` in a forked child; its exit status, once its sessions are gone."""
    pid = fork_child(spec)
    code = wait_child(pid, timeout)
    await_sessions_gone(spec.db_url, pid)
    return code


def run_subprocess(spec: ChildSpec, timeout: float = 120) -> int:
    """The same child in a fresh interpreter (no state inherited from the test process)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), *filter(None, [env.get("PYTHONPATH")])])
    code = "import sys, crashlib; sys.exit(crashlib.main(sys.argv[1]))"
    with (
        open(spec.log, "a") as log,
        subprocess.Popen(
            [sys.executable, "-c", code, spec.to_json()],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        ) as child,
    ):
        try:
            returncode = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            raise
    await_sessions_gone(spec.db_url, child.pid)
    return returncode


def main(spec_json: str) -> int:
    os.environ["PGAPPNAME"] = child_app_name(os.getpid())  # see await_sessions_gone
    torch.set_num_threads(1)
    return run_child(ChildSpec.from_json(spec_json))


def wait_for_line(path: Path, key: str, timeout: float) -> bool:
    """Whether ``path`` got a record with ``key`` within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(key in entry for entry in read_records(path)):
            return True
        time.sleep(0.002)
    return False


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete records of an ack file (a line cut short by the crash is ignored)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]  # the part after the last newline is incomplete
    return [json.loads(line) for line in lines if line]


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return "(no log)"


# -------------------------------------------------------------------- the ledger


@dataclass(frozen=True)
class Row:
    id: int
    stream: str
    step: int
    state: str
    path: str
    was_committed: bool


ROWS_QUERY = "SELECT id, stream, step, state, path, committed_at IS NOT NULL FROM checkpoints"


def ledger_rows(root: Path, db_url: str | None = None) -> list[Row]:
    """Every checkpoint row, read with plain SQL (no reconcile, no lock)."""
    if db_url is not None:
        client = LedgerClient(root, db_url)
        try:
            if client.rows("SELECT to_regclass('checkpoints') IS NULL") == [(True,)]:
                return []  # killed before the first migration committed
            found = client.rows(ROWS_QUERY)
        finally:
            client.close()
        return [Row(i, s, st, state, p, bool(c)) for i, s, st, state, p, c in found]
    found = sqlite_rows(root, ROWS_QUERY)
    return [Row(i, s, st, state, p, bool(c)) for i, s, st, state, p, c in found]


def sqlite_rows(root: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """``sql`` on the run's own SQLite ledger, read with plain SQL (no reconcile, no
    lock); nothing when there is no ledger yet, or its first migration never committed."""
    db = root / "ckptdb.sqlite"
    if not db.exists():
        return []
    con = sqlite3.connect(db)
    try:
        return list(con.execute(sql, args).fetchall())
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return []  # killed before the first migration committed
        raise
    finally:
        con.close()


def integrity(root: Path) -> str:
    con = sqlite3.connect(root / "ckptdb.sqlite")
    try:
        return str(con.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        con.close()


# ------------------------------------------------------------- reference model


@dataclass(frozen=True)
class Saved:
    stream: str
    id: int
    step: int
    index: int
    metric: float | None


@dataclass
class Reference:
    """What must be committed after a sequence of committed boundaries.

    ``commit`` applies one boundary the way the design says: a ``Keep`` stream
    drops every checkpoint at a step >= the new one (timeline rule), then keeps
    the newest ``last``; a ``TopK`` stream admits a candidate only if it ranks
    in the best K by (metric, step) among the members at other steps, and a
    re-save of a member's step replaces it.
    """

    policies: dict[str, Policy]
    schedule: dict[int, Boundary]
    live: dict[str, list[Saved]] = field(default_factory=dict)
    known: dict[int, Saved] = field(default_factory=dict)
    acked: dict[int, Saved] = field(default_factory=dict)
    evicted_by: dict[int, int] = field(default_factory=dict)
    next_index: int = 0
    acks: int = 0
    unacked_commits: int = 0
    interrupted: int = 0

    def __post_init__(self) -> None:
        self.live = {s: [] for s in self.policies}

    def commit(self, b: Boundary, rows: dict[str, int], *, acked: bool) -> list[str]:
        problems = []
        for stream, policy in self.policies.items():
            live = self.live[stream]
            if isinstance(policy, Keep):
                if stream not in rows:
                    problems.append(f"boundary {b.index} (step {b.step}): {stream} not published")
                    continue
                new = Saved(stream, rows[stream], b.step, b.index, None)
                gone = [e for e in live if e.step >= b.step]
                kept = sorted(
                    [e for e in live if e.step < b.step] + [new],
                    key=lambda e: (e.step, e.id),
                    reverse=True,
                )
                if policy.last is not None:
                    gone += [e for e in kept[policy.last :] if not _kept_forever(policy, e)]
                kept = [e for e in kept if e not in gone]
            else:
                others = [e for e in live if e.step != b.step]
                admitted = self.admits(stream, b)
                if admitted != (stream in rows):
                    problems.append(
                        f"boundary {b.index} (step {b.step}, {policy.metric} {b.val_loss}): "
                        f"{stream} {'published' if stream in rows else 'not published'}, "
                        f"but the top-{policy.k} reference says it "
                        f"{'enters' if admitted else 'does not enter'} (members "
                        f"{[(e.step, e.metric) for e in live]})"
                    )
                if stream not in rows:
                    continue
                new = Saved(stream, rows[stream], b.step, b.index, b.val_loss)
                kept = sorted([*others, new], key=lambda e: _rank(policy, e))[: policy.k]
                gone = [e for e in live if e not in kept]
            for e in gone:
                self.evicted_by[e.id] = b.index
            self.live[stream] = kept
            self.known[new.id] = new
            if acked:
                self.acked[new.id] = new
        return problems

    def admits(self, stream: str, b: Boundary) -> bool:
        """Whether a top-K stream's candidate at ``b`` enters: fewer than K members at
        other steps rank better by (metric, step)."""
        policy = self.policies[stream]
        assert isinstance(policy, TopK)
        candidate = Saved(stream, -1, b.step, b.index, b.val_loss)
        mine = _rank(policy, candidate)[:2]
        better = [e for e in self.live[stream] if e.step != b.step and _rank(policy, e)[:2] < mine]
        return len(better) < policy.k

    def absorb(self, ack_file: Path, rows: list[Row]) -> list[str]:
        """Apply one dead child's acknowledged boundaries, then its in-flight one if
        the ledger shows that it committed (died after COMMIT, before the ack)."""
        return self.absorb_records(read_records(ack_file), rows)

    def absorb_records(self, records: list[dict[str, Any]], rows: list[Row]) -> list[str]:
        """:meth:`absorb` on records already read (``begin``/``ack`` entries, in order)."""
        problems: list[str] = []
        begun: int | None = None
        for entry in records:
            if "begin" in entry:
                begun = entry["begin"]
                self.next_index = begun + 1
            elif "ack" in entry:
                b = self.schedule[entry["ack"]]
                problems += self.commit(b, entry["rows"], acked=True)
                self.acks += 1
                begun = None
        unknown = [r for r in rows if r.was_committed and r.id not in self.known]
        if begun is not None:
            self.interrupted += 1
        if not unknown:
            return problems
        b = self.schedule[begun] if begun is not None else None
        if b is None or any(r.step != b.step for r in unknown):
            return [
                *problems,
                f"rows committed that no boundary in flight explains: {unknown} (in flight: {b})",
            ]
        by_stream = {r.stream: r.id for r in unknown}
        if len(by_stream) != len(unknown):
            return [*problems, f"one boundary committed twice to a stream: {unknown}"]
        self.unacked_commits += 1
        return problems + self.commit(b, by_stream, acked=False)

    def compare(self, rows: list[Row]) -> list[str]:
        """Committed rows vs the reference; invariant 5 first."""
        by_id = {r.id: r for r in rows}
        committed = {r.id for r in rows if r.state == "committed"}
        expected = {e.id for live in self.live.values() for e in live}
        problems = []
        for ident, saved in sorted(self.acked.items()):
            if ident not in committed and ident not in self.evicted_by:
                state = by_id[ident].state if ident in by_id else "missing from the ledger"
                problems.append(
                    f"invariant 5: acknowledged {saved.stream} step {saved.step} (row {ident}, "
                    f"boundary {saved.index}) is {state}, but no later committed boundary "
                    "evicted it"
                )
        for ident in sorted(expected - committed):
            saved = self.known[ident]
            if ident not in self.acked:
                state = by_id[ident].state if ident in by_id else "missing"
                problems.append(
                    f"{saved.stream} step {saved.step} (row {ident}) committed by the boundary "
                    f"in flight at the crash is now {state}"
                )
        for ident in sorted(committed - expected):
            row = by_id[ident]
            why = (
                f"evicted by policy at boundary {self.evicted_by[ident]}"
                if ident in self.evicted_by
                else "never acknowledged nor committed in flight"
            )
            problems.append(f"{row.stream} step {row.step} (row {ident}) committed, but {why}")
        return problems

    def check_contents(self, save_dir: Path, rows: list[Row]) -> list[str]:
        """Each committed file holds the payload of the boundary its row came from."""
        problems = []
        for row in rows:
            if row.state != "committed" or row.id not in self.known:
                continue
            saved = self.known[row.id]
            try:
                tag = read_payload(save_dir, row.path)["tag"].tolist()
            except Exception as exc:  # the finding itself
                problems.append(f"{row.path} (row {row.id}) does not load: {exc!r}")
                continue
            want = [saved.index, STREAM_CODE[row.stream], saved.step]
            if tag != want:
                problems.append(f"{row.path} (row {row.id}) holds boundary {tag}, expected {want}")
        return problems


def read_payload(save_dir: Path, rel: str) -> Any:
    """A stored payload, read directly: a local file, a sharded (DCP) directory, a
    framework's directory (its ``state.pt``), or an object with boto3."""
    if not isinstance(save_dir, ObjectPath):
        path = save_dir / rel
        if rel.endswith(SHARDED_SUFFIX):
            return read_sharded(path)
        if path.is_dir():
            return torch.load(path / EXTERNAL_DIR_STATE, weights_only=True)
        return torch.load(path, weights_only=True)
    import boto3

    client = boto3.client("s3", endpoint_url=os.environ.get("CKPTDB_S3_ENDPOINT_URL"))
    body = client.get_object(Bucket=save_dir.bucket, Key=f"{save_dir.key}/{rel}")
    return torch.load(io.BytesIO(body["Body"].read()), weights_only=True)


def read_sharded(path: Path) -> dict[str, Any]:
    """A sharded checkpoint read back in one process, into tensors shaped by its metadata."""
    meta = dcp.file_reader(path).read_metadata().state_dict_metadata
    into: dict[str, Any] = {
        key: torch.zeros(tuple(m.size), dtype=m.properties.dtype)
        for key, m in meta.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load_sharded(into, dcp.file_reader(path), None)
    return into


def _rank(policy: TopK, e: Saved) -> tuple[float, int, int]:
    """Best first: by metric (in the policy's direction), then the earlier step."""
    assert e.metric is not None
    return (e.metric if policy.mode == "min" else -e.metric, e.step, e.id)


def _kept_forever(policy: Keep, e: Saved) -> bool:
    return policy.every is not None and e.step % policy.every == 0


# ----------------------------------------------------------------- verification


@dataclass
class Verified:
    problems: list[str]
    reconcile_counts: dict[str, int]


def verify(root: Path, ref: Reference, db_url: str | None = None) -> Verified:
    """Reopen (reconcile) and check every invariant; the reference must have absorbed
    the dead child's ack file already. (``PRAGMA integrity_check`` on SQLite only: a
    PostgreSQL server keeps its own files consistent across a client's death.)"""
    problems: list[str] = []
    with CheckpointManager(root, streams=policies(), db_url=db_url) as mgr:
        counts = mgr.last_reconcile.counts
        problems += [f"check: {p}" for p in mgr.check(load=True)]
        rows = ledger_rows(root, db_url)
        problems += ref.compare(rows)
        problems += ref.check_contents(mgr.save_dir, rows)
        odd = sorted({r.state for r in rows} - HEALTHY_STATES)
        if odd:
            problems.append(f"rows left in states {odd} after reconcile")
        again = mgr.reconcile()
        problems += [f"second reconcile acted: {a}" for a in again.actions]
    if db_url is None:
        status = integrity(root)
        if status != "ok":
            problems.append(f"PRAGMA integrity_check: {status}")
    return Verified(problems, counts)


def save_once_more(root: Path, ref: Reference, b: Boundary, db_url: str | None = None) -> list[str]:
    """A further save after the crash succeeds and leaves a consistent run."""
    with CheckpointManager(root, streams=policies(), db_url=db_url) as mgr:
        out = mgr.save(
            b.step, metrics={"val_loss": b.val_loss}, **{s: payload(b, s) for s in STREAM_CODE}
        )
        problems = ref.commit(b, {s: c.id for s, c in out.items()}, acked=True)
        problems += [f"check after the further save: {p}" for p in mgr.check(load=True)]
        rows = ledger_rows(root, db_url)
        problems += ref.compare(rows)
        problems += ref.check_contents(mgr.save_dir, rows)
    return problems
