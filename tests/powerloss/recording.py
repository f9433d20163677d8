"""Recording a scenario's file system calls as a trace that can be replayed.

The :class:`Recorder` attaches ``strace`` to the process while its block runs
(:mod:`.syscalls`) and then replays the calls the kernel saw into a logical
model of the tree under a *world* directory: inodes, directory entries, file
contents, symbolic links. Each call that changes the world becomes an
:class:`Op` that says what it changed (entries set or removed in directory
inodes, bytes written at an offset of a file inode, a file cut to a length)
or what it made durable (an ``fsync``/``fdatasync`` of a file's data, of a
directory's entries). Directories are inodes, not paths, so a renamed
directory keeps its contents and an fsync of a directory covers exactly the
entries changed in it. Paths come from the kernel: a descriptor's path is
the one ``/proc`` holds for it, and a name relative to a directory
descriptor is joined to that directory's path.

Nothing is taken from the library's own account of what it did, and nothing
is left out because somebody else did it: torch's C++ writer, DCP, a
framework's writer and SQLite's own reads and writes of the ledger (its
database file, its WAL, the directory fsync after creating one) are calls
like any other. Only SQLite's ``-shm`` file is left out: it is a memory map
that SQLite rebuilds after a crash, never a durable file.

What the scenario does in Python (its marks: a boundary begun, a save
acknowledged; the requests to an object store, seen through
:mod:`ckptdb.trace`) is put in the same order: each is kept in memory and
announced by a one-line write to a marker file outside the world, which the
replay meets in its place among the calls. Requests to an object store (a
run whose ``save_dir`` is ``s3://``) are followed by an
:class:`~powerloss.objects.ObjectRecorder` given to the recorder.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckptdb import trace as seam

from .syscalls import Call, Fd, SyscallTracer, calls, iov_bases

WORLD = 0  # the inode of the world directory
LEDGER_FILE = "ckptdb.sqlite"
#: SQLite's wal-index: a shared memory map, rebuilt by the first connection after a crash.
IGNORED_SUFFIXES = (f"{LEDGER_FILE}-shm",)
_RECORDINGS = itertools.count()


class TraceError(RuntimeError):
    """The recorder could not follow what happened on disk (a bug in a scenario or
    the recorder, never a finding about ckptdb)."""


@dataclass
class Node:
    ino: int
    kind: str  # "dir", "file" or "symlink"
    entries: dict[str, int] = field(default_factory=dict)
    content: bytearray = field(default_factory=bytearray)
    target: str = ""  # a symlink's

    @property
    def is_dir(self) -> bool:
        return self.kind == "dir"


@dataclass(frozen=True)
class Effect:
    """An entry of a directory inode set to ``ino``, or removed (``ino`` None)."""

    directory: int
    name: str
    ino: int | None


@dataclass(frozen=True)
class Op:
    """One recorded operation.

    Kinds: ``create``, ``mkdir``, ``symlink``, ``link`` (a new name for an
    inode), ``rename``, ``unlink``, ``rmdir`` (metadata: ``effects`` and
    ``dirs``, the directories whose fsync makes it durable); ``write``
    (``data`` at ``offset`` of file ``ino``; consecutive appends to one file
    are one op) and ``truncate`` (file ``ino`` cut or grown to ``length``);
    ``fsync`` (file ``ino``'s data so far) and ``fsync_dir`` (directory
    ``ino``'s entries); ``mark`` (a scenario's record); and the object-store
    requests of :mod:`.objects`. ``length``: a file's size after the op (for
    a ``rename``, the renamed file's; ``replaced``: the inode it replaced).
    ``key``/``upload``/``blob``/``answered``: an object-store request: the
    object's name relative to the recorded prefix, its multipart upload, the
    bytes it makes visible (an index into ``Trace.blobs``) and the index of
    the op that recorded its response (None: never answered).
    """

    index: int
    kind: str
    text: str
    effects: tuple[Effect, ...] = ()
    dirs: frozenset[int] = frozenset()
    ino: int | None = None
    length: int = 0
    replaced: int | None = None
    offset: int = 0
    data: bytes = b""
    mark: Mapping[str, Any] | None = None
    key: str | None = None
    upload: str | None = None
    blob: int | None = None
    answered: int | None = None


@dataclass(frozen=True)
class Trace:
    """A recorded scenario: the durable start and the operations."""

    world: Path
    root: Path
    base: dict[int, dict[str, int]]  # each directory's entries at the start (durable)
    base_files: dict[int, bytes]  # each file's content at the start (durable)
    files: dict[int, bytes]  # every file's content at the end of the recording
    directories: frozenset[int]
    links: dict[int, str]  # each symbolic link's target
    ops: list[Op]
    names: dict[int, str]  # each inode's latest name (relative to the world), for messages
    store: str | None = None  # the object store's ``s3://bucket/prefix`` (None: local only)
    objects: dict[str, int] = field(default_factory=dict)  # its objects at the start: blobs
    uploads: dict[str, str] = field(default_factory=dict)  # its uploads at the start: id -> key
    blobs: list[bytes] = field(default_factory=list)  # every object's bytes
    store_in_place: bool = False  # crash states built under ``store`` itself (see .objects)


def ignored(path: Path | str) -> bool:
    return str(path).endswith(IGNORED_SUFFIXES)


@dataclass
class _Open:
    """An open file description: its offset and ``O_APPEND``, and the model's inode of
    the file it was opened on (None: not a file of the world). Shared by the
    descriptor's duplicates, and by a forked child's copy of it, as in the kernel."""

    offset: int
    append: bool
    ino: int | None = None


Table = dict[int, "_Open"]  # a process's descriptors


class Recorder:
    """Records what the process does under ``world`` while installed (a context manager)."""

    def __init__(self, world: Path, root: Path, objects: Any = None) -> None:
        self.world = Path(os.path.realpath(world))
        self.objects = objects  # an ObjectRecorder (a run on object storage), or None
        self.root = Path(os.path.realpath(root))
        self.nodes: dict[int, Node] = {WORLD: Node(WORLD, "dir")}
        self.names: dict[int, str] = {WORLD: "."}
        self._scan(self.world, WORLD)
        self.base = {i: dict(n.entries) for i, n in self.nodes.items() if n.is_dir}
        self.base_files = {i: bytes(n.content) for i, n in self.nodes.items() if n.kind == "file"}
        self.ops: list[Op] = []
        self._lock = threading.Lock()
        self._events: list[Callable[[], None]] = []
        self._requests: dict[int, int] = {}  # id(params) of a request in flight -> its token
        self._tokens = itertools.count()
        stem = self.world.parent / f".powerloss-{os.getpid()}-{next(_RECORDINGS)}"
        self._marker, self._log = Path(f"{stem}.marks"), Path(f"{stem}.strace")
        self._marker_fd = -1
        self._tables: dict[int, Table] = {}  # tid -> its process's descriptors
        self._main: Table = {}
        self._clones: dict[int, tuple[int, bool]] = {}  # child tid -> (parent, shares fds)
        self._cwd = os.getcwd()
        self._previous: seam.Hook | None = None
        self._tracer: SyscallTracer | None = None

    def __enter__(self) -> Recorder:
        self._marker_fd = os.open(self._marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._previous = seam.set_hook(self.on_seam)
        self._tracer = SyscallTracer(self._log).__enter__()
        self._main = {
            fd: _Open(pos, append, self._lookup(path))
            for fd, (path, pos, append) in _open_descriptors(self.world).items()
        }
        self._cwd = os.getcwd()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            assert self._tracer is not None
            self._tracer.__exit__(*exc)
        finally:
            seam.set_hook(self._previous)
            os.close(self._marker_fd)
        try:
            if exc[0] is None:
                self._replay()
        finally:
            self._log.unlink(missing_ok=True)
            self._marker.unlink(missing_ok=True)

    def trace(self) -> Trace:
        return Trace(
            world=self.world,
            root=self.root,
            base=self.base,
            base_files=self.base_files,
            files={i: bytes(n.content) for i, n in self.nodes.items() if n.kind == "file"},
            directories=frozenset(i for i, n in self.nodes.items() if n.is_dir),
            links={i: n.target for i, n in self.nodes.items() if n.kind == "symlink"},
            ops=list(self.ops),
            names=dict(self.names),
            **({} if self.objects is None else self.objects.trace_fields()),
        )

    # ------------------------------------------------------------ in-process events

    def mark(self, record: Mapping[str, Any]) -> None:
        """A scenario's record (``{"begin": i}``, ``{"ack": i, "rows": {...}}``)."""
        kept = dict(record)
        self._event(lambda: self.append(Op(0, "mark", f"mark {kept}", mark=kept)))

    def on_seam(self, op: str, fields: Mapping[str, object]) -> None:
        """The library's object-store requests (:mod:`ckptdb.trace`), copied now (a
        request's body is a buffer reused later) and replayed in their place."""
        if op not in ("s3_request", "s3_response"):
            raise TraceError(f"unknown operation {op!r} at the seam")
        if self.objects is None:
            return
        params = fields["params"]
        assert isinstance(params, Mapping)
        with self._lock:
            if op == "s3_request":
                token = self._requests[id(params)] = next(self._tokens)
            else:
                token = self._requests.pop(id(params), -1)
        copied = self.objects.capture(params, token)
        operation = str(fields["operation"])
        if op == "s3_request":
            self._event(lambda: self.objects.request(self, operation, copied))
        else:
            answer = fields["answer"]
            self._event(lambda: self.objects.response(self, operation, copied, answer))

    def _event(self, run: Callable[[], None]) -> None:
        with self._lock:
            index = len(self._events)
            self._events.append(run)
        os.write(self._marker_fd, f"{index}\n".encode())

    def append(self, op: Op) -> int:
        """Append an op (its index set here); its index."""
        self.ops.append(replace(op, index=len(self.ops)))
        return len(self.ops) - 1

    # ------------------------------------------------------------ the replay

    def _replay(self) -> None:
        recorded = calls(self._log)
        for call in recorded:  # first: which process each thread belongs to
            if call.name in ("clone", "clone3", "fork", "vfork"):
                shares = "CLONE_FILES" in " ".join(call.raw(i) for i in range(len(call.args)))
                self._clones[call.result] = (call.tid, shares)
        for call in recorded:
            handler = getattr(self, f"_sys_{call.name}", None)
            if handler is None:
                raise TraceError(f"no replay for {call.name}")
            try:
                handler(call)
            except TraceError:
                raise
            except (IndexError, KeyError, ValueError) as exc:
                raise TraceError(f"cannot follow {call}: {exc!r}") from exc
        self._verify()

    def _fds(self, tid: int) -> Table:
        """The descriptors of ``tid``'s process: a thread shares its creator's, a forked
        child starts with a copy of its parent's (the same open file descriptions)."""
        table = self._tables.get(tid)
        if table is None:
            if tid in self._clones:
                parent, shares = self._clones[tid]
                table = self._fds(parent) if shares else dict(self._fds(parent))
            else:  # a thread of this process when the recording began
                table = self._main
            self._tables[tid] = table
        return table

    def _sys_clone(self, call: Call) -> None:
        self._fds(call.result)  # a forked child's copy is taken now, if not used before

    _sys_clone3 = _sys_fork = _sys_vfork = _sys_clone

    def _verify(self) -> None:
        """The model must hold what the disk holds at the end: a call the recorder missed
        or misplaced is an error of the recording, never a quiet gap in the trace."""
        model: dict[str, Any] = {}

        def walk(ino: int, prefix: str) -> None:
            for name, child in self.nodes[ino].entries.items():
                node, rel = self.nodes[child], f"{prefix}{name}"
                if node.kind == "dir":
                    model[rel] = "dir"
                elif node.kind == "symlink":
                    model[rel] = ("symlink", node.target)
                else:
                    model[rel] = ("file", bytes(node.content))
                if node.is_dir:
                    walk(child, rel + "/")

        walk(WORLD, "")
        disk: dict[str, Any] = {}
        for path in sorted(self.world.rglob("*")):
            rel = path.relative_to(self.world).as_posix()
            if ignored(path):
                continue
            if path.is_symlink():
                disk[rel] = ("symlink", os.readlink(path))
            elif path.is_dir():
                disk[rel] = "dir"
            else:
                disk[rel] = ("file", path.read_bytes())
        wrong = sorted(rel for rel in model.keys() | disk.keys() if model.get(rel) != disk.get(rel))
        if wrong:
            raise TraceError(f"the recording does not match the disk at: {', '.join(wrong[:8])}")

    # descriptors

    def _sys_openat(self, call: Call) -> None:
        self._opened(call, self._at(call.fd(0), call.text(1)), call.raw(2))

    def _sys_open(self, call: Call) -> None:
        self._opened(call, self._at(None, call.text(0)), call.raw(1))

    def _sys_creat(self, call: Call) -> None:
        self._opened(call, self._at(None, call.text(0)), "O_CREAT|O_WRONLY|O_TRUNC")

    def _opened(self, call: Call, asked: Path, flags: str) -> None:
        fd = call.result_fd
        path = Path(fd.path) if fd is not None and fd.path else asked
        state = self._fds(call.tid)[call.result] = _Open(0, "O_APPEND" in flags)
        if "O_TMPFILE" in flags or (fd is not None and fd.deleted):
            return  # a file with no name: nothing a crash can leave
        if not path.is_absolute() or not self._inside(path) or ignored(path):
            return
        ino = self._lookup(path)
        if ino is None:
            if "O_CREAT" not in flags:
                raise TraceError(f"{path} opened, but the model never saw it made")
            ino = self._make(path, "file")
        node = self.nodes[ino]
        if node.kind == "file":
            state.ino = ino
        if "O_TRUNC" in flags and node.kind == "file" and node.content:
            self._truncate(ino, 0)

    def _sys_close(self, call: Call) -> None:
        self._fds(call.tid).pop(_number(call.fd(0)), None)

    def _dup(self, call: Call) -> None:
        table = self._fds(call.tid)
        old = table.get(_number(call.fd(0)))
        if old is not None:
            table[call.result] = old  # one open file description, one offset
        else:
            table.pop(call.result, None)

    _sys_dup = _sys_dup2 = _sys_dup3 = _dup

    def _sys_fcntl(self, call: Call) -> None:
        command = call.raw(1)
        if command.startswith("F_DUPFD"):
            self._dup(call)
        elif command == "F_SETFL":
            state = self._fds(call.tid).get(_number(call.fd(0)))
            if state is not None:
                state.append = "O_APPEND" in call.raw(2)

    def _sys_lseek(self, call: Call) -> None:
        state = self._fds(call.tid).get(_number(call.fd(0)))
        if state is not None:
            state.offset = call.result

    def _sys_read(self, call: Call) -> None:
        """A read moves its descriptor's offset (printed raw: no buffer dumped)."""
        state = self._fds(call.tid).get(int(call.raw(0), 0))
        if state is not None:
            state.offset += call.result

    _sys_readv = _sys_read

    def _sys_chdir(self, call: Call) -> None:
        self._cwd = str(self._at(None, call.text(0)))

    def _sys_fchdir(self, call: Call) -> None:
        self._cwd = call.fd(0).path or self._cwd

    def _sys_mmap(self, call: Call) -> None:
        arg = call.args[4]
        shared_write = "PROT_WRITE" in call.raw(2) and "MAP_SHARED" in call.raw(3)
        if shared_write and isinstance(arg, Fd) and self._file_fd(arg) is not None:
            raise TraceError(f"{arg.path} written through a shared memory map")

    # data

    def _sys_write(self, call: Call) -> None:
        self._written(call, None, call.text(1)[: call.result])

    def _sys_pwrite64(self, call: Call) -> None:
        self._written(call, int(call.raw(3)), call.text(1)[: call.result])

    def _sys_writev(self, call: Call) -> None:
        self._written(call, None, iov_bases(call.raw(1))[: call.result])

    def _sys_pwritev(self, call: Call) -> None:
        offset = int(call.raw(3))
        data = iov_bases(call.raw(1))[: call.result]
        self._written(call, None if offset == -1 else offset, data)

    _sys_pwritev2 = _sys_pwritev

    def _written(self, call: Call, offset: int | None, data: bytes) -> None:
        """Bytes written to the inode the descriptor was opened on (whatever its name
        is now), at ``offset`` or the descriptor's own, which then advances; with
        ``O_APPEND`` at the end of the file, as Linux does even for ``pwrite``."""
        fd = call.fd(0)
        if fd.path == str(self._marker):
            self._events[int(data)]()
            return
        state = self._fds(call.tid).get(_number(fd))
        if state is None:
            if self._file_fd(fd) is not None:
                raise TraceError(f"a write to {fd.path} through a descriptor never seen opened")
            return
        ino = state.ino
        if state.append and ino is not None:
            offset = len(self.nodes[ino].content)
        elif offset is None:
            offset = state.offset
        if call.name in ("write", "writev") or (call.name == "pwritev2" and offset == -1):
            state.offset = offset + len(data)
        if ino is not None and data:
            self._write(ino, offset, data)

    def _sys_ftruncate(self, call: Call) -> None:
        state = self._fds(call.tid).get(_number(call.fd(0)))
        ino = state.ino if state is not None else self._file_fd(call.fd(0))
        if ino is not None:
            self._truncate(ino, int(call.raw(1)))

    def _sys_truncate(self, call: Call) -> None:
        path = self._at(None, call.text(0))
        if self._inside(path) and not ignored(path):
            self._truncate(self._known(path), int(call.raw(1)))

    def _unfollowed(self, fd: Fd, what: str) -> None:
        if self._file_fd(fd) is not None:
            raise TraceError(f"{fd.path} changed by {what}, which the explorer does not model")

    def _sys_sendfile(self, call: Call) -> None:
        self._unfollowed(call.fd(0), "sendfile")
        state = self._fds(call.tid).get(_number(call.fd(1)))
        if state is not None and call.raw(2) == "NULL":  # the input's offset moves
            state.offset += call.result

    def _sys_copy_file_range(self, call: Call) -> None:
        self._unfollowed(call.fd(2), "copy_file_range")

    def _sys_splice(self, call: Call) -> None:
        self._unfollowed(call.fd(2), "splice")

    def _sys_fallocate(self, call: Call) -> None:
        self._unfollowed(call.fd(0), "fallocate")

    def _sys_sync_file_range(self, call: Call) -> None:
        self._unfollowed(call.fd(0), "sync_file_range (no durability guarantee)")

    # durability

    def _sys_fsync(self, call: Call) -> None:
        fd = call.fd(0)
        state = self._fds(call.tid).get(_number(fd))
        if state is not None and state.ino is not None:
            ino = state.ino  # the file it was opened on, whatever its name now
        elif fd.deleted or not fd.path or not self._inside(Path(fd.path)) or ignored(fd.path):
            return
        else:
            ino = self._known(Path(fd.path))
        node = self.nodes[ino]
        name = self.names[ino]
        if node.is_dir:
            self.append(Op(0, "fsync_dir", f"{call.name} {name}/", ino=ino))
        else:
            n = len(node.content)
            self.append(Op(0, "fsync", f"{call.name} {name} ({n} bytes)", ino=ino, length=n))

    _sys_fdatasync = _sys_fsync

    # names

    def _sys_rename(self, call: Call) -> None:
        self._rename(self._at(None, call.text(0)), self._at(None, call.text(1)))

    def _sys_renameat(self, call: Call) -> None:
        source = self._at(call.fd(0), call.text(1))
        self._rename(source, self._at(call.fd(2), call.text(3)))

    def _sys_renameat2(self, call: Call) -> None:
        if "RENAME_EXCHANGE" in call.raw(4):
            raise TraceError("renameat2(RENAME_EXCHANGE) is not modeled")
        self._sys_renameat(call)

    def _sys_link(self, call: Call) -> None:
        self._link(self._at(None, call.text(0)), self._at(None, call.text(1)))

    def _sys_linkat(self, call: Call) -> None:
        self._link(self._at(call.fd(0), call.text(1)), self._at(call.fd(2), call.text(3)))

    def _sys_symlink(self, call: Call) -> None:
        self._symlink(call.text(0), self._at(None, call.text(1)))

    def _sys_symlinkat(self, call: Call) -> None:
        self._symlink(call.text(0), self._at(call.fd(1), call.text(2)))

    def _sys_unlink(self, call: Call) -> None:
        self._removed(self._at(None, call.text(0)), "unlink")

    def _sys_unlinkat(self, call: Call) -> None:
        how = "rmdir" if "AT_REMOVEDIR" in call.raw(2) else "unlink"
        self._removed(self._at(call.fd(0), call.text(1)), how)

    def _sys_rmdir(self, call: Call) -> None:
        self._removed(self._at(None, call.text(0)), "rmdir")

    def _sys_mkdir(self, call: Call) -> None:
        path = self._at(None, call.text(0))
        if self._inside(path):
            self._make(path, "dir")

    def _sys_mkdirat(self, call: Call) -> None:
        path = self._at(call.fd(0), call.text(1))
        if self._inside(path):
            self._make(path, "dir")

    # ------------------------------------------------------------ the model

    def _write(self, ino: int, offset: int, data: bytes) -> None:
        node = self.nodes[ino]
        if len(node.content) < offset:
            node.content += bytes(offset - len(node.content))
        node.content[offset : offset + len(data)] = data
        n, name = len(node.content), self.names[ino]
        last = self.ops[-1] if self.ops else None
        if (
            last is not None
            and last.kind == "write"
            and last.ino == ino
            and last.offset + len(last.data) == offset
        ):
            merged = last.data + data
            text = f"write {name} [{last.offset}, {last.offset + len(merged)}) (to {n} bytes)"
            self.ops[-1] = replace(last, data=merged, length=n, text=text)
            return
        text = f"write {name} [{offset}, {offset + len(data)}) (to {n} bytes)"
        self.append(Op(0, "write", text, ino=ino, length=n, offset=offset, data=data))

    def _truncate(self, ino: int, length: int) -> None:
        node = self.nodes[ino]
        if length <= len(node.content):
            del node.content[length:]
        else:
            node.content += bytes(length - len(node.content))
        text = f"truncate {self.names[ino]} to {length} bytes"
        self.append(Op(0, "truncate", text, ino=ino, length=length))

    def _make(self, path: Path, kind: str, target: str = "") -> int:
        parent, name = self._parent(path)
        if name in self.nodes[parent].entries:
            raise TraceError(f"{kind} {path}: it exists already in the model")
        ino = len(self.nodes)
        self.nodes[ino] = Node(ino, kind, target=target)
        self.nodes[parent].entries[name] = ino
        self.names[ino] = self._name(path)
        how = {"dir": "mkdir", "file": "create", "symlink": "symlink"}[kind]
        text = f"{how} {self._name(path)}" + (f" -> {target}" if target else "")
        effect = Effect(parent, name, ino)
        self.append(Op(0, how, text, (effect,), frozenset({parent})))
        return ino

    def _symlink(self, target: bytes, path: Path) -> None:
        if self._inside(path) and not ignored(path):
            self._make(path, "symlink", os.fsdecode(target))

    def _link(self, source: Path, path: Path) -> None:
        if not self._inside(path):
            return
        if not self._inside(source):
            raise TraceError(f"a hard link into the world from outside it: {source}")
        ino = self._known(source)
        parent, name = self._parent(path)
        self.nodes[parent].entries[name] = ino
        text = f"link {self._name(path)} = {self._name(source)}"
        self.append(Op(0, "link", text, (Effect(parent, name, ino),), frozenset({parent})))

    def _rename(self, source: Path, target: Path) -> None:
        inside = self._inside(source), self._inside(target)
        if not any(inside):
            return
        if not all(inside):
            raise TraceError(f"a rename across the world's edge: {source} -> {target}")
        if ignored(source) or ignored(target):
            return
        src_dir, src_name = self._parent(source)
        dst_dir, dst_name = self._parent(target)
        ino = self._known(source)
        replaced = self.nodes[dst_dir].entries.get(dst_name)
        del self.nodes[src_dir].entries[src_name]
        self.nodes[dst_dir].entries[dst_name] = ino
        self._rename_names(ino, self._name(target))
        node = self.nodes[ino]
        text = f"rename {self._name(source)} -> {self._name(target)}"
        effects = (Effect(src_dir, src_name, None), Effect(dst_dir, dst_name, ino))
        dirs = frozenset({src_dir, dst_dir})
        self.append(Op(0, "rename", text, effects, dirs, ino, len(node.content), replaced))

    def _removed(self, path: Path, how: str) -> None:
        if not self._inside(path) or ignored(path):
            return
        parent, name = self._parent(path)
        if self.nodes[parent].entries.pop(name, None) is None:
            raise TraceError(f"{how} {path}: not in the model")
        text = f"{how} {self._name(path)}"
        self.append(Op(0, how, text, (Effect(parent, name, None),), frozenset({parent})))

    def _rename_names(self, ino: int, name: str) -> None:
        """Messages name a file by its latest name (a renamed directory's files too)."""
        self.names[ino] = name
        for child_name, child in self.nodes[ino].entries.items():
            self._rename_names(child, f"{name}/{child_name}")

    def _scan(self, path: Path, ino: int) -> None:
        for name in sorted(os.listdir(path)):
            child = path / name
            if ignored(child):
                continue
            new = len(self.nodes)
            if child.is_symlink():
                self.nodes[new] = Node(new, "symlink", target=os.readlink(child))
            elif child.is_dir():
                self.nodes[new] = Node(new, "dir")
            else:
                self.nodes[new] = Node(new, "file", content=bytearray(child.read_bytes()))
            self.nodes[ino].entries[name] = new
            self.names[new] = self._name(child)
            if self.nodes[new].is_dir:
                self._scan(child, new)

    # ------------------------------------------------------------ paths

    def _at(self, directory: Fd | None, name: bytes) -> Path:
        """A path argument as the kernel resolves it: relative to the directory
        descriptor's path, or to the working directory."""
        text = os.fsdecode(name)
        if os.path.isabs(text):
            return Path(text)
        base = directory.path if directory is not None and directory.path else self._cwd
        return Path(base) / text

    def _file_fd(self, fd: Fd) -> int | None:
        """The model's file behind a descriptor (None: outside the world, ignored, gone)."""
        if fd.deleted or not fd.path or not self._inside(Path(fd.path)) or ignored(fd.path):
            return None
        ino = self._known(Path(fd.path))
        return ino if self.nodes[ino].kind == "file" else None

    def _inside(self, path: Path) -> bool:
        return self._parts(path) is not None

    def _parts(self, path: Path) -> tuple[str, ...] | None:
        full = Path(os.path.normpath(path))
        try:
            return full.relative_to(self.world).parts
        except ValueError:
            pass
        real = Path(os.path.realpath(full.parent)) / full.name
        try:
            return real.relative_to(self.world).parts
        except ValueError:
            return None

    def _name(self, path: Path) -> str:
        parts = self._parts(path)
        return str(path) if parts is None else "/".join(parts) or "."

    def _lookup(self, path: Path) -> int | None:
        parts = self._parts(path)
        if parts is None:
            raise TraceError(f"{path} is outside the world {self.world}")
        ino = WORLD
        for name in parts:
            child = self.nodes[ino].entries.get(name)
            if child is None:
                return None
            ino = child
        return ino

    def _known(self, path: Path) -> int:
        ino = self._lookup(path)
        if ino is None:
            raise TraceError(f"{path} is not in the model")
        return ino

    def _parent(self, path: Path) -> tuple[int, str]:
        return self._known(Path(path).parent), Path(path).name


def _number(fd: Fd) -> int:
    return -1 if fd.number is None else fd.number


def _open_descriptors(world: Path) -> dict[int, tuple[Path, int, bool]]:
    """The descriptors open on files under ``world`` now: path, offset, ``O_APPEND``."""
    found: dict[int, tuple[Path, int, bool]] = {}
    for entry in os.listdir("/proc/self/fd"):
        try:
            path = os.readlink(f"/proc/self/fd/{entry}")
            info = Path(f"/proc/self/fdinfo/{entry}").read_text()
        except OSError:
            continue
        if not path.startswith(f"{world}/"):
            continue
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        flags = int(fields.get("flags", "0").strip(), 8)
        found[int(entry)] = (Path(path), int(fields["pos"].strip()), bool(flags & os.O_APPEND))
    return found
