"""Loading into a live ``nn.Module``: in place (:func:`load_into`), or beside it for a hot swap
(:func:`prepare_swap`, :class:`Swap`).

Names are matched as ``nn.Module.load_state_dict`` matches them, with two additions users of
``save_pretrained`` files need: a parameter the module ties to another one (the same tensor object
under two names, as GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``) is filled by either
name, so a file that stores one of them is complete; and a module built on the ``meta`` device
(``torch.device("meta")``, ``init_empty_weights``) gets real tensors, one per tie group."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterable, Mapping
from itertools import compress, repeat
from operator import attrgetter, is_, itemgetter, not_
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import knobs, sources
from .._io.assemble import Entry, read
from .._io.tensors import assign, byte_span, check_apart, check_fillable, load_device, mismatch, modified, overlaps, writing
from .._runtime import cuda, gil, threads
from .._runtime.buffers import give_back_freed
from .._runtime.scheduler import Priority, Scheduler, own_scheduler
from ..errors import MismatchError
from ..location import engine_for, local_path
from ..sources import Keys


class LoadResult(NamedTuple):
    """What :func:`load_into` could not match, as ``nn.Module.load_state_dict`` reports it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


# (the names it fills: a name and those tied to it; the module's tensor; the loaded one)
Fill = Callable[[tuple[str, ...], torch.Tensor, torch.Tensor], object]


class _Walk(NamedTuple):
    """What one walk of a module's submodules finds (:func:`_walk`)."""

    tensors: dict[str, torch.Tensor] | None  # its state_dict's tensors; None: ask state_dict()
    loads_own_way: str | None  # why it loads its state its own way, if it does
    optional: set[str]  # names a file may lack although the module has them
    renamed: list[str]  # old names weight norm's hook renames, where that is a module's only hook


def _module_tensors(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, ...]], _Walk]:
    """The module's state tensors by name, for each name tied to others (one tensor object under
    several names) the names of its group, and the walk's findings."""
    walk = _walk(module)
    known = _tensors_by_name(module, walk)
    ids = list(map(id, known.values()))
    if len(set(ids)) == len(ids):  # no tensor under two names (C loops: tens of thousands)
        return known, {}, walk
    by_id: dict[int, list[str]] = {}
    for name, t in known.items():
        by_id.setdefault(id(t), []).append(name)
    return known, {n: tuple(g) for g in by_id.values() if len(g) > 1 for n in g}, walk


def _tensors_by_name(module: torch.nn.Module, walk: _Walk | None = None) -> dict[str, torch.Tensor]:
    """The tensors of ``module.state_dict(keep_vars=True)``, by the walk where it gives them."""
    known = (walk or _walk(module)).tensors  # parameters and buffers: tensors all
    if known is None:
        known = {k: v for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    return known


def _plain_state(module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    return _walk(module).tensors


def _walk(module: torch.nn.Module) -> _Walk:
    """One walk of ``module``'s submodules (as ``state_dict`` recurses: each child under
    ``prefix + name + "."``, a module reached twice walked twice; each class checked once), for:

    - ``tensors``: ``module.state_dict(keep_vars=True)``, the same names in the same order, from
      its modules' own parameter and buffer dicts, where every module saves its state as
      ``nn.Module`` does (no state_dict hook, no override of ``state_dict``,
      ``_save_to_state_dict`` or ``get_extra_state``, on its class or on itself); else None (then
      call ``state_dict``). torch's recursion costs 54 ms for a module of 20,000 submodules, this
      walk 25.
    - ``loads_own_way``: why it loads its state its own way, if it does: a module in it has a
      ``load_state_dict`` hook (weight norm's renaming of its old names, a layout change) or
      overrides ``load_state_dict``, ``_load_from_state_dict`` or ``set_extra_state`` (extra state,
      such as FP8 scaling factors, is restored only through the last). The walk stops there.
      torch's own overrides that change nothing a file of today's names loads are set aside:
      BatchNorm's and InstanceNorm's ``_load_from_state_dict`` (below), and weight norm's hook,
      which renames ``weight_g``/``weight_v`` only where a file has them (``renamed``: the
      caller looks at the file's names).
    - ``optional``: BatchNorm's ``num_batches_tracked``, which its ``_load_from_state_dict`` keeps
      as it is where a file lacks it (written before torch had it). (InstanceNorm's refuses the
      running statistics of old files that it does not track, as unexpected names are refused.)"""
    out: dict[str, torch.Tensor] | None = {}
    optional: set[str] = set()
    renamed: list[str] = []
    kinds: dict[type, tuple[bool, str | None, bool]] = {}  # class -> saves its own way, load override, a norm
    todo: list[tuple[str, torch.nn.Module, int]] = [("", module, 0)]
    while todo:
        prefix, m, depth = todo.pop()
        t = type(m)
        kind = kinds.get(t)
        if kind is None:
            overrides = [a for a in _LOADS if getattr(t, a) not in (getattr(torch.nn.Module, a), *_SET_ASIDE)]
            saves = any(getattr(t, a) is not getattr(torch.nn.Module, a) for a in _SAVES)
            kind = kinds[t] = (saves, overrides[0] if overrides else None, issubclass(t, _NORM))
        d = m.__dict__
        over = kind[1] or (next(a for a in _LOADS if a in d) if not _LOADS_SET.isdisjoint(d) else None)
        hooks = d["_load_state_dict_pre_hooks"]
        old = [_renames(h) for h in hooks.values()] if hooks else []
        if old and all(old):
            renamed += [prefix + n + end for n in old if n for end in ("_g", "_v")]
            hooks = None
        if over or hooks or d["_load_state_dict_post_hooks"]:
            what = f"overrides {over}" if over else "has a load_state_dict hook"
            return _Walk(None, f"{prefix.rstrip('.') or 'the module'} ({t.__name__}) {what}", optional, renamed)
        if kind[2] and m.track_running_stats:
            optional.add(prefix + "num_batches_tracked")
        if depth > _MAX_DEPTH:  # a cycle, or deeper than torch's recursion goes: its own error
            return _Walk(None, None, optional, renamed)
        if out is not None and (
            kind[0] or d["_state_dict_hooks"] or d["_state_dict_pre_hooks"] or "state_dict" in d or "_save_to_state_dict" in d
        ):
            out = None
        if out is not None:
            for k, v in d["_parameters"].items():
                if v is not None:
                    out[prefix + k] = v
            if d["_buffers"]:
                skip = d["_non_persistent_buffers_set"]
                for k, b in d["_buffers"].items():
                    if b is not None and k not in skip:
                        out[prefix + k] = b
        if d["_modules"]:
            todo += reversed([(prefix + k + ".", c, depth + 1) for k, c in d["_modules"].items() if c is not None])
    return _Walk(out, None, optional, renamed)


_SAVES = ("state_dict", "_save_to_state_dict", "get_extra_state")
_MAX_DEPTH = 500
_LOADS = ("load_state_dict", "_load_from_state_dict", "set_extra_state")
_LOADS_SET = frozenset(_LOADS)
_NORM = torch.nn.modules.batchnorm._NormBase
_SET_ASIDE = (_NORM._load_from_state_dict, torch.nn.modules.instancenorm._InstanceNorm._load_from_state_dict)


def _renames(hook: Any) -> str | None:
    """The name whose old ``{name}_g``/``{name}_v`` a file may hold, where ``hook`` (a wrapped
    load_state_dict pre-hook) is weight norm's, which renames them (a closure in
    ``torch.nn.utils.parametrizations.weight_norm``, over the ``name`` it was given); else None."""
    fn: Any = getattr(hook, "hook", None)
    qualname = getattr(fn, "__qualname__", "")
    if getattr(fn, "__module__", None) != "torch.nn.utils.parametrizations" or not qualname.endswith("._weight_norm_compat_hook"):
        return None
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False))
    name = cells["name"].cell_contents if "name" in cells else None
    return name if isinstance(name, str) else None


def _raise_if(strict: bool, source: object, got: LoadResult) -> None:
    if strict and (got.missing_keys or got.unexpected_keys):
        what = mismatch(got.missing_keys, got.unexpected_keys, "the module")
        raise MismatchError(f"{source}: {what}; strict=False loads the names both have")


# where an entry is read straight to (the module's tensor, or a new one of its dtype and device),
# given the names it fills and the module's tensor; None: into a new tensor, then Fill
Place = Callable[[tuple[str, ...], torch.Tensor, Entry], torch.Tensor | None]
_Batch = tuple[list[Entry], list[torch.Tensor | None], list[tuple[tuple[str, ...], torch.Tensor, int]]]


async def _matched(
    module: torch.nn.Module,
    source: str | os.PathLike[str],
    place: Place,
    fn: Fill,
    *,
    strict: bool,
    device: str | torch.device,
    window_bytes: int,
    scheduler: Scheduler | None,
    storage_options: Mapping[str, Any] | None,
    verify: bool = True,
    keys: Keys = None,
    no_meta: bool = False,
    swap: bool = False,
) -> LoadResult:
    """Match ``source``'s tensors to the module's by name (and shape: a mismatch is an error before
    anything is read), then read each where ``place`` says, straight into its final memory, once;
    the others into new tensors on ``device``, up to ``window_bytes`` of them at a time, handed to
    ``fn(names, module's tensor, loaded tensor)`` in worker threads. A name is missing only if
    neither it nor a name tied to it was loaded; ``strict``: a name the module lacks is an error
    (else it is reported). A module that loads its state its own way (:func:`_walk`) is loaded
    by its ``load_state_dict`` from new tensors of the whole file instead; ``swap``: that is a
    MismatchError (a swap switches tensors, which would skip it). ``keys``: only the file's
    tensors it selects are read, and only the module's names it selects can be missing."""
    if window_bytes < 1:  # (as stream refuses it)
        raise ValueError(f"window_bytes must be >= 1, got {window_bytes}")
    path = local_path(source, objects=True)
    async with own_scheduler(scheduler, engine_for(path, scheduler, storage_options)) as sched:
        src = await sched.call(sources.resolve, sched.engine, path, priority=Priority.LOAD)
        dev = await load_device(sched, device)
        known, ties, walk = await sched.run_sync(_module_tensors, module)
        keys = sources.fixed(keys)
        if keys is not None:
            src, known = await sched.call(_selected, src, known, ties, keys, priority=Priority.LOAD)
        why, optional = walk.loads_own_way, walk.optional
        if why is None and walk.renamed:
            names = {n for e in src.entries for n in e.names}
            old = [n for n in walk.renamed if n in names]
            why = f"weight norm renames the file's old name {old[0]!r}" if old else None
        if why is not None and swap:
            raise MismatchError(
                f"prepare_swap {source}: {why}, which a swap of its tensors would skip: load a second module with "
                "load_into and switch to it"
            )
        streams = cuda.caller_streams()  # new CUDA tensors and copies on the caller's streams
        if why is not None:
            if meta := [k for k, v in known.items() if v.is_meta]:  # its load_state_dict(assign=True) would drop dtypes and ties
                raise MismatchError(f"{why}, and has tensors on the meta device ({meta[:5]}): materialize it first (to_empty)")
            got = await read(sched, src.entries, dev, verify, checks=src.checks)
            loaded = {n: t for e, t in zip(src.entries, got, strict=True) for n in e.names}
            try:
                return await sched.call(
                    cuda.under, streams, _load_state_dict, module, loaded, known, ties, keys, priority=Priority.LOAD
                )
            finally:
                held = [src, loaded, got]
                del src, loaded, got
                await sched.discard(known, ties, held)
        if no_meta and (meta := [k for k, v in known.items() if v.is_meta]):
            raise MismatchError(f"the module has tensors on the meta device ({meta[:5]}); load_into materializes them")
        batches, left, unexpected = await sched.call(
            cuda.under, streams, _plan, src.entries, known, ties, place, strict, str(source), window_bytes, priority=Priority.LOAD
        )
        for entries, into, fills in batches:
            got = await read(sched, entries, dev, verify, into=into, checks=src.checks)
            await sched.call(_each, fn, fills, got, streams, priority=Priority.LOAD)
        # on the meta device, an optional name stays there: missing, as before torch's default fills it
        left = [k for k in left if k not in optional or known[k].is_meta]
        # what holds tens of thousands of objects (the source's entries, the plan, the module's
        # tensors) is freed in a thread: freeing them on the loop's thread held it 10 ms and more
        held = [src]
        del src
        await sched.discard(known, ties, batches, held, *(batches[-1] if batches else ()))
    return LoadResult(left, unexpected)


def _selected(
    src: sources.Source, known: dict[str, torch.Tensor], ties: Mapping[str, tuple[str, ...]], keys: Keys
) -> tuple[sources.Source, dict[str, torch.Tensor]]:
    """``src`` with only the entries ``keys`` selects, each under its selected names, and the
    module's tensors under the names it selects (:func:`aiotensor.sources.select`: a name or
    prefix that selects nothing is a MismatchError). A stored tensor also stands for the module's
    names tied to its own that the file does not store: a file that keeps one name of a tie
    (``lm_head.weight`` for ``transformer.wte.weight``) serves ``keys`` naming the other."""
    if ties:
        stored = {n for e in src.entries for n in e.names}
        # a tie's names the file lacks stand with its last stored name in the module's order (the
        # entry load_state_dict leaves it with; with each stored one, the file's first won: helper-76)
        at = {k: i for i, k in enumerate(known)}
        lead = {max(kept, key=at.__getitem__): g for g in set(ties.values()) if (kept := [n for n in g if n in stored])}

        def names(e: Entry) -> tuple[str, ...]:
            return tuple(dict.fromkeys(n for a in e.names for n in lead.get(a, (a,)) if n == a or n not in stored))

        src = dataclasses.replace(src, entries=tuple(e._replace(names=names(e)) for e in src.entries))
    pick = sources.selector(keys)
    entries = tuple(e._replace(names=names) for e, names in sources.select(src, keys))
    return dataclasses.replace(src, entries=entries), {k: t for k, t in known.items() if pick(k)}


def _load_state_dict(
    module: torch.nn.Module,
    loaded: dict[str, torch.Tensor],
    known: Mapping[str, torch.Tensor],
    ties: Mapping[str, tuple[str, ...]],
    keys: Keys = None,
) -> LoadResult:
    """``module.load_state_dict(loaded)`` (its hooks, extra state and overrides run, in this worker
    thread, on the caller's CUDA streams, waited for): an inference module's under
    ``inference_mode``; a name is missing only if no name tied to it was loaded either, and
    ``keys`` selects it (extra state included). Shapes are
    load_state_dict's to check (a hook may change them): one that differs is a MismatchError after
    the others were copied, as load_state_dict leaves them."""
    inference = torch.inference_mode() if any(t.is_inference() for t in known.values()) else contextlib.nullcontext()
    try:
        with inference:
            got = module.load_state_dict(loaded, strict=False)
    except RuntimeError as e:  # shapes that differ, or the module's own refusal
        raise MismatchError(f"{type(module).__name__}.load_state_dict refused the file: {str(e)[:2000]}") from None
    finally:
        for device in {t.device for t in known.values() if t.is_cuda}:
            torch.cuda.current_stream(device).synchronize()  # the copies read `loaded`, freed next
    pick = sources.selector(keys)
    missing = [k for k in got.missing_keys if pick(k) and not any(n in loaded for n in ties.get(k, ()))]
    return LoadResult(missing, list(got.unexpected_keys))


def _plan(
    entries: tuple[Entry, ...],
    known: dict[str, torch.Tensor],
    ties: dict[str, tuple[str, ...]],
    place: Place,
    strict: bool,
    source: str,
    window_bytes: int,
) -> tuple[list[_Batch], list[str], list[str]]:
    """The reads, in batches of at most ``window_bytes`` of new tensors (an entry read straight to
    its place counts nothing), with the module's names left unfilled and the file's unexpected ones."""
    at_once = _in_place_at_once(entries, known, ties, place)
    if at_once is not None:
        return at_once
    left = dict.fromkeys(known)
    unexpected: list[str] = []
    batches: list[_Batch] = []
    batch: _Batch = ([], [], [])
    size = 0
    skip = _tied_elsewhere(entries, known, ties, place)
    for e in entries:
        dest: torch.Tensor | None = None
        filled: list[torch.Tensor] = []  # (a tensor has one name, or a few)
        for name in e.names:
            dst = known.get(name)
            if dst is None:
                if strict:
                    raise MismatchError(  # (worded as load_into's after its read: helper-59)
                        f"{source} has a tensor {name!r} the module does not (unexpected); strict=False loads the names both have"
                    )
                unexpected.append(name)
                continue
            if dst.shape != e.shape:  # torch.Size is a tuple
                raise MismatchError(f"tensor {name!r}: {source} has {list(e.shape)}, the module {list(dst.shape)}")
            if dst.dtype != e.dtype and not _convertible(e.dtype, dst.dtype):  # (before anything is read: helper-47)
                raise MismatchError(
                    f"tensor {name!r}: {source} has {e.dtype}, which torch cannot copy into the module's {dst.dtype}"
                )
            if (id(e), name) in skip:  # (filled from the tie's entry that is read; checked as that one is)
                left.pop(name, None)
                continue
            if place is _itself and not dst.is_meta:  # (filled in place)
                check_fillable(dst, f"the module's tensor {name!r}")
            names = ties.get(name)
            if names is None:
                names = (name,)
                left.pop(name, None)
            else:
                for n in names:
                    left.pop(n, None)
            if filled and any(f is dst for f in filled):  # a name tied to one already filled
                continue
            filled.append(dst)
            if dest is None:
                dest = place(names, dst, e)
                batch[0].append(e)
                batch[1].append(dest)
                if dest is not None:
                    continue
                size += e.nbytes
            batch[2].append((names, dst, len(batch[0]) - 1))  # after the read: fn(names, dst, what was read)
        if size >= window_bytes:
            batches.append(batch)
            batch, size = ([], [], []), 0
    if batch[0]:
        batches.append(batch)
    return batches, list(left), unexpected


def _tied_elsewhere(
    entries: tuple[Entry, ...], known: dict[str, torch.Tensor], ties: dict[str, tuple[str, ...]], place: Place
) -> set[tuple[int, str]]:
    """The (entry id, name) pairs not to fill: a tensor of the module under several names whose
    names the file stores in several entries (a head untied by a fine-tune) is filled from one,
    the entry of its last name in the module's order, as ``load_state_dict`` copies in that order
    and the last stays (read from each, its bytes were a mix of the two in parallel pieces, and a
    swap took the file's last, helper-72/73). For ``load_into`` (filled in place) the module's
    tensors are checked apart first (:func:`~aiotensor._io.tensors.check_apart`: two overlapping
    views refused, two parameters over one memory a tie); for a swap, its ties are its tensors
    under several names."""
    pairs = [(n, known[n], e) for e in entries for n in e.names if n in known]
    groups: list[list[int]] = []
    if place is _itself:  # (meta tensors have no memory to compare: their ties below, as a swap's)
        real = [i for i, p in enumerate(pairs) if not p[1].is_meta]
        ties_of_memory = check_apart([pairs[i][0] for i in real], [pairs[i][1] for i in real], "the module")
        groups = [[real[j] for j in g] for g in ties_of_memory]
    if ties:
        by_tensor: dict[int, list[int]] = {}
        for i, (n, t, _) in enumerate(pairs):
            if n in ties and (place is not _itself or t.is_meta):
                by_tensor.setdefault(id(t), []).append(i)
        groups += [g for g in by_tensor.values() if len(g) > 1]
    if not groups:
        return set()
    if not any(len({id(pairs[i][2]) for i in g}) > 1 for g in groups):  # (each tie stored once)
        return set()
    at = {k: i for i, k in enumerate(known)}
    skip: set[tuple[int, str]] = set()
    for g in groups:
        last = max((pairs[i] for i in g), key=lambda p: at[p[0]])[2]
        skip |= {(id(pairs[i][2]), pairs[i][0]) for i in g if pairs[i][2] is not last}
    return skip


def _in_place_at_once(
    entries: tuple[Entry, ...], known: dict[str, torch.Tensor], ties: dict[str, tuple[str, ...]], place: Place
) -> tuple[list[_Batch], list[str], list[str]] | None:
    """:func:`_plan`'s answer where every entry is read straight into the module's tensor of its one
    name (``place`` is :func:`_itself`; no tie; every name the module's; its shape and dtype; none
    on the meta device: a model loaded into itself), by C loops a column at a time (the loop per
    entry cost 22 ms per 20,000); None otherwise (the loop then names what differs)."""
    if place is not _itself or ties or set(gil.listed(map(len, map(_NAMES, entries)))) - {1}:
        return None
    names = gil.listed(map(_FIRST, map(_NAMES, entries)))  # (a slice per C loop: the GIL changes hands)
    dsts = gil.listed(map(known.get, names))
    if any(gil.listed(map(is_, dsts, repeat(None)))) or len(set(names)) != len(names):
        return None
    if gil.listed(map(_SHAPE, dsts)) != gil.listed(map(_SHAPE, entries)):
        return None
    if gil.listed(map(_DTYPE, dsts)) != gil.listed(map(_DTYPE, entries)):
        return None
    if any(gil.listed(map(_IS_META, dsts))):
        return None
    have: list[torch.Tensor] = dsts  # type: ignore[assignment]  # (None is none of them now)
    odd = gil.listed(compress(have, map(not_, map(_IS_CONTIGUOUS, have))))
    if not all(map(is_, map(overlaps, odd), repeat(False))):  # (overlapping, or maybe: the loop names it)
        return None
    if check_apart(names, have, "the module"):  # a tie stored under each of its names: the loop picks one
        return None
    chosen = set(names)
    return [(list(entries), dsts, [])] if entries else [], [k for k in known if k not in chosen], []


_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_NAMES, _FIRST, _SHAPE, _DTYPE, _IS_META = (
    attrgetter("names"),
    itemgetter(0),
    attrgetter("shape"),
    attrgetter("dtype"),
    attrgetter("is_meta"),
)


@functools.cache
def _convertible(src: torch.dtype, dst: torch.dtype) -> bool:
    """Can torch copy a tensor of ``src`` into one of ``dst`` (``float4_e2m1fn_x2``: not at all)?"""
    try:
        torch.empty(1, dtype=dst).copy_(torch.empty(1, dtype=src))
    except (NotImplementedError, RuntimeError, TypeError):
        return False
    return True


def _each(fn: Fill, fills: list[tuple[tuple[str, ...], torch.Tensor, int]], got: list[torch.Tensor], streams: list[Any]) -> None:
    """``fn(names, module's tensor, got[i])`` for each of ``fills``."""
    with torch.no_grad(), cuda.on_streams(streams):  # per thread: set in the worker
        for names, dst, i in fills:
            fn(names, dst, got[i])
    got.clear()  # the loaded tensors are freed here, not on the loop's thread


def _itself(names: tuple[str, ...], dst: torch.Tensor, e: Entry) -> torch.Tensor | None:
    """Read straight into the module's tensor where it has the stored dtype (not on the meta device):
    the tensor itself, not a ``detach()`` of it (the reads write its memory, and each copy into it
    is made under ``no_grad``): 20,000 detached tensors cost 1 us each to make and as much to free."""
    return dst if not dst.is_meta and dst.dtype == e.dtype else None


def _in_place(module: torch.nn.Module) -> Fill:
    """Copy into the module's tensors; a tensor on the meta device is replaced by the loaded one
    (in the meta tensor's dtype, a Parameter again if it was one, with its ``requires_grad``), set
    under every name of its tie group so the tie survives."""
    made: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its replacement

    def put(names: tuple[str, ...], dst: torch.Tensor, t: torch.Tensor) -> None:
        if not dst.is_meta:
            assign(dst.detach(), t)
        elif (new := made.get(id(dst))) is not None:  # a second name of a tie group, also in the file
            assign(new.detach(), t)
        else:
            value = t.to(dst.dtype)
            if isinstance(dst, torch.nn.Parameter):
                value = torch.nn.Parameter(value, requires_grad=dst.requires_grad)
            made[id(dst)] = value
            for n in names:
                owner, _, leaf = n.rpartition(".")
                setattr(module.get_submodule(owner), leaf, value)

    return put


async def load_into(
    module: torch.nn.Module,
    source: str | os.PathLike[str],
    *,
    strict: bool = True,
    device: str | torch.device = "cpu",
    keys: Keys = None,
    verify: bool = True,
    window_bytes: int = knobs.WINDOW_BYTES,
    scheduler: Scheduler | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> LoadResult:
    """Load ``source`` in place into ``module``'s parameters and buffers: read straight into their
    memory, once, where the module's tensor has the stored dtype; converted on the fly to the
    module's dtype otherwise, through new tensors of up to ``window_bytes`` at a time (memory: the
    module, and that window). Names and shapes are matched before anything is read.

    Tied parameters (one tensor under several names) are filled by whichever name the file has.
    Tensors on the meta device are materialized on ``device`` (where new tensors are read to; tensors
    already on a device are copied where they are), as ``load_state_dict(assign=True)`` would, but
    keeping ties. Buffers the module does not save (``persistent=False``) are not in any file: a
    meta module's stay on the meta device.

    ``keys`` loads part of the module: one name, names and prefixes (a prefix ends with ``.``), or
    a predicate, as :func:`stream` takes them; only the file's tensors it selects are read, and
    only the module's names it selects count as missing (a name or prefix that selects nothing in
    the file is a MismatchError). The module's other tensors are left as they are, a meta one
    on the meta device.

    ``verify``: the checksums the source carries (an aiotensor file's or step's CRC-32C, a
    ``torch.save`` zip's CRC-32) are checked as the bytes arrive; ``False`` skips that, for a
    source you trust (a warm load of a 0.53 GB file of ours: 9.7 GB/s with, 13.4 without, on the
    2-core development VM).

    ``storage_options``: for an ``s3://`` path, obstore's S3 keys (``endpoint``, ``access_key_id``,
    ``region``..., and ``allow_http``) over the ``AWS_*`` environment (``docs/store.md``).

    Raises:
        MismatchError: a shape differs (named; before anything is read), or with ``strict``,
            missing or unexpected keys (after the file has been read: the module then holds
            what was loaded).
        What :func:`stream` raises.

    A load that fails part way (ChecksumError, OSError) leaves what it read in the module, the
    corrupt tensor's bytes too: each is read straight into its place before its checksum is
    checked. Use :func:`prepare_swap` to switch only once everything is in and verified.

    Cancellation: returns once no thread writes into the module; it may hold a mix of old and new
    values, their version counters moved (load into a copy, or use :func:`prepare_swap`, to switch only once everything is in).
    """
    got = await _matched(
        module,
        source,
        _itself,
        _in_place(module),
        strict=False,
        device=device,
        window_bytes=window_bytes,
        scheduler=scheduler,
        storage_options=storage_options,
        verify=verify,
        keys=keys,
    )
    _raise_if(strict, f"load_into {source}", got)
    return got


class Swap:
    """New weights for a module, loaded and verified beside the ones serving; :meth:`apply` switches.
    ``missing_keys`` and ``unexpected_keys`` say what the new version lacked or had beyond the
    module (both empty unless it was prepared with ``strict=False``)."""

    def __init__(
        self,
        module: torch.nn.Module,
        tensors: Mapping[str, torch.Tensor],
        result: LoadResult | None = None,
        ties: Iterable[tuple[str, ...]] = (),
        was: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.module = module
        self.tensors = dict(tensors)
        self.missing_keys, self.unexpected_keys = result or LoadResult([], [])
        self._ties = list(dict.fromkeys(ties))  # the module's names of one tensor, as prepared
        # the module's tensors as prepared, and their addresses: where both are the same at apply(),
        # the module did not change (the full check of each: 40 ms per 20,000 tensors)
        self._was = [was[n] for n in self.tensors] if was is not None else []
        self._ptrs = list(map(_PTR, self._was))

    def apply(self) -> None:
        """Switch the module to the new weights: pointer swaps only, no I/O and no copy. Call it
        between two requests, on the loop thread, while no other thread runs the module (with
        inference in worker threads, load a second module and switch the reference instead, as
        ``examples/model_server.py`` does): it does not await, so no coroutine sees half of it.
        A tied parameter switches under all its names at once (it is one tensor). The weights it
        switches out are freed in a worker thread (CPU memory: unmapping 1 GB took 70 ms, a stall
        of the event loop; CUDA memory goes back to torch's cache at once). Never awaiting, it
        holds the loop for its whole run, about 2 us a tensor: 40 ms for a module of 20,000
        submodules on the development VM (helper-36), most of it the walk that checks the module
        did not change since :func:`prepare_swap`; a few hundred tensors take well under 1 ms.

        Raises:
            MismatchError: the module changed since :func:`prepare_swap` (``.half()``, ``.to()``, a
                parameter replaced or removed, a tie made or broken): a tensor of it is not of the
                shape, dtype, device and strides of the one prepared for it, or its names no longer
                share tensors as they did. Nothing is switched; prepare the swap again.
        """
        # now: .to() or new parameters since replace tensors (by the walk where it gives the same:
        # half state_dict()'s time, on the loop's thread, for a module of many submodules)
        current = _tensors_by_name(self.module)
        news = list(self.tensors.values())
        got = list(map(current.get, self.tensors))
        if any(c is None for c in got):
            gone = [n for n, c in zip(self.tensors, got, strict=True) if c is None]
            raise MismatchError(f"the module changed since prepare_swap: it has no {gone[:5]} any more; nothing was switched")
        now: list[torch.Tensor] = got  # type: ignore[assignment]  # (none is None)
        # the same tensors at the same addresses (C loops), else each compared
        same = len(now) == len(self._was) and all(map(is_, now, self._was)) and list(map(_PTR, now)) == self._ptrs
        if not same and (list(map(_KIND, now)) != list(map(_KIND, news)) or _strides(now) != _strides(news)):
            changed = [
                n for n, c, t in zip(self.tensors, now, news, strict=True) if _KIND(c) != _KIND(t) or c.stride() != t.stride()
            ]
            raise MismatchError(
                f"the module changed since prepare_swap: {changed[:5]} ({len(changed)} in all) are no longer "
                "tensors of the shape, dtype, device and strides the swap loaded; nothing was switched, prepare it again"
            )
        untied = [g for g in self._ties if any(current.get(n) is not current[g[0]] for n in g[1:])]
        # a tie made since: two prepared names one tensor now (the same tensors as prepared are not)
        made = not same and len(set(map(id, now))) != len(now)
        if untied or made:
            what = f"{list(untied[0])} are no longer one tensor" if untied else "two of its names are one tensor now"
            raise MismatchError(f"the module's ties changed since prepare_swap: {what}; nothing was switched, prepare it again")
        old = list(map(_DATA, now))  # the weights switched out: the CPU ones freed in a worker thread
        with torch.no_grad():
            for p, new in zip(now, news, strict=True):
                p.data = new
        modified(now)  # a graph made from the old weights refuses backward() (helper-49), as after load_into
        old = [d for d in old if d.is_cpu]  # (CUDA memory back to torch's cache at once)
        threads.in_worker(functools.partial(_let_go, old))


def _let_go(old: list[torch.Tensor]) -> None:
    """Free the weights a swap switched out, and give the memory back to the system (kept by the C
    library, a server's memory grew with each swap: :func:`~aiotensor._runtime.buffers.give_back_freed`)."""
    if old:
        old.clear()
        give_back_freed()


_KIND, _DATA, _PTR = attrgetter("dtype", "shape", "device"), attrgetter("data"), torch.Tensor.data_ptr


def _strides(tensors: list[torch.Tensor]) -> list[tuple[int, ...]]:
    return list(map(torch.Tensor.stride, tensors))  # type: ignore[arg-type]


async def prepare_swap(
    module: torch.nn.Module,
    source: str | os.PathLike[str],
    *,
    strict: bool = True,
    keys: Keys = None,
    verify: bool = True,
    window_bytes: int = knobs.WINDOW_BYTES,
    scheduler: Scheduler | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Swap:
    """Load ``source`` for ``module`` into new tensors (one extra copy of the weights, on the
    module's devices and dtypes, read straight into them where the dtype is the stored one) while
    the module keeps serving; returns a :class:`Swap` whose
    ``apply()`` switches between two requests. If the load fails (a corrupt file: ChecksumError;
    other shapes, or with ``strict`` other keys: MismatchError), nothing of the new version is
    visible. Tied parameters count as :func:`load_into` counts them; with ``strict=False``, what
    the file lacks keeps its current value after ``apply()``.

    ``keys``: as :func:`load_into`'s; ``apply()`` then switches only those tensors (a new head, an
    adapter's layers), the rest keep serving as they are.

    ``verify``: as :func:`load_into`'s; with ``False`` a corrupt file is no longer refused, and
    its bytes are what ``apply()`` switches to.

    ``storage_options``: for an ``s3://`` path, obstore's S3 keys (``endpoint``, ``access_key_id``,
    ``region``..., and ``allow_http``) over the ``AWS_*`` environment (``docs/store.md``).

    Cancellation: nothing was switched; the partly loaded copy is dropped.
    """
    new: dict[str, torch.Tensor] = {}
    ties: list[tuple[str, ...]] = []  # the module's names of one tensor (tied weights)
    was: dict[str, torch.Tensor] = {}  # the module's tensor each new one replaces

    used: set[int] = set()  # the new tensors given to a name already (another name gets a copy)

    def beside(names: tuple[str, ...], dst: torch.Tensor, e: Entry) -> torch.Tensor | None:
        was[names[0]] = dst
        if len(names) > 1:
            ties.append(names)
        if dst.dtype != e.dtype:
            return None
        # in the kind (an inference tensor's replacement is one too: apply() mixing them breaks the
        # module) and the layout (channels_last stays so) of the tensor it replaces
        with writing(dst):
            t = new[names[0]] = torch.empty_like(dst)
        used.add(id(t))
        return t

    def keep(names: tuple[str, ...], dst: torch.Tensor, t: torch.Tensor) -> None:
        # (also a second module tensor of one stored entry, a torch.save storage under two names:
        # its own copy, where it had the first one's tensor and no `was`, a KeyError: helper-76)
        was[names[0]] = dst
        if id(t) not in used and (t.dtype, t.device, t.is_inference(), t.stride()) == (
            dst.dtype,
            dst.device,
            dst.is_inference(),
            dst.stride(),
        ):
            new[names[0]] = t
            used.add(id(t))
            return
        with writing(dst):
            made = new[names[0]] = torch.empty_like(dst)
            made.copy_(t)

    got = await _matched(
        module,
        source,
        beside,
        keep,
        strict=strict,
        device="cpu",
        window_bytes=window_bytes,
        scheduler=scheduler,
        storage_options=storage_options,
        verify=verify,
        keys=keys,
        no_meta=True,
        swap=True,
    )
    _raise_if(strict, f"prepare_swap {source}", got)
    await threads.run_sync(_check_kept_apart, module, was)
    return Swap(module, new, got, ties, was)


def _check_kept_apart(module: torch.nn.Module, was: Mapping[str, torch.Tensor]) -> None:
    """A MismatchError where a parameter or buffer of ``module`` that a swap keeps (a non-persistent
    buffer, one ``keys`` leaves out) shares memory with one it replaces (``was``): a view of a fused
    weight (``q = qkv[:2]``) kept serving the old weights after ``apply()``, where ``load_into``
    fills it (helper-72). Their byte spans compared by numpy: each kept one against the replaced
    ones that begin before it ends."""
    swapped = set(map(id, was.values()))
    kept = [
        (n, t)
        for n, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
        if id(t) not in swapped and _plain_memory(t)
    ]
    replaced_by_name = {n: t for n, t in was.items() if _plain_memory(t)}
    if not kept or not replaced_by_name:
        return
    names, replaced = list(replaced_by_name), list(replaced_by_name.values())
    lo, hi = _spans(replaced)
    order = np.argsort(lo, kind="stable")
    lo, reach = lo[order], np.maximum.accumulate(hi[order])  # the furthest a replaced one reaches, from the first
    k_lo, k_hi = _spans([t for _, t in kept])
    before = np.searchsorted(lo, k_hi, side="left")  # the replaced ones that begin before each kept one ends
    meets = np.flatnonzero((before > 0) & (reach[np.maximum(before - 1, 0)] > k_lo))
    if meets.size:
        i = int(meets[0])
        j = next(
            j for j in map(int, order[: before[i]]) if _spans([replaced[j]])[1][0] > k_lo[i]
        )  # (one of them: the message names it)
        raise MismatchError(
            f"the module's {kept[i][0]!r} shares memory with {names[j]!r}, which the swap replaces, and is not "
            "replaced itself (a view of it, or it of that): after apply() it would keep the old weights. Load this "
            "module with load_into, or load a second module and switch to it"
        )


def _plain_memory(t: torch.Tensor) -> bool:
    """Does ``t`` have bytes of its own to compare (a sparse, nested, meta or empty tensor, or a
    wrapper subclass, has none: its data pointer is an error, helper-73)?"""
    return (
        t.layout == torch.strided
        and not t.is_nested
        and not t.is_meta
        and t.numel() > 0
        and type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__
    )


def _spans(tensors: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Each tensor's first byte and one past its last (a strided one's: from its first element to its last)."""
    lo = np.array(list(map(torch.Tensor.data_ptr, tensors)), np.int64)
    return lo, lo + np.array(list(map(byte_span, tensors)), np.int64)
