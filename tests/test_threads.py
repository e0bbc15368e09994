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


async def test_a_cancelled_caller_gets_its_cancellation_even_where_the_call_failed_meanwhile() -> None:
    """A load cancelled by asyncio.wait_for while its read of a stalled server failed raised that
    OSError, not TimeoutError: the cancellation was lost (helper-30)."""

    def failing() -> None:
        time.sleep(0.2)
        raise OSError(5, "the server stopped answering")

    with anyio.move_on_after(0.02) as scope:
        await _threads.run_sync(failing)
    assert scope.cancelled_caught
    import sniffio

    if sniffio.current_async_library() == "asyncio":  # (and uvloop)
        import asyncio

        with pytest.raises(TimeoutError):
            await asyncio.wait_for(_threads.run_sync(failing), 0.02)
    with pytest.raises(OSError, match="stopped answering"):  # not cancelled: the failure, as before
        await _threads.run_sync(failing)


async def test_idle_threads_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_threads, "IDLE_S", 0.05)
    await _threads.run_sync(time.sleep, 0, nice=7)  # a pool of its own: no thread started before the patch
    deadline = time.monotonic() + 5
    while any(t.name == "aiotensor-worker-nice+7" for t in threading.enumerate()) and time.monotonic() < deadline:
        await anyio.sleep(0.02)
    assert not any(t.name == "aiotensor-worker-nice+7" for t in threading.enumerate())
    assert await _threads.run_sync(divmod, 9, 4, nice=7) == (2, 1)  # and new ones start on demand


async def test_home_calls_run_in_one_thread_one_after_another_and_it_exits_when_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a load returns is allocated in the home thread (glibc's arena of one thread: memory a
    load freed is reused by the next); its calls queue there, and it ends when idle as the others do."""
    monkeypatch.setattr(_threads, "IDLE_S", 0.2)
    nice = 5
    running: list[int] = []

    def call(i: int) -> str:
        running.append(i)
        time.sleep(0.01)
        assert running == [i]  # nothing else runs there meanwhile
        running.remove(i)
        return threading.current_thread().name

    names: list[str] = []

    async def one(i: int) -> None:
        names.append(await _threads.run_sync(call, i, nice=nice, home=True))

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(one, i)
    assert set(names) == {f"aiotensor-home-nice+{nice}"} and len(names) == 6
    deadline = time.monotonic() + 5
    while any(t.name == f"aiotensor-home-nice+{nice}" for t in threading.enumerate()) and time.monotonic() < deadline:
        await anyio.sleep(0.02)
    assert not any(t.name == f"aiotensor-home-nice+{nice}" for t in threading.enumerate())
    assert await _threads.run_sync(call, 7, nice=nice, home=True) == f"aiotensor-home-nice+{nice}"  # a new one


async def test_loads_allocate_what_they_return_in_the_home_thread(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import aiotensor
    from aiotensor._io import tensors

    seen: list[str] = []
    carve = tensors.carve

    def spy(*a: object) -> object:
        seen.append(threading.current_thread().name)
        return carve(*a)  # type: ignore[arg-type]

    for mod in ("aiotensor._io.tensors", "aiotensor._io.assemble"):  # every caller of carve looks it up in one of them
        monkeypatch.setattr(sys.modules[mod], "carve", spy)
    path = os.path.join(str(tmp_path), "m.safetensors")
    await aiotensor.save_file({"w": torch.ones(3), "b": torch.zeros(2)}, path)
    await aiotensor.load_file(path)
    async with aiotensor.stream(path) as s:
        assert {n async for n, _ in s} == {"w", "b"}
    async with aiotensor.TensorStore(os.path.join(str(tmp_path), "root")) as store:
        await store.save(1, {"w": torch.ones(3)})
        await store.load()
    assert len(seen) == 3 and all(n.startswith("aiotensor-home") for n in seen), seen


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
    await _threads.run_sync(divmod, 9, 4, nice=6, home=True)
    _threads._end_idle_workers()  # the home thread too
    assert not any(t.name == "aiotensor-home-nice+6" for t in threading.enumerate())


def test_exit_waits_for_what_in_worker_still_frees() -> None:
    """``in_worker`` hands work to a thread and returns (a swap's old weights, a dropped stream's
    window): a process that exited while that thread still freed tensors aborted in the C++
    runtime's teardown ("terminate called without an active exception", exit code 134)."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from aiotensor._runtime import threads\n"
        "old = [torch.ones(16) for _ in range(200000)]\n"  # freed well after the interpreter begins to exit
        "threads.in_worker(old.clear)\n"
        "del old\n"
    )
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and "terminate" not in got.stderr, (got.returncode, got.stderr[-500:])
    with _threads._unwaited_lock:
        assert not _threads._unwaited
