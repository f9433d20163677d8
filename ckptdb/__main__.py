"""The ``ckptdb`` command's entry point (also ``python -m ckptdb``).

``ckptdb latest ROOT`` is answered by :mod:`ckptdb.quickread` from the standard
library when it can be: a shell script's ``$(ckptdb latest runs/exp1)`` then
costs a Python start and one SQLite read. Everything else, and that command
whenever the quick read declines, is the full command (:mod:`ckptdb.cli`).
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    """Run the ``ckptdb`` command on ``sys.argv``."""
    from .quickread import latest_path

    answer = latest_path(sys.argv[1:], os.environ)
    if answer is not None:
        print(answer)
        return
    from .cli import main as command

    command(prog_name="ckptdb")


if __name__ == "__main__":
    main()
