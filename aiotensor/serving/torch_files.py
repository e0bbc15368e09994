"""torch.save files: :func:`load_torch` reads one without unrestricted pickle, :func:`save_torch`
writes one whose storages lie at 4096-byte offsets, atomically."""

from __future__ import annotations

import errno
import io
import os
import threading
from collections.abc import Mapping
from typing import IO, Any, cast

import torch

from .. import sources
from .._io.assemble import read
from .._io.tensors import load_device
from .._runtime.scheduler import Priority, Scheduler, own_scheduler
from ..commit import Publication
from ..engines import Engine
from ..errors import HeaderError, UnsafeFileError, annotate_oserror
from ..location import engine_for, local_path, where


async def load_torch(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    verify: bool = True,
    scheduler: Scheduler | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    """Load a torch.save zip (``.pt``/``.bin``) as the state it holds, as ``torch.load`` gives it
    (``weights_only=True``), without its pickle: only what state_dicts are made of is admitted, and
    each storage is bounds-checked and read once, straight from its offset in the file. Tensors
    that share a storage (tied weights, views, expanded views) come back as views of it, as
    ``torch.load`` makes them; structure the pickle shares stays shared. Each storage's bytes are
    checked against the CRC-32 its zip entry records (``torch.load`` never checks it;
    ``verify=False`` skips it).

    ``storage_options``: for an ``s3://`` path, obstore's S3 keys (``endpoint``, ``access_key_id``,
    ``region``..., and ``allow_http``) over the ``AWS_*`` environment (``docs/store.md``).

    Raises:
        ChecksumError: a storage's bytes differ from its zip entry's CRC-32 (naming the file).
        UnsafeFileError: a global outside the allow-list (nothing ran), a compressed or malformed
            entry, a storage of the wrong size, a tensor outside its storage, structure nested or
            shared past the bounds of :mod:`aiotensor.formats.torchsave`; not a torch.save zip.
        OSError: the file cannot be read.

    Cancellation: every read stops; nothing is returned.
    """
    path = local_path(path, objects=True)
    async with own_scheduler(scheduler, engine_for(path, scheduler, storage_options)) as sched:
        dev = await load_device(sched, device)
        try:
            src = await sched.call(sources.resolve, sched.engine, path, priority=Priority.LOAD)
        except HeaderError as e:  # a legacy pickle, junk: read as a safetensors file, it was a HeaderError (helper-50)
            what = "the file" if e.path == path else f"{e.path} (in it)"  # (a folder's broken file: named, helper-53)
            raise UnsafeFileError(f"not a torch.save zip: {what} {e.reason}", path) from None
        if src.kind != "torch":
            raise UnsafeFileError(
                f"not a torch.save zip (a {src.kind} {'folder' if src.kind in ('hf', 'dcp', 'step', 'root') else 'file'})", path
            )
        tensors = await read(sched, src.entries, dev, verify=verify, checks=src.checks)
        state = await sched.call(_state, src, tensors, priority=Priority.LOAD)
        await sched.discard(tensors)
        return state


def _state(src: sources.Source, tensors: list[torch.Tensor]) -> Any:
    """The state the file holds: its tree, each tensor under every name it goes by."""
    by_name = {}
    for e, t in zip(src.entries, tensors, strict=True):
        if e.requires_grad:
            t.requires_grad_(True)
        by_name.update(dict.fromkeys(e.names, t))
    assert src.state is not None
    return src.state(by_name.__getitem__)


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
    """Create ``path`` as a torch.save file of ``state``, storages 4096-aligned, durably (blocking).
    On an object store the file is made in memory, then put whole."""
    if not engine.renames:
        out = io.BytesIO()
        _save_aligned(state, out)
        engine.put(path, [out.getbuffer()])
        return
    fd = engine.create(path)
    try:
        _save_aligned(state, cast(IO[bytes], _EngineFile(engine, fd)))
        engine.sync(fd)
    finally:
        engine.close(fd)


def _save_aligned(state: Any, f: IO[bytes]) -> None:
    import torch.utils.serialization as ser

    with _ALIGN_LOCK:  # torch's setting is process-wide: restored before anyone else saves through us
        old = ser.config.save.storage_alignment
        ser.config.save.storage_alignment = 4096
        try:
            torch.save(state, f)
        finally:
            ser.config.save.storage_alignment = old


async def save_torch(
    state: Any,
    path: str | os.PathLike[str],
    *,
    scheduler: Scheduler | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Write a torch.save file that ``torch.load`` opens, with every storage at a 4096-byte file
    offset (so a reader can move them with O_DIRECT or cuFile, as :func:`load_torch` does),
    atomically (see :mod:`aiotensor.commit`: a temporary name, fsync'ed, renamed over ``path``,
    the folder fsync'ed), through the scheduler's engine.

    ``state`` is pickled as ``torch.save`` pickles it: a state of tensors, containers and plain
    values reads back with :func:`load_torch` and ``torch.load(weights_only=True)``; an object of
    another class is written all the same, and only ``torch.load(weights_only=False)`` (which runs
    the file's code) reads it back (helper-50).

    ``storage_options``: for an ``s3://`` path, obstore's S3 keys (``endpoint``, ``access_key_id``,
    ``region``..., and ``allow_http``) over the ``AWS_*`` environment (``docs/store.md``).

    Raises:
        OSError: naming the file; ``path`` is then untouched.

    Cancellation: the write finishes in its thread, then the temporary file is removed.
    """
    path = where(path)
    async with (
        own_scheduler(scheduler, engine_for(path, scheduler, storage_options)) as sched,
        Publication(sched, path, folder=False) as pub,
    ):
        try:
            await sched.call(_write_torch, sched.engine, pub.tmp, state, priority=Priority.SAVE)
        except OSError as e:
            raise annotate_oserror(e, f"writing {pub.tmp}") from e
        await pub.publish()
