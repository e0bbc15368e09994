"""Reading: open a file, read and validate a safetensors header, and read tensors from an open file
straight into their destination memory (through bounce slots where the destination is not one
contiguous CPU block), verifying their checksums."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import numpy as np
import torch

from .. import knobs
from .._runtime.scheduler import Priority, Scheduler
from ..engines import Engine
from ..errors import ChecksumError, FormatError, annotate_oserror
from ..formats import checksum
from ..formats import safetensors as st
from ..formats.dtypes import SAFETENSORS_TO_TORCH
from .tensors import Target, copy_tensor, crc_of_pieces, direct, io_bytes, spans, wait_for_streams


async def open_read(sched: Scheduler, path: str) -> int:
    """Open a file to read it (the engine's safe opener); a cancelled caller's descriptor is closed.

    Cancellation: returns once the open has stopped; nothing is left open."""
    try:
        return await sched.call(sched.engine.open_read, path, priority=Priority.LOAD, cleanup=sched.engine.close)
    except OSError as e:
        raise annotate_oserror(e, f"opening {path}") from e


async def close(sched: Scheduler, fd: int) -> None:
    with anyio.CancelScope(shield=True):
        await sched.call(sched.engine.close, fd, priority=Priority.LOAD)


def _read_exact(engine: Engine, fd: int, buf: memoryview | torch.Tensor, off: int, path: str, what: str) -> None:
    """Fill ``buf`` (host bytes, or a flat uint8 device tensor the engine reads into) from ``off``."""
    read = engine.pread_device if isinstance(buf, torch.Tensor) else engine.pread
    while len(buf):
        try:
            n = read(fd, buf, off)  # type: ignore[arg-type]
        except OSError as e:
            raise annotate_oserror(e, f"reading {what} from {path}") from e
        if n <= 0:
            raise FormatError(f"file ends at byte {off}, inside {what}", path)
        buf, off = buf[n:], off + n


def layout_of(engine: Engine, fd: int, path: str) -> st.Layout:
    """Read and validate the safetensors header of an open file (blocking: in a worker thread)."""
    size = engine.size(fd)
    prefix = bytearray(min(size, 8))
    _read_exact(engine, fd, memoryview(prefix), 0, path, "the header size")
    n = st.header_length(bytes(prefix), size, path)
    header = bytearray(n)
    _read_exact(engine, fd, memoryview(header), 8, path, "the header")
    return st.parse(bytes(header), size, path)


async def read_layout(sched: Scheduler, fd: int, path: str) -> st.Layout:
    """Read and validate the safetensors header of an open file, in one worker-thread call."""
    return await sched.call(layout_of, sched.engine, fd, path, priority=Priority.LOAD)


@dataclass(frozen=True)
class _ReadUnit:
    target: int
    offset: int  # file offset
    # the destination bytes: host memory, or device memory the engine reads into (checksummed
    # through a bounce slot); None: read into a bounce slot, then copy rows [row0, row1)
    dest: memoryview | torch.Tensor | None
    nbytes: int
    row0: int = 0
    row1: int = 0


async def read_tensors(sched: Scheduler, fd: int, path: str, targets: Sequence[Target], priority: int) -> None:
    """Read every target from the open file ``fd``, in parallel pieces, and verify checksums.

    Raises:
        ChecksumError: naming the file and the tensor whose bytes differ from the recorded crc32c.
        FormatError: the file ended early.
        OSError: the engine's error, naming the file.

    CUDA targets are written only after the work already queued on their streams.

    Cancellation: returns only once no thread writes into any target tensor.
    """
    await wait_for_streams(sched, (t.tensor for t in targets))
    units, nbytes = await sched.call(_read_units, sched, targets, priority=priority)

    def run(slot: memoryview, u: _ReadUnit) -> int:
        t = targets[u.target]
        what = f"tensor {t.spec.key!r}"
        if u.dest is not None:
            _read_exact(sched.engine, fd, u.dest, u.offset, path, what)
            if t.crc is None:
                return 0
            if isinstance(u.dest, memoryview):
                return checksum.of(t.kind, u.dest)
            # device memory: read back through the slot to checksum it
            copy_tensor(sched, torch.from_numpy(np.frombuffer(slot, np.uint8, u.nbytes)), u.dest)
            return checksum.of(t.kind, slot[: u.nbytes])
        buf = slot if u.nbytes <= len(slot) else memoryview(bytearray(u.nbytes))
        _read_exact(sched.engine, fd, buf[: u.nbytes], u.offset, path, what)
        dtype = SAFETENSORS_TO_TORCH[t.spec.dtype]
        src = torch.from_numpy(np.frombuffer(buf, np.uint8, u.nbytes)).view(dtype)
        target = t.tensor.detach()  # parameters require grad: copy into their memory, not their autograd view
        dst = target[u.row0 : u.row1] if target.dim() else target
        src = src.view((u.row1 - u.row0, *t.tensor.shape[1:])) if t.tensor.dim() else src.view(())
        copy_tensor(sched, dst, src)
        return checksum.of(t.kind, buf[: u.nbytes]) if t.crc is not None else 0

    crcs = await sched.map(run, units, nbytes=lambda u: u.nbytes, priority=priority, slot=True, io=True)
    await _checked(sched, path, targets, units, nbytes, crcs, priority)


def _read_units(sched: Scheduler, targets: Sequence[Target]) -> tuple[list[_ReadUnit], int]:
    """The pieces to read (straight into each target's memory, or through bounce slots by rows)
    and their bytes."""
    units: list[_ReadUnit] = []
    for i, t in enumerate(targets):
        spec, dst = t.spec, t.tensor
        if spec.nbytes == 0:
            continue
        if sched.engine.handles_device(dst) or direct(dst):
            whole = io_bytes(sched.engine, dst)
            piece = sched.chunk_bytes if isinstance(whole, torch.Tensor) else _read_piece(sched)
            units += [_ReadUnit(i, spec.offset + a, whole[a:b], b - a) for a, b in spans(spec.nbytes, piece)]
            continue
        rows = dst.shape[0] if dst.dim() else 1
        row_bytes = spec.nbytes // rows
        per = max(1, _read_piece(sched) // row_bytes)
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            units.append(_ReadUnit(i, spec.offset + r0 * row_bytes, None, (r1 - r0) * row_bytes, r0, r1))
    return units, sum(u.nbytes for u in units)


def _verify_units(sched: Scheduler, targets: Sequence[Target]) -> tuple[list[_ReadUnit], int]:
    """The pieces to read through bounce slots to check every target that has a crc, and their bytes."""
    step = _read_piece(sched)
    units = [
        _ReadUnit(i, t.spec.offset + a, None, b - a)
        for i, t in enumerate(targets)
        if t.crc is not None
        for a, b in spans(t.spec.nbytes, step)
    ]
    return units, sum(u.nbytes for u in units)


async def _checked(
    sched: Scheduler, path: str, targets: Sequence[Target], units: list[_ReadUnit], nbytes: int, crcs: list[int], priority: int
) -> None:
    """After a read or verify pass: count the bytes, compare the crcs, and free the units (tens
    of thousands of views, for a state of many tensors) in a thread."""
    sched.stats.bytes_read += nbytes
    await sched.call(_check_crcs, path, targets, units, crcs, priority=priority)
    await sched.discard(units, crcs)


def _read_piece(sched: Scheduler) -> int:
    """The largest read into host memory (:data:`aiotensor.knobs.HOST_READ_BYTES`)."""
    return min(sched.slots.slot_bytes, knobs.HOST_READ_BYTES)


async def verify_tensors(sched: Scheduler, fd: int, path: str, targets: Sequence[Target], priority: int) -> None:
    """Check the crc32c of every target that has one by reading its bytes through bounce slots;
    writes into no target (the first pass of an all-or-nothing load).

    Raises:
        ChecksumError, FormatError, OSError: as :func:`read_tensors`.

    Cancellation: returns once no thread reads any more; nothing was changed.
    """
    units, nbytes = await sched.call(_verify_units, sched, targets, priority=priority)

    def run(slot: memoryview, u: _ReadUnit) -> int:
        t = targets[u.target]
        _read_exact(sched.engine, fd, slot[: u.nbytes], u.offset, path, f"tensor {t.spec.key!r}")
        return checksum.of(t.kind, slot[: u.nbytes])

    crcs = await sched.map(run, units, nbytes=lambda u: u.nbytes, priority=priority, slot=True)
    await _checked(sched, path, targets, units, nbytes, crcs, priority)


def _check_crcs(path: str, targets: Sequence[Target], units: Sequence[_ReadUnit], crcs: Sequence[int]) -> None:
    """Combine the crcs of the pieces read and compare each target's with its recorded one."""
    pieces: dict[int, list[tuple[int, int]]] = {}
    for u, c in zip(units, crcs, strict=True):
        pieces.setdefault(u.target, []).append((c, u.nbytes))
    for i, t in enumerate(targets):
        if t.crc is None:
            continue
        got = crc_of_pieces(pieces.get(i, []), t.kind)
        if got != t.crc:
            s = t.spec
            raise ChecksumError(
                f"tensor {s.key!r} is corrupt: {t.kind} of bytes [{s.offset}, {s.offset + s.nbytes}) is {got:#010x}, "
                f"{t.crc:#010x} was recorded when it was written",
                path,
                s.key,
            )
