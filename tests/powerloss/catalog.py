"""Every local scenario of the explorer: the boundaries' and the other renames'."""

from __future__ import annotations

from .renames import RENAME_SCENARIOS
from .scenarios import SCENARIOS as BOUNDARY_SCENARIOS
from .scenarios import Scenario

SCENARIOS: dict[str, Scenario] = {**BOUNDARY_SCENARIOS, **RENAME_SCENARIOS}
