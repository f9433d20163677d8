"""Ctrl-C and SIGTERM for the commands that run until stopped (``ckptdb follow``).

Each signal raises ``KeyboardInterrupt``, as Python's own Ctrl-C does, and is
also remembered. The interpreter drops an exception raised inside a weakref
callback or a ``__del__`` (it prints "Exception ignored in ..." and goes
on): a Ctrl-C that lands while a pin and its keep-alive thread are freed,
right after an evaluation, was lost that way, and a follower without
``--timeout`` ran on. The remembered signal is what the loops ask between
two waits (``stop=``), and :meth:`Interrupts.raise_if_set` turns it back into
the interrupt the command reports.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    """While entered, SIGINT and SIGTERM raise ``KeyboardInterrupt`` and set a flag;
    the previous handlers come back on exit. Enter it on the main thread."""

    def __init__(self) -> None:
        self._received = threading.Event()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Interrupts:
        self._previous = {number: signal.signal(number, self._handle) for number in _SIGNALS}
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def is_set(self) -> bool:
        """Whether a signal came (its interrupt raised, or dropped by the interpreter)."""
        return self._received.is_set()

    def raise_if_set(self) -> None:
        """``KeyboardInterrupt`` if a signal came: one the interpreter dropped counts."""
        if self._received.is_set():
            raise KeyboardInterrupt

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._received.set()
        raise KeyboardInterrupt
