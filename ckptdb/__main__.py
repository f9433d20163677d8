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
    """Run the ``ckptdb`` command on ``sys.argv``.

    A reader that stops early (``ckptdb list ROOT | head``) closes the pipe:
    the command then stops quietly, as ``git log | head`` does, instead of
    printing a traceback of the write that failed.
    """
    try:
        _run()
        sys.stdout.flush()  # a failed write of the last buffered lines surfaces here
    except BrokenPipeError:
        # Python would fail again flushing stdout at exit: point it at /dev/null first
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


def _run() -> None:
    from .quickread import answer

    lines = answer(sys.argv[1:], os.environ)
    if lines is not None:
        print(lines)
        return
    from .cli import main as command

    command(prog_name="ckptdb")


if __name__ == "__main__":
    main()
