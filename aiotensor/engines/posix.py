"""The posix engine: os.preadv/os.pwritev (they release the GIL) and fdatasync."""

from __future__ import annotations

import os
import shutil

from .base import Engine

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class PosixEngine(Engine):
    """Plain buffered posix I/O. Chunking and parallelism are the scheduler's job."""

    name = "posix"

    def open_read(self, path: str) -> int:
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd

    def create(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        return os.preadv(fd, [buf], offset)

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        return os.pwritev(fd, [buf], offset)

    def sync(self, fd: int) -> None:
        os.fdatasync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def mkdir(self, path: str) -> None:
        os.mkdir(path)

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
