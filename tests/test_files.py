"""save_file / load_file: interop with the safetensors package both ways."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import pytest
import torch
from safetensors.torch import load_file as st_load
from safetensors.torch import save_file as st_save

import aiotensor
from aiotensor.errors import ChecksumError, HeaderError, MismatchError, StateError
from aiotensor.testing import FaultyEngine

from .conftest import assert_state_equal
from .test_store import DTYPES, random_tensor

pytestmark = pytest.mark.anyio


def tensors() -> dict[str, torch.Tensor]:
    out = {str(d).removeprefix("torch."): random_tensor(d, (7, 3), i) for i, d in enumerate(DTYPES)}
    out["scalar"] = torch.tensor(1.5)
    out["empty"] = torch.empty(0)
    return out


async def test_our_files_load_with_safetensors(tmp_path: Any) -> None:
    t = tensors()
    t["strided"] = torch.randn(6, 6)[:, ::2]
    await aiotensor.save_file(t, tmp_path / "m.safetensors", {"note": "hi"})
    assert_state_equal({k: t[k] for k in sorted(t)}, {k: v for k, v in sorted(st_load(str(tmp_path / "m.safetensors")).items())})
    data = (tmp_path / "m.safetensors").read_bytes()
    assert int.from_bytes(data[:8], "little") % 4096 == 4088  # data section starts at 4096 * k
    assert [n for n in os.listdir(tmp_path) if n != "m.safetensors"] == []


async def test_safetensors_files_load_with_us(tmp_path: Any) -> None:
    t = tensors()
    st_save(t, str(tmp_path / "m.safetensors"))
    out = await aiotensor.load_file(tmp_path / "m.safetensors")
    assert_state_equal({k: t[k] for k in sorted(t)}, {k: out[k] for k in sorted(out)})
    into = {k: torch.empty_like(v) for k, v in t.items()}
    await aiotensor.load_file(tmp_path / "m.safetensors", into=into)
    assert_state_equal(t, into)
    with pytest.raises(MismatchError, match="'scalar'"):
        await aiotensor.load_file(tmp_path / "m.safetensors", into={**into, "scalar": torch.empty(2)})


async def test_save_file_replaces_atomically_and_refuses_bad_input(tmp_path: Any) -> None:
    p = tmp_path / "m.safetensors"
    await aiotensor.save_file({"a": torch.ones(3)}, p)
    with pytest.raises(StateError, match="'b'"):
        await aiotensor.save_file({"a": torch.ones(3), "b": 5}, p)  # type: ignore[dict-item]
    with pytest.raises(StateError, match="metadata"):
        await aiotensor.save_file({"a": torch.ones(3)}, p, {"k": 1})  # type: ignore[dict-item]
    with pytest.raises(StateError, match="cannot be named '__metadata__'"):  # the header's own member
        await aiotensor.save_file({"a": torch.ones(3), "__metadata__": torch.ones(2)}, p)
    assert torch.equal((await aiotensor.load_file(p))["a"], torch.ones(3))
    await aiotensor.save_file({"a": torch.zeros(3)}, p)
    assert torch.equal((await aiotensor.load_file(p))["a"], torch.zeros(3))


async def test_overwriting_a_file_a_reader_has_mapped_keeps_the_reader_intact(tmp_path: Any) -> None:
    p = tmp_path / "m.safetensors"
    await aiotensor.save_file({"a": torch.arange(1000.0)}, p)
    mapped = st_load(str(p))  # safetensors mmaps the file
    from safetensors import safe_open

    with safe_open(str(p), "pt") as f:
        lazy = f.get_slice("a")
        await aiotensor.save_file({"a": torch.zeros(1000)}, p)  # a new inode: the mapping keeps the old one
        assert torch.equal(lazy[:], torch.arange(1000.0))
    assert torch.equal(mapped["a"], torch.arange(1000.0))
    assert torch.equal((await aiotensor.load_file(p))["a"], torch.zeros(1000))


async def test_load_file_errors(tmp_path: Any) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        await aiotensor.load_file(tmp_path / "nope")
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(HeaderError, match="empty: file is 0 bytes"):
        await aiotensor.load_file(tmp_path / "empty")


async def test_saving_over_a_file_a_reader_has_mmapped_leaves_the_reader_intact(tmp_path: Any) -> None:
    """safetensors#762: writing in place over a mapped file showed the reader zeros. save_file
    writes a new file and renames it over the old one, so the old mapping keeps the old bytes."""
    from safetensors import safe_open

    path = tmp_path / "m.safetensors"
    old = {"w": torch.arange(100_000, dtype=torch.float32)}
    await aiotensor.save_file(old, path)
    with safe_open(str(path), framework="pt") as reader:  # mmaps the file
        await aiotensor.save_file({"w": torch.zeros(100_000)}, path)
        assert torch.equal(reader.get_tensor("w"), old["w"])
    assert torch.equal((await aiotensor.load_file(path))["w"], torch.zeros(100_000))


async def test_lazy_conj_and_neg_views_are_written_as_their_values(tmp_path: Any) -> None:
    # regression: save_file wrote these from their raw memory (RuntimeError from torch.view)
    x = torch.randn(7, dtype=torch.complex64)
    n = torch.randn(5)._neg_view()
    path = str(tmp_path / "v.safetensors")
    await aiotensor.save_file({"conj": x.conj(), "neg": n}, path)
    got = st_load(path)
    assert torch.equal(got["conj"], x.conj().resolve_conj()) and torch.equal(got["neg"], n.resolve_neg())


async def test_load_file_to_a_device_this_machine_lacks_is_a_clear_error(tmp_path: Any) -> None:
    path = str(tmp_path / "d.safetensors")
    await aiotensor.save_file({"a": torch.ones(3)}, path)
    assert (await aiotensor.load_file(path, device="cpu"))["a"].equal(torch.ones(3))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cannot load to cuda"):
            await aiotensor.load_file(path, device="cuda")
        with pytest.raises(StateError, match="'a'"):
            await aiotensor.save_file({"a": torch.ones(3, device="meta")}, path)


async def test_big_tensors_are_written_in_page_aligned_blocks_bypassing_the_page_cache(tmp_path: Any) -> None:
    # tensors wherever torch put them (not page-aligned), odd sizes: assembled into aligned slots
    t = {f"w{i}": torch.randn(1000 + i, 777) for i in range(4)} | {"tail": torch.randn(3), "i8": torch.ones(5, dtype=torch.int8)}
    eng = FaultyEngine()
    sched = aiotensor.Scheduler(eng, chunk_bytes=1 << 20)
    path = tmp_path / "big.safetensors"
    try:
        await aiotensor.save_file(t, path, scheduler=sched)
    finally:
        sched.close()
    creates = [op for op in eng.ops if op[0] == "create"]
    assert len(creates) == 1 and creates[0][2] is True  # O_DIRECT asked for
    writes = [op for op in eng.ops if op[0] == "pwrite"]
    assert all(off % 4096 == 0 and n % 4096 == 0 for _, _, off, n in writes)
    assert_state_equal(t, st_load(str(path)))  # the real safetensors reads every byte back
    info = await aiotensor.read_header(path)
    assert os.path.getsize(path) == info.size  # the padded last block was cut off
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert info.size == 8 + header_len + sum(v.nbytes for v in t.values())
    got = await aiotensor.load_file(path, into={"tail": torch.zeros(3)}, strict=False)  # only what is asked for
    assert list(got) == ["tail"] and torch.equal(got["tail"], t["tail"])
    with pytest.raises(MismatchError, match=r"does not match the file .*: unexpected keys \['i8'"):
        await aiotensor.load_file(path, into={"tail": torch.zeros(3)})


async def test_a_sharded_model_loads_shard_by_shard_into_one_state(tmp_path: Any) -> None:
    """load_file(shard, into=full, strict=False), as load_state_dict(strict=False) means it: the
    entries other shards hold are missing keys, and left alone (issue 23.14)."""
    from safetensors.torch import save_file as st_save

    g = torch.Generator().manual_seed(3)
    full = {f"layers.{i}.w": torch.randn(8, 4, generator=g) for i in range(6)}
    shards = [dict(list(full.items())[:3]), dict(list(full.items())[3:])]
    for i, part in enumerate(shards):
        st_save(part, str(tmp_path / f"model-{i}.safetensors"))  # the real writer, as save_pretrained shards
    into = {k: torch.zeros_like(v) for k, v in full.items()}
    for i in range(2):
        got = await aiotensor.load_file(tmp_path / f"model-{i}.safetensors", into=into, strict=False)
        assert got.keys() == into.keys()
    assert_state_equal(full, into)
    with pytest.raises(MismatchError, match=r"missing keys \['layers.3.w'[^)]*\(only in `into`\)$"):
        await aiotensor.load_file(tmp_path / "model-0.safetensors", into=into)
    # strict=False still checks what both have
    with pytest.raises(MismatchError, match="layers.0.w"):
        await aiotensor.load_file(tmp_path / "model-0.safetensors", into={"layers.0.w": torch.zeros(4, 8)}, strict=False)


async def test_a_failed_block_write_leaves_the_old_file_and_no_temporary(tmp_path: Any) -> None:
    import errno

    path = tmp_path / "big.safetensors"
    old = {"old": torch.ones(3)}
    await aiotensor.save_file(old, path)
    t = {f"w{i}": torch.randn(1000, 777) for i in range(3)}  # big enough for the O_DIRECT blocks
    eng = FaultyEngine(fail={"pwrite": (2, errno.ENOSPC)})
    sched = aiotensor.Scheduler(eng, chunk_bytes=1 << 20)
    try:
        with pytest.raises(OSError) as info:
            await aiotensor.save_file(t, path, scheduler=sched)
    finally:
        sched.close()
    assert info.value.errno == errno.ENOSPC and "big.safetensors.tmp-" in str(info.value)  # names the file
    assert next(op for op in eng.ops if op[0] == "create")[2] is True  # it was the block path that failed
    assert_state_equal(old, st_load(str(path)))  # the old file, untouched
    assert os.listdir(tmp_path) == ["big.safetensors"]  # the temporary file was removed


async def test_load_file_keys_reads_only_what_they_select(tmp_path: Any) -> None:
    """keys= as stream takes them: names, prefixes, a predicate; the other tensors' bytes are never
    read (a corrupt one among them goes unnoticed), and a name or prefix that selects nothing is named."""
    state = {f"layers.{i}.{p}": torch.full((64,), float(i)) for i in range(3) for p in ("w", "b")} | {"head": torch.ones(8)}
    path = tmp_path / "m.safetensors"
    await aiotensor.save_file(state, path)
    got = await aiotensor.load_file(path, keys=["layers.1.", "head"])
    assert set(got) == {"layers.1.w", "layers.1.b", "head"} and all(torch.equal(got[k], state[k]) for k in got)
    assert set(await aiotensor.load_file(path, keys=(k for k in ["head"]))) == {"head"}  # a generator
    assert set(await aiotensor.load_file(path, keys=lambda k: k.endswith(".b"))) == {f"layers.{i}.b" for i in range(3)}
    assert await aiotensor.load_file(path, keys=lambda k: False) == {}
    with pytest.raises(MismatchError, match=r"select nothing for 'layers.7.', 'layers' \(did you mean the prefix 'layers.'\?\)"):
        await aiotensor.load_file(path, keys=["layers.7.", "layers", "head"])
    with pytest.raises(ValueError, match="keys="):
        await aiotensor.load_file(path, keys="head", into={"head": torch.zeros(8)})
    with pytest.raises(ValueError, match="keys="):
        await aiotensor.load_file(path, keys="head", mmap=True)
    # a corrupt tensor outside keys is never read; inside, it is refused
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    bad = "layers.2.w"
    data[8 + n + header[bad]["data_offsets"][0]] ^= 1
    path.write_bytes(bytes(data))
    assert set(await aiotensor.load_file(path, keys=lambda k: k != bad)) == set(state) - {bad}
    with pytest.raises(ChecksumError, match=bad):
        await aiotensor.load_file(path, keys="layers.2.")


@pytest.mark.parametrize("how", ["load_into", "load_file", "store", "store_dcp", "swap"])
async def test_a_load_in_place_tells_autograd_as_load_state_dict_does(tmp_path: Any, how: str) -> None:
    """helper-47: the loads that fill tensors in place left their version counters as they were,
    so a graph made from the old weights ran ``backward()`` on the new ones, silently wrong (torch's
    ``load_state_dict`` moves the counter, and autograd refuses). Every in-place load moves it."""
    import torch.distributed.checkpoint as dcp

    from aiotensor.dcp import AiotensorWriter

    w = torch.full((1, 3), 5.0)
    await aiotensor.save_file({"weight": w}, tmp_path / "w.safetensors")
    if how == "store_dcp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (DCP: "assuming the intent is to save in a single process")
            dcp.save({"weight": w}, storage_writer=AiotensorWriter(tmp_path / "s" / "step-000000000001"))
    elif how == "store":
        async with aiotensor.TensorStore(tmp_path / "s") as store:
            await store.save(1, {"weight": w})
    lin = torch.nn.Linear(3, 1, bias=False)
    z = (lin.weight * lin.weight).sum()  # autograd keeps the weight as it is now
    before = lin.weight._version
    if how == "load_into":
        await aiotensor.load_into(lin, tmp_path / "w.safetensors")
    elif how == "swap":  # (helper-49: the swap's p.data = new moved nothing either)
        (await aiotensor.prepare_swap(lin, tmp_path / "w.safetensors")).apply()
    elif how == "load_file":
        await aiotensor.load_file(tmp_path / "w.safetensors", into=dict(lin.named_parameters()))
    else:
        async with aiotensor.TensorStore(tmp_path / "s", readonly=True) as store:
            await store.load(into={"weight": lin.weight})
    assert torch.equal(lin.weight.detach(), w) and lin.weight._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()
    with torch.inference_mode():  # an inference tensor keeps no counter: loaded all the same
        frozen = torch.zeros(1, 3)
    await aiotensor.load_file(tmp_path / "w.safetensors", into={"weight": frozen})
    assert torch.equal(frozen, w)


@pytest.mark.parametrize("how", ["load_into", "load_file", "store"])
async def test_a_load_in_place_that_fails_partway_tells_autograd_too(tmp_path: Any, how: str) -> None:
    """A load in place that fails after it began writing (a checksum mismatch in the last tensor,
    the first already read) leaves the tensors' old values gone: their version counters move, so a
    graph made from the old weights refuses ``backward()`` as after a load that succeeds."""
    a, b = torch.full((64,), 5.0), torch.full((64,), 7.0)
    path = tmp_path / "w.safetensors"
    await aiotensor.save_file({"a": a, "b": b}, path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # (b's last byte)
    path.write_bytes(bytes(data))
    if how == "store":
        async with aiotensor.TensorStore(tmp_path / "s") as store:
            await store.save(1, {"a": a, "b": b})
        shard = next((tmp_path / "s" / "step-000000000001").glob("*.safetensors"))
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 0xFF
        shard.write_bytes(bytes(raw))

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Parameter(torch.zeros(64)), torch.nn.Parameter(torch.zeros(64))

    m = M()
    z = (m.a * m.a).sum() + (m.b * m.b).sum()
    with pytest.raises(ChecksumError):
        if how == "load_into":
            await aiotensor.load_into(m, path)
        elif how == "load_file":
            await aiotensor.load_file(path, into=dict(m.named_parameters()))
        else:
            async with aiotensor.TensorStore(tmp_path / "s", readonly=True) as store:
                await store.load(into=dict(m.named_parameters()), atomic=False)
    assert torch.equal(m.a.detach(), a)  # (written before the failure)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


async def test_into_and_tensors_of_the_wrong_kind_are_typed_errors(tmp_path: Any) -> None:
    """helper-47: ``into={"a": 3}`` (or None) raised AttributeError ('int' object has no attribute
    'is_meta'), and ``save_file([t], ...)`` AttributeError ('list' object has no attribute 'items')."""
    path = tmp_path / "a.safetensors"
    await aiotensor.save_file({"a": torch.ones(2)}, path)
    for odd in (3, None, [1.0, 1.0]):
        with pytest.raises(MismatchError, match="where a tensor is read"):
            await aiotensor.load_file(path, into={"a": odd})

    class Extra(torch.nn.Linear):  # a module's non-tensor _extra_state (Transformer Engine's fp8 meta)
        def get_extra_state(self) -> Any:
            return {"fp8_meta": 1}

        def set_extra_state(self, state: Any) -> None:
            pass

    sd = Extra(2, 2).state_dict()
    await aiotensor.save_file({"weight": torch.ones(2, 2), "bias": torch.zeros(2)}, tmp_path / "e.safetensors")
    await aiotensor.load_file(tmp_path / "e.safetensors", into=sd, strict=False)  # left alone (helper-49)
    assert torch.equal(sd["weight"], torch.ones(2, 2)) and sd["_extra_state"] == {"fp8_meta": 1}
    with pytest.raises(MismatchError, match="_extra_state"):  # strict: a missing key, as load_state_dict says
        await aiotensor.load_file(tmp_path / "e.safetensors", into=sd)
    with pytest.raises(TypeError, match="mapping of names to tensors"):
        await aiotensor.save_file([torch.ones(1)], tmp_path / "b.safetensors")  # type: ignore[arg-type]
    assert not (tmp_path / "b.safetensors").exists()


async def test_load_into_a_dtype_torch_cannot_convert_to_is_refused_before_reading(tmp_path: Any) -> None:
    """helper-47: a float4 file loaded into a uint8 buffer raised torch's bare NotImplementedError
    ("copy_" not implemented for 'Float4_e2m1fn_x2') once the reads were under way; it is a
    MismatchError naming the tensor, before anything is read."""
    packed = torch.arange(12, dtype=torch.uint8).view(4, 3).view(torch.float4_e2m1fn_x2)
    await aiotensor.save_file({"x": packed, "y": torch.ones(2)}, tmp_path / "f4.safetensors")
    m = torch.nn.Module()
    m.register_buffer("x", torch.zeros(4, 3, dtype=torch.uint8))
    m.register_buffer("y", torch.zeros(2))
    with pytest.raises(MismatchError, match="'x'.*float4_e2m1fn_x2.*cannot copy"):
        await aiotensor.load_into(m, tmp_path / "f4.safetensors")
    assert not m.x.any() and not m.y.any()  # nothing read


async def test_a_cancelled_save_file_removes_its_temporary_through_a_second_task_cancel(
    tmp_path: Any, anyio_backend: Any
) -> None:
    """save_file cancelled during its write, then cancelled again (a TaskGroup or a shutdown
    cancelling twice) while its clean-up waited for admission behind a load: the removal was
    withdrawn, and the hidden temporary stayed beside the user's file, which nothing else removes
    (helper-57: 5 of 5). The clean-up is handed to its thread at once and waited out."""
    if anyio_backend[0] != "asyncio":
        pytest.skip("asyncio's own Task.cancel()")
    import asyncio
    import contextlib
    import threading
    import time

    from aiotensor import PosixEngine
    from aiotensor._runtime.scheduler import Priority, Scheduler

    path = tmp_path / "model.safetensors"
    in_write, go_write, hold = threading.Event(), threading.Event(), threading.Event()
    loop = asyncio.get_running_loop()
    blockers: list[Any] = []

    class Eng(PosixEngine):
        def pwrite(self, fd: int, buf: Any, off: int) -> int:
            in_write.set()
            go_write.wait(5)
            return super().pwrite(fd, buf, off)

        def close(self, fd: int) -> None:  # the written file's close: a load queues meanwhile, taking the one worker
            loop.call_soon_threadsafe(
                lambda: blockers.append(asyncio.ensure_future(sched.call(hold.wait, 5, priority=Priority.LOAD)))
            )
            time.sleep(0.05)
            super().close(fd)

    sched = Scheduler(Eng(direct=False), workers=1)
    task = asyncio.ensure_future(aiotensor.save_file({"w": torch.randn(1 << 14)}, str(path), scheduler=sched))
    while not in_write.is_set():
        await asyncio.sleep(0.005)
    task.cancel()  # held through the write (its thread is waited out)
    go_write.set()
    await asyncio.sleep(0.3)  # the write ended, the file closed, the load admitted: the clean-up waits
    task.cancel()
    await asyncio.sleep(0.05)
    hold.set()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await asyncio.gather(*blockers)
    assert os.listdir(tmp_path) == []
