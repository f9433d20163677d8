"""Refuse a SQLite ledger on a network filesystem.

SQLite's locking (and WAL's shared memory) is not reliable on NFS, SMB,
Lustre and the like: two nodes can both believe they hold the write lock,
and the ledger is silently corrupted. A writer whose SQLite file would live on
such a filesystem is refused with :class:`NetworkFilesystemError`, which says
what to use instead: a PostgreSQL ledger, or a ``db_url`` on a local disk.
The filesystem is the mount (longest mount-point prefix of the ledger's real
path) in ``/proc/self/mounts``; where that file does not exist (not Linux),
nothing is checked. ``CKPTDB_ALLOW_NETWORK_SQLITE=1`` or
``allow_network_sqlite=True`` overrides the check.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from ..errors import NetworkFilesystemError

MOUNTS_PATH = Path("/proc/self/mounts")
ALLOW_ENV = "CKPTDB_ALLOW_NETWORK_SQLITE"

NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb",
        "smb3",
        "smbfs",
        "ncpfs",
        "afs",
        "9p",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "glusterfs",
        "panfs",
        "pvfs2",
        "orangefs",
        "davfs",
        "fuse.sshfs",
        "fuse.ceph",
        "fuse.cephfs",
        "fuse.glusterfs",
        "fuse.beegfs",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.rclone",
        "fuse.juicefs",
        "fuse.davfs",
    }
)
_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """Mount fields escape space, tab, newline and backslash as ``\\ooo``."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str | os.PathLike[str], mounts: Path | None = None) -> tuple[str, str] | None:
    """(mount point, filesystem type) holding ``path``, or None if the table is unreadable.

    ``path`` need not exist yet; its existing part is resolved (symlinks
    followed) first. Of several mounts on one point, the last one wins.
    """
    try:
        table = (mounts or MOUNTS_PATH).read_text(errors="surrogateescape")
    except OSError:
        return None
    target = os.path.realpath(path)
    best: tuple[str, str] | None = None
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point, fstype = _unescape(fields[1]), fields[2]
        inside = point == "/" or target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fstype)
    return best


def is_network_filesystem(fstype: str) -> bool:
    return fstype in NETWORK_FILESYSTEMS


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL; None for another backend or an in-memory database."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    if parsed.get_backend_name() != "sqlite":
        return None
    database = parsed.database or ""
    if database.startswith("file:"):  # sqlite:///file:PATH?mode=...&uri=true
        database = database[len("file:") :].split("?", 1)[0]
    if database in ("", ":memory:") or parsed.query.get("mode") == "memory":
        return None
    return Path(database)


def _allowed_by_env() -> bool:
    return os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def check_ledger_location(url: str, *, allow: bool = False, mounts: Path | None = None) -> None:
    """Refuse a SQLite ledger on a network filesystem (see the module docstring)."""
    path = sqlite_path(url)
    if path is None or allow or _allowed_by_env():
        return
    found = mount_of(path, mounts)
    if found is None or not is_network_filesystem(found[1]):
        return
    point, fstype = found
    raise NetworkFilesystemError(
        f"the SQLite ledger {path} would be on a network filesystem ({fstype} mounted at "
        f"{point}), where SQLite's locking is unreliable and the ledger can be corrupted. "
        "Use a PostgreSQL ledger (db_url='postgresql+psycopg://user@host/dbname', "
        "--db-url or CKPTDB_DB_URL), or keep the checkpoints there and put the ledger on a "
        "local disk (db_url='sqlite:////local/path/ckptdb.sqlite'). To use it anyway, set "
        f"{ALLOW_ENV}=1 (or pass allow_network_sqlite=True)."
    )
