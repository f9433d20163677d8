"""The export scenario: ``ckptdb export`` of a framework's checkpoint, power cut anywhere.

A run's ``ema`` stream holds a Hugging Face style directory (``model.safetensors``
and ``config.json``, written by "the framework" through ``External``); its
latest checkpoint is exported with a shard limit that splits the weights in
two, so the recording holds every kind of file an export writes: shards, the
index, a copied config, the temporary directory's fsync and its rename.

In every crash state, before the run is reopened:

- the target directory, if it is there, is the whole export: exactly the
  files the export wrote, each with the bytes it wrote (never a torn shard, a
  missing index, an empty config);
- a row of ``exports``, if there is one, names a whole target;
- once ``export`` returned, the row is there.

Then the run reopens and passes its checks (``ReferenceCheck``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from crashlib import EXTERNAL_DIR_STATE, Boundary, payload, policies, sqlite_rows
from safetensors.torch import save_file

from ckptdb import CheckpointManager, External, RunReader
from ckptdb.storage.files import hash_file

from .explorer import Check, ReferenceCheck
from .recording import Recorder
from .scenarios import Recorded, Run, Scenario, _paths, plain

TARGET = "exported"


def hf_directory(b: Boundary) -> dict[str, Any]:
    """``ema`` as a framework's model directory: two tensors and a config (and the
    state the reference model reads, copied like any file beside the weights)."""

    def write_dir(path: Path) -> None:
        path.mkdir(parents=True)
        weights = {"w": torch.full((32,), float(b.index)), "b": torch.arange(8.0) + b.step}
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps({"step": b.step, "hidden": 32}))
        # what the reference model reads to tell the boundary a directory came from
        torch.save(payload(b, "ema"), path / EXTERNAL_DIR_STATE)

    return {**plain(b), "ema": External(write_dir, name=f"hf/checkpoint-{b.step}")}


def export_run(tmp: Path, deep: bool) -> Recorded:
    spec = [(10, 0.5), (20, 0.3)] + ([(30, 0.7)] if deep else [])
    run = Run(spec, history=len(spec), make=hf_directory)
    world, root = _paths(tmp)
    with CheckpointManager(root, streams=policies()) as mgr:
        run.save_history(mgr)
    with Recorder(world, root) as rec, RunReader(root) as reader:
        rec.mark({"export": "begin"})
        # 100 bytes: "w" (128 bytes) alone in a shard, "b" in another, and an index
        result = reader.export(stream="ema", to=world / TARGET, max_shard_size=100)
        rec.mark({"export": "returned"})
    written = {f.name: (f.size, f.hash) for f in result.export.files}
    assert len(written) == 5, written  # two shards, the index, the config, state.pt
    return Recorded("export", rec.trace(), ExportCheck(written, ReferenceCheck(run.ref)))


@dataclass
class ExportCheck:
    """The export as the crash left it (see the module doc), then ``inner``."""

    written: dict[str, tuple[int, str]]
    inner: Check

    def __call__(
        self, root: Path, records: list[Mapping[str, Any]], save_dir: str | None = None
    ) -> list[str]:
        problems = export_problems(root.parent / TARGET, root, self.written, records)
        return problems + self.inner(root, records, save_dir)


def export_problems(
    target: Path, root: Path, written: dict[str, tuple[int, str]], records: list[Mapping[str, Any]]
) -> list[str]:
    problems = []
    whole = target.is_dir() and _files(target) == written
    if target.exists() and not whole:
        problems.append(f"{TARGET}/ is visible but not the whole export: {_files(target)}")
    rows = _rows(root)
    if rows and not whole:
        problems.append(f"the ledger records an export, but {TARGET}/ is not whole")
    if any(r.get("export") == "returned" for r in records) and not rows:
        problems.append("export() returned, but the ledger has no row of it")
    return problems


def _files(directory: Path) -> dict[str, tuple[int, str]]:
    found = {}
    for path in sorted(directory.iterdir()):
        info = hash_file(path)
        found[path.name] = (info.size, info.hash)
    return found


def _rows(root: Path) -> list[tuple[Any, ...]]:
    return sqlite_rows(root, "SELECT id, manifest FROM exports")


EXPORT_SCENARIOS = {
    s.name: s
    for s in (
        Scenario(
            "export",
            "ckptdb export of a framework's directory: shards, index, config",
            export_run,
        ),
    )
}
