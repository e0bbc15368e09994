"""The library's worker threads: a process-wide pool whose threads run at a lower CPU priority.

Loads and saves keep every core busy with copies (the kernel's, from the page cache, and ours, into
staging memory). At the default priority those threads compete as equals with the event loop's
thread and with the rest of the machine (an HTTP client, a data loader), and each wake-up of the loop
can wait for a time slice. With the workers ``nice``-r than the process (Linux: per thread), the
kernel runs the loop's thread first whenever it is ready; the copies use whatever CPU is left,
which on an otherwise idle machine is all of it. Measured in ``bench/bench_stall_cause.py``: the
loop's thread waiting for a core made up 51 % of its stalls during a load at nice 0, 19 % at nice 10.

Threads start on demand and exit after :data:`IDLE_S` seconds without work, so a scheduler that is
never closed leaves no thread behind; a forked child starts with no threads. The number of calls
running at once is the callers' business (each :class:`~aiotensor.scheduler.Scheduler` admits at
most ``workers``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import functools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import anyio

from ..knobs import IDLE_S, NICE

# anyio imports an event loop's backend when the first of its primitives is made (an Event, at the
# first load or save): 20-100 ms of imports on the event loop's thread, every task stalled. The
# asyncio one is imported here instead, with aiotensor.
with contextlib.suppress(ImportError):
    import anyio._backends._asyncio

T = TypeVar("T")
log = logging.getLogger("aiotensor")


def lower_priority(by: int) -> None:
    """Lower the calling thread's CPU priority by ``by`` nice levels (Linux; elsewhere, nothing).

    One way only: an unprivileged thread cannot raise it again, so only our own threads call this."""
    if by <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except OSError:
        pass


class _Worker(threading.Thread):
    def __init__(self, pool: _Pool, home: bool = False) -> None:
        super().__init__(name=f"aiotensor-{'home' if home else 'worker'}-nice+{pool.nice}", daemon=True)
        self.pool = pool
        self.home = home
        # a job returns what tells its caller it is done: called once this thread is idle again, so a
        # caller that has its result finds the thread back in the pool
        self.jobs: queue.SimpleQueue[Callable[[], Callable[[], None]] | None] = queue.SimpleQueue()  # None: end

    def run(self) -> None:
        lower_priority(self.pool.nice)
        while True:
            try:
                job = self.jobs.get(timeout=IDLE_S)
            except queue.Empty:
                with self.pool.lock:
                    if self.home and self.jobs.empty():  # submit() puts under this lock: none is on the way
                        if self.pool.home is self:  # not a successor started after _end_idle_workers
                            self.pool.home = None
                        return
                    if self in self.pool.idle:  # nobody took this thread: it ends
                        self.pool.idle.remove(self)
                        return
                job = self.jobs.get()  # taken just now: its job is on the way
            if job is None:
                return
            tell = job()
            del job
            if not self.home:
                with self.pool.lock:
                    self.pool.idle.append(self)
            tell()
            del tell


class _Pool:
    def __init__(self, nice: int) -> None:
        self.nice = nice
        self.lock = threading.Lock()
        self.idle: list[_Worker] = []
        self.home: _Worker | None = None

    def submit(self, job: Callable[[], Callable[[], None]], home: bool = False) -> None:
        if home:  # one thread for the calls that allocate what a load returns, one after another
            with self.lock:
                if self.home is None:
                    self.home = _Worker(self, home=True)
                    self.home.start()
                self.home.jobs.put(job)
            return
        with self.lock:
            worker = self.idle.pop() if self.idle else None  # the most recently busy: its caches are warm
        if worker is None:
            worker = _Worker(self)
            worker.start()
        worker.jobs.put(job)


_pools: dict[int, _Pool] = {}
_pools_lock = threading.Lock()


def _forget_pools() -> None:
    global _pools_lock
    _pools.clear()  # the parent's threads do not exist in a forked child
    _pools_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


@atexit.register
def _end_idle_workers() -> None:
    """At interpreter exit, end the idle threads and wait for them (briefly), as anyio does for its
    own when its event loop ends: a thread left running into the interpreter's and the C++ runtime's
    teardown (after it ran gloo collectives, say) can abort the process. :func:`in_worker`'s jobs
    are waited for first (what nobody else waits for), within the same 2 s."""
    deadline = time.monotonic() + 2
    with _unwaited_lock:
        pending = list(_unwaited)
    for done in pending:
        done.wait(max(0.0, deadline - time.monotonic()))
    ending: list[_Worker] = []
    with _pools_lock:
        for pool in _pools.values():
            with pool.lock:
                ending += pool.idle
                pool.idle.clear()
                if pool.home is not None:  # its None comes after any job queued there
                    ending.append(pool.home)
                    pool.home = None
    for w in ending:
        w.jobs.put(None)
    for w in ending:
        w.join(max(0.0, deadline - time.monotonic()))


def _pool(nice: int) -> _Pool:
    with _pools_lock:
        pool = _pools.get(nice)
        if pool is None:
            pool = _pools[nice] = _Pool(nice)
        return pool


def loop_token() -> anyio.lowlevel.EventLoopToken | None:
    """The running event loop's anyio token (None outside one: anyio's NoEventLoopError)."""
    try:
        return anyio.lowlevel.current_token()
    except RuntimeError:
        return None


def call_soon_threadsafe() -> Callable[[Callable[[], object]], object]:
    """Schedule a callback on the running event loop (asyncio or trio) from any thread."""
    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:  # not asyncio: trio
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon


async def run_sync(
    fn: Callable[..., T],
    *args: Any,
    nice: int = NICE,
    cleanup: Callable[[T], object] | None = None,
    home: bool = False,
    stop: threading.Event | None = None,
) -> T:
    """Run ``fn(*args)`` in a worker thread ``nice`` levels below the process, in a copy of the
    caller's context (as ``anyio.to_thread.run_sync``).

    ``home``: in the pool's one home thread, after the calls queued there. The tensors a load
    returns are allocated there: glibc gives each thread its own arena, so memory freed by one load
    is reused by the next only where the next allocates in the same thread; allocated by whichever
    worker was free, a 0.53 GB load faulted in all its pages again, load after load (0.2 ms a MB on
    the development VM), where one thread faults 131 MB (what is above glibc's mmap threshold).

    Cancellation: waits for ``fn`` to return, whatever cancels the caller (it may be writing into
    the caller's memory, or making what a clean-up removes): anyio's and trio's cancellation, and
    asyncio's own ``Task.cancel()`` (``wait_for``), which an anyio shield does not hold. Then the
    cancellation is raised (even where ``fn`` failed meanwhile), after ``cleanup(result)`` (in a
    worker) where ``fn`` made something (a file descriptor) that the caller would otherwise never
    get to release. ``stop``: set as the cancellation comes, for a ``fn`` that does its work in
    steps to give up between two (:meth:`aiotensor._runtime.scheduler.Scheduler.map`).
    """
    done = anyio.Event()
    call_soon = call_soon_threadsafe()
    ctx = contextvars.copy_context()
    out: list[Any] = []

    def tell() -> None:
        try:
            call_soon(done.set)
        except RuntimeError:  # the loop was closed under its waiting caller (its process is ending)
            pass

    def job() -> Callable[[], None]:
        try:
            out.append((True, ctx.run(fn, *args)))
        except BaseException as e:  # handed to the caller, whatever it is
            out.append((False, e))
        return tell

    _pool(nice).submit(job, home)
    cancelled = await wait_out(done, None if stop is None else stop.set)
    ok, value = out.pop()
    if ok and cleanup is not None:
        if cancelled is None:
            cancelled = await _cancellation()
        if cancelled is not None:
            await run_sync(cleanup, value, nice=nice)
    return await _handed_back(cancelled, ok, value)  # type: ignore[no-any-return]


async def _cancellation() -> BaseException | None:
    """The cancellation of the caller's anyio scope, if it is cancelled (not raised)."""
    try:
        await anyio.lowlevel.checkpoint_if_cancelled()
    except BaseException as e:
        return e
    return None


async def _handed_back(cancelled: BaseException | None, ok: bool, value: Any) -> Any:
    """What a call waited out (:func:`wait_out`) gives its caller: the cancellation that came
    meanwhile, or that its anyio scope holds now, raised (a cancelled caller gets its cancellation,
    not the failure that came meanwhile: a load cancelled by wait_for while its read of a stalled
    server failed raised OSError, helper-30); else the call's error raised, or its result."""
    if cancelled is None:
        cancelled = await _cancellation()
    if cancelled is not None:
        if not ok:  # (kept for a debugging reader: nothing else tells of it)
            log.debug("a call failed while its caller was being cancelled: %s: %s", type(value).__name__, value)
        raise cancelled
    if not ok:
        try:
            raise value
        finally:
            del value
    return value


async def wait_out(done: anyio.Event, cancelled: Callable[[], object] | None = None) -> BaseException | None:
    """Wait for ``done`` through any cancellation; return the cancellation that came meanwhile
    from outside anyio (asyncio's ``Task.cancel()`` is raised even inside a shielded scope), to be
    raised once the wait is over. With ``cancelled``, the wait is not shielded until a cancellation
    comes (anyio's too, which a shield would hold back unseen): ``cancelled()`` is called then."""
    pending: BaseException | None = None
    if cancelled is not None and not done.is_set():
        try:
            await done.wait()
        except anyio.get_cancelled_exc_class() as e:
            pending = e
            cancelled()
    with anyio.CancelScope(shield=True):
        while not done.is_set():
            try:
                await done.wait()
            except anyio.get_cancelled_exc_class() as e:
                pending = e
    return pending


async def finish(fn: Callable[[], Awaitable[T]]) -> T:
    """``await fn()`` run to its end whatever cancels the caller, then ``fn``'s error raised, else the
    cancellation that came meanwhile, else its result: for a sequence of steps that must not be
    cut between two of them (a commit and its ``latest``, a deletion, a close). An anyio shield
    holds anyio's and trio's cancellation but not asyncio's own ``Task.cancel()`` (``wait_for``,
    ``asyncio.timeout``, a TaskGroup's), which cut such a sequence after its step in hand (helper-51:
    a cancelled ``delete()`` left ``latest`` naming an older step and the step committed, a close
    cancelled twice let a second writer in while a save was still committing): on asyncio ``fn()``
    runs as a task of its own, waited out (:func:`wait_out`). ``fn``'s error is raised before the
    cancellation (on both backends). (The loop ending cancels that task too; where it never
    started, the cancellation is raised.)"""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # trio: its shield holds every cancellation
        with anyio.CancelScope(shield=True):
            got = await fn()
        await anyio.lowlevel.checkpoint_if_cancelled()
        return got
    done = anyio.Event()
    out: list[tuple[bool, Any]] = []

    async def run() -> None:
        try:
            out.append((True, await fn()))
        except BaseException as e:  # handed to the caller, whatever it is
            out.append((False, e))
        finally:
            done.set()

    spawn(run, done.set)  # (set even where the task never starts: a loop ending cancels it first, helper-53)
    cancelled = await wait_out(done)
    if not out:  # never started: the loop is ending, its tasks (the caller too) cancelled
        raise cancelled if cancelled is not None else asyncio.CancelledError()
    ok, value = out.pop()
    if not ok:  # it ran, and failed: its error, before a cancellation that came meanwhile (as trio's
        try:  # shield lets it out; a timed-out delete() that failed said nothing: helper-53)
            raise value
        finally:
            del value
    return await _handed_back(cancelled, ok, value)  # type: ignore[no-any-return]


_keep_alive: set[asyncio.Task[None]] = set()


def spawn(fn: Callable[[], Awaitable[None]], finally_: Callable[[], object] | None = None) -> None:
    """Run ``fn()`` as a task of the running loop, owned by no caller's task or task group: a
    store opened in one task may be used and closed from any other. ``fn`` never raises.
    ``finally_()`` runs once the task is done, even where it never started (asyncio cancels a task
    before its first step when its loop ends: ``fn``'s own ``finally`` never runs then)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio: trio (whose tasks always start, so fn's own finally runs)
        import trio

        async def run() -> None:
            try:
                await fn()
            finally:
                if finally_ is not None:
                    finally_()

        trio.lowlevel.spawn_system_task(run)
        return
    task: asyncio.Task[None] = loop.create_task(fn())  # type: ignore[arg-type]
    _keep_alive.add(task)
    task.add_done_callback(_keep_alive.discard)
    if finally_ is not None:
        task.add_done_callback(lambda _: finally_())


def spawner() -> Callable[[Callable[[], Awaitable[None]]], None]:
    """:func:`spawn` for later, from any thread (a finalizer runs on whichever collects): ``later(fn)``
    runs ``fn()`` as a task of the loop running now; nothing once that loop is ending or has ended
    (trio refuses new tasks then, and would call the refusal an internal error)."""
    soon = call_soon_threadsafe()

    def start(fn: Callable[[], Awaitable[None]]) -> None:
        with contextlib.suppress(RuntimeError):
            spawn(fn)

    def later(fn: Callable[[], Awaitable[None]]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has ended (trio's RunFinishedError is one too)
            soon(functools.partial(start, fn))

    return later


def in_worker(fn: Callable[[], object]) -> None:
    """Run ``fn()`` in a worker thread and return at once; nothing waits for it, its result and its
    errors are dropped. For letting go of what nobody waits for: freeing 1 GB of tensors took 70 ms
    (the kernel unmapping it; the GIL is free meanwhile), a stall of every task where the caller is
    the event loop's thread."""

    done = threading.Event()  # waited for at exit (_end_idle_workers): freeing tensors into the
    with _unwaited_lock:  # interpreter's teardown aborted the process ("terminate called ...")
        _unwaited.add(done)

    def finished() -> None:  # called by the worker once it is idle again
        with _unwaited_lock:
            _unwaited.discard(done)
        done.set()

    def job() -> Callable[[], None]:
        with contextlib.suppress(Exception):
            fn()
        return finished

    _pool(NICE).submit(job)


_unwaited: set[threading.Event] = set()  # in_worker's jobs not yet done
_unwaited_lock = threading.Lock()


class Tasks:
    """Work started in the background (by :func:`spawn`) that an owner waits for when it closes."""

    def __init__(self) -> None:
        self._busy: set[anyio.Event] = set()

    def __bool__(self) -> bool:
        return bool(self._busy)

    def start(self, fn: Callable[[], Awaitable[None]], finally_: Callable[[], object] | None = None) -> None:
        """Run ``fn()`` in the background (``fn`` never raises); then ``finally_()``, even where
        the task never started (:func:`spawn`)."""
        done = anyio.Event()
        self._busy.add(done)

        async def run() -> None:
            try:
                await fn()
            finally:
                self._busy.discard(done)
                done.set()

        spawn(run, finally_)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Count the caller's own work (a load) as running, for :meth:`wait`."""
        done = anyio.Event()
        self._busy.add(done)
        try:
            yield
        finally:
            self._busy.discard(done)
            done.set()

    async def wait(self) -> None:
        """Until nothing runs. Cancellation: stops waiting (the work goes on)."""
        while self._busy:
            await next(iter(self._busy)).wait()
