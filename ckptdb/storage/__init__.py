"""Where payloads live: the storage seam, its local implementation, payload kinds.

- :mod:`~ckptdb.storage.base`: the :class:`PayloadStore` protocol (the seam);
- :mod:`~ckptdb.storage.opening`: :func:`open_store`, the store of a location (local or object);
- :mod:`~ckptdb.storage.local`: :class:`LocalStore`, on a POSIX filesystem;
- :mod:`~ckptdb.storage.kinds`: payload kinds (a ``torch.save`` file, a DCP directory);
- :mod:`~ckptdb.storage.files`: the durable file primitives the local store uses;
- :mod:`~ckptdb.storage.naming`: how our files are named;
- :mod:`~ckptdb.storage.dcp`: ``torch.distributed.checkpoint`` and :class:`Sharded`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import lazy

if TYPE_CHECKING:
    from .base import Finding, Found, PayloadStore
    from .dcp import Sharded
    from .files import FileInfo, HashingWriter, hash_checkpoint, hash_file
    from .kinds import PayloadKind, kind_of, kind_of_path
    from .local import LocalStore
    from .naming import CHECKPOINT_NAME, TEMP_NAME, checkpoint_name, is_sharded, temp_name
    from .opening import open_store

#: Where each name lives, imported on first use (:mod:`ckptdb.lazy`): a reader that only names
#: files (``naming``) or checks a store never imports torch through ``dcp``/``kinds``.
_PUBLIC = {
    **dict.fromkeys(("Finding", "Found", "PayloadStore"), ".base"),
    "Sharded": ".dcp",
    **dict.fromkeys(("FileInfo", "HashingWriter", "hash_checkpoint", "hash_file"), ".files"),
    **dict.fromkeys(("PayloadKind", "kind_of", "kind_of_path"), ".kinds"),
    "LocalStore": ".local",
    **dict.fromkeys(
        ("CHECKPOINT_NAME", "TEMP_NAME", "checkpoint_name", "is_sharded", "temp_name"), ".naming"
    ),
    "open_store": ".opening",
}


if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy.attributes(__name__, _PUBLIC)

__all__ = [
    "CHECKPOINT_NAME",
    "TEMP_NAME",
    "FileInfo",
    "Finding",
    "Found",
    "HashingWriter",
    "LocalStore",
    "PayloadKind",
    "PayloadStore",
    "Sharded",
    "checkpoint_name",
    "hash_checkpoint",
    "hash_file",
    "is_sharded",
    "kind_of",
    "kind_of_path",
    "open_store",
    "temp_name",
]
