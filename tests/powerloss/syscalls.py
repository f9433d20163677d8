"""The file system calls a process really makes, as the kernel saw them (strace).

The explorer must not trust the library's own account of what it did: an
fsync of the wrong descriptor, a rename that went elsewhere, or an fsync
removed by a refactor that kept a log line would all look right in such an
account. So, like ALICE and CrashMonkey, it records the system calls
themselves. :class:`SyscallTracer` attaches ``strace`` to every thread of
the current process (``-f -p``: threads started later are followed too) and
detaches when the block ends; :func:`calls` reads its log back.

What this sees is what the process asked the kernel for, from any code in
it: ckptdb's Python, torch's C++ writer, DCP, a framework's writer, SQLite's
C library. Each descriptor is printed with the path the kernel holds for it
(``-y``, read from ``/proc``), not the name a caller meant. Strings are
printed whole (``-s``) and hex-escaped (``-xx``), so written bytes come back
exactly; a string strace had to cut short is an error, never a silent gap.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: The calls that change a file system, or that the recorder needs to follow a
#: descriptor (its offset, its duplicates), or that it must refuse to miss.
TRACED = (
    "open,openat,creat,close,dup,dup2,dup3,fcntl,lseek,read,readv,chdir,fchdir,"
    "clone,clone3,fork,vfork,"
    "write,pwrite64,writev,pwritev,pwritev2,ftruncate,truncate,"
    "fsync,fdatasync,sync_file_range,"
    "rename,renameat,renameat2,link,linkat,symlink,symlinkat,"
    "unlink,unlinkat,mkdir,mkdirat,rmdir,"
    "sendfile,copy_file_range,splice,mmap,fallocate"
)
#: The traced calls that change a file or a name (a read left blocked on a pipe when
#: strace detaches is no loss; one of these would be).
CHANGING = frozenset(
    [
        "creat",
        "write",
        "pwrite64",
        "writev",
        "pwritev",
        "pwritev2",
        "ftruncate",
        "truncate",
        "fsync",
        "fdatasync",
        "rename",
        "renameat",
        "renameat2",
        "link",
        "linkat",
        "symlink",
        "symlinkat",
        "unlink",
        "unlinkat",
        "mkdir",
        "mkdirat",
        "rmdir",
        "sendfile",
        "copy_file_range",
        "splice",
        "fallocate",
    ]
)
#: Longest string printed whole (a write's buffer): more is an error, not a gap.
STRING_LIMIT = 1 << 25
ATTACH_TIMEOUT = 20.0
DETACH_TIMEOUT = 60.0


class SyscallTraceError(RuntimeError):
    """strace is missing, could not attach, or printed what cannot be followed."""


def strace_binary() -> str:
    found = shutil.which("strace")
    if found is None:
        raise SyscallTraceError(
            "the power-loss explorer records real system calls with strace, which is not "
            "installed here (Debian/Ubuntu: apt-get install strace)"
        )
    return found


class SyscallTracer:
    """strace attached to this process (all its threads) while the block runs."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self._strace: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> SyscallTracer:
        pid = os.getpid()
        command = [
            strace_binary(),
            *("-f", "-qq", "-y", "-xx", "-s", str(STRING_LIMIT)),
            *("-e", f"trace={TRACED}", "-e", "raw=read,readv", "-e", "signal=none"),
            *("-o", str(self.log), "-p", str(pid)),
        ]
        self._strace = subprocess.Popen(command, stderr=subprocess.PIPE)
        deadline = time.monotonic() + ATTACH_TIMEOUT
        while not _every_thread_traced(pid):
            if self._strace.poll() is not None or time.monotonic() > deadline:
                self._stop()
                err = self._stderr()
                raise SyscallTraceError(f"strace did not attach to process {pid}: {err}")
            time.sleep(0.002)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._strace is None or self._strace.poll() is not None:
            return
        self._strace.send_signal(signal.SIGINT)  # detaches from every thread, then exits
        try:
            self._strace.wait(DETACH_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._strace.kill()
            self._strace.wait()
            raise SyscallTraceError("strace did not detach in time") from None

    def _stderr(self) -> str:
        assert self._strace is not None and self._strace.stderr is not None
        try:
            return self._strace.stderr.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""


def _every_thread_traced(pid: int) -> bool:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        if "\nTracerPid:\t0\n" in status:
            return False
    return True


# ------------------------------------------------------------------ reading the log


@dataclass(frozen=True)
class Fd:
    """A descriptor argument, with the path the kernel holds for it (None: none shown)."""

    number: int | None  # None: AT_FDCWD
    path: str | None
    deleted: bool = False


Arg = bytes | Fd | str  # a string argument, a descriptor, anything else as printed


@dataclass(frozen=True)
class Call:
    """One successful system call, in the order strace saw it finish."""

    tid: int
    name: str
    args: tuple[Arg, ...]
    result: int
    result_fd: Fd | None  # a call that returns a descriptor: it, with its path

    def fd(self, i: int) -> Fd:
        arg = self.args[i]
        if not isinstance(arg, Fd):
            raise SyscallTraceError(f"{self.name}: argument {i} is not a descriptor: {arg!r}")
        return arg

    def text(self, i: int) -> bytes:
        arg = self.args[i]
        if not isinstance(arg, bytes):
            raise SyscallTraceError(f"{self.name}: argument {i} is not a string: {arg!r}")
        return arg

    def raw(self, i: int) -> str:
        arg = self.args[i]
        return arg if isinstance(arg, str) else repr(arg)


_LINE = re.compile(r"^(\d+)\s+(.*)$")
_RESUMED = re.compile(r"^<\.\.\. (\w+) resumed>(.*)$")
_DETACHED = " <detached ...>"
_FD = re.compile(r"^(-?\d+|AT_FDCWD)<(.*?)>(\(deleted\))?$", re.S)


#: Calls placed where they started, not where they finished: an fsync covers what was
#: written before it began; a write another thread finished meanwhile may not be covered.
PLACED_AT_START = frozenset({"fsync", "fdatasync"})


def calls(log: Path) -> list[Call]:
    """The successful calls in ``log``, in the order they took effect: where they
    finished, but for an fsync, which counts from where it started. A line that
    cannot be read, or a call still unfinished when strace detached, is an error:
    the recording would be missing it."""
    unfinished: dict[int, tuple[int, str]] = {}  # tid -> (where it started, its text)
    placed: list[tuple[int, Call]] = []
    with open(log, encoding="ascii", errors="strict") as lines:
        for number, line in enumerate(lines):
            found = _LINE.match(line.rstrip("\n"))
            if found is None:
                raise SyscallTraceError(f"cannot read line {number + 1} of the trace: {line!r}")
            tid, rest = int(found.group(1)), found.group(2)
            if rest.startswith(("+++", "---")):
                continue
            if rest.endswith(" <unfinished ...>"):
                unfinished[tid] = (number, rest[: -len(" <unfinished ...>")])
                continue
            start = number
            resumed = _RESUMED.match(rest)
            if resumed is not None:
                if tid not in unfinished:
                    raise SyscallTraceError(f"a resumed call with no start: {line!r}")
                start, head = unfinished.pop(tid)
                rest = head + resumed.group(2)
            if rest.endswith(_DETACHED):
                # strace let go of a thread blocked in this call: it is unfinished, and
                # the check below refuses it only if it could change a file.
                unfinished[tid] = (start, rest[: -len(_DETACHED)])
                continue
            call = _parse(tid, rest)
            if call is not None:
                placed.append((start if call.name in PLACED_AT_START else number, call))
    cut = [text for _, text in unfinished.values() if text.split("(", 1)[0] in CHANGING]
    if cut:
        left = "; ".join(text[:120] for text in cut)
        raise SyscallTraceError(f"calls that change files never finished while traced: {left}")
    placed.sort(key=lambda item: item[0])  # stable: calls of one line keep their order
    return [call for _, call in placed]


def _parse(tid: int, text: str) -> Call | None:
    name, _, body = text.partition("(")
    close = _closing(body)
    args_text, tail = body[:close], body[close + 1 :]
    result = tail.strip()
    if not result.startswith("="):
        raise SyscallTraceError(f"cannot read {text[:200]!r}")
    value = result[1:].strip()
    if value.startswith("-1") or value.startswith("?"):
        return None  # failed (or never returned): it changed nothing
    number = value.split(" ", 1)[0]
    result_fd = None
    if "<" in number:
        result_fd = _fd_arg(number)
        assert isinstance(result_fd, Fd)
        number = number.split("<", 1)[0]
    try:
        code = int(number, 0)
    except ValueError:
        raise SyscallTraceError(f"cannot read the result of {text[:200]!r}") from None
    return Call(tid, name, tuple(_arg(a) for a in _split(args_text)), code, result_fd)


def _scan(text: str, opening: str, closing: str) -> Iterator[tuple[int, str, int]]:
    """Each character outside quoted strings (``-xx`` escapes every quote inside one),
    with the nesting depth before it."""
    depth, quoted = 0, False
    for i, ch in enumerate(text):
        if quoted or ch == '"':
            quoted = not quoted if ch == '"' else quoted
            continue
        yield i, ch, depth
        if ch in opening:
            depth += 1
        elif ch in closing:
            depth -= 1


def _closing(body: str) -> int:
    """The index of the parenthesis that closes the argument list."""
    for i, ch, depth in _scan(body, "([{", ")]}"):
        if ch in ")]}" and depth == 0:
            return i
    raise SyscallTraceError(f"an argument list that never closes: {body[:200]!r}")


def _split(args: str) -> list[str]:
    """The top-level arguments (``<path>`` annotations and structures kept whole)."""
    out, start = [], 0
    for i, ch, depth in _scan(args, "([{<", ")]}>"):
        if ch == "," and depth == 0:
            out.append(args[start:i].strip())
            start = i + 1
    if args.strip():
        out.append(args[start:].strip())
    return out


def _arg(text: str) -> Arg:
    if text.startswith('"'):
        if text.endswith("..."):
            raise SyscallTraceError(f"strace cut a string short (over {STRING_LIMIT} bytes)")
        return unescape(text[1:-1])
    if "<" in text and _FD.match(text):
        return _fd_arg(text)
    return text


def _fd_arg(text: str) -> Fd:
    found = _FD.match(text)
    if found is None:
        raise SyscallTraceError(f"not a descriptor: {text[:200]!r}")
    number = None if found.group(1) == "AT_FDCWD" else int(found.group(1))
    path = unescape(found.group(2)).decode("utf-8", "surrogateescape")
    return Fd(number, path, deleted=found.group(3) is not None)


def unescape(text: str) -> bytes:
    """A string as ``strace -xx`` prints it: every byte ``\\xNN`` (a few C escapes
    are kept for safety), back to bytes."""
    if "\\" not in text:
        return text.encode("latin-1")
    out = bytearray()
    i = 0
    escapes = {"n": 10, "t": 9, "r": 13, "v": 11, "f": 12, '"': 34, "\\": 92}
    while i < len(text):
        ch = text[i]
        if ch != "\\":
            out += ch.encode("latin-1")
            i += 1
        elif text[i + 1] == "x":
            out.append(int(text[i + 2 : i + 4], 16))
            i += 4
        elif text[i + 1] in escapes:
            out.append(escapes[text[i + 1]])
            i += 2
        else:  # octal
            digits = re.match(r"[0-7]{1,3}", text[i + 1 :])
            assert digits is not None, text[i : i + 5]
            out.append(int(digits.group(0), 8))
            i += 1 + len(digits.group(0))
    return bytes(out)


def iov_bases(text: str) -> bytes:
    """The bytes of a ``writev`` vector as printed (``[{iov_base="...", iov_len=N}, ...]``)."""
    parts = re.findall(r'iov_base="((?:[^"\\]|\\.)*)"(\.\.\.)?', text)
    if any(cut for _, cut in parts):
        raise SyscallTraceError(f"strace cut a vector's buffer short (over {STRING_LIMIT} bytes)")
    return b"".join(unescape(p) for p, _ in parts)
