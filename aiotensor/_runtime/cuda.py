"""CUDA staging: pinned staging memory, a copy stream per device, CUDA events bridged to ``await``.

Run on one GPU (an H200, 2026-11-26: ``tests/test_gpu.py``, ``tests/test_cuda.py``, ``bench/bench_gpu.py``;
never on two). The event bridge's logic (thread → loop delivery, errors, cancellation, keeping
sources alive) is also tested on CPU with stand-in events.

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

import contextlib
import ctypes
import functools
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter
from typing import Any, Protocol, TypeVar

import anyio
import torch

from . import threads

log = logging.getLogger(__name__)

T = TypeVar("T")


class Event(Protocol):
    """What the bridge needs of an event (``torch.cuda.Event`` has both)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def available() -> bool:
    """True where torch sees a CUDA device that this process may use: not in a child forked after
    CUDA was initialized, where every CUDA call fails (a CPU-only save there must not make one).

    "Sees", not "can start": asked without initializing the CUDA driver, since every
    ``Scheduler()`` asks, often on the event loop's thread. ``torch.cuda.is_available()``
    initializes it on its first call in a process (0.19 s of CPU on an H200 machine, measured
    there 2026-11-26); ``torch.cuda.device_count()`` asks NVML first (0.015 s), as
    ``is_available`` itself does under ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, and then a later fork
    stays free to use CUDA. Where NVML cannot answer (no ``libnvidia-ml``, MIG UUIDs in
    ``CUDA_VISIBLE_DEVICES``) torch falls back to the driver's count, as before. A device NVML
    sees but the driver cannot start (a driver older than torch's CUDA) counts as seen: what
    needs CUDA then fails with torch's error, and nothing is asked of CUDA for CPU tensors. The
    answer is kept per value of the variables that choose the visible devices, until CUDA is
    initialized, which answers at once."""
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # False in a bad fork
        return True
    if torch.cuda._is_in_bad_fork():
        return False
    return _devices_seen(tuple(map(os.environ.get, _VISIBLE)))


async def initialized(device: torch.device) -> None:
    """Where torch has not initialized CUDA yet (a load to ``device`` is this process's first CUDA
    use): initialize it, and ``device``'s context, in a plain thread: not on the caller's (the
    event loop's: the driver 0.19 s, a context 0.13 s of its CPU on an H200 machine), not in a
    worker (their lower priority would pass to the threads the driver starts for the process).

    Cancellation: returns once the thread has (CUDA initialized), then raises."""
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        await anyio.to_thread.run_sync(torch.cuda.synchronize, device)


_VISIBLE = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


@functools.cache
def _devices_seen(visible: tuple[str | None, ...]) -> bool:
    """Does torch count a device (``visible``: the variables' values, this answer's key)."""
    try:
        return torch.cuda.device_count() > 0
    except Exception:  # ROCm's device listing can raise where is_available() never did
        return bool(torch._C._cuda_getDeviceCount() > 0)


class EventBridge:
    """Delivers the completion of events to the event loop (asyncio or trio) that awaits them.

    One waiter thread (started on first use) calls ``event.synchronize()`` on each event in turn
    (events of one copy stream complete in order, so waiting in order costs nothing), then sets
    the waiting task's ``anyio.Event`` from that thread. Use one bridge per copy stream.
    """

    def __init__(self, name: str = "aiotensor-cuda-events", device: int | None = None) -> None:
        self._name = name
        self._device = device  # made current in the waiter thread: a device that has a context
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    async def wait(self, event: Event, keep: Iterable[Any] = (), *, through_cancel: bool = False) -> None:
        """Return once ``event`` has completed; raise what its ``synchronize()`` raised.

        ``keep`` (e.g. the source tensors of a copy) stays referenced until the event completes.

        Cancellation: the await stops at once; the waiter thread still waits for the event and
        only then drops ``keep``. With ``through_cancel`` (the copy writes memory the caller frees
        on return: a staging arena), it returns only once the event completed, whatever cancels
        it (anyio's, trio's, or asyncio's own ``Task.cancel()``), and then raises the cancellation.
        """
        if event.query():
            return
        done = anyio.Event()
        errors: list[BaseException] = []
        self._start()
        self._queue.put((event, tuple(keep), threads.call_soon_threadsafe(), done, errors))
        if through_cancel:
            cancelled = await threads.wait_out(done)
            if cancelled is not None:
                raise cancelled
            await anyio.lowlevel.checkpoint_if_cancelled()
        else:
            await done.wait()
        if errors:
            raise errors[0]

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        if self._device is not None:  # else a runtime call in this new thread could make a context on GPU 0
            torch.cuda.set_device(self._device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, keep, call_soon, done, errors = item
            try:
                event.synchronize()
            except Exception as e:  # a CUDA error: the awaiting task gets it
                errors.append(e)
            del keep, item  # the sources may go now: the copy that read them is complete
            try:
                call_soon(done.set)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    def close(self) -> None:
        """Stop the waiter thread after the events already queued (blocks: call it in a thread)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()


# --- CUDA calls (need a GPU) ----------------------------------------------------------------


class Pinning:
    """Registers host memory with CUDA once (``cudaHostRegister``) and unregisters it on release.

    Pinning costs about 1-2 GB/s and takes a global driver lock, so a staging arena is pinned
    once, when it is mapped, and reused for every later save. Registration is
    ``cudaHostRegisterPortable`` (as torch's own pin helper does): the memory is pinned for every
    context, so which device registers it only has to have a context already. Registration runs in
    worker threads, whose current device is 0 whatever the user chose; it is done under ``device``,
    or by default under a device that already has a primary context when the first pin happens (a
    rank's ``torch.cuda.set_device(local_rank)`` made after the store was built counts): never one
    that would get a new context for it. ``register`` and ``unregister`` are injectable for tests;
    by default they call the CUDA runtime through torch.
    """

    def __init__(self, register: Any = None, unregister: Any = None, device: int | None = None) -> None:
        self._register = register or _cuda_host_register
        self._unregister = unregister or _cuda_host_unregister
        self._device = device
        self._pinned: dict[int, int] = {}  # address -> bytes
        # re-entrant: a collection inside a registration can unmap (so unpin) another mapping here
        self._lock = threading.RLock()
        _pinnings.add(self)

    @property
    def device(self) -> int | None:
        """The device registrations run under: fixed by the first pin made while some device had
        a context (None until then: pinning then would create one, and :meth:`pin` waits)."""
        if self._device is None:
            self._device = next(iter(live_devices()), None)
        return self._device

    def pin(self, address: int, nbytes: int) -> None:
        """Register ``[address, address + nbytes)`` unless it is already (blocks: worker threads only)."""
        with self._lock:
            device = self.device
            if address not in self._pinned and device is not None:  # else pinned before its first CUDA copy
                self._register(address, nbytes, device)
                self._pinned[address] = nbytes

    def unpin(self, address: int) -> None:
        """Unregister ``address`` if this pinned it. A failure (CUDA broken by an earlier error) is
        logged, not raised: unpinning is part of a clean-up that must go on."""
        with self._lock:
            nbytes = self._pinned.pop(address, None)
            if nbytes is not None:
                assert self._device is not None  # fixed by the pin
                try:
                    self._unregister(address, self._device)
                except RuntimeError as e:
                    log.warning("could not unpin %d bytes of staging memory: %s", nbytes, e)

    def _forget(self) -> None:
        """In a forked child: nothing is pinned here (the pinned pages were kept from it), and the
        lock may have been held by a thread that does not exist here."""
        self._pinned = {}
        self._lock = threading.RLock()

    def pinned(self, address: int) -> bool:
        with self._lock:
            return address in self._pinned

    @property
    def pinned_bytes(self) -> int:
        return sum(self._pinned.values())


_pinnings: weakref.WeakSet[Pinning] = weakref.WeakSet()


def _forget_pinnings() -> None:
    for p in list(_pinnings):
        p._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pinnings)

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every context, as torch's own pin helper does


def _cuda_host_register(address: int, nbytes: int, device: int) -> None:
    with torch.cuda.device(device):
        err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE))  # type: ignore[no-untyped-call]
    if err != 0:
        _clear_last_error()  # else torch's next cudaGetLastError check fails an unrelated kernel
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err}")


def _cuda_host_unregister(address: int, device: int) -> None:
    with torch.cuda.device(device):
        err = int(torch.cuda.cudart().cudaHostUnregister(address))  # type: ignore[no-untyped-call]
    if err != 0:
        _clear_last_error()
        raise RuntimeError(f"cudaHostUnregister failed with CUDA error {err}")


def _clear_last_error() -> None:
    """``cudaGetLastError()`` from the libcudart this process loaded (torch exposes no binding)."""
    try:
        with open("/proc/self/maps") as f:
            path = next((line.split()[-1] for line in f if "libcudart" in line), None)
        if path is not None:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass


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
            self._bridges[i] = EventBridge(f"aiotensor-cuda{i}-events", device=i)
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


def live_devices() -> list[int]:
    """The CUDA devices that already have a primary context in this process. Touching any other
    (an event, a stream, ``set_device``) would create one: 0.3-0.5 GiB of its memory per process.
    None before torch initialized CUDA: no tensor lives on a GPU then, and asking the driver would
    initialize it (0.19 s, on the event loop's thread for every save of CPU tensors)."""
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # False in a child forked after it was
        return []
    has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has is None:  # a torch without the check: the current device only (the caller's, who made it)
        return [torch.cuda.current_device()]
    return [i for i in range(torch.cuda.device_count()) if has(i)]


def record_producers(tensors: Iterable[torch.Tensor]) -> dict[torch.device, Any]:
    """On the caller's thread: an event on each source device's current stream. The tensors are
    sifted by C loops: a Python loop asking each its device held the event loop's thread 7 ms per
    20,000 CPU tensors (15 ms on a busy GPU machine), 1.5 ms so."""
    return record_current_streams(set(map(_DEVICE, filter(_IS_CUDA, tensors))))


_DEVICE, _IS_CUDA = attrgetter("device"), attrgetter("is_cuda")


def record_current_streams(devices: Iterable[torch.device] | None = None) -> dict[torch.device, Any]:
    """On the caller's thread: a blocking-sync event on the current stream of each of ``devices``
    (default: every device with a context, :func:`live_devices`, which includes every device a
    tensor lives on; never one without, where the event would create a context). Blocking, so a
    thread that waits for one sleeps, not spins."""
    if devices is None:
        devices = [torch.device("cuda", i) for i in live_devices()]
    events = {}
    for dev in devices:
        ev = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        ev.record(torch.cuda.current_stream(dev))
        events[dev] = ev
    return events


def synchronize(events: dict[torch.device, Any]) -> None:
    """In a worker: wait for each event, under its device (a runtime call in a thread whose current
    device has no context would make one there)."""
    for dev, e in events.items():
        with torch.cuda.device(dev):
            e.synchronize()


def caller_streams() -> list[Any]:
    """On the caller's thread: the current stream of every device with a context (what a worker
    then allocates and copies under, with :func:`on_streams`, as if the caller had done it)."""
    live = live_devices()
    if not live:
        return []
    current = torch.cuda.current_device()  # entered last: a worker's plain "cuda" is the caller's device
    return [torch.cuda.current_stream(i) for i in sorted(live, key=lambda i: i == current)]


def under(streams: list[Any], fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with ``streams`` current (:func:`on_streams`): in a worker, for the caller."""
    with on_streams(streams):
        return fn(*args)


@contextlib.contextmanager
def on_streams(streams: Iterable[Any]) -> Iterator[None]:
    """Inside (a worker thread): each of ``streams`` (CUDA streams; None entries are skipped) is the
    current stream of its device, so the caching allocator ties what is allocated to it and copies
    are ordered on it. Each stream context is entered under ``torch.cuda.device(k)``: a bare one
    restores the thread's previous stream on exit through ``set_stream``, which sets the thread's
    previous device (0 in a worker) and so creates a context on GPU 0 in a rank that uses GPU k."""
    with contextlib.ExitStack() as stack:
        for s in streams:
            if s is not None:
                stack.enter_context(torch.cuda.device(s.device))
                stack.enter_context(torch.cuda.stream(s))
        yield


def d2h(streams: CopyStreams, producer: Any, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Any, list[torch.Tensor]]:
    """In a worker thread: queue ``dst.copy_(src)`` (device → pinned host) on the copy stream of the
    sources' device after ``producer``; return the completion event (not waited for) and the
    temporaries to keep alive until it completes.

    A source with a lazy conj or neg bit is resolved on the copy stream first: ``copy_`` would
    otherwise apply it to the host destination without ordering that after the asynchronous copy.
    """
    device = copies[0][1].device
    stream = streams.stream(device)
    done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
    keep: list[torch.Tensor] = []
    with on_streams([stream]):
        stream.wait_event(producer)
        try:
            for dst, src in copies:
                if src.is_conj() or src.is_neg():
                    src = src.resolve_conj().resolve_neg()
                    keep.append(src)
                dst.copy_(src, non_blocking=True)
        except BaseException:  # an allocation failed: the copies already queued still write the arena
            done.record(stream)
            done.synchronize()
            raise
        done.record(stream)
    return done, keep


def copy(streams: CopyStreams, dst: torch.Tensor, src: torch.Tensor) -> None:
    """In a worker thread: ``dst.copy_(src)`` between pinned host memory and a CUDA device, on that
    device's copy stream, and wait for it (the host side, a bounce slot, is reused on return)."""
    stream = streams.stream(dst.device if dst.device.type == "cuda" else src.device)
    done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
    with on_streams([stream]):
        dst.copy_(src, non_blocking=True)
        done.record(stream)
    done.synchronize()
