"""Reads at the disk's limit (issue 26): what the page cache holds is copied from it, the rest read
with O_DIRECT in big pieces, straight into page-aligned blocks the library allocates or through
bounce slots; new CPU tensors of one file carved from few allocations. Every path gives the same
bytes, checked against the checksums, cold, warm and half-warm."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import itertools
import json
import math
import os
import pickle
import stat
from typing import Any

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs
from safetensors.torch import save_file as save_st

import aiotensor
from aiotensor import knobs, sources
from aiotensor._io import read
from aiotensor._io.assemble import Entry, stored_bytes
from aiotensor._io.tensors import Target, crc_of_pieces
from aiotensor._runtime.scheduler import batched
from aiotensor.engines import PosixEngine
from aiotensor.errors import ChecksumError, FormatError, MismatchError
from aiotensor.formats import checksum
from aiotensor.formats.safetensors import TensorSpec
from aiotensor.testing import evict

pytestmark = pytest.mark.anyio


def warm(path: Any, upto: int | None = None) -> None:
    """Bring the file's first ``upto`` bytes (all by default) into the page cache, and no more:
    read-ahead off (it once cached the rest of a half-warmed file, and the test found no cold byte)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        n = os.fstat(fd).st_size if upto is None else upto
        for off in range(0, n, 1 << 20):
            os.pread(fd, min(1 << 20, n - off), off)
    finally:
        os.close(fd)


def direct_reads(tmp_path: Any) -> bool:
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 4096)
    fd = os.open(probe, os.O_RDONLY)
    try:
        d = PosixEngine().open_direct(fd)
    finally:
        os.close(fd)
    if d is None:
        return False
    os.close(d)
    return True


def mixed() -> dict[str, torch.Tensor]:
    """Big tensors at offsets that are not page multiples, of several dtypes, and small ones."""
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(3 << 20, generator=g),  # 12 MiB
        "odd": torch.randn(1_000_003, generator=g, dtype=torch.float64),
        "half": torch.randn(777, 1111, generator=g).to(torch.bfloat16),
        "ints": torch.randint(-(2**31), 2**31 - 1, (2_000_001,), dtype=torch.int32, generator=g),
        "byte": torch.randint(0, 255, (5,), dtype=torch.uint8, generator=g),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        **{f"small.{i}": torch.full((i + 1,), float(i)) for i in range(50)},
    }


async def saved(tmp_path: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """:func:`mixed` saved by aiotensor (checksummed), on a file system with O_DIRECT (else skip)."""
    if not direct_reads(tmp_path):
        pytest.skip("this file system has no O_DIRECT")
    w = mixed()
    path = tmp_path / "m.safetensors"
    await aiotensor.save_file(w, path)
    return w, path


async def flip_a_bit_in_a_big_tensor(path: Any) -> None:
    info = await aiotensor.read_header(path)
    data = bytearray(path.read_bytes())
    data[os.path.getsize(path) - info.tensors["byte"].nbytes - 7_000_000] ^= 0x10
    path.write_bytes(bytes(data))


def equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


# a read of at most a batch's bytes is planned, read and checked in one worker call; a bigger one in
# parallel calls (read.read_tensors): 64 MiB takes the whole ~40 MB file in one call, 16 MiB does not
BATCHES = pytest.mark.parametrize("batch", [64 << 20, 16 << 20], ids=["one-call", "parallel"])


@BATCHES
async def test_cold_reads_go_past_the_cache_warm_ones_come_from_it(tmp_path: Any, monkeypatch: Any, batch: int) -> None:
    w, path = await saved(tmp_path)
    calls = []
    monkeypatch.setattr(read, "_read_at_once", spy(read._read_at_once, calls))
    for cache in ("cold", "warm", "half"):
        evict(path)
        if cache == "warm":
            warm(path)
        elif cache == "half":
            warm(path, os.path.getsize(path) // 2 + 12345)
        sched = aiotensor.Scheduler(batch_bytes=batch)
        equal(await aiotensor.load_file(path, scheduler=sched), w)
        into = {k: torch.empty_like(v) for k, v in w.items()}  # the caller's memory: not page-aligned
        evict(path) if cache == "cold" else None
        await aiotensor.load_file(path, into=into, scheduler=sched)
        equal(into, w)
        direct = sched.stats.bytes_direct
        sched.close()
        total = sum(v.nbytes for v in w.values())
        if cache == "cold":
            assert direct >= 1.5 * total, direct  # both loads: nearly every byte read past the cache
        elif cache == "warm":
            assert direct == 0
        else:
            assert 0 < direct < 1.5 * total
    assert len(calls) == (6 if batch > total else 0)


async def test_an_engine_without_direct_reads_reads_cold_files_through_the_cache(tmp_path: Any) -> None:
    # PosixEngine(direct_reads=False): the same bytes, none read with O_DIRECT, the file cached after
    w, path = await saved(tmp_path)
    for load in ("new", "into"):
        evict(path)
        sched = aiotensor.Scheduler(PosixEngine(direct_reads=False))
        fd = os.open(path, os.O_RDONLY)
        try:
            into = {k: torch.empty_like(v) for k, v in w.items()} if load == "into" else None
            equal(await aiotensor.load_file(path, into=into, scheduler=sched), w)
            assert sched.stats.bytes_direct == 0
            assert sched.engine.open_direct(fd) is None
            assert sched.engine.cached(fd, 0, os.path.getsize(path)) == os.path.getsize(path)
        finally:
            os.close(fd)
            sched.close()
    assert PosixEngine(direct=False).direct_reads is False
    assert PosixEngine(direct=False, direct_reads=True).direct_reads is hasattr(os, "O_DIRECT")


def spy(fn: Any, calls: list[Any]) -> Any:
    def wrapped(*args: Any) -> Any:
        calls.append(args)
        return fn(*args)

    return wrapped


async def test_store_loads_and_streams_read_cold_shards_exactly(tmp_path: Any) -> None:
    w = mixed()
    async with aiotensor.TensorStore(tmp_path / "ck") as store:
        await store.save(1, w)
        for p in (tmp_path / "ck").rglob("*.safetensors"):
            evict(p)
        equal(await store.load(1), w)
    for p in (tmp_path / "ck").rglob("*.safetensors"):
        evict(p)
    got = {}
    async with aiotensor.stream(tmp_path / "ck", window_bytes=4 << 20) as s:
        async for name, t in s:
            got[name] = t
    equal(got, w)


@BATCHES
async def test_a_flipped_bit_is_caught_on_the_direct_path(tmp_path: Any, batch: int) -> None:
    _, path = await saved(tmp_path)
    await flip_a_bit_in_a_big_tensor(path)
    for cache in ("cold", "warm"):
        evict(path) if cache == "cold" else warm(path)
        with pytest.raises(ChecksumError) as e:
            await aiotensor.load_file(path, scheduler=aiotensor.Scheduler(batch_bytes=batch))
        assert str(path) in str(e.value) and "'ints' is corrupt" in str(e.value)


async def test_a_file_system_refusing_o_direct_mid_read_gets_buffered_reads(tmp_path: Any) -> None:
    class Refusing(PosixEngine):
        def open_direct(self, fd: int) -> int | None:
            d = super().open_direct(fd)
            if d is not None:
                self.direct_fds.add(d)
            return d

        def pread(self, fd: int, buf: memoryview, offset: int) -> int:
            if fd in self.direct_fds:
                raise OSError(errno.EINVAL, "Invalid argument")
            return super().pread(fd, buf, offset)

    w, path = await saved(tmp_path)
    eng = Refusing()
    eng.direct_fds = set()  # type: ignore[attr-defined]
    evict(path)
    equal(await aiotensor.load_file(path, scheduler=aiotensor.Scheduler(eng)), w)


def data_offsets(path: Any) -> dict[str, int]:
    """Where each tensor of a safetensors file begins, from the start of its data."""
    with open(path, "rb") as f:
        raw = f.read()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    return {k: v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


async def test_small_tensors_are_carved_from_few_allocations_each_with_a_storage_of_its_own(tmp_path: Any) -> None:
    kinds = [torch.float32, torch.float16, torch.float64, torch.bfloat16, torch.float8_e4m3fn]  # the last two: not numpy's
    w = {f"t.{i}": torch.randn(i % 7 + 1, 3, *[2] * (i % 3)).to(kinds[i % 5]) for i in range(3000)}
    w["big"] = torch.randn(2 << 20)
    w["rng"] = torch.get_rng_state()  # torch.set_rng_state ignores a storage offset: it crashed on a view
    path = tmp_path / "m.safetensors"
    await aiotensor.save_file(w, path)
    got = await aiotensor.load_file(path)
    equal(got, w)
    # a tensor's address less its offset in the file is its allocation's: few of them (a block
    # holds neighbours in the file, read in big pieces)...
    offsets = data_offsets(path)
    blocks = {got[k].data_ptr() - offsets[k] for k in w if k != "big"}
    small = sum(v.nbytes for k, v in w.items() if k != "big")
    assert len(blocks) <= small // knobs.CARVE_BLOCK_BYTES + 3  # one per run, at most
    # ... yet each tensor has a storage of its own, as torch.load's and safetensors' have
    for k, t in got.items():
        assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == w[k].nbytes, k
        assert t.data_ptr() % t.element_size() == 0
    assert len(pickle.dumps(got["t.0"])) < 1000  # not its block
    torch.Generator().set_state(got["rng"])
    got["t.0"].add_(1)  # writing one changes no other
    equal({k: v for k, v in got.items() if k != "t.0"}, {k: v for k, v in w.items() if k != "t.0"})
    for k in ("t.0", "t.3", "t.4"):  # float32, bfloat16, float8
        with pytest.raises(RuntimeError, match="not resizable"):  # as safetensors' (torch keeps the new shape even so)
            got[k].resize_(1000)  # which would write over its neighbours
    # a torch.save file's storages stay their own (torch.load's sharing), carved or not
    torch.save(w, tmp_path / "m.pt")
    got = await aiotensor.load_torch(tmp_path / "m.pt")
    equal(got, w)
    assert got["t.1"].untyped_storage().nbytes() == w["t.1"].nbytes


def mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(300, 500), torch.nn.LayerNorm(500), torch.nn.Linear(500, 7)).to(dtype)


@pytest.mark.parametrize("cache", ["cold", "warm"])
async def test_load_into_reads_straight_into_the_module_once(tmp_path: Any, monkeypatch: Any, cache: str) -> None:
    from aiotensor.serving import module as m

    filled: list[str] = []
    each = m._each
    monkeypatch.setattr(
        m, "_each", lambda fn, fills, got, streams: (filled.extend(n[0] for n, _, _ in fills), each(fn, fills, got, streams))
    )
    src = mlp()
    path = tmp_path / "m.safetensors"
    await aiotensor.save_file(src.state_dict(), path)
    evict(path) if cache == "cold" else warm(path)
    dst = torch.nn.Sequential(torch.nn.Linear(300, 500), torch.nn.LayerNorm(500), torch.nn.Linear(500, 7))
    where = {k: v.data_ptr() for k, v in dst.state_dict().items()}
    await aiotensor.load_into(dst, path)
    assert filled == []  # nothing went through a new tensor and a second copy
    assert {k: v.data_ptr() for k, v in dst.state_dict().items()} == where
    equal(dst.state_dict(), src.state_dict())
    # another dtype: converted through new tensors, each copied once into the module
    half = mlp(torch.bfloat16)
    await aiotensor.load_into(half, path)
    assert sorted(filled) == sorted(src.state_dict())
    equal(half.state_dict(), mlp().to(torch.bfloat16).state_dict())
    # a swap's new tensors are read into directly too; the module is untouched until apply()
    swap = await aiotensor.prepare_swap(mlp(), path)
    assert all(t.dtype == torch.float32 for t in swap.tensors.values())
    equal(swap.tensors, src.state_dict())


def reads(monkeypatch: Any) -> list[int]:
    """The buffers each read of the posix engine fills (one for a pread, a preadv's count)."""
    calls: list[int] = []
    pread, preadv = PosixEngine.pread, PosixEngine.preadv
    monkeypatch.setattr(PosixEngine, "pread", lambda self, fd, buf, off: (calls.append(1), pread(self, fd, buf, off))[1])
    monkeypatch.setattr(
        PosixEngine, "preadv", lambda self, fd, bufs, off: (calls.append(len(bufs)), preadv(self, fd, bufs, off))[1]
    )
    return calls


@pytest.mark.parametrize("cache", ["cold", "warm"])
async def test_small_tensors_of_a_module_are_read_together_and_copied_out(tmp_path: Any, monkeypatch: Any, cache: str) -> None:
    """load_into of 600 small parameters reads them in a few pieces (a read each cost more than the
    copy out of the bounce slot), into the module's own memory, exactly; a flipped bit is caught."""
    calls = reads(monkeypatch)
    torch.manual_seed(0)
    src = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(100 + i % 9)) for i in range(600)])
    src.append(torch.nn.Parameter(torch.randn(3 * knobs.GATHER_TENSOR_BYTES // 4)))  # too big to gather: read in place
    path = tmp_path / "small.safetensors"
    await aiotensor.save_file(src.state_dict(), path)
    evict(path) if cache == "cold" else warm(path)
    dst = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros_like(p)) for p in src])
    where = {k: v.data_ptr() for k, v in dst.state_dict().items()}
    calls.clear()
    await aiotensor.load_into(dst, path)
    assert len(calls) < 20, f"{len(calls)} reads for 601 tensors"
    assert {k: v.data_ptr() for k, v in dst.state_dict().items()} == where
    equal(dst.state_dict(), src.state_dict())
    data = bytearray(path.read_bytes())  # one bit of tensor 300, in the middle of a gathered read
    n = int.from_bytes(data[:8], "little")
    data[8 + n + json.loads(data[8 : 8 + n])["300"]["data_offsets"][0] + 17] ^= 0x10
    path.write_bytes(bytes(data))
    evict(path) if cache == "cold" else warm(path)
    with pytest.raises(ChecksumError, match="'300'"):
        await aiotensor.load_into(dst, path)


@pytest.mark.parametrize("cache", ["cold", "warm"])
async def test_gathered_tensors_the_cache_holds_are_read_straight_into_the_module(
    tmp_path: Any, monkeypatch: Any, cache: str
) -> None:
    """Warm, the small tensors of a gathered read land in the module's own memory by ``preadv``, at
    most 1,024 a call (the tensors the module lacks between them read past): no bounce slot, no
    copy out of it. Cold, they come through the slot with O_DIRECT. The same bytes either way; a
    flipped bit is caught, naming its tensor."""
    if cache == "cold" and not direct_reads(tmp_path):
        pytest.skip("this file system has no O_DIRECT")
    calls = reads(monkeypatch)
    g = torch.Generator().manual_seed(5)
    src = {f"t.{i}": torch.randn(2000 + i % 3, generator=g) for i in range(2500)}  # 20 MB: more than read-ahead takes
    path = tmp_path / "many.safetensors"
    await aiotensor.save_file(src, path)
    module = torch.nn.Module()
    module.t = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros_like(v)) for v in src.values()])
    for i in range(0, 2500, 7):  # tensors of the file the module lacks: gaps between the others
        del module.t._parameters[str(i)]
    where = {k: v.data_ptr() for k, v in module.state_dict().items()}
    evict(path) if cache == "cold" else warm(path)
    calls.clear()
    got = await aiotensor.load_into(module, path, strict=False)
    assert sorted(got.unexpected_keys) == sorted(f"t.{i}" for i in range(0, 2500, 7)) and not got.missing_keys
    assert {k: v.data_ptr() for k, v in module.state_dict().items()} == where
    equal(module.state_dict(), {k: v for k, v in src.items() if k in where})
    scattered = [n for n in calls if n > 1]
    if cache == "warm":
        assert len(scattered) >= 3 and max(scattered) <= 1024 and sum(scattered) >= len(where), calls
    else:  # (read-ahead of the header may bring some of the file in: that is scattered)
        assert sum(scattered) < len(where) / 2, calls
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    data[8 + n + json.loads(data[8 : 8 + n])["t.1234"]["data_offsets"][0] + 5] ^= 0x01
    path.write_bytes(bytes(data))
    evict(path) if cache == "cold" else warm(path)
    with pytest.raises(ChecksumError, match="'t.1234'"):
        await aiotensor.load_into(module, path, strict=False)
    # members that overlap in the file (no reader makes them: a guard) are not scattered
    fd = os.open(path, os.O_RDONLY)
    try:
        a, b = torch.zeros(8), torch.zeros(8)
        targets = [
            Target(TensorSpec("a", "F32", (8,), 4096, 32), a, None),
            Target(TensorSpec("b", "F32", (8,), 4112, 32), b, None),
        ]
        unit = read._ReadUnit(4096, None, 48, (), members=((0, 0), (1, 16)))
        assert read._scattered(PosixEngine(), fd, None, targets, memoryview(bytearray(4096)), unit) is None
        assert not a.any() and not b.any()
    finally:
        os.close(fd)


async def test_a_shape_mismatch_is_found_before_anything_is_read_into_the_module(tmp_path: Any) -> None:
    path = tmp_path / "m.safetensors"
    state = mlp().state_dict()
    state["2.weight"] = torch.randn(8, 500)
    await aiotensor.save_file(state, path)
    dst = torch.nn.Sequential(torch.nn.Linear(300, 500), torch.nn.LayerNorm(500), torch.nn.Linear(500, 7))
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(MismatchError, match="2.weight"):
        await aiotensor.load_into(dst, path)
    equal(dst.state_dict(), before)


async def test_mmap_loads_copy_nothing_and_verify_the_mapped_pages(tmp_path: Any) -> None:
    w = mixed()
    path = tmp_path / "m.safetensors"
    await aiotensor.save_file(w, path)
    got = await aiotensor.load_file(path, mmap=True)
    equal(got, w)
    # over one mapping (each with a storage of its own), copy-on-write: writing changes this
    # process's copy, never the file
    offsets = data_offsets(path)
    assert len({t.data_ptr() - offsets[k] for k, t in got.items() if t.numel()}) == 1
    assert all(t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes for t in got.values() if t.numel())
    got["big"].mul_(0)
    equal(await aiotensor.load_file(path), w)
    # a file from the real safetensors writer maps too (no checksums to verify)
    from safetensors.torch import save_file as st_save

    st_save(w, tmp_path / "st.safetensors")
    equal(await aiotensor.load_file(tmp_path / "st.safetensors", mmap=True), w)
    # a flipped bit: ChecksumError unless verify=False
    await flip_a_bit_in_a_big_tensor(path)
    with pytest.raises(ChecksumError):
        await aiotensor.load_file(path, mmap=True)
    assert (await aiotensor.load_file(path, mmap=True, verify=False)).keys() == w.keys()
    with pytest.raises(ValueError, match="mmap"):
        await aiotensor.load_file(path, mmap=True, into={})
    # the mapping outlives the file's name: tensors stay readable after it is deleted
    ok = await aiotensor.load_file(tmp_path / "st.safetensors", mmap=True)
    os.unlink(tmp_path / "st.safetensors")
    equal(ok, w)


async def test_a_store_step_maps_without_a_copy_and_outlives_its_retirement(tmp_path: Any) -> None:
    """store.load(mmap=True): views of the step's shards (several, with a tied weight and the state
    tree kept), checksums verified from the mapped pages; a step retired while mapped stays readable."""
    w = mixed()
    state = {"model": dict(w), "tied": w["big"], "step": 3, "lr": [0.1, 0.01]}
    root = tmp_path / "root"
    async with aiotensor.TensorStore(root, keep_last=1, shard_bytes=8 << 20) as store:
        await store.save(1, state)
        got = await store.load(mmap=True)
        assert got["step"] == 3 and got["lr"] == [0.1, 0.01]
        equal(got["model"], w)
        assert got["tied"] is got["model"]["big"]
        mapped = {line.split()[-1] for line in _mapped_under(str(root / "step-000000000001"))}
        assert len(mapped) == len(list((root / "step-000000000001").glob("*.safetensors"))) > 1
        got["model"]["big"].mul_(0)  # copy-on-write: never the file
        equal((await store.load())["model"], w)
        with pytest.raises(ValueError, match="mmap"):
            await store.load(mmap=True, into=state)
        keep = await store.load(mmap=True)
        await store.save(2, state)  # retires step 1, whose shards are mapped
        assert store.steps() == [2]
        equal(keep["model"], w)
        # the mappings hold no file descriptor (hundreds of shards mapped would hold hundreds), and
        # they go when their tensors go
        step1 = str(root / "step-000000000001")  # renamed as it is retired: .tmp-del...
        assert _mapped_under(step1) and not _open_under(step1)
        del keep, got
        gc.collect()
        assert not _mapped_under(step1)
    # a flipped bit: ChecksumError from the mapped pages unless verify=False
    shard = max((root / "step-000000000002").glob("*.safetensors"), key=os.path.getsize)
    data = bytearray(shard.read_bytes())
    data[-7_000_000] ^= 0x10
    shard.write_bytes(bytes(data))
    async with aiotensor.TensorStore(root, readonly=True) as store:
        with pytest.raises(ChecksumError):
            await store.load(mmap=True)
        assert (await store.load(mmap=True, verify=False))["model"].keys() == w.keys()


def _open_under(prefix: str) -> list[str]:
    """The files (not folders: a retired step's removal walks its folder meanwhile) this process
    holds open at paths that begin with ``prefix`` (Linux)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone
            link = f"/proc/self/fd/{fd}"
            if os.readlink(link).startswith(prefix) and stat.S_ISREG(os.stat(link).st_mode):
                held.append(fd)
    return held


def _mapped_under(prefix: str) -> list[str]:
    """This process's mappings of files at paths that begin with ``prefix`` (Linux)."""
    with open("/proc/self/maps") as f:
        return [line for line in f if f" {prefix}" in line]


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
async def test_read_only_destinations_and_in_place_updates_of_loaded_views(tmp_path: Any) -> None:
    """Found by review: a small destination in read-only memory is an error, not a crash (it is
    never memmoved into); carved views take in-place updates from values that need grad."""
    import numpy as np

    path = tmp_path / "m.safetensors"
    await aiotensor.save_file({"w": torch.arange(6.0), "b": torch.ones(3)}, path)
    np.save(tmp_path / "ro.npy", np.zeros(6, np.float32))
    ro = torch.from_numpy(np.load(tmp_path / "ro.npy", mmap_mode="r"))
    with pytest.raises(OSError):
        await aiotensor.load_file(path, into={"w": ro, "b": torch.zeros(3)})
    got = await aiotensor.load_file(path)
    x = torch.ones(3, requires_grad=True)
    got["b"].mul_(x)  # a view of a multi-view split refused this
    assert got["b"].requires_grad


def test_residency_is_counted_without_a_mapping_and_agrees_with_mincore(tmp_path: Any, monkeypatch: Any) -> None:
    """``cachestat`` (Linux 6.5) answers all-in and all-out ranges in one call, with no mapping (a
    mapping takes the memory-map lock behind every page fault of the other threads); mixed ranges,
    and kernels without it, go to mincore of a mapping. Both answer alike."""
    from aiotensor.engines import posix

    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 << 20))
    evict(str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead, still landing while we count
        os.preadv(fd, [bytearray(1 << 20)], 0)  # the first MiB
        ranges = [(0, 4096), (100, 1 << 19), (0, 4 << 20), (3 << 20, 1 << 20), (5000, 3 << 20)]
        if posix._cached_pages(fd, 0, 4096) is None:
            pytest.skip("this kernel has no cachestat (Linux 6.5)")
        mapped: list[Any] = []
        monkeypatch.setattr(posix._LIBC, "mmap", spy(posix._LIBC.mmap, mapped))
        counted = [posix.resident(fd, off, n) for off, n in ranges]
        mixed = len(mapped)
        monkeypatch.setattr(posix, "_cachestat_works", False)
        assert counted == [posix.resident(fd, off, n) for off, n in ranges]
        assert len(mapped) - mixed == len(ranges)  # without it, a mapping each
        assert counted[0] == 4096 and counted[3] == 0 and 1 << 20 <= counted[2] < 4 << 20
        assert mixed == 2  # only the ranges partly in the cache were mapped
    finally:
        os.close(fd)


def _batches_unit_by_unit(chosen: list[Any], limit: int) -> list[tuple[list[Any], list[Any], int, list[str]]]:
    """The stream's batches as they were made before they were made column by column: units (runs
    of entries over one span) grouped by the scheduler's ``batched``, a new batch at each new file
    (the reference)."""
    units: list[list[Any]] = []
    for e, names in chosen:
        if units and e.parts[0].span is units[-1][0][0].parts[0].span:
            units[-1].append((e, names))
        else:
            units.append([(e, names)])
    out = batched(
        units,
        lambda u: stored_bytes([e for e, _ in u]),
        limit,
        knobs.STREAM_BATCH_TENSORS,
        lambda a, b: a[0][0].parts[0].span.path != b[0][0].parts[0].span.path,
    )
    made = []
    for group, nbytes in out:
        pairs = [pair for unit in group for pair in unit]
        files = list(dict.fromkeys(p.span.path for e, _ in pairs for p in e.parts))
        made.append(([e for e, _ in pairs], [names for _, names in pairs], nbytes, files))
    return made


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's, saving without a process group
@pytest.mark.parametrize("kind", ["safetensors", "torch", "hf", "dcp", "rows", "chunks"])
@pytest.mark.parametrize("limit", [1, 3000, 1 << 20])
def test_a_streams_batches_are_the_unit_by_unit_grouping(
    tmp_path: Any, kind: str, limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches cut column by column (tensor_stream._planned) are the ones the unit-by-unit
    grouping makes, for sources with shared storages (torch.save), several files, chunked tensors
    (DCP) and row slices; any batch boundary moved or entry dropped fails it."""
    import torch.distributed.checkpoint as dcp

    from aiotensor.dcp import AiotensorWriter
    from aiotensor.serving import tensor_stream

    g = torch.Generator().manual_seed(7)
    w = {f"t{i:03d}": torch.randn(1 + i % 40, generator=g) for i in range(300)} | {"big": torch.randn(3000, generator=g)}
    rows: dict[str, tuple[int, int]] = {}
    if kind in ("safetensors", "rows"):
        path = str(tmp_path / "m.safetensors")
        save_st(w, path)
        rows = {"big": (10, 2000)} if kind == "rows" else {}
    elif kind == "torch":
        base = torch.randn(5000, generator=g)
        path = str(tmp_path / "m.pt")  # views of one storage, and tensors of their own, interleaved
        torch.save({**{f"v{i}": base[i * 7 : i * 7 + 5] for i in range(50)}, **dict(list(w.items())[:100])}, path)
    elif kind == "hf":
        path = str(tmp_path / "hf")
        os.mkdir(path)
        keys = sorted(w)
        save_st({k: w[k] for k in keys[:150]}, os.path.join(path, "a.safetensors"))
        save_st({k: w[k] for k in keys[150:]}, os.path.join(path, "b.safetensors"))
    elif kind == "dcp":
        path = str(tmp_path / "dcp")
        dcp.save(w, storage_writer=AiotensorWriter(path))
    else:  # tensors of several chunks, in two files (as ranks write them): made here from two files' spans
        path = str(tmp_path / "hf")
        os.mkdir(path)
        save_st(dict(list(w.items())[:150]), os.path.join(path, "a.safetensors"))
        save_st(dict(list(w.items())[150:]), os.path.join(path, "b.safetensors"))
        src = sources.resolve(PosixEngine(), path)
        e = src.entries
        half = len(e) // 2
        chunked = [
            Entry(x.names, x.dtype, x.shape, (x.parts[0], y.parts[0])) for x, y in zip(e[:half:3], e[half::3], strict=False)
        ]
        src = dataclasses.replace(src, entries=(*chunked, *e[1:half:3]))
        monkeypatch.setattr(sources, "resolve", lambda engine, p: src)
    monkeypatch.setattr(knobs, "STREAM_BATCH_TENSORS", 64)
    engine = PosixEngine()
    count, got, *_ = tensor_stream._planned(engine, path, None, rows, limit)
    chosen = sources.select(sources.resolve(engine, path), None)
    if rows:
        chosen = [(sources.with_rows(e, rows[n[0]]), n[:1]) if n[0] in rows else (e, n) for e, n in chosen]
    want = _batches_unit_by_unit(chosen, limit)
    assert count == len(chosen) and len(got) == len(want) > (limit < 1 << 20)
    assert got == want


@pytest.mark.parametrize("verify", [True, False])
def test_new_tensors_of_one_file_are_planned_as_the_entry_by_entry_path_plans_them(tmp_path: Any, verify: bool) -> None:
    """prepare's column-by-column path (every entry one span of one file, new tensors) lists the
    same reads as its entry-by-entry path (taken here by passing into=[None, ...]): the same specs,
    crcs, kinds and carving, each tensor handed out the one read into."""
    from aiotensor._io.assemble import prepare

    g = torch.Generator().manual_seed(3)
    w = {f"t{i}": torch.randn(1 + i % 9, 3, generator=g).to(torch.float16 if i % 4 else torch.float32) for i in range(200)}
    path = str(tmp_path / "m.safetensors")
    anyio.run(aiotensor.save_file, w | {"big": torch.randn(1 << 19, generator=g)}, path)  # with crcs
    entries = sources.resolve(PosixEngine(), path).entries
    cpu = torch.device("cpu")
    fast, slow = prepare(entries, cpu, verify), prepare(entries, cpu, verify, into=[None] * len(entries))
    assert fast.targets.keys() == slow.targets.keys() == {path} and not fast.copies
    got, want = fast.targets[path], slow.targets[path]
    assert [(t.spec, t.crc, t.kind, t.block is None) for t in got] == [(t.spec, t.crc, t.kind, t.block is None) for t in want]
    assert all(t.tensor is o for t, o in zip(got, fast.out, strict=True))
    assert all(  # a block's tensors lie in it, where their bytes are in the file: its reads land in them
        t.tensor.data_ptr() == t.block.memory.data_ptr() + t.spec.offset - t.block.offset for t in got if t.block is not None
    )
    assert [(o.dtype, o.shape) for o in fast.out] == [(o.dtype, o.shape) for o in slow.out]

    def groups(ts: list[Any]) -> list[list[int]]:  # which targets share a block
        by: dict[int, list[int]] = {}
        for i, t in enumerate(ts):
            by.setdefault(id(t.block), []).append(i)
        return sorted(by.values())

    assert groups(got) == groups(want) and len(groups(got)) > 1
    assert all(t.crc is not None for t in got) == verify


@pytest.mark.parametrize("verify", [True, False])
def test_reads_into_given_tensors_are_planned_as_the_entry_by_entry_path_plans_them(tmp_path: Any, verify: bool) -> None:
    """prepare's column-by-column path for a load into a module (every entry one span of one
    file, every destination given) lists the reads its entry-by-entry path lists (taken here by
    one more entry without a destination): each span into its own destination, a tie's span twice."""
    from aiotensor._io.assemble import prepare

    g = torch.Generator().manual_seed(4)
    path = str(tmp_path / "m.safetensors")
    anyio.run(aiotensor.save_file, {f"t{i}": torch.randn(1 + i % 5, 2, generator=g) for i in range(50)}, path)
    entries = list(sources.resolve(PosixEngine(), path).entries)
    entries.append(Entry(("tie",), entries[3].dtype, entries[3].shape, entries[3].parts))  # a tie: its span again
    dests = [torch.empty(e.shape, dtype=e.dtype) for e in entries]
    cpu = torch.device("cpu")
    fast = prepare(entries, cpu, verify, into=dests)
    slow = prepare([*entries, entries[0]], cpu, verify, into=[*dests, None])
    assert all(o is d for o, d in zip(fast.out, dests, strict=True)) and len(fast.out) == len(dests)
    got, want = fast.targets[path], slow.targets[path][:-1]
    assert [(t.spec, t.crc, t.kind, t.block) for t in got] == [(t.spec, t.crc, t.kind, t.block) for t in want]
    assert all(t.tensor is d for t, d in zip(got, dests, strict=True)) and len(got) == len(dests)
    assert all(t.crc is not None for t in got) == verify


def test_a_whole_span_two_entries_share_is_read_once_into_one_tensor(tmp_path: Any) -> None:
    """Two entries over one whole span (a DCP metadata file may point two items at one stored
    tensor) get one tensor, read once, as the entry-by-entry path always gave them."""
    from aiotensor._io.assemble import prepare

    path = str(tmp_path / "m.safetensors")
    save_st({f"t{i}": torch.full((3, 4), float(i)) for i in range(5)}, path)
    entries = sources.resolve(PosixEngine(), path).entries
    twin = Entry(("twin",), entries[2].dtype, entries[2].shape, entries[2].parts)
    a = prepare([*entries, twin], torch.device("cpu"), True)
    assert a.out[2] is a.out[-1] and len(a.targets[path]) == len(entries)


def test_rows_needs_every_field() -> None:
    from aiotensor.formats.safetensors import TensorSpec, rows

    assert rows(TensorSpec, ["a", "b"], ["F32"] * 2, [(1,), (2,)], [8, 12], [4, 8]) == [
        TensorSpec("a", "F32", (1,), 8, 4),
        TensorSpec("b", "F32", (2,), 12, 8),
    ]
    assert len(rows(TensorSpec, map(str, range(3000)), *([["F32"] * 3000] * 4))) == 3000  # several C calls
    with pytest.raises(TypeError, match="need 5 fields, got 2"):
        rows(TensorSpec, ["a"], ["F32"])


_VIEW_DTYPES = ["F32", "F16", "BF16", "I64", "U8", "BOOL", "F64", "C64", "F4"]


@settings(max_examples=300, deadline=None)
@given(
    hs.lists(
        hs.tuples(
            hs.sampled_from(_VIEW_DTYPES),
            hs.sampled_from(["0-dim", "1-D", "rows"]),
            hs.integers(1, 4),  # dim 0
            hs.sampled_from([(3,), (2, 2), (4,)]),  # a row's shape
            hs.sampled_from([0, 0, 0, 1, 3]),  # items of gap before it
        ),
        max_size=40,
    )
)
def test_views_are_each_tensors_own_view_of_the_block(layout: list[Any]) -> None:
    """views() gives, for any file order of dtypes, shapes (0-dim, 1-D, runs of one row shape,
    packed F4) and gaps, a tensor over exactly the memory a view would have (address, shape,
    strides, dtype), with a storage of its own that is just its bytes."""
    from aiotensor._io.tensors import views
    from aiotensor.formats import safetensors as st
    from aiotensor.formats.dtypes import ITEMSIZE, PACKED, SAFETENSORS_TO_TORCH, torch_shape

    base, pos, specs = 4096, 4096, []
    for i, (dtype, kind, lead, row, gap) in enumerate(layout):
        shape = {"0-dim": (), "1-D": (lead,), "rows": (lead, *row)}[kind]
        if dtype in PACKED:
            shape = (*shape[:-1], 2 * shape[-1]) if shape else (2,)
        item = ITEMSIZE[dtype]
        pos += -pos % item + gap * item
        n = math.prod(shape) * item // PACKED.get(dtype, 1)
        specs.append(st.TensorSpec(f"t{i}", dtype, shape, pos, n))
        pos += n
    memory = torch.zeros(pos - base, dtype=torch.uint8)
    got = views(memory, base, specs)
    assert len(got) == len(specs)
    for s, t in zip(specs, got, strict=True):
        want = (
            memory[s.offset - base : s.offset - base + s.nbytes]
            .view(SAFETENSORS_TO_TORCH[s.dtype])
            .view(torch_shape(s.dtype, s.shape))
        )
        assert (t.dtype, t.shape, t.stride(), t.data_ptr()) == (want.dtype, want.shape, want.stride(), want.data_ptr()), s
        assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == s.nbytes


@settings(max_examples=400, deadline=None)
@given(
    hs.lists(
        hs.tuples(
            hs.sampled_from(["F32", "F16", "U8", "F64", "BF16"]),
            hs.one_of(hs.integers(0, 200), hs.integers(0, 3000)),  # elements
            hs.sampled_from([0, 0, 0, 1, 7, 100, 4096, 4097, 9000]),  # bytes of gap before it
        ),
        max_size=30,
    ),
    hs.randoms(),
)
def test_carved_tensors_and_their_blocks_keep_the_rules(layout: list[Any], rnd: Any) -> None:
    """carve() (a loop over columns) for any file order of sizes, dtypes and gaps, specs given in
    any order: each tensor of its spec's dtype and shape; a block page-aligned, its tensors views
    at their file offsets, neighbours at most a page apart, at most CARVE_BLOCK_BYTES in all, a big
    tensor alone; a tensor out of a block only where it is empty or not at a multiple of its item size."""
    from aiotensor._io.tensors import carve
    from aiotensor._runtime.buffers import PAGE
    from aiotensor.formats import safetensors as st
    from aiotensor.formats.dtypes import ITEMSIZE, SAFETENSORS_TO_TORCH

    most, block_most = 2048, 6000
    specs, pos = [], 100
    for i, (dtype, n, gap) in enumerate(layout):
        pos += gap
        specs.append(st.TensorSpec(f"t{i}", dtype, (n,), pos, n * ITEMSIZE[dtype]))
        pos += n * ITEMSIZE[dtype]
    order = list(range(len(specs)))
    rnd.shuffle(order)
    given_specs = [specs[i] for i in order]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(knobs, "CARVE_TENSOR_BYTES", most)
        mp.setattr(knobs, "CARVE_BLOCK_BYTES", block_most)
        made = carve(given_specs, torch.device("cpu"))
    blocks: dict[int, list[st.TensorSpec]] = {}
    block_of: dict[str, int] = {}
    for s, (t, block) in zip(given_specs, made, strict=True):
        assert (t.dtype, tuple(t.shape)) == (SAFETENSORS_TO_TORCH[s.dtype], s.shape)
        aligned = s.offset % ITEMSIZE[s.dtype] == 0
        if block is None:
            assert s.nbytes == 0 or not aligned
            continue
        assert s.nbytes and aligned and block.offset % PAGE == 0 and block.memory.data_ptr() % PAGE == 0
        assert block.offset <= s.offset and s.offset + s.nbytes <= block.end <= block.offset + block.memory.numel()
        assert t.data_ptr() == block.memory.data_ptr() + s.offset - block.offset
        blocks.setdefault(id(block), []).append(s)
        block_of[s.key] = id(block)
    for members in blocks.values():
        members.sort(key=lambda s: s.offset)
        assert len(members) == 1 or (
            all(s.nbytes <= most for s in members) and members[-1].offset + members[-1].nbytes - members[0].offset <= block_most
        )
        assert all(0 <= b.offset - (a.offset + a.nbytes) <= PAGE for a, b in itertools.pairwise(members))
    carved = sorted((s for s in specs if s.key in block_of), key=lambda s: s.offset)
    for a, b in itertools.pairwise(carved):  # a new block only where the rules say (the packing is greedy)
        if block_of[a.key] != block_of[b.key]:
            first = min(blocks[block_of[a.key]], key=lambda s: s.offset)
            assert (
                max(a.nbytes, b.nbytes) > most
                or not 0 <= b.offset - (a.offset + a.nbytes) <= PAGE
                or b.offset + b.nbytes - first.offset > block_most
            ), (a, b)


@given(
    hs.lists(hs.tuples(hs.integers(0, 40), hs.sampled_from(["crc32c", "crc32", None])), min_size=1, max_size=12),
    hs.lists(hs.integers(1, 60), max_size=8),
    hs.randoms(use_true_random=False),
    hs.sampled_from(["none", "read", "recorded"]),
)
@settings(max_examples=300, deadline=None)
def test_crcs_compared_in_bulk_agree_with_a_loop_target_by_target(
    tensors: list[tuple[int, str | None]], cuts: list[int], rnd: Any, damage: str
) -> None:
    # tensors (size, the kind of crc it has, if any) at consecutive offsets in a random order, the
    # file's bytes cut into units at random points, each unit's parts the pieces of the tensors
    # with a crc it holds, their crcs as a read takes them (read._crcs); the bulk compare agrees with
    # the loop it replaced
    order = list(range(len(tensors)))
    rnd.shuffle(order)
    offsets, at = {}, 0
    for i in order:
        offsets[i] = at
        at += tensors[i][0]
    data = bytes(rnd.getrandbits(8) for _ in range(at))
    targets = [
        read.Target(
            TensorSpec(f"t{i}", "U8", (n,), offsets[i], n),
            torch.empty(0),
            checksum.of(kind, data[offsets[i] : offsets[i] + n]) if kind else None,
            kind or "crc32c",
        )
        for i, (n, kind) in enumerate(tensors)
    ]
    bounds = sorted({0, at, *(min(c * 3, at) for c in cuts)})
    units, got = [], []
    for lo, hi in itertools.pairwise(bounds):
        parts = tuple(
            (i, max(t.spec.offset, lo) - lo, min(t.spec.offset + t.spec.nbytes, hi) - lo)
            for i, t in sorted(enumerate(targets), key=lambda it: it[1].spec.offset)
            if t.crc is not None and t.spec.nbytes and t.spec.offset < hi and t.spec.offset + t.spec.nbytes > lo
        )
        units.append(read._ReadUnit(lo, None, hi - lo, parts))
        got.append((read._crcs(targets, units[-1], memoryview(data)[lo:hi]), 0))
    damaged = [k for k, (crcs, _) in enumerate(got) if crcs]
    if damage == "read" and damaged:
        crcs = got[rnd.choice(damaged)][0]
        crcs[rnd.randrange(len(crcs))] ^= 1 << rnd.randrange(32)
    with_crc = [i for i, t in enumerate(targets) if t.crc is not None]
    if damage == "recorded" and with_crc:
        i = rnd.choice(with_crc)
        targets[i] = targets[i]._replace(crc=targets[i].crc ^ 1)
    corrupt = _first_corrupt_by_the_loop(targets, units, got)
    try:
        read._check_crcs("f", targets, units, got)
        named = None
    except ChecksumError as e:
        named = e.key
    assert named == corrupt  # never a pass the loop would refuse, and the tensor it would name
    assert corrupt is None or damage != "none"  # the crcs a read takes are the tensors' own


def _first_corrupt_by_the_loop(targets: list[Any], units: list[Any], got: list[Any]) -> str | None:
    """The reference: target by target, its parts' crcs combined in order, compared with the one
    recorded (the loop read._check_crcs had before it compared in bulk)."""
    pieces: dict[int, list[tuple[int, int]]] = {}
    for u, (crcs, _) in zip(units, got, strict=True):
        for (i, a, b), c in zip(u.parts, crcs, strict=True):
            pieces.setdefault(i, []).append((c, b - a))
    for i, t in enumerate(targets):
        if t.crc is not None and crc_of_pieces(pieces.get(i, []), t.kind) != t.crc:
            return str(t.spec.key)
    return None


def _block_units_loop(block: Any, members: list[tuple[int, Any]], piece: int, odirect: bool) -> list[Any]:
    """read._block_units as it was written before its parts were found by bisection: the reference."""
    from aiotensor._io.tensors import byte_view, spans

    members.sort(key=lambda m: m[1].spec.offset)
    odirect = odirect and block.end - block.offset >= knobs.DIRECT_MIN_BYTES
    mem = byte_view(block.memory)
    base = block.offset if odirect else members[0][1].spec.offset
    out, k = [], 0
    for a, b in spans(block.end - base, piece):
        lo, hi = base + a, base + b
        parts = []
        while k < len(members) and members[k][1].spec.offset + members[k][1].spec.nbytes <= lo:
            k += 1
        j = k
        while j < len(members) and members[j][1].spec.offset < hi:
            i, t = members[j]
            if t.crc is not None:
                parts.append((i, max(t.spec.offset, lo) - lo, min(t.spec.offset + t.spec.nbytes, hi) - lo))
            j += 1
        out.append(read._ReadUnit(lo, mem[lo - block.offset :], b - a, tuple(parts), aligned=odirect))
    return out


@settings(max_examples=150, deadline=None)
@given(
    hs.lists(hs.tuples(hs.integers(1, 9000), hs.sampled_from([0, 0, 1, 5000]), hs.booleans()), min_size=1, max_size=25),
    hs.sampled_from([1, 7, 4096, 5000, 1 << 20]),
    hs.booleans(),
    hs.randoms(),
)
def test_a_blocks_pieces_hold_the_parts_the_loop_gave(layout: list[Any], piece: int, odirect: bool, rnd: Any) -> None:
    """_block_units (bisection and C loops) gives, for any sizes, gaps, pieces, checked or unchecked
    tensors and member order, the units the member-by-member loop gave: offsets, sizes, memory and
    each piece's parts (tensors cut at its edges)."""
    from aiotensor._io.tensors import Block
    from aiotensor._runtime.buffers import address

    pos, members = 8192 + rnd.randrange(3), []
    for n, gap, checked in layout:
        pos += gap
        members.append(
            (len(members), Target(TensorSpec(f"t{len(members)}", "U8", (n,), pos, n), torch.empty(0), 1 if checked else None))
        )
        pos += n
    start = members[0][1].spec.offset // 4096 * 4096
    block = Block(start, pos, torch.zeros(pos - start, dtype=torch.uint8))
    rnd.shuffle(members)
    targets = [t for _, t in sorted(members, key=lambda m: m[0])]
    got = read._block_units(block, targets, [i for i, _ in members], piece, odirect)
    want = _block_units_loop(block, list(members), piece, odirect)
    assert [(u.offset, u.nbytes, u.parts, u.aligned, address(u.dest), len(u.dest)) for u in got] == [
        (u.offset, u.nbytes, u.parts, u.aligned, address(u.dest), len(u.dest)) for u in want
    ]


async def test_gathered_reads_into_shared_memory_or_cut_short_take_the_slots_path(tmp_path: Any, monkeypatch: Any) -> None:
    """Where the cache holds a gathered read, it still goes through the bounce slot when two of its
    tensors land in one memory (an untied file into a module that ties them: each entry is
    checked as it was read, the last one wins), when an engine reads its own way (a subclass's
    pread sees every byte), and when the file shrinks under it (a FormatError naming the tensor,
    not stale bytes); an I/O error names the file and the tensor."""
    g = torch.Generator().manual_seed(9)
    src = {"emb": torch.randn(64, 8, generator=g), "head": torch.randn(64, 8, generator=g), "pad": torch.randn(3, generator=g)}
    path = tmp_path / "untied.safetensors"
    await aiotensor.save_file(src, path)
    warm(path)
    tied = torch.nn.Module()
    tied.emb = torch.nn.Parameter(torch.zeros(64, 8))
    tied.head = tied.emb
    tied.pad = torch.nn.Parameter(torch.zeros(3))
    await aiotensor.load_into(tied, path)
    assert torch.equal(tied.emb, src["head"]) and torch.equal(tied.pad, src["pad"])

    class Counting(PosixEngine):
        seen = 0

        def pread(self, fd: int, buf: memoryview, offset: int) -> int:
            n = super().pread(fd, buf, offset)
            Counting.seen += n
            return n

    assert PosixEngine().scatters and not Counting().scatters
    into = {k: torch.zeros_like(v) for k, v in src.items()}
    sched = aiotensor.Scheduler(engine=Counting())
    try:
        await aiotensor.load_file(path, into=into, scheduler=sched)
    finally:
        sched.close()
    assert Counting.seen >= sum(v.nbytes for v in src.values()) and all(torch.equal(into[k], src[k]) for k in src)

    def failing(self: Any, fd: int, bufs: Any, off: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    data = 8 + int.from_bytes(path.read_bytes()[:8], "little")  # the header reads; the tensors' fail
    pread = PosixEngine.pread
    monkeypatch.setattr(PosixEngine, "preadv", failing)
    monkeypatch.setattr(
        PosixEngine,
        "pread",
        lambda self, fd, buf, off: failing(self, fd, [buf], off) if off >= data else pread(self, fd, buf, off),
    )
    with pytest.raises(OSError, match="reading tensor 'emb' from .*untied.safetensors"):
        await aiotensor.load_file(path, into=into)
    monkeypatch.undo()
    size = os.path.getsize(path)
    preadv = PosixEngine.preadv

    def shrinking(self: Any, fd: int, bufs: Any, off: int) -> int:
        os.truncate(path, size - 100)  # the file shrinks under the read
        return preadv(self, fd, bufs, off)

    monkeypatch.setattr(PosixEngine, "preadv", shrinking)
    with pytest.raises(FormatError, match="inside tensor 'pad'"):
        await aiotensor.load_file(path, into={k: torch.zeros_like(v) for k, v in src.items()}, verify=False)


async def test_a_module_loaded_in_place_keeps_its_parameters_autograd_state(tmp_path: Any) -> None:
    """load_into writes the parameters' memory itself (no detached copy of each): they stay leaves
    without a grad_fn, keep requires_grad as it was, and a backward pass works after, for small
    (gathered) and big (read in place) parameters alike."""
    torch.manual_seed(1)
    src = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 3))
    path = tmp_path / "m.safetensors"
    await aiotensor.save_file(src.state_dict(), path)
    dst = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 3))
    dst[1].bias.requires_grad_(False)
    warm(path)
    await aiotensor.load_into(dst, path)
    equal(dst.state_dict(), src.state_dict())
    for name, p in dst.named_parameters():
        assert p.is_leaf and p.grad_fn is None and p.requires_grad == (name != "1.bias"), name
    dst(torch.randn(2, 300)).sum().backward()
    assert dst[0].weight.grad is not None and dst[1].bias.grad is None


async def test_scattered_reads_take_any_number_of_sizes_and_addresses_far_apart(tmp_path: Any, monkeypatch: Any) -> None:
    """A scattered read hands each member a slice of one view over the members' addresses (no
    ctypes type per size, which ctypes would keep for the process's life, and made past 4,096
    sizes no more): 5,000 sizes are all read straight into their tensors, half of them on the heap
    and half in one big allocation (a mapping, far from the heap), exactly."""
    g = torch.Generator().manual_seed(4)
    src = {f"t{i}": torch.randn(100 + i, generator=g) for i in range(5000)}  # 5,000 sizes
    path = tmp_path / "sizes.safetensors"
    await aiotensor.save_file(src, path)
    warm(path)
    scattered: list[int] = []

    def counted(*args: Any) -> Any:
        got = scatter(*args)
        scattered.append(len(args[-1].members) if got is not None else 0)
        return got

    scatter = read._scattered
    monkeypatch.setattr(read, "_scattered", counted)
    # 40 MB: above glibc's largest mmap threshold (32 MB), so a mapping of its own, far from the heap
    big = torch.zeros(10 << 20)
    into, at = {}, 0
    for i, (k, v) in enumerate(src.items()):
        if i % 2:
            into[k] = big[at : at + v.numel()]
            at += v.numel() + 7
        else:
            into[k] = torch.zeros_like(v)
    if abs(big.data_ptr() - into["t0"].data_ptr()) <= big.nbytes:  # (another allocator: MALLOC_MMAP_MAX_=0, jemalloc)
        pytest.skip("this allocator placed the big tensor beside the small ones")
    await aiotensor.load_file(path, into=into)
    assert all(torch.equal(into[k], src[k]) for k in src)
    assert sum(scattered) == len(src), scattered


def _gathered_one_by_one(targets: list[Target], chosen: list[int], most: int) -> list[Any]:
    """read._gathered as it was, a Python loop over the tensors: the reference its numpy version keeps."""
    out: list[Any] = []
    group: list[int] = []

    def flush() -> None:
        if group:
            lo = targets[group[0]].spec.offset
            hi = max(targets[j].spec.offset + targets[j].spec.nbytes for j in group)
            at = [(j, targets[j].spec.offset - lo) for j in group]
            parts = tuple((j, a, a + targets[j].spec.nbytes) for j, a in at if targets[j].crc is not None)
            out.append(read._ReadUnit(lo, None, hi - lo, parts, members=tuple(at)))
            group.clear()

    end = 0
    for i in sorted(chosen, key=lambda i: targets[i].spec.offset):
        s = targets[i].spec
        if group and (s.offset - end > knobs.CARVE_GAP_BYTES or s.offset + s.nbytes - targets[group[0]].spec.offset > most):
            flush()
        group.append(i)
        end = max(end, s.offset + s.nbytes) if len(group) > 1 else s.offset + s.nbytes
    flush()
    return out


@settings(max_examples=300, deadline=None)
@given(
    hs.lists(hs.tuples(hs.integers(0, 3), hs.integers(0, 300), hs.integers(1, 200), hs.booleans()), min_size=1, max_size=60),
    hs.integers(1, 1200),
    hs.randoms(use_true_random=False),
    hs.sampled_from([1, 2, 16]),
)
def test_gathered_units_are_the_one_by_one_walks(
    layout: list[tuple[int, int, int, bool]], most: int, rnd: Any, walk: int
) -> None:
    """Small tensors grouped into reads (walked one by one, then by numpy past ``walk`` tensors)
    make the units the loop over each tensor made: ties (the same offset), overlaps, gaps past
    CARVE_GAP_BYTES (shrunk to 100 here), reads of at most ``most`` bytes, tensors with and without
    a crc, in and out of file order."""
    from unittest import mock

    targets, at = [], 0
    for kind, gap, n, crc in layout:
        at = at + gap if kind else max(0, at - gap)  # forward, or back onto earlier bytes
        targets.append(Target(TensorSpec(f"t{len(targets)}", "U8", (n,), at, n), torch.empty(0), 7 if crc else None))
    chosen = list(range(len(targets)))
    rnd.shuffle(chosen)
    chosen = chosen[: rnd.randint(1, len(chosen))]
    with mock.patch.object(knobs, "CARVE_GAP_BYTES", 100), mock.patch.object(read, "_WALK", walk):
        assert read._gathered(targets, chosen, most) == _gathered_one_by_one(targets, chosen, most)


@pytest.mark.parametrize("walk", [1, 16])
def test_a_read_ends_past_its_furthest_tensor_not_its_last(monkeypatch: Any, walk: int) -> None:
    """A tensor that overlaps an earlier, longer one does not end the read early: the next
    tensor's gap is measured from the furthest end so far (as the one-by-one loop measures it)."""
    monkeypatch.setattr(knobs, "CARVE_GAP_BYTES", 100)
    monkeypatch.setattr(read, "_WALK", walk)
    spans = [(0, 200), (10, 10), (150, 10)]  # the third is 130 bytes past the second's end, inside the first
    targets = [Target(TensorSpec(f"t{i}", "U8", (n,), at, n), torch.empty(0), None) for i, (at, n) in enumerate(spans)]
    got = read._gathered(targets, [0, 1, 2], 1 << 20)
    assert got == _gathered_one_by_one(targets, [0, 1, 2], 1 << 20) and len(got) == 1 and got[0].nbytes == 200
