"""What a path is and which tensors it holds: a safetensors file (any writer; aiotensor's are
checksummed), a torch.save zip (read without unrestricted pickle), a Hugging Face model folder, or
an aiotensor checkpoint (a step folder, or a store root: its newest step). Blocking: worker threads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from . import root as _root
from ._io.read import layout_of
from ._runtime.scheduler import MiB, Scheduler
from .errors import ManifestError
from .formats import safetensors as st
from .formats import torchsave as ts
from .formats.dtypes import TORCH_TO_SAFETENSORS, file_shape

INDEX = "model.safetensors.index.json"


SINGLE = "model.safetensors"


Keys = Iterable[str] | Callable[[str], bool] | None


@dataclass(frozen=True)
class Item:
    """One tensor to read: from ``path``, its spec, its crc32c (if recorded), and the names it goes
    by; ``view`` for a torch.save tensor that is not one contiguous run of its storage (``spec``
    then covers the whole storage, and the tensor is cut out of it)."""

    path: str
    spec: st.TensorSpec
    crc: int | None
    names: tuple[str, ...]
    view: ts.TensorRef | None = None


def selector(keys: Keys) -> Callable[[str], bool]:
    """``keys``: None (all), a predicate, or names and prefixes (a prefix ends with ``.``)."""
    if keys is None:
        return lambda name: True
    if callable(keys):
        return keys
    wanted = set(keys)
    prefixes = tuple(k for k in wanted if k.endswith("."))
    return lambda name: name in wanted or name.startswith(prefixes)


def items_of(sched: Scheduler, source: str, select: Callable[[str], bool]) -> list[Item]:
    """Every selected tensor of ``source`` in file order (blocking: runs in a worker thread)."""
    eng = sched.engine
    if os.path.isdir(source):
        if os.path.isfile(os.path.join(source, _root.MANIFEST)):
            return checkpoint_items(sched, source, select)
        if os.path.isfile(os.path.join(source, _root.LATEST)) or any(_root.parse_step(n) is not None for n in os.listdir(source)):
            return checkpoint_items(sched, newest_step(sched, source), select)
        files = hf_files(eng, source)
    else:
        files = [source]
    items: list[Item] = []
    for path in map(os.path.realpath, files):  # Hugging Face cache folders link their files to blobs
        if is_zip(eng, path):
            items += torch_items(path, ts.parse_path(path), select)
            continue
        fd = eng.open_read(path)
        try:
            layout = layout_of(sched, fd, path)
        finally:
            eng.close(fd)
        crcs = st.crc_table(layout, path)
        items += [Item(path, s, None if crcs is None else crcs[s.key], (s.key,)) for s in layout.tensors if select(s.key)]
    return items


def is_zip(engine: Any, path: str) -> bool:
    fd = engine.open_read(path)
    try:
        head = bytearray(4)
        return engine.pread(fd, memoryview(head), 0) == 4 and ts.is_torch_zip(bytes(head))
    finally:
        engine.close(fd)


def torch_items(path: str, tree: Any, select: Callable[[str], bool]) -> list[Item]:
    """Read plans for the selected tensors of a torch.save file, in file order."""
    items: list[Item] = []

    def add(name: str, ref: ts.TensorRef) -> None:
        if not select(name):
            return
        dtype = TORCH_TO_SAFETENSORS[ref.dtype]
        if ref.contiguous:
            spec = st.TensorSpec(name, dtype, file_shape(dtype, ref.size), ref.file_offset, ref.nbytes)
            items.append(Item(path, spec, None, (name,)))
        else:  # read the whole storage, then cut the view out of it
            n = ref.storage.nbytes // ref.dtype.itemsize
            spec = st.TensorSpec(name, dtype, file_shape(dtype, (n,)), ref.storage.offset, n * ref.dtype.itemsize)
            items.append(Item(path, spec, None, (name,), ref))

    ts.map_tensors(tree, add)
    return sorted(items, key=lambda i: i.spec.offset)


def newest_step(sched: Scheduler, root: str) -> str:
    listing = _root.scan(sched.engine, root, {})
    if not listing.committed:
        raise FileNotFoundError(f"{root}: no committed checkpoint")
    return os.path.join(root, listing.committed[max(listing.committed)])


def checkpoint_items(sched: Scheduler, folder: str, select: Callable[[str], bool]) -> list[Item]:
    m = _root.read_manifest(sched.engine, folder)
    names: dict[str, list[str]] = {k: [k] for k in m.entries}
    for alias, target in m.aliases.items():
        names[target].append(alias)
    items = []
    for key, e in sorted(m.entries.items(), key=lambda kv: (kv[1].shard, kv[1].spec.offset)):
        chosen = tuple(n for n in names[key] if select(n))
        if chosen:
            items.append(Item(os.path.join(folder, e.shard), e.spec, e.crc32c, chosen))
    return items


def hf_files(engine: Any, folder: str) -> list[str]:
    """The safetensors files of a Hugging Face model folder, in index order."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        raw = _root.read_small(engine, index, 64 * MiB, ManifestError, "the index")
        doc = st.loads_json_object(raw, index, "index", ManifestError)
        weight_map = doc.get("weight_map")
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise ManifestError("weight_map must map tensor names to file names", index)
        files = list(dict.fromkeys(weight_map.values()))
        for f in files:
            if os.path.basename(f) != f or f in ("", ".", "..") or f.startswith("."):
                raise ManifestError(f"shard {f!r} is not a plain file name inside the folder", index)
        return [os.path.join(folder, f) for f in files]
    for single in (SINGLE, "pytorch_model.bin"):
        if os.path.isfile(os.path.join(folder, single)):
            return [os.path.join(folder, single)]
    found = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"{folder}: no {SINGLE}, {INDEX} or other safetensors file")
    return [os.path.join(folder, n) for n in found]


def slice_rows(item: Item, rows: tuple[int, int]) -> Item:
    """Only rows ``[a, b)`` of a tensor (dim 0): a shorter read at a later offset, unverified."""
    a, b = rows
    spec = item.spec
    if item.view is not None or not spec.shape or not 0 <= a <= b <= spec.shape[0]:
        raise ValueError(f"rows {rows} of {spec.key!r} (shape {list(spec.shape)}): need 0 <= a <= b <= {spec.shape[:1]}")
    row = spec.nbytes // spec.shape[0] if spec.shape[0] else 0
    sliced = st.TensorSpec(spec.key, spec.dtype, (b - a, *spec.shape[1:]), spec.offset + a * row, (b - a) * row)
    return Item(item.path, sliced, None, item.names[:1])
