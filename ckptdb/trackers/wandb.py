"""The Weights & Biases side of a mirror: one W&B run per ckptdb run.

- The W&B run id is ``ckptdb-<token>``, derived from the ckptdb run, and
  opened with ``resume="allow"``: every follower of the run, on any machine,
  online or offline, writes to the same W&B run.
- Metrics: one history row per step (a name logged twice at a step gets a
  second row), with the training step as ``ckptdb/step`` (every metric is
  plotted against it: a step redone after a crash is a row of its own, not
  one W&B drops for going backwards), the ledger's wall time as
  ``ckptdb/wall_time``, and ``ckptdb/metric_id``, the id of the row's last
  ledger point. ``run.log`` returns before W&B's own writer has the row, so
  a follower opening the run goes back to what W&B holds: the largest
  ``ckptdb/metric_id`` and the checkpoints' versions, read from the W&B API
  online, from the earlier offline runs' transaction logs offline
  (:mod:`.wandbfile`), and logs the rest again.
- Each checkpoint is a version of the artifact ``<run>-<stream>`` (type
  ``model``), its metadata the ledger id, step and metrics, its aliases
  ``ckpt-<id>`` (its own for good), ``step-<N>`` and whichever of
  ``latest``/``best`` it holds. Online, the follower waits for the upload
  before the ledger records it. A version
  logged again with the same files is the same version (W&B dedupes by
  digest), so a follower restarted after a log never makes two.
- ``latest`` and ``best``: W&B gives ``latest`` to every version it logs, so
  moving an alias means logging the version that should hold it again (no
  upload: the same digest), ``best`` first and ``latest`` last.
- An evicted checkpoint: ``mark`` records it in the run's summary
  (``ckptdb/evicted/<stream>/ckpt-<id>``: its state and step); ``delete``
  removes its artifact version (``ckpt-<id>``) through the W&B API, which
  needs the run online.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from ..ledger.trackers import Point
from ..record import Checkpoint
from . import Aliased, Held, Logged, missing_extra
from .wandbfile import METRIC_ID, logged_offline
from .wandbfile import Logged as OfflineLog

STEP, WALL_TIME = "ckptdb/step", "ckptdb/wall_time"


class WandbSink:
    """Mirrors into the W&B ``project`` (of ``entity``); ``directory``: where W&B writes
    its run files (its ``dir``); ``offline``: log offline (``wandb sync`` uploads)."""

    kind = "wandb"

    def __init__(
        self,
        project: str,
        *,
        entity: str | None = None,
        directory: str | os.PathLike[str] | None = None,
        offline: bool = False,
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise missing_extra("wandb", "wandb") from exc
        if not isinstance(project, str) or not project:
            raise InvalidArgumentError(f"project must be a non-empty str, got {project!r}")
        self._wandb = wandb
        self.project, self.entity, self.offline = project, entity, bool(offline)
        self.directory = Path(directory if directory is not None else os.getcwd()).resolve()
        self.target = f"{entity or ''}/{project}" + (
            f"#offline:{self.directory}" if offline else ""
        )
        self.run: Any = None
        self._name = ""
        #: (stream, alias) -> the checkpoint id that holds it, as this process logged it
        self._holds: dict[tuple[str, str], int] = {}
        self._logged_offline: OfflineLog | None = None
        self._held: Held | None = None  # what the run held when this follower opened it

    def open(self, token: str, run_name: str, known: str | None, streams: list[str]) -> str:
        ident = known or f"ckptdb-{token}"
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.offline:  # before this run's own file exists
            self._logged_offline = logged_offline(self.directory, ident)
            _next_second_if_taken(self.directory, ident)
        self.run = self._wandb.init(
            project=self.project,
            entity=self.entity,
            dir=str(self.directory),
            id=ident,
            resume="allow",
            name=run_name,
            mode="offline" if self.offline else "online",
            config={"ckptdb/run": token},
            settings=self._wandb.Settings(silent=True, console="off"),
        )
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)
        self._name = _artifact_name(run_name)
        return ident

    def holds(self) -> Held:
        """What the W&B run holds: ``run.log`` and ``log_artifact`` return before W&B's
        own writer has the data, so a follower killed meanwhile may have lost it."""
        if self._logged_offline is not None:
            offline = self._logged_offline
            self._held = Held(offline.last_metric_id, set(offline.checkpoints))
            return self._held
        found = self._wandb.Api().run(f"{self.run.entity}/{self.run.project}/{self.run.id}")
        last = max((int(r[METRIC_ID]) for r in found.scan_history(keys=[METRIC_ID])), default=0)
        logged = {a.metadata.get("ckptdb_id") for a in found.logged_artifacts()}
        self._held = Held(last, {int(i) for i in logged if i is not None})
        return self._held

    def already_logged(self, points: list[Point]) -> set[int]:
        """The points up to the largest ``ckptdb/metric_id`` W&B holds (rows are logged in
        the ledger's order, each whole)."""
        if self._held is None:
            self._held = self.holds()
        return {p.id for p in points if p.id <= self._held.metric_id}

    def log_metrics(self, points: list[Point]) -> None:
        row: dict[str, Any] = {}
        for point in points:
            if row and (row[STEP] != point.step or point.name in row):
                self.run.log(row)
                row = {}
            row.update({STEP: point.step, WALL_TIME: point.wall_time, METRIC_ID: point.id})
            row[point.name] = float("nan") if point.value is None else point.value
        if row:
            self.run.log(row)

    def log_checkpoint(self, checkpoint: Checkpoint, local: Path, aliases: list[str]) -> Logged:
        self._log(checkpoint, local, aliases)
        return Logged(f"{self._name}-{checkpoint.stream}:ckpt-{checkpoint.id}")

    def _log(self, checkpoint: Checkpoint, local: Path, aliases: list[str]) -> None:
        artifact = self._wandb.Artifact(
            f"{self._name}-{checkpoint.stream}",
            type="model",
            metadata={
                "ckptdb_id": checkpoint.id,
                "stream": checkpoint.stream,
                "step": checkpoint.step,
                "metrics": checkpoint.metrics,
            },
        )
        if local.is_dir():
            artifact.add_dir(str(local), name=local.name)
        else:
            artifact.add_file(str(local), name=local.name)
        unique = f"ckpt-{checkpoint.id}"  # step-N moves to a redone step's new version
        logged = self.run.log_artifact(
            artifact, aliases=[unique, f"step-{checkpoint.step}", *aliases]
        )
        if not self.offline:
            logged.wait()  # uploaded before the ledger says so
        self._holds[(checkpoint.stream, "latest")] = checkpoint.id  # W&B's own doing
        for alias in aliases:
            self._holds[(checkpoint.stream, alias)] = checkpoint.id

    def set_aliases(self, stream: str, wanted: dict[str, Aliased]) -> None:
        if all(self._holds.get((stream, a)) == w.checkpoint.id for a, w in wanted.items()):
            return
        latest, best = wanted.get("latest"), wanted.get("best")
        same = (
            best is not None and latest is not None and best.checkpoint.id == latest.checkpoint.id
        )
        if best is not None and not same:
            self._log(best.checkpoint, best.local(), ["best"])
        if latest is not None:
            self._log(latest.checkpoint, latest.local(), ["latest", *(["best"] if same else [])])

    def evict(self, checkpoint: Checkpoint, logged: Logged, how: str) -> None:
        name = f"ckptdb/evicted/{checkpoint.stream}/ckpt-{checkpoint.id}"
        self.run.summary[name] = f"{checkpoint.state} (step {checkpoint.step})"
        if how == "delete":
            api = self._wandb.Api()
            path = f"{self.run.entity}/{self.run.project}/{logged.where}"
            api.artifact(path, type="model").delete(delete_aliases=True)

    def check_eviction(self, how: str) -> None:
        if how == "delete" and self.offline:
            raise InvalidArgumentError(
                "on_evict='delete' removes an artifact version through the W&B API: it needs "
                "the run online (offline, use 'mark')"
            )

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _next_second_if_taken(directory: Path, ident: str) -> None:
    """An offline run's directory is named by the second it started in; a second run of
    the same id in the same second would reuse it and replace the first one's
    transaction log (what it logged, lost before ``wandb sync``). Wait for a free one
    (the name in local time or UTC: either may be W&B's)."""
    while True:
        now = time.time()
        names = {
            time.strftime("%Y%m%d_%H%M%S", clock(now)) for clock in (time.localtime, time.gmtime)
        }
        if not any((directory / "wandb" / f"offline-run-{n}-{ident}").exists() for n in names):
            return
        time.sleep(1.0 - now % 1.0 + 0.01)


def _artifact_name(run_name: str) -> str:
    """W&B artifact names: letters, digits, dashes, underscores and dots."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", run_name).strip("-") or "run"
