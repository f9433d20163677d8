"""A SQLite ledger on a network filesystem is refused, unless overridden.

The mount table is a fake ``/proc/self/mounts`` (``ckptdb.ledger.netfs.MOUNTS_PATH``)
that declares part of ``tmp_path`` to be NFS, SMB, Lustre...
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import state

import ckptdb.ledger.netfs
from ckptdb import CheckpointManager
from ckptdb.cli import main
from ckptdb.errors import CkptDBError, InvalidArgumentError, NetworkFilesystemError
from ckptdb.ledger.netfs import check_ledger_location, mount_of, sqlite_path
from ckptdb.reader import RunReader

MountTable = Callable[..., Path]


@pytest.fixture
def mount_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MountTable:
    """Install a fake mount table: ``/`` is ext4, plus the (point, type) pairs given."""
    monkeypatch.delenv(ckptdb.ledger.netfs.ALLOW_ENV, raising=False)
    monkeypatch.delenv("CKPTDB_DB_URL", raising=False)

    def install(*mounts: tuple[Path | str, str]) -> Path:
        lines = ["/dev/vda / ext4 rw,relatime 0 0"]
        for point, fstype in mounts:
            escaped = str(point).replace("\\", "\\134").replace(" ", "\\040")
            lines.append(f"server:/export {escaped} {fstype} rw,relatime 0 0")
        table = tmp_path / "mounts"
        table.write_text("\n".join(lines) + "\n")
        monkeypatch.setattr(ckptdb.ledger.netfs, "MOUNTS_PATH", table)
        return table

    return install


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    directory = tmp_path / "shared"
    directory.mkdir()
    return directory


NETWORK = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse.sshfs", "lustre", "gpfs", "beegfs")


@pytest.mark.parametrize("fstype", [*NETWORK, "ceph", "glusterfs", "9p"])
def test_a_sqlite_ledger_on_a_network_filesystem_is_refused(
    mount_table: MountTable, shared: Path, fstype: str
) -> None:
    mount_table((shared, fstype))
    root = shared / "run"
    with pytest.raises(NetworkFilesystemError) as info:
        CheckpointManager(root)
    err = info.value
    assert isinstance(err, CkptDBError) and isinstance(err, ValueError)
    assert isinstance(err, InvalidArgumentError)
    message = str(err)
    assert fstype in message and str(shared) in message
    assert "postgresql+psycopg://" in message  # what to use instead
    assert "db_url" in message and "CKPTDB_ALLOW_NETWORK_SQLITE=1" in message
    assert not root.exists()  # refused before anything was created


@pytest.mark.parametrize("fstype", ["ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs"])
def test_local_filesystems_are_fine(mount_table: MountTable, shared: Path, fstype: str) -> None:
    table = mount_table((shared, fstype))
    ledger = shared / "run" / "ckptdb.sqlite"
    assert mount_of(ledger, table) == (str(shared), fstype)  # what the check looks at
    with CheckpointManager(shared / "run") as mgr:
        mgr.save(1, model=state(1))
        assert mgr.latest().step == 1
    assert ledger.is_file()  # the ledger is on that filesystem, where it was refused nothing


def test_the_longest_mount_point_wins(mount_table: MountTable, shared: Path) -> None:
    local = shared / "scratch"
    table = mount_table((shared, "nfs"), (local, "ext4"))
    assert mount_of(local / "run" / "ckptdb.sqlite", table) == (str(local), "ext4")
    assert mount_of(shared / "scratchpad" / "run" / "ckptdb.sqlite", table) == (str(shared), "nfs")
    with CheckpointManager(local / "run") as mgr:  # a local disk mounted inside the NFS tree
        mgr.save(1, model=state(1))
        assert mgr.latest().step == 1
    assert (local / "run" / "ckptdb.sqlite").is_file()
    with pytest.raises(NetworkFilesystemError):
        CheckpointManager(shared / "scratchpad" / "run")  # a sibling name is not inside


def test_the_last_mount_on_a_point_wins(mount_table: MountTable, shared: Path) -> None:
    table = mount_table((shared, "ext4"), (shared, "nfs4"))
    assert mount_of(shared / "run" / "ckptdb.sqlite", table) == (str(shared), "nfs4")


def test_escaped_mount_points_and_symlinks(mount_table: MountTable, tmp_path: Path) -> None:
    spaced = tmp_path / "my share"
    spaced.mkdir()
    table = mount_table((spaced, "cifs"))
    assert mount_of(spaced / "a" / "ckptdb.sqlite", table) == (str(spaced), "cifs")
    link = tmp_path / "link"
    link.symlink_to(spaced)
    assert mount_of(link / "ckptdb.sqlite", table) == (str(spaced), "cifs")  # resolved
    with pytest.raises(NetworkFilesystemError):
        CheckpointManager(link / "run")


def test_the_environment_variable_overrides(
    mount_table: MountTable, shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = mount_table((shared, "nfs"))
    ledger = shared / "run" / "ckptdb.sqlite"
    assert mount_of(ledger, table) == (str(shared), "nfs")
    monkeypatch.setenv("CKPTDB_ALLOW_NETWORK_SQLITE", "1")
    with CheckpointManager(shared / "run") as mgr:
        mgr.save(1, model=state(1))
    assert ledger.is_file()  # on the NFS mount, as the override allows
    with RunReader(shared / "run") as reader:
        assert reader.latest().step == 1
    monkeypatch.setenv("CKPTDB_ALLOW_NETWORK_SQLITE", "0")
    with pytest.raises(NetworkFilesystemError):
        CheckpointManager(shared / "run")


def test_the_keyword_overrides(mount_table: MountTable, shared: Path) -> None:
    mount_table((shared, "lustre"))
    with CheckpointManager(shared / "run", allow_network_sqlite=True) as mgr:
        mgr.save(1, model=state(1))
        assert mgr.latest().step == 1


def test_a_local_db_url_is_allowed_for_a_run_on_a_network_filesystem(
    mount_table: MountTable, shared: Path, tmp_path: Path
) -> None:
    mount_table((shared, "nfs4"))
    url = f"sqlite:///{tmp_path / 'local' / 'ledger.sqlite'}"
    (tmp_path / "local").mkdir()
    with CheckpointManager(shared / "run", db_url=url) as mgr:
        mgr.save(1, model=state(1))
    assert (shared / "run" / "checkpoints" / "model" / "step-000000001.pt").exists()
    assert (tmp_path / "local" / "ledger.sqlite").is_file()  # the ledger is where the URL says
    assert not (shared / "run" / "ckptdb.sqlite").exists()  # and not on the NFS mount
    # ... but an explicit SQLite URL on the network filesystem is not
    with pytest.raises(NetworkFilesystemError):
        CheckpointManager(tmp_path / "elsewhere", db_url=f"sqlite:///{shared / 'l.sqlite'}")


def test_readers_are_not_refused(
    mount_table: MountTable, shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only writers are refused; looking at a run someone forced onto NFS still works."""
    mount_table((shared, "nfs"))
    with CheckpointManager(shared / "run", allow_network_sqlite=True) as mgr:
        mgr.save(1, model=state(1))
    with RunReader(shared / "run") as reader:
        assert reader.latest().step == 1


def test_cli_writers_are_refused_and_readers_are_not(
    mount_table: MountTable, shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mount_table((shared, "nfs"))
    root = shared / "run"
    with CheckpointManager(root, allow_network_sqlite=True) as mgr:
        mgr.save(1, model=state(1))
    runner = CliRunner()
    for args in (["gc", str(root)], ["reconcile", str(root)], ["db", "upgrade", str(root)]):
        result = runner.invoke(main, args)
        assert result.exit_code == 1, (args, result.output)
        assert "network filesystem" in result.output and "Traceback" not in result.output
    latest = runner.invoke(main, ["latest", str(root)])
    assert latest.exit_code == 0, latest.output
    assert latest.stdout == f"{root / 'checkpoints' / 'model' / 'step-000000001.pt'}\n"
    monkeypatch.setenv("CKPTDB_ALLOW_NETWORK_SQLITE", "1")
    gc = runner.invoke(main, ["gc", str(root)])
    assert gc.exit_code == 0, gc.output
    assert gc.stdout == "0 checkpoint(s) evicted\n"


def test_no_mount_table_means_no_check(
    mount_table: MountTable, shared: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(ckptdb.ledger.netfs, "MOUNTS_PATH", tmp_path / "no-such-file")
    assert mount_of(shared) is None
    assert check_ledger_location(f"sqlite:///{shared / 'ckptdb.sqlite'}") is None  # no refusal
    with CheckpointManager(shared / "run") as mgr:  # a writer opens as on any disk
        mgr.save(1, model=state(1))
        assert mgr.latest().step == 1
    assert (shared / "run" / "ckptdb.sqlite").is_file()


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("sqlite:////data/run/ckptdb.sqlite", "/data/run/ckptdb.sqlite"),
        ("sqlite:///rel/ckptdb.sqlite", "rel/ckptdb.sqlite"),
        ("sqlite:///file:/data/l.sqlite?mode=ro&uri=true", "/data/l.sqlite"),
        ("sqlite://", None),
        ("sqlite:///:memory:", None),
        ("postgresql+psycopg://u@h/db", None),
        ("not a url", None),
    ],
)
def test_sqlite_path_of_a_url(url: str, expected: str | None) -> None:
    found = sqlite_path(url)
    assert (str(found) if found is not None else None) == expected


def test_the_real_mount_table_is_read(tmp_path: Path) -> None:
    """On Linux, the real table answers for any path (the root mount at least)."""
    if not Path("/proc/self/mounts").exists():
        pytest.skip("no /proc/self/mounts")
    found = mount_of(tmp_path)
    assert found is not None and found[0].startswith("/")
