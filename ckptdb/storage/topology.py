"""Topology: the ranks a checkpoint was saved on, and loading it on another number.

Every checkpoint row records the world size that saved it (``world_size``) and,
for a sharded payload, the device meshes of its DTensors (``topology``, JSON).
A job that comes back on another number of ranks (a lost node, a resized
allocation) loads through :mod:`torch.distributed.checkpoint`, which reshards
DTensors N -> M by itself. What DCP cannot decide is what a key that only
some ranks had means: a per-rank entry such as ``rng/3`` on a job that grew
from 3 ranks to 4. Before anything loads, every rank checks what it asks for
against the checkpoint's metadata (names, and the global shape of each
tensor), DCP gathers the outcome from every rank, so a mismatch is one clear error
on every rank, never a half-loaded state or a hang. The check runs inside
DCP's own planning step (:class:`LayoutCheckingPlanner`), on the metadata DCP
reads anyway: no extra read, no extra collective.

The policy for keys the checkpoint lacks (``load(..., missing_keys=...)``):

``"error"`` (the default)
    refuse the load on every rank, naming each rank and what it lacks;
``"keep"``
    the lacking keys keep the values ``into`` has (a new rank keeps its
    freshly seeded RNG state); every other key loads.

Keys the checkpoint has and no rank asks for (the per-rank entries of ranks
that are gone) stay in the checkpoint, unread. A different global shape is
never resolvable and always refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ..errors import InvalidArgumentError, LayoutMismatchError
from .dcp import Sharded

log = logging.getLogger(__name__)

#: The policies for keys a sharded checkpoint lacks (see the module docstring).
ERROR = "error"
KEEP = "keep"
MISSING_KEY_POLICIES = (ERROR, KEEP)


def check_policy(missing_keys: object) -> str:
    """``missing_keys``, refused unless it is one of :data:`MISSING_KEY_POLICIES`."""
    if missing_keys not in MISSING_KEY_POLICIES:
        raise InvalidArgumentError(
            f"missing_keys must be one of {', '.join(map(repr, MISSING_KEY_POLICIES))}, "
            f"got {missing_keys!r}"
        )
    return str(missing_keys)


def describe(payload: Any) -> str | None:
    """The ``topology`` column of a payload's row: for a sharded one, JSON listing each
    device mesh its DTensors live on (device type, shape, dimension names) with how
    many tensors and which placements; None for any other payload."""
    if not isinstance(payload, Sharded):
        return None
    meshes: dict[tuple[Any, ...], dict[str, Any]] = {}
    for value in _leaves(payload.state_dict):
        if not isinstance(value, DTensor):
            continue
        mesh = value.device_mesh
        names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
        key = (mesh.device_type, tuple(mesh.shape), tuple(names or ()))
        entry = meshes.setdefault(
            key,
            {
                "device_type": mesh.device_type,
                "shape": list(mesh.shape),
                "dim_names": names,
                "tensors": 0,
                "placements": [],
            },
        )
        entry["tensors"] += 1
        shown = [repr(p) for p in value.placements]
        if shown not in entry["placements"]:
            entry["placements"].append(shown)
    return json.dumps({"meshes": list(meshes.values())}, sort_keys=True)


def _leaves(value: Any) -> Iterator[Any]:
    """Every value inside nested dicts, lists and tuples (as DCP flattens them)."""
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


class LayoutCheckingPlanner(DefaultLoadPlanner):
    """DCP's default load planner, checking what this rank asks for first.

    DCP hands every rank's planner the checkpoint's metadata (read once, by
    DCP itself) and this rank's state dict, flattened as DCP plans it, before
    it plans or reads anything; a refusal here is gathered by DCP from every
    rank and raised on all of them, before any tensor is read. With policy
    ``keep`` the keys the checkpoint lacks are left out of the plan.
    """

    def __init__(
        self, missing_keys: str, *, where: str, saved_world_size: int | None, world_size: int
    ) -> None:
        super().__init__(allow_partial_load=missing_keys == KEEP)
        self.missing_keys = missing_keys
        self.where = where
        self.saved_world_size = saved_world_size
        self.world_size = world_size

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:  # DCP always passes it on a load; nothing to check against
            return
        # The keys as DCP flattens them now (DCP falls back to its pre-2.4 flattening only
        # for checkpoints written that way; ckptdb's are written by torch 2.6 or later).
        check_layout(
            self.state_dict,
            metadata,
            where=self.where,
            saved_world_size=self.saved_world_size,
            world_size=self.world_size,
            missing_keys=self.missing_keys,
        )


def check_layout(
    wanted: dict[str, Any],
    metadata: Metadata,
    *,
    where: str,
    saved_world_size: int | None,
    world_size: int,
    missing_keys: str,
) -> list[str]:
    """The keys of ``wanted`` (a state dict flattened as DCP plans it) that keep their
    values under policy ``keep``; raises :class:`~ckptdb.errors.LayoutMismatchError`
    for a key the checkpoint lacks (policy ``error``) or another global shape."""
    saved = metadata.state_dict_metadata
    absent = [key for key in wanted if key not in saved]
    unfit = [_unfit(key, saved[key], wanted[key]) for key in wanted if key in saved]
    ranks = _ranks_said(saved_world_size, world_size)
    if any(unfit):
        said = "; ".join(u for u in unfit if u)
        raise LayoutMismatchError(f"{where} cannot load ({ranks}): {said}")
    if absent and missing_keys == ERROR:
        raise LayoutMismatchError(
            f"{where} has no {', '.join(map(repr, absent))} ({ranks}); "
            "load(..., missing_keys='keep') keeps this rank's own values for them"
        )
    if absent:
        log.warning(
            "%s has no %s (%s): kept as they were (missing_keys='keep')",
            where,
            ", ".join(map(repr, absent)),
            ranks,
        )
    return absent


def _unfit(key: str, found: Any, value: Any) -> str | None:
    """Why the saved entry ``found`` cannot load into ``value`` (None: it can): a tensor
    where something else was saved or the reverse, or another global shape."""
    tensor_saved = isinstance(found, TensorStorageMetadata)
    shape = _shape(value)
    if tensor_saved != (shape is not None):
        what = "a tensor" if tensor_saved else "a value that is not a tensor"
        return f"{key!r} was saved as {what}, this job's is {type(value).__name__}"
    if tensor_saved and tuple(found.size) != tuple(shape):
        return f"{key!r} was saved with shape {tuple(found.size)}, this job's is {tuple(shape)}"
    return None


def _shape(value: Any) -> Any:
    """A tensor's global shape (a DTensor's too); None for anything else."""
    if not isinstance(value, torch.Tensor):
        return None
    return value.size()


def _ranks_said(saved_world_size: int | None, world_size: int) -> str:
    now = _ranks(world_size)
    if saved_world_size is None:
        return f"saved on an unrecorded number of ranks; this job runs on {now}"
    if saved_world_size == world_size:
        return f"saved on {now}, as this job runs"
    return f"saved on {_ranks(saved_world_size)}; this job runs on {now}"


def _ranks(count: int) -> str:
    return f"{count} rank" if count == 1 else f"{count} ranks"


def agreed_mismatch(exc: CheckpointException) -> LayoutMismatchError | None:
    """DCP's agreed failure, when every failing rank refused the layout: one
    :class:`~ckptdb.errors.LayoutMismatchError` naming each rank (``ranks``), the
    same on every rank; None for any other failure."""
    failures = sorted(exc.failures.items())
    if not failures or not all(isinstance(f[0], LayoutMismatchError) for _, f in failures):
        return None
    error = LayoutMismatchError("; ".join(f"rank {rank}: {f[0]}" for rank, f in failures))
    error.ranks = [rank for rank, _ in failures]
    error.__cause__ = exc  # DCP's, with every rank's traceback
    return error


__all__ = [
    "ERROR",
    "KEEP",
    "MISSING_KEY_POLICIES",
    "LayoutCheckingPlanner",
    "agreed_mismatch",
    "check_layout",
    "check_policy",
    "describe",
]
