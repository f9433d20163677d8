"""Secondary failures are attached to the primary error, never dropped.

A failure met while handling another (closing a cursor, a second after-commit
job, a second pin's release) rides on the error the caller gets as a note; on a
Python without exception notes (3.10) it goes to the log instead.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from ckptdb import CheckpointManager, Keep, RunReader
from ckptdb.errors import note_on


class _NoNotes(Exception):
    """An exception as Python 3.10 has them: no ``add_note``."""

    add_note = None


def test_a_note_rides_on_the_primary_error() -> None:
    primary = ValueError("the first failure")
    note_on(primary, "closing failed too: OSError: disk gone")
    assert primary.__notes__ == ["closing failed too: OSError: disk gone"]
    assert str(primary) == "the first failure"


def test_without_notes_the_note_goes_to_the_log(caplog: pytest.LogCaptureFixture) -> None:
    primary = _NoNotes("the first failure")
    with caplog.at_level(logging.ERROR, logger="ckptdb.errors"):
        note_on(primary, "closing failed too: OSError: disk gone")
    assert not hasattr(primary, "__notes__")
    [record] = caplog.records
    assert (record.name, record.levelno) == ("ckptdb.errors", logging.ERROR)
    assert "closing failed too: OSError: disk gone" in record.getMessage()
    assert "_NoNotes" in record.getMessage()


def test_closing_a_reader_raises_the_first_pin_failure_and_notes_the_others(
    tmp_path: Path,
) -> None:
    with CheckpointManager(tmp_path, streams={"model": Keep(last=None)}) as mgr:
        mgr.save(1, model={"w": torch.ones(2)})
        mgr.save(2, model={"w": torch.ones(2)})
        reader = RunReader(tmp_path)
        pins = [reader.pin(1, ttl=60), reader.pin(2, ttl=60)]
        released: list[int] = []

        def failing(number: int, release: object) -> object:
            def fail(ident: int) -> None:
                released.append(number)
                assert callable(release)
                release(ident)  # the lease really ends; then its error is reported
                raise OSError(f"release {number} failed")

            return fail

        for number, pin in enumerate(pins, 1):
            pin._release = failing(number, pin._release)  # type: ignore[method-assign]
        with pytest.raises(OSError) as caught:
            reader.close()
        assert sorted(released) == [1, 2]  # the second was released despite the first
        messages = {"release 1 failed", "release 2 failed"}
        assert str(caught.value) in messages  # the pins are a set: either may fail first
        [other] = messages - {str(caught.value)}
        assert any(other in note for note in caught.value.__notes__)
