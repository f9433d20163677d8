"""Test-only stock ``dp``: DeePMD-kit's own entry point, no ckptdb.

With the one workaround the integration also makes
(:func:`ckptdb.integrations.deepmd.train._without_op_library`): when the
running torch is not the one DeePMD-kit 3.2.0's op library was built for,
``deepmd.pt.cxx_op`` is pre-seeded with ``ENABLE_CUSTOMIZED_OP = False`` so
that ``import deepmd.pt`` works. Nothing of ckptdb is imported.
"""

from __future__ import annotations

import sys
import types

import torch
from deepmd.env import GLOBAL_CONFIG


def _without_op_library() -> None:
    built_for = str(GLOBAL_CONFIG.get("pt_version") or "")
    if built_for and built_for != torch.__version__.split("+")[0]:
        stub = types.ModuleType("deepmd.pt.cxx_op")
        stub.ENABLE_CUSTOMIZED_OP = False  # type: ignore[attr-defined]
        stub.__all__ = ["ENABLE_CUSTOMIZED_OP"]  # type: ignore[attr-defined]
        sys.modules["deepmd.pt.cxx_op"] = stub


if __name__ == "__main__":
    _without_op_library()
    from deepmd.main import main

    main(sys.argv[1:])
