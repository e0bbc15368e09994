"""torch dtype <-> safetensors dtype string, and the shapes of packed dtypes.

Every dtype both safetensors (0.8) and torch know. ``F4`` (torch.float4_e2m1fn_x2) packs two 4-bit
values in one torch element: safetensors counts values, so a torch tensor of shape ``(..., n)`` is
stored with shape ``(..., 2 * n)`` and ``n`` bytes per row, as the safetensors package writes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
}
TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_TO_TORCH.items()}
ITEMSIZE: dict[str, int] = {k: v.itemsize for k, v in SAFETENSORS_TO_TORCH.items()}
PACKED: dict[str, int] = {"F4": 2}  # values per torch element, where more than one


def file_shape(dtype: str, shape: Sequence[int]) -> tuple[int, ...]:
    """The safetensors shape of a torch tensor of ``shape`` (0-d packed tensors are refused earlier)."""
    p = PACKED.get(dtype)
    return tuple(shape) if p is None else (*shape[:-1], shape[-1] * p)


def torch_shape(dtype: str, shape: Sequence[int]) -> tuple[int, ...]:
    """The torch shape of a safetensors ``shape`` (validated by :func:`packing_problem`)."""
    p = PACKED.get(dtype)
    return tuple(shape) if p is None else (*shape[:-1], shape[-1] // p)


def packing_problem(dtype: str, shape: Sequence[int]) -> str | None:
    """Why ``shape`` cannot hold whole elements of a packed dtype (None if it can)."""
    p = PACKED.get(dtype)
    if p is not None and (not shape or shape[-1] % p):
        return f"{dtype} packs {p} values per byte: its last dimension must be a multiple of {p}"
    return None


def nbytes_of(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * ITEMSIZE[dtype] // PACKED.get(dtype, 1)
