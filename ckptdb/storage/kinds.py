"""Payload kinds: how one kind of payload is written, measured and read back.

A kind is chosen once per payload (:func:`kind_of`) or per stored path
(:func:`kind_of_path`); the protocol then asks the kind, never the payload's
type. Three kinds exist: :data:`TORCH_FILE` (one ``torch.save`` file, written by
the chief), :data:`SHARDED` (a ``torch.distributed.checkpoint`` directory,
written by every rank) and :data:`EXTERNAL` (a file or directory that a
framework's own writer creates, under the framework's name). A kind writes through a
:class:`~ckptdb.storage.base.PayloadStore`, so it works on any store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from ..errors import InvalidArgumentError
from . import dcp
from .base import PayloadStore
from .dcp import Sharded
from .external import External
from .files import FileInfo
from .heldfile import HeldFile
from .naming import SHARDED_SUFFIX


class PayloadKind(Protocol):
    """What the protocol asks of a kind of payload."""

    name: ClassVar[str]
    suffix: ClassVar[str]
    #: Every rank writes its part (inside one collective); else the chief alone writes.
    every_rank_writes: ClassVar[bool]
    #: The chief creates the temporary directory at the intent (the writers fill it).
    temp_dir_first: ClassVar[bool]
    #: Every rank reports that its part is written before the chief seals (``wrote``).
    agree_written: ClassVar[bool]

    def prepared(self, payload: Any) -> Any:
        """The payload ready to write (resolved in the preflight, where errors are agreed)."""

    def data(self, payload: Any) -> Any:
        """What is copied to host memory for an asynchronous save."""

    def wrap(self, data: Any) -> Any:
        """A payload of this kind around (snapshotted) ``data``."""

    def write(self, store: PayloadStore, payload: Any, tmp: str, group: Any) -> FileInfo | None:
        """Write ``payload`` under the temporary name; the measured object, or None
        when it still has to be sealed (:meth:`seal`)."""

    def seal(self, store: PayloadStore, tmp: str, written: FileInfo | None) -> FileInfo:
        """The durable, measured temporary object."""

    def check_into(self, path: str, into: object) -> None:
        """Refuse a load target that does not fit this kind."""

    def load(
        self,
        store: PayloadStore,
        rel: str,
        *,
        map_location: Any,
        weights_only: bool,
        into: dict[str, Any] | None,
        group: Any,
        planner: Any = None,
    ) -> Any:
        """Read a verified checkpoint back (``planner``: DCP's, for a sharded load)."""

    def check_loadable(self, store: PayloadStore, rel: str) -> None:
        """Raise if the checkpoint cannot be read back (``check(load=True)``)."""


@dataclass(frozen=True)
class TorchFile:
    """One ``torch.save`` file, written by the chief, streamed and hashed as it is written."""

    name: ClassVar[str] = "torch"
    suffix: ClassVar[str] = ".pt"
    every_rank_writes: ClassVar[bool] = False
    temp_dir_first: ClassVar[bool] = False
    agree_written: ClassVar[bool] = False

    def prepared(self, payload: Any) -> Any:
        return payload

    def data(self, payload: Any) -> Any:
        return payload

    def wrap(self, data: Any) -> Any:
        return data

    def write(self, store: PayloadStore, payload: Any, tmp: str, group: Any) -> FileInfo | None:
        # torch.save is looked up at call time, so users and tests can wrap it
        return store.write_object(tmp, lambda f: torch.save(payload, f))

    def seal(self, store: PayloadStore, tmp: str, written: FileInfo | None) -> FileInfo:
        assert written is not None
        return written

    def check_into(self, path: str, into: object) -> None:
        if into is not None:
            raise InvalidArgumentError(
                f"into= is for sharded checkpoints; {path} is a file, use the returned state"
            )

    def load(
        self,
        store: PayloadStore,
        rel: str,
        *,
        map_location: Any,
        weights_only: bool,
        into: dict[str, Any] | None,
        group: Any,
        planner: Any = None,
    ) -> Any:
        verified = store.open_verified(rel)  # the bytes just hashed, never the file again
        if isinstance(verified, HeldFile):
            return verified.load(map_location, weights_only)
        if verified is not None:
            return torch.load(verified, map_location=map_location, weights_only=weights_only)
        raise InvalidArgumentError(
            f"{rel} is a directory written by a framework's own writer; ckptdb "
            "verified it, load it with that framework from checkpoint.path"
        )

    def check_loadable(self, store: PayloadStore, rel: str) -> None:
        verified = store.open_verified(rel)  # None: a framework's directory (size and hash only)
        if isinstance(verified, HeldFile):
            verified.load("cpu", weights_only=True)
        elif verified is not None:
            torch.load(verified, map_location="cpu", weights_only=True)


@dataclass(frozen=True)
class ShardedDirectory:
    """A ``torch.distributed.checkpoint`` directory: every rank writes its shards."""

    name: ClassVar[str] = "dcp"
    suffix: ClassVar[str] = SHARDED_SUFFIX
    every_rank_writes: ClassVar[bool] = True
    temp_dir_first: ClassVar[bool] = True
    agree_written: ClassVar[bool] = False  # DCP's own finish step waits for every rank

    def prepared(self, payload: Any) -> Any:
        assert isinstance(payload, Sharded)
        return payload.resolved()

    def data(self, payload: Any) -> Any:
        assert isinstance(payload, Sharded)
        return payload.state_dict

    def wrap(self, data: Any) -> Any:
        return Sharded(data)

    def write(self, store: PayloadStore, payload: Any, tmp: str, group: Any) -> FileInfo | None:
        dcp.write_sharded(self.data(payload), store.dcp_writer(tmp), group)
        return None

    def seal(self, store: PayloadStore, tmp: str, written: FileInfo | None) -> FileInfo:
        return store.seal(tmp)

    def check_into(self, path: str, into: object) -> None:
        if not isinstance(into, dict):
            raise InvalidArgumentError(
                f"{path} is a sharded checkpoint: pass into=<state dict> to load it in place"
            )

    def load(
        self,
        store: PayloadStore,
        rel: str,
        *,
        map_location: Any,
        weights_only: bool,
        into: dict[str, Any] | None,
        group: Any,
        planner: Any = None,
    ) -> Any:
        assert into is not None
        dcp.load_sharded(into, store.dcp_reader(rel), group, planner)
        return into

    def check_loadable(self, store: PayloadStore, rel: str) -> None:
        store.dcp_reader(rel).read_metadata()


@dataclass(frozen=True)
class ExternalWriter(TorchFile):
    """An :class:`External` payload: its writer creates a file or a directory.

    The writer runs on every rank, at the temporary path the chief chose (a
    framework's save has its own barriers); ckptdb seals what it created. A
    stored external payload reads back like a ``torch.save`` file (which is
    what Lightning's ``.ckpt`` is); a directory is verified, not unpickled.
    """

    name: ClassVar[str] = "external"
    suffix: ClassVar[str] = ""
    every_rank_writes: ClassVar[bool] = True
    temp_dir_first: ClassVar[bool] = False  # the writer creates a file or a directory
    agree_written: ClassVar[bool] = True  # a framework's saver may end without a barrier

    def prepared(self, payload: Any) -> Any:
        assert isinstance(payload, External)
        return payload.checked()

    def data(self, payload: Any) -> Any:
        raise InvalidArgumentError("an External payload is written during save(), never copied")

    def write(self, store: PayloadStore, payload: Any, tmp: str, group: Any) -> FileInfo | None:
        assert isinstance(payload, External)
        result = payload.write(store.local_path(tmp))
        # a writer that wrote through ckptdb's own durable writer says so (see External)
        return result if isinstance(result, FileInfo) else None

    def seal(self, store: PayloadStore, tmp: str, written: FileInfo | None) -> FileInfo:
        return written if written is not None else store.seal_written(tmp)


TORCH_FILE = TorchFile()
SHARDED = ShardedDirectory()
EXTERNAL = ExternalWriter()
KINDS: tuple[PayloadKind, ...] = (TORCH_FILE, SHARDED, EXTERNAL)


def kind_of(payload: Any) -> PayloadKind:
    """The kind that writes ``payload``: sharded if wrapped in :class:`Sharded`,
    a framework's writer if :class:`External`, else one ``torch.save`` file."""
    if isinstance(payload, Sharded):
        return SHARDED
    return EXTERNAL if isinstance(payload, External) else TORCH_FILE


def kind_of_path(path: object) -> PayloadKind:
    """The kind of a stored checkpoint, by its name's suffix."""
    text = str(path)
    return next((k for k in (TORCH_FILE, SHARDED) if text.endswith(k.suffix)), TORCH_FILE)


def kind_named(name: str) -> PayloadKind:
    """The kind called ``name`` (as sent to other ranks in a distributed plan)."""
    return next(k for k in KINDS if k.name == name)
