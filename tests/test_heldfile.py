"""Loading in one pass: the bytes hashed are the bytes loaded, and only they.

``LocalStore.verify(..., keep=True)`` reads a ``torch.save`` file once, hashing
it as it is read, and holds what it read; the load unpickles those held bytes
and never opens the file again. So a file that changes after it was verified
cannot reach the caller, and a file that changes while it is read fails the
hash and is never unpickled.
"""

from __future__ import annotations

import errno
import io
import pickle
import threading
import types
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import patch_unpickle, rows, state, value_of

import ckptdb.storage.heldfile as heldfile
from ckptdb import CheckpointManager
from ckptdb.errors import CorruptCheckpointError, InvalidArgumentError
from ckptdb.storage import LocalStore, hash_file
from ckptdb.storage.kinds import TORCH_FILE


@pytest.fixture(autouse=True, params=["inline", "ahead"])
def read_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test reads both ways: in the calling thread (what a small file gets), and
    with the reader thread (forced here, chunks and batches of 4 KiB: many hand-offs)."""
    if request.param == "ahead":
        monkeypatch.setattr(heldfile, "_READ_AHEAD_FROM", 0)
        monkeypatch.setattr(heldfile._Sequential, "CHUNK", 4096)
        monkeypatch.setattr(heldfile._Batches, "SIZE", 4096)
        monkeypatch.setattr(heldfile, "_usable_cpus", lambda: heldfile._READ_AHEAD_CPUS)
    return str(request.param)


AHEAD = pytest.mark.parametrize("read_mode", ["ahead"], indirect=True)


class Opaque:
    """A plain object: only ``weights_only=False`` unpickles it."""

    def __init__(self, value: int) -> None:
        self.value = value


def mixed_state() -> dict[str, Any]:
    """Dtypes, shapes, views sharing one storage, an empty and a 0-d tensor, nesting."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "w": base,
        "view": base[1:, ::2],  # shares base's storage: saved once, loaded as a view
        "t": base.t(),
        "half": torch.linspace(-1, 1, 7, dtype=torch.bfloat16),
        "ints": torch.arange(5, dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "nested": {"list": [torch.ones(2), 7, "text"], "tuple": (torch.zeros(1), None)},
    }


def saved(tmp_path: Path, obj: Any, name: str = "a.pt", **kwargs: Any) -> Path:
    path = tmp_path / name
    torch.save(obj, path, **kwargs)
    return path


def assert_same(loaded: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(loaded, torch.Tensor)
        assert loaded.dtype == expected.dtype and loaded.shape == expected.shape
        assert loaded.stride() == expected.stride()
        assert torch.equal(loaded, expected)
    elif isinstance(expected, dict):
        assert isinstance(loaded, dict) and loaded.keys() == expected.keys()
        for key in expected:
            assert_same(loaded[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert type(loaded) is type(expected) and len(loaded) == len(expected)
        for a, b in zip(loaded, expected, strict=True):
            assert_same(a, b)
    else:
        assert loaded == expected


@pytest.mark.parametrize(
    "obj",
    [
        mixed_state(),
        {f"p{i}": torch.full((3,), float(i)) for i in range(3000)},  # directory > 64 KiB
        {},
    ],
    ids=["mixed", "many-records", "empty-dict"],
)
def test_held_records_load_as_torch_loads_the_file(tmp_path: Path, obj: Any) -> None:
    path = saved(tmp_path, obj)
    held = heldfile.read_held(path)
    assert held.info == hash_file(path)  # one pass, the same size and hash as the file's
    assert held.by_records
    expected = torch.load(path, weights_only=True)
    loaded = held.load(None, weights_only=True)
    assert_same(loaded, expected)
    if "view" in expected:  # storage sharing survives: the view aliases its base
        assert loaded["view"].untyped_storage().data_ptr() == (
            loaded["w"].untyped_storage().data_ptr()
        )


def test_a_legacy_file_is_held_whole_and_loads(tmp_path: Path) -> None:
    path = saved(tmp_path, mixed_state(), _use_new_zipfile_serialization=False)
    held = heldfile.read_held(path)
    assert held.info == hash_file(path) and not held.by_records
    assert_same(held.load(None, weights_only=True), torch.load(path, weights_only=True))


def test_weights_only_and_map_location_are_honoured(tmp_path: Path) -> None:
    path = saved(tmp_path, {"obj": Opaque(5), "w": torch.ones(3)})
    with pytest.raises(pickle.UnpicklingError, match=r"Weights only load failed.*Opaque"):
        heldfile.read_held(path).load(None, weights_only=True)
    loaded = heldfile.read_held(path).load(None, weights_only=False)
    assert isinstance(loaded["obj"], Opaque) and loaded["obj"].value == 5
    meta = heldfile.read_held(path).load("meta", weights_only=False)
    assert meta["w"].device.type == "meta" and meta["w"].shape == (3,)
    seen: list[str] = []

    def locate(storage: Any, location: str) -> Any:
        seen.append(location)
        return storage

    assert torch.equal(
        heldfile.read_held(path).load(locate, weights_only=False)["w"], torch.ones(3)
    )
    assert seen == ["cpu"]


def test_bytes_changed_after_the_read_are_not_loaded(tmp_path: Path) -> None:
    """The load reads the held bytes, never the file: a later change cannot slip in."""
    store = LocalStore(tmp_path)
    (tmp_path / "model").mkdir()
    original = saved(tmp_path / "model", state(1.0))
    info = hash_file(original)
    assert store.verify("model/a.pt", info.size, info.hash, full=True, keep=True) is None
    torch.save(state(2.0), original)  # same name, same size, other values
    assert original.stat().st_size == info.size
    loaded = TORCH_FILE.load(
        store, "model/a.pt", map_location=None, weights_only=True, into=None, group=None
    )
    assert value_of(loaded) == 1.0


def test_held_bytes_are_handed_out_once_and_only_when_they_matched(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    (tmp_path / "model").mkdir()
    path = saved(tmp_path / "model", state(1.0))
    info = hash_file(path)
    with pytest.raises(InvalidArgumentError, match="not verified just before"):
        store.open_verified("model/a.pt")
    assert store.verify("model/a.pt", info.size, "0" * 32, full=True, keep=True) is not None
    with pytest.raises(InvalidArgumentError):  # a mismatch holds nothing
        store.open_verified("model/a.pt")
    assert store.verify("model/a.pt", info.size, info.hash, full=True, keep=False) is None
    with pytest.raises(InvalidArgumentError):  # nothing held without keep
        store.open_verified("model/a.pt")
    assert store.verify("model/a.pt", info.size, info.hash, full=True, keep=True) is None
    assert isinstance(store.open_verified("model/a.pt"), heldfile.HeldFile)
    with pytest.raises(InvalidArgumentError):  # handed out once
        store.open_verified("model/a.pt")


def _change_mid_read(monkeypatch: pytest.MonkeyPatch, change: Any) -> list[Path]:
    """Run ``change(path)`` after the archive's directory was read, before its body."""
    changed: list[Path] = []
    real = heldfile._central_directory

    def directory_then_change(f: Any, size: int) -> Any:
        found = real(f, size)
        path = Path(f.name)
        change(path)
        changed.append(path)
        return found

    monkeypatch.setattr(heldfile, "_central_directory", directory_then_change)
    return changed


def _overwrite_body(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with open(path, "r+b") as f:  # in place: the reader's open file sees it
        f.write(data)


def _cut_short(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("change", [_overwrite_body, _cut_short], ids=["rewritten", "truncated"])
def test_a_file_changed_while_it_is_read_is_corrupt_and_never_unpickled(
    open_manager: Any, monkeypatch: pytest.MonkeyPatch, change: Any
) -> None:
    mgr: CheckpointManager = open_manager()
    mgr.save(1, model=state(1.0))
    target = mgr.save(2, model=state(2.0))["model"]
    with monkeypatch.context() as patch:
        changed = _change_mid_read(patch, change)
        patch_unpickle(patch, lambda real: lambda *a, **k: pytest.fail("unpickled changed bytes"))
        with pytest.raises(CorruptCheckpointError):
            mgr.load()
    assert changed == [target.path.resolve()]
    assert rows(mgr.root, "SELECT state FROM checkpoints WHERE id = ?", target.id) == [("corrupt",)]
    assert value_of(mgr.load()) == 1.0  # latest fell back


def test_a_file_changed_after_verification_still_loads_the_verified_bytes(
    open_manager: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr: CheckpointManager = open_manager()
    target = mgr.save(1, model=state(1.0))["model"]
    real = heldfile.read_held

    def read_then_replace(path: Path) -> heldfile.HeldFile:
        held = real(path)
        torch.save(state(9.0), path)  # same size, other values, after the hash
        return held

    monkeypatch.setattr(heldfile, "read_held", read_then_replace)
    assert value_of(mgr.load()) == 1.0
    monkeypatch.undo()
    with pytest.raises(CorruptCheckpointError):  # the next load finds the change
        mgr.load()
    assert rows(mgr.root, "SELECT state FROM checkpoints WHERE id = ?", target.id) == [("corrupt",)]


def test_an_unusual_archive_falls_back_to_one_whole_read(tmp_path: Path) -> None:
    """A zip that torch.save did not lay out (compressed) is held whole and still loads
    through torch.load, hashed exactly once over the bytes it reads."""
    import zipfile

    plain = saved(tmp_path, {"w": torch.arange(6.0)}, "plain.pt")
    squeezed = tmp_path / "squeezed.pt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(squeezed, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_STORED)
        dst.writestr("plain/extra.txt", b"x" * 100, compress_type=zipfile.ZIP_DEFLATED)
    held = heldfile.read_held(squeezed)
    assert held.info == hash_file(squeezed) and not held.by_records
    assert isinstance(held.stream(), io.BytesIO)
    assert torch.equal(held.load(None, weights_only=True)["w"], torch.arange(6.0))


def test_weights_only_records_decode_byte_strings_as_torch_load_does(tmp_path: Path) -> None:
    """A pickle's 8-bit string (``SHORT_BINSTRING``, as Python 2 pickles wrote them) is
    decoded as utf-8 by torch.load's weights-only unpickler: so must the held load,
    or a file torch.load reads fails (UnicodeDecodeError, not even a pickle error)."""
    import zipfile

    plain = saved(tmp_path, {"w": torch.arange(6.0)}, "plain.pt")
    crafted = tmp_path / "crafted.pt"
    text = "é".encode()
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(crafted, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl"):
                data = b"\x80\x02U" + bytes([len(text)]) + text + b"."
            dst.writestr(info.filename, data, compress_type=zipfile.ZIP_STORED)
    held = heldfile.read_held(crafted)
    assert held.by_records and held.info == hash_file(crafted)
    assert held.load(None, weights_only=True) == torch.load(crafted, weights_only=True)


def test_a_damaged_central_directory_is_corruption_whatever_the_zip_parser_raises(
    tmp_path: Path,
) -> None:
    """Damage that makes the zip parser fail with something other than BadZipFile (a
    name flagged utf-8 that is not: UnicodeDecodeError) is still found by the hash:
    the file is read whole, and the verify reports it corrupt instead of raising."""
    import struct
    import zipfile

    from ckptdb.storage.base import CORRUPT

    store = LocalStore(tmp_path)
    (tmp_path / "model").mkdir()
    path = saved(tmp_path / "model", state(1.0))
    info = hash_file(path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        at = archive.start_dir  # the first central directory entry
    flags = struct.unpack_from("<H", data, at + 8)[0]
    struct.pack_into("<H", data, at + 8, flags | 0x800)  # "the name is utf-8"
    data[at + 46] = 0xFF  # never valid utf-8
    path.write_bytes(bytes(data))
    finding = store.verify("model/a.pt", info.size, info.hash, full=True, keep=True)
    assert finding is not None and finding.state == CORRUPT
    assert finding.actual == hash_file(path)  # hashed whole, once, as it is now


@pytest.mark.parametrize("past", ["the-file", "the-next-record"])
def test_a_damaged_record_size_never_sizes_a_buffer_past_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, past: str
) -> None:
    """A record (not the last one) whose sizes in the central directory were damaged
    alike must not make the read allocate that much: it is read whole, and corrupt.
    Sized past the next record only (still before the directory), the records would
    together exceed the file: none is allocated before the overlap is found."""
    import struct
    import zipfile

    from ckptdb.storage.base import CORRUPT

    store = LocalStore(tmp_path)
    (tmp_path / "model").mkdir()
    path = saved(tmp_path / "model", {"a": torch.ones(1000), "b": torch.ones(1000)})
    info = hash_file(path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        at = start_dir = archive.start_dir
        records = [i for i in archive.infolist() if "/data/" in i.filename]
        first = min(records, key=lambda i: i.header_offset)
        assert first.header_offset < max(i.header_offset for i in archive.infolist())
    while True:  # walk the central directory to the first entry's record
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, at + 28)
        if bytes(data[at + 46 : at + 46 + name_len]).decode() == first.filename:
            break
        at += 46 + name_len + extra_len + comment_len
    damaged = 1 << 30 if past == "the-file" else start_dir - first.header_offset - 64
    struct.pack_into("<II", data, at + 20, damaged, damaged)  # compressed, uncompressed
    path.write_bytes(bytes(data))
    sizes: list[int] = []
    real_empty = torch.empty

    def spy(*args: Any, **kwargs: Any) -> Any:
        sizes.append(int(args[0]) if args and isinstance(args[0], int) else 0)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", spy)
    finding = store.verify("model/a.pt", info.size, info.hash, full=True, keep=True)
    monkeypatch.undo()
    assert finding is not None and finding.state == CORRUPT
    assert sum(sizes) <= info.size, sizes


class ShortReads(io.FileIO):
    """A file whose every read returns at most a few KiB, as one read(2) returns at most
    ~2 GiB on Linux: a reader must loop until it has what it asked for."""

    CAP = 4096

    def read(self, size: int | None = -1) -> bytes:
        return super().read(self.CAP if size is None or size < 0 else min(size, self.CAP))

    def readinto(self, buffer: Any) -> int:
        return super().readinto(memoryview(buffer).cast("B")[: self.CAP])


@pytest.mark.parametrize("zipped", [True, False], ids=["records", "whole"])
def test_short_reads_still_read_the_whole_file(tmp_path: Path, zipped: bool) -> None:
    """A large file (past 2 GiB one read returns less) is read whole either way: held
    records or one whole read; a short read must never look like a shorter file
    (that would mark a healthy checkpoint corrupt)."""
    obj = {"big": torch.arange(100_000.0), **mixed_state()}
    path = saved(tmp_path, obj, _use_new_zipfile_serialization=zipped)
    assert path.stat().st_size > 20 * ShortReads.CAP
    with ShortReads(path, "rb") as f:
        held = heldfile.read_hashed(f)
    assert held.info == hash_file(path)
    assert held.by_records == zipped
    assert_same(held.load(None, weights_only=True), torch.load(path, weights_only=True))


# ------------------------------------------------------------- the reader thread


class Hooked(io.FileIO):
    """A file whose every ``readinto`` first calls ``before(position, length)`` (which
    may change the file, or raise as a failing disk would), noting the thread it ran on."""

    def __init__(self, path: Path, before: Callable[[int, int], None]) -> None:
        super().__init__(path, "rb")
        self.before = before
        self.threads: list[str] = []

    def readinto(self, buffer: Any) -> int:
        self.threads.append(threading.current_thread().name)
        self.before(self.tell(), len(buffer))
        return super().readinto(buffer)


def read_through(patch: pytest.MonkeyPatch, before: Callable[[int, int], None]) -> list[Hooked]:
    """Make every verify read its file through :class:`Hooked`; the files it opened."""
    opened: list[Hooked] = []

    def read_held(path: Path) -> heldfile.HeldFile:
        with Hooked(path, before) as f:
            opened.append(f)
            return heldfile.read_hashed(f)

    patch.setattr(heldfile, "read_held", read_held)
    return opened


def body_end(path: Path) -> int:
    """Where the records end (the central directory starts)."""
    with zipfile.ZipFile(path) as archive:
        return int(archive.start_dir)


def flip_in_place(path: Path, at: int) -> None:
    """Flip one byte of the open file's very inode (as a concurrent writer would)."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0xFF]))


@AHEAD
@pytest.mark.parametrize("when", ["between-chunks", "last-chunk"])
def test_a_file_changed_between_two_chunks_is_corrupt_and_never_unpickled(
    open_manager: Any, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """The reader is chunks ahead of the hash: a byte changed after the first chunks
    were read (``between-chunks``), or just before the very last one is
    (``last-chunk``: the hash of what the reader read last must still be compared
    before anything is unpickled), makes the load refuse the file."""
    mgr: CheckpointManager = open_manager()
    mgr.save(1, model=state(1.0))
    target = mgr.save(2, model=state(2.0, n=20_000))["model"]
    end = body_end(target.path)
    changed: list[int] = []

    def before(at: int, n: int) -> None:
        due = at > end // 2 if when == "between-chunks" else at + n >= end
        if due and not changed:
            flip_in_place(target.path, end - 1 if when == "last-chunk" else (at + end) // 2)
            changed.append(at)

    with monkeypatch.context() as patch:
        opened = read_through(patch, before)
        patch_unpickle(patch, lambda real: lambda *a, **k: pytest.fail("unpickled changed bytes"))
        with pytest.raises(CorruptCheckpointError):
            mgr.load()
    assert changed and len(opened[0].threads) > 10  # read in many chunks, changed midway
    assert set(opened[0].threads) == {"ckptdb-read-ahead"}
    assert rows(mgr.root, "SELECT state FROM checkpoints WHERE id = ?", target.id) == [("corrupt",)]
    assert value_of(mgr.load()) == 1.0  # latest fell back


def test_the_readers_error_is_raised_as_it_was_and_no_thread_is_left(
    tmp_path: Path, read_mode: str
) -> None:
    """An error of the read (EIO on the third chunk) reaches the caller itself, never
    swallowed nor retyped (the store sorts an ``OSError`` as unreadable), and the
    reader thread is gone when it does."""
    path = saved(tmp_path, {"big": torch.arange(50_000.0)})
    failure = OSError(errno.EIO, "injected: the disk failed")
    calls: list[int] = []

    def before(_at: int, _n: int) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise failure

    threads = threading.active_count()
    with Hooked(path, before) as f, pytest.raises(OSError) as raised:
        heldfile.read_hashed(f)
    assert raised.value is failure
    assert threading.active_count() == threads
    expected = {"ckptdb-read-ahead"} if read_mode == "ahead" else {threading.current_thread().name}
    assert set(f.threads) == expected


@AHEAD
def test_a_load_whose_read_fails_raises_that_error_and_marks_nothing(
    open_manager: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unreadable is not gone: the loader raises the reader thread's own error, and the
    row stays committed (a later load, the disk healthy again, succeeds)."""
    mgr: CheckpointManager = open_manager()
    target = mgr.save(1, model=state(1.0, n=20_000))["model"]
    failure = OSError(errno.EIO, "injected: the disk failed")

    def before(at: int, _n: int) -> None:
        if at > 8192:
            raise failure

    threads = threading.active_count()
    with monkeypatch.context() as patch:
        read_through(patch, before)
        with pytest.raises(OSError) as raised:
            mgr.load()
    assert raised.value is failure
    assert threading.active_count() == threads
    assert rows(mgr.root, "SELECT state FROM checkpoints WHERE id = ?", target.id) == [
        ("committed",)
    ]
    assert value_of(mgr.load()) == 1.0


class Interrupted(Exception):
    """What the hashing side raised (as an interrupt would)."""


@AHEAD
def test_an_error_while_hashing_stops_the_reader_before_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hashing thread's own error is raised as is (not the reader's "stopped"), and
    the reader is stopped and joined first: it reads nothing more, and no thread is
    left to touch the file after the call returned."""
    path = saved(tmp_path, {"big": torch.arange(100_000.0)})
    chunks = path.stat().st_size // heldfile._Sequential.CHUNK

    class Digest:
        updates = 0

        def update(self, _data: Any) -> None:
            Digest.updates += 1
            if Digest.updates == 3:
                raise Interrupted()

    monkeypatch.setattr(heldfile, "xxhash", types.SimpleNamespace(xxh3_128=Digest))
    stops: list[threading.Event] = []
    real_init = heldfile._Sequential.__init__

    def init(self: Any, f: Any, hand: Any, stop: threading.Event) -> None:
        stops.append(stop)
        real_init(self, f, hand, stop)

    monkeypatch.setattr(heldfile._Sequential, "__init__", init)

    waited: list[bool] = []

    def before(at: int, _n: int) -> None:
        if at >= 8 * 4096 and not waited:  # past a few batches: wait (5 s at most) for a stop
            waited.append(stops[0].wait(5))

    threads = threading.active_count()
    with Hooked(path, before) as f, pytest.raises(Interrupted):
        heldfile.read_hashed(f)
    assert threading.active_count() == threads
    read = len(f.threads)
    assert read < chunks // 2, (read, chunks)  # stopped, not read to the end
    assert not any(t.name == "ckptdb-read-ahead" for t in threading.enumerate())


@AHEAD
def test_records_are_allocated_by_the_caller_and_read_by_the_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader thread only reads: the records' memory is allocated by the calling
    thread (memory a thread's own allocator arena served and another thread freed left
    every later large allocation faulting fresh pages: torch.load itself ran 6x slower)."""
    path = saved(tmp_path, {"a": torch.arange(30_000.0), "b": torch.ones(20_000)})
    allocated_on: list[str] = []
    real_empty = torch.empty

    def spy(*args: Any, **kwargs: Any) -> Any:
        allocated_on.append(threading.current_thread().name)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", spy)
    with Hooked(path, lambda _at, _n: None) as f:
        held = heldfile.read_hashed(f)
    monkeypatch.undo()
    assert held.info == hash_file(path) and held.by_records
    assert allocated_on and set(allocated_on) == {threading.current_thread().name}
    assert set(f.threads) == {"ckptdb-read-ahead"}
    assert_same(held.load(None, weights_only=True), torch.load(path, weights_only=True))


@AHEAD
def test_too_few_usable_cpus_read_in_the_calling_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With fewer CPUs than the read-ahead wants (on a small machine the reader thread
    rarely finds a free core and costs more than it saves), the file is read inline,
    and is held and hashed exactly as with the reader thread."""
    path = saved(tmp_path, {"big": torch.arange(50_000.0)})
    monkeypatch.setattr(heldfile, "_usable_cpus", lambda: heldfile._READ_AHEAD_CPUS - 1)
    with Hooked(path, lambda _at, _n: None) as f:
        held = heldfile.read_hashed(f)
    assert set(f.threads) == {threading.current_thread().name}
    assert held.info == hash_file(path) and held.by_records


def test_a_fallback_read_holds_no_record_of_the_failed_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records are allocated (the file's size) before the pass; when the pass finds
    the archive unusual, the whole-file read that follows must not still hold them
    (the error's traceback, or a cycle through it, kept 2x the file alive)."""
    import weakref

    path = saved(tmp_path, {"w": torch.arange(50_000.0)}, "damaged.pt")
    data = bytearray(path.read_bytes())
    data[0:4] = b"XXXX"  # the first local header is gone: unusual, read whole
    path.write_bytes(bytes(data))
    allocated: list[weakref.ref[torch.Tensor]] = []
    real_allocate, real_read = heldfile._allocate, heldfile._read_up_to

    def allocate(entries: Any) -> dict[str, torch.Tensor]:
        tensors = real_allocate(entries)
        allocated.extend(weakref.ref(t) for t in tensors.values())
        return tensors

    alive_at_fallback: list[int] = []

    def read_up_to(f: Any, size: int) -> bytes:
        if allocated:  # the fallback's read (the tail's came before any allocation)
            alive_at_fallback.append(sum(r() is not None for r in allocated))
        return real_read(f, size)

    monkeypatch.setattr(heldfile, "_allocate", allocate)
    monkeypatch.setattr(heldfile, "_read_up_to", read_up_to)
    held = heldfile.read_held(path)
    assert not held.by_records and held.info == hash_file(path)
    assert allocated and alive_at_fallback == [0]
