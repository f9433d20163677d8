"""The ``ckptdb`` command's entry point (also ``python -m ckptdb``).

The plain forms of ``ckptdb latest``, ``best``, ``sql``, ``history``, ``list`` and ``status`` are
answered by :mod:`ckptdb.quickread` from the standard library when they can
be: a shell script's ``$(ckptdb latest runs/exp1)`` then costs a Python start
and a couple of SQLite reads. Everything else, and those commands whenever the
quick read declines, is the full command (:mod:`ckptdb.cli`).
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    """Run the ``ckptdb`` command on ``sys.argv``."""
    from .quickread import answer

    lines = answer(sys.argv[1:], os.environ)
    if lines is not None:
        print(lines)
        return
    from .cli import main as command

    command(prog_name="ckptdb")


if __name__ == "__main__":
    main()
