"""ckptdb inside the frameworks people train with.

Each integration is an addition on top of the core: it publishes through
:class:`ckptdb.External` payloads (the framework's own writer, the
framework's own names), resolves "last" and "best" through the ledger and
keeps the framework's habits. Importing one needs its framework installed:
``pip install 'ckptdb[lightning]'`` for :mod:`ckptdb.integrations.lightning`,
``'ckptdb[transformers]'`` for :mod:`ckptdb.integrations.transformers`,
``'ckptdb[accelerate]'`` for :mod:`ckptdb.integrations.accelerate`.
"""
