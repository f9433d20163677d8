"""A recording seam: the durable operations of the storage and the ledger, for tests.

A no-op hook, like :mod:`ckptdb.faults`: the file primitives
(:mod:`ckptdb.storage.files`) and the ledger's transactions call
:func:`record` after each operation that decides what survives a power
loss, and it does nothing unless a test installed a hook. The power-loss
explorer (``tests/powerloss/``) installs one that keeps the trace, then
builds from it every state the disk may be left in by a power cut, which
no process kill can produce.

Operations and their fields (paths are absolute; each is recorded once it
succeeded, so a failed call leaves nothing in the trace):

- ``create`` (``path``): a new file, created exclusively;
- ``write`` (``path``, ``offset``, ``data``): bytes written at an offset (a
  buffer the hook must copy before returning);
- ``fsync`` (``path``): a file's data and size made durable;
- ``rename`` (``source``, ``target``): ``os.replace``/``os.rename``;
- ``unlink`` (``path``), ``rmtree`` (``path``: a directory and all it held),
  ``mkdir`` (``path``), ``rmdir`` (``path``);
- ``fsync_dir`` (``path``): a directory's entries made durable;
- ``commit`` (``database``, ``backend``, ``durable``): a ledger transaction
  committed, with SQLite's ``synchronous=FULL`` (``durable``) or ``NORMAL``;
- ``s3_request`` (``operation``, ``params``): a request about to be sent to
  the object store (:class:`ckptdb.storage.s3client.Calls`: every request,
  reads included), and ``s3_response`` (``operation``, ``params``,
  ``answer``) once it succeeded. These two are recorded on both sides of the
  request, not after it: what a power cut of the client leaves depends on
  whether the response of a request was received. ``params`` is the same
  object in both (its ``Body``, a buffer, must be copied before returning).
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
