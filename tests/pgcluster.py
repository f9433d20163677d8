"""A private PostgreSQL cluster for tests that stop and start the server.

Never the shared server on 5432: ``initdb`` as the ``postgres`` user into a
temporary directory, a free port, a socket directory of its own. ``stop``
takes pg_ctl's modes (``fast``: sessions are ended cleanly; ``immediate``:
the postmaster and its backends are killed, as in a crash); ``start`` brings
the same cluster back on the same port, so URLs stay valid.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

#: Where initdb and pg_ctl are (a Debian layout, or on PATH).
_BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)


def _tool(name: str) -> str | None:
    for directory in _BIN_DIRS:
        if (directory / name).exists():
            return str(directory / name)
    return shutil.which(name)


def available() -> str | None:
    """Why a private cluster cannot be made here, or None when it can."""
    if _tool("initdb") is None or _tool("pg_ctl") is None:
        return "initdb/pg_ctl not installed"
    if os.geteuid() != 0 and os.environ.get("USER") != "postgres":
        return "initdb must run as the postgres user (the tests run it with runuser as root)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """One initdb'd cluster under ``base`` (which the postgres user must be able to enter)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.data = base / "data"
        self.sockets = base / "sockets"
        self.port = _free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        for path in (base, self.sockets):
            path.mkdir(parents=True, exist_ok=True)
        _open_to_postgres(base)
        self._as_postgres(_tool("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres")

    def _as_postgres(self, *command: str | None, check: bool = True) -> int:
        args = [str(c) for c in command if c is not None]
        if os.geteuid() == 0:
            args = ["runuser", "-u", "postgres", "--", *args]
        done = subprocess.run(args, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            log = self.base / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(
                f"{' '.join(args)} exited {done.returncode}: {done.stdout}{done.stderr}\n{tail}"
            )
        return done.returncode

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c max_connections=40"
        )
        self._as_postgres(
            _tool("pg_ctl"), "-D", str(self.data), "-o", options, "-l",
            str(self.base / "server.log"), "-w", "-t", "30", "start",
        )  # fmt: skip

    def running(self) -> bool:
        """``pg_ctl status``: 0 while the server runs."""
        return self._as_postgres(_tool("pg_ctl"), "-D", str(self.data), "status", check=False) == 0

    def stop(self, mode: str = "fast") -> None:
        self._as_postgres(_tool("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def close(self) -> None:
        """Stop the server (if running) for good."""
        self._as_postgres(
            _tool("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False
        )


def _open_to_postgres(path: Path) -> None:
    """Let the postgres user reach ``path``: it and every parent traversable, it owned."""
    if os.geteuid() != 0:
        return
    shutil.chown(path, "postgres", "postgres")
    for directory in [path, *path.parents]:
        mode = directory.stat().st_mode
        if not mode & 0o001:
            directory.chmod(mode | 0o001)
    for child in path.iterdir():
        shutil.chown(child, "postgres", "postgres")
