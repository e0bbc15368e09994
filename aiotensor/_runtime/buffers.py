"""Page-aligned host memory: staging arenas for saves and the bounce-slot pool for reads.

Both come from anonymous ``mmap``: page-aligned (O_DIRECT and cudaHostRegister want that) and
returned to the OS when closed. Memory is mapped once and reused; it never grows with the number of
saves, only with the largest state staged so far.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import torch

from .. import knobs
from . import threads
from .native import native

PAGE = mmap.PAGESIZE
log = logging.getLogger("aiotensor")


def round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


def copy_bytes(dst: Any, src: Any) -> None:
    """``dst[:] = src`` for two buffers of bytes (``src`` may be read-only), with the GIL released
    (numpy's plain copy, as the staging copies make; a memoryview assignment keeps the GIL for the
    whole copy, and the event loop's thread waits)."""
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def move(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``src`` to address ``dst`` (libc memmove through ctypes: a call
    costs far less than making buffers of both ends). A copy of up to :data:`knobs.MOVE_HELD_BYTES`
    keeps the GIL (microseconds); a bigger one lets it go. Letting it go costs little when nothing
    waits for it, but a thread that gives the GIL up waits to get it back while another runs Python,
    up to a switch interval: 20,000 moves of 5 KB took 24 ms alone and 9.4 s beside a thread
    running Python, against 44 ms when the GIL is kept."""
    (_held_memmove if nbytes <= knobs.MOVE_HELD_BYTES else ctypes.memmove)(dst, src, nbytes)


def _memmove_keeping_gil() -> Any:
    """libc's memmove called through PyDLL (the call keeps the GIL); ctypes' own where this
    process has no C library to open by name (not on Linux or macOS)."""
    try:
        fn = ctypes.PyDLL(None).memmove
    except (OSError, TypeError, AttributeError):
        return ctypes.memmove
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_held_memmove = _memmove_keeping_gil()


_copy_spans = getattr(native, "copy_spans", None)  # (None too from a helper built before it had one)


def copy_spans(base: int, starts: list[int], sources: list[int], sizes: list[int], compare: bool = False) -> bool:
    """``move(base + starts[i], sources[i], sizes[i])`` for every ``i``: many small copies in one C
    call (the GIL let go while the bytes move), where each :func:`move` costs a Python call (20,000
    copies of 16 KB: 42 ms by ``move``, against 20 by this). ``compare``: a span whose destination
    holds its bytes already is not copied; returns whether any span was (without: True)."""
    if _copy_spans is not None:
        return bool(_copy_spans(base, starts, sources, sizes, compare))
    top = 1 << (8 * ctypes.sizeof(ctypes.c_void_p))
    for start, src, n in zip(starts, sources, sizes, strict=True):  # (the C helper's checks: ctypes wraps)
        if min(base, start, src, n) < 0 or max(base + start + n, src + n) > top:
            raise OverflowError("copy_spans: a span past the address space")
    copied = not compare
    for start, src, n in zip(starts, sources, sizes, strict=True):
        if not (compare and same_bytes(base + start, src, n)):
            move(base + start, src, n)
            copied = True
    return copied


def give_back_freed() -> None:
    """Hand the memory the C library keeps free back to the system (glibc's ``malloc_trim(0)``;
    nothing where the library has none: musl, macOS). torch's CPU tensors come from ``malloc``,
    and what a hot swap freed stayed in glibc's arenas, one per thread that allocated: a server's
    resident memory grew by three models' sizes over seven swaps of a 0.53 GB model, 1.25 to 2.85
    GB, where with this it stays at 1.25 (``bench/bench_swap.py``). Blocking (it walks the arenas):
    in a worker thread."""
    trim = getattr(libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def libc() -> Any:
    """This process's C library, with the signatures of the calls aiotensor makes through ctypes
    (each releases the GIL): ``mmap``, ``munmap``, ``mincore``, ``madvise``, ``memcmp``, ``syscall``; None where
    there is no such library. One handle for every caller: the signatures are set once."""
    try:
        c = ctypes.CDLL(None, use_errno=True)
        c.mmap.restype = ctypes.c_void_p
        c.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        c.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        c.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        c.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        c.memcmp.restype = ctypes.c_int
        c.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        c.syscall.restype = ctypes.c_long
        if hasattr(c, "malloc_trim"):  # (glibc's)
            c.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return c


MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_POPULATE_WRITE = 23  # Linux 5.14


def prefault(buf: memoryview) -> None:
    """Fault in the pages of ``buf`` (writable host memory) in one call if its first page is not
    in memory yet (fresh memory that a read is about to fill; memory used before is left alone, a
    check of one page). A ``pread`` into fresh memory takes each page's fault inside the kernel's
    copy: a 0.5 GB read from the page cache in 1 MiB pieces on 2 threads took 174-205 ms that way,
    160-164 ms with the pages faulted in first (bench_fresh.py). Nothing where the kernel lacks it."""
    c = libc()
    if c is None or not len(buf):
        return
    at = address(buf)
    start = at - at % PAGE
    vec = ctypes.c_ubyte()
    if c.mincore(start, PAGE, ctypes.byref(vec)) != 0 or vec.value & 1:
        return
    c.madvise(start, at + len(buf) - start, _MADV_POPULATE_WRITE)


class _Mapping:
    """Mapped memory, as numpy's array interface sees it; unmapped once nothing refers to it, after
    each of ``pins`` (a cuda.Pinning that registered it with CUDA) has unregistered it. A range
    unmapped while still registered stays registered in the driver: the next mapping at that address
    then fails ``cudaHostRegister`` with error 712, ours and kvikio's bounce buffers alike (the first
    run on a GPU: every scheduler dropped without being closed left its pinned slots so)."""

    def __init__(self, at: int, size: int) -> None:
        self.__array_interface__ = {"data": (at, False), "shape": (size,), "typestr": "|u1", "version": 3}
        self.held = _Held(os.getpid())
        weakref.finalize(self, _unmap, at, size, self.held).atexit = False  # arrays may outlive atexit


@dataclass
class _Held:
    """What the unmapping needs: the process that mapped it, who pinned it, and whether forked
    children were kept from it. A child forked later has this object but not such a mapping's pages
    (nor CUDA): it neither unpins nor unmaps it there, where the address may hold a mapping of its own."""

    pid: int
    pins: list[Any] = field(default_factory=list)
    kept_from_children: bool = False


def _unmap(at: int, size: int, held: _Held) -> None:
    if os.getpid() != held.pid:  # a forked child
        if not held.kept_from_children:
            libc().munmap(at, size)  # its own copy-on-write copy
        return
    try:
        for pinning in held.pins:
            pinning.unpin(at)
    finally:
        libc().munmap(at, size)


def _map(size: int, flags: int, fd: int = -1) -> _Mapping:
    """``mmap`` through libc, read-write: ``size`` bytes of ``fd`` (or anonymous memory)."""
    c = libc()
    at = None if c is None else c.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if at is None or at == MAP_FAILED:
        err = ctypes.get_errno() if c is not None else errno.ENOSYS
        raise OSError(err, os.strerror(err))
    return _Mapping(at, size)


def map_copy(fd: int, size: int) -> np.ndarray:
    """``size`` (> 0) bytes of the open file ``fd`` mapped copy-on-write (writes stay in this
    process), as a uint8 array; unmapped when the last array or tensor over it goes. It holds no
    file descriptor, as ``mmap.mmap`` does for its whole life before Python 3.13 (a dup of ``fd``:
    a store's hundreds of shards, mapped, held hundreds); the mapping keeps the file's inode, so a
    file deleted meanwhile is still read.

    Raises:
        OSError: the file is shorter than ``size`` now (a touch past its end would kill the process
            with SIGBUS), or the kernel refused the mapping."""
    have = os.fstat(fd).st_size
    if have < size:
        raise OSError(errno.EIO, f"the file is {have} bytes now, fewer than the {size} to map (truncated meanwhile?)")
    return np.asarray(_map(size, mmap.MAP_PRIVATE, fd))


def address(buf: memoryview) -> int:
    """The address of a writable, non-empty memoryview's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def memory_at(addr: int, nbytes: int) -> memoryview:
    """A writable byte memoryview of the ``nbytes`` at address ``addr`` (no ctypes type made: ctypes
    keeps each array type it makes for the process's life, ~3 KB each). Nothing checks that the
    range is memory, or alive: slices of it are what callers hand out, over memory they hold."""
    return _FROM_MEMORY(addr, nbytes, _PYBUF_WRITE)  # type: ignore[no-any-return]


_FROM_MEMORY = ctypes.pythonapi["PyMemoryView_FromMemory"]  # an object of our own: its types set here alone
_FROM_MEMORY.argtypes, _FROM_MEMORY.restype = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int), ctypes.py_object
_PYBUF_WRITE = 0x200


def disjoint(addresses: Sequence[int], sizes: Sequence[int]) -> tuple[int, int] | None:
    """Where the ranges ``[addresses[i], addresses[i] + sizes[i])`` lie, from the lowest address to
    the highest end, if no two overlap (an empty range at another's address overlaps it); else
    None. By numpy (its sort lets the GIL go): a sort of 20,000 Python tuples held it 2 ms, the
    comparisons 3 ms more."""
    if not addresses:
        return None
    at = np.asarray(addresses, dtype=np.int64)
    order = np.argsort(at, kind="stable")
    lo, ends = at[order], (at + np.asarray(sizes, dtype=np.int64))[order]
    if (ends[:-1] > lo[1:]).any() or (lo[1:] == lo[:-1]).any():
        return None
    return int(lo[0]), int(ends.max())


def same_bytes(a: int, b: int, nbytes: int) -> bool:
    """Are the ``nbytes`` bytes at addresses ``a`` and ``b`` equal (libc's memcmp, GIL released;
    as fast as a copy of them)?"""
    return nbytes == 0 or libc().memcmp(a, b, nbytes) == 0


def memory_room() -> tuple[int, int]:
    """Host memory this process may still take, ``(sure, most)``, by its memory cgroup (v1 or v2,
    the lowest limit on the way up: a container's) and the machine's ``/proc/meminfo``: ``sure``
    counts as free only what the kernel reclaims without harm (page cache no process maps, less
    64 MiB), ``most`` every file page and swap too. A number past both is not there: touching it
    calls the OOM killer, which kills the process without a word. Unknown: ``1 << 62``."""
    sure = most = 1 << 62
    info = _numbers("/proc/meminfo", kib=True)
    if "MemAvailable" in info and "AnonPages" in info:
        sure = info["MemAvailable"]
        # (at least what is available: where meminfo is a container's view, LXCFS, its total is
        # the container's and its anonymous pages may be the host's)
        most = max(sure, info["MemTotal"] - info["AnonPages"] - info.get("Shmem", 0) + info.get("SwapFree", 0))
    for limit, anon, mapped, swaps in _cgroup_limits():
        sure = min(sure, limit - anon - mapped)
        if not (swaps and info.get("SwapFree", 0)):
            most = min(most, limit - anon)
    return sure - (64 << 20), most


def _cgroup_limits() -> list[tuple[int, int, int, bool]]:
    """This process's memory cgroup limits: each ``(limit, anonymous and shared memory charged,
    file pages mapped, whether it may swap)``; none where there is none or it cannot be read."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1: one folder, its limit already the lowest on the way up
            base = next((b for b in (f"/sys/fs/cgroup/memory{path}", "/sys/fs/cgroup/memory") if os.path.isdir(b)), None)
            stat = _numbers(f"{base}/memory.stat") if base else {}
            limit = stat.get("hierarchical_memory_limit", 1 << 62)  # (its own and its parents' lowest)
            if "total_rss" in stat and limit < 1 << 60:
                swap = _numbers(f"{base}/memory.memsw.limit_in_bytes").get("", 1 << 62) > limit
                out.append((limit, stat["total_rss"] + stat.get("total_shmem", 0), stat.get("total_mapped_file", 0), swap))
        elif controllers == "" and line.startswith("0::"):  # v2: every folder on the way up may limit
            at = "/sys/fs/cgroup" + path.rstrip("/")
            at = at if os.path.isdir(at) else "/sys/fs/cgroup"  # (a container's namespace: its own is the root)
            while True:
                cap = _numbers(f"{at}/memory.max").get("")  # (none: "max")
                stat = _numbers(f"{at}/memory.stat")
                if cap is not None and "anon" in stat:
                    swap = _numbers(f"{at}/memory.swap.max").get("", 1 << 62) > 0
                    out.append((cap, stat["anon"] + stat.get("shmem", 0), stat.get("file_mapped", 0), swap))
                if not at.startswith("/sys/fs/cgroup/"):
                    return out
                at = os.path.dirname(at)
    return out


def _numbers(path: str, kib: bool = False) -> dict[str, int]:
    """The ``name value`` lines of a kernel file as numbers (``/proc/meminfo``'s in kB: ``kib``);
    a file of one number (``max`` is none) under the name ``""``; nothing where it cannot be read."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        words = line.replace(":", " ").split()
        if len(words) == 1 and words[0].isdigit():
            out[""] = int(words[0])
        elif len(words) >= 2 and words[1].isdigit():
            out[words[0]] = int(words[1]) * (1024 if kib else 1)
    return out


class HostBuffer:
    """One anonymous mapping, seen as a memoryview and as a uint8 tensor (both share its pages); it
    is unmapped (and unpinned first, where pinned) when the last of them goes.

    Create it in a worker thread when ``populate`` (the default) is set: every page is touched.
    """

    def __init__(self, nbytes: int, *, populate: bool = True) -> None:
        self.nbytes = round_up(max(nbytes, 1))
        self._mapping = _map(self.nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.asarray(self._mapping)  # keeps the mapping alive for the tensor and the views
        self.tensor = torch.from_numpy(self.array)
        self.view = self.array.data
        self.address = int(self.array.ctypes.data)
        # what a save that used this arena left in it: arena offset -> the committed shard whose
        # bytes lie there (an incremental save compares its sources with them while it stages)
        self.images: dict[int, Any] = {}
        if populate:
            # Fault every page in now, in pieces, with the GIL released. Not MAP_POPULATE: it
            # would fault the whole mapping in one call that a cancelled save cannot cut short
            # (4 s for 1.4 GB on the development VM, where the first touch of guest memory is slow).
            for a in range(0, self.nbytes, knobs.TOUCH_BYTES):
                self.tensor[a : a + knobs.TOUCH_BYTES].zero_()

    def keep_from_children(self) -> None:
        """``madvise(MADV_DONTFORK)``: a forked child (a DataLoader worker) does not inherit this
        mapping. Done before pinning: a pinned page shared copy-on-write with a child breaks DMA."""
        advice = getattr(mmap, "MADV_DONTFORK", None)
        if advice is not None and not self._mapping.held.kept_from_children:
            if libc().madvise(self.address, self.nbytes, advice) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"madvise(MADV_DONTFORK): {os.strerror(err)}")
            self._mapping.held.kept_from_children = True

    def pin(self, pinning: Any) -> bool:
        """Pin this mapping with ``pinning`` (a cuda.Pinning; from a worker: pinning blocks), kept
        from forked children first, unless any pinning has already: registration is portable, for
        the whole process. False where no device has a context to pin it under yet."""
        pins = self._mapping.held.pins
        if not pins:
            self.keep_from_children()
            pinning.pin(self.address, self.nbytes)
            if pinning.pinned(self.address) and pinning not in pins:
                pins.append(pinning)  # unpinned by the unmapping at the latest
        return bool(pins)

    def close(self) -> None:
        """Let go of the mapping: unmapped now, or with the last tensor or view still over it."""
        self.view.release()
        del self.tensor, self.array, self._mapping


class StagingPool:
    """Staging arenas for saves: at most ``max_arenas`` exist, each as large as the largest state seen.

    A save takes a whole arena, copies the state into it (the "staged" point), writes it out and
    gives it back. When every arena is busy the next save waits: with two arenas, one save can stage
    while the previous one is still writing; memory stays bounded by ``max_arenas`` × state size.
    """

    def __init__(self, max_arenas: int = 2, *, pinning: Any = None, nice: int = knobs.NICE) -> None:
        if max_arenas < 1:
            raise ValueError(f"max_arenas must be >= 1, got {max_arenas}")
        self.max_arenas = max_arenas
        self.nice = nice  # of the threads that map (and page-fault) arenas: see aiotensor._runtime.threads
        self.pinning = pinning  # a cuda.Pinning: arenas are pinned once when mapped
        self._free: list[HostBuffer] = []
        self._count = 0
        self._changed: anyio.Event | None = None
        # reservations (a store's reserve=) under way: a save waits for the arena one maps rather
        # than map another beside it (helper-43: both stayed mapped, twice the memory for good)
        self.reserving = 0
        self._mapping = 0  # bytes of arenas being mapped now, not yet charged to the process
        self._unmapping = 0  # arenas being unmapped now, still charged

    @property
    def mapped_bytes(self) -> int:
        """Bytes mapped by idle arenas (busy ones are not counted)."""
        return sum(a.nbytes for a in self._free)

    async def acquire(self, nbytes: int, *, reservation: bool = False) -> HostBuffer:
        """Wait for an arena of at least ``nbytes``; mapping a new one runs in a worker thread.
        A new arena is mapped only where the host's memory has room for it (:func:`memory_room`:
        a container's limit): where another arena exists, a save waits for it instead, and
        ``max_arenas`` is lowered to the arenas there are (a warning); where none does, MemoryError
        says so, where touching the arena's pages would have had the process killed. While a
        ``reservation`` maps one, other saves wait for it.

        Cancellation: nothing is taken if cancelled while waiting; if cancelled while a new arena is
        being mapped, the mapping finishes in its thread and is kept for the next save.
        """
        while True:
            if self._free:
                self._free.sort(key=lambda a: a.nbytes)
                fit = next((a for a in self._free if a.nbytes >= nbytes), None)
                if fit is not None:
                    self._free.remove(fit)
                    return fit
                small = self._free.pop()  # grow the largest idle one: unmap it, map a bigger one
                self._unmapping += 1
                try:
                    await threads.run_sync(self._unmap, small, nice=self.nice)
                finally:
                    self._unmapping -= 1
                    self._count -= 1  # (counted until it is gone: its memory was)
                    self.changed()
                continue  # look again: one released meanwhile is there to take (helper-45: a save hung)
            # headroom for a big one: a later plan of the same state may need a little more (an
            # incremental save's candidate shards add headers), and mapping anew would page-fault
            # a whole arena again
            need = nbytes + (nbytes >> 8 if nbytes >= 64 << 20 else 0)
            if self._count < self.max_arenas and (reservation or not self.reserving) and self._room(need):
                self._count += 1
                self._mapping += need
                try:
                    with anyio.CancelScope(shield=True):
                        arena = await threads.run_sync(self._map, need, nice=self.nice)
                except BaseException:
                    self._count -= 1
                    raise
                finally:
                    self._mapping -= need
                    self.changed()  # the saves that waited for it look again
                try:
                    await anyio.lowlevel.checkpoint_if_cancelled()
                except BaseException:
                    self.release(arena)  # cancelled while mapping: kept for the next save
                    raise
                return arena
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    def _room(self, need: int) -> bool:
        """May an arena of ``need`` bytes be mapped now? (See :meth:`acquire`.)"""
        if need < knobs.ROOM_CHECK_BYTES:
            return True
        if self._mapping or self._unmapping:  # what is mapped is changing: decide once it has (changed() wakes)
            return False
        sure, most = memory_room()
        if self._count == 0 and need > most:
            raise MemoryError(
                f"a save needs {need / 2**20:.0f} MiB of staging memory (a copy of the state), and this process "
                f"has at most {max(most, 0) / 2**20:.0f} MiB left under its memory limit (its container's, or the "
                "machine's): raise the limit, or save a smaller state"
            )
        if self._count == 0 or need <= sure:
            return True
        self.max_arenas = self._count  # from now on (a Snapshotter's "skip" reads it)
        log.warning(
            "another staging arena of %.0f MiB would not fit in this process's memory limit (%.0f MiB left): "
            "this store stages %d save(s) at a time from now on, as TensorStore(max_staged=%d) would",
            need / 2**20,
            max(sure, 0) / 2**20,
            self._count,
            self._count,
        )
        return False

    def _map(self, nbytes: int) -> HostBuffer:
        try:
            arena = HostBuffer(nbytes)
        except OSError as e:  # (an address-space limit, overcommit refused): say what could not be mapped
            raise OSError(e.errno, f"{e.strerror}: mapping {nbytes / 2**20:.0f} MiB of staging memory for a save") from None
        if self.pinning is not None:
            arena.pin(self.pinning)
        return arena

    def _unmap(self, arena: HostBuffer) -> None:
        if self.pinning is not None:
            self.pinning.unpin(arena.address)
        arena.close()

    def release(self, arena: HostBuffer) -> None:
        self._free.append(arena)
        self.changed()

    def changed(self) -> None:
        """Wake the saves waiting for an arena (one was released, or a reservation ended)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def close(self) -> None:
        """Unmap the idle arenas (busy ones are unmapped when released to a closed pool)."""
        for a in self._free:
            self._unmap(a)
        self._count -= len(self._free)
        self._free.clear()


class SlotPool:
    """Fixed-size page-aligned bounce slots, mapped lazily on first use.

    The scheduler admits at most ``slots`` operations at a time, so taking a slot never waits.
    """

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = round_up(slot_bytes)
        self._buf: HostBuffer | None = None
        self._free: list[int] = []
        self._pinning: Any = None  # the cuda.Pinning that pinned the slots, if any

    @property
    def mapped(self) -> bool:
        """Whether the slots are mapped (closing the pool then unmaps them: a syscall)."""
        return self._buf is not None

    def take(self) -> int:
        """Take a free slot's index."""
        if self._buf is None:
            self._buf = HostBuffer(self.slots * self.slot_bytes, populate=False)
            self._free = list(range(self.slots))
        if not self._free:
            raise RuntimeError("bounce slot pool exhausted: more operations admitted than slots")
        return self._free.pop()

    def view(self, i: int) -> memoryview:
        assert self._buf is not None
        return self._buf.view[i * self.slot_bytes : (i + 1) * self.slot_bytes]

    def give(self, i: int) -> None:
        self._free.append(i)

    def forget(self) -> None:
        """In a forked child: the parent's slots are left as they are (taken by calls that never end
        here; not even mapped here where kept from children); new ones are mapped on first use."""
        self._buf, self._free, self._pinning = None, [], None

    def pin(self, pinning: Any) -> None:
        """Pin the slots (once; from a worker thread: pinning blocks)."""
        if self._buf is not None and self._pinning is None and self._buf.pin(pinning):
            self._pinning = pinning

    def close(self) -> None:
        if self._buf is not None and len(self._free) == self.slots:
            if self._pinning is not None:
                self._pinning.unpin(self._buf.address)
                self._pinning = None  # the next mapping (a scheduler used again) is pinned afresh
            self._buf.close()
            self._buf = None
