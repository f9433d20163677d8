"""A recording seam: the requests to an object store, for tests.

A no-op hook, like :mod:`ckptdb.faults`: the S3 client
(:class:`ckptdb.storage.s3client.Calls`) calls :func:`record` on both sides
of every request, and it does nothing unless a test installed a hook. The
power-loss explorer (``tests/powerloss/``) installs one to know which
requests a power cut of the client may leave sent and unanswered: what
that leaves in the store depends on whether a request's response was
received, which no system call shows.

The explorer learns everything else from the system calls the process
really makes (it traces them), never from the library's account of its own
file work: that would hide an fsync of the wrong descriptor, a rename gone
elsewhere, or an fsync a refactor removed.

Operations and their fields:

- ``s3_request`` (``operation``, ``params``): a request about to be sent to
  the object store (every request, reads included);
- ``s3_response`` (``operation``, ``params``, ``answer``): the same request
  once it succeeded. ``params`` is the same object in both (its ``Body``, a
  buffer, must be copied before returning).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

Hook = Callable[[str, Mapping[str, object]], None]

_hook: Hook | None = None


def record(op: str, **fields: object) -> None:
    if _hook is not None:
        _hook(op, fields)


def set_hook(hook: Hook | None) -> Hook | None:
    """Install ``hook`` (None removes it); returns the previous one."""
    global _hook
    previous, _hook = _hook, hook
    return previous
