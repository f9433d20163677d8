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
    """Mirrors into the experiment ``experiment`` of the tracking server at ``tracking_uri``
    (created with ``artifact_location`` if it does not exist: MLflow's default is
    ``./mlruns`` under the current directory for a database URI)."""

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
        """None: MLflow's calls return once the server stored what they sent."""

    def already_logged(self, points: list[Point]) -> set[int]:
        there: dict[str, set[tuple[int, int]]] = {}
        for name in sorted({p.name for p in points}):
            history = self.client.get_metric_history(self.run_id, name)
            there[name] = {(m.step, m.timestamp) for m in history}
        return {p.id for p in points if (p.step, _ms(p.wall_time)) in there[p.name]}

    def log_metrics(self, points: list[Point]) -> None:
        from mlflow.entities import Metric

        metrics = [
            Metric(p.name, math.nan if p.value is None else p.value, _ms(p.wall_time), p.step)
            for p in points
        ]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_checkpoint(self, checkpoint: Checkpoint, local: Path, aliases: list[str]) -> Logged:
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
        """Both ways work on every MLflow store (artifacts deleted through its repository)."""

    def evict(self, checkpoint: Checkpoint, logged: Logged, how: str) -> None:
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
        """Nothing held open: each call above is a request of its own."""


def without_secrets(uri: str) -> str:
    """``uri`` without a user, a password or a query (tokens): what the ledger may keep."""
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
