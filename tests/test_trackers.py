"""``ckptdb follow --to mlflow``: a run mirrored into one MLflow run, across restarts.

Against a real MLflow tracking store (a SQLite backend, a local artifact
root): a training run SIGKILLed and restarted, its follower SIGKILLed and
restarted too, ends as one MLflow run holding every metric point of the
ledger exactly once and the registered model's aliases where the ledger
says; a follower stopped between a log and its ledger write logs nothing
twice; evicted checkpoints are marked or deleted; bad input is refused.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers import raise_a_dropped_interrupt

from ckptdb import CheckpointManager, Keep, RunReader, TopK
from ckptdb.cli import main
from ckptdb.errors import (
    CkptDBError,
    InvalidArgumentError,
    LedgerLockedError,
    MissingExtraError,
)
from ckptdb.ledger import trackers as ledger_trackers
from ckptdb.trackers import Mirror
from ckptdb.trackers.mlflow import MlflowSink

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_db_url_from_environment")]

STREAMS = {"model": Keep(last=2), "best": TopK(1, "loss")}


@pytest.fixture
def tracking_uri(tmp_path: Path) -> str:
    """A SQLite tracking store whose experiment ``ckptdb`` keeps its artifacts in
    tmp_path (MLflow's default would be ./mlruns, wherever the test runs)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client(uri).create_experiment("ckptdb", artifact_location=str(tmp_path / "artifacts"))
    return uri


def client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def train(root: Path, steps: range, db_url: str | None = None) -> None:
    with CheckpointManager(root, streams=STREAMS, db_url=db_url) as mgr:
        for step in steps:
            loss = 10.0 / step
            mgr.log_metrics(step, {"loss": loss, "lr": 0.1})
            if step % 2 == 0:
                mgr.save(
                    step,
                    metrics={"loss": loss},
                    model={"w": torch.full((4,), float(step))},
                    best={"w": torch.full((4,), float(step))},
                )


def ledger_points(root: Path, db_url: str | None = None) -> Counter[tuple[str, int, float, int]]:
    """Each distinct point of the ledger, once: MLflow keeps one point per key, step,
    value and millisecond (two identical points logged in the same millisecond, as a
    save's metric and log_metrics may be, are one point there)."""
    with RunReader(root, db_url=db_url) as reader:
        _, rows = reader.sql("SELECT name, step, value, wall_time FROM metrics")
    return Counter({(n, s, round(v, 9), round(t * 1000)) for n, s, v, t in rows})


def mlflow_points(uri: str, run_id: str) -> Counter[tuple[str, int, float, int]]:
    c = client(uri)
    names = c.get_run(run_id).data.metrics
    return Counter(
        (name, m.step, round(m.value, 9), m.timestamp)
        for name in names
        for m in c.get_metric_history(run_id, name)
    )


def runs_of(uri: str) -> list[Any]:
    c = client(uri)
    experiment = c.get_experiment_by_name("ckptdb")
    return [] if experiment is None else c.search_runs([experiment.experiment_id])


def version_of_alias(uri: str, model: str, alias: str) -> int:
    return int(client(uri).get_model_version_by_alias(model, alias).tags["ckptdb.checkpoint"])


def test_one_pass_mirrors_metrics_checkpoints_and_aliases(
    tmp_path: Path, tracking_uri: str
) -> None:
    root = tmp_path / "run"
    train(root, range(1, 7))
    with Mirror(root, MlflowSink(tracking_uri, model_name="tiny")) as mirror:
        done = mirror.sync()
        run_id = mirror.tracker_run_id
        assert not mirror.sync()  # nothing new: nothing logged again
    assert run_id is not None
    assert mlflow_points(tracking_uri, run_id) == ledger_points(root)
    with RunReader(root) as reader:
        committed = reader.checkpoints()
        latest, best = reader.latest("model"), reader.best("best")[0]
    assert sorted(c.id for c in done.checkpoints) == sorted(c.id for c in committed)
    assert latest is not None
    assert version_of_alias(tracking_uri, "tiny", "model-last") == latest.id
    assert version_of_alias(tracking_uri, "tiny", "best-best") == best.id
    tags = client(tracking_uri).get_run(run_id).data.tags
    assert tags["ckptdb.latest.model"] == str(latest.step) and tags["ckptdb.best.best"] == str(
        best.step
    )
    described = json.loads(tags[f"ckptdb.checkpoint.model.{latest.id}"])
    assert described == {"id": latest.id, "step": latest.step, "metrics": {"loss": 10.0 / 6}}
    for c in committed:
        (listed,) = client(tracking_uri).list_artifacts(run_id, f"checkpoints/{c.stream}/{c.id}")
        assert (listed.path.rsplit("/", 1)[1], listed.file_size) == (c.path.name, c.size)


def test_one_stream_gets_the_plain_aliases_and_evictions_are_marked(
    tmp_path: Path, tracking_uri: str
) -> None:
    root = tmp_path / "run"
    train(root, range(1, 5))
    with Mirror(root, MlflowSink(tracking_uri, model_name="m"), streams=["model"]) as mirror:
        mirror.sync()
        run_id = mirror.tracker_run_id
    train(root, range(5, 9))  # steps 2 and 4 leave the last-2 window
    with Mirror(root, MlflowSink(tracking_uri, model_name="m"), streams=["model"]) as mirror:
        done = mirror.sync()
        assert mirror.tracker_run_id == run_id  # one MLflow run across restarts
        assert not mirror.sync()  # the passes after an eviction: nothing new
    with Mirror(root, MlflowSink(tracking_uri, model_name="m"), streams=["model"]) as mirror:
        assert not mirror.sync()  # nor for the next follower, which reads what was evicted
    assert len(done.evicted) == 2 and len(runs_of(tracking_uri)) == 1
    with RunReader(root) as reader:
        latest = reader.latest("model")
        evicted = [c for c in reader.checkpoints("model", states=("deleted",))]
    assert latest is not None and version_of_alias(tracking_uri, "m", "last") == latest.id
    tags = client(tracking_uri).get_run(run_id).data.tags
    assert sorted(k for k in tags if k.startswith("ckptdb.evicted.")) == sorted(
        f"ckptdb.evicted.model.{c.id}" for c in evicted
    )
    versions = client(tracking_uri).search_model_versions("name='m'")
    marked = {v.tags["ckptdb.checkpoint"]: v.tags.get("ckptdb.state") for v in versions}
    assert {k for k, v in marked.items() if v == "deleted"} == {str(c.id) for c in evicted}


def test_delete_removes_an_evicted_checkpoints_artifact_and_version(
    tmp_path: Path, tracking_uri: str
) -> None:
    root = tmp_path / "run"
    train(root, range(1, 5))
    sink = MlflowSink(tracking_uri, model_name="m")
    with Mirror(root, sink, streams=["model"], on_evict="delete") as mirror:
        mirror.sync()
        train(root, range(5, 9))
        mirror.sync()
        run_id = mirror.tracker_run_id
    listed = client(tracking_uri).list_artifacts(run_id, "checkpoints/model")
    with RunReader(root) as reader:
        kept = {str(c.id) for c in reader.checkpoints("model")}
    assert {a.path.rsplit("/", 1)[1] for a in listed} == kept
    versions = client(tracking_uri).search_model_versions("name='m'")
    assert len(versions) == len(kept)


def test_a_follower_stopped_between_a_log_and_its_ledger_write_logs_nothing_twice(
    tmp_path: Path, tracking_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The crash window of each step, forced: the tracker has the points (then a
    checkpoint and its model version) and the ledger does not know."""
    root = tmp_path / "run"
    train(root, range(1, 5))
    real_save = ledger_trackers.save

    def dies_when(condition: Any) -> Any:
        def save(session: Any, state: Any) -> None:
            if condition(state):
                raise KeyboardInterrupt  # the process dies here: the write never happens
            real_save(session, state)

        return save

    # 1. the metrics logged, the cursor not moved
    monkeypatch.setattr(ledger_trackers, "save", dies_when(lambda s: s.metric_cursor > 0))
    with Mirror(root, MlflowSink(tracking_uri, model_name="m")) as mirror:
        run_id = mirror.tracker_run_id
        with pytest.raises(KeyboardInterrupt):
            mirror.sync()
    assert run_id is not None and mlflow_points(tracking_uri, run_id) == ledger_points(root)
    # 2. a checkpoint uploaded and registered, the ledger not told
    first: list[str] = []
    monkeypatch.setattr(
        ledger_trackers, "save", dies_when(lambda s: bool(s.logged) and not first.append(1))
    )
    with (
        Mirror(root, MlflowSink(tracking_uri, model_name="m")) as mirror,
        pytest.raises(KeyboardInterrupt),
    ):
        mirror.sync()
    monkeypatch.setattr(ledger_trackers, "save", real_save)
    with RunReader(root) as reader:
        oldest = min(reader.checkpoints(), key=lambda c: c.id)
    listed = client(tracking_uri).list_artifacts(run_id, f"checkpoints/{oldest.stream}")
    assert [a.path.rsplit("/", 1)[1] for a in listed] == [str(oldest.id)]
    # 3. the next follower logs the rest, and nothing twice
    spy = MlflowSink(tracking_uri, model_name="m")
    uploads: list[Path] = []
    real_upload = spy.client.log_artifact

    def counted(run: str, local: str, artifact_path: str | None = None) -> None:
        uploads.append(Path(local).resolve())
        real_upload(run, local, artifact_path=artifact_path)

    monkeypatch.setattr(spy.client, "log_artifact", counted)
    sent: list[int] = []
    real_log = spy.log_metrics
    monkeypatch.setattr(
        spy, "log_metrics", lambda points: (sent.extend(p.id for p in points), real_log(points))
    )
    with Mirror(root, spy) as mirror:
        assert mirror.tracker_run_id == run_id
        done = mirror.sync()
    assert sent == []  # every point was in MLflow already: none sent again
    assert oldest.id in {c.id for c in done.checkpoints}  # recorded now...
    assert oldest.path.resolve() not in uploads and uploads  # ...never uploaded again
    versions = client(tracking_uri).search_model_versions("name='m'")
    assert sorted(Counter(v.tags["ckptdb.checkpoint"] for v in versions).values()) == [1] * len(
        done.checkpoints
    )
    assert mlflow_points(tracking_uri, run_id) == ledger_points(root)
    assert len(runs_of(tracking_uri)) == 1


def test_another_spelling_of_the_tracking_uri_logs_nothing_twice(
    tmp_path: Path, tracking_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second row of the trackers table (the same store, its URI written another way)
    starts from cursor 0 and finds the same MLflow run by its tag: it asks MLflow batch
    after batch, not only the first, what it holds already."""
    from ckptdb import trackers

    monkeypatch.setattr(trackers, "BATCH", 5)
    root = tmp_path / "run"
    train(root, range(1, 9))  # 12 points: three batches of 5
    with Mirror(root, MlflowSink(tracking_uri)) as mirror:
        mirror.sync()
        run_id = mirror.tracker_run_id
    train(root, range(9, 11))
    respelled = tracking_uri.replace("/mlflow.db", "/./mlflow.db")
    with Mirror(root, MlflowSink(respelled)) as mirror:
        done = mirror.sync()
        assert mirror.tracker_run_id == run_id
    assert done.metrics == 5  # loss and lr at steps 9 and 10, and the save's loss at 10
    assert mlflow_points(tracking_uri, run_id) == ledger_points(root)
    with sqlite3.connect(root / "ckptdb.sqlite") as con:
        assert con.execute("SELECT COUNT(*) FROM trackers").fetchone() == (2,)


def test_no_credential_of_the_tracking_uri_reaches_the_ledger() -> None:
    from ckptdb.trackers.mlflow import without_secrets

    uri = "postgresql://mlflow:s3cret@db.example:5432/mlflow?sslpassword=hunter2"
    assert without_secrets(uri) == "postgresql://db.example:5432/mlflow"
    assert without_secrets("sqlite:////data/mlflow.db") == "sqlite:////data/mlflow.db"
    assert without_secrets("https://token@mlflow.example/") == "https://mlflow.example/"


def test_an_eviction_the_tracker_refused_is_tried_again(
    tmp_path: Path, tracking_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "run"
    train(root, range(1, 5))
    sink = MlflowSink(tracking_uri)
    with Mirror(root, sink, streams=["model"]) as mirror:
        mirror.sync()
        train(root, range(5, 7))  # step 2 leaves the window
        real = sink.evict
        monkeypatch.setattr(sink, "evict", lambda *a: (_ for _ in ()).throw(OSError("down")))
        with pytest.raises(OSError, match="down"):
            mirror.sync()
        monkeypatch.setattr(sink, "evict", real)
        done = mirror.sync()
    with RunReader(root) as reader:
        (evicted,) = reader.checkpoints("model", states=("deleted",))
    assert done.evicted == [evicted.id]
    tags = client(tracking_uri).get_run(mirror.tracker_run_id).data.tags
    assert tags[f"ckptdb.evicted.model.{evicted.id}"] == "deleted"


def test_a_corrupt_checkpoint_is_not_mirrored_and_the_rest_is(
    tmp_path: Path, tracking_uri: str
) -> None:
    root = tmp_path / "run"
    train(root, range(1, 5))
    with RunReader(root) as reader:
        damaged = reader.checkpoints("model")[0]
    data = bytearray(damaged.path.read_bytes())
    data[-5] ^= 0xFF
    damaged.path.write_bytes(bytes(data))
    with Mirror(root, MlflowSink(tracking_uri)) as mirror:
        done = mirror.sync()
    assert list(done.refused) == [damaged.id] and "refusing to load" in done.refused[damaged.id]
    with RunReader(root) as reader:
        others = {c.id for c in reader.checkpoints()} - {damaged.id}
    assert {c.id for c in done.checkpoints} == others and others


def test_one_follower_per_run_and_tracker(tmp_path: Path, tracking_uri: str) -> None:
    root = tmp_path / "run"
    train(root, range(1, 3))
    with (
        Mirror(root, MlflowSink(tracking_uri)),
        pytest.raises(LedgerLockedError, match="another follower"),
    ):
        Mirror(root, MlflowSink(tracking_uri))


def test_bad_arguments_are_refused_before_anything_is_written(
    tmp_path: Path, tracking_uri: str
) -> None:
    root = tmp_path / "run"
    train(root, range(1, 3))
    with pytest.raises(InvalidArgumentError, match="on_evict"):
        Mirror(root, MlflowSink(tracking_uri), on_evict="shred")
    with pytest.raises(InvalidArgumentError, match="not streams of the run"):
        Mirror(root, MlflowSink(tracking_uri), streams=["nope"])
    with pytest.raises(InvalidArgumentError, match="tracking_uri"):
        MlflowSink("")
    with sqlite3.connect(root / "ckptdb.sqlite") as con:
        assert con.execute("SELECT COUNT(*) FROM trackers").fetchone() == (0,)
    assert runs_of(tracking_uri) == []


def test_without_the_extra_the_error_says_which_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'ckptdb\[mlflow\]'") as raised:
        MlflowSink("sqlite:///x.db")
    assert isinstance(raised.value, ImportError) and isinstance(raised.value, CkptDBError)


def test_the_command_mirrors_once_and_refuses_mixed_options(
    tmp_path: Path, tracking_uri: str
) -> None:
    root = tmp_path / "run"
    train(root, range(1, 5))
    runner = CliRunner()
    where = tmp_path / "elsewhere"
    args = ["follow", str(root), "--to", "mlflow", "--tracking-uri", tracking_uri, "--once"]
    done = runner.invoke(main, [*args, "--experiment", "e2", "--artifact-location", str(where)])
    assert done.exit_code == 0, done.output
    assert "mirroring" in done.output and "metric point(s)" in done.output
    assert len(list(where.rglob("step-*.pt"))) == 3  # model 2 and 4, best 4
    no_uri = runner.invoke(main, ["follow", str(root), "--to", "mlflow", "--once"])
    assert no_uri.exit_code == 2 and "--tracking-uri" in no_uri.output
    both = runner.invoke(
        main, ["follow", str(root), "--to", "mlflow", "--tracking-uri", "x", "echo"]
    )
    assert both.exit_code == 2 and "not both" in both.output
    stray = runner.invoke(main, ["follow", str(root), "--model-name", "m", "--", "echo", "{path}"])
    assert stray.exit_code == 2 and "--model-name" in stray.output
    assert runs_of(tracking_uri) == []  # the run went to experiment e2


# ------------------------------------------------------------------ real kills


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_the_interpreter_drops_still_stops_the_mirror(
    tmp_path: Path, tracking_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C raised inside a weakref callback is dropped by Python ("Exception
    ignored in"); the mirror without --timeout stops after the pass it came in, 130."""

    root = tmp_path / "run"
    train(root, range(1, 5))
    real_sync, passes = Mirror.sync, []

    def sync_then_dropped_interrupt(self: Mirror) -> Any:
        done = real_sync(self)
        passes.append(done)
        raise_a_dropped_interrupt()
        return done

    monkeypatch.setattr(Mirror, "sync", sync_then_dropped_interrupt)
    args = ["follow", str(root), "--to", "mlflow", "--tracking-uri", tracking_uri]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 130, (done.exit_code, done.output)
    assert "continues where this one left off" in done.output
    assert len(passes) == 1  # no second pass after the interrupt
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


TRAINING = """
import sys, time, torch
from ckptdb import CheckpointManager, Keep, TopK
root, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with CheckpointManager(root, streams={"model": Keep(last=2), "best": TopK(1, "loss")}) as mgr:
    for step in range(first, last + 1):
        loss = 10.0 / step
        mgr.log_metrics(step, {"loss": loss})
        if step % 2 == 0:
            w = torch.full((4,), float(step))
            mgr.save(step, metrics={"loss": loss}, model={"w": w}, best={"w": w})
        time.sleep(0.1)
"""


def follower(root: Path, uri: str, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "ckptdb.cli", "follow", str(root), "--to", "mlflow"]
    options = ["--tracking-uri", uri, "--model-name", "m", "--poll", "0.1", *extra]
    return subprocess.Popen(
        [*command, *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_for(predicate: Any, what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def ledger_rows(root: Path, query: str) -> list[tuple[Any, ...]]:
    try:
        with sqlite3.connect(root / "ckptdb.sqlite") as con:
            return con.execute(query).fetchall()
    except sqlite3.OperationalError:  # not created yet
        return []


def newest_step(root: Path) -> int:
    rows = ledger_rows(root, "SELECT MAX(step) FROM checkpoints WHERE state = 'committed'")
    return rows[0][0] or 0 if rows else 0


def mirrored_evictions(root: Path) -> int:
    rows = ledger_rows(root, "SELECT mirrored FROM trackers")
    return len(json.loads(rows[0][0])["evicted"]) if rows else 0


def test_a_run_killed_and_restarted_with_its_follower_is_one_mlflow_run(
    tmp_path: Path, tracking_uri: str
) -> None:
    """Both killed mid-work: the trainer after its follower has mirrored metrics,
    checkpoints and evictions; both restarted."""
    root = tmp_path / "run"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINING, str(root), "1", "200"])
    # a follower of a run that does not exist yet is refused, as any reader is ("no
    # ckptdb run"): it starts once the trainer has committed (it imports no torch, so
    # it would otherwise win the race)
    wait_for(lambda: newest_step(root) > 0, "the trainer's first checkpoint")
    watcher = follower(root, tracking_uri)
    try:
        try:
            wait_for(lambda: mirrored_evictions(root) >= 2, "the follower to mirror evictions")
        except AssertionError as exc:
            watcher.kill()
            raise AssertionError(f"{exc}; the follower said: {watcher.communicate()[0]}") from exc
        watcher.send_signal(signal.SIGKILL)
        watcher.wait(10)
        killed_at = newest_step(root)
        watcher = follower(root, tracking_uri)
        wait_for(lambda: newest_step(root) >= killed_at + 6, "more checkpoints")
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        resume = newest_step(root)
        end = resume + 8
        subprocess.run(
            [sys.executable, "-c", TRAINING, str(root), str(resume + 1), str(end)],
            check=True,
            timeout=120,
        )
        watcher.send_signal(signal.SIGKILL)
        watcher.wait(10)
        watcher = follower(root, tracking_uri, "--timeout", "2")
        out, _ = watcher.communicate(timeout=120)
        assert watcher.returncode == 0, out
    finally:
        for process in (trainer, watcher):
            if process.poll() is None:
                process.kill()
                process.wait(10)
    (run,) = runs_of(tracking_uri)
    assert mlflow_points(tracking_uri, run.info.run_id) == ledger_points(root)
    with RunReader(root) as reader:
        latest, best = reader.latest("model"), reader.best("best")[0]
        evicted = reader.checkpoints(states=("deleted",))
        assert len(reader.attempts()) == 2
    assert latest is not None and latest.step == end
    assert version_of_alias(tracking_uri, "m", "model-last") == latest.id
    assert version_of_alias(tracking_uri, "m", "best-best") == best.id
    versions = client(tracking_uri).search_model_versions("name='m'")
    per_checkpoint = Counter(v.tags["ckptdb.checkpoint"] for v in versions)
    assert set(per_checkpoint.values()) == {1}
    states = {v.tags["ckptdb.checkpoint"]: v.tags.get("ckptdb.state") for v in versions}
    # every evicted checkpoint the follower had logged is marked, none other
    assert {k for k, v in states.items() if v == "deleted"} <= {str(c.id) for c in evicted}
    assert sum(v == "deleted" for v in states.values()) >= 2


# ------------------------------------------------------------------ both ledgers


@pytest.fixture
def db_url(backend: str | None) -> str | None:
    return backend


def test_mirroring_a_run_on_either_ledger(
    root: Path, db_url: str | None, tracking_uri: str, db: Any
) -> None:
    train(root, range(1, 5), db_url)
    with Mirror(root, MlflowSink(tracking_uri), db_url=db_url) as mirror:
        mirror.sync()
        run_id = mirror.tracker_run_id
    assert run_id is not None
    assert mlflow_points(tracking_uri, run_id) == ledger_points(root, db_url)
    ((kind, external, cursor),) = db.rows("SELECT kind, external_id, metric_cursor FROM trackers")
    (top,) = db.rows("SELECT MAX(id) FROM metrics")
    assert (kind, external, cursor) == ("mlflow", run_id, top[0])


# ------------------------------------------------------------------ Weights & Biases (offline)


def wandb_records(directory: Path, run_id: str) -> list[tuple[str, Any]]:
    """Every record the offline runs of ``run_id`` wrote, in order, read back from their
    transaction logs with W&B's own protocol buffers."""
    from wandb.proto import wandb_internal_pb2

    from ckptdb.trackers.wandbfile import raw_records

    found = []
    for path in sorted(directory.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")):
        for raw in raw_records(path):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(raw)
            found.append((record.WhichOneof("record_type"), record))
    return found


def wandb_rows(directory: Path, run_id: str) -> list[dict[str, Any]]:
    return [
        {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        for kind, r in wandb_records(directory, run_id)
        if kind == "history"
    ]


def wandb_points(directory: Path, run_id: str) -> Counter[tuple[str, int, float]]:
    skip = {
        "_step",
        "_timestamp",
        "_runtime",
        "ckptdb/step",
        "ckptdb/wall_time",
        "ckptdb/metric_id",
    }
    return Counter(
        (name, row["ckptdb/step"], round(value, 9))
        for row in wandb_rows(directory, run_id)
        for name, value in row.items()
        if name not in skip
    )


def every_ledger_point(root: Path) -> Counter[tuple[str, int, float]]:
    with RunReader(root) as reader:
        _, rows = reader.sql("SELECT name, step, value FROM metrics")
    return Counter((n, s, round(v, 9)) for n, s, v in rows)


def wandb_artifacts(directory: Path, run_id: str) -> list[tuple[int, str, list[str], str]]:
    """(ckptdb id, artifact name, aliases, digest) of each artifact record, in order."""
    return [
        (
            json.loads(r.artifact.metadata)["ckptdb_id"],
            r.artifact.name,
            list(r.artifact.aliases),
            r.artifact.digest,
        )
        for kind, r in wandb_records(directory, run_id)
        if kind == "artifact"
    ]


def holder(artifacts: list[tuple[int, str, list[str], str]], name: str, alias: str) -> int:
    """The checkpoint the last record of artifact ``name`` that carries ``alias`` is."""
    return [ident for ident, n, aliases, _ in artifacts if n == name and alias in aliases][-1]


@pytest.fixture
def wandb_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    return tmp_path / "wandb-runs"


def test_wandb_offline_holds_each_point_once_and_the_aliases_the_ledger_has(
    tmp_path: Path, wandb_dir: Path
) -> None:
    from ckptdb.trackers.wandb import WandbSink

    root = tmp_path / "run"
    train(root, range(1, 5))
    with Mirror(root, WandbSink("p", directory=wandb_dir, offline=True)) as mirror:
        first = mirror.sync()
        run_id = mirror.tracker_run_id
    train(root, range(5, 9))  # a second attempt, and a second follower
    with Mirror(root, WandbSink("p", directory=wandb_dir, offline=True)) as mirror:
        done = mirror.sync()
        assert mirror.tracker_run_id == run_id
    assert run_id is not None and run_id.startswith("ckptdb-")
    assert wandb_points(wandb_dir, run_id) == every_ledger_point(root)
    artifacts = wandb_artifacts(wandb_dir, run_id)
    digests: dict[int, set[str]] = {}
    for ident, _, _, digest in artifacts:
        digests.setdefault(ident, set()).add(digest)
    assert all(len(d) == 1 for d in digests.values())  # logged again: the same version
    with RunReader(root) as reader:
        latest, best = reader.latest("model"), reader.best("best")[0]
        committed = {c.id for c in reader.checkpoints()}
    mirrored = {c.id for c in first.checkpoints + done.checkpoints}
    assert set(digests) == mirrored and committed <= mirrored and latest is not None
    assert holder(artifacts, "run-model", "latest") == latest.id
    assert holder(artifacts, "run-best", "best") == best.id
    assert holder(artifacts, "run-best", "latest") == best.id
    model_ids = {c.id for c in first.checkpoints if c.stream == "model"}
    summaries = [
        {i.key or "/".join(i.nested_key) for i in r.summary.update}
        for kind, r in wandb_records(wandb_dir, run_id)
        if kind == "summary"
    ]
    marked = set().union(*summaries)
    assert {f"ckptdb/evicted/model/ckpt-{i}" for i in done.evicted if i in model_ids} <= marked
    assert len(done.evicted) == 3 and len(model_ids & set(done.evicted)) == 2


def test_wandb_after_a_crash_between_a_log_and_the_ledger_nothing_is_logged_twice(
    tmp_path: Path, wandb_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptdb.trackers.wandb import WandbSink

    root = tmp_path / "run"
    train(root, range(1, 7))
    real_save = ledger_trackers.save

    def crashes_after_the_metrics(session: Any, state: Any) -> None:
        if state.metric_cursor > 0:
            raise KeyboardInterrupt
        real_save(session, state)

    monkeypatch.setattr(ledger_trackers, "save", crashes_after_the_metrics)
    with Mirror(root, WandbSink("p", directory=wandb_dir, offline=True)) as mirror:
        run_id = mirror.tracker_run_id
        with pytest.raises(KeyboardInterrupt):
            mirror.sync()
    monkeypatch.setattr(ledger_trackers, "save", real_save)
    assert run_id is not None
    # logged, not recorded (W&B's own writer, a process of its own, may still be writing)
    wait_for(
        lambda: wandb_points(wandb_dir, run_id) == every_ledger_point(root),
        "the offline log to hold every point",
        timeout=30,
    )
    with Mirror(root, WandbSink("p", directory=wandb_dir, offline=True)) as mirror:
        mirror.sync()
    ids = [row["ckptdb/metric_id"] for row in wandb_rows(wandb_dir, run_id)]
    assert len(ids) == len(set(ids))  # no row twice
    assert wandb_points(wandb_dir, run_id) == every_ledger_point(root)


def test_wandb_offline_cannot_delete_and_says_so_before_anything_is_written(
    tmp_path: Path, wandb_dir: Path
) -> None:
    from ckptdb.trackers.wandb import WandbSink

    root = tmp_path / "run"
    train(root, range(1, 3))
    with pytest.raises(InvalidArgumentError, match="needs the run online"):
        Mirror(root, WandbSink("p", directory=wandb_dir, offline=True), on_evict="delete")
    with sqlite3.connect(root / "ckptdb.sqlite") as con:
        assert con.execute("SELECT COUNT(*) FROM trackers").fetchone() == (0,)
    assert not wandb_dir.exists() or not list(wandb_dir.rglob("*.wandb"))


def test_wandb_without_the_extra_says_which_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptdb.trackers.wandb import WandbSink

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'ckptdb\[wandb\]'"):
        WandbSink("p")


def test_the_command_mirrors_into_wandb_offline(tmp_path: Path, wandb_dir: Path) -> None:
    root = tmp_path / "run"
    train(root, range(1, 5))
    runner = CliRunner()
    args = ["follow", str(root), "--to", "wandb", "--offline", "--once"]
    done = runner.invoke(main, [*args, "--project", "p", "--wandb-dir", str(wandb_dir)])
    assert done.exit_code == 0, done.output
    run_id = done.output.split(" run ", 1)[1].split()[0]
    assert wandb_points(wandb_dir, run_id) == every_ledger_point(root)
    no_project = runner.invoke(main, args)
    assert no_project.exit_code == 2 and "--project" in no_project.output
    mixed = runner.invoke(main, [*args, "--project", "p", "--tracking-uri", "sqlite:///x.db"])
    assert mixed.exit_code == 2 and "--tracking-uri" in mixed.output


def test_wandb_latest_moves_back_when_the_newest_checkpoint_is_found_corrupt(
    tmp_path: Path, wandb_dir: Path
) -> None:
    """W&B gives ``latest`` to each version it logs; when the ledger's latest goes back
    to an older checkpoint, that version is logged again (the same digest, no new
    version) to hold the alias."""
    from ckptdb.errors import CorruptCheckpointError
    from ckptdb.trackers.wandb import WandbSink

    root = tmp_path / "run"
    train(root, range(1, 7))
    with Mirror(root, WandbSink("p", directory=wandb_dir, offline=True)) as mirror:
        mirror.sync()
        run_id = mirror.tracker_run_id
    assert run_id is not None
    with CheckpointManager(root, streams=STREAMS) as mgr:
        newest = mgr.latest("model")
        assert newest is not None and newest.step == 6
        data = bytearray(newest.path.read_bytes())
        data[-3] ^= 0xFF
        newest.path.write_bytes(bytes(data))
        with pytest.raises(CorruptCheckpointError):
            mgr.load(newest)  # the writer marks it corrupt; latest goes back to step 4
        previous = mgr.latest("model")
    assert previous is not None and previous.step == 4
    with Mirror(root, WandbSink("p", directory=wandb_dir, offline=True)) as mirror:
        done = mirror.sync()
    assert done.evicted == [newest.id] and done.aliases == {"latest:model": previous.id}
    artifacts = wandb_artifacts(wandb_dir, run_id)
    assert holder(artifacts, "run-model", "latest") == previous.id
    assert len({d for i, _, _, d in artifacts if i == previous.id}) == 1


def write_log(path: Path, payloads: list[bytes]) -> None:
    """A transaction log as W&B writes one: the header, then records fragmented over
    32 KiB blocks (FIRST, MIDDLE..., LAST), a block's tail under 7 bytes padded."""
    import struct
    import zlib

    from ckptdb.trackers.wandbfile import BLOCK

    out = bytearray(b":W&B\xe1\xbe\x00")
    for payload in payloads:
        rest, first = payload, True
        while True:
            left = BLOCK - len(out) % BLOCK
            if left < 7:
                out += b"\x00" * left
                continue
            chunk, rest = rest[: left - 7], rest[left - 7 :]
            kind = (1 if first else 4) if not rest else (2 if first else 3)
            out += struct.pack("<IHB", zlib.crc32(chunk), len(chunk), kind) + chunk
            first = False
            if not rest:
                break
    path.write_bytes(bytes(out))


def test_the_transaction_log_reader_joins_fragments_and_stops_at_a_torn_tail(
    tmp_path: Path,
) -> None:
    from ckptdb.trackers.wandbfile import raw_records

    # "b" spans three blocks (FIRST, MIDDLE, LAST), ending at byte 70,045; "c" then ends
    # 3 bytes before the third block does, too few for a header: padding
    payloads = [b"a" * 10, b"b" * 70_000, b"c" * (3 * 32768 - 70_045 - 7 - 3), b"d" * 5]
    log = tmp_path / "run-x.wandb"
    write_log(log, payloads)
    assert list(raw_records(log)) == payloads
    data = log.read_bytes()
    log.write_bytes(data[:-3])  # a follower killed mid-write
    assert list(raw_records(log)) == payloads[:-1]
    log.write_bytes(b"not a log")
    assert list(raw_records(log)) == []
