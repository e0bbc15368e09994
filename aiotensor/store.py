"""TensorStore: a folder of committed, checksummed checkpoints, saved in the background.

Layout::

    root/
      step-000000000100/          committed: manifest.json + shard-00000.safetensors ...
      step-000000000200.tmp-ab12/ being written (or left by a crash): never read, removed at open
      latest                      name of the newest committed step (for other tools)

A step folder appears under its final name only after every file in it and the folder itself are
durable (the rename is the commit point), so a crash at any moment leaves either the old set of
checkpoints or the old set plus a complete new one. One process writes to a root at a time.
"""

from __future__ import annotations

import os
import re
import uuid
from collections import Counter
from collections.abc import Generator
from types import TracebackType
from typing import Any

import anyio
import torch

from . import _io, cuda
from ._plan import SavePlan, plan_save
from .buffers import StagingPool, round_up
from .engines import Engine
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ManifestError,
    SaveCancelledError,
    SaveFailedError,
    StoreClosedError,
    annotate_oserror,
)
from .formats import manifest as mf
from .formats.tree import flatten, unflatten
from .scheduler import MiB, Priority, Scheduler, run_concurrently

_STEP_DIR = re.compile(r"step-(\d{12})")
MANIFEST = "manifest.json"
LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step-{step:012d}"


class _Signal:
    """An awaitable stage of a save (``handle.staged``); awaiting it twice is fine."""

    def __init__(self, handle: SaveHandle, event: anyio.Event) -> None:
        self._handle = handle
        self._event = event

    def __await__(self) -> Generator[Any, None, None]:
        return self._handle._wait(self._event).__await__()


class SaveHandle:
    """A save in flight. ``await handle`` waits until the checkpoint is committed and durable.

    ``await handle.staged`` waits until every tensor has been copied out: from then on the caller
    may change its tensors; the checkpoint holds the values they had when ``save`` was called.

    Cancellation: cancelling a task that awaits the handle (or ``handle.staged``) cancels the save
    itself: its temporary folder is removed, earlier checkpoints are untouched, and the await
    returns (raising the cancellation) only after the save has stopped. To wait without that
    effect, shield the await (``anyio.CancelScope(shield=True)``). ``handle.cancel()`` cancels it
    without waiting; awaiting it afterwards raises :class:`~aiotensor.errors.SaveCancelledError`.
    """

    def __init__(self, step: int, nbytes: int) -> None:
        self.step = step
        self.nbytes = nbytes
        self._staged_event = anyio.Event()
        self._done_event = anyio.Event()
        self.staged = _Signal(self, self._staged_event)
        self._scope: anyio.CancelScope | None = None
        self._cancel_requested = False
        self._error: BaseException | None = None
        self.observed = False
        self.stage_seconds: float | None = None  # save() to staged
        self.commit_seconds: float | None = None  # save() to committed

    def __repr__(self) -> str:
        state = "done" if self.done() else ("staged" if self._staged_event.is_set() else "staging")
        return f"<SaveHandle step={self.step} {state}>"

    def done(self) -> bool:
        return self._done_event.is_set()

    def exception(self) -> BaseException | None:
        """The failure of a finished save (None while running or on success)."""
        return self._error

    def cancel(self) -> None:
        """Ask the save to stop; it cleans up in the background. A committed save stays committed."""
        self._cancel_requested = True
        if self._scope is not None:
            self._scope.cancel()

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait(self._done_event).__await__()

    async def _wait(self, event: anyio.Event) -> None:
        try:
            await event.wait()
        except anyio.get_cancelled_exc_class():
            self.cancel()
            with anyio.CancelScope(shield=True):
                await self._done_event.wait()
            raise
        if self._error is not None and (event is self._done_event or not self._staged_event.is_set()):
            self.observed = True
            raise self._error

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._staged_event.set()  # wakes staged-waiters of a failed save too (they see the error)
        self._done_event.set()


class TensorStore:
    """Checkpoints of nested state (state_dicts, optimizer state, Python scalars) in a folder.

    Use it as ``async with TensorStore(root) as store``: leaving the block waits for the saves in
    flight (or cancels them, when it is left by an exception).

    Args:
        root: the folder (created if missing).
        keep_last: after each commit, delete all but the newest ``keep_last`` steps (None: keep all).
            Older steps are retired (renamed away, durably) before the save's handle completes;
            their files are deleted in the background, and ``close`` waits for that.
        engine: the I/O engine (default: posix); tests pass a fault-injecting one.
        workers: worker threads for I/O and staging copies.
        chunk_bytes: the largest piece of one I/O call.
        batch_bytes: the most bytes one worker-thread call moves before it returns to the loop
            (smaller: priorities act sooner; larger: fewer loop round trips).
        shard_bytes: the largest shard file (a tensor is never split).
        max_staged: staging arenas, so saves that may be staged or writing at once; a further
            ``save`` waits for an arena before staging (memory stays ``max_staged`` × state size).
        verify: check crc32c on load (default); ``load(verify=False)`` skips it per call.

    Tensors sharing memory: keys that are the very same view of one storage (tied weights) are
    stored once; ``load()`` gives them back as one tensor object, and ``load(into=...)`` fills
    each target. Partly overlapping views are stored separately and come back unshared.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        engine: Engine | None = None,
        workers: int = 4,
        chunk_bytes: int = 16 * MiB,
        batch_bytes: int = 64 * MiB,
        shard_bytes: int = 4 << 30,
        max_staged: int = 2,
        verify: bool = True,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
        self.root = os.fspath(root)
        self.keep_last = keep_last
        self.shard_bytes = shard_bytes
        self.verify = verify
        self.scheduler = Scheduler(engine, workers=workers, chunk_bytes=chunk_bytes, batch_bytes=batch_bytes)
        cuda_ = self.scheduler.cuda
        self.staging = StagingPool(max_staged, pinning=cuda_.pinning if cuda_ is not None else None)
        self._committed: set[int] = set()
        self._in_flight: dict[int, SaveHandle] = {}
        self._readers: Counter[int] = Counter()
        self._tg: anyio.abc.TaskGroup | None = None  # None once closing: no new saves or loads
        self._group: anyio.abc.TaskGroup | None = None  # the same group, until close() returns
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
        """Create the root if needed, remove leftovers of interrupted saves, list committed steps."""
        if self._tg is not None:
            raise RuntimeError("store is already open")
        await self._call(_ensure_dir, self.root)
        await self.refresh(clean=True)
        self._commit_lock = anyio.Lock()
        self._tg = self._group = anyio.create_task_group()
        await self._tg.__aenter__()

    async def close(self, *, cancel: bool = False) -> None:
        """Wait for the saves in flight (cancel them with ``cancel=True``), then free staging memory.

        Raises:
            SaveFailedError: a save failed and its handle was never awaited.

        Cancellation: cancelling ``close`` cancels the saves in flight; it returns once they stopped.
        """
        tg, self._tg = self._tg, None
        if tg is None:
            return
        if cancel:
            tg.cancel_scope.cancel()
        try:
            await tg.__aexit__(None, None, None)
        except BaseException:
            tg.cancel_scope.cancel()
            raise
        finally:
            self._group = None
            with anyio.CancelScope(shield=True):  # unmapping gigabytes takes a while: not on the loop
                await anyio.to_thread.run_sync(self._free_memory)
        self._raise_unobserved()

    def _free_memory(self) -> None:
        self.staging.close()
        self.scheduler.close()

    def _raise_unobserved(self) -> None:
        failed = [h for h in self._unobserved if not h.observed]
        self._unobserved.clear()
        if failed:
            h = failed[0]
            h.observed = True
            raise SaveFailedError(f"the background save of step {h.step} failed and was never awaited") from h.exception()

    async def refresh(self, *, clean: bool = False) -> list[int]:
        """Re-list committed steps from disk (another process may have written); optionally clean up.

        With ``clean``, leftovers of interrupted saves (``*.tmp-*``) are removed: only do that when
        no other process saves into this root.
        """
        names = await self._call(self.engine.listdir, self.root)
        steps = set()
        for n in names:
            m = _STEP_DIR.fullmatch(n)
            if m:
                steps.add(int(m.group(1)))
            elif clean and ".tmp-" in n:
                await self._call(self.engine.remove_tree, os.path.join(self.root, n))
        self._committed = steps
        return self.steps()

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

    def save(self, step: int, state: Any, *, background: bool = False) -> SaveHandle:
        """Start saving ``state`` as ``step``; returns at once with a :class:`SaveHandle`.

        ``await store.save(step, state)`` returns once the checkpoint is committed and durable;
        ``await handle.staged`` returns once the tensors are copied out. ``background=True`` runs
        the save's I/O behind loads and foreground saves.

        Raises (at once, nothing written):
            StoreClosedError: the store is not open.
            StateError: a leaf that cannot be stored (named by its key path), or an unsupported tensor.
            CheckpointExistsError: the step is committed already, or being saved.
            SaveFailedError: an earlier background save failed and its handle was never awaited.

        Awaiting the handle raises the save's failure: ``OSError`` (disk full, I/O error, naming the
        file) or :class:`~aiotensor.errors.SaveCancelledError`. A failed save leaves nothing behind.

        Cancellation: see :class:`SaveHandle`.
        """
        if self._tg is None:
            raise StoreClosedError("the store is not open: use `async with TensorStore(...) as store`")
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 10**12:
            raise ValueError(f"step must be an int in [0, 10**12), got {step!r}")
        self._raise_unobserved()
        if step in self._committed or step in self._in_flight:
            where = "committed" if step in self._committed else "being saved"
            raise CheckpointExistsError(f"step {step} is already {where} in {self.root}")
        plan, sources = plan_save(state, shard_bytes=self.shard_bytes, devices=self.scheduler.devices)
        # CUDA sources are copied as of now: after the kernels already queued on their streams
        producers = cuda.record_producers(sources.values()) if self.scheduler.cuda is not None else {}
        handle = SaveHandle(step, plan.nbytes)
        self._in_flight[step] = handle
        prio = Priority.BACKGROUND if background else Priority.SAVE
        self._tg.start_soon(self._run_save, handle, plan, sources, prio, producers)
        return handle

    async def _run_save(
        self, h: SaveHandle, plan: SavePlan, sources: dict[str, torch.Tensor], prio: int, producers: dict[Any, Any]
    ) -> None:
        error: BaseException | None = None
        try:
            with anyio.CancelScope() as scope:
                h._scope = scope
                if h._cancel_requested:
                    scope.cancel()
                await self._save(h, plan, sources, prio, producers)
            if scope.cancelled_caught:
                error = SaveCancelledError(f"the save of step {h.step} was cancelled; nothing was committed")
        except Exception as e:
            error = e
        except BaseException:  # the store itself is being cancelled
            error = SaveCancelledError(f"the save of step {h.step} was cancelled; nothing was committed")
            raise
        finally:
            del self._in_flight[h.step]
            if isinstance(error, Exception) and not isinstance(error, SaveCancelledError):
                self._unobserved.append(h)
            h._finish(error)

    async def _save(
        self, h: SaveHandle, plan: SavePlan, sources: dict[str, torch.Tensor], prio: int, producers: dict[Any, Any]
    ) -> None:
        t0 = anyio.current_time()
        arena = await self.staging.acquire(plan.arena_bytes)
        try:
            pieces = await _io.stage(self.scheduler, plan, sources, arena, prio, producers)
            sources.clear()  # the caller's tensors are free to change from here on
            h.stage_seconds = anyio.current_time() - t0
            h._staged_event.set()
            await self._write(h.step, plan, arena, pieces, prio)
            h.commit_seconds = anyio.current_time() - t0
        finally:
            self.staging.release(arena)

    async def _write(self, step: int, plan: SavePlan, arena: Any, pieces: Any, prio: int) -> None:
        final = self.path(step)
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        eng = self.engine
        await self._call(eng.mkdir, tmp, what=f"creating {tmp}")
        committed = False
        crcs: dict[str, int] = {}
        try:

            async def checksum() -> None:
                crcs.update(await _io.checksums(self.scheduler, plan, pieces, arena, prio))

            async def write() -> None:
                for sh in plan.shards:  # each image padded to whole pages: written with O_DIRECT
                    size = sh.layout.file_size
                    image = arena.view[sh.arena_offset : sh.arena_offset + round_up(size)]
                    await _io.write_file(self.scheduler, os.path.join(tmp, sh.file), [(0, image)], prio, size=size)

            await run_concurrently(checksum, write)
            manifest = mf.Manifest(
                step=step,
                tree=plan.tree,
                shards={sh.file: sh.layout.file_size for sh in plan.shards},
                entries={s.key: mf.Entry(sh.file, s, crcs[s.key]) for sh in plan.shards for s in sh.layout.tensors},
                aliases=plan.aliases,
            )
            await _io.write_file(self.scheduler, os.path.join(tmp, MANIFEST), [(0, memoryview(mf.dumps(manifest)))], prio)
            await self._call(eng.sync_dir, tmp, what=f"syncing {tmp}")
            assert self._commit_lock is not None
            # past this point the save completes even if cancelled: a rename that ran in its
            # thread must be followed by the fsync that makes it durable, and by `latest`
            with anyio.CancelScope(shield=True):
                await self._commit(step, tmp, final)
                committed = True
        except BaseException:
            if not committed:
                with anyio.CancelScope(shield=True):
                    await self._call(eng.remove_tree, tmp)
            raise

    async def _commit(self, step: int, tmp: str, final: str) -> None:
        eng = self.engine
        assert self._commit_lock is not None
        async with self._commit_lock:  # one commit at a time, so `latest` only moves forward
            await self._call(eng.rename, tmp, final, what=f"renaming {tmp} to {final}")
            try:
                await self._call(eng.sync_dir, self.root, what=f"syncing {self.root}")
            except BaseException:
                await self._call(eng.rename, final, tmp)  # not known durable: not committed
                raise
            self._committed.add(step)
            if step == self.latest():
                await self._write_latest(step)
            await self._retain()

    async def _write_latest(self, step: int) -> None:
        eng = self.engine
        tmp = os.path.join(self.root, f"{LATEST}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            await _io.write_file(self.scheduler, tmp, [(0, memoryview((step_dir_name(step) + "\n").encode()))])
            await self._call(eng.rename, tmp, os.path.join(self.root, LATEST), what=f"replacing {LATEST}")
            await self._call(eng.sync_dir, self.root, what=f"syncing {self.root}")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._call(eng.remove_tree, tmp)
            raise

    async def _retain(self) -> None:
        """Retire steps beyond ``keep_last`` (never the newest, never one being loaded): each is
        renamed away durably here, and its files are deleted in the background."""
        if self.keep_last is None:
            return
        old = self.steps()[: -self.keep_last]
        eng = self.engine
        for step in old:
            if self._readers[step]:
                continue  # retried after the next commit
            self._committed.discard(step)
            # rename first: a half-deleted folder must never look like a checkpoint
            doomed = f"{self.path(step)}.tmp-del{uuid.uuid4().hex[:8]}"
            await self._call(eng.rename, self.path(step), doomed, what=f"retiring step {step}")
            await self._call(eng.sync_dir, self.root)
            # deleting the files is housekeeping: it runs after the save reports its commit (a
            # crash before it ends leaves a `.tmp-` folder that the next open removes)
            assert self._group is not None
            self._group.start_soon(self._remove_retired, doomed)

    async def _remove_retired(self, path: str) -> None:
        with anyio.CancelScope(shield=True):  # a store closed with cancel=True still deletes them
            try:
                await self.scheduler.call(self.engine.remove_tree, path, priority=Priority.BACKGROUND)
            except OSError:
                pass  # left as a `.tmp-` folder: removed by the next open(), never read as a step

    # --- load ------------------------------------------------------------------------------

    async def load(
        self, step: int | None = None, *, into: Any = None, verify: bool | None = None, device: str | torch.device = "cpu"
    ) -> Any:
        """Load a committed step (default: the newest) as the nested state it was saved as.

        With ``into`` (a state of the same structure, e.g. ``{"model": model.state_dict(), ...}``),
        tensors are read straight into its tensors, in place; the returned state holds those tensors
        and the saved non-tensor values. ``into`` tensors may be on CUDA; without ``into``, new
        tensors are made on ``device`` (``"cuda"``: read straight into GPU memory by the kvikio
        engine, else through pinned bounce slots and a copy stream; complete when this returns).

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
        if self._tg is None:
            raise StoreClosedError("the store is not open: use `async with TensorStore(...) as store`")
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.root}")
        if step not in self._committed:
            raise CheckpointNotFoundError(
                f"no committed checkpoint for step {step} in {self.root} (committed: {self.steps()[-10:]})"
            )
        self._readers[step] += 1
        try:
            verify = self.verify if verify is None else verify
            return await load_checkpoint(self.scheduler, self.path(step), into=into, verify=verify, device=device)
        except FileNotFoundError as e:
            if await self._call(self.engine.exists, self.path(step)):
                raise
            self._committed.discard(step)
            raise CheckpointNotFoundError(
                f"step {step} was retired while it was being loaded (by another process writing to {self.root})"
            ) from e
        finally:
            self._readers[step] -= 1

    async def _call(self, fn: Any, *args: Any, what: str | None = None) -> Any:
        try:
            return await self.scheduler.call(fn, *args, priority=Priority.SAVE)
        except OSError as e:
            raise annotate_oserror(e, what or f"{getattr(fn, '__name__', fn)} {args[0] if args else ''}") from e


def _ensure_dir(path: str) -> None:
    os.makedirs(path, exist_ok=True)


async def load_checkpoint(
    sched: Scheduler, folder: str, *, into: Any = None, verify: bool = True, device: str | torch.device = "cpu"
) -> Any:
    """Load one checkpoint folder (see :meth:`TensorStore.load`)."""
    dev = _io.check_device(sched, device)
    mpath = os.path.join(folder, MANIFEST)
    m = mf.loads(await _io.read_bytes(sched, mpath, mf.MAX_MANIFEST_BYTES, ManifestError, "the manifest"), mpath)
    by_shard: dict[str, list[mf.Entry]] = {shard: [] for shard in m.shards}
    for e in m.entries.values():
        by_shard[e.shard].append(e)
    fds: dict[str, int] = {}
    try:
        # every shard's header and size must agree with the manifest before anything is allocated:
        # a hostile manifest cannot make us allocate what the files do not hold
        for shard, size in m.shards.items():
            path = os.path.join(folder, shard)
            fds[shard] = await _io.open_read(sched, path)
            layout = await _io.read_layout(sched, fds[shard], path)
            listed = {e.spec.key: e.spec for e in by_shard[shard]}
            if layout.file_size != size or {s.key: s for s in layout.tensors} != listed:
                raise ManifestError(f"shard {shard} does not hold the tensors the manifest lists for it", mpath)
        dest = _destinations(m, into, dev, sched.devices)
        for shard, fd in fds.items():
            targets = [_io.Target(e.spec, dest[e.spec.key], e.crc32c if verify else None) for e in by_shard[shard]]
            await _io.read_tensors(sched, fd, os.path.join(folder, shard), targets, Priority.LOAD)
    finally:
        for fd in fds.values():
            await _io.close(sched, fd)
    for alias, target in m.aliases.items():
        if alias not in dest:
            dest[alias] = dest[target]
        elif not _same_view(dest[alias], dest[target]):
            await sched.call(dest[alias].copy_, dest[target], priority=Priority.LOAD)
    return unflatten(m.tree, dest.__getitem__, mpath)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape


def _destinations(m: mf.Manifest, into: Any, device: torch.device, devices: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Tensors to read into: ``into``'s (checked against the manifest), or new ones."""
    if into is None:
        return {k: _io.new_tensor(e.spec, device) for k, e in m.entries.items()}
    _, tensors = flatten(into)
    given = dict(tensors)
    specs = {k: e.spec for k, e in m.entries.items()} | {a: m.entries[t].spec for a, t in m.aliases.items()}
    _io.check_into(given, specs, devices, "the checkpoint")
    return given


__all__ = ["SaveHandle", "TensorStore", "load_checkpoint", "step_dir_name"]
