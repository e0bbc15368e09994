"""Serving: stream weights into a model server tensor by tensor, load into a live module, hot-swap.

Sources: a safetensors file (any writer; aiotensor's files are checksummed), a torch.save zip
(``.pt``/``.bin``: read without unrestricted pickle, storages straight from their offsets), a
Hugging Face model folder (``model.safetensors``, ``pytorch_model.bin``, or shards listed by
``model.safetensors.index.json``), or an aiotensor checkpoint (a step folder, or a store root: its
newest step).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
import torch

from . import _io, _root
from ._dtypes import TORCH_TO_SAFETENSORS, file_shape
from .engines.posix import PosixEngine
from .errors import ManifestError, MismatchError
from .files import _checksums
from .formats import safetensors as st
from .formats import torchsave as ts
from .scheduler import MiB, Priority, Scheduler, batched

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
WINDOW_BYTES = 256 * MiB
# Neighbouring small tensors of one file are read together, up to this many bytes and tensors: one
# read and a few worker round trips per batch, not per tensor (a stream of 20,000 small tensors took
# 18 s and stalled the loop 150-180 ms when each was read alone; bench/bench_loop.py).
BATCH_BYTES = 16 * MiB
BATCH_TENSORS = 512
# A consumer whose next tensors are already read does not wait, so it would run a whole batch's
# worth of loop iterations in one go: the iteration lets other tasks run at least this often.
YIELD_S = 0.0005
Keys = Iterable[str] | Callable[[str], bool] | None


@dataclass(frozen=True)
class _Item:
    """One tensor to read: from ``path``, its spec, its crc32c (if recorded), and the names it goes
    by; ``view`` for a torch.save tensor that is not one contiguous run of its storage (``spec``
    then covers the whole storage, and the tensor is cut out of it)."""

    path: str
    spec: st.TensorSpec
    crc: int | None
    names: tuple[str, ...]
    view: ts.TensorRef | None = None


def _selector(keys: Keys) -> Callable[[str], bool]:
    """``keys``: None (all), a predicate, or names and prefixes (a prefix ends with ``.``)."""
    if keys is None:
        return lambda name: True
    if callable(keys):
        return keys
    wanted = set(keys)
    prefixes = tuple(k for k in wanted if k.endswith("."))
    return lambda name: name in wanted or name.startswith(prefixes)


def _plan(sched: Scheduler, source: str, select: Callable[[str], bool]) -> list[_Item]:
    """Every selected tensor of ``source`` in file order (blocking: runs in a worker thread)."""
    eng = sched.engine
    if os.path.isdir(source):
        if os.path.isfile(os.path.join(source, _root.MANIFEST)):
            return _checkpoint_items(sched, source, select)
        if os.path.isfile(os.path.join(source, _root.LATEST)) or any(_root.parse_step(n) is not None for n in os.listdir(source)):
            return _checkpoint_items(sched, _newest_step(sched, source), select)
        files = _hf_files(eng, source)
    else:
        files = [source]
    items: list[_Item] = []
    for path in map(os.path.realpath, files):  # Hugging Face cache folders link their files to blobs
        if _is_zip(eng, path):
            items += _torch_items(path, ts.parse_path(path), select)
            continue
        fd = eng.open_read(path)
        try:
            layout = _io.layout_of(sched, fd, path)
        finally:
            eng.close(fd)
        crcs = _checksums(layout, path)
        items += [_Item(path, s, None if crcs is None else crcs[s.key], (s.key,)) for s in layout.tensors if select(s.key)]
    return items


def _prepared(
    sched: Scheduler, source: str, select: Callable[[str], bool], rows: Mapping[str, tuple[int, int]], batch_bytes: int
) -> tuple[list[_Item], list[tuple[list[_Item], int]]]:
    """The items to read (row slices applied), and the same in the batches read together: runs of
    items of one file of at most ``batch_bytes`` and :data:`BATCH_TENSORS` items, with their bytes
    (blocking)."""
    items = [_slice(i, rows[i.names[0]]) if i.names[0] in rows else i for i in _plan(sched, source, select)]
    return items, batched(items, lambda i: i.spec.nbytes, batch_bytes, BATCH_TENSORS, lambda a, b: a.path != b.path)


def _new_targets(items: list[_Item], device: torch.device, verify: bool, stream: Any) -> list[_io.Target]:
    """New tensors to read ``items`` into (CUDA ones allocated on the consumer's ``stream``, which
    the caching allocator ties their memory to, as if the consumer had made them)."""
    with _io.on_stream(stream):
        return [_io.Target(i.spec, _io.new_tensor(i.spec, device), i.crc if verify else None) for i in items]


def _finished(items: list[_Item], targets: list[_io.Target], dtype: torch.dtype | None, stream: Any) -> list[torch.Tensor]:
    """The tensors handed out: a torch.save view cut out of its storage, ``dtype`` applied (on the
    consumer's CUDA ``stream``, so that its own work is ordered after them)."""
    out = []
    with _io.on_stream(stream):
        for item, target in zip(items, targets, strict=True):
            t, v = target.tensor, item.view
            if v is not None:
                t = t.as_strided(v.size, v.stride, v.storage_offset).clone()
            out.append(t if dtype is None or t.dtype == dtype else t.to(dtype))
    return out


def _is_zip(engine: Any, path: str) -> bool:
    fd = engine.open_read(path)
    try:
        head = bytearray(4)
        return engine.pread(fd, memoryview(head), 0) == 4 and ts.is_torch_zip(bytes(head))
    finally:
        engine.close(fd)


def _torch_items(path: str, tree: Any, select: Callable[[str], bool]) -> list[_Item]:
    """Read plans for the selected tensors of a torch.save file, in file order."""
    items: list[_Item] = []

    def add(name: str, ref: ts.TensorRef) -> None:
        if not select(name):
            return
        dtype = TORCH_TO_SAFETENSORS[ref.dtype]
        if ref.contiguous:
            spec = st.TensorSpec(name, dtype, file_shape(dtype, ref.size), ref.file_offset, ref.nbytes)
            items.append(_Item(path, spec, None, (name,)))
        else:  # read the whole storage, then cut the view out of it
            n = ref.storage.nbytes // ref.dtype.itemsize
            spec = st.TensorSpec(name, dtype, file_shape(dtype, (n,)), ref.storage.offset, n * ref.dtype.itemsize)
            items.append(_Item(path, spec, None, (name,), ref))

    ts.map_tensors(tree, add)
    return sorted(items, key=lambda i: i.spec.offset)


def _newest_step(sched: Scheduler, root: str) -> str:
    listing = _root.scan(sched.engine, root, {})
    if not listing.committed:
        raise FileNotFoundError(f"{root}: no committed checkpoint")
    return os.path.join(root, listing.committed[max(listing.committed)])


def _checkpoint_items(sched: Scheduler, folder: str, select: Callable[[str], bool]) -> list[_Item]:
    m = _root.read_manifest(sched.engine, folder)
    names: dict[str, list[str]] = {k: [k] for k in m.entries}
    for alias, target in m.aliases.items():
        names[target].append(alias)
    items = []
    for key, e in sorted(m.entries.items(), key=lambda kv: (kv[1].shard, kv[1].spec.offset)):
        chosen = tuple(n for n in names[key] if select(n))
        if chosen:
            items.append(_Item(os.path.join(folder, e.shard), e.spec, e.crc32c, chosen))
    return items


def _hf_files(engine: Any, folder: str) -> list[str]:
    """The safetensors files of a Hugging Face model folder, in index order."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        raw = _root.read_small(engine, index, 64 * MiB, ManifestError, "the index")
        doc = st.loads_json_object(raw, index, "index", ManifestError)
        weight_map = doc.get("weight_map")
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise ManifestError("weight_map must map tensor names to file names", index)
        files = list(dict.fromkeys(weight_map.values()))
        for f in files:
            if os.path.basename(f) != f or f in ("", ".", "..") or f.startswith("."):
                raise ManifestError(f"shard {f!r} is not a plain file name inside the folder", index)
        return [os.path.join(folder, f) for f in files]
    for single in (SINGLE, "pytorch_model.bin"):
        if os.path.isfile(os.path.join(folder, single)):
            return [os.path.join(folder, single)]
    found = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"{folder}: no {SINGLE}, {INDEX} or other safetensors file")
    return [os.path.join(folder, n) for n in found]


def _slice(item: _Item, rows: tuple[int, int]) -> _Item:
    """Only rows ``[a, b)`` of a tensor (dim 0): a shorter read at a later offset, unverified."""
    a, b = rows
    spec = item.spec
    if item.view is not None or not spec.shape or not 0 <= a <= b <= spec.shape[0]:
        raise ValueError(f"rows {rows} of {spec.key!r} (shape {list(spec.shape)}): need 0 <= a <= b <= {spec.shape[:1]}")
    row = spec.nbytes // spec.shape[0] if spec.shape[0] else 0
    sliced = st.TensorSpec(spec.key, spec.dtype, (b - a, *spec.shape[1:]), spec.offset + a * row, (b - a) * row)
    return _Item(item.path, sliced, None, item.names[:1])


class TensorStream:
    """``async for name, tensor in aiotensor.stream(source, ...)``: the tensors of ``source`` (a
    safetensors file, a Hugging Face folder, a torch.save zip, an aiotensor checkpoint step or store
    root) as ``(name, tensor)`` pairs in file order, as soon as their bytes land: small neighbours
    are read together (up to :data:`BATCH_TENSORS` tensors and :data:`BATCH_BYTES`) and handed out
    together, a bigger tensor alone.

    ``keys`` selects what is read (names, prefixes ending in ``.``, or a predicate): the bytes of
    other tensors are never read. ``rows={"name": (a, b)}`` reads only rows ``a:b`` along dim 0 of
    that tensor (a tensor-parallel shard; its checksum covers the whole tensor, so a row slice is
    not verified). ``dtype`` converts each tensor as it arrives. Several streams may
    share one ``scheduler`` (loads run before saves on it).

    Raises (from the iteration): HeaderError / ManifestError (a malformed file or index, naming
    it), UnsafeFileError (a torch.save file that needs more than a state_dict's pickle),
    ChecksumError (a corrupt tensor of a checksummed file or checkpoint), OSError. An error is
    raised where its batch begins: the tensors read with a corrupt one are not handed out.

    Up to ``window_bytes`` of tensors are read ahead of the consumer (a tensor larger than the
    window is read alone); a slow consumer holds the reading back. Use it as an async context
    manager (``async with stream(...) as s: async for ... in s``) or call :meth:`aclose` when
    breaking out early: that stops every read at once and frees what was read ahead. A stream
    abandoned without either stops reading when its window is full and is freed with it.

    Cancellation: cancelling the task that iterates cancels the reads in flight; the stream is
    then closed (its reader task stopped, nothing left writing).
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        keys: Keys = None,
        rows: Mapping[str, tuple[int, int]] | None = None,
        window_bytes: int = WINDOW_BYTES,
        verify: bool = True,
        scheduler: Scheduler | None = None,
    ) -> None:
        if window_bytes < 1:
            raise ValueError(f"window_bytes must be >= 1, got {window_bytes}")
        self.source = os.fspath(source)
        self.dtype = dtype
        self.window_bytes = window_bytes
        self.verify = verify
        self._select = _selector(keys)
        self._rows = dict(rows or {})
        self._own = scheduler is None
        self.scheduler = scheduler if scheduler is not None else Scheduler()
        self.device = _io.check_device(self.scheduler, device)
        # the stream CUDA tensors are made and finished on, in worker threads: the caller's
        self._stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.bytes_read = 0
        self._batch_bytes = min(window_bytes, BATCH_BYTES)
        self._items: list[_Item] | None = None
        self._batches: list[tuple[list[_Item], int]] = []  # the items read together, and their bytes
        self._ready: dict[int, tuple[_Item, Any]] = {}  # read ahead, by index: (item, tensor or error)
        self._next = 0  # the index the consumer gets next
        self._count = 0
        self._failed = False
        self._ahead = 0  # bytes in _ready and in flight
        self._changed = anyio.Event()  # set, and replaced, when something changed that a waiter wants
        self._waiting = False  # anyone waiting on _changed (a new Event per tensor cost 13 us)
        self._reader: anyio.CancelScope | None = None
        self._reader_done: anyio.Event | None = None
        self._closed = False
        self._yielded = 0.0  # when the consumer last let other tasks run

    async def __aenter__(self) -> TensorStream:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    def __aiter__(self) -> TensorStream:
        return self

    async def __anext__(self) -> tuple[str, torch.Tensor]:
        if not self._closed and time.perf_counter() - self._yielded > YIELD_S:
            await self._wait(ready=True)
        if self._closed:
            raise StopAsyncIteration
        if self._items is None:
            sched = self.scheduler
            try:
                with sched.operation():
                    prepared = await sched.call(
                        _prepared, sched, self.source, self._select, self._rows, self._batch_bytes, priority=Priority.LOAD
                    )
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.aclose()
                raise
            (self._items, self._batches), self._count = prepared, len(prepared[0])
            self._start_reader()
        while self._next not in self._ready:
            if self._next >= self._count or (self._reader_done is not None and self._reader_done.is_set()):
                await self.aclose()
                raise StopAsyncIteration
            await self._wait()
        item, got = self._ready[self._next]
        if isinstance(got, BaseException):
            await self.aclose()
            raise got
        name = item.names[0]
        if len(item.names) > 1:  # a tied weight: the same tensor under its other names next
            self._ready[self._next] = (_Item(item.path, item.spec, item.crc, item.names[1:]), got)
        else:
            del self._ready[self._next]
            self._next += 1
            self._ahead -= item.spec.nbytes
            self._notify()
        return name, got

    async def _wait(self, ready: bool = False) -> None:
        """Wait for the reader to land something (``ready``: only let other tasks run); if
        cancelled meanwhile, the stream is closed."""
        try:
            await (anyio.lowlevel.checkpoint() if ready else self._next_change())
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise
        self._yielded = time.perf_counter()

    def _notify(self) -> None:
        if self._waiting:
            self._changed.set()
            self._changed = anyio.Event()
            self._waiting = False

    def _start_reader(self) -> None:
        from .store import _spawn

        self._reader_done = anyio.Event()
        _spawn(self._read_all)

    async def _read_all(self) -> None:
        """Read the batches in order, up to ``workers`` at once and ``window_bytes`` ahead of the
        consumer; each file is opened once. Results land in ``_ready`` by index; the first error
        ends it."""
        assert self._reader_done is not None
        fds: dict[str, int] = {}
        slots = anyio.Semaphore(self.scheduler.workers)
        try:
            with anyio.CancelScope() as scope:
                self._reader = scope
                async with anyio.create_task_group() as tg:
                    start = 0  # the index of the batch's first item
                    for items, nbytes in self._batches:
                        while self._ahead and self._ahead + nbytes > self.window_bytes:
                            await self._next_change()
                        if self._closed or self._failed:
                            break
                        await slots.acquire()
                        self._ahead += nbytes
                        path = items[0].path
                        if path not in fds:
                            try:
                                fds[path] = await _io.open_read(self.scheduler, path)
                            except Exception as e:  # the consumer gets it where that file's tensors begin
                                slots.release()
                                self._failed = True
                                self._ready[start] = (items[0], e)
                                break
                        tg.start_soon(self._read_batch, start, items, nbytes, fds[path], slots)
                        start += len(items)
        finally:
            with anyio.CancelScope(shield=True):
                for fd in fds.values():
                    await _io.close(self.scheduler, fd)
            self._reader_done.set()
            self._notify()

    async def _read_batch(self, start: int, items: list[_Item], nbytes: int, fd: int, slots: anyio.Semaphore) -> None:
        """Read ``items`` (indices ``start``...) into new tensors; an error lands at ``start``."""
        sched = self.scheduler
        try:
            with sched.operation():
                targets = await sched.call(_new_targets, items, self.device, self.verify, self._stream, priority=Priority.LOAD)
                await _io.read_tensors(sched, fd, items[0].path, targets, Priority.LOAD)
                self.bytes_read += nbytes
                got = await sched.call(_finished, items, targets, self.dtype, self._stream, priority=Priority.LOAD)
        except Exception as e:
            self._failed = True
            self._ready[start] = (items[0], e)
        else:
            self._ready.update(enumerate(zip(items, got, strict=True), start))
        finally:
            slots.release()
        self._notify()

    async def _next_change(self) -> None:
        self._waiting = True
        await self._changed.wait()

    async def aclose(self) -> None:
        """Stop reading and free what was read ahead (and the read plan: for tens of thousands of
        tensors, freeing it is work too, done in a worker thread); waits until no thread writes any
        more. Cancellation: shielded, it finishes."""
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
        with anyio.CancelScope(shield=True):
            if self._reader_done is not None:
                await self._reader_done.wait()
            self._ahead = 0
            held = (self._ready, self._items or [], self._batches)
            self._ready, self._items, self._batches = {}, [], []
            await self.scheduler.discard(*held)
            if self._own:
                self._own = False
                await anyio.to_thread.run_sync(self.scheduler.close)


stream = TensorStream  # ``aiotensor.stream(source, ...)``: the documented way to make one


class LoadResult(NamedTuple):
    """What :func:`load_into` could not match, as ``nn.Module.load_state_dict`` reports it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


async def load_torch(
    path: str | os.PathLike[str], *, device: str | torch.device = "cpu", scheduler: Scheduler | None = None
) -> Any:
    """Load a torch.save zip (``.pt``/``.bin``) as the state it holds, without unrestricted pickle:
    only what state_dicts are made of is admitted (as ``torch.load(weights_only=True)``), storages
    are bounds-checked against the file and read straight from their offsets.

    Raises:
        UnsafeFileError: a global outside the allow-list (nothing ran), a compressed entry, a
            storage of the wrong size, a tensor outside its storage; not a torch.save zip.
        OSError: the file cannot be read.

    Cancellation: every read stops; nothing is returned.
    """
    path = os.fspath(path)
    async with stream(path, device=device, scheduler=scheduler) as s:
        with s.scheduler.operation():
            tree = await s.scheduler.call(ts.parse_path, os.path.realpath(path), priority=Priority.LOAD)  # noqa: ASYNC240
            got = {name: t async for name, t in s}
            return await s.scheduler.run_sync(ts.map_tensors, tree, lambda name, ref: got[name].requires_grad_(ref.requires_grad))


_ALIGN_LOCK = threading.Lock()


def _torch_save_aligned(state: Any, path: str) -> None:
    import torch.utils.serialization as ser

    with _ALIGN_LOCK:  # torch's setting is process-wide: restored before anyone else saves through us
        old = ser.config.save.storage_alignment
        ser.config.save.storage_alignment = 4096
        try:
            torch.save(state, path)
        finally:
            ser.config.save.storage_alignment = old
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def save_torch(state: Any, path: str | os.PathLike[str]) -> None:
    """Write a torch.save file that ``torch.load`` opens, with every storage at a 4096-byte file
    offset (so a reader can move them with O_DIRECT or cuFile, as :func:`load_torch` does),
    atomically (a temporary name, fsync'ed, renamed over ``path``, the folder fsync'ed).

    Raises:
        OSError: naming the file; ``path`` is then untouched.

    Cancellation: the write finishes in its thread, then the temporary file is removed.
    """
    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")  # noqa: ASYNC240
    try:
        await anyio.to_thread.run_sync(_torch_save_aligned, state, tmp)
        await anyio.to_thread.run_sync(os.replace, tmp, path)
        await anyio.to_thread.run_sync(PosixEngine().sync_dir, os.path.dirname(os.path.abspath(path)))  # noqa: ASYNC240
    except BaseException:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(PosixEngine().remove_tree, tmp)
        raise


async def _matched(
    module: torch.nn.Module,
    source: str | os.PathLike[str],
    fn: Callable[[str, torch.Tensor, torch.Tensor], object],
    *,
    strict: bool,
    window_bytes: int,
    scheduler: Scheduler | None,
) -> LoadResult:
    """Stream ``source`` and call ``fn(name, module's tensor, loaded tensor)`` for each tensor the
    module has, of its shape, in worker threads, batches of up to :data:`BATCH_TENSORS` tensors or
    :data:`BATCH_BYTES` at a time (one call per tensor made a 20,000-tensor load_into take 7 s).
    ``strict``: a tensor the module lacks is an error at once (else it is reported)."""
    unexpected: list[str] = []
    async with stream(source, window_bytes=window_bytes, scheduler=scheduler) as s:
        with s.scheduler.operation():
            sched = s.scheduler
            left = await sched.run_sync(lambda: dict(module.state_dict(keep_vars=True)))  # not found yet
            batch: list[tuple[str, torch.Tensor, torch.Tensor]] = []
            size = 0
            async for name, t in s:
                dst = left.pop(name, None)
                if dst is None:
                    if strict:
                        raise MismatchError(f"{source} has a tensor {name!r} the module does not")
                    unexpected.append(name)
                    continue
                if tuple(dst.shape) != tuple(t.shape):
                    raise MismatchError(f"tensor {name!r}: {source} has {list(t.shape)}, the module {list(dst.shape)}")
                batch.append((name, dst, t))
                size += t.nbytes
                if len(batch) >= BATCH_TENSORS or size >= BATCH_BYTES:
                    await sched.call(_each, fn, batch, priority=Priority.LOAD)
                    batch, size = [], 0
            if batch:
                await sched.call(_each, fn, batch, priority=Priority.LOAD)
            missing: list[str] = await sched.run_sync(list, left)
            await sched.discard(left)
    return LoadResult(missing, unexpected)


def _each(fn: Callable[[str, torch.Tensor, torch.Tensor], object], batch: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():  # per thread: set in the worker
        for name, dst, t in batch:
            fn(name, dst, t)
    batch.clear()  # the loaded tensors are freed here, not on the loop's thread


async def load_into(
    module: torch.nn.Module,
    source: str | os.PathLike[str],
    *,
    strict: bool = True,
    window_bytes: int = WINDOW_BYTES,
    scheduler: Scheduler | None = None,
) -> LoadResult:
    """Load ``source`` in place into ``module``'s parameters and buffers, a batch of tensors at a
    time (memory: the module, the stream's window and a batch of up to :data:`BATCH_BYTES`),
    converting dtypes on the fly.

    Raises:
        MismatchError: a shape differs (named), or with ``strict``, missing or unexpected keys.
        What :func:`stream` raises.

    Cancellation: the stream is closed; the module may hold a mix of old and new values (load into
    a copy, or use :func:`prepare_swap`, to switch only once everything is in).
    """
    got = await _matched(
        module,
        source,
        lambda name, dst, t: dst.detach().copy_(t),
        strict=False,
        window_bytes=window_bytes,
        scheduler=scheduler,
    )
    if strict and (got.missing_keys or got.unexpected_keys):
        missing, unexpected = got.missing_keys[:10], got.unexpected_keys[:10]
        raise MismatchError(f"load_into {source}: missing keys {missing}, unexpected keys {unexpected}")
    return got


class Swap:
    """New weights for a module, loaded and verified beside the ones serving; :meth:`apply` switches."""

    def __init__(self, module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
        self.module = module
        self.tensors = dict(tensors)

    def apply(self) -> None:
        """Switch the module to the new weights: pointer swaps only, no I/O and no copy. Call it
        between two requests, on the loop thread, while no other thread runs the module (with
        inference in worker threads, load a second module and switch the reference instead, as
        ``examples/model_server.py`` does): it does not await, so no coroutine sees half of it."""
        current = self.module.state_dict(keep_vars=True)  # now: .to() or new parameters since replace tensors
        with torch.no_grad():
            for name, new in self.tensors.items():
                current[name].data = new


async def prepare_swap(
    module: torch.nn.Module,
    source: str | os.PathLike[str],
    *,
    window_bytes: int = WINDOW_BYTES,
    scheduler: Scheduler | None = None,
) -> Swap:
    """Load ``source`` for ``module`` into new tensors (one extra copy of the weights, on the
    module's devices and dtypes) while the module keeps serving; returns a :class:`Swap` whose
    ``apply()`` switches between two requests. If the load fails (a corrupt file: ChecksumError;
    other keys or shapes: MismatchError), nothing of the new version is visible.

    Cancellation: nothing was switched; the partly loaded copy is dropped.
    """
    new: dict[str, torch.Tensor] = {}

    def keep(name: str, dst: torch.Tensor, t: torch.Tensor) -> None:
        new[name] = t if (t.dtype, t.device) == (dst.dtype, dst.device) else t.to(dst.device, dst.dtype)

    got = await _matched(module, source, keep, strict=True, window_bytes=window_bytes, scheduler=scheduler)
    if got.missing_keys:
        raise MismatchError(f"the new version lacks {got.missing_keys[:10]}")
    return Swap(module, new)


__all__ = ["LoadResult", "Swap", "TensorStream", "load_into", "load_torch", "prepare_swap", "save_torch", "stream"]
