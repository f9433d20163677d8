"""DeePMD-kit's multi-task example (two heads over one shared DPA-2 descriptor) trained
through ckptdb on both backends: the longest of the examples of
``test_deepmd_examples.py`` (whose docstring says what each run checks), in a file
of its own so that xdist's ``--dist loadfile`` runs it beside the others.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("deepmd")

from test_deepmd_examples import MULTI_TASK, cases, train_freeze_and_restart

pytestmark = [pytest.mark.timeout(3600), pytest.mark.usefixtures("no_db_url_from_environment")]


@pytest.mark.parametrize(
    ("example", "backend"),
    cases((MULTI_TASK, "--pt", "multi_task"), (MULTI_TASK, "--pt-expt", "multi_task")),
)
def test_the_multi_task_example_trains_every_head_freezes_and_restarts(
    tmp_path: Path, example: str, backend: str
) -> None:
    train_freeze_and_restart(tmp_path, example, backend)
