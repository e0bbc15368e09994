"""TensorStore: a folder of committed, checksummed checkpoints, saved in the background.

The store orchestrates; the pieces live beside it: :mod:`.steps` (which steps exist: commit,
``latest``, retention, delete and rollback), :mod:`.saving` (the save pipeline), :mod:`.load`
(a committed step back to its state) and :mod:`.distributed` (under a process group). The on-disk
layout, the several-processes rules and the commit protocol are described in ``docs/store.md``.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import warnings
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, NoReturn

import anyio
import anyio.lowlevel
import torch

from .. import commit, knobs, sources
from .. import root as _root
from .._runtime import cuda, gil, threads
from .._runtime.buffers import StagingPool
from .._runtime.scheduler import Priority, ProgressCallback, Scheduler, check_progress
from ..engines import Engine
from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ReadOnlyStoreError,
    SaveCancelledError,
    SaveFailedError,
    StaleStepError,
    StoreClosedError,
    StoreLockedError,
    UnsupportedLocationError,
)
from ..files import TensorInfo
from ..location import engine_for, is_folder, is_object, local_path
from ..root import step_dir_name
from . import saving
from .handle import SaveHandle
from .load import load_checkpoint
from .mirror import Mirror
from .steps import Steps, call, check_step, take_lock

log = logging.getLogger("aiotensor")


def _checkpoint_record(engine: Engine, folder: str) -> str | None:
    """The file that makes ``folder`` a checkpoint itself (:func:`aiotensor.root.checkpoint_record`),
    if one does; a manifest.json counts only beside shards (a project's own manifest.json does not)."""
    try:
        names = engine.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):  # (no folder yet: the writer makes it)
        return None
    record = _root.checkpoint_record(names)
    shards = any(n.startswith("shard-") and n.endswith(".safetensors") for n in names)
    return None if record == _root.MANIFEST and not shards else record


def _absolute(root: str | os.PathLike[str]) -> str:
    """``root`` made absolute as it is now (a later ``os.chdir``, a notebook's or a library's, must
    not move the store), against the working folder without rewriting it (``link/../ck`` is where
    the system finds it, not where ``os.path.abspath`` would put it); an empty root (an unset
    variable) is a ValueError, not the working folder."""
    path = local_path(root, "TensorStore root", objects=True)  # (empty: a ValueError)
    return path if is_object(path) or os.path.isabs(path) else os.path.join(os.getcwd(), path)


_OPEN_IT = "use `async with TensorStore(...) as store`, or `await store.open()` (a notebook: then `await store.close()`)"


class TensorStore:
    """Checkpoints of nested state (state_dicts, optimizer state, Python scalars) in a folder
    (``docs/store.md``: the layout, what committed means, several processes on one root).

    Use it as ``async with TensorStore(root) as store``; ``open()`` and ``close()`` may run in
    different tasks. One writer per root holds its lock; any number of ``readonly=True`` stores
    read it and see new commits on :meth:`refresh`. A store collected without ``close()`` lets go
    of the lock (with a ``ResourceWarning``, as a file does). A child forked from the process that
    opened a writer store (a ``multiprocessing`` worker) may load through a local one, but not
    save or delete (StoreClosedError: it would write beside its parent, which holds the lock;
    open a store in the child), nor use one on object storage at all (its client does not survive
    a fork); its ``close()`` only forgets the store, which stays its parent's.

    Args:
        root: the folder (created by a writer if missing), or ``s3://bucket/prefix`` on an object
            store (``docs/store.md``: the commit and the writer lease there). A relative folder is
            made absolute here (``self.root``): a later ``os.chdir`` does not move the store.
        keep_last: after each commit, retire all but the newest ``keep_last`` steps (None: keep all).
        readonly: open for reading only (no lock, no writes, no clean-up).
        lock_timeout: seconds ``open()`` waits for another writer (0: fail at once; None: forever).
        engine: the I/O engine (default: chosen for this machine); tests pass a fault-injecting one.
        workers, chunk_bytes, batch_bytes, nice, switch_interval: the scheduler's
            (:class:`~aiotensor.Scheduler`).
        shard_bytes: the largest shard file (a tensor is never split; default 4 GiB, on an object
            store 256 MiB: each shard is one PUT, several in flight). FAT32 holds files of less
            than 4 GiB: there, ``shard_bytes=2**31`` (a bigger shard fails its save, ``EFBIG``).
        max_staged: saves staged or writing at once; memory: ``max_staged`` × the state's size,
            mapped once and kept until :meth:`release_memory`; fewer where a memory limit (a
            container's) has no room for more (``docs/store.md``: MemoryError where none fits).
        verify: check each tensor's crc32c on load (``load(verify=)`` per call).
        reserve: a state like the ones to come (or its size in bytes): ``open()`` maps its arena in
            the background, so the first save holds the trainer no longer than later ones.
        distributed: ``True`` or a ``ProcessGroup``: every rank opens the store on the same root and
            calls ``save``, ``load(into=)`` and ``close`` together (``docs/distributed.md``).
        mirror: a second store (``s3://bucket/prefix``, or another folder): every step committed
            here is uploaded there in the background, one at a time (``handle.mirrored`` awaits
            it), under that store's own commit protocol and writer lease; a step that is in the
            mirror only (a new node) is loaded from there. Steps committed here but missing there
            (a crash, the network) are uploaded when the store opens, every one the mirror's
            retention keeps. A mirror that cannot be reached never holds the trainer: the store
            opens with a warning, commits here, and each upload tries again (``handle.mirrored``
            raises OSError meanwhile), catching up once it answers.
        mirror_keep_last: the mirror's retention (None: keep all), independent of ``keep_last``.
        incremental: write only what changed since the last committed step (:mod:`.saving`): a
            shard of tensors proven unchanged (a blake3 digest of its bytes) is a hard link to the
            earlier step's file (on an object store, a server-side copy), so each step stays a
            complete folder. ``False``: every save writes every byte.
        storage_options: for an ``s3://`` root or mirror, obstore's S3 settings (``endpoint``,
            ``access_key_id``, ``region``...) over the ``AWS_*`` environment; never logged.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        readonly: bool = False,
        lock_timeout: float | None = 0,
        engine: Engine | None = None,
        workers: int = knobs.WORKERS,
        chunk_bytes: int = knobs.CHUNK_BYTES,
        batch_bytes: int = knobs.BATCH_BYTES,
        shard_bytes: int | None = None,
        max_staged: int = knobs.MAX_STAGED,
        verify: bool = True,
        reserve: Any = None,
        distributed: Any = False,
        nice: int = knobs.NICE,
        switch_interval: float | None = knobs.SWITCH_INTERVAL_S,
        mirror: str | os.PathLike[str] | None = None,
        mirror_keep_last: int | None = None,
        incremental: bool = True,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.root = _absolute(root)
        if engine is None:
            engine = engine_for(self.root, storage_options=storage_options)
        if shard_bytes is None:
            shard_bytes = knobs.SHARD_BYTES if engine is None or engine.renames else knobs.OBJECT_SHARD_BYTES
        if shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
        if lock_timeout is not None and lock_timeout < 0:
            raise ValueError(f"lock_timeout must be >= 0 or None, got {lock_timeout}")
        if distributed is not False and readonly:
            raise ValueError("a distributed store writes: readonly=True and distributed= do not go together")
        if distributed is not False and mirror is not None:
            raise UnsupportedLocationError(f"{self.root}: a distributed store has no mirror= yet (save to s3:// directly)")
        self.keep_last, self.readonly, self.lock_timeout = keep_last, readonly, lock_timeout
        self.shard_bytes, self.verify, self.reserve, self.distributed = shard_bytes, verify, reserve, distributed
        self.scheduler = Scheduler(
            engine, workers=workers, chunk_bytes=chunk_bytes, batch_bytes=batch_bytes, nice=nice, switch_interval=switch_interval
        )
        cuda_ = self.scheduler.cuda
        self.staging = StagingPool(max_staged, pinning=cuda_.pinning if cuda_ is not None else None, nice=nice)
        self._lock = None if readonly else _root.writer_lock(self.engine, self.root)
        self._tasks = threads.Tasks()  # saves, loads, deletions in the background: close() waits for them
        self._loop: anyio.lowlevel.EventLoopToken | None = None  # the event loop they run on (_check_loop)
        self._steps = Steps(
            self.scheduler, self.root, keep_last=keep_last, writer=not readonly, start=self._tasks.start, lock=self._lock
        )
        self._group: Any = None  # a distributed.Group, once open under a process group
        self._in_flight: dict[int, SaveHandle] = {}
        self._incremental = saving.Incremental() if incremental and distributed is False else None
        self._remembered: anyio.Event | None = None  # the newest step's manifest read, for the first incremental save
        self._tier: TensorStore | None = None  # the mirror's store, and what uploads to it
        self._mirror: Mirror | None = None
        self._tier_lock: anyio.Lock | None = None  # opening the mirror (at open, or at an upload)
        self._tier_retry_at = 0.0  # not before then, once it could not be reached
        self._uploading: set[int] = set()
        self._waiting: dict[object, int] = {}  # uploads not begun (a token each), each holding its step here
        self._behind = False  # an upload failed: the next that succeeds catches up
        if mirror is not None:
            self._tier = TensorStore(
                mirror,
                keep_last=mirror_keep_last,
                readonly=readonly,
                lock_timeout=0 if lock_timeout is None else lock_timeout,  # never for ever: it would hold open()
                verify=verify,
                storage_options=storage_options,
            )
            self._mirror = Mirror(self._tier.scheduler, self._tier._steps)
        self._open = False
        self._opened = False  # ever: steps() and latest() of a store never opened have nothing to tell
        self._pid = os.getpid()  # the process that opened it (a forked child only reads)
        self._unobserved: list[SaveHandle] = []

    @property
    def engine(self) -> Engine:
        return self.scheduler.engine

    @property
    def io_mode(self) -> str:
        """The I/O path in use: ``"posix"``, or ``"kvikio (gds)"``, ``"kvikio (cufile-compat)"``...
        (see :class:`~aiotensor.KvikioEngine`) where CUDA tensors move through cuFile, ``"kvikio
        (compat: CUDA tensors through bounce slots)"`` where kvikio runs in its own compatibility
        mode. For the kvikio engine, the first read waits for kvikio's set-up (up to a second, once
        per process): read it in a worker thread, or after a first save or load."""
        return self.engine.label

    @property
    def ignored(self) -> dict[str, str]:
        """Names in the root that are not committed steps, and why (as of the last listing)."""
        return self._steps.ignored

    def __repr__(self) -> str:  # (what a notebook shows: helper-55)
        if not self._opened:
            return f"<TensorStore {self.root!r} never opened>"
        steps = self.steps()
        seen = f"steps {steps[0]}..{steps[-1]} ({len(steps)})" if steps else "no steps"
        how = ("open" if self._open else "closed") + (", read-only" if self.readonly else "")
        flight = f", saving {sorted(self._in_flight)}" if self._in_flight else ""
        return f"<TensorStore {self.root!r} {how}, {seen}{flight}>"

    # --- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> TensorStore:
        await self.open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """:meth:`close`. Left by an exception (the training step raised), the saves in flight are
        waited for: each holds what was staged, and the newest checkpoint of a run that crashed is
        the one that matters (they were cancelled, and the last snapshot was lost: helper-36);
        a save that failed meanwhile is logged, not raised over that exception. Left by a
        cancellation, ``KeyboardInterrupt`` or ``SystemExit``, they are cancelled."""
        if exc is None or not isinstance(exc, Exception):
            await self.close(cancel=exc is not None)
            return
        try:
            await self.close()
        except SaveFailedError as e:
            log.warning("%s: %s (%s); the exception that left the block is raised", self.root, e, e.__cause__)

    def __del__(self) -> None:
        if not hasattr(self, "_pid") or self._forked():  # a forked child's copy: the lock is its parent's
            return
        lock = getattr(self, "_lock", None)
        if lock is not None and lock.held:
            warnings.warn(f"TensorStore({self.root!r}) was never closed: its lock is released now", ResourceWarning, 2)
            lock.release()

    async def open(self) -> None:
        """Open the store: a writer creates the root, takes its lock, removes the leftovers of
        interrupted saves and repairs ``latest``; everyone lists the committed steps.

        Raises:
            StoreLockedError: another writer holds the lock (after ``lock_timeout``).
            CheckpointNotFoundError: a read-only store's root does not exist (nor, with a
                ``mirror``, can that be reached: a new node reads the mirror's steps).
            UnsafePathError: the lock file is not aiotensor's (a link, a FIFO, another file).
            OSError: the root cannot be created, locked or listed (naming it).

        Cancellation: the lock, if taken, is released; the store stays closed.
        """
        if self._open:
            raise RuntimeError("store is already open")
        self._check_loop()  # (what open() starts in the background runs on this loop)
        absent = False  # a read-only store's root that is not there: only its mirror's steps
        try:
            if self.distributed is not False:
                await self._open_distributed()
            elif self._lock is None:
                absent = not await call(self.scheduler, is_folder, self.engine, self.root, what=f"opening {self.root}")
                if absent and self._tier is None:
                    raise CheckpointNotFoundError(f"{self.root} is not a folder (a read-only store never creates it)")
                if not absent:
                    await self._steps.scan()
            else:
                await self._open_writer()
            self._tier_lock, self._tier_retry_at = anyio.Lock(), 0.0
            if not await self._open_tier() and absent:
                raise CheckpointNotFoundError(
                    f"{self.root} is not a folder (a read-only store never creates it), and its mirror cannot be reached"
                )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._release()
            raise
        self._open, self._opened, self._pid = True, True, os.getpid()
        self._catch_up()
        newest = self._steps.newest()
        self._remembered = anyio.Event()
        if self._incremental is not None and newest is not None and not self.readonly:
            self._tasks.start(lambda: self._remember(newest))
        else:
            self._remembered.set()
        if self.reserve is not None and not self.readonly:
            self._tasks.start(lambda: saving.reserve(self.scheduler, self.staging, self.reserve, self.shard_bytes))

    async def _open_tier(self, now: bool = False) -> bool:
        """Open the mirror's store if it is not open yet; False, with a warning, where it cannot be
        reached or another writer holds its lease (a crashed trainer's, for ``knobs.LEASE_S``):
        the store opens and commits locally all the same (a mirror down at open failed it, and
        the trainer could not resume from its own disk: helper-30); uploads try again at most
        every ``knobs.MIRROR_RETRY_S`` (``now``: at once), never waiting for the lease, and
        catch up on the steps it missed once it answers."""
        tier = self._tier
        if tier is None or tier._open:
            return tier is not None
        assert self._tier_lock is not None, "the store opened"
        async with self._tier_lock:
            if tier._open:
                return True
            if not now and anyio.current_time() < self._tier_retry_at:  # tried a moment ago: queued uploads fail at once
                return False
            if self._open:
                tier.lock_timeout = 0  # a retry never waits for another writer's lease (close() would wait on it)
            try:
                await tier.open()
            except (OSError, StoreLockedError) as e:
                self._tier_retry_at = anyio.current_time() + knobs.MIRROR_RETRY_S
                then = "listed once it answers" if self.readonly else "committed here and uploaded once it answers"
                log.warning("%s: the mirror %s cannot be used (%s): steps are %s", self.root, tier.root, e, then)
                return False
        if self._open:  # (at open(): once the store is open)
            self._catch_up()
        return True

    async def _mirror_reachable(self, what: str) -> None:
        """``delete``/``rollback`` act on both tiers: with the mirror away, the step would stay
        there, to come back when it answers (or, saved again, never be uploaded over the old one:
        helper-33). Refused then.

        Raises:
            OSError: the mirror cannot be reached (tried now)."""
        if self._tier is not None and not await self._open_tier(now=True):
            raise OSError(
                errno.EHOSTUNREACH,
                f"{what}: the mirror {self._tier.root} cannot be reached, and it acts on both; try again once it answers",
            )

    def _catch_up(self) -> None:
        """Upload the steps committed here but not in the mirror (a crash, the network), oldest
        first: every one its retention keeps (with ``mirror_keep_last``, the newest that many of
        both stores' steps; it uploaded only those newer than the mirror's newest, and a step
        committed while it was down never got there: helper-30)."""
        tier = self._tier
        if tier is None or not tier._open or self.readonly or not self._open:  # (not once close() began)
            return
        kept = self.steps()
        if tier.keep_last is not None:
            kept = kept[-tier.keep_last :]
        for step in kept:
            fresh = step not in self._uploading and step not in self._in_flight  # (a save uploads its own)
            if step in self._steps.committed and step not in tier._steps.committed and fresh:
                self._start_upload(SaveHandle(step))

    async def _remember(self, step: int) -> None:
        """The newest step's candidate shards, for the next incremental save (after a restart);
        a failure only means that save writes every byte."""
        assert self._incremental is not None
        incremental, folder = self._incremental, self.path(step)

        def remember() -> None:  # tens of thousands of entries for a big state: in a worker
            incremental.committed(_root.read_manifest(self.engine, folder, step), folder)

        try:
            await self.scheduler.call(remember, priority=Priority.BACKGROUND)
        except Exception as e:
            log.info("%s: step %d's manifest was not read for incremental saves (%s)", self.root, step, e)
        finally:
            assert self._remembered is not None
            self._remembered.set()

    async def _open_writer(self) -> None:
        if self.engine.renames:  # an object store's folder is a key prefix: nothing to make
            if record := await call(self.scheduler, _checkpoint_record, self.engine, self.root, what=f"listing {self.root}"):
                raise CheckpointExistsError(
                    f"{self.root} is a checkpoint itself (it holds {record}), not a store root of steps: read it "
                    "(aiotensor.load_file, stream, dcp.load_full, a store opened on its parent), or write the store elsewhere"
                )
            await call(self.scheduler, os.makedirs, self.root, 0o777, True, what=f"creating the store folder {self.root}")
        await take_lock(self.scheduler, self._lock, self.root, self.lock_timeout)  # type: ignore[arg-type]
        await self._steps.repair(await self._steps.scan())

    async def _open_distributed(self) -> None:
        from .distributed import Group  # torch.distributed: imported only here

        self._group = group = Group(self.distributed, self.scheduler)  # (its open's turn taken here, before any await)
        try:
            if group.rank != 0:  # only rank 0 locks, cleans and commits
                self._lock = None
                self._steps.writer = False
            problem: BaseException | None = None
            if group.rank == 0:
                try:
                    await self._open_writer()
                except Exception as e:
                    problem = e
            await group.opened(problem, self.root)
        finally:
            group.passed(group.opening)  # (an open that failed before its turn gives it up)
        await self._steps.scan()

    async def close(self, *, cancel: bool = False) -> None:
        """Wait for the saves and loads in flight (cancel the saves with ``cancel=True``), then free
        staging memory and release the lock.

        Raises:
            SaveFailedError: a save failed and its handle was never awaited.

        Cancellation: cancelling ``close`` cancels the saves in flight; it returns once they stopped.
        """
        if not self._open:
            return
        if not self._forked():
            self._check_loop()
        self._open = False  # no new saves or loads from here on
        if self._forked():  # a forked child's copy: the lock, saves and memory are its parent's
            return
        try:
            if cancel:
                self._cancel_saves()
            try:
                await self._tasks.wait()
            except BaseException:
                self._cancel_saves()
                await threads.finish(self._tasks.wait)  # (a second Task.cancel() let a new writer in: helper-51)
                raise
        finally:
            await threads.finish(self._let_go)
        self._raise_unobserved()

    async def _let_go(self) -> None:
        if self._tier is not None:
            await self._tier.close()
        await self._release()

    def _cancel_saves(self) -> None:
        for h in list(self._in_flight.values()):
            h.cancel()

    async def _release(self) -> None:
        """Unmap staging memory and bounce slots and drop the lock (in a thread: unmapping takes a while)."""

        def release() -> None:
            if self._incremental is not None:  # tens of thousands of entries for a big state: freed here
                self._incremental.forget()
            self.staging.close()
            self.scheduler.close()
            if self._group is not None:
                self._group.close()
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
        """Re-list the committed steps (another process may have written); returns them. Never writes.

        Cancellation: the listing finishes in its thread; the store's view is unchanged.
        """
        self._check_open()
        # a read-only store with a mirror may have no local folder (a new node: helper-38)
        local = self._tier is None or not self.readonly
        if local or await call(self.scheduler, is_folder, self.engine, self.root, what=f"listing {self.root}"):
            await self._steps.scan()
        if await self._open_tier():  # (one that could not be used at open is tried again)
            assert self._tier is not None
            await self._tier.refresh()
        return self.steps()

    # --- queries ---------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, oldest first, here or in the mirror (this store's view: see
        :meth:`refresh`; after :meth:`close`, what it was then). No I/O.

        Raises:
            StoreClosedError: the store was never opened (it has not looked: ``[]`` would read as
                a fresh run's, and a resume would start over, helper-55)."""
        if not self._opened:
            raise StoreClosedError(f"the store of {self.root} was never opened: {_OPEN_IT}, then ask for its steps")
        return sorted(self._steps.committed | self._mirrored())

    def mirrored_steps(self) -> list[int]:
        """The steps committed in the mirror (their manifests are there). No I/O."""
        return sorted(self._mirrored())

    def _mirrored(self) -> set[int]:
        return set() if self._tier is None else self._tier._steps.committed

    def latest(self) -> int | None:
        """The newest committed step (here or in the mirror), or None. No I/O.

        Raises:
            StoreClosedError: the store was never opened (as :meth:`steps`)."""
        return max(self.steps(), default=None)

    def path(self, step: int) -> str:
        """The folder of a step."""
        return os.path.join(self.root, step_dir_name(step))

    # --- save ------------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, background: bool = False, progress: ProgressCallback | None = None) -> SaveHandle:
        """Start saving ``state`` as ``step``; returns at once with a :class:`SaveHandle`:
        ``await handle.staged`` once the tensors are copied out (until then, change neither the
        tensors nor the containers of ``state``: a tensor changed in place meanwhile fails the
        save, ``StateChangedError``), ``await handle`` once committed and durable.
        ``background=True`` puts the save's I/O behind loads and other saves; ``progress(done,
        total)`` is called on the loop thread as tensor bytes are written.

        Raises (at once, nothing written):
            StoreClosedError / ReadOnlyStoreError: the store is not open, or opened read-only.
            CheckpointExistsError: the step is committed already, or being saved, or its folder's
                name is taken by what is not a committed step (a damaged one, say: never deleted).
            StaleStepError: newer steps are committed (``latest`` would still name the newest; a resume
                from an earlier step rolls back first: :meth:`rollback`).
            SaveFailedError: an earlier background save failed and its handle was never awaited.

        Awaiting the handle raises the save's failure (``StateError`` naming a key path that cannot
        be stored, ``StateChangedError`` naming a tensor changed in place before it was copied out,
        ``OSError`` naming the file, ``SaveCancelledError``); a failed save leaves nothing.

        Cancellation: see :class:`SaveHandle`.
        """
        self._check_writable()
        check_step(step)
        check_progress(progress)
        self._raise_unobserved()
        committed = step in self._steps.committed or step in self._mirrored()
        if committed or step in self._in_flight:
            raise CheckpointExistsError(
                f"step {step} is already {'committed' if committed else 'being saved'} in {self.root}"
                + (
                    f" (to resume from an earlier step and save this one again, `await store.rollback"
                    f"({step - 1})` first; to replace only this one, `await store.delete(step)`)"
                    if committed and step
                    else " (to replace it, `await store.delete(step)` first)"
                    if committed
                    else ""
                )
            )
        why = self._steps.ignored.get(step_dir_name(step))
        if why:  # its name is taken by what is not a committed step: the final rename would fail
            raise CheckpointExistsError(
                f"{self.path(step)} exists but is not a committed checkpoint ({why}); aiotensor never deletes it: move "
                f"it out of {self.root} (its files may be worth keeping), or save another step"
            )
        newer = [s for s in self.steps() if s > step]
        if newer:  # a resume from an earlier step (helper-44: its steps were retired as they came, or never latest)
            doomed = self.keep_last is not None and len(newer) >= self.keep_last
            raise StaleStepError(
                f"step {step} is older than {len(newer)} committed step(s) of {self.root} ({newer[:5]}"
                f"{'...' if len(newer) > 5 else ''}): `latest`, and so every resume, would still name step {newer[-1]}"
                + (f", and keep_last={self.keep_last} would delete step {step} as soon as it commits" if doomed else "")
                + f". To go back to an earlier step, `await store.rollback({step - 1 if step else 0})` first (it deletes "
                f"every one of those newer steps), or delete them"
            )
        # CUDA sources are copied after the kernels already queued on the current streams as of now
        producers = cuda.record_current_streams() if self.scheduler.cuda is not None else {}
        # the tensors' version counters now: one changed in place before the save copies it out fails it
        marks = saving.versions(state) if self._group is None else None
        handle = SaveHandle(step)
        self._in_flight[step] = handle
        prio = Priority.BACKGROUND if background else Priority.SAVE
        # under a process group: its place among this process's store operations, taken now (call order)
        ticket = self._group.ticket() if self._group is not None else None
        # passed on once the save's task is done (before its turn, or a no-op after it), even where
        # the task never started (a loop ending at once: helper-42)
        passed = None if self._group is None or ticket is None else functools.partial(self._group.passed, ticket)

        in_flight = self._in_flight  # (not the store: a callback pending holds what it names, and a store
        # dropped unclosed is collected at once, with its warning: a notebook cell run again)

        def ended() -> None:
            if passed is not None:
                passed()
            if not handle.done():  # never started: a task awaiting the handle waited for ever (helper-53)
                in_flight.pop(step, None)
                handle.finish(SaveCancelledError(f"the save of step {step} was cancelled before it began (its event loop ended)"))
                handle.set_mirrored(None)

        try:
            self._tasks.start(lambda: self._run_save(handle, state, prio, producers, progress, ticket, marks), ended)
        except BaseException:
            if passed is not None:
                passed()
            del self._in_flight[step]
            raise
        return handle

    async def _run_save(
        self,
        h: SaveHandle,
        state: Any,
        prio: int,
        producers: dict[Any, Any],
        progress: ProgressCallback | None,
        ticket: int | None = None,
        marks: tuple[list[torch.Tensor], list[int]] | None = None,
    ) -> None:
        cancelled = SaveCancelledError(f"the save of step {h.step} was cancelled; nothing was committed")
        error: BaseException | None = None
        try:
            with anyio.CancelScope() as scope:
                h.begin(scope)
                # under a process group a save cancelled before its first collective is abandoned
                # by every rank there (skipped here, the others' next collectives would pair with
                # this rank's next save's)
                with anyio.CancelScope(shield=self._group is not None):
                    if self._remembered is not None:
                        await self._remembered.wait()  # at once, but for a first save right after open()
                with self.scheduler.operation():  # from the walk of the state to the commit
                    if self._group is not None:
                        assert ticket is not None
                        await self._group.save(h, state, self.path(h.step), self._steps, lambda: scope.cancel_called, ticket)
                    else:
                        await saving.save(
                            self.scheduler,
                            self.staging,
                            self._steps,
                            self.shard_bytes,
                            h,
                            state,
                            prio,
                            producers,
                            progress,
                            self._incremental,
                            marks,
                        )
            if scope.cancelled_caught and not h.committed:
                error = cancelled
        except Exception as e:
            if not h.committed:
                error = e
            else:  # past the commit point the save has succeeded (a progress callback raising at its
                msg = f"{self.root}: after step {h.step} was committed: {type(e).__name__}: {e}"  # end: helper-54)
                h.warn(msg)
                log.warning("%s", msg)
        except BaseException:  # the loop itself is shutting down (its tasks cancelled)
            error = None if h.committed else cancelled  # (committed as it ended: it succeeded, helper-51)
            if not h.committed:  # (nothing else tells: helper-36's trainer lost three steps silently)
                log.warning(
                    "%s: step %d was not committed: the event loop cancelled its tasks while it was being saved "
                    "(Ctrl-C, or a loop that ended first: await its handle, Snapshotter.drain() or store.close() "
                    "before it ends)", self.root, h.step,
                )  # fmt: skip
            raise
        finally:
            del self._in_flight[h.step]
            if isinstance(error, Exception) and not isinstance(error, SaveCancelledError):
                self._unobserved.append(h)
            h.finish(error)
            if self._tier is None or not h.committed:
                h.set_mirrored(None)
            else:
                self._start_upload(h)

    def _start_upload(self, h: SaveHandle) -> None:
        """Upload the committed step ``h.step`` to the mirror in the background (never retired
        here meanwhile); ``h.mirrored`` resolves when it is done. Uploads go one at a time: one
        that has not begun when ``mirror_keep_last`` newer steps are committed is dropped (the
        mirror's retention would retire that step at once), and lets its step go here, so that
        uploads slower than saves do not keep every step on the local disk (helper-35: 29 steps
        of keep_last=2, and growing)."""
        assert self._mirror is not None and self._tier is not None
        mirror, tier = self._mirror, self._tier
        self._steps.read(h.step, 1)
        self._uploading.add(h.step)
        token = object()  # (two uploads of one step may wait: a step deleted and saved again)
        self._waiting[token] = h.step
        self._drop_overtaken()
        began = False

        def begin() -> bool:  # the upload's turn came: does it go on (still wanted, its step still held)?
            nonlocal began
            began = self._waiting.pop(token, None) is not None
            return began

        async def upload() -> None:
            error: Exception | None = None
            try:
                if not await self._open_tier():
                    raise OSError(errno.EHOSTUNREACH, f"the mirror {tier.root} cannot be used now (tried again at a later save)")
                await mirror.upload(self.engine, self.path(h.step), h.step, begin)
            except Exception as e:
                error = e
                self._behind = True
                log.warning("%s: step %d was not mirrored to %s (%s)", self.root, h.step, tier.root, e)
            finally:
                if began or self._waiting.pop(token, None) is not None:  # (else _drop_overtaken let it go)
                    self._steps.read(h.step, -1)
                self._uploading.discard(h.step)
            h.set_mirrored(error)
            if error is None and self._behind:  # the mirror answers again: what it missed meanwhile
                self._behind = False
                self._catch_up()

        self._tasks.start(upload)

    def _drop_overtaken(self) -> None:
        """Let go of the uploads not begun whose step has ``mirror_keep_last`` newer ones committed
        (here or in the mirror): their steps may be retired here."""
        tier = self._tier
        keep = tier.keep_last if tier is not None else None
        if tier is None or keep is None or not self._waiting:
            return
        newest = sorted(set(self._steps.committed) | set(tier._steps.committed))[-keep:]
        for step in self._drop_waiting(lambda s: bool(newest) and s < newest[0]):
            log.info("%s: step %d is not mirrored: %d newer steps were committed before its upload began", self.root, step, keep)

    def _drop_waiting(self, which: Callable[[int], bool]) -> list[int]:
        """Let go of the uploads not begun of the steps ``which`` picks (they will not begin: their
        ``begin()`` answers no); returns those steps."""
        gone = [(t, s) for t, s in self._waiting.items() if which(s)]
        for token, step in gone:
            del self._waiting[token]
            self._steps.read(step, -1)
        return [s for _, s in gone]

    def _check_loop(self) -> None:
        """A store serves one event loop at a time: its saves' events, locks and tasks belong to the
        loop that started them, and a second loop's calls meanwhile hung (helper-36: two threads,
        each running its own loop, saving through one store stopped after 2-3 commits). One loop
        after another is fine.

        Raises:
            RuntimeError: work the store started on another event loop still runs."""
        token = threads.loop_token()
        if token is None:  # (terminal IPython's plain cells: anyio's NoEventLoopError, helper-55)
            raise RuntimeError(
                f"this store of {self.root} is used outside a running event loop: call it from async code "
                "(`async def`, a notebook cell that awaits, asyncio.run)"
            )
        if self._tasks and self._loop is not None and token != self._loop:
            raise RuntimeError(
                f"this store of {self.root} is busy on another event loop (saves or loads it started there still run): a "
                "store serves one event loop at a time; give each loop (thread) a store of its own (readonly=True for "
                "readers, or save from one loop); a pytest-asyncio fixture and the tests using it need one loop_scope"
            )
        self._loop = token

    def _check_open(self) -> None:
        if not self._open:
            raise StoreClosedError(f"the store is not open: {_OPEN_IT}")
        if not self._forked():
            self._check_loop()
        elif is_object(self.root) or (self._tier is not None and is_object(self._tier.root)):
            self._refuse_in_child("its object-store client does not survive a fork (its calls would hang)")
        # (a forked child's copy: the parent's work in flight never runs here, nor is another loop's: helper-50)

    def _check_writable(self) -> None:
        self._check_open()
        if self.readonly:
            raise ReadOnlyStoreError(f"this store of {self.root} was opened with readonly=True: it cannot save or delete")
        if self._forked():
            self._refuse_in_child("it holds the lock; a forked child may load through its store, but not save or delete")

    def _forked(self) -> bool:
        """Is this a child forked from the process that opened the store (its copy of it)?"""
        return self._pid != os.getpid()

    def _refuse_in_child(self, why: str) -> NoReturn:
        raise StoreClosedError(
            f"this store of {self.root} was opened by process {self._pid}, which this one was forked from: {why}; "
            "open a TensorStore in the child"
        )

    async def delete(self, step: int) -> None:
        """Delete a committed step: renamed away durably (it stops being a checkpoint at once), its
        files removed in the background, ``latest`` updated; in the mirror too.

        Under a process group every rank calls it with the same step (rank 0 deletes; each rank then
        lists the root again; ranks naming different steps: DistributedError, nothing deleted).

        Raises:
            CheckpointNotFoundError: no such committed step.
            ReadOnlyStoreError / StoreClosedError: not a writer, or not open.
            OSError: the rename failed (the step is then still committed).
            DistributedError: under a process group, it failed on another rank (naming it).

        Cancellation: once started, the deletion completes.
        """
        self._check_writable()
        await self._mirror_reachable(f"deleting step {step}")
        try:
            await self._delete(step)
        finally:
            await self._forget_deleted([step])

    async def _delete(self, step: int) -> None:
        if self._group is not None:  # every rank calls it; rank 0 deletes
            what = f"deleting step {step} of {self.root}"
            await self._group.retire(self._steps, step, lambda: [self._steps.check(step, exists=True)], what)
            return
        if self._tier is not None and self._mirror is not None:
            async with self._mirror.turn:  # not beside an upload (one of this step would commit it there again)
                self._drop_waiting(lambda s: s == step)  # nor after: one not begun would upload it again
                mirrored = step in self._mirrored()
                if mirrored:
                    await self._tier.delete(step)
                if not (mirrored and step not in self._steps.committed):  # (neither: CheckpointNotFoundError)
                    await self._steps.delete([self._steps.check(step, exists=True)])
            return
        await self._steps.delete([self._steps.check(step, exists=True)])

    async def rollback(self, step: int) -> list[int]:
        """Delete every committed step newer than ``step``, newest first (to go back to ``step``
        and save the later steps again, after a divergence say), here and in the mirror; returns
        them.

        Under a process group every rank calls it with the same step, as :meth:`delete`.

        Raises:
            CheckpointExistsError: a newer step is being saved (await or cancel it first).
            ReadOnlyStoreError / StoreClosedError, OSError: as :meth:`delete`.

        Cancellation: once started, the rollback completes.
        """
        self._check_writable()
        check_step(step)
        await self._mirror_reachable(f"rolling back to step {step}")
        busy = sorted(s for s in self._in_flight if s > step)
        if busy and self._group is None:
            raise CheckpointExistsError(f"steps {busy} are being saved in {self.root}: await or cancel them first")
        doomed = [s for s in reversed(self.steps()) if s > step]
        try:
            return await self._rollback(step, busy, doomed)
        finally:
            await self._forget_deleted(doomed)

    async def _rollback(self, step: int, busy: list[int], doomed: list[int]) -> list[int]:
        if self._group is not None:  # every rank calls it; rank 0 deletes
            what = f"rolling {self.root} back to step {step}"

            def doomed_here() -> list[int]:  # (a rank's refusal is voted: no rank is left in the collective)
                if busy:
                    raise CheckpointExistsError(f"steps {busy} are being saved in {self.root}: await or cancel them first")
                return [s for s in doomed if s in self._steps.committed]

            gone: list[int] = await self._group.retire(self._steps, step, doomed_here, what)
            return gone
        if self._tier is not None and self._tier._open and self._mirror is not None:
            async with self._mirror.turn:  # not beside an upload, nor before one not begun of a step rolled back
                self._drop_waiting(lambda s: s > step)  # (it uploaded the step again after: a flaky test's [1, 3])
                await self._tier.rollback(step)
        await self._steps.delete([s for s in doomed if s in self._steps.committed])
        return doomed

    async def _forget_deleted(self, steps: list[int]) -> None:
        """An incremental save links no file of a deleted step: the same step saved again is
        another file at the same path (helper-44: a save planned before it linked the new file for
        the old one's bytes; the step committed and could not be loaded, nor any that linked it).
        The newest step left is remembered instead (a rollback's next save links its files) where
        no save is in flight (its commit remembers its own step)."""
        inc = self._incremental
        if inc is not None and any(p.step in steps for _, p in inc.previous):
            inc.forget()
            newest = self._steps.newest()
            if newest is not None and not self._in_flight:
                with anyio.CancelScope(shield=True):
                    await self._remember(newest)

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
        mmap: bool = False,
        strict: bool = True,
    ) -> Any:
        """Load a committed step (default: the newest) as the nested state it was saved as: new
        tensors on ``device``, or, with ``into`` (a state of the same structure), its tensors filled
        in place and every saved non-tensor value put into its dicts and lists; ``into`` is returned
        (the same on 1 and N processes). In one process, a strict load puts the saved values under
        a dict ``into`` holds empty (a fresh optimizer's ``state``) there, new tensors included;
        under a process group DCP reads only the tensors ``into`` has. ``atomic=True`` verifies every checksum before writing into
        ``into``, so a corrupt step leaves it untouched (a cancellation while it writes does not:
        see below). ``progress(done, total)``: as for ``save``.

        ``mmap=True`` (CPU, without ``into``, a local store) copies nothing: the tensors are
        copy-on-write views of the step's shard files (as ``load_file(mmap=True)``), their
        checksums verified by reading the mapped pages unless ``verify=False``. A step retired
        later stays readable through them (a mapping keeps the file's inode), and its disk space
        is freed only when the last view is gone (``docs/serving.md``).

        ``strict`` (with ``into``) has ``load_state_dict``'s meaning: ``strict=False`` loads what
        both have (a resume after the model or optimizer changed), leaves a tensor or value of
        ``into`` the step lacks as it is (a missing key: a new head) and neither reads nor adds
        what ``into`` lacks (an unexpected key: a dropped layer, a saved value ``into`` has no
        place for); a warning on the ``aiotensor`` logger names both. A name both have must still
        match in shape and dtype; a place of ``into`` that holds tensors is never replaced by a
        saved value of another kind. Under a process group, DCP's partial load does this, without
        the warning (it never reads a key ``into`` lacks; strict, such a saved tensor is a
        MismatchError on every rank).

        Raises:
            CheckpointNotFoundError: no such committed step, or another process retired it meanwhile.
            MismatchError: ``into`` lacks a key, has an extra one (unless ``strict=False``), or a
                shape/dtype differs (named).
            ChecksumError, ManifestError, HeaderError: corrupt or malformed files (named).
            SourceChangedError: a file of the step was replaced after it was checked and before its
                data was read (the step saved again under its number by another process, a file
                renamed over): nothing of the new file is read; load again.
            OSError: an I/O error, naming the file.

        Cancellation: returns (raising it) only once no worker thread writes into ``into``'s
        tensors any more: each worker finishes the piece it is reading (at most ``chunk_bytes``;
        a 768 MB load cancelled returned in 4-28 ms on a 2-core machine). Its tensors may then hold a mix of old and new values
        (their version counters moved, as after a load that succeeds: a graph made before refuses
        ``backward()``), and its other values (a step, a learning rate) are the old ones: they are
        set at the end.
        """
        self._check_open()
        check_progress(progress)
        tier = self._tier
        if tier is not None and (self.latest() if step is None else step) in tier._steps.committed - self._steps.committed:
            return await tier.load(
                step, into=into, verify=verify, device=device, atomic=atomic, progress=progress, mmap=mmap, strict=strict
            )
        step = self._steps.check(step)
        self._steps.read(step, 1)  # never retired by this store meanwhile
        try:
            with self._tasks.running():  # close() waits for it
                if self._group is not None and into is not None and not mmap:  # mmap with into=: refused below
                    await self._group.load(into, step, self.path(step), f"loading step {step} from {self.root}", strict)
                    return into
                verify = self.verify if verify is None else verify
                return await load_checkpoint(
                    self.scheduler,
                    self.path(step),
                    into=into,
                    verify=verify,
                    device=device,
                    atomic=atomic,
                    step=step,
                    progress=progress,
                    mmap=mmap,
                    strict=strict,
                )
        except FileNotFoundError as e:
            # still committed, a file of it gone (a CheckpointNotFoundError, also a FileNotFoundError, is a retired step)
            broken = await call(
                self.scheduler, commit.damaged, self.engine, self.path(step), step, e, what=f"checking {self.path(step)}"
            )
            if broken is not None:
                raise broken from None
            self._steps.committed.discard(step)
            if self._steps.writer:
                raise CheckpointNotFoundError(
                    f"step {step} was retired while it was being loaded (by this store's retention, or removed by hand)"
                ) from e
            raise CheckpointNotFoundError(  # (helper-60: a reader that never refreshed was told "while")
                f"step {step} is gone: the writer of {self.root} (another process) retired it, or it was removed by hand, "
                "before or while it was being loaded; refresh() reads the root again, and latest() then names its newest step"
            ) from e
        finally:
            self._steps.read(step, -1)

    async def info(self, step: int | None = None) -> dict[str, TensorInfo]:
        """Names, dtypes, shapes and sizes of a committed step's tensors (default: the newest), from
        its manifest or metadata alone (no tensor data is read).

        Raises:
            CheckpointNotFoundError, ManifestError, OSError: as :meth:`load`.

        Cancellation: the read finishes in its thread; nothing changes.
        """
        self._check_open()
        step = self._steps.check(step)
        return await self.scheduler.call(_info, self.engine, self.path(step), step, priority=Priority.LOAD)


@gil.quiet_gc  # (tens of thousands of records: no collection walks them meanwhile)
def _info(engine: Engine, folder: str, step: int) -> dict[str, TensorInfo]:
    """:meth:`TensorStore.info` (tens of thousands of tensors: in a worker, helper-51: 100 ms on the loop)."""
    src = sources.step(engine, folder, step)
    return {n: TensorInfo(n, e.dtype, e.shape, e.nbytes) for e in src.entries for n in e.names}


__all__ = ["TensorStore"]
