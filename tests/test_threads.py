"""The library's worker threads (aiotensor._threads): results, errors, context, lowered priority,
cancellation, idle exit, a forked child; on asyncio, uvloop and trio."""

from __future__ import annotations

import contextvars
import multiprocessing
import os
import sys
import threading
import time

import anyio
import pytest

from aiotensor._runtime import threads as _threads
from aiotensor._runtime.scheduler import Scheduler

from .conftest import ALL_BACKENDS

pytestmark = pytest.mark.anyio
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")

var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")


@pytest.fixture(params=ALL_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> object:
    return request.param


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


async def test_result_error_and_context() -> None:
    assert await _threads.run_sync(divmod, 7, 2) == (3, 1)
    with pytest.raises(ZeroDivisionError):
        await _threads.run_sync(divmod, 1, 0)
    var.set("caller's")
    assert await _threads.run_sync(var.get) == "caller's"
    assert await _threads.run_sync(threading.current_thread) is not threading.current_thread()


@linux
async def test_workers_run_at_a_lower_priority_and_the_caller_does_not() -> None:
    mine = _nice()
    assert await _threads.run_sync(_nice, nice=5) == min(19, mine + 5)
    assert await _threads.run_sync(_nice, nice=0) == mine
    assert await Scheduler(nice=3).call(_nice) == min(19, mine + 3)
    assert _nice() == mine


async def test_cancel_waits_for_the_thread_then_raises() -> None:
    done = threading.Event()

    def slow() -> None:
        time.sleep(0.2)
        done.set()

    with anyio.move_on_after(0.02) as scope:
        await _threads.run_sync(slow)
    assert scope.cancelled_caught and done.is_set()


async def test_idle_threads_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_threads, "IDLE_S", 0.05)
    await _threads.run_sync(time.sleep, 0, nice=7)  # a pool of its own: no thread started before the patch
    deadline = time.monotonic() + 5
    while any(t.name == "aiotensor-worker-nice+7" for t in threading.enumerate()) and time.monotonic() < deadline:
        await anyio.sleep(0.02)
    assert not any(t.name == "aiotensor-worker-nice+7" for t in threading.enumerate())
    assert await _threads.run_sync(divmod, 9, 4, nice=7) == (2, 1)  # and new ones start on demand


def _child(q: multiprocessing.Queue[object]) -> None:
    # a fresh thread: the forked main thread still looks like it runs the parent's loop
    t = threading.Thread(target=lambda: q.put(anyio.run(_threads.run_sync, divmod, 9, 2)))
    t.start()
    t.join()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
async def test_a_forked_child_gets_threads_of_its_own(anyio_backend: object) -> None:
    if anyio_backend != ("asyncio", {}):
        pytest.skip("one backend is enough")
    await _threads.run_sync(time.sleep, 0)  # the parent has an idle worker thread
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    got = await anyio.to_thread.run_sync(q.get, True, 30)
    p.join(10)
    assert got == (4, 1) and p.exitcode == 0


async def test_exit_ends_the_idle_threads() -> None:
    await _threads.run_sync(time.sleep, 0, nice=6)
    assert any(t.name == "aiotensor-worker-nice+6" for t in threading.enumerate())
    _threads._end_idle_workers()  # what atexit runs
    assert not any(t.name.startswith("aiotensor-worker") for t in threading.enumerate())
    assert await _threads.run_sync(divmod, 9, 4, nice=6) == (2, 1)
