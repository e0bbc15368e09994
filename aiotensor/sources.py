"""The one source resolver: what a path is, and which tensors it holds, where.

Every reader (``stream``, ``load_into``, ``prepare_swap``, ``load_torch``, a store's load of a DCP
step, the DCP reader, every CLI command) asks :func:`resolve` and reads what it answers. Kinds:

- ``step``: an aiotensor checkpoint folder (``manifest.json``, shards with a crc32c per tensor);
- ``dcp``: a torch.distributed.checkpoint folder, aiotensor's (``.metadata.json``: one file per
  rank, a crc32c per item; a distributed store's steps) or DCP's own ``FileSystemWriter``'s
  (``.metadata``, read without running its pickle); its tensors are whole, assembled from chunks;
- ``root``: a store root, read as its newest committed step (of either kind above);
- ``safetensors``: one file (any writer; aiotensor's carry a crc32c per tensor);
- ``torch``: a torch.save zip (``.pt``/``.bin``: no pickle beyond a state_dict's; a storage shared by
  several tensors is read once, and each tensor is a view of it, as ``torch.load`` makes it);
- ``hf``: a Hugging Face model folder, in every layout ``from_pretrained`` reads.

Links: the path the user names is resolved (the user chose it), and so are the files of a Hugging
Face folder (its cache links them to blobs). Inside a checkpoint folder nothing is followed: a link
there is :class:`~aiotensor.errors.UnsafePathError`, as a FIFO or device anywhere is (every file
is opened by the engine's safe opener, :func:`aiotensor.engines.posix.open_regular`).

Everything here blocks: run it in a worker thread.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import repeat
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from . import root as _root
from ._io.assemble import Entry, Part, Span, stored_bytes
from ._io.read import Check, ShardCheck, layout_of, same_file, same_step
from .engines import Engine
from .errors import CheckpointNotFoundError, FormatError, ManifestError, MismatchError, UnsafeFileError, annotate_oserror
from .formats import dcp_metadata as dm
from .formats import safetensors as st
from .formats import torchsave as ts
from .formats.dtypes import PACKED, SAFETENSORS_TO_TORCH, TORCH_TO_SAFETENSORS, file_shape, torch_shape
from .formats.tree import unflatten
from .location import mode_of, real_path

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
MAX_INDEX_BYTES = 64 << 20


@dataclass(frozen=True)
class Source:
    """What :func:`resolve` found.

    ``entries`` are in file order. ``state`` rebuilds the whole state (non-tensor values and
    nesting kept) from a lookup of tensors by name, where the source has more than a flat mapping
    of names (a checkpoint, a torch.save file); otherwise it is None. ``checksummed``: every byte
    read is covered by a crc32c the writer recorded. ``metadata``: each safetensors file's
    ``__metadata__``. ``checks``: what each file must pass as a reader opens it for its data
    (:func:`~aiotensor._io.read.open_read`): a file whose header was read must still be that file
    (:func:`~aiotensor._io.read.same_file`: else a :class:`SourceChangedError`, not other bytes
    read by the header read), a step's shard must hold what its manifest lists
    (:func:`~aiotensor._io.read.check_shard`, as a store's ``load()`` checks it: helper-60 found
    ``verify`` and ``stream`` reading a shard whose header ``load()`` refused). Checked where the
    data is read, so a listing (``ls``, ``info()``) or a stream of some keys opens only what it reads.
    """

    kind: str
    path: str
    entries: tuple[Entry, ...]
    files: tuple[str, ...]
    checksummed: bool
    step: int | None = None
    state: Callable[[Callable[[str], Any]], Any] | None = None
    metadata: dict[str, dict[str, str]] = field(default_factory=dict)
    checks: dict[str, Check] = field(default_factory=dict)

    @property
    def stored_bytes(self) -> int:
        """Bytes the tensors take in the files (a storage shared by several tensors counted once)."""
        return stored_bytes(self.entries)


def resolve(engine: Engine, path: str) -> Source:
    """Resolve the path a user named.

    Raises:
        CheckpointNotFoundError: nothing there, a store root with no committed step, or a folder
            that holds no checkpoint or model.
        FormatError: a file, header, manifest, index or metadata that does not follow its format.
        UnsafePathError: a link inside a checkpoint folder, a FIFO, a device.
        OSError: a file cannot be read.
    """
    real = real_path(path)  # the user chose it
    try:
        mode = mode_of(engine, real)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such file or folder") from None
    except OSError as e:  # (an object store's answer names its request, not the URL: helper-74)
        raise annotate_oserror(e, f"looking at {path}", unless_named=True) from None
    if stat.S_ISDIR(mode):
        return _folder(engine, real)
    name = os.path.basename(path)
    if name in (INDEX, BIN_INDEX, _root.MANIFEST, dm.PICKLE_NAME, dm.JSON_NAME):
        # a model's index (helper-59) or a checkpoint's record (helper-60) named: its folder, the
        # one it was named in (a Hugging Face cache links it to a blob elsewhere: helper-61)
        folder = real_path(os.path.dirname(path) or ".")
        return _hf(engine, folder, {name}) if name in (INDEX, BIN_INDEX) else _folder(engine, folder)
    return _file(engine, real)


def _folder(engine: Engine, folder: str) -> Source:
    names = set(engine.listdir(folder))
    if _root.checkpoint_record(names) is not None:
        return step(engine, folder)
    if names & {_root.LATEST, _root.LOCK} or any(_root.parse_step(n) is not None for n in names):
        listing = _root.scan(engine, folder, {})
        if not listing.committed:
            raise CheckpointNotFoundError(f"{folder}: a store root with no committed step")
        newest = max(listing.committed)
        return replace(step(engine, os.path.join(folder, listing.committed[newest]), newest), kind="root")
    return _hf(engine, folder, names)


def step(engine: Engine, folder: str, number: int | None = None) -> Source:
    """A checkpoint folder, of either kind (an aiotensor manifest step, or a DCP checkpoint); with
    ``number``, its manifest must name that step."""
    try:
        if engine.exists(os.path.join(folder, _root.MANIFEST)):
            return _manifest_step(engine, folder, number)
        return _dcp_step(engine, folder)
    except FileNotFoundError as e:
        if (gone := missing(engine, folder, e)) is e:
            raise
        raise gone from None  # (helper-64: a stream of a root whose newest step went meanwhile said a .metadata was missing)


def missing(engine: Engine, folder: str, e: FileNotFoundError) -> Exception:
    """What a file of the checkpoint ``folder`` found missing (``e``) means: where the folder still
    holds its record, a file it lists is gone, damage (``e`` itself, which the caller names);
    else the checkpoint went while it was read (a CheckpointNotFoundError)."""
    if isinstance(e, CheckpointNotFoundError) or _root.checkpoint_record(_names(engine, folder)) is not None:
        return e
    return CheckpointNotFoundError(f"{folder} is gone: retired (or removed) while it was being read; read the newest step again")


def _names(engine: Engine, folder: str) -> list[str]:
    """The entries of ``folder``; none where it is gone."""
    try:
        return list(engine.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []


# --- aiotensor checkpoints ----------------------------------------------------------------------


def _manifest_step(engine: Engine, folder: str, number: int | None) -> Source:
    m = _root.read_manifest(engine, folder, number)
    names: dict[str, list[str]] = {k: [k] for k in m.entries}
    for alias, target in m.aliases.items():
        names[target].append(alias)
    entries = tuple(
        Entry(
            tuple(names[k]),
            SAFETENSORS_TO_TORCH[e.spec.dtype],
            torch_shape(e.spec.dtype, e.spec.shape),
            (Part(Span(os.path.join(folder, e.shard), e.spec, e.crc32c)),),
        )
        for k, e in sorted(m.entries.items(), key=lambda kv: (kv[1].shard, kv[1].spec.offset))
    )
    where = os.path.join(folder, _root.MANIFEST)
    files = tuple(os.path.join(folder, s) for s in m.shards)
    checks = _shard_checks(m, folder, where)
    return Source("step", folder, entries, files, True, m.step, lambda get: unflatten(m.tree, get, where), checks=checks)


def _shard_checks(m: Any, folder: str, where: str) -> dict[str, Check]:
    """The check of each shard of the step ``m`` (:func:`~aiotensor._io.read.check_shard`)."""
    by_shard: dict[str, list[Any]] = {s: [] for s in m.shards}
    for e in m.entries.values():
        by_shard[e.shard].append(e)
    checks: dict[str, Check] = {}
    for shard, size in m.shards.items():
        path = os.path.join(folder, shard)
        checks[path] = ShardCheck(path, size, by_shard[shard], m.headers.get(shard), where, m.identity)
    return checks


def _dcp_step(engine: Engine, folder: str) -> Source:
    """A DCP checkpoint: whole tensors assembled from each rank's chunks, and the state rebuilt
    from the places DCP recorded (non-tensor values unpickled as ``torch.load(weights_only=True)``
    does, or refused)."""
    aiotensor = engine.exists(os.path.join(folder, dm.JSON_NAME))
    where = os.path.join(folder, dm.JSON_NAME if aiotensor else dm.PICKLE_NAME)
    identity: list[Any] = []
    data = _root.read_small(engine, where, dm.MAX_BYTES, ManifestError, "the DCP metadata", identity=identity)
    d = dm.loads_json(data, where) if aiotensor else dm.loads_pickle(data, where)[1]
    try:
        src = _dcp_source(engine, folder, d, where, aiotensor)
    except FormatError:  # a checkpoint saved again over it meanwhile: that, not a malformed one
        same_step(engine, where, identity[0])
        raise
    # its data files were first opened (their identities kept) after it was read: the same save's, or
    # one replaced the folder meanwhile (its old metadata's offsets read the new files, helper-64)
    same_step(engine, where, identity[0])
    return src


def _dcp_source(engine: Engine, folder: str, d: Any, where: str, aiotensor: bool) -> Source:
    """:func:`_dcp_step`'s source, of the metadata ``d`` (read from ``where``)."""
    checks: dict[str, Check] = {}  # each file as first opened here: what a reader's open must find again
    dm.check(d, lambda name: file_size(engine, os.path.join(folder, name), checks), where)
    files = {name: os.path.join(folder, name) for name in sorted(d.files())}
    if aiotensor:  # items are tensors of each rank's safetensors file
        layouts = {name: _safetensors_layout(engine, path, checks) for name, path in files.items()}
        spans = {
            (name, s.key): Span(files[name], s, None if crcs is None else crcs[s.key])
            for name, (lay, crcs) in layouts.items()
            for s in lay.tensors
        }

        def span_of(fqn: str, s: dm.Stored) -> tuple[Span, ts.TensorRef | None]:
            got = spans.get((s.file, s.key or ""))
            if got is None:
                raise ManifestError(f"item {fqn!r}: {s.file} holds no tensor {s.key!r}", where)
            return got, None
    else:

        def span_of(fqn: str, s: dm.Stored) -> tuple[Span, ts.TensorRef | None]:
            assert s.offset is not None and s.length is not None
            ref = _blob(engine, files[s.file], s.offset, s.length, f"item {fqn!r}", checks)
            storage = st.TensorSpec(fqn, "U8", (ref.storage.nbytes,), s.offset + ref.storage.offset, ref.storage.nbytes)
            return Span(files[s.file], storage, ref.storage.crc32, "crc32"), ref

    entries = []
    for fqn, t in d.tensors.items():
        parts = []
        for c in t.chunks:
            span, view = span_of(fqn, c.stored)
            dtype, shape = (
                (view.dtype, view.size)
                if view is not None
                else (SAFETENSORS_TO_TORCH[span.spec.dtype], torch_shape(span.spec.dtype, span.spec.shape))
            )
            if (dtype, tuple(shape)) != (t.dtype, c.sizes):
                raise ManifestError(
                    f"item {fqn!r}: a chunk holds {dtype} {list(shape)}, the metadata says {t.dtype} {list(c.sizes)}", where
                )
            whole = c.sizes == t.size and not any(c.offsets)
            parts.append(Part(span, view, None if whole else c.offsets))
        _check_cover(fqn, t, where)
        entries.append(Entry((fqn,), t.dtype, t.size, tuple(parts), t.requires_grad))
    entries.sort(key=lambda e: (e.parts[0].span.path, e.parts[0].span.spec.offset) if e.parts else ("", 0))
    values = {
        fqn: _value(engine, fqn, s, files[s.file], spans if aiotensor else None, where, checks) for fqn, s in d.values.items()
    }

    def state(get: Callable[[str], Any]) -> Any:  # as DCP's own loader nests it: an item without a place at the top
        out: dict[str, Any] = {}
        for fqn in [*d.tensors, *d.values]:
            _set_element(out, d.places.get(fqn, (fqn,)), values[fqn] if fqn in values else get(fqn))
        _indexed_states(out)
        return out

    # DCP's own files: each tensor blob a zip, its CRC-32s checked (none where torch saved it without); a
    # value's pickled bytes carry none
    checksummed = (aiotensor or not d.values) and all(p.span.crc is not None for e in entries for p in e.parts)
    return Source("dcp", folder, tuple(entries), tuple(files.values()), checksummed, None, state, checks=checks)


def _indexed_states(tree: Any) -> None:
    """An optimizer's ``state_dict()`` keys its ``state`` by the indices its ``param_groups`` list
    under ``params`` (ints); DCP's places make them strings (``"0"``), and ``load_state_dict`` of
    that attached no moment to any parameter, without a word (helper-47: a distributed store's step
    resumed in one process trained on from zero moments). Each such ``state`` is keyed by those
    ints again, in place."""
    todo = [tree]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            state, groups = x.get("state"), x.get("param_groups")
            if isinstance(state, dict) and state and isinstance(groups, list):
                ids = {p for g in groups if isinstance(g, dict) for p in g.get("params", ()) if type(p) is int}
                keys = [int(k) if type(k) is str and k.isdecimal() and str(int(k)) == k else None for k in state]
                if None not in keys and set(keys) <= ids:
                    x["state"] = dict(zip(keys, state.values(), strict=True))
            todo += [v for v in x.values() if isinstance(v, (dict, list))]
        elif isinstance(x, list):
            todo += [v for v in x if isinstance(v, (dict, list))]


def _check_cover(fqn: str, t: dm.Tensor, where: str) -> None:
    """The chunks of a tensor (each inside it: :mod:`~aiotensor.formats.dcp_metadata`) fill it
    exactly: as many elements as it has, none of two chunks in common (a count alone let two that
    overlapped leave a hole, the memory of a new tensor there as it was: helper-72). A grid (the
    layouts DCP's sharding makes: rows, columns, both) is recognised by numpy: along each
    dimension its chunks' ranges tile the tensor, and the chunks are that many distinct cells.
    Any other layout: chunks sorted along the dimension where the fewest pairs meet, each against
    those that begin before it ends there, at most :data:`_PAIRS` pairs."""
    if sum(math.prod(c.sizes) for c in t.chunks) != math.prod(t.size):
        raise ManifestError(f"item {fqn!r}: its chunks do not cover {list(t.size)} exactly", where)
    if len(t.chunks) < 2 or not t.size:
        return
    lo = np.array([c.offsets for c in t.chunks], np.int64)
    hi = lo + np.array([c.sizes for c in t.chunks], np.int64)
    full = (hi > lo).all(axis=1)  # (an empty chunk holds nothing)
    lo, hi = lo[full], hi[full]
    if len(lo) < 2 or _grid(lo, hi, t.size):  # (an empty tensor's chunks: none left, helper-75)
        return
    own = np.arange(len(lo)) + 1
    best = None  # the dimension along which the fewest pairs meet: (pairs, order, ends)
    for k in range(lo.shape[1]):
        order = np.argsort(lo[:, k], kind="stable")
        ends = np.searchsorted(lo[order, k], hi[order, k], side="left")  # i meets only i+1 .. ends[i]-1 there
        pairs = int((ends - own).clip(0).sum())
        if best is None or pairs < best[0]:
            best = (pairs, order, ends)
    assert best is not None
    pairs, order, ends = best
    lo, hi = lo[order], hi[order]
    if pairs > _PAIRS:
        raise ManifestError(f"item {fqn!r}: its {len(t.chunks)} chunks are too many, too entangled, to check apart", where)
    for i in np.flatnonzero(ends > own):
        others = slice(i + 1, ends[i])
        if ((lo[others] < hi[i]) & (hi[others] > lo[i])).all(axis=1).any():
            raise ManifestError(f"item {fqn!r}: two of its chunks overlap (and leave a hole in {list(t.size)})", where)


_PAIRS = 1 << 24  # chunk pairs _check_cover compares at most outside a grid (~5 us each)


def _grid(lo: np.ndarray, hi: np.ndarray, size: Sequence[int]) -> bool:
    """Are the boxes ``[lo, hi)`` distinct cells of one grid over ``size``: along each dimension
    their ranges tile ``[0, size)``, and there are as many boxes as cells (then none overlap)?"""
    cells = 1
    for k, n in enumerate(size):
        ranges = np.unique(np.stack([lo[:, k], hi[:, k]], axis=1), axis=0)  # (sorted by start)
        if ranges[0, 0] != 0 or ranges[-1, 1] != n or (ranges[1:, 0] != ranges[:-1, 1]).any():
            return False
        cells *= len(ranges)
    return cells == len(lo) and len(np.unique(lo, axis=0)) == len(lo)


def _value(
    engine: Engine, fqn: str, s: dm.Stored, path: str, spans: dict[Any, Span] | None, where: str, checks: dict[str, Check]
) -> Any:
    """A non-tensor value of a DCP checkpoint: its pickled bytes, loaded only as
    ``torch.load(weights_only=True)`` admits (DCP's own planner would run any pickle)."""
    if spans is not None:
        span = spans.get((s.file, s.key or ""))
        if span is None:
            raise ManifestError(f"item {fqn!r}: {s.file} holds no tensor {s.key!r}", where)
        offset, length, crc = span.spec.offset, span.spec.nbytes, span.crc
    else:
        assert s.offset is not None and s.length is not None
        offset, length, crc = s.offset, s.length, None
    fd = engine.open_read(path)
    try:
        _seen(engine, path, fd, checks)
        data = _root.read_range(engine, fd, offset, length, path, FormatError, f"item {fqn!r}")
    finally:
        engine.close(fd)
    if crc is not None:
        from .formats.checksum import crc32c

        if crc32c(data) != crc:
            from .errors import ChecksumError

            raise ChecksumError(f"item {fqn!r} is corrupt: its crc32c differs from the one recorded", path, fqn)
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise UnsafeFileError(
            f"item {fqn!r} is not a value torch.load(weights_only=True) admits ({type(e).__name__}); nothing was run", path
        ) from None


def _set_element(root: dict[str, Any], place: tuple[str | int, ...], value: Any) -> None:
    """``value`` at ``place`` in ``root``, making dicts for str keys and lists for int keys on the
    way, as DCP's own loader does (``torch.distributed.checkpoint._traverse.set_element``)."""
    cur: Any = root
    for key, nxt in itertools.pairwise(place):
        fresh: Any = {} if type(nxt) is str else []
        if isinstance(cur, dict):
            cur = cur.setdefault(key, fresh)
        else:
            assert isinstance(key, int)
            cur.extend([None] * (key + 1 - len(cur)))
            if cur[key] is None:
                cur[key] = fresh
            cur = cur[key]
    last = place[-1]
    if isinstance(cur, list):
        assert isinstance(last, int)
        cur.extend([None] * (last + 1 - len(cur)))
    cur[last] = value


# --- single files and model folders --------------------------------------------------------------


def _file(engine: Engine, path: str) -> Source:
    """A safetensors file or a torch.save zip, its header read through one descriptor (the file
    whose identity the source keeps: ``Source.checks``)."""
    fd = engine.open_read(path)  # a FIFO or a device is refused here, before anything reads it
    try:
        checks: dict[str, Check] = {path: partial(same_file, path, engine.identity(fd))}
        head = bytearray(4)
        if engine.pread(fd, memoryview(head), 0) == 4 and ts.is_torch_zip(bytes(head)):
            return replace(_torch_file(engine, path, fd), checks=checks)
        if ts.is_legacy_torch(bytes(head)):
            raise UnsafeFileError(f"not a torch.save zip: the file {st.A_PICKLE}", path)
        layout = layout_of(engine, fd, path)
    finally:
        engine.close(fd)
    crcs = st.crc_table(layout, path)
    return Source("safetensors", path, _safetensors_entries(path, layout, crcs), (path,), crcs is not None or not layout.tensors,
                  metadata={path: dict(layout.metadata or {})}, checks=checks)  # fmt: skip


def _seen(engine: Engine, path: str, fd: int, checks: dict[str, Check]) -> None:
    """The open file ``fd`` is the one first opened at ``path`` while a source was resolved: its
    identity is kept in ``checks`` the first time (a reader's open for the data compares it,
    :func:`~aiotensor._io.read.same_file`), compared each time after (a DCP file is opened once per
    item: a file replaced between two of them mixed two checkpoints)."""
    check = checks.get(path)
    if check is None:
        checks[path] = partial(same_file, path, engine.identity(fd))
    else:
        check(engine, fd)


def _safetensors_layout(engine: Engine, path: str, checks: dict[str, Check]) -> tuple[st.Layout, dict[str, int] | None]:
    fd = engine.open_read(path)
    try:
        _seen(engine, path, fd, checks)
        layout = layout_of(engine, fd, path)
    finally:
        engine.close(fd)
    return layout, st.crc_table(layout, path)


def _safetensors_entries(path: str, layout: st.Layout, crcs: dict[str, int] | None) -> tuple[Entry, ...]:
    """An entry per tensor, each one span of the file: made column by column in C loops
    (:func:`~aiotensor.formats.safetensors.rows`; a 20,000-tensor file has as many)."""
    specs = layout.tensors
    keys = list(map(_KEY, specs))
    kinds = list(map(_DTYPE, specs))
    shapes = list(map(_SHAPE, specs)) if PACKED.keys().isdisjoint(kinds) else [torch_shape(s.dtype, s.shape) for s in specs]
    spans = st.rows(Span, repeat(path), specs, repeat(None) if crcs is None else map(crcs.__getitem__, keys), repeat("crc32c"))
    parts = zip(st.rows(Part, spans, repeat(None), repeat(None)))  # each a tuple of one
    dtypes = map(SAFETENSORS_TO_TORCH.__getitem__, kinds)
    return tuple(st.rows(Entry, zip(keys), dtypes, shapes, parts, repeat(False)))


_KEY, _DTYPE, _SHAPE = attrgetter("key"), attrgetter("dtype"), attrgetter("shape")


def _torch_file(engine: Engine, path: str, fd: int) -> Source:
    """A torch.save zip (open: ``fd``): one span per storage (read once, whatever shares it), each
    tensor a view of its storage's span; the tree walked once per object (shared structure stays
    shared)."""
    tree = ts.parse_open(engine, fd, path)
    refs = ts.tensor_refs(tree, path)  # each distinct tensor, with all its names, in first-seen order
    spans: dict[str, Span] = {}
    entries = []
    for names, ref in refs:
        s = ref.storage
        span = spans.get(s.key)
        if span is None:
            span = spans[s.key] = Span(path, st.TensorSpec(s.key, "U8", (s.nbytes,), s.offset, s.nbytes), s.crc32, "crc32")
        entries.append(Entry(names, ref.dtype, ref.size, (Part(span, ref),), ref.requires_grad))
    entries.sort(key=lambda e: e.parts[0].span.spec.offset)
    by_ref = {id(ref): names[0] for names, ref in refs}
    checksummed = all(span.crc is not None for span in spans.values())  # (saved with set_crc32_options(False): none)
    return Source(
        "torch", path, tuple(entries), (path,), checksummed, None, lambda get: ts.rebuild(tree, lambda ref: get(by_ref[id(ref)]))
    )


def _hf(engine: Engine, folder: str, names: set[str]) -> Source:
    """A model folder, in the order ``from_pretrained`` prefers: ``model.safetensors``, its sharded
    index, ``pytorch_model.bin``, its sharded index; else every ``*.safetensors`` file."""
    if SINGLE in names:
        files = [SINGLE]
    elif INDEX in names:
        files = _index_files(engine, os.path.join(folder, INDEX))
    elif BIN in names:
        files = [BIN]
    elif BIN_INDEX in names:
        files = _index_files(engine, os.path.join(folder, BIN_INDEX))
    else:
        files = sorted(n for n in names if n.endswith(".safetensors"))
    if not files:
        raise CheckpointNotFoundError(
            f"{folder}: not a checkpoint or model folder (no manifest.json, DCP metadata, committed step, "
            f"{SINGLE}, {INDEX}, {BIN}, {BIN_INDEX} or other safetensors file)"
        )
    entries: list[Entry] = []
    found_in: dict[str, str] = {}  # tensor name -> the file that holds it
    checksummed, metadata, checks = True, dict[str, dict[str, str]](), dict[str, Check]()
    for name in files:
        try:
            src = _file(engine, real_path(os.path.join(folder, name)))
        except FileNotFoundError as gone:  # a shard the index names, or a link to a blob not there
            raise annotate_oserror(gone, f"{folder}: {name}, a file of the model, is not there") from None
        for e in src.entries:
            for n in e.names:
                if n in found_in:
                    raise ManifestError(f"tensor {n!r} is in both {found_in[n]} and {name}", folder)
                found_in[n] = name
        entries += src.entries
        checksummed = checksummed and src.checksummed
        metadata |= src.metadata
        checks |= src.checks
    paths = tuple(real_path(os.path.join(folder, n)) for n in files)
    return Source("hf", folder, tuple(entries), paths, checksummed, metadata=metadata, checks=checks)


def _index_files(engine: Engine, index: str) -> list[str]:
    """The shard files a model folder's index names, in its order; read where a Hugging Face cache
    links it (a blob), named as the folder's."""
    try:
        raw = _root.read_small(engine, real_path(index), MAX_INDEX_BYTES, ManifestError, "the index", shown=index)
    except FileNotFoundError as gone:  # a link to a blob an interrupted download never wrote
        raise annotate_oserror(gone, f"{index}: the model's index is not there") from None
    doc = st.loads_json_object(raw, index, "index", ManifestError)
    weight_map = doc.get("weight_map")
    if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
        raise ManifestError("weight_map must map tensor names to file names", index)
    files = list(dict.fromkeys(weight_map.values()))
    if not files:  # (else "no model.safetensors.index.json", which is there)
        raise ManifestError("weight_map is empty: the index names no tensor and no shard", index)
    for f in files:
        if os.path.basename(f) != f or f in ("", ".", "..") or f.startswith(".") or not _encodable(f):
            raise ManifestError(f"shard {f!r} is not a plain file name inside the folder", index)
    return files


def _encodable(name: str) -> bool:
    """A name a file can have: no NUL, no lone surrogate (what ``os.fsdecode`` makes of bytes that
    are not UTF-8, which a JSON index can also hold)."""
    try:
        return "\x00" not in name and bool(os.fsencode(name))
    except UnicodeEncodeError:
        return False


# --- helpers --------------------------------------------------------------------------------------


def file_size(engine: Engine, path: str, checks: dict[str, Check] | None = None) -> int:
    """The size of a regular file, opened as every file is (a link, FIFO, device or folder
    refused); with ``checks``, the file's identity kept or compared (:func:`_seen`)."""
    fd = engine.open_read(path)
    try:
        if checks is not None:
            _seen(engine, path, fd, checks)
        return engine.size(fd)
    finally:
        engine.close(fd)


def _blob(engine: Engine, path: str, offset: int, length: int, what: str, checks: dict[str, Check]) -> ts.TensorRef:
    """The tensor a ``torch.save`` blob at ``[offset, offset + length)`` of ``path`` describes."""
    fd = engine.open_read(path)
    try:
        _seen(engine, path, fd, checks)
        ref = ts.parse_at(engine, fd, offset, length, path, what)
    finally:
        engine.close(fd)
    return ref


Keys = Iterable[str] | str | Callable[[str], bool] | None  # what `stream`, `load_file`, `load_into`, `prepare_swap` read


def fixed(keys: Keys) -> Keys:
    """``keys`` that can be read twice: names given as an iterator or generator, as a tuple."""
    return keys if keys is None or callable(keys) or isinstance(keys, str) else tuple(keys)


def selector(keys: Keys) -> Callable[[str], bool]:
    """``keys``: None (all), a predicate, one name, or names and prefixes (a prefix ends with ``.``)."""
    if keys is None:
        return lambda name: True
    if callable(keys):
        return keys
    wanted = {keys} if isinstance(keys, str) else set(keys)
    prefixes = {k for k in wanted if k.endswith(".")}
    if len(prefixes) <= _FEW_PREFIXES:  # one C call per name
        first = tuple(prefixes)
        return lambda name: name in wanted or name.startswith(first)
    # many (a layer list): a prefix ends with ".", so it can only end at one of the name's own dots
    return lambda name: name in wanted or not prefixes.isdisjoint(_heads(name))


def _heads(name: str) -> list[str]:
    """Every prefix of ``name`` that ends with a ``.`` of it (``"a.b.c"``: ``"a."``, ``"a.b."``)."""
    parts = name.split(".")[:-1]
    return [".".join(parts[: i + 1]) + "." for i in range(len(parts))]


_FEW_PREFIXES = 16  # above, startswith over every prefix cost more than the name's own heads


def select(src: Source, keys: Keys) -> list[tuple[Entry, tuple[str, ...]]]:
    """The entries ``keys`` selects, each with the names it is selected under. A name or prefix of
    ``keys`` that selects nothing is an error naming it (a predicate may select nothing).

    Raises:
        MismatchError: naming what selected nothing (and the prefix meant, for a prefix written
            without its dot).
    """
    keys = fixed(keys)
    if keys is None:  # every entry under every name (20,000 predicate calls cost 15 ms)
        return [(e, e.names) for e in src.entries]
    found = chosen([n for e in src.entries for n in e.names], keys, src.path)
    return [(e, names) for e in src.entries if (names := tuple(n for n in e.names if n in found))]


def chosen(names: Iterable[str], keys: Keys, path: str) -> set[str]:
    """The ``names`` (of the file or step ``path``) that ``keys`` selects.

    Raises:
        MismatchError: as :func:`select`.
    """
    every = list(names)
    found = set(filter(selector(keys), every))
    _check_selected(keys, found, every, path)
    return found


def _check_selected(keys: Keys, found: set[str], every: Iterable[str], path: str) -> None:
    """A MismatchError naming each name or prefix of ``keys`` that selected nothing (``found``:
    the names selected, of ``every`` name there; and the prefix meant, for one written without
    its dot). A predicate may select nothing."""
    if keys is None or callable(keys):
        return
    wanted = [keys] if isinstance(keys, str) else list(keys)
    if sum(k.endswith(".") for k in wanted) <= _FEW_PREFIXES:
        missing = [k for k in wanted if not (k in found if not k.endswith(".") else any(n.startswith(k) for n in found))]
    else:  # many prefixes: each looked up among the selected names' own heads, not scanned for
        heads = {h for n in found for h in _heads(n)}
        missing = [k for k in wanted if k not in (heads if k.endswith(".") else found)]
    if missing:
        names = list(every)
        hints = [
            f"{k!r} (did you mean the prefix {k + '.'!r}?)" if any(n.startswith(k + ".") for n in names) else repr(k)
            for k in missing[:5]
        ]
        raise MismatchError(f"{path}: keys select nothing for {', '.join(hints)}")


def with_rows(e: Entry, rows: tuple[int, int], path: str = "") -> Entry:
    """Only rows ``[a, b)`` (dim 0) of a tensor whose bytes lie in one piece of its file (a
    safetensors tensor, a step's, a torch.save tensor that is a contiguous view of its storage, a
    DCP tensor of one chunk): a shorter read at a later offset; its checksum covers the whole
    tensor (or storage), so the slice is unverified.

    Raises:
        ValueError: ``rows`` not within the tensor's first dimension.
        MismatchError: the tensor is not in one piece (chunks of several ranks, a strided view).
    """
    a, b = rows
    if not e.shape or not (st.is_count(a) and st.is_count(b) and a <= b <= e.shape[0]):
        raise ValueError(f"rows {rows} of {e.names[0]!r} (shape {list(e.shape)}): need 0 <= a <= b <= {e.shape[:1]}")
    span, how = _in_one_piece(e)
    if span is None:
        raise MismatchError(f"{path}: rows {rows} of {e.names[0]!r}: it is {how}; load it whole and slice it")
    s = span.spec
    row = s.nbytes // e.shape[0] if e.shape[0] else 0
    # (in the file's units: a 1-D packed tensor's one dimension counts its values, helper-72)
    spec = st.TensorSpec(s.key, s.dtype, file_shape(s.dtype, (b - a, *e.shape[1:])), s.offset + a * row, (b - a) * row)
    return Entry(e.names[:1], e.dtype, (b - a, *e.shape[1:]), (Part(Span(span.path, spec, None)),), e.requires_grad)


def _in_one_piece(e: Entry) -> tuple[Span | None, str]:
    """The span of the file that holds ``e``'s bytes in order, if one does; else why not."""
    if (whole := e.whole) is not None:
        return whole, ""
    if len(e.parts) != 1 or e.parts[0].at is not None:
        return None, f"stored in {len(e.parts)} chunks (of several ranks)"
    span, v = e.parts[0].span, e.parts[0].view
    assert v is not None  # (else it is whole)
    if v.conj or v.neg:
        return None, "a lazily conjugated or negated view"
    if not v.contiguous or v.dtype != e.dtype:
        return None, "a strided view of its storage"
    if e.dtype not in TORCH_TO_SAFETENSORS:
        return None, f"a {e.dtype} tensor (read whole only)"
    spec = spec_for(span.spec.key, e.dtype, e.shape)._replace(offset=span.spec.offset + v.storage_offset * e.dtype.itemsize)
    if spec.offset + spec.nbytes > span.spec.offset + span.spec.nbytes:
        return None, "not within its storage"
    return Span(span.path, spec, None, span.kind), ""


def spec_for(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> st.TensorSpec:
    """The safetensors spec a tensor of ``dtype`` and ``shape`` would have (offsets 0)."""
    kind = TORCH_TO_SAFETENSORS[dtype]
    return st.TensorSpec(name, kind, file_shape(kind, shape), 0, math.prod(shape) * dtype.itemsize)


__all__ = [
    "BIN",
    "BIN_INDEX",
    "INDEX",
    "SINGLE",
    "Entry",
    "Part",
    "Source",
    "Span",
    "file_size",
    "resolve",
    "select",
    "selector",
    "spec_for",
    "step",
    "with_rows",
]
