"""Topology: the world size every checkpoint and attempt records, and resuming a
sharded checkpoint on another number of ranks.

The multi-rank tests save on 3 gloo ranks (a DTensor sharded unevenly over a
mesh of 3, a replicated one, and a per-rank entry ``rng/<rank>``) with the
ledger on PostgreSQL, then resume on 2 ranks and on 4: the DTensors come back
resharded with their values, and the per-rank entries follow each documented
policy (``missing_keys="error"``, ``"keep"``, and mapping a rank onto a saved
one through ``Checkpoint.world_size``). Collectives time out after 15 s and a
rank still running after 45 s is killed (tests/distlib.py).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from distlib import Outcome, run_ranks
from helpers import LedgerClient, flip_byte, migrate_to
from sqlalchemy import create_engine, inspect
from sqlalchemy.pool import NullPool

from ckptdb import CheckpointManager, Keep, Replicator, RunReader, Sharded
from ckptdb.cli import main
from ckptdb.errors import InvalidArgumentError, LayoutMismatchError
from ckptdb.ledger.engine import default_sqlite_url

pytestmark = pytest.mark.timeout(120)

STREAMS = {"model": Keep(last=3), "plain": Keep(last=3)}
ROWS = 10  # rows of the sharded tensor: uneven shards on 3 ranks (4, 4, 2) and on 4 (3, 3, 3, 1)


@pytest.fixture
def db_url(backend: str | None) -> str | None:
    return backend


def full_weight() -> torch.Tensor:
    return torch.arange(ROWS * 3, dtype=torch.float32).reshape(ROWS, 3)


def full_bias() -> torch.Tensor:
    return torch.tensor([0.25, -0.5, 4.0])


def rng_of(rank: int) -> torch.Tensor:
    """What rank ``rank`` saved as its own entry ``rng/<rank>``."""
    return torch.full((4,), rank + 0.5)


# ------------------------------------------------------------------ one process


def test_every_checkpoint_and_attempt_records_its_world_size(
    open_manager: Any, db: LedgerClient
) -> None:
    mgr = open_manager(streams=STREAMS)
    saved = mgr.save(1, model=Sharded({"w": torch.ones(3), "n": 2}), plain={"w": torch.ones(2)})

    assert saved["model"].world_size == saved["plain"].world_size == 1
    assert mgr.latest("model").world_size == 1
    assert [c.world_size for c in mgr.checkpoints()] == [1, 1]
    found = db.rows("SELECT stream, world_size, topology FROM checkpoints ORDER BY stream")
    assert found[0][:2] == ("model", 1) and json.loads(found[0][2]) == {"meshes": []}
    assert found[1] == ("plain", 1, None)  # a torch.save file has no mesh to describe
    assert db.rows("SELECT world_size FROM attempts") == [(1,)]


def test_a_key_the_checkpoint_lacks_is_refused_before_anything_loads(
    open_manager: Any, db: LedgerClient
) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=Sharded({"w": torch.ones(3), "rng/0": rng_of(0)}))
    events_before = db.rows("SELECT kind FROM events ORDER BY id")
    into = {"w": torch.zeros(3), "rng/0": torch.zeros(4), "rng/1": torch.zeros(4)}

    with pytest.raises(LayoutMismatchError) as caught:
        mgr.load(into=into)

    assert isinstance(caught.value, InvalidArgumentError) and isinstance(caught.value, ValueError)
    message = str(caught.value)
    assert "'rng/1'" in message and "'rng/0'" not in message and "'w'" not in message
    assert "saved on 1 rank, as this job runs" in message and "missing_keys='keep'" in message
    # nothing loaded, not even the keys the checkpoint has; nothing recorded
    assert all(torch.equal(v, torch.zeros_like(v)) for v in into.values())
    assert db.rows("SELECT kind FROM events ORDER BY id") == events_before
    assert db.rows("SELECT resumed_from_id FROM attempts") == [(None,)]


def test_keep_loads_what_the_checkpoint_has_and_keeps_the_rest(
    open_manager: Any, db: LedgerClient
) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=Sharded({"w": torch.ones(3), "nested": {"rng/0": rng_of(0)}}))
    mine = torch.full((4,), -7.0)
    into = {"w": torch.zeros(3), "nested": {"rng/0": torch.zeros(4), "rng/1": mine.clone()}}

    assert mgr.load(into=into, missing_keys="keep") is into

    assert torch.equal(into["w"], torch.ones(3))
    assert torch.equal(into["nested"]["rng/0"], rng_of(0))  # nested keys are DCP's "a.b"
    assert torch.equal(into["nested"]["rng/1"], mine)
    # saved and loaded on one rank: no world-size change to record
    assert db.rows("SELECT COUNT(*) FROM events WHERE kind = 'world_size_changed'") == [(0,)]
    assert db.rows("SELECT COUNT(*) FROM events WHERE kind = 'resumed'") == [(1,)]


@pytest.mark.parametrize(
    ("saved", "asked", "said"),
    [
        (2, torch.zeros(2), "'n' was saved as a value that is not a tensor, this job's is Tensor"),
        (torch.ones(2), 0, "'n' was saved as a tensor, this job's is int"),
    ],
)
def test_a_tensor_where_something_else_was_saved_is_refused(
    open_manager: Any, saved: Any, asked: Any, said: str
) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=Sharded({"w": torch.ones(3), "n": saved}))
    into = {"w": torch.zeros(3), "n": asked}

    with pytest.raises(LayoutMismatchError, match=said):
        mgr.load(into=into, missing_keys="keep")
    assert torch.equal(into["w"], torch.zeros(3)) and into["n"] is asked


@pytest.mark.parametrize("missing_keys", ["error", "keep"])
def test_a_tensor_of_another_shape_is_refused_under_every_policy(
    open_manager: Any, missing_keys: str
) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=Sharded({"w": torch.ones(3), "b": torch.ones(2)}))
    into = {"w": torch.zeros(5), "b": torch.zeros(2)}

    with pytest.raises(LayoutMismatchError, match=r"'w' was saved with shape \(3,\), this job"):
        mgr.load(into=into, missing_keys=missing_keys)  # type: ignore[arg-type]
    assert torch.equal(into["b"], torch.zeros(2))  # refused before anything loaded


@pytest.mark.parametrize("policy", ["Keep", "ignore", None, 1])
def test_an_unknown_missing_keys_policy_is_refused(
    open_manager: Any, db: LedgerClient, policy: object
) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=Sharded({"w": torch.ones(3)}), plain={"w": torch.ones(2)})
    into = {"w": torch.zeros(3)}
    before = db.rows("SELECT kind FROM events ORDER BY id")

    for stream, target in (("model", into), ("plain", None)):
        with pytest.raises(InvalidArgumentError, match="missing_keys must be one of"):
            mgr.load(stream=stream, into=target, missing_keys=policy)  # type: ignore[arg-type]
    assert torch.equal(into["w"], torch.zeros(3))
    assert db.rows("SELECT kind FROM events ORDER BY id") == before


def test_rows_from_before_the_column_say_unknown_and_load_as_before(
    open_manager: Any, root: Path, db_url: str | None, db: LedgerClient
) -> None:
    """A ledger at 0004 upgrades at the next open; its rows keep NULL (unknown), load
    as before and record no world-size change; downgrading drops only the columns."""
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=Sharded({"w": torch.ones(3)}))
    mgr.close()
    url = db_url or default_sqlite_url(root)
    migrate_to(url, "0004", down=True)
    before = db.rows("SELECT id, stream, step, state, path, hash FROM checkpoints")

    later = open_manager(streams=STREAMS)  # upgrades to the head
    old = later.latest("model")
    assert old.world_size is None
    into = {"w": torch.zeros(3)}
    later.load(into=into)
    assert torch.equal(into["w"], torch.ones(3))
    later.save(2, model=Sharded({"w": torch.ones(3)}))
    assert db.rows("SELECT step, world_size FROM checkpoints ORDER BY id") == [(1, None), (2, 1)]
    assert db.rows("SELECT world_size FROM attempts ORDER BY id") == [(None,), (1,)]
    assert db.rows("SELECT COUNT(*) FROM events WHERE kind = 'world_size_changed'") == [(0,)]
    later.close()

    migrate_to(url, "0004", down=True)
    assert not {"world_size", "topology"} & columns_of(url, "checkpoints")
    assert "world_size" not in columns_of(url, "attempts")
    assert db.rows("SELECT id, stream, step, state, path, hash FROM checkpoints")[:1] == before


def columns_of(url: str, table: str) -> set[str]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        return {c["name"] for c in inspect(engine).get_columns(table)}
    finally:
        engine.dispose()


# -------------------------------------------------------------- several ranks


def _save_on_ranks(rank: int, world: int, root: str, db_url: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    state = {
        "w": distribute_tensor(full_weight(), mesh, [Shard(0)]),
        "b": distribute_tensor(full_bias(), mesh, [Replicate()]),
        f"rng/{rank}": rng_of(rank),
        "step": 7,
    }
    with CheckpointManager(root, streams=STREAMS, db_url=db_url) as mgr:
        saved = mgr.save(7, model=Sharded(state), plain={"opt": torch.tensor([1.5])})
        return {"world_size": saved["model"].world_size, "local_rows": state["w"].to_local().shape}


def _resume_on_ranks(rank: int, world: int, root: str, db_url: str) -> dict[str, Any]:
    """Load the 3-rank checkpoint on ``world`` ranks under each per-rank policy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))

    def target(*ranks: int) -> dict[str, Any]:
        return {
            "w": distribute_tensor(torch.zeros(ROWS, 3), mesh, [Shard(0)]),
            "b": distribute_tensor(torch.zeros(3), mesh, [Replicate()]),
            **{f"rng/{r}": torch.full((4,), -1.0) for r in ranks},
            "step": 0,
        }

    def shown(into: dict[str, Any]) -> dict[str, Any]:
        return {
            "w": into["w"].full_tensor(),
            "w_local": into["w"].to_local().clone(),
            "b": into["b"].full_tensor(),
            "rng": {k: v.clone() for k, v in into.items() if k.startswith("rng/")},
            "step": into["step"],
        }

    report: dict[str, Any] = {}
    with CheckpointManager(root, db_url=db_url) as mgr:
        record = mgr.latest("model")
        report["saved_world_size"] = record.world_size
        into = target(rank)
        try:
            mgr.load(into=into)  # the default policy: "error"
            report["error"] = None
        except LayoutMismatchError as exc:
            report["error"] = (str(exc), exc.ranks)
        report["after_error"] = shown(into)

        kept = target(rank)
        mgr.load(into=kept, missing_keys="keep")
        report["keep"] = shown(kept)

        source = rank % record.world_size  # the recipe: take over a saved rank's entry
        mapped = target(source)
        mgr.load(into=mapped)
        report["mapped"] = shown(mapped)
        report["plain"] = mgr.load(stream="plain")["opt"]
    return report


def _ranks_ok(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    for o in outcomes:
        assert o.error is None, o.trace
    return [o.value for o in outcomes]


@pytest.fixture
def saved_on_three(tmp_path: Path, pg_url: str) -> Iterator[tuple[str, str, LedgerClient]]:
    root = str(tmp_path / "run")
    saved = _ranks_ok(run_ranks(_save_on_ranks, 3, tmp_path, root, pg_url))
    assert [s["world_size"] for s in saved] == [3, 3, 3]
    assert [s["local_rows"][0] for s in saved] == [4, 4, 2]  # really sharded unevenly
    client = LedgerClient(Path(root), pg_url)
    topology = client.rows("SELECT stream, world_size, topology FROM checkpoints ORDER BY stream")
    assert [(s, w) for s, w, _ in topology] == [("model", 3), ("plain", 3)]
    assert json.loads(topology[0][2]) == {
        "meshes": [
            {
                "device_type": "cpu",
                "dim_names": ["dp"],
                "placements": [["Shard(dim=0)"], ["Replicate()"]],
                "shape": [3],
                "tensors": 2,
            }
        ]
    }
    assert topology[1][2] is None
    yield root, pg_url, client
    client.close()


def assert_resharded(report: dict[str, Any], rank: int, world: int) -> None:
    """The DTensors came back whole, each rank holding its new shard."""
    assert torch.equal(report["w"], full_weight())
    assert torch.equal(report["b"], full_bias())
    assert torch.equal(report["w_local"], torch.chunk(full_weight(), world)[rank])
    assert report["step"] == 7


def resumed_on(
    world: int, tmp_path: Path, saved: tuple[str, str, LedgerClient]
) -> tuple[list[dict[str, Any]], LedgerClient]:
    """Every rank's report of :func:`_resume_on_ranks` on ``world`` ranks, and the ledger."""
    root, url, client = saved
    return _ranks_ok(run_ranks(_resume_on_ranks, world, tmp_path, root, url)), client


@pytest.mark.postgres
def test_a_three_rank_checkpoint_resumes_on_four(
    tmp_path: Path, saved_on_three: tuple[str, str, LedgerClient]
) -> None:
    reports, client = resumed_on(4, tmp_path, saved_on_three)

    for rank, report in enumerate(reports):
        assert report["saved_world_size"] == 3
        # "error": one error on every rank, naming rank 3 and what it lacks, nothing loaded
        message, ranks = report["error"]
        assert ranks == [3]
        assert "'rng/3'" in message and "saved on 3 ranks; this job runs on 4" in message
        untouched = report["after_error"]
        assert torch.equal(untouched["w"], torch.zeros(ROWS, 3)) and untouched["step"] == 0
        assert torch.equal(untouched["rng"][f"rng/{rank}"], torch.full((4,), -1.0))
        # "keep": everything the checkpoint has loads, resharded; rank 3 keeps its own
        assert_resharded(report["keep"], rank, 4)
        want = rng_of(rank) if rank < 3 else torch.full((4,), -1.0)
        assert torch.equal(report["keep"]["rng"][f"rng/{rank}"], want)
        # mapping: rank 3 takes over rank 0's entry
        assert_resharded(report["mapped"], rank, 4)
        assert torch.equal(report["mapped"]["rng"][f"rng/{rank % 3}"], rng_of(rank % 3))
        assert torch.equal(report["plain"], torch.tensor([1.5]))  # a torch.save file, any size
    changed = client.rows("SELECT detail FROM events WHERE kind = 'world_size_changed' ORDER BY id")
    assert [json.loads(d)["saved"] for (d,) in changed] == [3, 3, 3]  # each load that landed
    assert {json.loads(d)["now"] for (d,) in changed} == {4}
    assert client.rows("SELECT world_size FROM attempts ORDER BY id") == [(3,), (4,)]


@pytest.mark.postgres
def test_a_three_rank_checkpoint_resumes_on_two(
    tmp_path: Path, saved_on_three: tuple[str, str, LedgerClient]
) -> None:
    reports, client = resumed_on(2, tmp_path, saved_on_three)
    root, url, _ = saved_on_three

    for rank, report in enumerate(reports):
        assert report["error"] is None  # every rank's entry is there; rank 2's stays unread
        assert_resharded(report["after_error"], rank, 2)
        assert torch.equal(report["after_error"]["rng"][f"rng/{rank}"], rng_of(rank))
        assert_resharded(report["keep"], rank, 2)
        assert torch.equal(report["mapped"]["rng"][f"rng/{rank}"], rng_of(rank))
    changed = client.rows("SELECT detail FROM events WHERE kind = 'world_size_changed'")
    assert [(json.loads(d)["saved"], json.loads(d)["now"]) for (d,) in changed] == [(3, 2)] * 4
    # the checkpoint itself is untouched by loads on another size
    with CheckpointManager(root, db_url=url) as mgr:
        assert mgr.check(load=True) == []


@pytest.mark.postgres
def test_one_process_reads_a_three_rank_checkpoint_whole(
    saved_on_three: tuple[str, str, LedgerClient],
) -> None:
    """A reader (an evaluator, a converter) in one process: the DTensors load into plain
    tensors whole; a rank's entry the checkpoint lacks follows the same policy."""
    root, url, client = saved_on_three
    events = client.rows("SELECT COUNT(*) FROM events")
    with RunReader(root, db_url=url) as reader:
        whole = {"w": torch.zeros(ROWS, 3), "b": torch.zeros(3), "rng/2": torch.zeros(4)}
        reader.load(into=whole)
        assert torch.equal(whole["w"], full_weight()) and torch.equal(whole["b"], full_bias())
        assert torch.equal(whole["rng/2"], rng_of(2))

        lacking = {"w": torch.zeros(ROWS, 3), "rng/5": torch.zeros(4)}
        with pytest.raises(LayoutMismatchError, match="saved on 3 ranks; this job runs on 1"):
            reader.load(into=lacking)
        assert torch.equal(lacking["w"], torch.zeros(ROWS, 3))
        reader.load(into=lacking, missing_keys="keep")
        assert torch.equal(lacking["w"], full_weight())
        assert torch.equal(lacking["rng/5"], torch.zeros(4))
        with pytest.raises(InvalidArgumentError, match="missing_keys must be one of"):
            reader.load(into=lacking, missing_keys="drop")  # type: ignore[arg-type]
    assert client.rows("SELECT COUNT(*) FROM events") == events  # a reader writes nothing

    listed = CliRunner().invoke(main, ["list", root, "--db-url", url, "--json"])
    assert listed.exit_code == 0, listed.output
    assert {(c["stream"], c["world_size"]) for c in json.loads(listed.stdout)} == {
        ("model", 3),
        ("plain", 3),
    }
    table = CliRunner().invoke(main, ["list", root, "--db-url", url]).stdout.splitlines()
    column = table[0].split().index("ranks")
    assert [line.split()[column] for line in table[1:]] == ["3", "3"]


# ------------------------------------------------------- a new machine, fewer ranks


def _resume_from_copies(rank: int, world: int, root: str, db_url: str, remote: str) -> Any:
    """Open with ``remote=`` on ``world`` ranks (the chief restores inside the open's
    agreement, the others wait there), load the sharded checkpoint resharded, then
    train on: one more save on these ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    into = {
        "w": distribute_tensor(torch.zeros(ROWS, 3), mesh, [Shard(0)]),
        "b": distribute_tensor(torch.zeros(3), mesh, [Replicate()]),
        f"rng/{rank}": torch.full((4,), -1.0),
        "step": 0,
    }
    with CheckpointManager(root, db_url=db_url, remote=remote) as mgr:
        restored = sorted((c.stream, c.step) for c in mgr.restored_at_open)
        mgr.load(into=into)
        report = {
            "restored": restored,
            "w": into["w"].full_tensor(),
            "w_local": into["w"].to_local().clone(),
            "b": into["b"].full_tensor(),
            "rng": into[f"rng/{rank}"].clone(),
            "step": into["step"],
            "plain": mgr.load(stream="plain")["opt"],
        }
        into["step"] = 8
        saved = mgr.save(8, model=Sharded(into), plain={"opt": torch.tensor([2.5])})
        report["saved_world_size"] = saved["model"].world_size
    return report


@pytest.mark.postgres
@pytest.mark.parametrize("loss", ["machine", "corrupt shard"])
def test_a_three_rank_run_resumes_on_two_ranks_from_its_copies(
    tmp_path: Path, saved_on_three: tuple[str, str, LedgerClient], s3_url: str, loss: str
) -> None:
    """The fleet's case: a job saved on 3 ranks loses its machine (or a shard file of its
    newest checkpoint rots) and comes back on 2 ranks with ``remote=``: every rank
    resumes from the copy, resharded, values checked, and training goes on."""
    root, url, client = saved_on_three
    with Replicator(root, s3_url, db_url=url) as replicator:
        assert [r.state for r in replicator.replicate()] == ["replicated", "replicated"]
    model_dir = Path(root) / "checkpoints" / "model" / "step-000000007.dcp"
    if loss == "machine":
        shutil.rmtree(root)
    else:
        shard = next(p for p in sorted(model_dir.iterdir()) if p.name.endswith(".distcp"))
        flip_byte(shard)

    reports = _ranks_ok(run_ranks(_resume_from_copies, 2, tmp_path, root, url, s3_url))

    restored_at_open = [("model", 7), ("plain", 7)] if loss == "machine" else []
    assert reports[0]["restored"] == restored_at_open  # the chief's open restored them
    assert reports[1]["restored"] == []  # another rank waited in the open's agreement
    for rank, report in enumerate(reports):
        assert_resharded(report, rank, 2)
        assert torch.equal(report["rng"], rng_of(rank))
        assert torch.equal(report["plain"], torch.tensor([1.5]))
        assert report["saved_world_size"] == 2
    kinds = [k for (k,) in client.rows("SELECT kind FROM events ORDER BY id")]
    assert kinds.count("restored_from_replica") == (2 if loss == "machine" else 1)
    if loss == "corrupt shard":  # found by the load, brought back from its copy
        assert kinds.index("corrupt") < kinds.index("restored_from_replica")
        assert list((Path(root) / "ckptdb.quarantine").rglob("*.distcp"))
    with CheckpointManager(root, db_url=url) as mgr:
        assert mgr.check(load=True) == []
        assert [c.step for c in mgr.checkpoints(stream="model")] == [7, 8]
