"""``aiotensor.stream``: the tensors of a source as ``(name, tensor)`` pairs, as soon as their bytes
land, read ahead within a window, small neighbours read together."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import anyio
import anyio.lowlevel
import torch

from .. import sources
from .._io.read import close, open_read, read_tensors
from .._io.tensors import Target, check_device, new_tensor, on_stream
from .._runtime import threads
from .._runtime.scheduler import MiB, Priority, Scheduler, batched
from ..sources import Item, Keys

WINDOW_BYTES = 256 * MiB


# Neighbouring small tensors of one file are read together, up to this many bytes and tensors: one
# read and a few worker round trips per batch, not per tensor (a stream of 20,000 small tensors took
# 18 s and stalled the loop 150-180 ms when each was read alone; bench/bench_loop.py).
BATCH_BYTES = 16 * MiB


BATCH_TENSORS = 512


# A consumer whose next tensors are already read does not wait, so it would run a whole batch's
# worth of loop iterations in one go: the iteration lets other tasks run at least this often.
YIELD_S = 0.0005


def _prepared(
    sched: Scheduler, source: str, select: Callable[[str], bool], rows: Mapping[str, tuple[int, int]], batch_bytes: int
) -> tuple[list[Item], list[tuple[list[Item], int]]]:
    """The items to read (row slices applied), and the same in the batches read together: runs of
    items of one file of at most ``batch_bytes`` and :data:`BATCH_TENSORS` items, with their bytes
    (blocking)."""
    found = sources.items_of(sched, source, select)
    items = [sources.slice_rows(i, rows[i.names[0]]) if i.names[0] in rows else i for i in found]
    return items, batched(items, lambda i: i.spec.nbytes, batch_bytes, BATCH_TENSORS, lambda a, b: a.path != b.path)


def _new_targets(items: list[Item], device: torch.device, verify: bool, stream: Any) -> list[Target]:
    """New tensors to read ``items`` into (CUDA ones allocated on the consumer's ``stream``, which
    the caching allocator ties their memory to, as if the consumer had made them)."""
    with on_stream(stream):
        return [Target(i.spec, new_tensor(i.spec, device), i.crc if verify else None) for i in items]


def _finished(items: list[Item], targets: list[Target], dtype: torch.dtype | None, stream: Any) -> list[torch.Tensor]:
    """The tensors handed out: a torch.save view cut out of its storage, ``dtype`` applied (on the
    consumer's CUDA ``stream``, so that its own work is ordered after them)."""
    out = []
    with on_stream(stream):
        for item, target in zip(items, targets, strict=True):
            t, v = target.tensor, item.view
            if v is not None:
                t = t.as_strided(v.size, v.stride, v.storage_offset).clone()
            out.append(t if dtype is None or t.dtype == dtype else t.to(dtype))
    return out


class TensorStream:
    """``async for name, tensor in aiotensor.stream(source, ...)``: the tensors of ``source`` (a
    safetensors file, a Hugging Face folder, a torch.save zip, an aiotensor checkpoint step or store
    root) as ``(name, tensor)`` pairs in file order, as soon as their bytes land: small neighbours
    are read together (up to :data:`BATCH_TENSORS` tensors and :data:`BATCH_BYTES`) and handed out
    together, a bigger tensor alone.

    ``keys`` selects what is read (names, prefixes ending in ``.``, or a predicate): the bytes of
    other tensors are never read. ``rows={"name": (a, b)}`` reads only rows ``a:b`` along dim 0 of
    that tensor (a tensor-parallel shard; its checksum covers the whole tensor, so a row slice is
    not verified). ``dtype`` converts each tensor as it arrives. Several streams may
    share one ``scheduler`` (loads run before saves on it).

    Raises (from the iteration): HeaderError / ManifestError (a malformed file or index, naming
    it), UnsafeFileError (a torch.save file that needs more than a state_dict's pickle),
    ChecksumError (a corrupt tensor of a checksummed file or checkpoint), OSError. An error is
    raised where its batch begins: the tensors read with a corrupt one are not handed out.

    Up to ``window_bytes`` of tensors are read ahead of the consumer (a tensor larger than the
    window is read alone); a slow consumer holds the reading back. Use it as an async context
    manager (``async with stream(...) as s: async for ... in s``) or call :meth:`aclose` when
    breaking out early: that stops every read at once and frees what was read ahead. A stream
    abandoned without either stops reading when its window is full and is freed with it.

    Cancellation: cancelling the task that iterates cancels the reads in flight; the stream is
    then closed (its reader task stopped, nothing left writing).
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        keys: Keys = None,
        rows: Mapping[str, tuple[int, int]] | None = None,
        window_bytes: int = WINDOW_BYTES,
        verify: bool = True,
        scheduler: Scheduler | None = None,
    ) -> None:
        if window_bytes < 1:
            raise ValueError(f"window_bytes must be >= 1, got {window_bytes}")
        self.source = os.fspath(source)
        self.dtype = dtype
        self.window_bytes = window_bytes
        self.verify = verify
        self._select = sources.selector(keys)
        self._rows = dict(rows or {})
        self._own = scheduler is None
        self.scheduler = scheduler if scheduler is not None else Scheduler()
        self.device = check_device(self.scheduler, device)
        # the stream CUDA tensors are made and finished on, in worker threads: the caller's
        self._stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.bytes_read = 0
        self._batch_bytes = min(window_bytes, BATCH_BYTES)
        self._items: list[Item] | None = None
        self._batches: list[tuple[list[Item], int]] = []  # the items read together, and their bytes
        self._ready: dict[int, tuple[Item, Any]] = {}  # read ahead, by index: (item, tensor or error)
        self._next = 0  # the index the consumer gets next
        self._count = 0
        self._failed = False
        self._ahead = 0  # bytes in _ready and in flight
        self._changed = anyio.Event()  # set, and replaced, when something changed that a waiter wants
        self._waiting = False  # anyone waiting on _changed (a new Event per tensor cost 13 us)
        self._reader: anyio.CancelScope | None = None
        self._reader_done: anyio.Event | None = None
        self._closed = False
        self._yielded = 0.0  # when the consumer last let other tasks run

    async def __aenter__(self) -> TensorStream:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    def __aiter__(self) -> TensorStream:
        return self

    async def __anext__(self) -> tuple[str, torch.Tensor]:
        if not self._closed and time.perf_counter() - self._yielded > YIELD_S:
            await self._wait(ready=True)
        if self._closed:
            raise StopAsyncIteration
        if self._items is None:
            sched = self.scheduler
            try:
                with sched.operation():
                    prepared = await sched.call(
                        _prepared, sched, self.source, self._select, self._rows, self._batch_bytes, priority=Priority.LOAD
                    )
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.aclose()
                raise
            (self._items, self._batches), self._count = prepared, len(prepared[0])
            self._start_reader()
        while self._next not in self._ready:
            if self._next >= self._count or (self._reader_done is not None and self._reader_done.is_set()):
                await self.aclose()
                raise StopAsyncIteration
            await self._wait()
        item, got = self._ready[self._next]
        if isinstance(got, BaseException):
            await self.aclose()
            raise got
        name = item.names[0]
        if len(item.names) > 1:  # a tied weight: the same tensor under its other names next
            self._ready[self._next] = (Item(item.path, item.spec, item.crc, item.names[1:]), got)
        else:
            del self._ready[self._next]
            self._next += 1
            self._ahead -= item.spec.nbytes
            self._notify()
        return name, got

    async def _wait(self, ready: bool = False) -> None:
        """Wait for the reader to land something (``ready``: only let other tasks run); if
        cancelled meanwhile, the stream is closed."""
        try:
            await (anyio.lowlevel.checkpoint() if ready else self._next_change())
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise
        self._yielded = time.perf_counter()

    def _notify(self) -> None:
        if self._waiting:
            self._changed.set()
            self._changed = anyio.Event()
            self._waiting = False

    def _start_reader(self) -> None:
        self._reader_done = anyio.Event()
        threads.spawn(self._read_all)

    async def _read_all(self) -> None:
        """Read the batches in order, up to ``workers`` at once and ``window_bytes`` ahead of the
        consumer; each file is opened once. Results land in ``_ready`` by index; the first error
        ends it."""
        assert self._reader_done is not None
        fds: dict[str, int] = {}
        slots = anyio.Semaphore(self.scheduler.workers)
        try:
            with anyio.CancelScope() as scope:
                self._reader = scope
                async with anyio.create_task_group() as tg:
                    start = 0  # the index of the batch's first item
                    for items, nbytes in self._batches:
                        while self._ahead and self._ahead + nbytes > self.window_bytes:
                            await self._next_change()
                        if self._closed or self._failed:
                            break
                        await slots.acquire()
                        self._ahead += nbytes
                        path = items[0].path
                        if path not in fds:
                            try:
                                fds[path] = await open_read(self.scheduler, path)
                            except Exception as e:  # the consumer gets it where that file's tensors begin
                                slots.release()
                                self._failed = True
                                self._ready[start] = (items[0], e)
                                break
                        tg.start_soon(self._read_batch, start, items, nbytes, fds[path], slots)
                        start += len(items)
        finally:
            with anyio.CancelScope(shield=True):
                for fd in fds.values():
                    await close(self.scheduler, fd)
            self._reader_done.set()
            self._notify()

    async def _read_batch(self, start: int, items: list[Item], nbytes: int, fd: int, slots: anyio.Semaphore) -> None:
        """Read ``items`` (indices ``start``...) into new tensors; an error lands at ``start``."""
        sched = self.scheduler
        try:
            with sched.operation():
                targets = await sched.call(_new_targets, items, self.device, self.verify, self._stream, priority=Priority.LOAD)
                await read_tensors(sched, fd, items[0].path, targets, Priority.LOAD)
                self.bytes_read += nbytes
                got = await sched.call(_finished, items, targets, self.dtype, self._stream, priority=Priority.LOAD)
        except Exception as e:
            self._failed = True
            self._ready[start] = (items[0], e)
        else:
            self._ready.update(enumerate(zip(items, got, strict=True), start))
        finally:
            slots.release()
        self._notify()

    async def _next_change(self) -> None:
        self._waiting = True
        await self._changed.wait()

    async def aclose(self) -> None:
        """Stop reading and free what was read ahead (and the read plan: for tens of thousands of
        tensors, freeing it is work too, done in a worker thread); waits until no thread writes any
        more. Cancellation: shielded, it finishes."""
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
        with anyio.CancelScope(shield=True):
            if self._reader_done is not None:
                await self._reader_done.wait()
            self._ahead = 0
            held = (self._ready, self._items or [], self._batches)
            self._ready, self._items, self._batches = {}, [], []
            await self.scheduler.discard(*held)
            if self._own:
                self._own = False
                await anyio.to_thread.run_sync(self.scheduler.close)


stream = TensorStream  # ``aiotensor.stream(source, ...)``: the documented way to make one
