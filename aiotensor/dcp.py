"""aiotensor as torch.distributed.checkpoint's storage layer: ``dcp.save``/``dcp.async_save``/``dcp.load``
write and read through aiotensor's engines, checksums and commit protocol; metadata is JSON.

Layout of a checkpoint written by :class:`AiotensorWriter` to ``root/step-000000000100``::

    root/step-000000000100/
      __0_data.safetensors     rank 0's items (valid safetensors, a crc32c per item in __metadata__)
      __1_data.safetensors     rank 1's items ...
      .metadata.json           DCP's Metadata as JSON (never pickle), sealed with its crc32c

Every rank writes and fsyncs its file in a temporary folder ``step-….tmp-XXXXXXXX`` that the
coordinator creates; DCP gathers every rank's results to the coordinator only after each rank's
``write_data`` returned (its file durable), and the coordinator's ``finish`` writes the metadata,
fsyncs, renames the folder to its final name, fsyncs the root and updates ``latest``: one commit
for all ranks. A failure on any rank fails ``dcp.save`` on every rank (DCP's own collectives carry
the error, naming the rank); nothing is committed and the temporary folder is a leftover that the
next TensorStore writer removes. Timeouts are the process group's (``init_process_group(timeout=)``).

:class:`SafeFileSystemReader` reads checkpoints made by DCP's own ``FileSystemWriter`` without
executing their ``.metadata`` pickle beyond DCP's metadata classes.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import logging
import os
import stat
import uuid
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anyio
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import commit, errors, sources
from . import root as _root
from ._io.assemble import read
from ._io.tensors import assign, check_apart, check_fillable
from ._runtime.scheduler import Scheduler, own_scheduler
from .engines import Engine
from .engines.posix import PosixEngine
from .files import read_file, write_safetensors
from .formats import dcp_metadata as dm
from .formats import manifest as mf
from .formats import torchsave as ts
from .formats import tree
from .location import engine_for, is_object, local_path, split, where

METADATA = dm.JSON_NAME
FORMAT = dm.FORMAT
T = TypeVar("T")
log = logging.getLogger("aiotensor")


class _Runner:
    """Where a DCP storage layer runs its I/O: DCP calls it synchronously, from its own threads.

    With a ``scheduler`` and the ``token`` of the event loop it belongs to (a distributed
    :class:`~aiotensor.TensorStore`, which calls DCP from a worker thread), the I/O runs on that
    loop and scheduler. Otherwise on a scheduler of its own over ``engine`` (default: the one that
    serves ``path``: local files, or ``s3://`` objects configured by ``storage_options`` over the
    ``AWS_*`` environment), in an event loop of its own, in a thread of its own (``dcp.save`` may be
    called from inside a running event loop).
    """

    def __init__(
        self, path: str, engine: Engine | None, scheduler: Scheduler | None, token: Any, storage_options: Any = None
    ) -> None:
        if (scheduler is None) != (token is None):
            raise ValueError("scheduler= and token= go together (the event loop the scheduler runs on)")
        self.scheduler, self.token, self.storage_options = scheduler, token, storage_options
        self.chosen = engine  # the caller's, kept whatever the path
        self.engine = self._engine(path)

    def _engine(self, path: str) -> Engine:
        if self.scheduler is not None:
            engine_for(path, self.scheduler)  # refuses a local scheduler for an s3:// path
            return self.scheduler.engine
        return self.chosen or engine_for(path, None, self.storage_options) or PosixEngine()

    def moved(self, path: str) -> None:
        """The checkpoint's path changed (DCP's ``reset(checkpoint_id)``): the engine that serves it."""
        self.engine = self._engine(path)

    def run(self, fn: Callable[[Scheduler], Coroutine[Any, Any, T]]) -> T:
        if self.scheduler is not None:
            return anyio.from_thread.run(fn, self.scheduler, token=self.token)

        async def own() -> T:
            async with own_scheduler(None, engine=self.engine) as sched:
                return await fn(sched)

        with ThreadPoolExecutor(1) as ex:
            return ex.submit(anyio.run, own).result()


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


# --- Metadata <-> JSON -----------------------------------------------------------------------------


def _index(i: md.MetadataIndex) -> dict[str, Any]:
    return {"fqn": i.fqn, "offset": None if i.offset is None else list(i.offset), "index": i.index}


def check_places(m: md.Metadata) -> None:
    """A StateError where one item's place lies inside another's (``w`` a tensor on one rank, a
    dict or list holding ``w.x`` or ``w.0`` on another): the step was committed and never loaded
    (helper-77: a TypeError or an expand error, and ``keep_last`` would retire the good steps)."""
    places = m.planner_data if isinstance(m.planner_data, dict) else {}
    paths = {tuple(map(str, p)) for p in places.values() if isinstance(p, (list, tuple))}
    inner = next((p[:i] for p in paths for i in range(1, len(p)) if p[:i] in paths), None)
    if inner is not None:
        raise errors.StateError(
            f"the ranks' states differ in structure at {'.'.join(inner)!r}: a value on one, a container holding more "
            "on another; give every rank the same structure (its values may differ: one is kept)"
        )


def dumps_metadata(m: md.Metadata) -> bytes:
    entries: dict[str, Any] = {}
    for fqn, s in m.state_dict_metadata.items():
        if isinstance(s, md.BytesStorageMetadata):
            entries[fqn] = {"type": "bytes"}
        else:
            p = s.properties
            entries[fqn] = {
                "type": "tensor",
                "dtype": str(p.dtype).removeprefix("torch."),
                "requires_grad": p.requires_grad,
                "size": list(s.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in s.chunks],
            }
    planner = m.planner_data if isinstance(m.planner_data, dict) else {}
    doc = {
        "format": FORMAT,
        "version": getattr(m, "version", None),  # torch 2.8 has none
        "state_dict_metadata": entries,
        "planner_data": {k: list(v) for k, v in planner.items()},
        "storage_data": [{"index": _index(k), **v} for k, v in (m.storage_data or {}).items()],
    }
    return mf.checked(mf.seal(doc), "DCP metadata")


def loads_metadata(data: bytes, path: str) -> md.Metadata:
    """aiotensor's ``.metadata.json`` as DCP's ``Metadata`` (see :func:`aiotensor.formats.dcp_metadata.loads_json`)."""
    return _to_dcp(dm.loads_json(data, path))


def _to_dcp(d: dm.Description) -> md.Metadata:
    sdm: dict[str, Any] = {}
    storage: dict[md.MetadataIndex, dict[str, Any]] = {}
    for fqn, t in d.tensors.items():
        props = md.TensorProperties(dtype=t.dtype, requires_grad=t.requires_grad)
        chunks = [md.ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks]
        sdm[fqn] = md.TensorStorageMetadata(props, torch.Size(t.size), chunks)
        for c in t.chunks:
            storage[md.MetadataIndex(fqn, torch.Size(c.offsets))] = {"file": c.stored.file, "key": c.stored.key}
    for fqn, v in d.values.items():
        sdm[fqn] = md.BytesStorageMetadata()
        storage[md.MetadataIndex(fqn)] = {"file": v.file, "key": v.key}
    return md.Metadata(sdm, planner_data=dict(d.places), storage_data=storage)


# --- the writer --------------------------------------------------------------------------------------


class AiotensorWriter(StorageWriter):
    """A DCP ``StorageWriter``: ``dcp.save(state, storage_writer=AiotensorWriter("root/step-000000000100"))``.

    The folder's name should be a step folder of a TensorStore root (``step-`` + 12 digits) so that
    its leftovers are cleaned like a TensorStore's; any name works for DCP itself. There the
    coordinator also points ``latest`` at it (``latest=False``: left to the caller, as a distributed
    :class:`~aiotensor.TensorStore` does, which also applies its retention). ``nbytes``: the bytes this
    rank wrote.

    ``path`` may be an ``s3://bucket/prefix/step-…`` URL (``storage_options``: obstore's S3 keys,
    over the ``AWS_*`` environment): every rank puts its file whole, and the coordinator's
    metadata, put last and only if absent, is the commit point (``docs/store.md``, "A store in a
    bucket"); the folder is marked as the library's first, so two writers cannot share it.
    ``fence``: a blocking check the coordinator runs just before the commit point (a distributed
    store's writer lease: renewed, or StoreLockedError). Without one, a local store root's
    writer lock is taken around the commit (StoreLockedError where a TensorStore writes there).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        latest: bool = True,
        engine: Engine | None = None,
        scheduler: Scheduler | None = None,
        token: Any = None,
        storage_options: Any = None,
        fence: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.path = where(path)
        self.latest, self.fence = latest, fence
        self.runner = _Runner(self.path, engine, scheduler, token, storage_options)
        self.is_coordinator = False
        self.rank = 0
        self.nbytes = 0
        self.tmp = ""  # the coordinator's temporary folder, once made, until committed
        self._lock: _root.WriterLock | None = None  # the root's, held by the coordinator around the commit

    @property
    def engine(self) -> Engine:
        return self.runner.engine

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = where(checkpoint_id)
            self.runner.moved(self.path)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: create the temporary folder every rank writes into (the checkpoint's
        folder may exist if it is empty, as DCP's FileSystemWriter allows; on an object store, the
        checkpoint's own prefix, which must hold nothing)."""
        eng = self.engine
        if eng.exists(self.path) and (not stat.S_ISDIR(eng.stat(self.path).st_mode) or eng.listdir(self.path)):
            raise errors.CheckpointExistsError(f"{self.path} exists already (a checkpoint goes to a new or empty folder)")
        root, name = split(self.path)
        if eng.renames:
            os.makedirs(root, exist_ok=True)
            tmp = os.path.join(root, commit.temp_name(name))
        else:
            tmp = self.path  # see commit: the marker is made only if absent, the metadata commits
        self._lock_root(root, name)  # refused before anything is written
        self._unlock()
        eng.mkdir(tmp)
        self.tmp = tmp
        return [dataclasses.replace(p, storage_data={"tmp": tmp, "prefix": f"__{i}_"}) for i, p in enumerate(plans)]

    def _lock_root(self, root: str, name: str) -> None:
        """Alone (no ``fence``: not a TensorStore's own writer) and into a local store root's step
        folder: take the root's writer lock, as a store does (a dcp.save here moved `latest` behind
        a running store's back, whose retention then missed it: helper-31). Checked when the save
        is planned, held from the commit to `latest`'s update (DCP tells a writer of no failure: a
        lock held across the writes could outlive a failed save).

        Raises:
            StoreLockedError: a TensorStore (or another such save) writes there."""
        if self.fence is not None or _root.parse_step(name) is None or not self.engine.renames:
            return
        lock = _root.WriterLock(root)
        try:
            got = lock.try_acquire()
        except OSError as e:  # a file system without flock (Lustre without -o flock): DCP's save as before
            if e.errno in (errno.ENOSYS, errno.EOPNOTSUPP):
                log.warning("%s: no writer lock on this file system (%s): saving %s without it", root, e.strerror, name)
                return
            raise
        if not got:
            holder = lock.holder()
            raise errors.StoreLockedError(
                f"{root} has a writer ({f'process {holder}' if holder else 'another process'}): save through its "
                "TensorStore (distributed= for a process group), or to another folder"
            )
        self._lock = lock

    def _unlock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        tmp, prefix = plan.storage_data["tmp"], plan.storage_data["prefix"]
        file = f"{prefix}data.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            fqn, offset = item.index.fqn, item.index.offset  # unique within a rank: errors name the tensor
            key = fqn if offset is None or not any(offset) else f"{fqn}@{','.join(map(str, offset))}"
            if item.type == WriteItemType.BYTE_IO:  # DCP's own pickled extras: stored as opaque bytes
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            else:
                assert isinstance(data, torch.Tensor)
                t = data.detach().cpu().contiguous()
            tensors[key] = t
            results.append(WriteResult(index=item.index, size_in_bytes=t.nbytes, storage_data={"file": file, "key": key}))

        async def write(sched: Scheduler) -> int:  # in a folder that is published whole: no rename of its own
            return await write_safetensors(sched, os.path.join(tmp, file), tensors)

        try:
            self.nbytes = self.runner.run(write)
        except OSError as e:
            raise OSError(e.errno, f"rank {self.rank}: {e.strerror or e}") from e  # (str(e) has "[Errno n]" already)
        return _done(results)

    def finish(self, metadata: md.Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator, after every rank's file is durable: metadata, then the commit."""
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        check_places(metadata)
        eng = self.engine
        root, name = split(self.path)
        try:
            if self.fence is not None:
                self.fence()
            else:
                self._lock_root(root, name)
            commit.write_small(eng, os.path.join(self.tmp, METADATA), dumps_metadata(metadata))
            commit.publish(eng, self.tmp, self.path, folder=True)  # the commit point
            self.tmp = ""  # committed: nothing for abort() to remove
            if self.latest and _root.parse_step(name) is not None:  # a TensorStore root
                _root.point_latest(eng, root, name)
        finally:
            self._unlock()

    def abort(self) -> None:
        """On the coordinator, once no rank writes any more: remove the uncommitted temporary folder
        (blocking; its metadata first, on an object store).

        Raises:
            OSError: it could not be removed (a store's next writer removes it).
        """
        if self.tmp:
            commit.remove(self.engine, self.tmp)
            self.tmp = ""

    def storage_meta(self) -> md.StorageMeta | None:
        return md.StorageMeta(checkpoint_id=self.path, save_id=uuid.uuid4().hex)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class _SafeBytes:
    """``planner`` with its byte items unpickled only where torch's ``weights_only`` unpickler admits
    them: DCP's ``DefaultLoadPlanner.load_bytes`` runs ``torch.load(weights_only=False)`` on whatever
    bytes a checkpoint holds, so a hostile one could run code through any reader."""

    def __init__(self, planner: LoadPlanner, path: str) -> None:
        self._planner, self._path = planner, path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, req: Any, value: io.BytesIO) -> None:
        data = value.getvalue() if isinstance(value, io.BytesIO) else value.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            raise errors.UnsafeFileError(
                f"item {req.storage_index.fqn!r} is not a value torch.load(weights_only=True) admits "
                f"({type(e).__name__}: {str(e)[:200]}); nothing was run",
                self._path,
            ) from None
        self._planner.load_bytes(req, io.BytesIO(data))


# --- the reader ------------------------------------------------------------------------------------


class _MetadataOnce:
    """Read and validate a checkpoint's metadata once per reader (until ``reset`` names another
    checkpoint), so a caller may read it first and get the error as itself: DCP's loader folds a
    failure of ``read_metadata`` into an ``AssertionError`` of its own."""

    _metadata: md.Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> md.Metadata:
        if self._metadata is None:
            self._metadata = self._read_metadata()
        return self._metadata

    def _read_metadata(self) -> md.Metadata:
        raise NotImplementedError

    def _forget(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        if checkpoint_id is not None:
            self._metadata = None


class AiotensorReader(_MetadataOnce, StorageReader):
    """A DCP ``StorageReader`` for checkpoints :class:`AiotensorWriter` wrote, and for TensorStore
    steps (their tensors: ``dcp.load({"model": model.state_dict()},
    storage_reader=AiotensorReader(store.path(step)))``); any world size loads them (DCP reshards by
    chunk). Every item's crc32c is verified as it is read."""

    def __init__(
        self, path: str | os.PathLike[str], *, scheduler: Scheduler | None = None, token: Any = None, storage_options: Any = None
    ) -> None:
        super().__init__()
        self.path = where(path)
        self.runner = _Runner(self.path, None, scheduler, token, storage_options)
        self.storage_data: dict[md.MetadataIndex, dict[str, Any]] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._forget(checkpoint_id)
        if checkpoint_id is not None:
            self.path = where(checkpoint_id)
            self.runner.moved(self.path)

    def _read_metadata(self) -> md.Metadata:
        eng = self.runner.engine
        if not eng.exists(os.path.join(self.path, METADATA)) and eng.exists(os.path.join(self.path, _root.MANIFEST)):
            return _store_metadata(_root.read_manifest(eng, self.path))
        path = os.path.join(self.path, METADATA)
        d = dm.loads_json(_root.read_small(eng, path, dm.MAX_BYTES, errors.ManifestError, "the metadata"), path)
        dm.check(d, lambda name: sources.file_size(eng, os.path.join(self.path, name)), path)
        return _to_dcp(d)

    def set_up_storage_reader(self, metadata: md.Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _whole(self, req: Any, target: torch.Tensor) -> bool:
        """Does ``req`` fill all of ``target`` from all of one stored item (same sharding as saved)?"""
        if any(req.storage_offsets) or any(req.dest_offsets) or tuple(req.lengths) != tuple(target.shape):
            return False
        meta = self.metadata.state_dict_metadata.get(req.storage_index.fqn)
        offset = req.storage_index.offset
        chunks = getattr(meta, "chunks", [])
        return target.is_contiguous() and any(c.offsets == offset and tuple(c.sizes) == tuple(target.shape) for c in chunks)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        planner = _SafeBytes(planner, self.path)  # type: ignore[assignment]
        per_file: dict[str, list[Any]] = {}
        direct: dict[str, dict[str, tuple[Any, torch.Tensor]]] = {}  # file -> key -> (request, target)
        # every tensor this rank's reads fill: the state's own (DefaultLoadPlanner's lookup_tensor),
        # not the pieces of one that each read fills (a column-sharded one's: disjoint by DCP's plan)
        written: dict[int, tuple[str, torch.Tensor]] = {}
        lookup = getattr(planner, "lookup_tensor", None)
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if req.type == LoadItemType.TENSOR:
                target = planner.resolve_tensor(req).detach()
                whole = lookup(req.dest_index) if lookup is not None else target
                written.setdefault(id(whole), (req.dest_index.fqn, whole))
                if info["file"] and self._whole(req, target) and info["key"] not in direct.get(info["file"], {}):
                    direct.setdefault(info["file"], {})[info["key"]] = (req, target)
                    continue
            per_file.setdefault(info["file"], []).append(req)
        # (two overlapping views of one buffer were filled in turn, mixed: helper-68)
        check_apart([n for n, _ in written.values()], [t for _, t in written.values()], "the state loaded into")

        async def read_all(sched: Scheduler) -> None:
            """All of this rank's reads, a file at a time: whole items straight into their targets
            (no copy), the others read, then cut and copied; crc32c verified either way."""
            with sched.operation():
                for file, wanted in direct.items():
                    into = {k: t for k, (_, t) in wanted.items()}
                    await read_file(sched, os.path.join(self.path, file), into, unexpected_ok=True)
                    for req, target in wanted.values():
                        planner.commit_tensor(req, target)
                for file, reqs in per_file.items():
                    for req in [r for r in reqs if "value" in self.storage_data[r.storage_index]]:
                        # a TensorStore step's non-tensor leaf, from its manifest
                        planner.load_bytes(req, _saved(self.storage_data[req.storage_index]["value"]))
                    reqs = [r for r in reqs if "value" not in self.storage_data[r.storage_index]]
                    if not reqs:
                        continue
                    keys = {self.storage_data[r.storage_index]["key"] for r in reqs}
                    if file:  # a file of the folder: opened without following a link, as a store's shards are
                        got = await read_file(sched, os.path.join(self.path, file), keys=keys)
                    else:  # "": a TensorStore step, its manifest's shards
                        src = await sched.call(sources.step, sched.engine, self.path)
                        chosen = [e for e in src.entries if keys.intersection(e.names)]
                        tensors = await read(sched, chosen, torch.device("cpu"), checks=src.checks)
                        got = {n: t for e, t in zip(chosen, tensors, strict=True) for n in e.names}
                    for req in reqs:
                        _fill(planner, req, got[self.storage_data[req.storage_index]["key"]])

        self.runner.run(read_all)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        folder = local_path(checkpoint_id, objects=True)
        if is_object(folder):
            return True  # listing it needs credentials: read_metadata says what is there
        return any(os.path.lexists(os.path.join(folder, n)) for n in (METADATA, _root.MANIFEST))


def _saved(value: Any) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return buf


def _fill(planner: LoadPlanner, req: Any, t: torch.Tensor) -> None:
    """Hand ``req``'s part of the stored item ``t`` to the planner."""
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(t.numpy().tobytes()))
        return
    for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
        t = t.narrow(dim, start, length)
    target = planner.resolve_tensor(req).detach()
    fqn = req.storage_index.fqn
    if target.size() != t.size():
        raise errors.MismatchError(f"{fqn}: the checkpoint has {list(t.size())}, the target {list(target.size())}")
    check_fillable(target, f"the tensor loaded into for {fqn!r}")  # (copy_ into an as_strided one mixed values)
    assign(target, t)
    planner.commit_tensor(req, target)


def _store_metadata(m: mf.Manifest) -> md.Metadata:
    """DCP's view of a TensorStore step: its state as DCP flattens it (so the names are the ones DCP
    asks for when it flattens a target of the same shape), every tensor one whole chunk, every
    other leaf (an optimizer's ``lr``, a step count) a bytes item whose value the storage data
    carries (``read_data`` hands it to DCP as ``torch.save`` bytes)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from .formats.dtypes import SAFETENSORS_TO_TORCH, torch_shape

    stand_in: dict[int, str] = {}  # one small tensor per key (DCP walks lists of tensors item by item)

    def tensor(key: str) -> torch.Tensor:
        t = torch.empty(0, device="meta")
        stand_in[id(t)] = key
        return t

    state = tree.unflatten(m.tree, tensor, "the manifest")
    flat, places = flatten_state_dict(state if isinstance(state, dict) else {"": state})
    sdm: dict[str, Any] = {}
    storage: dict[md.MetadataIndex, dict[str, Any]] = {}
    for fqn, value in flat.items():
        key = stand_in.get(id(value)) if isinstance(value, torch.Tensor) else None
        if key is None:
            sdm[fqn] = md.BytesStorageMetadata()
            # (a numpy scalar as its Python value: DCP hands values over pickled, helper-68)
            storage[md.MetadataIndex(fqn)] = {"file": "", "key": fqn, "value": tree.python_values(value)}
            continue
        spec = m.entries[m.aliases.get(key, key)].spec
        shape = torch.Size(torch_shape(spec.dtype, spec.shape))
        origin = torch.Size([0] * len(shape))
        props = md.TensorProperties(dtype=SAFETENSORS_TO_TORCH[spec.dtype])
        sdm[fqn] = md.TensorStorageMetadata(props, shape, [md.ChunkStorageMetadata(origin, shape)])
        storage[md.MetadataIndex(fqn, origin)] = {"file": "", "key": key}
    return md.Metadata(sdm, planner_data=dict(places), storage_data=storage)


# --- existing FileSystemWriter checkpoints, without their pickle -----------------------------------


class SafeFileSystemReader(_MetadataOnce, FileSystemReader):
    """DCP's ``FileSystemReader`` without its trust in the files:

    - ``.metadata`` is unpickled by an allow-list of DCP's metadata classes only (a hostile pickle is
      :class:`~aiotensor.errors.UnsafeFileError` and runs nothing), then validated before DCP
      allocates anything from it: every item a plain file of the folder, its bytes inside that file,
      no transforms (compression), no more tensor bytes declared than the files hold;
    - data files are opened as a store's shards are (no link followed, regular files only, never
      blocking), and each tensor item, a ``torch.save`` of one tensor, is read by aiotensor's
      torch.save reader (no pickle beyond a state_dict's, every storage bounds-checked);
    - byte items (non-tensor values) are admitted only if ``torch.load(weights_only=True)`` loads
      them: DCP's planner would unpickle them with ``weights_only=False``.
    """

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._forget(checkpoint_id)
        super().reset(checkpoint_id)

    def _read_metadata(self) -> md.Metadata:
        folder, eng = local_path(self.path), PosixEngine()
        path = os.path.join(folder, dm.PICKLE_NAME)
        m, d = dm.loads_pickle(_root.read_small(eng, path, dm.MAX_BYTES, errors.ManifestError, "the metadata"), path)
        dm.check(d, lambda name: sources.file_size(eng, os.path.join(folder, name)), path)
        if m.storage_meta is not None:
            m.storage_meta.load_id = getattr(self, "load_id", None)
        return m  # type: ignore[no-any-return]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        folder = local_path(self.path)
        safe = _SafeBytes(planner, folder)
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        eng = PosixEngine()
        for name, reqs in per_file.items():
            path = os.path.join(folder, name)
            fd = eng.open_read(path)  # a link, a FIFO, a device: refused before reading
            try:
                size = eng.size(fd)
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    where = f"item {req.storage_index.fqn!r}"
                    if info.offset + info.length > size:
                        raise errors.FormatError(f"{where} lies past the end of the file ({size} bytes): it shrank", path)
                    if req.type == LoadItemType.BYTE_IO:
                        data = _root.read_range(eng, fd, info.offset, info.length, path, errors.FormatError, where)
                        safe.load_bytes(req, io.BytesIO(data))
                    else:
                        _fill(safe, req, ts.read_tensor_at(eng, fd, info.offset, info.length, path, where))  # type: ignore[arg-type]
            finally:
                eng.close(fd)
        return _done(None)


def reader_for(path: str | os.PathLike[str]) -> StorageReader:
    """The reader for a DCP checkpoint folder: aiotensor's, or DCP's own without its pickle."""
    path = local_path(path)
    if os.path.lexists(os.path.join(path, METADATA)):
        return AiotensorReader(path)
    if os.path.lexists(os.path.join(path, dm.PICKLE_NAME)):
        return SafeFileSystemReader(path)
    raise FileNotFoundError(f"{path}: not a DCP checkpoint (no {METADATA} or .metadata)")


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    return any(os.path.lexists(os.path.join(local_path(path), n)) for n in (METADATA, dm.PICKLE_NAME))


def load_full(path: str | os.PathLike[str], *, verify: bool = True, storage_options: Any = None) -> Any:
    """The whole state a DCP checkpoint holds (either writer's), unsharded, in this process (no
    process group): what ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` does,
    through aiotensor's resolver and read path (:mod:`aiotensor.sources`): no pickle runs beyond
    the allow-listed metadata, every item is read within its file, and checked against its
    checksum. One difference: an optimizer's ``state`` comes keyed by the ints its
    ``param_groups`` list (``0``), as the optimizer made it, where DCP's places give ``"0"``.
    Memory: the whole state. Blocking (an event loop of its own, in a thread).
    ``path`` may be an ``s3://`` URL (``storage_options`` as for :class:`AiotensorReader`).

    Raises:
        CheckpointNotFoundError: ``path`` holds no checkpoint (a store root: its step folders do),
            or it went (deleted, retired) while it was read.
        FormatError (ManifestError, UnsafeFileError, ChecksumError...), OSError: as raised while
            reading, naming the file and the item.
    """
    folder = where(path)

    async def load(sched: Scheduler) -> Any:
        src = await sched.call(_checkpoint, sched.engine, folder)
        try:
            tensors = await read(sched, src.entries, torch.device("cpu"), verify, checks=src.checks)
        except FileNotFoundError as e:
            if (gone := await sched.call(sources.missing, sched.engine, folder, e)) is e:
                raise
            raise gone from None
        by_name = {n: t for e, t in zip(src.entries, tensors, strict=True) for n in e.names}
        assert src.state is not None
        return src.state(by_name.__getitem__)

    return _Runner(folder, None, None, None, storage_options).run(load)


def _checkpoint(engine: Engine, folder: str) -> sources.Source:
    """The DCP checkpoint (or step) ``folder``, or a CheckpointNotFoundError saying what it is instead."""
    try:
        names = engine.listdir(folder)
    except FileNotFoundError:
        raise errors.CheckpointNotFoundError(f"{folder}: no such folder") from None
    except NotADirectoryError:
        raise errors.CheckpointNotFoundError(f"{folder} is a file, not a DCP checkpoint's folder") from None
    if _root.checkpoint_record(names) is None:
        hint = ": a store root, pass one of its step folders (step-...)" if _root.is_store(names) else ""
        raise errors.CheckpointNotFoundError(f"{folder} is not a DCP checkpoint (no {dm.PICKLE_NAME}){hint}")
    return sources.step(engine, folder)


def unwrap(exc: CheckpointException, what: str) -> BaseException:
    """DCP's ``CheckpointException`` (a BaseException, which ``except Exception`` misses) as an
    ordinary error: this rank's own failure as itself (noting the other ranks that failed), or a
    :class:`~aiotensor.errors.DistributedError` naming the ranks that did and what they raised."""
    failures: dict[int, Any] = dict(exc.failures)
    me = dist.get_rank() if dist.is_initialized() else 0
    lines = {r: f"rank {r}: {type(e).__name__}: {e}"[:600] for r, (e, _tb) in sorted(failures.items())}
    own = failures.get(me, (None, None))[0]
    if type(own) is ValueError and "validate global plan" in str(own):  # DCP's coordinator: the ranks' states
        own = errors.MismatchError(f"{what}: the ranks' states do not fit together ({own})")  # (a ValueError too)
    if isinstance(own, Exception):
        if len(failures) > 1:
            own.add_note(f"{what} also failed on " + "; ".join(ln for r, ln in lines.items() if r != me))
        return own
    err = errors.DistributedError(f"{what} failed: " + "; ".join(lines.values()))
    err.failures = {r: e for r, (e, _tb) in failures.items()}
    return err


__all__ = [
    "AiotensorReader",
    "AiotensorWriter",
    "SafeFileSystemReader",
    "dumps_metadata",
    "is_checkpoint",
    "load_full",
    "loads_metadata",
    "reader_for",
    "unwrap",
]
