"""Writing: byte ranges to a new file, durably, in parallel pieces (O_DIRECT through page-aligned
bounce slots where it pays, cuFile for device memory where the engine can), and crc32c of bytes
about to be written."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .. import knobs
from .._runtime.buffers import PAGE, round_up
from .._runtime.scheduler import Priority, Scheduler
from ..errors import annotate_oserror
from ..formats import checksum
from .read import close
from .tensors import copy_tensor, crc_of_pieces, spans


async def write_file(
    sched: Scheduler,
    path: str,
    ranges: Sequence[tuple[int, memoryview | torch.Tensor]],
    priority: int = Priority.SAVE,
    *,
    size: int | None = None,
) -> None:
    """Create ``path`` (it must not exist), write ``(offset, bytes)`` ranges, fdatasync, close.

    A range's bytes are host memory, or a flat uint8 CUDA tensor: written by the engine from
    device memory where it can (kvikio), else copied through a pinned bounce slot.

    With ``size``, the file is cut to ``size`` bytes after writing: the ranges may then run past
    it, so that a page-aligned image (a staging arena) is written whole, bypassing the page cache
    where the engine can (see :meth:`Engine.create`).

    Raises:
        OSError: the engine's error (disk full, EIO...), its message naming ``path``.

    Cancellation: returns once no thread writes from the ranges; the file is closed (the caller
    removes it: it lives in a temporary name).
    """
    eng = sched.engine
    if not eng.renames:  # an object store: one PUT of the whole object, from the ranges' memory
        views, total = await sched.call(_object_views, ranges, size, priority=priority)
        try:
            await sched.call(eng.put, path, views, priority=priority)
        except OSError as e:
            raise annotate_oserror(e, f"writing {path}") from e
        sched.stats.bytes_written += total
        if len(views) > knobs.INLINE_UNITS:  # a view per tensor of 20,000: freed in a thread
            await sched.discard(views)
        return
    # thousands of ranges (save_file of many small tensors): laid out in a thread
    image = None if size is not None else await sched.call(_image_blocks, sched, ranges, priority=priority)
    if image is None:
        direct, units, bounce, total = await sched.call(_write_units, sched, ranges, size, priority=priority)
    else:  # the last block is written padded to whole pages, then the file is cut to its size
        size = total = image[1]
        direct, units, bounce = True, [], False
    try:
        fd = await sched.call(lambda: eng.create(path, direct=direct), priority=priority, cleanup=eng.close)
    except OSError as e:
        raise annotate_oserror(e, f"creating {path}") from e
    try:

        def assemble(slot: memoryview, block: _Block) -> None:
            """Copy the block's pieces into a page-aligned slot and write it whole (O_DIRECT)."""
            off, length, pieces = block
            dst = np.frombuffer(slot, np.uint8, length)
            if sum(len(mv) for _, mv in pieces) < length:  # padding past the end, or gaps
                dst[:] = 0
            for pos, mv in pieces:
                dst[pos : pos + len(mv)] = np.frombuffer(mv, np.uint8)  # numpy copies without the GIL
            _write_all(eng.pwrite, fd, slot[:length], off)

        def run(slot: memoryview | None, u: _WriteUnit) -> None:
            off, src, via_slot = u
            if via_slot:
                assert slot is not None and isinstance(src, torch.Tensor)
                copy_tensor(sched, torch.from_numpy(np.frombuffer(slot, np.uint8, len(src))), src)
                src = slot[: len(src)]
            _write_all(eng.pwrite_device if isinstance(src, torch.Tensor) else eng.pwrite, fd, src, off)

        if image is not None:
            await sched.map(assemble, image[0], nbytes=lambda b: b[1], priority=priority, slot=True, io=True)
        elif bounce:
            await sched.map(run, units, nbytes=lambda u: len(u[1]), priority=priority, slot=True, io=True)
        else:
            await sched.map(functools.partial(run, None), units, nbytes=lambda u: len(u[1]), priority=priority, io=True)
        if size is not None:
            await sched.call(eng.truncate, fd, size, priority=priority)
        await sched.call(eng.sync, fd, priority=priority)
        sched.stats.bytes_written += total
    except OSError as e:
        raise annotate_oserror(e, f"writing {path}") from e
    finally:
        await close(sched, fd)
    if len(units) > knobs.INLINE_UNITS:  # a unit per range of 20,000 tensors: freed in a thread
        await sched.discard(units)


async def crcs_of(sched: Scheduler, sources: Sequence[memoryview | torch.Tensor], priority: int = Priority.SAVE) -> list[int]:
    """crc32c of each source's bytes (host memory, or a flat uint8 CUDA tensor read back through a
    bounce slot), in parallel pieces.

    Cancellation: returns once no thread reads the sources.
    """
    step = sched.slots.slot_bytes

    def cut() -> list[tuple[int, int, int]]:  # (source, offset, bytes)
        return [(i, a, b - a) for i, src in enumerate(sources) for a, b in spans(len(src), step)]

    units = await sched.call(cut, priority=priority)

    def run(slot: memoryview, u: tuple[int, int, int]) -> int:
        i, offset, nbytes = u
        src = sources[i][offset : offset + nbytes]
        if isinstance(src, torch.Tensor):
            copy_tensor(sched, torch.from_numpy(np.frombuffer(slot, np.uint8, nbytes)), src)
            src = slot[:nbytes]
        return checksum.crc32c(src)

    crcs = await sched.map(run, units, nbytes=lambda u: u[2], priority=priority, slot=True, budget=False)

    def combine() -> list[int]:
        parts: list[list[tuple[int, int]]] = [[] for _ in sources]
        for (i, _, nbytes), c in zip(units, crcs, strict=True):
            parts[i].append((c, nbytes))
        return [crc_of_pieces(p) for p in parts]

    out = await sched.call(combine, priority=priority)
    if len(units) > knobs.INLINE_UNITS:  # a piece per tensor: 20,000 freed on the loop held it 0.6 ms
        await sched.discard(units, crcs)
    return out


_WriteUnit = tuple[int, "memoryview | torch.Tensor", bool]  # file offset, bytes, through a bounce slot


def _write_units(
    sched: Scheduler, ranges: Sequence[tuple[int, memoryview | torch.Tensor]], size: int | None
) -> tuple[bool, list[_WriteUnit], bool, int]:
    """Whether the file can bypass the page cache, the pieces to write, whether any goes through a
    bounce slot, and the bytes the file will hold."""
    direct = size is not None and all(isinstance(mv, memoryview) and off % PAGE == 0 and _page_aligned(mv) for off, mv in ranges)
    units: list[_WriteUnit] = []
    for off, mv in ranges:
        if isinstance(mv, torch.Tensor) and sched.engine.handles_device(mv):
            units += _device_units(off, mv, sched.chunk_bytes)
        else:  # host memory (the kernel orders writes into one page), or device memory bounced
            units += [(off + a, mv[a:b], isinstance(mv, torch.Tensor)) for a, b in spans(len(mv), sched.chunk_bytes, start=off)]
    bounce = any(via_slot for _, _, via_slot in units)
    return direct, units, bounce, sum(len(mv) for _, mv in ranges) if size is None else size


def _device_units(off: int, src: torch.Tensor, chunk: int) -> list[_WriteUnit]:
    """The pieces of a range of device memory the engine writes itself (cuFile): whole file pages
    only, in pieces cut at page-aligned multiples of ``chunk``, so that no two calls, of this range
    or a neighbour's, write into one page (cuFile writes a partial page as a read-modify-write of
    the whole page: two threads doing that to one page lose one's bytes). The partial pages at
    either end, which a neighbour shares, go through a bounce slot and the page cache."""
    end = off + len(src)
    first = min(round_up(off), end)
    last = max(end // PAGE * PAGE, first)  # == first: no whole page, a head and a tail under a page each
    step = max(PAGE, chunk // PAGE * PAGE)
    units: list[_WriteUnit] = [(off, src[: first - off], True)] if first > off else []
    units += [(first + a, src[first - off + a : first - off + b], False) for a, b in spans(last - first, step, start=first)]
    if end > last:
        units.append((last, src[last - off :], True))
    return units


_Block = tuple[int, int, list[tuple[int, memoryview]]]  # file offset, length (whole pages), (position, bytes)


def _object_views(ranges: Sequence[tuple[int, memoryview | torch.Tensor]], size: int | None) -> tuple[list[memoryview], int]:
    """The file's bytes in order, as views of the ranges (device memory copied to the host, gaps
    as zeros), cut at ``size``; and their count of bytes (summed here, not on the loop's thread)."""
    views: list[memoryview] = []
    pos = 0
    for off, mv in sorted(ranges, key=lambda r: r[0]):
        if isinstance(mv, torch.Tensor):
            mv = memoryview(mv.cpu().numpy()).cast("B")  # type: ignore[arg-type]
        if off < pos:
            raise ValueError(f"ranges overlap at byte {off}")
        if off > pos:
            views.append(memoryview(bytes(off - pos)))
        views.append(mv)
        pos = off + len(mv)
    if size is not None:
        views, pos = _cut(views, size), size
    return views, sum(map(len, views))


def _cut(views: list[memoryview], size: int) -> list[memoryview]:
    out, left = [], size
    for v in views:
        if left <= 0:
            break
        out.append(v[:left])
        left -= len(out[-1])
    if left > 0:
        out.append(memoryview(bytes(left)))
    return out


def _write_all(write: Callable[[int, Any, int], int], fd: int, src: memoryview | torch.Tensor, off: int) -> None:
    """``write(fd, bytes, offset)`` until all of ``src`` is written at ``off``."""
    while len(src):
        n = write(fd, src, off)
        if n <= 0:
            raise OSError(28, "no progress writing (disk full?)")
        src, off = src[n:], off + n


def _image_blocks(sched: Scheduler, ranges: Sequence[tuple[int, memoryview | torch.Tensor]]) -> tuple[list[_Block], int] | None:
    """For a file of host ranges that are not page-aligned (``save_file``'s tensors, wherever torch
    allocated them): slot-sized blocks of the file to assemble in page-aligned bounce slots and
    write with O_DIRECT, and the file's size. Bypassing the page cache is what makes a durable write fast (on the VM
    this was measured on, fio wrote 1.0 GB/s with O_DIRECT and 0.24 GB/s buffered + fsync); the
    price is one memory copy, which the kernel would make into the page cache anyway. None for
    small files and many small tensors (not worth the Python work per piece), and for device
    memory (its own path)."""
    if any(isinstance(mv, torch.Tensor) for _, mv in ranges):
        return None
    end = max((off + len(mv) for off, mv in ranges), default=0)
    if end < knobs.IMAGE_MIN_BYTES or end < len(ranges) * (256 << 10):
        return None
    step = sched.slots.slot_bytes
    pieces: dict[int, list[tuple[int, memoryview]]] = {}
    for off, mv in ranges:
        for a, b in spans(len(mv), step, start=off):
            pieces.setdefault((off + a) // step, []).append(((off + a) % step, mv[a:b]))  # type: ignore[arg-type]
    return [(k * step, min(step, round_up(end - k * step)), ps) for k, ps in sorted(pieces.items())], end


def _page_aligned(mv: memoryview) -> bool:
    if len(mv) % PAGE:
        return False
    return not len(mv) or np.frombuffer(mv, np.uint8).__array_interface__["data"][0] % PAGE == 0
