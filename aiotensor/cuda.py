"""CUDA staging: pinned staging memory, a copy stream per device, CUDA events bridged to ``await``.

NOT YET RUN ON A GPU: no device was lent while this was written. The event bridge's logic (thread →
loop delivery, errors, cancellation, keeping sources alive) is tested on CPU with stand-in events;
the CUDA calls themselves (``cudaHostRegister``, streams, ``copy_(non_blocking=True)``) are not.

How a save of CUDA tensors stages (see :func:`aiotensor._io.stage`):

1. ``save()`` records an event on each source device's current stream, on the caller's thread:
   the copies must see the values as of that call, after the kernels already queued.
2. A worker thread makes the device's copy stream wait on that event, queues one
   ``copy_(non_blocking=True)`` per tensor into the (pinned) staging arena, and records a
   blocking-sync completion event.
3. :class:`EventBridge` waits for that event in its own thread and wakes the awaiting task with
   ``loop.call_soon_threadsafe``; an event that is already complete is seen by ``query()`` without
   a thread hop. The source tensors stay referenced until the event has completed, even if the
   save is cancelled, so the caching allocator cannot hand their memory out while a copy reads it.

Loads into CUDA tensors first wait (in a worker thread) for the work already queued on the
destinations' current streams, then either read into bounce slots and copy host → device on the
copy stream, waiting for the copy before the slot is reused (:func:`copy`), or, with the kvikio
engine, read straight into device memory through cuFile.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterable
from typing import Any, Protocol

import torch


class Event(Protocol):
    """What the bridge needs of an event (``torch.cuda.Event`` has both)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def available() -> bool:
    """True where torch sees a CUDA device (so libcuda loaded)."""
    return torch.cuda.is_available()


class EventBridge:
    """Delivers the completion of events to the asyncio loop that awaits them.

    One waiter thread (started on first use) calls ``event.synchronize()`` on each event in turn
    (events of one copy stream complete in order, so waiting in order costs nothing), then wakes
    the waiting task. Use one bridge per copy stream.
    """

    def __init__(self, name: str = "aiotensor-cuda-events") -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    async def wait(self, event: Event, keep: Iterable[Any] = ()) -> None:
        """Return once ``event`` has completed; raise what its ``synchronize()`` raised.

        ``keep`` (e.g. the source tensors of a copy) stays referenced until the event completes.

        Cancellation: the await stops at once; the waiter thread still waits for the event and
        only then drops ``keep``.
        """
        if event.query():
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._start()
        self._queue.put((event, tuple(keep), loop, fut))
        await fut

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, keep, loop, fut = item
            error: BaseException | None = None
            try:
                event.synchronize()
            except Exception as e:  # a CUDA error: the awaiting task gets it
                error = e
            del keep, item  # the sources may go now: the copy that read them is complete
            try:
                loop.call_soon_threadsafe(_deliver, fut, error)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    def close(self) -> None:
        """Stop the waiter thread after the events already queued (blocks: call it in a thread)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()


def _deliver(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():  # cancelled meanwhile
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


# --- CUDA calls (need a GPU) ----------------------------------------------------------------


class Pinning:
    """Registers host memory with CUDA once (``cudaHostRegister``) and unregisters it on release.

    Pinning costs about 1-2 GB/s and takes a global driver lock, so a staging arena is pinned
    once, when it is mapped, and reused for every later save. ``register``/``unregister`` are
    injectable for tests; by default they call the CUDA runtime through torch.
    """

    def __init__(self, register: Any = None, unregister: Any = None) -> None:
        self._register = register or _cuda_host_register
        self._unregister = unregister or _cuda_host_unregister
        self._pinned: dict[int, int] = {}  # address -> bytes
        self._lock = threading.Lock()

    def pin(self, address: int, nbytes: int) -> None:
        """Register ``[address, address + nbytes)`` unless it is already (blocks: worker threads only)."""
        with self._lock:
            if address not in self._pinned:
                self._register(address, nbytes)
                self._pinned[address] = nbytes

    def unpin(self, address: int) -> None:
        with self._lock:
            if self._pinned.pop(address, None) is not None:
                self._unregister(address)

    @property
    def pinned_bytes(self) -> int:
        return sum(self._pinned.values())


def _cuda_host_register(address: int, nbytes: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)  # type: ignore[no-untyped-call]
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")


def _cuda_host_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]


class CopyStreams:
    """One copy stream per CUDA device, and one event bridge per stream."""

    def __init__(self, pinning: Pinning | None = None) -> None:
        self._streams: dict[int, Any] = {}
        self._bridges: dict[int, EventBridge] = {}
        self.pinning = pinning or Pinning()  # staging arenas and bounce slots

    def _index(self, device: torch.device) -> int:
        i = device.index if device.index is not None else torch.cuda.current_device()
        if i not in self._streams:
            self._streams[i] = torch.cuda.Stream(device=i)  # type: ignore[no-untyped-call]
            self._bridges[i] = EventBridge(f"aiotensor-cuda{i}-events")
        return i

    def stream(self, device: torch.device) -> Any:
        return self._streams[self._index(device)]

    def bridge(self, device: torch.device) -> EventBridge:
        return self._bridges[self._index(device)]

    def close(self) -> None:
        for b in self._bridges.values():
            b.close()
        self._bridges.clear()
        self._streams.clear()


def record_producers(tensors: Iterable[torch.Tensor]) -> dict[torch.device, Any]:
    """On the caller's thread: an event on each source device's current stream."""
    events = {}
    for t in tensors:
        if t.device.type == "cuda" and t.device not in events:
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(torch.cuda.current_stream(t.device))
            events[t.device] = ev
    return events


def d2h(streams: CopyStreams, producer: Any, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """In a worker thread: queue ``dst.copy_(src)`` (device → pinned host) on the copy stream of the
    sources' device after ``producer``; return the completion event (not waited for)."""
    device = copies[0][1].device
    stream = streams.stream(device)
    done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        stream.wait_event(producer)
        for dst, src in copies:
            dst.copy_(src, non_blocking=True)
        done.record(stream)
    return done


def copy(streams: CopyStreams, dst: torch.Tensor, src: torch.Tensor) -> None:
    """In a worker thread: ``dst.copy_(src)`` between pinned host memory and a CUDA device, on that
    device's copy stream, and wait for it (the host side, a bounce slot, is reused on return)."""
    stream = streams.stream(dst.device if dst.device.type == "cuda" else src.device)
    done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        done.record(stream)
    done.synchronize()
