"""Planning: state -> frozen plan of shards and byte ranges. Pure: no I/O, tested without a disk."""

from __future__ import annotations

import os
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter, itemgetter, mul, not_
from typing import Any

import torch

from .. import knobs
from .._runtime import gil
from .._runtime.buffers import round_up
from ..formats import safetensors as st
from ..formats.dtypes import ITEMSIZE, PACKED, file_shape
from ..formats.tree import flatten
from .tensors import check_tensor, check_tensors

SHARD_METADATA = {"format": "pt"}  # a shard's header ``__metadata__`` (as safetensors' torch writer)


@dataclass(frozen=True)
class Previous:
    """A shard of an earlier committed step that a new shard may be (incremental saves): its file,
    its header, the digest of its bytes, and its tensors' crc32c."""

    path: str
    header: bytes
    digest: str
    crcs: dict[str, int]
    step: int


@dataclass(frozen=True)
class ShardPlan:
    """One shard file: its header bytes, its layout, and where its image starts in the staging
    arena. A ``candidate`` holds tensors that may be unchanged: its bytes get a digest (``reuse``:
    the earlier shard of the same header it may be, if the digests agree)."""

    file: str
    header: bytes
    layout: st.Layout
    arena_offset: int
    candidate: bool = False
    reuse: Previous | None = None


@dataclass(frozen=True)
class SavePlan:
    tree: Any
    shards: tuple[ShardPlan, ...]
    aliases: dict[str, str]
    arena_bytes: int
    nbytes: int  # bytes of tensor data (headers excluded)
    # each stored tensor's memory and version counter as planned (incremental saves: the next
    # save's :func:`plan_save` ``stable`` compares them)
    marks: dict[str, Any] = field(default_factory=dict)


def _identity(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Tensors with equal identity are the same values over the same bytes (tied weights); a lazily
    conjugated or negated view of a tensor is not (its values differ)."""
    if t.numel() == 0:
        return None
    # data_ptr() is where the view's first element lies: with shape, stride and dtype it pins down
    # exactly the bytes and their order (and is far cheaper than asking for the storage); the
    # device is its index (-1: the CPU; a torch.device made per tensor cost 0.3 us)
    return (t.get_device(), t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_conj(), t.is_neg())


_DATA_PTR = torch.Tensor.data_ptr
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


@gil.quiet_gc
def plan_save(
    state: Any,
    *,
    shard_bytes: int = knobs.SHARD_BYTES,
    devices: tuple[str, ...] = ("cpu",),
    stable: Callable[[list[str], list[Any]], list[bool]] | None = None,
    previous: Sequence[tuple[tuple[str, ...], Previous]] = (),
) -> tuple[SavePlan, dict[str, torch.Tensor]]:
    """Plan a checkpoint of ``state``: returns the plan and the source tensor of every stored key.

    Tensors that are exactly the same view of the same memory (tied weights) are stored once; the
    others become aliases. Shards are filled in state order up to ``shard_bytes``; inside a shard,
    tensors are ordered by descending itemsize, so each starts at a multiple of its itemsize.

    Incremental saves: each of ``previous`` (an earlier shard's keys, in file order) whose tensors
    are all here, with its header, is planned again as it was (a candidate to reuse it); then the
    tensors ``stable`` says may be unchanged (asked for a list of keys and their tensors'
    :func:`tensor_marks` at once; the plan keeps every stored tensor's mark) go to candidate
    shards of their own (at most ``knobs.CANDIDATE_SHARD_BYTES``), whose layout the next save can
    repeat; the rest as above.
    """
    tree, tensors = flatten(state)
    dtypes = check_tensors(tensors, devices)
    # only tensors whose first element lies where another's does can be the same view: their
    # identities are the ones compared (each one cost 1-2 us; 20,000 data pointers, one C loop each)
    ptrs = gil.listed(map(_DATA_PTR, gil.listed(map(_SECOND, tensors))))
    for key, t in compress(tensors, map(not_, ptrs)) if 0 in ptrs else ():  # at address 0: empty, or a ZeroTensor
        check_tensor(key, t, devices)
    shared = {p for p, n in Counter(ptrs).items() if n > 1} if len(set(ptrs)) < len(ptrs) else set()
    seen: dict[Any, str] = {}
    aliases: dict[str, str] = {}
    stored: list[tuple[str, str, torch.Tensor]] = []
    if not shared:  # no two tensors start at one address (no tied weights): all stored, by C loops
        stored = gil.listed(zip(map(_FIRST, tensors), dtypes, map(_SECOND, tensors), strict=True))
    for (key, t), dtype, ptr in zip(tensors, dtypes, ptrs, strict=True) if shared else ():
        if ptr in shared and (ident := _identity(t)) is not None:
            first = seen.setdefault(ident, key)
            if first != key:  # (keys are unique)
                aliases[key] = first
                continue
        stored.append((key, dtype, t))
    by_key: dict[str, tuple[str, str, torch.Tensor]] = {}
    if previous:
        gil.filled(by_key, zip(map(_FIRST, stored), stored, strict=True))
    planned: list[tuple[bytes, st.Layout, bool, Previous | None]] = []
    for keys, earlier in previous:  # (C loops: an earlier shard may hold tens of thousands)
        # (a shard of more tensors than one file may hold, written before they were split: not
        # reused, and never built: it is refused now, helper-73)
        if len(keys) <= st.MAX_TENSORS and all(map(by_key.__contains__, keys)):
            group = gil.listed(map(by_key.__getitem__, keys))
            header, layout = _shard(group)
            if header == earlier.header:
                planned.append((header, layout, True, earlier))
                deque(map(by_key.__delitem__, keys), maxlen=0)
    left = list(by_key.values()) if previous else stored
    marks: dict[str, Any] = {}
    flags: list[bool] = []
    if stable is not None:
        # (where every tensor is stored, their data pointers are those already taken)
        made = tensor_marks(gil.listed(map(_THIRD, stored)), None if shared else ptrs)
        marks = gil.filled({}, zip(map(_FIRST, stored), made, strict=True))
        names = gil.listed(map(_FIRST, left))
        flags = stable(names, gil.listed(map(marks.__getitem__, names)))
    maybe = gil.listed(compress(left, flags))
    rest = gil.listed(compress(left, map(not_, flags))) if maybe else left
    for group, candidate in [
        *((g, True) for g in _fill(maybe, min(shard_bytes, knobs.CANDIDATE_SHARD_BYTES))),
        *((g, False) for g in _fill(rest, shard_bytes)),
    ]:
        _by_itemsize(group)
        header, layout = _shard(group)
        planned.append((header, layout, candidate, None))
    shards = []
    arena = 0
    for i, (header, layout, candidate, prev) in enumerate(planned or [(*st.build([], SHARD_METADATA), False, None)]):
        shards.append(ShardPlan(f"shard-{i:05d}.safetensors", header, layout, arena, candidate, prev))
        arena += round_up(layout.file_size)
    nbytes = sum(sum(map(_NBYTES, sh.layout.tensors)) for sh in shards)
    sources: dict[str, torch.Tensor] = gil.filled({}, zip(map(_FIRST, stored), map(_THIRD, stored), strict=True))
    gil.emptied(seen, by_key, tensors, stored, left, maybe, rest, dtypes, ptrs)  # (freed on return: one C call, ~3 ms per 20,000)
    return SavePlan(tree, tuple(shards), aliases, arena, nbytes, marks), sources


def tensor_marks(tensors: list[torch.Tensor], ptrs: list[int] | None = None) -> list[Any]:
    """Each tensor's memory and version counter, ``(data_ptr, _version)``, by C loops (``ptrs``: their
    data pointers, where taken already). An inference tensor has no counter (None): in the same
    memory, it is taken as maybe unchanged, as a frozen base model made under ``inference_mode``
    is (what a candidate shard holds is compared byte for byte before it is reused)."""
    try:
        return gil.listed(zip(ptrs or map(_DATA_PTR, tensors), map(_VERSION, tensors), strict=True))
    except RuntimeError:  # "Inference tensors do not track version counter"
        return [(t.data_ptr(), None if t.is_inference() else t._version) for t in tensors]


def shard_header(specs: Sequence[st.TensorSpec]) -> bytes:
    """The header of a shard the store writes holding ``specs`` (in file order)."""
    return st.header_bytes([(s.key, s.dtype, s.shape) for s in specs], SHARD_METADATA)[0]


def _shard(group: list[tuple[str, str, torch.Tensor]]) -> tuple[bytes, st.Layout]:
    """The header and layout of a shard holding ``group`` (key, safetensors dtype, tensor), in order
    (column by column, in C loops where no dtype is packed: 20,000 tensors, a Python call each cost
    ~6 ms)."""
    keys, dtypes, tensors = (gil.listed(map(itemgetter(i), group)) for i in range(3))
    return _planned.get(keys, dtypes, gil.listed(map(_SHAPE, tensors)))


def _built(keys: list[str], dtypes: list[str], shapes: list[torch.Size]) -> tuple[bytes, st.Layout]:
    sizes = map(tuple, shapes) if PACKED.keys().isdisjoint(dtypes) else map(file_shape, dtypes, shapes)
    return st.build(gil.listed(zip(keys, dtypes, sizes, strict=True)), SHARD_METADATA)


class _Planned:
    """The shards :func:`_shard` made lately, by their tensors' keys, dtypes and shapes: a state saved
    again in the same layout (every save of a training run) finds its shards' headers and layouts
    here (20,000 tensors: 15 ms to build, ~2 to compare). At most ``most`` tensors' worth, the
    least recently used dropped. Shared by every store of the process (a lock: plans are made in
    worker threads); it holds no tensor."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.count = 0
        self.lock = threading.Lock()
        self.held: OrderedDict[tuple[str, ...], tuple[list[str], list[torch.Size], tuple[bytes, st.Layout]]] = OrderedDict()

    def get(self, keys: list[str], dtypes: list[str], shapes: list[torch.Size]) -> tuple[bytes, st.Layout]:
        if len(keys) > self.most:
            return _built(keys, dtypes, shapes)
        name = tuple(keys)
        with self.lock:
            hit = self.held.get(name)
        if hit is not None and gil.same(hit[0], dtypes) and gil.same(hit[1], shapes):
            with self.lock:
                if name in self.held:
                    self.held.move_to_end(name)
            return hit[2]
        made = _built(keys, dtypes, shapes)
        with self.lock:
            if self.held.pop(name, None) is not None:
                self.count -= len(name)
            self.held[name] = (dtypes, shapes, made)
            self.count += len(name)
            while self.count > self.most:
                self.count -= len(self.held.popitem(last=False)[0])
        return made


_planned = _Planned(knobs.PLANNED_TENSORS)
os.register_at_fork(after_in_child=lambda: setattr(_planned, "lock", threading.Lock()))  # (one a thread held at the fork)


def _nbytes(items: list[tuple[str, str, torch.Tensor]]) -> list[int]:
    """Each item's tensor's bytes (C loops)."""
    return gil.listed(map(mul, map(_NUMEL, map(_THIRD, items)), map(ITEMSIZE.__getitem__, map(_SECOND, items))))


def _by_itemsize(group: list[tuple[str, str, torch.Tensor]]) -> None:
    """Order ``group`` by descending item size, stably (state order within an item size), so that
    each tensor starts at a multiple of its own; as it is where it has one item size (nearly always:
    no sort, which cost a Python call per tensor)."""
    sizes = gil.listed(map(ITEMSIZE.__getitem__, map(_SECOND, group)))
    if min(sizes, default=0) != max(sizes, default=0):
        minus = [-n for n in sizes]
        group[:] = [group[i] for i in sorted(range(len(group)), key=minus.__getitem__)]


def _fill(items: list[tuple[str, str, torch.Tensor]], most: int) -> list[list[tuple[str, str, torch.Tensor]]]:
    """``items`` in groups of at most ``most`` bytes (a bigger tensor alone) and of at most
    :data:`~aiotensor.formats.safetensors.MAX_TENSORS` tensors (what a reader of one file takes:
    helper-71, a shard of 270,000 that ``load_file`` refused), in order."""
    sizes = _nbytes(items)
    if sum(sizes) <= most and len(items) <= st.MAX_TENSORS:  # one group (bytes counted in C loops: ~10 ms a loop per 20,000)
        return [items] if items else []
    groups: list[list[tuple[str, str, torch.Tensor]]] = []
    size = 0
    for item, n in zip(items, sizes, strict=True):
        if not groups or (groups[-1] and size + n > most) or len(groups[-1]) == st.MAX_TENSORS:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    return groups


_THIRD, _SHAPE, _NBYTES, _VERSION = itemgetter(2), attrgetter("shape"), attrgetter("nbytes"), attrgetter("_version")
_NUMEL = torch.Tensor.numel
