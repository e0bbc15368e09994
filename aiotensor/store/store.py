"""TensorStore: a folder of committed, checksummed checkpoints, saved in the background.

Layout::

    root/
      .aiotensor.lock             the writer lock (flock): one writer per root, any number of readers
      step-000000000100/          committed: manifest.json + shard-00000.safetensors ...
      step-000000000200.tmp-ab12cd34/  being written (or left by a crash): never read, removed by
                                  the next writer that takes the lock
      latest                      name of the newest committed step (for other tools)

A step folder appears under its final name only after every file in it and the folder itself are
durable, and the root is fsync'ed after the rename: that is the commit point. A crash at any moment
leaves either the old set of checkpoints or the old set plus a complete new one.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import anyio
import torch

from .. import commit
from .. import root as _root
from .._io.plan import SavePlan, manifest_bytes, plan_save
from .._io.stage import checksums, stage
from .._io.write import write_file
from .._runtime import cuda, gil, threads
from .._runtime.buffers import StagingPool, round_up
from .._runtime.scheduler import MiB, Priority, ProgressCallback, Scheduler, reporting, run_concurrently
from ..commit import Publication
from ..engines import Engine
from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    DistributedError,
    ReadOnlyStoreError,
    SaveCancelledError,
    SaveFailedError,
    StaleStepError,
    StoreClosedError,
    StoreLockedError,
    annotate_oserror,
)
from ..files import TensorInfo, tensor_info
from ..root import LATEST, step_dir_name
from .handle import SaveHandle
from .load import load_checkpoint

log = logging.getLogger("aiotensor")
_LOCK_POLL = 0.05


class TensorStore:
    """Checkpoints of nested state (state_dicts, optimizer state, Python scalars) in a folder.

    Use it as ``async with TensorStore(root) as store``: leaving the block waits for the saves in
    flight (or cancels them, when it is left by an exception). ``open()`` and ``close()`` may run
    in different tasks (fixtures, server start-up and shutdown hooks).

    Several processes, one root: one *writer* at a time holds the root's lock (``flock`` on
    ``root/.aiotensor.lock``, dropped by the kernel when the process dies, so a crash never leaves it
    held); a second writer gets :class:`~aiotensor.errors.StoreLockedError` at ``open()`` (or waits,
    with ``lock_timeout``). Any number of ``readonly=True`` stores read the same root: they never
    write, lock or clean anything (a read-only mount works) and see new commits on :meth:`refresh`.

    Args:
        root: the folder (created by a writer if missing).
        keep_last: after each commit, delete all but the newest ``keep_last`` steps (None: keep all).
            Older steps are retired (renamed away, durably) before the save's handle completes;
            their files are deleted in the background, and ``close`` waits for that.
        readonly: open for reading only (no lock, no writes, no clean-up).
        lock_timeout: seconds ``open()`` waits for another writer to let go (0: fail at once; None:
            wait for ever).
        engine: the I/O engine (default: chosen for this machine); tests pass a fault-injecting one.
        workers: worker threads for I/O and staging copies.
        chunk_bytes: the largest piece of one I/O call.
        batch_bytes: the most bytes one worker-thread call moves before it returns to the loop
            (smaller: priorities act sooner; larger: fewer loop round trips).
        nice: how many nice levels below the process the worker threads run (Linux; 0: the same
            priority). The default lets the event loop's thread (and the rest of the machine) take a
            core the moment it needs one while a save or load keeps every core copying; on an
            otherwise idle machine the copies still get all of the CPU.
        switch_interval: while a save or load runs, the interpreter's GIL switch interval is at
            most this many seconds (default 1 ms, against Python's 5 ms), so that the event loop's
            thread gets the GIL back from a worker within about that long; the previous interval
            comes back when the last save or load ends. ``None`` leaves it alone. (The cyclic
            garbage collector is paused for the same window: see the README.)
        shard_bytes: the largest shard file (a tensor is never split).
        max_staged: staging arenas, so saves that may be staged or writing at once; a further
            ``save`` waits for an arena before staging (memory stays ``max_staged`` × state size).
            Arenas stay mapped between saves (no page faults on the trainer's next save) until
            :meth:`release_memory` or ``close``.
        verify: check crc32c on load (default); ``load(verify=False)`` skips it per call.
        reserve: a state like the ones you will save (or its size in bytes): ``open()`` starts
            mapping and touching a staging arena for it in the background, so the first save's
            ``staged`` does not pay for the page faults (a save that comes sooner waits for it).
        distributed: ``True`` (the default process group) or a ``ProcessGroup``: every rank of the
            group opens the store on the same root (a shared file system) and calls ``save``,
            ``load(into=)`` and ``close`` together; see "Under a process group" below.

    Tensors sharing memory: keys that are the very same view of one storage (tied weights) are
    stored once; ``load()`` gives them back as one tensor object, and ``load(into=...)`` fills
    each target. Partly overlapping views are stored separately and come back unshared.

    Under a process group (``distributed=``, ``torch.distributed`` initialized): the group's rank 0
    is the root's writer (it takes the lock, cleans leftovers, moves ``latest`` and applies
    ``keep_last``); the other ranks write only their own files. ``save`` hands the state (DTensor,
    FSDP and ShardedTensor shards, plain tensors, non-tensor values) to
    ``torch.distributed.checkpoint``: each rank stages its shards to CPU memory (``staged``), writes
    one safetensors file with a crc32c per item, and rank 0 commits the step once, after every
    rank's file is durable. ``load(into=)`` fills each rank's sharded ``into`` through DCP, which
    reshards, so a different world size loads it. ``load()`` without ``into`` gives each rank the
    whole state. A failure on any rank fails the save on every rank (this rank's own error raised as
    itself, another rank's as :class:`~aiotensor.errors.DistributedError` naming it) and commits
    nothing. A rank that dies makes the others fail as soon as the backend notices, at the latest
    after the process group's timeout (``init_process_group(timeout=...)``). Collectives cannot be
    abandoned half-way: cancelling such a save or load waits for it to end on this rank.

    What a committed step is: a folder named exactly ``step-`` + 12 ASCII digits, a real folder
    (not a symbolic link), holding a valid manifest that names the same step. Anything else in the
    root is ignored (listed in :attr:`ignored`), never loaded and never counted by retention.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        readonly: bool = False,
        lock_timeout: float | None = 0,
        engine: Engine | None = None,
        workers: int = 4,
        chunk_bytes: int = 16 * MiB,
        batch_bytes: int = 64 * MiB,
        shard_bytes: int = 4 << 30,
        max_staged: int = 2,
        verify: bool = True,
        reserve: Any = None,
        distributed: Any = False,
        nice: int = threads.NICE,
        switch_interval: float | None = gil.SWITCH_INTERVAL,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
        if lock_timeout is not None and lock_timeout < 0:
            raise ValueError(f"lock_timeout must be >= 0 or None, got {lock_timeout}")
        self.root = os.fspath(root)
        self.keep_last = keep_last
        self.readonly = readonly
        self.lock_timeout = lock_timeout
        self.shard_bytes = shard_bytes
        self.verify = verify
        self.reserve = reserve
        self.scheduler = Scheduler(
            engine, workers=workers, chunk_bytes=chunk_bytes, batch_bytes=batch_bytes, nice=nice, switch_interval=switch_interval
        )
        cuda_ = self.scheduler.cuda
        self.staging = StagingPool(max_staged, pinning=cuda_.pinning if cuda_ is not None else None, nice=nice)
        self.ignored: dict[str, str] = {}  # names in the root that are not committed steps, and why
        self._errors: dict[str, Exception] = {}  # of those, the ones whose manifest failed to load
        if distributed is not False and readonly:
            raise ValueError("a distributed store writes: readonly=True and distributed= do not go together")
        self.distributed = distributed
        self._group: Any = None  # set by open() when distributed
        self._saver: Any = None  # its _dist.Saver
        self._collective = anyio.Lock()  # one save or load of the group's at a time, in call order
        self._lock = None if readonly else _root.WriterLock(self.root)
        self._known: dict[str, Any] = {}  # manifests already validated, by folder name
        self._committed: set[int] = set()
        self._latest_on_disk: str | None = None
        self._in_flight: dict[int, SaveHandle] = {}
        self._readers: Counter[int] = Counter()
        self._busy: set[anyio.Event] = set()  # one per save, load and background removal running
        self._open = False
        self._commit_lock: anyio.Lock | None = None
        self._unobserved: list[SaveHandle] = []

    @property
    def engine(self) -> Engine:
        return self.scheduler.engine

    @property
    def io_mode(self) -> str:
        """The I/O path in use: ``"posix"``, or ``"kvikio (gds)"`` / ``"kvikio (compat)"``... (see
        :class:`~aiotensor.KvikioEngine`) where CUDA tensors move through cuFile."""
        e = self.engine
        return f"{e.name} ({e.mode})" if e.mode else e.name

    # --- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> TensorStore:
        await self.open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close(cancel=exc is not None)

    async def open(self) -> None:
        """Open the store: a writer creates the root if needed and takes its lock, then removes the
        leftovers of interrupted saves and repairs ``latest``; everyone lists the committed steps.

        Raises:
            StoreLockedError: another writer holds the lock (after ``lock_timeout``).
            CheckpointNotFoundError: a read-only store's root does not exist.
            OSError: the root cannot be created, locked or listed (naming it).

        Cancellation: the lock, if taken, is released; the store stays closed.
        """
        if self._open:
            raise RuntimeError("store is already open")
        self._commit_lock = anyio.Lock()
        if self.distributed is not False:
            await self._open_distributed()
            return
        try:
            if self._lock is None:
                if not await self._call(os.path.isdir, self.root, what=f"opening {self.root}"):
                    raise CheckpointNotFoundError(f"{self.root} is not a folder (a read-only store never creates it)")
                await self._list()
            else:
                await self._open_writer()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._release()
            raise
        self._open = True
        if self.reserve is not None and not self.readonly:
            self._start(self._reserve)

    async def _open_writer(self) -> None:
        """Create the root, take its lock, list it, remove the leftovers of interrupted saves and
        repair ``latest``."""
        await self._call(os.makedirs, self.root, 0o777, True, what=f"creating the store folder {self.root}")
        await self._take_lock()
        for name in (await self._list()).leftovers:  # the lock proves the save that made them is gone
            await self._try(functools.partial(self._remove, name), None, f"removing {name}, left by an interrupted save")
        await self._try(self._sync_latest, None, "repairing `latest`")

    async def _open_distributed(self) -> None:
        """Rank 0 opens as the writer; every rank learns whether it could, then lists the root."""
        from . import distributed as _dist

        group, rank, _ = _dist.group_of(self.distributed)
        if rank != 0:
            self._lock = None  # only rank 0 locks, cleans and commits
        problem: BaseException | None = None
        if rank == 0:
            try:
                await self._open_writer()
            except Exception as e:
                problem = e
        try:
            mine = "" if problem is None else f"{type(problem).__name__}: {problem}"
            text = await anyio.to_thread.run_sync(_dist.share_outcome, mine, group)
            if problem is not None:
                raise problem
            if text:
                raise DistributedError(f"rank 0 could not open {self.root} as its writer: {text}")
            await self._list()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._release()
            raise
        self._group, self._saver = group, _dist.Saver(group)
        self._open = True

    async def _reserve(self) -> None:
        """Map and touch a staging arena for ``reserve`` (the pool keeps it for the first save)."""
        try:
            if isinstance(self.reserve, int):
                nbytes = self.reserve + (1 << 20)  # room for the shard headers
            else:
                plan, _ = await self.scheduler.call(
                    functools.partial(plan_save, self.reserve, shard_bytes=self.shard_bytes, devices=self.scheduler.devices),
                    priority=Priority.BACKGROUND,
                )
                nbytes = plan.arena_bytes
            self.staging.release(await self.staging.acquire(nbytes))
        except Exception as e:  # a failed reservation only means the first save maps its own arena
            log.warning("%s: could not reserve staging memory (%s)", self.root, e)

    async def _remove(self, name: str) -> None:
        path = os.path.join(self.root, name)
        await self._call(self.engine.remove_tree, path, what=f"removing {path}")

    async def _take_lock(self) -> None:
        assert self._lock is not None
        deadline = None if self.lock_timeout is None else anyio.current_time() + self.lock_timeout
        while not await self._call(self._lock.try_acquire, what=f"locking {self.root}"):
            if deadline is not None and anyio.current_time() >= deadline:
                pid = await self._call(self._lock.holder, what=f"reading {self._lock.path}")
                who = "in this process" if pid == str(os.getpid()) else (f"process {pid}" if pid else "another process")
                raise StoreLockedError(
                    f"{self.root} is being written by another store ({who}): "
                    "one writer per folder. Open it with readonly=True to read it, or pass lock_timeout= to wait"
                )
            await anyio.sleep(_LOCK_POLL)

    async def close(self, *, cancel: bool = False) -> None:
        """Wait for the saves and loads in flight (cancel the saves with ``cancel=True``), then free
        staging memory and release the lock.

        Raises:
            SaveFailedError: a save failed and its handle was never awaited.

        Cancellation: cancelling ``close`` cancels the saves in flight; it returns once they stopped.
        """
        if not self._open:
            return
        self._open = False  # no new saves or loads from here on
        try:
            if cancel:
                self._cancel_saves()
            try:
                while self._busy:
                    await next(iter(self._busy)).wait()
            except BaseException:
                self._cancel_saves()
                with anyio.CancelScope(shield=True):
                    while self._busy:
                        await next(iter(self._busy)).wait()
                raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._release()
        self._raise_unobserved()

    def _cancel_saves(self) -> None:
        for h in list(self._in_flight.values()):
            h.cancel()

    async def _release(self) -> None:
        """Unmap staging memory and bounce slots and drop the lock (in a thread: unmapping takes a while)."""

        def release() -> None:
            self.staging.close()
            self.scheduler.close()
            if self._saver is not None:
                self._saver.close()
            if self._lock is not None:
                self._lock.release()

        await anyio.to_thread.run_sync(release)

    async def release_memory(self) -> int:
        """Unmap the staging arenas no save is using; returns the bytes freed. The next save maps
        (and page-faults) new ones, so its ``staged`` takes longer. Runs in a worker thread.

        Cancellation: the unmapping finishes in its thread.
        """
        before = self.staging.mapped_bytes
        await anyio.to_thread.run_sync(self.staging.close)
        return before - self.staging.mapped_bytes

    def _raise_unobserved(self) -> None:
        failed = [h for h in self._unobserved if not h.observed]
        self._unobserved.clear()
        if failed:
            h = failed[0]
            h.observed = True
            raise SaveFailedError(f"the background save of step {h.step} failed and was never awaited") from h.exception()

    async def refresh(self) -> list[int]:
        """Re-list committed steps from disk (another process may have written); returns them.

        Manifests are validated once per folder (again only if their file changed). Never writes.

        Cancellation: the listing finishes in its thread; the store's view is unchanged.
        """
        if not self._open:
            raise StoreClosedError("the store is not open: use `async with TensorStore(...) as store`")
        await self._list()
        return self.steps()

    async def _list(self) -> _root.Listing:
        assert self._commit_lock is not None
        async with self._commit_lock:  # a commit landing during the listing must not be lost
            known = dict(self._known)
            listing: _root.Listing = await self._call(_root.scan, self.engine, self.root, known, what=f"listing {self.root}")
            self._known = known
            self._committed = set(listing.committed)
            self._latest_on_disk = listing.latest
            for name, why in listing.ignored.items():
                if self.ignored.get(name) != why:
                    log.warning("%s: ignoring %s: %s", self.root, name, why)
            self.ignored = listing.ignored
            self._errors = listing.errors
        return listing

    # --- queries ---------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, oldest first (this store's view: see :meth:`refresh`). No I/O."""
        return sorted(self._committed)

    def latest(self) -> int | None:
        """The newest committed step, or None. No I/O."""
        return max(self._committed, default=None)

    def path(self, step: int) -> str:
        """The folder of a step."""
        return os.path.join(self.root, step_dir_name(step))

    # --- save ------------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, background: bool = False, progress: ProgressCallback | None = None) -> SaveHandle:
        """Start saving ``state`` as ``step``; returns at once with a :class:`SaveHandle`.

        ``await store.save(step, state)`` returns once the checkpoint is committed and durable;
        ``await handle.staged`` returns once the tensors are copied out. ``background=True`` runs
        the save's I/O behind loads and foreground saves. ``progress(done, total)`` is called on the
        loop thread as the tensor bytes are written. The handle is also a coroutine object:
        ``asyncio.create_task(store.save(...))`` works.

        ``save`` returns at once whatever the size of ``state``: walking and planning it runs in a
        worker thread. Until ``staged``, change neither the tensors nor the containers of ``state``.

        Raises (at once, nothing written):
            StoreClosedError / ReadOnlyStoreError: the store is not open, or opened read-only.
            CheckpointExistsError: the step is committed already, or being saved.
            StaleStepError: ``keep_last`` newer steps exist, so retention would delete it at once.
            SaveFailedError: an earlier background save failed and its handle was never awaited.

        Awaiting the handle (or ``handle.staged``) raises the save's failure:
        :class:`~aiotensor.errors.StateError` (a leaf that cannot be stored, named by its key path,
        or an unsupported tensor), ``OSError`` (disk full, I/O error, naming the file) or
        :class:`~aiotensor.errors.SaveCancelledError`. A failed save leaves nothing behind.
        Trouble after the commit point never fails it (see :class:`SaveHandle`).

        Cancellation: see :class:`SaveHandle`.
        """
        self._check_writable()
        _check_step(step)
        self._raise_unobserved()
        if step in self._committed or step in self._in_flight:
            where = "committed" if step in self._committed else "being saved"
            raise CheckpointExistsError(
                f"step {step} is already {where} in {self.root}"
                + (" (to replace it, `await store.delete(step)` first)" if step in self._committed else "")
            )
        newer = sorted(s for s in self._committed if s > step)
        if self.keep_last is not None and len(newer) >= self.keep_last:
            raise StaleStepError(
                f"step {step} would be deleted as soon as it commits: keep_last={self.keep_last} and {len(newer)} newer "
                f"steps exist in {self.root} ({newer[:5]}{'...' if len(newer) > 5 else ''}). To go back to an earlier "
                f"step, `await store.rollback({step - 1 if step else 0})` first, or raise keep_last"
            )
        # the call itself is O(1): the state is walked and planned in a worker thread (a 20,000-tensor
        # state takes the better part of a second of Python); CUDA sources are copied after the
        # kernels already queued on the current streams as of now
        producers = cuda.record_current_streams() if self.scheduler.cuda is not None else {}
        handle = SaveHandle(step, 0)
        self._in_flight[step] = handle
        prio = Priority.BACKGROUND if background else Priority.SAVE
        self._start(lambda: self._run_save(handle, state, prio, producers, progress))
        return handle

    def _check_writable(self) -> None:
        if not self._open:
            raise StoreClosedError("the store is not open: use `async with TensorStore(...) as store`")
        if self.readonly:
            raise ReadOnlyStoreError(f"this store of {self.root} was opened with readonly=True: it cannot save or delete")

    def _start(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run ``fn`` in the background; ``close`` waits for it."""
        done = anyio.Event()
        self._busy.add(done)

        async def run() -> None:
            try:
                await fn()
            finally:
                self._busy.discard(done)
                done.set()

        threads.spawn(run)

    async def _run_save(
        self, h: SaveHandle, state: Any, prio: int, producers: dict[Any, Any], progress: ProgressCallback | None
    ) -> None:
        error: BaseException | None = None
        try:
            with anyio.CancelScope() as scope:
                h._scope = scope
                if h._cancel_requested:
                    scope.cancel()
                with self.scheduler.operation():  # from the walk of the state to the commit
                    await self._save(h, state, prio, producers, progress)
            if scope.cancelled_caught and not h.committed:
                error = SaveCancelledError(f"the save of step {h.step} was cancelled; nothing was committed")
        except Exception as e:
            error = e
        except BaseException:  # the loop itself is shutting down
            error = SaveCancelledError(f"the save of step {h.step} was cancelled; nothing was committed")
            raise
        finally:
            del self._in_flight[h.step]
            if isinstance(error, Exception) and not isinstance(error, SaveCancelledError):
                self._unobserved.append(h)
            h._finish(error)

    async def _save(
        self, h: SaveHandle, state: Any, prio: int, producers: dict[Any, Any], progress: ProgressCallback | None
    ) -> None:
        if self._saver is not None:
            return await self._save_distributed(h, state)
        t0 = anyio.current_time()
        plan: SavePlan
        sources: dict[str, torch.Tensor]
        plan, sources = await self.scheduler.call(
            functools.partial(plan_save, state, shard_bytes=self.shard_bytes, devices=self.scheduler.devices), priority=prio
        )
        del state
        h.nbytes = plan.nbytes
        arena = await self.staging.acquire(plan.arena_bytes)
        try:
            pieces, views = await stage(self.scheduler, plan, sources, arena, prio, producers)
            h.stage_seconds = anyio.current_time() - t0
            h._staged_event.set()  # the caller's tensors are free to change from here on
            await self.scheduler.discard(sources, *views)  # our references to them: freed in a thread
            with reporting(sum(round_up(sh.layout.file_size) for sh in plan.shards), progress):
                await self._write(h, plan, arena, pieces, prio)
            h.commit_seconds = anyio.current_time() - t0
        finally:
            self.staging.release(arena)
        # a plan and its pieces are tens of thousands of objects for a state of many tensors: freed
        # in a thread (on failure they go where the error takes them)
        big = [plan]
        del plan
        await self.scheduler.discard(pieces, big)

    async def _save_distributed(self, h: SaveHandle, state: Any) -> None:
        """A save under the process group (see the class): DCP plans, aiotensor writes, rank 0 commits."""
        t0, what = anyio.current_time(), f"saving step {h.step} in {self.root}"
        with anyio.CancelScope(shield=True):  # collectives cannot be left half-way
            async with self._collective:
                staged = await self.scheduler.run_sync(self._saver.stage, state, what)
                del state
                h.stage_seconds = anyio.current_time() - t0
                h._staged_event.set()
                token = anyio.lowlevel.current_token()
                write = self._saver.write
                h.nbytes = await self.scheduler.run_sync(write, staged, self.path(h.step), what, self.scheduler, token)
            h.commit_seconds = anyio.current_time() - t0
            assert self._commit_lock is not None
            async with self._commit_lock:
                await self._committed_now(h)

    async def _write(self, h: SaveHandle, plan: SavePlan, arena: Any, pieces: Any, prio: int) -> None:
        """Write the shards and the manifest under a temporary name, then commit (one at a time, so
        that ``latest`` only moves forward). Past the commit point the save completes even if
        cancelled: a rename that ran must be followed by the fsync that makes it durable."""
        sched = self.scheduler
        async with Publication(sched, self.path(h.step), folder=True, priority=prio) as pub:
            crcs: dict[str, int] = {}

            async def checksum() -> None:
                crcs.update(await checksums(sched, plan, pieces, arena, prio))

            async def write() -> None:
                for sh in plan.shards:  # each image padded to whole pages: written with O_DIRECT
                    size = sh.layout.file_size
                    image = arena.view[sh.arena_offset : sh.arena_offset + round_up(size)]
                    await write_file(sched, os.path.join(pub.tmp, sh.file), [(0, image)], prio, size=size)

            await run_concurrently(checksum, write)
            data = await sched.call(manifest_bytes, h.step, plan, crcs, priority=prio)  # a big tree: off the loop
            await sched.discard(crcs)
            await write_file(sched, os.path.join(pub.tmp, _root.MANIFEST), [(0, memoryview(data))], prio)
            assert self._commit_lock is not None
            with anyio.CancelScope(shield=True):
                async with self._commit_lock:
                    await pub.publish()
                    await self._committed_now(h)  # the commit point: the save has succeeded

    async def _committed_now(self, h: SaveHandle) -> None:
        """Past the commit point (under the commit lock): the save has succeeded; then ``latest``
        and retention, by the root's writer (a distributed store's rank 0; the other ranks only
        drop from their view the steps rank 0 retires)."""
        h.committed = True
        self._committed.add(h.step)
        if self._lock is None:
            if self.keep_last is not None:
                self._committed.difference_update(self.steps()[: -self.keep_last])
            return
        log.info("%s: committed step %d (%d bytes)", self.root, h.step, h.nbytes)
        await self._try(functools.partial(self._sync_latest, h), h, "updating `latest`")
        await self._try(self._retain, h, "retiring old steps")

    async def _try(self, fn: Callable[[], Awaitable[Any]], h: SaveHandle | None, what: str) -> None:
        """Housekeeping that must not fail what it follows: a failure is logged and listed in ``h``'s
        warnings; the next save or open repairs it."""
        try:
            await fn()
        except Exception as e:
            msg = f"{self.root}: {what} failed ({e}); the checkpoint is committed, and the next save or open repairs this"
            if h is not None:
                h.warnings.append(msg)
            log.warning("%s", msg)

    async def _sync_latest(self, h: SaveHandle | None = None) -> None:
        """Make ``latest`` name the newest committed step (or remove it when none is left). Something
        else of that name (a folder, a link, a file of other contents) is the user's: it is left
        alone, and reported in ``h.warnings`` and :attr:`ignored`."""
        newest = self.latest()
        want = None if newest is None else step_dir_name(newest)
        if want == self._latest_on_disk:
            return
        path = os.path.join(self.root, LATEST)
        why = await self._call(_root.point_latest, self.engine, self.root, want, what=f"updating {path}")
        if not why:
            self._latest_on_disk = want
            return
        msg = f"{path} is {why} (the newest step is {want})"
        if h is not None:
            h.warnings.append(msg)
        if self.ignored.get(LATEST) != why:
            log.warning("%s", msg)
            self.ignored[LATEST] = why

    async def _retain(self) -> None:
        """Retire steps beyond ``keep_last`` (never one being loaded by this store)."""
        if self.keep_last is None:
            return
        for step in self.steps()[: -self.keep_last]:
            if not self._readers[step]:  # retried after the next commit
                await self._retire(step)

    async def _retire(self, step: int) -> None:
        """Retire a step durably (:func:`aiotensor.commit.retire`), then delete its files in the
        background (a crash first leaves a leftover the next writer removes)."""
        eng = self.engine
        self._committed.discard(step)  # gone from this store's view once renamed, even if its fsync fails
        try:
            doomed = await self._call(commit.retire, eng, self.path(step), what=f"retiring step {step}")
        except BaseException:
            if await self._call(os.path.lexists, self.path(step), what=f"checking {self.path(step)}"):
                self._committed.add(step)  # the rename did not run: still committed
            raise
        log.info("%s: retired step %d", self.root, step)

        async def remove() -> None:
            with anyio.CancelScope(shield=True):  # a store closed with cancel=True still deletes them
                try:
                    await self.scheduler.call(eng.remove_tree, doomed, priority=Priority.BACKGROUND)
                except OSError as e:
                    log.warning("%s: could not delete the retired %s (%s); the next writer removes it", self.root, doomed, e)

        self._start(remove)

    async def delete(self, step: int) -> None:
        """Delete a committed step: renamed away durably (it stops being a checkpoint at once), then
        its files are removed in the background; ``latest`` is updated.

        Raises:
            CheckpointNotFoundError: no such committed step.
            ReadOnlyStoreError / StoreClosedError: not a writer, or not open.
            OSError: the rename failed (the step is then still committed).

        Cancellation: once started, the deletion completes.
        """
        self._check_writable()
        _check_step(step)
        if step not in self._committed:
            raise CheckpointNotFoundError(f"no committed checkpoint for step {step} in {self.root}")
        await self._delete([step])

    async def rollback(self, step: int) -> list[int]:
        """Delete every committed step newer than ``step``, newest first, so that training can go
        back to ``step`` (after a divergence, say) and save the later steps again; returns them.

        Raises:
            CheckpointExistsError: a newer step is being saved (await or cancel it first).
            ReadOnlyStoreError / StoreClosedError: not a writer, or not open.
            OSError: a rename failed (the steps not yet deleted stay committed).

        Cancellation: once started, the rollback completes.
        """
        self._check_writable()
        _check_step(step)
        busy = sorted(s for s in self._in_flight if s > step)
        if busy:
            raise CheckpointExistsError(f"steps {busy} are being saved in {self.root}: await or cancel them first")
        doomed = sorted((s for s in self._committed if s > step), reverse=True)
        await self._delete(doomed)
        return doomed

    async def _delete(self, steps: list[int]) -> None:
        assert self._commit_lock is not None
        with anyio.CancelScope(shield=True):
            async with self._commit_lock:
                for s in steps:
                    if s in self._committed:
                        await self._retire(s)
                await self._try(self._sync_latest, None, "updating `latest`")

    # --- load ------------------------------------------------------------------------------

    async def load(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        verify: bool | None = None,
        device: str | torch.device = "cpu",
        atomic: bool = False,
        progress: ProgressCallback | None = None,
    ) -> Any:
        """Load a committed step (default: the newest) as the nested state it was saved as.

        With ``into`` (a state of the same structure, e.g. ``{"model": model.state_dict(), ...}``),
        tensors are read straight into its tensors, in place; the returned state holds those tensors
        and the saved non-tensor values. ``into`` tensors may be on CUDA; without ``into``, new
        tensors are made on ``device`` (``"cuda"``: read straight into GPU memory by the kvikio
        engine, else through pinned bounce slots and a copy stream; complete when this returns).

        ``progress(done, total)`` is called on the loop thread as tensor bytes are read.

        ``atomic=True`` (with ``into``) is all-or-nothing: every tensor's checksum is verified in a
        first pass that writes nothing (extra memory: the bounce slots only; extra time: a second
        read, mostly from the page cache), and ``into`` is written only if all of it is intact. A
        corrupt or malformed checkpoint then leaves ``into`` untouched. Without it (the default),
        a failure leaves ``into`` with the new values of the tensors read before it, and the
        corrupt bytes of the tensor that failed. Either way an I/O error or a cancellation while
        ``into`` is being written leaves a mix.

        Raises:
            CheckpointNotFoundError: no such committed step (or none at all), or another process
                retired the step while it was being read.
            MismatchError: ``into`` lacks a key, has an extra one, or a shape/dtype differs (named).
            ChecksumError: stored bytes are corrupt (names the file and the tensor).
            ManifestError / HeaderError: a malformed manifest or shard (names the file).
            OSError: an I/O error, naming the file.

        Cancellation: returns (raising the cancellation) only once no worker thread writes into
        ``into``'s tensors any more; they may then hold a mix of old and new values.
        """
        if not self._open:
            raise StoreClosedError("the store is not open: use `async with TensorStore(...) as store`")
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.root}")
        _check_step(step)
        if step not in self._committed:
            damaged = self._errors.get(step_dir_name(step))
            if damaged is not None:  # the folder is there but broken: say what is wrong with it
                raise damaged
            why = self.ignored.get(step_dir_name(step))
            raise CheckpointNotFoundError(
                f"no committed checkpoint for step {step} in {self.root} "
                + (f"({step_dir_name(step)} is {why})" if why else f"(committed: {self.steps()[-10:]})")
            )
        self._readers[step] += 1
        done = anyio.Event()
        self._busy.add(done)
        try:
            verify = self.verify if verify is None else verify
            if self._saver is not None and into is not None:
                return await self._load_distributed(step, into)
            return await load_checkpoint(
                self.scheduler,
                self.path(step),
                into=into,
                verify=verify,
                device=device,
                atomic=atomic,
                step=step,
                progress=progress,
            )
        except FileNotFoundError as e:
            if await self._call(os.path.lexists, self.path(step), what=f"checking {self.path(step)}"):
                raise
            self._committed.discard(step)
            raise CheckpointNotFoundError(
                f"step {step} was retired while it was being loaded (by another process writing to {self.root})"
            ) from e
        finally:
            self._readers[step] -= 1
            self._busy.discard(done)
            done.set()

    async def _load_distributed(self, step: int, into: Any) -> Any:
        from . import distributed as _dist

        what = f"loading step {step} from {self.root}"
        with anyio.CancelScope(shield=True):  # collectives cannot be left half-way
            async with self._collective:
                token = anyio.lowlevel.current_token()
                await self.scheduler.run_sync(_dist.load, into, self.path(step), self._group, what, self.scheduler, token)
        return into

    async def info(self, step: int | None = None) -> dict[str, TensorInfo]:
        """Names, dtypes, shapes and sizes of a committed step's tensors (default: the newest), from
        its manifest alone (no tensor data is read).

        Raises:
            CheckpointNotFoundError, ManifestError, OSError: as :meth:`load`.

        Cancellation: the manifest read finishes in its thread; nothing changes.
        """
        if not self._open:
            raise StoreClosedError("the store is not open: use `async with TensorStore(...) as store`")
        step = self.latest() if step is None else step
        if step is None or step not in self._committed:
            raise CheckpointNotFoundError(f"no committed checkpoint for step {step} in {self.root}")
        m = await self.scheduler.call(_root.read_manifest, self.engine, self.path(step), step, priority=Priority.LOAD)
        specs = {k: e.spec for k, e in m.entries.items()} | {a: m.entries[t].spec for a, t in m.aliases.items()}
        return {k: tensor_info(s) for k, s in specs.items()}

    async def _call(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        """``fn(*args)`` in a worker thread; an OSError names ``what`` the user's call was doing."""
        try:
            return await self.scheduler.call(fn, *args, priority=Priority.SAVE)
        except OSError as e:
            raise annotate_oserror(e, what) from e


def _check_step(step: object) -> None:
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}")
    if not 0 <= step < 10**12:
        raise ValueError(f"step must be in [0, 10**12), got {step}")


__all__ = ["TensorStore"]
