"""Planning: state -> frozen plan of shards and byte ranges. Pure: no I/O, tested without a disk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import _gil
from ._dtypes import PACKED, TORCH_TO_SAFETENSORS, file_shape
from .buffers import round_up
from .errors import StateError
from .formats import safetensors as st
from .formats.tree import flatten


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


def check_tensor(key: str, t: torch.Tensor, devices: tuple[str, ...] = ("cpu",)) -> str:
    """The safetensors dtype of ``t``, or a StateError naming ``key`` and saying what to do."""
    if t.is_nested:
        raise StateError(f"tensor {key!r} is a nested tensor; store its components (t.unbind()) or t.to_padded_tensor(0)")
    if t.layout != torch.strided:
        raise StateError(f"tensor {key!r} has layout {t.layout}; only dense (strided) tensors are stored (use .to_dense())")
    if t.is_quantized:
        raise StateError(f"tensor {key!r} is quantized; store t.int_repr(), t.q_scale() and t.q_zero_point() instead")
    if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        raise StateError(
            f"tensor {key!r} is a {type(t).__name__}, a tensor subclass that is not plain memory "
            "(DTensor: open the store with distributed=True on every rank, or save .full_tensor(); "
            "others: convert to a plain tensor)"
        )
    if t.device.type not in devices:
        raise StateError(f"tensor {key!r} is on {t.device}; this store handles {', '.join(devices)} tensors")
    dtype = TORCH_TO_SAFETENSORS.get(t.dtype)
    if dtype is None:
        raise StateError(f"tensor {key!r} has dtype {t.dtype}, which safetensors cannot store")
    if dtype in PACKED and t.dim() == 0:
        raise StateError(f"tensor {key!r}: a 0-d {t.dtype} cannot be stored (safetensors counts its packed values)")
    return dtype


def _identity(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Tensors with equal identity are the same values over the same bytes (tied weights); a lazily
    conjugated or negated view of a tensor is not (its values differ)."""
    if t.numel() == 0:
        return None
    # data_ptr() is where the view's first element lies: with shape, stride and dtype it pins down
    # exactly the bytes and their order (and is far cheaper than asking for the storage)
    return (t.device, t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_conj(), t.is_neg())


@_gil.quiet_gc
def plan_save(
    state: Any, *, shard_bytes: int = 4 << 30, devices: tuple[str, ...] = ("cpu",)
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
        header, layout = st.build([(k, d, file_shape(d, t.shape)) for k, d, t in group], {"format": "pt"})
        shards.append(ShardPlan(f"shard-{i:05d}.safetensors", header, layout, arena))
        arena += round_up(layout.file_size)
    nbytes = sum(s.nbytes for sh in shards for s in sh.layout.tensors)
    return SavePlan(tree, tuple(shards), aliases, arena, nbytes), {k: t for k, _, t in stored}
