"""A power-loss crash-state explorer for ckptdb's publication protocol.

Process kills (``tests/test_crash.py``) lose nothing the kernel has accepted,
so they cannot tell whether an fsync is missing. A power cut can: unsynced
file data lost or cut short, a rename or a new directory entry gone, the last
SQLite transactions committed with ``synchronous=NORMAL`` gone. This package
does what ALICE (OSDI 2014) does for an application, for ckptdb alone:

1. :mod:`.recording` runs a scenario for real and records, through the
   library's no-op seam (:mod:`ckptdb.trace`), every durable file operation
   and every ledger commit (with a snapshot of the ledger after it, by
   SQLite's backup API), plus the scenario's own marks (a boundary begun, a
   save acknowledged). :mod:`.observe` adds what torch's DCP writer does to
   the files it writes itself.
2. :mod:`.persistence` says, for a persistence model (POSIX-minimal, or ext4
   ``data=ordered`` for comparison) and each prefix of the trace, which
   operations are durable and which may or may not have reached the disk.
3. :mod:`.explorer` enumerates (or samples, with a fixed seed) the crash
   states of every prefix, materializes each one, opens the run there (which
   reconciles), runs ``check`` and compares the ledger with the reference
   model of ``tests/crashlib.py``: every acknowledged save must still be
   committed and load, unless a later acknowledged commit evicted it.
4. :mod:`.scenarios` are the boundaries explored by ``tests/test_powerloss.py``.

A run on object storage (S3) is explored the same way under the object-store
model: :mod:`.objects` records the requests to the store (sent, answered)
and builds each crash state on the real server under a fresh prefix;
:mod:`.s3scenarios` are its scenarios.
"""
