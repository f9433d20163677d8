"""A power-loss crash-state explorer for ckptdb's publication protocol.

Process kills (``tests/test_crash.py``) lose nothing the kernel has accepted,
so they cannot tell whether an fsync is missing. A power cut can: unsynced
file data lost or cut short, a rename or a new directory entry gone, the
WAL frames SQLite did not sync gone. This package does what ALICE (OSDI
2014) and CrashMonkey do for an application, for ckptdb alone:

1. :mod:`.recording` runs a scenario for real under ``strace``
   (:mod:`.syscalls`) and replays the system calls the kernel saw into a
   trace: every create, write (with its offset), truncate, fsync, rename,
   link, unlink, mkdir and rmdir under the scenario's directory, whoever
   made it (ckptdb, torch's writer, DCP, a framework's writer, SQLite on its
   database and WAL), plus the scenario's own marks (a boundary begun, a
   save acknowledged). Nothing comes from the library's account of itself.
2. :mod:`.persistence` says, for a persistence model (POSIX-minimal, or ext4
   ``data=ordered`` for comparison) and each prefix of the trace, which
   operations are durable and which may or may not have reached the disk.
3. :mod:`.explorer` enumerates (or samples, with a fixed seed) the crash
   states of every prefix, materializes each one (the ledger's files
   included: SQLite's recovery runs for real), opens the run there (which
   reconciles), runs ``check`` and compares the ledger with the reference
   model of ``tests/crashlib.py``: every acknowledged save must still be
   committed and load, unless a later acknowledged commit evicted it. The
   state with every op on disk must also leave nothing to repair.
4. :mod:`.scenarios` are the boundaries explored by ``tests/test_powerloss.py``,
   :mod:`.renames` the aliases and ``adopt --move`` (:mod:`.catalog` has both).
5. :mod:`.sites` finds every durability call of ``ckptdb/`` by reading its
   source and disables one at a time (``tests/test_powerloss_sites.py``).

A run on object storage (S3) is explored the same way under the object-store
model: :mod:`.objects` records the requests to the store (sent, answered)
and builds each crash state on the real server under a fresh prefix;
:mod:`.s3scenarios` are its scenarios.
"""
