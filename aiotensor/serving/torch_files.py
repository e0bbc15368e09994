"""torch.save files: :func:`load_torch` reads one without unrestricted pickle, :func:`save_torch`
writes one whose storages lie at 4096-byte offsets, atomically."""

from __future__ import annotations

import os
import threading
import uuid
from typing import Any

import anyio
import torch

from .._runtime.scheduler import Priority, Scheduler
from ..engines.posix import PosixEngine
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


def _torch_save_aligned(state: Any, path: str) -> None:
    import torch.utils.serialization as ser

    with _ALIGN_LOCK:  # torch's setting is process-wide: restored before anyone else saves through us
        old = ser.config.save.storage_alignment
        ser.config.save.storage_alignment = 4096
        try:
            torch.save(state, path)
        finally:
            ser.config.save.storage_alignment = old
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def save_torch(state: Any, path: str | os.PathLike[str]) -> None:
    """Write a torch.save file that ``torch.load`` opens, with every storage at a 4096-byte file
    offset (so a reader can move them with O_DIRECT or cuFile, as :func:`load_torch` does),
    atomically (a temporary name, fsync'ed, renamed over ``path``, the folder fsync'ed).

    Raises:
        OSError: naming the file; ``path`` is then untouched.

    Cancellation: the write finishes in its thread, then the temporary file is removed.
    """
    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")  # noqa: ASYNC240
    try:
        await anyio.to_thread.run_sync(_torch_save_aligned, state, tmp)
        await anyio.to_thread.run_sync(os.replace, tmp, path)
        await anyio.to_thread.run_sync(PosixEngine().sync_dir, os.path.dirname(os.path.abspath(path)))  # noqa: ASYNC240
    except BaseException:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(PosixEngine().remove_tree, tmp)
        raise
