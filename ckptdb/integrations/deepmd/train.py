"""``dp --pt train`` through a ckptdb ledger (see the package docstring).

The only module that imports DeePMD-kit. It reaches into DeePMD's
``Trainer`` (its checkpoint writer, its stores, its guard), so it refuses any
DeePMD-kit but the tested 3.2 series (:func:`check_version`), and it refuses
what it does not guard yet (several ranks, a best-checkpoint directory
outside the save directory) rather than let DeePMD write or delete
checkpoints behind the ledger's back.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any
from unittest import mock

import torch

from .. import common

try:
    import deepmd
    import deepmd.env as deepmd_env
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise common.framework_missing("ckptdb.integrations.deepmd", "DeePMD-kit", "deepmd") from exc

from ...errors import (
    CheckpointLostError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    NoCheckpointToResumeError,
    NonFiniteGradientError,
    UnsupportedVersionError,
    note_on,
)
from ...guard import NonFiniteGradGuard
from ...manager import CheckpointManager
from ...policies import Keep, Policy, TopK
from ...record import Checkpoint
from ...storage.alias import point_symlink, write_pointer
from ...storage.external import External
from .layout import BEST_EMA_STREAM, BEST_STREAM, EMA_STREAM, POINTER, STREAM
from .logs import LogTail

__all__ = [
    "SUPPORTED",
    "LedgerTrainer",
    "LogTail",
    "check_version",
    "main",
    "resolve_restart",
]

log = logging.getLogger("ckptdb.deepmd")

#: The DeePMD-kit series this integration was built and tested against.
SUPPORTED = (3, 2)
SUPPORTED_RANGE = "deepmd-kit>=3.2,<3.3"
#: ckptdb's own option (taken out of the argument list before DeePMD parses it).
GUARD_OPTION = "--ckptdb-guard"
GUARD_CHOICES: dict[str, common.GuardSetting] = {"warn": True, "raise": "raise", "off": False}


def check_version(version: str | None = None) -> str:
    """DeePMD-kit's version, or :class:`UnsupportedVersionError` outside 3.2.x.

    The integration overrides private parts of DeePMD's ``Trainer``
    (``_write_checkpoint``, the checkpoint stores, the gradient guard); in
    another series they may mean something else, and a checkpoint could be
    written or deleted unguarded.
    """
    found = str(deepmd.__version__ if version is None else version)
    match = re.match(r"(\d+)\.(\d+)", found)
    if match is None or (int(match[1]), int(match[2])) != SUPPORTED:
        raise UnsupportedVersionError(
            f"ckptdb's DeePMD-kit integration supports {SUPPORTED_RANGE} (tested with "
            f"3.2.0); this is deepmd-kit {found}: pip install 'ckptdb[deepmd]'"
        )
    return found


def _without_op_library() -> bool:
    """Let ``import deepmd.pt`` work when torch is not the one DeePMD's op library was
    built for; True when the library is left out.

    DeePMD-kit 3.2.0's wheel ships ``libdeepmd_op_pt.so`` built against one torch
    (2.11); with any other, ``deepmd/pt/cxx_op.py`` raises at import and nothing
    of the PyTorch backend can be used. Its custom ops back only model
    compression, the parallel (MPI) border op and C++/LAMMPS inference; training,
    ``freeze`` and ``test`` run on DeePMD's Python fallbacks, exactly as in a
    source build without the op library. So, only when the versions differ,
    the module is pre-seeded with ``ENABLE_CUSTOMIZED_OP = False``; with the
    matching torch, DeePMD loads its library as it always does.
    """
    if "deepmd.pt.cxx_op" in sys.modules:
        return False
    built_for = str(deepmd_env.GLOBAL_CONFIG.get("pt_version") or "")
    running = torch.__version__.split("+")[0]
    if not built_for or built_for == running:
        return False
    stub = types.ModuleType("deepmd.pt.cxx_op")
    stub.ENABLE_CUSTOMIZED_OP = False  # type: ignore[attr-defined]
    stub.__all__ = ["ENABLE_CUSTOMIZED_OP"]  # type: ignore[attr-defined]
    sys.modules["deepmd.pt.cxx_op"] = stub
    log.info(
        "ckptdb: DeePMD-kit's op library was built for torch %s, this is torch %s: "
        "loaded without it (model compression and the LAMMPS/MPI ops are unavailable)",
        built_for,
        running,
    )
    return True


check_version()  # before anything of DeePMD's internals is imported
_without_op_library()

import deepmd.main as dp_main  # noqa: E402
import deepmd.pt.train.training as training  # noqa: E402
import deepmd.pt_expt.train.validation as validation  # noqa: E402

#: DeePMD's own ``Trainer`` (``main`` patches the module's name while it runs).
DeepmdTrainer: Any = training.Trainer
DeepmdValidator: Any = validation.FullValidator


@dataclass(frozen=True)
class Options:
    """What the command line gave ckptdb: the guard, and ``--restart`` as typed."""

    guard: common.GuardSetting = True
    restart: str | None = None


# --------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> None:
    """``dp`` with ``train`` through the ledger; every other command is DeePMD's own.

    ``argv`` are ``dp``'s arguments (default ``sys.argv[1:]``), plus
    ``--ckptdb-guard warn|raise|off`` (default ``warn``), which is taken out
    before DeePMD parses them. ``train`` needs the PyTorch backend (``--pt``):
    another backend would train unguarded, so it is refused.
    """
    check_version()
    args, guard = _take_guard(list(sys.argv[1:] if argv is None else argv))
    flags = dp_main.parse_args(args)
    if flags.command != "train":
        dp_main.main(args)
        return
    if flags.backend != "pytorch":
        raise InvalidArgumentError(
            f"ckptdb trains DeePMD-kit's PyTorch backend only, not {flags.backend!r}: "
            "pass --pt (or set DP_BACKEND=pytorch)"
        )
    options = Options(guard=guard, restart=flags.restart)
    with mock.patch.object(training, "Trainer", partial(LedgerTrainer, ckptdb=options)):
        dp_main.main(args)


def _take_guard(args: list[str]) -> tuple[list[str], common.GuardSetting]:
    """``--ckptdb-guard X`` / ``--ckptdb-guard=X`` out of ``args``; the rest stays as typed."""
    rest: list[str] = []
    value: str | None = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == GUARD_OPTION:
            if i + 1 >= len(args):
                raise InvalidArgumentError(f"{GUARD_OPTION} needs a value: warn, raise or off")
            value, i = args[i + 1], i + 2
            continue
        if arg.startswith(GUARD_OPTION + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if value is None:
        return rest, True
    if value not in GUARD_CHOICES:
        raise InvalidArgumentError(f"{GUARD_OPTION} must be warn, raise or off, got {value!r}")
    return rest, GUARD_CHOICES[value]


# ------------------------------------------------------------------- trainer


class LedgerTrainer(DeepmdTrainer):  # type: ignore[misc]  # DeePMD is untyped
    """DeePMD-kit's ``Trainer`` whose periodic checkpoints are ledger boundaries.

    Constructed by DeePMD's own ``get_trainer`` (``main`` substitutes it for
    ``deepmd.pt.train.training.Trainer``). The ledger is opened before DeePMD's
    constructor runs, so that ``--restart`` is resolved through it and DeePMD
    loads only a committed, verified checkpoint.
    """

    nonfinite_grad_guard: Any  # DeePMD's, wrapped by :class:`_DeepmdGuard`

    def __init__(
        self,
        config: dict[str, Any],
        training_data: Any,
        *args: Any,
        ckptdb: Options,
        restart_model: str | None = None,
        **kwargs: Any,
    ) -> None:
        _refuse_unsupported(config)
        self.ckptdb = ckptdb
        self.run_root = Path.cwd().resolve()  # where DeePMD writes its `checkpoint` pointer
        self.manager = CheckpointManager(
            self.run_root,
            streams=_streams(config),
            save_dir=_save_dir(config["training"], self.run_root),
        )
        self.resumed: Checkpoint | None = None
        self._pending: tuple[int, Path, dict[str, Any]] | None = None
        self._refused_step: int | None = None
        self._hook: Any = None
        self._tails: list[LogTail] = []
        try:
            if restart_model is not None:
                spec = ckptdb.restart if ckptdb.restart is not None else restart_model
                self.resumed = resolve_restart(
                    self.manager, spec, root=self.run_root, aliases=_aliases(config)
                )
                restart_model = os.fspath(self.resumed.path)
            common.protect_start(self.manager, self.resumed)
            super().__init__(config, training_data, *args, restart_model=restart_model, **kwargs)
            self._take_over()
        except BaseException as exc:
            self._close(exc)
            raise

    def _take_over(self) -> None:
        """After DeePMD's constructor: its retention, aliases and guard become the ledger's."""
        for _, store in self._stores():
            if store.directory.resolve() != self.manager.save_dir:
                raise InvalidArgumentError(  # pragma: no cover - both read the same keys
                    f"DeePMD writes checkpoints to {store.directory}, the ledger expects "
                    f"{self.manager.save_dir}"
                )
            # retention is the ledger's; the aliases are written after each commit
            store.prune = _never
            store.publish = _never
        guard_on = bool(self.ckptdb.guard)
        self.nonfinite_grad_guard = _DeepmdGuard(self.nonfinite_grad_guard, defer=guard_on)
        if guard_on:
            self.manager.guard = NonFiniteGradGuard(self.wrapper.named_parameters())
            self._hook = self.optimizer.register_step_pre_hook(self._observe)
        self._point_aliases(stale_warning=True)
        self._tails = self._log_tails()

    def _log_tails(self) -> list[LogTail]:
        """``lcurve.out`` (``disp_file``) and each validator's ``val.log``, read from where
        this attempt starts writing: the end of the file on a restart (DeePMD appends),
        the start once DeePMD has rewritten it otherwise."""
        tails = [
            LogTail(self.run_root / self.disp_file, append=bool(self.restart_training), skip={"lr"})
        ]
        for stream, validator in self._validators():
            tails.append(
                LogTail(
                    self.run_root / validator.full_val_file,
                    prefix=VAL_PREFIX[stream],
                    append=validator._write_mode == "a",
                )
            )
        return tails

    def _log_files(self) -> None:
        """What DeePMD appended to its log files since the last look, as ledger metrics
        (buffered: written with the next commit, or when the ledger closes)."""
        for tail in self._tails:
            for step, values in tail.read():
                self.manager.log_metrics(step, values)

    def _stores(self) -> list[tuple[str, Any]]:
        """Each stream with DeePMD's store of its names (the EMA one when EMA is on)."""
        pairs = [(STREAM, self.ckpt_store)]
        if self.model_ema is not None:
            pairs.append((EMA_STREAM, self.ema_ckpt_store))
        return pairs

    # ------------------------------------------------------------ lifecycle

    def run(self) -> None:
        """DeePMD's training loop; the ledger's attempt ends with it (failed on an error)."""
        try:
            super().run()
        except BaseException as exc:
            self._close(exc)
            raise
        self._close(None)

    def _close(self, exc: BaseException | None) -> None:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()
        try:  # the rows written after the last boundary
            self._log_files()
        except Exception as failed:  # never in place of the attempt's own outcome
            text = f"ckptdb: the last rows of DeePMD's logs were not recorded: {failed!r}"
            if exc is not None:
                note_on(exc, text)  # the training's own error is the one raised
            else:  # training succeeded: its checkpoints stand, the lost metrics are said
                log.error(text, exc_info=True)
        tb: TracebackType | None = exc.__traceback__ if exc is not None else None
        self.manager.__exit__(type(exc) if exc is not None else None, exc, tb)

    # -------------------------------------------------------------- saving

    def _write_checkpoint(
        self, save_path: str | os.PathLike[str], checkpoint_data: dict[str, Any], *, store: Any
    ) -> None:
        """Every checkpoint DeePMD writes comes here (rank 0): a regular one is held until
        its EMA twin arrives (DeePMD writes them one after the other, nothing trains
        in between), then both are one ledger boundary; without EMA the regular one
        is a boundary by itself."""
        path = Path(save_path)
        if store is self.ckpt_store and store.holds(path):
            self._pending = (int(store.step_of(path)), path, checkpoint_data)
            if self.model_ema is None:
                self._publish(self._pending[0], None)
            return
        if store is self.ema_ckpt_store and store.holds(path):
            self._publish(int(store.step_of(path)), (path, checkpoint_data))
            return
        for stream, validator in self._validators():
            match = validator.best_checkpoint_pattern.match(path.name)
            if match is not None and path.parent.resolve() == validator.checkpoint_dir.resolve():
                self._publish_best(stream, validator, int(match[1]), checkpoint_data)
                return
        raise InvalidArgumentError(  # nothing else is written by DeePMD's training loop
            f"ckptdb's DeePMD-kit integration does not publish {path}: only the periodic "
            "and the validation-best checkpoints go through the ledger"
        )

    def _publish(self, step: int, ema: tuple[Path, dict[str, Any]] | None) -> None:
        """One boundary: the held regular checkpoint of ``step`` and its EMA twin."""
        pending, self._pending = self._pending, None
        payloads: dict[str, External] = {}
        if pending is not None and pending[0] == step:
            payloads[STREAM] = self._payload(pending[1], pending[2])
        if ema is not None:
            payloads[EMA_STREAM] = self._payload(*ema)
        if self._boundary(step, self._metrics(), payloads) is not None:
            self._point_aliases()

    def _publish_best(self, stream: str, validator: Any, step: int, data: dict[str, Any]) -> None:
        """A validation-best checkpoint: one boundary of its top-K stream, ranked by
        DeePMD's validation metric, under DeePMD's name without the rank (``-t-R``):
        the ledger ranks, a name never changes."""
        value = next(r.metric for r in validator.topk_records if r.step == step)
        metric = self.manager.policies[stream].ranking_metric
        assert metric is not None
        metrics = common.rankable_metrics(
            {**(self._metrics() or {}), metric: value},
            self.manager.policies[stream],
            step=step,
            log=log,
        )
        name = os.path.relpath(
            validator.checkpoint_dir.resolve()
            / f"{validator.best_checkpoint_prefix}-{step}{validator.best_checkpoint_suffix}",
            self.manager.save_dir,
        )
        payload = External(self._writer(data), common.free_name(name, self.manager, suffix=".pt"))
        saved = self._boundary(step, metrics, {stream: payload})
        if saved is None or stream not in saved:
            # refused, or not in the ledger's top-K: DeePMD's own top-K (which decides
            # what it proposes next, and is saved in its checkpoints) drops it too
            validator.topk_records = [r for r in validator.topk_records if r.step != step]
            validator._sync_state_store()

    def _boundary(
        self, step: int, metrics: Mapping[str, Any] | None, payloads: Mapping[str, External]
    ) -> dict[str, Checkpoint] | None:
        """``manager.save`` of ``payloads``; None when the guard refused the step.

        A refusal is :func:`common.publish_all`'s (the manager has recorded
        ``guard_tripped``; ``raise`` re-raises, otherwise a warning and training
        goes on); it also refuses every later boundary of the step (the
        periodic checkpoint after a best one).
        """
        self._log_files()  # the rows so far commit with this boundary
        if self._refused_step == step:
            log.warning("ckptdb: step %d was not checkpointed: the guard refused this step", step)
            return None

        def refused(exc: NonFiniteGradientError) -> None:
            self._refused_step = step

        return common.publish_all(
            self.manager,
            step,
            payloads,
            metrics=metrics,
            guard=self.ckptdb.guard,
            log=log,
            refused=refused,
        )

    def _metrics(self) -> dict[str, float] | None:
        lr = self._get_inner_module().train_infos.get("lr")
        return {"lr": float(lr)} if isinstance(lr, (int, float)) else None

    def _payload(self, path: Path, data: dict[str, Any]) -> External:
        """DeePMD's own write of ``data``, published under its name (``-vN`` when taken)."""
        return External(self._writer(data), common.free_name(path.name, self.manager, suffix=".pt"))

    def _writer(self, data: dict[str, Any]) -> Callable[[Path], None]:
        def write(target: Path) -> None:
            DeepmdTrainer._write_checkpoint(self, target, data, store=_KEEP_ALL)

        return write

    # ------------------------------------------------------------ validation

    def _create_full_validators(self, **kwargs: Any) -> Any:
        """DeePMD's full validators, without their own renaming and deleting of
        ``best.ckpt-*`` files (:class:`_LedgerValidator`): the ledger's top-K does it."""
        with mock.patch.object(validation, "FullValidator", _LedgerValidator):
            return super()._create_full_validators(**kwargs)

    def _validators(self) -> list[tuple[str, Any]]:
        pairs = [(BEST_STREAM, self.full_validator), (BEST_EMA_STREAM, self.ema_full_validator)]
        return [(stream, v) for stream, v in pairs if v is not None]

    # ------------------------------------------------------------- aliases

    def _point_aliases(self, *, stale_warning: bool = False) -> None:
        """``model.ckpt.pt`` (``model_ema.ckpt.pt``) and ``checkpoint`` name the ledger's
        latest of each stream: written after the commit, swapped in atomically, never
        read by ckptdb. At start (``stale_warning``) a stale one, left by a crash
        between a commit and its aliases, is re-pointed with a warning."""
        for stream, store in self._stores():
            latest = self.manager.latest(stream)
            if latest is None:
                continue
            alias = _alias_path(store, self.run_root)
            link = os.path.relpath(latest.path, alias.parent)
            if stale_warning and alias.is_symlink() and os.readlink(alias) != link:
                log.warning(
                    "ckptdb: %s named %s, not the newest committed %s: re-pointed",
                    alias.name,
                    os.readlink(alias),
                    latest.path.name,
                )
            point_symlink(latest.path, alias)
            if stream == STREAM:
                write_pointer(self.run_root / POINTER, os.path.relpath(latest.path, self.run_root))

    # --------------------------------------------------------------- guard

    def _observe(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Every optimizer step's gradients, after DeePMD's clipping, to ckptdb's guard
        (on the device: no host sync per step)."""
        guard = self.manager.guard
        if guard is not None:
            guard.observe(common.optimizer_params(optimizer))


#: The metric-name prefix of each validator's log (``val.log``, ``val_ema.log``).
VAL_PREFIX = {BEST_STREAM: "val_", BEST_EMA_STREAM: "val_ema_"}


class _DeepmdGuard:
    """DeePMD's own ``NonFiniteGradGuard`` (it raises at the next periodic checkpoint
    after a non-finite clipped-gradient norm, killing the run), deferring to ckptdb's.

    With ckptdb's guard on, DeePMD's is not fed: a non-finite total norm makes the
    clipping scale every gradient by NaN, which ckptdb's guard sees at the
    optimizer step; the boundary is refused and training goes on (``warn``) or
    stops with :class:`NonFiniteGradientError` (``raise``). With ckptdb's guard
    off, DeePMD's own works as it always does.
    """

    def __init__(self, inner: Any, *, defer: bool) -> None:
        self.inner = inner
        self.defer = defer

    def update(self, total_norm: torch.Tensor) -> None:
        if not self.defer:
            self.inner.update(total_norm)

    def raise_if_nonfinite(self, named_parameters: Callable[[], Any]) -> None:
        self.inner.raise_if_nonfinite(named_parameters)


class _LedgerValidator(DeepmdValidator):  # type: ignore[misc]  # DeePMD is untyped
    """DeePMD's ``FullValidator`` that never renames nor deletes a best checkpoint.

    DeePMD names its best checkpoints by rank (``best.ckpt-N.t-R.pt``), renames
    them as the ranking changes and deletes the ones that drop out, at start
    (every best file of an earlier run) and after each save, by name. Here
    every best checkpoint is a row of a top-K stream: its name never changes
    and the ledger evicts it after the commit that pushed it out.
    """

    def _initialize_best_checkpoints(self, restart_training: bool) -> None:
        """Never: the files of an earlier run are the ledger's (or no one's) to remove."""

    def _reconcile_best_checkpoints(self) -> None:
        """Never: the ledger's top-K ranks and evicts."""


class _KeepAll:
    """The store DeePMD's write is handed inside a boundary: it prunes nothing."""

    def prune(self, current: Path) -> None:
        """Retention is the ledger's: files go after the commit that evicted them."""


_KEEP_ALL = _KeepAll()


def _never(path: Path) -> None:
    """DeePMD's ``prune``/``publish``, replaced: the ledger evicts, and the aliases are
    written after each commit from the ledger's latest (:meth:`LedgerTrainer._point_aliases`)."""


# ------------------------------------------------------------------ restart


def resolve_restart(
    manager: CheckpointManager, spec: str, *, root: Path, aliases: Mapping[str, str]
) -> Checkpoint:
    """The committed, verified checkpoint ``--restart spec`` names, in this run's ledger.

    ``latest``; this run's directory (the run root or the save directory):
    the newest committed checkpoint whose size and hash match its row; a
    prefix or alias (``model.ckpt``, ``model.ckpt.pt``, ``model_ema.ckpt``):
    the newest whole checkpoint of its stream, whatever the alias names; a
    path (``.pt`` added when missing, as DeePMD does): that checkpoint, if
    the ledger has a committed row for it and it is whole. A path with no
    committed row is refused (:class:`CheckpointNotFoundError`) instead of
    loaded. ``aliases`` maps alias file names (relative to ``root``) to their
    streams.
    """
    if spec == "latest" and not os.path.lexists(root / spec):
        return _newest(manager, STREAM, spec)
    path = Path(os.path.abspath(root / Path(spec).expanduser()))
    if path.is_dir():
        if path.resolve() in (root, manager.save_dir):
            return _newest(manager, STREAM, spec)
        raise InvalidArgumentError(
            f"--restart {spec}: not this run's directory ({root}, checkpoints in "
            f"{manager.save_dir}); ckptdb resumes from this run's ledger only"
        )
    if path.suffix != ".pt":
        path = path.with_name(path.name + ".pt")
    for name, stream in aliases.items():
        if path == Path(os.path.abspath(root / name)):
            return _newest(manager, stream, spec)
    try:
        return manager.verify(path)
    except CheckpointLostError:
        raise
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"--restart {spec}: {path} has no committed row in this run's ledger "
            f"({root}); ckptdb resumes only from committed checkpoints "
            "(--restart latest takes the newest)"
        ) from exc


def _newest(manager: CheckpointManager, stream: str, spec: str) -> Checkpoint:
    found = common.newest_whole(manager, stream, log)
    if found is None:
        raise NoCheckpointToResumeError(
            f"--restart {spec}: the ledger has no committed checkpoint of {stream!r} to resume from"
        )
    return found


# --------------------------------------------------------------- the config


def _refuse_unsupported(config: dict[str, Any]) -> None:
    """What this integration does not guard yet is refused before anything is opened."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise InvalidArgumentError(
            "ckptdb's DeePMD-kit integration does not support several ranks yet "
            f"(world size {dist.get_world_size()}): train on one process"
        )
    if _best_metric(config) is not None:
        root = Path.cwd().resolve()
        best_dir = (root / _best_dir(config)).resolve()
        save_dir = _save_dir(config["training"], root)
        if not best_dir.is_relative_to(save_dir):
            raise InvalidArgumentError(
                f"validating.save_best_dir ({best_dir}) must be inside the save directory "
                f"({save_dir}): ckptdb publishes every checkpoint of a run in its save directory"
            )


def _keep(value: object) -> int | None:
    """DeePMD's keep count as the ledger's ``Keep(last=...)``: below one keeps all."""
    count = int(value)  # type: ignore[call-overload]  # DeePMD's argcheck made it an int
    return count if count >= 1 else None


def _streams(config: dict[str, Any]) -> dict[str, Policy]:
    """``model``: DeePMD's ``max_ckpt_keep`` (or ``ckpt_keep_ratio``);
    ``model_ema``: its ``ema_ckpt_keep`` (default: the same), when EMA is on."""
    params = config["training"]
    keep = params.get("max_ckpt_keep", 5)
    ema_keep = params.get("ema_ckpt_keep")
    ema_keep = keep if ema_keep is None else ema_keep
    ratio = params.get("ckpt_keep_ratio")
    if ratio is not None:
        if params.get("numb_steps") is None:
            raise InvalidArgumentError(
                "training.ckpt_keep_ratio with num_epoch is not yet supported by ckptdb's "
                "DeePMD-kit integration: set max_ckpt_keep (or numb_steps)"
            )
        from deepmd.dpmodel.train.checkpoint import resolve_keep_ckpt_count

        keep = ema_keep = resolve_keep_ckpt_count(
            ratio, int(params["numb_steps"]), int(params.get("save_freq", 1000))
        )
    streams: dict[str, Policy] = {STREAM: Keep(last=_keep(keep))}
    if params.get("enable_ema"):
        streams[EMA_STREAM] = Keep(last=_keep(ema_keep))
    metric = _best_metric(config)
    if metric is not None:
        validating = config["validating"]
        k = int(validating.get("max_best_ckpt", 1))
        if validating.get("full_validation"):
            streams[BEST_STREAM] = TopK(k, metric, "min")
        if params.get("enable_ema") and validating.get("ema_full_validation"):
            streams[BEST_EMA_STREAM] = TopK(k, metric, "min")
    return streams


def _best_metric(config: Mapping[str, Any]) -> str | None:
    """DeePMD's ``validation_metric`` (lower is better) when validation keeps best
    checkpoints (``full_validation`` or ``ema_full_validation`` with ``save_best``)."""
    validating = config.get("validating") or {}
    full = validating.get("full_validation") or (
        config["training"].get("enable_ema") and validating.get("ema_full_validation")
    )
    if not (full and validating.get("save_best", True)):
        return None
    return str(validating.get("validation_metric", "E:MAE"))


def _best_dir(config: Mapping[str, Any]) -> Path:
    """Where DeePMD writes best checkpoints (``save_best_dir``, else beside ``save_ckpt``)."""
    validating = config.get("validating") or {}
    where = validating.get("save_best_dir")
    return Path(where) if where else Path(config["training"].get("save_ckpt", "model.ckpt")).parent


def _save_dir(params: Mapping[str, Any], root: Path) -> Path:
    """Where DeePMD writes ``model.ckpt-N.pt``: ``save_dir``, else the directory of
    ``save_ckpt`` (as DeePMD's ``build_checkpoint_stores``)."""
    save_dir = params.get("save_dir")
    where = Path(save_dir) if save_dir else Path(params.get("save_ckpt", "model.ckpt")).parent
    return (root / where).resolve()


def _aliases(config: dict[str, Any]) -> dict[str, str]:
    """DeePMD's alias names (relative to the run root) and their streams."""
    from deepmd.pt_expt.train.ema import get_ema_checkpoint_prefix

    prefix = str(config["training"].get("save_ckpt", "model.ckpt"))
    return {prefix + ".pt": STREAM, get_ema_checkpoint_prefix(prefix) + ".pt": EMA_STREAM}


def _alias_path(store: Any, root: Path) -> Path:
    prefix = Path(store.prefix)
    return root / prefix.parent / (prefix.name + str(store.suffix))
