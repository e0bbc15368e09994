"""Staging: copy a state's tensors into a staging arena (CPU copies in worker threads, CUDA copies
on the copy stream), and checksum what was staged."""

from __future__ import annotations

import bisect
import os
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

import anyio
import torch

from .. import knobs
from .._runtime import cuda
from .._runtime.buffers import HostBuffer, copy_spans, move, same_bytes
from .._runtime.scheduler import Scheduler, run_concurrently
from ..errors import StateChangedError
from ..formats import checksum
from ..formats import safetensors as st
from .plan import SavePlan
from .tensors import all_direct, crc_of_pieces, direct, spans


class _StageUnit(NamedTuple):  # (a tuple: a frozen dataclass cost 1.5 us to make, 20,000 tensors 2 of them each)
    key: str
    src: torch.Tensor
    start: int  # arena byte offset
    nbytes: int
    whole: bool  # copy the tensor with its shape (a non-contiguous source)


class _Spans(NamedTuple):
    """Small plain CPU tensors of one shard, copied by one C call (:func:`copy_spans`)."""

    srcs: list[torch.Tensor]
    starts: list[int]  # arena byte offsets
    sizes: list[int]
    nbytes: int


async def stage(
    sched: Scheduler,
    plan: SavePlan,
    sources: dict[str, torch.Tensor],
    arena: HostBuffer,
    priority: int,
    producers: dict[torch.device, Any] | None = None,
    compare: set[int] | None = None,
    changed: set[int] | None = None,
) -> tuple[list[_StageUnit], list[Any]]:
    """Copy every source tensor and shard header into ``arena``; return the pieces copied, and the
    containers of views of the sources (tens of thousands of objects for a state of many tensors),
    for the caller to free in a thread (:meth:`Scheduler.discard`) once it has said ``staged``.

    ``compare``: arena offsets of shards whose bytes the arena holds already, from an earlier save
    (incremental saves): a CPU piece there is compared first (memcmp, as fast as the copy) and
    copied only if it differs. The offsets of those shards that differ (or hold a piece that cannot
    be compared: CUDA, non-contiguous) are added to ``changed``; the others are proven equal.

    CPU tensors are copied by worker threads; CUDA tensors by one device → host copy per device on
    its copy stream, after ``producers[device]`` (an event recorded when ``save`` was called).

    Cancellation: returns only once no copy reads a source tensor or writes the arena.
    """
    # one unit per piece of every tensor: tens of thousands for a large state, so built in a thread
    pieces, cpu, gpu, cpu_bytes = await sched.call(_stage_units, sched, plan, sources, arena, priority=priority)
    starts = sorted(compare or ())
    ends = (
        {sh.arena_offset: sh.arena_offset + sh.layout.file_size for sh in plan.shards if sh.arena_offset in compare}
        if compare
        else {}
    )
    if starts and changed is not None:  # tens of thousands of tensors: in a thread
        changed |= await sched.call(_on_device, plan, sources, set(ends), priority=priority)

    def within(start: int) -> int | None:
        i = bisect.bisect_right(starts, start) - 1
        return starts[i] if i >= 0 and start < ends[starts[i]] else None

    def copy(u: _StageUnit | _Spans) -> None:
        if isinstance(u, _Spans):
            shard = within(u.starts[0]) if starts else None
            ptrs = list(map(_DATA_PTR, u.srcs))
            if copy_spans(arena.address, u.starts, ptrs, u.sizes, compare=shard is not None) and shard is not None:
                assert changed is not None
                changed.add(shard)
            return
        shard = within(u.start) if starts else None
        if shard is not None:
            assert changed is not None
            if not u.whole and same_bytes(arena.address + u.start, u.src.data_ptr(), u.nbytes):
                return  # the arena holds these bytes already
            changed.add(shard)
        if u.whole:
            arena.tensor[u.start : u.start + u.nbytes].view(u.src.dtype).view(u.src.shape).copy_(u.src)
        else:  # plain memcpy (the GIL kept for a small one: microseconds; let go for a big one)
            move(arena.address + u.start, u.src.data_ptr(), u.nbytes)

    async def host() -> None:
        # the caller waits for these copies: every core makes them, unless they are small ones,
        # whose Python work per copy (the GIL) a second thread only contends for
        batch = _per_cpu(sched, cpu_bytes, spare=0 if cpu_bytes >= len(cpu) * knobs.MiB else 1)
        await sched.map(copy, cpu, nbytes=lambda u: u.nbytes, priority=priority, batch_bytes=batch, budget=False)

    async def device() -> None:
        assert producers is not None and sched.cuda is not None
        if not sched.cuda.pinning.pinned(arena.address):  # no device had a context when it was mapped
            await sched.call(arena.pin, sched.cuda.pinning, priority=priority)
        for dev, copies in gpu.items():
            await device_copies(sched, dev, producers[dev], copies, priority)

    await run_concurrently(host, device) if gpu else await host()
    return pieces, [cpu, gpu]


async def device_copies(
    sched: Scheduler, dev: torch.device, producer: Any, copies: list[tuple[torch.Tensor, torch.Tensor]], priority: int
) -> None:
    """Queue ``copies`` (pinned host ← ``dev``) on the device's copy stream after ``producer`` and
    wait for them to complete.

    Cancellation: the copies write the arena, which the caller releases once this returns: queueing
    them and waiting for their completion event are one shielded step (queueing is cheap), and a
    completion event a worker made reaches a wait whatever cancels the caller (asyncio's own
    ``Task.cancel()`` included); the cancellation is raised after that.
    """
    assert sched.cuda is not None
    keep = [src for _, src in copies]
    with anyio.CancelScope(shield=True):
        event, resolved = await sched.call(
            cuda.d2h, sched.cuda, producer, copies, priority=priority, cleanup=lambda made: cuda.synchronize({dev: made[0]})
        )
        await sched.cuda.bridge(dev).wait(event, keep=[*keep, *resolved], through_cancel=True)


def _stage_units(
    sched: Scheduler, plan: SavePlan, sources: dict[str, torch.Tensor], arena: HostBuffer
) -> tuple[list[_StageUnit], list[_StageUnit | _Spans], dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]], int]:
    """Copy the headers into ``arena``; return every piece to checksum (in arena order, without
    sources), the CPU copies to make, the CUDA copies per device, and the CPU copies' bytes.

    A shard's tensors are taken :data:`_SPANS` at a time: where all of them are plain CPU tensors of
    at most a chunk (the many small tensors of a model), they are copied by :class:`_Spans` and
    looked at by C loops; the others one by one."""
    pieces: list[_StageUnit] = []
    cpu: list[_StageUnit | _Spans] = []
    gpu: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    chunk = sched.chunk_bytes
    for sh in plan.shards:
        base = sh.arena_offset
        arena.view[base : base + len(sh.header)] = sh.header
        specs = sh.layout.tensors
        for lo in range(0, len(specs), _SPANS):
            some = specs[lo : lo + _SPANS]
            keys = list(map(_KEY, some))
            srcs = list(map(sources.__getitem__, keys))
            at = list(map(base.__add__, map(_OFFSET, some)))
            sizes = list(map(_NBYTES, some))
            if list(map(_NBYTES, srcs)) != sizes:  # (copied by the plan's sizes: past the end of its memory, helper-67)
                key = next(k for k, t, n in zip(keys, srcs, sizes, strict=True) if t.nbytes != n)
                raise StateChangedError(
                    f"tensor {key!r} is not the size it was when save() was called (another thread replaced it, or "
                    "its .data): nothing was saved. Change the state only once `await handle.staged` returns"
                )
            if max(sizes, default=0) <= chunk and all_direct(srcs):
                pieces += st.rows(_StageUnit, keys, repeat(_NO_SOURCE), at, sizes, repeat(False))
                cpu += _spans(srcs, at, sizes, chunk)
                continue
            for key, src, start, nbytes in zip(keys, srcs, at, sizes, strict=True):
                if src.is_cuda:
                    if nbytes:
                        dst = arena.tensor[start : start + nbytes].view(src.dtype).view(src.shape)
                        gpu.setdefault(src.device, []).append((dst, src))
                    pieces.append(_StageUnit(key, _NO_SOURCE, start, nbytes, False))
                    continue
                if not direct(src):
                    units = [_StageUnit(key, src, start, nbytes, True)]
                else:
                    flat = src.detach().reshape(-1)
                    size = src.element_size()
                    units = [
                        _StageUnit(key, flat[a:b], start + a * size, (b - a) * size, False)
                        for a, b in spans(flat.numel(), max(1, chunk // size))
                    ]
                cpu += units
                pieces += (u._replace(src=_NO_SOURCE, whole=False) for u in units)
    pieces.sort(key=_START)
    return pieces, cpu, gpu, sum(map(_NBYTES, cpu))


def _spans(srcs: list[torch.Tensor], starts: list[int], sizes: list[int], most: int) -> list[_Spans]:
    """Consecutive tensors in copies of at most ``most`` bytes (each tensor's at most that)."""
    out = []
    lo = total = 0
    for i, n in enumerate(sizes):
        if total + n > most:
            out.append(_Spans(srcs[lo:i], starts[lo:i], sizes[lo:i], total))
            lo, total = i, 0
        total += n
    if lo < len(sizes):
        out.append(_Spans(srcs[lo:], starts[lo:], sizes[lo:], total))
    return out


async def checksums(
    sched: Scheduler,
    plan: SavePlan,
    units: list[_StageUnit],
    arena: HostBuffer,
    priority: int,
    skip: frozenset[str] = frozenset(),
) -> dict[str, int]:
    """crc32c of every tensor staged in ``arena`` (but those of ``skip``), from the pieces ``stage`` returned."""
    if skip:  # tens of thousands of units: in a thread
        units = await sched.call(lambda: [u for u in units if u.key not in skip], priority=priority)
    crcs = await sched.map(
        lambda u: checksum.crc32c(arena.view[u.start : u.start + u.nbytes]),
        units,
        nbytes=lambda u: u.nbytes,
        priority=priority,
        batch_bytes=_per_cpu(sched, plan.nbytes),
        budget=False,
    )
    return await sched.call(_crcs_by_key, plan, units, crcs, skip, priority=priority)


def _crcs_by_key(plan: SavePlan, units: list[_StageUnit], crcs: list[int], skip: frozenset[str]) -> dict[str, int]:
    pieces: dict[str, list[tuple[int, int]]] = {
        spec.key: [] for sh in plan.shards for spec in sh.layout.tensors if spec.key not in skip
    }
    for u, c in zip(units, crcs, strict=True):
        pieces[u.key].append((c, u.nbytes))
    return {k: crc_of_pieces(v) for k, v in pieces.items()}


def _on_device(plan: SavePlan, sources: dict[str, torch.Tensor], offsets: set[int]) -> set[int]:
    """The shards at ``offsets`` that hold a CUDA tensor (their bytes cannot be compared)."""
    return {
        sh.arena_offset
        for sh in plan.shards
        if sh.arena_offset in offsets and any(sources[s.key].device.type == "cuda" for s in sh.layout.tensors)
    }


_NO_SOURCE = torch.empty(0)
_START = itemgetter(2)  # (of a _StageUnit)
_NBYTES = attrgetter("nbytes")  # (of a _StageUnit, a _Spans or a TensorSpec)
_KEY, _OFFSET = attrgetter("key"), attrgetter("offset")  # (of a TensorSpec)
_DATA_PTR = torch.Tensor.data_ptr
_SPANS = 1024  # tensors looked at per C loop (the GIL held ~0.1 ms)


def _per_cpu(sched: Scheduler, nbytes: int, spare: int = 1) -> int:
    """Batch size splitting CPU-bound work on ``nbytes`` into one batch per core but ``spare``.
    Work behind the caller's back (checksums) leaves the loop a core; the staging copies, which
    the caller waits for, take every core: the workers are niced, so the loop thread still wins a
    core whenever it wakes (worst loop lag measured the same, 7.5 ms, with one or two threads)."""
    threads = max(1, min(sched.workers, (os.cpu_count() or 2) - spare))
    return max(1, -(-nbytes // threads))
