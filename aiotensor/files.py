"""Single safetensors files: ``save_file``, ``load_file`` and ``read_header``, async and atomic.

Files written here carry a crc32c per tensor in their ``__metadata__`` under ``aiotensor.crc32c``
(a JSON object, tensor name -> 8 lowercase hex digits): the file stays a standard safetensors file
(other readers ignore metadata), and ``load_file`` verifies every tensor of a file that has them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any

import torch

from . import sources
from ._io.read import close, layout_of, read_tensors, verify_mapped, written
from ._io.tensors import (
    Target,
    carved_targets,
    check_into,
    check_tensor,
    io_bytes,
    load_device,
    mapped,
    materialize,
    wait_for_streams,
)
from ._io.write import crcs_of, write_file
from ._runtime import cuda, gil
from ._runtime.scheduler import Priority, ProgressCallback, Scheduler, check_progress, own_scheduler, reporting
from .commit import Publication
from .engines import Engine
from .errors import MismatchError, StateError, UnsafePathError, annotate_oserror
from .formats import safetensors as st
from .formats.dtypes import SAFETENSORS_TO_TORCH, file_shape, torch_shape
from .location import engine_for, is_object, local_path, where

CRC_KEY = st.CRC_KEY


@dataclass(frozen=True)
class TensorInfo:
    """A stored tensor's name, dtype, shape (as torch makes it) and size in bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class FileInfo:
    """What a safetensors file holds, read from its header alone (no tensor data).

    ``metadata`` is the file's ``__metadata__`` without aiotensor's own checksum entry;
    ``checksummed`` says whether the file carries aiotensor's per-tensor crc32c.
    """

    path: str
    size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    checksummed: bool


def tensor_info(spec: st.TensorSpec) -> TensorInfo:
    return TensorInfo(spec.key, SAFETENSORS_TO_TORCH[spec.dtype], torch_shape(spec.dtype, spec.shape), spec.nbytes)


async def save_file(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
    *,
    scheduler: Scheduler | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Write ``tensors`` to a safetensors file that any safetensors reader opens, atomically.

    The file is written under a temporary name, made durable, then renamed over ``path``: a reader
    sees the old file or the new one, never a mix. Tensors are written from their own memory (no
    staging copy): do not change them until this returns. CUDA tensors are written after the work
    already queued on their streams, by cuFile with the kvikio engine, else through pinned bounce
    slots. Tensors sharing memory are written once each. The data section starts at a 4096-byte
    boundary. ``metadata`` (str -> str) goes into the file's ``__metadata__``, beside aiotensor's
    per-tensor crc32c (``aiotensor.crc32c``) and ``"format": "pt"`` (unless ``metadata`` has a
    format): transformers' ``from_pretrained`` refuses a file whose metadata lacks it, as
    ``save_pretrained`` writes it. :func:`read_header` gives it back.

    ``storage_options``: for an ``s3://`` path, obstore's S3 keys (``endpoint``, ``access_key_id``,
    ``region``..., and ``allow_http``) over the ``AWS_*`` environment (``docs/store.md``).

    Raises:
        StateError: a key that is not a string, metadata that is not str -> str (or uses aiotensor's
            key), or a tensor safetensors cannot store (named).
        OSError: disk full or another I/O error, naming the file; ``path`` is then untouched.

    Cancellation: the temporary file is removed and ``path`` is untouched; returns after the
    writing threads stopped.
    """
    path = where(path)
    async with (
        own_scheduler(scheduler, engine_for(path, scheduler, storage_options)) as sched,
        Publication(sched, path, folder=False) as pub,
    ):
        await write_safetensors(sched, pub.tmp, tensors, metadata)
        await pub.publish()


async def write_safetensors(
    sched: Scheduler, path: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> int:
    """Create ``path`` (it must not exist) as a safetensors file of ``tensors`` with aiotensor's
    per-tensor crc32c, durably (fsync'ed), and return its tensor bytes: :func:`save_file` without
    the publication (a file inside a folder being published needs none of its own).

    Raises: as :func:`save_file`. Cancellation: returns after the writing threads stopped; the
    file is the caller's to remove.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names to tensors (a dict), got {type(tensors).__name__}")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise StateError("metadata must map str to str")
    if metadata is not None and CRC_KEY in metadata:
        raise StateError(f"metadata key {CRC_KEY!r} is aiotensor's own (the per-tensor checksums)")
    # checking, ordering and laying out tens of thousands of tensors: not on the loop thread
    entries = await sched.call(_entries, tensors, sched.devices, priority=Priority.SAVE)
    await wait_for_streams(sched, map(_THIRD, entries))
    sources = await sched.call(_sources, sched, entries, priority=Priority.SAVE)
    crcs = await crcs_of(sched, sources)
    meta = {"format": "pt", **(metadata or {})}
    ranges, nbytes = await sched.call(_ranges, entries, sources, crcs, meta, priority=Priority.SAVE)
    await write_file(sched, path, ranges)
    await sched.discard(entries, sources, crcs, ranges)  # tens of thousands of objects: freed in a thread
    return nbytes


def _entries(tensors: Mapping[str, torch.Tensor], devices: tuple[str, ...]) -> list[tuple[str, str, torch.Tensor]]:
    entries = []
    for key, t in tensors.items():
        if not isinstance(key, str):
            raise StateError(f"tensor keys must be str, got {key!r}")
        if not isinstance(t, torch.Tensor):
            raise StateError(f"{key!r} is a {type(t).__name__}, not a tensor")
        entries.append((key, check_tensor(key, t, devices), t))
    entries.sort(key=lambda e: -e[2].element_size())  # each tensor starts at a multiple of its itemsize
    return entries


def _sources(sched: Scheduler, entries: list[tuple[str, str, torch.Tensor]]) -> list[memoryview | torch.Tensor]:
    """Each tensor's bytes as the engine writes them (a lazy conj/neg or strided view materialized)."""
    return [io_bytes(sched.engine, materialize(t)) for _, _, t in entries]


def _ranges(
    entries: list[tuple[str, str, torch.Tensor]],
    sources: list[memoryview | torch.Tensor],
    crcs: list[int],
    metadata: dict[str, str],
) -> tuple[list[tuple[int, memoryview | torch.Tensor]], int]:
    """The header (with the checksums) and every tensor's bytes at their offsets in the file, and
    the tensors' bytes (counted here: a sum over 20,000 sources held the loop 2 ms)."""
    metadata[CRC_KEY] = json.dumps({k: f"{c:08x}" for (k, _, _), c in zip(entries, crcs, strict=True)}, separators=(",", ":"))
    header, layout = st.build([(k, d, file_shape(d, t.shape)) for k, d, t in entries], metadata)
    ranges: list[tuple[int, memoryview | torch.Tensor]] = [(0, memoryview(header))]
    ranges += [(s.offset, src) for s, src in zip(layout.tensors, sources, strict=True) if s.nbytes]
    return ranges, sum(map(len, sources))


def _opened(engine: Engine, path: str, resolve: bool) -> tuple[int, st.Layout]:
    """Open ``path`` and read its header, in one worker call (errors name ``path``).
    ``resolve``: the file a user named, links resolved (the user chose it: a Hugging Face cache
    links its files to blobs). Files inside a checkpoint folder are never resolved: a link there
    could lead out of it, so opening one is refused (see
    :func:`aiotensor.engines.posix.open_regular`)."""
    real = os.path.realpath(path) if resolve and not is_object(path) else path
    try:
        fd = engine.open_read(real)
    except UnsafePathError as e:
        if e.reason.startswith("is a folder"):  # (helper-59: the message sent them nowhere)
            raise UnsafePathError(
                "is a folder: load_file and read_header read one safetensors file; stream, load_into and "
                "prepare_swap read a model folder or a checkpoint (TensorStore reads a store's steps)",
                path,
            ) from None
        raise
    except OSError as e:
        raise annotate_oserror(e, f"opening {path}") from e
    try:
        return fd, layout_of(engine, fd, path)
    except BaseException:
        engine.close(fd)
        raise


async def _open_layout(sched: Scheduler, path: str, resolve: bool) -> tuple[int, st.Layout]:
    """The open file ``path`` and its header (:func:`_opened`). Cancellation: returns once the
    open has stopped; nothing is left open."""
    eng = sched.engine
    return await sched.call(_opened, eng, path, resolve, priority=Priority.LOAD, cleanup=lambda got: eng.close(got[0]))


def _header(engine: Engine, path: str) -> FileInfo:
    """:func:`read_header` (tens of thousands of tensors: in a worker, helper-51: 40-70 ms on the loop)."""
    fd, layout = _opened(engine, path, True)
    engine.close(fd)
    crcs = st.crc_table(layout, path)
    meta = {k: v for k, v in (layout.metadata or {}).items() if k != CRC_KEY}
    return FileInfo(path, layout.file_size, {s.key: tensor_info(s) for s in layout.tensors}, meta, crcs is not None)


async def read_header(
    path: str | os.PathLike[str], *, scheduler: Scheduler | None = None, storage_options: Mapping[str, Any] | None = None
) -> FileInfo:
    """Names, dtypes, shapes and sizes of a safetensors file's tensors, and its metadata, from the
    header alone (validated completely; no tensor data is read).

    ``storage_options``: for an ``s3://`` path, obstore's S3 keys (``endpoint``, ``access_key_id``,
    ``region``..., and ``allow_http``) over the ``AWS_*`` environment (``docs/store.md``).

    Raises:
        HeaderError: a malformed header (or not a safetensors file), naming the file.
        UnsafePathError: not a regular file (a FIFO, a device, a folder).
        OSError: the file cannot be read.

    Cancellation: returns once the header read has stopped; nothing is left open.
    """
    path = local_path(path, objects=True)
    async with own_scheduler(scheduler, engine_for(path, scheduler, storage_options)) as sched:
        return await sched.call(_header, sched.engine, path, priority=Priority.LOAD)


async def load_file(
    path: str | os.PathLike[str],
    *,
    into: Mapping[str, torch.Tensor] | None = None,
    device: str | torch.device = "cpu",
    verify: bool = True,
    strict: bool = True,
    scheduler: Scheduler | None = None,
    progress: ProgressCallback | None = None,
    mmap: bool = False,
    keys: sources.Keys = None,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Read a safetensors file (from any writer) into new tensors on ``device``, or in place into
    ``into`` (whose tensors may be on CUDA; parameters that require grad are filled in place).
    ``strict`` has ``load_state_dict``'s meaning, ``into`` in the module's place: ``strict=False``
    reads the tensors both have, leaves the rest of ``into`` as it is (missing keys: a sharded model
    loads shard by shard into one state dict) and skips the file's others (unexpected keys).

    The header is validated completely before anything is allocated. A file written by aiotensor
    carries a crc32c per tensor: each is verified (unless ``verify=False``), so a flipped bit or a
    file rewritten in place by another process while it was read is an error, never silent wrong
    values. CUDA tensors are filled through cuFile by the kvikio engine, or through pinned bounce
    slots and a copy stream; either way they are complete when this returns. ``progress(done,
    total)`` is called on the loop thread as bytes are read.

    ``mmap=True`` (CPU, without ``into``) copies nothing: the tensors are views of the file's pages,
    mapped copy-on-write as ``safetensors.load_file`` maps them (writing into one changes this
    process's copy, never the file), and the page cache holds the bytes once however many
    processes map them. The checksums are verified by reading the mapped pages (``verify=False``
    skips that, and the load then reads nothing until a tensor is used). The mapping lives as long
    as any of its tensors, and with it the file's inode: a step retired or deleted meanwhile keeps
    its disk space until they are gone. A tensor at an offset that is not a multiple of its item
    size (other writers may put one there) is copied.

    ``keys`` reads only some tensors into new ones: one name, names and prefixes (a prefix ends
    with ``.``), or a predicate, as :func:`stream` takes them; the others' bytes are never read
    (not with ``into=``, whose names choose, nor ``mmap=True``, which reads nothing anyway).

    ``storage_options``: for an ``s3://`` path, obstore's S3 keys (``endpoint``, ``access_key_id``,
    ``region``..., and ``allow_http``) over the ``AWS_*`` environment (``docs/store.md``).

    Raises:
        HeaderError: a malformed header, or not a safetensors file (a torch.save zip is named as
            such), naming the file (and the tensor).
        ChecksumError: a tensor's bytes differ from its recorded crc32c (naming file and tensor).
        MismatchError: ``into`` has other shapes or dtypes than the file, or with ``strict``,
            other keys (named as missing and unexpected keys); a name or prefix of ``keys``
            selects nothing.
        UnsafePathError: not a regular file (a FIFO, a device, a folder).
        OSError: the file cannot be read.
        ValueError: ``device`` is not a device type this machine's scheduler handles.

    Cancellation: returns once no worker thread writes into the tensors; ``into``'s may then hold
    a mix of old and new values, their version counters moved (as when a load fails partway).
    """
    path = local_path(path, objects=True)
    check_progress(progress)
    keys = sources.fixed(keys)
    if keys is not None and (into is not None or mmap):
        raise ValueError("keys= chooses what a load into new tensors reads: not with into= (its names choose) or mmap=True")
    async with own_scheduler(scheduler, engine_for(path, scheduler, storage_options)) as sched:
        if mmap:
            if into is not None or torch.device(device).type != "cpu" or is_object(path):
                raise ValueError("mmap=True maps a local file into new CPU tensors: not with into=, another device or a URL")
            return await map_file(sched, path, verify)
        ok = not strict
        return await read_file(
            sched, path, into, device=device, verify=verify, missing_ok=ok, unexpected_ok=ok, progress=progress, resolve=True,
            select=keys,
        )  # fmt: skip


async def read_file(
    sched: Scheduler,
    path: str,
    into: Mapping[str, torch.Tensor] | None = None,
    *,
    keys: set[str] | None = None,
    device: str | torch.device = "cpu",
    verify: bool = True,
    missing_ok: bool = False,
    unexpected_ok: bool = False,
    progress: ProgressCallback | None = None,
    resolve: bool = False,
    select: sources.Keys = None,
) -> dict[str, torch.Tensor]:
    """:func:`load_file` on ``sched`` of a file at a path that is never resolved (links refused),
    unless ``resolve`` (:func:`_opened`); ``keys`` (without ``into``): read only those tensors;
    ``select``: ``load_file``'s ``keys`` (names, prefixes, a predicate) to choose them by;
    ``missing_ok``/``unexpected_ok``: as :func:`check_into`."""
    dev = await load_device(sched, device)
    fd, layout = await _open_layout(sched, path, resolve)
    dest: dict[str, torch.Tensor]
    try:
        if select is not None:  # a predicate per tensor, for tens of thousands: not on the loop thread
            keys = await sched.call(sources.chosen, map(_KEY, layout.tensors), select, path, priority=Priority.LOAD)
        ok = (missing_ok, unexpected_ok)
        # new CUDA tensors allocated on the caller's streams: the allocator ties a block to the stream
        # it was allocated on, and the worker's default stream would let the caller's work race a reuse
        streams = cuda.caller_streams()
        dest, targets, nbytes = await sched.call(
            cuda.under, streams, _targets, sched, layout, path, into, dev, verify, ok, keys, priority=Priority.LOAD, home=True
        )
        try:
            with reporting(nbytes, progress):
                await read_tensors(sched, fd, path, targets, Priority.LOAD)
        finally:
            if into is not None:  # (read whole, or failed or cancelled partway: some hold new bytes)
                await written(sched, map(_TENSOR, targets))
    finally:
        await close(sched, fd)
    big = [layout]
    del layout
    await sched.discard(targets, big)  # tens of thousands of objects: freed in a thread
    return dest


async def map_file(sched: Scheduler, path: str, verify: bool = True) -> dict[str, torch.Tensor]:
    """:func:`load_file` with ``mmap=True`` (``path`` as the user named it: links resolved, see
    :func:`_opened`), the file opened, parsed and mapped in one worker call (a server maps many
    shards: each hop to a thread costs as much as the mapping)."""
    targets, tensors, checked = await sched.call(_mapped, sched.engine, path, verify, priority=Priority.LOAD)
    if checked:
        await verify_mapped(sched, path, targets, Priority.LOAD)
    await sched.discard(targets)  # tens of thousands of objects, for a file of many tensors
    return tensors


def _mapped(engine: Engine, path: str, verify: bool) -> tuple[list[Target], dict[str, torch.Tensor], bool]:
    """A copy-on-write mapping of the file the user named and a view of it for each tensor (with
    its crc), the tensors by name, and whether any has a crc to check."""
    fd, layout = _opened(engine, path, True)
    try:
        crcs = st.crc_table(layout, path) if verify else None
        targets = mapped(
            fd, path, layout.file_size, layout.tensors, None if crcs is None else [crcs[s.key] for s in layout.tensors]
        )
        return targets, {t.spec.key: t.tensor for t in targets}, crcs is not None
    finally:
        engine.close(fd)


def _targets(
    sched: Scheduler,
    layout: st.Layout,
    path: str,
    into: Mapping[str, torch.Tensor] | None,
    dev: torch.device,
    verify: bool,
    ok: tuple[bool, bool] = (False, False),
    keys: set[str] | None = None,
) -> tuple[dict[str, torch.Tensor], list[Target], int]:
    """The tensors to fill (in ``into``'s order, or the file's), a read target for each, and their bytes."""
    crcs = st.crc_table(layout, path) if verify else None
    if keys is not None and not keys <= {s.key for s in layout.tensors}:
        raise MismatchError(f"{path} holds no tensor {sorted(keys - {s.key for s in layout.tensors})[:5]}")
    if into is None:  # new tensors, carved, in the file's order
        chosen = [s for s in layout.tensors if keys is None or s.key in keys]
        names = gil.listed(map(_KEY, chosen))
        tensors, targets = carved_targets(
            chosen, repeat(None) if crcs is None else map(crcs.__getitem__, names), repeat("crc32c"), dev
        )
        dest = gil.filled({}, zip(names, tensors, strict=True))
    else:
        specs = {s.key: s for s in layout.tensors}
        *_, shadowed = check_into(into, specs, sched.devices, f"the file {path}", missing_ok=ok[0], unexpected_ok=ok[1])
        dest = dict(into)
        targets = [
            Target(s, dest[s.key], None if crcs is None else crcs[s.key])
            for s in layout.tensors
            if s.key in dest and s.key not in shadowed
        ]
    return dest, targets, sum(t.spec.nbytes for t in targets)


_KEY, _TENSOR = attrgetter("key"), attrgetter("tensor")
_THIRD = itemgetter(2)
