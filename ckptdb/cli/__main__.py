"""``python -m ckptdb.cli``: the ``ckptdb`` command without its console script."""

from . import main

main()
