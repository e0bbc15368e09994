"""Planning: state -> frozen plan of shards and byte ranges. Pure: no I/O, tested without a disk."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter, mul
from typing import Any

import torch

from .. import knobs
from .._runtime import gil
from .._runtime.buffers import round_up
from ..formats import safetensors as st
from ..formats.dtypes import PACKED, file_shape
from ..formats.tree import flatten
from .tensors import check_tensor

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
_SECOND = itemgetter(1)


@gil.quiet_gc
def plan_save(
    state: Any,
    *,
    shard_bytes: int = knobs.SHARD_BYTES,
    devices: tuple[str, ...] = ("cpu",),
    stable: Callable[[str, torch.Tensor], bool] | None = None,
    previous: Sequence[tuple[tuple[str, ...], Previous]] = (),
) -> tuple[SavePlan, dict[str, torch.Tensor]]:
    """Plan a checkpoint of ``state``: returns the plan and the source tensor of every stored key.

    Tensors that are exactly the same view of the same memory (tied weights) are stored once; the
    others become aliases. Shards are filled in state order up to ``shard_bytes``; inside a shard,
    tensors are ordered by descending itemsize, so each starts at a multiple of its itemsize.

    Incremental saves: each of ``previous`` (an earlier shard's keys, in file order) whose tensors
    are all here, with its header, is planned again as it was (a candidate to reuse it); then the
    tensors ``stable`` says may be unchanged go to candidate shards of their own (at most
    ``knobs.CANDIDATE_SHARD_BYTES``), whose layout the next save can repeat; the rest as above.
    """
    tree, tensors = flatten(state)
    dtypes = [check_tensor(key, t, devices) for key, t in tensors]
    # only tensors whose first element lies where another's does can be the same view: their
    # identities are the ones compared (each one cost 1-2 us; 20,000 data pointers, one C loop each)
    ptrs = gil.listed(map(_DATA_PTR, gil.listed(map(_SECOND, tensors))))
    shared = {p for p, n in Counter(ptrs).items() if n > 1}
    seen: dict[Any, str] = {}
    aliases: dict[str, str] = {}
    stored: list[tuple[str, str, torch.Tensor]] = []
    for (key, t), dtype, ptr in zip(tensors, dtypes, ptrs, strict=True):
        if ptr in shared and (ident := _identity(t)) is not None:
            first = seen.setdefault(ident, key)
            if first != key:  # (keys are unique)
                aliases[key] = first
                continue
        stored.append((key, dtype, t))
    by_key = {k: (k, d, t) for k, d, t in stored}
    planned: list[tuple[bytes, st.Layout, bool, Previous | None]] = []
    for keys, earlier in previous:
        if all(k in by_key for k in keys):
            group = [by_key[k] for k in keys]
            header, layout = _shard(group)
            if header == earlier.header:
                planned.append((header, layout, True, earlier))
                for k in keys:
                    del by_key[k]
    left = list(by_key.values())
    maybe = [it for it in left if stable is not None and stable(it[0], it[2])]
    chosen = {id(it) for it in maybe}
    for group, candidate in [
        *((g, True) for g in _fill(maybe, min(shard_bytes, knobs.CANDIDATE_SHARD_BYTES))),
        *((g, False) for g in _fill([it for it in left if id(it) not in chosen], shard_bytes)),
    ]:
        _by_itemsize(group)
        header, layout = _shard(group)
        planned.append((header, layout, candidate, None))
    shards = []
    arena = 0
    for i, (header, layout, candidate, prev) in enumerate(planned or [(*st.build([], SHARD_METADATA), False, None)]):
        shards.append(ShardPlan(f"shard-{i:05d}.safetensors", header, layout, arena, candidate, prev))
        arena += round_up(layout.file_size)
    nbytes = sum(s.nbytes for sh in shards for s in sh.layout.tensors)
    sources = {k: t for k, _, t in stored}
    gil.emptied(seen, by_key, tensors, stored, left, maybe, dtypes, ptrs)  # (freed on return: one C call, ~3 ms per 20,000)
    return SavePlan(tree, tuple(shards), aliases, arena, nbytes), sources


def shard_header(specs: Sequence[st.TensorSpec]) -> bytes:
    """The header of a shard the store writes holding ``specs`` (in file order)."""
    return st.header_bytes([(s.key, s.dtype, s.shape) for s in specs], SHARD_METADATA)[0]


def _shard(group: list[tuple[str, str, torch.Tensor]]) -> tuple[bytes, st.Layout]:
    """The header and layout of a shard holding ``group`` (key, safetensors dtype, tensor), in order
    (column by column, in C loops where no dtype is packed: 20,000 tensors, a Python call each cost
    ~6 ms)."""
    keys, dtypes, tensors = (gil.listed(map(itemgetter(i), group)) for i in range(3))
    shapes = gil.listed(map(_SHAPE, tensors))
    sizes = map(tuple, shapes) if PACKED.keys().isdisjoint(dtypes) else map(file_shape, dtypes, shapes)
    return st.build(gil.listed(zip(keys, dtypes, sizes, strict=True)), SHARD_METADATA)


def _nbytes(items: list[tuple[str, str, torch.Tensor]]) -> list[int]:
    """Each item's tensor's bytes (C loops)."""
    tensors = gil.listed(map(_THIRD, items))
    return gil.listed(map(mul, map(_NUMEL, tensors), map(_ELEMENT_SIZE, tensors)))


def _by_itemsize(group: list[tuple[str, str, torch.Tensor]]) -> None:
    """Order ``group`` by descending item size, stably (state order within an item size), so that
    each tensor starts at a multiple of its own; as it is where it has one item size (nearly always:
    no sort, which cost a Python call per tensor)."""
    sizes = gil.listed(map(_ELEMENT_SIZE, map(_THIRD, group)))
    if min(sizes, default=0) != max(sizes, default=0):
        minus = [-n for n in sizes]
        group[:] = [group[i] for i in sorted(range(len(group)), key=minus.__getitem__)]


def _fill(items: list[tuple[str, str, torch.Tensor]], most: int) -> list[list[tuple[str, str, torch.Tensor]]]:
    """``items`` in groups of at most ``most`` bytes (a bigger tensor alone), in order."""
    sizes = _nbytes(items)
    if sum(sizes) <= most:  # one group (their bytes counted in C loops: 20,000 tensors, a loop each cost ~10 ms)
        return [items] if items else []
    groups: list[list[tuple[str, str, torch.Tensor]]] = []
    size = 0
    for item, n in zip(items, sizes, strict=True):
        if not groups or (groups[-1] and size + n > most):
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    return groups


_THIRD, _SHAPE = itemgetter(2), attrgetter("shape")
_NUMEL, _ELEMENT_SIZE = torch.Tensor.numel, torch.Tensor.element_size
