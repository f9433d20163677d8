"""A full disk: a small tmpfs mounted by the test holds the run, and fills up.

The save that does not fit fails with ``PublishError`` naming the file and
``No space left on device``; nothing partial is left (no temporary file, no
row but the aborted one); the manager goes on, and once space is freed the
next save succeeds and the run checks clean.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptdb import CheckpointManager, Keep, RunReader
from ckptdb.errors import PublishError

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_db_url_from_environment")]

DISK = 4 * 1024 * 1024  # bytes of the tmpfs
PAYLOAD = 1024 * 1024 // 4  # float32 elements: 1 MiB per checkpoint


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(disk: Path, leave: int) -> Path:
    """A file that takes all but ``leave`` bytes of the disk."""
    stats = os.statvfs(disk)
    free = stats.f_bavail * stats.f_frsize
    filler = disk / "filler"
    with open(filler, "wb") as out:
        out.write(b"\0" * max(0, free - leave))
    return filler


def test_a_save_that_does_not_fit_fails_naming_the_disk_and_the_next_one_works(
    small_disk: Path,
) -> None:
    root = small_disk / "run"
    payload = {"w": torch.ones(PAYLOAD)}
    with CheckpointManager(root, streams={"model": Keep(last=None)}) as mgr:
        mgr.save(1, model=payload)
        filler = fill(small_disk, leave=256 * 1024)  # room for the ledger, not the payload
        with pytest.raises(PublishError) as failed:
            mgr.save(2, model=payload)
        assert failed.value.phase in ("write", "fsync")
        assert "No space left on device" in str(failed.value)
        assert str(root / "checkpoints") in str(failed.value)  # names where it was writing
        leftovers = sorted(p.name for p in (root / "checkpoints" / "model").iterdir())
        assert leftovers == [mgr.latest().path.name]  # nothing partial of step 2
        filler.unlink()
        mgr.save(3, model=payload)
        assert [c.step for c in mgr.checkpoints("model")] == [1, 3]
        assert mgr.check() == []
    with RunReader(root) as reader:
        states = sorted(
            (c.step, c.state) for c in reader.checkpoints(states=("committed", "aborted"))
        )
    assert states == [(1, "committed"), (2, "aborted"), (3, "committed")]
