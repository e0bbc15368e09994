"""Single safetensors files: ``save_file`` and ``load_file``, async and atomic."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import torch

from . import _io
from ._plan import check_tensor
from .errors import StateError, annotate_oserror
from .formats import safetensors as st
from .scheduler import Priority, Scheduler


async def save_file(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
    *,
    scheduler: Scheduler | None = None,
) -> None:
    """Write ``tensors`` to a safetensors file that any safetensors reader opens, atomically.

    The file is written under a temporary name, made durable, then renamed over ``path``: a reader
    sees the old file or the new one, never a mix. Tensors are written from their own memory (no
    staging copy): do not change them until this returns. CUDA tensors are written after the work
    already queued on their streams, by cuFile with the kvikio engine, else through pinned bounce
    slots. Tensors sharing memory are written once each. The data section starts at a 4096-byte boundary.

    Raises:
        StateError: a key that is not a string, or a tensor safetensors cannot store (named).
        OSError: disk full or another I/O error, naming the file; ``path`` is then untouched.

    Cancellation: the temporary file is removed and ``path`` is untouched; returns after the
    writing threads stopped.
    """
    path = os.path.abspath(os.fspath(path))  # noqa: ASYNC240 - getcwd, no disk access
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise StateError("metadata must map str to str")
    async with _scheduler(scheduler) as sched:
        entries = []
        for key, t in tensors.items():
            if not isinstance(key, str):
                raise StateError(f"tensor keys must be str, got {key!r}")
            if not isinstance(t, torch.Tensor):
                raise StateError(f"{key!r} is a {type(t).__name__}, not a tensor")
            entries.append((key, check_tensor(key, t, sched.devices), t))
        entries.sort(key=lambda e: -e[2].element_size())
        header, layout = st.build([(k, d, tuple(t.shape)) for k, d, t in entries], dict(metadata or {}) or None)
        await _io.wait_for_streams(sched, [t for _, _, t in entries])
        contiguous = [t if _io.plain(t) else await sched.call(_io.materialize, t) for _, _, t in entries]
        ranges: list[tuple[int, memoryview | torch.Tensor]] = [(0, memoryview(header))]
        for s, t in zip(layout.tensors, contiguous, strict=True):
            if s.nbytes:
                ranges.append((s.offset, _io.io_bytes(sched.engine, t)))
        folder = os.path.dirname(path)
        tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
        eng = sched.engine
        try:
            await _io.write_file(sched, tmp, ranges)
            try:
                await sched.call(eng.rename, tmp, path)
                await sched.call(eng.sync_dir, folder)
            except OSError as e:
                raise annotate_oserror(e, f"replacing {path}") from e
        except BaseException:
            with anyio.CancelScope(shield=True):
                await sched.call(eng.remove_tree, tmp)
            raise


@asynccontextmanager
async def _scheduler(given: Scheduler | None) -> AsyncIterator[Scheduler]:
    """``given``, or a scheduler of our own, closed (its slots unpinned and unmapped) at the end."""
    if given is not None:
        yield given
        return
    sched = Scheduler()
    try:
        yield sched
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(sched.close)


async def load_file(
    path: str | os.PathLike[str],
    *,
    into: Mapping[str, torch.Tensor] | None = None,
    device: str | torch.device = "cpu",
    scheduler: Scheduler | None = None,
) -> dict[str, torch.Tensor]:
    """Read a safetensors file (from any writer) into new tensors on ``device``, or in place into
    ``into`` (whose tensors may be on CUDA).

    The header is validated completely before anything is allocated. CUDA tensors are filled
    through cuFile by the kvikio engine, or through pinned bounce slots and a copy stream; either
    way they are complete when this returns.

    Raises:
        HeaderError: a malformed header, naming the file (and the tensor).
        MismatchError: ``into`` has other keys, shapes or dtypes than the file.
        OSError: the file cannot be read.
        ValueError: ``device`` is not a device type this machine's scheduler handles.

    Cancellation: returns once no worker thread writes into the tensors.
    """
    path = os.fspath(path)
    async with _scheduler(scheduler) as sched:
        dev = _io.check_device(sched, device)
        fd = await _io.open_read(sched, path)
        try:
            layout = await _io.read_layout(sched, fd, path)
            if into is None:
                dest = {s.key: _io.new_tensor(s, dev) for s in layout.tensors}
            else:
                _io.check_into(into, {s.key: s for s in layout.tensors}, sched.devices, f"the file {path}")
                dest = dict(into)
            targets = [_io.Target(s, dest[s.key], None) for s in layout.tensors]
            await _io.read_tensors(sched, fd, path, targets, Priority.LOAD)
        finally:
            await _io.close(sched, fd)
    return {s.key: dest[s.key] for s in sorted(layout.tensors, key=_key_order(into))}


def _key_order(into: Mapping[str, Any] | None) -> Any:
    order = {k: i for i, k in enumerate(into)} if into is not None else {}
    return lambda s: order.get(s.key, s.offset)
