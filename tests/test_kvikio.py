"""The kvikio engine against a stand-in kvikio module (no GPU here).

``HostKvikio`` treats contiguous CPU tensors as "device memory", so the store's device paths
(reading straight into a tensor through ``CuFile.pread``, checksumming it through a bounce slot,
``save_file`` writing through ``CuFile.pwrite``) run for real on CPU: real files, real threads, a
real loop. What cannot run here is kvikio itself; the ``gpu`` tests below do that.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import types
from typing import Any

import pytest
import torch
from safetensors.torch import load_file as st_load_file

import aiotensor
from aiotensor import FaultyEngine, KvikioEngine, PosixEngine, TensorStore, load_file, save_file
from aiotensor.engines import default_engine
from aiotensor.engines.kvikio import io_mode
from aiotensor.errors import ChecksumError
from aiotensor.scheduler import Scheduler

from .conftest import assert_state_equal, small_state
from .test_store import DTYPES, random_tensor

pytestmark = pytest.mark.anyio


class FakeCuFile:
    """kvikio.CuFile's calls, done with posix I/O into the buffer's memory (CPU tensors here)."""

    def __init__(self, kv: FakeKvikio, path: str, flags: str) -> None:
        assert flags in ("r", "r+"), flags
        self.kv = kv
        self.fd = os.open(path, os.O_RDONLY if flags == "r" else os.O_RDWR)
        self.closed = False
        kv.opened.append(self)

    def _io(self, op: str, buf: torch.Tensor, size: int, offset: int) -> Any:
        assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous() and size == buf.numel()
        self.kv.calls.append((op, threading.get_ident(), offset, size))
        n = min(size, self.kv.max_io)
        mv = buf.numpy().data.cast("B")[:n]
        done = os.preadv(self.fd, [mv], offset) if op == "pread" else os.pwritev(self.fd, [mv], offset)
        return types.SimpleNamespace(get=lambda: done)

    def pread(self, buf: torch.Tensor, size: int, file_offset: int = 0, task_size: int | None = None) -> Any:
        return self._io("pread", buf, size, file_offset)

    def pwrite(self, buf: torch.Tensor, size: int, file_offset: int = 0, task_size: int | None = None) -> Any:
        return self._io("pwrite", buf, size, file_offset)

    def close(self) -> None:
        os.close(self.fd)
        self.closed = True


class FakeDefaults:
    """kvikio.defaults, kvikio >= 25.04 (``get``/``set``)."""

    def __init__(self, compat_preferred: bool) -> None:
        self.values: dict[str, Any] = {"num_threads": 1, "task_size": 4 << 20}
        self.compat_preferred = compat_preferred

    def get(self, name: str) -> Any:
        return self.values[name]

    def set(self, config: dict[str, Any]) -> None:
        self.values.update(config)

    def is_compat_mode_preferred(self) -> bool:
        return self.compat_preferred


class OldDefaults:
    """kvikio.defaults before 25.04: ``compat_mode()`` and ``*_reset``."""

    def __init__(self, compat: Any) -> None:
        self.compat = compat
        self.num_threads, self.task_size = 8, 4 << 20

    def compat_mode(self) -> Any:
        return self.compat

    def get_num_threads(self) -> int:
        return self.num_threads

    def num_threads_reset(self, n: int) -> None:
        self.num_threads = n

    def task_size_reset(self, n: int) -> None:
        self.task_size = n


class FakeKvikio(types.SimpleNamespace):
    def __init__(self, *, compat_preferred: bool = False, gds: bool = True, max_io: int = 1 << 62) -> None:
        super().__init__()
        self.defaults: Any = FakeDefaults(compat_preferred)
        self.cufile_driver = types.SimpleNamespace(get=lambda name: {"is_gds_available": gds}[name])
        self.max_io = max_io
        self.calls: list[tuple[str, int, int, int]] = []
        self.opened: list[FakeCuFile] = []

    def CuFile(self, path: str, flags: str) -> FakeCuFile:
        return FakeCuFile(self, path, flags)


class HostKvikio(KvikioEngine):
    """The kvikio engine, with contiguous CPU tensors standing in for CUDA memory."""

    def handles_device(self, t: torch.Tensor) -> bool:
        return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v) for k, v in tensors.items()}


def _check_io(kv: FakeKvikio, op: str) -> None:
    """kvikio was called for ``op``, never on the loop thread, and every CuFile was closed."""
    loop_thread = threading.get_ident()
    calls = [c for c in kv.calls if c[0] == op]
    assert calls, f"no CuFile.{op} call"
    assert all(c[1] != loop_thread for c in calls), f"CuFile.{op} ran on the event loop thread"
    assert kv.opened and all(f.closed for f in kv.opened)


async def test_checkpoints_load_through_cufile_into_tensors(tmp_path: Any) -> None:
    state = {"t": {str(d): random_tensor(d, (33, 17), i) for i, d in enumerate(DTYPES)}, **small_state(1)}
    async with TensorStore(tmp_path / "ck", engine=PosixEngine(), chunk_bytes=4096) as store:
        await store.save(1, state)
    kv = FakeKvikio(max_io=3000)  # short reads: the engine call is repeated for the rest
    eng = HostKvikio(kvikio_module=kv)
    async with TensorStore(tmp_path / "ck", engine=eng, chunk_bytes=4096) as store:
        assert store.io_mode == "kvikio (gds)"
        got = await store.load(1)
        assert eng._files == {}
    assert_state_equal(got, state)
    _check_io(kv, "pread")
    # read into tensors, not bounced: every tensor's bytes went through CuFile.pread
    assert sum(c[3] for c in kv.calls) >= sum(t.nbytes for t in state["t"].values())


async def test_corruption_read_into_device_memory_is_caught(tmp_path: Any) -> None:
    async with TensorStore(tmp_path, engine=PosixEngine()) as store:
        await store.save(1, {"w": torch.arange(10_000, dtype=torch.float32)})
    shard = os.path.join(store.path(1), "shard-00000.safetensors")
    with open(shard, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x10]))
    kv = FakeKvikio()
    async with TensorStore(tmp_path, engine=HostKvikio(kvikio_module=kv)) as store:
        with pytest.raises(ChecksumError, match="'w'"):
            await store.load(1)
        got = await store.load(1, verify=False)  # the read itself works: only the check failed
    assert got["w"][:-2].equal(torch.arange(9_998, dtype=torch.float32))
    _check_io(kv, "pread")


async def test_files_written_through_cufile_read_with_posix_and_safetensors(tmp_path: Any) -> None:
    tensors = {str(d): random_tensor(d, (40, 9), i) for i, d in enumerate(DTYPES)}
    kv = FakeKvikio(max_io=5000)
    path = str(tmp_path / "w.safetensors")
    await save_file(tensors, path, scheduler=Scheduler(HostKvikio(kvikio_module=kv), chunk_bytes=4096))
    _check_io(kv, "pwrite")
    assert_state_equal(await load_file(path, into=_like(tensors), scheduler=Scheduler(PosixEngine())), tensors)
    assert_state_equal(dict(sorted(st_load_file(path).items())), dict(sorted(tensors.items())))
    # and back: a posix-written file read through CuFile
    await save_file(tensors, path, scheduler=Scheduler(PosixEngine()))
    kv2 = FakeKvikio()
    assert_state_equal(await load_file(path, into=_like(tensors), scheduler=Scheduler(HostKvikio(kvikio_module=kv2))), tensors)
    _check_io(kv2, "pread")


async def test_an_io_error_in_a_device_read_names_the_file(tmp_path: Any) -> None:
    async with TensorStore(tmp_path, engine=PosixEngine()) as store:
        await store.save(1, {"w": torch.ones(100_000)})
    eng = FaultyEngine(HostKvikio(kvikio_module=FakeKvikio()), fail={"pread": (3, errno.EIO)})
    async with TensorStore(tmp_path, engine=eng, chunk_bytes=65536) as store:
        with pytest.raises(OSError, match="shard-00000") as e:
            await store.load(1)
        assert e.value.errno == errno.EIO
    assert eng.open_fds() == []


async def test_a_kvikio_failure_is_an_oserror_naming_the_file(tmp_path: Any) -> None:
    async with TensorStore(tmp_path, engine=PosixEngine()) as store:
        await store.save(1, {"w": torch.ones(1000)})
    kv = FakeKvikio()

    def broken(*a: Any) -> Any:
        raise RuntimeError("cuFile error: CU_FILE_IO_ERROR")

    eng = HostKvikio(kvikio_module=kv)
    async with TensorStore(tmp_path, engine=eng) as store:
        setattr(kv, "CuFile", lambda path, flags: types.SimpleNamespace(pread=broken, close=lambda: None))  # noqa: B010
        with pytest.raises(OSError, match="shard-00000.*CU_FILE_IO_ERROR") as e:
            await store.load(1)
        assert e.value.errno == errno.EIO and eng._files == {}


def test_mode_reports_what_runs() -> None:
    assert io_mode(FakeKvikio(compat_preferred=True)) == "compat"
    assert io_mode(FakeKvikio(gds=True)) == "gds"
    assert io_mode(FakeKvikio(gds=False)) == "cufile-compat"
    old = FakeKvikio()
    for value, mode in [(True, "compat"), (False, "cufile-compat"), (1, "compat"), (0, "cufile-compat")]:
        old.defaults = OldDefaults(value)
        old.cufile_driver = types.SimpleNamespace(get=lambda name: False)
        assert io_mode(old) == mode, value
    del old.cufile_driver  # a kvikio without driver properties
    old.defaults = OldDefaults(False)
    assert io_mode(old) == "cufile"


def test_threads_and_task_size_are_set_deliberately(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    monkeypatch.delenv("KVIKIO_TASK_SIZE", raising=False)
    kv = FakeKvikio()
    KvikioEngine(num_threads=6, task_size=8 << 20, kvikio_module=kv)
    assert kv.defaults.values == {"num_threads": 6, "task_size": 8 << 20}
    KvikioEngine(num_threads=2, task_size=8 << 20, kvikio_module=kv)
    assert kv.defaults.values["num_threads"] == 6  # a pool is never shrunk
    old = FakeKvikio()
    old.defaults = OldDefaults(False)
    KvikioEngine(num_threads=16, task_size=1 << 20, kvikio_module=old)
    assert (old.defaults.num_threads, old.defaults.task_size) == (16, 1 << 20)
    monkeypatch.setenv("KVIKIO_NTHREADS", "3")
    monkeypatch.setenv("KVIKIO_TASK_SIZE", "65536")
    kv = FakeKvikio()
    KvikioEngine(num_threads=6, task_size=8 << 20, kvikio_module=kv)
    assert kv.defaults.values == {"num_threads": 1, "task_size": 4 << 20}  # the user's environment wins


def test_kvikio_is_chosen_only_where_cuda_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvikio", FakeKvikio())
    if not torch.cuda.is_available():
        assert type(default_engine()) is PosixEngine  # kvikio imports, but there is no CUDA
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    eng = default_engine(workers=3, chunk_bytes=1 << 20)
    assert isinstance(eng, KvikioEngine) and eng.mode == "gds"
    assert sys.modules["kvikio"].defaults.values == {"num_threads": 3, "task_size": 1 << 20}
    monkeypatch.setitem(sys.modules, "kvikio", None)  # `import kvikio` fails
    assert type(default_engine()) is PosixEngine


# --- on a GPU, with the real kvikio -----------------------------------------------------------

gpu = pytest.mark.gpu
needs_kvikio = pytest.mark.skipif(not aiotensor.engines.kvikio_usable(), reason="needs CUDA and kvikio")


@gpu
@needs_kvikio
async def test_kvikio_round_trips_to_cuda_and_reads_posix_files(tmp_path: Any) -> None:
    state = {str(d): random_tensor(d, (257, 31), i) for i, d in enumerate(DTYPES)}
    async with TensorStore(tmp_path, engine=PosixEngine()) as store:
        await store.save(1, state)
    async with TensorStore(tmp_path, engine=KvikioEngine()) as store:
        got = await store.load(1, device="cuda")
        assert all(t.is_cuda for t in got.values())
        assert_state_equal({k: v.cpu() for k, v in got.items()}, state)
        await store.save(2, got)  # CUDA sources, staged through pinned memory
    async with TensorStore(tmp_path, engine=PosixEngine()) as store:
        assert_state_equal(await store.load(2), state)


@gpu
@needs_kvikio
async def test_kvikio_single_files_to_and_from_cuda(tmp_path: Any) -> None:
    tensors = {str(d): random_tensor(d, (129, 7), i).cuda() for i, d in enumerate(DTYPES)}
    for writer in (KvikioEngine(), PosixEngine()):
        for reader in (KvikioEngine(), PosixEngine()):
            path = str(tmp_path / f"{writer.name}-{reader.name}.safetensors")
            await save_file(tensors, path, scheduler=Scheduler(writer))
            got = await load_file(path, device="cuda", scheduler=Scheduler(reader))
            assert all(t.is_cuda for t in got.values())
            assert_state_equal({k: got[k].cpu() for k in tensors}, {k: v.cpu() for k, v in tensors.items()})
