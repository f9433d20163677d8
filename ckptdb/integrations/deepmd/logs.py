"""DeePMD-kit's column logs (``lcurve.out``, ``val.log``) read as they grow.

Framework-free: it reads text files, so it is testable without DeePMD-kit;
:class:`~ckptdb.integrations.deepmd.train.LedgerTrainer` turns their rows
into ledger metrics before each boundary and when training ends.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

__all__ = ["LogTail"]

log = logging.getLogger("ckptdb.deepmd")

#: A unit in a column's name: ``E_MAE(meV/atom)`` is recorded as ``E_MAE``.
_UNIT = re.compile(r"\(.*?\)")


class LogTail:
    """The rows DeePMD appends to one of its column logs, as ``(step, metrics)``.

    ``lcurve.out`` and ``val.log`` are alike: ``#`` lines, of which the one
    starting ``# step`` names the columns (the latest such header holds), and
    rows of a step then one number per column. A column's metric name is its
    header name with any unit in parentheses dropped (``E_MAE(meV/atom)`` is
    ``E_MAE``), after ``prefix``; columns in ``skip`` are not recorded. NaN
    (DeePMD's ``nan`` for a quantity without reference data) is kept: the
    ledger stores it as NULL and reads it back as NaN; an infinity likewise.

    ``append``: DeePMD appends (a restart): the rows already in the file are
    an earlier attempt's, and only its header is read. Otherwise DeePMD
    rewrites the file from the start (``"w"``) when it first writes it: until
    the file changes, what is there is an earlier run's and is not read.
    Only whole lines are read; a file that shrank is read again from the start.
    """

    def __init__(
        self,
        path: Path,
        *,
        prefix: str = "",
        append: bool,
        skip: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        self.path = path
        self.prefix = prefix
        self.skip = frozenset(skip)
        self.offset = 0
        self.columns: list[str] | None = None
        self._stale: tuple[int, int] | None = None
        try:
            stat = path.stat()
        except FileNotFoundError:
            return
        if append:
            with path.open("rb") as fin:
                self._parse(fin.read(stat.st_size), rows=False)
            self.offset = stat.st_size
        else:
            self._stale = (stat.st_size, stat.st_mtime_ns)

    def read(self) -> list[tuple[int, dict[str, float]]]:
        """The whole rows appended since the last call."""
        try:
            stat = self.path.stat()
        except OSError:  # not written yet (or not readable: tried again next time)
            return []
        if self._stale is not None:
            if self._stale == (stat.st_size, stat.st_mtime_ns):
                return []  # an earlier run's file, not yet rewritten by this one
            self._stale = None
        if stat.st_size < self.offset:
            self.offset, self.columns = 0, None
        if stat.st_size == self.offset:
            return []
        try:
            with self.path.open("rb") as fin:
                fin.seek(self.offset)
                data = fin.read(stat.st_size - self.offset)
        except OSError as exc:  # a log that cannot be read never stops a checkpoint
            log.warning("ckptdb: %s not read, its rows not recorded yet: %s", self.path, exc)
            return []
        whole = data.rfind(b"\n") + 1
        self.offset += whole
        return self._parse(data[:whole], rows=True)

    def _parse(self, data: bytes, *, rows: bool) -> list[tuple[int, dict[str, float]]]:
        found: list[tuple[int, dict[str, float]]] = []
        for line in data.decode("utf-8", "replace").splitlines():
            words = line.split()
            if not words:
                continue
            if words[0].startswith("#"):
                names = [*words[0][1:].split(), *words[1:]]
                if names[:1] == ["step"]:
                    self.columns = [self.prefix + _UNIT.sub("", n) for n in names[1:]]
                continue
            if rows and self.columns is not None:
                row = _row(words, self.columns, self.skip)
                if row is not None:
                    found.append(row)
        return found


def _row(
    words: list[str], columns: list[str], skip: frozenset[str]
) -> tuple[int, dict[str, float]] | None:
    try:
        step = int(words[0])
        values = [float(w) for w in words[1:]]
    except ValueError:
        log.debug("ckptdb: not a row of numbers, not recorded: %r", " ".join(words))
        return None
    if step < 0 or len(values) != len(columns):
        log.debug("ckptdb: a row that does not match its header, not recorded: %r", words)
        return None
    return step, {n: v for n, v in zip(columns, values, strict=True) if n not in skip}
