"""The GPU paths on a real GPU (issue 24): every test is marked ``gpu`` and skipped without CUDA.

Written to fail on the code before issue 24's fixes. First run on an H200 on 2026-11-26 (torch 2.11,
kvikio-cu13 26.10 in compatibility mode): 10 failed there, all from pinned memory unmapped while still
registered, since fixed; all pass now (the two-GPU tests skip). ``bench/device_gpu.sh`` is that run;
by hand: ``python -m pytest -m gpu tests/test_gpu.py tests/test_cuda.py
tests/test_kvikio.py`` on a CUDA machine, with ``kvikio-cu13`` (or ``-cu12``) installed for the
cuFile paths.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from typing import Any

import anyio
import pytest
import torch
from safetensors.torch import load_file as st_load_file

import aiotensor
from aiotensor import PosixEngine, Scheduler, TensorStore, load_file, save_file, stream
from aiotensor.errors import SaveCancelledError

from .conftest import assert_state_equal

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG = 2_000_000_000  # torch.cuda._sleep cycles: about a second on an H100, longer than any pinning


class Counting(aiotensor.KvikioEngine):
    """The kvikio engine, counting the bytes that really went through cuFile (through it whatever
    kvikio's mode: in its own compat mode "auto" would take the store's bounce slots)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(cufile="always", **kw)
        self.device_bytes = {"pread": 0, "pwrite": 0}

    def pread_device(self, fd: int, dst: torch.Tensor, offset: int) -> int:
        n = super().pread_device(fd, dst, offset)
        self.device_bytes["pread"] += n
        return n

    def pwrite_device(self, fd: int, src: torch.Tensor, offset: int) -> int:
        n = super().pwrite_device(fd, src, offset)
        self.device_bytes["pwrite"] += n
        return n


def _kvikio() -> Counting:
    if not aiotensor.engines.kvikio_usable():
        pytest.skip("needs kvikio")
    return Counting()


def _odd_state(seed: int, device: str = "cuda") -> dict[str, torch.Tensor]:
    """Multi-MB tensors of odd byte lengths (above kvikio's 16 KiB GDS threshold) in mixed dtypes."""
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.float16, torch.uint8]
    sizes = [3_000_017, 1_234_567, 4_194_305, 777_777, 2_000_003, 9]
    return {f"t{i}": torch.randint(-100, 100, (n,), generator=g).to(dtypes[i]).to(device) for i, n in enumerate(sizes)}


@pytest.mark.parametrize("chunk_bytes,batch_bytes", [(None, None), (24 << 20, 40 << 20), (4096 * 3, 1 << 20)])
async def test_cufile_writes_and_reads_of_odd_tensors_are_exact(tmp_path: Any, chunk_bytes: Any, batch_bytes: Any) -> None:
    eng = kv = _kvikio()
    kw = {k: v for k, v in (("chunk_bytes", chunk_bytes), ("batch_bytes", batch_bytes)) if v is not None}
    for r in range(20):
        state = _odd_state(r)
        path = str(tmp_path / f"{r}.safetensors")
        await save_file(state, path, scheduler=Scheduler(eng, **kw))
        cpu = {k: v.cpu() for k, v in state.items()}
        assert_state_equal(dict(sorted(st_load_file(path).items())), dict(sorted(cpu.items())))
        back = await load_file(path, scheduler=Scheduler(PosixEngine()))
        assert_state_equal(dict(sorted(back.items())), dict(sorted(cpu.items())))
        into = {k: torch.empty_like(v) for k, v in state.items()}
        await load_file(path, into=into, verify=True, scheduler=Scheduler(eng, **kw))
        assert all(torch.equal(into[k], state[k]) for k in state)
        async with TensorStore(tmp_path / "ck", engine=eng, keep_last=1, **kw) as store:
            await store.save(r, state)
            got = await store.load(r, device="cuda")
            assert all(torch.equal(got[k], state[k]) for k in state)
    assert kv.device_bytes["pwrite"] > 0 and kv.device_bytes["pread"] > 0, kv.device_bytes
    assert sum(kv.file_modes.values()) > 0, "no file went through cuFile"
    if kv.mode == "gds":
        assert kv.file_modes["gds"] > 0, kv.file_modes
    print(f"kvikio mode: {kv.mode}, files by mode: {dict(kv.file_modes)}")


async def test_every_entry_point_under_a_busy_consumer_stream(tmp_path: Any) -> None:
    """Saves see the values as of the call, loads land before the consumer's next kernel and
    allocate on its stream; then freeing and reallocating on the default stream while the consumer
    stream is busy must not hand the loaded memory out under it."""
    src = {"a": torch.randn(3 << 20, device="cuda"), "b": torch.randn(1 << 20, device="cuda", dtype=torch.float64)}
    path = str(tmp_path / "m.safetensors")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(LONG)  # type: ignore[no-untyped-call]
        x = torch.full((4 << 20,), 7.0, device="cuda")  # queued behind the sleep
        await save_file({"x": x, **src}, path)
        assert torch.equal(st_load_file(path)["x"], torch.full((4 << 20,), 7.0))
        for load in ("load_file", "stream", "store"):
            torch.cuda._sleep(LONG)  # type: ignore[no-untyped-call]
            if load == "load_file":
                got = await load_file(path, device="cuda")
            elif load == "stream":
                got = {k: t async for k, t in stream(path, device="cuda")}
            else:
                async with TensorStore(tmp_path / "ck") as store:
                    if not store.steps():
                        await store.save(0, {"x": x, **src})
                    got = await store.load(0, device="cuda")
            segs = [seg for seg in torch.cuda.memory_snapshot() if seg["stream"] == s.cuda_stream]
            assert any(seg["address"] <= got["x"].data_ptr() < seg["address"] + seg["total_size"] for seg in segs), (
                f"{load}: allocated on another stream than the consumer's"
            )
            y = got["x"] * 2  # the consumer's next kernel, on s
            del got
            with torch.cuda.stream(torch.cuda.default_stream()):
                junk = torch.zeros(8 << 20, device="cuda")  # a reuse on the default stream while s is busy
            s.synchronize()
            assert torch.equal(y.cpu(), torch.full((4 << 20,), 14.0)), load
            del junk


async def test_cancelled_saves_of_a_large_cuda_state_never_corrupt_the_next_one(tmp_path: Any) -> None:
    big = torch.randn(512 << 20, device="cuda")  # 2 GB
    rng = random.Random(0)
    async with TensorStore(tmp_path, keep_last=2) as store:
        pinned_max = 0
        for step in range(8):
            if step % 2:
                layout = {"big": big, "cpu": torch.randn(rng.randrange(1, 1 << 20))}
            else:
                layout = {
                    "small": torch.randn(rng.randrange(1, 1 << 22), device="cuda"),
                    "big": big[: rng.randrange(1, 512 << 20)],
                }
            h = store.save(2 * step, layout)
            await anyio.sleep(rng.uniform(0, 0.3))
            h.cancel()
            try:
                await h
            except SaveCancelledError:
                pass
            other = {"small": torch.randn(rng.randrange(1, 1 << 22), device="cuda"), "cpu": torch.randn(1000)}
            await store.save(2 * step + 1, other)
            got = await store.load(2 * step + 1)
            assert all(torch.equal(got[k].cpu(), other[k].cpu()) for k in other)
            assert store.staging.pinning is not None
            pinned_max = max(pinned_max, store.staging.pinning.pinned_bytes)
        # arenas are as large as the largest state (2 GB + headers and a CPU tensor), at most max_arenas
        assert 0 < pinned_max <= store.staging.max_arenas * (big.nbytes + (80 << 20)), pinned_max


def _child(code: str, env: dict[str, str] | None = None) -> str:
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | (env or {}),
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_round_trip_with_expandable_segments(tmp_path: Any) -> None:
    out = _child(
        f"""
        import anyio, torch, aiotensor
        async def main():
            w = {{"w": torch.randn(3_000_017, device="cuda")}}
            async with aiotensor.TensorStore({str(tmp_path)!r}) as s:
                await s.save(1, w)
                got = await s.load(1, device="cuda")
            await aiotensor.save_file(w, {str(tmp_path / "f.safetensors")!r})
            back = await aiotensor.load_file({str(tmp_path / "f.safetensors")!r}, device="cuda")
            print(torch.equal(got["w"], w["w"]) and torch.equal(back["w"], w["w"]))
        anyio.run(main)
        """,
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    )
    assert out.strip() == "True"


def test_a_rank_on_gpu_k_makes_contexts_on_gpu_k_only(tmp_path: Any) -> None:
    """Issues 24.1 and 24.4: in a fresh process that uses GPU k, a save, a load and a stream leave
    a primary context on GPU k alone (each other context costs 0.3-0.5 GiB per GPU per rank)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    k = torch.cuda.device_count() - 1
    out = _child(
        f"""
        import anyio, torch, aiotensor
        async def main():
            async with aiotensor.TensorStore({str(tmp_path)!r}) as s:  # built before set_device, as ranks often do
                torch.cuda.set_device({k})
                w = {{"w": torch.randn(1 << 22, device="cuda")}}
                await s.save(1, w)
                got = await s.load(1, device="cuda")
                assert torch.equal(got["w"], w["w"])
            await aiotensor.save_file(w, {str(tmp_path / "f.safetensors")!r})
            await aiotensor.load_file({str(tmp_path / "f.safetensors")!r}, device="cuda")
            async for _ in aiotensor.stream({str(tmp_path / "f.safetensors")!r}, device="cuda"):
                pass
            print([i for i in range(torch.cuda.device_count()) if torch._C._cuda_hasPrimaryContext(i)])
        anyio.run(main)
        """
    )
    assert out.strip() == f"[{k}]"


def test_cpu_work_in_a_fresh_process_never_initializes_cuda(tmp_path: Any) -> None:
    """The first store a process made on a GPU machine held the event loop 0.18 s of CPU
    (tests/test_loop_blocking on an H200, 2026-11-26): asking ``torch.cuda.is_available()``
    initializes the driver. Saves and loads of CPU tensors in a fresh process, with the default
    engine (kvikio where installed), never ask the driver: it is not initialized, by torch or by
    a driver call of ours through torch, at the end."""
    if torch.cuda._device_count_nvml() < 0:  # type: ignore[attr-defined]
        pytest.skip("NVML cannot count the devices here (MIG UUIDs, no libnvidia-ml): torch asks the driver")
    out = _child(
        f"""
        import anyio, torch, aiotensor

        def boom(*a):
            raise AssertionError("the CUDA driver was asked")

        torch.cuda.is_available = torch._C._cuda_getDeviceCount = torch._C._cuda_hasPrimaryContext = boom
        async def main():
            w = {{"w": torch.randn(1 << 20), "b": torch.arange(7)}}
            async with aiotensor.TensorStore({str(tmp_path / "s")!r}) as s:
                await s.save(1, w)
                assert torch.equal((await s.load(1))["w"], w["w"])
                await s.load(1, into=w)
            await aiotensor.save_file(w, {str(tmp_path / "f.safetensors")!r})
            await aiotensor.load_file({str(tmp_path / "f.safetensors")!r})
            async for _ in aiotensor.stream({str(tmp_path / "f.safetensors")!r}):
                pass
            print(aiotensor._runtime.cuda.available(), torch.cuda.is_initialized())
        anyio.run(main)
        """
    )
    assert out.strip().splitlines()[-1] == "True False"


@pytest.mark.parametrize("load", ["load_file", "stream", "store", "load_into"])
def test_a_first_load_to_the_gpu_initializes_cuda_off_the_event_loop(tmp_path: Any, load: str) -> None:
    """A server whose first CUDA use is a load to "cuda" (a model built on the meta device, say):
    asking the caller's current device or stream initialized CUDA on the event loop's thread
    (the driver 0.19 s, a context 0.13 s on an H200 machine). Now a plain thread does; no callback
    of the loop uses more than 50 ms of its CPU or waits 0.5 s, and the tensors are right."""
    torch.save({"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(3)}, tmp_path / "ref.pt")
    out = _child(
        f"""
        import asyncio, os, threading, torch, aiotensor
        from tests._loop_timing import RUN, timed_callbacks
        ref = torch.load({str(tmp_path / "ref.pt")!r})
        path = {str(tmp_path / "m.safetensors")!r}

        async def write():
            await aiotensor.save_file(ref, path)
            async with aiotensor.TensorStore({str(tmp_path / "s")!r}) as s:
                await s.save(1, ref)

        asyncio.run(write())
        assert not torch.cuda.is_initialized()
        loop_thread, slow = threading.get_ident(), []
        init_in, cuda_init = [], torch._C._cuda_init

        def recorded():  # where torch initializes CUDA: a thread, and its nice value
            init_in.append((threading.get_ident(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
            return cuda_init()

        torch._C._cuda_init = recorded

        async def main():
            if {load!r} == "load_file":
                return await aiotensor.load_file(path, device="cuda")
            if {load!r} == "stream":
                async with aiotensor.stream(path, device="cuda") as s:
                    return {{k: t async for k, t in s}}
            if {load!r} == "store":
                async with aiotensor.TensorStore({str(tmp_path / "s")!r}, readonly=True) as s:
                    return await s.load(1, device="cuda")
            with torch.device("meta"):
                m = torch.nn.Module()
                m.register_buffer("w", torch.empty(1 << 20))
                m.register_buffer("b", torch.empty(3))
            await aiotensor.load_into(m, path, device="cuda")
            return dict(m.state_dict())

        asyncio.events.Handle._run = timed_callbacks(0.05, 0.5, slow)  # 0.5 s: a wait on the loop (kvikio's set-up)
        got = asyncio.run(main())
        asyncio.events.Handle._run = RUN
        assert all(t.device.type == "cuda" and torch.equal(t.cpu(), ref[k]) for k, t in got.items()), got
        print(torch.cuda.is_initialized(), slow, [(t != loop_thread, n == os.getpriority(os.PRIO_PROCESS, 0)) for t, n in init_in])
        """
    )
    # initialized once, in a thread of the process's own priority (not a niced worker: the
    # driver's threads would inherit it), not on the loop's
    assert out.strip().splitlines()[-1] == "True [] [(True, True)]"


async def test_a_failed_registration_leaves_no_stale_error_in_its_thread() -> None:
    """cudaHostRegister of memory already registered fails (cudaErrorHostMemoryAlreadyRegistered);
    the error must be cleared, or torch's next kernel launch in that thread reports it."""
    from aiotensor._runtime.buffers import HostBuffer
    from aiotensor._runtime.cuda import Pinning

    def in_a_worker() -> float:
        buf = HostBuffer(1 << 20)
        a, b = Pinning(), Pinning()
        a.pin(buf.address, buf.nbytes)
        assert buf.tensor.is_pinned()
        with pytest.raises(RuntimeError, match="cudaHostRegister"):
            b.pin(buf.address, buf.nbytes)
        value = float((torch.ones(4, device="cuda") * 3).sum())  # a kernel launch in the same thread
        a.unpin(buf.address)
        assert not buf.tensor.is_pinned()
        buf.close()
        return value

    assert await anyio.to_thread.run_sync(in_a_worker) == 12.0


async def test_arenas_and_slots_are_pinned_while_in_use_and_not_after_close(tmp_path: Any) -> None:
    store = TensorStore(tmp_path)
    async with store:
        await store.save(1, {"w": torch.randn(1 << 22, device="cuda")})
        arena = await store.staging.acquire(1 << 20)
        assert arena.tensor.is_pinned()
        t = arena.tensor
        store.staging.release(arena)
        await store.load(1, into={"w": torch.empty(1 << 22, device="cuda")})
    assert not t.is_pinned()


@pytest.mark.parametrize("engine", ["posix", "kvikio"])
async def test_a_partial_resume_into_cuda_tensors_under_a_busy_stream(tmp_path: Any, engine: str) -> None:
    """``load(into=, strict=False)`` into a CUDA model and optimizer that changed: what both have
    lands before the consumer stream's next kernel, what only ``into`` has is left as it was, on
    the default engine and on kvikio's (its "auto" choice of path for CUDA tensors)."""
    eng = PosixEngine() if engine == "posix" else _kvikio()
    state = _odd_state(3)
    w = state["t0"]
    saved = {"model": {**state, "tied": w}, "optim": {"lr": 0.1, "exp_avg": [torch.ones(5, device="cuda")]}}
    async with TensorStore(tmp_path, engine=eng) as store:
        await store.save(1, saved)
        new = torch.full((7,), 3.0, device="cuda")
        into: dict[str, Any] = {
            "model": {k: torch.zeros_like(t) for k, t in state.items() if k != "t1"} | {"tied": torch.zeros_like(w), "new": new},
            "optim": {"lr": 0.5, "exp_avg": [torch.zeros(5, device="cuda"), torch.zeros(2, device="cuda")]},
        }
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(LONG)  # type: ignore[no-untyped-call]
            await store.load(into=into, strict=False)
            sums = {k: t.double().sum() for k, t in into["model"].items()}  # the consumer's next kernels
        s.synchronize()
    for k, t in state.items():
        if k != "t1":
            assert torch.equal(into["model"][k], t), k
            assert sums[k] == t.double().sum(), k
    assert torch.equal(into["model"]["tied"], w) and into["model"]["new"] is new and new.eq(3).all()
    assert "t1" not in into["model"] and into["optim"]["lr"] == 0.1
    assert into["optim"]["exp_avg"][0].eq(1).all() and not into["optim"]["exp_avg"][1].any()
