"""The checkpoint manifest (``manifest.json``): build it and validate one read from disk.

The manifest is plain JSON whose last member is its own checksum, ``"checksum":"crc32c:XXXXXXXX"``:
the crc32c of the file's bytes with those eight hex digits written as zeros. Tensor bytes carry
their own crc32c in the manifest; the manifest's checksum covers everything else (keys, the state
tree, Python values such as the step or a learning rate), which a flipped bit would otherwise
change silently.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice, repeat
from operator import add, attrgetter, le, mul
from typing import Any, NamedTuple

import numpy as np

from .._runtime import gil
from .._runtime.native import native
from ..errors import ManifestError, StateError
from . import checksum
from .dtypes import ITEMSIZE, PACKED, nbytes_of
from .safetensors import (
    MAX_DIMS,
    NESTED,
    TensorSpec,
    check_written,
    columns,
    counts,
    first_leaf,
    is_count,
    parse_members,
    plain_nbytes,
    plain_sizes,
    rows,
    shape_problem,
    utf8,
)
from .tree import unflatten

FORMAT = "aiotensor.checkpoint"
# 2: shards record their header's crc32c (header_crc32c), which 1 does not know; 3: the tensors
# are a table of columns (``table``), not an object of objects (``tensors``): for 20,000 tensors
# half the text, read in 0.69 of the time (57 against 84 ms), written in half (bench_manifest.py)
VERSION = 3
VERSIONS = (1, 2, 3)  # what this aiotensor reads
_READS = "1, 2 and 3"
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
_SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,200}")
_CHECKSUM_TAIL = re.compile(rb',"checksum":"crc32c:([0-9a-f]{8})"\}\Z')
_ZEROS = b"00000000"
_TAIL_BYTES = len(',"checksum":"crc32c:00000000"}')


class Entry(NamedTuple):
    """One stored tensor: its shard file, where its bytes are, and their crc32c."""

    shard: str
    spec: TensorSpec
    crc32c: int


@dataclass(frozen=True)
class Manifest:
    step: int
    tree: Any
    shards: Mapping[str, int]  # file name -> size in bytes
    entries: Mapping[str, Entry]
    aliases: Mapping[str, str]  # key -> key of the stored tensor it shares memory with
    # incremental saves: file -> blake3 of its bytes (shards that may be unchanged next time), and
    # file -> the earlier step whose shard it is the same file as (a hard link, or a server-side copy)
    digests: Mapping[str, str] = field(default_factory=dict)
    reused: Mapping[str, int] = field(default_factory=dict)
    # file -> crc32c of its safetensors header (8-byte length, JSON, padding): a load that finds it
    # equal needs neither to parse the header nor to rebuild it from the entries to compare
    headers: Mapping[str, int] = field(default_factory=dict)
    # the bytes of the JSON it was read from (0: made, not read): what freeing it costs, tree and all
    nbytes: int = field(default=0, compare=False, repr=False)
    # what told the file it was read from from another (Engine.identity; None: made, not read): a
    # reader checks that the step is still this one as it checks each shard (read.check_shard)
    identity: Any = field(default=None, compare=False, repr=False)


@gil.quiet_gc
def dumps(m: Manifest) -> bytes:
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "step": m.step,
        "shards": [_shard_doc(m, f, n) for f, n in m.shards.items()],
        "table": _table_doc(m),
        "aliases": dict(m.aliases),
        "tree": m.tree,
    }
    return checked(seal(doc), "manifest")


def checked(raw: bytes, what: str) -> bytes:
    """``raw``, a sealed document (``what``: a manifest, DCP metadata) about to be committed, if
    its readers take it (:func:`~aiotensor.formats.safetensors.check_written`), else StateError."""
    check_written(raw, what, MAX_MANIFEST_BYTES)
    return raw


# version 3's table, as dumps writes it: the keys a JSON list, each other column one string of
# numbers (or dtype names) with a space between rows; a tensor's dims are ``ndim[i]`` of ``dims``
_COLUMNS = ("keys", "shard", "dtype", "ndim", "dims", "offset", "crc32c")


def _table_doc(m: Manifest) -> dict[str, Any]:
    """The tensor table of version 3 (:data:`_COLUMNS`): row ``i`` is the tensor ``keys[i]``,
    ``shard`` indexes ``shards``, a tensor's bytes are its dtype's times its shape's (made column by
    column, in C loops). One JSON value per column: a list of numbers per column was denser than
    the density rule allows (``tests/test_hostile.py``), a string is one value, and splits and
    converts in C."""
    index = {f: i for i, f in enumerate(m.shards)}
    entries = list(m.entries.values())
    specs = list(map(_SPEC, entries))
    shapes = list(map(_SHAPE, specs))
    numbers = (
        map(index.__getitem__, map(_SHARD, entries)),
        map(_DTYPE, specs),
        map(len, shapes),
        chain.from_iterable(shapes),
        map(_OFFSET, specs),
        map(_CRC, entries),
    )
    return {"keys": list(m.entries)} | {c: " ".join(gil.listed(map(str, n))) for c, n in zip(_COLUMNS[1:], numbers, strict=True)}


_SHARD, _SPEC, _CRC = attrgetter("shard"), attrgetter("spec"), attrgetter("crc32c")
_DTYPE, _SHAPE, _OFFSET = attrgetter("dtype"), attrgetter("shape"), attrgetter("offset")


def _shard_doc(m: Manifest, file: str, size: int) -> dict[str, Any]:
    doc: dict[str, Any] = {"file": file, "size": size}
    if file in m.digests:
        doc["blake3"] = m.digests[file]
    if file in m.reused:
        doc["reused_from"] = m.reused[file]
    if file in m.headers:
        doc["header_crc32c"] = m.headers[file]
    return doc


@gil.quiet_gc
def seal(doc: dict[str, Any]) -> bytes:
    """Serialize a manifest document and append its checksum (what a writer writes is checked
    against what its readers take by :func:`checked`).

    Raises:
        StateError: an int too long for Python's text."""
    doc = {k: v for k, v in doc.items() if k != "checksum"} | {"checksum": "crc32c:" + _ZEROS.decode()}
    try:
        text = gil.dumps(doc)
    except ValueError as e:  # an int of more digits than Python converts (sys.get_int_max_str_digits())
        if "integer string conversion" not in str(e):
            raise
        found = first_leaf(doc, _too_long)
        where = "" if found is None else f" ({'a key' if found[2] else 'a value'} under the key {found[0]!r})"
        raise StateError(
            f"an int of the state has more than {sys.get_int_max_str_digits()} digits{where}, more than Python "
            "writes as text: store it as a str or a tensor (or raise sys.set_int_max_str_digits in every process "
            "that saves or loads it)"
        ) from None
    raw = utf8(text, doc=doc)
    digits = len(raw) - len(_ZEROS) - 2  # the digits sit right before the closing '"}'
    view = memoryview(raw)  # one copy of a manifest of megabytes, not three
    return b"".join((view[:digits], b"%08x" % checksum.crc32c(raw), view[digits + len(_ZEROS) :]))


def check_seal(data: bytes, path: object) -> None:
    m = _CHECKSUM_TAIL.search(data, max(0, len(data) - _TAIL_BYTES))  # from the end: not a scan of the whole file
    if m is None:
        raise ManifestError(
            "the manifest does not end with its checksum (truncated, not written by aiotensor, or by aiotensor's first "
            "commits of 2026-11-22, before f27d1a0, whose version 1 manifests carried none: not read)",
            path,
        )
    recorded = int(m.group(1), 16)
    view = memoryview(data)  # the crc of the bytes with the digits as zeros, in three pieces: no copy
    got = checksum.crc32c(view[m.end(1) :], checksum.crc32c(_ZEROS, checksum.crc32c(view[: m.start(1)])))
    if got != recorded:
        raise ManifestError(f"the manifest is corrupt: its crc32c is {got:#010x}, it records {recorded:#010x}", path)


def _too_long(x: Any) -> bool:
    """An int Python will not write as text (more digits than ``sys.get_int_max_str_digits()``)."""
    if type(x) is not int or x.bit_length() < 3 * sys.get_int_max_str_digits():  # (fewer digits, surely: no str made)
        return False
    try:
        str(x)
    except ValueError:
        return True
    return False


_HEAD = re.compile(rb'\{"format":"aiotensor\.checkpoint","version":([0-9]{1,9}),"step":([0-9]{1,15}),')


def sealed_step(data: bytes, path: object) -> int:
    """The step a manifest names, from its seal and its first bytes (as :func:`dumps` writes them),
    without parsing it: what listing a root needs, in memory the size of the file.

    Raises:
        ManifestError: a broken seal, or not the start of an aiotensor manifest of this version.
    """
    check_seal(data, path)
    m = _HEAD.match(data)
    if m is None:
        raise ManifestError("not an aiotensor manifest (it does not begin as one)", path)
    if int(m.group(1)) not in VERSIONS:
        raise ManifestError(f"manifest version {int(m.group(1))} is not supported (this aiotensor reads {_READS})", path)
    return int(m.group(2))


def safe_shard_name(name: object) -> bool:
    """A plain file name: no separators, no ``..``, not absolute, not hidden."""
    return isinstance(name, str) and _SHARD_NAME.fullmatch(name) is not None and ".." not in name


_SHARD_FIELDS = frozenset({"file", "size", "blake3", "reused_from", "header_crc32c"})
_DIGEST = re.compile(r"[0-9a-f]{64}")


@gil.quiet_gc
def _shards(
    raw: Any, bad: Callable[[str], ManifestError], digests: dict[str, str], reused: dict[str, int], headers: dict[str, int]
) -> dict[str, int]:
    if not isinstance(raw, list):
        raise bad("shards must be a list")
    shards: dict[str, int] = {}
    for s in raw:
        if not (isinstance(s, dict) and {"file", "size"} <= s.keys() <= _SHARD_FIELDS and is_count(s["size"])):
            raise bad(f"shard entry {str(s)[:100]!r} must be {{file, size}} (and blake3, reused_from, header_crc32c)")
        if not safe_shard_name(s["file"]):
            raise bad(f"shard file {str(s['file'])[:80]!r} is not a plain file name inside the checkpoint folder")
        if "blake3" in s:
            if not (isinstance(s["blake3"], str) and _DIGEST.fullmatch(s["blake3"])):
                raise bad(f"shard {str(s['file'])[:80]!r}: blake3 must be 64 hex digits")
            digests[s["file"]] = s["blake3"]
        if "reused_from" in s:
            if not is_count(s["reused_from"]):
                raise bad(f"shard {str(s['file'])[:80]!r}: reused_from must be a step number")
            reused[s["file"]] = s["reused_from"]
        if "header_crc32c" in s:
            if not (is_count(s["header_crc32c"]) and s["header_crc32c"] < 2**32):
                raise bad(f"shard {str(s['file'])[:80]!r}: header_crc32c must be a crc32c")
            headers[s["file"]] = s["header_crc32c"]
        if s["file"] in shards:
            raise bad(f"shard file {s['file']!r} listed twice")
        shards[s["file"]] = s["size"]
    return shards


_ORDER = ("shard", "dtype", "shape", "offset", "nbytes", "crc32c")  # as dumps writes them
_FIELDS = frozenset(_ORDER)


def _entry(key: str, t: Any, shards: Mapping[str, int], bad: Callable[[str], ManifestError]) -> Entry:
    if type(t) is dict and t.keys() == _FIELDS:  # every real entry, in few C calls
        shard, offset, nbytes, crc = t["shard"], t["offset"], t["nbytes"], t["crc32c"]
        ints = type(offset) is int and type(nbytes) is int and type(crc) is int  # bool is no count
        if type(shard) is str and ints and 0 <= crc < 2**32 and offset >= 0:
            n = plain_nbytes(t["dtype"], t["shape"])
            if n and n == nbytes and offset + n <= shards.get(shard, -1):
                return Entry(shard, TensorSpec(key, t["dtype"], tuple(t["shape"]), offset, n), crc)
    if not (type(t) is dict and t.keys() == _FIELDS):
        raise bad(f"tensor {key!r}: entry must have exactly {sorted(_FIELDS)}")
    if not (isinstance(t["shard"], str) and t["shard"] in shards):
        raise bad(f"tensor {key!r}: shard {t['shard']!r} is not listed in shards")
    if not (isinstance(t["dtype"], str) and t["dtype"] in ITEMSIZE):
        raise bad(f"tensor {key!r}: unknown dtype {t['dtype']!r}")
    shape = t["shape"]
    problem = shape_problem(shape, t["dtype"])
    if problem:
        raise bad(f"tensor {key!r}: {problem}")
    if not (is_count(t["offset"]) and is_count(t["nbytes"]) and is_count(t["crc32c"]) and t["crc32c"] < 2**32):
        raise bad(f"tensor {key!r}: offset, nbytes and crc32c must be non-negative integers")
    if nbytes_of(t["dtype"], shape) != t["nbytes"]:
        raise bad(f"tensor {key!r}: shape {shape} of {t['dtype']} is not {t['nbytes']} bytes")
    if t["offset"] + t["nbytes"] > shards[t["shard"]]:
        raise bad(f"tensor {key!r}: bytes [{t['offset']}, {t['offset'] + t['nbytes']}) lie past the end of {t['shard']}")
    return Entry(t["shard"], TensorSpec(key, t["dtype"], tuple(shape), t["offset"], t["nbytes"]), t["crc32c"])


@gil.quiet_gc
def _table(raw: Any, shards: Mapping[str, int], bad: Callable[[str], ManifestError]) -> dict[str, Entry]:
    """Version 3's tensor table (:func:`_table_doc`), checked column by column in C loops, cheapest
    first: the keys and each column's count before a number is made, the keys and shards before
    the dims (a hostile table's bulk). A row whose bytes are not its dtype's size times its dims
    (a packed dtype, a zero-size tensor, something wrong) is checked alone (:func:`_entry`, which
    names the tensor and what is wrong), and so is every row where a later check fails."""
    if not (type(raw) is dict and raw.keys() == set(_COLUMNS) and type(raw["keys"]) is list):
        raise bad(f"table must be an object of {', '.join(_COLUMNS)}")
    keys = raw["keys"]
    got = _native_table(keys, raw, shards) if native is not None and keys else None
    if got is not None:
        return got
    if not _STR.issuperset(map(type, keys)):
        raise bad(f"table: tensor key {next(k for k in keys if type(k) is not str)!r} is not a string")
    if not _unique(keys):
        seen: set[str] = set()
        raise bad(f"tensor {next(k for k in keys if k in seen or seen.add(k))!r} is listed twice")  # type: ignore[func-returns-value]
    files = list(shards)
    texts: list[str] = []
    for c in _COLUMNS[1:]:
        if type(raw[c]) is not str:
            raise bad(f"table: {c} must be a string")
        texts.append(raw[c])
    dtype = texts[1].split(" ") if texts[1] else []
    if len(dtype) != len(keys):  # (the numbers' columns counted as they are read)
        raise bad(f"table: dtype has {len(dtype)} values for {len(keys)} ({len(keys)} tensors)")
    n = len(keys)
    shard, ndim = _column(texts[0], "shard", n, n, bad), _column(texts[2], "ndim", n, n, bad)
    if shard and max(shard) >= len(files):
        i = _first(shard, len(files) - 1)
        raise bad(f"tensor {keys[i]!r}: shard {shard[i]} is not the index of one of the {len(files)} shards")
    if max(ndim, default=0) > MAX_DIMS:
        raise bad(f"tensor {keys[_first(ndim, MAX_DIMS)]!r}: shape must have at most {MAX_DIMS} dimensions")
    dims = _column(texts[3], "dims", sum(ndim), n, bad)
    offset, crc = _column(texts[4], "offset", n, n, bad), _column(texts[5], "crc32c", n, n, bad)
    if max(crc, default=0) >= 2**32:
        raise bad(f"tensor {keys[_first(crc, 2**32 - 1)]!r}: crc32c must be below 2**32")
    # column by column, a slice at a time (gil.listed: one C loop over 200,000 rows held the GIL 40 ms)
    names = gil.listed(map(files.__getitem__, shard))
    shape = gil.listed(map(list, map(islice, repeat(iter(dims)), ndim)))  # each tensor's ndim dims, in turn
    # dtype's size times the dims' product: 0 for a packed or unknown dtype or a zero-size tensor
    nbytes = gil.listed(map(mul, map(_PLAIN.get, dtype, repeat(0)), map(math.prod, shape)))
    rest = () if min(nbytes, default=1) > 0 and max(nbytes, default=0) < 2**63 else range(len(keys))
    odd = {i: _row(keys, names, dtype, shape, offset, crc, i, shards, bad) for i in rest if not 0 < nbytes[i] < 2**63}
    for i, e in odd.items():
        nbytes[i] = e.spec.nbytes
    if not all(gil.listed(map(le, map(add, offset, nbytes), map(shards.__getitem__, names)))):
        return {k: _row(keys, names, dtype, shape, offset, crc, i, shards, bad) for i, k in enumerate(keys)}
    specs = rows(TensorSpec, keys, dtype, map(tuple, shape), offset, nbytes)
    entries = rows(Entry, names, specs, crc)
    for i, e in odd.items():
        entries[i] = e
    return gil.filled({}, zip(keys, entries, strict=True))


def _native_table(keys: list[Any], raw: dict[str, Any], shards: Mapping[str, int]) -> dict[str, Entry] | None:
    """:func:`_table`'s entries, made by :mod:`aiotensor._native` (``table_rows``) a slice of
    :data:`_TABLE_ROWS` rows at a time, where the table is as :func:`_table_doc` writes it; else
    None (then :func:`_table` reads it and names what is wrong)."""
    texts = tuple(raw[c] for c in _COLUMNS[1:])
    if not _STR.issuperset(map(type, texts)):
        return None
    files, sizes = list(shards), list(shards.values())
    out: dict[str, Entry] = {}
    pos: tuple[int, ...] | None = (0,) * len(texts)
    for row in range(0, len(keys), _TABLE_ROWS):
        pos = native.table_rows(out, keys, texts, pos, row, _TABLE_ROWS, files, sizes, _PLAIN, MAX_DIMS, TensorSpec, Entry)
        if pos is None:
            return None
    return out if pos == tuple(map(len, texts)) else None  # every column read to its end


def _first(column: list[int], most: int) -> int:
    """The first row whose value in ``column`` is above ``most`` (for a message)."""
    return next(i for i, x in enumerate(column) if x > most)


def _row(
    keys: list[str],
    names: list[str],
    dtype: list[str],
    shape: list[list[int]],
    offset: list[int],
    crc: list[int],
    i: int,
    shards: Mapping[str, int],
    bad: Callable[[str], ManifestError],
) -> Entry:
    """Row ``i`` of a version 3 table checked alone, as :func:`_entry` checks version 2's (its
    ``nbytes`` what its dtype and shape make, where they are valid)."""
    d, s = dtype[i], shape[i]
    n = nbytes_of(d, s) if d in ITEMSIZE and not shape_problem(s, d) else 0
    return _entry(keys[i], dict(zip(_ORDER, (names[i], d, s, offset[i], n, crc[i]), strict=True)), shards, bad)


def _column(text: str, name: str, want: int, tensors: int, bad: Callable[[str], ManifestError]) -> list[int]:
    """The ``want`` numbers of a table's column ``name`` (:func:`_numbers`), counted before any is made."""
    got = text.count(" ") + 1 if text else 0
    if got != want:
        raise bad(f"table: {name} has {got} values for {want} ({tensors} tensors)")
    numbers = _numbers(text)
    if numbers is None or len(numbers) != want:  # (a count of spaces is not a count of numbers)
        raise bad(f"table: {name} must be non-negative integers in plain decimal, one space between each two")
    return numbers


def _unique(keys: list[str]) -> bool:
    """No key twice (a set made a slice at a time: one of 200,000 keys held the GIL 18 ms)."""
    seen: set[str] = set()
    for some in gil.slices(keys, _SLICE):
        seen.update(some)
    return len(seen) == len(keys)


def _numbers(text: str) -> list[int] | None:
    """The numbers of ``text`` if it is ASCII decimal numbers of at most 19 digits with no leading
    zeros, one space between each two (or empty); else None. Checked and read a slice of about
    :data:`_NUMBERS_CHARS` at a time (cut at a space) by C calls whose memory does not grow with
    the count (regular expressions of the same took 200 bytes a number for backtracking, and 5
    times as long), the numbers read by numpy (no string per number: 0.5 ms for 20,000, where
    ``map(int, text.split())`` took 2 and 60 bytes a number)."""
    out: list[int] = []
    at = 0
    if text[-1:] == " ":  # (a slice's end at the last space would leave it unseen: helper-63)
        return None
    while at < len(text):
        end = text.find(" ", at + _NUMBERS_CHARS)
        end = len(text) if end < 0 else end
        part = text[at:end]
        shape = part.translate(_ONES)  # every digit but 0 a 1: a leading zero is "00" or "01" after a space
        if not (
            part.isascii()
            and part.replace(" ", "").isdigit()
            and "  " not in part
            and part[0] != " "
            and part[-1] != " "
            and " 00" not in shape
            and " 01" not in shape
            and shape[:2] not in ("00", "01")
            and _LONG not in shape.replace("0", "1")
        ):
            return None
        out += np.fromstring(part, dtype=np.uint64, sep=" ").tolist()  # 19 digits fit
        at = end + 1
    return out


_SLICE = 16384
_TABLE_ROWS = 4096  # rows of a table per native call: ~0.6 ms with the GIL held
_NUMBERS_CHARS = 256 * 1024
_PLAIN = {d: n for d, n in ITEMSIZE.items() if d not in PACKED}  # the item sizes of dtypes not packed
_LONG = "1" * 20  # a number of 20 digits
_ONES = str.maketrans("23456789", "11111111")
_STR = frozenset({str})


@gil.quiet_gc  # tens of thousands of entries: no collection walks them meanwhile
def loads(data: bytes, path: object) -> Manifest:
    """Validate a manifest completely before anything is allocated from it.

    Raises:
        ManifestError: naming the file and what is wrong.
    """

    def bad(msg: str) -> ManifestError:
        return ManifestError(msg, path)

    check_seal(data, path)
    doc: dict[str, Any] = {}
    shards: dict[str, int] = {}
    entries: dict[str, Entry] = {}
    digests: dict[str, str] = {}
    reused: dict[str, int] = {}
    headers: dict[str, int] = {}

    def member(key: str, value: Any) -> None:
        if key in ("tensors", "aliases") and value is not NESTED:
            raise bad(f"{key} must be an object")
        if key == "tensors":  # its members follow (an empty object too lists the tensors)
            listed("tensors")
            value = None
        if key == "shards":
            shards.update(_shards(value, bad, digests, reused, headers))
        if key == "table":  # version 3
            listed("table")
            entries.update(_table(value, shards, bad))
            value = None  # (the lists: freed now)
        doc[key] = value

    def listed(how: str) -> None:
        if "shards" not in doc:
            raise bad("the manifest lists its tensors before its shards")
        if ("tensors" if how == "table" else "table") in doc:
            raise bad("the manifest lists its tensors twice (tensors and table)")

    def tensor(key: str, t: Any) -> None:  # each entry checked as it is parsed: a bad one stops the parse
        entries[key] = _entry(key, t, shards, bad)

    def many(keys: Sequence[str], objects: Sequence[Any]) -> bool:  # the same, many entries at once
        cols = columns(objects, _ORDER) if "shards" in doc and "table" not in doc else None
        if cols is None:  # (each member's own call says what is wrong)
            return False
        shard, dtype, shape, offset, nbytes, crc = cols
        sizes = plain_sizes(dtype, shape)
        if sizes is None or not counts(offset, nbytes, crc) or sizes != nbytes or max(crc) >= 2**32:
            return False
        if not (set(map(type, shard)) == {str} and shards.keys() >= set(shard)):
            return False
        if not all(map(int.__le__, map(int.__add__, offset, nbytes), map(shards.__getitem__, shard))):
            return False
        specs = rows(TensorSpec, keys, dtype, map(tuple, shape), offset, nbytes)
        gil.filled(entries, zip(keys, rows(Entry, shard, specs, crc), strict=True))
        return True

    aliases: dict[str, str] = {}

    def alias(key: str, target: Any) -> None:
        if not (isinstance(target, str) and target in entries) or key in entries:
            raise bad(f"aliases must map keys to stored tensor keys: {key!r} names {str(target)[:80]!r}")
        aliases[key] = target

    nested = {"tensors": tensor, "aliases": alias}
    parse_members(data, path, "manifest", ManifestError, member, nested, {"tensors": many})
    doc["aliases"] = aliases
    doc.pop("checksum", None)
    if doc.get("format") != FORMAT:
        raise bad(f"not an aiotensor manifest (format is {doc.get('format')!r}, expected {FORMAT!r})")
    version = doc.get("version")
    if not (type(version) is int and version in VERSIONS):
        raise bad(f"manifest version {version!r} is not supported (this aiotensor reads {_READS})")
    if ("table" in doc) != (version >= 3) or ("tensors" in doc and version >= 3):
        raise bad(f"a version {version} manifest lists its tensors in {'table' if version >= 3 else 'tensors'}")
    step = doc.get("step")
    if not is_count(step):
        raise bad(f"step must be a non-negative integer, got {step!r}")
    if "shards" not in doc:
        raise bad("shards must be a list")
    if "tree" not in doc:
        raise bad("tree is missing")
    # the tree's leaves, by a walk that knows what is a leaf ({"tensor": key} is also a mapping
    # whose one key is "tensor"): each stored tensor and alias once, and no other
    keys: list[str] = []
    unflatten(doc["tree"], keys.append, path)
    named: set[str] = gil.filled(set(), keys)
    if (
        len(named) != len(keys)
        or len(keys) != len(entries) + len(aliases)
        or not named.issuperset(entries)
        or not named.issuperset(aliases)
    ):
        raise bad(f"the state tree and the tensor table do not list the same tensors ({_odd_one(keys, entries, aliases)!r})")
    assert isinstance(step, int)
    return Manifest(step, doc["tree"], shards, entries, aliases, digests, reused, headers, len(data))


def _odd_one(keys: list[str], entries: Mapping[str, Entry], aliases: Mapping[str, str]) -> str:
    """A key the tree and the tables do not agree on (for the message): named twice, not stored, or not named."""
    seen: set[str] = set()
    for k in keys:
        if k in seen or (k not in entries and k not in aliases):
            return k[:80]
        seen.add(k)
    return next((k for k in (*entries, *aliases) if k not in seen), "")[:80]
