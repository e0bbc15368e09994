"""``kvikio.cufile``: ``CuFile`` and ``IOFuture`` with the real signatures, posix I/O underneath."""

from __future__ import annotations

import os
import pathlib
import threading
from typing import Optional, Union

from kvikio._fake import state


class IOFuture:
    __slots__ = "_result"

    def __init__(self, result: int) -> None:
        self._result = result

    def get(self) -> int:
        return self._result

    def done(self) -> bool:
        return True


class CuFile:
    """File handle for GPUDirect Storage (GDS)"""

    def __init__(self, file: Union[pathlib.Path, str], flags: str = "r"):
        if flags not in ("r", "w", "a", "r+", "w+", "a+"):
            raise ValueError(f"Unknown file open flag: {flags}")
        mode = os.O_RDONLY if flags == "r" else os.O_RDWR
        self._fd = os.open(file, mode)
        self._closed = False
        state.opened.append(self)

    def close(self) -> None:
        if not self._closed:
            os.close(self._fd)
            self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        return self._fd

    def open_flags(self) -> int:
        return 0

    def __enter__(self) -> CuFile:
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:  # type: ignore[no-untyped-def]
        self.close()

    def _io(self, op: str, buf, size: Optional[int], file_offset: int) -> IOFuture:  # type: ignore[no-untyped-def]
        if state.fail is not None:
            err, state.fail = state.fail, None
            raise err
        assert buf.dtype.itemsize == 1 and buf.dim() == 1 and buf.is_contiguous(), "kvikio takes a flat byte buffer"
        size = buf.nbytes if size is None else size
        state.calls.append((op, threading.get_ident(), file_offset, size))
        n = min(size, state.max_io)
        mv = buf.numpy().data.cast("B")[:n]
        done = os.preadv(self._fd, [mv], file_offset) if op == "pread" else os.pwritev(self._fd, [mv], file_offset)
        return IOFuture(done)

    def pread(self, buf, size: Optional[int] = None, file_offset: int = 0, task_size: Optional[int] = None) -> IOFuture:  # type: ignore[no-untyped-def]
        return self._io("pread", buf, size, file_offset)

    def pwrite(self, buf, size: Optional[int] = None, file_offset: int = 0, task_size: Optional[int] = None) -> IOFuture:  # type: ignore[no-untyped-def]
        return self._io("pwrite", buf, size, file_offset)

    def is_direct_io_supported(self) -> bool:
        return state.direct_io
