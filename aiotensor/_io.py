"""The I/O steps shared by the store and the single-file API, run through a Scheduler.

``stage`` copies tensors into a staging arena (and checksums them), ``write_file`` writes byte
ranges to a new file and makes it durable, ``read_tensors`` reads tensors from an open file
straight into their destination memory (through bounce slots where the destination is not one
contiguous CPU block) and verifies their checksums.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import torch

from . import _checksum, cuda
from ._dtypes import SAFETENSORS_TO_TORCH, torch_shape
from ._plan import SavePlan, check_tensor
from .buffers import PAGE, HostBuffer, round_up
from .errors import ChecksumError, FormatError, MismatchError, annotate_oserror
from .formats import safetensors as st
from .scheduler import Priority, Scheduler, run_concurrently

# The largest piece one read moves into host memory. A buffered read is the kernel copying from the
# page cache, and kernels built without preemption (PREEMPT_NONE, common on servers and cloud VMs)
# let no other thread onto that core until the copy yields. Cold 1.4 GB loads on a 2-core VM
# (bench/results/stall-cause.md): with 16 MiB pieces the loop stalled 73 ms per load (worst tick
# 12.4 ms), with 1 MiB pieces 23 ms (8.2 ms), and the load ran at 2.36 GB/s against 1.66.
READ_PIECE = 1 << 20


def byte_tensor(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor on its device (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (no copy)."""
    if t.numel() == 0:
        return memoryview(bytearray())
    return byte_tensor(t).numpy().data.cast("B")


def plain(t: torch.Tensor) -> bool:
    """Are ``t``'s values its memory's bytes, in order (contiguous, no lazy conj/neg bit)?"""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def direct(t: torch.Tensor) -> bool:
    """Can bytes be read straight into (or written straight from) ``t``'s memory?"""
    return t.device.type == "cpu" and plain(t)


def materialize(t: torch.Tensor) -> torch.Tensor:
    """A :func:`plain` tensor with ``t``'s values (``t`` itself when it is one; blocks: on CUDA it
    returns once the copy is done, so a copy stream or cuFile may read the result)."""
    if plain(t):
        return t
    out = t.resolve_conj().resolve_neg().contiguous()
    if out.device.type == "cuda":
        torch.cuda.current_stream(out.device).synchronize()
    return out


def io_bytes(eng: Any, t: torch.Tensor) -> memoryview | torch.Tensor:
    """A :func:`plain` tensor's bytes as an engine moves them: a flat uint8 tensor where the engine
    reads and writes that memory itself (or must bounce it: CUDA memory, posix engine), else a
    memoryview of host memory."""
    return byte_tensor(t) if eng.handles_device(t) or t.device.type != "cpu" else byte_view(t)


def _pieces(n: int, chunk: int, start: int = 0) -> Iterator[tuple[int, int]]:
    """``[a, b)`` pieces of ``n`` bytes of at most ``chunk``, cut where ``start + a`` is a multiple of ``chunk``."""
    a = 0
    while a < n:
        b = min(n, a + chunk - (start + a) % chunk)
        yield a, b
        a = b


def _crc_of_pieces(crcs: Sequence[tuple[int, int]]) -> int:
    """Combine ``(crc, length)`` of consecutive pieces into the crc of the whole."""
    if not crcs:
        return 0
    total = crcs[0][0]  # the crc of the first piece is its own: no combining (the common case)
    for c, n in crcs[1:]:
        total = _checksum.combine(total, c, n)
    return total


# --- staging --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StageUnit:
    key: str
    src: torch.Tensor
    start: int  # arena byte offset
    nbytes: int
    whole: bool  # copy the tensor with its shape (a non-contiguous source)


async def stage(
    sched: Scheduler,
    plan: SavePlan,
    sources: dict[str, torch.Tensor],
    arena: HostBuffer,
    priority: int,
    producers: dict[torch.device, Any] | None = None,
) -> tuple[list[_StageUnit], list[Any]]:
    """Copy every source tensor and shard header into ``arena``; return the pieces copied, and the
    containers of views of the sources (tens of thousands of objects for a state of many tensors),
    for the caller to free in a thread (:meth:`Scheduler.discard`) once it has said ``staged``.

    CPU tensors are copied by worker threads; CUDA tensors by one device → host copy per device on
    its copy stream, after ``producers[device]`` (an event recorded when ``save`` was called).

    Cancellation: returns only once no copy reads a source tensor or writes the arena.
    """
    # one unit per piece of every tensor: tens of thousands for a large state, so built in a thread
    pieces, cpu, gpu, cpu_bytes = await sched.call(_stage_units, sched, plan, sources, arena, priority=priority)

    def copy(u: _StageUnit) -> None:
        if u.whole:
            arena.tensor[u.start : u.start + u.nbytes].view(u.src.dtype).view(u.src.shape).copy_(u.src)
        else:  # plain memcpy, one thread each, GIL released
            np.copyto(arena.array[u.start : u.start + u.nbytes], np.frombuffer(byte_view(u.src), np.uint8))

    async def host() -> None:
        batch = _per_cpu(sched, cpu_bytes)
        await sched.map(copy, cpu, nbytes=lambda u: u.nbytes, priority=priority, batch_bytes=batch, budget=False)

    async def device() -> None:
        assert sched.cuda is not None and producers is not None
        for dev, copies in gpu.items():
            event, resolved = await sched.call(cuda.d2h, sched.cuda, producers[dev], copies, priority=priority)
            with anyio.CancelScope(shield=True):  # the copy writes the arena: let it finish
                await sched.cuda.bridge(dev).wait(event, keep=[*(src for _, src in copies), *resolved])

    await run_concurrently(host, device) if gpu else await host()
    return pieces, [cpu, gpu]


def _stage_units(
    sched: Scheduler, plan: SavePlan, sources: dict[str, torch.Tensor], arena: HostBuffer
) -> tuple[list[_StageUnit], list[_StageUnit], dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]], int]:
    """Copy the headers into ``arena``; return every piece to checksum (in arena order, without
    sources), the CPU copies to make, the CUDA copies per device, and the CPU copies' bytes."""
    units: list[_StageUnit] = []
    cpu: list[_StageUnit] = []
    gpu: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for sh in plan.shards:
        arena.view[sh.arena_offset : sh.arena_offset + len(sh.header)] = sh.header
        for spec in sh.layout.tensors:
            src = sources[spec.key]
            start = sh.arena_offset + spec.offset
            if src.device.type == "cuda":
                if spec.nbytes:
                    dst = arena.tensor[start : start + spec.nbytes].view(src.dtype).view(src.shape)
                    gpu.setdefault(src.device, []).append((dst, src))
                units.append(_StageUnit(spec.key, _NO_SOURCE, start, spec.nbytes, False))
            elif not direct(src):
                cpu.append(_StageUnit(spec.key, src, start, spec.nbytes, True))
            else:
                flat = src.detach().reshape(-1)
                per = max(1, sched.chunk_bytes // src.element_size())
                for a, b in _pieces(flat.numel(), per):
                    size = src.element_size()
                    cpu.append(_StageUnit(spec.key, flat[a:b], start + a * size, (b - a) * size, False))
    units += cpu
    units.sort(key=lambda u: u.start)
    pieces = [_StageUnit(u.key, _NO_SOURCE, u.start, u.nbytes, False) for u in units]
    return pieces, cpu, gpu, sum(u.nbytes for u in cpu)


async def checksums(
    sched: Scheduler, plan: SavePlan, units: list[_StageUnit], arena: HostBuffer, priority: int
) -> dict[str, int]:
    """crc32c of every tensor staged in ``arena``, from the pieces ``stage`` returned."""
    crcs = await sched.map(
        lambda u: _checksum.crc32c(arena.view[u.start : u.start + u.nbytes]),
        units,
        nbytes=lambda u: u.nbytes,
        priority=priority,
        batch_bytes=_per_cpu(sched, plan.nbytes),
        budget=False,
    )
    return await sched.call(_crcs_by_key, plan, units, crcs, priority=priority)


def _crcs_by_key(plan: SavePlan, units: list[_StageUnit], crcs: list[int]) -> dict[str, int]:
    pieces: dict[str, list[tuple[int, int]]] = {spec.key: [] for sh in plan.shards for spec in sh.layout.tensors}
    for u, c in zip(units, crcs, strict=True):
        pieces[u.key].append((c, u.nbytes))
    return {k: _crc_of_pieces(v) for k, v in pieces.items()}


_NO_SOURCE = torch.empty(0)


def _per_cpu(sched: Scheduler, nbytes: int) -> int:
    """Batch size giving one batch per core but one for work on ``nbytes``: CPU-bound, and the
    loop keeps a core."""
    threads = max(1, min(sched.workers, (os.cpu_count() or 2) - 1))
    return max(1, -(-nbytes // threads))


# --- writing --------------------------------------------------------------------------------


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
    # thousands of ranges (save_file of many small tensors): laid out in a thread
    image = None if size is not None else await sched.call(_image_blocks, sched, ranges, priority=priority)
    if image is None:
        direct, units, bounce, total = await sched.call(_write_units, sched, ranges, size, priority=priority)
    else:  # the last block is written padded to whole pages, then the file is cut to its size
        size = total = image[1]
        direct, units, bounce = True, [], False
    try:
        fd = await sched.call(lambda: eng.create(path, direct=direct), priority=priority)
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

        def run(slot: memoryview | None, u: tuple[int, memoryview | torch.Tensor]) -> None:
            off, src = u
            if isinstance(src, torch.Tensor) and not eng.handles_device(src):
                assert slot is not None
                _copy(sched, torch.from_numpy(np.frombuffer(slot, np.uint8, len(src))), src)
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
        with anyio.CancelScope(shield=True):
            await sched.call(eng.close, fd, priority=priority)


async def crcs_of(sched: Scheduler, sources: Sequence[memoryview | torch.Tensor], priority: int = Priority.SAVE) -> list[int]:
    """crc32c of each source's bytes (host memory, or a flat uint8 CUDA tensor read back through a
    bounce slot), in parallel pieces.

    Cancellation: returns once no thread reads the sources.
    """
    step = sched.slots.slot_bytes

    def cut() -> list[_ReadUnit]:
        return [_ReadUnit(i, a, None, b - a) for i, src in enumerate(sources) for a, b in _pieces(len(src), step)]

    units = await sched.call(cut, priority=priority)

    def run(slot: memoryview, u: _ReadUnit) -> int:
        src = sources[u.target][u.offset : u.offset + u.nbytes]
        if isinstance(src, torch.Tensor):
            _copy(sched, torch.from_numpy(np.frombuffer(slot, np.uint8, u.nbytes)), src)
            src = slot[: u.nbytes]
        return _checksum.crc32c(src)

    crcs = await sched.map(run, units, nbytes=lambda u: u.nbytes, priority=priority, slot=True, budget=False)

    def combine() -> list[int]:
        pieces: list[list[tuple[int, int]]] = [[] for _ in sources]
        for u, c in zip(units, crcs, strict=True):
            pieces[u.target].append((c, u.nbytes))
        return [_crc_of_pieces(p) for p in pieces]

    return await sched.call(combine, priority=priority)


_WriteUnit = tuple[int, "memoryview | torch.Tensor"]


def _write_units(
    sched: Scheduler, ranges: Sequence[tuple[int, memoryview | torch.Tensor]], size: int | None
) -> tuple[bool, list[_WriteUnit], bool, int]:
    """Whether the file can bypass the page cache, the pieces to write, whether any goes through a
    bounce slot, and the bytes the file will hold."""
    direct = size is not None and all(isinstance(mv, memoryview) and off % PAGE == 0 and _page_aligned(mv) for off, mv in ranges)
    # pieces end on chunk boundaries of the file, so two threads never write into one page of a
    # range (cuFile does an unaligned write as a read-modify-write of the whole page)
    units: list[_WriteUnit] = [
        (off + a, mv[a:b]) for off, mv in ranges for a, b in _pieces(len(mv), sched.chunk_bytes, start=off)
    ]
    bounce = any(isinstance(mv, torch.Tensor) and not sched.engine.handles_device(mv) for _, mv in units)
    return direct, units, bounce, sum(len(mv) for _, mv in ranges) if size is None else size


_Block = tuple[int, int, list[tuple[int, memoryview]]]  # file offset, length (whole pages), (position, bytes)
_IMAGE_MIN = 4 << 20


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
    if end < _IMAGE_MIN or end < len(ranges) * (256 << 10):
        return None
    step = sched.slots.slot_bytes
    pieces: dict[int, list[tuple[int, memoryview]]] = {}
    for off, mv in ranges:
        for a, b in _pieces(len(mv), step, start=off):
            pieces.setdefault((off + a) // step, []).append(((off + a) % step, mv[a:b]))  # type: ignore[arg-type]
    return [(k * step, min(step, round_up(end - k * step)), ps) for k, ps in sorted(pieces.items())], end


def _page_aligned(mv: memoryview) -> bool:
    if len(mv) % PAGE:
        return False
    return not len(mv) or np.frombuffer(mv, np.uint8).__array_interface__["data"][0] % PAGE == 0


# --- reading --------------------------------------------------------------------------------


async def open_read(sched: Scheduler, path: str) -> int:
    try:
        return await sched.call(sched.engine.open_read, path, priority=Priority.LOAD)
    except OSError as e:
        raise annotate_oserror(e, f"opening {path}") from e


async def close(sched: Scheduler, fd: int) -> None:
    with anyio.CancelScope(shield=True):
        await sched.call(sched.engine.close, fd, priority=Priority.LOAD)


def _read_exact(sched: Scheduler, fd: int, buf: memoryview | torch.Tensor, off: int, path: str, what: str) -> None:
    """Fill ``buf`` (host bytes, or a flat uint8 device tensor the engine reads into) from ``off``."""
    read = sched.engine.pread_device if isinstance(buf, torch.Tensor) else sched.engine.pread
    while len(buf):
        try:
            n = read(fd, buf, off)  # type: ignore[arg-type]
        except OSError as e:
            raise annotate_oserror(e, f"reading {what} from {path}") from e
        if n <= 0:
            raise FormatError(f"file ends at byte {off}, inside {what}", path)
        buf, off = buf[n:], off + n


def _copy(sched: Scheduler, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` in a worker thread; between a bounce slot and CUDA memory on the copy
    stream, returning once the copy is done (the slot is then free again)."""
    if dst.device.type == "cuda" or src.device.type == "cuda":
        assert sched.cuda is not None
        sched.slots.pin(sched.cuda.pinning)
        cuda.copy(sched.cuda, dst, src)
    else:
        dst.copy_(src)


def layout_of(sched: Scheduler, fd: int, path: str) -> st.Layout:
    """Read and validate the safetensors header of an open file (blocking: in a worker thread)."""
    size = sched.engine.size(fd)
    prefix = bytearray(min(size, 8))
    _read_exact(sched, fd, memoryview(prefix), 0, path, "the header size")
    n = st.header_length(bytes(prefix), size, path)
    header = bytearray(n)
    _read_exact(sched, fd, memoryview(header), 8, path, "the header")
    return st.parse(bytes(header), size, path)


async def read_layout(sched: Scheduler, fd: int, path: str) -> st.Layout:
    """Read and validate the safetensors header of an open file, in one worker-thread call."""
    return await sched.call(layout_of, sched, fd, path, priority=Priority.LOAD)


def new_tensor(spec: st.TensorSpec, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of ``spec``'s dtype and shape on ``device``, to read it into."""
    return torch.empty(torch_shape(spec.dtype, spec.shape), dtype=SAFETENSORS_TO_TORCH[spec.dtype], device=device)


def check_into(
    given: Mapping[str, torch.Tensor],
    specs: Mapping[str, st.TensorSpec],
    devices: tuple[str, ...],
    where: str,
    strict: bool = True,
) -> None:
    """``given`` (``into``'s tensors) has exactly ``specs``' keys (``strict=False``: some of them),
    each a tensor of its spec's dtype and shape on a device this machine handles; else
    MismatchError (StateError for the device)."""
    missing, extra = sorted(set(specs) - set(given)) if strict else [], sorted(set(given) - set(specs))
    if missing or extra:
        raise MismatchError(f"`into` does not match {where}: missing {_few(missing)}, unexpected {_few(extra)}")
    for k, t in given.items():
        spec = specs[k]
        check_tensor(k, t, devices)
        want, shape = SAFETENSORS_TO_TORCH[spec.dtype], torch_shape(spec.dtype, spec.shape)
        if tuple(t.shape) != shape or t.dtype != want:
            raise MismatchError(f"tensor {k!r}: {where} has {want} {list(shape)}, `into` has {t.dtype} {list(t.shape)}")


def _few(keys: list[str]) -> str:
    return f"{keys[:5]}{'...' if len(keys) > 5 else ''}"


def on_stream(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Inside: ``stream`` (a CUDA stream, or None: nothing changes) is this thread's current one."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def check_device(sched: Scheduler, device: str | torch.device) -> torch.device:
    """``device`` as a torch.device, or ValueError where this machine cannot load to it."""
    dev = torch.device(device)
    if dev.type not in sched.devices:
        raise ValueError(f"cannot load to {device}: this machine handles {', '.join(sched.devices)} tensors")
    if dev.type == "cuda" and dev.index is None:  # worker threads make the tensors: the caller's current device
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


async def wait_for_streams(sched: Scheduler, tensors: Iterable[torch.Tensor]) -> None:
    """Before writing into CUDA tensors: wait (in a worker thread) for the work already queued on
    their devices' current streams, which may still read them. Copies on the copy stream and
    cuFile reads are not ordered after that work otherwise."""
    if sched.cuda is None:
        return
    events = list(cuda.record_producers(tensors).values())
    if events:
        await sched.call(lambda: [e.synchronize() for e in events], priority=Priority.LOAD)


@dataclass(frozen=True)
class Target:
    """Read ``spec``'s bytes into ``tensor`` (same dtype and shape); check ``crc`` if given."""

    spec: st.TensorSpec
    tensor: torch.Tensor
    crc: int | None


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
            _read_exact(sched, fd, u.dest, u.offset, path, what)
            if t.crc is None:
                return 0
            if isinstance(u.dest, memoryview):
                return _checksum.crc32c(u.dest)
            # device memory: read back through the slot to checksum it
            _copy(sched, torch.from_numpy(np.frombuffer(slot, np.uint8, u.nbytes)), u.dest)
            return _checksum.crc32c(slot[: u.nbytes])
        buf = slot if u.nbytes <= len(slot) else memoryview(bytearray(u.nbytes))
        _read_exact(sched, fd, buf[: u.nbytes], u.offset, path, what)
        dtype = SAFETENSORS_TO_TORCH[t.spec.dtype]
        src = torch.from_numpy(np.frombuffer(buf, np.uint8, u.nbytes)).view(dtype)
        target = t.tensor.detach()  # parameters require grad: copy into their memory, not their autograd view
        dst = target[u.row0 : u.row1] if target.dim() else target
        src = src.view((u.row1 - u.row0, *t.tensor.shape[1:])) if t.tensor.dim() else src.view(())
        _copy(sched, dst, src)
        return _checksum.crc32c(buf[: u.nbytes]) if t.crc is not None else 0

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
            units += [_ReadUnit(i, spec.offset + a, whole[a:b], b - a) for a, b in _pieces(spec.nbytes, piece)]
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
        for a, b in _pieces(t.spec.nbytes, step)
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
    """The largest read into host memory (see :data:`READ_PIECE`)."""
    return min(sched.slots.slot_bytes, READ_PIECE)


async def verify_tensors(sched: Scheduler, fd: int, path: str, targets: Sequence[Target], priority: int) -> None:
    """Check the crc32c of every target that has one by reading its bytes through bounce slots;
    writes into no target (the first pass of an all-or-nothing load).

    Raises:
        ChecksumError, FormatError, OSError: as :func:`read_tensors`.

    Cancellation: returns once no thread reads any more; nothing was changed.
    """
    units, nbytes = await sched.call(_verify_units, sched, targets, priority=priority)

    def run(slot: memoryview, u: _ReadUnit) -> int:
        _read_exact(sched, fd, slot[: u.nbytes], u.offset, path, f"tensor {targets[u.target].spec.key!r}")
        return _checksum.crc32c(slot[: u.nbytes])

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
        got = _crc_of_pieces(pieces.get(i, []))
        if got != t.crc:
            s = t.spec
            raise ChecksumError(
                f"tensor {s.key!r} is corrupt: crc32c of bytes [{s.offset}, {s.offset + s.nbytes}) is {got:#010x}, "
                f"{t.crc:#010x} was recorded when it was written",
                path,
                s.key,
            )
