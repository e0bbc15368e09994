"""The scheduler's gate: priorities, budget, cancellation, error propagation."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import anyio
import pytest

from aiotensor import knobs
from aiotensor._runtime.scheduler import Priority, Scheduler

from .conftest import ALL_BACKENDS, cancel_task_once

pytestmark = pytest.mark.anyio


async def test_priority_order_when_saturated() -> None:
    sched = Scheduler(workers=1, chunk_bytes=4096)
    release = threading.Event()
    order: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: sched.call(release.wait, 5, priority=Priority.SAVE))
        await anyio.sleep(0.05)
        for name, prio in [("bg", Priority.BACKGROUND), ("save", Priority.SAVE), ("load", Priority.LOAD)]:

            async def job(name: str = name, prio: int = prio) -> None:
                await sched.call(order.append, name, priority=prio)

            tg.start_soon(job)
            await anyio.sleep(0.01)
        release.set()
    assert order == ["load", "save", "bg"]


async def test_cancelled_waiter_never_runs_and_frees_its_place() -> None:
    sched = Scheduler(workers=1, chunk_bytes=4096)
    release = threading.Event()
    ran: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: sched.call(release.wait, 5))
        await anyio.sleep(0.05)
        with anyio.move_on_after(0.05):
            await sched.call(ran.append, "cancelled", priority=Priority.LOAD)
        release.set()
    await sched.call(ran.append, "after")
    assert ran == ["after"]


async def test_cancel_waits_for_the_running_thread() -> None:
    sched = Scheduler(workers=2, chunk_bytes=4096)
    finished: list[float] = []

    def slow() -> None:
        time.sleep(0.2)
        finished.append(time.monotonic())

    with anyio.move_on_after(0.02):
        await sched.call(slow)
    assert finished, "the call returned before its thread finished"


async def test_map_raises_the_first_error_itself_and_stops() -> None:
    sched = Scheduler(workers=2, chunk_bytes=4096)
    seen: list[int] = []

    def fn(i: int) -> int:
        seen.append(i)
        if i == 3:
            raise KeyError("boom")
        time.sleep(0.001)
        return i

    with pytest.raises(KeyError, match="boom"):
        await sched.map(fn, range(1000), nbytes=lambda _: 1, priority=Priority.SAVE)
    assert len(seen) < 1000
    assert await sched.map(lambda i: i * 2, range(5), nbytes=lambda _: 1, priority=Priority.LOAD) == [0, 2, 4, 6, 8]


@pytest.mark.parametrize("anyio_backend", ALL_BACKENDS)
@pytest.mark.parametrize("how", ["scope", "task"])
async def test_a_cancelled_map_stops_its_running_batches_after_the_unit_in_hand(how: str, anyio_backend: Any) -> None:
    """A batch runs its units in one thread call; a cancelled map waited for all of them (a batch of
    64 MiB of reads held a cancelled load 0.1-0.25 s). Now each running batch stops after the unit
    in hand, and a unit that works in steps (a stream's batch) stops between two (given_up); the
    cancellation is raised, once no thread runs."""
    from aiotensor._runtime import scheduler as scheduler_module

    if how == "task" and anyio_backend[0] == "trio":
        pytest.skip("asyncio's own Task.cancel()")
    sched = Scheduler(workers=1, chunk_bytes=4096)
    ran: list[int] = []
    steps: list[int] = []
    started = threading.Event()

    def unit(i: int) -> int:
        ran.append(i)
        if i == 0:
            started.set()
            stop = scheduler_module._stop.get()
            assert stop is not None and stop.wait(10), "the cancellation never reached the thread"
            for step in range(5):  # a unit of steps: stops at the next
                try:
                    scheduler_module.given_up()
                except scheduler_module._Stopped:
                    break
                steps.append(step)
        return i

    async def run() -> None:
        await sched.map(unit, range(50), nbytes=lambda _: 1, priority=Priority.LOAD, batch_bytes=1 << 30)

    if how == "scope":
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await anyio.to_thread.run_sync(started.wait)
                scope.cancel()
        assert scope.cancelled_caught
    else:
        await cancel_task_once(run, started)
    assert ran == [0] and steps == []
    assert await sched.map(lambda i: i * 2, range(5), nbytes=lambda _: 1, priority=Priority.LOAD) == [0, 2, 4, 6, 8]


def test_validation_names_the_argument() -> None:
    with pytest.raises(ValueError, match="workers must be >= 1"):
        Scheduler(workers=0)
    with pytest.raises(ValueError, match="chunk_bytes must be >= 4096"):
        Scheduler(chunk_bytes=10)


async def test_discard_empties_containers_a_slice_at_a_time_and_only_those_given() -> None:
    """discard() frees what the containers held a slice at a time (objects die while their
    container still holds others, in several slices: no one call frees 20,000, and the GIL
    changes hands between them), dicts as lists; a container inside one is freed, not emptied."""
    seen: list[int] = []

    class Obj:
        def __init__(self, home: list[Any] | dict[Any, Any]) -> None:
            self.home = home

        def __del__(self) -> None:
            seen.append(len(self.home))

    many: list[Any] = []
    many += [Obj(many) for _ in range(5000)]
    table: dict[int, Any] = {}
    table.update((i, Obj(table)) for i in range(3000))
    inner = [1, 2, 3]
    holder = [inner]
    sched = Scheduler(workers=2)
    try:
        await sched.discard(many, table, holder)
    finally:
        sched.close()
    assert many == [] and table == {} and holder == [] and inner == [1, 2, 3]
    intervals: list[float] = []

    class Timed:
        def __del__(self) -> None:
            intervals.append(sys.getswitchinterval())

    sched = Scheduler(workers=1)
    try:  # outside any load or save: the switch interval is lowered while it frees
        await sched.discard([Timed()])
    finally:
        sched.close()
    assert intervals == [knobs.SWITCH_INTERVAL_S] and sys.getswitchinterval() > knobs.SWITCH_INTERVAL_S
    assert len(seen) == 8000 and len(set(seen[:5000])) >= 4 and len(set(seen[5000:])) >= 4  # several slices each


@pytest.mark.parametrize("what", ["close", "written"])
async def test_what_must_end_waits_for_admission_through_task_cancel(tmp_path: Any, anyio_backend: Any, what: str) -> None:
    """A load's closing of its files and its marking of the tensors it wrote (``close``,
    ``written``) wait for admission like any call; asyncio's own ``Task.cancel()`` (``wait_for``, a
    TaskGroup) goes through an anyio shield, and withdrew them while they waited: the files stayed
    open, the tensors' version counters unmoved (stop 60's note). They are handed to a thread at
    once now (outside the gate) and waited out."""
    if anyio_backend[0] != "asyncio":
        pytest.skip("asyncio's own Task.cancel()")
    import asyncio
    import contextlib
    import os

    import torch

    from aiotensor._io.read import close, written

    sched = Scheduler(workers=1, chunk_bytes=4096)
    release = threading.Event()
    blocker = asyncio.ensure_future(sched.call(release.wait, 5, priority=Priority.SAVE))  # the one worker, busy
    await anyio.sleep(0.05)
    fds = [os.open(tmp_path, os.O_RDONLY) for _ in range(3)]
    t = torch.zeros(4)
    version = t._version
    task = asyncio.ensure_future(close(sched, *fds) if what == "close" else written(sched, [t]))
    await anyio.sleep(0.02)  # waiting for admission
    task.cancel()
    await anyio.sleep(0.01)
    task.cancel()
    release.set()
    await blocker
    with contextlib.suppress(asyncio.CancelledError):
        await task
    _assert_done(what, fds, t, version)


def _assert_done(what: str, fds: list[int], t: Any, version: int) -> None:
    """``close`` closed ``fds``; ``written`` moved ``t``'s version counter (then ``fds`` are closed here)."""
    import os

    if what == "close":
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)
    else:
        assert t._version > version
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("what", ["close", "written"])
def test_what_must_end_runs_when_the_loop_ends_in_the_same_turn(tmp_path: Any, what: str) -> None:
    """A load cancelled as ``asyncio.run``'s main coroutine returns runs its ``finally`` (closing
    its files, marking its tensors) while the loop cancels what is left: run as a task of its own
    (``threads.finish``), that work was cancelled before its first step (helper-57: 20 of 20)."""
    import asyncio
    import os

    import torch

    from aiotensor._io.read import close, written

    for _ in range(5):
        fds = [os.open(tmp_path, os.O_RDONLY) for _ in range(3)]
        t = torch.zeros(2)
        version = t._version

        async def main() -> None:
            sched = Scheduler(workers=2, chunk_bytes=4096)
            started = asyncio.Event()

            async def load() -> None:
                try:
                    started.set()
                    await asyncio.sleep(3600)
                finally:
                    await (close(sched, *fds) if what == "close" else written(sched, [t]))

            task = asyncio.ensure_future(load())
            await started.wait()
            task.cancel()  # and return: asyncio.run cancels what is left and ends the loop

        asyncio.run(main())
        _assert_done(what, fds, t, version)
