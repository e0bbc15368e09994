"""The committed steps of a root as one store sees them, and the only code that changes which steps
exist: a commit (the publication, then ``latest``, then retention), delete and rollback (each a
retirement, :func:`aiotensor.commit.retire`), and the repairs a writer makes when it opens.

After the commit point nothing fails a save: trouble with ``latest`` or retention is logged and
listed in the handle's warnings; ``latest`` is repaired by the next save or open, retention by
the next commit.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import anyio

from .. import commit
from .. import root as _root
from .._runtime import threads
from .._runtime.scheduler import Priority, Scheduler
from ..commit import Publication
from ..engines.objects import ObjectLease
from ..errors import CheckpointNotFoundError, StoreLockedError, annotate_oserror
from ..root import LATEST, step_dir_name
from .handle import SaveHandle

log = logging.getLogger("aiotensor")
Start = Callable[[Callable[[], Awaitable[None]]], None]  # runs work in the background, awaited on close


async def call(sched: Scheduler, fn: Callable[..., Any], *args: Any, what: str, priority: int = Priority.SAVE) -> Any:
    """``fn(*args)`` in a worker thread; an OSError names ``what`` the caller was doing."""
    try:
        return await sched.call(fn, *args, priority=priority)
    except OSError as e:
        raise annotate_oserror(e, what) from e


# what retiring a step fails with for as long as the root is as it is: a folder of an overlay's
# lower layer (a container image's), a read-only file system, an immutable folder
_LASTING = frozenset({errno.EXDEV, errno.EROFS, errno.EPERM, errno.EACCES})


class Steps:
    """A root's committed steps, for one store.

    Args:
        writer: this store writes the root (moves ``latest``, retires, removes leftovers); a
            reader, or a distributed store's rank other than 0, only keeps its view in step.
        start: runs background work (the deletion of retired steps) that ``close`` waits for.
    """

    def __init__(
        self,
        sched: Scheduler,
        root: str,
        *,
        keep_last: int | None,
        writer: bool,
        start: Start,
        lock: _root.WriterLock | ObjectLease | None = None,
    ) -> None:
        self.sched, self.root, self.keep_last, self.writer, self.writer_lock = sched, root, keep_last, writer, lock
        self._start = start
        self.committed: set[int] = set()
        self.ignored: dict[str, str] = {}  # names in the root that are not committed steps, and why
        self.errors: dict[str, Exception] = {}  # of those, the ones whose manifest failed to load
        self.readers: Counter[int] = Counter()  # loads in flight, by step: never retired meanwhile
        self.unremoved: set[str] = set()  # retired steps' folders whose deletion failed (tried again)
        self.lock = anyio.Lock()  # one commit (or listing) at a time, so `latest` only moves forward
        self._known: dict[str, Any] = {}  # manifests already checked, by folder name
        self._latest_on_disk: str | None = None
        self.stuck: set[int] = set()  # steps retiring failed for good: passed over until reopened or saved anew

    def check(self, step: int | None, *, exists: bool = False) -> int:
        """``step`` (None: the newest), if it is committed; else why not (for a load: what is
        wrong with a folder that is there but broken)."""
        if step is None:
            step = self.newest()
            if step is None:
                seen = "" if self.writer else " as this store last read it (refresh() reads it again)"
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.root}{seen}")
        check_step(step)
        if step in self.committed:
            return step
        damaged = None if exists else self.errors.get(step_dir_name(step))
        if damaged is not None:
            raise damaged
        why = self.ignored.get(step_dir_name(step))
        raise CheckpointNotFoundError(
            f"no committed checkpoint for step {step} in {self.root} "
            + (f"({step_dir_name(step)} is {why})" if why else f"(committed: {self.sorted()[-10:]})")
        )

    def sorted(self) -> list[int]:
        return sorted(self.committed)

    def newest(self) -> int | None:
        return max(self.committed, default=None)

    def path(self, step: int) -> str:
        return os.path.join(self.root, step_dir_name(step))

    async def _call(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        return await call(self.sched, fn, *args, what=what)

    async def scan(self) -> _root.Listing:
        """Re-list the root (a manifest is checked again only if its file changed)."""
        async with self.lock:  # a commit landing during the listing must not be lost
            known = dict(self._known)
            listing: _root.Listing = await self._call(
                _root.scan, self.sched.engine, self.root, known, what=f"listing {self.root}"
            )
            self._known = known
            self.committed = set(listing.committed)
            self._latest_on_disk = listing.latest
            for name, why in listing.ignored.items():
                if self.ignored.get(name) != why:
                    log.warning("%s: ignoring %s: %s", self.root, name, why)
            self.ignored, self.errors = listing.ignored, listing.errors
        return listing

    async def repair(self, listing: _root.Listing) -> None:
        """A writer that just took the lock: remove the leftovers of interrupted saves (the lock
        proves the save that made them is gone), then bring ``latest`` up to date."""
        for name in listing.leftovers:
            await self._try(functools.partial(self._remove, name), None, f"removing {name}, left by an interrupted save")
        await self._try(self.sync_latest, None, "repairing `latest`")

    async def _remove(self, name: str) -> None:
        path = os.path.join(self.root, name)
        await self._call(self.sched.engine.remove_tree, path, what=f"removing {path}")

    def read(self, step: int, n: int) -> None:
        """One load (or upload) of ``step`` more (``n`` 1) or fewer (-1): a step no longer read leaves
        no entry (a server following a trainer kept one for every step it ever loaded: helper-54)."""
        left = self.readers[step] + n
        if left > 0:
            self.readers[step] = left
        else:
            self.readers.pop(step, None)

    async def fence(self) -> None:
        """Just before a save's commit record is written: the writer's lock or lease is still its
        own (an object store's lease is renewed now; StoreLockedError if it was taken over, or
        the lock file is no longer the one this store locked)."""
        if self.writer_lock is not None:
            await self._call(self.writer_lock.check, what=f"renewing the writer lease of {self.root}")

    async def commit(self, h: SaveHandle, pub: Publication | None) -> None:
        """``pub``'s publication (the commit point; None where it happened elsewhere: a distributed
        save's rank 0, inside DCP), then ``latest`` and retention, run to their end whatever cancels
        the caller (:func:`~aiotensor._runtime.threads.finish`). Where a cancellation cuts in once
        the publication ran (the event loop ending: its tasks are all cancelled), the step is
        recorded as committed all the same (helper-51: it was, and the handle said it was not)."""
        await threads.finish(functools.partial(self._commit, h, pub))

    async def _commit(self, h: SaveHandle, pub: Publication | None) -> None:
        async with self.lock:
            try:
                if pub is not None:
                    await pub.publish()
            except BaseException:
                if pub is not None and pub.published:
                    self._committed(h)  # (latest and retention: the next open repairs them)
                raise
            self._committed(h)
            if not self.writer:  # rank 0 retires: the other ranks drop those steps from their view
                if self.keep_last is not None:
                    self.committed.difference_update(self.sorted()[: -self.keep_last])
                return
            log.info("%s: committed step %d (%d bytes)", self.root, h.step, h.nbytes)
            await self._try(lambda: self.sync_latest(h), h, "updating `latest`")
            await self._retain(h)

    def _committed(self, h: SaveHandle) -> None:
        h.set_committed()
        self.committed.add(h.step)
        self.stuck.discard(h.step)  # (a step saved again: its folder is a new one)

    async def delete(self, steps: list[int]) -> None:
        """Move ``latest`` to the newest step that stays, retire ``steps`` (those still committed),
        then update ``latest`` (if the first move failed, or a step could not be retired: it names
        the newest step there is, helper-48). Once started it ends, whatever cancels the caller
        (:func:`~aiotensor._runtime.threads.finish`).

        Raises:
            StoreLockedError: this store is no longer the root's writer (:meth:`fence`).
            OSError: a step could not be retired (the others before it were)."""
        await threads.finish(functools.partial(self._delete, steps))

    async def _delete(self, steps: list[int]) -> None:
        async with self.lock:
            await self.fence()
            await self._try(lambda: self.sync_latest(None, steps), None, "updating `latest`")
            try:
                for s in steps:
                    if s in self.committed:
                        await self._retire(s)
            finally:
                await self._try(self.sync_latest, None, "updating `latest`")

    async def _try(self, fn: Callable[[], Awaitable[Any]], h: SaveHandle | None, what: str) -> None:
        """Housekeeping that must not fail what it follows: a failure is logged and listed in ``h``'s
        warnings; the next save or open repairs it."""
        try:
            await fn()
        except Exception as e:
            _failed(self.root, what, e, h, "and the next save or open repairs this")

    async def sync_latest(self, h: SaveHandle | None = None, leaving: Iterable[int] = ()) -> None:
        """Make ``latest`` name the newest committed step (or remove it when none is left). Something
        else of that name (a folder, a link, a file of other contents) is the user's: it is left
        alone, and reported in ``h``'s warnings and :attr:`ignored`. ``leaving``: steps about to be
        deleted, passed over."""
        newest = max(self.committed.difference(leaving), default=None)
        want = None if newest is None else step_dir_name(newest)
        if want == self._latest_on_disk:
            return
        path = os.path.join(self.root, LATEST)
        why = await self._call(_root.point_latest, self.sched.engine, self.root, want, what=f"updating {path}")
        if not why:
            self._latest_on_disk = want
            return
        msg = f"{path} is {why} (the newest step is {want})"
        if h is not None:
            h.warn(msg)
        if self.ignored.get(LATEST) != why:
            log.warning("%s", msg)
            self.ignored[LATEST] = why

    async def _retain(self, h: SaveHandle) -> None:
        """Retire steps beyond ``keep_last`` (never one being loaded by this store, nor the one
        ``latest`` names: retried after the next commit). A step that cannot be retired while the
        root is as it is (:data:`_LASTING`: a folder of an overlay's lower layer, a container
        image's, cannot be renamed; nor an immutable one) is left, said once in ``h``'s warnings,
        and passed over until the store is opened again or saves that step anew; one that failed
        otherwise (EIO) is tried again after the next commit. The others are retired as usual
        (the first such step stopped retention, and the root grew without bound: helper-46)."""
        for doomed in list(self.unremoved):
            self._delete_retired(doomed)
        if self.keep_last is None:
            return
        for step in self.sorted()[: -self.keep_last]:
            # nor the one `latest` still names (moving it failed: a full disk, say), so that it
            # never names a step that is gone
            if self.readers[step] or step_dir_name(step) == self._latest_on_disk or step in self.stuck:
                continue
            try:
                await self._retire(step)
            except Exception as e:
                stays = step in self.committed  # (else it was renamed away: what followed failed)
                lasting = stays and isinstance(e, OSError) and e.errno in _LASTING
                if lasting:  # (a passing failure is tried again at the next commit, as before)
                    self.stuck.add(step)
                then = (
                    ("left until the store is opened again" if lasting else "tried again after the next commit")
                    if stays
                    else "retired (the next save or open repairs the rest)"
                )
                _failed(self.root, f"retiring step {step}", e, h, f"step {step} is {then}, and the others are retired as usual")

    async def _retire(self, step: int) -> None:
        """Retire a step durably (:func:`aiotensor.commit.retire`), then delete its files in the
        background (a crash first leaves a leftover the next writer removes)."""
        eng, path = self.sched.engine, self.path(step)
        self.committed.discard(step)  # gone from this store's view once renamed, even if its fsync fails
        try:
            doomed = await self._call(commit.retire, eng, path, what=f"retiring step {step}")
        except BaseException as e:
            if await self._call(eng.exists, path, what=f"checking {path}"):
                self.committed.add(step)  # the rename did not run: still committed
            if isinstance(e, OSError) and e.errno == errno.EXDEV:  # (overlayfs, without redirect_dir)
                raise OSError(e.errno, f"{e.strerror} (a folder of an overlay's lower layer, a container image's, "
                              "cannot be renamed: the step stays)", e.filename) from e  # fmt: skip
            raise
        log.info("%s: retired step %d", self.root, step)
        self._delete_retired(doomed)

    def _delete_retired(self, doomed: str) -> None:
        """Delete a retired step's files in the background; where that fails, it is tried again
        after the next commit (a passing EIO left the folder until the store was reopened, 2.3 GB
        for a 42 MB store in a day's faults: helper-54)."""
        eng = self.sched.engine

        async def remove() -> None:
            with anyio.CancelScope(shield=True):  # a store closed with cancel=True still deletes them
                try:
                    await self.sched.call(eng.remove_tree, doomed, priority=Priority.BACKGROUND)
                    self.unremoved.discard(doomed)
                except FileNotFoundError:  # (gone: a retry that overlapped another)
                    self.unremoved.discard(doomed)
                except OSError as e:
                    if doomed not in self.unremoved:
                        log.warning("%s: could not delete the retired %s (%s); tried again after the next commit",
                                    self.root, doomed, e)  # fmt: skip
                    self.unremoved.add(doomed)

        self._start(remove)


def _failed(root: str, what: str, e: Exception, h: SaveHandle | None, then: str) -> None:
    """Housekeeping after a commit failed: logged, and listed in ``h``'s warnings."""
    msg = f"{root}: {what} failed ({e}); the checkpoint is committed, {then}"
    if h is not None:
        h.warn(msg)
    log.warning("%s", msg)


async def _try_lock(sched: Scheduler, lock: _root.WriterLock | ObjectLease, root: str) -> bool:
    """One try at ``root``'s writer lock; a file system that refuses the lock file's writes (a
    read-only mount: helper-60 got a bare EROFS) says to open the store read-only."""
    try:
        return bool(await call(sched, lock.try_acquire, what=f"locking {root}"))
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        hint = "a store that saves writes its lock file there: open it with readonly=True to read it"
        raise type(e)(e.errno, f"{e.strerror} ({hint})", e.filename) from None


async def take_lock(sched: Scheduler, lock: _root.WriterLock | ObjectLease, root: str, wait: float | None) -> None:
    """Take ``root``'s writer lock, waiting up to ``wait`` seconds (None: for ever) for the writer
    that holds it.

    Raises:
        StoreLockedError: naming the root and the holder's pid.
    """
    deadline = None if wait is None else anyio.current_time() + wait
    while not await _try_lock(sched, lock, root):
        if deadline is not None and anyio.current_time() >= deadline:
            pid = await call(sched, lock.holder, what=f"reading {lock.path}")
            here = pid == str(os.getpid())
            who = "in this process" if here else (f"process {pid}" if pid else "another process")
            how = (  # (helper-55: a notebook cell run again while Out[n], a Snapshotter or a handle keeps the first)
                "Close that store first (`await store.close()`; a store kept by a variable, a notebook's Out[n], a "
                "Snapshotter or a save handle stays open until it is closed), or open this one with readonly=True to read"
                if here
                else "Open it with readonly=True to read it, or pass lock_timeout= to wait"
                if not wait
                else f"Open it with readonly=True to read it; lock_timeout={wait:g} s was not long enough"
            )
            raise StoreLockedError(
                f"{root} is being written by another store ({who}): one writer per folder. {how}"
                + (
                    f" (in a bucket a writer that died keeps its lease until it expires, {lock.ttl:.0f} s after its "
                    f"last renewal: lock_timeout={lock.ttl:.0f} waits for that)"
                    if isinstance(lock, ObjectLease)
                    else ""
                )
            )
        await anyio.sleep(lock.poll_s)


def check_step(step: object) -> None:
    """A step number, or TypeError / ValueError saying what it must be."""
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}")
    if not 0 <= step < 10**12:
        raise ValueError(f"step must be in [0, 10**12), got {step}")


__all__ = ["Steps", "call", "check_step", "take_lock"]
