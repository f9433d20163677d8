"""``python -m ckptdb.integrations.deepmd --pt train input.json``: DeePMD-kit's ``dp``
with ``train`` through a ckptdb ledger; every other command is DeePMD's own."""

from .train import main

if __name__ == "__main__":
    main()
