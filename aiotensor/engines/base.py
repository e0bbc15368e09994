"""The engine contract.

Every method blocks and is called from a worker thread, never from the event loop thread. Every
change to the file system the store makes goes through an engine, so a test engine can record
the operations (commit order, power-loss replay) or fail any one of them.

Call order for a file the store writes: ``create`` → ``pwrite``… → (``truncate``) → ``sync`` →
``close``; then for the checkpoint folder ``sync_dir`` → ``rename`` → ``sync_dir(parent)``.
"""

from __future__ import annotations

import abc
import errno
import os
from collections.abc import Sequence
from typing import Any

import torch


class Engine(abc.ABC):
    """Blocking file operations on paths and integer handles."""

    name: str = "engine"
    mode: str = ""  # how the engine moves device memory, where it has modes (kvikio: gds/compat)
    read_bytes: int | None = None  # the size of read it wants (an object store: a request per read)
    # the storage renames atomically (a file system); False: an object store, where every object is
    # put whole under its final name and a folder is a key prefix (see aiotensor.commit)
    renames: bool = True
    # every read of an open file goes through its handle, so a file unlinked meanwhile is still read
    # whole (False: an object store, whose handle is a key)
    holds_files: bool = True

    @property
    def label(self) -> str:
        """What :attr:`TensorStore.io_mode <aiotensor.TensorStore.io_mode>` reports: the name, and
        the mode where there is one."""
        return f"{self.name} ({self.mode})" if self.mode else self.name

    @abc.abstractmethod
    def open_read(self, path: str) -> int: ...

    @abc.abstractmethod
    def create(self, path: str, *, direct: bool = False) -> int:
        """Create a new file for writing; fails if it exists.

        ``direct`` promises that every write will be page-aligned in memory, offset and length
        (the file is then cut to its size with :meth:`truncate`): the engine may bypass the page
        cache. It is a hint; an engine or file system that cannot do it writes normally.
        """

    @abc.abstractmethod
    def size(self, fd: int) -> int: ...

    def identity(self, fd: int) -> Any:
        """What tells this open file from another file, or from itself written since, at the same
        path (compared, never read): None where the engine cannot tell."""
        return None

    @abc.abstractmethod
    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        """Read up to ``len(buf)`` bytes at ``offset`` into ``buf``; return the count (0 at end of file)."""

    @property
    def scatters(self) -> bool:
        """Does :meth:`preadv` read many buffers in one call?"""
        return False

    def preadv(self, fd: int, bufs: Sequence[Any], offset: int) -> int:
        """Read into each of ``bufs`` in turn, from ``offset``, in one call (at most 1,024 of them);
        return the count (short only at the file's end). Only where :attr:`scatters`."""
        raise NotImplementedError

    def open_direct(self, fd: int) -> int | None:
        """A second descriptor of the open file ``fd`` that reads past the page cache (O_DIRECT:
        memory, offset and length page-aligned, a short read only at the file's end), or None where
        the engine or the file system has none. Read it with :meth:`pread`; close it with :meth:`close`."""
        return None

    def cached(self, fd: int, offset: int, nbytes: int) -> int:
        """How many of the ``nbytes`` bytes at ``offset`` the page cache holds, from the first on
        (0: none, or the engine cannot tell). Asking reads nothing and starts no read-ahead."""
        return 0

    @abc.abstractmethod
    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        """Write ``buf`` at ``offset``; return how many bytes were written (may be short)."""

    @abc.abstractmethod
    def truncate(self, fd: int, size: int) -> None:
        """Set the file's size."""

    @abc.abstractmethod
    def sync(self, fd: int) -> None:
        """Make the file's data durable (fdatasync)."""

    @abc.abstractmethod
    def close(self, fd: int) -> None: ...

    @abc.abstractmethod
    def mkdir(self, path: str) -> bytes | None:
        """Create the folder ``path`` (FileExistsError if it is there). An engine whose folders are
        marked (an object store's) returns the marker's bytes, which tell this folder from one
        another writer made at that name since (:meth:`holds`); else None."""

    def holds(self, path: str, data: bytes) -> bool:
        """Does the file ``path`` hold exactly ``data``? (False where it is missing.)"""
        try:
            fd = self.open_read(path)
        except FileNotFoundError:
            return False
        try:
            if self.size(fd) != len(data):
                return False
            buf = bytearray(len(data))
            return self.pread(fd, memoryview(buf), 0) == len(data) and buf == data
        finally:
            self.close(fd)

    @abc.abstractmethod
    def rename(self, src: str, dst: str) -> None:
        """Atomically rename ``src`` to ``dst`` (replacing a file ``dst``)."""

    @abc.abstractmethod
    def sync_dir(self, path: str) -> None:
        """Make a folder's entries (creations, renames, removals) durable."""

    @abc.abstractmethod
    def remove_tree(self, path: str) -> None:
        """Remove a file or a folder and everything in it; a missing path is not an error."""

    def remove_file(self, path: str) -> None:
        """Remove a file (never a folder: that is an error); a missing path is not an error."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    # --- device memory (engines that move bytes between files and GPU memory themselves) ---

    def handles_device(self, t: torch.Tensor) -> bool:
        """Can :meth:`pread_device`/:meth:`pwrite_device` move ``t``'s bytes (no host bounce)?"""
        return False

    def pread_device(self, fd: int, dst: torch.Tensor, offset: int) -> int:
        """Read up to ``dst.nbytes`` bytes at ``offset`` into ``dst``'s memory; return the count."""
        raise NotImplementedError(f"the {self.name} engine cannot read into {dst.device} memory")

    def pread_ranges(self, fd: int, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(offset, nbytes)`` range of ``fd``, at most ``nbytes`` (fewer at the
        end of the file): many small reads at once, one call each here (an object store fetches
        them together, in parallel)."""
        out = []
        for off, n in ranges:
            buf = bytearray(n)
            out.append(bytes(buf[: self.pread(fd, memoryview(buf), off)]))
        return out

    def pwrite_device(self, fd: int, src: torch.Tensor, offset: int) -> int:
        """Write ``src``'s bytes at ``offset``; return how many were written (may be short)."""
        raise NotImplementedError(f"the {self.name} engine cannot write from {src.device} memory")

    # --- whole files (the one way an object store writes) ---

    def put(self, path: str, views: Sequence[memoryview]) -> None:
        """Create ``path`` (it must not exist) holding the bytes of ``views`` one after the other,
        durably."""
        fd = self.create(path)
        try:
            off = 0
            for view in views:
                while len(view):
                    n = self.pwrite(fd, view, off)
                    if n <= 0:
                        raise OSError(errno.ENOSPC, f"no progress writing {path} (disk full?)")
                    view, off = view[n:], off + n
            self.sync(fd)
        finally:
            self.close(fd)

    def replace(self, path: str, tmp: str, data: bytes) -> None:
        """Make ``path`` hold ``data`` atomically (written at the temporary name ``tmp`` beside it,
        then renamed over it; the caller makes the folder durable)."""
        try:
            self.put(tmp, [memoryview(data)])
            self.rename(tmp, path)
        except BaseException:
            self.remove_file(tmp)
            raise

    def link(self, src: str, dst: str) -> None:
        """Make ``dst`` (it must not exist) the same file as ``src`` (a hard link): its bytes are
        durable already; ``dst``'s folder entry is, once the folder is synced. OSError where the
        file system has no hard links."""
        os.link(src, dst, follow_symlinks=False)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def exists(self, path: str) -> bool:
        """Is there anything of that name (a symbolic link counts, even a broken one)?"""
        return os.path.lexists(path)

    def stat(self, path: str) -> os.stat_result:
        """What ``path`` is, not following a symbolic link (``os.lstat``)."""
        return os.lstat(path)
