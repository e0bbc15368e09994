"""A store's save pipeline: plan the state (in a worker), stage it into an arena (the caller's
tensors free from then on), then checksum and write the shards and the manifest under a temporary
name and commit (:class:`~aiotensor.commit.Publication`, then :meth:`Steps.commit`)."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from .. import root as _root
from .._io.plan import SavePlan, manifest_bytes, plan_save
from .._io.stage import checksums, stage
from .._io.write import write_file
from .._runtime.buffers import HostBuffer, StagingPool, round_up
from .._runtime.scheduler import Priority, ProgressCallback, Scheduler, reporting, run_concurrently
from ..commit import Publication
from .handle import SaveHandle
from .steps import Steps

log = logging.getLogger("aiotensor")


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
) -> None:
    """Save ``state`` as ``h.step``. Past the commit point it completes even if cancelled."""
    plan: SavePlan
    sources: dict[str, torch.Tensor]
    plan, sources = await sched.call(
        functools.partial(plan_save, state, shard_bytes=shard_bytes, devices=sched.devices), priority=prio
    )
    del state
    arena = await staging.acquire(plan.arena_bytes)
    try:
        pieces, views = await stage(sched, plan, sources, arena, prio, producers)
        h.set_staged(plan.nbytes)  # the caller's tensors are free to change from here on
        await sched.discard(sources, *views)  # our references to them: freed in a thread
        with reporting(sum(round_up(sh.layout.file_size) for sh in plan.shards), progress):
            await _write(sched, steps, h, plan, arena, pieces, prio)
        # a plan and its pieces are tens of thousands of objects for a state of many tensors: freed
        # in a thread, before the arena goes back (so the next save cannot start before this one
        # has let go of everything); on failure they go where the error takes them
        big = [plan]
        del plan
        await sched.discard(pieces, big)
    finally:
        staging.release(arena)


async def _write(
    sched: Scheduler, steps: Steps, h: SaveHandle, plan: SavePlan, arena: HostBuffer, pieces: Any, prio: int
) -> None:
    """The shards (each a page-aligned image of the arena, written with O_DIRECT, checksummed
    meanwhile) and the manifest under a temporary name, then the commit."""
    async with Publication(sched, steps.path(h.step), folder=True, priority=prio) as pub:
        crcs: dict[str, int] = {}

        async def checksum() -> None:
            crcs.update(await checksums(sched, plan, pieces, arena, prio))

        def writer(sh: Any) -> Callable[[], Awaitable[None]]:
            size = sh.layout.file_size
            image = arena.view[sh.arena_offset : sh.arena_offset + round_up(size)]
            return functools.partial(write_file, sched, os.path.join(pub.tmp, sh.file), [(0, image)], prio, size=size)

        async def write() -> None:
            for sh in plan.shards:  # each file's pieces go in parallel
                await writer(sh)()

        # on an object store each shard is one request: several at once
        await run_concurrently(checksum, *((writer(sh) for sh in plan.shards) if not sched.engine.renames else (write,)))
        data = await sched.call(manifest_bytes, h.step, plan, crcs, priority=prio)  # a big tree: off the loop
        await sched.discard(crcs)
        await steps.fence()
        await write_file(sched, os.path.join(pub.tmp, _root.MANIFEST), [(0, memoryview(data))], prio)
        await steps.commit(h, pub.publish)


async def reserve(sched: Scheduler, staging: StagingPool, like: Any, shard_bytes: int) -> None:
    """Map and touch a staging arena for a state ``like`` the ones to come (or its size in bytes),
    kept in the pool for the first save; a failure only means that save maps its own."""
    try:
        if isinstance(like, int):
            nbytes = like + (1 << 20)  # room for the shard headers
        else:
            plan, _ = await sched.call(
                lambda: plan_save(like, shard_bytes=shard_bytes, devices=sched.devices), priority=Priority.BACKGROUND
            )
            nbytes = plan.arena_bytes
        staging.release(await staging.acquire(nbytes))
    except Exception as e:
        log.warning("could not reserve staging memory (%s)", e)


__all__ = ["reserve", "save"]
