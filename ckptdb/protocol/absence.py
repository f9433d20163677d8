"""Directories that are not there while the ledger records committed checkpoints in them.

The save directory, or a stream's directory in it, not there at all (missing, a
link to nowhere or a loop, not a directory) is storage not mounted (or moved),
not checkpoints lost. Taking it for lost would move ``latest`` back (to None for
a stream that lost them all): a job resuming from it would start again from
scratch, and its first save would make the directory again, on whatever is
mounted there now, and take the stream on without them for good. So the
reconcile at open refuses it, and so does a save under a running job, both
before anything changes, naming each directory and how to say the checkpoints
are gone (directories made empty on purpose).

An unmounted save directory that is itself a mount point is there and empty:
its streams' directories are what is missing. Only the streams' own
directories count (a row whose path starts with its stream's name): the
directories of a framework's name (one per checkpoint, or one that several
share) are not told apart from ones removed with their checkpoints, and their
rows are ``lost`` as any missing file's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from pathlib import Path

from ..errors import RunDirectoryError
from ..storage.base import PayloadStore


def in_streams_directory(stream: str, path: str) -> bool:
    """Whether a row of ``stream`` lies in the stream's own directory."""
    return path.startswith(f"{stream}/")


def absent_directories(
    store: PayloadStore,
    committed: Sequence[tuple[str, str]],
    nothing_done: str,
    streams: Collection[str] | None = None,
) -> RunDirectoryError | None:
    """The refusal for committed checkpoints, given as (stream, path), in directories
    that are not there (the save directory, or the directory of one of ``streams``,
    default all), or None. A directory that cannot be looked at raises its own
    :class:`RunDirectoryError`. ``nothing_done`` says what the refused caller left
    as it was."""
    if not committed:
        return None
    here = store.location
    in_stream = Counter(stream for stream, path in committed if in_streams_directory(stream, path))
    if store.absent():
        n = len(committed)
        return RunDirectoryError(
            f"the save directory {here} does not exist (or is not a directory), yet the "
            f"ledger records {n} committed checkpoint{'' if n == 1 else 's'} in it: is its "
            f"filesystem mounted? {nothing_done} {_gone_for_good(here, sorted(in_stream) or [''])}"
        )
    missing = {
        stream: n
        for stream, n in sorted(in_stream.items())
        if (streams is None or stream in streams) and store.absent(stream)
    }
    if not missing:
        return None
    named = ", ".join(f"{here / s} ({n} committed)" for s, n in missing.items())
    one = len(missing) == 1
    return RunDirectoryError(
        "the ledger records committed checkpoints in "
        + ("a stream directory that does" if one else "stream directories that do")
        + f" not exist (or {'is' if one else 'are'} not a directory): {named}. Is a "
        f"filesystem not mounted, or a link's target missing? {nothing_done} "
        + _gone_for_good(here, list(missing))
    )


def _gone_for_good(location: Path, directories: list[str]) -> str:
    """How to say the checkpoints are gone: the directories to make, empty."""
    made = ", ".join(str(location / d) if d else str(location) for d in directories)
    each = "each of " if len(directories) > 1 else ""
    return (
        f"If they are gone for good, make {each}{made} an empty directory (parents "
        "included; remove a link or a file in the way first) and open the run again: "
        "reconcile then marks them lost"
    )
