"""``python -m ckptdb.integrations.deepmd --pt train input.json``: DeePMD-kit's ``dp``
with ``train`` through a ckptdb ledger; every other command is DeePMD's own.

A ckptdb error (an unsupported DeePMD-kit, a ``--restart`` the ledger does not
know, a configuration the integration refuses) is one line on stderr and exit
status 1, as with the ``ckptdb`` command; DeePMD's own errors are DeePMD's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ...errors import CkptDBError


def run(argv: Sequence[str] | None = None) -> int:
    """The process's exit status for ``dp`` with ``argv``."""
    try:
        from .train import main  # checks DeePMD-kit's version at import

        main(argv)
    except CkptDBError as exc:
        print(f"Error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run())
