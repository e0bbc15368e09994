"""Tiered saves: every step a store commits on its local disk is copied, in the background, to a
second store (``mirror=``: an object store), with that store's own commit protocol, writer lease
and retention. The trainer is never held by the network: a save's handle resolves at the local
commit; ``handle.mirrored`` resolves once the step's manifest is in the mirror.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable
from typing import Any

import anyio

from .. import root as _root
from .._runtime.scheduler import Priority, Scheduler, run_concurrently
from ..commit import MANIFEST, Publication
from ..engines import Engine
from .handle import SaveHandle
from .steps import Steps

log = logging.getLogger("aiotensor")


class Mirror:
    """The mirror of a local store (the steps of the mirror's store, on its scheduler): uploads
    committed steps one at a time, in commit order."""

    def __init__(self, sched: Scheduler, steps: Steps) -> None:
        self.sched, self.steps = sched, steps
        self.turn = anyio.Lock()  # one upload at a time, in the order the steps were committed
        self.last: dict[str, str] = {}  # the newest mirrored step's shards, by blake3 digest: digest -> path
        self.uploaded = self.copied = 0  # bytes put, and bytes the server copied from an earlier step

    async def upload(self, local: Engine, folder: str, step: int, begin: Callable[[], bool] = lambda: True) -> None:
        """Copy the committed local step ``folder`` to the mirror as ``step``: its shards (several
        PUTs at once; a shard whose digest the newest mirrored step has, from an incremental save,
        is copied by the server from there instead), then, once the mirror's lease is renewed, its
        manifest (the commit point). ``begin()``, called once its turn comes: False drops it.

        Raises:
            OSError, StoreLockedError: the upload failed; nothing of it is left in the mirror.
        """
        async with self.turn:
            if not begin() or step in self.steps.committed:  # (its turn came: ``begin()`` says whether it still goes)
                return
            sched = self.sched
            m = await sched.call(_root.read_manifest, local, folder, step, priority=Priority.BACKGROUND)
            h = SaveHandle(step, sum(e.spec.nbytes for e in m.entries.values()))
            async with Publication(
                sched, self.steps.path(step), folder=True, priority=Priority.BACKGROUND, fence=self.steps.fence
            ) as pub:

                def put(name: str) -> Any:
                    src, dst = os.path.join(folder, name), os.path.join(pub.tmp, name)
                    earlier = self.last.get(m.digests.get(name, ""))

                    async def run() -> None:
                        if earlier is not None:
                            try:
                                await sched.call(sched.engine.link, earlier, dst, priority=Priority.BACKGROUND)
                                self.copied += m.shards[name]
                                return
                            except OSError as e:  # retired meanwhile: put it
                                log.info("putting %s instead of copying %s (%s)", dst, earlier, e)
                        await sched.call(put_file, sched.engine, src, dst, priority=Priority.BACKGROUND)
                        self.uploaded += m.shards.get(name, 0)

                    return run

                await run_concurrently(*(put(name) for name in m.shards))
                await self.steps.fence()
                await put(MANIFEST)()
                await self.steps.commit(h, pub)
            self.last = {d: os.path.join(self.steps.path(step), f) for f, d in m.digests.items()}
            for w in h.warnings:
                log.warning("%s", w)


def put_file(engine: Engine, src: str, dst: str) -> None:
    """Put the local file ``src`` as the object ``dst``, from its pages (mapped, not copied)."""
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        if not size:
            engine.put(dst, [memoryview(b"")])
            return
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                engine.put(dst, [view])
            finally:
                view.release()
    finally:
        os.close(fd)


__all__ = ["Mirror", "put_file"]
