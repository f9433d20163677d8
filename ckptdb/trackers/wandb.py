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
    """The W&B side of a :class:`~ckptdb.trackers.Mirror`: one W&B run per ckptdb run.

    Pass it to a :class:`~ckptdb.trackers.Mirror`, which calls its methods;
    what goes where in W&B is described in the module doc and
    docs/trackers.md. The W&B run id ``ckptdb-<token>`` is derived from the
    ckptdb run and opened with ``resume="allow"``, so every follower of the
    run, on any machine, online or offline, writes to the same W&B run. W&B
    writes asynchronously; a follower opening the run reads back what W&B
    holds and logs the rest again. Needs the ``wandb`` extra
    (``pip install 'ckptdb[wandb]'``).

    Args:
        project: The W&B project to log into.
        entity: The W&B entity (user or team) that owns the project; None
            (the default): W&B's default entity.
        directory: Where W&B writes its run files (its ``dir``), created if
            missing; None (the default): the current directory. An offline
            follower restarted later must use the same one, since it reads
            the earlier offline runs' transaction logs there.
        offline: Log offline (default False); ``wandb sync`` uploads later.
            Offline, ``on_evict="delete"`` is refused.

    Attributes:
        kind: ``"wandb"``: the tracker's name in the ledger and in
            ``ckptdb follow --to``.
        project: The project.
        entity: The entity, or None.
        offline: Whether it logs offline.
        directory: W&B's ``dir``, absolute.
        target: ``<entity>/<project>`` (and ``#offline:<directory>`` offline):
            the key of this tracker's row in the ledger.
        run: The W&B run, once :meth:`open` started it (None after
            :meth:`close`).

    Raises:
        MissingExtraError: When ``wandb`` is not installed.
        InvalidArgumentError: When ``project`` is not a non-empty str.
    """

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
        """Start (or resume) the W&B run of a ckptdb run.

        Every metric is plotted against ``ckptdb/step``. Offline, the earlier
        offline runs of the same id under ``directory`` are read first (what
        they logged), and a follower restarted within the same second waits
        for the next one: W&B names an offline run's directory by the second,
        and a second run in it would replace the first one's log.

        Args:
            token: The ckptdb run's token: the run id is ``ckptdb-<token>``,
                and the run's config records it as ``ckptdb/run``.
            run_name: The W&B run's name; also the start of its artifacts'
                names (``<run>-<stream>``, other characters than letters,
                digits, ``_``, ``.`` and ``-`` replaced).
            known: The W&B run's id as the ledger keeps it; None:
                ``ckptdb-<token>``.
            streams: The followed streams (W&B needs no per-stream setup).

        Returns:
            The W&B run's id.
        """
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
        """What the W&B run holds, read back from W&B.

        ``run.log`` and ``log_artifact`` return before W&B's own writer has
        the data, so a follower killed meanwhile may have lost what the
        ledger calls mirrored; the mirror goes back to what this returns.
        Online it asks the W&B API (the run's history and logged artifacts);
        offline it uses the transaction logs of the earlier offline runs read
        by :meth:`open`.

        Returns:
            The largest ``ckptdb/metric_id`` the run holds (0: none), and the
            ledger ids of the checkpoints logged as artifact versions.
        """
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
        """Which points W&B holds already: those up to the largest ``ckptdb/metric_id``.

        Rows are logged in the ledger's order, each whole, so every point up
        to the last one W&B holds is there. Reads :meth:`holds` once, if the
        mirror has not.

        Args:
            points: Metric points of the ledger, oldest first.

        Returns:
            The ids of those W&B holds.
        """
        if self._held is None:
            self._held = self.holds()
        return {p.id for p in points if p.id <= self._held.metric_id}

    def log_metrics(self, points: list[Point]) -> None:
        """Log metric points as history rows, one per step.

        Each row carries the training step as ``ckptdb/step`` (a step redone
        after a crash is a row of its own, not one W&B drops for going
        backwards), the ledger's wall time as ``ckptdb/wall_time`` and the id
        of its last point as ``ckptdb/metric_id``. A name logged twice at one
        step starts a second row; a value the ledger holds as NULL is logged
        as NaN.

        Args:
            points: Metric points of the ledger, oldest first.
        """
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
        """Log a checkpoint as a version of the artifact ``<run>-<stream>`` (type ``model``).

        Its metadata are the ledger id, stream, step and metrics; its aliases
        ``ckpt-<id>`` (its own for good), ``step-<N>`` (which a redone step's
        new version takes over) and ``aliases``. Online, it waits for the
        upload, so the ledger never records a checkpoint W&B lacks. A version
        logged again with the same files is the same version (W&B dedupes by
        digest), so a restarted follower never makes two.

        Args:
            checkpoint: The checkpoint, as the ledger records it.
            local: Its verified file or directory on disk.
            aliases: Those of ``latest``/``best`` it holds in the ledger, given
                to the version as it is logged.

        Returns:
            ``<run>-<stream>:ckpt-<id>``, the version's name.
        """
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
        """Point ``latest`` and ``best`` of a stream at these checkpoints.

        W&B gives ``latest`` to every version it logs, so moving an alias
        logs the version that should hold it again (the same digest: no new
        version, nothing uploaded), ``best`` first and ``latest`` last.
        Nothing is logged when this process logged them where they belong.

        Args:
            stream: The stream.
            wanted: Alias (``latest``, ``best``) -> the checkpoint it should
                name.
        """
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
        """Record an evicted checkpoint in the run's summary; with ``"delete"``, delete it.

        The summary key ``ckptdb/evicted/<stream>/ckpt-<id>`` holds its state
        and step, either way.

        Args:
            checkpoint: The checkpoint; its ``state`` is what is recorded.
            logged: Its version's name in W&B.
            how: ``"mark"``: the summary only; ``"delete"``: its artifact
                version (``ckpt-<id>``) is also deleted, with its aliases,
                through the W&B API (online only).
        """
        name = f"ckptdb/evicted/{checkpoint.stream}/ckpt-{checkpoint.id}"
        self.run.summary[name] = f"{checkpoint.state} (step {checkpoint.step})"
        if how == "delete":
            api = self._wandb.Api()
            path = f"{self.run.entity}/{self.run.project}/{logged.where}"
            api.artifact(path, type="model").delete(delete_aliases=True)

    def check_eviction(self, how: str) -> None:
        """Refuse ``on_evict="delete"`` offline, before anything is written.

        Deleting an artifact version goes through the W&B API, which needs
        the run online.

        Args:
            how: ``"mark"`` or ``"delete"``.

        Raises:
            InvalidArgumentError: When ``how`` is ``"delete"`` and the sink is
                offline.
        """
        if how == "delete" and self.offline:
            raise InvalidArgumentError(
                "on_evict='delete' removes an artifact version through the W&B API: it needs "
                "the run online (offline, use 'mark')"
            )

    def close(self) -> None:
        """Finish the W&B run, so W&B's writer flushes what was logged (idempotent)."""
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
