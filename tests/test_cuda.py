"""The CUDA path: the event bridge and pinning on CPU (stand-in events, real threads, real loop);
round trips and staging semantics on a GPU (marked ``gpu``, skipped without CUDA)."""

from __future__ import annotations

import faulthandler
import functools
import gc
import os
import signal
import threading
import weakref
from typing import Any

import anyio
import pytest
import torch

import aiotensor
from aiotensor import PosixEngine, Scheduler, TensorStore, load_file, save_file
from aiotensor._runtime.buffers import HostBuffer, StagingPool
from aiotensor._runtime.cuda import EventBridge, Pinning

from .conftest import assert_state_equal, cancel_task_once
from .test_store import DTYPES, random_tensor

pytestmark = pytest.mark.anyio


class StandInEvent:
    """An event whose completion the test controls; ``synchronize`` blocks a real thread."""

    def __init__(self, error: Exception | None = None) -> None:
        self._done = threading.Event()
        self.error = error
        self.synchronize_calls = 0

    def complete(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self.synchronize_calls += 1
        self._done.wait()
        if self.error is not None:
            raise self.error


class Source:
    """Something to keep alive (a stand-in for a source tensor); weakly referenceable."""


async def test_completed_event_returns_without_a_thread() -> None:
    bridge = EventBridge()
    ev = StandInEvent()
    ev.complete()
    await bridge.wait(ev)
    assert ev.synchronize_calls == 0 and bridge._thread is None


async def test_pending_event_wakes_the_loop_which_keeps_running() -> None:
    bridge = EventBridge()
    ev = StandInEvent()
    ticks = 0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        threading.Timer(0.05, ev.complete).start()
        await bridge.wait(ev)
        done.set()
    assert ev.synchronize_calls == 1
    assert ticks >= 5  # the loop ran while the event was pending: nothing blocked it
    await anyio.to_thread.run_sync(bridge.close)


async def test_events_complete_in_order_and_errors_reach_the_awaiting_task() -> None:
    bridge = EventBridge()
    evs = [StandInEvent(), StandInEvent(RuntimeError("CUDA error: an illegal memory access")), StandInEvent()]
    results: list[Any] = [None] * 3

    async def waiter(i: int) -> None:
        try:
            await bridge.wait(evs[i])
            results[i] = "ok"
        except RuntimeError as e:
            results[i] = str(e)

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(waiter, i)
        await anyio.sleep(0.01)
        for ev in evs:
            ev.complete()
    assert results == ["ok", "CUDA error: an illegal memory access", "ok"]
    await anyio.to_thread.run_sync(bridge.close)


async def test_cancelled_wait_keeps_the_sources_alive_until_the_event_completes() -> None:
    bridge = EventBridge()
    ev = StandInEvent()
    src = Source()
    ref = weakref.ref(src)
    with anyio.move_on_after(0.02) as scope:
        await bridge.wait(ev, keep=[src])
    assert scope.cancelled_caught
    del src
    gc.collect()
    assert ref() is not None  # the copy may still read it: still referenced by the waiter
    ev.complete()
    await anyio.to_thread.run_sync(bridge.close)  # the waiter has handled the event
    gc.collect()
    assert ref() is None  # and let go once the event completed


async def test_close_stops_the_waiter_thread() -> None:
    bridge = EventBridge(name="bridge-under-test")
    ev = StandInEvent()
    threading.Timer(0.01, ev.complete).start()
    await bridge.wait(ev)
    await anyio.to_thread.run_sync(bridge.close)
    assert not any(t.name == "bridge-under-test" for t in threading.enumerate())


async def test_staging_arenas_are_pinned_once_and_unpinned_when_unmapped() -> None:
    calls: list[tuple[str, int]] = []
    pinning = Pinning(
        register=lambda a, n, d: calls.append(("pin", n)), unregister=lambda a, d: calls.append(("unpin", 0)), device=0
    )
    pool = StagingPool(1, pinning=pinning)
    for _ in range(5):  # reused: pinned once
        arena = await pool.acquire(10_000)
        pool.release(arena)
    assert calls == [("pin", 12288)] and pinning.pinned_bytes == 12288
    arena = await pool.acquire(100_000)  # grows: the small one is unpinned and unmapped
    pool.release(arena)
    assert calls == [("pin", 12288), ("unpin", 0), ("pin", 102400)]
    pool.close()
    assert calls[-1] == ("unpin", 0) and pinning.pinned_bytes == 0


def test_the_bridge_works_under_trio() -> None:
    async def main() -> None:
        bridge = EventBridge()
        ev, failed = StandInEvent(), StandInEvent(RuntimeError("CUDA error"))
        threading.Timer(0.02, ev.complete).start()
        await bridge.wait(ev)
        threading.Timer(0.02, failed.complete).start()
        with pytest.raises(RuntimeError, match="CUDA error"):
            await bridge.wait(failed)
        await anyio.to_thread.run_sync(bridge.close)

    anyio.run(main, backend="trio")


async def test_a_wait_through_cancel_returns_only_once_the_event_completed() -> None:
    bridge = EventBridge()
    ev = StandInEvent()
    threading.Timer(0.1, ev.complete).start()
    with anyio.move_on_after(0.01) as scope:
        await bridge.wait(ev, through_cancel=True)
    assert scope.cancelled_caught  # the cancellation is raised...
    assert ev.query(), "...but only once the copy that writes the arena completed"
    await anyio.to_thread.run_sync(bridge.close)


class _CopyStreams:
    """What stage() needs of CopyStreams, with a real bridge."""

    def __init__(self) -> None:
        self.b = EventBridge()
        self.pinning = Pinning(register=lambda a, n, d: None, unregister=lambda a, d: None, device=0)

    def bridge(self, device: Any) -> EventBridge:
        return self.b


@pytest.mark.parametrize("canceller", ["scope", "task.cancel"])
async def test_a_save_cancelled_while_its_device_copies_are_queued_waits_for_them(
    monkeypatch: pytest.MonkeyPatch, canceller: str, anyio_backend: Any
) -> None:
    """Issue 24.3: cancelled while the worker queues the device → host copies, the completion
    event it made was dropped and the arena released while the copies still wrote into it."""

    from aiotensor._io import stage as stage_module

    ev = StandInEvent()
    queued = threading.Event()

    def d2h(streams: Any, producer: Any, copies: Any) -> tuple[Any, list[Any]]:
        queued.set()
        threading.Event().wait(0.1)  # queueing in the worker while the caller is cancelled
        threading.Timer(0.2, ev.complete).start()  # the copies complete later, on the GPU
        return ev, []

    fake_dev = torch.device("cpu")
    monkeypatch.setattr(stage_module.cuda, "d2h", d2h)
    monkeypatch.setattr(
        stage_module,
        "_stage_units",
        lambda sched, plan, sources, arena: ([], [], {fake_dev: [(torch.empty(1), torch.empty(1))]}, 0),
    )
    sched = Scheduler(PosixEngine())
    sched.cuda = _CopyStreams()  # type: ignore[assignment]
    returned_before_completion: list[bool] = []

    async def run() -> None:
        try:
            await stage_module.stage(sched, None, {}, HostBuffer(4096), 0, {fake_dev: None})  # type: ignore[arg-type]
        finally:
            returned_before_completion.append(not ev.query())

    if canceller == "scope":
        with anyio.move_on_after(0.03):
            await run()
    else:
        await cancel_task_once(run, queued)
    assert returned_before_completion == [False]
    await anyio.to_thread.run_sync(sched.cuda.b.close)  # type: ignore[union-attr]


def test_record_current_streams_touches_no_device_without_a_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24.1: an event on each of 8 GPUs made a context (0.3-0.5 GiB) on every one, per rank."""
    from aiotensor._runtime import cuda

    recorded: list[Any] = []

    class Event:
        def __init__(self, **kw: Any) -> None:
            pass

        def record(self, stream: Any) -> None:
            recorded.append(stream)

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: i in (3, 5), raising=False)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: ("stream of", torch.device(dev)))
    events = cuda.record_current_streams()
    assert sorted(str(d) for d in events) == ["cuda:3", "cuda:5"]
    assert recorded == [("stream of", torch.device("cuda", 3)), ("stream of", torch.device("cuda", 5))]


def test_pinning_picks_its_device_at_the_first_pin_not_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24.4: a store built before ``torch.cuda.set_device(local_rank)`` pinned under GPU 0,
    making a context there in every rank."""
    from aiotensor._runtime import cuda

    registered: list[int] = []
    pinning = Pinning(register=lambda a, n, d: registered.append(d), unregister=lambda a, d: None)
    monkeypatch.setattr(cuda, "live_devices", lambda: [])  # no context anywhere yet: pinning would make one on GPU 0
    pinning.pin(4096, 4096)
    assert registered == [] and pinning.device is None and pinning.pinned_bytes == 0
    monkeypatch.setattr(cuda, "live_devices", lambda: [2])  # the rank's set_device(2), then its first CUDA save
    pinning.pin(4096, 4096)
    assert registered == [2] and pinning.device == 2


def test_a_closed_slot_pool_pins_its_new_slots() -> None:
    from aiotensor._runtime.buffers import SlotPool

    calls: list[str] = []
    pinning = Pinning(register=lambda a, n, d: calls.append("pin"), unregister=lambda a, d: calls.append("unpin"), device=0)
    pool = SlotPool(2, 4096)
    pool.give(pool.take())
    pool.pin(pinning)
    pool.close()  # a scheduler reused after close maps new slots: they must be pinned too
    pool.give(pool.take())
    pool.pin(pinning)
    assert calls == ["pin", "unpin", "pin"]
    pool.close()


# --- on a GPU -----------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _engines() -> list[Any]:
    """Both CUDA paths: posix (pinned bounce slots, copy stream) and, where it imports, kvikio."""
    out = [pytest.param("posix", id="posix")]
    if aiotensor.engines.kvikio_usable():
        out.append(pytest.param("kvikio", id="kvikio"))
    return out


def _engine(name: str) -> Any:
    return PosixEngine() if name == "posix" else aiotensor.KvikioEngine(cufile="always")  # through cuFile in any mode


@gpu
@needs_cuda
@pytest.mark.parametrize("engine_name", _engines())
async def test_cuda_round_trip_of_every_dtype(tmp_path: Any, engine_name: str) -> None:
    state = {str(d): random_tensor(d, (33, 7), i).cuda() for i, d in enumerate(DTYPES)}
    state["t"] = state["torch.float32"].t()  # non-contiguous
    state["scalar"] = torch.tensor(2.5, device="cuda")
    state["empty"] = torch.empty(0, 3, device="cuda")
    z = torch.randn(1 << 20, dtype=torch.complex64, device="cuda")
    state["z"], state["zc"], state["zn"] = z, z.conj(), z._neg_view()  # resolved on the copy stream
    state["big_odd"] = torch.randn(3 << 20, device="cuda")[1:]  # multi-MB, not page aligned
    async with TensorStore(tmp_path, engine=_engine(engine_name)) as store:
        await store.save(1, state)
        assert store.staging.pinning is not None and store.staging.pinning.pinned_bytes > 0
        assert store.staging._free[0].tensor.is_pinned()  # really pinned (cudaHostRegister took)
        back = await store.load(1, device="cuda")
        assert all(t.is_cuda for t in back.values())
        assert_state_equal({k: v.cpu() for k, v in state.items()}, {k: v.cpu() for k, v in back.items()})
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        await store.load(1, into=into)
        assert_state_equal({k: v.cpu() for k, v in state.items()}, {k: v.cpu() for k, v in into.items()})
        if engine_name == "kvikio":
            assert sum(store.engine.file_modes.values()) > 0, store.engine.file_modes  # cuFile really ran


@gpu
@needs_cuda
async def test_pinning_happens_on_the_rank_device(tmp_path: Any) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    torch.cuda.set_device(1)
    try:
        async with TensorStore(tmp_path) as store:
            await store.save(1, {"w": torch.randn(1 << 20, device="cuda:1")})
            assert store.staging.pinning.device == 1
    finally:
        torch.cuda.set_device(0)


@gpu
@needs_cuda
async def test_cuda_staged_means_the_trainer_may_change_every_parameter(tmp_path: Any) -> None:
    params = {f"p{i}": torch.randn(1 << 20, device="cuda") for i in range(8)}
    before = {k: v.cpu() for k, v in params.items()}
    async with TensorStore(tmp_path) as store:
        h = store.save(1, params)
        await h.staged
        for p in params.values():
            p.add_(1.0)  # the optimizer step
        await h
        assert_state_equal(before, await store.load(1))


@gpu
@needs_cuda
async def test_fifty_cuda_saves_leak_no_threads(tmp_path: Any) -> None:
    state = {"w": torch.randn(1 << 16, device="cuda")}
    async with TensorStore(tmp_path, keep_last=2) as store:
        await store.save(0, state)

        def ours() -> int:  # anyio's worker pool legitimately varies: count the library's own threads
            return sum(t.name.startswith("aiotensor") for t in threading.enumerate())

        threads = ours()
        for step in range(1, 51):
            await store.save(step, state)
        assert ours() <= threads
    assert not any(t.name.startswith("aiotensor-cuda") for t in threading.enumerate())


@gpu
@needs_cuda
async def test_cuda_io_is_ordered_after_the_kernels_already_queued(tmp_path: Any) -> None:
    """save sees, and load overwrites, the values as of after the work queued before the call."""
    x = torch.zeros(1 << 20, device="cuda")
    async with TensorStore(tmp_path, engine=PosixEngine()) as store:
        torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]  # keep the stream busy
        x.fill_(7.0)
        await store.save(1, {"x": x})
        torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]
        x.add_(1.0)  # queued before the load: the load must land after it
        await store.load(1, into={"x": x})
        assert bool((x == 7.0).all())
    path = str(tmp_path / "x.safetensors")
    torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]
    x.fill_(3.0)
    t = torch.arange(12.0, device="cuda").view(3, 4).t()  # made contiguous on the device first
    await save_file({"x": x, "t": t}, path, scheduler=Scheduler(PosixEngine()))  # bounced through pinned slots
    got = await load_file(path, device="cuda", scheduler=Scheduler(PosixEngine()))
    assert got["x"].is_cuda and bool((got["x"] == 3.0).all()) and torch.equal(got["t"], t)


def test_pinned_mappings_are_not_inherited_by_forked_children() -> None:
    """MADV_DONTFORK (CPU check of the mapping itself): a DataLoader worker forked after the arena
    was pinned must not share its pages copy-on-write; touching it in the child faults."""
    from aiotensor._runtime.buffers import HostBuffer

    buf = HostBuffer(1 << 16)
    buf.keep_from_children()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        faulthandler.disable()  # the expected SIGSEGV needs no traceback dump
        try:
            buf.array[0] = 1
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV, status
    buf.array[0] = 1  # the parent keeps it
    buf.close()


async def test_loading_to_an_absent_device_is_a_clear_error(tmp_path: Any) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    async with TensorStore(tmp_path) as store:
        await store.save(1, {"w": torch.ones(2)})
        with pytest.raises(ValueError, match="cannot load to cuda"):
            await store.load(1, device="cuda")


def test_a_pinned_mapping_dropped_unclosed_is_unregistered_before_it_is_unmapped() -> None:
    """Found on the first GPU run: a scheduler dropped without being closed let its pinned slots
    be unmapped while still registered, and the next mapping at that address (ours, or kvikio's
    bounce buffers) failed cudaHostRegister with error 712. Registration now ends with the mapping,
    whoever holds it last; a stand-in refuses an overlap the way CUDA does."""
    import gc

    from aiotensor._runtime.buffers import HostBuffer

    registered: dict[int, int] = {}

    def register(at: int, n: int, device: int) -> None:
        if any(a < at + n and at < a + m for a, m in registered.items()):
            raise RuntimeError("cudaHostRegister failed with CUDA error 712")
        registered[at] = n

    pinning = Pinning(register=register, unregister=lambda at, d: registered.pop(at), device=0)
    for _ in range(20):  # each maps where the last was, typically
        buf = HostBuffer(1 << 20, populate=False)
        assert buf.pin(pinning) and buf.pin(Pinning(register=register, device=0))  # pinned once, whoever asks
        view = buf.view[4096:8192]  # a slot's view outlives the buffer: unmapped with it
        del buf
        gc.collect()
        assert registered
        del view
        gc.collect()
        assert registered == {} and pinning.pinned_bytes == 0


def test_a_child_forked_after_cuda_was_initialized_makes_no_cuda_call(monkeypatch: Any, cuda_seen: None) -> None:
    """On the first GPU run, CPU-only saves in a child forked by a process that had initialized
    CUDA failed: the store recorded CUDA events (every CUDA call fails in such a child)."""
    from aiotensor._runtime import cuda
    from aiotensor.engines import kvikio_usable

    assert cuda.available()  # as with a GPU
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    assert not cuda.available() and not kvikio_usable() and Scheduler(PosixEngine()).cuda is None


def test_a_forked_child_neither_unpins_nor_unmaps_the_pinned_memory_it_inherited_the_object_of() -> None:
    """Review of the first GPU run's fix: a child forked while a pinned buffer was garbage (in a
    cycle) collected it, and its finalizer made a CUDA call there and unmapped the address, where the
    child's own new buffer often lay: SIGSEGV at its first touch."""
    import gc

    from aiotensor._runtime.buffers import HostBuffer

    parent = os.getpid()

    def unregister(at: int, device: int) -> None:
        assert os.getpid() == parent, "a CUDA call in a forked child"

    pinning = Pinning(register=lambda a, n, d: None, unregister=unregister, device=0)
    gc.disable()
    try:
        buf = HostBuffer(64 << 20, populate=False)
        assert buf.pin(pinning)
        buf.me = buf  # type: ignore[attr-defined]  # a cycle: garbage not yet collected at the fork
        del buf
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                mine = HostBuffer(64 << 20, populate=False)  # often where the parent's lay
                assert pinning.pinned_bytes == 0  # nothing is pinned in the child
                gc.collect()  # the parent's garbage: its finalizer runs here
                mine.array[0] = 1
                mine.close()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        gc.enable()
    gc.collect()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert pinning.pinned_bytes == 0  # the parent's was unpinned by the parent's collection


async def test_a_failed_unpin_is_logged_and_the_clean_up_goes_on(caplog: Any) -> None:
    def broken(at: int, device: int) -> None:
        raise RuntimeError("cudaHostUnregister failed with CUDA error 999")

    pinning = Pinning(register=lambda a, n, d: None, unregister=broken, device=0)
    pool = StagingPool(2, pinning=pinning)
    arenas = [await pool.acquire(10_000), await pool.acquire(10_000)]
    for a in arenas:
        pool.release(a)
    pool.close()
    assert pool.mapped_bytes == 0 and pinning.pinned_bytes == 0
    assert caplog.text.count("could not unpin") == 2


def test_asking_whether_cuda_is_there_never_initializes_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Scheduler() asks, often on the event loop's thread; torch.cuda.is_available()
    initializes the driver on its first call in a process (0.19 s of CPU on an H200 machine, a
    loop held that long by the first store a server made). The answer comes from NVML's count
    (torch.cuda.device_count), kept per CUDA_VISIBLE_DEVICES."""
    from aiotensor._runtime import cuda

    def no(*a: Any) -> Any:
        raise AssertionError("the CUDA driver was initialized")

    counted: list[str | None] = []

    def device_count() -> int:
        counted.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
        return 0 if counted[-1] == "" else 2

    # as in a process that has not used CUDA yet (earlier tests on a GPU machine have)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", no)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", no, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", device_count)
    monkeypatch.setattr(cuda, "_devices_seen", functools.cache(cuda._devices_seen.__wrapped__))  # type: ignore[attr-defined]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert cuda.available() and cuda.available() and Scheduler(PosixEngine()).cuda is not None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not cuda.available() and Scheduler(PosixEngine()).cuda is None
    assert counted == ["0,1", ""]  # asked once per value
    # a save of CPU tensors asks for the devices with a context: none before torch initialized CUDA
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", no, raising=False)
    assert cuda.live_devices() == [] and cuda.record_current_streams() == {} and cuda.caller_streams() == []


def test_a_load_to_cuda_as_the_first_cuda_use_initializes_it_in_a_plain_thread(
    monkeypatch: pytest.MonkeyPatch, cuda_seen: None, tmp_path: Any
) -> None:
    """Before torch initialized CUDA, a load to "cuda" asks nothing of CUDA on the caller's thread
    (the event loop's): its device is 0, which no thread can have changed through torch without
    initializing CUDA; CUDA and that device's context are then made in a plain thread (not a
    niced worker, whose priority the driver's own threads would inherit), and a stream takes the
    caller's current stream at its first read."""
    from aiotensor._io.tensors import check_device, load_device

    def no(*a: Any) -> Any:
        raise AssertionError("CUDA initialized on the caller's thread")

    made_in: list[tuple[threading.Thread, Any]] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", no)
    monkeypatch.setattr(torch.cuda, "current_stream", no)
    here = threading.current_thread()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: made_in.append((threading.current_thread(), dev)))
    sched = Scheduler(PosixEngine())
    assert check_device(sched, "cuda") == torch.device("cuda", 0) and check_device(sched, "cuda:1").index == 1
    assert aiotensor.stream(tmp_path / "x.safetensors", device="cuda", scheduler=sched)._s._stream is None
    assert anyio.run(load_device, sched, "cuda:1") == torch.device("cuda", 1)
    assert [d for _, d in made_in] == [torch.device("cuda", 1)]
    assert made_in[0][0] is not here and not made_in[0][0].name.startswith("aiotensor")  # anyio's, not a worker
    # once CUDA is in use: the caller's device and stream, nothing initialized again
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: ("stream of", dev))
    assert check_device(sched, "cuda") == torch.device("cuda", 3) and anyio.run(load_device, sched, "cuda:2").index == 2
    assert aiotensor.stream(tmp_path / "x.safetensors", device="cuda", scheduler=sched)._s._stream == (
        "stream of",
        torch.device("cuda", 3),
    )
    assert len(made_in) == 1
