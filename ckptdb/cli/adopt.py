"""``ckptdb adopt``: register the checkpoints of an existing run in a ledger.

A **layout** knows one framework's checkpoints: where they are, which are
complete, their step and metrics, and where that framework's ckptdb
integration keeps its ledger (so that a later training run with the
integration finds the adopted checkpoints). It only reads. The ledger work is
:mod:`ckptdb.protocol.adopt` (through :meth:`CheckpointManager.adopt`).

=============  =================================  ======================  ==============
layout         checkpoints (ROOT is...)           ledger (save dir)       stream
=============  =================================  ======================  ==============
lightning      ``*.ckpt`` in the ``dirpath``      ``<parent>/.<name>.``   the monitor's
                                                  ``ckptdb`` (ROOT)       name, or
                                                                          ``checkpoints``
transformers   ``checkpoint-<N>/`` in the         ROOT (ROOT)             ``checkpoints``
               ``output_dir``
accelerate     ``checkpoints/checkpoint_<N>/``    ROOT                    ``checkpoints``
               in the ``project_dir``             (ROOT/checkpoints)
deepmd         ``model.ckpt-<N>.pt``              ROOT (ROOT)             ``model``
glob           ``--pattern`` under ROOT           ROOT (ROOT)             ``model``
=============  =================================  ======================  ==============

An existing run keeps its stored save directory. Nothing but the ledger is
written, except DeePMD's ``model.ckpt.pt`` alias and ``checkpoint`` pointer
(re-pointed at the newest committed checkpoint after the commit) and, with
``--move``, checkpoints outside the run's save directory (moved into it).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ..errors import InvalidArgumentError, LedgerError
from ..ledger import Ledger, RunQueries, open_ledger
from ..ledger.engine import LEDGER_FILE
from ..ledger.runs import OpenedRun, ledger_beside, ledger_url, open_as_reader
from ..location import ObjectPath
from ..manager import CheckpointManager
from ..policies import RESERVED_STREAM_NAMES, Policy
from ..protocol.adopt import ADOPTED, NEW_STREAM_POLICY, Candidate, Outcome, preview
from ..storage.alias import point_alias, point_symlink, write_pointer
from ..storage.local import LocalStore

__all__ = ["LAYOUTS", "AdoptReport", "AliasChange", "adopt", "layout_named", "lightning_stream"]

LAYOUTS = ("lightning", "transformers", "accelerate", "deepmd", "glob")


# ------------------------------------------------------------------ file checks


def file_damage(path: Path) -> str | None:
    """Why a file looks partial or damaged; None if it looks whole (or its format is
    not one we can check). ``torch.save`` files (zip archives: their directory is at
    the end, so a truncated one has none) and safetensors (header vs size) are checked."""
    try:
        size = path.stat().st_size
        if size == 0:
            return "empty file"
        with open(path, "rb") as f:
            head = f.read(8)
        if path.suffix == ".safetensors":
            return _safetensors_damage(path, size, head)
        if head.startswith(b"PK\x03\x04"):
            with zipfile.ZipFile(path) as archive:
                archive.infolist()
    except (OSError, ValueError, KeyError, TypeError, AttributeError, zipfile.BadZipFile) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _safetensors_damage(path: Path, size: int, head: bytes) -> str | None:
    if len(head) < 8:
        return f"truncated ({size} bytes)"
    length = int.from_bytes(head, "little")
    if 8 + length > size:
        return f"truncated: its header alone needs {8 + length} bytes, the file has {size}"
    with open(path, "rb") as f:
        f.seek(8)
        header = json.loads(f.read(length))
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"truncated: {size} bytes, its header describes {expected}"
    return None


def tree_damage(directory: Path) -> str | None:
    """The first damaged file of a checkpoint directory (or a link inside it)."""
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory).as_posix()
        if path.is_symlink():
            return f"{rel}: a link inside the checkpoint directory"
        if path.is_file():
            damage = file_damage(path)
            if damage is not None:
                return f"{rel}: {damage}"
    return None


def _torch_load(path: Path) -> Any:
    """A ``torch.save`` file's contents with ``weights_only=True`` (tensors memory-mapped)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not a zip archive (the legacy format) cannot be mapped: read it
        return torch.load(path, map_location="cpu", weights_only=True)


def _unreadable(exc: BaseException) -> str:
    text = " ".join(str(exc).split())[:200]
    return f"unreadable (partial or damaged?): {type(exc).__name__}: {text}"


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _kind_problem(path: Path, want_dir: bool) -> str | None:
    if path.is_symlink():
        return "a symbolic link (an alias), not a checkpoint"
    if want_dir and not path.is_dir():
        return "not a directory"
    if not want_dir and not path.is_file():
        return "not a regular file"
    return None


# ------------------------------------------------------------------ aliases


@dataclass(frozen=True)
class AliasChange:
    """A derived name that adopt re-points at the newest committed checkpoint."""

    path: Path
    target: Path
    kind: Literal["symlink", "link", "pointer"]

    def apply(self) -> None:
        if self.kind == "symlink":
            point_symlink(self.target, self.path)
        elif self.kind == "link":
            point_alias(self.target, self.path)
        else:
            write_pointer(self.path, os.path.relpath(self.target, self.path.parent))

    def __str__(self) -> str:
        return f"{self.path.name} -> {os.path.relpath(self.target, self.path.parent)}"


# ------------------------------------------------------------------ layouts


class Layout:
    """One framework's checkpoints (see the module docstring). Subclasses scan."""

    name = ""
    #: The stream whose newest checkpoint the layout's aliases name (None: no aliases).
    alias_stream: str | None = None

    def ledger_root(self, root: Path) -> Path:
        return root

    def save_dir(self, root: Path) -> Path:
        return root

    def scan(self, root: Path) -> list[Candidate]:
        raise NotImplementedError

    def alias_changes(self, root: Path, target: Path | None) -> list[AliasChange]:
        """The aliases that do not name ``target`` yet (none by default)."""
        return []


#: Lightning's ``last`` alias names (``last.ckpt``, ``last-v1.ckpt``).
LIGHTNING_ALIAS = re.compile(r"last(-v\d+)?\.ckpt")


def lightning_stream(monitor: str | None) -> str:
    """The top-k stream ckptdb's Lightning ``ModelCheckpoint`` uses for ``monitor``
    (``main_stream`` without ``stream=``); ``tests/test_adopt.py`` compares the two."""
    if monitor is None:
        return "checkpoints"
    name = re.sub(r"[^A-Za-z0-9_.\-]", "_", monitor).strip(".")[:56] or "monitor"
    return f"by_{name}" if name in RESERVED_STREAM_NAMES else name


class _Ambiguous(Exception):
    pass


class LightningLayout(Layout):
    """``*.ckpt`` files in a ``ModelCheckpoint`` dirpath; the ledger beside it.

    Step: ``global_step`` in the file. Stream: the monitor of the
    ``ModelCheckpoint`` whose state (inside the file) names it, as the ckptdb
    ``ModelCheckpoint`` names its streams; a ``last*.ckpt`` file goes to its
    ``<stream>.last`` stream; ``last.ckpt`` / ``last-vN.ckpt`` are alias names
    and never adopted. Metric: the file's score in that state's
    ``best_k_models`` (or ``current_score``), stored under the monitor's name.
    """

    name = "lightning"

    def ledger_root(self, root: Path) -> Path:
        if root.parent == root:
            raise InvalidArgumentError(f"dirpath {root} has no parent to hold its ledger")
        return ledger_beside(root)

    def scan(self, root: Path) -> list[Candidate]:
        return [
            self._read(entry)
            for entry in sorted(root.iterdir())
            if entry.name.endswith(".ckpt") and not entry.name.startswith(".")
        ]

    def _read(self, path: Path) -> Candidate:
        if LIGHTNING_ALIAS.fullmatch(path.name):
            return Candidate(
                path,
                problem="the 'last' alias name: the ckptdb ModelCheckpoint re-points it after "
                "every save, so it is never a checkpoint of its own (copy it to another name "
                "to adopt what it holds)",
            )
        problem = _kind_problem(path, want_dir=False)
        if path.is_dir() and not path.is_symlink():
            problem = "a directory (sharded) checkpoint: the lightning layout reads single files"
        if problem is not None:
            return Candidate(path, problem=problem)
        try:
            ckpt = _torch_load(path)
        except Exception as exc:
            return Candidate(path, problem=_unreadable(exc))
        step = ckpt.get("global_step") if isinstance(ckpt, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            return Candidate(path, problem="not a Lightning checkpoint (no global_step)")
        callbacks = ckpt.get("callbacks")
        states = [
            state
            for key, state in (callbacks if isinstance(callbacks, dict) else {}).items()
            if isinstance(key, str)
            and key.startswith("ModelCheckpoint")
            and isinstance(state, dict)
        ]
        try:
            state = _writer_of(states, path.name)
        except _Ambiguous:
            return Candidate(
                path,
                step=step,
                problem="several ModelCheckpoint callbacks, none of which names this file",
            )
        monitor = state.get("monitor") if state is not None else None
        monitor = monitor if isinstance(monitor, str) and monitor else None
        stream = lightning_stream(monitor)
        metrics: dict[str, float] = {}
        if path.name.startswith("last"):
            stream += ".last"
        elif monitor is not None and state is not None:
            score = _score_in(state, path.name)
            if score is not None:
                # the ledger ranks by finite numbers: the integration stores +-inf as the
                # largest float of that sign (Lightning's score for a NaN monitor)
                metrics[monitor] = (
                    score
                    if math.isnan(score)
                    else max(min(score, sys.float_info.max), -sys.float_info.max)
                )
        return Candidate(path, stream, step, metrics, written_at=_mtime(path))


def _names_in(state: Mapping[str, Any]) -> set[str]:
    keys = [*(state.get("best_k_models") or {}), state.get("best_model_path")]
    keys.append(state.get("last_model_path"))
    return {Path(str(k)).name for k in keys if k}


def _writer_of(states: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any] | None:
    """The ModelCheckpoint state that wrote ``name``: the one naming it, or the only one."""
    naming = [s for s in states if name in _names_in(s)]
    if len(naming) == 1:
        return naming[0]
    if not naming and len(states) == 1:
        return states[0]
    if not states:
        return None
    raise _Ambiguous


def _score_in(state: Mapping[str, Any], name: str) -> float | None:
    for key, value in (state.get("best_k_models") or {}).items():
        if Path(str(key)).name == name:
            return _number(value)
    if Path(str(state.get("best_model_path") or "")).name == name:
        return _number(state.get("best_model_score"))
    return _number(state.get("current_score"))


class TransformersLayout(Layout):
    """``checkpoint-<N>/`` directories of a Hugging Face ``Trainer`` ``output_dir``.

    Complete: ``trainer_state.json`` (the Trainer writes it last) says
    ``global_step`` N; model weights are there (``model.safetensors``,
    ``pytorch_model.bin``, an adapter, or a sharded index with all its
    shards); every ``torch.save`` and safetensors file in it is whole.
    Metrics: the ``log_history`` entries at step N (``eval_loss``...).
    """

    name = "transformers"
    PATTERN = re.compile(r"checkpoint-(\d+)")
    WEIGHTS = (
        "model.safetensors",
        "pytorch_model.bin",
        "adapter_model.safetensors",
        "adapter_model.bin",
    )
    INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

    def scan(self, root: Path) -> list[Candidate]:
        found = []
        for entry in sorted(root.iterdir()):
            match = self.PATTERN.fullmatch(entry.name)
            if match is not None:
                found.append(self._read(entry, int(match.group(1))))
        return found

    def _read(self, path: Path, step: int) -> Candidate:
        problem = _kind_problem(path, want_dir=True)
        if problem is not None:
            return Candidate(path, step=step, problem=problem)
        state_file = path / "trainer_state.json"
        if not state_file.is_file():
            return Candidate(
                path,
                step=step,
                problem="no trainer_state.json (the Trainer writes it last: an unfinished save)",
            )
        try:
            state = json.loads(state_file.read_text(encoding="utf-8"))
            if not isinstance(state, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            return Candidate(path, step=step, problem=f"trainer_state.json unreadable: {exc}")
        if state.get("global_step") != step:
            return Candidate(
                path,
                step=step,
                problem=f"trainer_state.json says global_step {state.get('global_step')!r}, "
                f"its name says {step}",
            )
        problem = self._weights_problem(path) or tree_damage(path)
        if problem is not None:
            return Candidate(path, step=step, problem=problem)
        metrics: dict[str, float] = {}
        for entry in state.get("log_history") or []:
            if isinstance(entry, dict) and entry.get("step") == step:
                for key, value in entry.items():
                    number = _number(value)
                    if key != "step" and number is not None:
                        metrics[str(key)] = number
        return Candidate(path, "checkpoints", step, metrics, written_at=_mtime(state_file))

    def _weights_problem(self, path: Path) -> str | None:
        if any((path / name).is_file() for name in self.WEIGHTS):
            return None
        for index in self.INDEXES:
            if (path / index).is_file():
                try:
                    shards = set(json.loads((path / index).read_text())["weight_map"].values())
                except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                    return f"{index} unreadable: {exc}"
                missing = sorted(str(s) for s in shards if not (path / str(s)).is_file())
                return f"model shards missing: {', '.join(missing)}" if missing else None
        return "no model weights (model.safetensors, pytorch_model.bin or a sharded index)"


class AccelerateLayout(Layout):
    """``checkpoints/checkpoint_<N>/`` of an Accelerate ``project_dir`` (automatic naming).

    Step: N from the name (Accelerate's automatic naming counts saves; the ckptdb
    integration's ``checkpoint_<step>[-v<n>]`` names carry the training step). Complete: what
    ``Accelerator.save_state`` writes: the model (``model.safetensors``,
    ``pytorch_model.bin``, or FSDP's ``pytorch_model_fsdp_0``), the optimizer
    (``optimizer.bin``, or FSDP's ``optimizer_0``) and the random states of
    every process (``random_states_<i>.pkl``, i = 0.., written last), every
    file whole.
    """

    name = "accelerate"
    PATTERN = re.compile(r"checkpoint_(\d+)(?:-v\d+)?")
    RANDOM_STATES = re.compile(r"random_states_(\d+)\.pkl")

    def save_dir(self, root: Path) -> Path:
        return root / "checkpoints"

    def scan(self, root: Path) -> list[Candidate]:
        directory = self.save_dir(root)
        if not directory.is_dir():
            return []
        found = []
        for entry in sorted(directory.iterdir()):
            match = self.PATTERN.fullmatch(entry.name)
            if match is not None:
                found.append(self._read(entry, int(match.group(1))))
        return found

    def _read(self, path: Path, step: int) -> Candidate:
        problem = _kind_problem(path, want_dir=True) or self._missing(path) or tree_damage(path)
        if problem is not None:
            return Candidate(path, step=step, problem=problem)
        return Candidate(path, "checkpoints", step, written_at=_mtime(path))

    def _missing(self, path: Path) -> str | None:
        names = {p.name for p in path.iterdir()}
        model = names & {"model.safetensors", "pytorch_model.bin"} or {
            n for n in names if n.startswith("pytorch_model_fsdp_0")
        }
        if not model:
            return "no model weights (model.safetensors or pytorch_model.bin)"
        if not ("optimizer.bin" in names or any(n.startswith("optimizer_0") for n in names)):
            return "no optimizer.bin"
        ranks = sorted(int(m.group(1)) for n in names if (m := self.RANDOM_STATES.fullmatch(n)))
        if not ranks:
            return "no random_states_0.pkl (save_state writes it last: an unfinished save)"
        if ranks != list(range(len(ranks))):
            return f"random states of some processes missing (found {ranks})"
        return None


class DeepmdLayout(Layout):
    """DeePMD-kit (PyTorch backend): ``model.ckpt-<N>.pt`` files in the training directory.

    A file is ``torch.save({"model": state_dict, "optimizer": ...})``; its
    ``model["_extra_state"]["train_infos"]["step"]`` must be N or N - 1
    (DeePMD stores the index of the step it had just done), and the step
    recorded is N, the one in the name that DeePMD's ``checkpoint`` file
    names. After the commit, the ``model.ckpt.pt`` alias (a symlink stays a
    symlink) and the ``checkpoint`` pointer name the newest committed one.
    """

    name = "deepmd"
    alias_stream = "model"
    PATTERN = re.compile(r"model\.ckpt-(\d+)\.pt")
    ALIAS = "model.ckpt.pt"
    POINTER = "checkpoint"

    def scan(self, root: Path) -> list[Candidate]:
        found = []
        for entry in sorted(root.iterdir()):
            match = self.PATTERN.fullmatch(entry.name)
            if match is not None:
                found.append(self._read(entry, int(match.group(1))))
        return found

    def _read(self, path: Path, step: int) -> Candidate:
        problem = _kind_problem(path, want_dir=False)
        if problem is not None:
            return Candidate(path, step=step, problem=problem)
        try:
            ckpt = _torch_load(path)
        except Exception as exc:
            return Candidate(path, step=step, problem=_unreadable(exc))
        infos = _dig(ckpt, "model", "_extra_state", "train_infos")
        stored = infos.get("step") if isinstance(infos, dict) else None
        if not isinstance(stored, int) or isinstance(stored, bool):
            return Candidate(
                path,
                step=step,
                problem="not a DeePMD checkpoint (no model._extra_state.train_infos.step)",
            )
        if stored not in (step, step - 1):
            return Candidate(
                path,
                step=step,
                problem=f"the step stored in it ({stored}) does not match its name (step {step})",
            )
        assert isinstance(infos, dict)
        lr = _number(infos.get("lr"))
        metrics = {"lr": lr} if lr is not None else {}
        return Candidate(path, "model", step, metrics, written_at=_mtime(path))

    def alias_changes(self, root: Path, target: Path | None) -> list[AliasChange]:
        if target is None:
            return []
        changes = []
        alias = root / self.ALIAS
        if alias.is_file() and not alias.is_symlink():  # a copy or hard link (not DeePMD's own)
            if not os.path.samefile(alias, target):
                changes.append(AliasChange(alias, target, "link"))
        elif not (alias.is_symlink() and os.readlink(alias) == os.path.relpath(target, root)):
            changes.append(AliasChange(alias, target, "symlink"))
        pointer = root / self.POINTER
        try:
            current = (
                pointer.read_text() if pointer.is_file() and not pointer.is_symlink() else None
            )
        except (OSError, UnicodeDecodeError):
            current = None
        if current != os.path.relpath(target, root):
            changes.append(AliasChange(pointer, target, "pointer"))
        return changes


def _dig(value: Any, *keys: str) -> Any:
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


class GlobLayout(Layout):
    """Files (or directories) matching ``pattern`` under ROOT; step from the name.

    The step is the first integer in the file name, or the group of
    ``step_regex`` (its only group, or the one named ``step``) searched in
    the name. A ``torch.save`` or safetensors file must be whole.
    """

    name = "glob"

    def __init__(self, pattern: str | None, step_regex: str | None) -> None:
        if not pattern:
            raise InvalidArgumentError("--layout glob needs --pattern, e.g. --pattern 'ckpt_*.pt'")
        parts = Path(pattern).parts
        if Path(pattern).is_absolute() or ".." in parts or pattern.startswith("~"):
            raise InvalidArgumentError(
                f"--pattern {pattern!r} must be relative to ROOT, without '..'"
            )
        self.pattern = pattern
        self.step_regex = step_regex
        try:
            regex = re.compile(step_regex if step_regex is not None else r"\d+")
        except re.error as exc:
            raise InvalidArgumentError(
                f"--step-regex {step_regex!r} is not a regex: {exc}"
            ) from exc
        if step_regex is not None and "step" not in regex.groupindex and regex.groups != 1:
            raise InvalidArgumentError(
                f"--step-regex {step_regex!r} needs one group (or a group named 'step') "
                "that matches the step, e.g. 'step(\\d+)'"
            )
        self.regex = regex
        self.group: int | str = (
            "step" if "step" in regex.groupindex else (1 if regex.groups == 1 else 0)
        )

    def scan(self, root: Path) -> list[Candidate]:
        try:
            matches = sorted(root.glob(self.pattern))
        except (ValueError, NotImplementedError) as exc:
            raise InvalidArgumentError(f"--pattern {self.pattern!r}: {exc}") from exc
        found = []
        for path in matches:
            rel = path.relative_to(root).parts
            if not rel or any(p.startswith((".", "ckptdb.")) for p in rel):
                continue  # hidden files (ckptdb's temporaries among them), the ledger's own
            if not path.parent.resolve().is_relative_to(root):
                found.append(Candidate(path, problem="reached through a link out of ROOT"))
                continue
            found.append(self._read(path))
        return found

    def _read(self, path: Path) -> Candidate:
        if path.is_symlink():
            return Candidate(path, problem="a symbolic link (an alias), not a checkpoint")
        match = self.regex.search(path.name)
        text = match.group(self.group) if match is not None else None
        if text is None or not text.isdigit():
            how = f"--step-regex {self.step_regex!r}" if self.step_regex else "an integer"
            return Candidate(path, problem=f"no step in its name ({how})")
        step = int(text)
        problem = tree_damage(path) if path.is_dir() else file_damage(path)
        if problem is not None:
            return Candidate(path, step=step, problem=problem)
        return Candidate(path, "model", step, written_at=_mtime(path))


def layout_named(name: str, pattern: str | None = None, step_regex: str | None = None) -> Layout:
    """The layout called ``name`` (``--pattern`` and ``--step-regex`` are the glob layout's)."""
    if name not in LAYOUTS:
        raise InvalidArgumentError(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}")
    if name == "glob":
        return GlobLayout(pattern, step_regex)
    if pattern is not None or step_regex is not None:
        raise InvalidArgumentError("--pattern and --step-regex are for --layout glob")
    layouts: dict[str, Callable[[], Layout]] = {
        "lightning": LightningLayout,
        "transformers": TransformersLayout,
        "accelerate": AccelerateLayout,
        "deepmd": DeepmdLayout,
    }
    return layouts[name]()


# ------------------------------------------------------------------ adopting


@dataclass
class AdoptReport:
    """What one ``adopt`` did (or, with ``dry_run``, would do)."""

    root: Path
    layout: str
    ledger: Path
    save_dir: Path
    dry_run: bool
    outcomes: list[Outcome] = field(default_factory=list)
    aliases: list[AliasChange] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(1 for o in self.outcomes if o.status == status)


def _order(candidate: Candidate) -> tuple[bool, int, str]:
    """Oldest first (adopting appends); those without a step last."""
    return (candidate.step is None, candidate.step or 0, str(candidate.source))


def _existing_run(ledger_root: Path, db_url: str | None) -> tuple[Ledger, OpenedRun] | None:
    """The run already recorded for ``ledger_root`` (read-only), or None."""
    if db_url is None and not (ledger_root / LEDGER_FILE).is_file():
        return None
    db = open_ledger(ledger_url(ledger_root, db_url, readonly=True), readonly=True)
    try:
        schema = db.schema()
        if schema == "empty":
            db.dispose()
            return None
        if schema != "current":
            raise LedgerError(
                f"the ledger of {ledger_root} uses an older schema; run "
                f"`ckptdb db upgrade {ledger_root}` first"
            )
        try:
            run = open_as_reader(db, ledger_root, adopt_single=db_url is None)
        except LedgerError:  # a current schema without this run: a new run
            db.dispose()
            return None
    except BaseException:
        db.dispose()
        raise
    return db, run


def adopt(
    root: str | os.PathLike[str],
    layout: str,
    *,
    pattern: str | None = None,
    step_regex: str | None = None,
    dry_run: bool = False,
    move: bool = False,
    db_url: str | None = None,
    report: Callable[[Outcome], None] | None = None,
) -> AdoptReport:
    """Adopt the checkpoints that ``layout`` finds in ``root`` (see the module docstring).

    Bad input (an unknown layout, a bad pattern, a ROOT that is no directory)
    raises :class:`~ckptdb.errors.InvalidArgumentError` before anything is
    read; a run whose writer lock another process holds raises
    :class:`~ckptdb.errors.LedgerLockedError` before anything changes.
    ``report`` hears each outcome once it is final.
    """
    lay = layout_named(layout, pattern, step_regex)
    where = Path(root)
    if not where.is_dir():
        what = "does not exist" if not os.path.lexists(where) else "is not a directory"
        raise InvalidArgumentError(f"ROOT {where} {what}")
    where = where.resolve()
    candidates = sorted(lay.scan(where), key=_order)
    ledger_root = lay.ledger_root(where)
    existing = _existing_run(ledger_root, db_url)
    policies: dict[str, Policy] = {}
    current: Path | None = None
    if existing is None:
        save_dir = lay.save_dir(where)
        outcomes = preview(
            candidates, save_dir=save_dir, store=LocalStore(save_dir), policies={}, move=move
        )
    else:
        db, run = existing
        save_dir, policies = run.save_dir, run.policies
        if isinstance(save_dir, ObjectPath) and move:
            db.dispose()
            raise InvalidArgumentError(
                f"adopt --move: the run saves to object storage ({save_dir}), and moving a "
                "local file there would be an upload; adopt it into a run with a local save_dir"
            )
        try:
            outcomes = preview(
                candidates,
                save_dir=save_dir,
                store=LocalStore(save_dir),
                policies=policies,
                db=db,
                run_id=run.run_id,
                move=move,
            )
            if lay.alias_stream in policies:
                latest = RunQueries(db, run.run_id, save_dir, policies).latest(lay.alias_stream)
                current = latest.path if latest is not None else None
        finally:
            db.dispose()
    result = AdoptReport(where, lay.name, ledger_root, save_dir, dry_run, outcomes)
    planned = [o for o in outcomes if o.status == ADOPTED]
    newest = [o for o in planned if o.candidate.stream == lay.alias_stream and o.name]
    target = save_dir / str(newest[-1].name) if newest else current
    result.aliases = lay.alias_changes(where, target)
    if dry_run or (not planned and not result.aliases):
        if report is not None:
            for outcome in outcomes:
                report(outcome)
        return result
    streams = {str(o.candidate.stream): NEW_STREAM_POLICY for o in planned}
    with CheckpointManager(
        ledger_root,
        streams=streams if existing is None else None,
        save_dir=save_dir if existing is None else None,
        db_url=db_url,
        maintenance=True,
    ) as mgr:
        result.outcomes = mgr.adopt(candidates, move=move, report=report)
        stream = lay.alias_stream
        latest = mgr.latest(stream) if stream is not None and stream in mgr.policies else None
        result.aliases = lay.alias_changes(where, latest.path if latest is not None else None)
        for change in result.aliases:
            change.apply()
    return result
