"""Every local scenario of the explorer: the boundaries', the other renames', an export's,
and (deep
only: a real Trainer's recording explores some 500 states) a framework's own writer's."""

from __future__ import annotations

from .exporting import EXPORT_SCENARIOS
from .frameworks import FRAMEWORK_SCENARIOS
from .renames import RENAME_SCENARIOS
from .scenarios import SCENARIOS as BOUNDARY_SCENARIOS
from .scenarios import Scenario

SCENARIOS: dict[str, Scenario] = {**BOUNDARY_SCENARIOS, **RENAME_SCENARIOS, **EXPORT_SCENARIOS}
DEEP_SCENARIOS: dict[str, Scenario] = {**SCENARIOS, **FRAMEWORK_SCENARIOS}
