"""A remote tier: the object store a run's checkpoints are copied to.

The one remote tier of this version is object storage (``s3://``), opened as
a save directory there is (same options, probed for conditional writes), and
used through the methods a copy needs: ``write_object`` (a unique key,
completed with ``If-None-Match: *`` and HEAD-checked), ``download``,
``remove_tree``, ``url_of`` and ``rel_of``. See :mod:`ckptdb.replication`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import InvalidArgumentError
from ..location import is_object_url
from .opening import open_store

#: The ``replicas.tier`` value of a copy on object storage.
REMOTE = "remote"


def remote_store(
    to: object, storage_options: Mapping[str, object] | None, *, probe: bool = True
) -> Any:
    """The object store of a remote tier at ``to``; ``probe``: checked for conditional
    writes first (a replicator writes; a restore only reads, with a credential that may
    be read-only)."""
    if not isinstance(to, str) or not is_object_url(to):
        raise InvalidArgumentError(
            "a remote tier must be an object-storage URL (s3://bucket/prefix)"
        )
    return open_store(to, storage_options, probe=probe)


__all__ = ["REMOTE", "remote_store"]
