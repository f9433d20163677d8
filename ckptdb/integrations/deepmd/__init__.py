"""DeePMD-kit (PyTorch backend).

Today: the ``ckptdb adopt --layout deepmd`` layout (:mod:`.layout`), which
registers a finished run's ``model.ckpt-<N>.pt`` checkpoints and derives
``model.ckpt.pt`` and ``checkpoint`` from the ledger. The package is the
home of everything ckptdb knows about DeePMD-kit, as each framework's
package is.
"""
