"""The staging pool and the bounce slots: bounded, reused, and fair to waiters and cancellation."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiotensor import knobs
from aiotensor._runtime import buffers
from aiotensor._runtime.buffers import PAGE, SlotPool, StagingPool
from aiotensor._runtime.cuda import Pinning

pytestmark = pytest.mark.anyio


async def test_arenas_are_bounded_reused_and_waited_for() -> None:
    pool = StagingPool(2)
    a = await pool.acquire(5000)
    b = await pool.acquire(5000)
    assert a is not b and a.nbytes == b.nbytes == 2 * PAGE
    got: list[object] = []

    async def third() -> None:
        got.append(await pool.acquire(100))

    async with anyio.create_task_group() as tg:
        tg.start_soon(third)
        await anyio.sleep(0.05)
        assert got == []  # both arenas busy: the third save waits, nothing new is mapped
        pool.release(b)
    assert got == [b]  # the released arena, reused (a small request fits a larger arena)
    with anyio.move_on_after(0.05):  # a waiter cancelled while waiting takes nothing
        await pool.acquire(100)
    pool.release(a)
    assert await pool.acquire(100) is a
    pool.release(a)
    pool.release(b)
    assert pool.mapped_bytes == 4 * PAGE
    pool.close()
    assert pool.mapped_bytes == 0


async def test_a_bigger_state_replaces_an_idle_arena_instead_of_adding_one() -> None:
    pool = StagingPool(1)
    small = await pool.acquire(PAGE)
    pool.release(small)
    big = await pool.acquire(10 * PAGE)
    assert big is not small and big.nbytes == 10 * PAGE
    pool.release(big)
    assert pool.mapped_bytes == 10 * PAGE  # the small one was unmapped
    pool.close()


def test_slots_are_taken_given_back_pinned_once_and_never_over_handed() -> None:
    calls: list[str] = []
    pinning = Pinning(register=lambda a, n, d: calls.append("pin"), unregister=lambda a, d: calls.append("unpin"), device=0)
    slots = SlotPool(2, 5000)
    i, j = slots.take(), slots.take()
    assert {i, j} == {0, 1} and len(slots.view(i)) == 2 * PAGE
    with pytest.raises(RuntimeError, match="exhausted"):
        slots.take()
    slots.pin(pinning)
    slots.pin(pinning)
    assert calls == ["pin"]
    slots.give(i)
    slots.close()  # a slot is still out: nothing is unmapped under it
    assert calls == ["pin"]
    slots.give(j)
    slots.close()
    assert calls == ["pin", "unpin"]


def _in_memory(buf: memoryview) -> list[bool]:
    """Which pages of ``buf`` (page-aligned) are in memory, by ``mincore``."""
    import ctypes

    from aiotensor._runtime.buffers import address

    n = len(buf) // PAGE
    vec = ctypes.create_string_buffer(n)
    assert ctypes.CDLL(None).mincore(ctypes.c_void_p(address(buf)), ctypes.c_size_t(len(buf)), vec) == 0
    return [bool(b & 1) for b in vec.raw]


def test_prefault_faults_in_fresh_memory_in_one_call_and_leaves_used_memory_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import mmap

    from aiotensor._runtime import buffers

    probe = mmap.mmap(-1, PAGE)  # the kernel asked directly: does it know the advice at all?
    if buffers.libc().madvise(buffers.address(memoryview(probe)), PAGE, 23) != 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    probe.close()
    m = mmap.mmap(-1, 64 * PAGE)
    whole = memoryview(m)
    assert not any(_in_memory(whole))  # fresh anonymous memory: no page yet
    buffers.prefault(whole[PAGE + 5 : 40 * PAGE - 3])  # a read about to fill these bytes
    got = _in_memory(whole)
    assert got == [False] + [True] * 39 + [False] * 24  # the pages the bytes lie on, no others
    calls: list[object] = []
    real = buffers.libc()

    class Spy:
        mincore = real.mincore

        def madvise(self, *a: object) -> None:
            calls.append(a)

    monkeypatch.setattr(buffers, "libc", Spy)
    buffers.prefault(whole[PAGE : 40 * PAGE])
    assert calls == []  # in memory already (a load's memory used before): one page checked, nothing done
    buffers.prefault(whole[50 * PAGE :])
    assert len(calls) == 1
    del whole
    m.close()


def test_a_copy_on_write_mapping_holds_no_descriptor_and_goes_with_its_last_array(tmp_path: Any) -> None:
    import errno
    import os

    from aiotensor._runtime.buffers import map_copy

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 32)
    fd = os.open(path, os.O_RDONLY)
    a = map_copy(fd, 8192)
    os.close(fd)  # the mapping needs no descriptor
    assert bytes(a[250:260]) == bytes([250, 251, 252, 253, 254, 255, 0, 1, 2, 3])
    a[0] = 7  # copy-on-write: this process only
    assert path.read_bytes()[0] == 0
    view = a[4096:]
    del a
    assert int(view[1]) == 1  # alive while any array over it lives

    def mapped() -> bool:
        with open("/proc/self/maps") as f:
            return any(str(path) in line for line in f)

    assert mapped()
    del view
    assert not mapped()
    fd = os.open(path, os.O_WRONLY)
    with pytest.raises(OSError) as e:
        map_copy(fd, 8192)  # a mapping needs a readable file
    assert e.value.errno == errno.EACCES
    os.close(fd)


def test_a_mapping_past_the_end_of_a_file_is_refused_naming_it(tmp_path: Any) -> None:
    """Found by review: libc's mmap maps past a file's end (touching it there is a SIGBUS that kills
    the process), where mmap.mmap refused; a file truncated after its header was read is an OSError
    that names it."""
    import os

    from aiotensor._io.tensors import mapped

    path = tmp_path / "f.bin"
    path.write_bytes(b"\1" * 8192)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match=f"mapping {path}: the file is 8192 bytes now, fewer than the 12288"):
            mapped(fd, str(path), 12288, [], None)
        assert len(mapped(fd, str(path), 8192, [], None)) == 0
    finally:
        os.close(fd)


@pytest.mark.parametrize("nbytes", [1, knobs.MOVE_HELD_BYTES, knobs.MOVE_HELD_BYTES + 1, 3 << 20])
def test_move_copies_exactly_nbytes_whether_it_keeps_the_gil_or_not(nbytes: int) -> None:
    src = torch.randint(0, 256, (nbytes + 8,), dtype=torch.uint8)
    dst = torch.zeros(nbytes + 8, dtype=torch.uint8)
    buffers.move(dst.data_ptr() + 4, src.data_ptr() + 2, nbytes)
    assert torch.equal(dst[4 : 4 + nbytes], src[2 : 2 + nbytes])
    assert not dst[:4].any() and not dst[4 + nbytes :].any()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 64), st.integers(0, 16)), max_size=12))
def test_disjoint_is_the_pairwise_check(ranges: list[tuple[int, int]]) -> None:
    """``disjoint`` (numpy, for a unit's 20,000 members) says what comparing every two ranges
    says: an overlap, or an empty range at another's start, is None; else the span they cover."""
    addresses, sizes = [a for a, _ in ranges], [n for _, n in ranges]
    clash = any(a1 == a2 or (a1 < a2 + n2 and a2 < a1 + n1) for i, (a1, n1) in enumerate(ranges) for a2, n2 in ranges[i + 1 :])
    want = None if clash or not ranges else (min(addresses), max(a + n for a, n in ranges))
    assert buffers.disjoint(addresses, sizes) == want


async def test_an_arena_the_system_refuses_to_map_is_an_oserror_saying_what(monkeypatch: pytest.MonkeyPatch) -> None:
    """helper-43: an address-space limit (ulimit -v) made a save fail with a bare OSError(12,
    'Cannot allocate memory'), naming nothing; the pool counts no arena for it."""
    import errno

    def refused(*a: object) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    pool = StagingPool(2)
    monkeypatch.setattr(buffers.HostBuffer, "__init__", refused)
    with pytest.raises(OSError, match=r"Cannot allocate memory: mapping 5 MiB of staging memory for a save") as e:
        await pool.acquire(5 << 20)
    assert e.value.errno == errno.ENOMEM and pool._count == 0


class _Charged:
    """A StagingPool whose arenas are charged to a limit of ``limit`` bytes (memory_room() of it);
    unmapping takes 0.2 s, so other saves run meanwhile (helper-45's schedules)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, limit: int, arenas: int) -> None:
        import time

        self.live = 0
        monkeypatch.setattr(knobs, "ROOM_CHECK_BYTES", 1)
        monkeypatch.setattr(buffers, "memory_room", lambda: (limit - self.live, limit - self.live))
        self.pool = pool = StagingPool(arenas)
        real_map, real_unmap = pool._map, pool._unmap

        def charged(n: int) -> Any:
            a = real_map(n)
            self.live += a.nbytes
            return a

        def slowly(a: Any) -> None:
            time.sleep(0.2)
            self.live -= a.nbytes
            real_unmap(a)

        monkeypatch.setattr(pool, "_map", charged)
        monkeypatch.setattr(pool, "_unmap", slowly)


async def test_a_save_that_grows_an_arena_takes_one_released_meanwhile(monkeypatch: pytest.MonkeyPatch) -> None:
    """helper-45: a save unmapping an idle arena to map a bigger one never looked again at the
    idle arenas: one released during the unmap sat there while the save waited for ever (room
    for one 30 MiB arena, not two, after the memory check)."""
    MiB = 1 << 20
    c = _Charged(monkeypatch, 50 * MiB, 2)
    small = await c.pool.acquire(10 * MiB)
    big = await c.pool.acquire(30 * MiB)
    c.pool.release(small)
    got: list[Any] = []

    async def grown() -> None:
        got.append(await c.pool.acquire(30 * MiB))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(grown)
            await anyio.sleep(0.05)  # it unmaps the small one
            c.pool.release(big)
    assert got == [big]


async def test_no_memory_error_while_another_save_unmaps_an_arena(monkeypatch: pytest.MonkeyPatch) -> None:
    """helper-45: while one save unmapped the small arena to grow it, another found no arena
    counted and the small one's memory still charged: MemoryError for a state that fits once
    the unmap is done. It waits; both get the arena in turn."""
    MiB = 1 << 20
    c = _Charged(monkeypatch, 35 * MiB, 1)
    small = await c.pool.acquire(10 * MiB)
    done: list[int] = []

    async def save() -> None:
        a = await c.pool.acquire(30 * MiB)
        await anyio.sleep(0.1)
        done.append(a.nbytes)
        c.pool.release(a)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(save)
            tg.start_soon(save)
            await anyio.sleep(0.05)
            c.pool.release(small)
    assert len(done) == 2
