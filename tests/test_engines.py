"""Engines: O_DIRECT writes of page-padded images, the fallback where a file system refuses it."""

from __future__ import annotations

import errno
import fcntl
import os
from typing import Any

import pytest

from aiotensor import PosixEngine
from aiotensor._io.write import write_file
from aiotensor._runtime.buffers import PAGE, HostBuffer
from aiotensor._runtime.scheduler import Scheduler
from aiotensor.testing import FaultyEngine

pytestmark = pytest.mark.anyio


def _o_direct_supported(folder: str) -> bool:
    probe = os.path.join(folder, "probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as e:
        assert e.errno == errno.EINVAL
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    os.close(fd)
    return True


def test_create_direct_sets_o_direct_where_the_file_system_has_it(tmp_path: Any) -> None:
    for direct, engine in [(True, PosixEngine()), (False, PosixEngine()), (True, PosixEngine(direct=False))]:
        path = str(tmp_path / f"f-{direct}-{engine.direct}")
        fd = engine.create(path, direct=direct)
        try:
            on = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        finally:
            engine.close(fd)
        assert on == (direct and engine.direct and _o_direct_supported(str(tmp_path)))


@pytest.mark.parametrize("folder", ["tmp", "shm"])
async def test_page_padded_image_is_written_direct_and_cut_to_size(tmp_path: Any, folder: str) -> None:
    if folder == "shm":  # tmpfs: O_DIRECT is refused on older kernels; the write falls back
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm on this machine")
        base = f"/dev/shm/aiotensor-test-{os.getpid()}"
        os.makedirs(base, exist_ok=True)
    else:
        base = str(tmp_path)
    eng = FaultyEngine()
    sched = Scheduler(eng, chunk_bytes=2 * PAGE)
    buf = HostBuffer(5 * PAGE)
    buf.view[:] = os.urandom(5 * PAGE)
    path = os.path.join(base, "image")
    size = 4 * PAGE + 123
    try:
        await write_file(sched, path, [(0, buf.view[: 5 * PAGE])], size=size)
        with open(path, "rb") as f:
            assert f.read() == bytes(buf.view[:size])
        await write_file(sched, path + ".small", [(0, memoryview(b"manifest"))])
        with open(path + ".small", "rb") as f:
            assert f.read() == b"manifest"
    finally:
        for p in (path, path + ".small"):
            if os.path.exists(p):
                os.unlink(p)
        if folder == "shm":
            os.rmdir(base)
        sched.close()
        buf.close()
    creates = [op for op in eng.ops if op[0] == "create"]
    assert [op[2] for op in creates] == [True, False]  # aligned image: direct; small unaligned bytes: not
    assert ("truncate", path, size) in eng.ops
    writes = [op for op in eng.ops if op[0] == "pwrite" and op[1] == path]
    assert all(off % PAGE == 0 and n % PAGE == 0 for _, _, off, n in writes)
