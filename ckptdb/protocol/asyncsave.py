"""Asynchronous publication: the snapshot, the handle and the background worker.

``save(..., blocking=False)`` decides everything that gives a boundary its
meaning at call time (input, guard, top-K admission, the ``pending`` rows),
copies the payload to host memory, and hands writing, fsync, placement and
the commit to one background thread per manager. At most one boundary is in
flight: the next ``save`` (and ``close``, ``flush``, a ``load`` of a stream
being written) waits for it first, so the snapshot buffers of boundary N are
free again when boundary N+1 is snapshotted and are reused instead of
allocated (peak extra host memory: about one copy of the payload).

Under torch.distributed the background work of a boundary needs collectives
(DCP for sharded payloads, then the ``write`` and ``outcome`` agreements).
They run in the background thread on a **dedicated gloo process group**,
created collectively at the first asynchronous save, never on the training
group: collectives of two threads on one group would interleave in an order
that differs between ranks, and deadlock. Because every rank runs the same
boundaries in the same order and at most one is in flight, the dedicated
group sees the same sequence on every rank. The commit thus happens as soon
as every rank's write is done, not at the next boundary, and ``result()`` and
``done()`` are local calls.
"""

from __future__ import annotations

import concurrent.futures
import copy
import datetime as dt
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..coord.dist import RankGroup
from ..record import Checkpoint
from ..storage.kinds import PayloadKind, kind_of

log = logging.getLogger("ckptdb.asyncsave")  # the name users configure (kept across moves)


class SaveHandle:
    """The outcome of one asynchronous boundary, like a ``concurrent.futures.Future``.

    ``save(..., blocking=False)`` returns it once the payloads are copied to host
    memory; the write and the commit finish on the manager's background thread.
    ``result()`` waits and returns the committed checkpoints by stream (the
    same dict a blocking ``save`` returns) or raises the boundary's error.
    Errors are never lost: one nobody fetched with ``result()``/``exception()`` is
    raised by the manager's next ``save`` or ``close`` instead, and it is logged
    when it happens either way (logger ``ckptdb.asyncsave``, level ERROR). Made
    by the manager, not directly.

    Args:
        step: The boundary's step.
        future: The background work's future, whose result is the committed
            checkpoints by stream.

    Attributes:
        step: The boundary's step.
    """

    def __init__(self, step: int, future: concurrent.futures.Future[dict[str, Checkpoint]]) -> None:
        self.step = step
        self._future = future
        self._fetched = False

    def done(self) -> bool:
        """Whether the boundary has committed or failed (never blocks).

        Returns:
            True once the boundary has finished, either way.
        """
        return self._future.done()

    def result(self, timeout: float | None = None) -> dict[str, Checkpoint]:
        """Wait for the commit; the committed checkpoints by stream, or the error.

        Fetching the boundary's error here means the manager's next ``save`` or
        ``close`` does not raise it again.

        Args:
            timeout: Seconds to wait at most; None (the default): until the
                boundary finishes.

        Returns:
            The committed checkpoints by stream, the same dict a blocking ``save``
                returns.

        Raises:
            TimeoutError: the boundary is still in flight after ``timeout``; this
                fetches nothing: the boundary's error, if it comes, is still raised
                by the next ``save``/``close``.
            PublishError: the boundary failed and was rolled back; any other error
                the boundary ended with (see
                :meth:`ckptdb.CheckpointManager.save`) is raised the same way.
        """
        try:
            out = self._future.result(timeout)
        except BaseException as exc:
            self._fetched = self._fetched or self._is_outcome(exc)
            raise
        self._fetched = True
        return out

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait; the boundary's error, or None if it committed.

        Like :meth:`result`, it fetches the error: the manager's next ``save`` or
        ``close`` does not raise it.

        Args:
            timeout: Seconds to wait at most; None (the default): until the
                boundary finishes.

        Returns:
            The error the boundary ended with, or None if it committed.

        Raises:
            TimeoutError: the boundary is still in flight after ``timeout`` (nothing
                is fetched).
        """
        error = self._future.exception(timeout)  # TimeoutError: nothing fetched
        self._fetched = True
        return error

    def _is_outcome(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the boundary's own error (not a wait that timed out)."""
        return self._future.done() and self._future.exception() is exc

    @property
    def unfetched_error(self) -> BaseException | None:
        """The error of a finished boundary that nobody has fetched yet."""
        if not self._future.done() or self._fetched:
            return None
        return self._future.exception()

    def mark_fetched(self) -> None:
        """Count the boundary's error as fetched, so nothing raises it again.

        Used by the manager once it raised the error itself.
        """
        self._fetched = True

    def outcome_error(self) -> BaseException | None:
        """The finished boundary's error (or None), without fetching it.

        Returns:
            The error of a finished boundary; None if it committed or is still in
                flight.
        """
        return self._future.exception() if self._future.done() else None

    def wait(self) -> None:
        """Wait for the boundary to finish, without fetching its outcome."""
        concurrent.futures.wait([self._future])

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<SaveHandle step={self.step} {state}>"


class InFlight:
    """The one asynchronous boundary in flight, if any, and the streams it writes."""

    def __init__(self) -> None:
        self.handle: SaveHandle | None = None
        self.streams: frozenset[str] = frozenset()

    def start(self, handle: SaveHandle, streams: frozenset[str]) -> None:
        self.handle, self.streams = handle, streams

    def busy(self) -> bool:
        """Whether a boundary is still being written or committed in the background."""
        handle = self.handle
        return handle is not None and not handle.done()

    def wait(self) -> None:
        """Wait for the boundary in flight (its error stays with its handle)."""
        if self.handle is not None:
            self.handle.wait()

    def settle(self) -> tuple[BaseException | None, bool]:
        """Wait for the boundary in flight: (its error, whether nobody had fetched it).

        The next boundary raises that error (agreed across ranks under
        torch.distributed) instead of running.
        """
        handle, self.handle = self.handle, None
        if handle is None:
            return None, False
        handle.wait()
        unfetched = handle.unfetched_error is not None
        handle.mark_fetched()
        return handle.outcome_error(), unfetched

    def writes(self, stream: str | None) -> bool:
        """Whether the boundary in flight may write ``stream`` (None: any stream)."""
        return self.handle is not None and (stream is None or stream in self.streams)


def finished(step: int, records: dict[str, Checkpoint]) -> SaveHandle:
    """A handle for a boundary that finished at call time (nothing was admitted)."""
    future: concurrent.futures.Future[dict[str, Checkpoint]] = concurrent.futures.Future()
    future.set_result(records)
    return SaveHandle(step, future)


class BackgroundWriter:
    """One worker thread per manager, and (distributed) its dedicated process group."""

    def __init__(self) -> None:
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.group: RankGroup | None = None
        self._lock = threading.Lock()

    def submit(self, step: int, work: Callable[[], dict[str, Checkpoint]]) -> SaveHandle:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="ckptdb-writer"
            )
        future = self._executor.submit(_logged(step, work))
        return SaveHandle(step, future)

    def rank_group(self, main: RankGroup) -> RankGroup:
        """The dedicated gloo group for background collectives, with the ranks of
        ``main``; created collectively (by those ranks only) on first use."""
        if self.group is None:
            self.group = RankGroup(
                dist.new_group(
                    ranks=dist.get_process_group_ranks(main.group),
                    backend="gloo",
                    timeout=group_timeout(main.group),
                    use_local_synchronization=True,
                )
            )
        return self.group

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        group, self.group = self.group, None
        # After destroy_process_group() of the default group ours is gone with it.
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group.group)


def _logged(
    step: int, work: Callable[[], dict[str, Checkpoint]]
) -> Callable[[], dict[str, Checkpoint]]:
    def run() -> dict[str, Checkpoint]:
        try:
            return work()
        except BaseException as exc:
            log.error("ckptdb: asynchronous save of step %d failed: %s", step, exc)
            raise

    return run


def group_timeout(group: Any) -> dt.timedelta | None:
    """The collective timeout the user gave ``group`` (None: torch's default).

    torch has no public getter; the backend's options carry it, for gloo (a
    CPU backend) and NCCL (a CUDA one).
    """
    for device in ("cpu", "cuda"):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue  # no backend for that device type in this group
        if isinstance(timeout, dt.timedelta):
            return timeout
    return None


class Snapshotter:
    """Copies payloads to host memory, reusing the previous boundary's buffers.

    A buffer is keyed by stream and position in the payload and reused when
    shape and dtype match. CUDA tensors go to pinned buffers with
    non-blocking copies and one synchronization at the end; CPU tensors are
    copied too, since the optimizer updates them in place. Tensors that alias
    the same memory (tied weights) stay one tensor in the snapshot.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, _Where], torch.Tensor] = {}

    def release(self) -> None:
        """Drop the buffers (the manager is closing)."""
        self._buffers.clear()

    def snapshot(self, stream: str, payload: Any, kind: PayloadKind | None = None) -> Any:
        """A host copy of ``payload`` (of ``kind``, by default the one it wraps itself as)."""
        kind = kind or kind_of(payload)
        copier = _Copy(self._buffers, stream)
        copied = kind.wrap(copier.copy((), kind.data(payload)))
        for device in copier.devices:
            torch.cuda.current_stream(device).synchronize()
        return copied


_IMMUTABLE = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_AliasKey = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]
_Where = tuple[Any, ...]


class _Copy:
    """One snapshot pass over one payload.

    A position is the tuple of keys/indices from the payload's root, so
    ``{"a/b": x}`` and ``{"a": {"b": y}}`` never share a buffer; and a buffer
    already filled in this pass is never reused for another tensor.
    """

    def __init__(self, buffers: dict[tuple[str, _Where], torch.Tensor], stream: str) -> None:
        self.buffers, self.stream = buffers, stream
        self.aliases: dict[_AliasKey, Any] = {}
        self.devices: set[torch.device] = set()
        self.filled: set[int] = set()

    def copy(self, where: _Where, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.tensor(where, obj)
        if obj is None or isinstance(obj, _IMMUTABLE):
            return obj
        if type(obj) is dict:
            return {k: self.copy((*where, k), v) for k, v in obj.items()}
        if isinstance(obj, dict):  # OrderedDict with _metadata, defaultdict...: same type and state
            out = copy.copy(obj)
            for k, v in obj.items():
                out[k] = self.copy((*where, k), v)
            if getattr(obj, "__dict__", None):
                out.__dict__ = copy.deepcopy(obj.__dict__)
            return out
        if isinstance(obj, list):
            return [self.copy((*where, i), v) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            items = [self.copy((*where, i), v) for i, v in enumerate(obj)]
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        return copy.deepcopy(obj)  # anything else may be mutated after the call too

    def tensor(self, where: _Where, t: torch.Tensor) -> Any:
        local = _local(t)
        storage = local.untyped_storage().data_ptr()
        shape, stride = tuple(local.shape), tuple(local.stride())
        key: _AliasKey = (storage, int(local.storage_offset()), shape, stride, local.dtype)
        if key in self.aliases and local.numel() > 0:
            return self.aliases[key]
        buf = self.buffers.get((self.stream, where))
        reusable = buf is not None and id(buf) not in self.filled
        if not reusable or buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            buf = torch.empty(local.shape, dtype=local.dtype, pin_memory=local.is_cuda)
            self.buffers[(self.stream, where)] = buf
        self.filled.add(id(buf))
        buf.copy_(local.detach(), non_blocking=local.is_cuda)
        if local.is_cuda:
            self.devices.add(local.device)
        copied = _rewrap(t, buf)
        self.aliases[key] = copied
        return copied


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local data of a DTensor, or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _rewrap(original: torch.Tensor, host: torch.Tensor) -> Any:
    """A DTensor again around the host copy of its local shard (same spec).

    ``DTensor.from_local`` would move the host copy back to the mesh's device
    (a CUDA mesh: a second GPU copy); the constructor keeps it where it is,
    as torch's own CPU offload of state dicts does.
    """
    if not callable(getattr(original, "to_local", None)):
        return host
    from torch.distributed.tensor import DTensor

    assert isinstance(original, DTensor)
    return DTensor(host, original._spec, requires_grad=False)  # type: ignore[no-untyped-call]


__all__ = ["BackgroundWriter", "InFlight", "SaveHandle", "Snapshotter", "finished"]
