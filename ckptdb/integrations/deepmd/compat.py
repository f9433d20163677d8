"""Everything ckptdb borrows from DeePMD-kit beyond its command line, in one place.

The integration (:mod:`.train`) reaches into DeePMD-kit's ``Trainer``: its
checkpoint writer, its validators, its process-group and DDP set-up. Each
such name (a private method or attribute, a module attribute swapped while
DeePMD runs) is used through one small, named piece of this module, whose
comment says what it is and why ckptdb needs it. Every one was checked
against deepmd-kit 3.2.0 (``CHECKED_WITH``); :func:`check_version` refuses any
DeePMD-kit outside the 3.2 series, at the import of this module (so at the
import of the integration's writer module), before any of DeePMD's internals
is imported. Moving to a new DeePMD-kit series means re-reading the DeePMD
code named here, and nothing else.

Only this module imports DeePMD-kit.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .. import common

try:
    import deepmd
    import deepmd.env as deepmd_env
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise common.framework_missing("ckptdb.integrations.deepmd", "DeePMD-kit", "deepmd") from exc

from ...errors import UnsupportedVersionError

__all__ = [
    "CHECKED_WITH",
    "PYTORCH",
    "PYTORCH_EXPORTABLE",
    "SUPPORTED",
    "SUPPORTED_RANGE",
    "DeepmdExptTrainer",
    "DeepmdTrainer",
    "DeepmdValidator",
    "HookedExptTrainer",
    "HookedTrainer",
    "HookedValidator",
    "check_version",
    "ddp_on_the_cpu",
    "ema_checkpoint_prefix",
    "gloo_on_the_cpu",
    "keep_count_from_ratio",
    "load_without_op_library",
    "on_the_cpu",
    "parse_dp_args",
    "run_dp",
    "swapped_attribute",
    "sync_topk_state",
    "trainer_replaced_by",
    "validator_appends",
]

log = logging.getLogger("ckptdb.deepmd")

#: The DeePMD-kit series this integration was built and tested against.
SUPPORTED = (3, 2)
SUPPORTED_RANGE = "deepmd-kit>=3.2,<3.3"
#: The DeePMD-kit release whose source every name below was checked against.
CHECKED_WITH = "3.2.0"


# ------------------------------------------------------------------ version


def check_version(version: str | None = None) -> str:
    """DeePMD-kit's version, checked against the one series the integration supports.

    The integration overrides private parts of DeePMD-kit's ``Trainer``; in
    another series they may mean something else, and a checkpoint could be
    written or deleted unguarded. So only ``deepmd-kit>=3.2,<3.3`` (checked
    against 3.2.0) is accepted. Importing the integration calls it before
    any of DeePMD's internals is imported, and ``main`` again.

    Args:
        version: The version to check (None: the installed ``deepmd.__version__``).

    Returns:
        The version checked, as a string.

    Raises:
        UnsupportedVersionError: The version is outside 3.2.x (one line, naming
            the supported range and ``pip install 'ckptdb[deepmd]'``).
    """
    found = str(deepmd.__version__ if version is None else version)
    match = re.match(r"(\d+)\.(\d+)", found)
    if match is None or (int(match[1]), int(match[2])) != SUPPORTED:
        raise UnsupportedVersionError(
            f"ckptdb's DeePMD-kit integration supports {SUPPORTED_RANGE} (tested with "
            f"{CHECKED_WITH}); this is deepmd-kit {found}: pip install 'ckptdb[deepmd]'"
        )
    return found


# --------------------------------------------------------------- op library


def load_without_op_library() -> bool:
    """Let ``import deepmd.pt`` work when torch is not the one DeePMD's op library was
    built for; True when the library is left out.

    Borrowed: the module ``deepmd.pt.cxx_op`` (its ``ENABLE_CUSTOMIZED_OP``) and
    ``deepmd.env.GLOBAL_CONFIG["pt_version"]``; checked with 3.2.0. Why: DeePMD-kit
    3.2.0's wheel ships ``libdeepmd_op_pt.so`` built against one torch (2.11);
    with any other, ``deepmd/pt/cxx_op.py`` raises at import and nothing of the
    PyTorch backend can be used. Its custom ops back only model compression,
    the parallel (MPI) border op and C++/LAMMPS inference; training, ``freeze``
    and ``test`` run on DeePMD's Python fallbacks, exactly as in a source build
    without the op library. So, only when the versions differ, the module is
    pre-seeded with ``ENABLE_CUSTOMIZED_OP = False``; with the matching torch,
    DeePMD loads its library as it always does.
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
load_without_op_library()

import deepmd.main as dp_main  # noqa: E402
import deepmd.pt.train.training as training  # noqa: E402
import deepmd.pt.utils.env as pt_env  # noqa: E402
import deepmd.pt_expt.train.training as expt_training  # noqa: E402
import deepmd.pt_expt.train.validation as validation  # noqa: E402

#: DeePMD's own ``Trainer`` and ``FullValidator``, as imported: the module attributes
#: are swapped while ``dp`` runs (:func:`trainer_replaced_by`) and while the
#: validators are built (:meth:`HookedTrainer._create_full_validators`).
DeepmdTrainer: Any = training.Trainer
DeepmdExptTrainer: Any = expt_training.Trainer
DeepmdValidator: Any = validation.FullValidator

#: ``dp``'s names of the two PyTorch backends (``--pt``, ``--pt-expt``), as parsed.
PYTORCH = "pytorch"
PYTORCH_EXPORTABLE = "pytorch-exportable"

# ------------------------------------------------------- swapping attributes


@contextmanager
def swapped_attribute(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside the block; the original is put back after
    it, whether the block returns or raises. ``owner.name`` must exist."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


# ------------------------------------------------------------- entry point


def parse_dp_args(args: list[str]) -> Any:
    """``dp``'s own argument parser (``deepmd.main.parse_args``, public; 3.2.0): its
    ``command``, ``backend`` and ``restart``."""
    return dp_main.parse_args(args)


def run_dp(args: list[str]) -> None:
    """``dp`` itself (``deepmd.main.main``, public; 3.2.0)."""
    dp_main.main(args)


@contextmanager
def trainer_replaced_by(factory: Callable[..., Any], backend: str = PYTORCH) -> Iterator[None]:
    """DeePMD's ``dp train`` with ``backend`` builds ``factory(...)`` instead of its ``Trainer``.

    Borrowed: the module attributes ``deepmd.pt.train.training.Trainer`` and
    ``deepmd.pt_expt.train.training.Trainer``; checked with 3.2.0, where each
    backend's ``entrypoints.main.get_trainer`` looks it up at call time
    (``training.Trainer(config, ...)``). Why: ``dp``'s entry point has no way to
    be handed another trainer, and ckptdb runs DeePMD's own entry point (its
    configuration handling, its data loading) unchanged.
    """
    module = expt_training if backend == PYTORCH_EXPORTABLE else training
    with swapped_attribute(module, "Trainer", factory):
        yield


def on_the_cpu() -> bool:
    """Whether DeePMD trains on the CPU (no CUDA, or ``DEVICE=cpu``).

    Borrowed: ``deepmd.pt.utils.env.DEVICE`` (the device DeePMD trains on); 3.2.0.
    """
    return bool(pt_env.DEVICE.type == "cpu")


@contextmanager
def gloo_on_the_cpu() -> Iterator[None]:
    """Under ``torchrun`` on the CPU, DeePMD's process group is gloo's.

    Swapped: ``torch.distributed.init_process_group``, while ``dp`` runs. Why:
    DeePMD-kit 3.2.0's ``deepmd.pt.entrypoints.main.train`` asks for
    ``backend="cuda:nccl,cpu:gloo"`` when ``LOCAL_RANK`` is set, which fails in
    a torch built without NCCL (every CPU build); a CPU run needs gloo alone.
    On a GPU nothing changes.
    """
    if os.environ.get("LOCAL_RANK") is None or not on_the_cpu():
        yield
        return
    dist = torch.distributed
    original = dist.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        kwargs["backend"] = "gloo"
        original(*args, **kwargs)

    with swapped_attribute(dist, "init_process_group", init_process_group):
        yield


@contextmanager
def ddp_on_the_cpu() -> Iterator[None]:
    """DeePMD's DDP set-up, on the CPU: no ``torch.cuda.set_device``, and DDP built
    without ``device_ids`` (torch's form for a CPU module). On a GPU nothing changes.

    Swapped, while DeePMD's ``Trainer.__init__`` runs: ``torch.cuda.set_device``
    and the module attribute ``deepmd.pt.train.training.DDP`` (torch's
    ``DistributedDataParallel`` as DeePMD imported it). Why: DeePMD-kit 3.2.0's
    ``Trainer.__init__``, when distributed, calls ``torch.cuda.set_device(LOCAL_RANK)``
    and ``DDP(wrapper, device_ids=[LOCAL_RANK], output_device=LOCAL_RANK)``, both
    of which need a CUDA device.
    """
    if not on_the_cpu():
        yield
        return
    with ExitStack() as stack:
        stack.enter_context(swapped_attribute(torch.cuda, "set_device", _no_device))
        stack.enter_context(swapped_attribute(training, "DDP", partial(_cpu_ddp, training.DDP)))
        yield


def _no_device(device: Any) -> None:
    """``torch.cuda.set_device`` on the CPU: there is no device to select."""


def _cpu_ddp(ddp: Any, module: Any, *args: Any, **kwargs: Any) -> Any:
    kwargs.pop("device_ids", None)
    kwargs.pop("output_device", None)
    return ddp(module, *args, **kwargs)


# ------------------------------------------------------------------ trainer


class _ValidatorHook:
    """Both backends build their full validators the same way (3.2.0)."""

    def _create_full_validators(self, **kwargs: Any) -> Any:
        """Borrowed: ``Trainer._create_full_validators(**kwargs)`` (3.2.0, both
        backends), which builds the live and EMA validators through
        ``deepmd.pt_expt.train.validation.build_full_validators``; that looks up
        the module attribute ``validation.FullValidator`` at call time, which is
        swapped for :meth:`ckptdb_full_validator_class` meanwhile. Why: DeePMD
        offers no other way to choose the validator's class."""
        with swapped_attribute(validation, "FullValidator", self.ckptdb_full_validator_class()):
            return super()._create_full_validators(**kwargs)  # type: ignore[misc]

    def ckptdb_full_validator_class(self) -> Any:
        """The class DeePMD's full validators are built from: by default DeePMD's."""
        return DeepmdValidator


class HookedTrainer(_ValidatorHook, DeepmdTrainer):  # type: ignore[misc]  # DeePMD is untyped
    """DeePMD-kit's ``Trainer`` (``deepmd.pt.train.training.Trainer``; 3.2.0) whose
    private hooks ckptdb overrides, each forwarded to a ckptdb-named method.

    On its own it behaves as DeePMD's; a subclass overrides the ``ckptdb_*``
    methods, never DeePMD's private names.
    """

    def _write_checkpoint(self, save_path: Any, checkpoint_data: Any, *, store: Any) -> None:
        """Borrowed: ``Trainer._write_checkpoint(save_path, checkpoint_data, *, store)``
        (3.2.0): the one method through which DeePMD writes every checkpoint file
        (periodic, EMA, validation-best), then has ``store`` prune. ckptdb turns
        each write into a ledger boundary (:meth:`ckptdb_write_checkpoint`)."""
        self.ckptdb_write_checkpoint(Path(save_path), checkpoint_data, store=store)

    def ckptdb_write_checkpoint(
        self, path: Path, checkpoint_data: dict[str, Any], *, store: Any
    ) -> None:
        """Where DeePMD writes a checkpoint: by default DeePMD's own write."""
        self.deepmd_write_checkpoint(path, checkpoint_data, store=store)

    def deepmd_write_checkpoint(
        self, path: Path, checkpoint_data: dict[str, Any], *, store: Any
    ) -> None:
        """DeePMD's own ``Trainer._write_checkpoint`` (rank 0 writes ``torch.save`` of
        ``checkpoint_data`` to ``path``, then calls ``store.prune(path)``)."""
        super()._write_checkpoint(path, checkpoint_data, store=store)

    def deepmd_learning_rate(self, step: int) -> float | None:
        """The learning rate of the checkpoint of ``step``, as DeePMD saves it in the
        checkpoint's ``train_infos`` (set at each checkpoint).

        Borrowed: ``Trainer._get_inner_module()`` (3.2.0): the model wrapper with
        DDP unwrapped, which holds ``train_infos``."""
        lr = self._get_inner_module().train_infos.get("lr")
        return float(lr) if isinstance(lr, (int, float)) else None

    def deepmd_save_at(self, step: int) -> None:
        """DeePMD's loop saves a periodic checkpoint at the end of ``step``.

        Borrowed: ``Trainer.save_freq`` (3.2.0), which the loop reads at every step."""
        self.save_freq = step

    def deepmd_save_freq(self) -> int:
        """DeePMD's periodic checkpoint frequency now (``Trainer.save_freq``, 3.2.0)."""
        return int(self.save_freq)


class HookedExptTrainer(_ValidatorHook, DeepmdExptTrainer):  # type: ignore[misc]
    """DeePMD-kit's ``pytorch-exportable`` ``Trainer`` (``deepmd.pt_expt.train.training``;
    3.2.0) whose private checkpoint write ckptdb overrides, forwarded to a
    ckptdb-named method. On its own it behaves as DeePMD's.

    Its periodic checkpoints go through the public ``save_checkpoint(step)``
    (DeePMD's backend-independent loop calls it), which a subclass overrides;
    the validation-best ones reach only the private write below.
    """

    _ckptdb_writing = False  # inside deepmd_save_to: DeePMD's own write goes ahead

    def _write_checkpoint(
        self,
        ckpt_path: Any,
        *,
        step: int,
        include_optimizer: bool = True,
        include_ema_state: bool = True,
    ) -> None:
        """Borrowed: ``Trainer._write_checkpoint(ckpt_path, *, step, include_optimizer,
        include_ema_state)`` (3.2.0): the one method that serializes a checkpoint
        (periodic, EMA with the shadow weights applied around it, validation-best);
        every rank collects the state, rank 0 writes ``torch.save`` to ``ckpt_path``.
        Outside :meth:`deepmd_save_to` it is a best checkpoint, handed to
        :meth:`ckptdb_write_checkpoint` with its own write to another path."""
        options = {
            "step": step,
            "include_optimizer": include_optimizer,
            "include_ema_state": include_ema_state,
        }
        if self._ckptdb_writing:
            super()._write_checkpoint(ckpt_path, **options)
            return

        def write(target: Path) -> None:
            self._ckptdb_writing = True
            try:
                super(HookedExptTrainer, self)._write_checkpoint(target, **options)
            finally:
                self._ckptdb_writing = False

        self.ckptdb_write_checkpoint(Path(ckpt_path), write)

    def ckptdb_write_checkpoint(self, path: Path, write: Callable[[Path], None]) -> None:
        """Where DeePMD writes a checkpoint outside ``save_checkpoint``: by default, to
        ``path``."""
        write(path)

    def deepmd_save_to(self, target: Path, *, step: int, ema: bool) -> None:
        """DeePMD's own serialization of the checkpoint of ``step`` to ``target`` (the EMA
        twin with ``ema``: the shadow weights, no optimizer state).

        Borrowed: ``Trainer._save_checkpoint_to_path(path, *, step, use_ema_weights)``
        (3.2.0), what DeePMD's ``save_checkpoint`` calls for each file."""
        self._ckptdb_writing = True
        try:
            self._save_checkpoint_to_path(target, step=step, use_ema_weights=ema)
        finally:
            self._ckptdb_writing = False

    def deepmd_log_saved(self, path: Path) -> None:
        """DeePMD's own ``Saved model to <path>`` line, on DeePMD's logger (what its
        ``save_checkpoint`` prints after each periodic checkpoint; 3.2.0)."""
        expt_training.log.info(f"Saved model to {path}")

    def deepmd_learning_rate(self, step: int) -> float | None:
        """The learning rate of DeePMD's (one-based) ``step``, the one its
        ``lcurve.out`` shows there: this backend keeps none in ``train_infos``.

        Public: ``Trainer.learning_rate(step)`` (zero-based; 3.2.0)."""
        return float(self.learning_rate(step - 1))

    def deepmd_save_at(self, step: int) -> None:
        """DeePMD's loop saves a periodic checkpoint at the end of ``step`` (its
        ``save_freq`` becomes ``step``).

        Borrowed: ``AbstractTrainer.trainer_config`` (``deepmd.dpmodel.train.trainer``;
        3.2.0), a frozen ``TrainerConfig`` whose ``save_freq`` the loop reads at
        every step."""
        current: Any = getattr(self, "trainer_config")  # noqa: B009  # DeePMD's, untyped
        self.trainer_config = dataclasses.replace(current, save_freq=step)

    def deepmd_save_freq(self) -> int:
        """DeePMD's periodic checkpoint frequency now (``trainer_config.save_freq``, 3.2.0)."""
        current: Any = getattr(self, "trainer_config")  # noqa: B009  # DeePMD's, untyped
        return int(current.save_freq)


# --------------------------------------------------------------- validator


class HookedValidator(DeepmdValidator):  # type: ignore[misc]  # DeePMD is untyped
    """DeePMD-kit's ``FullValidator`` (``deepmd.pt_expt.train.validation``; 3.2.0)
    whose private hooks of best-checkpoint files forward to ckptdb-named
    methods. On its own it behaves as DeePMD's."""

    def _initialize_best_checkpoints(self, restart_training: bool) -> None:
        """Borrowed: ``FullValidator._initialize_best_checkpoints(restart_training)``
        (3.2.0): at construction (rank 0), deletes every best checkpoint file of
        an earlier run, or renames them after a restart."""
        self.ckptdb_initialize_best_checkpoints(restart_training)

    def ckptdb_initialize_best_checkpoints(self, restart_training: bool) -> None:
        super()._initialize_best_checkpoints(restart_training)

    def _reconcile_best_checkpoints(self) -> None:
        """Borrowed: ``FullValidator._reconcile_best_checkpoints()`` (3.2.0): after
        each best save, renames the best files by rank and deletes those out of
        its top-K."""
        self.ckptdb_reconcile_best_checkpoints()

    def ckptdb_reconcile_best_checkpoints(self) -> None:
        super()._reconcile_best_checkpoints()


def validator_appends(validator: Any) -> bool:
    """Whether the validator appends to its ``val.log`` (a restart) rather than
    rewriting it.

    Borrowed: ``FullValidator._write_mode`` (3.2.0): ``"a"`` on a restart,
    ``"w"`` until the first write otherwise."""
    return bool(validator._write_mode == "a")


def sync_topk_state(validator: Any) -> None:
    """Copy the validator's ``topk_records`` into the state DeePMD saves in its
    checkpoints (``train_infos``), after ckptdb changed them.

    Borrowed: ``FullValidator._sync_state_store()`` (3.2.0)."""
    validator._sync_state_store()


# ---------------------------------------------------------------- the config


def keep_count_from_ratio(ratio: Any, numb_steps: int, save_freq: int) -> int:
    """How many periodic checkpoints ``training.ckpt_keep_ratio`` keeps, as DeePMD
    counts it (``deepmd.dpmodel.train.checkpoint.resolve_keep_ckpt_count``; 3.2.0)."""
    from deepmd.dpmodel.train.checkpoint import resolve_keep_ckpt_count

    return int(resolve_keep_ckpt_count(ratio, numb_steps, save_freq))


def ema_checkpoint_prefix(prefix: str) -> str:
    """The EMA checkpoints' prefix for ``save_ckpt`` ``prefix`` (``model.ckpt`` ->
    ``model_ema.ckpt``), as DeePMD names them
    (``deepmd.pt_expt.train.ema.get_ema_checkpoint_prefix``; 3.2.0)."""
    from deepmd.pt_expt.train.ema import get_ema_checkpoint_prefix

    return str(get_ema_checkpoint_prefix(prefix))
