"""The scheduler: runs engine calls in worker threads under one budget, highest priority first.

Every blocking call of every save and load in a store goes through :meth:`Scheduler.call`. A gate
admits at most ``workers`` calls and ``budget_bytes`` bytes at once; waiting calls are admitted in
priority order (loads, then saves, then background snapshots) and, within a priority, first come
first served. Bookkeeping is synchronous; the only ``await`` is the wait itself and the thread.
"""

from __future__ import annotations

import enum
import functools
import heapq
import inspect
import itertools
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio

from .. import knobs
from ..engines import Engine, default_engine
from . import gil, threads
from .buffers import SlotPool
from .cuda import CopyStreams
from .cuda import available as cuda_available

T = TypeVar("T")
U = TypeVar("U")


class Priority(enum.IntEnum):
    """Lower runs first."""

    LOAD = 0
    SAVE = 1
    BACKGROUND = 2


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    nbytes: int = field(compare=False)
    event: anyio.Event = field(compare=False)
    granted: bool = field(default=False, compare=False)
    gone: bool = field(default=False, compare=False)


class _Gate:
    def __init__(self, slots: int, budget: int) -> None:
        self.budget = budget
        self.free_slots = slots
        self.free_bytes = budget
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()

    def _fits(self, n: int) -> bool:
        return self.free_slots > 0 and self.free_bytes >= n

    def _take(self, n: int) -> None:
        self.free_slots -= 1
        self.free_bytes -= n

    def _release(self, n: int) -> None:
        self.free_slots += 1
        self.free_bytes += n
        self._wake()

    def _wake(self) -> None:
        # strict order: the first waiter blocks those behind it, so large requests cannot starve
        while self._heap:
            w = self._heap[0]
            if w.gone:
                heapq.heappop(self._heap)
                continue
            if not self._fits(w.nbytes):
                return
            heapq.heappop(self._heap)
            self._take(w.nbytes)
            w.granted = True
            w.event.set()

    @asynccontextmanager
    async def hold(self, nbytes: int, priority: int) -> AsyncIterator[None]:
        n = min(nbytes, self.budget)
        if not self._heap and self._fits(n):
            self._take(n)
        else:
            w = _Waiter(priority, next(self._seq), n, anyio.Event())
            heapq.heappush(self._heap, w)
            try:
                await w.event.wait()
            except BaseException:
                if w.granted:
                    self._release(n)
                else:
                    w.gone = True
                    self._wake()
                raise
        try:
            yield
        finally:
            self._release(n)


ProgressCallback = Callable[[int, int], object]


def check_progress(callback: ProgressCallback | None) -> None:
    """A TypeError at the call for a ``progress=`` that cannot report: not callable (it failed the
    save after its copy, helper-71), or a coroutine function (never awaited: no progress came, a
    RuntimeWarning at most)."""
    if callback is None:
        return
    if not callable(callback):
        raise TypeError(f"progress must be a function of (done, total), got {type(callback).__name__}")
    if inspect.iscoroutinefunction(callback) or inspect.iscoroutinefunction(type(callback).__call__):
        raise TypeError(
            "progress is called on the event loop's thread as bytes move, and never awaited: give a plain function "
            "(one that starts a task, if it must await)"
        )


class _Progress:
    def __init__(self, total: int, callback: ProgressCallback) -> None:
        self.total, self.done, self.callback = total, 0, callback

    def add(self, n: int) -> None:
        self.done = min(self.total, self.done + n)
        self.callback(self.done, self.total)


_progress: ContextVar[_Progress | None] = ContextVar("aiotensor_progress", default=None)


@contextmanager
def reporting(total: int, callback: ProgressCallback | None) -> Iterator[None]:
    """Within this block (this task and the tasks it starts), bytes read or written by the
    scheduler's I/O are reported as ``callback(done, total)``, on the loop thread, once per batch;
    a last ``callback(total, total)`` comes when the block ends without an error."""
    if callback is None:
        yield
        return
    p = _Progress(total, callback)
    token = _progress.set(p)
    try:
        yield
        if p.done < total:
            p.add(total - p.done)
    finally:
        _progress.reset(token)


@dataclass
class Stats:
    """Counters of a scheduler (bytes moved by the engine, calls run)."""

    bytes_read: int = 0
    bytes_direct: int = 0  # of bytes_read, read with O_DIRECT
    bytes_written: int = 0
    calls: int = 0


class Scheduler:
    """Runs blocking engine work in worker threads under a byte budget with priorities.

    Args:
        engine: the engine to run (default: :func:`aiotensor.engines.default_engine`).
        workers: worker threads, and the most calls in flight at once.
        chunk_bytes: the largest piece one engine call reads or writes.
        batch_bytes: the most bytes one thread call moves before returning to the event loop.
        nice: how many nice levels below the process the worker threads run (Linux; 0: the same
            priority). The event loop's thread then gets a core as soon as it is ready, instead of
            waiting for a time slice behind the copies (see :mod:`aiotensor._runtime.threads`).
        switch_interval: while an operation of this scheduler runs (:meth:`operation`), the
            interpreter's GIL switch interval is at most this many seconds, so that the event loop's
            thread waits at most about that long for the GIL (``None``: left alone; see
            :func:`aiotensor.gil.switch_interval`).
    """

    def __init__(
        self,
        engine: Engine | None = None,
        *,
        workers: int = knobs.WORKERS,
        chunk_bytes: int = knobs.CHUNK_BYTES,
        batch_bytes: int = knobs.BATCH_BYTES,
        nice: int = knobs.NICE,
        switch_interval: float | None = knobs.SWITCH_INTERVAL_S,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, got {chunk_bytes}")
        self.engine = engine if engine is not None else default_engine(workers=workers, chunk_bytes=chunk_bytes)
        self.workers = workers
        self.chunk_bytes = chunk_bytes
        self.batch_bytes = max(batch_bytes, chunk_bytes)
        if switch_interval is not None and not switch_interval > 0:
            raise ValueError(f"switch_interval must be > 0 seconds or None, got {switch_interval}")
        self.nice = nice
        self.switch_interval = switch_interval
        self.slots = SlotPool(workers, chunk_bytes)
        self.stats = Stats()
        self.cuda: CopyStreams | None = CopyStreams() if cuda_available() else None
        self._gate = _Gate(workers, workers * self.batch_bytes)  # also keeps the threads to `workers`
        _schedulers.add(self)

    async def call(
        self,
        fn: Callable[..., T],
        *args: Any,
        nbytes: int = 0,
        priority: int = Priority.SAVE,
        slot: bool = False,
        cleanup: Callable[[T], object] | None = None,
        home: bool = False,
        stop: threading.Event | None = None,
    ) -> T:
        """Run ``fn(*args)`` in a worker thread once admitted; with ``slot``, ``fn(slot, *args)``;
        with ``home``, in the home thread, where the tensors a load returns are allocated (see
        :func:`aiotensor._runtime.threads.run_sync`); ``stop`` is set as a cancellation comes.

        Cancellation: while waiting for admission, the call is withdrawn and never runs. Once its
        thread has started, cancellation waits for the thread to return (the thread may be writing
        into a caller's buffer) and then raises; the slot is returned only after that. What the
        call made is handed to ``cleanup`` if the caller was cancelled meanwhile (see
        :func:`aiotensor._runtime.threads.run_sync`).
        """
        async with self._gate.hold(nbytes, priority):
            self.stats.calls += 1
            if not slot:
                return await self.run_sync(fn, *args, cleanup=cleanup, home=home, stop=stop)
            i = self.slots.take()
            try:
                return await self.run_sync(fn, self.slots.view(i), *args, cleanup=cleanup, stop=stop)
            finally:
                self.slots.give(i)

    async def run_sync(
        self,
        fn: Callable[..., T],
        *args: Any,
        cleanup: Callable[[T], object] | None = None,
        home: bool = False,
        stop: threading.Event | None = None,
    ) -> T:
        """Run ``fn(*args)`` in one of the worker threads now, outside the gate (for work that is
        not I/O, such as mapping memory). Cancellation: as for :meth:`call` once started."""
        return await threads.run_sync(gil.call_collecting, fn, *args, nice=self.nice, cleanup=cleanup, home=home, stop=stop)

    @contextmanager
    def operation(self) -> Iterator[None]:
        """The window of one save or load: the cyclic garbage collector paused and the GIL switch
        interval lowered (see :mod:`aiotensor._runtime.gil`), both process-wide, both given back when the
        last such window ends."""
        with gil.paused_gc(), gil.switch_interval(self.switch_interval):
            yield

    async def discard(self, *containers: list[Any] | dict[Any, Any]) -> None:
        """Empty ``containers`` in a worker thread, a slice at a time: where they held the last
        references to tens of thousands of objects (tensor views, units, specs), freeing those is
        Python work too, and it happens wherever the last reference goes. (To free one big object,
        pass ``[obj]`` and drop your own reference first; a big container inside another is freed
        in one call unless it is passed too, before.) Inside an :meth:`operation` window, whether or
        not the caller's has ended (a stream's close): with Python's 5 ms switch interval the loop's
        thread waited up to that long for the freeing worker. Cancellation: as for :meth:`run_sync`."""
        with self.operation():
            await self.run_sync(gil.emptied, *containers)

    def discard_later(self, *containers: list[Any] | dict[Any, Any], then: Callable[[], object] | None = None) -> None:
        """:meth:`discard`, not awaited: ``containers`` are emptied in a worker thread, then
        ``then()`` runs there. For what nobody waits for (a stream dropped unclosed, whose event
        loop may be ending)."""
        threads.in_worker(functools.partial(_clear_then, containers, then))

    async def map(
        self,
        fn: Callable[..., T],
        units: Iterable[U],
        *,
        nbytes: Callable[[U], int],
        priority: int,
        slot: bool = False,
        batch_bytes: int | None = None,
        budget: bool = True,
        io: bool = False,
    ) -> list[T]:
        """Run ``fn(unit)`` (``fn(slot, unit)`` with ``slot``) over ``units``; results in unit order.

        Consecutive units are batched up to ``batch_bytes`` (default ``batch_bytes`` of the
        scheduler) and each batch runs in one thread call, so work goes on in the threads even
        while the event loop is held by other code; up to ``workers`` batches run at once, and
        priorities take effect between batches. ``budget=False`` admits batches without counting
        their bytes (memory copies that do no I/O). ``io=True``: the units' bytes are file I/O,
        reported to the progress callback of the operation (see :func:`reporting`).

        The first failure cancels the batches not yet started, waits for those running, and is
        raised as itself (not wrapped in an exception group).

        Cancellation: as for :meth:`call`; returns only when no thread of this map still runs. A
        batch running stops after its unit in hand (a batch of 64 MiB of reads held a cancelled
        load up to 0.2 s).
        """
        limit = self.batch_bytes if batch_bytes is None else batch_bytes
        units = list(units)
        if not units:
            return []
        # cutting tens of thousands of units into batches is Python work: not on the loop thread
        if len(units) > knobs.INLINE_UNITS:
            batches = await self.run_sync(batched, units, nbytes, limit)
        else:
            batches = batched(units, nbytes, limit)
        results: list[list[T]] = [[] for _ in batches]
        it = iter(enumerate(batches))

        stop = threading.Event()

        def run(*args: Any) -> list[T]:
            *pre, batch = args
            _stop.set(stop)  # (in this call's copy of the caller's context)
            out = []
            for u in batch:
                given_up()
                out.append(fn(*pre, u))
            return out

        progress = _progress.get() if io else None

        async def worker() -> None:
            for i, (batch, size) in it:
                results[i] = await self.call(run, batch, nbytes=size if budget else 0, priority=priority, slot=slot, stop=stop)
                if progress is not None:
                    progress.add(size)

        await run_concurrently(*[worker] * min(self.workers, len(batches)))
        if len(units) > knobs.INLINE_UNITS:
            return await self.run_sync(_concat, results)
        return _concat(results)

    def metrics(self) -> dict[str, int]:
        """What a server can export: bytes moved so far, bytes admitted and not yet done, calls
        waiting for admission, and calls run (sample twice for bytes/s). No I/O, no lock."""
        g = self._gate
        return {
            "bytes_read": self.stats.bytes_read,
            "bytes_written": self.stats.bytes_written,
            "bytes_in_flight": g.budget - g.free_bytes,
            "queue_depth": sum(not w.gone for w in g._heap),
            "calls": self.stats.calls,
        }

    @property
    def devices(self) -> tuple[str, ...]:
        """Device types whose tensors this scheduler saves and loads."""
        return ("cpu", "cuda") if self.cuda is not None else ("cpu",)

    def close(self) -> None:
        """Free the bounce slots and stop the CUDA event threads (blocks: call it in a thread)."""
        self.slots.close()
        if self.cuda is not None:
            self.cuda.close()


def batched(
    units: list[U], nbytes: Callable[[U], int], limit: int, most: int = 0, apart: Callable[[U, U], bool] | None = None
) -> list[tuple[list[U], int]]:
    """Consecutive units in batches of at most ``limit`` bytes (a bigger unit alone), with their
    sizes; with ``most``, of at most that many units; ``apart(previous, unit)``: ``unit`` begins a
    new batch."""
    batches: list[tuple[list[U], int]] = []
    batch: list[U] = []
    size = 0
    for u in units:
        n = nbytes(u)
        if batch and (size + n > limit or len(batch) == most or (apart is not None and apart(batch[-1], u))):
            batches.append((batch, size))
            batch, size = [], 0
        batch.append(u)
        size += n
    if batch:
        batches.append((batch, size))
    return batches


def _clear_then(containers: tuple[list[Any] | dict[Any, Any], ...], then: Callable[[], object] | None) -> None:
    gil.emptied(*containers)
    if then is not None:
        then()


class _Stopped(Exception):
    """A batch of :meth:`Scheduler.map` given up between two units: its caller was cancelled (what
    it gets is the cancellation)."""


_stop: ContextVar[threading.Event | None] = ContextVar("aiotensor_stop", default=None)


def given_up() -> None:
    """In a unit of :meth:`Scheduler.map` (a worker thread): raise where the map was cancelled, for
    a unit that does its work in steps to stop between two."""
    stop = _stop.get()
    if stop is not None and stop.is_set():
        raise _Stopped


_schedulers: weakref.WeakSet[Scheduler] = weakref.WeakSet()


def _forget_in_flight() -> None:
    """In a forked child (a DataLoader worker forked mid-save): the parent's calls in flight never
    end here, their threads do not exist, so every scheduler admits afresh, with bounce slots of its
    own (the parent's may be kept from children); a load through a copied store waited for ever
    for slots the parent's saves held (helper-53)."""
    for s in list(_schedulers):
        s._gate = _Gate(s.workers, s.workers * s.batch_bytes)
        s.slots.forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_flight)


def _concat(results: list[list[T]]) -> list[T]:
    return [r for batch in results for r in batch]


async def run_concurrently(*fns: Callable[[], Any]) -> None:
    """Run coroutine functions concurrently; the first failure cancels the rest and is raised as
    itself (not wrapped in an exception group)."""
    error: BaseException | None = None
    try:
        async with anyio.create_task_group() as tg:
            for fn in fns:
                tg.start_soon(fn)
    except BaseExceptionGroup as eg:
        error = _single(eg)
    if error is not None:
        raise error  # outside the handler: keeps the error's own cause and context


def _single(eg: BaseExceptionGroup) -> BaseException:
    """The first real error inside a task group's exception group (the group if only cancellations)."""
    leaves: list[BaseException] = []
    _leaves(eg, leaves)
    real = [e for e in leaves if not isinstance(e, anyio.get_cancelled_exc_class())]
    if not real:
        return eg
    # several workers failing at once (a full disk fails every writer): the first is the cause,
    # raised as itself (an OSError stays an OSError); the others are listed on it
    first = real[0]
    for other in real[1:]:
        first.add_note(f"also: {type(other).__name__}: {other}")
    return first


def _leaves(e: BaseException, out: list[BaseException]) -> None:
    if isinstance(e, BaseExceptionGroup):
        for x in e.exceptions:
            _leaves(x, out)
    else:
        out.append(e)


@asynccontextmanager
async def own_scheduler(given: Scheduler | None, engine: Engine | None = None) -> AsyncIterator[Scheduler]:
    """``given``, or a scheduler of our own, closed (its slots unpinned and unmapped) at the end;
    inside its :meth:`~Scheduler.operation` window."""
    if given is not None:
        with given.operation():
            yield given
        return
    sched = Scheduler(engine)
    try:
        with sched.operation():
            yield sched
    finally:
        if sched.slots.mapped or sched.cuda is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(sched.close)
        else:  # nothing to free (a header read, a mapping): no thread hop
            sched.close()
