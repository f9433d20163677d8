"""Asynchronous publication on one process: ``save(..., blocking=False)``.

The call decides everything synchronously (input, guard, top-K admission, the
``pending`` rows), snapshots the payload to host memory and returns a
:class:`~ckptdb.protocol.asyncsave.SaveHandle`; writing, fsync, placement and the commit
run on one background thread. These tests hold that thread at the write with a
gate (a ``threading.Event`` the test controls, never a sleep) to show what is
and is not done when ``save`` returns, and check: the records equal a blocking
save's, snapshot isolation (in-place updates after the call, tied weights),
reuse of the snapshot buffers, every way a background error is delivered (and
never lost), preflight errors raised by the call itself, the waits for the
boundary in flight (next save, close, flush, load, reconcile/check/gc), top-K
admission at call time, crash consistency at every protocol point of a write
in flight (forked children), and sharded payloads. (Several ranks:
tests/test_distributed.py.)

"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import errno
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from crashlib import CRASH_EXIT, fork_running, tail, wait_child
from helpers import files, rows, state

import ckptdb.storage.dcp
import ckptdb.storage.files
from ckptdb import CheckpointManager, Keep, NonFiniteGradGuard, Preempted, Sharded, TopK, faults
from ckptdb.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    InvalidMetricError,
    LedgerError,
    NonFiniteGradientError,
    PublishError,
    UnknownStreamError,
)
from ckptdb.protocol.asyncsave import BackgroundWriter, SaveHandle, Snapshotter
from ckptdb.storage import is_sharded

Opener = Callable[..., CheckpointManager]

WAIT = 30.0  # upper bound for anything the test waits on (a hang fails, never a slow pass)
PROBE = 0.2  # how long a thread that must be blocked is given to (wrongly) finish
ASYNC_LOGGER = "ckptdb.asyncsave"
STREAMS = {"model": Keep(last=3), "ema": Keep(last=3), "best": TopK(2, "val_loss")}


# --------------------------------------------------------------------- helpers


# Where the write of one payload happens, by the function a gate holds.
GATED = {"write_stream": ckptdb.storage.files, "write_sharded": ckptdb.storage.dcp}


class Gate:
    """Holds the calls of ``<module>.<name>`` (the write of one payload) until
    :attr:`release` is set: every call, or the first ``hold`` ones. Records each call
    (file name, and what ``observe()`` returned at the call) and its thread."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        name: str = "write_stream",
        hold: int | None = None,
        observe: Callable[[], Any] = lambda: None,
    ) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls: list[tuple[str, Any]] = []  # (file name, observe() at the call)
        self.threads: list[threading.Thread] = []
        module = GATED[name]
        real = getattr(module, name)

        def gated(obj: Any, path: Path, *args: Any) -> Any:
            index = len(self.calls)
            where = getattr(path, "path", path)  # a DCP writer writes into its path
            self.calls.append((Path(str(where)).name, observe()))
            self.threads.append(threading.current_thread())
            if hold is None or index < hold:
                self.entered.set()
                if not self.release.wait(WAIT):
                    raise TimeoutError("the test never released the gate")
            return real(obj, path, *args)

        monkeypatch.setattr(module, name, gated)


@pytest.fixture
def gate(open_manager: Opener, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Gate]]:
    """Make gates; all are released at teardown, before ``open_manager`` closes the
    managers (which wait for the boundary in flight)."""
    made: list[Gate] = []

    def factory(**kwargs: Any) -> Gate:
        made.append(Gate(monkeypatch, **kwargs))
        return made[-1]

    yield factory
    for g in made:
        g.release.set()


class Worker(threading.Thread):
    """Runs ``fn`` in a thread; :meth:`outcome` joins it and returns or raises."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.finished = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:
            self.error = exc
        finally:
            self.finished.set()

    def blocked(self) -> bool:
        """Whether the thread is still running after a short probe."""
        return not self.finished.wait(PROBE)

    def outcome(self) -> Any:
        self.join(WAIT)
        assert not self.is_alive(), "the thread never finished"
        if self.error is not None:
            raise self.error
        return self.value


@pytest.fixture
def no_background(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts snapshots and submissions to the background writer."""
    counts = {"snapshot": 0, "submit": 0}
    real_snapshot, real_submit = Snapshotter.snapshot, BackgroundWriter.submit

    def snapshot(self: Snapshotter, stream: str, payload: Any, *kind: Any) -> Any:
        counts["snapshot"] += 1
        return real_snapshot(self, stream, payload, *kind)

    def submit(self: BackgroundWriter, step: int, work: Callable[[], Any]) -> SaveHandle:
        counts["submit"] += 1
        return real_submit(self, step, work)

    monkeypatch.setattr(Snapshotter, "snapshot", snapshot)
    monkeypatch.setattr(BackgroundWriter, "submit", submit)
    return counts


def states(root: Path, step: int) -> dict[str, str]:
    """Stream -> row state of the rows at ``step``."""
    return dict(rows(root, "SELECT stream, state FROM checkpoints WHERE step = ?", step))


def committed_steps(root: Path) -> list[tuple[str, int]]:
    found = rows(root, "SELECT stream, step FROM checkpoints WHERE state = 'committed'")
    return sorted((s, n) for s, n in found)


def described(c: ckptdb.Checkpoint, save_dir: Path) -> tuple[Any, ...]:
    """What a blocking and an asynchronous save of the same payload must agree on."""
    relative = c.path.relative_to(save_dir).as_posix()
    return (c.stream, c.step, relative, c.size, c.hash, c.metric, c.state, c.metrics)


def assert_same(actual: Any, expected: Any, where: str = "payload") -> None:
    """Same structure, types and values (tensors by dtype, shape and content)."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), f"{where}: {actual} != {expected}"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def load_file(path: Path, *, weights_only: bool = True) -> Any:
    return torch.load(path, map_location="cpu", weights_only=weights_only)


def enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fail_writes(monkeypatch: pytest.MonkeyPatch, error: BaseException, nth: int = 1) -> None:
    """The ``nth`` ``torch.save`` (inside the protocol's write) raises ``error``."""
    real = torch.save
    calls = {"n": 0}

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == nth:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "save", failing)


def optimizer_state() -> dict[str, Any]:
    """A real Adam state dict after one step (tensors in nested dicts, lists, floats)."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return opt.state_dict()


# ------------------------------------------------- the call returns before the write


def test_save_returns_before_the_write_and_commits_like_a_blocking_save(
    open_manager: Opener, gate: Callable[..., Gate], root: Path, tmp_path: Path
) -> None:
    mgr = open_manager(streams=STREAMS)
    first = mgr.save(1, metrics={"val_loss": 0.5}, model=state(1.0), ema=state(-1.0))
    g = gate()

    handle = mgr.save(
        2, metrics={"val_loss": 0.25}, model=state(2.0), ema=state(-2.0), best=state(3.0),
        blocking=False,
    )  # fmt: skip

    assert isinstance(handle, SaveHandle) and handle.step == 2
    assert g.entered.wait(WAIT)  # the background thread reached the write, and waits
    assert all(t is not threading.main_thread() for t in g.threads)
    assert not handle.done()
    with pytest.raises(concurrent.futures.TimeoutError):
        handle.exception(timeout=0)
    assert states(root, 2) == {"model": "pending", "ema": "pending", "best": "pending"}
    assert mgr.latest("model") == first["model"]
    assert mgr.latest("ema") == first["ema"]
    assert mgr.best("best") == []

    g.release.set()
    out = handle.result(timeout=WAIT)

    assert handle.done() and handle.exception() is None
    assert states(root, 2) == {"model": "committed", "ema": "committed", "best": "committed"}
    # the same boundaries, saved blocking in another run, give the same records
    other = open_manager(tmp_path / "blocking", streams=STREAMS)
    other.save(1, metrics={"val_loss": 0.5}, model=state(1.0), ema=state(-1.0))
    expected = other.save(
        2, metrics={"val_loss": 0.25}, model=state(2.0), ema=state(-2.0), best=state(3.0)
    )
    assert sorted(out) == sorted(expected)
    for stream in expected:
        assert described(out[stream], mgr.save_dir) == described(expected[stream], other.save_dir)
        assert mgr.latest(stream) == out[stream]
    assert_same(mgr.load("latest"), state(2.0))
    assert_same(mgr.load("latest", stream="ema"), state(-2.0))
    assert mgr.best("best") == [out["best"]]
    assert mgr.check() == []


def test_the_metrics_of_an_async_boundary_commit_with_it(
    open_manager: Opener, gate: Callable[..., Gate], root: Path
) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.log_metrics(1, {"loss": 1.5})
    g = gate()
    handle = mgr.save(2, metrics={"val_loss": 0.5}, best=state(2.0), blocking=False)
    assert g.entered.wait(WAIT)
    assert rows(root, "SELECT COUNT(*) FROM metrics") == [(0,)]  # buffered until the commit
    g.release.set()
    handle.result(timeout=WAIT)
    found = rows(root, "SELECT step, name, value FROM metrics ORDER BY step, name")
    assert found == [(1, "loss", 1.5), (2, "val_loss", 0.5)]


# ---------------------------------------------------------------- snapshot isolation


def test_in_place_updates_after_the_call_do_not_reach_the_file(
    open_manager: Opener, gate: Callable[..., Gate]
) -> None:
    mgr = open_manager(streams=STREAMS)
    payload: dict[str, Any] = {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "t": torch.arange(10, dtype=torch.float64)[2:8:2],  # a strided view
        "nested": {"list": [torch.ones(2), torch.zeros(3, dtype=torch.int64)], "cfg": {"lr": 0.1}},
        "pair": (torch.full((2,), 7.0), "tag"),
        "epoch": 3,
    }
    opt = optimizer_state()
    expected_model, expected_opt = copy.deepcopy(payload), copy.deepcopy(opt)
    g = gate()

    handle = mgr.save(2, model=payload, ema=opt, blocking=False)
    # the trainer goes on while the write is held: every container and tensor changes
    payload["w"].add_(100)
    payload["t"].mul_(-1)
    payload["nested"]["list"][0].zero_()
    payload["nested"]["list"][1].fill_(9)
    payload["nested"]["list"].append(torch.ones(1))
    payload["nested"]["cfg"]["lr"] = 99.0
    payload["pair"][0].fill_(-7)
    payload["epoch"] = 4
    payload["new"] = torch.ones(1)
    for per_param in opt["state"].values():
        for value in per_param.values():
            value.add_(1000)  # Adam's exp_avg/exp_avg_sq/step are updated in place
    opt["param_groups"][0]["lr"] = 0.5
    opt["state"][0]["extra"] = torch.ones(1)
    g.release.set()
    out = handle.result(timeout=WAIT)

    assert_same(load_file(out["model"].path), expected_model)
    assert_same(load_file(out["ema"].path), expected_opt)
    assert_same(mgr.load("latest"), expected_model)


class TiedModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied weights


def test_tied_weights_stay_one_storage(
    open_manager: Opener, gate: Callable[..., Gate], tmp_path: Path
) -> None:
    mgr = open_manager()
    model = TiedModel()
    sd = dict(model.state_dict())  # two keys, two tensor objects, one storage
    base = torch.arange(12, dtype=torch.float32)
    sd["alias"] = base  # the same tensor under two keys
    sd["again"] = base
    sd["view"] = base.view(12)  # a different view object, same storage/offset/shape/stride
    assert sd["embed.weight"] is not sd["head.weight"]
    expected = copy.deepcopy(sd)
    plain = tmp_path / "plain.pt"
    torch.save(sd, plain)  # stores each storage once
    g = gate()

    handle = mgr.save(1, model=sd, blocking=False)
    with torch.no_grad():
        model.embed.weight.mul_(0)
    base.fill_(-1)
    g.release.set()
    saved = handle.result(timeout=WAIT)["model"]

    loaded = load_file(saved.path)
    assert_same(loaded, expected)

    def storage(key: str) -> int:
        return int(loaded[key].untyped_storage().data_ptr())

    assert storage("embed.weight") == storage("head.weight")
    assert storage("alias") == storage("again") == storage("view")
    assert storage("alias") != storage("embed.weight")
    # not larger than torch.save of the original
    assert saved.size is not None and saved.size <= plain.stat().st_size


def test_aliases_in_one_snapshot_are_one_tensor() -> None:
    snapshots = Snapshotter()
    t = torch.ones(4)
    copied = snapshots.snapshot("model", {"a": t, "b": t, "c": t.view(4), "d": t[:2]})
    assert copied["a"] is copied["b"] is copied["c"]
    assert copied["a"] is not t and copied["a"].data_ptr() != t.data_ptr()  # a real copy
    assert copied["d"].untyped_storage().data_ptr() != copied["a"].untyped_storage().data_ptr()
    assert torch.equal(copied["d"], t[:2])


# ------------------------------------------------------------------- buffer reuse


def boundary_payload(value: float, rows_: int = 3) -> dict[str, Any]:
    return {
        "w": torch.full((rows_, 4), value),
        "b": torch.full((4,), -value, dtype=torch.float64),
        "i": torch.tensor([int(value)] * 2, dtype=torch.int32),
        "inner": [torch.full((2,), value)],
    }


def count_tensors(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(count_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(count_tensors(v) for v in obj)
    return 0


def buffer_ids(mgr: CheckpointManager) -> dict[tuple[str, Any], tuple[torch.Tensor, int]]:
    return {k: (b, b.data_ptr()) for k, b in mgr._snapshots._buffers.items()}


def test_repeated_boundaries_reuse_the_snapshot_buffers(open_manager: Opener) -> None:
    mgr = open_manager(streams=STREAMS)
    first = mgr.save(1, model=boundary_payload(1.0), ema=boundary_payload(-1.0), blocking=False)
    first.result(timeout=WAIT)
    before = buffer_ids(mgr)
    assert len(before) == 2 * count_tensors(boundary_payload(0.0))  # per stream and position
    assert {stream for stream, _ in before} == {"model", "ema"}

    second = mgr.save(2, model=boundary_payload(2.0), ema=boundary_payload(-2.0), blocking=False)
    out = second.result(timeout=WAIT)

    after = buffer_ids(mgr)
    assert after.keys() == before.keys()
    for key, (buf, ptr) in before.items():
        assert after[key][0] is buf and after[key][1] == ptr, key  # reused, not reallocated
    # reuse never leaks one boundary's values into another's file
    assert_same(load_file(out["model"].path), boundary_payload(2.0))
    assert_same(load_file(out["ema"].path), boundary_payload(-2.0))
    assert_same(mgr.load(1, stream="model"), boundary_payload(1.0))

    # a shape change (and a dtype change) allocates a new buffer for that position only
    changed = boundary_payload(3.0, rows_=5)
    changed["i"] = changed["i"].to(torch.int64)
    third = mgr.save(3, model=changed, blocking=False).result(timeout=WAIT)
    now = buffer_ids(mgr)
    assert now.keys() == before.keys()
    renewed = {key for key in now if now[key][0] is not before[key][0]}
    assert len(renewed) == 2 and {k[0] for k in renewed} == {"model"}
    assert sorted((tuple(now[k][0].shape), now[k][0].dtype) for k in renewed) == sorted(
        [((5, 4), torch.float32), ((2,), torch.int64)]
    )
    assert_same(load_file(third["model"].path), changed)


# --------------------------------------------------------------------------- errors


def test_a_background_write_error_is_raised_by_result(
    open_manager: Opener, monkeypatch: pytest.MonkeyPatch, root: Path, caplog: Any
) -> None:
    mgr = open_manager(streams=STREAMS)
    older = mgr.save(1, model=state(1.0), ema=state(-1.0))
    error = enospc()
    fail_writes(monkeypatch, error, nth=2)  # the second stream's write fails

    with caplog.at_level(logging.ERROR, logger=ASYNC_LOGGER):
        handle = mgr.save(2, model=state(2.0), ema=state(-2.0), blocking=False)
        with pytest.raises(PublishError) as info:
            handle.result(timeout=WAIT)

    exc = info.value
    assert exc.phase == "write" and exc.step == 2
    assert exc.__cause__ is error
    assert exc.cleanup_failures == []
    assert handle.exception() is exc  # the same error, again
    assert states(root, 2) == {"model": "aborted", "ema": "aborted"}
    assert files(mgr.save_dir) == sorted(
        c.path.relative_to(mgr.save_dir).as_posix() for c in older.values()
    )
    assert mgr.latest("model") == older["model"] and mgr.latest("ema") == older["ema"]
    logged = [r for r in caplog.records if r.name == ASYNC_LOGGER]
    assert [r.levelno for r in logged] == [logging.ERROR]
    assert str(exc) in logged[0].getMessage()
    monkeypatch.undo()
    assert mgr.check() == []
    # fetched: the next save runs normally, and close does not raise it again
    again = mgr.save(2, model=state(2.0), ema=state(-2.0), blocking=False).result(timeout=WAIT)
    assert_same(mgr.load(again["model"]), state(2.0))
    mgr.close()


@pytest.mark.parametrize("next_blocking", [True, False])
def test_an_unfetched_error_is_raised_by_the_next_save(
    open_manager: Opener, monkeypatch: pytest.MonkeyPatch, root: Path, next_blocking: bool
) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=state(1.0))
    error = enospc()
    fail_writes(monkeypatch, error)
    handle = mgr.save(2, model=state(2.0), blocking=False)
    handle.wait()  # finished, its outcome not fetched
    monkeypatch.undo()
    boundaries = rows(root, "SELECT COUNT(*) FROM checkpoints")

    with pytest.raises(PublishError) as info:
        mgr.save(3, metrics={"val_loss": 0.1}, model=state(3.0), blocking=next_blocking)

    assert info.value.__cause__ is error and info.value.phase == "write"
    assert handle.exception() is info.value
    assert rows(root, "SELECT COUNT(*) FROM checkpoints") == boundaries  # step 3 did not run
    assert states(root, 3) == {}
    mgr.flush()
    assert rows(root, "SELECT COUNT(*) FROM metrics WHERE step = 3") == [(0,)]
    # raised once: the save after it works, and close has nothing left to raise
    out = mgr.save(3, model=state(3.0), blocking=next_blocking)
    records = out if isinstance(out, dict) else out.result(timeout=WAIT)
    assert records["model"].step == 3
    assert states(root, 3) == {"model": "committed"}
    mgr.close()


def test_an_unfetched_error_is_raised_by_close_once_closed(
    open_manager: Opener, monkeypatch: pytest.MonkeyPatch, root: Path
) -> None:
    mgr = open_manager()
    mgr.save(1, model=state(1.0))
    fail_writes(monkeypatch, enospc())
    handle = mgr.save(2, model=state(2.0), blocking=False)

    with pytest.raises(PublishError) as info:
        mgr.close()

    assert info.value is handle.exception() and info.value.phase == "write"
    assert rows(root, "SELECT end_state, ended_at IS NOT NULL FROM attempts") == [("closed", 1)]
    with pytest.raises(LedgerError):
        mgr.save(3, model=state(3.0))
    mgr.close()  # closed already: nothing raised twice
    monkeypatch.undo()
    reopened = open_manager()  # the writer lock was released
    assert reopened.latest() is not None and reopened.latest().step == 1
    assert states(root, 2) == {"model": "aborted"}


def test_leaving_the_with_block_raises_an_unfetched_error(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_writes(monkeypatch, enospc())
    with pytest.raises(PublishError) as info, CheckpointManager(root) as mgr:
        handle = mgr.save(1, model=state(1.0), blocking=False)
    assert info.value is handle.exception()
    assert rows(root, "SELECT end_state FROM attempts") == [("closed",)]


def test_preempted_leaving_the_with_block_is_not_masked_by_an_unfetched_error(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks agreed on a preemption, so the attempt ends ``preempted`` rather than
    ``failed``; the job's own way out (``Preempted``, exit status 128 + signal) still
    wins over an asynchronous boundary's error nobody fetched."""
    with pytest.raises(Preempted) as info, CheckpointManager(root) as mgr:
        stop = mgr.preemption(signals=[signal.SIGUSR1])
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested(1)
        fail_writes(monkeypatch, enospc())
        handle = mgr.save(1, model=state(1.0), blocking=False)
        handle.wait()  # failed, its error not fetched
        raise stop.stop(1)
    assert info.value.code == 128 + signal.SIGUSR1
    assert isinstance(handle.exception(), PublishError)
    assert rows(root, "SELECT end_state FROM attempts") == [("preempted",)]


def test_another_exception_leaving_the_with_block_is_not_masked(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    g = Gate(monkeypatch)
    fail_writes(monkeypatch, enospc())
    with (
        caplog.at_level(logging.ERROR, logger=ASYNC_LOGGER),
        pytest.raises(ZeroDivisionError),
        CheckpointManager(root) as mgr,
    ):
        handle = mgr.save(1, model=state(1.0), blocking=False)
        g.release.set()  # the boundary fails while the block is exiting
        _ = 1 / 0

    error = handle.exception(timeout=0)  # the exit waited for it
    assert isinstance(error, PublishError) and error.phase == "write"
    logged = [r for r in caplog.records if r.name == ASYNC_LOGGER]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR
    assert str(error) in logged[0].getMessage()
    assert rows(root, "SELECT end_state FROM attempts") == [("failed",)]
    assert states(root, 1) == {"model": "aborted"}
    with CheckpointManager(root) as again:  # the lock was released
        assert again.latest() is None


def test_a_result_that_timed_out_does_not_fetch_the_error(
    open_manager: Opener, monkeypatch: pytest.MonkeyPatch, gate: Callable[..., Gate]
) -> None:
    mgr = open_manager()
    g = gate()
    fail_writes(monkeypatch, enospc())
    handle = mgr.save(1, model=state(1.0), blocking=False)
    with pytest.raises(concurrent.futures.TimeoutError):
        handle.result(timeout=0)  # a poll: nothing was delivered
    g.release.set()
    handle.wait()
    with pytest.raises(PublishError):
        mgr.save(2, model=state(2.0))


def trip_and_save(mgr: CheckpointManager) -> Any:
    assert mgr.guard is not None
    mgr.guard.update(torch.tensor(float("nan")))
    return mgr.save(3, model=state(1.0), blocking=False)


PREFLIGHT: dict[str, tuple[Callable[[CheckpointManager], Any], type[Exception]]] = {
    "negative step": (lambda mgr: mgr.save(-1, model=state(1.0), blocking=False),
                      InvalidArgumentError),
    "step not an int": (lambda mgr: mgr.save("3", model=state(1.0), blocking=False),
                        ArgumentTypeError),
    "no payload": (lambda mgr: mgr.save(3, blocking=False), InvalidArgumentError),
    "unknown stream": (lambda mgr: mgr.save(3, nope=state(1.0), blocking=False),
                       UnknownStreamError),
    "bad metrics": (lambda mgr: mgr.save(3, metrics={"x": "y"}, model=state(1.0),
                                         blocking=False), ArgumentTypeError),
    "missing ranking metric": (lambda mgr: mgr.save(3, best=state(1.0), blocking=False),
                               InvalidMetricError),
    "non-finite ranking metric": (
        lambda mgr: mgr.save(3, metrics={"val_loss": float("nan")}, best=state(1.0),
                             blocking=False), InvalidMetricError),
    "guard tripped": (trip_and_save, NonFiniteGradientError),
    "blocking='yes'": (lambda mgr: mgr.save(3, model=state(1.0), blocking="yes"),
                       ArgumentTypeError),
    "blocking=0": (lambda mgr: mgr.save(3, model=state(1.0), blocking=0), ArgumentTypeError),
    "blocking=None": (lambda mgr: mgr.save(3, model=state(1.0), blocking=None),
                      ArgumentTypeError),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(PREFLIGHT))
def test_preflight_errors_raise_from_the_call(
    open_manager: Opener, root: Path, no_background: dict[str, int], case: str
) -> None:
    call, error = PREFLIGHT[case]
    guard = NonFiniteGradGuard()
    mgr = open_manager(streams=STREAMS, guard=guard)
    mgr.save(1, metrics={"val_loss": 1.0}, model=state(1.0), best=state(1.0))
    before = rows(root, "SELECT id, state FROM checkpoints")
    on_disk = files(mgr.save_dir)
    calls = dict(no_background)

    with pytest.raises(error):
        call(mgr)

    assert no_background == calls  # nothing snapshotted, nothing sent to the background
    assert rows(root, "SELECT id, state FROM checkpoints") == before
    assert files(mgr.save_dir) == on_disk
    trips = rows(root, "SELECT step FROM events WHERE kind = 'guard_tripped'")
    assert trips == ([(3,)] if error is NonFiniteGradientError else [])
    assert not guard.tripped()  # reset by a refused boundary (a tripped one included)
    handle = mgr.save(3, model=state(3.0), blocking=False)  # the manager is fine
    assert handle.result(timeout=WAIT)["model"].step == 3


class Unsnapshottable:
    """An object in a payload that cannot be copied."""

    def __deepcopy__(self, memo: Any) -> Any:
        raise RuntimeError("this object cannot be copied")


def test_a_snapshot_failure_rolls_back_in_the_call(
    open_manager: Opener, root: Path, no_background: dict[str, int]
) -> None:
    mgr = open_manager(streams=STREAMS)
    older = mgr.save(1, model=state(1.0), ema=state(-1.0))

    with pytest.raises(PublishError) as info:
        mgr.save(2, ema=state(-2.0), model={"w": torch.ones(2), "x": Unsnapshottable()},
                 blocking=False)  # fmt: skip

    assert info.value.phase == "snapshot" and info.value.step == 2
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "cannot be copied" in str(info.value.__cause__)
    assert no_background["submit"] == 0
    assert states(root, 2) == {"model": "aborted", "ema": "aborted"}
    assert files(mgr.save_dir) == sorted(
        c.path.relative_to(mgr.save_dir).as_posix() for c in older.values()
    )
    assert mgr.latest("model") == older["model"]
    assert mgr.check() == []
    # nothing is pending: the next boundary runs at once
    out = mgr.save(2, model=state(2.0), ema=state(-2.0), blocking=False).result(timeout=WAIT)
    assert sorted(out) == ["ema", "model"]


def test_an_interrupt_during_the_snapshot_propagates_after_the_rollback(
    open_manager: Opener, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = open_manager()
    mgr.save(1, model=state(1.0))

    def interrupted(self: Snapshotter, stream: str, payload: Any, *kind: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(Snapshotter, "snapshot", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, model=state(2.0), blocking=False)
    monkeypatch.undo()
    assert states(root, 2) == {"model": "aborted"}
    assert mgr.check() == []
    assert mgr.save(2, model=state(2.0), blocking=False).result(timeout=WAIT)["model"].step == 2


# ------------------------------------------------------------- waiting and ordering


@pytest.mark.parametrize("next_blocking", [True, False])
def test_the_next_save_waits_for_the_boundary_in_flight(
    open_manager: Opener, gate: Callable[..., Gate], root: Path, next_blocking: bool
) -> None:
    mgr = open_manager()
    mgr.save(1, model=state(1.0))
    # only the first write (step 2's) is held; the committed rows are noted at every write
    g = gate(hold=1, observe=lambda: committed_steps(root))
    first = mgr.save(2, model=state(2.0), blocking=False)
    assert g.entered.wait(WAIT)

    def next_save() -> Any:
        out = mgr.save(3, model=state(3.0), blocking=next_blocking)
        return out if isinstance(out, dict) else out.result(timeout=WAIT)

    worker = Worker(next_save)
    assert worker.blocked()
    assert states(root, 3) == {}  # not even its intent: it waits before anything
    assert not first.done()
    g.release.set()
    records = worker.outcome()

    assert first.done() and first.result()["model"].step == 2
    assert records["model"].step == 3
    # step 3 was written only after step 2 committed
    assert len(g.calls) == 2
    assert ("model", 2) not in g.calls[0][1]
    assert ("model", 2) in g.calls[1][1]
    assert mgr.latest() == records["model"]


def test_close_and_the_with_block_wait_for_the_boundary_in_flight(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = Gate(monkeypatch)
    with CheckpointManager(root) as mgr:
        handle = mgr.save(1, model=state(1.0), blocking=False)
        assert g.entered.wait(WAIT)
        closing = Worker(mgr.close)
        assert closing.blocked()
        assert rows(root, "SELECT end_state FROM attempts") == [("running",)]
        g.release.set()
        closing.outcome()
    assert handle.result(timeout=0)["model"].step == 1
    assert states(root, 1) == {"model": "committed"}
    assert rows(root, "SELECT end_state FROM attempts") == [("closed",)]

    g2 = Gate(monkeypatch)

    def with_block() -> SaveHandle:
        with CheckpointManager(root) as mgr:
            return mgr.save(2, model=state(2.0), blocking=False)

    leaving = Worker(with_block)
    assert g2.entered.wait(WAIT)
    assert leaving.blocked()  # leaving the block waits for the boundary
    g2.release.set()
    handle = leaving.outcome()
    assert handle.done() and handle.result()["model"].step == 2
    assert rows(root, "SELECT end_state FROM attempts") == [("closed",), ("closed",)]
    with CheckpointManager(root) as mgr:
        assert mgr.last_reconcile.actions == []
        assert mgr.latest() == handle.result()["model"]


def test_flush_waits_and_metrics_are_written_exactly_once(
    open_manager: Opener, gate: Callable[..., Gate], root: Path
) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.log_metrics(1, {"loss": 1.0})
    g = gate()
    handle = mgr.save(2, metrics={"val_loss": 0.5}, best=state(2.0), blocking=False)
    assert g.entered.wait(WAIT)
    mgr.log_metrics(2, {"loss": 2.0})  # logged while the boundary is in flight

    flushing = Worker(mgr.flush)
    assert flushing.blocked()
    assert rows(root, "SELECT COUNT(*) FROM metrics") == [(0,)]
    g.release.set()
    flushing.outcome()
    handle.result(timeout=WAIT)

    def points() -> list[tuple[Any, ...]]:
        return rows(root, "SELECT step, name, value FROM metrics ORDER BY step, name, id")

    expected = [(1, "loss", 1.0), (2, "loss", 2.0), (2, "val_loss", 0.5)]
    assert points() == expected
    mgr.log_metrics(3, {"loss": 3.0})
    mgr.save(3, model=state(3.0), blocking=False).result(timeout=WAIT)
    mgr.flush()
    mgr.close()
    assert points() == [*expected, (3, "loss", 3.0)]


def test_metrics_logged_during_the_flight_are_written_once_without_flush(
    open_manager: Opener, gate: Callable[..., Gate], root: Path
) -> None:
    mgr = open_manager(streams=STREAMS)
    g = gate()
    mgr.log_metrics(1, {"loss": 1.0})
    handle = mgr.save(2, metrics={"val_loss": 0.5}, best=state(2.0), blocking=False)
    mgr.log_metrics(2, {"loss": 2.0})
    g.release.set()
    handle.result(timeout=WAIT)
    mgr.save(3, metrics={"val_loss": 0.25}, best=state(3.0), blocking=False)
    mgr.log_metrics(3, {"loss": 3.0})
    mgr.close()
    found = rows(root, "SELECT step, name, value FROM metrics ORDER BY step, name, id")
    assert found == [
        (1, "loss", 1.0), (2, "loss", 2.0), (2, "val_loss", 0.5), (3, "loss", 3.0),
        (3, "val_loss", 0.25),
    ]  # fmt: skip


def test_load_waits_only_for_the_stream_being_written(
    open_manager: Opener, gate: Callable[..., Gate]
) -> None:
    mgr = open_manager(streams=STREAMS)
    older = mgr.save(1, model=state(1.0), ema=state(-1.0))
    g = gate()
    handle = mgr.save(2, model=state(2.0), blocking=False)
    assert g.entered.wait(WAIT)

    # another stream: loads at once, while the write is held
    assert_same(mgr.load("latest", stream="ema"), state(-1.0))
    assert_same(mgr.load(1, stream="ema"), state(-1.0))
    assert not handle.done()

    # the stream in flight (by "latest", by step, by path): waits for the commit
    latest = Worker(lambda: mgr.load("latest"))
    assert latest.blocked()
    by_step = Worker(lambda: mgr.load(1))
    by_path = Worker(lambda: mgr.load(older["model"].path))
    assert by_step.blocked() and by_path.blocked()
    g.release.set()
    assert_same(latest.outcome(), state(2.0))  # the boundary it waited for
    assert_same(by_step.outcome(), state(1.0))
    assert_same(by_path.outcome(), state(1.0))
    assert handle.done()


@pytest.mark.parametrize("operation", ["reconcile", "check", "gc"])
def test_maintenance_waits_and_keeps_the_boundary_in_flight(
    open_manager: Opener, gate: Callable[..., Gate], root: Path, operation: str
) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=state(1.0))
    g = gate()
    handle = mgr.save(2, model=state(2.0), ema=state(-2.0), blocking=False)
    assert g.entered.wait(WAIT)

    worker = Worker(getattr(mgr, operation))
    assert worker.blocked()
    assert states(root, 2) == {"model": "pending", "ema": "pending"}
    g.release.set()
    outcome = worker.outcome()

    if operation == "reconcile":
        assert outcome.actions == []  # nothing rolled back
    else:
        assert outcome == []
    assert handle.result(timeout=0)["model"].step == 2
    assert states(root, 2) == {"model": "committed", "ema": "committed"}
    assert_same(mgr.load("latest"), state(2.0))
    assert mgr.check() == []


# -------------------------------------------------------------------------- top-K


def test_a_topk_candidate_that_does_not_enter_is_decided_at_call_time(
    open_manager: Opener, gate: Callable[..., Gate], root: Path, no_background: dict[str, int]
) -> None:
    mgr = open_manager(streams={"model": Keep(last=3), "best": TopK(1, "val_loss")})
    member = mgr.save(1, metrics={"val_loss": 0.1}, best=state(1.0))["best"]
    g = gate()
    calls = dict(no_background)

    rejected = mgr.save(2, metrics={"val_loss": 0.9}, best=state(2.0), blocking=False)

    assert rejected.done() and rejected.exception() is None and rejected.result() == {}
    assert no_background == calls  # nothing snapshotted, nothing in the background
    assert states(root, 2) == {}
    assert g.calls == []

    # in a mixed boundary the candidate is dropped at the call, the rest goes on
    mixed = mgr.save(3, metrics={"val_loss": 0.5}, model=state(3.0), best=state(3.0),
                     blocking=False)  # fmt: skip
    assert states(root, 3) == {"model": "pending"}
    assert no_background["snapshot"] == calls["snapshot"] + 1
    g.release.set()
    assert sorted(mixed.result(timeout=WAIT)) == ["model"]

    # an admitted candidate has its pending row from the call, and ranks at the commit
    g.release.clear()
    admitted = mgr.save(4, metrics={"val_loss": 0.05}, best=state(4.0), blocking=False)
    assert states(root, 4) == {"best": "pending"}
    assert mgr.best() == [member]
    g.release.set()
    new = admitted.result(timeout=WAIT)["best"]
    assert new.metric == 0.05
    assert mgr.best() == [new]


# ------------------------------------------------------------ crash consistency


CRASH_STREAMS = {"model": Keep(last=1), "ema": Keep(last=1)}
BEFORE_COMMIT = ("after_intent", "mid_write", "after_fsync", "after_replace", "after_fsync_dir",
                 "in_commit")  # fmt: skip
CRASH_POINTS = (*BEFORE_COMMIT, "after_commit")


def crash_in_background(root: Path, point: str, log: Path) -> int:
    """Fork a child that opens the run, saves step 2 with ``blocking=False`` and dies by
    ``os._exit(CRASH_EXIT)`` when its background thread reaches ``point``."""

    def body() -> int:
        def hook(name: str) -> None:
            if name == point:
                main = threading.current_thread() is threading.main_thread()
                print(f"crash at {name}: {'main' if main else 'background'} thread")
                os._exit(CRASH_EXIT)

        faults.set_hook(hook)
        with CheckpointManager(root, streams=CRASH_STREAMS) as mgr:
            handle = mgr.save(2, model=state(2.0), ema=state(-2.0), blocking=False)
            print("save returned")
            handle.result(timeout=WAIT)
        return 0

    return wait_child(fork_running(root, log, body), timeout=60)


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_crash_in_the_background_reconciles_like_a_blocking_one(
    open_manager: Opener, root: Path, tmp_path: Path, point: str
) -> None:
    with CheckpointManager(root, streams=CRASH_STREAMS) as mgr:
        older = mgr.save(1, model=state(1.0), ema=state(-1.0))
    log = tmp_path / "child.log"

    code = crash_in_background(root, point, log)

    assert code == CRASH_EXIT, f"child exited {code}, not at {point}:\n{tail(log)}"
    assert f"crash at {point}: background thread" in log.read_text(), tail(log)
    committed = point not in BEFORE_COMMIT
    assert states(root, 2) == dict.fromkeys(older, "committed" if committed else "pending")

    mgr = open_manager(streams=CRASH_STREAMS)

    report = mgr.last_reconcile
    assert report.failures == []
    assert mgr.check() == []
    assert mgr.reconcile().actions == []
    if committed:
        assert states(root, 2) == dict.fromkeys(older, "committed")
        assert states(root, 1) == dict.fromkeys(older, "deleted")  # cleanup finished
        assert {a.kind for a in report.actions} == {"deleted"}
        assert_same(mgr.load("latest"), state(2.0))
        assert_same(mgr.load("latest", stream="ema"), state(-2.0))
    else:
        assert states(root, 2) == dict.fromkeys(older, "aborted")
        assert sorted(a.kind for a in report.actions) == ["rolled_back"] * len(older)
        for stream, previous in older.items():
            assert mgr.latest(stream) == previous
        assert_same(mgr.load("latest"), state(1.0))
    assert files(mgr.save_dir) == sorted(
        c.path.relative_to(mgr.save_dir).as_posix() for c in mgr.checkpoints()
    )
    # and the run goes on, asynchronously
    out = mgr.save(3, model=state(3.0), ema=state(-3.0), blocking=False).result(timeout=WAIT)
    assert_same(mgr.load(out["model"]), state(3.0))
    assert mgr.check() == []


# ----------------------------------------------------------------------- sharded


def sharded_sd(value: float) -> dict[str, Any]:
    return {
        "w": torch.full((8,), float(value)),
        "m": torch.arange(6, dtype=torch.float32).reshape(2, 3) * value,
        "n": torch.tensor([int(value)] * 3, dtype=torch.int64),
    }


def zeroed() -> dict[str, Any]:
    return {k: torch.zeros_like(v) for k, v in sharded_sd(0.0).items()}


def test_a_sharded_payload_commits_asynchronously_and_round_trips(
    open_manager: Opener, gate: Callable[..., Gate], root: Path
) -> None:
    mgr = open_manager(streams=STREAMS)
    older = mgr.save(1, model=Sharded(sharded_sd(1.0)))["model"]
    g = gate(name="write_sharded")
    sd = sharded_sd(2.0)

    handle = mgr.save(2, model=Sharded(sd), ema=state(-2.0), blocking=False)
    assert g.entered.wait(WAIT)
    assert all(t is not threading.main_thread() for t in g.threads)
    assert not handle.done()
    for tensor in sd.values():
        tensor.add_(1000)  # in place, while DCP is held
    assert mgr.latest() == older
    g.release.set()
    out = handle.result(timeout=WAIT)

    saved = out["model"]
    assert is_sharded(saved.path) and saved.path.is_dir()
    assert states(root, 2) == {"model": "committed", "ema": "committed"}
    assert mgr.latest() == saved
    assert_same(mgr.load("latest", into=zeroed()), sharded_sd(2.0))
    assert_same(mgr.load("latest", stream="ema"), state(-2.0))
    assert_same(mgr.load(older, into=zeroed()), sharded_sd(1.0))
    assert mgr.check(load=True) == []


# ------------------------------------------- the file an async save writes (fidelity)


class Pair(collections.namedtuple("Pair", "left right")):
    pass


def fidelity_cases() -> dict[str, Callable[[], Any]]:
    return {
        "plain dict": lambda: state(1.0),
        "nested containers": lambda: {
            "a": [torch.ones(2), (torch.zeros(1), None, "s", 3, 2.5, True)],
            "b": {"c": {"d": torch.arange(3)}, "dtype": torch.float16},
            "e": b"bytes",
        },
        "ordered dict": lambda: collections.OrderedDict(
            [("z", torch.ones(1)), ("a", torch.zeros(2))]
        ),
        "bare tensor": lambda: torch.arange(5),
        "optimizer state": optimizer_state,
        "namedtuple": lambda: {"p": Pair(torch.ones(1), 2)},
        # each of these once lost data or failed (kept as regressions)
        "module state_dict": lambda: torch.nn.Linear(2, 2).state_dict(),  # keeps _metadata
        "key collision 'a/b' vs a->b": lambda: {"a/b": torch.ones(2), "a": {"b": torch.zeros(2)}},
        "key collision 0 vs '0'": lambda: {0: torch.ones(2), "0": torch.zeros(2)},
        "torch.Size": lambda: {"shape": torch.Size([2, 3]), "w": torch.ones(1)},
        "defaultdict": lambda: {"d": collections.defaultdict(list, {"a": [1]}), "w": torch.ones(1)},
    }


@pytest.mark.parametrize("case", list(fidelity_cases()))
def test_an_async_save_writes_the_file_a_blocking_save_writes(
    open_manager: Opener, tmp_path: Path, case: str
) -> None:
    make = fidelity_cases()[case]
    torch.manual_seed(0)
    payload = make()
    blocking = open_manager(tmp_path / "blocking").save(1, model=copy.deepcopy(payload))["model"]
    mgr = open_manager()
    saved = mgr.save(1, model=payload, blocking=False).result(timeout=WAIT)["model"]

    expected = load_file(blocking.path, weights_only=False)
    loaded = load_file(saved.path, weights_only=False)
    assert_same(loaded, expected)
    assert getattr(loaded, "_metadata", None) == getattr(expected, "_metadata", None)
    assert (saved.size, saved.hash) == (blocking.size, blocking.hash)


# -------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_snapshotted_to_pinned_host_buffers(
    open_manager: Opener, gate: Callable[..., Gate]
) -> None:
    mgr = open_manager()
    device = torch.device("cuda")
    sd = {"w": torch.arange(1 << 16, dtype=torch.float32, device=device), "b": torch.ones(3)}
    expected = {k: v.detach().cpu().clone() for k, v in sd.items()}
    g = gate()
    handle = mgr.save(1, model=sd, blocking=False)
    sd["w"].mul_(-1)  # on the GPU, after the call
    sd["b"].fill_(5)
    buffers = list(mgr._snapshots._buffers.values())
    assert all(not b.is_cuda for b in buffers)
    assert any(b.is_pinned() for b in buffers)
    g.release.set()
    saved = handle.result(timeout=WAIT)["model"]
    assert_same(load_file(saved.path), expected)
    # the next boundary reuses the pinned buffers
    before = {k: b.data_ptr() for k, b in mgr._snapshots._buffers.items()}
    mgr.save(2, model=sd, blocking=False).result(timeout=WAIT)
    assert {k: b.data_ptr() for k, b in mgr._snapshots._buffers.items()} == before
    assert_same(mgr.load("latest"), {k: v.detach().cpu() for k, v in sd.items()})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_snapshot_is_complete_when_the_call_returns() -> None:
    """The copy to pinned memory is asynchronous, queued behind the kernels before it:
    the snapshot must wait for it, or the writer reads a stale or half-filled buffer."""
    snapshots = Snapshotter()
    device = torch.device("cuda")
    w = torch.zeros(1 << 26, device=device)
    snapshots.snapshot("model", {"w": w})  # allocates the pinned buffer
    x = torch.randn(4096, 4096, device=device)
    for _ in range(100):  # keep the stream busy past the call
        x = torch.tanh(x @ x)
    w.fill_(2.0)  # queued after them
    copied = snapshots.snapshot("model", {"w": w})["w"]  # into the same pinned buffer
    host = copied.clone()  # read at once, with no synchronization of ours
    assert not host.is_cuda and torch.equal(host, torch.full_like(host, 2.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_boundary_commits_the_values_at_the_call(open_manager: Opener) -> None:
    mgr = open_manager()
    device = torch.device("cuda")
    w = torch.zeros(1 << 24, device=device)
    mgr.save(1, model={"w": w}, blocking=False).result(timeout=WAIT)  # the pinned buffer
    x = torch.randn(4096, 4096, device=device)
    for _ in range(100):
        x = torch.tanh(x @ x)
    w.fill_(2.0)
    handle = mgr.save(2, model={"w": w}, blocking=False)  # reuses the buffer of step 1
    w.mul_(-1)  # after the call: not in the snapshot
    saved = handle.result(timeout=WAIT)["model"]
    assert torch.equal(load_file(saved.path)["w"], torch.full((1 << 24,), 2.0))


def test_reads_do_not_wait_for_a_commit_running_in_the_background(
    open_manager: Opener,
) -> None:
    """The background thread is held inside its commit transaction (it holds
    SQLite's write lock): latest/best/checkpoints on the training thread answer
    at once, from the last committed state (a load may write: a resume event)."""
    mgr = open_manager(streams={"model": Keep(last=2), "other": Keep(last=2), "top": TopK(1, "m")})
    before = mgr.save(1, metrics={"m": 1.0}, model=state(1.0), other=state(1.0), top=state(1.0))
    inside, release = threading.Event(), threading.Event()

    def hold(point: str) -> None:
        if point == "in_commit" and threading.current_thread() is not threading.main_thread():
            inside.set()
            assert release.wait(30), "never released"

    previous = faults.set_hook(hold)
    try:
        handle = mgr.save(2, blocking=False, model=state(2.0))
        assert inside.wait(30), "the commit never started"
        reader = Worker(  # starts at once
            lambda: (mgr.latest("model"), mgr.checkpoints(), mgr.best("top"))
        )
        reader.join(5)  # far below SQLite's busy timeout (10 s) that a locked read would wait
        assert not reader.is_alive(), "a read waited for the background commit"
        latest, listed, best = reader.outcome()
        assert latest == before["model"]
        assert [(c.stream, c.step) for c in listed] == [("model", 1), ("other", 1), ("top", 1)]
        assert best == [before["top"]]
    finally:
        release.set()
        faults.set_hook(previous)
    assert handle.result()["model"].step == 2
    assert mgr.latest("model").step == 2
