"""The safetensors format, written one tensor at a time.

The ``safetensors`` library writes a file from a dict of tensors held in
memory, which is what makes exporting a large model run out of memory. The
format needs no such thing: an 8-byte little-endian header length, a JSON
header giving each tensor's dtype, shape and byte range, then the bytes. The
header depends only on names, dtypes and shapes, which every source knows
before reading a byte (a DCP checkpoint from its metadata), so a file is
written header first and then tensor by tensor, each fetched, written and
dropped: peak memory is one tensor.

The reader here is used for sources that are themselves safetensors files
(an HF Trainer checkpoint): it reads one tensor's byte range at a time.
Files are checked the way the ``safetensors`` library checks them: byte
ranges contiguous from 0, each exactly its dtype's size times its shape.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
import xxhash

from ..errors import CorruptCheckpointError, InvalidArgumentError
from ..storage.files import FileInfo, sync_data

#: torch dtype <-> safetensors dtype code (the codes the format defines).
CODES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
DTYPES = {code: dtype for dtype, code in CODES.items()}
#: What ``from_pretrained`` requires of a file's metadata to read it as PyTorch weights.
METADATA = {"format": "pt"}
#: The header's length is padded so that the data starts 8-byte aligned.
ALIGN = 8
#: The largest header the safetensors library reads (100 MB).
MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as a file's header records it, before its bytes are read."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def checked_spec(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorSpec:
    """A tensor's spec; a dtype safetensors cannot hold is refused."""
    if dtype not in CODES:
        raise InvalidArgumentError(
            f"{name}: safetensors cannot hold {dtype} (it holds {', '.join(CODES.values())})"
        )
    return TensorSpec(name, dtype, shape)


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return checked_spec(name, tensor.dtype, tuple(tensor.shape))


def header_bytes(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header of a file holding ``specs`` in this order."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for spec in specs:
        end = offset + spec.nbytes
        header[spec.name] = {
            "dtype": CODES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % ALIGN)
    return struct.pack("<Q", len(text)) + text


def write_file(
    path: Path,
    specs: list[TensorSpec],
    tensors: Iterable[torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> FileInfo:
    """Write ``specs`` to a new file at ``path``; ``tensors`` yields their tensors in
    that order, each consumed when its bytes are due. Durable (fsynced) on return,
    with its size and hash."""
    digest = xxhash.xxh3_128()
    size = 0
    with open(path, "xb") as f:
        for chunk in _chunks(specs, tensors, {**METADATA, **(metadata or {})}):
            f.write(chunk)
            digest.update(chunk)
            size += len(chunk)
            del chunk  # a tensor's bytes go before the next one is read
        f.flush()
        sync_data(f.fileno(), path)
    return FileInfo(size, digest.hexdigest())


def _chunks(
    specs: list[TensorSpec], tensors: Iterable[torch.Tensor], metadata: dict[str, str]
) -> Iterator[memoryview | bytes]:
    yield header_bytes(specs, metadata)
    for spec, found in zip(specs, tensors, strict=True):
        tensor = found.detach()
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise CorruptCheckpointError(
                f"{spec.name}: read as {tensor.dtype} {tuple(tensor.shape)}, but its source "
                f"described {spec.dtype} {spec.shape}"
            )
        flat = tensor.to("cpu").contiguous().reshape(-1)
        yield memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # no copy
        del tensor, flat, found


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes are."""

    spec: TensorSpec
    start: int  # absolute offset in the file


def read_header(path: Path) -> tuple[list[Entry], dict[str, str]]:
    """The tensors of a safetensors file (in file order) and its metadata, checked."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", _exactly(f, 8, path))
            if length > MAX_HEADER:
                raise CorruptCheckpointError(f"{path}: a header of {length} bytes")
            header = json.loads(_exactly(f, length, path))
            total = os.fstat(f.fileno()).st_size
    except (ValueError, struct.error, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{path}: not a safetensors file ({exc})") from exc
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    entries = sorted(
        (_entry(path, name, value, 8 + length) for name, value in header.items()),
        key=lambda e: e.start,
    )
    expected = 8 + length
    for entry in entries:  # contiguous, no gaps or overlaps, the file's whole data
        if entry.start != expected:
            raise CorruptCheckpointError(f"{path}: {entry.spec.name} is not where it should be")
        expected += entry.spec.nbytes
    if expected != total:
        raise CorruptCheckpointError(f"{path}: {total} bytes, its header describes {expected}")
    return entries, {str(k): str(v) for k, v in dict(metadata).items()}


def _entry(path: Path, name: str, value: object, base: int) -> Entry:
    try:
        assert isinstance(value, dict)
        dtype = DTYPES[value["dtype"]]
        shape = tuple(int(n) for n in value["shape"])
        begin, end = (int(n) for n in value["data_offsets"])
    except (AssertionError, KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path}: cannot read the entry of {name!r}") from exc
    spec = TensorSpec(name, dtype, shape)
    if end - begin != spec.nbytes or min(shape, default=0) < 0:
        raise CorruptCheckpointError(f"{path}: {name!r} has {end - begin} bytes for {shape}")
    return Entry(spec, base + begin)


def read_tensor(f: BinaryIO, entry: Entry, path: Path) -> torch.Tensor:
    """One tensor's bytes, read from the open file ``f``."""
    f.seek(entry.start)
    data = bytearray(_exactly(f, entry.spec.nbytes, path))
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(entry.spec.dtype).reshape(entry.spec.shape)


def _exactly(f: BinaryIO, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CorruptCheckpointError(f"{path}: ends {n - len(data)} bytes early")
    return data
