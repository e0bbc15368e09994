"""An engine for tests: records every operation and fails chosen ones with a chosen errno.

eng = FaultyEngine(fail={"sync": (2, errno.EIO)})     # the 2nd sync raises EIO
async with TensorStore(root, engine=eng) as store: ...
eng.ops   # [("mkdir", path), ("create", path, direct), ("pwrite", path, offset, n), ("sync", path), ...]

evict(path)   # a file's pages dropped from the page cache: the next read of it is cold
"""

from __future__ import annotations

import errno
import os
import random
import socket
import threading
import time
from collections import Counter
from typing import Any

import torch

from .engines.base import Engine
from .engines.posix import PosixEngine, resident


class FaultyEngine(Engine):
    """Wraps another engine (posix by default), recording operations and injecting failures.

    Args:
        inner: the engine doing the real work.
        fail: operation name -> (n, errno): the n-th call (1-based) of that operation fails.
            Names: open_read, create, pread, pwrite, truncate, sync, close, mkdir, rename, link, sync_dir,
            remove_tree, remove_file.
        hook: called as ``hook(op_tuple)`` before each operation runs (e.g. to kill the process).
        record_data: pwrite ops also carry the bytes written, ``("pwrite", path, offset, n, data)``
            (for replaying a save, as the power-loss tests do).
    """

    name = "faulty"

    def __init__(
        self,
        inner: Engine | None = None,
        *,
        fail: dict[str, tuple[int, int]] | None = None,
        hook: Any = None,
        record_data: bool = False,
    ):
        self.inner = inner or PosixEngine()
        self.record_data = record_data
        self.fail = dict(fail or {})
        self.hook = hook
        self.ops: list[tuple[Any, ...]] = []
        self.counts: Counter[str] = Counter()
        self._paths: dict[int, str] = {}
        self._lock = threading.Lock()

    @property
    def mode(self) -> str:  # type: ignore[override]
        return self.inner.mode

    def _op(self, *op: Any) -> None:
        with self._lock:
            self.counts[op[0]] += 1
            n = self.counts[op[0]]
            self.ops.append(op)
        if self.hook is not None:
            self.hook(op)
        rule = self.fail.get(op[0])
        if rule is not None and rule[0] == n:
            raise OSError(rule[1], f"injected {errno.errorcode.get(rule[1], rule[1])} on {op[0]} #{n}")

    def open_read(self, path: str) -> int:
        self._op("open_read", path)
        fd = self.inner.open_read(path)
        self._paths[fd] = path
        return fd

    def create(self, path: str, *, direct: bool = False) -> int:
        self._op("create", path, direct)
        fd = self.inner.create(path, direct=direct)
        self._paths[fd] = path
        return fd

    def size(self, fd: int) -> int:
        return self.inner.size(fd)

    def identity(self, fd: int) -> Any:
        return self.inner.identity(fd)

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        self._op("pread", self._paths.get(fd), offset, len(buf))
        return self.inner.pread(fd, buf, offset)

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        self._write_op(fd, offset, len(buf), lambda: bytes(buf))
        return self.inner.pwrite(fd, buf, offset)

    def _write_op(self, fd: int, offset: int, n: int, data: Any) -> None:
        """Record a write; with ``record_data``, with its bytes (``data()``)."""
        self._op("pwrite", self._paths.get(fd), offset, n, *((data(),) if self.record_data else ()))

    def handles_device(self, t: torch.Tensor) -> bool:
        return self.inner.handles_device(t)

    def pread_device(self, fd: int, dst: torch.Tensor, offset: int) -> int:
        self._op("pread", self._paths.get(fd), offset, dst.nbytes)
        return self.inner.pread_device(fd, dst, offset)

    def pwrite_device(self, fd: int, src: torch.Tensor, offset: int) -> int:
        self._write_op(fd, offset, src.nbytes, lambda: src.cpu().numpy().tobytes())
        return self.inner.pwrite_device(fd, src, offset)

    def truncate(self, fd: int, size: int) -> None:
        self._op("truncate", self._paths.get(fd), size)
        self.inner.truncate(fd, size)

    def sync(self, fd: int) -> None:
        self._op("sync", self._paths.get(fd))
        self.inner.sync(fd)

    def close(self, fd: int) -> None:
        path = self._paths.pop(fd, None)
        try:
            self._op("close", path)
        finally:
            self.inner.close(fd)

    def mkdir(self, path: str) -> bytes | None:
        self._op("mkdir", path)
        return self.inner.mkdir(path)

    def rename(self, src: str, dst: str) -> None:
        self._op("rename", src, dst)
        self.inner.rename(src, dst)

    def link(self, src: str, dst: str) -> None:
        self._op("link", src, dst)
        self.inner.link(src, dst)

    def sync_dir(self, path: str) -> None:
        self._op("sync_dir", path)
        self.inner.sync_dir(path)

    def remove_tree(self, path: str) -> None:
        self._op("remove_tree", path)
        self.inner.remove_tree(path)

    def remove_file(self, path: str) -> None:
        self._op("remove_file", path)
        self.inner.remove_file(path)

    def open_fds(self) -> list[str]:
        """Paths of files this engine opened and has not closed (a leak check for tests)."""
        return sorted(self._paths.values())


def evict(path: str | os.PathLike[str]) -> None:
    """Drop a file's pages from the page cache (blocking), asking again until ``mincore`` finds
    none: pages still in another core's LRU batch survive one ``POSIX_FADV_DONTNEED``. Dirty pages
    are written first (fsync).

    Raises: RuntimeError if pages stay (the file is mapped and in use elsewhere)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        size = os.fstat(fd).st_size
        for _ in range(100):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if not any(resident(fd, a, 1 << 20) for a in range(0, size, 1 << 20)):
                return
            time.sleep(0.01)
        raise RuntimeError(f"{os.fspath(path)} stays in the page cache")
    finally:
        os.close(fd)


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports p that are free, with p + 10000 free too, both below the kernel's
    ephemeral range where it leaves room (else below 55536): for a local SeaweedFS (``weed`` serves
    gRPC at each port + 10000, and dies past 65535) in tests and benchmarks. A port in the ephemeral
    range can be taken by any outgoing connection meanwhile: a server restarted on its ports then
    failed with "address already in use"."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 0
    top = ephemeral - 10000 if ephemeral - 10000 > 15000 else 55000
    ports: list[int] = []
    while len(ports) < n:
        p = rng.randrange(10000, top)
        try:
            for q in (p, p + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
        except OSError:
            continue
        if p not in ports:
            ports.append(p)
    return ports
