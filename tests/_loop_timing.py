"""Every callback of the event loop timed in the loop thread's own CPU time and in wall time (one
step of a task, a timer): for tests that hold library code to a limit on the loop's thread, in
this process (tests/test_loop_blocking.py) or a child's (tests/test_gpu.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

RUN = asyncio.events.Handle._run


def timed_callbacks(cpu: float, wall: float, slow: list[str]) -> Callable[[asyncio.Handle], Any]:
    """A replacement for ``asyncio.events.Handle._run`` that adds to ``slow`` each callback run on
    the calling thread that used more than ``cpu`` seconds of its CPU or ``wall`` seconds."""
    loop_thread = threading.get_ident()

    def timed(handle: asyncio.Handle) -> Any:
        if threading.get_ident() != loop_thread:  # another loop (a worker's own): not ours to time
            return RUN(handle)
        t, w = time.thread_time(), time.perf_counter()
        try:
            return RUN(handle)
        finally:
            used, took = time.thread_time() - t, time.perf_counter() - w
            if used > cpu or took > wall:
                task = getattr(handle._callback, "__self__", None)  # type: ignore[attr-defined]
                what = repr(task) if isinstance(task, asyncio.Task) else repr(handle)  # the task names its line
                slow.append(f"{what} used {used:.3f} s of the loop thread's CPU in {took:.3f} s")

    return timed
