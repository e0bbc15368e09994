"""A store's save pipeline: plan the state (in a worker), stage it into an arena (the caller's
tensors free from then on), then checksum and write the shards and the manifest under a temporary
name and commit (:class:`~aiotensor.commit.Publication`, then :meth:`Steps.commit`).

**Incremental saves** (:class:`Incremental`): a tensor is unchanged only when proven so. Torch's
version counter and the tensor's memory (unchanged since the last save) decide which tensors go
into *candidate* shards, whose layout a later save repeats. The proof is byte equality with the
earlier shard of the same header, established one of two ways: where the staging arena still holds
that earlier shard's image at the same place (the save before, in this process), each CPU source
piece is compared with it (memcmp, as fast as the copy it replaces: the caller waits no longer)
and copied only if it differs; otherwise (a restart, CUDA sources, the other arena) a blake3 digest
(256 bits) of the staged shard, header included, equals the digest recorded for the earlier one.
Such a shard is published as a hard link to the earlier file (on an object store, a server-side
copy): every step stays a complete folder that any safetensors reader opens, deletable on its own.
A `.data` write that the version counter misses fails the comparison (or changes the digest), and
the shard is written.

The earlier file must still hold what its digest says: one damaged on disk (a stray write, a
truncation) was linked into every later step, each committed and unloadable while the trainer's
memory was intact (helper-35). Before a link, the file is checked: unchanged since this store
wrote or read it whole (its inode, size and modification time, from a stat, where that time is a
tick of the file system's clock before the store knew the file: see :func:`_tick_ns`), or else
read whole and its blake3 digest compared (after a restart, the first save reads each shard it
links once). A file that differs is not linked: the shard is written, with a warning.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from itertools import chain, islice, repeat
from operator import attrgetter, eq
from typing import Any

import blake3
import torch

from .. import root as _root
from .._io.plan import Previous, SavePlan, plan_save, shard_header
from .._io.stage import checksums, stage
from .._io.write import write_file
from .._runtime import gil
from .._runtime.buffers import HostBuffer, StagingPool, round_up
from .._runtime.scheduler import Priority, ProgressCallback, Scheduler, reporting, run_concurrently
from ..commit import Publication
from ..engines import Engine
from ..errors import StateChangedError
from ..formats import checksum
from ..formats import manifest as mf
from ..formats.tree import MAX_DEPTH
from .handle import SaveHandle
from .steps import Steps

log = logging.getLogger("aiotensor")


class Incremental:
    """What a store remembers from one save to the next to write only what changed: each stored
    tensor's memory and version counter as of the last save (the hint), and the candidate shards of
    the last committed step (their headers, digests and crc32c; from its manifest after a restart)."""

    def __init__(self) -> None:
        self.versions: dict[str, tuple[int, int]] = {}
        self.previous: list[tuple[tuple[str, ...], Previous]] = []
        # earlier files known to hold their digest's bytes: their marks, and that digest (a path may
        # hold another file later: a step deleted and saved again, helper-44)
        self.known: dict[str, tuple[tuple[Any, ...], str]] = {}

    def forget(self) -> None:
        """Drop what was remembered (the store closes; a reopened one reads the newest manifest)."""
        self.versions = {}
        self.previous = []
        self.known = {}

    def stable(self, keys: list[str], marks: list[Any]) -> list[bool]:
        """Is each tensor's memory and version counter (its :func:`~aiotensor._io.plan.tensor_marks`)
        what the last save planned (C loops)?"""
        return gil.listed(map(eq, map(self.versions.get, keys, repeat(_UNSEEN)), marks))

    def planned(self, plan: SavePlan) -> None:
        self.versions = plan.marks

    def committed(self, m: mf.Manifest, folder: str, wrote: Engine | None = None) -> list[tuple[tuple[str, ...], Previous]]:
        """The step ``m`` of ``folder`` is the newest: its candidate shards are the next save's
        (returned too). ``wrote``: this store just wrote (or linked, once checked) its files
        through that engine, so that they hold their digests' bytes as they are now; else each is
        read whole before its first link (:meth:`intact`). Made apart, then put in place at once:
        another thread may remember a step meanwhile (a delete's, helper-45)."""
        known = {}
        if wrote is not None:
            # (an object store's marks are entity tags, which any write changes: no tick to mind)
            settled = _settled(wrote, folder) if wrote.renames else None
            checked = {mark for mark, _ in self.known.values()}  # the files its links were checked as
            for file, digest in m.digests.items():
                path = os.path.join(folder, file)
                try:
                    mark = _root.stat_key(wrote.stat(path))
                except OSError:  # (retired meanwhile, a request that failed): read whole before its first link
                    continue
                # a link is known only as its check left it: an earlier file is older than any
                # manifest, and one read whole in the tick of its last write is not (helper-48)
                if settled is None or ((mark in checked) if file in m.reused else (mark[3] < settled)):
                    known[path] = (mark, digest)
        by_shard: dict[str, list[mf.Entry]] = {}
        for e in m.entries.values():
            by_shard.setdefault(e.shard, []).append(e)
        previous = []
        for file, digest in m.digests.items():
            entries = sorted(by_shard.get(file, []), key=lambda e: e.spec.offset)
            header = shard_header([e.spec for e in entries])
            crcs = {e.spec.key: e.crc32c for e in entries}
            prev = Previous(os.path.join(folder, file), header, digest, crcs, m.step)
            previous.append((tuple(e.spec.key for e in entries), prev))
        self.known, self.previous = known, previous
        return previous

    def intact(self, engine: Engine, earlier: Previous) -> tuple[Any, ...] | None:
        """The stat mark of ``earlier``'s file where it still holds the bytes its digest names
        (unchanged since it was known to, or read whole now); else None: changed, gone (a step
        deleted, helper-45), or unreadable (EIO: a bad sector, a request that failed): the shard
        is written."""
        now = _now_ns()  # (before the stat: a write during the read lands at or after it)
        try:
            mark = _root.stat_key(engine.stat(earlier.path))
            if self.known.get(earlier.path) == (mark, earlier.digest):
                return mark
            if _digest_of(engine, earlier.path) != earlier.digest:
                return None
        except OSError as e:
            log.info("%s could not be checked (%s): the shard is written", earlier.path, e)
            return None
        if not engine.renames or now - mark[3] > _tick_ns(mark[3]):
            self.known[earlier.path] = (mark, earlier.digest)
        return mark


# A stat mark tells a file unchanged only where a write after it would change it. A file system
# stamps a write with its clock's tick (a second on ext4 of 128-byte inodes, two on FAT): a stray
# write in the tick of the file's last write left its mark as it was, and the damaged shard was
# linked (helper-46, on ext4 of 1 s stamps). So a file is known by its mark only where it was last
# written in an earlier tick: before its step's manifest was (each stamped by the same clock), or
# more than a tick before its whole read began (by this machine's clock: a file server whose clock
# lags more than that is not covered).


def _tick_ns(mtime_ns: int) -> int:
    """The longest tick a file system whose clock stamped ``mtime_ns`` may have: two seconds where
    that is whole seconds (FAT's, or ext4 of 128-byte inodes; one file in 250 of a finer clock too,
    by chance), else 20 ms (a kernel's clock ticks every 1-10 ms; exFAT stamps 10 ms)."""
    return 2 * 10**9 if mtime_ns % 10**9 == 0 else 20 * 10**6


_now_ns = time.time_ns


def _settled(engine: Engine, folder: str) -> float:
    """Files of the step ``folder`` last written before this are known by their marks: the tick its
    manifest was written in (none where that cannot be told)."""
    try:
        return engine.stat(os.path.join(folder, _root.MANIFEST)).st_mtime_ns
    except OSError:
        return -math.inf


def _same(engine: Engine, path: str, mark: tuple[Any, ...]) -> bool:
    """Is ``path`` (a hard link just made) the file whose stat mark is ``mark``?"""
    try:
        return _root.stat_key(engine.stat(path)) == mark
    except OSError:
        return False


def _digest_of(engine: Engine, path: str) -> str:
    """The blake3 digest of the file ``path``, read a piece at a time."""
    fd = engine.open_read(path)
    try:
        size, digest = engine.size(fd), blake3.blake3()
        buf = memoryview(bytearray(min(size, _PIECE) or 1))
        at = 0
        while at < size:
            n = engine.pread(fd, buf[: min(_PIECE, size - at)], at)
            if n <= 0:
                break
            digest.update(buf[:n])
            at += n
        return digest.hexdigest()
    finally:
        engine.close(fd)


_PIECE = 8 << 20


_UNSEEN = object()  # (a key the last save did not see: never equal to a mark)


def versions(state: Any) -> tuple[list[torch.Tensor], list[int]]:
    """Each tensor of ``state`` found in its dicts, lists and tuples, and its version counter as
    ``save()`` is called (PyTorch moves it with most in-place changes: a ``fill_``, an unfused
    optimizer's step); :func:`changed` compares them once the tensors are copied out. Runs on the
    caller's thread, so its cost is bounded: a level of the tree at a time, in C loops, the values
    of a level sorted by their types (``isinstance`` against a tensor is slow: a list of a million
    sample indices took 230-310 ms, helper-58); a dict, list or tuple of more than :data:`_MOST`
    values whose first ones are neither tensors nor containers is not looked into (a sampler's
    indices, per-sample losses: a tensor further on is not watched), nor anything below
    :data:`~aiotensor.formats.tree.MAX_DEPTH` levels (a state that holds itself: the save's own
    walk names it). Inference tensors have no counter (skipped). 20,000 tensors ~2.5 ms flat, ~5 ms
    in 10,000 dicts; a sampler's 10 million indices and a million losses ~0.2 ms."""
    found: list[torch.Tensor] = [state] if isinstance(state, torch.Tensor) else []
    level = [] if found else [state]  # the containers of one depth
    for _ in range(MAX_DEPTH + 1):
        if not level:
            break
        dicts = [x.values() for x in level if isinstance(x, dict)]
        seqs = [x for x in level if isinstance(x, (list, tuple))]
        values = list(chain.from_iterable(x for x in chain(dicts, seqs) if len(x) <= _MOST or _holds(x)))
        types = set(map(type, values))
        tensors = {t for t in types if issubclass(t, torch.Tensor)}
        if tensors and len(tensors) == len(types):  # (a flat state_dict: no test of each value)
            found += values
            break
        if tensors:
            found += [v for v in values if type(v) in tensors]
        inner = {t for t in types if issubclass(t, (dict, list, tuple))}
        level = [v for v in values if type(v) in inner] if inner else []
    try:
        return found, list(map(_VERSION, found))
    except RuntimeError:  # an inference tensor among them: "Inference tensors do not track version counter"
        found = [t for t in found if not t.is_inference()]
        return found, list(map(_VERSION, found))


def _holds(values: Any) -> bool:
    """Does a big container's first :data:`_LOOK` values hold a tensor or a container (else it is
    taken for a table of numbers: a sampler's indices, per-sample losses, not looked into)?"""
    return any(issubclass(t, (torch.Tensor, dict, list, tuple)) for t in set(map(type, islice(values, _LOOK))))


_MOST, _LOOK = 4096, 256


def changed(marks: tuple[list[torch.Tensor], list[int]]) -> list[torch.Tensor]:
    """The tensors of ``marks`` (:func:`versions`) changed in place since."""
    tensors, then = marks
    now = gil.listed(map(_VERSION, tensors))  # (in a worker: one C loop over 20,000 held the GIL 4 ms)
    return [] if now == then else [t for t, a, b in zip(tensors, then, now, strict=True) if a != b]


def _changed_keys(marks: tuple[list[torch.Tensor], list[int]], sources: dict[str, torch.Tensor]) -> list[str]:
    """The keys of the tensors :func:`changed` finds, each tensor once (by identity; an alias
    of another key, which ``sources`` leaves out, is named as such)."""
    moved = {id(t): t for t in changed(marks)}  # (a tensor under two keys, tied weights: once)
    if not moved:
        return []
    keys = {id(t): k for k, t in sources.items()}
    return [keys.get(i, "a tensor under another key") for i in moved]


_VERSION = attrgetter("_version")


async def save(
    sched: Scheduler,
    staging: StagingPool,
    steps: Steps,
    shard_bytes: int,
    h: SaveHandle,
    state: Any,
    prio: int,
    producers: dict[Any, Any],
    progress: ProgressCallback | None,
    incremental: Incremental | None = None,
    marks: tuple[list[torch.Tensor], list[int]] | None = None,
) -> None:
    """Save ``state`` as ``h.step``. Past the commit point it completes even if cancelled. With
    ``marks`` (:func:`versions`, taken by ``save()``), a tensor changed in place before it was
    copied out fails the save (:class:`~aiotensor.errors.StateChangedError`)."""
    plan: SavePlan
    sources: dict[str, torch.Tensor]
    hint: dict[str, Any] = {} if incremental is None else {"stable": incremental.stable, "previous": incremental.previous}
    plan, sources = await sched.call(
        functools.partial(plan_save, state, shard_bytes=shard_bytes, devices=sched.devices, **hint), priority=prio
    )
    if incremental is not None:
        incremental.planned(plan)
    del state
    arena = await staging.acquire(plan.arena_bytes)
    try:
        # an incremental save's candidate shards whose earlier image this arena still holds
        held, arena.images = arena.images, {}
        compare = {sh.arena_offset: sh for sh in plan.shards if sh.reuse is not None and held.get(sh.arena_offset) is sh.reuse}
        changed: set[int] = set()
        pieces, views = await stage(sched, plan, sources, arena, prio, producers, set(compare), changed)
        proven = {sh.file for off, sh in compare.items() if off not in changed}
        if marks is not None:
            moved = await sched.run_sync(_changed_keys, marks, sources)  # (not I/O: no wait for the gate)
            if moved:
                raise StateChangedError(
                    f"step {h.step}: {len(moved)} tensor(s) changed in place after save() and before the save had "
                    f"copied them all out ({', '.join(map(repr, moved[:3]))}{'...' if len(moved) > 3 else ''}): what was "
                    "copied may be half old, half new (a view shares its counter with its base: a change anywhere in "
                    "the base counts), so nothing was committed. Change the state only once `await handle.staged` "
                    "returns (Snapshotter: call before_update() first); the event loop must run meanwhile (a "
                    "notebook cell or a loop that never awaits blocks it: the save copies nothing until it yields)"
                )
        h.set_staged(plan.nbytes)  # the caller's tensors are free to change from here on
        await sched.discard(sources, *views)  # our references to them: freed in a thread
        with reporting(sum(round_up(sh.layout.file_size) for sh in plan.shards), progress):
            remembered = await _write(sched, steps, h, plan, arena, pieces, prio, incremental, proven)
        if remembered:  # what this arena now holds, for the next save (this step's, whatever was remembered since)
            by_file = {os.path.basename(p.path): p for _, p in remembered}
            arena.images = {sh.arena_offset: by_file[sh.file] for sh in plan.shards if sh.file in by_file}
        # a plan and its pieces are tens of thousands of objects for a state of many tensors: freed
        # in a thread, before the arena goes back (so the next save cannot start before this one
        # has let go of everything); on failure they go where the error takes them
        big = [plan]
        del plan
        await sched.discard(pieces, big)
    finally:
        staging.release(arena)


async def _write(
    sched: Scheduler,
    steps: Steps,
    h: SaveHandle,
    plan: SavePlan,
    arena: HostBuffer,
    pieces: Any,
    prio: int,
    incremental: Incremental | None,
    proven: set[str],
) -> list[tuple[tuple[str, ...], Previous]]:
    """The shards (each a page-aligned image of the arena, written with O_DIRECT, checksummed
    meanwhile; a candidate proven equal to an earlier shard linked instead) and the manifest under
    a temporary name, then the commit; returns what ``incremental`` remembered of this step."""
    async with Publication(
        sched, steps.path(h.step), folder=True, priority=prio, fence=steps.fence if steps.writer else None
    ) as pub:
        digests, reused = await _reuse(sched, h, plan, arena, pub.tmp, prio, proven, incremental)
        # the same bytes as those files': their crc32c (tens of thousands of keys: in a thread)
        crcs, skip = await sched.call(_linked_crcs, plan, reused, priority=prio)

        async def checksum() -> None:
            crcs.update(await checksums(sched, plan, pieces, arena, prio, skip))

        def writer(sh: Any) -> Callable[[], Awaitable[None]]:
            size = sh.layout.file_size
            image = arena.view[sh.arena_offset : sh.arena_offset + round_up(size)]
            return functools.partial(write_file, sched, os.path.join(pub.tmp, sh.file), [(0, image)], prio, size=size)

        fresh = [sh for sh in plan.shards if sh.file not in reused]

        async def write() -> None:
            for sh in fresh:  # each file's pieces go in parallel
                await writer(sh)()

        # on an object store each shard is one request: several at once
        await run_concurrently(checksum, *((writer(sh) for sh in fresh) if not sched.engine.renames else (write,)))
        h.bytes_written = sum(sh.layout.file_size for sh in fresh)
        h.bytes_reused = sum(sh.layout.file_size for sh in plan.shards if sh.file in reused)
        m, data = await sched.call(_manifest, h.step, plan, crcs, digests, reused, priority=prio)  # a big tree: off the loop
        await sched.discard(crcs)
        await steps.fence()
        await write_file(sched, os.path.join(pub.tmp, _root.MANIFEST), [(0, memoryview(data))], prio)
        await steps.commit(h, pub)
    if incremental is not None:  # past the commit point: a failure here only means the next save writes every byte
        try:
            remembered: list[tuple[tuple[str, ...], Previous]] = await sched.call(
                incremental.committed, m, steps.path(h.step), sched.engine, priority=prio
            )
            return remembered
        except Exception as e:
            incremental.forget()
            log.info("%s: step %d is not remembered for incremental saves (%s)", steps.root, h.step, e)
    return []


def _linked_crcs(plan: SavePlan, reused: dict[str, int]) -> tuple[dict[str, int], frozenset[str]]:
    crcs: dict[str, int] = {}
    for sh in plan.shards:
        if sh.file in reused and sh.reuse is not None:
            crcs |= sh.reuse.crcs
    return crcs, frozenset(crcs)


def _manifest(
    step: int, plan: SavePlan, crcs: dict[str, int], digests: dict[str, str], reused: dict[str, int]
) -> tuple[mf.Manifest, bytes]:
    """The manifest of a committed step, and its bytes."""
    m = mf.Manifest(
        step,
        plan.tree,
        {sh.file: sh.layout.file_size for sh in plan.shards},
        {s.key: mf.Entry(sh.file, s, crcs[s.key]) for sh in plan.shards for s in sh.layout.tensors},
        plan.aliases,
        digests,
        reused,
        {sh.file: checksum.crc32c(sh.header) for sh in plan.shards},
    )
    return m, mf.dumps(m)


async def _reuse(
    sched: Scheduler,
    h: SaveHandle,
    plan: SavePlan,
    arena: HostBuffer,
    folder: str,
    prio: int,
    proven: set[str],
    incremental: Incremental | None,
) -> tuple[dict[str, str], dict[str, int]]:
    """The blake3 digest of every candidate shard's staged bytes, and the shards linked into
    ``folder`` from an earlier step (file -> that step) because their digests are equal, or
    because staging compared every byte with that earlier shard's image (``proven``: no digest to
    compute), once the earlier file is checked (:meth:`Incremental.intact`). An earlier file gone
    meanwhile or changed on disk, or a file system without hard links: the shard is written."""
    hashed = [sh for sh in plan.shards if sh.candidate and sh.file not in proven]
    got = await sched.map(
        lambda sh: blake3.blake3(arena.view[sh.arena_offset : sh.arena_offset + sh.layout.file_size]).hexdigest(),
        hashed,
        nbytes=lambda sh: sh.layout.file_size,
        priority=prio,
        batch_bytes=1,  # a shard per call: several at once
        budget=False,
    )
    digests = {sh.file: d for sh, d in zip(hashed, got, strict=True)}
    digests |= {sh.file: sh.reuse.digest for sh in plan.shards if sh.file in proven and sh.reuse is not None}
    reused: dict[str, int] = {}

    def link(sh: Any, earlier: Previous) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            mark = None
            if incremental is not None:
                mark = await sched.call(incremental.intact, sched.engine, earlier, priority=prio)
                if mark is None:
                    if not await sched.call(sched.engine.exists, earlier.path, priority=prio):  # (retention retired the
                        log.info("%s is gone (its step retired): %s is written", earlier.path, sh.file)  # step: helper-54)
                        return
                    msg = (f"{earlier.path} no longer holds what step {earlier.step}'s manifest said (replaced, or "
                           f"damaged on disk): {sh.file} is written, not linked to it")  # fmt: skip
                    h.warn(msg)
                    log.warning("%s", msg)
                    return
            new = os.path.join(folder, sh.file)
            try:
                await sched.call(sched.engine.link, earlier.path, new, priority=prio)
            except OSError as e:
                log.info("writing %s instead of linking %s (%s)", sh.file, earlier.path, e)
                return
            if mark is not None and sched.engine.renames and not await sched.call(_same, sched.engine, new, mark, priority=prio):
                # another file took the path between its check and the link (the step deleted and
                # saved again, helper-45): the link is undone, the shard written. (A hard link only:
                # an object store's link is a copy, another object with a mark of its own.)
                await sched.call(sched.engine.remove_file, new, priority=prio)
                log.info("%s changed while it was linked: %s is written", earlier.path, sh.file)
                return
            reused[sh.file] = earlier.step

        return run

    # several at once: on an object store each link is a server-side copy of a whole shard
    same = [(sh, sh.reuse) for sh in plan.shards if sh.candidate and sh.reuse is not None and digests[sh.file] == sh.reuse.digest]
    await run_concurrently(*(link(sh, earlier) for sh, earlier in same))
    return digests, reused


async def reserve(sched: Scheduler, staging: StagingPool, like: Any, shard_bytes: int) -> None:
    """Map and touch a staging arena for a state ``like`` the ones to come (or its size in bytes),
    kept in the pool for the first save; a failure only means that save maps its own. Saves that
    start meanwhile wait for it rather than map one of their own beside it."""
    staging.reserving += 1
    try:
        if isinstance(like, int):
            nbytes = like + (1 << 20)  # room for the shard headers
        else:
            plan, _ = await sched.call(
                lambda: plan_save(like, shard_bytes=shard_bytes, devices=sched.devices), priority=Priority.BACKGROUND
            )
            nbytes = plan.arena_bytes
        staging.release(await staging.acquire(nbytes, reservation=True))
    except Exception as e:
        log.warning("could not reserve staging memory (%s)", e)
    finally:
        staging.reserving -= 1
        staging.changed()


__all__ = ["reserve", "save"]
