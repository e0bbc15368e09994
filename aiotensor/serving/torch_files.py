"""torch.save files: :func:`load_torch` reads one without unrestricted pickle, :func:`save_torch`
writes one whose storages lie at 4096-byte offsets, atomically."""

from __future__ import annotations

import errno
import io
import os
import threading
from typing import IO, Any, cast

import torch

from .._runtime.scheduler import Priority, Scheduler, own_scheduler
from ..commit import Publication
from ..engines import Engine
from ..errors import annotate_oserror
from ..formats import torchsave as ts
from .tensor_stream import stream


async def load_torch(
    path: str | os.PathLike[str], *, device: str | torch.device = "cpu", scheduler: Scheduler | None = None
) -> Any:
    """Load a torch.save zip (``.pt``/``.bin``) as the state it holds, without unrestricted pickle:
    only what state_dicts are made of is admitted (as ``torch.load(weights_only=True)``), storages
    are bounds-checked against the file and read straight from their offsets.

    Raises:
        UnsafeFileError: a global outside the allow-list (nothing ran), a compressed entry, a
            storage of the wrong size, a tensor outside its storage; not a torch.save zip.
        OSError: the file cannot be read.

    Cancellation: every read stops; nothing is returned.
    """
    path = os.fspath(path)
    async with stream(path, device=device, scheduler=scheduler) as s:
        with s.scheduler.operation():
            tree = await s.scheduler.call(ts.parse_path, os.path.realpath(path), priority=Priority.LOAD)  # noqa: ASYNC240
            got = {name: t async for name, t in s}
            return await s.scheduler.run_sync(ts.map_tensors, tree, lambda name, ref: got[name].requires_grad_(ref.requires_grad))


_ALIGN_LOCK = threading.Lock()


class _EngineFile(io.RawIOBase):
    """A new file as torch.save writes it: each ``write`` one engine ``pwrite`` (so a test engine
    sees every byte), in order."""

    def __init__(self, engine: Engine, fd: int) -> None:
        super().__init__()
        self.engine, self.fd, self.pos = engine, fd, 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        off = 0
        while off < len(view):
            n = self.engine.pwrite(self.fd, view[off:], self.pos + off)
            if n <= 0:
                raise OSError(errno.ENOSPC, "no progress writing (disk full?)")
            off += n
        self.pos += len(view)
        return len(view)


def _write_torch(engine: Engine, path: str, state: Any) -> None:
    """Create ``path`` as a torch.save file of ``state``, storages 4096-aligned, durably (blocking)."""
    import torch.utils.serialization as ser

    fd = engine.create(path)
    try:
        with _ALIGN_LOCK:  # torch's setting is process-wide: restored before anyone else saves through us
            old = ser.config.save.storage_alignment
            ser.config.save.storage_alignment = 4096
            try:
                torch.save(state, cast(IO[bytes], _EngineFile(engine, fd)))
            finally:
                ser.config.save.storage_alignment = old
        engine.sync(fd)
    finally:
        engine.close(fd)


async def save_torch(state: Any, path: str | os.PathLike[str], *, scheduler: Scheduler | None = None) -> None:
    """Write a torch.save file that ``torch.load`` opens, with every storage at a 4096-byte file
    offset (so a reader can move them with O_DIRECT or cuFile, as :func:`load_torch` does),
    atomically (see :mod:`aiotensor.commit`: a temporary name, fsync'ed, renamed over ``path``,
    the folder fsync'ed), through the scheduler's engine.

    Raises:
        OSError: naming the file; ``path`` is then untouched.

    Cancellation: the write finishes in its thread, then the temporary file is removed.
    """
    path = os.path.abspath(os.fspath(path))  # noqa: ASYNC240 - getcwd, no disk access
    async with own_scheduler(scheduler) as sched, Publication(sched, path, folder=False) as pub:
        try:
            await sched.call(_write_torch, sched.engine, pub.tmp, state, priority=Priority.SAVE)
        except OSError as e:
            raise annotate_oserror(e, f"writing {pub.tmp}") from e
        await pub.publish()
