"""The export case: a DCP checkpoint to safetensors, and the memory it takes.

A model of ``megabytes`` in float32 tensors of ``tensor_mb`` each, saved by
ckptdb as one sharded (DCP) checkpoint, exported side by side:

- **load whole, then save_file** (the baseline): what a user does without
  ckptdb: load every tensor of the checkpoint into memory (DCP into a full
  state dict) and write it with ``safetensors.torch.save_file``;
- **ckptdb export**: :meth:`ckptdb.RunReader.export`, which first verifies
  the checkpoint against its row (reads and hashes every byte), then reads
  and writes one batch of tensors at a time (at most the largest tensor).

Times are ratios to the baseline. The notes give each contender's peak
resident-memory growth (Linux ``VmHWM``) against the model's size and its
largest tensor's: the figure the export is built for.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from .harness import Comparison, anon_peak_growth, compare, rss_peak_growth

MiB = 1 << 20
BASELINE = "load whole, then safetensors save_file"
CKPTDB = "ckptdb export (verified, streamed)"


def export(work: Path, megabytes: int, tensor_mb: int, reps: int) -> Comparison:
    from ckptdb import CheckpointManager, RunReader, Sharded

    work.mkdir(parents=True, exist_ok=True)
    count = max(1, megabytes // tensor_mb)
    rows = tensor_mb * MiB // (4 * 1024)
    with CheckpointManager(work / "run") as mgr:
        mgr.save(
            1, model=Sharded({f"layer{i}.weight": torch.randn(rows, 1024) for i in range(count)})
        )
    reader = RunReader(work / "run")
    latest = reader.latest()
    assert latest is not None
    outputs = iter(range(1_000_000))

    def fresh() -> Path:
        return work / f"out{next(outputs)}"

    def baseline() -> None:
        target = fresh()
        target.mkdir()
        _load_whole_then_save(latest.path, target)
        shutil.rmtree(target)

    def ours() -> None:
        target = fresh()
        reader.export(to=target)
        shutil.rmtree(target)

    contenders = {BASELINE: baseline, CKPTDB: ours}
    try:
        result = compare(
            f"export {megabytes} MB DCP to safetensors", contenders, baseline=BASELINE, reps=reps
        )
        anon = {name: anon_peak_growth(run) for name, run in contenders.items()}
        resident = {name: rss_peak_growth(run) for name, run in contenders.items()}
    finally:
        reader.close()
    result.notes["model_mib"] = count * tensor_mb
    result.notes["largest_tensor_mib"] = tensor_mb
    result.notes["peak_anon_growth_mib"] = {k: round(v / MiB, 1) for k, v in anon.items()}
    result.notes["peak_anon_over_largest_tensor"] = {
        k: round(v / (tensor_mb * MiB), 2) for k, v in anon.items()
    }
    result.notes["peak_rss_growth_mib (file pages included)"] = {
        k: round(v / MiB, 1) for k, v in resident.items() if v is not None
    }
    return result


def _load_whole_then_save(checkpoint: Path, target: Path) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load

    reader = FileSystemReader(str(checkpoint))
    found = reader.read_metadata().state_dict_metadata
    state: dict[str, Any] = {
        name: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for name, item in found.items()
        if isinstance(item, TensorStorageMetadata)
    }
    load(state, storage_reader=reader, no_dist=True)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
