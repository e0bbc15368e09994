"""The metadata of a torch.distributed.checkpoint (DCP) checkpoint, read into one small description:
aiotensor's ``.metadata.json`` (sealed JSON, read without importing torch.distributed) and DCP's own
``.metadata`` (a pickle, unpickled by an allow-list of DCP's metadata classes only). Pure: bytes
in, records out; :func:`check` validates a description against the sizes of its files before
anything is allocated from it.
"""

from __future__ import annotations

import enum
import io
import math
import pickle
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ManifestError, UnsafeFileError
from . import manifest as mf
from .pickled import brief, check_hashing, checked, hash_budget
from .safetensors import is_count, loads_json_object

FORMAT = "aiotensor.dcp"
JSON_NAME = ".metadata.json"  # aiotensor's DCP writer
PICKLE_NAME = ".metadata"  # DCP's own FileSystemWriter
MAX_BYTES = mf.MAX_MANIFEST_BYTES
MAX_PLACE = 64  # components of an item's place in the state (formats.tree's nesting cap)


@dataclass(frozen=True)
class Stored:
    """Where one item lies in the folder: in ``file``, under ``key`` (a tensor of an aiotensor rank
    file, a safetensors file) or at ``offset`` for ``length`` bytes (DCP's own files: a torch.save
    of the chunk, or a value's pickled bytes)."""

    file: str
    key: str | None = None
    offset: int | None = None
    length: int | None = None


@dataclass(frozen=True)
class Chunk:
    """A piece of a tensor: at ``offsets`` in it, of ``sizes``, stored at ``stored``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    stored: Stored


@dataclass(frozen=True)
class Tensor:
    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    requires_grad: bool = False


@dataclass(frozen=True)
class Description:
    """A DCP checkpoint: its tensors (in chunks), its non-tensor values (pickled bytes), and the
    place of each in the state (``("optim", "param_groups", 0, "lr")``)."""

    tensors: dict[str, Tensor]
    values: dict[str, Stored]
    places: dict[str, tuple[str | int, ...]]

    def files(self) -> set[str]:
        return {c.stored.file for t in self.tensors.values() for c in t.chunks} | {v.file for v in self.values.values()}


def _dtype(name: object, path: object) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise ManifestError(f"unknown dtype {brief(name)}", path)
    return dt


def _str(x: Any) -> str:
    if not isinstance(x, str):
        raise TypeError(f"a name must be a string, got {type(x).__name__}")
    return x


def _count(x: Any) -> int:
    if not is_count(x):
        raise TypeError(f"an offset or length must be a non-negative integer, got {str(x)[:40]!r}")
    return int(x)


def _ints(x: Any) -> tuple[int, ...]:
    if not (isinstance(x, (list, tuple)) and all(is_count(v) for v in x)):
        raise TypeError("sizes and offsets are lists of non-negative integers")
    return tuple(int(v) for v in x)


def _place(x: Any) -> list[Any]:
    if not isinstance(x, (list, tuple)):
        raise TypeError("a place in the state is a list of names")
    return list(x)


def loads_json(data: bytes, path: object) -> Description:
    """aiotensor's ``.metadata.json`` (see :func:`aiotensor.dcp.dumps_metadata`).

    Raises:
        ManifestError: a broken seal, not aiotensor's format, or malformed.
    """
    mf.check_seal(data, path)
    doc = loads_json_object(data, path, "DCP metadata", ManifestError)
    if doc.get("format") != FORMAT:
        raise ManifestError(f"not aiotensor DCP metadata (format {doc.get('format')!r})", path)
    try:
        where: dict[tuple[str, tuple[int, ...] | None], Stored] = {}
        for s in doc["storage_data"]:
            index = s["index"]
            offset = None if index["offset"] is None else _ints(index["offset"])
            where[(_str(index["fqn"]), offset)] = Stored(_str(s["file"]), key=_str(s["key"]))
        tensors: dict[str, Tensor] = {}
        values: dict[str, Stored] = {}
        for fqn, e in doc["state_dict_metadata"].items():
            if not isinstance(e, dict):
                raise TypeError(f"item {fqn!r} is not an object")
            if e["type"] == "bytes":
                values[fqn] = where[(fqn, None)]
                continue
            chunks = tuple(Chunk(_ints(c["offsets"]), _ints(c["sizes"]), where[(fqn, _ints(c["offsets"]))]) for c in e["chunks"])
            tensors[fqn] = Tensor(_dtype(e["dtype"], path), _ints(e["size"]), chunks, bool(e["requires_grad"]))
        places = {str(k): tuple(_place(v)) for k, v in doc["planner_data"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ManifestError(f"malformed DCP metadata ({type(e).__name__}: {str(e)[:200]})", path) from None
    return Description(tensors, values, places)


_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
              "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
     ("pathlib", "PosixPath"), ("collections", "OrderedDict")}  # fmt: skip


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: object) -> None:
        super().__init__(io.BytesIO(data))
        self.path = path
        self._odict = checked(OrderedDict, [hash_budget(len(data))])

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return self._odict
        if (module, name) in _DCP_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if name == "getattr" and module in ("builtins", "__builtin__"):
            return self._member
        raise UnsafeFileError(f"refusing the global {module}.{name} in DCP metadata (nothing was run)", self.path)

    def _member(self, cls: Any, name: Any) -> Any:
        """``getattr(cls, name)``, as some Python 3.11 releases (3.11.2: Debian 12's) pickle an Enum
        member (DCP's ``_MEM_FORMAT_ENCODING``): only a member of an Enum the allow-list admitted."""
        if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
            return cls[name]
        what = getattr(cls, "__name__", type(cls).__name__)
        raise UnsafeFileError(f"refusing getattr({what}, {brief(name)}) in DCP metadata (only an Enum's member)", self.path)


def loads_pickle(data: bytes, path: object) -> tuple[Any, Description]:
    """DCP's own ``.metadata``: DCP's ``Metadata`` (imports torch.distributed.checkpoint) and its
    description.

    Raises:
        UnsafeFileError: a global outside DCP's metadata classes (nothing was run), or an item
            stored with transforms (compression), which aiotensor does not read.
        ManifestError: malformed.
    """
    from torch.distributed.checkpoint import metadata as md

    try:
        check_hashing(data, path, "the DCP metadata")
        m = _Unpickler(data, path).load()
    except UnsafeFileError:
        raise
    except Exception as e:
        raise ManifestError(f"malformed DCP metadata ({type(e).__name__}: {str(e)[:200]})", path) from None
    if not (
        isinstance(m, md.Metadata)
        and isinstance(getattr(m, "storage_data", None), dict)
        and isinstance(getattr(m, "state_dict_metadata", None), dict)
    ):
        raise ManifestError("the metadata is not a DCP Metadata", path)
    try:
        where: dict[tuple[str, tuple[int, ...] | None], Stored] = {}
        for index, info in m.storage_data.items():
            if getattr(info, "transform_descriptors", None):
                raise UnsafeFileError(
                    f"item {index.fqn!r} is stored with transforms (compression), which aiotensor does not read", path
                )
            offset = None if index.offset is None else _ints(index.offset)
            where[(_str(index.fqn), offset)] = Stored(
                _str(info.relative_path), offset=_count(info.offset), length=_count(info.length)
            )
        tensors: dict[str, Tensor] = {}
        values: dict[str, Stored] = {}
        for fqn, item in m.state_dict_metadata.items():
            if isinstance(item, md.BytesStorageMetadata):
                values[fqn] = where[(fqn, None)]
                continue
            chunks = tuple(Chunk(_ints(c.offsets), _ints(c.sizes), where[(fqn, _ints(c.offsets))]) for c in item.chunks)
            tensors[fqn] = Tensor(_dtype(str(item.properties.dtype).removeprefix("torch."), path), _ints(item.size), chunks)
        places = {str(k): tuple(_place(v)) for k, v in (m.planner_data or {}).items()}
    except UnsafeFileError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ManifestError(f"malformed DCP metadata ({type(e).__name__}: {str(e)[:200]})", path) from None
    return m, Description(tensors, values, places)


def check(d: Description, size_of: Callable[[str], int], path: object) -> None:
    """Before anything is allocated from ``d``: every item lies in a plain file of the folder
    (``size_of(name)`` gives its size, and refuses a link or anything but a regular file) and,
    where it has an offset, inside it; every tensor has a chunk or more, each inside it; no more
    tensor bytes declared than the files hold; every place in the state a short path of names.

    Raises:
        ManifestError: naming the metadata file and the item.
        FileNotFoundError: a data file it names is not there (naming it).
    """
    sizes: dict[str, int] = {}

    def inside(fqn: str, s: Stored) -> None:
        if not mf.safe_shard_name(s.file):
            raise ManifestError(f"item {fqn!r}: data file {str(s.file)[:100]!r} is not a plain file name in the folder", path)
        if s.file not in sizes:
            try:
                sizes[s.file] = size_of(s.file)
            except FileNotFoundError as e:  # as a manifest's missing shard: a store tells a retired step from a damaged one
                raise FileNotFoundError(e.errno, f"{path}: item {fqn!r}: its data file {s.file!r} is missing", s.file) from None
        if s.offset is not None or s.length is not None:
            if not (is_count(s.offset) and is_count(s.length)) or s.offset + s.length > sizes[s.file]:  # type: ignore[operator]
                raise ManifestError(
                    f"item {fqn!r}: bytes at {s.offset!r}, {s.length!r} long, are not inside {s.file} ({sizes[s.file]} bytes)",
                    path,
                )

    declared = 0
    for fqn, t in d.tensors.items():
        if not t.chunks:  # DCP writes a chunk even for a tensor of no elements
            raise ManifestError(f"item {fqn!r}: a tensor with no chunks", path)
        for c in t.chunks:
            inside(fqn, c.stored)
            if (
                len(c.offsets) != len(t.size)
                or len(c.sizes) != len(t.size)
                or any(o + n > s for o, n, s in zip(c.offsets, c.sizes, t.size, strict=True))
            ):
                raise ManifestError(
                    f"item {fqn!r}: a chunk at {list(c.offsets)} of {list(c.sizes)} lies outside {list(t.size)}", path
                )
        declared += math.prod(t.size) * t.dtype.itemsize
    for fqn, s in d.values.items():
        inside(fqn, s)
    if declared > sum(sizes.values()):
        raise ManifestError(f"declares {declared} bytes of tensors, but its data files hold {sum(sizes.values())}", path)
    for fqn, place in d.places.items():  # a list index past the number of items would allocate for nothing
        if not (0 < len(place) <= MAX_PLACE and all(isinstance(p, str) or (is_count(p) and p <= len(d.places)) for p in place)):
            raise ManifestError(f"the place of {fqn[:100]!r} in the state is not a short path of names", path)


__all__ = [
    "FORMAT",
    "JSON_NAME",
    "PICKLE_NAME",
    "Chunk",
    "Description",
    "Stored",
    "Tensor",
    "check",
    "loads_json",
    "loads_pickle",
]
