"""Loading one checkpoint folder: manifest, shard headers, then the tensors, a shard file at a time."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from functools import partial
from itertools import chain, islice, repeat
from operator import attrgetter
from typing import Any

import torch

from .. import knobs, sources
from .. import root as _root
from .._io.assemble import read
from .._io.read import (
    Check,
    ShardCheck,
    close,
    open_read,
    read_tensors,
    same_file,
    same_step,
    verify_mapped,
    verify_tensors,
    written,
)
from .._io.tensors import Target, assign, carved_targets, check_into, load_device, mapped, mismatch, modified, new_tensor
from .._runtime import cuda, gil
from .._runtime.scheduler import Priority, ProgressCallback, Scheduler, reporting
from ..engines import Engine
from ..errors import annotate_oserror
from ..formats import manifest as mf
from ..formats import safetensors as st
from ..formats.tree import UNREAD, flatten, leaves, matched, under_empty, unflatten, update
from ..location import is_object, local_path

log = logging.getLogger("aiotensor")


async def load_checkpoint(
    sched: Scheduler,
    folder: str | os.PathLike[str],
    *,
    into: Any = None,
    verify: bool = True,
    device: str | torch.device = "cpu",
    atomic: bool = False,
    step: int | None = None,
    progress: ProgressCallback | None = None,
    mmap: bool = False,
    strict: bool = True,
) -> Any:
    """Load one checkpoint folder (see :meth:`TensorStore.load` for ``into``, ``device``, ``atomic``,
    ``mmap``, ``strict``).

    With ``step``, the folder must be a real folder (not a symbolic link) whose manifest names that
    step. At most one shard file is open at a time, whatever the number of shards; a load ``into``
    tensors keeps a local step's shards open from their check to their read (up to
    :data:`~aiotensor.knobs.HELD_SHARDS` of them), so a step another process retires meanwhile is
    read whole from its unlinked files instead of leaving ``into`` half written.

    Raises:
        ManifestError / HeaderError: a malformed manifest or shard, naming the file.
        ChecksumError: corrupt tensor bytes, naming the file and the tensor.
        MismatchError: ``into`` does not match the checkpoint.
        UnsafePathError: a symbolic link, FIFO or device where a file or folder belongs.
        OSError: an I/O error, naming the file.

    Cancellation: returns only once no worker thread writes into the destination tensors; with
    ``into``, they may then hold a mix of old and new values, their version counters moved (unless
    the verify pass of ``atomic`` was still running: then they are untouched).
    """
    with sched.operation():  # the whole load
        path = local_path(folder, objects=True)
        dev = await load_device(sched, device)
        if mmap and (into is not None or dev.type != "cpu" or is_object(path)):
            raise ValueError("mmap=True maps a local step's shards into new CPU tensors: not with into=, another device or a URL")
        return await _load(sched, path, into, verify, dev, atomic, step, progress, mmap, strict)


async def _load(
    sched: Scheduler,
    folder: str,
    into: Any,
    verify: bool,
    dev: torch.device,
    atomic: bool,
    step: int | None,
    progress: ProgressCallback | None,
    mmap: bool = False,
    strict: bool = True,
) -> Any:
    held: dict[str, int] = {}  # the shards kept open (a load into tensors): closed here, whatever happens
    seen: dict[str, Check] = {}  # each shard checked, by name: what its reopening for the read must find
    try:
        opened = await sched.call(
            _open_step, sched, folder, step, mmap, verify, into is not None, held, seen, priority=Priority.LOAD
        )
        if opened is None:
            if mmap:
                raise ValueError(f"{folder} was written through DCP (a shard per rank, chunks to assemble): mmap=True cannot map")
            return await _load_dcp(sched, folder, into, dev, verify, strict)
        m: mf.Manifest
        m, by_shard, views = opened
        del opened
        try:
            return await _load_opened(
                sched, folder, m, by_shard, views, held, seen, into, verify, dev, atomic, progress, mmap, strict
            )
        except FileNotFoundError:  # a shard gone as it was opened again: the step saved again, or retired
            await sched.call(same_step, sched.engine, os.path.join(folder, _root.MANIFEST), m.identity, priority=Priority.LOAD)
            raise
    finally:
        await close(sched, *held.values())


async def _load_opened(
    sched: Scheduler,
    folder: str,
    m: mf.Manifest,
    by_shard: dict[str, list[mf.Entry]],
    views: dict[str, list[Target]],
    held: dict[str, int],
    seen: dict[str, Check],
    into: Any,
    verify: bool,
    dev: torch.device,
    atomic: bool,
    progress: ProgressCallback | None,
    mmap: bool,
    strict: bool,
) -> Any:
    """:func:`_load` of a step whose manifest was read and first shard checked (``held``: the shards
    kept open for a load into ``into``, by name: the first, where the others are to be kept too)."""
    mpath = os.path.join(folder, _root.MANIFEST)
    for shard in islice(m.shards, 1, None):  # a call each: a cancelled load stops after the shard in hand
        got = await sched.call(
            _open_shard, sched, folder, m, by_shard, shard, mmap, verify, held or None, seen, priority=Priority.LOAD
        )
        if got is not None:
            views[shard] = got
    if mmap:
        manifest = [m]
        del m
        return await _mapped(sched, folder, manifest, views, by_shard, mpath, verify)
    # allocating and checking tens of thousands of tensors is Python work: not on the loop thread
    streams = cuda.caller_streams()  # new tensors are allocated, and aliases copied, on the caller's streams
    dest, targets, nbytes, wanted = await sched.call(
        cuda.under,
        streams,
        _targets,
        m,
        by_shard,
        into,
        dev,
        sched.devices,
        verify,
        strict,
        folder,
        priority=Priority.LOAD,
        home=True,
    )
    passes = ("verify", "read") if atomic and verify and into is not None else ("read",)
    with reporting(nbytes, progress):
        await _read_passes(sched, folder, targets, passes, held, seen, dest if into is not None else None)
    state = await sched.call(cuda.under, streams, _finish, m, dest, mpath, into, None, wanted, priority=Priority.LOAD)
    manifest = [m]
    del m
    await _discard(sched, manifest, *by_shard.values(), *targets.values(), by_shard, targets, dest)
    return state


async def _discard(sched: Scheduler, manifest: list[mf.Manifest], *containers: list[Any] | dict[Any, Any]) -> None:
    """Free a load's ``containers`` and its manifest (``[m]``, the caller's reference dropped) in a
    thread: tens of thousands of objects for a state of many tensors, the manifest's tensor table
    a slice at a time (:meth:`Scheduler.discard`); those of a manifest of at most :data:`_FREE_HERE`
    bytes here (a few hundred tensors: a hop to a thread and back cost more, ~0.15 ms). Its size,
    not its tensors, decides: its tree may hold big values beside few tensors."""
    entries = manifest[0].entries
    assert isinstance(entries, dict)  # (manifest.loads makes one)
    if 0 < manifest[0].nbytes <= _FREE_HERE:
        for c in (*containers, entries, manifest):
            c.clear()
        return
    await sched.discard(*containers, entries, manifest)


_FREE_HERE = 64 * 1024


async def _read_passes(
    sched: Scheduler,
    folder: str,
    targets: dict[str, list[Target]],
    passes: tuple[str, ...],
    held: dict[str, int],
    seen: Mapping[str, Check],
    into: dict[str, torch.Tensor] | None,
) -> None:
    """Verify, then read, ``targets``; a shard not ``held`` open since its check is opened again,
    and must be the file checked (``seen``: else a :class:`~aiotensor.errors.SourceChangedError`;
    a step saved again under its number meanwhile, its shards replaced, gave the new shard's bytes
    to the old manifest's entries: with ``verify=False``, garbage). Where the read pass fails or is
    cancelled, ``into``'s tensors (a load in place) are marked written
    (:func:`~aiotensor._io.read.written`)."""
    for what in passes:
        try:
            for shard, shard_targets in targets.items():
                path = os.path.join(folder, shard)
                fd = held.get(shard)
                own = fd is None
                if fd is None:
                    fd = await open_read(sched, path, seen.get(shard))
                try:
                    if what == "verify":
                        await verify_tensors(sched, fd, path, shard_targets, Priority.LOAD)
                    else:
                        await read_tensors(sched, fd, path, shard_targets, Priority.LOAD)
                finally:
                    if own:
                        await close(sched, fd)
        except BaseException:
            if what == "read" and into is not None:
                await written(sched, into.values())
            raise


async def _load_dcp(sched: Scheduler, folder: str, into: Any, dev: torch.device, verify: bool, strict: bool = True) -> Any:
    """A checkpoint written through DCP (any number of ranks): its tensors whole, assembled from
    their chunks, straight into ``into``'s tensors or new ones (:mod:`aiotensor.sources`)."""
    src = await sched.call(sources.step, sched.engine, folder, priority=Priority.LOAD)
    entries, dests = list(src.entries), None
    tied: dict[str, torch.Tensor] = {}
    if into is not None:
        entries, dests, tied = await sched.call(_dests, src, into, sched.devices, strict, folder, priority=Priority.LOAD)
    tensors = await read(sched, entries, dev, verify, into=dests, checks=src.checks)
    return await sched.call(_state_of, src, entries, tensors, into, strict, tied, priority=Priority.LOAD)


class _Leaf:
    """A tensor's place holder, to find where each tensor of a source's state lies."""

    def __init__(self, name: str) -> None:
        self.name = name


def _dests(
    src: sources.Source, into: Any, devices: tuple[str, ...], strict: bool, folder: str
) -> tuple[list[sources.Entry], list[torch.Tensor | None], dict[str, torch.Tensor]]:
    """The entries of ``src`` to read and ``into``'s tensor for each, checked against it (keys,
    dtypes, shapes); not ``strict``: those ``into`` has (:func:`_partial`); and by name the
    tensors of ``into`` that a tie's other name fills, their entries not read (a tied embedding
    that DCP stores under both names is read once)."""
    assert src.state is not None
    saved = src.state(_Leaf)
    where = {leaf.name: key for key, leaf in leaves(saved, _is_leaf)}
    _, targets = flatten(into)
    given = dict(targets)
    specs = {where[n]: sources.spec_for(n, e.dtype, e.shape) for e in src.entries for n in e.names}
    new, shadowed = _checked(folder, lambda: saved, into, given, specs, devices, strict, where.__getitem__)
    entries: list[sources.Entry] = []
    dests: list[torch.Tensor | None] = []
    tied: dict[str, torch.Tensor] = {}
    for e in src.entries:  # (not strict: the entries `into` has a tensor for, or a new one)
        t = next((given[where[n]] for n in e.names if where[n] in given), None)
        if t is not None and all(where[n] in shadowed for n in e.names):  # a tie's name but its last: not read
            tied |= dict.fromkeys(e.names, t)
        elif t is not None or any(where[n] in new for n in e.names):
            entries.append(e)
            dests.append(t)
    return entries, dests, tied


def _checked(
    folder: str,
    saved: Callable[[], Any],
    into: Any,
    given: Mapping[str, torch.Tensor],
    specs: Mapping[str, st.TensorSpec],
    devices: tuple[str, ...],
    strict: bool,
    key: Callable[[str], str],
    source: Callable[[str], str] | None = None,
) -> tuple[set[str], set[str]]:
    """``into``'s tensors (``given``) checked against the checkpoint's (``specs``: keys, dtypes,
    shapes; not ``strict``: a warning names what either lacks); returns, ``strict``, the saved
    tensors ``into`` lacks that lie under a dict it holds empty (a fresh optimizer's ``state``,
    before its first step; :func:`~aiotensor.formats.tree.under_empty`): each is read into a new
    tensor and put there, as the saved values beside it are. Not with ``strict=False``, which
    keeps ``into``'s lists of another length: an optimizer's ``param_groups`` after the model
    changed, whose saved moments would land on other parameters by their index. ``saved()``: the
    saved state with :class:`_Leaf` leaves (``key(leaf.name)``: its key), made only where needed.
    Also returns the keys of a tie not to read into (:func:`~aiotensor._io.tensors.check_into`)."""
    new = set()
    if strict and not specs.keys() <= given.keys():
        new = {key(leaf.name) for leaf in under_empty(saved, into, _is_leaf)} - given.keys()
    missing, unexpected, shadowed = check_into(
        given, specs, devices, "the checkpoint", missing_ok=not strict, unexpected_ok=not strict, new=new, source=source
    )
    _partial(folder, (missing, unexpected))
    return new, shadowed


def _is_leaf(x: Any) -> bool:
    return isinstance(x, _Leaf)


def _partial(folder: str, keys: tuple[list[str], list[str]]) -> None:
    """A load with ``strict=False`` says what it left alone and what it did not read."""
    if keys[0] or keys[1]:
        counts = f"{len(keys[0])} missing, {len(keys[1])} unexpected"
        log.warning("%s loaded with strict=False (%s tensors): %s", folder, counts, mismatch(*keys, "`into`"))


@gil.quiet_gc
def _state_of(
    src: sources.Source,
    entries: list[sources.Entry],
    tensors: list[torch.Tensor],
    into: Any,
    strict: bool = True,
    tied: Mapping[str, torch.Tensor] | None = None,
) -> Any:
    """The state ``src`` holds, its tensors ``tensors`` (of ``entries``, and ``tied``: by name,
    those a tie's read filled); with ``into``, every saved value put there (not ``strict``: where
    ``into`` has its place)."""
    assert src.state is not None
    by_name = {n: t for e, t in zip(entries, tensors, strict=True) for n in e.names} | dict(tied or {})
    state = src.state(by_name.__getitem__ if strict else lambda n: by_name.get(n, UNREAD))
    return state if into is None else update(into, state, partial=not strict, str_keys=True)  # (DCP's keys)


def _open_step(
    sched: Scheduler,
    folder: str,
    step: int | None,
    mmap: bool,
    verify: bool,
    into: bool,
    held: dict[str, int],
    seen: dict[str, Check],
) -> tuple[mf.Manifest, dict[str, list[mf.Entry]], dict[str, list[Target]]] | None:
    """A step's manifest, its entries by shard, and its first shard opened (:func:`_open_shard`;
    with ``mmap``, its views), in one worker call (each hop to a thread and back costs ~0.1 ms: a
    mapped load of one shard made seven); None for a step written through DCP. A load ``into``
    tensors of a local step of at most :data:`~aiotensor.knobs.HELD_SHARDS` shards keeps each open
    from its check to its read (in ``held``, by shard: the caller closes them): a step another process
    retires meanwhile is still read whole from the files it unlinked, never left half written into
    ``into``."""
    eng = sched.engine
    if _root.is_dcp_step(eng, folder):
        return None
    m = _root.read_manifest(eng, folder, step)
    by_shard: dict[str, list[mf.Entry]] = {shard: [] for shard in m.shards}
    for e in m.entries.values():
        by_shard[e.shard].append(e)
    views: dict[str, list[Target]] = {}
    keep = into and not mmap and sched.engine.holds_files and len(m.shards) <= knobs.HELD_SHARDS
    for shard in islice(m.shards, 1):
        got = _open_shard(sched, folder, m, by_shard, shard, mmap, verify, held if keep else None, seen)
        if got is not None:
            views[shard] = got
    return m, by_shard, views


def _open_shard(
    sched: Scheduler,
    folder: str,
    m: mf.Manifest,
    by_shard: dict[str, list[mf.Entry]],
    shard: str,
    mmap: bool,
    verify: bool,
    held: dict[str, int] | None = None,
    seen: dict[str, Check] | None = None,
) -> list[Target] | None:
    """Check that ``shard`` holds what the manifest lists for it (:func:`~aiotensor._io.read.check_shard`), before
    anything is allocated: a hostile manifest cannot make us allocate what the files do not hold;
    with ``mmap``, map it too: its views (:func:`_map_shard`). The file is closed again, or kept
    open in ``held`` (by shard) once checked, where ``held`` is given (:func:`_open_step`); what
    tells the file checked from another is kept in ``seen`` (by shard: :func:`_read_passes`)."""
    eng = sched.engine
    path = os.path.join(folder, shard)
    check = ShardCheck(
        path, m.shards[shard], by_shard[shard], m.headers.get(shard), os.path.join(folder, _root.MANIFEST), m.identity
    )
    try:
        fd = eng.open_read(path)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            check.missing(eng)
        raise annotate_oserror(e, f"opening {path}") from e
    try:
        identity = eng.identity(fd)  # before the check: a write meanwhile makes it another file (helper-63)
        if mmap:
            return _map_shard(eng, fd, check, verify)
        check(eng, fd)
        if seen is not None:
            seen[shard] = partial(same_file, path, identity)
        if held is not None:
            held[shard], fd = fd, -1
        return None
    finally:
        if fd != -1:
            eng.close(fd)


@gil.quiet_gc
def _targets(
    m: mf.Manifest,
    by_shard: dict[str, list[mf.Entry]],
    into: Any,
    device: torch.device,
    devices: tuple[str, ...],
    verify: bool,
    strict: bool = True,
    folder: str = "",
) -> tuple[dict[str, torch.Tensor], dict[str, list[Target]], int, set[str] | None]:
    """The tensors to read into by key, the reads by shard, their bytes, and (not ``strict``) the
    keys of ``into`` among them (:func:`_destinations`)."""
    wanted = None
    if into is None:  # new tensors, carved shard by shard
        dest: dict[str, torch.Tensor] = {}
        targets: dict[str, list[Target]] = {}
        for shard, entries in by_shard.items():  # column by column, in C loops (tens of thousands)
            specs = gil.listed(map(_SPEC, entries))
            crcs = map(_CRC, entries) if verify else repeat(None)
            tensors, targets[shard] = carved_targets(specs, crcs, repeat("crc32c"), device)
            gil.filled(dest, zip(map(_KEY, specs), tensors, strict=True))
    else:
        dest, wanted, shadowed = _destinations(m, into, device, devices, strict, folder)
        targets = {
            shard: [
                Target(e.spec, dest[e.spec.key], e.crc32c if verify else None)
                for e in entries
                if e.spec.key in dest and e.spec.key not in shadowed
            ]
            for shard, entries in by_shard.items()
        }
        targets = {shard: ts for shard, ts in targets.items() if ts}
    return dest, targets, sum(t.spec.nbytes for ts in targets.values() for t in ts), wanted


_SPEC, _CRC, _KEY, _OFFSET = attrgetter("spec"), attrgetter("crc32c"), attrgetter("key"), attrgetter("offset")


@gil.quiet_gc
def _finish(
    m: mf.Manifest,
    dest: dict[str, torch.Tensor],
    mpath: str,
    into: Any,
    views: dict[str, list[Target]] | None = None,
    wanted: set[str] | None = None,
) -> Any:
    """Fill the aliases and rebuild the state tree; with ``into``, every saved value put there
    (``wanted``, a load with strict=False: only the tensors of those keys, where ``into`` has their
    place). ``views``: the tensors (mapped shards' views) are put in ``dest`` first."""
    if into is not None:
        modified(dest.values())
    for targets in (views or {}).values():
        dest.update((t.spec.key, t.tensor) for t in targets)
    for alias, target in m.aliases.items():
        if target not in dest:  # (strict=False: neither is in `into`)
            continue
        if alias not in dest:
            dest[alias] = dest[target]
        elif not _same_view(dest[alias], dest[target]):
            assign(dest[alias].detach(), dest[target])
    state = unflatten(m.tree, dest.__getitem__ if wanted is None else lambda k: dest[k] if k in wanted else UNREAD, mpath)
    return state if into is None else update(into, state, partial=wanted is not None)


def _map_shard(engine: Engine, fd: int, check: ShardCheck, verify: bool) -> list[Target]:
    """The shard's ``check``, then a copy-on-write mapping of it and a view of it for each entry
    (with its crc, to verify, if ``verify``)."""
    check(engine, fd)
    entries = check.entries
    return mapped(fd, check.path, check.size, [e.spec for e in entries], [e.crc32c for e in entries] if verify else None)


async def _mapped(
    sched: Scheduler,
    folder: str,
    manifest: list[mf.Manifest],
    views: dict[str, list[Target]],
    by_shard: dict[str, list[mf.Entry]],
    mpath: str,
    verify: bool,
) -> Any:
    """The state of a step whose shards are mapped (``views``): with ``verify``, checksums verified
    by reading the mapped pages, then the state tree rebuilt (in a thread: tens of thousands of
    tensors are Python work). ``manifest`` (``[m]``, the caller's reference dropped) and
    ``by_shard`` are freed in a thread (:func:`_discard`)."""
    if verify:
        for shard, targets in views.items():
            await verify_mapped(sched, os.path.join(folder, shard), targets, Priority.LOAD)
    dest: dict[str, torch.Tensor] = {}
    state = await sched.call(_finish, manifest[0], dest, mpath, None, views, priority=Priority.LOAD)
    await _discard(sched, manifest, *views.values(), views, *by_shard.values(), by_shard, dest)
    return state


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape


def _destinations(
    m: mf.Manifest, into: Any, device: torch.device, devices: tuple[str, ...], strict: bool = True, folder: str = ""
) -> tuple[dict[str, torch.Tensor], set[str] | None, set[str]]:
    """``into``'s tensors to read into, checked against the manifest, and new ones on ``device``
    where ``into`` holds an empty dict (:func:`_checked`); not ``strict``: those both have (and their
    keys), a tied name ``into`` has read from the stored tensor it names where ``into`` lacks that
    one (under that one's key, which the state rebuilt then leaves out); and the stored tensors not
    to read, a tie's of ``into`` but its last (:func:`~aiotensor._io.tensors.check_into`)."""
    given = matched(m.tree, chain(m.entries, m.aliases), into)
    specs = {k: e.spec for k, e in m.entries.items()} | {a: m.entries[t].spec for a, t in m.aliases.items()}
    source = lambda k: m.aliases.get(k, k)  # noqa: E731  (the stored tensor a key reads)
    new, shadowed = _checked(folder, lambda: unflatten(m.tree, _Leaf), into, given, specs, devices, strict, str, source)
    # a tied name among them reads the stored tensor it names, new too where `into` lacks that one
    stored = {m.aliases.get(k, k) for k in new} - given.keys()
    made = {k: new_tensor(m.entries[k].spec, device) for k in stored}
    if strict:
        return given | made, None, shadowed
    shared = {k: t for k, t in given.items() if k in specs} | made
    wanted = set(shared) | {a for a in new if m.aliases.get(a) in shared}
    for alias, target in m.aliases.items():
        if alias in wanted and target not in shared:
            shared[target] = shared[alias]
    return shared, wanted, shadowed
