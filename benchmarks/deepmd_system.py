"""A tiny DeePMD-kit training problem: the tests' and the benchmark's one system.

The system is a Lennard-Jones-like pair potential (two atom types, twelve
atoms in a periodic cubic box), written in DeePMD's npy format for training
and validation: pure numpy, deterministic, milliseconds. The model is the
smallest ``se_e2_a`` that trains (a few thousand parameters), so a run of a
hundred steps is a few seconds of training; most of a run's time is
importing DeePMD-kit. ``tests/deepmdlib.py`` and :mod:`benchmarks.deepmd_case`
both train on it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np

BOX = 6.0  # Angstrom, cubic
RCUT = 2.9  # < BOX/2: the minimum image is exact
EPS = np.array([[0.05, 0.04], [0.04, 0.03]])  # eV, per type pair
SIG = np.array([[1.6, 1.7], [1.7, 1.8]])  # Angstrom

#: One thread, no loader workers: on a 2-core runner a run is mostly its import.
SPEED_ENV = {
    "NUM_WORKERS": "0",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "DP_INTRA_OP_PARALLELISM_THREADS": "1",
    "DP_INTER_OP_PARALLELISM_THREADS": "1",
}

CONFIG: dict[str, Any] = {
    "model": {
        "type_map": ["A", "B"],
        "descriptor": {
            "type": "se_e2_a",
            "sel": [12, 12],
            "rcut_smth": 0.5,
            "rcut": 3.0,
            "neuron": [4, 8],
            "resnet_dt": False,
            "axis_neuron": 4,
            "seed": 1,
        },
        "fitting_net": {"neuron": [16, 16], "resnet_dt": True, "seed": 1},
    },
    "learning_rate": {"type": "exp", "decay_steps": 40, "start_lr": 0.001, "stop_lr": 1e-05},
    "loss": {
        "type": "ener",
        "start_pref_e": 0.2,
        "limit_pref_e": 1,
        "start_pref_f": 100,
        "limit_pref_f": 1,
        "start_pref_v": 0.02,
        "limit_pref_v": 0.1,
    },
    "training": {
        "training_data": {"systems": ["data/train"], "batch_size": 1},
        "validation_data": {"systems": ["data/valid"], "batch_size": 1, "numb_btch": 1},
        "numb_steps": 100,
        "seed": 10,
        "disp_file": "lcurve.out",
        "disp_freq": 20,
        "save_freq": 20,
        "max_ckpt_keep": 2,
    },
}


def _pair(r: np.ndarray, eps: np.ndarray, sig: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Energy and dE/dr of a LJ potential, force-shifted to 0 at the cutoff."""

    def lj(rr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s6 = (sig / rr) ** 6
        return 4 * eps * (s6 * s6 - s6), 4 * eps * (-12 * s6 * s6 + 6 * s6) / rr

    e, de = lj(r)
    ec, dec = lj(np.full_like(r, RCUT))
    return e - ec - (r - RCUT) * dec, de - dec


def _frame(rng: np.random.Generator, types: np.ndarray) -> tuple[np.ndarray, ...]:
    n = len(types)
    g = int(np.ceil(n ** (1 / 3)))  # a jittered lattice: no two atoms too close
    grid = np.array([(i, j, k) for i in range(g) for j in range(g) for k in range(g)])[:n]
    coord = ((grid + 0.5) * (BOX / g) + rng.normal(scale=0.15, size=(n, 3))) % BOX
    energy, force, virial = 0.0, np.zeros((n, 3)), np.zeros((3, 3))
    for i in range(n):
        d = coord[i + 1 :] - coord[i]
        d -= BOX * np.round(d / BOX)
        r = np.linalg.norm(d, axis=1)
        near = r < RCUT
        if not near.any():
            continue
        j = np.arange(i + 1, n)[near]
        e, de = _pair(r[near], EPS[types[i], types[j]], SIG[types[i], types[j]])
        energy += float(e.sum())
        fij = (de / r[near])[:, None] * d[near]
        force[i] += fij.sum(0)
        np.subtract.at(force, j, fij)
        virial -= np.einsum("ka,kb->ab", d[near], fij)
    box = np.eye(3) * BOX
    flat = coord.reshape(-1), box.reshape(-1), np.array(energy)
    return (*flat, force.reshape(-1), virial.reshape(-1))


def write_system(path: Path, *, natoms: int = 12, nframes: int = 8, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    types = np.array([i % 2 for i in range(natoms)], dtype=int)
    rows = [_frame(rng, types) for _ in range(nframes)]
    (path / "set.000").mkdir(parents=True, exist_ok=True)
    np.savetxt(path / "type.raw", types, fmt="%d")
    (path / "type_map.raw").write_text("A\nB\n")
    for k, name in enumerate(["coord", "box", "energy", "force", "virial"]):
        np.save(path / "set.000" / f"{name}.npy", np.array([r[k] for r in rows], dtype=np.float64))


#: Full validation every 20 steps from the start, the two best of each kind kept.
VALIDATING: dict[str, Any] = {
    "full_validation": True,
    "ema_full_validation": True,
    "validation_freq": 20,
    "full_val_start": 0,
    "save_best": True,
    "max_best_ckpt": 2,
    "validation_metric": "E:MAE",
    "full_val_file": "val.log",
}


def make_run_dir(path: Path, *, validating: dict[str, Any] | None = None, **training: Any) -> Path:
    """A training directory: ``data/{train,valid}`` and ``input.json`` (``training``
    overrides keys of the training section; ``validating`` is the section of that name)."""
    path.mkdir(parents=True, exist_ok=True)
    write_system(path / "data" / "train", seed=0)
    write_system(path / "data" / "valid", nframes=2, seed=1)
    config = copy.deepcopy(CONFIG)
    config["training"].update(training)
    if validating is not None:
        config["validating"] = validating
    (path / "input.json").write_text(json.dumps(config, indent=2))
    return path
