"""Distributed runs: rank agreement, a chief-only ledger, sharded checkpoints.

Every test forks 2 or 3 ranks into a gloo process group on the CPU
(tests/distlib.py): collectives time out after 15 s and a rank still running
after 45 s is killed, so a protocol bug fails fast instead of hanging. Each
rank reports its outcome (value, or exception type, message and failing
ranks) and the log of collectives it ran; the log must be identical on every
rank whatever happened.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distlib import Outcome, run_ranks
from helpers import files, rows

import ckptdb
import ckptdb.manager
import ckptdb.storage.files
from ckptdb import CheckpointManager, Keep, NonFiniteGradGuard, Sharded, TopK, faults
from ckptdb.coord.dist import DistCoordinator
from ckptdb.errors import ChiefOnlyError

pytestmark = pytest.mark.timeout(60)

STREAMS = {"model": Keep(last=3), "ema": Keep(last=2), "best": TopK(2, "loss")}
WORLDS = [2, 3]


def sd(value: float, rank: int = 0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), float(value)), "b": torch.tensor([float(value) + rank])}


def same_logs(outcomes: list[Outcome]) -> list[str]:
    """The collective log, asserted identical on every rank."""
    logs = [o.value["log"] if isinstance(o.value, dict) else o.attrs.get("log") for o in outcomes]
    assert all(log == logs[0] for log in logs), logs
    return logs[0]


def manager(root: str, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(root, streams=kwargs.pop("streams", STREAMS), **kwargs)


def log_of(mgr: CheckpointManager) -> list[str]:
    assert isinstance(mgr._coord, DistCoordinator)
    return list(mgr._coord.log)


def attempt(mgr: CheckpointManager, work: Any) -> dict[str, Any]:
    """Run ``work``; report its error as data (with the collective log) instead of raising."""
    try:
        return {"value": work(), "log": log_of(mgr), "error": None}
    except Exception as exc:
        return {
            "value": None,
            "log": log_of(mgr),
            "error": type(exc).__name__,
            "mro": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),
            "ranks": getattr(exc, "ranks", None),
            "cleanup": [str(f) for f in getattr(exc, "cleanup_failures", [])],
            "phase": getattr(exc, "phase", None),
        }


def agreed_error(outcomes: list[Outcome], expected: str) -> list[dict[str, Any]]:
    """Every rank raised ``expected`` (by MRO) at the same point, after the same collectives."""
    reports = [o.value for o in outcomes]
    for o in outcomes:
        assert o.error is None, o.trace
    for r in reports:
        assert r["error"] is not None, r
        assert expected in r["mro"], r
    assert len({r["error"] for r in reports}) == 1, [r["error"] for r in reports]
    same_logs(outcomes)
    return reports


def ledger_states(root: Path) -> list[tuple[str, str, int]]:
    return rows(root, "SELECT stream, state, step FROM checkpoints ORDER BY id")


# ------------------------------------------------------------------ happy path


def _happy(rank: int, world: int, root: str) -> dict[str, Any]:
    with manager(root) as mgr:
        for step in range(1, 21):
            loss = abs(10 - step) + 0.5  # best at step 10, then 9 and 11
            mgr.save(step, metrics={"loss": loss}, model=sd(step), ema=sd(step / 2), best=sd(step))
        latest = mgr.latest()
        best = mgr.best()
        listed = mgr.checkpoints()
        log = log_of(mgr)
    with manager(root) as again:  # every rank restarts and resumes from latest
        resumed = again.load()
        best_state = again.load("best")
    return {
        "latest": latest,
        "best": [c.step for c in best],
        "listed": [(c.stream, c.step) for c in listed],
        "resumed": resumed,
        "best_state": best_state,
        "log": log,
    }


@pytest.mark.parametrize("world", WORLDS)
def test_twenty_boundaries_then_every_rank_resumes_from_latest(tmp_path: Path, world: int) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_happy, world, tmp_path, str(root))
    for o in outcomes:
        assert o.error is None, o.trace
    chief = outcomes[0].value
    assert chief["latest"].step == 20
    assert chief["best"] == [10, 9]
    assert chief["listed"] == [("best", 9), ("best", 10)] + [("ema", s) for s in (19, 20)] + [
        ("model", s) for s in (18, 19, 20)
    ]
    for o in outcomes:
        # every rank saw what the chief resolved, and loaded the same state
        assert o.value["latest"] == chief["latest"]
        assert o.value["best"] == chief["best"]
        assert o.value["listed"] == chief["listed"]
        assert torch.equal(o.value["resumed"]["w"], sd(20)["w"])
        assert torch.equal(o.value["best_state"]["w"], sd(10)["w"])
    log = same_logs(outcomes)
    assert log[0] == "open"
    boundary = ["preflight", "plan", "write", "outcome"]
    assert log[1 : 1 + 4 * 20] == boundary * 20  # exactly four collectives per boundary
    assert log[81:] == ["latest", "best", "checkpoints"]
    assert rows(root, "SELECT kind, end_state FROM attempts ORDER BY id") == [
        ("train", "closed"),
        ("train", "closed"),
    ]
    # only the chief wrote, once per stream and step (top-K: only admitted candidates)
    admitted, top = 0, []
    for step in range(1, 21):
        loss = abs(10 - step) + 0.5
        if len(top) < 2 or loss < max(top):
            admitted += 1
            top = sorted([*top, loss])[:2]
    assert rows(root, "SELECT COUNT(*) FROM checkpoints") == [(20 + 20 + admitted,)]
    assert rows(root, "SELECT COUNT(*) FROM checkpoints WHERE state = 'committed'") == [
        (3 + 2 + 2,)
    ]


def _sharded_roundtrip(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(world * 6, dtype=torch.float32).reshape(world * 2, 3)
    state = {
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        f"own_{rank}": torch.full((5,), float(rank)),  # a tensor only this rank has
        "step": 7,
    }
    with manager(root, streams={"model": Keep(last=2)}) as mgr:
        saved = mgr.save(7, model=Sharded(state))["model"]
        target = {
            "sharded": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]),
            f"own_{rank}": torch.zeros(5),
            "step": 0,
        }
        loaded = mgr.load(into=target)
        return {
            "saved": saved,
            "same_object": loaded is target,
            "local": target["sharded"].to_local().clone(),
            "expected_local": state["sharded"].to_local().clone(),
            "full": target["sharded"].full_tensor(),
            "own": target[f"own_{rank}"],
            "step": target["step"],
            "log": log_of(mgr),
        }


@pytest.mark.parametrize("world", WORLDS)
def test_sharded_save_and_restore_round_trip(tmp_path: Path, world: int) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_sharded_roundtrip, world, tmp_path, str(root))
    for o in outcomes:
        assert o.error is None, o.trace
    full = torch.arange(world * 6, dtype=torch.float32).reshape(world * 2, 3)
    for rank, o in enumerate(outcomes):
        v = o.value
        assert v["same_object"]
        assert torch.equal(v["local"], v["expected_local"])
        assert torch.equal(v["full"], full)
        assert torch.equal(v["own"], torch.full((5,), float(rank)))
        assert v["step"] == 7
        assert v["saved"] == outcomes[0].value["saved"]
    saved = outcomes[0].value["saved"]
    assert saved.path.is_dir() and saved.path.name == "step-000000007.dcp"
    # every rank wrote its shard file into the one directory; the coordinator the metadata
    assert sorted(os.listdir(saved.path)) == [".metadata"] + [
        f"__{r}_0.distcp" for r in range(world)
    ]
    assert saved.size == sum(p.stat().st_size for p in saved.path.iterdir())
    assert rows(root, "SELECT path, state, tmp_path FROM checkpoints") == [
        ("model/step-000000007.dcp", "committed", None)
    ]
    boundary = ["preflight", "plan", "write", "outcome"]
    assert same_logs(outcomes) == ["open", *boundary, "resolve", "ready", "loaded"]
    with CheckpointManager(root) as mgr:  # one process: reconcile and check accept it
        assert mgr.last_reconcile.actions == []
        assert mgr.reconcile(verify=True).actions == []
        assert mgr.check(load=True) == []


# ------------------------------------------------------- preflight agreement


def _guard_on(rank: int, world: int, root: str, bad_rank: int) -> dict[str, Any]:
    model = torch.nn.Linear(3, 2)
    guard = NonFiniteGradGuard(model)
    with manager(root, guard=guard) as mgr:
        mgr.save(1, metrics={"loss": 1.0}, model=sd(1), best=sd(1))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        if rank == bad_rank:
            model.weight.grad[0, 0] = float("nan")  # type: ignore[index]
        guard.clip_grad_norm_(model.parameters(), 1.0)
        result = attempt(mgr, lambda: mgr.save(2, metrics={"loss": 0.5}, model=sd(2), best=sd(2)))
        result["tripped_after"] = guard.tripped()  # reset on every rank
        # the next boundary publishes again, on every rank
        result["next"] = sorted(mgr.save(3, metrics={"loss": 0.4}, model=sd(3), best=sd(3)))
        return result


@pytest.mark.parametrize("world", WORLDS)
def test_guard_tripped_on_one_non_chief_rank_stops_every_rank(tmp_path: Path, world: int) -> None:
    root = tmp_path / "run"
    bad = world - 1
    outcomes = run_ranks(_guard_on, world, tmp_path, str(root), bad)
    reports = agreed_error(outcomes, "NonFiniteGradientError")
    for r in reports:
        assert r["ranks"] == [bad]
        assert f"rank {bad}" in r["message"] and "weight" in r["message"]
        assert r["tripped_after"] is False
        assert r["next"] == ["best", "model"]
    assert ("model", "pending", 2) not in ledger_states(root)
    assert [s for _, _, s in ledger_states(root)] == [1, 1, 3, 3]  # nothing at step 2
    assert not any("000000002" in f for f in files(root / "checkpoints"))
    events = rows(root, "SELECT step, detail FROM events WHERE kind = 'guard_tripped'")
    assert len(events) == 1 and events[0][0] == 2 and f'"ranks": [{bad}]' in events[0][1]


def _bad_input_on(rank: int, world: int, root: str, case: str) -> dict[str, Any]:
    with manager(root) as mgr:

        def boundary() -> Any:
            step: Any = 5
            metrics: dict[str, Any] = {"loss": 1.0}
            payloads: dict[str, Any] = {"model": sd(5), "best": sd(5)}
            if rank == world - 1:
                if case == "type":
                    step = "5"
                elif case == "stream":
                    payloads = {"modle": sd(5)}
                elif case == "step":
                    step = 6
                elif case == "nan_metric":
                    metrics = {"loss": float("nan")}
                elif case == "sharded":
                    payloads = {"model": Sharded(sd(5)), "best": sd(5)}
            return mgr.save(step, metrics=metrics, **payloads)

        result = attempt(mgr, boundary)
        result["after"] = [c.stream for c in mgr.checkpoints()]
        return result


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("type", "ArgumentTypeError"),
        ("stream", "InvalidArgumentError"),
        ("step", "InvalidArgumentError"),
        ("nan_metric", "InvalidMetricError"),
        ("sharded", "InvalidArgumentError"),
    ],
)
def test_bad_input_on_one_rank_is_refused_on_every_rank(
    tmp_path: Path, case: str, expected: str
) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_bad_input_on, 3, tmp_path, str(root), case)
    reports = agreed_error(outcomes, expected)
    for r in reports:
        assert "rank" in r["message"]
        assert r["after"] == []
        assert r["log"][-2:] == ["preflight", "plan"]  # every rank stopped after the plan
    assert rows(root, "SELECT COUNT(*) FROM checkpoints") == [(0,)]
    assert files(root / "checkpoints") == []


# ---------------------------------------------------------- write agreement


def _shard_write_fails(rank: int, world: int, root: str, cleanup_fails: bool) -> dict[str, Any]:
    with manager(root) as mgr:
        mgr.save(1, metrics={"loss": 1.0}, model=sd(1), best=sd(1))

        def fail(name: str) -> None:
            if name == "mid_shard_write" and rank == world - 1:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")

        real = ckptdb.storage.files.remove

        def stubborn(path: Path) -> bool:
            if ".tmp-" in path.name and os.path.lexists(path):
                raise PermissionError(errno.EACCES, "Permission denied (injected)", str(path))
            return real(path)

        faults.set_hook(fail)
        if cleanup_fails and rank == 0:
            ckptdb.storage.files.remove = stubborn  # type: ignore[assignment]
        try:
            result = attempt(mgr, lambda: mgr.save(2, model=Sharded(sd(2, rank)), ema=sd(2)))
        finally:
            faults.set_hook(None)
            ckptdb.storage.files.remove = real  # type: ignore[assignment]
        result["latest"] = mgr.latest()
        return result


@pytest.mark.parametrize("world", WORLDS)
def test_non_chief_shard_write_failure_rolls_back_on_every_rank(tmp_path: Path, world: int) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_shard_write_fails, world, tmp_path, str(root), False)
    reports = agreed_error(outcomes, "PublishError")
    for r in reports:
        assert r["ranks"] == [world - 1]
        assert "No space left on device (injected)" in r["message"]
        assert r["latest"].step == 1  # nothing published
        assert r["log"][-4:] == ["preflight", "plan", "write", "outcome"]
    assert [(s, st) for s, st, step in ledger_states(root) if step == 2] == [
        ("model", "aborted"),
        ("ema", "aborted"),
    ]
    assert not any("000000002" in f for f in files(root / "checkpoints"))
    assert rows(root, "SELECT kind FROM events WHERE kind = 'publish_failed'") == [
        ("publish_failed",)
    ]


@pytest.mark.parametrize("world", WORLDS)
def test_cleanup_failure_on_the_chief_is_reported_on_every_rank(tmp_path: Path, world: int) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_shard_write_fails, world, tmp_path, str(root), True)
    reports = agreed_error(outcomes, "PublishError")
    for r in reports:
        assert len(r["cleanup"]) == 1 and "Permission denied (injected)" in r["cleanup"][0]
        assert ".dcp.tmp-" in r["cleanup"][0]
        assert "No space left on device (injected)" in r["message"]
    # the leftover stays pending for the next reconcile, which removes it
    assert ("model", "pending", 2) in ledger_states(root)
    with CheckpointManager(root) as mgr:
        assert [a.kind for a in mgr.last_reconcile.actions] == ["rolled_back"]
        assert mgr.check() == []
    assert not any("000000002" in f for f in files(root / "checkpoints"))


def _chief_commit_fails(rank: int, world: int, root: str) -> dict[str, Any]:
    with manager(root) as mgr:
        mgr.save(1, metrics={"loss": 1.0}, model=sd(1), best=sd(1))

        def fail(name: str) -> None:
            if name == "in_commit" and rank == 0:
                raise RuntimeError("commit exploded (injected)")

        faults.set_hook(fail)
        result = attempt(mgr, lambda: mgr.save(2, metrics={"loss": 0.5}, model=sd(2), best=sd(2)))
        faults.set_hook(None)
        result["latest"] = mgr.latest()
        return result


@pytest.mark.parametrize("world", WORLDS)
def test_chief_commit_failure_raises_the_same_error_on_every_rank(
    tmp_path: Path, world: int
) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_chief_commit_fails, world, tmp_path, str(root))
    reports = agreed_error(outcomes, "PublishError")
    for r in reports:
        assert r["error"] == "PublishError" and r["phase"] == "commit"
        assert r["ranks"] == [0]
        assert "commit exploded (injected)" in r["message"]
        assert r["latest"].step == 1
    assert sorted(st for _, st, step in ledger_states(root) if step == 2) == ["aborted", "aborted"]
    assert not any("000000002" in f for f in files(root / "checkpoints"))


# ------------------------------------------------------------ reads and loads


def _load_corrupt(rank: int, world: int, root: str) -> dict[str, Any]:
    with manager(root) as mgr:
        mgr.save(1, metrics={"loss": 1.0}, model=sd(1), best=sd(1))
        saved = mgr.save(2, metrics={"loss": 2.0}, model=sd(2), best=sd(2))
        if rank == 0:
            saved["model"].path.write_bytes(b"garbage")
        dist.barrier()
        result = attempt(mgr, lambda: mgr.load())
        result["fallback"] = mgr.load()["w"]
        return result


@pytest.mark.parametrize("world", WORLDS)
def test_corrupt_latest_found_by_the_chief_fails_every_rank(tmp_path: Path, world: int) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_load_corrupt, world, tmp_path, str(root))
    reports = agreed_error(outcomes, "CorruptCheckpointError")
    for r in reports:
        assert r["ranks"] == [0]
        assert torch.equal(r["fallback"], sd(1)["w"])  # latest fell back, on every rank
    assert ("model", "corrupt", 2) in ledger_states(root)


def _load_misread_on_the_last_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """The chief verifies the file; the last rank's own read of it comes back different
    (a stale client cache on a network filesystem, say)."""
    import ckptdb.storage.heldfile as heldfile

    with manager(root, streams={"model": Keep(last=2)}) as mgr:
        mgr.save(1, model=sd(1))
        if rank == world - 1:
            real = heldfile.read_hashed

            def misread(f: Any) -> heldfile.HeldFile:
                held = real(f)
                return heldfile.HeldFile(
                    ckptdb.storage.files.FileInfo(held.info.size, "0" * 32), None, b""
                )

            heldfile.read_hashed = misread  # type: ignore[assignment]
        return attempt(mgr, lambda: mgr.load())


def test_a_rank_whose_own_read_differs_fails_every_rank_and_loads_nothing(
    tmp_path: Path,
) -> None:
    """Every rank unpickles only what it hashed itself: the chief's verification does not
    vouch for another rank's read. The mismatch is raised, not recorded (only the chief
    writes the ledger), so the row stays committed."""
    root = tmp_path / "run"
    outcomes = run_ranks(_load_misread_on_the_last_rank, 3, tmp_path, str(root))
    reports = agreed_error(outcomes, "CorruptCheckpointError")
    for r in reports:
        assert r["ranks"] == [2]
        assert r["log"][-2:] == ["resolve", "ready"]  # nobody went on to unpickle
    assert ledger_states(root) == [("model", "committed", 1)]


def _load_into_mismatch(rank: int, world: int, root: str) -> dict[str, Any]:
    with manager(root, streams={"model": Keep(last=2)}) as mgr:
        mgr.save(1, model=Sharded(sd(1)))
        into = sd(0) if rank != world - 1 else None
        return attempt(mgr, lambda: mgr.load(into=into))


def test_a_rank_that_cannot_load_a_sharded_checkpoint_fails_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_load_into_mismatch, 3, tmp_path, str(root))
    reports = agreed_error(outcomes, "InvalidArgumentError")
    for r in reports:
        assert r["ranks"] == [2] and "into=" in r["message"]
        assert r["log"][-2:] == ["resolve", "ready"]  # nobody entered the DCP load
    assert rows(root, "SELECT COUNT(*) FROM events WHERE kind = 'resumed'") == [(0,)]


# ---------------------------------------------------------- opening, maintenance


def _open_while_locked(rank: int, world: int, root: str) -> dict[str, Any]:
    try:
        manager(root)
    except Exception as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "ranks": getattr(exc, "ranks", None),
        }
    return {"error": None}


def test_chief_open_failure_is_raised_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root):  # another writer holds the run
        outcomes = run_ranks(_open_while_locked, 3, tmp_path, str(root))
    for o in outcomes:
        assert o.error is None, o.trace
        assert o.value["error"] == "LedgerLockedError", o.value
        assert o.value["ranks"] == [0]


def _followers_touch_nothing(rank: int, world: int, root: str) -> dict[str, Any]:
    touched: list[str] = []
    if rank != 0:

        def forbid(module: Any, name: str) -> None:
            real = getattr(module, name)

            def spy(*args: Any, **kwargs: Any) -> Any:
                touched.append(f"{module.__name__}.{name}")
                return real(*args, **kwargs)

            setattr(module, name, spy)

        for name in ("write_stream", "make_dir", "place", "fsync_dir", "remove", "seal_directory"):
            forbid(ckptdb.storage.files, name)
        forbid(ckptdb.manager, "open_ledger")
        forbid(ckptdb.manager, "writer_lock")
    with manager(root) as mgr:
        for step in range(1, 4):
            mgr.save(step, metrics={"loss": float(step)}, model=Sharded(sd(step, rank)), best=sd(1))
        mgr.log_metrics(3, {"acc": 0.5})
        mgr.load(into=sd(0, rank))
        errors = []
        for call in (mgr.reconcile, mgr.check, mgr.gc):
            try:
                call()
            except ChiefOnlyError as exc:
                errors.append(str(exc))
        return {"touched": touched, "chief_only": errors}


def test_non_chief_ranks_never_touch_the_ledger_or_files(tmp_path: Path) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_followers_touch_nothing, 3, tmp_path, str(root))
    for o in outcomes:
        assert o.error is None, o.trace
    assert outcomes[0].value["chief_only"] == []
    for o in outcomes[1:]:
        assert o.value["touched"] == []
        assert len(o.value["chief_only"]) == 3 and "rank" in o.value["chief_only"][0]
    # the chief's metrics only
    assert rows(root, "SELECT name, COUNT(*) FROM metrics GROUP BY name") == [
        ("acc", 1),
        ("loss", 3),
    ]
    # every file on disk belongs to a committed sharded checkpoint or the best stream
    on_disk = files(root / "checkpoints")
    assert all(".tmp-" not in f for f in on_disk)
    assert {f.split("/")[0] for f in on_disk} == {"model", "best"}


# ------------------------------------------------------------- a rank dies


def _rank_dies(rank: int, world: int, root: str) -> dict[str, Any]:
    with manager(root) as mgr:
        mgr.save(1, metrics={"loss": 1.0}, model=sd(1), best=sd(1))
        if rank == world - 1:
            os._exit(3)  # dies before the next boundary's preflight
        return attempt(mgr, lambda: mgr.save(2, metrics={"loss": 0.5}, model=sd(2), best=sd(2)))


def test_a_dead_rank_gives_a_clear_error_not_a_hang(tmp_path: Path) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_rank_dies, 2, tmp_path, str(root), may_die=True)
    assert outcomes[1] is None  # it died
    chief = outcomes[0]
    assert chief is not None
    assert chief.error is None, chief.trace
    assert chief.value["error"] == "RankAgreementError"
    assert "'preflight' collective failed" in chief.value["message"]
    assert [s for _, _, s in ledger_states(root)] == [1, 1]  # nothing pending or published


# ------------------------------------------------------- the torchrun example

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchrun_train.py"


def _torchrun(root: Path, steps: int) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(EXAMPLE),
        str(root),
        f"--steps={steps}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.timeout(240)
def test_torchrun_example_resumes_every_rank_exactly(tmp_path: Path) -> None:
    """The torchrun example of docs/distributed.md, run for real: stopped at step 40 and
    restarted, it ends bit-for-bit where an uninterrupted run ends (model,
    optimizer and every rank's RNG come back from the ledger)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _torchrun(straight, 60)
    _torchrun(resumed, 40)
    _torchrun(resumed, 60)
    final = []
    for root in (straight, resumed):
        with CheckpointManager(root) as mgr:
            assert mgr.check(load=True) == []
            latest = mgr.latest("model")
            assert latest is not None and latest.step == 59
            final.append(mgr.load("latest"))
    for name, tensor in final[0]["model"].items():
        assert torch.equal(tensor, final[1]["model"][name]), name
    # attempts: the first torchrun, the restarted one, and the check above
    restarts = rows(resumed, "SELECT resumed_from_id FROM attempts ORDER BY id")
    assert len(restarts) == 3 and restarts[0] == (None,) and restarts[1][0] is not None
    resumed_step = rows(resumed, "SELECT step FROM checkpoints WHERE id = ?", restarts[1][0])
    assert resumed_step == [(39,)]


# ---------------------------------------------------- asynchronous boundaries


def bg_log(mgr: CheckpointManager) -> list[str]:
    group = mgr._writer.group
    return list(group.log) if group is not None else []


def _async_happy(rank: int, world: int, root: str) -> dict[str, Any]:
    streams = {"model": Keep(last=2), "best": TopK(1, "loss"), "mine": Keep(last=2)}
    with manager(root, streams=streams) as mgr:
        w = torch.zeros(6)
        handles = []
        for step in range(1, 9):
            w += 1
            handles.append(
                mgr.save(
                    step,
                    metrics={"loss": 1.0 / step},
                    blocking=False,
                    model={"w": w},
                    best={"w": w},
                    mine=Sharded({f"r{rank}": w + rank}),
                )
            )
            w.mul_(-1)  # in place, right after the call: must not reach the checkpoint
        results = [h.result() for h in handles]
        into = {f"r{rank}": torch.zeros(6)}
        mgr.load(stream="mine", into=into)
        return {
            "results": results,
            "model": mgr.load()["w"],
            "mine": into[f"r{rank}"],
            "log": log_of(mgr),
            "bg": bg_log(mgr),
        }


@pytest.mark.parametrize("world", WORLDS)
def test_async_boundaries_commit_the_snapshot_on_every_rank(tmp_path: Path, world: int) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_async_happy, world, tmp_path, str(root))
    for o in outcomes:
        assert o.error is None, o.trace
    # the value each boundary saw at call time, replayed by hand
    w, seen = torch.zeros(6), []
    for _ in range(8):
        w += 1
        seen.append(w.clone())
        w.mul_(-1)
    for rank, o in enumerate(outcomes):
        v = o.value
        # loss falls at every step, so the top-1 stream admits every candidate
        assert [sorted(r) for r in v["results"]] == [["best", "mine", "model"]] * 8
        assert v["results"] == outcomes[0].value["results"]  # every rank, the same records
        assert torch.equal(v["model"], seen[-1])
        assert torch.equal(v["mine"], seen[-1] + rank)
    same_logs(outcomes)
    for o in outcomes:
        # the training group carries the call-time collectives only; the write and
        # commit agreements ran on the dedicated group, in the background
        assert o.value["log"][1:25] == ["preflight", "plan", "snapshot"] * 8
        assert o.value["bg"] == ["write", "outcome"] * 8
    assert len({tuple(o.value["bg"]) for o in outcomes}) == 1


def _async_overlaps_training(rank: int, world: int, root: str) -> dict[str, Any]:
    """The chief's background write is held until the training loop has run
    collectives of its own on the training group: they must not wait for it."""
    release = threading.Event()
    if rank == 0:
        real = ckptdb.storage.files.write_stream

        def held(obj: Any, tmp: Path) -> Any:
            assert release.wait(COLLECTIVE_WAIT), "never released"
            return real(obj, tmp)

        ckptdb.storage.files.write_stream = held  # type: ignore[assignment]
    with manager(root, streams={"model": Keep(last=2)}) as mgr:
        handle = mgr.save(1, blocking=False, model=sd(1))
        done_early = handle.done()
        total = torch.tensor([float(rank)])
        for _ in range(5):  # "training" on the same group while the save is in flight
            dist.all_reduce(total)
        release.set()
        records = handle.result()
        return {"done_early": done_early, "total": total.item(), "step": records["model"].step}


COLLECTIVE_WAIT = 30.0


def test_async_write_in_flight_does_not_block_training_collectives(tmp_path: Path) -> None:
    outcomes = run_ranks(_async_overlaps_training, 3, tmp_path, str(tmp_path / "run"))
    totals = []
    for o in outcomes:
        assert o.error is None, o.trace
        assert o.value["done_early"] is False
        assert o.value["step"] == 1
        totals.append(o.value["total"])
    expected = float(sum(range(3)))
    for _ in range(4):
        expected *= 3
    assert totals == [expected] * 3


def _async_failures(rank: int, world: int, root: str, fetch: bool) -> dict[str, Any]:
    with manager(root) as mgr:
        mgr.save(1, metrics={"loss": 1.0}, model=sd(1), best=sd(1))

        def fail(name: str) -> None:
            if name == "mid_shard_write" and rank == world - 1:
                raise OSError(errno.EIO, "Input/output error (injected)")

        faults.set_hook(fail)
        try:
            handle = mgr.save(2, blocking=False, model=Sharded(sd(2, rank)), ema=sd(2))
            first = attempt(mgr, handle.result) if fetch else {"error": None}
            handle.wait()  # finished (without fetching its outcome) before the hook goes
        finally:
            faults.set_hook(None)
        # unfetched: the next save raises it (on every rank) and does not run
        nxt = attempt(mgr, lambda: mgr.save(3, metrics={"loss": 0.3}, model=sd(3), best=sd(3)))
        after = mgr.save(4, metrics={"loss": 0.2}, model=sd(4), best=sd(4))
        return {"first": first, "next": nxt, "after": sorted(after), "log": log_of(mgr)}


@pytest.mark.parametrize("fetch", [True, False], ids=["fetched", "unfetched"])
def test_async_failure_on_one_rank_reaches_every_rank(tmp_path: Path, fetch: bool) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_async_failures, 3, tmp_path, str(root), fetch)
    for o in outcomes:
        assert o.error is None, o.trace
    reports = [o.value["first"] if fetch else o.value["next"] for o in outcomes]
    for r in reports:
        assert r["error"] == "PublishError", r
        assert r["ranks"] == [2] and "Input/output error (injected)" in r["message"]
    for o in outcomes:
        if fetch:
            assert o.value["next"]["error"] is None  # fetched: the next save just works
        assert o.value["after"] == ["best", "model"]
    same_logs(outcomes)
    states = ledger_states(root)
    assert sorted(st for _, st, step in states if step == 2) == ["aborted", "aborted"]
    assert [st for _, st, step in states if step == 3] == (["committed"] * 2 if fetch else [])
    assert not any("000000002" in f for f in files(root / "checkpoints"))


def _async_guard(rank: int, world: int, root: str) -> dict[str, Any]:
    guard = NonFiniteGradGuard()
    with manager(root, guard=guard) as mgr:
        if rank == 1:
            guard.update(torch.tensor(float("inf")))
        result = attempt(mgr, lambda: mgr.save(1, blocking=False, model=sd(1)))
        result["inflight"] = mgr._inflight.handle is not None
        return result


def test_async_guard_trip_on_one_rank_raises_at_call_time_everywhere(tmp_path: Path) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_async_guard, 3, tmp_path, str(root))
    for r in agreed_error(outcomes, "NonFiniteGradientError"):
        assert r["ranks"] == [1]
        assert r["inflight"] is False  # nothing went to the background
        assert r["log"][-2:] == ["preflight", "plan"]
    assert rows(root, "SELECT COUNT(*) FROM checkpoints") == [(0,)]


# ------------------------------------------- regressions from the code review


def _typo_then_retry(rank: int, world: int, root: str) -> dict[str, Any]:
    guard = NonFiniteGradGuard()
    with manager(root, guard=guard) as mgr:
        if rank == 1:
            guard.update(torch.tensor(float("nan")))
        payload = {"modle": sd(1)} if rank == 0 else {"model": sd(1)}
        typo = attempt(mgr, lambda: mgr.save(1, metrics={"loss": 1.0}, **payload))
        retry = attempt(mgr, lambda: mgr.save(1, metrics={"loss": 1.0}, model=sd(1)))
        return {"typo": typo, "retry": retry, "log": log_of(mgr)}


def test_a_typo_on_one_rank_does_not_reset_the_guard_anywhere(tmp_path: Path) -> None:
    """Bad input stops the boundary before the guard is looked at, as in one process:
    the NaN seen on rank 1 still stops the corrected retry on every rank."""
    root = tmp_path / "run"
    outcomes = run_ranks(_typo_then_retry, 2, tmp_path, str(root))
    for o in outcomes:
        assert o.error is None, o.trace
        assert o.value["typo"]["error"] == "UnknownStreamError"
        assert o.value["retry"]["error"] == "NonFiniteGradientError"
        assert o.value["retry"]["ranks"] == [1]
    same_logs(outcomes)
    assert rows(root, "SELECT COUNT(*) FROM checkpoints") == [(0,)]
    # the metrics of the refused (diverged) boundary are history, recorded once
    assert rows(root, "SELECT COUNT(*) FROM metrics WHERE name = 'loss'") == [(1,)]


def _fetched_on_chief_only(rank: int, world: int, root: str) -> dict[str, Any]:
    with manager(root) as mgr:

        def fail(name: str) -> None:
            if name == "mid_shard_write" and rank == 1:
                raise OSError(errno.EIO, "Input/output error (injected)")

        faults.set_hook(fail)
        try:
            handle = mgr.save(1, blocking=False, model=Sharded(sd(1, rank)))
            first = attempt(mgr, handle.result) if rank == 0 else {"error": None}
            handle.wait()
        finally:
            faults.set_hook(None)
        nxt = attempt(mgr, lambda: mgr.save(2, metrics={"loss": 0.3}, model=sd(2), best=sd(2)))
        after = sorted(mgr.save(3, metrics={"loss": 0.2}, model=sd(3), best=sd(3)))
        return {"first": first, "next": nxt, "after": after, "log": log_of(mgr)}


def test_an_error_fetched_on_some_ranks_only_is_raised_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_fetched_on_chief_only, 2, tmp_path, str(root))
    for o in outcomes:
        assert o.error is None, o.trace
        assert o.value["next"]["error"] == "PublishError", o.value["next"]
        assert "Input/output error (injected)" in o.value["next"]["message"]
        assert o.value["after"] == ["best", "model"]
    assert outcomes[0].value["first"]["error"] == "PublishError"
    same_logs(outcomes)
    assert [s for _, _, s in ledger_states(root) if _ == "committed"] == [3, 3]


class FlakyState:
    """DCP's app-state pattern (Stateful), whose state_dict() fails on one rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def state_dict(self) -> dict[str, Any]:
        if self.rank == 1:
            raise RuntimeError("state_dict exploded (injected)")
        return {"x": torch.ones(2)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _stateful_fails(rank: int, world: int, root: str) -> dict[str, Any]:
    with manager(root) as mgr:
        return attempt(mgr, lambda: mgr.save(1, model=Sharded({"app": FlakyState(rank)})))


def test_a_stateful_failing_on_one_rank_is_agreed_not_a_timeout(tmp_path: Path) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_stateful_fails, 2, tmp_path, str(root), timeout=12)
    for r in agreed_error(outcomes, "InvalidArgumentError"):
        assert r["ranks"] == [1] and "state_dict exploded (injected)" in r["message"]
    assert rows(root, "SELECT COUNT(*) FROM checkpoints") == [(0,)]


def _close_after_destroy(rank: int, world: int, root: str) -> dict[str, Any]:
    mgr = manager(root, streams={"model": Keep(last=2)})
    mgr.save(1, blocking=False, model=sd(1)).result()
    mgr.log_metrics(1, {"acc": 0.5})
    dist.destroy_process_group()  # as a training script's teardown may, before close
    mgr.close()
    return {"closed": True}


def test_close_after_the_process_group_is_destroyed_still_ends_the_attempt(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_close_after_destroy, 2, tmp_path, str(root))
    for o in outcomes:
        assert o.error is None, o.trace
    assert rows(root, "SELECT end_state FROM attempts") == [("closed",)]
    assert rows(root, "SELECT name, value FROM metrics") == [("acc", 0.5)]
    with CheckpointManager(root):  # the writer lock was released
        pass


def _dies_before_plan(rank: int, world: int, root: str) -> dict[str, Any]:
    from ckptdb.coord.dist import RankGroup

    with manager(root, streams={"model": Keep(last=2)}) as mgr:
        if rank == 1:
            real = RankGroup.share

            def die_at_plan(self: RankGroup, name: str, obj: Any) -> Any:
                if name == "plan":
                    os._exit(3)
                return real(self, name, obj)

            RankGroup.share = die_at_plan  # type: ignore[method-assign]
        return attempt(mgr, lambda: mgr.save(1, model=Sharded(sd(1, rank))))


def test_a_rank_dying_before_the_plan_leaves_nothing_pending(tmp_path: Path) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_dies_before_plan, 2, tmp_path, str(root), may_die=True)
    assert outcomes[1] is None
    chief = outcomes[0]
    assert chief is not None and chief.error is None, chief and chief.trace
    assert chief.value["error"] in ("RankAgreementError", "PublishError"), chief.value
    assert ledger_states(root) == [("model", "aborted", 1)]
    assert files(root / "checkpoints") == []


def _dies_in_dcp(rank: int, world: int, root: str) -> dict[str, Any]:
    with manager(root, streams={"model": Keep(last=2)}) as mgr:
        if rank == 1:
            faults.set_hook(lambda name: os._exit(3) if name == "mid_shard_write" else None)
        return attempt(mgr, lambda: mgr.save(1, model=Sharded(sd(1, rank))))


def test_a_rank_dying_inside_dcp_is_rolled_back_once(tmp_path: Path) -> None:
    """The chief's DCP write fails, then the ``write`` agreement: one rollback,
    one ``publish_failed`` event, nothing left behind."""
    root = tmp_path / "run"
    outcomes = run_ranks(_dies_in_dcp, 2, tmp_path, str(root), may_die=True)
    chief = outcomes[0]
    assert outcomes[1] is None
    assert chief is not None and chief.error is None, chief and chief.trace
    assert chief.value["error"] == "RankAgreementError"
    assert "'write' collective failed" in chief.value["message"]
    assert ledger_states(root) == [("model", "aborted", 1)]
    assert files(root / "checkpoints") == []
    assert rows(root, "SELECT COUNT(*) FROM events WHERE kind = 'publish_failed'") == [(1,)]


def _steps_past_32_bits(rank: int, world: int, root: str, url: str) -> dict[str, Any]:
    with manager(root, db_url=url) as mgr:
        mgr.log_metrics(2**31, {"loss": 1.0})
        mgr.save(2**31, model=Sharded(sd(1, rank)))

        def past() -> None:
            mgr.save(2**63, model=Sharded(sd(1, rank)))

        latest = mgr.latest()
        return {"latest": latest.step if latest else None, "past": attempt(mgr, past)["error"]}


def test_every_rank_saves_a_64_bit_step_on_postgresql(tmp_path: Path, pg_url: str) -> None:
    """PostgreSQL's step columns are BIGINT (revision 0003): a step past 2**31 - 1
    commits on every rank, and past 2**63 - 2 every rank refuses it alike."""
    root = tmp_path / "run"
    outcomes = run_ranks(_steps_past_32_bits, 2, tmp_path, str(root), pg_url)
    for o in outcomes:
        assert o.error is None, o.trace
        assert o.value == {"latest": 2**31, "past": "InvalidArgumentError"}


def test_one_ranks_failure_relayed_by_the_chief_is_said_once() -> None:
    """A write failure on rank 1 reaches the ``write`` gather twice: from rank 1 itself
    and from the chief, which already agreed on it (``wrote``) and relays it. The
    agreed message names it once; a different failure of another rank is still added."""
    from ckptdb.coord.dist import first_error
    from ckptdb.errors import WireError

    own = WireError(1, "PublishError", "OSError: [Errno 5] disk on fire", {}, (1,))
    relayed = WireError(0, "PublishError", "rank 1: OSError: [Errno 5] disk on fire", {}, (1,))
    agreed = first_error([relayed, own])
    assert agreed is not None
    assert agreed.message == "rank 1: OSError: [Errno 5] disk on fire"
    assert agreed.ranks == (1,)
    other = WireError(2, "PublishError", "OSError: [Errno 28] disk full", {}, (2,))
    both = first_error([relayed, own, other])
    assert both is not None
    assert both.message == (
        "rank 1: OSError: [Errno 5] disk on fire (also rank 2: OSError: [Errno 28] disk full)"
    )
    assert both.ranks == (1, 2)
