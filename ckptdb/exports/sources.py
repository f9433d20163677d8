"""What an export reads: the tensors of a verified checkpoint, one at a time.

A source names its tensors (with dtype and shape) before reading any, then
yields them in the order asked for. Three kinds of checkpoint are read:

- a ``torch.save`` file (ckptdb's own, or a Lightning ``.ckpt``): unpickled
  with ``weights_only=True``; its state dict is the payload itself when every
  value is a tensor, the ``key`` the caller names, or a Lightning
  checkpoint's ``state_dict``;
- a framework's directory (an HF Trainer ``checkpoint-N/``): its
  ``model*.safetensors`` files, read tensor by tensor (or its
  ``pytorch_model*.bin``), and the files ``from_pretrained`` needs beside
  the weights (config, tokenizer);
- a sharded ``torch.distributed.checkpoint`` directory saved on any number
  of ranks: each tensor is assembled from its shards alone, in batches no
  larger than the largest tensor, so the whole model is never in memory.

Nested dicts are flattened with ``.`` as DCP flattens them. Values that are
not tensors (a step count, an RNG state's bytes) are left out and listed in
``skipped``. Names that alias one tensor (tied weights) are written once,
under the first name, as Hugging Face's ``save_pretrained`` does; the others
are listed in ``aliases``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch

from ..errors import CorruptCheckpointError, InvalidArgumentError
from ..storage import dcp
from ..storage.base import PayloadStore
from ..storage.kinds import SHARDED, kind_of_path
from .safetensors import Entry, TensorSpec, checked_spec, read_header, read_tensor, spec_of

#: The weights of a framework's directory; rewritten by the export, never copied.
WEIGHT_FILES = re.compile(
    r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$"
)
#: Training state in a Trainer's checkpoint directory: not part of a model.
TRAINING_STATE = re.compile(
    r"^(optimizer|scheduler|scaler|rng_state.*)\.(pt|pth|bin)$|^trainer_state\.json$"
    r"|^training_args\.bin$"
)
#: A Lightning checkpoint: its weights are under this key.
LIGHTNING_MARK, LIGHTNING_KEY = "pytorch-lightning_version", "state_dict"


class Source(Protocol):
    """The tensors of one checkpoint, named before any is read."""

    specs: list[TensorSpec]
    skipped: list[str]
    aliases: dict[str, str]
    #: Files copied next to the weights (a model's config, its tokenizer).
    extra_files: list[Path]

    def tensors(self, specs: list[TensorSpec]) -> Iterator[torch.Tensor]:
        """The tensors of ``specs`` (a subset of :attr:`specs`), in that order."""


def open_source(store: PayloadStore, rel: str, key: str | None, trust_pickle: bool) -> Source:
    """The source of the verified payload ``rel`` of ``store``."""
    if kind_of_path(rel) is SHARDED:
        return ShardedSource(store.dcp_reader(rel), key)
    verified = store.open_verified(rel)
    if verified is None:  # a directory a framework wrote
        directory = store.local_path(rel)
        if not directory.is_dir():  # an object store's "directory"
            raise InvalidArgumentError(
                f"{directory}: exporting a framework's directory from object storage is not "
                "supported; restore the run locally first (ckptdb restore)"
            )
        return directory_source(directory, key, trust_pickle)
    try:
        if hasattr(verified, "load"):
            payload = verified.load("cpu", not trust_pickle)
        else:
            payload = torch.load(verified, map_location="cpu", weights_only=not trust_pickle)
    except Exception as exc:
        if type(exc).__name__ == "UnpicklingError":
            raise InvalidArgumentError(
                f"{rel} holds objects other than tensors and plain values ({exc}); if you "
                "trust the file, pass trust_pickle=True (--trust-pickle)"
            ) from exc
        raise
    return StateDictSource(chosen_state_dict(payload, key, rel))


def chosen_state_dict(payload: object, key: str | None, where: str) -> Mapping[str, Any]:
    """The state dict to export from an unpickled payload (see the module doc)."""
    if not isinstance(payload, Mapping):
        raise InvalidArgumentError(f"{where} holds a {type(payload).__name__}, not a state dict")
    if key is not None:
        if key not in payload:
            raise InvalidArgumentError(f"{where} has no key {key!r} (it has {_keys(payload)})")
        chosen = payload[key]
        if not isinstance(chosen, Mapping):
            raise InvalidArgumentError(f"{where}[{key!r}] is a {type(chosen).__name__}, not a dict")
        return chosen
    if LIGHTNING_MARK in payload and isinstance(payload.get(LIGHTNING_KEY), Mapping):
        return payload[LIGHTNING_KEY]  # type: ignore[no-any-return]
    if payload and all(isinstance(v, torch.Tensor) for v in payload.values()):
        return payload
    raise InvalidArgumentError(
        f"{where} is not a state dict of tensors: choose the one to export with key= "
        f"(--key), one of {_keys(payload)}"
    )


def _keys(payload: Mapping[Any, Any]) -> str:
    names = [repr(k) for k in list(payload)[:12]]
    return ", ".join(names) + (", ..." if len(payload) > 12 else "") if names else "no keys"


@dataclass
class StateDictSource:
    """A state dict in memory (an unpickled file)."""

    state: Mapping[str, Any]
    specs: list[TensorSpec] = field(init=False)
    skipped: list[str] = field(init=False, default_factory=list)
    aliases: dict[str, str] = field(init=False, default_factory=dict)
    extra_files: list[Path] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        seen: dict[tuple[Any, ...], str] = {}
        for name, value in flatten(self.state):
            if not isinstance(value, torch.Tensor):
                self.skipped.append(name)
                continue
            identity = _identity(value)
            if identity in seen:
                self.aliases[name] = seen[identity]
                continue
            seen[identity] = name
            self._tensors[name] = value
        self.specs = [spec_of(name, t) for name, t in self._tensors.items()]

    def tensors(self, specs: list[TensorSpec]) -> Iterator[torch.Tensor]:
        for spec in specs:
            yield self._tensors[spec.name]


def flatten(state: Mapping[Any, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(name, value)`` of every leaf, nested dict keys joined with ``.`` (as DCP does)."""
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten(value, f"{name}.")
        else:
            yield name, value


def _identity(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Two names alias one tensor when they view the same bytes the same way."""
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return (id(tensor),)
    storage = tensor.untyped_storage()
    return (
        storage.data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
    )


def directory_source(directory: Path, key: str | None, trust_pickle: bool) -> Source:
    """A framework's checkpoint directory: its model weights and the files beside them."""
    files = sorted(p for p in directory.iterdir() if p.is_file())
    weights = [p for p in files if WEIGHT_FILES.match(p.name) and not p.name.endswith(".json")]
    safetensors = [p for p in weights if p.suffix == ".safetensors"]
    extra = [
        p for p in files if not WEIGHT_FILES.match(p.name) and not TRAINING_STATE.match(p.name)
    ]
    if key is not None:
        raise InvalidArgumentError(f"{directory} is a model directory: key= does not apply")
    source: Source
    if safetensors:
        source = SafetensorsSource(safetensors)
    elif weights:
        state: dict[str, Any] = {}
        for path in weights:
            state.update(torch.load(path, map_location="cpu", weights_only=not trust_pickle))
        source = StateDictSource(state)
    else:
        raise InvalidArgumentError(
            f"{directory} holds no model weights (model*.safetensors or pytorch_model*.bin)"
        )
    source.extra_files = extra
    return source


@dataclass
class SafetensorsSource:
    """Safetensors files (a Trainer's ``model*.safetensors``), read one tensor at a time."""

    files: list[Path]
    specs: list[TensorSpec] = field(init=False)
    skipped: list[str] = field(init=False, default_factory=list)
    aliases: dict[str, str] = field(init=False, default_factory=dict)
    extra_files: list[Path] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._where: dict[str, tuple[Path, Entry]] = {}
        for path in self.files:
            entries, _ = read_header(path)
            for entry in entries:
                if entry.spec.name in self._where:
                    raise CorruptCheckpointError(
                        f"{entry.spec.name} is in two files of {path.parent}"
                    )
                self._where[entry.spec.name] = (path, entry)
        self.specs = [entry.spec for _, entry in self._where.values()]

    def tensors(self, specs: list[TensorSpec]) -> Iterator[torch.Tensor]:
        with ExitStack() as stack:
            opened: dict[Path, BinaryIO] = {}
            for spec in specs:
                path, entry = self._where[spec.name]
                if path not in opened:
                    opened[path] = stack.enter_context(open(path, "rb"))
                yield read_tensor(opened[path], entry, path)


class ShardedSource:
    """A DCP checkpoint: each tensor assembled from the shards that hold it.

    Tensors are read in batches of at most the largest tensor's size (one DCP
    load each), so peak memory stays a small multiple of that tensor whatever
    the model's size, and a model of many small tensors is not read one DCP
    call per tensor."""

    def __init__(self, reader: Any, key: str | None) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self._reader = reader
        metadata = reader.read_metadata()
        found = metadata.state_dict_metadata
        prefix = _prefix(found, key)
        self.specs: list[TensorSpec] = []
        self.skipped: list[str] = []
        self.aliases: dict[str, str] = {}
        self.extra_files: list[Path] = []
        self._fqn: dict[str, str] = {}
        for fqn, item in found.items():
            if not fqn.startswith(prefix):
                continue
            name = fqn[len(prefix) :]
            if not isinstance(item, TensorStorageMetadata):
                self.skipped.append(name)
                continue
            self.specs.append(checked_spec(name, item.properties.dtype, tuple(item.size)))
            self._fqn[name] = fqn
        self._budget = max((s.nbytes for s in self.specs), default=0)

    def tensors(self, specs: list[TensorSpec]) -> Iterator[torch.Tensor]:
        batch: list[TensorSpec] = []
        size = 0
        for spec in specs:
            if batch and size + spec.nbytes > self._budget:
                yield from self._load(batch)
                batch, size = [], 0
            batch.append(spec)
            size += spec.nbytes
        if batch:
            yield from self._load(batch)

    def _load(self, batch: list[TensorSpec]) -> Iterator[torch.Tensor]:
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        into = {self._fqn[s.name]: torch.empty(s.shape, dtype=s.dtype) for s in batch}
        dcp.load_sharded(into, self._reader, None, DefaultLoadPlanner(allow_partial_load=True))
        for spec in batch:
            yield into.pop(self._fqn[spec.name])


def _prefix(found: Mapping[str, Any], key: str | None) -> str:
    """The prefix of the names to export: ``key.`` or none, when every entry is a tensor."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tops = sorted({fqn.split(".", 1)[0] for fqn in found})
    if key is not None:
        if key not in tops:
            shown = ", ".join(repr(t) for t in tops[:12])
            raise InvalidArgumentError(f"the checkpoint has no key {key!r} (it has {shown})")
        return f"{key}."
    if found and all(isinstance(item, TensorStorageMetadata) for item in found.values()):
        return ""
    shown = ", ".join(repr(t) for t in tops[:12])
    raise InvalidArgumentError(
        f"the checkpoint is not a state dict of tensors: choose the one to export with key= "
        f"(--key), one of {shown}"
    )
