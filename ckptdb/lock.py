"""One writer per run: a file lock in the run root, and who holds it.

The lock itself is ``<root>/ckptdb.lock`` (``filelock``, released by the OS
when the holder dies, so a crash never leaves a stale lock). The holder writes
its pid and host to ``<root>/ckptdb.owner`` so a refused second writer can say
who is in the way.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from filelock import FileLock, Timeout

from .errors import LedgerLockedError

LOCK_NAME = "ckptdb.lock"
OWNER_NAME = "ckptdb.owner"


class WriterLock:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = FileLock(str(root / LOCK_NAME), timeout=0, thread_local=False)

    def acquire(self) -> None:
        """Take the lock at once or raise :class:`LedgerLockedError` naming the holder."""
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            holder = self._read_owner()
            who = (
                f"pid {holder.get('pid')} on host {holder.get('host')}"
                if holder
                else "another process"
            )
            raise LedgerLockedError(
                f"run {self.root} is open for writing by {who}; only one writer per run "
                "(readers such as `ckptdb status` need no lock)",
                holder=holder,
            ) from None
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        tmp = self.root / f".{OWNER_NAME}.{os.getpid()}"
        tmp.write_text(json.dumps(owner))
        os.replace(tmp, self.root / OWNER_NAME)

    def _read_owner(self) -> dict[str, object]:
        try:
            data = json.loads((self.root / OWNER_NAME).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def release(self) -> None:
        if self._lock.is_locked:
            self._lock.release()
