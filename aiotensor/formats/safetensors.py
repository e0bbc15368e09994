"""safetensors headers: build one with an aligned data section, and validate any file's header.

The format: 8 bytes little-endian header length N, N bytes of JSON, then the data section. Every
tensor is ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the data section; the
tensors cover the data section exactly (no holes, no overlaps, no trailing bytes).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate, chain, islice, repeat
from operator import add, attrgetter, floordiv, itemgetter, lt, mul, sub
from typing import Any, NamedTuple, TypeVar

from .._runtime import gil
from .._runtime.native import native
from ..errors import FormatError, HeaderError, StateError
from ..knobs import JSON_CHUNK_VALUES
from .dtypes import ITEMSIZE, PACKED, nbytes_of, packing_problem
from .tree import TAGS

ALIGN = 4096
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the cap safetensors itself uses
MAX_TENSORS = 1 << 18
MAX_DIMS = 64
METADATA_KEY = "__metadata__"  # the header member that is not a tensor
# values any JSON may have before its density is checked (a state's list of a million small ints:
# ~60 MB of Python objects at most, [{}, {}, ...]); beyond, real headers and manifests have 15-25
# bytes of text per JSON value
_DENSE_FREE = 1_000_000
_MIN_BYTES_PER_VALUE = 6


class TensorSpec(NamedTuple):
    """Where one tensor's bytes lie in its file. ``offset`` is absolute (from the file's start)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """A validated safetensors file: its tensors in file order and its ``__metadata__``."""

    data_start: int
    file_size: int
    tensors: tuple[TensorSpec, ...]
    metadata: dict[str, str] | None


def shape_problem(shape: object, dtype: str) -> str | None:
    """Why ``shape`` of ``dtype`` is not one torch can make (None if it is): a short message."""
    # set/min/max: C loops (a 20,000-tensor header or manifest checks 20,000 shapes)
    if (
        type(shape) is not list
        or len(shape) > MAX_DIMS
        or not _INT.issuperset(map(type, shape))
        or (shape and (min(shape) < 0 or max(shape) >= 2**63))
    ):
        return f"shape must be a list of at most {MAX_DIMS} integers in [0, 2**63)"
    if math.prod(d for d in shape if d) >= 2**63:  # torch counts elements in int64, zero-size or not
        return "shape has more than 2**63 elements"
    return packing_problem(dtype, shape)


@gil.quiet_gc
def build(entries: Sequence[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None) -> tuple[bytes, Layout]:
    """Header bytes (length prefix included, padded with spaces to a multiple of 4096) and the layout.

    ``entries`` are ``(key, dtype, shape)`` in the order their bytes follow each other. Callers order
    them by descending itemsize so that every tensor starts at a multiple of its own itemsize.
    """
    blob, sizes = header_bytes(entries, metadata)
    offsets = gil.listed(accumulate(sizes, initial=len(blob)))  # each tensor's, and the end
    keys, dtypes, shapes = (map(itemgetter(i), entries) for i in range(3))
    specs = rows(TensorSpec, keys, dtypes, map(tuple, shapes), offsets, sizes)  # C loops: tens of thousands
    return blob, Layout(len(blob), offsets[-1], tuple(specs), metadata or None)


@gil.quiet_gc
def header_bytes(
    entries: Sequence[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[int]]:
    """:func:`build`'s header bytes, and each entry's size in bytes, without the layout (a reader
    that only compares headers needs no specs). The text is ``json.dumps`` of ``{"__metadata__":
    metadata, key: {"dtype", "shape", "data_offsets"}, ...}`` (compact, not ASCII-escaped), byte for
    byte, the entries written by C calls (``map``) of a few hundred entries each (the sizes and
    offsets by C calls over all of them: 2 ms for 20,000). The keys are distinct and none is
    ``__metadata__`` (callers check: :func:`aiotensor._io.tensors.check_tensor`), as a dict's would be."""
    # columns, a slice per C loop (over 20,000 entries, each held the GIL 1-3 ms)
    keys, dtypes, shapes = (gil.listed(map(itemgetter(i), entries)) for i in range(3))
    itemsizes = map(ITEMSIZE.__getitem__, dtypes)  # nbytes_of, in C loops
    sizes = gil.listed(map(floordiv, map(mul, map(math.prod, shapes), itemsizes), map(PACKED.get, dtypes, repeat(1))))
    ends = gil.listed(accumulate(sizes))
    begins = [0, *ends[:-1]]
    head = [_quoted(METADATA_KEY) + ":" + gil.dumps(dict(metadata))] if metadata else []
    text = _entries_text(keys, dtypes, shapes, begins, ends, head)
    if text is None:
        parts = list(head)
        step = max(1, JSON_CHUNK_VALUES // 8)  # about 8 JSON values an entry
        for i in range(0, len(sizes), step):  # the GIL can change hands between calls
            j = i + step
            dims = map(",".join, map(map, repeat(str), shapes[i:j]))
            members = zip(map(_quoted, keys[i:j]), dtypes[i:j], dims, begins[i:j], ends[i:j], strict=True)
            parts.append(",".join(map(_ENTRY_TEXT.__mod__, members)))
        text = utf8("{" + ",".join(parts) + "}", keys)
    total = 8 + len(text)
    padded = len(text) + (-total) % ALIGN
    if max(map(len, shapes), default=0) > MAX_DIMS:  # (torch makes up to 64 in one call, and more by reshape)
        key = next(k for k, shape in zip(keys, shapes, strict=True) if len(shape) > MAX_DIMS)
        raise StateError(f"tensor {key!r} has more than the {MAX_DIMS} dimensions that a safetensors reader takes: reshape it")
    if len(sizes) > MAX_TENSORS:  # (a store's shards hold fewer: _io.plan)
        raise StateError(
            f"{len(sizes)} tensors in one safetensors file, over the {MAX_TENSORS} that aiotensor reads: save fewer per file"
        )
    check_written(text, "safetensors header", MAX_HEADER_BYTES - (padded - len(text)))
    return struct.pack("<Q", padded) + text + b" " * (padded - len(text)), sizes


_ENTRY_TEXT = '%s:{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}'


def _entries_text(
    keys: list[str], dtypes: list[str], shapes: list[Any], begins: list[int], ends: list[int], head: list[str]
) -> bytes | None:
    """:func:`header_bytes`' JSON text, made by :mod:`aiotensor._native` (``header_entries``, a
    slice of entries per call: 34 ms of ``%``-formatting per 20,000 entries in Python, ~4 in C);
    None where the helper is not built, or a shape is not a tuple of plain ints (a numpy integer,
    a bool), or a number is beyond a C ``long long``, or a string is not valid Unicode (the Python
    code then writes it, or names what is wrong)."""
    if native is None or not _TUPLE.issuperset(map(type, shapes)):
        return None
    try:
        out = [b"{", ",".join(head).encode()] if head else [b"{"]
    except UnicodeEncodeError:  # (the Python code names the key at fault, or where)
        return None
    for i in range(0, len(keys), _ROWS_PER_CALL // 2):
        some = native.header_entries(keys, dtypes, shapes, begins, ends, i, min(len(keys), i + _ROWS_PER_CALL // 2))
        if some is None:
            return None
        out.append(b"," if len(out) > 1 else b"")
        out.append(some)
    out.append(b"}")
    return b"".join(out)


_TUPLE = frozenset({tuple})
_quoted: Callable[[str], str] = json.encoder.encode_basestring  # type: ignore[attr-defined]  # json.dumps' (ensure_ascii=False)


def utf8(text: str, names: Sequence[str] = (), doc: Any = None) -> bytes:
    """A header's or a manifest's JSON as UTF-8, or a StateError showing where a string of the
    state is not Unicode: a lone surrogate, what ``os.fsdecode`` makes of a name that is not UTF-8
    (it was a raw UnicodeEncodeError): the first of ``names`` (a header's keys) that is, or the
    first such string of ``doc`` (the document ``text`` was made of) and the key it is under, or
    the text around it."""
    try:
        return text.encode()
    except UnicodeEncodeError as e:
        bad = next((n for n in names if not _encodes(n)), None)
        found = first_leaf(doc, _not_unicode) if bad is None and doc is not None else None
        if bad is not None:
            where = f"the name {bad!r}"
        elif found is not None:
            under, bad_text, is_key = found
            where = f"{bad_text!r} ({'a key' if is_key else 'a value'}{'' if under is None else f' under the key {under!r}'})"
        else:
            where = f"near {text[max(0, e.start - 60) : e.end + 20]!r}"
        raise StateError(f"a string of the state is not valid Unicode (a lone surrogate): {where}: encode it first") from None


def first_leaf(obj: Any, test: Callable[[Any], bool], key: Any = None) -> tuple[Any, Any, bool] | None:
    """The first key or leaf of a JSON document that passes ``test``: the key it is under (None: at
    the top), it, and whether it is a key; the keys of a saved state tree's one-member objects
    (``{"dict": ...}``, ``{"list": ...}``: :mod:`aiotensor.formats.tree`) are not named. For the
    messages that say where a state holds what JSON cannot."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if test(k):
                return key, k, True
            got = first_leaf(v, test, key if len(obj) == 1 and k in TAGS else k)
            if got is not None:
                return got
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            got = first_leaf(v, test, key)
            if got is not None:
                return got
    elif test(obj):
        return key, obj, False
    return None


def _not_unicode(x: Any) -> bool:
    return isinstance(x, str) and not _encodes(x)


def _encodes(name: str) -> bool:
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


def header_length(prefix: bytes, file_size: int, path: object) -> int:
    """Validate the 8-byte prefix; return the JSON header's length."""
    if file_size < 8 or len(prefix) < 8:
        raise HeaderError(f"file is {file_size} bytes, too small to be a safetensors file", path)
    n = int(struct.unpack("<Q", prefix[:8])[0])
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise HeaderError(_not_safetensors(prefix, n, file_size), path)
    return n


A_PICKLE = (
    "is a pickle (a legacy torch.save file, _use_new_zipfile_serialization=False?), not a safetensors file or "
    "a torch.save zip: aiotensor reads neither pickle nor that format; torch.load it and save it again"
)


def _not_safetensors(prefix: bytes, n: int, file_size: int) -> str:
    if prefix.startswith(b"PK\x03\x04"):
        return "is a zip archive (a torch.save file?), not a safetensors file; read it with aiotensor.load_torch"
    if prefix[:1] == b"\x80":
        return A_PICKLE
    why = f"over the {MAX_HEADER_BYTES} byte cap" if n > MAX_HEADER_BYTES else f"but the file has only {file_size - 8} after it"
    return f"is not a safetensors file: its first 8 bytes claim a {n} byte header, {why}"


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # a C loop; the slow one only to name a duplicate
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _Duplicate(k)
            seen.add(k)
    return out


class _Duplicate(Exception):
    pass


@gil.quiet_gc
def loads_json_object(text: bytes, path: object, what: str, error: type[HeaderError] | Any = HeaderError) -> dict[str, Any]:
    """Parse UTF-8 JSON that must be an object with unique keys; any failure is ``error``.

    Parsing memory stays within a small multiple of the text's size: Python objects take 20 to 50
    times the bytes of dense JSON such as ``[1,1,1,...]`` or ``[{},{},...]``, so text denser than
    any header or manifest aiotensor and safetensors write is refused before it is parsed.
    """
    doc = _text(text, path, what, error)
    try:
        obj = json.loads(doc, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except _Duplicate as e:
        raise error(f"{what} has the key {e.args[0]!r} twice", path) from None
    except (ValueError, RecursionError) as e:
        raise error(f"{what} is not valid JSON ({str(e)[:200]})", path) from None
    if not isinstance(obj, dict):
        raise error(f"{what} must be a JSON object, found {type(obj).__name__}", path)
    return obj


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


_WS = re.compile(r"[ \t\n\r]*")
_SPACE = frozenset(" \t\n\r")
# the C scanner itself (``raw_decode`` is a Python wrapper of it): one call per member
_DECODE: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder(
    object_pairs_hook=_no_duplicates, parse_constant=_reject_constant
).scan_once  # type: ignore[attr-defined]
Member = Callable[[str, Any], None]
NESTED: Any = object()  # parse_members' value of a nested object, whose members go one by one


def parse_members(
    text: bytes,
    path: object,
    what: str,
    error: type[FormatError],
    member: Member,
    nested: Mapping[str, Member] | None = None,
    bulk: Mapping[str | None, Bulk] | None = None,
) -> None:
    """Parse UTF-8 JSON that must be an object with unique keys, one member at a time:
    ``member(key, value)`` for each; for a key of ``nested`` whose value is an object,
    ``member(key, NESTED)``, then ``nested[key](k, v)`` for each member of that object, which is
    never held whole. What a member makes of its value
    is all that stays: a member that is not what it must be stops the parse at once, so parsing
    memory stays within a small multiple of the text's size (with the density rule of
    :func:`loads_json_object`). ``bulk[key]`` (``bulk[None]``: the document's own members) may take
    a whole fragment of members at once (:data:`Bulk`). Any failure is ``error``."""
    doc = _text(text, path, what, error)
    many = bulk or {}
    try:
        walk = lambda k, j: _member(doc, k, j, member, nested or {}, many)  # noqa: E731
        end = _members(doc, 0, walk, None if nested else member, many.get(None))
        if doc[_skip(doc, end) :]:
            raise ValueError(f"extra data after the object at {end}")
    except FormatError:
        raise
    except _Duplicate as e:
        raise error(f"{what} has the key {e.args[0]!r} twice", path) from None
    except (ValueError, RecursionError, IndexError) as e:
        raise error(f"{what} is not valid JSON ({str(e)[:200]})", path) from None


def _member(
    doc: str,
    key: str,
    j: int,
    member: Member,
    nested: Mapping[str, Member],
    bulk: Mapping[str | None, Bulk],
) -> int:
    inner = nested.get(key)
    if inner is not None and doc[j : j + 1] == "{":
        member(key, NESTED)  # (an empty object calls nothing below)
        return _members(doc, j, lambda k, i: _apply(doc, k, i, inner, scan), inner, bulk.get(key))
    return _apply(doc, key, j, member, scan)


def _apply(doc: str, key: str, j: int, fn: Member, scan: Callable[[str, int], tuple[Any, int]]) -> int:
    try:
        value, end = scan(doc, j)
    except StopIteration:
        raise ValueError(f"expected a value at {j}") from None
    fn(key, value)
    return int(end)


def scan(doc: str, i: int, spent: _Spent | None = None, tried: bool = False) -> tuple[Any, int]:
    """The JSON value at ``doc[i]`` and where it ends, as the C scanner (:data:`_DECODE`) gives
    them, made by calls of it on at most :data:`_WINDOW` characters each: one call holds the GIL
    throughout, and a worker decoding a state tree's list of a million sample indices (7 MB) in
    one held it 65-80 ms, a dict of 300,000 entries 150-170 ms, while the event loop's thread
    waited. An array or object longer than that is decoded a window's worth of its elements at a
    time (:func:`_elements`); a string is one call (its scan is a copy). ``tried``: the window
    from ``i`` did not decode (its container's cuts failed there), so the value is walked at once.
    Attempts that do not decode are counted (``spent``): past what :class:`_Spent` allows, a value
    is one call (a tower of nested arrays re-decoded a window per level: 100-800 times
    ``json.loads``)."""
    spent = _Spent() if spent is None else spent
    if doc[i : i + 1] not in ("[", "{") or spent.lost > spent.allowed:
        return _DECODE(doc, i)
    for width in () if tried else (_SMALL, _WINDOW):  # (a slice of the window's width is made: small values first)
        if len(doc) - i <= width:
            return _DECODE(doc, i)
        try:  # the whole value inside the window (a window's end inside it leaves it unclosed: no value)
            value, end = _DECODE(doc[i : i + width], 0)
        except (StopIteration, ValueError):
            spent.lost += width
            continue
        spent.allowed += _SPEND * end
        return value, i + end
    return _elements(doc, i, spent)


_SMALL, _WINDOW = 512, 64 * 1024
_SPEND = 4  # characters of attempts that do not decode, per character decoded


class _Spent:
    """What a :func:`scan` has decoded in vain (``lost``) and may (``allowed``: 64 windows, a
    window's cuts at each of 64 levels of big values nested, and 4 characters per character
    decoded)."""

    __slots__ = ("allowed", "lost")

    def __init__(self) -> None:
        self.allowed, self.lost = 64 * _WINDOW, 0


def _elements(doc: str, i: int, spent: _Spent) -> tuple[Any, int]:
    """The array or object at ``doc[i]`` and where it ends, its elements (members) a window at a
    time: from an element's start to the window's last comma, bracketed and decoded in one call.
    That decodes only where the comma is the container's own (one inside a string or a value below
    leaves a string or bracket open), or where the container's own closing bracket comes first
    (then the value is all the rest of it); else the one element is taken (by :func:`scan`). An
    object's keys are checked for duplicates across windows too."""
    array = doc[i] == "["
    opener, closer = ("[", "]") if array else ("{", "}")
    out: Any = [] if array else {}

    def add(some: Any) -> None:
        if array:
            out.extend(some)
            return
        had = len(out)
        out.update(some)  # (no key twice in ``some``: one object)
        if len(out) != had + len(some):  # a key of an earlier window: the walk names the first such
            _members(doc, i, lambda _, j: _DECODE(doc, j)[1])

    j = _skip(doc, i + 1)
    if doc[j : j + 1] == closer:
        return out, j + 1
    alone_to = 0  # elements before this are taken one by one (a window's cuts did not decode)
    while True:
        some, tried = None, False
        if j >= alone_to and spent.lost <= spent.allowed:
            window = doc[j : j + _WINDOW]
            for cut in _cuts(window):
                try:
                    some, n = _DECODE(opener + window[:cut] + closer, 0)
                except (StopIteration, ValueError):
                    spent.lost += cut
                    continue
                spent.allowed += _SPEND * n
                break
            else:
                alone_to, tried = j + _WINDOW, True
        if some is not None:
            add(some)
            if n != cut + 2:  # its own closing bracket, at n - 2 in the window
                return out, j + n - 1
            j += cut
        elif array:
            value, j = scan(doc, j, spent, tried)
            add([value])
        else:
            if doc[j : j + 1] != '"':
                raise ValueError(f"expected a key at {j}")
            key, j = json.decoder.scanstring(doc, j + 1)  # type: ignore[attr-defined]
            j = _skip(doc, j)
            if doc[j : j + 1] != ":":
                raise ValueError(f"expected ':' at {j}")
            value, j = scan(doc, _skip(doc, j + 1), spent, tried)
            add({key: value})
        j = _skip(doc, j)
        if doc[j : j + 1] == closer:
            return out, j + 1
        if doc[j : j + 1] != ",":
            raise ValueError(f"expected ',' or '{closer}' at {j}")
        j = _skip(doc, j + 1)
        if doc[j : j + 1] == closer:  # a comma before the end: refused, as one call refuses it
            raise ValueError(f"expected a value at {j}")


def _cuts(window: str) -> list[int]:
    """Where to try to cut a window of a container's elements: its last comma, and the last after
    a nested value's end (the last comma of a window of ``[[0,{...}],[1,{...}],...`` is inside an
    element)."""
    found = ((window.rfind(","), 0), (window.rfind("],"), 1), (window.rfind("},"), 1))
    return sorted({c + d for c, d in found if c > 0}, reverse=True)


def _skip(doc: str, i: int) -> int:
    """Where the white space at ``doc[i]`` ends."""
    if doc[i : i + 1] not in _SPACE:  # mostly none (the regex costs 1 µs a call)
        return i
    return _WS.match(doc, i).end()  # type: ignore[union-attr]


def _members(doc: str, i: int, member: Callable[[str, int], int], plain: Member | None = None, bulk: Bulk | None = None) -> int:
    """Walk the JSON object at ``doc[i]``: ``member(key, j)`` for each member, ``j`` where its
    value starts, returning where the value ends; returns where the object ends. With ``plain``,
    runs of members are parsed by the C scanner in fragments instead (:func:`_fragment`), each
    handed to ``plain(key, value)`` as the walk's ``member`` would see it; where a fragment is not
    what every writer makes, the walk takes its members. ``bulk`` may take a fragment's members
    at once."""
    i = _skip(doc, i)
    if doc[i : i + 1] != "{":
        raise ValueError(f"expected an object at {i}")
    i = _skip(doc, i + 1)
    if doc[i : i + 1] == "}":
        return i + 1
    seen: set[str] = set()
    walk_to = 0  # members before this are walked (a fragment there was refused)
    while True:
        if doc[i : i + 1] != '"':
            raise ValueError(f"expected a key at {i}")
        end = 0
        if plain is not None and i >= walk_to:
            end = _fragment(doc, i, plain, seen, bulk)
            walk_to = i + 4 * _FRAGMENT_CHARS if end == 0 else 0
        if end > 0:
            i = end
        elif end < 0:  # the object's own end
            return -end
        else:
            key, i = json.decoder.scanstring(doc, i + 1)  # type: ignore[attr-defined]
            if key in seen:
                raise _Duplicate(key)
            seen.add(key)
            i = _skip(doc, i)
            if doc[i : i + 1] != ":":
                raise ValueError(f"expected ':' at {i}")
            i = member(key, _skip(doc, i + 1))
        i = _skip(doc, i)
        if doc[i : i + 1] == ",":
            i = _skip(doc, i + 1)
        elif doc[i : i + 1] == "}":
            return i + 1
        else:
            raise ValueError(f"expected ',' or '}}' at {i}")


_FRAGMENT_CHARS = 64 * 1024
# the C scanner with a C hook: each JSON object comes back as the tuple of its (key, value) pairs
# (arrays stay lists, so ``{}`` and ``[]`` differ)
_TUPLES = json.JSONDecoder(object_pairs_hook=tuple, parse_constant=_reject_constant)
_CUT = re.compile(r'\}[ \t\n\r]*,[ \t\n\r]*"')  # where a member whose value is an object ends, and the next begins
Bulk = Callable[[Sequence[str], Sequence[Any]], bool]
"""Takes a fragment's members at once: their keys (new, no two the same) and values, each
object as the tuple of its ``(key, value)`` pairs (:data:`_TUPLES`; no object is below another).
Either it does what the member would with each (given the objects as dicts) and returns True,
or it does nothing and returns False: the members then go to the member one by one (which names
what is wrong). Its checks are column by column, in C loops (``map``, ``set``, ``zip``): a
member's value checked in Python costs microseconds, tens of milliseconds for 20,000 tensors."""


def _fragment(doc: str, i: int, plain: Member, seen: set[str], bulk: Bulk | None = None) -> int:
    """Parse the members from ``doc[i]`` (a key) to a cut :data:`_FRAGMENT_CHARS` to four times that
    further on, where a member's object ends and the next member begins, with one call of the C
    scanner, and hand each to ``plain``: the walk costs 3 µs a member in Python (60 ms for a
    header of 20,000 tensors). Returns where the fragment ends (> 0), or minus where the object
    ends if it ends inside; 0, having handed nothing over, where the fragment is not plain (a cut
    inside a string, which fails to parse; an object below a member's value; a duplicate key
    inside a value): the walk then takes those members and names what is wrong. A fragment parses
    only if it ends between two tokens, so its members are the document's own, in order; parsing
    memory stays within a small multiple of the fragment's."""
    cut = _CUT.search(doc, i + _FRAGMENT_CHARS, i + 4 * _FRAGMENT_CHARS)
    stop = cut.start() + 1 if cut is not None else min(len(doc), i + 4 * _FRAGMENT_CHARS)
    frag = "{" + doc[i:stop] + ("}" if cut is not None else "")
    try:
        pairs, n = _TUPLES.raw_decode(frag)
    except (ValueError, RecursionError):
        return 0
    closed = n <= stop - i + 1  # the brace that closed it is the document's
    if not closed and cut is None:
        return 0
    end = -(i + n - 1) if closed else stop
    braces = frag.count("{", 0, n)
    if bulk is not None and pairs and braces == 1 + len(pairs):  # objects, none below another
        keys, raw = zip(*pairs, strict=True)
        fresh = seen.isdisjoint(keys) and len(set(keys)) == len(keys)
        if fresh and set(map(type, raw)) == {tuple} and bulk(keys, raw):
            seen.update(keys)
            return end
    values: list[tuple[str, Any]] = []
    objects = 0
    for key, value in pairs:
        if type(value) is tuple:
            obj = dict(value)
            if len(obj) != len(value):
                return 0
            value, objects = obj, objects + 1
        values.append((key, value))
    if braces != 1 + objects:  # an object below a value (or a brace in a string)
        return 0
    for key, value in values:
        if key in seen:
            raise _Duplicate(key)
        seen.add(key)
        plain(key, value)
    return end


def _text(text: bytes, path: object, what: str, error: type[FormatError]) -> str:
    """The text of a JSON document, refused where it is far denser than real headers and manifests
    (:func:`_text_density`)."""
    _text_density(text, path, what, error)
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})", path) from None


def _text_density(text: bytes, path: object, what: str, error: type[FormatError]) -> None:
    """Refuse a JSON document far denser than real headers and manifests (:func:`dense`)."""
    values = dense(text)
    if values is not None:
        raise error(f"{what} holds {values} JSON values in {len(text)} bytes: far denser than any real {what}", path)


def dense(text: bytes) -> int | None:
    """The JSON values of ``text`` (its ``,``, ``[`` and ``{`` outside strings) where they are far
    more than real headers and manifests hold for their bytes (over :data:`_DENSE_FREE`, fewer
    than :data:`_MIN_BYTES_PER_VALUE` bytes each: Python objects take 20 to 50 times the bytes of
    ``[1,1,1,...]`` or ``[{},{},...]``); else None. The bytes are counted first; only where they
    say dense are the strings taken out (helper-71: a string of 120,000 commas, labels as CSV,
    counted as as many values)."""
    values = text.count(b",") + text.count(b"[") + text.count(b"{")
    if values <= _DENSE_FREE or len(text) >= _MIN_BYTES_PER_VALUE * values:
        return None
    bare = _STRING.sub(b'""', text)  # (as JSON splits it: a quote begins a string, the next unescaped one ends it)
    values = bare.count(b",") + bare.count(b"[") + bare.count(b"{")
    return values if values > _DENSE_FREE and len(text) < _MIN_BYTES_PER_VALUE * values else None


# a string, or an unterminated one to the end (which no JSON has: one that restarted at each later
# quote was quadratic, hours for a hostile header, helper-73); possessive: 0.2 s per 100 MB
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)  # (a lone backslash last too: helper-75)


def check_written(text: bytes, what: str, most: int) -> None:
    """Refuse to write a JSON document (``what``) that the readers refuse: over ``most`` bytes, or
    :func:`dense`. A step committed with it was listed, and never loaded, and retention retired the
    good steps before it (helper-71).

    Raises:
        StateError: saying what to do."""
    if len(text) > most:
        raise StateError(
            f"the {what} would be {len(text)} bytes, over the {most} that aiotensor reads: the state's plain values "
            "(lists, dicts, strings, numbers) are too big; hold big lists of numbers in tensors"
        )
    values = dense(text)
    if values is not None:
        raise StateError(
            f"the {what} would hold {values} JSON values in {len(text)} bytes, denser than aiotensor reads (over "
            f"{_DENSE_FREE} values, under {_MIN_BYTES_PER_VALUE} bytes each): hold long lists of small numbers, "
            "booleans or empty containers in tensors (torch.tensor(values))"
        )


def is_count(x: object) -> bool:
    """A non-negative JSON integer (bool is not an integer here)."""
    return type(x) is int and x >= 0  # JSON and the restricted unpickler make exact ints: only bool to tell apart


_INT = frozenset({int})
_PLAIN_ITEMSIZE = {k: v for k, v in ITEMSIZE.items() if k not in PACKED}


def plain_nbytes(dtype: Any, shape: Any) -> int:
    """The bytes of a tensor of ``dtype`` (not packed) and ``shape`` where both are what real files
    hold, every dimension at least 1; else 0 (then check it slowly, for the message). A caller
    compares the result with a real size, which bounds every dimension."""
    if (
        type(dtype) is str
        and dtype in _PLAIN_ITEMSIZE
        and type(shape) is list
        and len(shape) <= MAX_DIMS
        and _INT.issuperset(map(type, shape))
        and min(shape, default=1) >= 1
    ):
        n = math.prod(shape)
        return n * _PLAIN_ITEMSIZE[dtype] if n < 2**63 else 0  # a manifest's shard size is only what it says
    return 0


def plain_sizes(dtypes: Sequence[Any], shapes: Sequence[Any]) -> list[int] | None:
    """:func:`plain_nbytes` of many tensors at once (C loops): the bytes of each, or None where any
    one is not plain (then check them one by one)."""
    if not (_STR.issuperset(map(type, dtypes)) and _PLAIN_ITEMSIZE.keys() >= set(dtypes)):
        return None
    if not (_LIST.issuperset(map(type, shapes)) and max(map(len, shapes), default=0) <= MAX_DIMS):
        return None
    dims = list(chain.from_iterable(shapes))
    if not (_INT.issuperset(map(type, dims)) and min(dims, default=1) >= 1):
        return None
    sizes = list(map(mul, map(math.prod, shapes), map(_PLAIN_ITEMSIZE.__getitem__, dtypes)))
    return sizes if max(sizes, default=0) < 2**63 else None


def columns(objects: Sequence[tuple[tuple[str, Any], ...]], names: tuple[str, ...]) -> list[list[Any]] | None:
    """The values of ``objects`` (each the tuple of its ``(key, value)`` pairs) name by name, where
    every one has exactly ``names``, in that order (as every writer makes them); else None."""
    if set(map(len, objects)) != {len(names)}:
        return None
    out = []
    for name, column in zip(names, zip(*objects, strict=True), strict=True):
        if set(map(_KEY, column)) != {name}:
            return None
        out.append(list(map(_VALUE, column)))
    return out


R = TypeVar("R", bound=tuple[Any, ...])


def rows(cls: type[R], *fields: Iterable[Any]) -> list[R]:
    """Instances of the named tuple ``cls``, one per row of ``fields`` (one iterable per field, every
    field given; ``repeat(value)`` for a constant, the shortest ends the rows), made by C loops: a
    named tuple's ``__new__`` is a Python function (0.25 us a call, and the bulk paths make tens of
    thousands), a slice at a time (:func:`aiotensor._runtime.gil.listed`: a C loop keeps the GIL).
    By :mod:`aiotensor._native` where it is built (``tuple.__new__`` through ``map`` and ``zip``
    costs 0.2 us a row: 13 ms for the 60,000 records of a 20,000-tensor file's entries)."""
    want = len(cls._fields)  # type: ignore[attr-defined]  # (a named tuple's)
    if len(fields) != want:  # tuple.__new__ would make a record short of fields
        raise TypeError(f"rows of {cls.__name__} need {want} fields, got {len(fields)}")
    if native is None or not fields:
        return gil.listed(map(partial(tuple.__new__, cls), zip(*fields)))  # noqa: B905 (repeat() has no end)
    its = tuple(map(iter, fields))
    out: list[R] = []
    while True:
        some = native.rows(cls, its, _ROWS_PER_CALL)
        out += some
        if len(some) < _ROWS_PER_CALL:
            return out


_ROWS_PER_CALL = 4096  # ~0.2 ms with the GIL held
_SPECS_PER_CALL = 1024  # ~0.6 ms with the GIL held (4,096: ~2.4 ms, the loop's p99 during a load 2.3-3.2 ms)


def counts(*values: Sequence[Any]) -> bool:
    """Is every one of ``values`` a non-negative integer (:func:`is_count`, in C loops)?"""
    return all(_INT.issuperset(map(type, v)) and min(v, default=0) >= 0 for v in values)


_KEY, _VALUE = itemgetter(0), itemgetter(1)
_STR, _LIST = frozenset({str}), frozenset({list})
_ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})
_ENTRY_ORDER = ("dtype", "shape", "data_offsets")  # safetensors' and ours


def _spec(key: str, info: Any, data_start: int, file_size: int, path: object) -> TensorSpec:
    """One tensor entry of a header, validated."""
    if type(info) is dict and info.keys() == _ENTRY_FIELDS:  # every real entry, in few C calls
        offsets = info["data_offsets"]
        if type(offsets) is list and len(offsets) == 2 and _INT.issuperset(map(type, offsets)):
            begin, end = offsets
            n = plain_nbytes(info["dtype"], info["shape"])
            if n and n == end - begin and begin >= 0 and data_start + end <= file_size:
                return TensorSpec(key, info["dtype"], tuple(info["shape"]), data_start + begin, n)
    if type(info) is not dict or info.keys() != _ENTRY_FIELDS:
        raise HeaderError(f"tensor {key!r}: entry must have exactly dtype, shape and data_offsets", path)
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise HeaderError(f"tensor {key!r}: unknown dtype {dtype!r}", path)
    problem = shape_problem(shape, dtype)
    if problem:
        raise HeaderError(f"tensor {key!r}: {problem}", path)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_count(o) for o in offsets)):
        raise HeaderError(f"tensor {key!r}: data_offsets must be two non-negative integers, got {offsets!r}", path)
    begin, end = offsets
    if begin > end or data_start + end > file_size:
        raise HeaderError(
            f"tensor {key!r}: data_offsets [{begin}, {end}] outside the data section of {file_size - data_start} bytes", path
        )
    n = nbytes_of(dtype, shape)  # Python ints: no overflow; compared against real sizes below
    if n != end - begin:
        raise HeaderError(f"tensor {key!r}: shape {shape} of {dtype} needs {n} bytes but data_offsets span {end - begin}", path)
    return TensorSpec(key, dtype, tuple(shape), data_start + begin, n)


@gil.quiet_gc  # tens of thousands of specs, and the fragments' tuples: no collection walks them meanwhile
def parse(header: bytes, file_size: int, path: object, max_tensors: int = MAX_TENSORS) -> Layout:
    """Validate a header (the JSON bytes after the 8-byte prefix) against the file size.

    Raises:
        HeaderError: naming the file, and the key where one is at fault.
    """
    data_start = 8 + len(header)
    if header.count(b'"data_offsets"') > max_tensors:
        raise HeaderError(f"more than {max_tensors} tensors in one file", path)
    specs: list[TensorSpec] = []
    found: dict[str, dict[str, str]] = {}

    def member(key: str, info: Any) -> None:  # each entry checked as it is parsed: a bad one stops the parse
        if key == METADATA_KEY:
            if not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
                raise HeaderError("__metadata__ must map strings to strings", path)
            found["metadata"] = info
            return
        specs.append(_spec(key, info, data_start, file_size, path))

    def bulk(keys: Sequence[str], objects: Sequence[Any]) -> bool:  # the same, many entries at once
        meta = None
        if METADATA_KEY in keys:
            k = keys.index(METADATA_KEY)
            meta = dict(objects[k])
            if not (_STR.issuperset(map(type, meta.values())) and len(meta) == len(objects[k])):
                return False
            keys, objects = (*keys[:k], *keys[k + 1 :]), (*objects[:k], *objects[k + 1 :])
        cols = columns(objects, _ENTRY_ORDER)
        if cols is None:
            return False
        dtypes, shapes, offsets = cols
        sizes = plain_sizes(dtypes, shapes)
        if sizes is None or not _LIST.issuperset(map(type, offsets)) or set(map(len, offsets)) != {2}:
            return False
        begins, ends = zip(*offsets, strict=True)
        if not (counts(begins, ends) and data_start + max(ends) <= file_size and list(map(sub, ends, begins)) == sizes):
            return False
        if meta is not None:
            found["metadata"] = meta
        specs.extend(rows(TensorSpec, keys, dtypes, map(tuple, shapes), map(add, begins, repeat(data_start)), sizes))
        return True

    canonical = _canonical(header, data_start, file_size, path)
    if canonical is not None:
        specs, metadata = canonical
    else:
        parse_members(header, path, "header", HeaderError, member, bulk={None: bulk})
        metadata = found.get("metadata")
    offsets = gil.listed(map(_OFFSET, specs))
    # in file order nearly always (a sort of 20,000 held the GIL 3 ms); equal offsets (an empty tensor
    # beside another) are sorted by size, which header order need not be (helper-62)
    if not all(map(lt, offsets, islice(offsets, 1, None))):
        specs.sort(key=_PLACE)
    if follow_on(specs, data_start, file_size):
        return Layout(data_start, file_size, tuple(specs), metadata)
    pos = data_start  # the walk, to name the first gap or overlap
    for s in specs:
        if s.offset != pos:
            what = "a gap before" if s.offset > pos else "an overlap at"
            raise HeaderError(f"tensor {s.key!r}: {what} byte {s.offset - data_start} of the data section", path)
        pos += s.nbytes
    if pos != file_size:
        raise HeaderError(f"{file_size - pos} trailing bytes after the last tensor", path)
    return Layout(data_start, file_size, tuple(specs), metadata)


def _canonical(header: bytes, data_start: int, file_size: int, path: object) -> tuple[list[TensorSpec], Any] | None:
    """:func:`parse`'s specs (in the header's order) and metadata, made by :mod:`aiotensor._native`
    where the header is written as every writer writes it (``scan_header``: compact JSON, each entry
    ``{"dtype":..,"shape":[..],"data_offsets":[..]}`` of a dtype that is not packed, keys without
    escapes), each entry checked as :func:`_spec` checks one; None where the helper is not built or
    the header is anything else (the Python parser then takes it, and names what is wrong). The
    Python parser takes 50 ms for a header of 20,000 tensors, this 10-12."""
    if native is None:
        return None
    _text_density(header, path, "header", HeaderError)
    specs: list[TensorSpec] = []
    meta: bytes | None = None
    pos = 0
    while True:
        got = native.scan_header(header, pos, _SPECS_PER_CALL, data_start, file_size, _PLAIN_ITEMSIZE, MAX_DIMS, TensorSpec)
        if got is None:
            return None
        some, pos, a, b = got
        specs += some
        if a >= 0:
            if meta is not None:
                return None
            meta = header[a:b]
        if pos == 0:
            break
    if len(gil.filled(set(), map(_KEY, specs))) != len(specs):  # a key twice: the parser names it
        return None
    if meta is None:
        return specs, None
    try:
        metadata = loads_json_object(meta, path, "__metadata__")
    except HeaderError:
        return None
    return (specs, metadata) if _STR.issuperset(map(type, metadata.values())) else None


def follow_on(specs: Sequence[TensorSpec], start: int, end: int) -> bool:
    """Do ``specs`` (in file order) fill bytes ``[start, end)``, each right after the one before,
    with no gap and no overlap? (C loops: tens of thousands of specs.)"""
    ends = list(accumulate(map(_NBYTES, specs), initial=start))
    return list(map(_OFFSET, specs)) == ends[:-1] and ends[-1] == end


_PLACE, _OFFSET, _NBYTES = attrgetter("offset", "nbytes"), attrgetter("offset"), attrgetter("nbytes")
CRC_KEY = "aiotensor.crc32c"  # the __metadata__ entry of aiotensor's per-tensor checksums


def crc_table(layout: Layout, path: object) -> dict[str, int] | None:
    """The per-tensor crc32c a file written by aiotensor carries (None for other writers' files)."""
    raw = (layout.metadata or {}).get(CRC_KEY)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        crcs = {k: int(v, 16) for k, v in doc.items() if isinstance(v, str) and len(v) == 8}
    except (ValueError, AttributeError, TypeError, RecursionError):
        raise HeaderError(f"__metadata__[{CRC_KEY!r}] is not a map of tensor names to crc32c", path) from None
    if set(crcs) != {s.key for s in layout.tensors} or len(crcs) != len(doc):
        raise HeaderError(f"__metadata__[{CRC_KEY!r}] does not list exactly the file's tensors", path)
    return crcs
