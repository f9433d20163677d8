"""Writing an export directory: Hugging Face's file names, shards and index.

One file ``model.safetensors`` when the weights fit ``max_shard_size``;
otherwise ``model-0000k-of-0000n.safetensors`` and
``model.safetensors.index.json`` (``{"metadata": {"total_size": N},
"weight_map": {name: file}}``), split as ``huggingface_hub`` splits a state
dict: in order, a new shard when the next tensor would overflow the current
one, a tensor larger than the limit alone in its own. The files a source
carries beside its weights (a model's config, its tokenizer) are copied.
Every file is fsynced and measured (size and hash) as it is written.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InvalidArgumentError
from ..record import ExportedFile
from ..storage.files import FileInfo, hash_file, sync_data

if TYPE_CHECKING:  # both import torch, which a reader of the ledger never needs
    from .safetensors import TensorSpec
    from .sources import Source

#: The largest shard by default: huggingface_hub's (transformers 4 used it too;
#: transformers 5's save_pretrained writes up to 50GB per file).
DEFAULT_MAX_SHARD_SIZE = "5GB"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.I)


def size_in_bytes(size: int | str) -> int:
    """A shard size: bytes, or text as Hugging Face writes it (``"5GB"``: 5*10**9,
    ``"2GiB"``: 2*2**30)."""
    if isinstance(size, bool):
        raise InvalidArgumentError(f"max_shard_size must be bytes or text like '5GB', got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        found = _SIZE.match(str(size))
        if found is None:
            raise InvalidArgumentError(
                f"max_shard_size must be like '5GB' or '500MiB', got {size!r}"
            )
        value = int(float(found.group(1)) * _UNITS[(found.group(2) or "").upper()])
    if value <= 0:
        raise InvalidArgumentError(f"max_shard_size must be positive, got {size!r}")
    return value


def plan_shards(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """The tensors of each shard, in order (see the module doc)."""
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    used = 0
    for spec in specs:
        if spec.nbytes > max_bytes:
            shards.append([spec])
            continue
        if current and used + spec.nbytes > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(spec)
        used += spec.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def aligned(specs: list[TensorSpec]) -> list[TensorSpec]:
    """A shard's tensors in the order the safetensors library writes them: larger
    elements first, then by name, so that every tensor starts at a multiple of its
    element size (a reader that maps the file gets aligned views)."""
    return sorted(specs, key=lambda s: (-s.itemsize, s.name))


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def write_export(source: Source, directory: Path, max_bytes: int) -> list[ExportedFile]:
    """Write ``source`` into the existing empty ``directory``; each file written."""
    from .safetensors import write_file

    shards = plan_shards(source.specs, max_bytes)
    names = shard_names(len(shards))
    written = []
    for name, specs in zip(names, shards, strict=True):
        ordered = aligned(specs)
        info = write_file(directory / name, ordered, source.tensors(ordered))
        written.append(_file(name, info))
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in source.specs)},
            "weight_map": {
                spec.name: name for name, specs in zip(names, shards, strict=True) for spec in specs
            },
        }
        written.append(_write_text(directory / INDEX, json.dumps(index, indent=2, sort_keys=True)))
    for extra in source.extra_files:
        written.append(_copy(extra, directory / extra.name))
    return written


def _file(name: str, info: FileInfo) -> ExportedFile:
    return ExportedFile(name, info.size, info.hash)


def _write_text(path: Path, text: str) -> ExportedFile:
    with open(path, "x", encoding="utf-8") as f:
        f.write(text + "\n")
        f.flush()
        sync_data(f.fileno(), path)
    return _file(path.name, hash_file(path))


def _copy(source: Path, target: Path) -> ExportedFile:
    with open(source, "rb") as src, open(target, "xb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.flush()
        sync_data(dst.fileno(), target)
    return _file(target.name, hash_file(target))


__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "INDEX",
    "SINGLE",
    "plan_shards",
    "shard_names",
    "size_in_bytes",
    "write_export",
]
