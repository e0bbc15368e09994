"""Planning: state -> frozen plan of shards and byte ranges. Pure: no I/O, tested without a disk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import knobs
from .._runtime import gil
from .._runtime.buffers import round_up
from ..formats import manifest as mf
from ..formats import safetensors as st
from ..formats.dtypes import file_shape
from ..formats.tree import flatten
from .tensors import check_tensor

SHARD_METADATA = {"format": "pt"}  # a shard's header ``__metadata__`` (as safetensors' torch writer)


@dataclass(frozen=True)
class ShardPlan:
    """One shard file: its header bytes, its layout, and where its image starts in the staging arena."""

    file: str
    header: bytes
    layout: st.Layout
    arena_offset: int


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
    # exactly the bytes and their order (and is far cheaper than asking for the storage)
    return (t.device, t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_conj(), t.is_neg())


@gil.quiet_gc
def plan_save(
    state: Any, *, shard_bytes: int = knobs.SHARD_BYTES, devices: tuple[str, ...] = ("cpu",)
) -> tuple[SavePlan, dict[str, torch.Tensor]]:
    """Plan a checkpoint of ``state``: returns the plan and the source tensor of every stored key.

    Tensors that are exactly the same view of the same memory (tied weights) are stored once; the
    others become aliases. Shards are filled in state order up to ``shard_bytes``; inside a shard,
    tensors are ordered by descending itemsize, so each starts at a multiple of its itemsize.
    """
    tree, tensors = flatten(state)
    seen: dict[Any, str] = {}
    aliases: dict[str, str] = {}
    stored: list[tuple[str, str, torch.Tensor]] = []
    for key, t in tensors:
        dtype = check_tensor(key, t, devices)
        ident = _identity(t)
        if ident is not None and ident in seen:
            aliases[key] = seen[ident]
            continue
        if ident is not None:
            seen[ident] = key
        stored.append((key, dtype, t))
    groups: list[list[tuple[str, str, torch.Tensor]]] = [[]]
    size = 0
    for item in stored:
        n = item[2].numel() * item[2].element_size()
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    shards = []
    arena = 0
    for i, group in enumerate(groups):
        group.sort(key=lambda x: -x[2].element_size())  # stable: state order within an itemsize
        header, layout = st.build([(k, d, file_shape(d, t.shape)) for k, d, t in group], SHARD_METADATA)
        shards.append(ShardPlan(f"shard-{i:05d}.safetensors", header, layout, arena))
        arena += round_up(layout.file_size)
    nbytes = sum(s.nbytes for sh in shards for s in sh.layout.tensors)
    return SavePlan(tree, tuple(shards), aliases, arena, nbytes), {k: t for k, _, t in stored}


def manifest_bytes(step: int, plan: SavePlan, crcs: dict[str, int]) -> bytes:
    """The manifest of a committed step: the plan's tree and shards, every tensor's crc32c."""
    return mf.dumps(
        mf.Manifest(
            step=step,
            tree=plan.tree,
            shards={sh.file: sh.layout.file_size for sh in plan.shards},
            entries={s.key: mf.Entry(sh.file, s, crcs[s.key]) for sh in plan.shards for s in sh.layout.tensors},
            aliases=plan.aliases,
        )
    )
