"""``ckptdb export``: committed checkpoints out as Hugging Face safetensors, recorded.

Round trips from each source ckptdb holds (a plain state dict, a real
Lightning run, a real HF Trainer run read back with ``from_pretrained``, a DCP
checkpoint saved on 3 gloo ranks), sharded output as ``huggingface_hub``
shards it, tied weights written once as ``save_pretrained`` does, and the
failure paths: a corrupt source, a taken target, a failed record and a
SIGKILL mid-export leave no visible export and the ledger unchanged.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from distlib import run_ranks
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckptdb import CheckpointManager, RunReader, Sharded
from ckptdb.cli import main
from ckptdb.errors import (
    CkptDBError,
    CorruptCheckpointError,
    ExportTargetError,
    InvalidArgumentError,
)
from ckptdb.exports import safetensors as st
from ckptdb.exports import sources
from ckptdb.exports.writing import plan_shards, size_in_bytes

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_db_url_from_environment")]


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(8, 4, generator=g),
        "layer.bias": torch.randn(8, generator=g),
        "steps": torch.arange(6),
        "half": torch.randn(3, generator=g).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(2.5),
    }


def saved_run(root: Path, payload: Any, step: int = 1) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(step, model=payload)


def exports_in(root: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(root / "ckptdb.sqlite") as con:
        return con.execute("SELECT checkpoint_id, path, format, tensors FROM exports").fetchall()


def ledger_dump(root: Path) -> list[str]:
    """Every row of every table: what a refused or killed export must not change."""
    with sqlite3.connect(root / "ckptdb.sqlite") as con:
        return list(con.iterdump())


# ------------------------------------------------------------------ plain state dicts


def test_a_state_dict_round_trips_through_safetensors(tmp_path: Path) -> None:
    sd = state()
    saved_run(tmp_path / "run", {"model": sd, "epoch": 3})
    with RunReader(tmp_path / "run") as reader:
        result = reader.export(to=tmp_path / "out", key="model")
        recorded = reader.exports()
        latest = reader.latest()
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(sd)
    for name, tensor in sd.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert latest is not None and recorded == [result.export]
    export = result.export
    assert (export.checkpoint_id, export.step, export.format) == (latest.id, 1, "safetensors")
    assert [f.name for f in export.files] == ["model.safetensors"]
    assert export.files[0].size == (tmp_path / "out" / "model.safetensors").stat().st_size
    assert export.tensors == len(sd) and result.skipped == () and result.aliases == {}
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}  # what from_pretrained requires


def test_every_tensor_starts_at_a_multiple_of_its_element_size(tmp_path: Path) -> None:
    """Mixed dtypes (a 3-byte bool mask before a float) are laid out as the safetensors
    library lays them out, larger elements first, so a reader that maps the file gets
    aligned views."""
    saved_run(tmp_path / "run", state())
    with RunReader(tmp_path / "run") as reader:
        reader.export(to=tmp_path / "out")
    entries, _ = st.read_header(tmp_path / "out" / "model.safetensors")
    assert len(entries) == len(state())
    assert all(e.start % e.spec.itemsize == 0 for e in entries), [
        (e.spec.name, e.start) for e in entries
    ]
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert all(t.data_ptr() % t.element_size() == 0 for t in got.values())


def test_a_failed_record_leaves_the_users_empty_directory_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptdb.ledger import exports as ledger_exports

    saved_run(tmp_path / "run", state())
    (tmp_path / "out").mkdir()

    def refused(*args: Any, **kwargs: Any) -> int:
        raise RuntimeError("the ledger refused the row")

    monkeypatch.setattr(ledger_exports, "record", refused)
    with RunReader(tmp_path / "run") as reader, pytest.raises(RuntimeError):
        reader.export(to=tmp_path / "out")
    assert (tmp_path / "out").is_dir() and not any((tmp_path / "out").iterdir())


def test_non_tensor_entries_are_left_out_and_named(tmp_path: Path) -> None:
    sd: dict[str, Any] = {"w": torch.ones(2), "inner": {"b": torch.zeros(3), "count": 4}}
    saved_run(tmp_path / "run", {"model": sd})
    with RunReader(tmp_path / "run") as reader:
        result = reader.export(to=tmp_path / "out", key="model")
    assert sorted(load_file(tmp_path / "out" / "model.safetensors")) == ["inner.b", "w"]
    assert result.skipped == ("inner.count",)


def test_without_a_key_a_dict_of_more_than_tensors_is_refused_and_nothing_written(
    tmp_path: Path,
) -> None:
    saved_run(tmp_path / "run", {"model": state(), "optimizer": {"lr": 0.1}})
    before = ledger_dump(tmp_path / "run")
    with RunReader(tmp_path / "run") as reader:
        with pytest.raises(InvalidArgumentError, match="'model', 'optimizer'"):
            reader.export(to=tmp_path / "out")
        with pytest.raises(InvalidArgumentError, match="no key 'weights'"):
            reader.export(to=tmp_path / "out", key="weights")
    assert not (tmp_path / "out").exists() and ledger_dump(tmp_path / "run") == before
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no temporary either


def test_tied_weights_are_written_once_and_from_pretrained_reties_them(tmp_path: Path) -> None:
    """GPT-2 ties lm_head to the token embeddings; save_pretrained writes the shared
    tensor once, so does the export, and the model loads back to the same logits."""
    from hflib import tiny_model

    model = tiny_model()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    saved_run(tmp_path / "run", model.state_dict())
    with RunReader(tmp_path / "run") as reader:
        result = reader.export(to=tmp_path / "out")
    assert result.aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert "lm_head.weight" not in load_file(tmp_path / "out" / "model.safetensors")
    assert_same_logits(model, tmp_path / "out")


def assert_same_logits(model: Any, directory: Path) -> None:
    """As a user would: the model's config saved beside the exported weights."""
    from transformers import GPT2LMHeadModel

    model.config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    loaded = GPT2LMHeadModel.from_pretrained(directory)
    ids = torch.arange(12).reshape(2, 6)
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_above_the_shard_size_the_weights_are_sharded_as_huggingface_hub_shards_them(
    tmp_path: Path,
) -> None:
    from hflib import tiny_model
    from huggingface_hub import split_torch_state_dict_into_shards

    model = tiny_model()
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    limit = 20_000
    saved_run(tmp_path / "run", sd)
    with RunReader(tmp_path / "run") as reader:
        result = reader.export(to=tmp_path / "out", max_shard_size=limit)
    hub = split_torch_state_dict_into_shards(sd, max_shard_size=limit)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert hub.is_sharded and index["weight_map"] == hub.tensor_to_filename
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in sd.values())
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == sorted([*hub.filename_to_tensors, "model.safetensors.index.json"])
    assert sorted(f.name for f in result.export.files) == names
    assert_same_logits(model, tmp_path / "out")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (1000, 1000),
        ("5GB", 5 * 10**9),
        ("2GiB", 2 * 2**30),
        ("500MB", 500 * 10**6),
        ("1.5KB", 1500),
    ],
)
def test_shard_sizes_read_as_hugging_face_writes_them(given: Any, expected: int) -> None:
    assert size_in_bytes(given) == expected


@pytest.mark.parametrize("bad", ["5 parsecs", "-1", 0, True, "GB"])
def test_a_bad_shard_size_is_refused(tmp_path: Path, bad: Any) -> None:
    saved_run(tmp_path / "run", state())
    with RunReader(tmp_path / "run") as reader, pytest.raises(InvalidArgumentError):
        reader.export(to=tmp_path / "out", max_shard_size=bad)
    assert not (tmp_path / "out").exists()


def test_a_tensor_larger_than_the_shard_size_gets_a_shard_of_its_own() -> None:
    """As huggingface_hub splits: the big tensor alone, the open shard goes on filling."""
    specs = [st.TensorSpec(n, torch.float32, (s,)) for n, s in [("a", 2), ("b", 30), ("c", 2)]]
    assert [[s.name for s in shard] for shard in plan_shards(specs, 16)] == [["b"], ["a", "c"]]


@pytest.mark.parametrize("dtype", sorted(st.CODES, key=str))
def test_every_dtype_reads_back_with_the_safetensors_library(tmp_path: Path, dtype: Any) -> None:
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(dtype)
    path = tmp_path / "t.safetensors"
    st.write_file(path, [st.spec_of("t", tensor)], [tensor])
    got = load_file(path)["t"]
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    assert (8 + header_length) % 8 == 0  # the data 8-byte aligned, as the library writes it
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))
    # and our reader reads what the library writes
    save_file({"x": tensor, "e": torch.empty(0, 2, dtype=dtype)}, tmp_path / "lib.safetensors")
    entries, _ = st.read_header(tmp_path / "lib.safetensors")
    with open(tmp_path / "lib.safetensors", "rb") as f:
        read = {e.spec.name: st.read_tensor(f, e, tmp_path) for e in entries}
    assert torch.equal(read["x"].view(torch.uint8), tensor.view(torch.uint8))
    assert read["e"].shape == (0, 2)


def test_a_dtype_safetensors_cannot_hold_is_refused(tmp_path: Path) -> None:
    saved_run(tmp_path / "run", {"z": torch.ones(2, dtype=torch.complex64)})
    with RunReader(tmp_path / "run") as reader, pytest.raises(InvalidArgumentError, match="z:"):
        reader.export(to=tmp_path / "out")
    assert not (tmp_path / "out").exists() and exports_in(tmp_path / "run") == []


def test_a_truncated_or_overlapping_safetensors_file_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.ones(4), "b": torch.ones(4)}, path)
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    with pytest.raises(CorruptCheckpointError, match="describes"):
        st.read_header(path)
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    header["b"]["data_offsets"] = header["a"]["data_offsets"]
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length :])
    with pytest.raises(CorruptCheckpointError):
        st.read_header(path)


# ------------------------------------------------------------------ refusals


def test_a_corrupt_checkpoint_is_refused_before_it_is_read(tmp_path: Path) -> None:
    saved_run(tmp_path / "run", state())
    with RunReader(tmp_path / "run") as reader:
        latest = reader.latest()
    assert latest is not None
    data = bytearray(latest.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    latest.path.write_bytes(bytes(data))
    before = ledger_dump(tmp_path / "run")
    with RunReader(tmp_path / "run") as reader, pytest.raises(CorruptCheckpointError):
        reader.export(to=tmp_path / "out")
    assert not (tmp_path / "out").exists() and ledger_dump(tmp_path / "run") == before


def test_a_taken_target_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    saved_run(tmp_path / "run", state())
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("a file")
    with RunReader(tmp_path / "run") as reader:
        with pytest.raises(ExportTargetError, match="not empty") as raised:
            reader.export(to=taken)
        assert isinstance(raised.value, FileExistsError)
        with pytest.raises(ExportTargetError, match="not a directory"):
            reader.export(to=tmp_path / "file")
        inside = reader.save_dir / "exported"
        with pytest.raises(ExportTargetError, match="inside the run"):
            reader.export(to=inside)
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    assert not inside.exists() and exports_in(tmp_path / "run") == []


def test_an_empty_directory_is_a_fine_target(tmp_path: Path) -> None:
    saved_run(tmp_path / "run", state())
    (tmp_path / "out").mkdir()
    with RunReader(tmp_path / "run") as reader:
        reader.export(to=tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_a_record_that_fails_removes_the_placed_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptdb.ledger import exports as ledger_exports

    saved_run(tmp_path / "run", state())
    before = ledger_dump(tmp_path / "run")

    def refused(*args: Any, **kwargs: Any) -> int:
        raise RuntimeError("the ledger refused the row")

    monkeypatch.setattr(ledger_exports, "record", refused)
    with RunReader(tmp_path / "run") as reader, pytest.raises(RuntimeError, match="refused"):
        reader.export(to=tmp_path / "out")
    assert not (tmp_path / "out").exists() and ledger_dump(tmp_path / "run") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


KILLED_EXPORT = """
import sys, time
from pathlib import Path
import ckptdb.exports.safetensors as st
from ckptdb import RunReader

real = st.write_file
def first_shard_then_stall(path, *args, **kwargs):
    info = real(path, *args, **kwargs)
    Path(sys.argv[3]).write_text(str(path))
    time.sleep(60)
    return info
st.write_file = first_shard_then_stall
with RunReader(sys.argv[1]) as reader:
    reader.export(to=sys.argv[2], max_shard_size=100)
"""


def test_a_sigkill_mid_export_leaves_no_visible_export_and_the_ledger_unchanged(
    tmp_path: Path,
) -> None:
    saved_run(tmp_path / "run", state())
    before = ledger_dump(tmp_path / "run")
    marker = tmp_path / "one-shard-written"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            KILLED_EXPORT,
            str(tmp_path / "run"),
            str(tmp_path / "out"),
            str(marker),
        ]
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the export never wrote its first shard"
        written = Path(marker.read_text())
        assert written.parent.name.startswith(".out.ckptdb-export-") and written.exists()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert not (tmp_path / "out").exists() and ledger_dump(tmp_path / "run") == before
    with RunReader(tmp_path / "run") as reader:  # the next export clears the leftover
        reader.export(to=tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one-shard-written", "out", "run"]
    assert len(exports_in(tmp_path / "run")) == 1


# ------------------------------------------------------------------ the ledger's view


def test_check_verifies_every_recorded_export(tmp_path: Path) -> None:
    saved_run(tmp_path / "run", state())
    with RunReader(tmp_path / "run") as reader:
        export = reader.export(to=tmp_path / "out", max_shard_size=100).export
    assert len(export.files) > 2
    with CheckpointManager(tmp_path / "run", maintenance=True) as mgr:
        assert mgr.check() == []
    first, second = (tmp_path / "out" / f.name for f in export.files[:2])
    data = bytearray(first.read_bytes())
    data[-1] ^= 0x01
    first.write_bytes(bytes(data))
    second.unlink()
    with CheckpointManager(tmp_path / "run", maintenance=True) as mgr:
        problems = mgr.check()
    assert len(problems) == 2
    assert f"{first.name} size/hash" in problems[0] and f"{second.name} unreadable" in problems[1]


def test_exporting_again_where_a_removed_export_was_replaces_its_row(tmp_path: Path) -> None:
    import shutil

    saved_run(tmp_path / "run", state())
    with RunReader(tmp_path / "run") as reader:
        first = reader.export(to=tmp_path / "out").export
        shutil.rmtree(tmp_path / "out")
        second = reader.export(to=tmp_path / "out", max_shard_size=100).export
        assert reader.exports() == [second] and second.files != first.files


def test_a_reader_exports_while_the_trainer_holds_the_run(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, model=state())
        with RunReader(tmp_path / "run") as reader:
            reader.export(to=tmp_path / "out")
        mgr.save(2, model=state())
        assert mgr.check() == []
    assert len(exports_in(tmp_path / "run")) == 1


# ------------------------------------------------------------------ the command


def test_the_command_exports_the_best_and_list_shows_it(tmp_path: Path) -> None:
    from ckptdb import TopK

    with CheckpointManager(tmp_path / "run", streams={"best": TopK(2, "loss")}) as mgr:
        for step, loss in [(1, 3.0), (2, 1.0), (3, 2.0)]:
            mgr.save(step, metrics={"loss": loss}, best=state())
    runner = CliRunner()
    out = tmp_path / "best"
    done = runner.invoke(
        main, ["export", str(tmp_path / "run"), "--best", "--to", str(out), "--json"]
    )
    assert done.exit_code == 0, done.output
    shown = json.loads(done.output)
    assert (shown["stream"], shown["step"], shown["path"]) == ("best", 2, str(out))
    listed = runner.invoke(main, ["list", str(tmp_path / "run"), "--json"])
    by_step = {c["step"]: c["exports"] for c in json.loads(listed.output)}
    assert by_step == {2: [str(out)], 3: []}  # step 1 left the top 2
    table = runner.invoke(main, ["list", str(tmp_path / "run")]).output
    assert "exports" in table.splitlines()[0] and str(out) in table


def test_the_command_says_one_line_on_bad_input(tmp_path: Path) -> None:
    saved_run(tmp_path / "run", {"model": state(), "step": 1})
    runner = CliRunner()
    root = str(tmp_path / "run")
    both = runner.invoke(main, ["export", root, "--best", "--step", "1", "--to", "x"])
    assert both.exit_code == 2 and "one of --step, --best, --latest" in both.output
    refused = runner.invoke(main, ["export", root, "--to", str(tmp_path / "out")])
    assert refused.exit_code == 1
    assert refused.output.startswith("Error: ") and "--key" in refused.output
    assert refused.output.count("\n") == 1 and not (tmp_path / "out").exists()


def test_a_directory_that_is_not_a_run_is_one_line_and_untouched(tmp_path: Path) -> None:
    (tmp_path / "not_a_run").mkdir()
    (tmp_path / "not_a_run" / "notes.txt").write_text("keep me")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    done = CliRunner().invoke(
        main, ["export", str(tmp_path / "not_a_run"), "--to", str(tmp_path / "out")]
    )
    assert done.exit_code == 1 and done.output.count("\n") == 1, done.output
    assert done.output.startswith("Error: ") and "not_a_run" in done.output
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_errors_are_of_the_one_hierarchy() -> None:
    assert issubclass(ExportTargetError, CkptDBError)
    assert issubclass(ExportTargetError, FileExistsError)


# ------------------------------------------------------------------ frameworks


def test_a_lightning_checkpoint_exports_its_state_dict(tmp_path: Path) -> None:
    from lightninglib import Tiny, trainer

    from ckptdb.integrations.lightning import ModelCheckpoint, default_ledger

    d = tmp_path / "ckpts"
    module = Tiny()
    trainer(tmp_path, [ModelCheckpoint(dirpath=d)], max_epochs=2).fit(module)
    with RunReader(default_ledger(d)) as reader:
        (stream,) = {c.stream for c in reader.checkpoints()}
        result = reader.export(stream=stream, to=tmp_path / "out")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(module.state_dict())
    for name, tensor in module.state_dict().items():
        assert torch.equal(got[name], tensor), name
    assert result.export.step == 8


def test_an_hf_trainer_checkpoint_loads_with_from_pretrained(tmp_path: Path) -> None:
    from hflib import dataset, tiny_model, training_args
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from ckptdb.integrations.transformers import STREAM, Trainer

    out = tmp_path / "out"
    vocab = {f"t{i}": i for i in range(64)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
        unk_token="t0",
        pad_token="t0",
    )
    trainer = Trainer(
        model=tiny_model(),
        args=training_args(out),
        train_dataset=dataset(),
        processing_class=tokenizer,
    )
    trainer.train()
    with RunReader(out) as reader:
        result = reader.export(stream=STREAM, to=tmp_path / "exported")
        latest = reader.latest(STREAM)
    assert latest is not None and latest.path.name == "checkpoint-12"
    assert result.export.checkpoint_id == latest.id
    names = {p.name for p in (tmp_path / "exported").iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
    assert not names & {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"}
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    original = AutoModelForCausalLM.from_pretrained(latest.path)
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, original(ids).logits)
    assert type(PreTrainedTokenizerFast.from_pretrained(tmp_path / "exported")) is type(tokenizer)


# ------------------------------------------------------------------ DCP on 3 ranks

ROWS = 7  # over 3 ranks: shards of 3, 2 and 2 rows


def full_weight() -> torch.Tensor:
    return torch.arange(ROWS * 3, dtype=torch.float32).reshape(ROWS, 3)


def _save_sharded(rank: int, world: int, root: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = {
        "w": distribute_tensor(full_weight(), mesh, [Shard(0)]),
        "b": distribute_tensor(torch.linspace(0, 1, 5), mesh, [Replicate()]),
        "emb": torch.ones(4, 2, dtype=torch.bfloat16),
    }
    with CheckpointManager(root) as mgr:
        saved = mgr.save(3, model=Sharded({"model": model, "step": 3}))
        return int(saved["model"].world_size or 0)


def test_a_dcp_checkpoint_saved_on_three_ranks_is_consolidated(tmp_path: Path) -> None:
    outcomes = run_ranks(_save_sharded, 3, tmp_path, str(tmp_path / "run"), timeout=90)
    assert [o.error for o in outcomes] == [None] * 3, [o.trace for o in outcomes]
    assert outcomes[0].value == 3
    with RunReader(tmp_path / "run") as reader:
        with pytest.raises(InvalidArgumentError, match="'model', 'step'"):
            reader.export(to=tmp_path / "out")
        result = reader.export(to=tmp_path / "out", key="model")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(got) == ["b", "emb", "w"]
    assert torch.equal(got["w"], full_weight())
    assert torch.equal(got["b"], torch.linspace(0, 1, 5))
    assert got["emb"].dtype == torch.bfloat16 and torch.equal(
        got["emb"], torch.ones(4, 2).bfloat16()
    )
    assert result.skipped == ()


def test_a_dcp_source_reads_at_most_the_largest_tensor_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consolidation never holds the model: each DCP read is a batch of tensors no
    larger together than the largest one."""
    model = {f"small{i}": torch.full((16,), float(i)) for i in range(10)}
    model["big"] = torch.ones(64)
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, model=Sharded(model))
    batches: list[int] = []
    real = sources.dcp.load_sharded

    def measured(into: dict[str, torch.Tensor], *args: Any) -> None:
        batches.append(sum(t.nbytes for t in into.values()))
        real(into, *args)

    monkeypatch.setattr(sources.dcp, "load_sharded", measured)
    with RunReader(tmp_path / "run") as reader:
        reader.export(to=tmp_path / "out")
    assert max(batches) == model["big"].nbytes and len(batches) < len(model)
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(got[k], v) for k, v in model.items())


def test_a_write_that_fails_removes_the_temporary_and_raises_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    saved_run(tmp_path / "run", state())
    before = ledger_dump(tmp_path / "run")
    real = st.write_file

    def disk_full(path: Path, *args: Any, **kwargs: Any) -> Any:
        real(path, *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(st, "write_file", disk_full)
    with RunReader(tmp_path / "run") as reader, pytest.raises(OSError, match="No space"):
        reader.export(to=tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["run"] and ledger_dump(tmp_path / "run") == before


# ------------------------------------------------------------------ both ledgers


@pytest.fixture
def db_url(backend: str | None) -> str | None:
    return backend


def test_an_export_is_recorded_in_the_runs_ledger_and_survives_a_migration_round_trip(
    open_manager: Any, root: Path, db_url: str | None, db: Any, tmp_path: Path
) -> None:
    """On SQLite and PostgreSQL: the row, what list and check make of it, and revision
    0010 downgraded (the table dropped, the files left) and upgraded again."""
    from helpers import migrate_to

    from ckptdb.ledger.engine import default_sqlite_url

    mgr = open_manager()
    mgr.save(1, model=state())
    with RunReader(root, db_url=db_url) as reader:
        result = reader.export(to=tmp_path / "out")
    rows = db.rows("SELECT checkpoint_id, format, path, tensors, size FROM exports")
    export = result.export
    assert rows == [(export.checkpoint_id, "safetensors", str(tmp_path / "out"), 6, export.size)]
    assert mgr.check() == []
    (tmp_path / "out" / "model.safetensors").unlink()
    assert [p.split(":")[0] for p in mgr.check()] == [f"export {export.id} ({tmp_path / 'out'})"]
    mgr.close()
    migrate_to(db_url or default_sqlite_url(root), "0009", down=True)
    with pytest.raises(Exception, match="exports"):
        db.rows("SELECT COUNT(*) FROM exports")
    later = open_manager()  # upgrades to the head again
    assert later.check() == [] and db.rows("SELECT COUNT(*) FROM exports") == [(0,)]
