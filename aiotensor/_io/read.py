"""Reading: open a file, read and validate a safetensors header, and read tensors from an open file
straight into their destination memory (through bounce slots where the destination is not one
contiguous CPU block), verifying their checksums."""

from __future__ import annotations

import bisect
import errno
import os
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import chain, compress, groupby, islice, repeat
from operator import add, attrgetter, is_not, itemgetter, le, sub
from typing import Any

import anyio
import numpy as np
import torch

from .. import knobs
from .._runtime import gil
from .._runtime.buffers import PAGE, address, copy_bytes, disjoint, memory_at, move, prefault, round_up
from .._runtime.scheduler import Priority, Scheduler, given_up
from ..engines import Engine
from ..errors import ChecksumError, FormatError, ManifestError, SourceChangedError, annotate_oserror
from ..formats import checksum
from ..formats import manifest as mf
from ..formats import safetensors as st
from ..formats.dtypes import SAFETENSORS_TO_TORCH
from .plan import shard_header
from .tensors import (
    Block,
    Target,
    byte_view,
    check_fillable,
    copy_tensor,
    crc_of_pieces,
    direct,
    io_bytes,
    modified,
    spans,
    wait_for_streams,
)

Check = Callable[[Engine, int], None]
"""What a file must pass as it is opened to read its data, given the engine and its descriptor
(``Source.checks``): :func:`same_file`, :func:`check_shard`."""


async def open_read(sched: Scheduler, path: str, check: Check | None = None) -> int:
    """Open a file to read it (the engine's safe opener), and ``check`` it; a cancelled caller's
    descriptor is closed.

    Raises:
        What ``check`` raises (:class:`SourceChangedError`, :class:`ManifestError`...).
        OSError: naming the file.

    Cancellation: returns once the open has stopped; nothing is left open."""
    try:
        return await sched.call(_open_checked, sched.engine, path, check, priority=Priority.LOAD, cleanup=sched.engine.close)
    except OSError as e:
        raise annotate_oserror(e, f"opening {path}") from e


def _open_checked(engine: Engine, path: str, check: Check | None) -> int:
    try:
        fd = engine.open_read(path)
    except FileNotFoundError:
        if isinstance(check, ShardCheck):
            check.missing(engine)
        raise
    if check is not None:
        try:
            check(engine, fd)
        except BaseException:
            engine.close(fd)
            raise
    return fd


def same_file(path: str, identity: Any, engine: Engine, fd: int) -> None:
    """A :data:`Check`: the open file ``fd`` is the one whose header was read, whose
    :meth:`~aiotensor.engines.Engine.identity` was ``identity`` (None: nothing to compare).

    Raises:
        SourceChangedError: another file is there now (renamed over it), or it was written since:
            the header read would place other bytes (helper-59)."""
    if identity is not None and engine.identity(fd) != identity:
        raise SourceChangedError(
            f"{path} changed while it was being loaded: it is not the file whose header was read at the start "
            "(replaced, or written since); nothing was read from the new one. Load again (a file replaced "
            "by a rename is safe to load once it is there)"
        )


async def close(sched: Scheduler, *fds: int) -> None:
    """Close ``fds``, in one worker call handed to its thread at once (outside the scheduler's
    gate) and waited out whatever cancels the caller: asyncio's own ``Task.cancel()`` goes through
    an anyio shield, and withdrew a call that waited for admission (or broke a loop of one call a
    descriptor off), leaving the files open; a task of its own was never started where the event
    loop ended first (helper-57). A cancellation from asyncio is raised once they are closed."""
    if fds:
        with anyio.CancelScope(shield=True):
            await sched.run_sync(_close_all, sched.engine, fds)


async def written(sched: Scheduler, tensors: Iterable[torch.Tensor | None]) -> None:
    """:func:`~aiotensor._io.tensors.modified` of the tensors a load that failed or was cancelled
    had begun to write in place (a graph made from their old values must refuse ``backward()``
    then too), in one worker call handed to its thread at once, as :func:`close`."""
    marked = list(tensors)
    with anyio.CancelScope(shield=True):
        await sched.run_sync(modified, marked)


def _close_all(engine: Engine, fds: tuple[int, ...]) -> None:
    for fd in fds:
        engine.close(fd)


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
    size, _, header = _header(engine, fd, path)
    return st.parse(bytes(header), size, path)


def header_crc(engine: Engine, fd: int, path: str) -> tuple[int, int]:
    """Where an open safetensors file's data begins and the crc32c of all before it (length
    prefix, JSON, padding: what a store's manifest records), without parsing the JSON (blocking)."""
    _, prefix, header = _header(engine, fd, path)
    return len(prefix) + len(header), checksum.crc32c(header, checksum.crc32c(prefix))


def _header(engine: Engine, fd: int, path: str) -> tuple[int, bytearray, bytearray]:
    """An open file's size, its 8-byte length prefix and the header it announces (HeaderError if
    it is no safetensors file)."""
    size = engine.size(fd)
    prefix = bytearray(min(size, 8))
    _read_exact(engine, fd, memoryview(prefix), 0, path, "the header size")
    header = bytearray(st.header_length(bytes(prefix), size, path))
    _read_exact(engine, fd, memoryview(header), 8, path, "the header")
    return size, prefix, header


def check_shard(
    engine: Engine, fd: int, path: str, size: int, entries: Sequence[mf.Entry], crc: int | None, mpath: str, step: Any = None
) -> None:
    """Check that the shard holds what its manifest entries say (else ManifestError), and that the
    step is still the one whose manifest (``mpath``) had the identity ``step`` as it was read
    (:func:`same_step`: a step saved again under its number, its folder replaced, passed the check
    of a shard of the same layout, and loads mixed the two saves, helper-64), after the check and
    after a failure of it (a shard of another layout is the new save's, not damage)."""
    try:
        _check_shard(engine, fd, path, size, entries, crc, mpath)
    except FormatError:
        same_step(engine, mpath, step)
        raise
    same_step(engine, mpath, step)


@dataclass(frozen=True)
class ShardCheck:
    """:func:`check_shard` of one shard of a step, as a :data:`Check` (``Source.checks``, a
    store's ``load()``); :meth:`missing` where the shard is not there."""

    path: str
    size: int
    entries: Sequence[mf.Entry]
    crc: int | None
    mpath: str
    step: Any = None

    def __call__(self, engine: Engine, fd: int) -> None:
        check_shard(engine, fd, self.path, self.size, self.entries, self.crc, self.mpath, self.step)

    def missing(self, engine: Engine) -> None:
        """The shard is not there: a step saved again with other shards is that (a
        SourceChangedError), not damage; else the caller's FileNotFoundError stands."""
        same_step(engine, self.mpath, self.step)


def same_step(engine: Engine, mpath: str, step: Any) -> None:
    """The manifest at ``mpath`` is still the file whose identity was ``step`` (None: nothing to
    compare).

    A manifest gone is no answer: the step retired, or between its deletion and its new save; the
    files opened so far are the step's (a retired step's files stay readable while open, or are
    gone), and each later open of the load finds out (a file gone, or another one).

    Raises:
        SourceChangedError: another file is there (the step saved again under its number): what a
            load has read of the step so far may be of either save."""
    if step is None:
        return
    try:
        fd = engine.open_read(mpath)
    except FileNotFoundError:
        return
    try:
        if engine.identity(fd) == step:
            return
    finally:
        engine.close(fd)
    folder = os.path.dirname(mpath)
    raise SourceChangedError(
        f"{folder} was saved again while it was being loaded (its {os.path.basename(mpath)} is another file now): "
        "what was read of it may be of either save, and none of it is returned. Load again"
    )


def _check_shard(engine: Engine, fd: int, path: str, size: int, entries: Sequence[mf.Entry], crc: int | None, mpath: str) -> None:
    """:func:`check_shard`'s check of the shard: its size,
    the entries' bytes one after the other from its header's end to its end, and that header the
    one written with them. ``crc``: the crc32c of the header that the manifest records, if it
    does (version 2 and later).

    A header with that crc is the one the store wrote beside these entries: the manifest's seal
    ties the two, so a damaged or swapped shard, or a damaged manifest, is caught. The seal is a
    checksum, not a signature: a manifest edited and sealed again that renames or reinterprets
    tensors (same bytes, other names, dtypes or shapes) but keeps the crc is believed, as its
    tree's values are. Without a crc, or with another one, the header the entries make is rebuilt
    and compared byte for byte (20 ms per 20,000 tensors, the crc 0.1 ms), and where that
    differs the header is parsed and its tensors compared with the entries (a shard rewritten by
    another safetensors writer). Every reader of a step checks a shard so as it opens it for its
    data: a store's ``load()``, and through ``Source.checks`` (:func:`aiotensor.sources.step`)
    ``stream``, ``load_into``, ``verify`` and ``convert`` (helper-60 found ``verify`` saying OK
    of a shard whose header ``load()`` refused)."""
    specs = sorted(map(_ENTRY_SPEC, entries), key=_SPEC_OFFSET)
    # the tensors follow the header with no gap, in this order, up to the end of the file
    if size == engine.size(fd):
        if crc is not None:
            end, got = header_crc(engine, fd, path)
            if got == crc and st.follow_on(specs, end, size):
                return
        header = shard_header(specs)
        if st.follow_on(specs, len(header), size) and begins_with(engine, fd, header, path):
            return
    layout = layout_of(engine, fd, path)
    listed = {e.spec.key: e.spec for e in entries}
    if layout.file_size != size or {s.key: s for s in layout.tensors} != listed:
        raise ManifestError(f"shard {os.path.basename(path)} does not hold the tensors the manifest lists for it", mpath)


def begins_with(engine: Engine, fd: int, data: bytes, path: str) -> bool:
    """Whether an open file begins with exactly ``data`` (blocking: in a worker thread)."""
    if engine.size(fd) < len(data):
        return False
    buf = bytearray(len(data))
    _read_exact(engine, fd, memoryview(buf), 0, path, "the header")
    return buf == data


@dataclass(frozen=True)
class _ReadUnit:
    offset: int  # file offset
    # the destination bytes: host memory (``nbytes`` of it; for a block's piece, up to a page
    # boundary after), or device memory the engine reads into (checksummed through a bounce slot);
    # None: read into a bounce slot, then copy rows [row0, row1) of ``target``
    dest: memoryview | torch.Tensor | None
    nbytes: int
    # (target, a, b): bytes [a, b) of this unit are bytes of that target, in order (its crc's pieces)
    parts: tuple[tuple[int, int, int], ...]
    aligned: bool = False  # a block's piece: page-aligned memory at a page-aligned offset
    target: int = -1
    row0: int = 0
    row1: int = 0
    # small tensors gathered into one read (an object store: a request per read), each
    # (target, its first byte in this unit): read straight into each by preadv where the page
    # cache holds them (_scattered), else into a bounce slot, then copied out
    members: tuple[tuple[int, int], ...] = ()


async def read_tensors(sched: Scheduler, fd: int, path: str, targets: Sequence[Target], priority: int) -> None:
    """Read every target from the open file ``fd``, in parallel pieces, and verify checksums. What
    the page cache holds is copied from it; the rest is read with O_DIRECT where the engine offers
    it (:meth:`~aiotensor.engines.Engine.open_direct`): straight into the blocks of carved tensors,
    through page-aligned bounce slots into other memory.

    Raises:
        ChecksumError: naming the file and the tensor whose bytes differ from the recorded crc32c.
        FormatError: the file ended early.
        OSError: the engine's error, naming the file.

    CUDA targets are written only after the work already queued on their streams.

    Cancellation: returns only once no thread writes into any target tensor.
    """
    await wait_for_streams(sched, map(_TENSOR, targets))
    total = sum(map(_NBYTES, targets))
    if total <= sched.batch_bytes:
        # what one worker call would read anyway (a stream's batch, a small file): planned, read
        # and checked in that one call; each hop to a thread and back costs ~0.1 ms of the loop's
        # and the thread's time, and a stream of a 0.5 GB file made 250 of them
        [(nbytes, direct)] = await sched.map(
            _read_at_once, [(sched, fd, path, targets)], nbytes=lambda _: total, priority=priority, slot=True, io=True
        )
        sched.stats.bytes_read += nbytes
        sched.stats.bytes_direct += direct
        return
    units, nbytes, dfd = await sched.call(_plan, sched, fd, targets, priority=priority, cleanup=_close_direct(sched.engine))
    try:
        run = partial(_read_unit, sched, fd, dfd, path, targets)
        got = await sched.map(run, units, nbytes=lambda u: u.nbytes, priority=priority, slot=True, io=True)
    finally:
        if dfd is not None:
            await close(sched, dfd)
    await _checked(sched, path, targets, units, nbytes, got, priority)


def _read_at_once(slot: memoryview, job: tuple[Scheduler, int, str, Sequence[Target]]) -> tuple[int, int]:
    """:func:`read_tensors` in the calling thread: plan, read every unit, check the crcs; the bytes
    read, and how many of them with O_DIRECT."""
    sched, fd, path, targets = job
    units, nbytes, dfd = _plan(sched, fd, targets)
    try:
        got = []
        for u in units:
            given_up()  # (a cancelled stream's batch stops here)
            got.append(_read_unit(sched, fd, dfd, path, targets, slot, u))
    finally:
        if dfd is not None:
            sched.engine.close(dfd)
    _check_crcs(path, targets, units, got)
    return nbytes, sum(n for _, n in got)


def _read_unit(
    sched: Scheduler, fd: int, dfd: int | None, path: str, targets: Sequence[Target], slot: memoryview, u: _ReadUnit
) -> tuple[list[int], int]:
    """Read one unit where it goes (through ``slot`` where it must bounce); its pieces' crcs, and
    the bytes read with O_DIRECT."""
    eng = sched.engine
    what = f"tensor {targets[u.parts[0][0] if u.parts else u.target].spec.key!r}"
    if isinstance(u.dest, torch.Tensor):  # device memory the engine reads into
        _read_exact(eng, fd, u.dest, u.offset, path, what)
        if not u.parts:
            return [], 0
        copy_tensor(sched, torch.from_numpy(np.frombuffer(slot, np.uint8, u.nbytes)), u.dest)
        return _crcs(targets, u, slot), 0
    if u.dest is not None:
        direct = _fill(eng, fd, dfd, u.dest, u.offset, u.nbytes, u.aligned, slot, path, what)
        return _crcs(targets, u, u.dest), direct
    if u.members and (crcs := _scattered(eng, fd, dfd, targets, slot, u)) is not None:
        return crcs, 0
    bounce = u.nbytes + 2 * PAGE <= len(slot)
    room = slot if bounce else memoryview(bytearray(u.nbytes))
    data, direct = _fetch(eng, fd, dfd if bounce else None, room, u.offset, u.nbytes, path, what)
    if u.members:
        at = address(data)
        for j, a in u.members:
            move(targets[j].tensor.data_ptr(), at + a, targets[j].spec.nbytes)
        return _crcs(targets, u, data), direct
    t = targets[u.target]
    dtype = SAFETENSORS_TO_TORCH[t.spec.dtype]
    src = torch.from_numpy(np.frombuffer(data, np.uint8, u.nbytes)).view(dtype)
    target = t.tensor.detach()  # parameters require grad: copy into their memory, not their autograd view
    dst = target[u.row0 : u.row1] if target.dim() else target
    src = src.view((u.row1 - u.row0, *t.tensor.shape[1:])) if t.tensor.dim() else src.view(())
    copy_tensor(sched, dst, src)
    return _crcs(targets, u, data), direct


def _plan(sched: Scheduler, fd: int, targets: Sequence[Target]) -> tuple[list[_ReadUnit], int, int | None]:
    """The pieces to read (:func:`_read_units`) and a descriptor of ``fd`` that reads with O_DIRECT
    (None: there is none, or the bounce slots are too small to read through)."""
    dfd = None
    if sched.slots.slot_bytes - 2 * PAGE >= knobs.DIRECT_MIN_BYTES:
        dfd = sched.engine.open_direct(fd)
    try:
        return (*_read_units(sched, targets, dfd is not None), dfd)
    except BaseException:
        if dfd is not None:
            sched.engine.close(dfd)
        raise


def _close_direct(engine: Engine) -> Callable[[tuple[list[_ReadUnit], int, int | None]], None]:
    def cleanup(planned: tuple[list[_ReadUnit], int, int | None]) -> None:
        if planned[2] is not None:
            engine.close(planned[2])

    return cleanup


def _scattered(
    eng: Engine, fd: int, dfd: int | None, targets: Sequence[Target], slot: memoryview, u: _ReadUnit
) -> list[int] | None:
    """Read the gathered unit ``u`` straight into its members' memory, up to 1,024 buffers per
    ``preadv`` (the bytes between members into ``slot``), where the page cache holds it (or it is
    read buffered anyway): one copy, with the GIL released, where a read into a bounce slot then
    a memmove per member, with the GIL held (:func:`~aiotensor._runtime.buffers.move`), took 34 ms
    of it per 20,000 tensors of 5 KB. Each member's buffer is a slice of one memoryview over the
    members' address range, the slices made by C loops (a ctypes array per member, made in a Python
    loop, cost 2.6 us each: 52 ms of the GIL per 20,000). The crcs of ``u``'s parts; None, having
    read nothing or only what will be read again, where the engine has no ``preadv``, the cache
    lacks some of it (read with O_DIRECT through the slot), members overlap in the file or in
    memory (two entries into one tied parameter: each is checked as read, through the slot), or a
    read fails or comes up short (the slot's path then says why, naming the file and the tensor)."""
    if not eng.scatters or not u.members:
        return None
    if dfd is not None and u.nbytes >= knobs.DIRECT_MIN_BYTES and eng.cached(fd, u.offset, u.nbytes) < u.nbytes:
        return None
    # columns of the members, a slice per C loop (one over 20,000 members held the GIL 1-5 ms)
    idx = gil.listed(map(_FIRST, u.members))  # in file order
    begins = gil.listed(map(_SECOND, u.members))
    members = gil.listed(map(targets.__getitem__, idx))
    sizes = gil.listed(map(_NBYTES, members))
    gaps = gil.listed(map(sub, begins, chain((0,), map(add, begins, sizes))))  # before each member
    if min(gaps) < 0 or max(gaps) > len(slot):  # overlapping in the file; a gap past the slot
        return None
    ptrs = gil.listed(map(torch.Tensor.data_ptr, map(_TENSOR, members)))
    where = disjoint(ptrs, sizes)
    if where is None:  # overlapping in memory
        return None
    lo, hi = where
    memory = memory_at(lo, hi - lo)
    starts = gil.listed(map(sub, ptrs, repeat(lo)))
    mine = gil.listed(map(memory.__getitem__, map(slice, starts, map(add, starts, sizes))))
    # each gap's bytes into the slot, then the member's; no buffer for an empty gap
    bufs = gil.listed(filter(len, chain.from_iterable(zip(map(slot.__getitem__, map(slice, gaps)), mine, strict=True))))
    at = u.offset
    for i in range(0, len(bufs), _IOV_MAX):
        some = bufs[i : i + _IOV_MAX]
        try:
            got = eng.preadv(fd, some, at)
        except OSError:
            return None
        if got != sum(map(len, some)):
            return None
        at += got
    return _crcs(targets, u, None, gil.filled({}, zip(idx, mine, strict=True)))


_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16)  # Linux: 1024


def _crcs(targets: Sequence[Target], u: _ReadUnit, data: memoryview | None, bufs: dict[int, Any] | None = None) -> list[int]:
    """The crc of each of ``u``'s parts in ``data`` (a block's piece has thousands: C loops), or
    of each part's target's bytes ``bufs[target]`` (a whole target's)."""
    if not u.parts:
        return []
    idx, begins, ends = zip(*u.parts, strict=True)
    views: Iterable[Any]
    if bufs is not None:
        views = map(bufs.__getitem__, idx)
    else:
        assert data is not None
        views = map(data.__getitem__, map(slice, begins, ends))
    kinds = list(map(_KIND, map(targets.__getitem__, idx)))
    if kinds.count(kinds[0]) == len(kinds):
        return checksum.each(kinds[0], views, list(map(sub, ends, begins)))
    return list(map(checksum.of, kinds, views))


def _fill(
    engine: Engine,
    fd: int,
    dfd: int | None,
    dest: memoryview,
    off: int,
    need: int,
    aligned: bool,
    slot: memoryview,
    path: str,
    what: str,
) -> int:
    """Fill ``dest[:need]`` with the file's bytes at ``off``; return how many were read with O_DIRECT.
    Without ``dfd``: buffered reads. With it: what the page cache holds is copied, the rest read
    with O_DIRECT, straight into ``dest`` if ``aligned`` (a block's piece: :func:`_fetch` lands it
    in place), else through ``slot``."""
    if aligned or dfd is None or need < knobs.DIRECT_MIN_BYTES:
        return _fetch(engine, fd, dfd, dest, off, need, path, what)[1]
    got = _cached(engine, fd, dest[:need], off, path, what)
    if got == need:
        return 0
    if need - got + 2 * PAGE > len(slot):  # no room to bounce: buffered
        _read_exact(engine, fd, dest[got:need], off + got, path, what)
        return 0
    data, n = _fetch(engine, fd, dfd, slot, off + got, need - got, path, what, cached=False)
    copy_bytes(dest[got:need], data)
    return n


def _fetch(
    engine: Engine, fd: int, dfd: int | None, room: memoryview, off: int, need: int, path: str, what: str, cached: bool = True
) -> tuple[memoryview, int]:
    """The file's bytes ``[off, off + need)`` read into ``room`` (page-aligned, with room up to the
    page boundary after ``off % PAGE + need`` when ``dfd`` is given), as a view of it, and how many
    were read with O_DIRECT. With ``dfd`` the view starts ``off % PAGE`` into ``room``, so that
    O_DIRECT reads land aligned; what the page cache holds is copied first unless ``cached=False``."""
    if dfd is None or need < knobs.DIRECT_MIN_BYTES:
        _read_exact(engine, fd, room[:need], off, path, what)
        return room[:need], 0
    skip = off % PAGE
    data = room[skip : skip + need]
    got = _cached(engine, fd, data, off, path, what) if cached else 0
    if got < need:
        start = (skip + got) // PAGE * PAGE
        _read_direct(engine, fd, dfd, room[start:], off - skip + start, skip + need - start, path, what)
    return data, need - got


def _cached(engine: Engine, fd: int, buf: memoryview, off: int, path: str, what: str) -> int:
    """Copy what the page cache holds of ``buf``'s bytes at ``off``, from the first on (buffered
    reads of at most :data:`knobs.HOST_READ_BYTES`); return the count."""
    got = engine.cached(fd, off, len(buf))
    for a, b in spans(got, knobs.HOST_READ_BYTES):
        prefault(buf[a:b])
        _read_exact(engine, fd, buf[a:b], off + a, path, what)
    return got


def _read_direct(engine: Engine, fd: int, dfd: int, buf: memoryview, off: int, need: int, path: str, what: str) -> None:
    """Read at least ``need`` bytes at the page-aligned ``off`` into the page-aligned ``buf`` with
    O_DIRECT, in whole pages (``buf`` has room up to the page boundary after them); a file system
    that refuses it mid-way (EINVAL) gets buffered reads of the rest."""
    done, room = 0, round_up(need)
    prefault(buf[:room])  # O_DIRECT pins the pages it reads into: faulted in one by one otherwise
    while done < need:
        try:
            n = engine.pread(dfd, buf[done:room], off + done)
        except OSError as e:
            if e.errno != errno.EINVAL or done % PAGE:
                raise annotate_oserror(e, f"reading {what} from {path}") from e
            _read_exact(engine, fd, buf[done:need], off + done, path, what)
            return
        if n <= 0 or (n % PAGE and done + n < need):
            raise FormatError(f"file ends at byte {off + done + max(n, 0)}, inside {what}", path)
        done += n


def _read_units(sched: Scheduler, targets: Sequence[Target], odirect: bool) -> tuple[list[_ReadUnit], int]:
    """The pieces to read (straight into each target's memory, a block's pieces into its memory, or
    through bounce slots by rows) and their bytes. ``direct``: O_DIRECT reads are offered, so host
    pieces are :data:`knobs.DIRECT_READ_BYTES` (what the cache holds is still copied in pieces of
    :data:`knobs.HOST_READ_BYTES`)."""
    units: list[_ReadUnit] = []
    host = _read_piece(sched, odirect)
    blocks, others = _by_block(targets, sched.engine.handles_device)
    small: list[int] = []  # read together, then copied out (knobs.GATHER_TENSOR_BYTES)
    gather = knobs.GATHER_TENSOR_BYTES if sched.engine.read_bytes is None else knobs.CARVE_TENSOR_BYTES
    for i in others:
        t = targets[i]
        spec, dst = t.spec, t.tensor
        if spec.nbytes == 0:
            continue
        engine_reads = sched.engine.handles_device(dst)  # device memory the engine reads into itself
        part = (i,) if t.crc is not None else ()
        # memmove into memory torch allocated only: a read-only mapping (from_numpy of np.load's
        # mmap) is an OSError to pread, a crash to memmove
        if spec.nbytes <= gather and not engine_reads and direct(dst) and dst.untyped_storage().resizable():
            small.append(i)
            continue
        if engine_reads or direct(dst):
            whole = io_bytes(sched.engine, dst)
            piece = sched.chunk_bytes if isinstance(whole, torch.Tensor) else host
            units += [
                _ReadUnit(spec.offset + a, whole[a:b], b - a, tuple((j, 0, b - a) for j in part))
                for a, b in spans(spec.nbytes, piece)
            ]
            continue
        # (planned before this file's reads: none of them written; helper-59: torch's RuntimeError)
        check_fillable(dst, f"tensor {spec.key!r}: the tensor to read it into")
        rows = dst.shape[0] if dst.dim() else 1
        row_bytes = spec.nbytes // rows
        per = max(1, host // row_bytes)
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            n = (r1 - r0) * row_bytes
            parts = tuple((j, 0, n) for j in part)
            units.append(_ReadUnit(spec.offset + r0 * row_bytes, None, n, parts, target=i, row0=r0, row1=r1))
    for block, members in blocks.items():
        units += _block_units(block, targets, members, host, odirect)
    units += _gathered(targets, small, host)
    return units, sum(u.nbytes for u in units)


def _by_block(
    targets: Sequence[Target], reads_itself: Callable[[torch.Tensor], bool] | None = None
) -> tuple[dict[Block, list[int]], list[int]]:
    """The targets carved from each block, and the others (those of a block whose memory the
    engine ``reads_itself``), by index, in order: C loops and a step per run of one block's (a
    loop over 20,000 targets cost ~10 ms)."""
    blocks: dict[Block, list[int]] = {}
    others: list[int] = []
    of = gil.listed(map(_BLOCK, targets))
    for block, run in groupby(range(len(of)), of.__getitem__):
        members = gil.listed(run)
        if block is None or (reads_itself is not None and reads_itself(targets[members[0]].tensor)):  # (one allocation)
            others += members
        else:
            blocks.setdefault(block, []).extend(members)
    return blocks, others


def _gathered(targets: Sequence[Target], chosen: list[int], most: int) -> list[_ReadUnit]:
    """Small tensors read together: neighbours in the file (at most :data:`knobs.CARVE_GAP_BYTES`
    apart, e.g. a torch.save zip's storages, between which lie their entries' headers) in reads
    of at most ``most`` bytes (:func:`_scattered` into each, or through a bounce slot). A read's
    first tensors are walked one by one; where it goes on past :data:`_WALK` of them, its end is
    found by numpy over the tensors within ``most`` bytes of its start and its members listed by
    C loops (a loop over 20,000 tensors cost 15 ms; numpy for every read, 15 us a read of one
    tensor: a model's biases between its big weights are that)."""
    if not chosen:
        return []
    mine = gil.listed(map(targets.__getitem__, chosen))
    first = np.asarray(gil.listed(map(_OFFSET_OF, mine)), dtype=np.int64)
    order = np.argsort(first, kind="stable")  # (stable: as sorted() orders ties)
    first, end = first[order], first[order] + np.asarray(gil.listed(map(_NBYTES, mine)), dtype=np.int64)[order]
    starts, ends, idx = first.tolist(), end.tolist(), np.asarray(chosen, dtype=np.int64)[order].tolist()
    gap, n = knobs.CARVE_GAP_BYTES, len(chosen)
    out: list[_ReadUnit] = []
    a = 0
    while a < n:
        b, hi, long = a + 1, ends[a], False  # the read's tensors [a, b), its end
        while b < n and starts[b] - hi <= gap and ends[b] - starts[a] <= most:  # tensor b joins it
            if b - a == _WALK:
                long = True
                break
            hi, b = max(hi, ends[b]), b + 1
        lo = starts[a]
        if long:  # past w, a tensor ends beyond most; its end, with each tensor, from its first
            w = int(np.searchsorted(first, lo + most, side="right"))
            run = np.maximum.accumulate(end[a:w])
            cut = np.flatnonzero((first[a + 1 : w] - run[:-1] > gap) | (end[a + 1 : w] - lo > most))
            b = a + 1 + int(cut[0]) if cut.size else w
            hi = int(run[b - 1 - a])
            members, at, till = idx[a:b], (first[a:b] - lo).tolist(), (end[a:b] - lo).tolist()
            checked = gil.listed(map(is_not, map(_CRC, map(targets.__getitem__, members)), repeat(None)))
            parts = tuple(gil.listed(compress(zip(members, at, till, strict=True), checked)))
            placed = tuple(gil.listed(zip(members, at, strict=True)))
        else:
            placed = tuple((j, x - lo) for j, x in zip(idx[a:b], starts[a:b], strict=True))
            parts = tuple((j, x, x + targets[j].spec.nbytes) for j, x in placed if targets[j].crc is not None)
        out.append(_ReadUnit(lo, None, hi - lo, parts, members=placed))
        a = b
    return out


_WALK = 16


def _block_units(block: Block, targets: Sequence[Target], members: list[int], piece: int, odirect: bool) -> list[_ReadUnit]:
    """A block's pieces, each with the parts of the tensors it holds (``targets[i]`` for ``i`` in
    ``members``) that have a crc; from its page-aligned start for O_DIRECT reads, else from its
    first tensor's first byte. A piece's parts are found by bisection and made by C loops (a block
    may hold 30,000 tensors)."""
    mine = gil.listed(map(targets.__getitem__, members))
    starts = gil.listed(map(_OFFSET_OF, mine))
    if not all(map(le, starts, islice(starts, 1, None))):  # (carved in file order: nearly always)
        order = sorted(range(len(mine)), key=starts.__getitem__)
        members, mine, starts = [members[k] for k in order], [mine[k] for k in order], [starts[k] for k in order]
    odirect = odirect and block.end - block.offset >= knobs.DIRECT_MIN_BYTES
    mem = byte_view(block.memory)
    base = block.offset if odirect else starts[0]
    checked = gil.listed(map(is_not, map(_CRC, mine), repeat(None)))
    idx = gil.listed(compress(members, checked))
    ends = gil.listed(compress(map(add, starts, map(_NBYTES, mine)), checked))
    starts = gil.listed(compress(starts, checked))
    out = []
    for a, b in spans(block.end - base, piece):
        lo, hi = base + a, base + b
        first, last = bisect.bisect_right(ends, lo), bisect.bisect_left(starts, hi)  # the tensors in [lo, hi)
        at = repeat(lo)
        parts = list(zip(idx[first:last], map(sub, starts[first:last], at), map(sub, ends[first:last], at), strict=True))
        if parts:  # the first and last may lie partly outside
            parts[0] = (parts[0][0], max(parts[0][1], 0), parts[0][2])
            parts[-1] = (parts[-1][0], parts[-1][1], min(parts[-1][2], hi - lo))
        out.append(_ReadUnit(lo, mem[lo - block.offset :], b - a, tuple(parts), aligned=odirect))
    return out


def _verify_units(sched: Scheduler, targets: Sequence[Target]) -> tuple[list[_ReadUnit], int]:
    """The pieces to read through bounce slots to check every target that has a crc, and their bytes."""
    step = _read_piece(sched, False)
    units = [
        _ReadUnit(t.spec.offset + a, None, b - a, ((i, 0, b - a),), target=i)
        for i, t in enumerate(targets)
        if t.crc is not None
        for a, b in spans(t.spec.nbytes, step)
    ]
    return units, sum(u.nbytes for u in units)


async def _checked(
    sched: Scheduler,
    path: str,
    targets: Sequence[Target],
    units: list[_ReadUnit],
    nbytes: int,
    got: list[tuple[list[int], int]],
    priority: int,
) -> None:
    """After a read or verify pass: count the bytes, compare the crcs, and free the units (tens
    of thousands of views, for a state of many tensors) in a thread."""
    sched.stats.bytes_read += nbytes
    sched.stats.bytes_direct += sum(n for _, n in got)
    await sched.call(_check_crcs, path, targets, units, got, priority=priority)
    await sched.discard(units, got)


def _read_piece(sched: Scheduler, odirect: bool) -> int:
    """The largest read into host memory: :data:`knobs.DIRECT_READ_BYTES` where O_DIRECT reads are
    offered (at most a bounce slot less two pages), else the engine's own size or
    :data:`aiotensor.knobs.HOST_READ_BYTES`."""
    if odirect:
        return min(sched.slots.slot_bytes - 2 * PAGE, knobs.DIRECT_READ_BYTES)
    return min(sched.slots.slot_bytes, sched.engine.read_bytes or knobs.HOST_READ_BYTES)


async def verify_tensors(sched: Scheduler, fd: int, path: str, targets: Sequence[Target], priority: int) -> None:
    """Check the crc32c of every target that has one by reading its bytes through bounce slots;
    writes into no target (the first pass of an all-or-nothing load). Buffered reads: the pass
    that follows finds the bytes in the page cache.

    Raises:
        ChecksumError, FormatError, OSError: as :func:`read_tensors`.

    Cancellation: returns once no thread reads any more; nothing was changed.
    """
    units, nbytes = await sched.call(_verify_units, sched, targets, priority=priority)

    def run(slot: memoryview, u: _ReadUnit) -> tuple[list[int], int]:
        t = targets[u.target]
        _read_exact(sched.engine, fd, slot[: u.nbytes], u.offset, path, f"tensor {t.spec.key!r}")
        return _crcs(targets, u, slot), 0

    got = await sched.map(run, units, nbytes=lambda u: u.nbytes, priority=priority, slot=True)
    await _checked(sched, path, targets, units, nbytes, got, priority)


def _check_crcs(path: str, targets: Sequence[Target], units: Sequence[_ReadUnit], got: Sequence[tuple[list[int], int]]) -> None:
    """Combine the crcs of the pieces read and compare each target's with its recorded one:
    ChecksumError names the first that differs."""
    recorded = gil.listed(map(_CRC, targets))
    crcs = _combined(targets, units, got, recorded)
    if crcs == recorded:  # the common case: one C compare
        return
    i = next(i for i, (c, r) in enumerate(zip(crcs, recorded, strict=True)) if r is not None and c != r)
    t, s = targets[i], targets[i].spec
    raise ChecksumError(
        f"tensor {s.key!r} is corrupt: {t.kind} of bytes [{s.offset}, {s.offset + s.nbytes}) is {crcs[i]:#010x}, "
        f"{t.crc:#010x} was recorded when it was written",
        path,
        s.key,
    )


def _combined(
    targets: Sequence[Target], units: Sequence[_ReadUnit], got: Sequence[tuple[list[int], int]], recorded: list[int | None]
) -> list[int | None]:
    """Each target's crc, combined from its parts' in order (None where none is recorded; 0, the
    crc of nothing, for a target with a crc and no part read), by C loops where a target is read in
    one part (a Python loop cost ~8 ms per 20,000 tensors)."""
    if list(map(len, map(_PARTS, units))) != list(map(len, map(_FIRST, got))):
        raise ValueError("a unit's crcs are not one per part")
    parts = gil.listed(chain.from_iterable(map(_PARTS, units)))  # (a slice per C loop: 20,000 parts)
    idx = gil.listed(map(_FIRST, parts))
    read = gil.listed(chain.from_iterable(map(_FIRST, got)))
    crcs: list[int | None] = [0] * len(targets) if None not in recorded else [None if c is None else 0 for c in recorded]
    for at, got_crcs in zip(gil.slices(idx), gil.slices(read), strict=True):  # a target's last part's crc: one part, its own
        deque(map(crcs.__setitem__, at, got_crcs), maxlen=0)
    if len(gil.filled(set(), idx)) != len(idx):  # a few targets read in several parts (a block's pieces' edges)
        split = {i for i, n in Counter(idx).items() if n > 1}
        pieces: dict[int, list[tuple[int, int]]] = {}
        for k in [k for k, i in enumerate(idx) if i in split]:
            i, a, b = parts[k]
            pieces.setdefault(i, []).append((read[k], b - a))
        for i, p in pieces.items():
            crcs[i] = crc_of_pieces(p, targets[i].kind)
    return crcs


_KIND, _PARTS, _CRC, _FIRST, _SECOND = attrgetter("kind"), attrgetter("parts"), attrgetter("crc"), itemgetter(0), itemgetter(1)
_TENSOR, _NBYTES, _OFFSET_OF = attrgetter("tensor"), attrgetter("spec.nbytes"), attrgetter("spec.offset")
_BLOCK = attrgetter("block")
_ENTRY_SPEC, _SPEC_OFFSET = attrgetter("spec"), attrgetter("offset")


async def verify_mapped(sched: Scheduler, path: str, targets: Sequence[Target], priority: int) -> None:
    """Check the crc of every target that has one by reading its memory (the mapped pages of a
    file: :func:`aiotensor.files.load_file` with ``mmap=True``), in parallel pieces.

    Raises: ChecksumError, as :func:`read_tensors`. Cancellation: returns once no thread reads."""
    step = knobs.CHUNK_BYTES

    def plan() -> list[_ReadUnit]:
        # views of a mapping (their block) in big pieces of it, each piece's crc parts per tensor
        # (a byte view per tensor was four torch ops each: 20,000 of them cost more than the crcs)
        blocks, others = _by_block(targets)
        units = []
        for i in others:
            t = targets[i]
            if t.crc is None:
                continue
            mem = byte_view(t.tensor)
            units += [_ReadUnit(t.spec.offset + a, mem[a:b], b - a, ((i, 0, b - a),)) for a, b in spans(t.spec.nbytes, step)]
        for block, members in blocks.items():
            units += [u for u in _block_units(block, targets, members, step, False) if u.parts]  # (checked pieces only)
        return units

    units = await sched.call(plan, priority=priority)

    def run(u: _ReadUnit) -> tuple[list[int], int]:
        assert isinstance(u.dest, memoryview)
        return _crcs(targets, u, u.dest), 0

    got = await sched.map(run, units, nbytes=lambda u: u.nbytes, priority=priority)
    await _checked(sched, path, targets, units, 0, got, priority)
