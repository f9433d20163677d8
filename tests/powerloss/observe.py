"""What torch's DCP writer does to the files it writes itself, in the trace.

A sharded checkpoint's files are written by ``torch.distributed.checkpoint``,
not by ckptdb's primitives, so the library's seam does not see them. While a
recording runs, :func:`observing_dcp` gives ckptdb's DCP writer a file system
object that reports each file it creates (and, once closed, the bytes it
holds), each rename and each removal, and has DCP's own ``os.fsync`` report
what it made durable: the bytes the kernel held at that moment, which is
what an fsync covers (not what is still in a Python buffer).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import filesystem as dcp_filesystem

from ckptdb.storage import dcp

from .recording import Recorder


class RecordingFileSystem(dcp_filesystem.FileSystem):
    """DCP's local file system, reporting to a recorder."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        writing = "w" in mode or "a" in mode
        with super().create_stream(path, mode) as stream:
            if writing:
                self.recorder.on_op("create", {"path": Path(path)})
            yield stream
        if writing:
            self.recorder.observe(Path(path))

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        self.recorder.on_op("rename", {"source": Path(path), "target": Path(new_path)})

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        super().rm_file(path)
        self.recorder.on_op("unlink", {"path": Path(path)})

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        if not Path(path).is_dir():
            raise AssertionError(f"DCP made {path}: ckptdb makes the temporary directory first")
        super().mkdir(path)


class _OsWithObservedFsync:
    """``os`` as DCP's file system module sees it, with ``fsync`` reported."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def fsync(self, fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        self._recorder.observe(path)  # what the kernel holds now is what this fsync covers
        os.fsync(fd)
        self._recorder.on_op("fsync", {"path": path})


@contextlib.contextmanager
def observing_dcp(recorder: Recorder) -> Iterator[None]:
    """Report DCP's file work to ``recorder`` while the block runs."""
    real_writer = dcp.file_writer

    def file_writer(directory: Path) -> Any:
        writer = real_writer(directory)
        writer.fs = RecordingFileSystem(recorder)
        return writer

    real_os = dcp_filesystem.os
    dcp.file_writer = file_writer  # type: ignore[assignment]
    dcp_filesystem.os = _OsWithObservedFsync(recorder)  # type: ignore[assignment]
    try:
        yield
    finally:
        dcp.file_writer = real_writer
        dcp_filesystem.os = real_os
