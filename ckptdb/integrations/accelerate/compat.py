"""What ckptdb's ``Checkpoints`` borrows from Accelerate's internals, in one place.

Accelerate's public ``save_state``/``load_state`` do the writing and reading;
the guard needs to know which models and optimizers an ``Accelerator``
prepared, which Accelerate keeps in private lists. Both are read here,
checked against accelerate 1.15.0 and 1.16.0 (the oldest and newest CI
runs the integration's tests on), and :func:`check_version` refuses a
release outside the tested range at import, in one line.
"""

from __future__ import annotations

from typing import Any

import accelerate

from ..common import check_release

#: The tested range: the oldest release supported, and the first one that is not.
OLDEST, FIRST_UNSUPPORTED = (1, 15), (2, 0)


def check_version(version: str | None = None) -> str:
    """Accelerate's version, or :class:`~ckptdb.errors.UnsupportedVersionError` outside
    the tested range."""
    found = str(accelerate.__version__ if version is None else version)
    tested = (OLDEST, FIRST_UNSUPPORTED)
    return check_release(
        found,
        tested,
        framework="accelerate",
        integration="ckptdb's Checkpoints",
        extra="accelerate",
    )


check_version()


def prepared_models(accelerator: Any) -> list[Any]:
    """The models ``accelerator.prepare`` wrapped (``Accelerator._models``)."""
    return list(accelerator._models)


def prepared_optimizers(accelerator: Any) -> list[Any]:
    """The optimizers ``accelerator.prepare`` wrapped (``Accelerator._optimizers``)."""
    return list(accelerator._optimizers)
