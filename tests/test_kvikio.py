"""The kvikio engine against a stand-in kvikio package (no GPU here).

``tests/fake_kvikio/kvikio`` mirrors the real kvikio's module layout and signatures (26.08): as with
the real one, ``import kvikio`` does not load ``kvikio.defaults`` nor ``kvikio.cufile_driver``.
``HostKvikio`` treats contiguous CPU tensors as "device memory", so the store's device paths
(reading straight into a tensor through ``CuFile.pread``, checksumming it through a bounce slot,
``save_file`` writing through ``CuFile.pwrite``) run for real on CPU: real files, real threads, a
real loop. What cannot run here is kvikio itself; the ``gpu`` tests below do that.
"""

from __future__ import annotations

import errno
import importlib
import inspect
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import load_file as st_load_file

import aiotensor
from aiotensor import KvikioEngine, PosixEngine, TensorStore, load_file, save_file
from aiotensor._runtime.scheduler import Scheduler
from aiotensor.engines import default_engine
from aiotensor.engines.kvikio import io_mode
from aiotensor.errors import ChecksumError
from aiotensor.testing import FaultyEngine

from .conftest import assert_state_equal, small_state
from .test_store import DTYPES, load_while_its_step_is_retired, random_tensor

pytestmark = pytest.mark.anyio
FAKE = os.path.join(os.path.dirname(__file__), "fake_kvikio")


def _drop_kvikio_modules() -> None:
    for name in [n for n in sys.modules if n == "kvikio" or n.startswith("kvikio.")]:
        del sys.modules[name]


@pytest.fixture
def kv(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The stand-in kvikio on sys.path (fresh modules); yields its test controls."""
    if importlib.util.find_spec("kvikio") is not None and FAKE not in (importlib.util.find_spec("kvikio").origin or ""):
        pytest.skip("a real kvikio is installed: these tests use the stand-in")
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    monkeypatch.delenv("KVIKIO_NUM_THREADS", raising=False)
    monkeypatch.delenv("KVIKIO_TASK_SIZE", raising=False)
    monkeypatch.syspath_prepend(FAKE)
    _drop_kvikio_modules()
    aiotensor.engines.kvikio.forget_setup()  # kvikio is set up once per process: again, for the stand-in
    state = importlib.import_module("kvikio._fake").state
    state.reset()
    yield state
    _drop_kvikio_modules()
    aiotensor.engines.kvikio.forget_setup()


class HostKvikio(KvikioEngine):
    """The kvikio engine, with contiguous CPU tensors standing in for CUDA memory."""

    def device_memory(self, t: torch.Tensor) -> bool:
        return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v) for k, v in tensors.items()}


def _check_io(kv: Any, op: str) -> None:
    """kvikio was called for ``op``, never on the loop thread, and every CuFile was closed."""
    loop_thread = threading.get_ident()
    calls = [c for c in kv.calls if c[0] == op]
    assert calls, f"no CuFile.{op} call"
    assert all(c[1] != loop_thread for c in calls), f"CuFile.{op} ran on the event loop thread"
    assert kv.opened and all(f.closed for f in kv.opened)


# the real kvikio 26.08 (rapidsai/kvikio@2e98113d, python/kvikio/kvikio/): names and parameters
REAL_LAYOUT = {
    "kvikio": ["CuFile"],
    "kvikio.defaults": ["get", "set", "is_compat_mode_preferred"],
    "kvikio.cufile_driver": ["get"],
}
REAL_SIGNATURES = {
    "CuFile.__init__": ["self", "file", "flags"],
    "CuFile.pread": ["self", "buf", "size", "file_offset", "task_size"],
    "CuFile.pwrite": ["self", "buf", "size", "file_offset", "task_size"],
    "CuFile.close": ["self"],
    "CuFile.is_direct_io_supported": ["self"],
    "IOFuture.get": ["self"],
}


def test_the_stand_in_has_the_real_module_layout(kv: Any) -> None:
    import kvikio

    assert "kvikio.defaults" not in sys.modules and not hasattr(kvikio, "defaults"), "import kvikio loads no submodules"
    assert "kvikio.cufile_driver" not in sys.modules and not hasattr(kvikio, "cufile_driver")
    for module, names in REAL_LAYOUT.items():
        m = importlib.import_module(module)
        assert all(hasattr(m, n) for n in names), module
    cufile = importlib.import_module("kvikio.cufile")
    for qual, params in REAL_SIGNATURES.items():
        cls, meth = qual.split(".")
        assert list(inspect.signature(getattr(getattr(cufile, cls), meth)).parameters) == params, qual


def test_the_engine_imports_the_submodules_itself(kv: Any) -> None:
    """The bug a first real run would hit: `kvikio.defaults` is not loaded by `import kvikio`."""
    eng = KvikioEngine()
    assert eng.mode == "gds" and eng.defaults.get("num_threads") == 4


async def test_checkpoints_load_through_cufile_into_tensors(tmp_path: Any, kv: Any) -> None:
    state = {"t": {str(d): random_tensor(d, (33, 17), i) for i, d in enumerate(DTYPES)}, **small_state(1)}
    async with TensorStore(tmp_path / "ck", engine=PosixEngine(), chunk_bytes=4096) as store:
        await store.save(1, state)
    kv.max_io = 3000  # short reads: the engine call is repeated for the rest
    eng = HostKvikio()
    async with TensorStore(tmp_path / "ck", engine=eng, chunk_bytes=4096) as store:
        assert store.io_mode == "kvikio (gds)"
        got = await store.load(1)
        assert eng._files == {}
    assert_state_equal(got, state)
    _check_io(kv, "pread")
    # read into tensors, not bounced: every tensor's bytes went through CuFile.pread
    assert sum(c[3] for c in kv.calls) >= sum(t.nbytes for t in state["t"].values())
    assert eng.file_modes["gds"] >= 1


@pytest.mark.parametrize("atomic", [False, True])
async def test_a_step_retired_while_it_loads_through_cufile_is_read_whole(
    tmp_path: Any, kv: Any, monkeypatch: pytest.MonkeyPatch, atomic: bool
) -> None:
    """Found on an H200 (the CPU test of this, tests/test_store.py, failed there): the kvikio
    engine, the default where CUDA is, opened CuFile by path, so it kept no shard open through a
    load into tensors; a step that the writer's retention deleted meanwhile left the first shards
    read into ``into`` and the rest ``CheckpointNotFoundError``, atomic=True too. CuFile now opens
    the descriptor's own file (/proc/thread-self/fd/N): the unlinked shards are read whole, through CuFile."""
    new = await load_while_its_step_is_retired(tmp_path, monkeypatch, atomic, HostKvikio())
    _check_io(kv, "pread")
    assert sum(c[3] for c in kv.calls if c[0] == "pread") >= sum(t.nbytes for t in new.values())


async def test_multi_megabyte_tensors_at_unaligned_offsets_go_through_cufile(tmp_path: Any, kv: Any) -> None:
    """Above kvikio's GDS threshold (16 KiB) and not 4 KiB aligned: what a real run exercises."""
    state = {"a": torch.randn(3), "big": torch.randn(3 << 20), "odd": torch.randn(1_000_003)}
    async with TensorStore(tmp_path, engine=PosixEngine()) as store:
        await store.save(1, state)
    eng = HostKvikio()
    async with TensorStore(tmp_path, engine=eng) as store:
        assert_state_equal(await store.load(1), state)
    offsets = {c[2] % 4096 for c in kv.calls if c[3] > 1 << 20}
    assert offsets - {0}, "some large reads start off a page boundary"
    kv.direct_io = False  # a file system without O_DIRECT (tmpfs): kvikio runs that file in compat
    eng = HostKvikio()
    async with TensorStore(tmp_path, engine=eng) as store:
        await store.load(1)
    assert eng.file_modes == {"compat": 1}


async def test_corruption_read_into_device_memory_is_caught(tmp_path: Any, kv: Any) -> None:
    async with TensorStore(tmp_path, engine=PosixEngine()) as store:
        await store.save(1, {"w": torch.arange(10_000, dtype=torch.float32)})
    shard = os.path.join(store.path(1), "shard-00000.safetensors")
    with open(shard, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x10]))
    async with TensorStore(tmp_path, engine=HostKvikio()) as store:
        with pytest.raises(ChecksumError, match="'w'"):
            await store.load(1)
        got = await store.load(1, verify=False)  # the read itself works: only the check failed
    assert got["w"][:-2].equal(torch.arange(9_998, dtype=torch.float32))
    _check_io(kv, "pread")


async def test_files_written_through_cufile_read_with_posix_and_safetensors(tmp_path: Any, kv: Any) -> None:
    tensors = {str(d): random_tensor(d, (400, 90), i) for i, d in enumerate(DTYPES)}  # whole pages: through cuFile
    kv.max_io = 5000
    path = str(tmp_path / "w.safetensors")
    await save_file(tensors, path, scheduler=Scheduler(HostKvikio(), chunk_bytes=4096))
    _check_io(kv, "pwrite")
    assert_state_equal(await load_file(path, into=_like(tensors), scheduler=Scheduler(PosixEngine())), tensors)
    assert_state_equal(dict(sorted(st_load_file(path).items())), dict(sorted(tensors.items())))
    # and back: a posix-written file read through CuFile
    await save_file(tensors, path, scheduler=Scheduler(PosixEngine()))
    kv.calls.clear()
    kv.opened.clear()
    assert_state_equal(await load_file(path, into=_like(tensors), scheduler=Scheduler(HostKvikio())), tensors)
    _check_io(kv, "pread")


@pytest.mark.parametrize("chunk_bytes", [4096 * 3 + 512, 1 << 20, 24 << 20])
async def test_no_two_cufile_writes_share_a_page(tmp_path: Any, kv: Any, chunk_bytes: int) -> None:
    """cuFile writes a partial page as a read-modify-write of the whole page: two threads writing
    into one page lose one's bytes. Every CuFile.pwrite covers whole pages no other call touches;
    the partial pages neighbours share go through a bounce slot."""
    g = torch.Generator().manual_seed(5)
    sizes = [3, 1_000_003, 4093, 2_500_001, 17, 1 << 20, 999, 6_000_011]
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.float64]
    tensors = {f"t{i}": torch.randint(-100, 100, (n,), generator=g).to(dtypes[i % 4]) for i, n in enumerate(sizes)}
    path = str(tmp_path / "w.safetensors")
    await save_file(tensors, path, scheduler=Scheduler(HostKvikio(), chunk_bytes=chunk_bytes, workers=4))
    writes = [(off, n) for op, _, off, n in kv.calls if op == "pwrite"]
    assert sum(n for _, n in writes) > 0.9 * sum(t.nbytes for t in tensors.values())  # most bytes through cuFile
    pages: dict[int, int] = {}
    for off, n in writes:
        assert off % 4096 == 0 and n % 4096 == 0, (off, n)
        for p in range(off // 4096, (off + n) // 4096):
            pages[p] = pages.get(p, 0) + 1
    assert max(pages.values()) == 1
    assert_state_equal(dict(sorted(st_load_file(path).items())), dict(sorted(tensors.items())))
    got = await load_file(path, scheduler=Scheduler(PosixEngine()))
    assert_state_equal(dict(sorted(got.items())), dict(sorted(tensors.items())))


async def test_an_io_error_in_a_device_read_names_the_file(tmp_path: Any, kv: Any) -> None:
    async with TensorStore(tmp_path, engine=PosixEngine()) as store:
        await store.save(1, {"w": torch.ones(100_000)})
    eng = FaultyEngine(HostKvikio(), fail={"pread": (3, errno.EIO)})
    # (incremental=False: a writer reads the newest manifest at open, for its next save; preads counted here)
    async with TensorStore(tmp_path, engine=eng, chunk_bytes=65536, incremental=False) as store:
        with pytest.raises(OSError, match="shard-00000") as e:
            await store.load(1)
        assert e.value.errno == errno.EIO
    assert eng.open_fds() == []


@pytest.mark.parametrize(
    "error,code",
    [
        (RuntimeError("cuFile error: CU_FILE_IO_ERROR"), errno.EIO),
        (RuntimeError(f"pwrite failed: {os.strerror(errno.ENOSPC)}"), errno.ENOSPC),  # std::system_error's what()
        (RuntimeError(f"posix_fadvise failed: {os.strerror(errno.EDQUOT)}"), errno.EDQUOT),
        (ValueError("Cannot read/write beyond the end of the file"), errno.EIO),  # kvikio's argument checks
        (TypeError("buf must be a device or host buffer"), errno.EIO),
        # dlerror ends in "No such file or directory": not a missing file (FileNotFoundError)
        (RuntimeError("cuFile: libcuda.so.1: cannot open shared object file: No such file or directory"), errno.ELIBACC),
    ],
)
async def test_a_kvikio_failure_is_an_oserror_naming_the_file_with_its_errno(
    tmp_path: Any, kv: Any, error: Exception, code: int
) -> None:
    async with TensorStore(tmp_path, engine=PosixEngine()) as store:
        await store.save(1, {"w": torch.ones(1000)})
    eng = HostKvikio()
    async with TensorStore(tmp_path, engine=eng) as store:
        kv.fail = error
        with pytest.raises(OSError, match="shard-00000") as e:
            await store.load(1)
        assert e.value.errno == code and eng._files == {}
        assert not isinstance(e.value, FileNotFoundError)


def test_mode_reports_what_runs(kv: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvikio.cufile_driver
    import kvikio.defaults

    kv.compat_preferred = True
    assert io_mode(kvikio.defaults, kvikio.cufile_driver) == "compat"
    kv.compat_preferred, kv.gds = False, True
    assert io_mode(kvikio.defaults, kvikio.cufile_driver) == "gds"
    kv.gds = False
    assert io_mode(kvikio.defaults, kvikio.cufile_driver) == "cufile-compat"
    assert io_mode(kvikio.defaults, None) == "cufile"  # a kvikio without driver properties

    class Old:  # kvikio.defaults before 25.04: compat_mode() is a bool, later a CompatMode
        def __init__(self, v: Any) -> None:
            self.v = v

        def compat_mode(self) -> Any:
            return self.v

    for value, mode in [(True, "compat"), (False, "cufile-compat"), (1, "compat"), (0, "cufile-compat")]:
        assert io_mode(Old(value), kvikio.cufile_driver) == mode, value


async def test_in_kvikios_own_compat_mode_device_tensors_take_the_bounce_slots(tmp_path: Any, kv: Any) -> None:
    """Without a cuFile library (mode "compat") kvikio bounces through its own pinned buffers with
    plain reads: the store's bounce slots (O_DIRECT) measured faster on an H200, so "auto" takes
    them; "always" still goes through kvikio."""
    kv.compat_preferred = True
    tensors = {str(d): random_tensor(d, (400, 90), i) for i, d in enumerate(DTYPES)}
    path = str(tmp_path / "w.safetensors")
    eng = HostKvikio()
    await save_file(tensors, path, scheduler=Scheduler(eng))
    assert_state_equal(await load_file(path, into=_like(tensors), scheduler=Scheduler(eng)), tensors)
    async with TensorStore(tmp_path / "ck", engine=eng) as store:
        await store.save(1, tensors)
        assert_state_equal(await store.load(1), tensors)
        assert store.io_mode == "kvikio (compat: CUDA tensors through bounce slots)"
    assert not kv.calls and not kv.opened and eng.mode == "compat"
    assert_state_equal(dict(sorted(st_load_file(path).items())), dict(sorted(tensors.items())))
    eng = HostKvikio(cufile="always")
    await save_file(tensors, path, scheduler=Scheduler(eng))
    assert_state_equal(await load_file(path, into=_like(tensors), scheduler=Scheduler(eng)), tensors)
    _check_io(kv, "pwrite")
    _check_io(kv, "pread")
    async with TensorStore(tmp_path / "ck", engine=eng) as store:
        assert store.io_mode == "kvikio (compat)"
    with pytest.raises(ValueError, match='cufile must be "auto" or "always"'):
        KvikioEngine(cufile="never")


def test_threads_and_task_size_are_set_deliberately(kv: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert KvikioEngine(num_threads=6, task_size=8 << 20).mode == "gds"  # configured on first use
    assert (kv.values["num_threads"], kv.values["task_size"]) == (6, 8 << 20)
    assert KvikioEngine(num_threads=2, task_size=8 << 20).mode == "gds"
    assert kv.values["num_threads"] == 6  # a pool is never shrunk
    for var in ("KVIKIO_NTHREADS", "KVIKIO_NUM_THREADS"):  # kvikio 26.x reads both names
        kv.reset()
        monkeypatch.setenv(var, "3")
        monkeypatch.setenv("KVIKIO_TASK_SIZE", "65536")
        assert KvikioEngine(num_threads=6, task_size=8 << 20).mode == "gds"
        assert (kv.values["num_threads"], kv.values["task_size"]) == (1, 4 << 20)  # the user's environment wins
        monkeypatch.delenv(var)


async def test_kvikio_is_set_up_once_per_process_off_the_loop_thread(tmp_path: Any, kv: Any) -> None:
    """Every save_file/load_file/stream without a scheduler builds an engine: none imports kvikio
    (0.6 s) or opens the cuFile driver on the event loop's thread, and only the first sets it up."""
    tensors = {"w": torch.randn(5000)}
    for i in range(3):
        await save_file(tensors, tmp_path / f"{i}.safetensors", scheduler=Scheduler(HostKvikio()))
        await load_file(tmp_path / f"{i}.safetensors", scheduler=Scheduler(HostKvikio()))
    assert len(kv.imports) == 1 and kv.imports[0] != threading.get_ident()
    _check_io(kv, "pwrite")


async def test_a_kvikio_that_fails_to_load_leaves_cuda_tensors_to_the_bounce_path(
    tmp_path: Any, kv: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "kvikio.defaults", None)  # installed, but part of it fails to import
    eng = HostKvikio()
    tensors = {"w": torch.randn(5000)}
    await save_file(tensors, tmp_path / "w.safetensors", scheduler=Scheduler(eng))
    assert_state_equal(await load_file(tmp_path / "w.safetensors", scheduler=Scheduler(eng)), tensors)
    assert eng.mode == "unavailable" and not kv.calls
    assert "failed to load" in caplog.text


def test_kvikio_is_chosen_only_where_cuda_is(kv: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        assert type(default_engine()) is PosixEngine  # kvikio imports, but there is no CUDA
        monkeypatch.setattr(aiotensor._runtime.cuda, "_devices_seen", lambda visible: True)
    eng = default_engine(workers=3, chunk_bytes=1 << 20)
    assert isinstance(eng, KvikioEngine) and eng.mode == "gds"
    assert (kv.values["num_threads"], kv.values["task_size"]) == (3, 1 << 20)
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


def test_device_write_units_cover_the_range_in_whole_pages() -> None:
    """Every split of a device range: exact cover, in order; cuFile pieces on page boundaries and at
    most a chunk; bounced pieces under a page, so that they fit any bounce slot."""
    import random

    from aiotensor._io.write import _device_units

    rng = random.Random(7)
    for _ in range(20_000):
        off, n = rng.randrange(0, 40_000), rng.randrange(1, 40_000)
        chunk = rng.choice([4096, 4096 * 3 + 512, 65536])
        units = _device_units(off, torch.empty(n, dtype=torch.uint8), chunk)
        at = off
        for start, src, bounced in units:
            assert start == at and len(src) > 0, (off, n, chunk, units)
            at += len(src)
            if bounced:
                assert len(src) < 4096, (off, n, chunk)  # fits any bounce slot
            else:
                assert start % 4096 == 0 and len(src) % 4096 == 0 and len(src) <= max(4096, chunk // 4096 * 4096)
        assert at == off + n
