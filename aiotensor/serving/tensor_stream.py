"""``aiotensor.stream``: the tensors of a source as ``(name, tensor)`` pairs, as soon as their bytes
land, read ahead within a window, small neighbours read together."""

from __future__ import annotations

import functools
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from itertools import compress
from operator import attrgetter, is_not, itemgetter
from types import TracebackType
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
import torch

from .. import commit, knobs, sources
from .._io.assemble import Assembly, DtypeRule, Entry, check_rule, finish, prepare, read_named, stored_bytes
from .._io.read import Check, close, open_read
from .._io.tensors import check_device
from .._runtime import cuda, threads
from .._runtime.scheduler import Priority, Scheduler
from ..engines import Engine
from ..errors import CheckpointNotFoundError, MismatchError, StreamClosedError
from ..location import engine_for, local_path

Keys = sources.Keys
_Batch = tuple[list[Entry], list[tuple[str, ...]], int, list[str]]  # entries, their names, bytes, files


class _Plan(NamedTuple):
    tensors: int  # how many are read
    batches: list[_Batch]
    hold: list[str]  # the files opened before the first read (a checkpoint's: see _HOLD)
    step: int | None  # a checkpoint step's number, or None
    checks: dict[str, Check]  # what each file must pass as it is opened (Source.checks)


def _planned(engine: Engine, source: str, keys: Keys, rows: Mapping[str, tuple[int, int]], batch_bytes: int) -> _Plan:
    """What the stream reads (:func:`aiotensor.sources.resolve`, ``keys`` and ``rows`` applied), in
    the batches read together: runs of entries of one file of at most ``batch_bytes`` and
    :data:`knobs.STREAM_BATCH_TENSORS` units (a unit: an entry, or the run of entries over one
    storage, which is never split apart) (blocking)."""
    src = sources.resolve(engine, source)
    chosen = sources.select(src, keys)
    if rows:
        selected = {n for _, names in chosen for n in names}
        unknown = sorted(set(rows) - selected)
        if unknown:
            raise MismatchError(f"{src.path}: rows= names {unknown[:5]}, which this stream does not read")
        chosen = [piece for e, names in chosen for piece in _sliced(e, names, rows, src.path)]
    entries = [e for e, _ in chosen]
    spans = [e.parts[0].span for e in entries]
    # units: runs of entries over one span (a storage's views go together), and the bytes of each
    starts = [0, *compress(range(1, len(spans)), map(is_not, spans[1:], spans))] if spans else []
    ends = [*starts[1:], len(spans)] if spans else []
    one = max(map(len, map(_PARTS, entries)), default=1) == 1
    sizes = [
        spans[a].spec.nbytes if one and b - a == 1 else stored_bytes(entries[a:b]) for a, b in zip(starts, ends, strict=True)
    ]
    batches: list[_Batch] = []

    def cut(a: int, b: int, nbytes: int) -> None:
        files = [spans[a].path] if one else list(dict.fromkeys(p.span.path for e in entries[a:b] for p in e.parts))
        batches.append((entries[a:b], [names for _, names in chosen[a:b]], nbytes, files))

    lo = size = units = 0  # the batch being made: its first entry, bytes and units
    for a, n in zip(starts, sizes, strict=True):
        if a > lo and (size + n > batch_bytes or units == knobs.STREAM_BATCH_TENSORS or spans[a].path != spans[lo].path):
            cut(lo, a, size)
            lo, size, units = a, 0, 0
        size += n
        units += 1
    if spans:
        cut(lo, len(spans), size)
    files = list(dict.fromkeys(f for b in batches for f in b[3]))
    hold = files if src.kind in ("step", "root", "dcp") and len(files) <= _HOLD else []
    return _Plan(len(chosen), batches, hold, src.step, src.checks)


# a checkpoint's files (at most this many) are all opened before the first read: its writer's
# retention, or a delete, may retire the step meanwhile, and open files read on (helper-51: a
# stream of a store root raced retention and ended with a bare FileNotFoundError halfway)
_HOLD = 64


_PARTS = attrgetter("parts")


def _why(e: BaseException, what: str) -> str:
    """Why a stream closed part way: ``what`` was cancelled, or failed with ``e``."""
    if isinstance(e, (anyio.get_cancelled_exc_class(), KeyboardInterrupt, SystemExit)):
        return f"{what} was cancelled"
    return f"{what} failed: {type(e).__name__}"


def _pairs(names: list[tuple[str, ...]], got: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs a batch hands out, in reverse order (taken by ``pop()``): a
    tensor under each of its names (a tied weight), one after the other."""
    if max(map(len, names), default=1) == 1:
        pairs = list(zip(map(_FIRST, names), got, strict=True))  # C loops: thousands of tensors
    else:
        pairs = [(n, t) for ns, t in zip(names, got, strict=True) for n in ns]
    pairs.reverse()
    return pairs


_FIRST = itemgetter(0)


def _sliced(
    e: Entry, names: tuple[str, ...], rows: Mapping[str, tuple[int, int]], path: str
) -> list[tuple[Entry, tuple[str, ...]]]:
    """``e`` (under ``names``) as the stream reads it: whole under the names without ``rows``, and
    a slice under each name with them (a tied weight's second name's rows were ignored: helper-41)."""
    whole = tuple(n for n in names if n not in rows)
    return [(e, whole)] * bool(whole) + [(sources.with_rows(e, rows[n], path), (n,)) for n in names if n in rows]


def _prepare(entries: list[Entry], device: torch.device, verify: bool, stream: Any) -> Assembly:
    """What ``entries`` are read into (CUDA memory allocated on the consumer's ``stream``, which the
    caching allocator ties it to, as if the consumer had made it)."""
    with cuda.on_streams([stream]):
        return prepare(entries, device, verify)


def _finish(a: Assembly, names: list[str], dtype: DtypeRule, stream: Any) -> list[torch.Tensor]:
    """The tensors handed out, ``dtype`` applied, on the consumer's CUDA ``stream`` (its own work is
    then ordered after them)."""
    with cuda.on_streams([stream]):
        return finish(a, names, dtype)


class _Stream:
    """A :class:`TensorStream`'s reading and what it landed: what its reader task holds, never the
    TensorStream a consumer holds (so that dropping that one closes this)."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        """``args``: :class:`TensorStream`'s, in its order."""
        source, device, dtype, keys, rows, window_bytes, verify, scheduler, storage_options = args
        if window_bytes < 1:
            raise ValueError(f"window_bytes must be >= 1, got {window_bytes}")
        check_rule(dtype)
        self.source = local_path(source, objects=True)
        self.dtype = dtype
        self.window_bytes = window_bytes
        self.verify = verify
        self._keys = keys
        self._rows = dict(rows or {})
        self._own = scheduler is None
        engine = engine_for(self.source, scheduler, storage_options)  # an object needs an engine of its own
        self.scheduler = scheduler if scheduler is not None else Scheduler(engine)
        self.device = check_device(self.scheduler, device)
        # the stream CUDA tensors are made and finished on, in worker threads: the caller's (taken
        # at the first read where torch has not initialized CUDA yet: asking would, here)
        cuda_in_use = self.device.type == "cuda" and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        self._stream = torch.cuda.current_stream(self.device) if cuda_in_use else None
        self.bytes_read = 0
        self._batch_bytes = min(window_bytes, knobs.STREAM_BATCH_BYTES)
        self._batches: list[_Batch] | None = None
        self._hold: list[str] = []
        self._checks: dict[str, Check] = {}
        self._step: int | None = None
        # read ahead, by batch: its (name, tensor) pairs in reverse order (a tied tensor once per
        # name), or the error the consumer gets there
        self._ready: dict[int, list[tuple[str, torch.Tensor]] | BaseException] = {}
        self._next = 0  # the batch the consumer takes next
        self._run: list[tuple[str, torch.Tensor]] = []  # what is left of the batch taken, reversed
        self._run_bytes = 0  # the window's bytes that batch gives back once it is all taken
        self._failed = False
        self._error: Exception | None = None  # what ended the reader before a batch could say it
        self._ahead = 0  # bytes in _ready and in flight
        self._flying = 0  # tensors in flight
        self._changed = anyio.Event()  # set, and replaced, when something changed that a waiter wants
        self._waiting = False  # anyone waiting on _changed (a new Event per tensor cost 13 us)
        self._reader: anyio.CancelScope | None = None
        self._reader_done: anyio.Event | None = None
        self._closed = False
        self._cut: str | None = None  # why it closed before its end, where it did (StreamClosedError)
        self._yielded = 0.0  # when the consumer last let other tasks run
        self._later: Callable[[Callable[[], Awaitable[None]]], None] | None = None  # spawns on its loop, from any thread

    async def next(self, owner: object) -> tuple[str, torch.Tensor]:
        """The next pair; ``owner`` (the TensorStream) is held meanwhile: ``await anext(stream(...))``
        holds no other reference to it, and its collection would close the stream under this call."""
        if not self._closed and time.perf_counter() - self._yielded > knobs.YIELD_S:
            await self._wait(ready=True)
        if self._closed:
            if self._cut is not None:  # (ending as if done: a consumer that went on after a timeout had half a model)
                raise StreamClosedError(f"the stream of {self.source} was closed part way ({self._cut}); open a new stream")
            raise StopAsyncIteration
        if self._run:  # the rest of a batch that landed: ~1 us a tensor
            return self._take()
        if self._batches is None:
            sched = self.scheduler
            try:
                if self.device.type == "cuda" and self._stream is None:  # this process's first CUDA use
                    await cuda.initialized(self.device)
                    self._stream = torch.cuda.current_stream(self.device)
                with sched.operation():
                    plan = await sched.call(
                        _planned, sched.engine, self.source, self._keys, self._rows, self._batch_bytes, priority=Priority.LOAD
                    )
            except BaseException as e:
                self._cut = _why(e, "its opening")
                with anyio.CancelScope(shield=True):
                    await self._close()
                raise
            self._batches, self._hold, self._step, self._checks = plan.batches, plan.hold, plan.step, plan.checks
            self._start_reader()
        while self._next not in self._ready:
            if self._next >= len(self._batches):
                await self._close()
                raise StopAsyncIteration
            if self._reader_done is not None and self._reader_done.is_set():  # it stopped before the end
                why = self._error or StreamClosedError(f"the stream of {self.source} stopped before its end")
                self._cut = _why(why, "its reader")
                await self._close()
                raise why  # (ending as if done handed out part of the tensors without a word, helper-67)
            await self._wait()
        got = self._ready.pop(self._next)
        if isinstance(got, BaseException):
            self._cut = _why(got, "a read")
            await self._close()
            raise got
        self._run, self._run_bytes = got, self._batches[self._next][2]
        self._next += 1
        return self._take()

    def _take(self) -> tuple[str, torch.Tensor]:
        """The next pair of the batch taken; its last gives the batch's bytes back to the window."""
        pair = self._run.pop()
        if not self._run:
            self._ahead -= self._run_bytes
            self._notify()
        return pair

    async def _wait(self, ready: bool = False) -> None:
        """Wait for the reader to land something (``ready``: only let other tasks run); if
        cancelled meanwhile, the stream is closed."""
        try:
            await (anyio.lowlevel.checkpoint() if ready else self._next_change())
        except BaseException as e:
            self._cut = _why(e, "a wait for its next tensor")
            with anyio.CancelScope(shield=True):
                await self._close()
            raise
        self._yielded = time.perf_counter()

    def _notify(self) -> None:
        if self._waiting:
            self._changed.set()
            self._changed = anyio.Event()
            self._waiting = False

    def _start_reader(self) -> None:
        self._reader_done = anyio.Event()
        self._later = threads.spawner()
        threads.spawn(self._read_all)

    def abandon(self) -> None:
        """Its TensorStream was collected unclosed (on any thread): close it on its event loop,
        what it holds let go in a worker thread, not awaited (its loop may be ending)."""
        if not self._closed and self._later is not None:
            self._later(functools.partial(self._close, False))

    async def _read_all(self) -> None:
        """Read the batches in order, up to ``workers`` at once and ``window_bytes`` ahead of the
        consumer; each file is opened once. Results land in ``_ready`` by index; the first error
        ends it."""
        assert self._reader_done is not None and self._batches is not None
        fds: dict[str, int] = {}
        slots = anyio.Semaphore(self.scheduler.workers)
        # batches of many small tensors are Python work, and more than two at once shared the GIL with
        # the loop's thread, which then waited for it far more often (knobs): from a local file, at most
        # that many tensors are in flight (one batch at least); an object store's reads wait on latency
        local = self.scheduler.engine.read_bytes is None
        most = knobs.STREAM_BATCHES_IN_FLIGHT * knobs.STREAM_BATCH_TENSORS if local else 1 << 62
        try:
            with anyio.CancelScope() as scope:
                self._reader = scope
                async with anyio.create_task_group() as tg:
                    for batch, (entries, names, nbytes, files) in enumerate(self._batches):
                        while (self._ahead and self._ahead + nbytes > self.window_bytes) or (
                            self._flying and self._flying + len(entries) > most
                        ):
                            await self._next_change()
                        if self._closed or self._failed:
                            break
                        await slots.acquire()
                        try:  # (a checkpoint's files all with the first batch: _HOLD)
                            for path in [*self._hold, *files] if batch == 0 else files:
                                if path not in fds:
                                    fds[path] = await open_read(self.scheduler, path, self._checks.get(path))
                        except Exception as e:  # the consumer gets it where that file's tensors begin
                            slots.release()
                            self._failed = True
                            self._ready[batch] = await self._gone(e)
                            break
                        self._ahead += nbytes
                        self._flying += len(entries)
                        tg.start_soon(self._read_batch, batch, entries, names, nbytes, fds, slots)
        except Exception as e:  # (the consumer gets it where the batches it waits for stop)
            self._failed, self._error = True, e
        finally:
            try:
                await close(self.scheduler, *fds.values())
            finally:
                self._reader_done.set()
                self._notify()

    async def _gone(self, e: Exception) -> Exception:
        """``e`` as the consumer gets it: a checkpoint's file missing is its step retired meanwhile,
        or, where the step is still committed, the step damaged (helper-60: verify said retired)."""
        if not (isinstance(e, FileNotFoundError) and self._step is not None):
            return e
        folder = os.path.dirname(e.filename) if isinstance(e.filename, str) else ""
        if folder:
            try:
                broken = await self.scheduler.call(
                    commit.damaged, self.scheduler.engine, folder, self._step, e, priority=Priority.LOAD
                )
            except Exception as failed:  # (an object store's HEAD timing out): the read's own error
                e.add_note(f"whether step {self._step} is damaged or was retired is unknown: {type(failed).__name__}: {failed}")
                return e
            if broken is not None:
                return broken
        return CheckpointNotFoundError(
            f"step {self._step} was retired (by its writer's retention, or deleted) before it could be read: "
            f"{e.filename} is gone; stream the store's newest step again"
        )

    async def _read_batch(
        self,
        batch: int,
        entries: list[Entry],
        names: list[tuple[str, ...]],
        nbytes: int,
        fds: dict[str, int],
        slots: anyio.Semaphore,
    ) -> None:
        """Read ``entries`` (the ``batch``-th batch) into new tensors; its pairs, or its error, land
        in ``_ready[batch]``."""
        sched = self.scheduler
        try:
            with sched.operation():
                a = await sched.call(_prepare, entries, self.device, self.verify, self._stream, priority=Priority.LOAD, home=True)
                for path, targets in a.targets.items():
                    await read_named(sched, fds[path], path, targets, entries)
                self.bytes_read += nbytes
                first = list(map(_FIRST, names))
                if a.copies or self.dtype is not None:
                    got = await sched.call(_finish, a, first, self.dtype, self._stream, priority=Priority.LOAD)
                else:  # nothing to finish: no hop to a thread
                    got = a.out
        except Exception as e:
            self._failed = True
            self._ready[batch] = e
        else:
            self._ready[batch] = _pairs(names, got)
        finally:
            slots.release()
            self._flying -= len(entries)
        self._notify()

    async def _next_change(self) -> None:
        self._waiting = True
        await self._changed.wait()

    async def _close(self, wait: bool = True) -> None:
        """:meth:`TensorStream.aclose`; without ``wait``, what it read ahead and its own scheduler
        are let go in a worker thread once no thread writes any more, not awaited."""
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
        await threads.finish(functools.partial(self._let_go, wait))  # (a Task.cancel() cut it short: helper-51)

    async def _let_go(self, wait: bool) -> None:
        if self._reader_done is not None:
            await self._reader_done.wait()
        self._ahead = 0
        held = (self._ready, self._batches or [], self._run)
        self._ready, self._batches, self._run = {}, [], []
        close = self.scheduler.close if self._own else None
        self._own = False
        if not wait:
            self.scheduler.discard_later(*held, then=close)
            return
        await self.scheduler.discard(*held)
        if close is not None:
            await anyio.to_thread.run_sync(close)


class TensorStream:
    """``async for name, tensor in aiotensor.stream(source, ...)``: the tensors of ``source`` (a
    safetensors file, a Hugging Face folder, a torch.save zip, an aiotensor checkpoint step or store
    root) as ``(name, tensor)`` pairs in file order, as soon as their bytes land: small neighbours
    are read together (up to :data:`knobs.STREAM_BATCH_TENSORS` tensors and :data:`knobs.STREAM_BATCH_BYTES`) and handed out
    together, a bigger tensor alone.

    ``keys`` selects what is read: one name, names and prefixes (a prefix ends with ``.``), or a
    predicate; the bytes of other tensors are never read, and a name or prefix that selects nothing
    is an error. ``rows={"name": (a, b)}`` reads only rows ``a:b`` along dim 0 of that tensor (a
    tensor-parallel shard; its checksum covers the whole tensor, so a row slice is not verified): a
    tensor whose bytes lie in one piece (safetensors, a step, a torch.save tensor that is a contiguous
    view, a DCP tensor one process saved); one in chunks of several ranks is a MismatchError.
    ``dtype`` converts floating-point tensors as they arrive, as ``nn.Module.to(dtype)`` does,
    packed 4-bit ones excepted (``dtype=lambda name, d: torch.bfloat16`` converts every tensor;
    return None to keep one; anything else is a TypeError, raised here).
    Tensors of a torch.save file that share a storage come as views of it, as ``torch.load`` makes
    them. Several streams may share one ``scheduler`` (loads run before saves on it). A checkpoint's
    files (a store root's newest step, a step, at most 64 files) are opened before the first read:
    its writer's retention may retire the step meanwhile, and the stream reads on.

    Raises (from the iteration): CheckpointNotFoundError (nothing there, a store root with no
    committed step, or a step retired before its files were opened), MismatchError (``keys`` or
    ``rows`` name what is not there), HeaderError / ManifestError (a malformed file, index or
    metadata, naming it), UnsafeFileError (a torch.save file that needs more than a state_dict's
    pickle), ChecksumError (a corrupt tensor of a checksummed file or checkpoint), OSError. An
    error is raised where its batch begins: the tensors read with a corrupt one are not handed out.

    Up to ``window_bytes`` of tensors are read ahead of the consumer (a tensor larger than the
    window is read alone); a slow consumer holds the reading back. Use it as an async context
    manager (``async with stream(...) as s: async for ... in s``) or call :meth:`aclose` when
    breaking out early: that stops every read at once and frees what was read ahead. A stream
    dropped without either (a ``break`` or ``return`` out of ``async for``, a consumer task
    cancelled) is closed as soon as it is collected: its reads stop, its files are closed and what
    it read ahead is freed.

    ``storage_options``: for an ``s3://`` path, obstore's S3 keys (``endpoint``, ``access_key_id``,
    ``region``..., and ``allow_http``) over the ``AWS_*`` environment (``docs/store.md``).

    Cancellation: cancelling the task that iterates cancels the reads in flight; the stream is
    then closed (its reader task stopped, nothing left writing), and asked again it raises
    :class:`~aiotensor.errors.StreamClosedError` (what it gave is only part of the source), as it
    does after a read that failed.
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        *,
        device: str | torch.device = "cpu",
        dtype: DtypeRule = None,
        keys: Keys = None,
        rows: Mapping[str, tuple[int, int]] | None = None,
        window_bytes: int = knobs.WINDOW_BYTES,
        verify: bool = True,
        scheduler: Scheduler | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        # the reading runs on a _Stream, which its reader task holds, never this object: a consumer
        # that drops this stream unclosed lets it be collected, which closes it
        self._s = s = _Stream((source, device, dtype, keys, rows, window_bytes, verify, scheduler, storage_options))
        weakref.finalize(self, s.abandon).atexit = False
        self.source, self.device, self.dtype, self.window_bytes, self.verify, self.scheduler = (
            s.source,
            s.device,
            s.dtype,
            s.window_bytes,
            s.verify,
            s.scheduler,
        )

    def __repr__(self) -> str:
        return f"<TensorStream of {str(self.source)!r} to {self.device}, {self.bytes_read / 1e6:.1f} MB read>"

    @property
    def bytes_read(self) -> int:
        """The bytes of the batches read so far."""
        return self._s.bytes_read

    async def __aenter__(self) -> TensorStream:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self._s._close()

    def __aiter__(self) -> TensorStream:
        return self

    def __anext__(self) -> Coroutine[Any, Any, tuple[str, torch.Tensor]]:
        return self._s.next(self)  # (its coroutine as it is: no frame more per tensor)

    async def aclose(self) -> None:
        """Stop reading and free what was read ahead (and the read plan: for tens of thousands of
        tensors, freeing it is work too, done in a worker thread); waits until no thread writes any
        more. Cancellation: shielded, it finishes."""
        await self._s._close()


stream = TensorStream  # ``aiotensor.stream(source, ...)``: the class itself, so that help() shows its arguments (helper-55)
