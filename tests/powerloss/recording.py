"""Recording a scenario's durable operations as a trace that can be replayed.

The :class:`Recorder` keeps a logical model of the tree under a *world*
directory (inodes, directory entries, file contents), updated by each
operation the library reports through :mod:`ckptdb.trace`. Each operation
becomes an :class:`Op` that says what it changed (entries set or removed in
directory inodes, bytes appended to a file inode) or what it made durable
(a file's data, a directory's entries, a ledger commit). Directories are
inodes, not paths, so a renamed directory keeps its contents and an fsync of
a directory covers exactly the entries changed in that directory.

A file that someone else wrote (a framework's writer, DCP) is adopted when
the library first touches it (an fsync, the fsync of its directory): its
creation and its bytes enter the trace then, as not yet durable, which is
what they are. Consecutive appends to one file are one ``write`` op: a crash
inside them is covered by the persistence model's partial data anyway.

The ledger is not modeled as files: after each commit the recorder takes a
snapshot of the database with SQLite's backup API; the persistence model
picks which snapshot a crash leaves. SQLite's own files (and the writer
lock's) are left out of the tree.

Requests to an object store (a run whose ``save_dir`` is ``s3://``) are
followed by an :class:`~powerloss.objects.ObjectRecorder` given to the
recorder: each request that changes the store becomes an op when it is sent,
and learns the index of its answer when the response comes back.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckptdb import trace as seam

WORLD = 0  # the inode of the world directory
LEDGER_FILE = "ckptdb.sqlite"
IGNORED_PREFIXES = (LEDGER_FILE, "ckptdb.lock", "ckptdb.owner", ".ckptdb.owner")


class TraceError(RuntimeError):
    """The recorder could not follow what happened on disk (a bug in a scenario or
    the recorder, never a finding about ckptdb)."""


@dataclass
class Node:
    ino: int
    is_dir: bool
    entries: dict[str, int] = field(default_factory=dict)
    content: bytearray = field(default_factory=bytearray)


@dataclass(frozen=True)
class Effect:
    """An entry of a directory inode set to ``ino``, or removed (``ino`` None)."""

    directory: int
    name: str
    ino: int | None


@dataclass(frozen=True)
class Op:
    """One recorded operation (see :mod:`ckptdb.trace` for the kinds).

    ``effects`` and ``dirs``: a metadata change and the directories whose
    fsync makes it durable. ``ino``/``length``: the file a ``write`` grew (to
    ``length`` bytes), a ``fsync`` made durable (its first ``length`` bytes),
    the directory of a ``fsync_dir``, the inode a ``rename`` moved (``length``:
    its size then; ``replaced``: the inode it replaced). ``snapshot`` and
    ``durable``: the ledger a ``commit`` left, and whether it was FULL.
    ``mark``: a scenario's own record (a boundary begun, a save acknowledged).
    ``key``/``upload``/``blob``/``answered``: an object-store request (see
    :mod:`.objects`): the object's name relative to the recorded prefix, its
    multipart upload, the bytes it makes visible (an index into
    ``Trace.blobs``) and the index of the op that recorded its response (None:
    never answered).
    """

    index: int
    kind: str
    text: str
    effects: tuple[Effect, ...] = ()
    dirs: frozenset[int] = frozenset()
    ino: int | None = None
    length: int = 0
    replaced: int | None = None
    snapshot: int | None = None
    durable: bool = False
    mark: Mapping[str, Any] | None = None
    key: str | None = None
    upload: str | None = None
    blob: int | None = None
    answered: int | None = None


@dataclass(frozen=True)
class Trace:
    """A recorded scenario: the durable start, the operations, the ledger snapshots."""

    world: Path
    root: Path
    base: dict[int, dict[str, int]]  # each directory's entries at the start (durable)
    base_lengths: dict[int, int]  # each file's length at the start (durable)
    files: dict[int, bytes]  # every file's content, as far as it was ever written
    directories: frozenset[int]
    ops: list[Op]
    snapshots: list[bytes]
    base_snapshot: int | None  # the ledger at the start (None: no ledger yet)
    names: dict[int, str]  # each inode's latest name (relative to the world), for messages
    store: str | None = None  # the object store's ``s3://bucket/prefix`` (None: local only)
    objects: dict[str, int] = field(default_factory=dict)  # its objects at the start: blobs
    uploads: dict[str, str] = field(default_factory=dict)  # its uploads at the start: id -> key
    blobs: list[bytes] = field(default_factory=list)  # every object's bytes


def ignored(path: Path) -> bool:
    """SQLite's and the writer lock's files: the ledger is modeled by snapshots."""
    return path.name.startswith(IGNORED_PREFIXES)


def snapshot_ledger(database: Path) -> bytes:
    """The committed content of a SQLite database, read through SQLite's backup API."""
    source = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
    target = sqlite3.connect(":memory:")
    try:
        source.backup(target)
        return target.serialize()
    finally:
        source.close()
        target.close()


class Recorder:
    """Records what the library does under ``world`` while installed (a context manager)."""

    def __init__(self, world: Path, root: Path, objects: Any = None) -> None:
        self.world = Path(os.path.realpath(world))
        self.objects = objects  # an ObjectRecorder (a run on object storage), or None
        self.root = Path(os.path.realpath(root))
        self.nodes: dict[int, Node] = {WORLD: Node(WORLD, True)}
        self.names: dict[int, str] = {WORLD: "."}
        self._scan(self.world, WORLD)
        self.base = {i: dict(n.entries) for i, n in self.nodes.items() if n.is_dir}
        self.base_lengths = {i: len(n.content) for i, n in self.nodes.items() if not n.is_dir}
        self.ops: list[Op] = []
        self.snapshots: list[bytes] = []
        self._lock = threading.RLock()
        self._previous: seam.Hook | None = None
        ledger = self.root / LEDGER_FILE
        self.base_snapshot = self._snapshot() if ledger.exists() else None

    def __enter__(self) -> Recorder:
        self._previous = seam.set_hook(self.on_op)
        return self

    def __exit__(self, *exc: object) -> None:
        seam.set_hook(self._previous)

    def trace(self) -> Trace:
        return Trace(
            world=self.world,
            root=self.root,
            base=self.base,
            base_lengths=self.base_lengths,
            files={i: bytes(n.content) for i, n in self.nodes.items() if not n.is_dir},
            directories=frozenset(i for i, n in self.nodes.items() if n.is_dir),
            ops=list(self.ops),
            snapshots=list(self.snapshots),
            base_snapshot=self.base_snapshot,
            names=dict(self.names),
            **({} if self.objects is None else self.objects.trace_fields()),
        )

    # ------------------------------------------------------------ the hook

    def on_op(self, op: str, fields: Mapping[str, object]) -> None:
        with self._lock:
            handler = getattr(self, f"_on_{op}", None)
            if handler is None:
                raise TraceError(f"unknown operation {op!r} in the trace")
            handler(**fields)

    def observe(self, path: Path) -> None:
        """Record what the kernel holds of a file that another writer is writing."""
        with self._lock:
            if self._inside(path):
                self._adopt(path)
                self.catch_up(path)

    def mark(self, record: Mapping[str, Any]) -> None:
        """A scenario's record (``{"begin": i}``, ``{"ack": i, "rows": {...}}``)."""
        with self._lock:
            self._append(Op(0, "mark", f"mark {dict(record)}", mark=dict(record)))

    def append(self, op: Op) -> int:
        """Append an op (its index set here); its index."""
        self._append(op)
        return len(self.ops) - 1

    def _on_s3_request(self, operation: str, params: Mapping[str, Any]) -> None:
        if self.objects is not None:
            self.objects.request(self, operation, params)

    def _on_s3_response(self, operation: str, params: Mapping[str, Any], answer: Any) -> None:
        if self.objects is not None:
            self.objects.response(self, operation, params, answer)

    def _on_create(self, path: Path) -> None:
        if self._inside(path):
            self._make(path, is_dir=False, how="create")

    def _on_mkdir(self, path: Path) -> None:
        if self._inside(path):
            self._make(path, is_dir=True, how="mkdir")

    def _on_write(self, path: Path | None, offset: int, data: Any) -> None:
        if path is None or not self._inside(path):
            return
        node = self.nodes[self._known(path)]
        if offset != len(node.content):
            raise TraceError(f"{path}: a write at {offset}, not an append ({len(node.content)})")
        node.content += bytes(data)
        self._grew(node, path)

    def _on_fsync(self, path: Path) -> None:
        if not self._inside(path):
            return
        ino = self._adopt(path)
        self.catch_up(path)
        n = len(self.nodes[ino].content)
        self._append(Op(0, "fsync", f"fsync {self._name(path)} ({n} bytes)", ino=ino, length=n))

    def _on_fsync_dir(self, path: Path) -> None:
        if not self._inside(path):
            return
        ino = self._adopt(path)
        self._adopt_children(path, ino)
        self._append(Op(0, "fsync_dir", f"fsync_dir {self._name(path)}", ino=ino))

    def _on_rename(self, source: Path, target: Path) -> None:
        if not (self._inside(source) and self._inside(target)):
            raise TraceError(f"a rename across the world's edge: {source} -> {target}")
        if self._lookup(source) is None:  # another writer made it, nothing synced it yet
            self._adopt(source, disk=target)
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
        self._append(Op(0, "rename", text, effects, dirs, ino, len(node.content), replaced))

    def _on_unlink(self, path: Path) -> None:
        if self._inside(path):
            self._remove(path, "unlink")

    def _on_rmdir(self, path: Path) -> None:
        if self._inside(path):
            self._remove(path, "rmdir")

    def _on_rmtree(self, path: Path) -> None:
        """The tree is gone from the disk already: its removal, entry by entry, in
        the order ``shutil.rmtree`` takes (depth first, a directory after its entries)."""
        if not self._inside(path):
            return
        for child_path, is_dir in self._walk_down(path, self._known(path)):
            self._remove(child_path, "rmdir" if is_dir else "unlink", via=f"rmtree {path.name}")
        self._remove(path, "rmdir", via="rmtree")

    def _on_commit(self, database: str | None, backend: str, durable: bool) -> None:
        if backend != "sqlite" or database is None:
            raise TraceError(f"the explorer models SQLite ledgers only, not {backend}")
        if Path(os.path.realpath(database)) != self.root / LEDGER_FILE:
            return
        level = "FULL" if durable else "NORMAL"
        snap = self._snapshot()
        self._append(Op(0, "commit", f"commit ({level})", snapshot=snap, durable=durable))

    # ------------------------------------------------------------ the model

    def catch_up(self, path: Path, where: Path | None = None) -> None:
        """What the kernel holds of a file now (another writer appended it): recorded.
        ``where``: where the file is now, if not at ``path``."""
        node = self.nodes[self._known(path)]
        disk = (where or path).read_bytes()
        if bytes(node.content) == disk:
            return
        if not disk.startswith(bytes(node.content)):
            raise TraceError(f"{path} changed other than by appending")
        node.content += disk[len(node.content) :]
        self._grew(node, path)

    def _grew(self, node: Node, path: Path) -> None:
        last = self.ops[-1] if self.ops else None
        n = len(node.content)
        text = f"write {self._name(path)} (to {n} bytes)"
        if last is not None and last.kind == "write" and last.ino == node.ino:
            self.ops[-1] = replace(last, length=n, text=text)
        else:
            self._append(Op(0, "write", text, ino=node.ino, length=n))

    def _make(self, path: Path, *, is_dir: bool, how: str) -> int:
        parent, name = self._parent(path)
        if name in self.nodes[parent].entries:
            raise TraceError(f"{how} {path}: it exists already in the model")
        ino = len(self.nodes)
        self.nodes[ino] = Node(ino, is_dir)
        self.nodes[parent].entries[name] = ino
        self.names[ino] = self._name(path)
        effect = Effect(parent, name, ino)
        self._append(Op(0, how, f"{how} {self._name(path)}", (effect,), frozenset({parent})))
        return ino

    def _remove(self, path: Path, how: str, via: str = "") -> None:
        parent, name = self._parent(path)
        if self.nodes[parent].entries.pop(name, None) is None:
            raise TraceError(f"{how} {path}: not in the model")
        text = f"{how} {self._name(path)}" + (f" ({via})" if via else "")
        self._append(Op(0, how, text, (Effect(parent, name, None),), frozenset({parent})))

    def _rename_names(self, ino: int, name: str) -> None:
        """Messages name a file by its latest name (a renamed directory's files too)."""
        self.names[ino] = name
        for child_name, child in self.nodes[ino].entries.items():
            self._rename_names(child, f"{name}/{child_name}")

    def _walk_down(self, path: Path, ino: int) -> Iterator[tuple[Path, bool]]:
        for name, child in sorted(self.nodes[ino].entries.items()):
            if self.nodes[child].is_dir:
                yield from self._walk_down(path / name, child)
            yield path / name, self.nodes[child].is_dir

    def _adopt(self, path: Path, disk: Path | None = None) -> int:
        """The inode of ``path``, adopting it (and its parents) from the disk if another
        writer made it: a directory with everything in it, a file with its bytes.
        ``disk``: where it is now, if it was renamed since (the rename is recorded next)."""
        found = self._lookup(path)
        if found is not None:
            return found
        self._adopt(path.parent)  # which may adopt ``path`` with the rest of its directory
        found = self._lookup(path)
        if found is not None:
            return found
        disk = disk or path
        if disk.is_dir() and not disk.is_symlink():
            ino = self._make(path, is_dir=True, how="mkdir")
            self._adopt_children(path, ino, disk)
            return ino
        if not disk.is_file():
            raise TraceError(f"{path} is neither in the model nor a file on disk")
        ino = self._make(path, is_dir=False, how="create")
        self.catch_up(path, disk)
        return ino

    def _adopt_children(self, path: Path, ino: int, disk: Path | None = None) -> None:
        disk = disk or path
        for name in sorted(os.listdir(disk)):
            if name not in self.nodes[ino].entries and not ignored(disk / name):
                self._adopt(path / name, disk / name)

    def _scan(self, path: Path, ino: int) -> None:
        if not path.is_dir():
            return
        for name in sorted(os.listdir(path)):
            child = path / name
            if ignored(child) or child.is_symlink():
                continue
            new = len(self.nodes)
            self.nodes[new] = Node(new, child.is_dir())
            self.nodes[ino].entries[name] = new
            self.names[new] = self._name(child)
            if child.is_dir():
                self._scan(child, new)
            else:
                self.nodes[new].content += child.read_bytes()

    def _snapshot(self) -> int:
        data = snapshot_ledger(self.root / LEDGER_FILE)
        for i, known in enumerate(self.snapshots):
            if known == data:
                return i
        self.snapshots.append(data)
        return len(self.snapshots) - 1

    def _append(self, op: Op) -> None:
        self.ops.append(replace(op, index=len(self.ops)))

    # ------------------------------------------------------------ paths

    def _inside(self, path: Path) -> bool:
        return self._parts(path) is not None

    def _parts(self, path: Path) -> tuple[str, ...] | None:
        full = Path(os.path.realpath(Path(path).parent)) / Path(path).name
        try:
            return full.relative_to(self.world).parts
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
