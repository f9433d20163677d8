"""Reading a ``torch.save`` file once: every byte hashed as it arrives, then loaded from
what was hashed.

Why: verifying a checkpoint and then letting ``torch.load`` read it again costs a
second pass over the file, and leaves a window in which the file could change
between the hash and the read. Here the file is read once, in file order; a
zip archive as ``torch.save`` writes it is read into one tensor per stored
record (torch's own reader allocates the same way, so memory is reused as with
``torch.load``); the caller compares the hash, and only then are those very
records unpickled (:meth:`HeldFile.load`). Any other file (a legacy pickle, a
TorchScript archive, a compressed entry) is held as one ``bytes`` object and
handed to ``torch.load`` as a stream.

On a machine of several CPUs, an archive of a few MiB or more is read by a second
thread while this one hashes what it read (:func:`_hash_while_reading`):
``readinto`` releases the GIL and xxhash does not, so the hash hides behind the
read when a second CPU is free (see :data:`_READ_AHEAD_CPUS`).
The records are still returned only after every byte was hashed, and the bytes
unpickled are the very buffers that were hashed.
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import queue
import struct
import threading
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

import torch
import torch.serialization as torch_serialization
import xxhash

from .files import FileInfo

# torch.load's own zip loader, fed records instead of a file: private to torch, so
# looked up once; without it every file is held whole and read as a stream.
_TORCH_LOAD_RECORDS: Callable[..., Any] | None = getattr(torch_serialization, "_load", None)
_WEIGHTS_ONLY_UNPICKLER: Any = getattr(torch_serialization, "_weights_only_unpickler", None)
if _WEIGHTS_ONLY_UNPICKLER is None:  # pragma: no cover - every supported torch has it
    _TORCH_LOAD_RECORDS = None

#: The local file header of a zip entry: signature, ..., name length, extra length.
_LOCAL_HEADER = struct.Struct("<4s22xHH")
_TAIL_START = 64 << 10


@dataclass(frozen=True)
class _Entry:
    name: str  # without the archive's top directory, as torch names records
    header_offset: int
    size: int


class _Unusual(Exception):
    """The archive is not laid out as ``torch.save`` writes it: read it whole instead."""


class HeldFile:
    """A file's bytes, read once and hashed (``info``); loadable once the hash matched."""

    def __init__(
        self,
        info: FileInfo,
        records: dict[str, Any] | None,
        raw: bytes | None,
        offsets: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        self.info = info
        self._records = records
        self._raw = raw
        self._offsets = offsets or {}  # record: (local header offset, data offset)

    @property
    def by_records(self) -> bool:
        """Held as the archive's records (the fast load), not as one stream."""
        return self._records is not None

    def stream(self) -> BinaryIO:
        """The whole file as a stream (what ``torch.load`` of a legacy file reads)."""
        if self._raw is None:
            raise _Unusual("records are loaded with load(), not streamed")
        return io.BytesIO(self._raw)  # shares the bytes, no copy

    def load(self, map_location: Any, weights_only: bool) -> Any:
        """``torch.load`` of exactly the bytes that were hashed (no file is read again)."""
        source = self.stream() if self._records is None else _Records(self._records, self._offsets)
        return unpickle(source, map_location=map_location, weights_only=weights_only)


def unpickle(source: Any, *, map_location: Any, weights_only: bool) -> Any:
    """The one place a held file is unpickled: a stream by ``torch.load``, held records
    by torch's own zip loader (the same code ``torch.load`` runs on an archive)."""
    if not isinstance(source, _Records):
        return torch.load(source, map_location=map_location, weights_only=weights_only)
    assert _TORCH_LOAD_RECORDS is not None  # else read_hashed held raw bytes
    if not _forced_weights_only(weights_only):
        return _TORCH_LOAD_RECORDS(source, map_location, pickle, encoding="utf-8")
    try:  # torch.load passes this encoding to its weights-only unpickler too
        return _TORCH_LOAD_RECORDS(source, map_location, _WEIGHTS_ONLY_UNPICKLER, encoding="utf-8")
    except pickle.UnpicklingError as exc:  # worded as torch.load words it
        raise pickle.UnpicklingError(
            "Weights only load failed: the checkpoint holds an object that is not a "
            "tensor or an allowed type. Load it with weights_only=False only if you "
            f"trust its source. WeightsUnpickler error: {exc}"
        ) from None


#: What torch reads as "on" in its environment switches.
_TORCH_TRUE = ("1", "y", "yes", "true")


def _forced_weights_only(weights_only: bool) -> bool:
    """``weights_only`` as ``torch.load`` settles it: ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``
    (an administrator's safety switch) makes every load weights-only, an explicit
    ``False`` included. Held records bypass ``torch.load``, so its check is repeated."""
    forced = os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TORCH_TRUE
    return weights_only or forced


def read_held(path: Path) -> HeldFile:
    """A checkpoint file read once, hashed as it is read, its bytes held for loading."""
    with open(path, "rb", buffering=0) as f:
        return read_hashed(f)


def read_hashed(f: BinaryIO) -> HeldFile:
    """Read the open file ``f`` (at offset 0) once, hashing every byte in file order.

    A file that shrinks while it is read yields what was read: its size and
    hash then differ from the row, which is how the caller finds it corrupt.
    """
    size = os.fstat(f.fileno()).st_size
    try:
        if _TORCH_LOAD_RECORDS is None:
            raise _Unusual("this torch has no zip loader to feed")  # pragma: no cover
        return _read_archive(f, size)
    except _Unusual:
        pass  # read whole below, once the error (its traceback holds the records) is gone
    f.seek(0)
    raw = _read_up_to(f, size)
    return HeldFile(FileInfo(len(raw), xxhash.xxh3_128(raw).hexdigest()), None, raw)


def _read_up_to(f: BinaryIO, size: int) -> bytes:
    """``size`` bytes of ``f`` from its position, fewer only at its end: one read(2)
    returns at most ~2 GiB on Linux, and a short read is not a shorter file (which
    would make a healthy checkpoint look corrupt). One part (the common case): no copy."""
    parts: list[bytes] = []
    left = size
    while left > 0:
        part = f.read(left)
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _read_archive(f: BinaryIO, size: int) -> HeldFile:
    """The entries' layout from the central directory at the end, then one pass from
    the start; the central directory's bytes are hashed from the copy that was parsed.

    On a machine of several CPUs the pass is two threads (:func:`_hash_while_reading`;
    one for a small file): a reader fills the records front to back while this thread
    hashes what it filled, in file order. ``readinto`` releases the GIL and xxhash
    does not, so the read of one chunk and the hash of the one before it overlap when
    a second CPU is free. Nothing leaves here before every chunk was hashed, and the
    records are the very buffers that were hashed: the caller compares the digest
    before anything is unpickled.
    """
    directory_at, directory, entries = _central_directory(f, size)
    tensors = _allocate(entries)
    digest = xxhash.xxh3_128()
    layout = _hash_while_reading(
        f,
        digest,
        lambda reader: _read_entries(reader, entries, tensors, directory_at),
        ahead=directory_at >= _READ_AHEAD_FROM and _usable_cpus() >= _READ_AHEAD_CPUS,
    )
    digest.update(directory)
    if layout.end + len(directory) != size:
        raise _Unusual("the file changed size while it was read")  # pragma: no cover
    return HeldFile(FileInfo(size, digest.hexdigest()), layout.records, None, layout.offsets)


@dataclass(frozen=True)
class _Layout:
    """What the reader thread read: the records, where they lie, where it stopped."""

    records: dict[str, Any]
    offsets: dict[str, tuple[int, int]]  # record: (local header offset, data offset)
    end: int


def _allocate(entries: list[_Entry]) -> dict[str, torch.Tensor]:
    """An empty tensor for each tensor record, allocated here, in the calling thread.

    Why not in the reader thread: glibc serves a thread from an arena of its own,
    and 100 MB of records allocated there and freed here left the allocator so that
    every later large allocation of the process (``torch.load``'s own included)
    faulted in fresh pages: 10 ms loads took 60. Entries must not overlap (checked
    before anything is allocated), so the records together never exceed the file.
    """
    for entry, after in itertools.pairwise(entries):
        if entry.header_offset + entry.size > after.header_offset:
            raise _Unusual("entries overlap")
    return {
        e.name: torch.empty(e.size, dtype=torch.uint8)
        for e in entries
        if e.name.startswith("data/")
    }


def _read_entries(
    reader: _Sequential, entries: list[_Entry], tensors: dict[str, torch.Tensor], directory_at: int
) -> _Layout:
    """Every entry's local header and bytes, in file order, up to the central directory
    (run by the reader thread: each byte it reads is handed on to be hashed); a tensor
    record is read into its tensor from ``tensors``."""
    records: dict[str, Any] = {}
    offsets: dict[str, tuple[int, int]] = {}
    for entry in entries:
        reader.skip_to(entry.header_offset)
        signature, name_len, extra_len = _LOCAL_HEADER.unpack(reader.take(_LOCAL_HEADER.size))
        if signature != b"PK\x03\x04":
            raise _Unusual("no local header where the central directory says")
        reader.take(name_len + extra_len)
        offsets[entry.name] = (entry.header_offset, reader.offset)
        if entry.name in tensors:
            tensor = tensors[entry.name]
            reader.read_into(memoryview(cast(Any, tensor.numpy())))
            records[entry.name] = tensor
        else:
            records[entry.name] = bytes(reader.take(entry.size))
    reader.skip_to(directory_at)
    return _Layout(records, offsets, reader.offset)


def _central_directory(f: BinaryIO, size: int) -> tuple[int, bytes, list[_Entry]]:
    """(where the central directory starts, its bytes to the end of the file, the
    stored entries in file order), or :class:`_Unusual`."""
    window = min(size, _TAIL_START)
    while True:
        f.seek(size - window)
        tail = _read_up_to(f, window)
        if len(tail) != window:
            raise _Unusual("short read of the tail")
        try:
            archive = zipfile.ZipFile(_Tail(tail, size - window, size))
        except _NeedMore:
            if window == size:
                raise _Unusual("the central directory lies outside the file") from None
            window = min(size, window * 4)
            continue
        except (zipfile.BadZipFile, ValueError, EOFError, struct.error) as exc:
            # damage can make the parser fail in any of these ways (a name flagged utf-8
            # that is not: UnicodeDecodeError): the whole read's hash judges the file
            raise _Unusual(str(exc)) from None
        break
    directory_at = getattr(archive, "start_dir", None)
    if not isinstance(directory_at, int) or not size - window <= directory_at <= size:
        raise _Unusual("no central directory offset")
    return directory_at, tail[directory_at - (size - window) :], _entries(archive, directory_at)


def _entries(archive: zipfile.ZipFile, directory_at: int) -> list[_Entry]:
    infos = sorted(archive.infolist(), key=lambda i: i.header_offset)
    prefixes = {i.filename.split("/", 1)[0] for i in infos}
    if len(prefixes) != 1 or any("/" not in i.filename for i in infos):
        raise _Unusual("not one archive directory")
    entries = [_Entry(i.filename.split("/", 1)[1], i.header_offset, i.file_size) for i in infos]
    names = {e.name for e in entries}
    if "data.pkl" not in names or "constants.pkl" in names:
        raise _Unusual("not a pickled state (a TorchScript archive?)")
    if any(i.compress_type != zipfile.ZIP_STORED or i.file_size != i.compress_size for i in infos):
        raise _Unusual("a compressed entry")
    if any(i.header_offset + i.file_size > directory_at for i in infos):
        # checked for every entry: a damaged size must not size a buffer past the file
        raise _Unusual("an entry overlaps the central directory")
    return entries


class _NeedMore(Exception):
    """The zip parser asked for bytes before the tail that was read."""


class _Tail(io.RawIOBase):
    """The last bytes of a file, seen at their offsets (what the zip parser reads)."""

    def __init__(self, data: bytes, start: int, size: int) -> None:
        self._data, self._start, self._size, self._pos = data, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        if self._pos < self._start:
            raise _NeedMore()
        chunk = self._data[self._pos - self._start : self._pos - self._start + len(buffer)]
        memoryview(buffer).cast("B")[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


T = TypeVar("T")

#: Archives smaller than this are read and hashed in the calling thread: below a few
#: chunks a thread's start and hand-offs cost more than the overlap saves.
_READ_AHEAD_FROM = 4 << 20


#: The reader thread pays only where a CPU is likely to be free for it. On a 2-CPU
#: machine shared with other work (docs/performance.md, "the hash beside the read")
#: it was 2-5 ms slower than reading inline for a 100 MB load: the hand-offs, and
#: the hash reading from the other core's cache, cost CPU that only an idle core
#: hides. 4 is a judgement, not a measurement: no larger machine was measured.
_READ_AHEAD_CPUS = 4


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, not the machine's count)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _hash_while_reading(
    f: BinaryIO, digest: Any, job: Callable[[_Sequential], T], *, ahead: bool
) -> T:
    """``job``'s result, once ``digest`` has hashed every byte ``job`` read, in file order.

    ``job`` runs in a reader thread; what it fills is handed through a FIFO to this
    thread (:class:`_Batches`), which hashes it while the reader fills the next. An
    error on either side ends both: the reader's is raised here as it was raised
    (never swallowed, its type kept: a short file is :class:`_Unusual`, an ``EIO``
    an ``OSError``); on this side's (an interrupt), the reader is told to stop and
    is joined before anything else happens, so no thread outlives the call and none
    reads the file after it was handed back. Without ``ahead`` (a small file, or too
    few CPUs) all of it runs in this thread.
    """
    if not ahead:
        return job(_Sequential(f, digest.update, threading.Event()))
    handed: queue.SimpleQueue[list[memoryview] | _Finished] = queue.SimpleQueue()
    stop = threading.Event()

    def read() -> None:
        batches = _Batches(handed.put)
        try:
            done = _Finished(job(_Sequential(f, batches.add, stop)), None)
            batches.flush()
        except BaseException as exc:  # handed over, and raised by the hashing thread
            done = _Finished(None, exc)
        handed.put(done)
        del done  # the error's traceback holds this frame: no cycle through it

    reader = threading.Thread(target=read, name="ckptdb-read-ahead", daemon=True)
    reader.start()
    try:
        while isinstance(item := handed.get(), list):
            for view in item:
                digest.update(view)
    finally:
        stop.set()
        reader.join()
    error, result = item.error, item.result
    del item  # no frame of the raise may hold the error: a cycle would keep the records
    if error is not None:
        try:
            raise error
        finally:
            del error
    return cast(T, result)


class _Batches:
    """Filled views handed on ``SIZE`` bytes at a time: one wake-up of the hashing
    thread per batch, not one per chunk or local header (two of those per record)."""

    SIZE = 8 << 20

    def __init__(self, put: Callable[[list[memoryview]], object]) -> None:
        self._put = put
        self._views: list[memoryview] = []
        self._bytes = 0

    def add(self, view: memoryview) -> None:
        self._views.append(view)
        self._bytes += len(view)
        if self._bytes >= self.SIZE:
            self.flush()

    def flush(self) -> None:
        if self._views:
            self._put(self._views)
            self._views, self._bytes = [], 0


@dataclass(frozen=True)
class _Finished:
    """The reader's last word: what its job returned, or what it raised."""

    result: Any
    error: BaseException | None


class _Stopped(Exception):
    """The hashing side gave up (it raised): the reader stops at its next chunk."""


class _Sequential:
    """Reads a file front to back, handing each chunk on (to be hashed) as it is filled."""

    CHUNK = 1 << 20

    def __init__(
        self, f: BinaryIO, hand: Callable[[memoryview], object], stop: threading.Event
    ) -> None:
        self._f = f
        self._hand = hand
        self._stop = stop
        self.offset = 0
        f.seek(0)

    def take(self, n: int) -> memoryview:
        view = memoryview(bytearray(n))
        self.read_into(view)
        return view

    def skip_to(self, offset: int) -> None:
        """Read (and hand on) the bytes up to ``offset`` (a data descriptor, padding)."""
        if offset < self.offset:
            raise _Unusual("entries overlap")
        self.take(offset - self.offset)

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` from the file; a buffer is never written again once handed on."""
        done = 0
        while done < len(view):
            if self._stop.is_set():
                raise _Stopped()
            part = view[done : done + self.CHUNK]
            n = cast(Any, self._f).readinto(part)
            if not n:
                raise _Shrunk(self.offset)
            self._hand(part[:n])
            done += n
            self.offset += n


class _Shrunk(_Unusual):
    """The file ended before the size it had when it was opened."""

    def __init__(self, offset: int) -> None:
        super().__init__(f"the file ended at {offset}")


class _Records:
    """The records of a held archive, as ``torch.serialization._load`` asks for them."""

    def __init__(self, records: dict[str, Any], offsets: dict[str, tuple[int, int]]) -> None:
        self._records, self._offsets = records, offsets

    def has_record(self, name: str) -> bool:
        return name in self._records

    def get_record(self, name: str) -> bytes:
        return bytes(self._records[name])

    def get_all_records(self) -> list[str]:
        return list(self._records)

    def get_storage_from_record(self, name: str, numel: int, _cls: object) -> torch.Tensor:
        tensor: torch.Tensor = self._records[name]
        if tensor.numel() != numel:
            raise RuntimeError(f"record {name} holds {tensor.numel()} bytes, not {numel}")
        return tensor

    # where a record lies in the file (a load onto the meta device asks)
    def get_record_offset(self, name: str) -> int:
        return self._offsets[name][1]

    def get_record_header_offset(self, name: str) -> int:
        return self._offsets[name][0]

    def get_record_offset_no_read(self, _at: int, name: str, _n: int, _align: int) -> int:
        return self._offsets[name][1]

    def serialization_id(self) -> str:
        return bytes(self._records.get(".data/serialization_id", b"")).decode()
