"""Serving (issue 13): streaming safetensors files, Hugging Face folders and checkpoints, selection,
backpressure, cancellation, load_into a live module, and hot swaps that never show half a model."""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
from safetensors.torch import save_file as st_save

import aiotensor
from aiotensor import TensorStore, knobs, load_into, prepare_swap, save_file, stream
from aiotensor.errors import ChecksumError, ManifestError, MismatchError
from aiotensor.testing import FaultyEngine

from .conftest import assert_state_equal, bits

pytestmark = pytest.mark.anyio


def weights(seed: int = 0, n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(64, 32, generator=g) for i in range(n)} | {"head.b": torch.randn(32, generator=g)}


def read_bytes(eng: FaultyEngine) -> int:
    return sum(op[3] for op in eng.ops if op[0] == "pread")


async def collect(s: aiotensor.TensorStream) -> dict[str, torch.Tensor]:
    out = {}
    async with s:
        async for name, t in s:
            out[name] = t
    return out


async def test_stream_a_file_written_by_safetensors_in_file_order(tmp_path: Any) -> None:
    w = weights()
    st_save(w, str(tmp_path / "m.safetensors"))
    names = []
    async with stream(tmp_path / "m.safetensors") as s:
        async for name, t in s:
            names.append(name)
            assert torch.equal(t, w[name])
    assert sorted(names) == sorted(w)


async def test_stream_a_sharded_hugging_face_folder(tmp_path: Any) -> None:
    w = weights(1)
    keys = sorted(w)
    halves = {"model-00001-of-00002.safetensors": keys[:3], "model-00002-of-00002.safetensors": keys[3:]}
    for f, ks in halves.items():
        st_save({k: w[k] for k in ks}, str(tmp_path / f))
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    got = await collect(stream(tmp_path, dtype=torch.float16))
    assert set(got) == set(w) and all(t.dtype == torch.float16 for t in got.values())
    assert all(torch.equal(got[k], w[k].half()) for k in w)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index | {"weight_map": {}}))
    with pytest.raises(ManifestError, match="weight_map is empty"):
        await collect(stream(tmp_path))
    for bad in ("../outside.safetensors", "a\x00b.safetensors", "\ud800.safetensors"):  # (NUL, surrogate: raw errors)
        index["weight_map"][keys[0]] = bad
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(ManifestError, match="plain file name"):
            await collect(stream(tmp_path))


async def test_a_stream_dtype_converts_floats_keeps_packed_fp4_and_refuses_a_string(tmp_path: Any) -> None:
    """An NVFP4 checkpoint: packed 4-bit weights (torch cannot convert them) beside fp8 scales and
    fp32 norms. ``dtype=torch.bfloat16`` converts the floats and leaves the packed weights as they
    are; a dtype given as a string is a TypeError when the stream is made, not a RuntimeError about
    a device halfway through."""
    fp4 = torch.randint(0, 255, (4, 8), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    state = {"w": fp4, "scale": torch.rand(4, 1).to(torch.float8_e4m3fn), "norm": torch.rand(8), "ids": torch.arange(3)}
    st_save(state, str(tmp_path / "m.safetensors"))
    got = await collect(stream(tmp_path / "m.safetensors", dtype=torch.bfloat16))
    assert {k: t.dtype for k, t in got.items()} == {
        "w": torch.float4_e2m1fn_x2, "scale": torch.bfloat16, "norm": torch.bfloat16, "ids": torch.int64
    }  # fmt: skip
    assert torch.equal(got["w"].view(torch.uint8), fp4.view(torch.uint8))
    assert torch.equal(got["scale"], state["scale"].to(torch.bfloat16)) and torch.equal(got["norm"], state["norm"].bfloat16())
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        stream(tmp_path / "m.safetensors", dtype="bfloat16")  # type: ignore[arg-type]


@pytest.mark.parametrize("index", ["model.safetensors.index.json", "pytorch_model.bin.index.json"])
async def test_a_sharded_model_in_the_hugging_face_cache_layout(tmp_path: Any, index: str) -> None:
    """huggingface_hub's cache links every file of ``snapshots/<revision>/``, the index too, to
    ``../../blobs/<hash>``: the index was refused as a link, so no sharded model of the cache loaded."""
    w = weights(1)
    keys = sorted(w)
    repo = tmp_path / "models--org--name"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    suffix = ".safetensors" if index.startswith("model.") else ".bin"
    halves = {f"model-00001-of-00002{suffix}": keys[:3], f"model-00002-of-00002{suffix}": keys[3:]}
    for i, (f, ks) in enumerate(halves.items()):
        part = {k: w[k] for k in ks}
        if suffix == ".safetensors":
            st_save(part, str(blobs / f"{i:040x}"))
        else:
            torch.save(part, blobs / f"{i:040x}")
        (snapshot / f).symlink_to(f"../../blobs/{i:040x}")
    (blobs / ("f" * 40)).write_text(json.dumps({"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}))
    (snapshot / index).symlink_to("../../blobs/" + "f" * 40)
    assert_state_equal(dict(sorted((await collect(stream(snapshot))).items())), dict(sorted(w.items())))
    module = torch.nn.Module()
    for k, t in w.items():  # a module of those names
        *path, leaf = k.split(".")
        at = module
        for p in path:
            if not hasattr(at, p):
                at.add_module(p, torch.nn.Module())
            at = getattr(at, p)
        at.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(t)))
    await load_into(module, snapshot)
    assert_state_equal(dict(sorted(module.state_dict().items())), dict(sorted(w.items())))
    (blobs / f"{1:040x}").unlink()  # a shard's blob not there (an interrupted download): say which file
    with pytest.raises(FileNotFoundError, match=f"model-00002-of-00002{suffix}, a file of the model, is not there"):
        await collect(stream(snapshot))
    (blobs / ("f" * 40)).write_text("{")  # the index's errors name it, not its blob
    with pytest.raises(ManifestError, match=f"snapshots/0123abc/{index}"):
        await collect(stream(snapshot))
    (blobs / ("f" * 40)).unlink()
    with pytest.raises(FileNotFoundError, match=f"{index}: the model's index is not there"):
        await collect(stream(snapshot))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_stream_dropped_as_its_event_loop_ends(tmp_path: Any, backend: str) -> None:
    """An async generator over a stream, alive when the run ends, is finalized then: the stream's
    close must neither fail the run (trio refuses new tasks then: that was a TrioInternalError)
    nor stay pending for the life of the process (asyncio: a task waiting on a closed loop)."""
    from aiotensor._runtime import threads

    st_save({f"t.{i}": torch.randn(64 * 1024) for i in range(32)}, str(tmp_path / "m.safetensors"))

    async def tensors() -> Any:
        async for pair in stream(tmp_path / "m.safetensors", window_bytes=1 << 20):
            yield pair

    alive = []

    async def main() -> None:
        g = tensors()
        await g.__anext__()
        alive.append(g)

    before = open_fds()
    anyio.run(main, backend=backend)
    alive.clear()
    assert [t for t in threads._keep_alive if not t.done()] == []
    for _ in range(200):
        if open_fds() == before:
            break
        time.sleep(0.01)
    assert open_fds() == before


async def test_a_stream_dropped_unclosed_is_closed_once_collected(tmp_path: Any) -> None:
    """A consumer that leaves ``async for`` without ``async with`` or ``aclose()`` (a ``return``, or
    its task cancelled between tensors): the reader task held the stream, so its files, its window
    of tensors read ahead and its reader stayed until the event loop ended, one more per request."""
    import gc

    w = {f"t.{i}": torch.randn(64 * 1024) for i in range(32)}  # 8 MB, 256 KB a tensor
    st_save(w, str(tmp_path / "m.safetensors"))
    eng = FaultyEngine()
    before = open_fds()

    async def peek() -> str:
        async for name, _ in stream(tmp_path / "m.safetensors", window_bytes=1 << 20, scheduler=aiotensor.Scheduler(eng)):
            return name
        raise AssertionError("empty")

    async def slow_consumer() -> None:
        async for _ in stream(tmp_path / "m.safetensors", window_bytes=1 << 20, scheduler=aiotensor.Scheduler(eng)):
            await anyio.sleep(10)  # its own work, where it is cancelled

    for _ in range(3):
        assert await peek() == "t.0"
        # the idiom for one tensor: nothing else holds the stream while its first pair is read
        name, _ = await anext(stream(tmp_path / "m.safetensors", window_bytes=1 << 20, scheduler=aiotensor.Scheduler(eng)))
        assert name == "t.0"
    with anyio.move_on_after(0.2):
        await slow_consumer()
    gc.collect()
    for _ in range(200):  # closing runs as a task of the loop
        if open_fds() == before:
            break
        await anyio.sleep(0.01)
    assert open_fds() == before, "a dropped stream kept its files open"
    read = read_bytes(eng)
    assert read < 4 * 6 * (1 << 20) + (8 << 20), "each stream read within its window"
    await anyio.sleep(0.1)
    assert read_bytes(eng) == read, "nothing is read after the streams were dropped"


async def test_stream_a_checkpoint_and_a_store_root(tmp_path: Any) -> None:
    w = weights(2)
    state = {"model": w, "tied": w["head.b"], "step": 3}
    async with TensorStore(tmp_path) as store:
        await store.save(3, state)
    got = await collect(stream(tmp_path))  # the root: its newest step
    assert set(got) == {f"model.{k}" for k in w} | {"tied"}
    assert got["tied"] is got["model.head.b"]
    got = await collect(stream(tmp_path / "step-000000000003", keys=["model.layers.1.w", "model.head."]))
    assert set(got) == {"model.layers.1.w", "model.head.b"}


async def test_selection_reads_only_the_selected_bytes(tmp_path: Any) -> None:
    w = weights(3, n=20)
    await save_file(w, tmp_path / "m.safetensors")
    eng = FaultyEngine()
    sched = aiotensor.Scheduler(eng)
    got = await collect(stream(tmp_path / "m.safetensors", keys=lambda n: n == "layers.7.w", scheduler=sched))
    assert list(got) == ["layers.7.w"] and torch.equal(got["layers.7.w"], w["layers.7.w"])
    header = os.path.getsize(tmp_path / "m.safetensors") - sum(t.nbytes for t in w.values())
    sniff = 4  # the first bytes, to tell a torch.save zip from a safetensors file
    assert read_bytes(eng) <= header + w["layers.7.w"].nbytes + sniff, "only the header and the one tensor were read"


async def test_a_slow_consumer_holds_the_reading_back(tmp_path: Any) -> None:
    w = {f"t{i}": torch.full((16_384,), float(i)) for i in range(32)}  # 64 KiB each
    await save_file(w, tmp_path / "m.safetensors")
    eng = FaultyEngine()
    window = 4 * 65536
    ahead = []
    async with stream(tmp_path / "m.safetensors", window_bytes=window, scheduler=aiotensor.Scheduler(eng)) as s:
        consumed = 0
        async for name, t in s:
            consumed += t.nbytes
            await anyio.sleep(0.01)  # the consumer is slower than the disk
            ahead.append(s.bytes_read - consumed)
            assert torch.equal(t, w[name])
    assert max(ahead) <= window, max(ahead)


async def test_breaking_out_stops_every_read(tmp_path: Any) -> None:
    w = {f"t{i}": torch.full((65_536,), float(i)) for i in range(64)}
    await save_file(w, tmp_path / "m.safetensors")
    eng = FaultyEngine()
    async with stream(tmp_path / "m.safetensors", window_bytes=1 << 20, scheduler=aiotensor.Scheduler(eng)) as s:
        async for _name, _t in s:
            break
    after = read_bytes(eng)
    await anyio.sleep(0.2)
    assert read_bytes(eng) == after, "nothing is read after the stream closed"
    assert after < sum(t.nbytes for t in w.values()) // 4
    assert eng.open_fds() == []
    with anyio.move_on_after(0.05):  # cancellation mid-stream
        async with stream(tmp_path / "m.safetensors", scheduler=aiotensor.Scheduler(eng)) as s:
            async for _name, _t in s:
                await anyio.sleep(1)
    assert eng.open_fds() == []


async def test_an_aclose_cancelled_by_asyncio_still_returns_only_once_nothing_reads(tmp_path: Any) -> None:
    """helper-51: ``aclose()`` is shielded, but asyncio's own ``Task.cancel()`` goes through an anyio
    shield: it returned while its reader still read, 20 times in 20. It returns once it did."""
    import asyncio

    w = {f"t{i}": torch.full((4096,), float(i)) for i in range(2000)}
    await save_file(w, tmp_path / "m.safetensors")
    for _ in range(5):
        eng = FaultyEngine()
        s = stream(tmp_path / "m.safetensors", scheduler=aiotensor.Scheduler(eng))
        await s.__anext__()  # reading under way
        task = asyncio.ensure_future(s.aclose())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after = read_bytes(eng)
        assert eng.open_fds() == []
        await anyio.sleep(0.05)
        assert read_bytes(eng) == after, "nothing is read once aclose() returned"


async def test_a_stream_of_a_store_outlives_the_retirement_of_its_step(tmp_path: Any) -> None:
    """helper-51: a stream of a store root (an evaluator beside the trainer) whose step the writer's
    retention retired meanwhile ended halfway with a bare FileNotFoundError (22 times in 24): a
    checkpoint's files are all opened before the first read, and read on once retired."""
    root = tmp_path / "store"
    async with TensorStore(root, keep_last=1, shard_bytes=8 << 20) as store:
        await store.save(0, {f"t{i}": torch.full((1 << 18,), 0.0) for i in range(64)})
        got = {}
        async with stream(root, window_bytes=4 << 20) as s:
            async for name, t in s:
                got[name] = t
                if len(got) == 1:  # the newest step retired while the stream is under way
                    await store.save(1, {f"t{i}": torch.full((1 << 18,), 1.0) for i in range(64)})
                    while (root / "step-000000000000").exists() or any(".tmp-del" in p.name for p in root.iterdir()):
                        await anyio.sleep(0.01)
        assert len(got) == 64 and all(float(t[0]) == 0.0 and float(t[-1]) == 0.0 for t in got.values())


async def test_a_stream_whose_reader_stops_early_raises_and_never_ends_as_if_done(tmp_path: Any, monkeypatch: Any) -> None:
    """helper-67: a shard gone, and the check of whether its step was damaged or retired failing
    too (an object store's HEAD timing out), ended the stream's reader with that error unseen: the
    consumer's `async for` ended normally with none of the 8 tensors. Now it gets the read's error,
    the failed check noted."""
    from aiotensor import commit

    root = tmp_path / "store"
    async with TensorStore(root, shard_bytes=1 << 20) as store:
        await store.save(1, {f"t{i}": torch.randn(1 << 16) for i in range(8)})
    os.remove(sorted((root / "step-000000000001").glob("*.safetensors"))[-1])

    def failing(*args: Any) -> Any:
        raise TimeoutError("the HEAD timed out")

    monkeypatch.setattr(commit, "has_records", failing)
    got = []
    with pytest.raises(FileNotFoundError) as e:
        async for name, _ in stream(root):
            got.append(name)
    assert got == [] and "is damaged or was retired is unknown: TimeoutError: the HEAD timed out" in e.value.__notes__[0]


async def test_many_small_tensors_are_read_in_batches_and_other_tasks_run_meanwhile(tmp_path: Any) -> None:
    n = 3000
    w = {f"t{i}": torch.full((4,), float(i)) for i in range(n)}
    await save_file(w, tmp_path / "m.safetensors")
    sched = aiotensor.Scheduler()
    got: dict[str, torch.Tensor] = {}
    seen: list[int] = []  # how many tensors the consumer had each time another task ran

    async def other() -> None:
        while len(got) < n:
            seen.append(len(got))
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg, stream(tmp_path / "m.safetensors", scheduler=sched) as s:
        async for name, t in s:
            if not got:
                while s.bytes_read < 16 * n:  # every tensor is read ahead meanwhile: the rest are ready
                    await anyio.sleep(0.01)
                await anyio.sleep(0.1)  # and handed over
                tg.start_soon(other)
            got[name] = t
    assert got.keys() == w.keys() and all(torch.equal(got[k], w[k]) for k in w)
    # one read per tensor made 4 worker calls each (12,000 here); a batch of up to BATCH_TENSORS makes 5
    assert sched.stats.calls < 6 * (n // knobs.STREAM_BATCH_TENSORS + 1) + 8, sched.stats.calls
    # all were ready, so nothing made the consumer wait: it let other tasks run on its own
    assert any(1 < k < n for k in seen), seen[:5]


@pytest.mark.parametrize("batches", [1, 3])
async def test_a_stream_keeps_at_most_its_batches_of_tensors_in_flight(tmp_path: Any, monkeypatch: Any, batches: int) -> None:
    """A local file's batches are read while at most STREAM_BATCHES_IN_FLIGHT batches' worth of
    tensors are in flight, and that many are: each read waits until that many are in flight (or
    2 s went by), so a cap not kept shows more, a stricter one fewer; every tensor still comes,
    in order."""
    import threading

    from aiotensor.serving import tensor_stream

    n, batch = 400, 16
    w = {f"t{i}": torch.full((3,), float(i)) for i in range(n)}
    await save_file(w, tmp_path / "m.safetensors")
    monkeypatch.setattr(knobs, "STREAM_BATCH_TENSORS", batch)
    monkeypatch.setattr(knobs, "STREAM_BATCHES_IN_FLIGHT", batches)
    lock, flying, most = threading.Lock(), [0], [0]
    prepare, read_named = tensor_stream._prepare, tensor_stream.read_named

    def counted(entries: Any, *args: Any) -> Any:  # in a worker thread
        with lock:
            flying[0] += len(entries)
            most[0] = max(most[0], flying[0])
        return prepare(entries, *args)

    async def held(sched: Any, fd: int, path: str, targets: Any, entries: Any) -> None:
        with anyio.move_on_after(2):
            while most[0] < batches * batch:
                await anyio.sleep(0.005)
        try:
            await read_named(sched, fd, path, targets, entries)
        finally:
            with lock:
                flying[0] -= len(entries)

    monkeypatch.setattr(tensor_stream, "_prepare", counted)
    monkeypatch.setattr(tensor_stream, "read_named", held)
    async with stream(tmp_path / "m.safetensors", scheduler=aiotensor.Scheduler(workers=4)) as s:
        got = [(name, t) async for name, t in s]
    assert [k for k, _ in got] == list(w) and all(torch.equal(t, w[k]) for k, t in got)
    assert most[0] == batches * batch, most[0]


async def test_a_file_that_cannot_be_opened_any_more_is_an_error_not_an_early_end(tmp_path: Any) -> None:
    w = weights(4, n=8)
    keys = sorted(w)
    halves = {"model-00001-of-00002.safetensors": keys[:4], "model-00002-of-00002.safetensors": keys[4:]}
    for f, ks in halves.items():
        await save_file({k: w[k] for k in ks}, tmp_path / f)
    index = {"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    opened: list[str] = []

    def hook(op: tuple[Any, ...]) -> None:
        if op[0] == "open_read" and "model-00002-of" in str(op[1]):
            opened.append(op[1])
            if len(opened) > 1:  # opened once to plan (what kind of file, its header); gone by the read
                raise FileNotFoundError(2, "gone", op[1])

    got: list[str] = []
    with pytest.raises(FileNotFoundError):
        async with stream(tmp_path, scheduler=aiotensor.Scheduler(FaultyEngine(hook=hook))) as s:
            async for name, _t in s:
                got.append(name)
    assert sorted(got) == keys[:4], "the first file's tensors came first"


async def test_a_corrupt_tensor_is_named(tmp_path: Any) -> None:
    await save_file(weights(), tmp_path / "m.safetensors")
    data = bytearray((tmp_path / "m.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (tmp_path / "m.safetensors").write_bytes(bytes(data))
    with pytest.raises(ChecksumError):
        await collect(stream(tmp_path / "m.safetensors"))


async def test_load_into_a_live_module(tmp_path: Any) -> None:
    src = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    dst = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    await save_file(dict(src.state_dict()), tmp_path / "m.safetensors")
    res = await load_into(dst, tmp_path / "m.safetensors")
    assert res == ([], []) and dst[0].weight.dtype == torch.bfloat16 and dst[0].weight.requires_grad
    assert torch.equal(dst[0].weight, src[0].weight.to(torch.bfloat16))
    await save_file({"0.weight": src[0].weight, "extra": torch.ones(1)}, tmp_path / "part.safetensors")
    with pytest.raises(MismatchError, match="missing keys.*unexpected keys.*extra"):
        await load_into(dst, tmp_path / "part.safetensors")
    res = await load_into(dst, tmp_path / "part.safetensors", strict=False)
    assert "0.bias" in res.missing_keys and res.unexpected_keys == ["extra"]
    await save_file({k: v for k, v in src.state_dict().items() if k != "2.bias"}, tmp_path / "less.safetensors")
    with pytest.raises(MismatchError, match=r"missing keys \['2.bias'\] \(only in the module\); strict=False loads") as e:
        await load_into(dst, tmp_path / "less.safetensors")
    assert "unexpected" not in str(e.value)  # no empty list


async def test_a_hot_swap_switches_whole_or_not_at_all(tmp_path: Any) -> None:
    model = torch.nn.Linear(32, 8)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    new = torch.nn.Linear(32, 8)
    await save_file(dict(new.state_dict()), tmp_path / "v2.safetensors")
    swap = await prepare_swap(model, tmp_path / "v2.safetensors")
    assert_state_equal(old, {k: v.detach() for k, v in model.state_dict().items()})  # still serving v1
    swap.apply()
    assert torch.equal(model.weight, new.weight) and torch.equal(model.bias, new.bias)
    # a corrupt v3: the load fails and nothing of it is visible
    await save_file({k: v * 2 for k, v in new.state_dict().items()}, tmp_path / "v3.safetensors")
    data = bytearray((tmp_path / "v3.safetensors").read_bytes())
    data[-5] ^= 0x01
    (tmp_path / "v3.safetensors").write_bytes(bytes(data))
    with pytest.raises(ChecksumError):
        await prepare_swap(model, tmp_path / "v3.safetensors")
    assert torch.equal(bits(model.weight), bits(new.weight))


async def test_verify_false_skips_the_checksums_of_load_into_and_prepare_swap(tmp_path: Any) -> None:
    """As load_file's and stream's: the checksums are checked unless verify=False, where the
    bytes as stored are what lands (a corrupt byte too)."""
    src = torch.nn.Linear(16, 4)
    await save_file(dict(src.state_dict()), tmp_path / "w.safetensors")
    data = bytearray((tmp_path / "w.safetensors").read_bytes())
    data[-1] ^= 0x40  # the last byte of the last tensor (bias or weight, by the header's order)
    (tmp_path / "w.safetensors").write_bytes(bytes(data))
    model = torch.nn.Linear(16, 4)
    with pytest.raises(ChecksumError):
        await load_into(model, tmp_path / "w.safetensors")
    with pytest.raises(ChecksumError):
        await prepare_swap(model, tmp_path / "w.safetensors")
    for load in ("load_into", "prepare_swap"):
        model = torch.nn.Linear(16, 4)
        if load == "load_into":
            await load_into(model, tmp_path / "w.safetensors", verify=False)
        else:
            (await prepare_swap(model, tmp_path / "w.safetensors", verify=False)).apply()
        differs = [k for k, v in model.state_dict().items() if not torch.equal(bits(v), bits(src.state_dict()[k]))]
        assert len(differs) == 1, (load, differs)  # the corrupt tensor, as stored; the other exact
        got = model.state_dict()[differs[0]].reshape(-1)
        assert torch.equal(bits(got[:-1]), bits(src.state_dict()[differs[0]].reshape(-1)[:-1])), load


async def test_keys_load_or_swap_part_of_a_module(tmp_path: Any) -> None:
    """keys (as stream takes them) select the file's tensors to read and the module's names that
    count: a new head swapped in alone, one layer reloaded; a name that selects nothing is named."""
    src = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    await save_file(dict(src.state_dict()), tmp_path / "w.safetensors")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert await load_into(model, tmp_path / "w.safetensors", keys="1.") == ([], [])  # strict: nothing missing
    for k, v in model.state_dict().items():
        assert torch.equal(v, (src if k.startswith("1.") else model).state_dict()[k]) and (
            k.startswith("1.") or torch.equal(v, before[k])
        )
    swap = await prepare_swap(model, tmp_path / "w.safetensors", keys=lambda n: n.startswith("2."))
    head, first = model[2].weight.data_ptr(), model[0].weight.data_ptr()
    swap.apply()
    assert torch.equal(model[2].weight, src[2].weight) and model[2].weight.data_ptr() != head
    assert model[0].weight.data_ptr() == first
    assert torch.equal(model[0].weight, before["0.weight"])  # not in keys: serving as it was
    with pytest.raises(MismatchError, match="select nothing for '3.'"):
        await load_into(model, tmp_path / "w.safetensors", keys=["1.weight", "3."])
    with pytest.raises(MismatchError, match="the prefix '1.'"):
        await prepare_swap(model, tmp_path / "w.safetensors", keys="1")
    for nothing in ([], lambda n: False):  # selects nothing: nothing read, nothing handed out
        async with stream(tmp_path / "w.safetensors", keys=nothing) as s:
            assert [x async for x in s] == []
    # names as a generator (read twice inside); a module that loads its own way (a hook) too
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    fresh[0].register_load_state_dict_pre_hook(lambda *a, **k: None)
    assert await load_into(fresh, tmp_path / "w.safetensors", keys=(k for k in ["1.weight", "1.bias"])) == ([], [])
    assert torch.equal(fresh[1].weight, src[1].weight) and not torch.equal(fresh[0].weight, src[0].weight)


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.mid, self.lm_head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.wte.weight


async def test_keys_name_either_name_of_a_tied_weight(tmp_path: Any) -> None:
    """A file that keeps one name of a tie (safetensors' save_model keeps one) serves keys naming
    the other; the tie survives a load and a swap. A file that stores both names (a head untied
    by a fine-tune) serves each name from its own bytes, and only those are read."""
    from safetensors.torch import save_model

    src = _Tied()
    save_model(src, str(tmp_path / "t.safetensors"))
    for keys in ("wte.", "lm_head.weight"):
        for load in ("load_into", "prepare_swap"):
            m = _Tied()
            mid = m.mid.weight.clone()
            if load == "load_into":
                assert await load_into(m, tmp_path / "t.safetensors", keys=keys) == ([], [])
            else:
                (await prepare_swap(m, tmp_path / "t.safetensors", keys=keys)).apply()
            assert m.lm_head.weight is m.wte.weight and torch.equal(m.wte.weight, src.wte.weight), (keys, load)
            assert torch.equal(m.mid.weight, mid), (keys, load)  # not selected: as it was
    await save_file(
        {"wte.weight": torch.full((10, 4), 1.0), "lm_head.weight": torch.full((10, 4), 2.0)}, tmp_path / "both.safetensors"
    )
    for keys, value in (("lm_head.weight", 2.0), ("wte.", 1.0)):
        for load in ("load_into", "prepare_swap"):
            m = _Tied()
            if load == "load_into":
                await load_into(m, tmp_path / "both.safetensors", keys=keys)
            else:
                (await prepare_swap(m, tmp_path / "both.safetensors", keys=keys)).apply()
            assert m.lm_head.weight is m.wte.weight and m.wte.weight.eq(value).all(), (keys, load)


@pytest.mark.parametrize("rows", [10, 3 << 20])  # (12 MB: read in parallel pieces)
async def test_a_tie_the_file_stores_under_each_name_gets_one_of_them_whole(tmp_path: Any, rows: int) -> None:
    """helper-72: a tie (lm_head.weight = wte.weight) whose file stores both names with other
    bytes got both read into its memory, in parallel pieces: a mix of the two, or a ChecksumError
    of a sound file. Now only one is read: a module's last name in its own order (load_state_dict
    leaves that one), an `into` dict's last key in its order."""

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = torch.nn.Parameter(torch.zeros(rows, 1))
            self.lm_head = self.wte  # the module's order: wte, lm_head (the file's: lm_head, wte)

    both = {"wte": torch.full((rows, 1), 1.0), "lm_head": torch.full((rows, 1), 2.0)}
    await save_file(both, tmp_path / "both.safetensors")  # with crc32c
    st_save(both, str(tmp_path / "plain.safetensors"))
    ref = Tied()
    ref.load_state_dict(both)
    assert ref.wte.eq(2.0).all()
    for name in ("both", "plain"):
        m = Tied()
        assert await load_into(m, tmp_path / f"{name}.safetensors") == ([], [])
        assert m.lm_head is m.wte and m.wte.eq(2.0).all(), name
        with torch.device("meta"):  # (helper-75: a meta module's tie took the file's last)
            m = Tied()
        assert await load_into(m, tmp_path / f"{name}.safetensors") == ([], [])
        assert m.lm_head is m.wte and m.wte.eq(2.0).all(), name
        m = Tied()
        (await prepare_swap(m, tmp_path / f"{name}.safetensors")).apply()  # (it took the file's last: wte)
        assert m.lm_head is m.wte and m.wte.eq(2.0).all(), name
        for order, value in ((("wte", "lm_head"), 2.0), (("lm_head", "wte"), 1.0)):
            t = torch.zeros(rows, 1)
            into = {k: t for k in order}
            await aiotensor.load_file(tmp_path / f"{name}.safetensors", into=into)
            assert t.eq(value).all(), (name, order)
    st_save({"wte": torch.ones(rows + 1, 1), "lm_head": both["lm_head"]}, str(tmp_path / "odd.safetensors"))
    for how in ("load_into", "prepare_swap"):  # (helper-75: the name not read, wte, is still checked)
        with pytest.raises(MismatchError, match="'wte'"):
            await (load_into if how == "load_into" else prepare_swap)(Tied(), tmp_path / "odd.safetensors")
    async with TensorStore(tmp_path / "store") as store:
        for step, order in enumerate((("a", "b"), ("b", "a"))):
            await store.save(step, {"a": both["wte"], "b": both["lm_head"]})
            t = torch.zeros(rows, 1)
            into = {k: t for k in order}
            assert await store.load(step, into=into) is into
            assert t.eq(2.0 if order[-1] == "b" else 1.0).all() and into["a"] is into["b"] is t


async def test_a_swap_frees_the_weights_it_switched_out_in_a_worker_thread(tmp_path: Any, monkeypatch: Any) -> None:
    """The old weights' last references went on the caller's thread, the event loop's: unmapping
    them took 31 ms for 0.47 GB (70 ms a GB) there, every task stalled. Now a worker drops them."""
    import threading
    import weakref

    from aiotensor._runtime import threads

    model = torch.nn.Linear(64, 32)
    await save_file(dict(torch.nn.Linear(64, 32).state_dict()), tmp_path / "v2.safetensors")
    swap = await prepare_swap(model, tmp_path / "v2.safetensors")
    before = {model.weight.data_ptr(), model.bias.data_ptr()}
    given: list[set[int]] = []
    freed_in: list[str] = []
    in_worker = threads.in_worker

    def spy(fn: Any) -> None:
        items = fn.args[0]  # _let_go(old): the list of the weights switched out
        given.append({t.data_ptr() for t in items})
        for t in items:
            weakref.finalize(t, lambda: freed_in.append(threading.current_thread().name))
        del t, items
        in_worker(fn)

    monkeypatch.setattr(threads, "in_worker", spy)
    swap.apply()
    assert given == [before]
    for _ in range(200):
        if len(freed_in) == 2:
            break
        await anyio.sleep(0.01)
    assert len(freed_in) == 2 and threading.main_thread().name not in freed_in, freed_in


async def test_a_swap_refuses_a_module_changed_since_it_was_prepared(tmp_path: Any) -> None:
    """``apply()`` set each parameter's data to the tensor prepared for it: after ``model.half()``
    it silently put float32 weights back, and a parameter removed meanwhile was a KeyError."""
    model = torch.nn.Linear(32, 8)
    await save_file(dict(torch.nn.Linear(32, 8).state_dict()), tmp_path / "v2.safetensors")
    swap = await prepare_swap(model, tmp_path / "v2.safetensors")
    model.half()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(MismatchError, match=r"changed since prepare_swap: \['weight', 'bias'\]"):
        swap.apply()
    assert_state_equal({k: v.detach() for k, v in model.state_dict().items()}, before)  # nothing switched
    swap = await prepare_swap(model, tmp_path / "v2.safetensors")  # prepared again: it switches
    del model.bias
    model.bias = None
    with pytest.raises(MismatchError, match=r"\['bias'\]"):
        swap.apply()
    lm = TiedLM()  # a tie broken since prepare: only one name of it would have switched
    await save_file(dict(TiedLM().state_dict()), tmp_path / "lm.safetensors")
    swap = await prepare_swap(lm, tmp_path / "lm.safetensors")
    lm.lm_head.weight = torch.nn.Parameter(lm.wte.weight.detach().clone())
    with pytest.raises(MismatchError, match="ties changed since prepare_swap"):
        swap.apply()
    lm = TiedLM()
    lm.lm_head.weight = torch.nn.Parameter(lm.wte.weight.detach().clone())  # untied when prepared, tied since
    swap = await prepare_swap(lm, tmp_path / "lm.safetensors")
    lm.lm_head.weight = lm.wte.weight
    with pytest.raises(MismatchError, match="two of its names are one tensor now"):
        swap.apply()
    swap = await prepare_swap(lm, tmp_path / "lm.safetensors")  # prepared as it is: it switches, tied
    swap.apply()
    assert lm.lm_head.weight is lm.wte.weight
    conv = torch.nn.Conv2d(3, 8, 3)
    await save_file(dict(torch.nn.Conv2d(3, 8, 3).state_dict()), tmp_path / "c.safetensors")
    swap = await prepare_swap(conv, tmp_path / "c.safetensors")
    conv.to(memory_format=torch.channels_last)  # a swap keeps a layout: not this one, made since
    with pytest.raises(MismatchError, match=r"\['weight'\]"):
        swap.apply()
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)


class TiedLM(torch.nn.Module):
    """A language model whose output layer shares the embedding matrix (GPT-2, Gemma), with a
    buffer, built with torch alone."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(50, 16, dtype=dtype)
        self.norm = torch.nn.BatchNorm1d(16, dtype=dtype)
        self.lm_head = torch.nn.Linear(16, 50, bias=False, dtype=dtype)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.wte(ids)))


def trained_tied(seed: int) -> TiedLM:
    torch.manual_seed(seed)
    m = TiedLM()
    m.norm.running_mean.uniform_()
    return m.eval()


async def test_tied_weights_load_from_a_file_that_stores_one_name(tmp_path: Any) -> None:
    from safetensors.torch import save_model

    src = trained_tied(1)
    save_model(src, str(tmp_path / "m.safetensors"))  # the real writer drops one tied name, as save_pretrained does
    names = set((await aiotensor.read_header(tmp_path / "m.safetensors")).tensors)
    assert len(names & {"wte.weight", "lm_head.weight"}) == 1
    dst = trained_tied(2)
    assert await load_into(dst, tmp_path / "m.safetensors") == ([], [])
    assert dst.lm_head.weight is dst.wte.weight and torch.equal(dst.wte.weight, src.wte.weight)
    ids = torch.arange(50)
    assert torch.equal(dst(ids), src(ids))
    # a hot swap of the same model, strict: the tie counts as present, and switches under both names
    served = trained_tied(3)
    swap = await prepare_swap(served, tmp_path / "m.safetensors")
    assert (swap.missing_keys, swap.unexpected_keys) == ([], [])
    swap.apply()
    assert served.lm_head.weight is served.wte.weight and torch.equal(served(ids), src(ids))


async def test_prepare_swap_strict_false_keeps_what_the_file_lacks(tmp_path: Any) -> None:
    src, served = trained_tied(1), trained_tied(2)
    keep = served.norm.weight.detach().clone()
    part = {k: v for k, v in src.state_dict().items() if not k.startswith("norm.") and k != "lm_head.weight"}
    await save_file(part | {"extra": torch.ones(1)}, tmp_path / "part.safetensors")
    with pytest.raises(MismatchError, match="extra"):
        await prepare_swap(served, tmp_path / "part.safetensors")
    swap = await prepare_swap(served, tmp_path / "part.safetensors", strict=False)
    assert "norm.weight" in swap.missing_keys and "lm_head.weight" not in swap.missing_keys
    assert swap.unexpected_keys == ["extra"]
    swap.apply()
    assert torch.equal(served.lm_head.weight, src.wte.weight) and torch.equal(served.norm.weight, keep)


@pytest.mark.parametrize("both", [False, True], ids=["one-name", "both-names"])
async def test_a_meta_model_is_materialized_with_its_ties(tmp_path: Any, both: bool) -> None:
    src = trained_tied(1)
    state = dict(src.state_dict())
    if not both:
        del state["lm_head.weight"]
    await save_file({k: v.clone() for k, v in state.items()}, tmp_path / "m.safetensors")
    with torch.device("meta"):
        dst = TiedLM(torch.bfloat16)
    assert await load_into(dst, tmp_path / "m.safetensors") == ([], [])
    assert not any(t.is_meta for t in dst.state_dict().values())
    assert dst.lm_head.weight is dst.wte.weight and isinstance(dst.wte.weight, torch.nn.Parameter)
    assert dst.wte.weight.requires_grad and dst.wte.weight.dtype == torch.bfloat16
    assert dst.norm.running_mean.dtype == torch.bfloat16 and "running_mean" in dst.norm._buffers
    assert torch.equal(dst.wte.weight, src.wte.weight.to(torch.bfloat16))
    assert torch.equal(dst.norm.running_mean, src.norm.running_mean.to(torch.bfloat16))
    dst(torch.arange(50))  # the next forward runs
    # a swap needs a serving module: a meta one is refused, by name
    with torch.device("meta"):
        meta = TiedLM()
    with pytest.raises(MismatchError, match="meta"):
        await prepare_swap(meta, tmp_path / "m.safetensors")


async def test_a_meta_model_missing_tensors_are_reported(tmp_path: Any) -> None:
    src = trained_tied(1)
    await save_file({"wte.weight": src.wte.weight}, tmp_path / "m.safetensors")
    with torch.device("meta"):
        dst = TiedLM()
    with pytest.raises(MismatchError, match="norm.weight"):
        await load_into(dst, tmp_path / "m.safetensors")
    res = await load_into(dst, tmp_path / "m.safetensors", strict=False)
    assert "norm.running_mean" in res.missing_keys and "lm_head.weight" not in res.missing_keys
    assert not dst.wte.weight.is_meta and dst.norm.weight.is_meta


async def test_row_slices_read_only_those_rows(tmp_path: Any) -> None:
    w = {"a": torch.randn(100, 64), "b": torch.randn(10)}
    await save_file(w, tmp_path / "m.safetensors")
    eng = FaultyEngine()
    got = await collect(stream(tmp_path / "m.safetensors", keys=["a"], rows={"a": (40, 50)}, scheduler=aiotensor.Scheduler(eng)))
    assert torch.equal(got["a"], w["a"][40:50])
    assert read_bytes(eng) <= 4096 + 10 * 64 * 4 + 4
    with pytest.raises(ValueError, match="rows"):
        await collect(stream(tmp_path / "m.safetensors", rows={"a": (90, 101)}))


async def test_row_slices_of_a_packed_tensor_are_specified_in_the_file_s_units(tmp_path: Any) -> None:
    """helper-72: rows of a 1-D float4_e2m1fn_x2 tensor (two values a byte; the file's shape counts
    values) were specified with the torch shape: a new tensor of half the length where the spec
    made one (CUDA); a CPU read counted bytes and was right."""
    from aiotensor import sources

    w = {"v": torch.randint(0, 255, (16,), dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
         "m": torch.randint(0, 255, (6, 4), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}  # fmt: skip
    await save_file(w, tmp_path / "f4.safetensors")
    src = sources.resolve(aiotensor.PosixEngine(), str(tmp_path / "f4.safetensors"))
    for e in src.entries:
        part = sources.with_rows(e, (2, 5)).parts[0].span.spec
        assert part.shape == ((6,) if e.names == ("v",) else (3, 8)) and part.nbytes == 3 * (1 if e.names == ("v",) else 4)
    got = await collect(stream(tmp_path / "f4.safetensors", rows={"v": (2, 5), "m": (2, 5)}))
    for k, v in w.items():
        assert torch.equal(got[k].view(torch.uint8), v[2:5].view(torch.uint8)), k


async def test_row_slices_of_torch_save_files_and_dcp_checkpoints(tmp_path: Any) -> None:
    """helper-39: rows= of a torch.save file or a DCP checkpoint raised a ValueError whose message
    was false ("need one stored tensor and 0 <= a <= b"); a tensor in one piece of its file (a
    contiguous view, one chunk) is sliced now, and one that is not is a MismatchError saying so."""
    import warnings

    import torch.distributed.checkpoint as dcp

    big = torch.randn(20, 4)
    w = {"w": torch.randn(8, 4), "v": big[5:15], "big": big, "t": torch.randn(4, 8).t()}
    torch.save(w, tmp_path / "m.pt")
    got = await collect(stream(tmp_path / "m.pt", keys=["w", "v"], rows={"w": (1, 3), "v": (2, 9)}))
    assert torch.equal(got["w"], w["w"][1:3]) and torch.equal(got["v"], big[7:14])
    with pytest.raises(MismatchError, match="'t': it is a strided view"):
        await collect(stream(tmp_path / "m.pt", keys=["t"], rows={"t": (0, 2)}))
    with pytest.raises(ValueError, match=r"need 0 <= a <= b <= \(8,\)"):
        await collect(stream(tmp_path / "m.pt", keys=["w"], rows={"w": (3, 9)}))
    # helper-41: a complex128 tensor (no safetensors dtype) was a KeyError; a tied weight's second
    # name's rows were ignored (both names got the whole tensor)
    c, tied = torch.randn(6, 2, dtype=torch.complex128), torch.randn(6, 4)
    torch.save({"c": c, "a": tied, "b": tied, "n": torch.randn(3, 2, dtype=torch.complex64).conj()}, tmp_path / "t.pt")
    with pytest.raises(MismatchError, match="a torch.complex128 tensor"):
        await collect(stream(tmp_path / "t.pt", keys=["c"], rows={"c": (1, 3)}))
    with pytest.raises(MismatchError, match="conjugated or negated view"):
        await collect(stream(tmp_path / "t.pt", keys=["n"], rows={"n": (0, 1)}))
    got = await collect(stream(tmp_path / "t.pt", keys=["a", "b"], rows={"b": (0, 2)}))
    assert torch.equal(got["a"], tied) and torch.equal(got["b"], tied[:2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": w["w"], "e": torch.randn(5, 3)}, checkpoint_id=str(tmp_path / "dcp"))
    got = await collect(stream(tmp_path / "dcp", rows={"w": (2, 8), "e": (0, 0)}))
    assert torch.equal(got["w"], w["w"][2:8]) and got["e"].shape == (0, 3)


async def test_aligned_torch_save_files_open_with_torch_load(tmp_path: Any) -> None:
    import zipfile

    from aiotensor.formats import torchsave as ts

    w = weights(5)
    await aiotensor.save_torch(w, tmp_path / "m.pt")
    assert all(torch.equal(v, w[k]) for k, v in torch.load(tmp_path / "m.pt", weights_only=True).items())
    with open(tmp_path / "m.pt", "rb") as f:
        with zipfile.ZipFile(f) as z:
            offsets = [
                ts._data_offset(f, i, os.path.getsize(tmp_path / "m.pt"), "m.pt") for i in z.infolist() if "/data/" in i.filename
            ]
    assert offsets and all(o % 4096 == 0 for o in offsets)
    assert all(torch.equal(v, w[k]) for k, v in (await aiotensor.load_torch(tmp_path / "m.pt")).items())


async def test_the_scheduler_reports_metrics(tmp_path: Any) -> None:
    await save_file(weights(), tmp_path / "m.safetensors")
    sched = aiotensor.Scheduler()
    await collect(stream(tmp_path / "m.safetensors", scheduler=sched))
    m = sched.metrics()
    assert m["bytes_read"] >= sum(t.nbytes for t in weights().values()) and m["bytes_in_flight"] == 0 and m["queue_depth"] == 0


def _modules_to_walk() -> dict[str, torch.nn.Module]:
    shared = torch.nn.Linear(3, 3)
    twice = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)  # one submodule under two names
    no_bias = torch.nn.Linear(2, 2, bias=False)  # a None parameter
    bn = torch.nn.BatchNorm1d(4)
    bn.register_buffer("scratch", torch.zeros(2), persistent=False)
    bn.register_buffer("absent", None)
    tied = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False))
    tied[1].weight = tied[0].weight
    nested = torch.nn.ModuleDict({"a": torch.nn.ModuleList([bn, no_bias]), "b": twice, "c": tied})
    transformer = torch.nn.Transformer(16, 2, 1, 1, 32, batch_first=True)
    odd = torch.nn.Module()
    setattr(odd, "", torch.nn.Linear(1, 1))  # a child named "" (setattr does not check): ".weight"
    return {"nested": nested, "transformer": transformer, "empty": torch.nn.Module(), "odd name": odd}


@pytest.mark.parametrize("name", ["nested", "transformer", "empty", "odd name"])
def test_a_modules_tensors_are_its_state_dicts_in_order(name: str) -> None:
    from aiotensor.serving.module import _plain_state

    module = _modules_to_walk()[name]
    want = module.state_dict(keep_vars=True)
    got = _plain_state(module)
    assert got is not None and list(got) == list(want) and all(got[k] is want[k] for k in want)


class _Extra(torch.nn.Linear):
    def get_extra_state(self) -> Any:
        return torch.ones(1)

    def set_extra_state(self, state: Any) -> None:
        pass


class _Saves(torch.nn.Linear):
    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "renamed"] = self.weight


@pytest.mark.parametrize(
    "how",
    ["post hook", "pre hook", "extra state", "own _save_to_state_dict", "instance state_dict", "instance _save_to_state_dict"],
)
async def test_a_module_that_saves_its_state_its_own_way_is_asked_for_its_state_dict(tmp_path: Any, how: str) -> None:
    from aiotensor.serving.module import _plain_state

    inner: torch.nn.Linear = {"extra state": _Extra, "own _save_to_state_dict": _Saves}.get(how, torch.nn.Linear)(2, 2)
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), inner)
    if how == "post hook":

        def renamed(m: Any, state: Any, prefix: str, meta: Any) -> None:
            state[prefix + "renamed"] = state.pop(prefix + "weight")

        inner._register_state_dict_hook(renamed)
    elif how == "pre hook":
        inner.register_state_dict_pre_hook(lambda *a: None)
    elif how == "instance state_dict":
        inner.state_dict = lambda *a, **k: {}  # type: ignore[method-assign]
    elif how == "instance _save_to_state_dict":
        inner._save_to_state_dict = lambda d, prefix, keep: d.__setitem__(prefix + "renamed", inner.weight)  # type: ignore[method-assign]
    assert _plain_state(module) is None
    # what state_dict() names (a hook's or an override's names), each tensor + 1, loads by those names
    names = [k for k, v in module.state_dict().items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")]
    want = {k: module.state_dict()[k].detach() + 1 for k in names}
    await save_file(want, tmp_path / "w.safetensors")
    got = await load_into(module, tmp_path / "w.safetensors", strict=False)
    assert not got.unexpected_keys and all(k.endswith("_extra_state") for k in got.missing_keys)
    assert_state_equal({k: module.state_dict()[k].detach() for k in names}, want)


async def test_a_stream_hands_a_tied_tensor_out_under_each_name_in_order(tmp_path: Any) -> None:
    w = torch.randn(4)
    state = {"a": w, "b": w, **{f"t{i}": torch.full((3,), float(i)) for i in range(300)}, "z": torch.ones(2)}
    async with TensorStore(tmp_path) as store:
        await store.save(1, state)
    got = [(n, t) async for n, t in stream(tmp_path, window_bytes=1024)]  # many batches
    assert [n for n, _ in got] == list(state)
    assert got[0][1] is got[1][1] and all(torch.equal(t, state[n]) for n, t in got)


def _inference_model() -> torch.nn.Module:
    """A server's module, made under inference_mode (every tensor an inference tensor), one weight
    non-contiguous (a transpose): torch refuses in-place writes to such tensors outside that mode."""
    with torch.inference_mode():
        m = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 4, bias=False))
        m[0].weight = torch.nn.Parameter(torch.zeros(8, 4).t(), requires_grad=False)
    return m


@pytest.mark.parametrize("fmt", ["safetensors", "torch.save", "bf16 safetensors"])
async def test_a_module_made_under_inference_mode_loads_and_swaps(tmp_path: Any, fmt: str) -> None:
    g = torch.Generator().manual_seed(3)
    want = {
        "0.weight": torch.randn(4, 8, generator=g),
        "0.bias": torch.randn(4, generator=g),
        "1.weight": torch.randn(4, 4, generator=g),
    }
    path = tmp_path / "m.bin"
    if fmt == "torch.save":
        torch.save(want, path)
    else:
        stored = {k: v.bfloat16() for k, v in want.items()} if fmt.startswith("bf16") else want
        st_save(stored, str(path))
        want = {k: v.float() for k, v in stored.items()}
    x = torch.randn(2, 8, generator=g)
    with torch.inference_mode():
        expected = torch.nn.functional.linear(torch.nn.functional.linear(x, want["0.weight"], want["0.bias"]), want["1.weight"])

    into = _inference_model()
    await load_into(into, path)
    assert_state_equal({k: v.detach() for k, v in into.state_dict().items()}, want)

    served = _inference_model()
    swap = await prepare_swap(served, path)
    swap.apply()
    assert all(p.is_inference() for p in served.parameters())  # an inference module stays one: it still runs
    with torch.inference_mode():
        assert torch.allclose(served(x), expected) and torch.allclose(into(x), expected)  # (layouts differ: not bit for bit)


class _Scaled(torch.nn.Linear):
    """FP8-style extra state: kept by get_extra_state / set_extra_state, not as a buffer."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.amax = torch.zeros(4)

    def get_extra_state(self) -> torch.Tensor:
        return self.amax.clone()

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.amax = state.clone()


class _Conv1D(torch.nn.Module):
    """A weight stored transposed, turned by a load_state_dict pre-hook (a layout change)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3, 5))
        self._register_load_state_dict_pre_hook(self._turn)

    @staticmethod
    def _turn(state: dict[str, torch.Tensor], prefix: str, *args: Any) -> None:
        if state[prefix + "w"].shape == (5, 3):
            state[prefix + "w"] = state[prefix + "w"].t()


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated")  # what wrote the old names
@pytest.mark.parametrize("kind", ["extra state", "load hook", "weight_norm's old names"])
async def test_a_module_that_loads_its_own_way_is_loaded_as_load_state_dict_loads_it(tmp_path: Any, kind: str) -> None:
    from torch.nn.utils.parametrizations import weight_norm

    if kind == "extra state":
        make: Any = lambda: torch.nn.Sequential(_Scaled())  # noqa: E731
        src = make()
        src[0].amax.fill_(3.0)
        state = src.state_dict()
    elif kind == "load hook":
        make = lambda: torch.nn.Sequential(_Conv1D())  # noqa: E731
        state = {"0.w": torch.arange(15.0).view(5, 3)}
    else:
        make = lambda: weight_norm(torch.nn.Linear(4, 4))  # noqa: E731
        state = torch.nn.utils.weight_norm(torch.nn.Linear(4, 4)).state_dict()  # old names: weight_g, weight_v
    st_save({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "m.safetensors"))
    want = make()
    want.load_state_dict({k: v.clone() for k, v in state.items()})
    got = make()
    result = await load_into(got, tmp_path / "m.safetensors")
    assert result == ([], [])
    assert_state_equal(
        {k: v.detach() for k, v in got.state_dict().items()}, {k: v.detach() for k, v in want.state_dict().items()}
    )
    if kind == "extra state":
        assert got[0].amax.tolist() == [3.0] * 4
    with pytest.raises(MismatchError, match="load_into"):  # a swap of tensors would skip it: said, not done
        await prepare_swap(make(), tmp_path / "m.safetensors")


async def test_a_file_without_batchnorms_num_batches_tracked_loads_strictly_as_in_torch(tmp_path: Any) -> None:
    make = lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))  # noqa: E731
    src = make()
    src[1].running_mean.fill_(2.0)
    state = {k: v for k, v in src.state_dict().items() if not k.endswith("num_batches_tracked")}
    st_save(state, str(tmp_path / "bn.safetensors"))
    assert make().load_state_dict(state, strict=True) is not None  # torch keeps it as it is
    got = make()
    assert await load_into(got, tmp_path / "bn.safetensors") == ([], [])
    assert got[1].running_mean.tolist() == [2.0] * 4 and got[1].num_batches_tracked.item() == 0
    swap = await prepare_swap(make(), tmp_path / "bn.safetensors")
    assert swap.missing_keys == []


async def test_a_swap_keeps_channels_last(tmp_path: Any) -> None:
    make = lambda: torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)  # noqa: E731
    src = make()
    st_save({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "c.safetensors"))
    served = make()
    (await prepare_swap(served, tmp_path / "c.safetensors")).apply()
    assert served.weight.is_contiguous(memory_format=torch.channels_last) and torch.equal(served.weight, src.weight)


async def test_torchs_own_overrides_that_change_nothing_keep_the_fast_path(tmp_path: Any) -> None:
    # weight norm's hook renames old names only: a file of today's names swaps; InstanceNorm's
    # override only refuses old running statistics; a meta module that loads its own way is refused
    from torch.nn.utils.parametrizations import weight_norm

    make = lambda: torch.nn.Sequential(weight_norm(torch.nn.Conv1d(2, 4, 3)), torch.nn.InstanceNorm1d(4, affine=True))  # noqa: E731
    src = make()
    st_save({k: v.detach().contiguous() + 1 for k, v in src.state_dict().items()}, str(tmp_path / "m.safetensors"))
    served = make()
    (await prepare_swap(served, tmp_path / "m.safetensors")).apply()
    assert_state_equal(
        {k: v.detach() for k, v in served.state_dict().items()}, {k: v.detach() + 1 for k, v in src.state_dict().items()}
    )
    with torch.device("meta"):
        meta = torch.nn.Sequential(_Conv1D())
    st_save({"0.w": torch.ones(5, 3)}, str(tmp_path / "c.safetensors"))
    with pytest.raises(MismatchError, match="materialize it first"):
        await load_into(meta, tmp_path / "c.safetensors")


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated")
async def test_weight_norm_of_another_name_loads_its_old_names(tmp_path: Any) -> None:
    from torch.nn.utils.parametrizations import weight_norm

    old = torch.nn.utils.weight_norm(torch.nn.LSTM(3, 4), name="weight_hh_l0")  # old names: weight_hh_l0_g/_v
    st_save({k: v.detach().contiguous() for k, v in old.state_dict().items()}, str(tmp_path / "m.safetensors"))
    want = weight_norm(torch.nn.LSTM(3, 4), name="weight_hh_l0")
    want.load_state_dict({k: v.detach().clone() for k, v in old.state_dict().items()})
    got = weight_norm(torch.nn.LSTM(3, 4), name="weight_hh_l0")
    assert await load_into(got, tmp_path / "m.safetensors") == ([], [])
    assert_state_equal(
        {k: v.detach() for k, v in got.state_dict().items()}, {k: v.detach() for k, v in want.state_dict().items()}
    )


def test_many_prefixes_select_what_a_few_do() -> None:
    """Above a few prefixes, keys= looks each name's own dot-prefixes up in a set: the same
    selection, and the same prefixes named as selecting nothing, as startswith over all of them."""
    import random

    from aiotensor import sources

    names = [f"layers.{i}.{p}" for i in range(60) for p in ("w", "b")] + ["a..b", "x.", ".y", "plain", "layers"]
    pool = [*names, "layers.", "a.", "a..", ".", "x.", "layers.1", "layers.10.", "nope.", *(f"layers.{i}." for i in range(70))]
    rnd = random.Random(0)
    for _ in range(200):
        keys = rnd.sample(pool, rnd.choice([1, 3, 17, 40, 80]))
        prefixes = tuple(k for k in keys if k.endswith("."))
        want = {n for n in names if n in keys or n.startswith(prefixes)}
        pick = sources.selector(keys)
        assert {n for n in names if pick(n)} == want, keys
        nothing = [k for k in keys if not (any(n.startswith(k) for n in want) if k.endswith(".") else k in want)]
        if nothing:
            with pytest.raises(MismatchError, match=re.escape(repr(nothing[0]))):
                sources.chosen(names, keys, "f")
        else:
            assert sources.chosen(names, keys, "f") == want, keys


@pytest.mark.parametrize("api", ["stream", "load_into", "prepare_swap", "load_torch"])
@pytest.mark.parametrize("how", ["renamed over", "written in place"])
async def test_a_file_replaced_between_its_header_and_its_data_fails_the_load(tmp_path: Any, api: str, how: str) -> None:
    """A file replaced (a deploy's rename, helper-59: 16-64 of 200 loads came back with garbage,
    the new file's bytes read by the old header; swaps applied them) or written in place after
    its header was read and before its data is: a SourceChangedError, the module untouched by
    the swap; a file replaced before anything was read loads whole."""
    from aiotensor.errors import SourceChangedError

    folder = tmp_path / "m"
    folder.mkdir()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    ones = {k: torch.full_like(v, 1.0) for k, v in model.state_dict().items()}
    twos = {k: torch.full_like(v, 2.0) for k, v in model.state_dict().items()}
    name = "pytorch_model.bin" if api == "load_torch" else "model.safetensors"
    target, other = folder / name, tmp_path / f"v2-{name}"
    if api == "load_torch":
        torch.save(ones, target)
        torch.save({"pad": torch.zeros(7), **twos}, other)  # (other offsets)
    else:
        st_save(ones, str(target))
        st_save(twos, str(other), metadata={"pad": "x" * 50})  # (other offsets)
    opens = 0

    def replace_before_the_data(op: tuple[Any, ...]) -> None:
        nonlocal opens
        if op[0] == "open_read" and op[1] == str(target):
            opens += 1
            if opens == 2:  # the header was read through the first
                if how == "renamed over":
                    os.replace(other, target)
                else:
                    target.write_bytes(other.read_bytes())

    sched = aiotensor.Scheduler(FaultyEngine(hook=replace_before_the_data))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(SourceChangedError, match="changed while it was being loaded"):
        if api == "stream":
            async with stream(folder, scheduler=sched) as s:
                async for _ in s:
                    pass
        elif api == "load_into":
            await load_into(model, folder, scheduler=sched)
        elif api == "prepare_swap":
            (await prepare_swap(model, folder, scheduler=sched)).apply()
        else:
            await aiotensor.load_torch(target, scheduler=sched)
    if api == "prepare_swap":
        assert_state_equal(model.state_dict(), before)
    got = await aiotensor.load_torch(target) if api == "load_torch" else await aiotensor.load_file(folder / name)
    assert all(torch.equal(got[k], twos[k]) for k in twos)  # the new file, whole, once it is there


async def test_what_a_server_passes_by_mistake_gets_a_clear_answer(tmp_path: Any) -> None:
    """helper-59: a model's index named instead of its folder reads the shards it names (it was
    a HeaderError about an 8-exabyte header); a folder given to load_file says what reads one; a
    torch.save file of the pre-1.6 format says so (it was a HeaderError); window_bytes=0 is
    refused, as stream refuses it."""
    from aiotensor.errors import UnsafeFileError, UnsafePathError

    w = weights(4, n=4)
    keys = sorted(w)
    halves = {"model-00001-of-00002.safetensors": keys[:2], "model-00002-of-00002.safetensors": keys[2:]}
    for f, ks in halves.items():
        await save_file({k: w[k] for k in ks}, tmp_path / f)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}))
    async with stream(index) as s:
        got = {name: t async for name, t in s}
    assert sorted(got) == keys and all(torch.equal(got[k], w[k]) for k in keys)
    async with TensorStore(tmp_path / "ckpt") as store:
        await store.save(3, {"w": w[keys[0]]})
    async with stream(tmp_path / "ckpt" / "step-000000000003" / "manifest.json") as s:  # a step's record: the step
        assert [name async for name, _ in s] == ["w"]
    with pytest.raises(UnsafePathError, match="is a folder: load_file and read_header read one safetensors file; stream"):
        await aiotensor.load_file(tmp_path)
    model = torch.nn.Linear(2, 2)
    for protocol in (2, 3, 4, 5):  # (4 and 5 were still HeaderError: helper-61)
        legacy = tmp_path / f"old{protocol}.pt"
        torch.save({"a": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
        with pytest.raises(UnsafeFileError, match="not a torch.save zip: the file is a pickle .a legacy torch.save"):
            await load_into(model, legacy)
    with pytest.raises(ValueError, match="window_bytes must be >= 1"):
        await load_into(model, tmp_path, window_bytes=0)


async def test_a_hugging_face_caches_index_named_reads_its_snapshot(tmp_path: Any) -> None:
    """helper-61: in a cache snapshot every file links to ../../blobs/<hash>; naming the index read
    the folder of its blob (FileNotFoundError), not the snapshot's shards."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev1"
    blobs.mkdir()
    snap.mkdir(parents=True)
    st_save({"a": torch.ones(2)}, str(blobs / "h1"))
    st_save({"b": torch.ones(3)}, str(blobs / "h2"))
    shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (blobs / "h3").write_text(json.dumps({"weight_map": shards}))
    for name, blob in [(shards["a"], "h1"), (shards["b"], "h2"), ("model.safetensors.index.json", "h3")]:
        (snap / name).symlink_to(os.path.join("..", "..", "blobs", blob))
    for what in (snap, snap / "model.safetensors.index.json"):
        async with stream(what) as s:
            assert sorted([k async for k, _ in s]) == ["a", "b"], what


async def test_load_into_an_expanded_buffer_is_a_mismatch_before_anything_is_read(tmp_path: Any) -> None:
    """helper-59: a module's buffer that is an expand()ed view (its elements share memory) made
    load_into fail with torch's bare RuntimeError; now a MismatchError naming it, planned before
    its file's reads (of a file of several, as here, none is read; a model's earlier files may have
    loaded, as before any load_into that fails part way: helper-62)."""
    st_save({"b": torch.ones(3, 4), "w": torch.full((2,), 7.0)}, str(tmp_path / "m.safetensors"))
    m = torch.nn.Module()
    m.register_buffer("b", torch.zeros(4).expand(3, 4))
    m.register_buffer("w", torch.zeros(2))
    with pytest.raises(MismatchError, match="the module's tensor 'b' is expanded \\(a stride of 0\\): its elements share memory"):
        await load_into(m, tmp_path / "m.safetensors")
    assert torch.equal(m.w, torch.zeros(2))  # nothing read


async def test_load_into_refuses_a_module_tensor_whose_elements_overlap(tmp_path: Any) -> None:
    """A parameter made by as_strided with overlapping strides: load_into filled it, each location
    with whichever value came last (torch's copy_ says nothing either); now a MismatchError naming
    it, before anything is read. A transposed or sliced parameter still loads."""
    from safetensors.torch import save_file

    w, b = torch.randn(4, 4), torch.randn(4)
    save_file({"weight": w, "bias": b}, tmp_path / "m.safetensors")
    m = torch.nn.Linear(4, 4)
    m.weight.data = torch.zeros(16).as_strided((4, 4), (1, 1))
    with pytest.raises(MismatchError, match="the module's tensor 'weight' has strides \\[1, 1\\]"):
        await aiotensor.load_into(m, tmp_path / "m.safetensors")
    assert not m.weight.any()
    m.weight.data = torch.zeros(4, 4).t()
    await aiotensor.load_into(m, tmp_path / "m.safetensors")
    assert torch.equal(m.weight, w) and torch.equal(m.bias, b)
    # helper-67: one too big to count (2M rows; 0 here) was taken as not overlapping, and filled
    from unittest import mock

    from aiotensor._io import tensors as tensors_module

    m.weight.data = torch.zeros(32).as_strided((4, 4), (2, 4))  # [2][0] is [0][1]: found by counting only
    with mock.patch.object(tensors_module, "_COUNTED", 0), pytest.raises(MismatchError, match="'weight' has strides"):
        await aiotensor.load_into(m, tmp_path / "m.safetensors")
    assert not m.weight.any()


async def test_load_into_refuses_two_tensors_that_share_part_of_their_memory(tmp_path: Any) -> None:
    """helper-67: two parameters that are overlapping views of one buffer were each read in turn,
    the shared bytes left holding whichever came last; now a MismatchError naming both, before
    anything is read (store.load(into=) and load_file(into=) too). Views of one buffer that do not
    overlap (a flat parameter's) and a tie (one tensor under two names) still load."""
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    await save_file({"a.weight": a, "b.weight": b}, tmp_path / "m.safetensors")
    flat = torch.zeros(24)
    m = torch.nn.Module()
    m.a, m.b = torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False)
    m.a.weight = torch.nn.Parameter(flat[0:16].view(4, 4))
    m.b.weight = torch.nn.Parameter(flat[8:24].view(4, 4))
    for tied in (False, True):  # (a tie elsewhere in the module: the plan's loop, not its columns)
        if tied:
            m.c, m.d = torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False)
            m.d.weight = m.c.weight
        with pytest.raises(MismatchError, match="'a.weight' and 'b.weight' of the module share part of their memory"):
            await load_into(m, tmp_path / "m.safetensors", strict=False)
        assert not flat.any()
    into = {"a.weight": flat[0:16].view(4, 4), "b.weight": flat[8:24].view(4, 4)}
    with pytest.raises(MismatchError, match="of `into` share part of their memory"):
        await aiotensor.load_file(tmp_path / "m.safetensors", into=into)
    # helper-68: a strided view beside another (a transpose, a column slice) went unchecked
    for into in ({"a.weight": flat[0:16].view(4, 4), "b.weight": flat[0:16].view(4, 4).t()},
                 {"a.weight": flat[0:16].view(4, 4), "b.weight": flat[0:24].view(4, 6)[:, 1:5]}):  # fmt: skip
        with pytest.raises(MismatchError, match="of `into` share part of their memory"):
            await aiotensor.load_file(tmp_path / "m.safetensors", into=into)
    # and a module's tensors filled after a conversion (a float16 file)
    await save_file({"a.weight": a.half(), "b.weight": b.half()}, tmp_path / "half.safetensors")
    with pytest.raises(MismatchError, match="'a.weight' and 'b.weight' of the module share part of their memory"):
        await load_into(m, tmp_path / "half.safetensors", strict=False)
    assert not flat.any()
    flat = torch.zeros(32)
    m.a.weight, m.b.weight = torch.nn.Parameter(flat[0:16].view(4, 4)), torch.nn.Parameter(flat[16:32].view(4, 4))
    await load_into(m, tmp_path / "m.safetensors", strict=False)
    assert torch.equal(flat, torch.cat([a.reshape(-1), b.reshape(-1)]))
    m.b.weight = m.a.weight  # a tie: one tensor, filled by whichever name the file has
    await save_file({"a.weight": b}, tmp_path / "tied.safetensors")
    await load_into(m, tmp_path / "tied.safetensors", strict=False)
    assert torch.equal(m.b.weight, b)


async def test_a_stream_cut_short_by_a_cancelled_wait_says_so_when_asked_again(tmp_path: Any) -> None:
    """A per-tensor timeout (``wait_for(anext(s), t)``) cancels the wait and closes the stream; a
    consumer that went on got StopAsyncIteration, as if the file had no more tensors, and kept
    part of the weights (helper-66). Now a StreamClosedError; a stream closed by aclose() still
    ends as an iterator does."""
    import asyncio
    import threading

    from aiotensor.errors import StreamClosedError
    from aiotensor.testing import FaultyEngine

    st_save({f"t{i}": torch.randn(1 << 16) for i in range(8)}, str(tmp_path / "m.safetensors"))
    slow = threading.Event()

    def hook(op: tuple[Any, ...]) -> None:
        if slow.is_set() and op[0] in ("pread", "preadv", "readinto"):
            threading.Event().wait(0.2)  # a slow disk: the consumer's timeout comes first

    sched = aiotensor.Scheduler(FaultyEngine(hook=hook))
    try:
        async with stream(tmp_path / "m.safetensors", scheduler=sched, window_bytes=1 << 18) as s:
            await anext(s)
            slow.set()
            with pytest.raises(TimeoutError):
                while True:
                    await asyncio.wait_for(anext(s), 0.05)
            with pytest.raises(StreamClosedError, match="closed part way \\(a wait for its next tensor was cancelled\\)"):
                await anext(s)
    finally:
        sched.close()
    async with stream(tmp_path / "m.safetensors") as s:
        await anext(s)
        await s.aclose()
        with pytest.raises(StopAsyncIteration):
            await anext(s)


async def test_ties_whose_names_a_torch_save_file_stores_under_shared_storages(tmp_path: Any) -> None:
    """helper-73: a tie of three names (a, b, c one tensor) whose file stores a and c as one
    storage and b apart got b's value (load_state_dict leaves c's, the last); a file entry holding
    a tie's earlier name and an untied name (x, a storage shared with a) was dropped whole, x
    left unfilled and not reported missing; a swap took the file's last of a tie."""
    x, y = torch.full((4,), 1.0), torch.full((4,), 2.0)

    class Three(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(4))
            self.b = self.c = self.a
            self.x = torch.nn.Parameter(torch.zeros(4))

    cases = {"three": {"a": x, "b": y, "c": x, "x": y}, "shared": {"a": x, "b": y, "c": y, "x": x}}
    for name, state in cases.items():
        torch.save(state, tmp_path / f"{name}.pt")
        ref = Three()
        ref.load_state_dict(torch.load(tmp_path / f"{name}.pt"))
        for how in ("load_into", "prepare_swap"):
            m = Three()
            if how == "load_into":
                assert await load_into(m, tmp_path / f"{name}.pt") == ([], [])
            else:
                (await prepare_swap(m, tmp_path / f"{name}.pt")).apply()
            assert m.a is m.b is m.c and torch.equal(m.a, ref.a) and torch.equal(m.x, ref.x), (name, how)


async def test_keys_naming_a_tie_s_unstored_name_and_a_storage_shared_across_a_tie(tmp_path: Any) -> None:
    """helper-76: keys= naming a tie's name the file lacks (a, b stored apart, c not) read the
    file's first of them (load_state_dict leaves b's, the module's last stored name); a swap of a
    torch.save storage under two names (a, b) where the module ties a to c and b is apart raised
    a KeyError (and would have tied b to a)."""

    def tied3() -> torch.nn.ModuleDict:
        m = torch.nn.ModuleDict({k: torch.nn.Linear(4, 3, bias=False) for k in "abc"})
        m.b.weight = m.c.weight = m.a.weight
        return m

    st_save({"a.weight": torch.full((3, 4), 1.0), "b.weight": torch.full((3, 4), 2.0)}, str(tmp_path / "ab.safetensors"))
    ref = tied3()
    ref.load_state_dict({"a.weight": torch.full((3, 4), 1.0), "b.weight": torch.full((3, 4), 2.0)}, strict=False)
    assert ref.a.weight.eq(2.0).all()
    for how in ("load_into", "meta", "prepare_swap"):
        if how == "meta":
            with torch.device("meta"):
                m = tied3()
        else:
            m = tied3()
        if how == "prepare_swap":
            (await prepare_swap(m, tmp_path / "ab.safetensors", keys=["c.weight"])).apply()
        else:
            await load_into(m, tmp_path / "ab.safetensors", keys=["c.weight"])
        assert m.a.weight is m.c.weight and m.c.weight.eq(2.0).all(), how
    x = torch.ones(3, 4)
    torch.save({"a.weight": x, "b.weight": x}, tmp_path / "shared.pt")
    m = torch.nn.ModuleDict({k: torch.nn.Linear(4, 3, bias=False) for k in "abc"})
    m.c.weight = m.a.weight
    swap = await prepare_swap(m, tmp_path / "shared.pt", strict=False)
    swap.apply()
    assert m.a.weight is m.c.weight and m.b.weight is not m.a.weight
    assert m.a.weight.eq(1).all() and m.b.weight.eq(1).all()
    assert m.b.weight.data_ptr() != m.a.weight.data_ptr()


async def test_a_store_load_into_a_tie_with_an_alias_reads_one_stored_tensor(tmp_path: Any) -> None:
    """helper-73: a step storing a (x its alias) and b apart, loaded into one tensor under x and b
    (strict=False, into lacking a) read both stored tensors into it; under a, b and x (strict), the
    last key's value lost to b's. Now the tie gets the stored tensor its last key reads."""
    n = 1 << 20
    a, b = torch.arange(n, dtype=torch.float32), -torch.arange(n, dtype=torch.float32)
    async with TensorStore(tmp_path / "s") as store:
        await store.save(1, {"a": a, "x": a, "b": b})
        for order, strict in ((("x", "b"), False), (("b", "x"), False), (("a", "b", "x"), True), (("x", "b", "a"), True)):
            t = torch.zeros(n)
            read: list[int] = []
            await store.load(1, into={k: t for k in order}, strict=strict, progress=lambda d, total: read.append(total))
            assert torch.equal(t, b if order[-1] == "b" else a) and read[-1] == 4 * n, (order, strict)


async def test_a_swap_refuses_a_module_that_keeps_a_view_of_a_weight_it_replaces(tmp_path: Any) -> None:
    """helper-72: a non-persistent buffer that is a view of a parameter (a fused weight's slice)
    kept the old weights after apply(), where load_into and load_state_dict fill it. Now
    prepare_swap refuses such a module (nothing switched); one whose buffers have memory of
    their own, and keys= leaving out a parameter of its own memory, still swap."""

    class Fused(torch.nn.Module):
        def __init__(self, view: bool) -> None:
            super().__init__()
            self.qkv, self.out = torch.nn.Parameter(torch.zeros(6, 4)), torch.nn.Parameter(torch.zeros(4))
            self.register_buffer("q", self.qkv.data[:2] if view else torch.zeros(2, 4), persistent=False)

    await save_file({"qkv": torch.ones(6, 4), "out": torch.ones(4)}, tmp_path / "w.safetensors")
    m = Fused(view=True)
    with pytest.raises(MismatchError, match="'q' shares memory with 'qkv'"):
        await prepare_swap(m, tmp_path / "w.safetensors")
    assert m.qkv.eq(0).all()
    await load_into(m, tmp_path / "w.safetensors")
    assert m.q.eq(1).all()
    for keys in (None, "out"):
        m = Fused(view=keys is not None)
        (await prepare_swap(m, tmp_path / "w.safetensors", keys=keys)).apply()
        assert m.out.eq(1).all() and (m.qkv.eq(1).all() if keys is None else m.qkv.eq(0).all())
    m = Fused(view=False)  # helper-73: a sparse buffer (no data pointer) failed the check with a RuntimeError
    adj = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.ones(2), (2, 2), check_invariants=True)
    m.register_buffer("adj", adj, persistent=False)
    (await prepare_swap(m, tmp_path / "w.safetensors")).apply()
    assert m.qkv.eq(1).all()
