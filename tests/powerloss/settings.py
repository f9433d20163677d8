"""How deep an exploration goes: the default suite's bound, or ``CKPTDB_POWERLOSS=deep``."""

from __future__ import annotations

import os

from .persistence import Budget

ENV = "CKPTDB_POWERLOSS"
DEEP = os.environ.get(ENV, "").strip().lower() == "deep"
SEED = int(os.environ.get("CKPTDB_POWERLOSS_SEED", "20261201"))


def budget_for(deep: bool) -> Budget:
    """The default suite: each cut's structured states (its extremes, each floating
    operation and each file varied alone) unless it has at most 4 states in all.
    Deep: every state of a cut with up to 4096, else the structured ones and 64
    drawn at random."""
    return Budget(exhaustive=4096, samples=64, seed=SEED) if deep else Budget(4, 0, SEED)
