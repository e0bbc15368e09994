"""The optional C helpers (``aiotensor/_native.c``) against the Python code they stand in for: the
same records, the same layouts, the same errors, on the headers real writers make and on near misses."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import struct
from collections import namedtuple
from itertools import repeat
from typing import Any, NamedTuple
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from aiotensor._runtime.native import native
from aiotensor.errors import HeaderError
from aiotensor.formats import safetensors as st

needs_native = pytest.mark.skipif(
    native is None, reason="aiotensor._native is not built here (no C compiler, or AIOTENSOR_NATIVE=0)"
)


def test_the_helpers_are_built_where_a_compiler_is() -> None:
    """An install with a C compiler builds them (else every test here skips, and the fast paths go
    untested: this says so)."""
    if os.environ.get("AIOTENSOR_NATIVE") == "0" or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("AIOTENSOR_NATIVE=0, or no C compiler: the Python code does the work")
    assert native is not None, "aiotensor._native did not build: run `pip install -e .` again and read its output"
    source = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "aiotensor", "_native.c")
    with open(source, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    assert native.SOURCE == digest, "aiotensor._native was built from another _native.c: run `pip install -e .` again"


class _Row(NamedTuple):
    a: Any
    b: Any
    c: Any


@needs_native
@pytest.mark.parametrize("per", [1, 3, 4096])
def test_rows_are_what_tuple_new_makes(per: int) -> None:
    """Records from lists, strings, generators, maps, zips and ``repeat`` (the shortest ends them),
    in slices of ``per``: those ``tuple.__new__`` makes, of the class, each field the same object."""
    objs = [object() for _ in range(10)]
    cases = [
        lambda: ([1, 2, 3], "xyz", repeat(None)),
        lambda: (objs, (o for o in objs), map(id, objs)),
        lambda: (range(7), zip(range(9)), repeat(objs[0])),
        lambda: ([], repeat(1), repeat(2)),
    ]
    for fields in cases:
        want = [tuple.__new__(_Row, r) for r in zip(*fields())]  # noqa: B905
        got = _rows_by(per, _Row, *fields())
        assert got == want and all(type(r) is _Row for r in got)
        assert all(x is y for r, w in zip(got, want, strict=True) for x, y in zip(r, w, strict=True) if type(x) is object)
    pair = namedtuple("pair", "x y")
    assert _rows_by(per, pair, [1], [2]) == [pair(1, 2)]


def _rows_by(per: int, cls: Any, *fields: Any) -> list[Any]:
    with mock.patch.object(st, "_ROWS_PER_CALL", per):
        return st.rows(cls, *fields)


@needs_native
def test_rows_refuse_what_is_not_a_named_tuple() -> None:
    class WithDict(tuple):  # instances have a __dict__ after their items
        pass

    stat_result = type(
        os.stat("/")
    )  # a struct sequence: a tuple subclass of that size, with hidden fields (helper-61: freed, a crash)
    for cls in (dict, WithDict, tuple, stat_result):
        with pytest.raises(TypeError, match="named tuple"):
            native.rows(cls, (iter([1]),), 4)
    with pytest.raises(TypeError, match="named tuple class of 2 fields"):  # _Row has 3 (helper-61: records of 2)
        native.rows(_Row, (iter([1]), iter([2])), 4)
    with pytest.raises(TypeError, match="iterator"):
        native.rows(_Row, ([1], [2], [3]), 4)
    for pos in (-1, 10, 2**62):  # (helper-61: read before the buffer, or past it)
        with pytest.raises(ValueError, match="pos outside the document"):
            native.scan_header(b'{"a":{}}', pos, 4, 0, 100, {"F32": 4}, 64, st.TensorSpec)
    with pytest.raises(TypeError, match="named tuple class of 5 fields"):
        native.scan_header(b"{}", 0, 4, 0, 100, {"F32": 4}, 64, _Row)
    boom = map(lambda x: 1 / x, [1, 0])
    with pytest.raises(ZeroDivisionError):
        native.rows(_Row, (boom, iter("ab"), iter("cd")), 4)


def _header(blob: bytes) -> tuple[bytes, int]:
    n = struct.unpack("<Q", blob[:8])[0]
    return blob[8 : 8 + n], len(blob)


def _both(header: bytes, size: int) -> tuple[object, object]:
    """parse's outcome with the helper, and without it (the Python parser)."""

    def outcome() -> object:
        try:
            layout = st.parse(header, size, "f")
        except HeaderError as e:
            return ("error", str(e))
        return (layout.tensors, layout.metadata)

    fast = outcome()
    with mock.patch.object(st, "native", None):
        return fast, outcome()


@needs_native
def test_real_writers_headers_are_scanned_by_the_helper(tmp_path: Any) -> None:
    """safetensors' (with and without metadata, scalars, empty tensors, every plain dtype), and
    aiotensor's own (its crc metadata is a big escaped string): taken by the helper, never by the
    Python parser, with the layout the Python parser gives."""
    from safetensors.torch import save as st_save

    import aiotensor

    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float64, torch.int8]
    state = {f"m.{i}.w": torch.zeros(i % 3 + 1, 2, dtype=dtypes[i % len(dtypes)]) for i in range(40)}
    state |= {"scalar": torch.tensor(1.5), "empty": torch.zeros(0, 3), "é.ünï": torch.ones(2)}
    asyncio.run(aiotensor.save_file(state, tmp_path / "ours.safetensors"))
    blobs = [
        st_save(state),
        st_save(state, {"format": "pt", "x": 'a "quoted" \\ value'}),
        (tmp_path / "ours.safetensors").read_bytes(),
    ]
    for blob in blobs:
        header, size = _header(blob)
        with mock.patch.object(st, "parse_members", side_effect=AssertionError("the Python parser ran")):
            fast = st.parse(header, size, "f")
        with mock.patch.object(st, "native", None):
            slow = st.parse(header, size, "f")
        assert (fast.tensors, fast.metadata, fast.data_start) == (slow.tensors, slow.metadata, slow.data_start)
        assert len(fast.tensors) == len(state)


_ENTRY = '"{k}":{{"dtype":"F32","shape":[{n}],"data_offsets":[{b},{e}]}}'


def _doc(members: list[str], pad: str = "") -> bytes:
    return ("{" + ",".join(members) + "}" + pad).encode()


@needs_native
@pytest.mark.parametrize(
    "case",
    [
        "escaped key",
        "control in key",
        "metadata twice",
        "metadata not strings",
        "newline pad",
        "leading zero",
        "19 digits",
        "elements overflow",
        "65 dims",
        "bad utf-8",
        "key twice",
        "space after colon",
        "packed dtype",
        "past the end",
        "wrong span",
        "backwards",
        "not closed",
    ],
)
def test_near_misses_go_to_the_python_parser_with_its_outcome(case: str) -> None:
    """Each is refused by the helper (or agreed with), and parse's outcome is the Python parser's."""
    ok = [_ENTRY.format(k=f"t{i}", n=2, b=8 * i, e=8 * i + 8) for i in range(3)]
    size = 8 + 24
    members, pad = list(ok), " "
    if case == "escaped key":
        members[1] = members[1].replace('"t1"', '"t\\u00e91"')
    elif case == "control in key":
        members[1] = members[1].replace('"t1"', '"t\t1"')
    elif case == "metadata twice":
        members[1:1] = ['"__metadata__":{"a":"b"}', '"__metadata__":{"a":"c"}']
    elif case == "metadata not strings":
        members.insert(0, '"__metadata__":{"a":1}')
    elif case == "newline pad":
        pad = "\n"
    elif case == "leading zero":
        members[0] = members[0].replace("[0,8]", "[00,8]")
    elif case == "19 digits":
        members[2] = members[2].replace("[16,24]", "[16,0000000000000000024]")
    elif case == "elements overflow":
        members[2] = _ENTRY.format(k="t2", n=f"0,{2**40},{2**40}", b=16, e=16)
    elif case == "65 dims":
        members[2] = _ENTRY.format(k="t2", n=",".join(["1"] * 65), b=16, e=20)
    elif case == "bad utf-8":
        members[1] = members[1].replace('"t1"', '"t\udcff1"')
    elif case == "key twice":
        members[2] = members[2].replace('"t2"', '"t0"')
    elif case == "space after colon":
        members[1] = members[1].replace('":{', '": {')
    elif case == "packed dtype":
        members[2] = '"t2":{"dtype":"F4","shape":[16],"data_offsets":[16,24]}'
    elif case == "past the end":
        size -= 1
    elif case == "wrong span":
        members[2] = _ENTRY.format(k="t2", n=3, b=16, e=24)
    elif case == "backwards":
        members[2] = _ENTRY.format(k="t2", n=0, b=24, e=16)
    elif case == "not closed":
        pad = ""
        members[-1] = members[-1][:-1]
    header = ("{" + ",".join(members) + "}" + pad).encode("utf-8", "surrogateescape")
    size += len(header)
    for per in (1, 2, 4096):
        with mock.patch.object(st, "_SPECS_PER_CALL", per):
            fast, slow = _both(header, size)
            assert fast == slow


@needs_native
@settings(max_examples=int(os.environ.get("AIOTENSOR_FUZZ_EXAMPLES", "300")), deadline=None)
@given(hs.lists(hs.tuples(hs.integers(0, 10_000), hs.binary(min_size=1, max_size=3)), min_size=1, max_size=3), hs.integers(1, 4))
def test_a_header_with_bytes_changed_parses_as_the_python_parser_says(edits: list[tuple[int, bytes]], per: int) -> None:
    """A real header (metadata, a scalar, an empty tensor) with a few bytes replaced: the same
    layout or the same error with the helper (in slices of ``per`` members) as without."""
    from safetensors.torch import save as st_save

    state = {"a.w": torch.ones(2, 3), "s": torch.tensor(2.0), "e": torch.zeros(0), "b": torch.ones(4, dtype=torch.bfloat16)}
    header, size = _header(st_save(state, {"format": "pt"}))
    doc = bytearray(header)
    for at, new in edits:
        at %= len(doc)
        doc[at : at + len(new)] = new
    text = bytes(doc)
    with mock.patch.object(st, "_SPECS_PER_CALL", per):
        fast, slow = _both(text, size - len(header) + len(text))
    assert fast == slow


@needs_native
def test_a_header_of_many_tensors_is_scanned_in_slices() -> None:
    """20,000 entries: the helper is called a slice at a time (the GIL changes hands between), and
    its layout is the Python parser's."""
    blob, layout = st.build([(f"layer.{i}.weight", "F32", (3, i % 5 + 1)) for i in range(20_000)], {"format": "pt"})
    header, _ = _header(blob)
    size = layout.file_size
    calls: list[int] = []
    real = native.scan_header

    def counted(*args: Any) -> Any:
        calls.append(args[1])
        return real(*args)

    with mock.patch.object(st, "native", mock.Mock(scan_header=counted, rows=native.rows)):
        parsed = st.parse(header, size, "x")
    assert parsed.tensors == layout.tensors and parsed.metadata == {"format": "pt"}
    assert len(calls) == -(-20_001 // st._SPECS_PER_CALL) and calls[0] == 0 and json.loads(header)  # (a valid document)


@needs_native
@settings(max_examples=int(os.environ.get("AIOTENSOR_FUZZ_EXAMPLES", "300")), deadline=None)
@given(
    hs.lists(
        hs.text(
            alphabet=hs.sampled_from(["a", '"', "\\", "\n", "\x01", "\x1f", "\x7f", "é", "\u2028", "😀", "\t", "\b", "\f", "\r"]),
            min_size=1,
            max_size=6,
        ),
        max_size=8,
        unique=True,
    ),
    hs.sampled_from([None, {"format": "pt"}, {"x": 'q"\\\n\x00'}]),
    hs.integers(1, 5),
)
def test_header_bytes_written_by_the_helper_are_the_pythons(keys: list[str], meta: Any, per: int) -> None:
    """A shard's header written by the helper (``header_entries``, in slices of ``per`` entries):
    byte for byte what the Python code writes (``json.dumps``' escapes, ``ensure_ascii=False``)."""
    entries = [(k, ["F32", "BF16", "U8", "F4"][i % 4], tuple(2 * (j + i % 3) for j in range(i % 4))) for i, k in enumerate(keys)]
    with mock.patch.object(st, "_ROWS_PER_CALL", 2 * per):
        fast = st.header_bytes(entries, meta)
    with mock.patch.object(st, "native", None):
        slow = st.header_bytes(entries, meta)
    assert fast == slow
    doc = json.loads(fast[0][8:])
    assert list(doc) == ([st.METADATA_KEY] if meta else []) + keys


@needs_native
def test_header_entries_refuses_odd_arguments() -> None:
    cols: list[list[Any]] = [["a"], ["F32"], [(2,)], [0], [8]]
    assert native.header_entries(*cols, 0, 1) == b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
    for lo, hi in ((-1, 1), (0, 2), (1, 0)):
        with pytest.raises(ValueError, match="outside the columns"):
            native.header_entries(*cols, lo, hi)
    assert native.header_entries(["a"], ["F32"], [(True,)], [0], [8], 0, 1) is None  # (not a plain int: the Python code)
    with pytest.raises(TypeError, match="shapes tuples"):
        native.header_entries(["a"], ["F32"], [[2]], [0], [8], 0, 1)
    assert native.header_entries(["a\udc80"], ["F32"], [(2,)], [0], [8], 0, 1) is None  # (the Python code names it)
    assert native.header_entries(["a"], ["F32"], [(2**70,)], [0], [8], 0, 1) is None  # (beyond C's: the Python code writes it)


# ---- a manifest's tensor table (table_rows) ---------------------------------------------------------


def _real_manifest(tmp_path: Any) -> bytes:
    """A store's manifest of two shards: plain dtypes, a scalar, an empty tensor, a packed-free
    bool, a tied weight (an alias), keys not ASCII."""
    import aiotensor

    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float64, torch.int8]
    state: dict[str, Any] = {f"m.{i}.w": torch.ones(i % 3 + 1, 2, dtype=dtypes[i % len(dtypes)]) for i in range(40)}
    state |= {"scalar": torch.tensor(1.5), "empty": torch.zeros(0, 3), "é.ünï": torch.ones(2), "step": 7}
    state["tied"] = state["m.0.w"]

    async def save() -> None:
        async with aiotensor.TensorStore(tmp_path / "s", shard_bytes=256) as store:
            await store.save(1, state)

    asyncio.run(save())
    (path,) = (tmp_path / "s").glob("step-*/manifest.json")
    return path.read_bytes()


def _loads_both(data: bytes) -> tuple[object, object]:
    """manifest.loads' outcome with the helper, and without it."""
    from aiotensor.errors import ManifestError
    from aiotensor.formats import manifest

    def outcome() -> object:
        try:
            return manifest.loads(data, "m")
        except ManifestError as e:
            return ("error", str(e))

    fast = outcome()
    with mock.patch.object(manifest, "native", None):
        return fast, outcome()


@needs_native
@pytest.mark.parametrize("per", [1, 2, 4096])
def test_a_stores_table_is_read_by_the_helper_as_by_python(tmp_path: Any, per: int) -> None:
    """A real store's manifest: its table taken by the helper (the Python reader never runs), in
    slices of ``per`` rows, with the entries the Python reader gives."""
    from aiotensor.formats import manifest

    data = _real_manifest(tmp_path)
    with mock.patch.object(manifest, "_TABLE_ROWS", per):
        with mock.patch.object(manifest, "_column", side_effect=AssertionError("the Python reader ran")):
            fast = manifest.loads(data, "m")
    with mock.patch.object(manifest, "native", None):
        slow = manifest.loads(data, "m")
    assert fast == slow and len(fast.entries) == 43 and len(fast.shards) > 1 and fast.aliases == {"tied": "m.0.w"}
    assert list(fast.entries) == list(slow.entries) and all(type(e.spec.shape) is tuple for e in fast.entries.values())


def _table_edit(data: bytes, column: str, edit: Any) -> bytes:
    from aiotensor.formats import manifest

    doc = json.loads(data)
    table = doc["table"]
    table[column] = edit(table[column])
    return manifest.seal(doc)


_TABLE_CASES: dict[str, tuple[str, Any]] = {
    "leading zero": ("offset", lambda t: "0" + t),
    "two spaces": ("crc32c", lambda t: t.replace(" ", "  ", 1)),
    "trailing space": ("dims", lambda t: t + " "),
    "leading space": ("ndim", lambda t: " " + t),
    "a value more": ("crc32c", lambda t: t + " 5"),
    "a value less": ("offset", lambda t: t.rsplit(" ", 1)[0]),
    "a dim more": ("dims", lambda t: t + " 2"),
    "20 digits": ("offset", lambda t: "1" * 20 + t[t.index(" ") :]),
    "2**63": ("dims", lambda t: str(2**63) + t[t.index(" ") :]),
    "crc 2**32": ("crc32c", lambda t: str(2**32) + t[t.index(" ") :]),
    "shard index past the list": ("shard", lambda t: "9" + t[1:]),
    "65 dims": ("ndim", lambda t: "65" + t[1:]),
    "not ASCII": ("dtype", lambda t: t.replace("F32", "F３2", 1)),
    "packed dtype": ("dtype", lambda t: "F4" + t[t.index(" ") :]),
    "unknown dtype": ("dtype", lambda t: "Q8" + t[t.index(" ") :]),
    "a dtype of 33 letters": ("dtype", lambda t: "F" * 33 + t[t.index(" ") :]),
    "an empty dtype": ("dtype", lambda t: " " + t[t.index(" ") :]),
    "past its shard's end": ("offset", lambda t: str(10**12) + t[t.index(" ") :]),
    "a minus": ("offset", lambda t: "-1" + t[t.index(" ") :]),
    "a key twice": ("keys", lambda k: [k[1], *k[1:]]),
    "a key not a string": ("keys", lambda k: [7, *k[1:]]),
    "a column not a string": ("shard", lambda t: [int(x) for x in t.split(" ")]),
    "bytes past 2**63": ("dims", lambda t: f"{2**32} {2**32}" + t[t.index(" ", t.index(" ") + 1) :]),
}


@needs_native
@pytest.mark.parametrize("case", sorted(_TABLE_CASES))
def test_table_near_misses_read_as_the_python_reader_says(tmp_path: Any, case: str) -> None:
    """Each is refused by the helper (or agreed with): loads' outcome, entries or the error that
    names what is wrong, is the Python reader's, in slices of 1, 2 and 4,096 rows."""
    from aiotensor.formats import manifest

    column, edit = _TABLE_CASES[case]
    data = _table_edit(_real_manifest(tmp_path), column, edit)
    for per in (1, 2, 4096):
        with mock.patch.object(manifest, "_TABLE_ROWS", per):
            fast, slow = _loads_both(data)
        assert fast == slow


@needs_native
@settings(max_examples=int(os.environ.get("AIOTENSOR_FUZZ_EXAMPLES", "300")), deadline=None)
@given(
    hs.sampled_from(["shard", "dtype", "ndim", "dims", "offset", "crc32c"]),
    hs.lists(hs.tuples(hs.integers(0, 10_000), hs.text(alphabet=" 0123456789-FBUI_é", min_size=0, max_size=3)), max_size=3),
    hs.integers(1, 5),
)
def test_a_table_with_values_changed_reads_as_the_python_reader_says(column: str, edits: Any, per: int) -> None:
    """A real table with a few characters of a column replaced (or removed): the same entries or
    the same error with the helper (in slices of ``per`` rows) as without."""
    from aiotensor.formats import manifest

    def edit(text: str) -> str:
        for at, new in edits:
            at %= len(text) + 1
            text = text[:at] + new + text[at + len(new) :]
        return text

    data = _table_edit(_MANIFEST_BYTES, column, edit)
    with mock.patch.object(manifest, "_TABLE_ROWS", per):
        fast, slow = _loads_both(data)
    assert fast == slow


def _manifest_bytes() -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return _real_manifest(__import__("pathlib").Path(d))


_MANIFEST_BYTES = _manifest_bytes() if native is not None else b""


@needs_native
def test_table_rows_refuses_odd_arguments() -> None:
    from aiotensor.formats.manifest import Entry

    texts = ("0", "F32", "1", "2", "0", "5")
    args = (["a"], texts, (0,) * 6, 0, 4, ["f"], [8], {"F32": 4}, 64, st.TensorSpec, Entry)
    out: dict[str, Any] = {}
    assert native.table_rows(out, *args) == (1, 3, 1, 1, 1, 1)
    assert out == {"a": Entry("f", st.TensorSpec("a", "F32", (2,), 0, 8), 5)}
    with pytest.raises(TypeError, match="named tuple class of 3 fields"):
        native.table_rows({}, *args[:-1], st.TensorSpec)
    with pytest.raises(TypeError, match="named tuple class of 5 fields"):
        native.table_rows({}, *args[:-2], Entry, Entry)
    with pytest.raises(ValueError, match="a position outside its column"):
        native.table_rows({}, args[0], texts, (0, 0, 0, 9, 0, 0), *args[3:])
    with pytest.raises(ValueError, match="6 texts"):
        native.table_rows({}, args[0], texts[:5], *args[2:])
    with pytest.raises(ValueError, match="a size per file"):
        native.table_rows({}, *args[:6], [], *args[7:])
    with pytest.raises(TypeError, match="must be str"):
        native.table_rows({}, args[0], (0, *texts[1:]), *args[2:])
    assert native.table_rows({}, *args[:3], 5, *args[4:]) == (0,) * 6  # rows past the keys: none read


@needs_native
def test_a_shard_size_past_a_long_long_is_left_to_the_python_reader(tmp_path: Any) -> None:
    """A size of 2**63 or more bounds a tensor too (an offset of 2**63 - 1 and 8 bytes pass it):
    the helper took such rows unchecked where the Python reader refuses them (helper-63)."""
    from aiotensor.formats import manifest

    doc = json.loads(_real_manifest(tmp_path))
    doc["shards"][0]["size"] = 2**63
    offsets = doc["table"]["offset"].split(" ")
    first = doc["table"]["shard"].split(" ").index("0")
    offsets[first] = str(2**63 - 1)
    doc["table"]["offset"] = " ".join(offsets)
    fast, slow = _loads_both(manifest.seal(doc))
    assert fast == slow and isinstance(fast, tuple) and "lie past the end" in str(fast[1])


def test_a_column_whose_last_space_ends_a_slice_is_refused() -> None:
    """A column longer than a slice of ``_numbers`` ending in one space, the first after a slice's
    end: read one value short while its count of spaces passed, so a tensor lost a dimension and
    loaded with another shape (helper-63), with the helper and without."""
    from aiotensor.errors import ManifestError
    from aiotensor.formats import manifest

    n = manifest._NUMBERS_CHARS // 2 + 1  # "1 " * n: its last space is the first at or after a slice's end
    raw = {
        "keys": [f"k{i}" for i in range(n)],
        "shard": " ".join(["0"] * n),
        "dtype": " ".join(["F32"] * n),
        "ndim": " ".join(["1"] * (n - 1) + ["2"]),  # n + 1 dims wanted: n given, and a space
        "dims": "1 " * n,
        "offset": " ".join(["0"] * n),
        "crc32c": " ".join(["0"] * n),
    }
    for helper in (manifest.native, None):
        with mock.patch.object(manifest, "native", helper):
            with pytest.raises(ManifestError, match="table: dims must be non-negative integers"):
                manifest._table(raw, {"f": 10**6}, lambda msg: ManifestError(msg, "m"))


@needs_native
def test_table_rows_holds_what_python_code_it_runs_may_change() -> None:
    """A key already in ``out`` whose ``__eq__`` empties the keys (a hash collision runs it): the
    helper read past the list (a crash, helper-63); now it refuses."""
    from aiotensor.formats.manifest import Entry

    keys = [f"k{i}" for i in range(64)]

    class Emptier:
        def __hash__(self) -> int:
            return hash("k0")

        def __eq__(self, other: object) -> bool:
            keys.clear()
            return False

    texts = tuple(" ".join([v] * 64) for v in ("0", "F32", "1", "1", "0", "0"))
    out: dict[Any, Any] = {Emptier(): 1}
    assert native.table_rows(out, keys, texts, (0,) * 6, 0, 64, ["f"], [100], {"F32": 4}, 64, st.TensorSpec, Entry) is None
    assert native.table_rows({}, ["a"], texts, (0,) * 6, 5, 2**62, ["f"], [100], {"F32": 4}, 64, st.TensorSpec, Entry) == (0,) * 6
    sizes: list[Any] = [100.0]  # not an int: left to the Python code (no __index__ runs in the helper)
    assert native.table_rows({}, ["a"], texts, (0,) * 6, 0, 1, ["f"], sizes, {"F32": 4}, 64, st.TensorSpec, Entry) is None


@pytest.mark.parametrize("helper", ["native", "python"])
def test_copy_spans_copies_each_span_and_compares_where_asked(helper: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from aiotensor._runtime import buffers

    if helper == "native" and native is None:
        pytest.skip("aiotensor._native is not built here")
    if helper == "python":  # (also a helper built before it had copy_spans: helper-65)
        monkeypatch.setattr(buffers, "_copy_spans", None)
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    base, at = dst.data_ptr(), src.data_ptr()
    starts, sources, sizes = [0, 40, 10, 63], [at + 8, at, at + 30, at + 1], [5, 7, 0, 1]
    assert buffers.copy_spans(base, starts, sources, sizes) is True
    want = torch.zeros(64, dtype=torch.uint8)
    want[0:5], want[40:47], want[63] = src[8:13], src[0:7], src[1]
    assert torch.equal(dst, want)
    assert buffers.copy_spans(base, starts, sources, sizes, compare=True) is False  # all there already
    dst[42] = 200
    dst[63] = 9
    assert buffers.copy_spans(base, starts, sources, sizes, compare=True) is True
    assert torch.equal(dst, want)
    assert buffers.copy_spans(base, [], [], [], compare=True) is False
    # helper-67: a base past the address space was taken modulo 2**64, a start added to it wrapped,
    # and the Python code handed ctypes a negative address (a write before the buffer)
    for args in [(2**64 + base, [4], [at], [2]), (2**63, [2**63 + base], [at], [2]), (-1, [base + 1], [at], [1]),
                 (base, [-1], [at], [1]), (base, [0], [at], [2**64 - 1])]:  # fmt: skip
        with pytest.raises(OverflowError):
            buffers.copy_spans(*args)
    assert torch.equal(dst, want)


@needs_native
def test_copy_spans_refuses_odd_arguments() -> None:
    buf = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="of one length"):
        native.copy_spans(buf.data_ptr(), [0], [buf.data_ptr()], [], False)
    with pytest.raises(TypeError):
        native.copy_spans(buf.data_ptr(), (0,), [buf.data_ptr()], [1], False)
    with pytest.raises(OverflowError):
        native.copy_spans(buf.data_ptr(), [-1], [buf.data_ptr()], [1], False)
    with pytest.raises(TypeError):
        native.copy_spans(buf.data_ptr(), ["0"], [buf.data_ptr()], [1], False)
