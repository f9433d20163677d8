"""The payload-storage seam: what the protocol asks of the place payloads live.

A :class:`PayloadStore` holds one run's payloads under names relative to the
run's save directory (``<stream>/<name>``). The protocol never touches a file
itself: every step it needs goes through these methods. A save reaches the
store in four of its six phases (the save phases: ckptdb/protocol/boundary.py,
rendered in docs/reference/protocol.md), calling, in this order:

- intent: :meth:`~PayloadStore.absent` (the save directory and the streams'
  directories still there), :meth:`~PayloadStore.prepare_stream` (or
  :meth:`~PayloadStore.prepare_parent` for a framework's name, whose leftover
  temporary it may :meth:`~PayloadStore.remove`), :meth:`~PayloadStore.exists`
  (a name already taken) and, for a payload kind written by every rank,
  :meth:`~PayloadStore.make_temp_dir`;
- write: :meth:`~PayloadStore.write_object` (a byte stream, hashed as it is
  written, made durable) or, for a sharded payload,
  :meth:`~PayloadStore.dcp_writer` then :meth:`~PayloadStore.seal`
  (:meth:`~PayloadStore.seal_written` for what a framework's writer created);
- place: :meth:`~PayloadStore.place`, then :meth:`~PayloadStore.sync_placed`;
- clean-up, after the commit: :meth:`~PayloadStore.remove` what retention evicted.

Reads go through :meth:`~PayloadStore.verify` (size and hash against the
ledger, sorted into lost or corrupt in one place) and the kind's loader.
Reconcile lists what is ours (:meth:`~PayloadStore.list_ours`), removes
temporaries and quarantines unowned checkpoints.

Two stores implement it: the local POSIX filesystem
(:class:`~ckptdb.storage.local.LocalStore`) and object storage
(:class:`~ckptdb.storage.s3.S3Store`); a payload kind
(:mod:`ckptdb.storage.kinds`) never needs to know which one it writes to. A
store without rename (``renames`` False) has the protocol name the temporary
object with its final name, a name unique to its row: ``place`` then moves
nothing, and the ledger row alone decides visibility.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal, Protocol

from .files import FileInfo

if TYPE_CHECKING:
    from .heldfile import HeldFile

__all__ = ["CORRUPT", "LOST", "FileInfo", "Finding", "Found", "PayloadStore", "verdict"]

LOST: Literal["lost"] = "lost"
CORRUPT: Literal["corrupt"] = "corrupt"


@dataclass(frozen=True)
class Finding:
    """Why a stored payload does not match its ledger row: ``lost`` or ``corrupt``.

    ``actual`` is what was measured, when the payload could be read at all.
    """

    state: Literal["lost", "corrupt"]
    detail: str
    actual: FileInfo | None = None
    #: The payload is gone (not merely unreadable now).
    missing: bool = False
    #: The error met while reading it, if any.
    error: BaseException | None = None


def verdict(
    actual: FileInfo, size: int | None, digest: str | None, *, full: bool, part: str | None = None
) -> Finding | None:
    """The verdict on a payload that could be read and measured as ``actual``: ``corrupt``
    if its size, or with ``full`` its hash, differs from its row's; None if it matches.

    Every store sorts what it read by this one rule, so that a row is found
    corrupt (and said to be, in the same words) whatever holds its payload;
    what cannot be read at all is ``lost``, which each store tells by its own
    errors. ``part``: a file inside the payload (a shard of a sharded
    checkpoint), compared with what its writer recorded in the manifest: the
    finding names it and carries no ``actual``, which measures a whole
    payload (what a row records), not one of its files.
    """
    where, against = ("", "recorded") if part is None else (f"{part}: ", "written")
    measured = actual if part is None else None
    if actual.size != size:
        return Finding(CORRUPT, f"{where}size {actual.size} != {against} {size}", measured)
    if full and actual.hash != digest:
        return Finding(CORRUPT, f"{where}hash {actual.hash} != {against} {digest}", measured)
    return None


@dataclass(frozen=True)
class Found:
    """An entry of the save directory in our naming (see :meth:`PayloadStore.list_ours`)."""

    stream: str
    name: str
    role: Literal["temp", "checkpoint"]

    @property
    def rel(self) -> str:
        return f"{self.stream}/{self.name}"


class PayloadStore(Protocol):
    """Where one run's payloads live (see the module docstring for the call order)."""

    #: False: no atomic rename; a payload is written directly under its final
    #: name, which the protocol makes unique to its row (object storage).
    renames: bool
    #: The names of the payload kinds this store can hold (the others are refused).
    kinds: frozenset[str]
    #: True: a read is served from the bytes a full :meth:`verify` with ``keep`` held
    #: (object storage: one GET), so every process that reads must verify for
    #: itself first; False: a verified directory is read by its :meth:`local_path`
    #: (a file is still read from the bytes its verify held).
    reads_verified_bytes: bool
    #: A store without rename: the run's token (:func:`~ckptdb.storage.naming.run_token`),
    #: set by the writer once its run is open; it is in every name the run writes,
    #: and only names with it (or none, from before tokens) are the run's.
    run_token: str | None

    @property
    def location(self) -> Path:
        """The save directory (for messages and the public records' paths)."""

    def prepare_stream(self, stream: str) -> None:
        """Make the stream's place durable before its first intent row commits."""

    def prepare_parent(self, rel: str) -> None:
        """Create the directory that will hold ``rel`` (an external payload's own name)."""

    def exists(self, rel: str) -> bool:
        """Whether anything (even a dangling link) is stored under ``rel``."""

    def make_temp_dir(self, rel: str) -> None:
        """Create the temporary directory of a payload that every rank writes into."""

    def write_object(self, rel: str, serialize: Callable[[Any], object]) -> FileInfo:
        """Write a new temporary object: ``serialize(stream)``, hashed, made durable."""

    def dcp_writer(self, rel: str) -> Any:
        """A ``torch.distributed.checkpoint`` storage writer into the directory ``rel``."""

    def dcp_reader(self, rel: str) -> Any:
        """A ``torch.distributed.checkpoint`` storage reader of the directory ``rel``."""

    def seal(self, rel: str) -> FileInfo:
        """Make a directory written by DCP durable and measure it."""

    def seal_written(self, rel: str) -> FileInfo:
        """Make what an external writer created at ``rel`` (a file or a directory)
        durable, every file in it included, and measure it."""

    def place(self, tmp: str, final: str) -> None:
        """Atomically make the temporary object visible under its final name."""

    def sync_placed(self, finals: list[str]) -> None:
        """Make the placements of ``finals`` durable."""

    def verify(
        self, rel: str, size: int | None, digest: str | None, *, full: bool, keep: bool = False
    ) -> Finding | None:
        """Check a payload against its row: size always, the hash too with ``full``.

        ``keep``: a load of ``rel`` follows at once, so a store that reads the
        whole payload to hash it may hold those bytes for :meth:`open_verified`
        (only then: a check that loads nothing must not pin a payload in memory)."""

    def open_verified(self, rel: str) -> BinaryIO | HeldFile | None:
        """The bytes the last full :meth:`verify` of ``rel`` hashed, when the store keeps
        them (object storage: one GET serves both; a local file: one read, see
        :mod:`~ckptdb.storage.heldfile`); None: read :meth:`local_path` (a directory)."""

    def forget_verified(self) -> None:
        """Drop what a ``verify(keep=True)`` holds for a load that will not come (one
        refused after its verify): a whole payload must not stay in memory until the
        next verify."""

    def local_path(self, rel: str) -> Path:
        """A confined local path to read ``rel`` from (refused if ``rel`` escapes the store)."""

    def absent(self, directory: str = "") -> bool:
        """Whether the store's place itself, or ``directory`` in it (a stream's), is
        missing (not there, a link to nowhere, not a directory: an unmounted filesystem,
        a moved disk), as opposed to present and empty; one that cannot be looked at
        (no permission) raises :class:`~ckptdb.errors.RunDirectoryError` rather than
        being guessed either way. An object store's prefixes always exist."""

    def memoized(self) -> AbstractContextManager[Any]:
        """One pass over many names (reconcile, check): lookups may be cached until it ends."""

    def list_ours(self) -> Iterator[Found]:
        """Every entry in our naming, temporaries included (never links, never foreign kinds)."""

    def disowned(self, rel: str) -> bool:
        """Whether a write of this process found ``rel`` taken by someone else: not
        ours, never to be removed (the rollback records it for later reconciles)."""

    def remove(self, rel: str) -> bool:
        """Remove ``rel`` (a file or a whole directory); False if it was absent."""

    def quarantine(self, rel: str, into: Path) -> Path:
        """Move ``rel`` aside into ``into`` under a free name; where it went."""

    def move_in(self, source: Path, rel: str) -> Callable[[], None]:
        """Move ``source`` (a file or directory outside the store, a checkpoint being
        adopted) onto the free name ``rel``, atomically and durably; returns the undo
        (moving it back), for when its ledger row could not be committed."""
