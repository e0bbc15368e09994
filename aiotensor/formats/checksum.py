"""crc32c of buffers, and combining the crcs of consecutive pieces.

Pieces of one tensor are checksummed in parallel by worker threads; ``combine`` joins them into the
crc of the whole, so the manifest stores one crc32c per tensor, the plain crc of its bytes. Two
kinds are read: ``crc32c`` (what aiotensor records) and ``crc32`` (zlib's, which a zip records for
each entry: a torch.save file's storages).
"""

from __future__ import annotations

import zlib
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from functools import lru_cache
from itertools import accumulate, islice

import crc32c as _crc32c

_POLY = {"crc32c": 0x82F63B78, "crc32": 0xEDB88320}  # Castagnoli, and zlib's (IEEE), reflected


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """crc32c of a bytes-like object, continuing from ``value``; releases the GIL on large buffers."""
    return int(_crc32c.crc32c(data, value))


def of(kind: str, data: bytes | bytearray | memoryview) -> int:
    """The ``kind`` crc of a bytes-like object (both release the GIL on large buffers)."""
    return crc32c(data) if kind == "crc32c" else zlib.crc32(data)


def each(kind: str, views: Iterable[bytes | bytearray | memoryview], sizes: Sequence[int]) -> list[int]:
    """The ``kind`` crc of each buffer (``sizes``: their lengths), a slice of them per C loop of at
    most :data:`SLICE_BYTES` (but one buffer at least) and 1,024 buffers: a block's piece may hold
    30,000 tensors of 256 bytes, 10 ms of crcs with the GIL held in one loop; 1,024 of 16 KB (a
    buffer under 32 KiB is checked with the GIL held) held it 14-33 ms where the crcs faulted in
    mapped pages (helper-37)."""
    crcs = map(_crc32c.crc32c if kind == "crc32c" else zlib.crc32, views)
    total = [0, *accumulate(sizes)]
    out: list[int] = []
    i, n = 0, len(sizes)
    while i < n:
        j = max(i + 1, bisect_right(total, total[i] + SLICE_BYTES, i + 1, min(n, i + _MOST) + 1) - 1)
        out += islice(crcs, j - i)
        i = j
    return out


SLICE_BYTES = 1 << 20
_MOST = 1024


def _times(mat: tuple[int, ...], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(mat, mat[n]) for n in range(32))


@lru_cache(maxsize=128)
def _zeros_operator(poly: int, power: int) -> tuple[int, ...]:
    """Matrix that advances a crc over 2**power zero bytes (zlib's crc32_combine construction)."""
    if power == 0:
        # one zero bit, applied 8 times (3 squarings) = one zero byte
        odd = (poly, *(1 << n for n in range(31)))
        return _square(_square(_square(odd)))
    return _square(_zeros_operator(poly, power - 1))


def combine(crc1: int, crc2: int, len2: int, kind: str = "crc32c") -> int:
    """The crc of ``A + B`` from ``crc1`` (of ``A``), ``crc2`` (of ``B``) and ``len2 = len(B)``."""
    poly = _POLY[kind]
    power = 0
    while len2:
        if len2 & 1:
            crc1 = _times(_zeros_operator(poly, power), crc1)
        len2 >>= 1
        power += 1
    return crc1 ^ crc2
