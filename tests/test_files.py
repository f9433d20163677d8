"""The file primitives of the local store (``ckptdb/storage/files.py``).

The gathering writer: a file written through it has exactly ``torch.save``'s
bytes and the hash of those bytes; what reaches the OS is what the kernel
saw (each real write's offset and data, read back with strace) and
``mid_write`` is visited after each real write; a failure of a real write, wherever it comes, is a
``write`` phase error. Confinement: a stream directory that is (or became)
a link is never followed out of the save directory, and a plain stream file
is confined without resolving whole paths.
"""

from __future__ import annotations

import errno
import io
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from powerloss.syscalls import SyscallTracer, calls

from ckptdb import faults
from ckptdb.errors import InvalidArgumentError, PhaseError
from ckptdb.storage import files
from ckptdb.storage.files import SMALL_WRITE, WRITE_BUFFER, HashingWriter
from ckptdb.storage.local import LocalStore

Recorded = list[tuple[str, dict[str, Any]]]  # see RealCalls


def torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


STATES: dict[str, Callable[[], Any]] = {
    "tiny": lambda: {"w": torch.ones(4)},
    # each tensor's bytes a large write of its own, between small headers
    "large_tensors": lambda: {f"l{i}": torch.arange(SMALL_WRITE // 4 * 2) + i for i in range(3)},
    # small writes enough to fill the buffer several times over
    "many_small": lambda: {f"t{i}": torch.full((1000,), float(i)) for i in range(800)},
}


class RealCalls(list[tuple[str, dict[str, Any]]]):
    """The file system calls this process makes under ``under`` while a test runs,
    as the kernel saw them (strace, :mod:`powerloss.syscalls`): ``create``
    (an open with ``O_CREAT``), ``write`` (each real write: ``offset``,
    ``data``), ``fsync``, ``unlink`` and ``rmdir``, each with its ``path``.
    Filled when the test first compares it (the tracer detaches then)."""

    def __init__(self, under: Path, log: Path) -> None:
        super().__init__()
        self.under, self.log = under, log
        self.tracer: SyscallTracer | None = SyscallTracer(log).__enter__()

    def stop(self) -> RealCalls:
        if self.tracer is not None:
            self.tracer.__exit__(None, None, None)
            self.tracer = None
            self.extend(self._read())
        return self

    def _read(self) -> Iterator[tuple[str, dict[str, Any]]]:
        offsets: dict[int, int] = {}
        for call in calls(self.log):
            if call.name in ("openat", "unlinkat"):
                path = Path(os.fsdecode(call.text(1)))
                path = path if path.is_absolute() else Path(call.fd(0).path or "") / path
            elif call.name in ("unlink", "rmdir"):
                path = Path(os.fsdecode(call.text(0)))
            elif call.name in ("write", "pwrite64", "fsync", "fdatasync"):
                path = Path(call.fd(0).path or "")
            else:
                continue
            if self.under not in path.parents:
                continue
            if call.name == "openat":
                offsets[call.result] = 0
                if "O_CREAT" in call.raw(2):
                    yield "create", {"path": path}
            elif call.name == "unlinkat":
                yield ("rmdir" if "AT_REMOVEDIR" in call.raw(2) else "unlink"), {"path": path}
            elif call.name in ("unlink", "rmdir"):
                yield call.name, {"path": path}
            elif call.name in ("fsync", "fdatasync"):
                yield "fsync", {"path": path}
            else:
                data = call.text(1)[: call.result]
                fd = call.fd(0).number or 0
                offset = int(call.raw(3)) if call.name == "pwrite64" else offsets.get(fd, 0)
                offsets[fd] = offset + len(data)
                yield "write", {"path": path, "offset": offset, "data": data}

    def __eq__(self, other: object) -> bool:
        return list.__eq__(self.stop(), other)

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        return list.__iter__(self.stop())


@pytest.fixture
def recorded(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCalls]:
    """The real calls of whatever runs in the test under ``tmp_path``."""
    real = RealCalls(tmp_path, tmp_path_factory.mktemp("strace") / "calls.log")
    try:
        yield real
    finally:
        real.stop()


@pytest.fixture
def visits() -> Iterator[list[str]]:
    seen: list[str] = []
    previous = faults.set_hook(seen.append)
    yield seen
    faults.set_hook(previous)


class RealFile:
    """The OS file under a ``HashingWriter``: logs each real write (offset, bytes);
    ``limit`` makes every write short, ``fail_at`` makes that real write fail."""

    def __init__(self, raw: Any, limit: int | None = None, fail_at: int | None = None) -> None:
        self.raw, self.limit, self.fail_at = raw, limit, fail_at
        self.writes: list[tuple[int, bytes]] = []
        self.offset = 0

    def write(self, data: Any) -> int:
        if self.fail_at == len(self.writes):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = memoryview(data)
        if self.limit is not None:
            view = view[: self.limit]
        n: int = self.raw.write(view)
        self.writes.append((self.offset, bytes(view[:n])))
        self.offset += n
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def under_real_file(**kwargs: Any) -> Callable[[Callable[[Any], object]], Callable[[Any], object]]:
    """Wrap a serializer so that its writer's OS file is a :class:`RealFile`."""
    made: list[RealFile] = []

    def wrap(serialize: Callable[[Any], object]) -> Callable[[Any], object]:
        def run(writer: HashingWriter) -> object:
            writer._file = RealFile(writer._file, **kwargs)
            made.append(writer._file)
            return serialize(writer)

        return run

    wrap.made = made  # type: ignore[attr-defined]
    return wrap


def writes_of(ops: Recorded, path: Path) -> list[tuple[int, bytes]]:
    return [(f["offset"], f["data"]) for op, f in ops if op == "write" and f["path"] == path]


@pytest.mark.parametrize("name", list(STATES))
def test_the_file_is_torch_saves_bytes_and_hashed_as_written(
    tmp_path: Path, name: str, recorded: Recorded
) -> None:
    state = STATES[name]()
    path = tmp_path / "out.pt"
    info = files.write_stream(lambda f: torch.save(state, f), path)
    expected = torch_bytes(state)
    assert path.read_bytes() == expected
    assert info == files.FileInfo(len(expected), xxhash.xxh3_128_hexdigest(expected))
    assert info == files.hash_file(path)
    assert [op for op, _ in recorded] == [
        "create",
        *["write"] * len(writes_of(recorded, path)),
        "fsync",
    ]


@pytest.mark.parametrize("name", list(STATES))
def test_the_kernel_sees_every_write_at_its_offset(
    tmp_path: Path, name: str, recorded: Recorded
) -> None:
    state = STATES[name]()
    path = tmp_path / "out.pt"
    wrap = under_real_file()
    files.write_stream(wrap(lambda f: torch.save(state, f)), path)
    (real,) = wrap.made  # type: ignore[attr-defined]
    traced = writes_of(recorded, path)
    assert traced == real.writes  # what reached the OS, offset for offset
    assert b"".join(data for _, data in traced) == path.read_bytes()
    assert all(0 < len(data) <= WRITE_BUFFER + SMALL_WRITE for _, data in traced)


def test_small_writes_are_gathered_and_large_ones_go_through(
    tmp_path: Path, recorded: Recorded
) -> None:
    path = tmp_path / "out.bin"
    big = bytes(range(256)) * (SMALL_WRITE // 256)  # exactly SMALL_WRITE: not small

    def serialize(f: Any) -> None:
        for _ in range(40):
            f.write(b"head")
        f.write(big)
        f.write(b"tail")

    info = files.write_stream(serialize, path)
    assert writes_of(recorded, path) == [(0, b"head" * 40), (160, big), (160 + len(big), b"tail")]
    assert info.size == path.stat().st_size == 160 + len(big) + 4


def test_the_buffer_goes_out_once_full(tmp_path: Path, recorded: Recorded) -> None:
    path = tmp_path / "out.bin"
    chunk = b"x" * (SMALL_WRITE - 1)
    count = WRITE_BUFFER // len(chunk) + 1  # the first write that reaches WRITE_BUFFER

    def serialize(f: Any) -> None:
        for _ in range(count + 1):
            f.write(chunk)
        assert f.pending == len(chunk)  # the last one waits for the flush

    files.write_stream(serialize, path)
    lengths = [len(data) for _, data in writes_of(recorded, path)]
    assert lengths == [count * len(chunk), len(chunk)]


def test_mid_write_comes_after_each_real_write_with_its_bytes_out(
    tmp_path: Path, recorded: Recorded
) -> None:
    path = tmp_path / "out.pt"
    state = STATES["large_tensors"]()
    sizes_at_visits: list[int] = []
    previous = faults.set_hook(lambda name: sizes_at_visits.append(path.stat().st_size))
    try:
        files.write_stream(lambda f: torch.save(state, f), path)
    finally:
        faults.set_hook(previous)
    ends = [offset + len(data) for offset, data in writes_of(recorded, path)]
    assert len(ends) > 1
    assert sizes_at_visits == ends


def test_a_short_write_is_continued(tmp_path: Path, recorded: Recorded) -> None:
    state = STATES["tiny"]()
    path = tmp_path / "out.pt"
    wrap = under_real_file(limit=100)
    info = files.write_stream(wrap(lambda f: torch.save(state, f)), path)
    expected = torch_bytes(state)
    assert path.read_bytes() == expected and info.size == len(expected)
    traced = writes_of(recorded, path)
    assert len(traced) == -(-len(expected) // 100)
    assert [offset for offset, _ in traced] == list(range(0, len(expected), 100))


@pytest.mark.parametrize("fail_at", [0, 1, 3])
def test_a_real_write_that_fails_is_a_write_error(tmp_path: Path, fail_at: int) -> None:
    """Inside torch's writer (its RuntimeError hides the OSError) or in the final flush."""
    state = STATES["large_tensors"]()
    path = tmp_path / "out.pt"
    wrap = under_real_file(fail_at=fail_at)
    with pytest.raises(PhaseError) as info:
        files.write_stream(wrap(lambda f: torch.save(state, f)), path)
    assert info.value.phase == "write" and info.value.path == path
    assert isinstance(info.value.error, OSError) and info.value.error.errno == errno.ENOSPC


def test_a_failure_when_the_gathered_bytes_go_out_at_the_end_is_a_write_error(
    tmp_path: Path, visits: list[str]
) -> None:
    """A serializer that never flushes: its bytes go out in ``write_stream``."""
    path = tmp_path / "out.bin"
    wrap = under_real_file(fail_at=0)
    with pytest.raises(PhaseError) as info:
        files.write_stream(wrap(lambda f: f.write(b"never flushed")), path)
    assert info.value.phase == "write"
    assert isinstance(info.value.error, OSError) and info.value.error.errno == errno.ENOSPC
    assert visits == []  # no real write succeeded: no mid_write


def test_unflushed_bytes_are_written_before_the_fsync(tmp_path: Path, recorded: Recorded) -> None:
    path = tmp_path / "out.bin"
    info = files.write_stream(lambda f: f.write(b"never flushed"), path)
    assert path.read_bytes() == b"never flushed" and info.size == 13
    assert [op for op, _ in recorded] == ["create", "write", "fsync"]


@pytest.mark.parametrize("raised", [OSError(errno.EIO, "injected"), KeyboardInterrupt()])
def test_a_fault_at_mid_write_stays_what_it_was(tmp_path: Path, raised: BaseException) -> None:
    """An OSError at ``mid_write`` is a write error; an interrupt stays an interrupt."""

    def hook(name: str) -> None:
        if name == "mid_write":
            raise raised

    previous = faults.set_hook(hook)
    try:
        with pytest.raises(type(raised)) as info:
            files.write_stream(lambda f: torch.save(STATES["tiny"](), f), tmp_path / "out.pt")
    finally:
        faults.set_hook(previous)
    if isinstance(raised, OSError):
        assert isinstance(info.value, PhaseError) and info.value.phase == "write"
        assert info.value.error is raised
    else:
        assert info.value is raised


# ------------------------------------------------------------------ confinement


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    save_dir = tmp_path / "save"
    (save_dir / "model").mkdir(parents=True)
    return LocalStore(save_dir)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    (tmp_path / "outside").mkdir()
    return tmp_path / "outside"


def test_a_stream_file_is_confined_without_resolving_paths(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    resolved: list[Any] = []
    real = os.path.realpath

    def realpath(path: Any, *args: Any, **kwargs: Any) -> str:
        resolved.append(path)
        return str(real(path, *args, **kwargs))

    monkeypatch.setattr(os.path, "realpath", realpath)
    (store.save_dir / "model" / "step-000000001.pt").write_bytes(b"x")
    assert store.path("model/step-000000001.pt") == store.save_dir / "model/step-000000001.pt"
    assert store.remove("model/step-000000001.pt")
    assert resolved == []


def test_a_pass_memoizes_for_its_own_thread_only(store: LocalStore, outside: Path) -> None:
    """A check's pass confines each stream directory once; a save in another thread
    meanwhile confines afresh and refuses the directory swapped for a link."""
    model = store.save_dir / "model"
    (model / "step-000000001.pt").write_bytes(b"ours")
    seen: list[object] = []
    with store.memoized():
        assert store.path("model/step-000000001.pt") == model / "step-000000001.pt"
        model.rename(store.save_dir / "gone")
        model.symlink_to(outside, target_is_directory=True)

        def other_thread() -> None:
            try:
                seen.append(store.path("model/step-000000002.pt"))
            except InvalidArgumentError as refused:
                seen.append(refused)

        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join(10)
        # the pass's own thread goes on with what it confined (as reconcile always has)
        assert store.path("model/step-000000003.pt") == model / "step-000000003.pt"
    assert len(seen) == 1 and isinstance(seen[0], InvalidArgumentError), seen
    assert "outside" in str(seen[0])
    with pytest.raises(InvalidArgumentError, match="outside"):  # the pass is over
        store.path("model/step-000000003.pt")


def test_a_stream_directory_swapped_for_a_link_is_never_followed(
    store: LocalStore, outside: Path
) -> None:
    """Between two removals: nothing about the first is remembered by the second."""
    model = store.save_dir / "model"
    (model / "step-000000001.pt").write_bytes(b"ours")
    (outside / "step-000000002.pt").write_bytes(b"not ours")
    assert store.remove("model/step-000000001.pt")
    assert store.path("model/step-000000002.pt") == model / "step-000000002.pt"
    model.rmdir()
    model.symlink_to(outside, target_is_directory=True)
    with pytest.raises(InvalidArgumentError, match="outside"):
        store.remove("model/step-000000002.pt")
    assert (outside / "step-000000002.pt").read_bytes() == b"not ours"


def test_a_link_that_stays_inside_is_still_allowed(store: LocalStore) -> None:
    """Not plain: the full check decides, as before (it resolves inside the save dir)."""
    (store.save_dir / "model" / "step-000000003.pt").write_bytes(b"x")
    (store.save_dir / "alias").symlink_to(store.save_dir / "model", target_is_directory=True)
    resolved = store.path("alias/step-000000003.pt")
    assert resolved == (store.save_dir / "model").resolve() / "step-000000003.pt"
    assert store.remove("alias/step-000000003.pt")
    assert not (store.save_dir / "model" / "step-000000003.pt").exists()


@pytest.mark.parametrize(
    "rel", ["../outside/x.pt", "model/../../outside/x.pt", "./../outside/x.pt", "model/..", ""]
)
def test_names_that_escape_or_name_no_file_are_refused(
    store: LocalStore, outside: Path, rel: str
) -> None:
    (outside / "x.pt").write_bytes(b"not ours")
    with pytest.raises(InvalidArgumentError):
        store.remove(rel)
    assert (outside / "x.pt").exists()


def test_an_absolute_name_is_refused(store: LocalStore, outside: Path) -> None:
    (outside / "x.pt").write_bytes(b"not ours")
    with pytest.raises(InvalidArgumentError, match="outside"):
        store.remove(str(outside / "x.pt"))
    assert (outside / "x.pt").exists()


def test_remove_acts_on_links_never_on_their_targets(store: LocalStore, outside: Path) -> None:
    model = store.save_dir / "model"
    (outside / "target.pt").write_bytes(b"kept")
    (outside / "dir").mkdir()
    (outside / "dir" / "kept").write_bytes(b"kept")
    (model / "file-link.pt").symlink_to(outside / "target.pt")
    (model / "dir-link.dcp").symlink_to(outside / "dir", target_is_directory=True)
    (model / "dangling.pt").symlink_to(outside / "nowhere")
    for name in ("file-link.pt", "dir-link.dcp", "dangling.pt"):
        assert store.remove(f"model/{name}")
        assert not os.path.lexists(model / name)
    assert (outside / "target.pt").read_bytes() == b"kept"
    assert (outside / "dir" / "kept").read_bytes() == b"kept"


def test_remove_takes_a_real_directory_with_its_contents(
    store: LocalStore, outside: Path, recorded: Recorded
) -> None:
    sharded = store.save_dir / "model" / "step-000000004.dcp"
    sharded.mkdir()
    (sharded / ".metadata").write_bytes(b"m")
    (outside / "kept").write_bytes(b"kept")
    (sharded / "link").symlink_to(outside / "kept")
    assert store.remove("model/step-000000004.dcp")
    assert not sharded.exists() and (outside / "kept").read_bytes() == b"kept"
    removed = [(op, f["path"]) for op, f in recorded if op in ("unlink", "rmdir")]
    inside = [("unlink", sharded / ".metadata"), ("unlink", sharded / "link")]
    assert sorted(removed[:2]) == inside and removed[2:] == [("rmdir", sharded)]


def test_remove_of_what_is_absent_is_false(store: LocalStore, recorded: Recorded) -> None:
    assert store.remove("model/step-000000005.pt") is False
    assert store.remove("missing-stream/step-000000005.pt") is False
    assert recorded == []


@pytest.mark.parametrize("kind", ["file", "link to a directory"])
def test_an_unlink_refused_for_another_reason_raises(
    store: LocalStore, outside: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """EPERM (macOS's answer for a directory) on what is not a real directory is
    raised: nothing is removed in its place, least of all through a link."""
    path = store.save_dir / "model" / "step-000000006.pt"
    (outside / "dir").mkdir()
    (outside / "dir" / "kept").write_bytes(b"kept")
    if kind == "file":
        path.write_bytes(b"x")
    else:
        path.symlink_to(outside / "dir", target_is_directory=True)

    def unlink(target: Any, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EPERM, "immutable", str(target))

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(PermissionError):
        store.remove("model/step-000000006.pt")
    assert os.path.lexists(path) and (outside / "dir" / "kept").read_bytes() == b"kept"


def test_a_relative_save_dir_gives_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plain path is only taken from an absolute base: a later chdir must not move it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "save" / "model").mkdir(parents=True)
    store = LocalStore(Path("save"))
    expected = tmp_path.resolve() / "save/model/step-000000001.pt"
    assert store.path("model/step-000000001.pt") == expected


@pytest.mark.parametrize(
    "size", [0, 1, files.MMAP_FROM - 1, files.MMAP_FROM, files.MMAP_FROM + 1, 3 * files.MMAP_FROM]
)
def test_a_file_hashes_to_its_bytes_whether_read_or_mapped(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "step.pt"
    path.write_bytes(data)
    expected = files.FileInfo(size, xxhash.xxh3_128_hexdigest(data))
    assert files.hash_file(path) == expected
    assert files.hash_checkpoint(str(path)) == expected  # a pass over many rows gives text
    with open(path, "rb", buffering=0) as f:  # from an offset: the rest, streamed
        f.seek(size // 2)
        rest = data[size // 2 :]
        assert files.hash_open_file(f) == files.FileInfo(len(rest), xxhash.xxh3_128_hexdigest(rest))


def test_a_link_is_hashed_as_what_it_leads_to_and_never_as_a_sharded_directory(
    tmp_path: Path,
) -> None:
    target = tmp_path / "elsewhere.pt"
    target.write_bytes(b"weights")
    (tmp_path / "file-link.pt").symlink_to(target)
    assert files.hash_checkpoint(tmp_path / "file-link.pt") == files.hash_file(target)
    sharded = tmp_path / "step.dcp"
    sharded.mkdir()
    (sharded / "0.distcp").write_bytes(b"shard")
    (tmp_path / "dir-link.dcp").symlink_to(sharded)
    assert files.hash_checkpoint(str(sharded)).size == len(b"shard")
    with pytest.raises(IsADirectoryError):  # a link to a directory is not a checkpoint
        files.hash_checkpoint(tmp_path / "dir-link.dcp")
    with pytest.raises(FileNotFoundError):
        files.hash_checkpoint(str(tmp_path / "gone.pt"))
