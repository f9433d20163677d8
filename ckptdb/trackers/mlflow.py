"""The MLflow side of a mirror: one MLflow run per ckptdb run.

- The run is found by its tag ``ckptdb.run`` (the ckptdb run's token) in the
  experiment, or created there; its id is kept in the ledger, with the
  tracking URI stripped of any user, password and query.
- Metrics go through ``log_batch`` with the ledger's step and wall time.
  After a restart, the points MLflow already holds (same key, step and
  timestamp) are left out, batch after batch until one holds none.
- Each checkpoint is an artifact under ``checkpoints/<stream>/<id>/<file
  name>`` (``id``: its ledger id), with a run tag
  ``ckptdb.checkpoint.<stream>.<id>`` that gives its step and metrics. A
  copy whose files MLflow holds whole already (same names and sizes) is not
  uploaded again. With ``model_name``, each one is also a version of that
  registered model (tagged the same way).
- ``latest`` and ``best``: run tags ``ckptdb.latest.<stream>`` and
  ``ckptdb.best.<stream>`` (the step), and, with ``model_name``, the
  registered model's aliases ``last`` and ``best`` (``<stream>-last``,
  ``<stream>-best`` when several streams are followed). MLflow reserves the
  alias ``latest``.
- An evicted checkpoint: ``mark`` tags its copy (``ckptdb.evicted.<stream>.<id>``
  on the run, ``ckptdb.state`` on its model version); ``delete`` removes its
  artifact and its model version.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ..errors import InvalidArgumentError
from ..ledger.trackers import Point
from ..record import Checkpoint
from . import Aliased, Logged, missing_extra

PREFIX = "checkpoints"
RUN_TAG = "ckptdb.run"


class MlflowSink:
    """The MLflow side of a :class:`~ckptdb.trackers.Mirror`: one MLflow run per ckptdb run.

    Pass it to a :class:`~ckptdb.trackers.Mirror`, which calls its methods;
    what goes where in MLflow is described in the module doc and
    docs/trackers.md. The MLflow run is found by its tag ``ckptdb.run`` (the
    ckptdb run's token), so every follower of the run, after any restart,
    writes to the same one. Needs the ``mlflow`` extra
    (``pip install 'ckptdb[mlflow]'``).

    Args:
        tracking_uri: The MLflow tracking URI (a server, or a database such
            as ``sqlite:///mlflow.db``), also used as the model registry's.
            The ledger keeps it without any user, password or query.
        experiment: The experiment to log into (default ``"ckptdb"``),
            created if it does not exist.
        model_name: A registered model to make each checkpoint a version of,
            with the aliases ``last`` and ``best``; created if it does not
            exist. None (the default): artifacts and run tags only.
        artifact_location: Where a newly created experiment stores its
            artifacts; None (the default): MLflow's default, ``./mlruns``
            under the current directory for a database URI. An existing
            experiment keeps its own.

    Attributes:
        kind: ``"mlflow"``: the tracker's name in the ledger and in
            ``ckptdb follow --to``.
        client: The ``MlflowClient`` every call goes through.
        target: The tracking URI (without secrets) and experiment: the key of
            this tracker's row in the ledger.
        run_id: The MLflow run's id, once :meth:`open` found or created it.

    Raises:
        MissingExtraError: When ``mlflow`` is not installed.
        InvalidArgumentError: When ``tracking_uri`` or ``experiment`` is not a
            non-empty str.
    """

    kind = "mlflow"

    def __init__(
        self,
        tracking_uri: str,
        *,
        experiment: str = "ckptdb",
        model_name: str | None = None,
        artifact_location: str | None = None,
    ) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise missing_extra("mlflow", "mlflow") from exc
        for name, value in (("tracking_uri", tracking_uri), ("experiment", experiment)):
            if not isinstance(value, str) or not value:
                raise InvalidArgumentError(f"{name} must be a non-empty str, got {value!r}")
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        self.target = f"{without_secrets(tracking_uri)}#{experiment}"
        self.experiment, self.model_name = experiment, model_name
        self._artifact_location = artifact_location  # a new experiment's (MLflow's default)
        self._several = False  # aliases named per stream (open says which are followed)
        self.run_id = ""
        self._artifact_uri = ""

    def open(self, token: str, run_name: str, known: str | None, streams: list[str]) -> str:
        """Find or create the MLflow run of a ckptdb run (and the experiment, and the model).

        The run is created with its tag ``ckptdb.run`` already set, so a
        follower killed before the ledger kept its id finds it again instead
        of creating another.

        Args:
            token: The ckptdb run's token, the value of the tag ``ckptdb.run``.
            run_name: The MLflow run's name, if it is created.
            known: The MLflow run's id as the ledger keeps it; None: searched
                for by the tag in the experiment, else created.
            streams: The followed streams: with several, the model's aliases
                are named per stream (``<stream>-last``, ``<stream>-best``).

        Returns:
            The MLflow run's id.
        """
        self._several = len(streams) > 1
        found = self.client.get_experiment_by_name(self.experiment)
        experiment = (
            found.experiment_id
            if found is not None
            else self.client.create_experiment(
                self.experiment, artifact_location=self._artifact_location
            )
        )
        if known is None:
            runs = self.client.search_runs(
                [experiment], filter_string=f"tags.`{RUN_TAG}` = '{token}'"
            )
            known = runs[0].info.run_id if runs else None
        if known is None:  # tagged at creation: a crash before the ledger's write finds it
            known = self.client.create_run(
                experiment, run_name=run_name, tags={RUN_TAG: token}
            ).info.run_id
        self.run_id = known
        self._artifact_uri = self.client.get_run(known).info.artifact_uri
        if self.model_name is not None and _missing_model(self.client, self.model_name):
            self.client.create_registered_model(self.model_name)
        return known

    def holds(self) -> None:
        """Nothing to read back: MLflow's calls return once the server stored what they sent.

        So what the ledger says was mirrored is in MLflow, and the mirror
        keeps its cursor.
        """

    def already_logged(self, points: list[Point]) -> set[int]:
        """Which points the MLflow run holds already: same key, step and timestamp.

        Reads the metric history of each key among ``points``, so a follower
        killed between a log and its cursor's write (or a second ledger row
        for the same MLflow run, its URI written another way) logs nothing
        twice.

        Args:
            points: Metric points of the ledger, oldest first.

        Returns:
            The ids of those MLflow holds.
        """
        there: dict[str, set[tuple[int, int]]] = {}
        for name in sorted({p.name for p in points}):
            history = self.client.get_metric_history(self.run_id, name)
            there[name] = {(m.step, m.timestamp) for m in history}
        return {p.id for p in points if (p.step, _ms(p.wall_time)) in there[p.name]}

    def log_metrics(self, points: list[Point]) -> None:
        """Log metric points in one ``log_batch``, with the ledger's step and wall time (ms).

        A value the ledger holds as NULL is logged as NaN. MLflow keeps one
        point per key, step, value and millisecond, so two identical points
        within one millisecond are one point there.

        Args:
            points: Metric points of the ledger, oldest first.
        """
        from mlflow.entities import Metric

        metrics = [
            Metric(p.name, math.nan if p.value is None else p.value, _ms(p.wall_time), p.step)
            for p in points
        ]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_checkpoint(self, checkpoint: Checkpoint, local: Path, aliases: list[str]) -> Logged:
        """Log a checkpoint as an artifact, tag the run with it, and register it.

        The artifact goes under ``checkpoints/<stream>/<id>/<file name>``
        (``id``: its ledger id, so a framework's name reused after a resume
        never meets the old one); it is not uploaded again when MLflow holds
        its files whole already (same names and sizes). The run tag
        ``ckptdb.checkpoint.<stream>.<id>`` gives its id, step and metrics.
        With ``model_name``, it is also a version of that registered model,
        tagged the same way; a version of this run tagged with its id is
        reused.

        Args:
            checkpoint: The checkpoint, as the ledger records it.
            local: Its verified file or directory on disk.
            aliases: Unused: MLflow's aliases are set by :meth:`set_aliases`.

        Returns:
            The artifact path and, with ``model_name``, the model version.
        """
        # the ledger id keeps a framework's reused name (checkpoint-12, after a resume) apart
        where = f"{PREFIX}/{checkpoint.stream}/{checkpoint.id}/{local.name}"
        if _listing(self.client, self.run_id, where) != _files(local, where):
            if local.is_dir():
                self.client.log_artifacts(self.run_id, str(local), artifact_path=where)
            else:
                self.client.log_artifact(
                    self.run_id, str(local), artifact_path=where.rpartition("/")[0]
                )
        described = json.dumps(
            {"id": checkpoint.id, "step": checkpoint.step, "metrics": checkpoint.metrics},
            sort_keys=True,
        )
        self.client.set_tag(
            self.run_id, f"ckptdb.checkpoint.{checkpoint.stream}.{checkpoint.id}", described
        )
        version = None
        if self.model_name is not None:
            version = self._version_of(checkpoint, where)
        return Logged(where, version)

    def _version_of(self, checkpoint: Checkpoint, where: str) -> str:
        assert self.model_name is not None
        for found in self.client.search_model_versions(f"name='{self.model_name}'"):
            if (
                found.tags.get("ckptdb.checkpoint") == str(checkpoint.id)
                and found.run_id == self.run_id
            ):
                return str(found.version)  # created before a crash kept the ledger from knowing
        tags = {"ckptdb.checkpoint": str(checkpoint.id), "step": str(checkpoint.step)}
        tags.update({f"metric.{k}": str(v) for k, v in checkpoint.metrics.items()})
        created = self.client.create_model_version(
            self.model_name, source=f"{self._artifact_uri}/{where}", run_id=self.run_id, tags=tags
        )
        return str(created.version)

    def set_aliases(self, stream: str, wanted: dict[str, Aliased]) -> None:
        """Point ``latest`` and ``best`` of a stream at these checkpoints.

        Sets the run tags ``ckptdb.latest.<stream>`` and ``ckptdb.best.<stream>``
        (the step) and, with ``model_name``, the registered model's aliases
        ``last`` and ``best`` (``<stream>-last``, ``<stream>-best`` when
        several streams are followed); MLflow reserves the alias ``latest``.

        Args:
            stream: The stream.
            wanted: Alias (``latest``, ``best``) -> the checkpoint it should
                name.
        """
        for alias, aliased in wanted.items():
            checkpoint, logged = aliased.checkpoint, aliased.logged
            self.client.set_tag(self.run_id, f"ckptdb.{alias}.{stream}", str(checkpoint.step))
            if self.model_name is None or logged.version is None:
                continue
            name = "last" if alias == "latest" else alias  # MLflow reserves "latest"
            if self._several:
                name = f"{stream}-{name}"
            self.client.set_registered_model_alias(self.model_name, name, logged.version)

    def check_eviction(self, how: str) -> None:
        """Accept either ``on_evict``: both work on every MLflow store.

        Artifacts are deleted through the store's artifact repository, so
        nothing is refused here.

        Args:
            how: ``"mark"`` or ``"delete"``.
        """

    def evict(self, checkpoint: Checkpoint, logged: Logged, how: str) -> None:
        """Mark or remove the MLflow copy of a checkpoint retention evicted.

        Args:
            checkpoint: The checkpoint; its ``state`` is what a mark records.
            logged: Where it went in MLflow.
            how: ``"mark"``: the run tag ``ckptdb.evicted.<stream>.<id>`` and
                the model version's tag ``ckptdb.state`` (its state); else
                ``"delete"``: its artifact's ``<id>/`` directory is removed
                and its model version deleted.
        """
        if how == "mark":
            self.client.set_tag(
                self.run_id, f"ckptdb.evicted.{checkpoint.stream}.{checkpoint.id}", checkpoint.state
            )
            if self.model_name is not None and logged.version is not None:
                self.client.set_model_version_tag(
                    self.model_name, logged.version, "ckptdb.state", checkpoint.state
                )
            return
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        repository: Any = get_artifact_repository(self._artifact_uri)
        repository.delete_artifacts(logged.where.rpartition("/")[0])  # its own <id>/
        if self.model_name is not None and logged.version is not None:
            self.client.delete_model_version(self.model_name, logged.version)

    def close(self) -> None:
        """Nothing to close: each call is a request of its own, and nothing is held open."""


def without_secrets(uri: str) -> str:
    """``uri`` without a user, a password or a query (tokens): what the ledger may keep.

    Args:
        uri: A tracking URI.

    Returns:
        The URI without those parts; unchanged when it has none (a
        ``sqlite:////abs`` URI keeps its empty host).
    """
    parts = urlsplit(uri)
    if not parts.scheme or ("@" not in parts.netloc and not parts.query):
        return uri  # nothing to remove (and sqlite:////abs keeps its empty host)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _ms(wall_time: float) -> int:
    return round(wall_time * 1000)


def _missing_model(client: Any, name: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        return True
    return False


def _files(local: Path, where: str) -> set[tuple[str, int]]:
    """The artifact paths and sizes a checkpoint's copy consists of."""
    if not local.is_dir():
        return {(where, local.stat().st_size)}
    found = set()
    for base, _, names in os.walk(local):
        for name in names:
            path = Path(base) / name
            found.add((f"{where}/{path.relative_to(local).as_posix()}", path.stat().st_size))
    return found


def _listing(client: Any, run_id: str, where: str) -> set[tuple[str, int]]:
    """What the run holds at ``where`` (a file, or a directory walked whole)."""
    parent, _, _ = where.rpartition("/")
    found: set[tuple[str, int]] = set()
    pending = [where]
    while pending:
        path = pending.pop()
        for info in client.list_artifacts(run_id, path):
            if info.is_dir:
                pending.append(info.path)
            else:
                found.add((info.path, info.file_size or 0))
    if not found:  # a file: listed by its directory
        found = {
            (info.path, info.file_size or 0)
            for info in client.list_artifacts(run_id, parent)
            if info.path == where and not info.is_dir
        }
    return found
