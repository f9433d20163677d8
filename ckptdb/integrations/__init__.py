"""ckptdb inside the frameworks people train with.

One package per framework (:mod:`.lightning`, :mod:`.transformers`,
:mod:`.accelerate`, :mod:`.deepmd`), each holding its writer (the callback
or Trainer that publishes through :class:`ckptdb.External` payloads: the
framework's own writer, the framework's own names) and its adopt layout
(how ``ckptdb adopt`` reads a finished run of it). Every writer takes its
shared decisions from :mod:`.common`; :mod:`.layouts` is the layouts'
registry and :mod:`.adopt` adopts what a layout finds.

Importing a framework's package, its layout, :mod:`.common`, :mod:`.layouts`
or :mod:`.adopt` never imports the framework; its public names (the writer)
need it installed: ``pip install 'ckptdb[lightning]'``,
``'ckptdb[transformers]'``, ``'ckptdb[accelerate]'``.
"""
