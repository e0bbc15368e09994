"""The posix engine: os.preadv/os.pwritev (they release the GIL) and fdatasync."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import shutil
import stat
import sys
from collections.abc import Sequence
from typing import Any

from .._runtime.buffers import MAP_FAILED, libc
from ..errors import UnsafePathError
from .base import Engine

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Linux's: opening FD_DIR/N opens descriptor N's file again, unlinked or not (thread-self: also in a
# process whose main thread has exited, where /proc/self/fd fails, helper-56; Linux 3.17 and later)
FD_DIR = next((d for d in ("/proc/thread-self/fd", "/proc/self/fd") if os.path.isdir(d)), None)
log = logging.getLogger("aiotensor")


class PosixEngine(Engine):
    """Posix I/O. Chunking and parallelism are the scheduler's job.

    Args:
        direct: honour ``create(direct=True)`` with O_DIRECT and (unless ``direct_reads`` says
            otherwise) offer :meth:`open_direct`, where the file system supports it. Aligned
            writes from staging arenas skip the page cache: 2.9 to 3.7 GB/s against 0.5 to 2 GB/s
            buffered (1.4 GB written and fdatasync'ed, on the development VM). Reads take what the
            page cache holds from it (``mincore``) and the rest with O_DIRECT in big pieces.
        direct_reads: offer :meth:`open_direct` (default: as ``direct``). Which reads a cold file
            faster depends on the machine: on the GPU machine O_DIRECT (4 x 16 MiB: 1.9 GB/s
            against 1.6 buffered, ``bench_read_patterns.py``); on the development VM either, from
            one hour to the next (``bench_serving.py`` measures both). ``False``: every read goes
            through the page cache, which then holds the file (a second load is warm).
    """

    name = "posix"

    def __init__(self, *, direct: bool = True, direct_reads: bool | None = None) -> None:
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.direct_reads = self.direct if direct_reads is None else direct_reads and hasattr(os, "O_DIRECT")

    def open_read(self, path: str) -> int:
        return open_regular(path)

    def create(self, path: str, *, direct: bool = False) -> int:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
        if direct and self.direct:
            try:  # set after creating: a file system without O_DIRECT refuses it here, not at open
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    os.close(fd)
                    raise
                log.info("%s: the file system refuses O_DIRECT; writing through the page cache", path)
        return fd

    def truncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def identity(self, fd: int) -> tuple[int, int, int, int]:
        """The file (device, inode: a file renamed over the path is another) and its size and
        modification time (written in place since)."""
        st = os.fstat(fd)
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        return os.preadv(fd, [buf], offset)

    @property
    def scatters(self) -> bool:
        """Only where :meth:`pread` is this class's own: a subclass that reads its own way gets every read."""
        return type(self).pread is PosixEngine.pread

    def preadv(self, fd: int, bufs: Sequence[Any], offset: int) -> int:
        return os.preadv(fd, bufs, offset)

    def open_direct(self, fd: int) -> int | None:
        if not self.direct_reads:
            return None
        if FD_DIR is None:
            return None
        try:  # the open file itself, by its descriptor: no path is looked up again
            return os.open(f"{FD_DIR}/{fd}", os.O_RDONLY | os.O_DIRECT | _O_CLOEXEC)
        except OSError:  # a file system without O_DIRECT (tmpfs before Linux 6.6: EINVAL)
            return None

    def cached(self, fd: int, offset: int, nbytes: int) -> int:
        return resident(fd, offset, nbytes)

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        return os.pwritev(fd, [buf], offset)

    def sync(self, fd: int) -> None:
        os.fdatasync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def mkdir(self, path: str) -> None:
        os.mkdir(path)
        return None

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove_tree(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=False)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


_KINDS = {stat.S_IFIFO: "FIFO", stat.S_IFCHR: "character device", stat.S_IFBLK: "block device", stat.S_IFSOCK: "socket"}


def open_regular(path: str) -> int:
    """Open a regular file for reading, never following a symbolic link at ``path`` itself.

    Opened non-blocking and checked with ``fstat`` before anything reads it: a FIFO or device can
    never block a worker thread (and so a cancellation) for ever.

    Raises:
        UnsafePathError: ``path`` is a symbolic link, a folder, a FIFO, a device or a socket.
        OSError: it cannot be opened.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePathError(
                "is a symbolic link: aiotensor does not follow links inside checkpoints (they could lead out of it)",
                path,
            ) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "folder" if stat.S_ISDIR(mode) else _KINDS.get(stat.S_IFMT(mode), "special file")
            raise UnsafePathError(f"is a {kind}, not a regular file: refused before reading", path)
        os.set_blocking(fd, True)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


_LIBC = libc()
_PAGE = mmap.PAGESIZE
_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore sets the low bit of a resident page's byte


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_NR_CACHESTAT = 451  # Linux 6.5, the same number on every architecture (asm-generic/unistd.h)
_cachestat_works = sys.platform == "linux"


def _cached_pages(fd: int, start: int, length: int) -> int | None:
    """``cachestat``: how many pages of the range are in the page cache, in one call and with no
    mapping (None where the kernel has no such call). ``syscall`` is variadic: every argument goes
    as a whole register (a C ``long``), as the kernel reads them."""
    global _cachestat_works
    if not _cachestat_works:
        return None
    got = _Cachestat()
    if _LIBC.syscall(
        ctypes.c_long(_NR_CACHESTAT),
        ctypes.c_long(fd),
        ctypes.byref(_CachestatRange(start, length)),
        ctypes.byref(got),
        ctypes.c_long(0),
    ):
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # an older kernel, or a seccomp filter
            _cachestat_works = False
        return None
    return int(got.nr_cache)


def resident(fd: int, offset: int, nbytes: int) -> int:
    """How many of the ``nbytes`` bytes of ``fd`` at ``offset`` are in the page cache, from the
    first on (a read with ``RWF_NOWAIT`` would start read-ahead of what is missing, reading it
    twice). ``cachestat`` counts the pages in one call (Linux 6.5); where it finds some in and
    some out, or the kernel lacks it, ``mincore`` of a mapping that is never touched says which. A
    mapping costs more than its syscalls: mapping and unmapping take the process's memory-map lock
    for writing, behind every page fault and ``madvise`` of the other threads (1.2 ms a call in a
    stream of 20,000 tensors, where ``cachestat`` takes a few µs). 0 where it cannot be told."""
    if _LIBC is None or nbytes <= 0:
        return 0
    start = offset // _PAGE * _PAGE
    length = offset + nbytes - start
    pages = -(-length // _PAGE)
    counted = _cached_pages(fd, start, length)
    if counted is not None and (counted == 0 or counted >= pages):
        return nbytes if counted else 0
    addr = _LIBC.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr is None or addr == MAP_FAILED:
        return 0
    try:
        vec = ctypes.create_string_buffer(pages)
        # the first, middle and last page first: a range is nearly always all in or all out, and
        # asking for every page costs ~70 ns each (a tenth of copying them from the cache)
        base = ctypes.addressof(vec)
        probe = sorted({0, pages // 2, pages - 1})
        if any(_LIBC.mincore(addr + i * _PAGE, _PAGE, base + i) for i in probe):
            return 0
        seen = {vec.raw[i] & 1 for i in probe}
        if len(seen) == 1:
            cold = pages if seen == {1} else 0
        elif _LIBC.mincore(addr, length, base) != 0:
            return 0
        else:
            cold = vec.raw.translate(_LOW_BIT).find(0)  # the first page that is not resident
            cold = pages if cold < 0 else cold
    finally:
        _LIBC.munmap(addr, length)
    return max(0, min(nbytes, cold * _PAGE - (offset - start)))
