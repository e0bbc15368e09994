"""Pure format and planning code: no disk, no event loop."""

from __future__ import annotations

import collections
import json
import math
import os
import struct
import tracemalloc
from collections import Counter, OrderedDict
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as hs

from aiotensor._io.plan import plan_save
from aiotensor.errors import HeaderError, ManifestError, MismatchError, StateError
from aiotensor.formats import checksum as _checksum
from aiotensor.formats import manifest as mf
from aiotensor.formats import safetensors as st
from aiotensor.formats import tree as tree_module
from aiotensor.formats.dtypes import TORCH_TO_SAFETENSORS
from aiotensor.formats.tree import flatten, unflatten


def _file(header: object, data: bytes = b"", raw: bytes | None = None) -> tuple[bytes, int]:
    text = raw if raw is not None else json.dumps(header).encode()
    return text, 8 + len(text) + len(data)


def _parse(header: object = None, data_len: int = 0, raw: bytes | None = None) -> st.Layout:
    text, size = _file(header, b"\0" * data_len, raw)
    return st.parse(text, size, "f.safetensors")


def test_build_then_parse_round_trips_and_aligns() -> None:
    blob, layout = st.build([("a", "F32", (2, 3)), ("b", "BF16", (4,)), ("c", "U8", ())], {"format": "pt"})
    assert len(blob) % 4096 == 0 and layout.data_start == len(blob)
    n = struct.unpack("<Q", blob[:8])[0]
    parsed = st.parse(blob[8 : 8 + n], layout.file_size, "x")
    assert parsed.tensors == layout.tensors and parsed.metadata == {"format": "pt"}


@settings(max_examples=int(os.environ.get("AIOTENSOR_FUZZ_EXAMPLES", "300")), deadline=None)
@given(
    hs.lists(
        hs.tuples(
            hs.text(max_size=6), hs.sampled_from(["F32", "U8", "BF16", "F4", "I64"]), hs.lists(hs.integers(0, 5), max_size=3)
        ),
        max_size=12,
        unique_by=lambda e: e[0],
    ),
    hs.one_of(hs.none(), hs.dictionaries(hs.text(max_size=4), hs.text(max_size=4), max_size=3)),
    hs.sampled_from([1, 2, 1000]),
)
def test_header_bytes_are_json_dumps_of_the_header(entries: list[Any], metadata: Any, step: int) -> None:
    """What every writer's header is, byte for byte (any key: quotes, controls, non-ASCII), in
    calls of any size: what store shards hold, and what a load compares them with."""
    from unittest import mock

    from aiotensor import knobs

    entries = [(k, d, (*shape, 2) if d == "F4" else tuple(shape)) for k, d, shape in entries]
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    pos = 0
    for key, dtype, shape in entries:
        n = st.nbytes_of(dtype, shape)
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    with mock.patch.object(st, "JSON_CHUNK_VALUES", step * 8):
        blob, sizes = st.header_bytes(entries, metadata)
    assert knobs.JSON_CHUNK_VALUES >= 8
    assert blob[8 : 8 + len(text)] == text and blob[8 + len(text) :].strip(b" ") == b""
    assert struct.unpack("<Q", blob[:8])[0] == len(blob) - 8 and len(blob) % 4096 == 0
    assert sizes == [st.nbytes_of(d, s) for _, d, s in entries]


MALFORMED = {
    "not json": (None, 0, b"{nope"),
    "not an object": ([1, 2], 0, None),
    "not utf-8": (None, 0, b'{"\xff": 1}'),
    "duplicate keys": (
        None,
        0,
        b'{"a": {"dtype":"U8","shape":[1],"data_offsets":[0,1]}, "a": {"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    ),
    "unknown dtype": ({"a": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}, 1, None),
    "extra field": ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": 1}}, 1, None),
    "negative offset": ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [-1, 0]}}, 1, None),
    "float offset": ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0.0, 1]}}, 1, None),
    "bool dim": ({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, 1, None),
    "length mismatch": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, 4, None),
    "gap": ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}, 2, None),
    "overlap": (
        {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}},
        3,
        None,
    ),
    "trailing bytes": ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, 5, None),
    "past the end": ({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}, 4, None),
    "overflowing shape": ({"a": {"dtype": "F64", "shape": [2**62, 2**62], "data_offsets": [0, 8]}}, 8, None),
    "negative dims": ({"a": {"dtype": "F32", "shape": [-1, -1], "data_offsets": [0, 4]}}, 4, None),
    "duplicate field": (None, 1, b'{"a": {"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}'),
    "duplicate metadata key": (
        None,
        1,
        b'{"__metadata__": {"m":"x","m":"y"}, "a": {"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    ),
    "bad metadata": ({"__metadata__": {"a": 1}}, 0, None),
    "NaN constant": (None, 0, b'{"__metadata__": {"a": NaN}}'),
    "deep nesting": (None, 0, b"[" * 100000 + b"]" * 100000),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_headers_raise_header_error_naming_the_file(case: str) -> None:
    header, data_len, raw = MALFORMED[case]
    with pytest.raises(HeaderError, match=r"^f\.safetensors: "):
        _parse(header, data_len, raw)


def test_header_length_checks() -> None:
    with pytest.raises(HeaderError, match="too small"):
        st.header_length(b"", 0, "f")
    with pytest.raises(HeaderError, match="cap"):
        st.header_length(struct.pack("<Q", 2**40), 2**41, "f")
    with pytest.raises(HeaderError, match="only"):
        st.header_length(struct.pack("<Q", 100), 50, "f")


def test_a_million_tiny_tensors_are_refused_quickly() -> None:
    one = b'"t%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},'
    text = b"{" + b"".join(one % i for i in range(1_000_000)) + b'"z":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'
    with pytest.raises(HeaderError, match="more than"):
        st.parse(text, 8 + len(text), "f")


def test_empty_and_zero_size_tensors_parse() -> None:
    layout = _parse(
        {
            "a": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]},
            "b": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
        },
        4,
    )
    assert [t.key for t in layout.tensors] == ["a", "b"]


@settings(max_examples=int(os.environ.get("AIOTENSOR_FUZZ_EXAMPLES", "300")), deadline=None)
@given(hs.binary(max_size=600))
def test_any_bytes_parse_or_raise_header_error(data: bytes) -> None:
    size = len(data) + 8
    try:
        layout = st.parse(data, size, "f")
    except HeaderError:
        return
    for t in layout.tensors:
        assert layout.data_start <= t.offset and t.offset + t.nbytes <= size


# --- state tree -------------------------------------------------------------------------


def test_tree_keeps_types_exactly() -> None:
    state = {
        "a": [1, 2.5, "x", None, True, (3, 4)],
        7: {"n": float("inf"), "m": float("-inf")},
        (1.5): "float key",
        "dt": torch.bfloat16,
        "t": torch.ones(2),
    }
    tree, tensors = flatten(state)
    assert [k for k, _ in tensors] == ["t"]
    json.dumps(tree, allow_nan=False)
    back = unflatten(json.loads(json.dumps(tree)), lambda k: tensors[0][1])
    assert back == {**state, "t": back["t"]} and back["a"][5] == (3, 4) and back["t"] is state["t"]


def test_numpy_scalars_come_back_as_their_numpy_type_and_hostile_ones_are_refused() -> None:
    """A metric or a loader's index is often a numpy scalar (``np.float32``, ``np.int64``): a save
    refused them ("convert it"), numpy's float64 came back a float. Now each comes back as its
    own numpy type and value, nan and inf too; what JSON cannot hold exactly is still refused."""
    import numpy as np

    values = [np.float32(0.1), np.float16(-1.5), np.float64(2.0), np.int8(-7), np.uint64(2**64 - 1), np.bool_(False)]
    values += [np.float32("nan"), np.float64("-inf")]
    tree, _ = flatten({"v": values})
    back = unflatten(json.loads(json.dumps(tree, allow_nan=False)), lambda k: None)["v"]
    assert [type(b) for b in back] == [type(v) for v in values]
    assert all(b == v or (np.isnan(b) and np.isnan(v)) for b, v in zip(back, values, strict=True))
    for refused in (np.complex64(1j), np.longdouble(1), np.datetime64("2020"), np.arange(3)):
        with pytest.raises(StateError, match=f"cannot save numpy.{type(refused).__name__} at 'x'"):
            flatten({"x": refused})
    hostile = [["int8", 300], ["int8", 1.0], ["float32", "x"], ["f4", 1.0], ["object", 1], ["complex64", 1.0], ["nope", 1]]
    # helper-68: a name numpy parses as a shape raised SyntaxError; a float out of range became inf or 0
    hostile += [["(2,2", 1.0], ["(-1,)f8", 1.0], ["float32", 1e300], ["float16", 1e-30], ["float32", 0.1], ["bool", 1]]
    for bad in hostile:
        with pytest.raises(ManifestError, match="numpy scalar"):
            unflatten({"numpy": bad}, lambda k: None)
    # what a writer that pickles values gets (DCP, a torch.save file): the Python values
    from aiotensor.formats.tree import python_values

    state = {"a": [np.float32(1.5), 2], "b": (np.int8(3),), "t": torch.ones(1)}
    assert python_values(state) == {"a": [1.5, 2], "b": (3,), "t": state["t"]}
    assert type(python_values(state)["a"][0]) is float and python_values({"x": [1]})["x"] is not None
    od: Any = collections.OrderedDict(w=1)
    od._metadata = {"": {"version": np.int64(2)}}  # (helper-69: an OrderedDict's _metadata was left as it was)
    assert type(python_values({"m": od})["m"]._metadata[""]["version"]) is int


def test_tree_rejects_unknown_leaves_with_key_path() -> None:
    class Thing:
        pass

    with pytest.raises(StateError, match=r"test_formats.*Thing at 'model.layers.1'.*never pickles"):
        flatten({"model": {"layers": [1, Thing()]}})
    with pytest.raises(StateError, match="keys must be"):
        flatten({(1, 2): 3})


@pytest.mark.parametrize(
    "leaves",
    [
        {"a": {"tensor": "x"}, "b": {"tensor": "y"}},
        {"a": {"tensor": "x"}, "b": {"tensor": 1}},
        {"a": {"tensor": "x"}, "b": {"tensor": "y", "more": 1}},
        {"a": {"tensor": "x"}, "b": {"list": []}},
        {"a": {"tensor": "x"}, "b": 3},
        {"a": {"tensor": "x"}, "b": {}},
    ],
)
@pytest.mark.parametrize("depth", [1, 65, 66])
def test_a_dict_of_tensors_rebuilds_as_the_walk_does(leaves: dict[str, Any], depth: int) -> None:
    """A dict whose values are all tensors is rebuilt by C loops (a state_dict of 20,000 tensors):
    the same state, the same tensors asked for in the same order, or the same error, nested as
    deep as the limit and past it."""
    from unittest import mock

    from aiotensor.formats import tree as tree_mod

    node: Any = {"dict": leaves}
    for _ in range(depth - 1):
        node = {"list": [node]}

    def outcome() -> object:
        asked: list[Any] = []
        try:
            return unflatten(node, lambda k: asked.append(k) or f"T{k}", "m.json"), asked
        except ManifestError as e:
            return str(e)

    fast = outcome()
    with mock.patch.object(tree_mod, "_tensor_keys", lambda nodes: None):
        slow = outcome()
    assert fast == slow
    assert (depth == 66) == isinstance(fast, str) or leaves["b"] != {"tensor": "y"}


def test_tree_keys_stay_unique_when_paths_collide() -> None:
    _, tensors = flatten({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}})
    assert [k for k, _ in tensors] == ["a.b", "a.b#2"]


# --- manifest ---------------------------------------------------------------------------


def _manifest(**over: object) -> bytes:
    doc = {
        "format": mf.FORMAT,
        "version": 1,
        "step": 5,
        "shards": [{"file": "shard-00000.safetensors", "size": 4100}],
        "tensors": {
            "w": {"shard": "shard-00000.safetensors", "dtype": "F32", "shape": [1], "offset": 4096, "nbytes": 4, "crc32c": 1}
        },
        "aliases": {},
        "tree": {"dict": {"w": {"tensor": "w"}}},
    }
    doc.update(over)
    return mf.seal(doc)


def test_manifest_round_trip() -> None:
    m = mf.loads(_manifest(), "m.json")
    assert m.step == 5 and m.entries["w"].crc32c == 1
    assert mf.loads(mf.dumps(m), "m.json") == m
    assert json.loads(mf.dumps(m))["checksum"].startswith("crc32c:")  # still plain JSON


def test_a_state_with_keys_named_tensor_round_trips() -> None:
    """A mapping whose one key is "tensor" is written as {"dict": {"tensor": ...}}, which looks like a
    leaf: loads refused every such checkpoint ("do not list the same tensors") though save wrote it."""
    w = torch.ones(1)
    for state in (
        {"tensor": w},
        {"a": {"tensor": w}, "b": [{"tensor": 5}], "c": {"tensor": "hello"}, "d": {"tensor": {"tensor": None}}},
        {"tensor": "w", "x": w},  # a string that names a stored tensor, beside it
    ):
        tree, tensors = flatten(state)
        entries = {
            k: {"shard": "s", "dtype": "F32", "shape": [1], "offset": 8 + 4 * i, "nbytes": 4, "crc32c": 0}
            for i, (k, _) in enumerate(tensors)
        }
        raw = _manifest(shards=[{"file": "s", "size": 8 + 4 * len(tensors)}], tensors=entries, tree=tree)
        m = mf.loads(raw, "m.json")
        assert m.tree == tree and list(m.entries) == [k for k, _ in tensors], state


def test_manifest_checksum_catches_every_flipped_bit() -> None:
    """Found by the fuzzer: a flipped bit in a tree key ("w" -> "v") loaded silently before the
    manifest had its own checksum."""
    raw = _manifest()
    for i in range(len(raw)):
        for bit in (0x01, 0x20):
            bad = bytearray(raw)
            bad[i] ^= bit
            with pytest.raises(ManifestError, match="m.json"):
                mf.loads(bytes(bad), "m.json")
    with pytest.raises(ManifestError, match="does not end with its checksum"):
        mf.loads(json.dumps(json.loads(raw)).encode(), "m.json")


@pytest.mark.parametrize("name", ["../evil", "/etc/passwd", "a/b", "..", ".hidden", "", "a\\b", "x" * 300])
def test_manifest_refuses_shard_paths_outside_the_folder(name: str) -> None:
    with pytest.raises(ManifestError, match="plain file name"):
        mf.loads(_manifest(shards=[{"file": name, "size": 4100}]), "m.json")


_ENTRY = {"shard": "shard-00000.safetensors", "dtype": "F32", "shape": [1], "offset": 0, "nbytes": 4, "crc32c": 1}


@pytest.mark.parametrize(
    "over, match",
    [
        ({"format": "x"}, "not an aiotensor manifest"),
        ({"version": 9}, "version 9"),
        ({"step": -1}, "step"),
        (
            {"tensors": {"w": {"shard": "nope", "dtype": "F32", "shape": [1], "offset": 0, "nbytes": 4, "crc32c": 1}}},
            "not listed",
        ),
        (
            {
                "tensors": {
                    "w": {"shard": "shard-00000.safetensors", "dtype": "F32", "shape": [2], "offset": 0, "nbytes": 4, "crc32c": 1}
                }
            },
            "is not 4 bytes",
        ),
        (
            {
                "tensors": {
                    "w": {
                        "shard": "shard-00000.safetensors",
                        "dtype": "F32",
                        "shape": [1],
                        "offset": 4099,
                        "nbytes": 4,
                        "crc32c": 1,
                    }
                }
            },
            "past the end",
        ),
        # found by the fuzzer (test_fuzz.py): an unhashable shard name raised TypeError
        ({"tensors": {"w": {"shard": [], "dtype": "F32", "shape": [1], "offset": 0, "nbytes": 4, "crc32c": 1}}}, "not listed"),
        # each passes the checks every real entry passes at once, but one: the full checks name it
        *(
            ({"tensors": {"w": _ENTRY | bad}}, match)
            for bad, match in [
                ({"shape": [-1, -1]}, "shape must be"),
                ({"crc32c": 2**32}, "crc32c must be"),
                ({"offset": True}, "must be non-negative integers"),
                ({"dtype": "U8", "nbytes": True}, "must be non-negative integers"),
                # found by review: the fast path took a shape past 2**63 a forged shard size allowed
                ({"dtype": "U8", "shape": [2**62, 4], "nbytes": 2**64}, "shape"),
                ({"dtype": "F4", "shape": [3], "nbytes": 1}, "packs 2 values"),
            ]
        ),
        ({"aliases": {"v": "nope"}}, "aliases"),
        ({"tree": {"dict": {}}}, "same tensors"),
        ({"tree": {"dict": {"w": {"tensor": "w"}, "v": {"tensor": "w"}}}}, "same tensors .'w'"),  # twice
        ({"tree": {"dict": {"w": {"tensor": "w"}, "v": {"tensor": "x"}}}}, "same tensors .'x'"),  # not stored
        ({"tree": {"list": [{"tensor": "w"}, {"tensor": "w"}]}}, "same tensors .'w'"),
        ({"aliases": {"v": "w"}}, "same tensors .'v'"),  # an alias the tree does not name
        ({"tree": {"weird": 1}}, "state tree"),
    ],
)
def test_manifest_validation(over: dict[str, object], match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        mf.loads(_manifest(**over), "m.json")


_TABLE = {"keys": ["w"], "shard": "0", "dtype": "F32", "ndim": "1", "dims": "1", "offset": "4096", "crc32c": "1"}
_TWO = {
    "keys": ["w", "v"],
    "shard": "0 0",
    "dtype": "F32 F32",
    "ndim": "1 0",
    "dims": "1",
    "offset": "4096 4096",
    "crc32c": "1 2",
}


def _v3(table: object = None, **over: object) -> bytes:
    """A version 3 manifest (a table, not tensors) of ``_manifest``'s one tensor, with ``over``."""
    doc = json.loads(_manifest())
    del doc["tensors"], doc["checksum"]
    return mf.seal({**doc, "version": 3, "table": _TABLE if table is None else table} | over)


def test_a_version_3_table_reads_as_the_same_entries_as_version_1() -> None:
    assert mf.loads(_v3(), "m.json").entries == mf.loads(_manifest(), "m.json").entries
    state = {"s": torch.tensor(1.0), "e": torch.zeros(0, 3), "f4": torch.zeros(2, 2, dtype=torch.float4_e2m1fn_x2)}
    tree, _ = flatten(state)
    table = {
        "keys": ["s", "e", "f4"],
        "shard": "0 0 0",
        "dtype": "F32 F32 F4",
        "ndim": "0 2 2",
        "dims": "0 3 2 4",
        "offset": "8 12 12",
        "crc32c": "0 0 0",
    }
    m = mf.loads(_v3(table, shards=[{"file": "s", "size": 16}], tree=tree), "m.json")
    assert [(e.spec.shape, e.spec.nbytes) for e in m.entries.values()] == [((), 4), ((0, 3), 0), ((2, 4), 4)]
    assert mf.loads(mf.dumps(m), "m.json") == m and b'"version":3' in mf.dumps(m)


@pytest.mark.parametrize(
    "table, match",
    [
        ({**_TABLE, "nbytes": "4"}, "table must be an object of keys, shard"),
        ({**_TABLE, "keys": "w"}, "table must be an object"),
        ([], "table must be an object"),
        ({**_TABLE, "offset": [4096]}, "offset must be a string"),
        ({**_TABLE, "offset": "4096 "}, "offset has 2 values for 1"),
        ({**_TABLE, "offset": " 4096"}, "offset has 2 values for 1"),
        ({**_TABLE, "offset": "-4096"}, "offset must be non-negative integers in plain decimal"),
        ({**_TABLE, "offset": "4_096"}, "offset must be non-negative integers"),
        ({**_TABLE, "offset": "\t4096"}, "offset must be non-negative integers"),
        ({**_TABLE, "offset": "+4096"}, "offset must be non-negative integers"),
        ({**_TABLE, "offset": "04096"}, "offset must be non-negative integers"),
        ({**_TABLE, "offset": "\u0664096"}, "offset must be non-negative integers"),  # an Arabic-Indic 4: int() takes it
        ({**_TABLE, "crc32c": "1" * 20}, "crc32c must be non-negative integers"),
        ({**_TABLE, "dtype": "f32"}, "unknown dtype 'f32'"),
        ({**_TABLE, "dtype": 32}, "dtype must be a string"),
        ({**_TABLE, "dtype": "F32 F32"}, r"dtype has 2 values for 1 \(1 tensors\)"),
        ({**_TABLE, "dims": "1 1"}, r"dims has 2 values for 1 \(1 tensors\)"),
        ({**_TABLE, "offset": ""}, "offset has 0 values for 1"),
        (
            {
                **_TABLE,
                "keys": ["w", "w"],
                "shard": "0 0",
                "dtype": "F32 F32",
                "ndim": "1 1",
                "dims": "1 1",
                "offset": "4096 4096",
                "crc32c": "1 1",
            },
            "tensor 'w' is listed twice",
        ),
        ({**_TABLE, "keys": [7]}, "tensor key 7 is not a string"),
        ({**_TABLE, "shard": "1"}, "tensor 'w': shard 1 is not the index of one of the 1 shards"),
        ({**_TABLE, "ndim": "65", "dims": " ".join(["1"] * 65)}, "at most 64 dimensions"),
        ({**_TWO, "offset": "4096 04096"}, "offset must be non-negative integers"),  # a leading zero, not first
        ({**_TWO, "crc32c": "1 " + "9" * 19}, "tensor 'v': crc32c must be below 2..32"),
        ({**_TWO, "ndim": "1 65", "dims": " ".join(["1"] * 66)}, "tensor 'v': shape must have at most 64"),
        ({**_TABLE, "dtype": "X9"}, "tensor 'w': unknown dtype 'X9'"),
        ({**_TABLE, "dims": "2"}, "past the end"),
        ({**_TABLE, "offset": "4097"}, "past the end"),
        ({**_TABLE, "crc32c": str(2**32)}, "crc32c must be"),
        ({**_TABLE, "ndim": "2", "dims": "0 " + str(2**70)}, "dims must be non-negative integers"),
        ({**_TABLE, "ndim": "2", "dims": "4294967296 4294967296"}, "shape"),
    ],
)
def test_a_version_3_table_is_checked_and_names_what_is_wrong(table: object, match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        mf.loads(_v3(table), "m.json")


def test_a_version_3_column_is_counted_before_it_is_split() -> None:
    """A column of many more values than the table has keys is refused before a value is made:
    split, 16 MB of "1 1 1 ..." would be 8 million strings (~450 MB)."""
    raw = _v3({**_TABLE, "offset": " ".join(["1"] * (8 << 20))})
    tracemalloc.start()
    try:
        with pytest.raises(ManifestError, match="offset has 8388608 values for 1"):
            mf.loads(raw, "m.json")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(raw), f"{peak / len(raw):.1f}x the manifest's size"


def test_a_version_3_table_checks_alone_only_the_rows_that_need_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A zero-size or packed (F4) tensor's bytes are not its dtype's size times its dims: such a
    row is checked alone, the others column by column (one such row sent every row through the
    row-by-row checks: 103-108 ms for 20,000 tensors against 39). The entries are version 2's."""
    n = 3000
    dtypes = ["F32"] * n
    dtypes[7], dtypes[2000] = "F4", "BF16"
    dims = [[4]] * n
    dims[7], dims[1500] = [2, 2], [0, 3]
    sizes = [
        4 * math.prod(d) * (2 if t == "BF16" else 4) // 4 // (2 if t == "F4" else 1) for t, d in zip(dtypes, dims, strict=True)
    ]
    sizes = [
        math.prod(d) * {"F32": 4, "BF16": 2, "F4": 1}[t] // (2 if t == "F4" else 1) for t, d in zip(dtypes, dims, strict=True)
    ]
    offsets = [8 + sum(sizes[:i]) for i in range(n)]
    keys = [f"t{i}" for i in range(n)]
    table = {
        "keys": keys,
        "shard": " ".join(["0"] * n),
        "dtype": " ".join(dtypes),
        "ndim": " ".join(str(len(d)) for d in dims),
        "dims": " ".join(str(x) for d in dims for x in d),
        "offset": " ".join(map(str, offsets)),
        "crc32c": " ".join(["0"] * n),
    }
    shards = [{"file": "s", "size": 8 + sum(sizes)}]
    tree = {"dict": {k: {"tensor": k} for k in keys}}
    alone: list[str] = []
    row = mf._row
    monkeypatch.setattr(mf, "_row", lambda keys, *a: alone.append(keys[a[-3]]) or row(keys, *a))
    m = mf.loads(_v3(table, shards=shards, tree=tree), "m.json")
    assert sorted(alone) == ["t1500", "t7"]
    v2 = {k: {"shard": "s", "dtype": t, "shape": d, "offset": o, "nbytes": z, "crc32c": 0}
          for k, t, d, o, z in zip(keys, dtypes, dims, offsets, sizes, strict=True)}  # fmt: skip
    assert m.entries == mf.loads(_manifest(version=2, shards=shards, tensors=v2, tree=tree), "m.json").entries
    assert [e.spec.nbytes for e in m.entries.values()][7] == 2 and m.entries["t1500"].spec.shape == (0, 3)


def test_a_version_3_table_with_no_shards_names_the_tensor() -> None:
    with pytest.raises(ManifestError, match="tensor 'w': shard 0 is not the index of one of the 0 shards"):
        mf.loads(_v3(shards=[], tree={"tensor": "w"}), "m.json")


def test_a_hostile_version_3_table_is_refused_in_bounded_memory() -> None:
    """Counts that agree, and many of them: 100,000 tensors of 64 dims of 1 (2 bytes of text a
    number, which the density rule does not see inside a string), refused by the tree. Duplicate
    keys are refused before a column is read."""
    k = 100_000
    keys = [str(i) for i in range(k)]
    many = {"keys": keys, "shard": " ".join(["0"] * k), "dtype": " ".join(["F32"] * k), "ndim": " ".join(["64"] * k),
            "dims": " ".join(["1"] * (64 * k)), "offset": " ".join(["0"] * k), "crc32c": " ".join(["1"] * k)}  # fmt: skip
    for table, most, match in ((many, 20, "do not list the same tensors"), ({**many, "keys": [""] * k}, 4, "'' is listed twice")):
        raw = _v3(table, shards=[{"file": "s", "size": 4}], tree=None)
        tracemalloc.start()
        try:
            with pytest.raises(ManifestError, match=match):
                mf.loads(raw, "m.json")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < most * len(raw), f"{peak / len(raw):.1f}x the manifest's size"


def test_a_manifest_lists_its_tensors_one_way_as_its_version_says() -> None:
    tensors = json.loads(_manifest())["tensors"]
    with pytest.raises(ManifestError, match="lists its tensors twice"):
        mf.loads(_v3(tensors=tensors), "m.json")
    with pytest.raises(ManifestError, match="lists its tensors twice"):  # an empty object lists them too
        mf.loads(_v3(tensors={}), "m.json")
    with pytest.raises(ManifestError, match="a version 2 manifest lists its tensors in tensors"):
        mf.loads(_v3(version=2), "m.json")
    with pytest.raises(ManifestError, match="a version 3 manifest lists its tensors in table"):
        mf.loads(_manifest(version=3), "m.json")
    doc = json.loads(_v3())
    table = doc.pop("table")
    del doc["checksum"]
    with pytest.raises(ManifestError, match="lists its tensors before its shards"):
        mf.loads(mf.seal({"table": table} | doc), "m.json")
    for listed in (tensors, {}):
        with pytest.raises(ManifestError, match="lists its tensors twice"):  # tensors, then table
            mf.loads(
                mf.seal({k: v for k, v in doc.items() if k != "tree"} | {"tensors": listed, "table": table, "tree": doc["tree"]}),
                "m.json",
            )
    empty = json.loads(_manifest()) | {"tensors": {}, "tree": {"dict": {}}}  # version 2 of an empty state: loads
    del empty["checksum"]
    assert mf.loads(mf.seal(empty), "m.json").entries == {}


# --- checksums --------------------------------------------------------------------------


@given(hs.binary(max_size=5000), hs.binary(max_size=5000))
def test_crc_combine_matches_crc_of_concatenation(a: bytes, b: bytes) -> None:
    assert _checksum.combine(_checksum.crc32c(a), _checksum.crc32c(b), len(b)) == _checksum.crc32c(a + b)


@pytest.mark.parametrize("kind", ["crc32c", "crc32"])
def test_crcs_of_many_buffers_are_each_buffers_own(kind: str) -> None:
    bufs = [bytes(range(i % 251)) * (1 + i % 3) for i in range(2 * 1024 + 5)]  # past two C loops' worth
    bufs += [os.urandom(n) for n in (3 << 20, 1, 1 << 20, (1 << 20) + 1, 5)]  # slices cut by bytes: one buffer at least
    assert _checksum.each(kind, iter(bufs), [len(b) for b in bufs]) == [_checksum.of(kind, b) for b in bufs]
    assert _checksum.each(kind, [], []) == []


def test_crc_combine_large_lengths() -> None:
    a, b = os.urandom(100), os.urandom(3 << 20)
    assert _checksum.combine(_checksum.crc32c(a), _checksum.crc32c(b), len(b)) == _checksum.crc32c(a + b)


# --- planning ---------------------------------------------------------------------------


def test_plan_dedupes_tied_weights_and_aligns_by_itemsize() -> None:
    w = torch.randn(4, 4)
    state = {"a": torch.ones(3, dtype=torch.uint8), "w": w, "tied": w, "view": w[1:], "d": torch.ones(2, dtype=torch.float64)}
    plan, sources = plan_save(state)
    assert plan.aliases == {"tied": "w"}
    assert set(sources) == {"a", "w", "view", "d"}
    (shard,) = plan.shards
    for t in shard.layout.tensors:
        assert (t.offset - shard.layout.data_start) % st.ITEMSIZE[t.dtype] == 0
    assert [t.dtype for t in shard.layout.tensors] == ["F64", "F32", "F32", "U8"]
    assert [t.key for t in shard.layout.tensors] == ["d", "w", "view", "a"]  # state order within an item size


def test_flatten_names_a_tensor_under_a_str_subclass_key_by_its_str() -> None:
    """helper-41: flatten's fast path named {K.W: t} (a str Enum) 'layer.weight' where the walk
    (and matched(), which pairs a load's into=) says 'layer.K.W'."""
    import enum

    class K(str, enum.Enum):  # noqa: UP042 (a StrEnum's str() is its value: the case is one whose str() is not)
        W = "weight"

    t = torch.ones(1)
    _, tensors = flatten({"layer": {K.W: t, "b": t}, "": t})
    assert [k for k, _ in tensors] == ["layer.K.W", "layer.b", "<root>"]


def test_plan_stores_each_different_view_of_one_address() -> None:
    """Views that start where another does (the same data pointer) are one tensor only when shape,
    strides, dtype and the lazy conj/neg bits agree too; empty views are never ties."""
    w, c = torch.randn(4, 4), torch.randn(3, dtype=torch.complex64)
    state = {
        "w": w, "flat": w.view(16), "t": w.t(), "ints": w.view(torch.int32), "again": w.view(4, 4),
        "e1": w[:0], "e2": w[:0], "c": c, "conj": c.conj(), "neg": c._neg_view(), "c2": c,
    }  # fmt: skip
    plan, sources = plan_save(state)
    assert plan.aliases == {"again": "w", "c2": "c"}
    assert set(sources) == set(state) - {"again", "c2"}


def test_plan_splits_shards_by_size_without_splitting_tensors() -> None:
    state = {f"t{i}": torch.ones(1000) for i in range(5)}
    plan, _ = plan_save(state, shard_bytes=8000)
    assert [len(s.layout.tensors) for s in plan.shards] == [2, 2, 1]
    assert all(s.arena_offset % 4096 == 0 for s in plan.shards)
    assert plan.arena_bytes >= sum(s.layout.file_size for s in plan.shards)


def test_plan_refuses_unsupported_tensors() -> None:
    with pytest.raises(StateError, match="'x'.*layout"):
        plan_save({"x": torch.ones(2, 2).to_sparse()})
    with pytest.raises(StateError, match="'y'.*dtype"):
        plan_save({"y": torch.ones(2, dtype=torch.complex128)})
    with pytest.raises(StateError, match="'z'.*meta"):
        plan_save({"z": torch.ones(2, device="meta")})


def _refused(name: str) -> torch.Tensor:
    class Sub(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    return {
        "sparse": lambda: torch.ones(2, 2).to_sparse(),
        "complex128": lambda: torch.ones(2, dtype=torch.complex128),
        "meta": lambda: torch.ones(2, device="meta"),
        "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "quantized": lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
        "subclass": lambda: torch.Tensor._make_subclass(Sub, torch.ones(2)),
        "packed 0-d": lambda: torch.zeros((), dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        "__metadata__": lambda: torch.ones(2),
    }[name]()


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*deprecated")
@pytest.mark.parametrize("bad", ["sparse", "complex128", "meta", "nested", "quantized", "subclass", "packed 0-d", "__metadata__"])
@pytest.mark.parametrize("at", [0, 1500, 2999])
def test_tensors_checked_by_columns_are_refused_as_one_by_one(bad: str, at: int) -> None:
    """check_tensors asks a slice of tensors at a time by C loops: among 3,000 good ones, a bad one
    anywhere is refused with check_tensor's own error, naming its key; the good ones' dtypes are
    check_tensor's."""
    from aiotensor._io.tensors import check_tensor, check_tensors

    good = [torch.ones(1), torch.ones(2, dtype=torch.bfloat16), torch.ones((), dtype=torch.int64), torch.ones(2, 2).t()]
    tensors = [(f"k{i}", good[i % 4]) for i in range(3000)]
    assert check_tensors(tensors) == [check_tensor(k, t) for k, t in tensors]
    key = "__metadata__" if bad == "__metadata__" else f"k{at}"
    tensors[at] = (key, _refused(bad))
    with pytest.raises(StateError) as one:
        check_tensor(*tensors[at])
    with pytest.raises(StateError) as columns:
        check_tensors(tensors)
    assert str(columns.value) == str(one.value) and repr(key) in str(one.value)


def test_tensors_on_several_devices_are_checked_one_by_one() -> None:
    from aiotensor._io.tensors import check_tensors

    tensors = [("a", torch.ones(1)), ("b", torch.ones(1, device="meta"))]
    assert check_tensors(tensors, ("cpu", "meta")) == ["F32", "F32"]
    with pytest.raises(StateError, match="'b' is on meta"):
        check_tensors(tensors, ("cpu",))


def test_a_state_saved_again_in_its_layout_reuses_its_shards_and_any_change_makes_new_ones() -> None:
    """The shards of a state planned again in the same keys, dtypes and shapes are found, not
    built again; a changed shape, dtype or key order (the same keys and byte count) gets its own."""
    from aiotensor._io import plan as plan_module

    state = {f"t{i}": torch.ones(6) for i in range(3000)}
    (a,), (b,) = plan_save(state)[0].shards, plan_save(dict(state))[0].shards
    assert b.header is a.header and b.layout is a.layout
    changes = {
        "shape": lambda s: s.update(t7=torch.ones(2, 3)),
        "dtype": lambda s: s.update(t7=torch.ones(6, dtype=torch.int32)),
        "order": lambda s: s.update(t7=s.pop("t7")),
    }
    for name, change in changes.items():
        other = dict(state)
        change(other)
        (c,) = plan_save(other)[0].shards
        assert c.header != a.header, name
        assert c.header == plan_module._built(*_columns(other))[0], name  # what building it makes
    with mock.patch.object(plan_module, "_planned", plan_module._Planned(4000)):  # room for one
        for n in (3000, 3001, 3000):
            plan_save({f"t{i}": torch.ones(6) for i in range(n)})
        assert plan_module._planned.count == 3000 and len(plan_module._planned.held) == 1


def _columns(state: dict[str, torch.Tensor]) -> tuple[list[str], list[str], list[torch.Size]]:
    return list(state), [TORCH_TO_SAFETENSORS[t.dtype] for t in state.values()], [t.shape for t in state.values()]


def test_marks_say_a_tensor_may_be_unchanged_an_inference_one_in_the_same_memory_too() -> None:
    """An inference tensor has no version counter: in the same memory it may be unchanged (a
    frozen base model made under inference_mode: its shards are compared byte for byte, then
    linked; helper-65 found them written in full at every save when its mark equalled nothing)."""
    from aiotensor._io.plan import tensor_marks
    from aiotensor.store.saving import Incremental

    t = torch.ones(2)
    with torch.inference_mode():
        i, j = torch.ones(2), torch.ones(2)
    assert tensor_marks([t]) == [(t.data_ptr(), t._version)]
    assert tensor_marks([t, i]) == [(t.data_ptr(), t._version), (i.data_ptr(), None)]
    inc = Incremental()
    plan, _ = plan_save({"t": t, "i": i}, stable=inc.stable)
    inc.planned(plan)
    assert inc.stable(["t", "i", "new"], tensor_marks([t, i, t])) == [True, True, False]
    assert inc.stable(["i"], tensor_marks([j])) == [False]  # other memory
    t.add_(1)
    assert inc.stable(["t"], tensor_marks([t])) == [False]


@pytest.mark.parametrize("per", [1, 3, 1024])
def test_same_compares_lists_a_slice_at_a_time(per: int) -> None:
    from aiotensor._runtime import gil as _gil

    with mock.patch.object(_gil, "_LISTED_PER_CALL", per):
        a = list(range(2500))
        assert _gil.same(a, list(a)) and _gil.same([], [])
        assert not _gil.same(a, a[:-1]) and not _gil.same(a, [*a[:-1], -1]) and not _gil.same(a, [-1, *a[1:]])


@settings(max_examples=400, deadline=None)
@given(hs.lists(hs.tuples(hs.integers(0, 5), hs.integers(0, 7)), min_size=0, max_size=4))
def test_overlaps_says_what_the_offsets_say(dims: list[tuple[int, int]]) -> None:
    """overlaps(t): two elements at one offset, as counting every element's offset says (a
    transpose, a slice, a broadcast, an interleaving of strides, an empty tensor)."""
    from itertools import product

    from aiotensor._io import tensors as tensors_module
    from aiotensor._io.tensors import overlaps

    shape, strides = [n for n, _ in dims], [s for _, s in dims]
    size = 1 + sum((n - 1) * s for n, s in dims if n)
    t = torch.zeros(max(size, 1)).as_strided(shape, strides)
    offsets = [sum(i * s for i, s in zip(idx, strides, strict=True)) for idx in product(*map(range, shape))]
    assert overlaps(t) == (len(set(offsets)) < len(offsets))
    with mock.patch.object(tensors_module, "_COUNTED", 0):  # nothing counted: what is sure, else None
        assert overlaps(t) in (None, len(set(offsets)) < len(offsets))


@settings(max_examples=500, deadline=None)
@given(hs.lists(hs.tuples(hs.integers(0, 12), hs.integers(0, 6), hs.integers(1, 3), hs.booleans()), max_size=6))
def test_check_apart_refuses_exactly_the_views_that_share_part_of_their_memory(views: list[Any]) -> None:
    """check_apart: two views of one buffer that share an element but are not the same view are
    refused; disjoint ones (interleaved strided ones too), empty ones and the same view twice (a
    tie) pass, as comparing every pair of views' element addresses says (helper-68: a strided view
    beside another went unchecked)."""
    from aiotensor._io.tensors import check_apart

    base = torch.zeros(40)
    tensors, elements = [], []
    for a, n, step, as_matrix in views:  # n elements from a, step apart; as a (n, 1) matrix's transpose too
        t = base[a : a + n * step : step]
        tensors.append(t.view(n, 1).t() if as_matrix and n else t)
        t = tensors[-1]
        key = t.is_contiguous() or tuple((k, st_) for k, st_ in zip(t.shape, t.stride(), strict=True) if k != 1)
        elements.append((tuple(range(a, a + n * step, step)), key))
    # one view (a tie): the same bytes, contiguous in both, or the same sizes and strides (size-1 dims aside)
    clash = any(set(x[0]) & set(y[0]) and x != y for i, x in enumerate(elements) for y in elements[i + 1 :])
    names = [f"t{i}" for i in range(len(tensors))]
    if clash:
        with pytest.raises(MismatchError, match="share part of their memory"):
            check_apart(names, tensors, "x")
    else:
        check_apart(names, tensors, "x")


def test_check_apart_tells_big_column_slices_and_odd_views_of_one_column_apart() -> None:
    """helper-69: two disjoint column halves of a 2048 x 4096 matrix (what DCP's reads of a
    column-sharded tensor are) were refused as too big to tell apart, element by element; one
    column seen through a size-1 dimension of another stride, or as int32, was not one view."""
    from aiotensor._io.tensors import check_apart

    big = torch.zeros(2048, 4096)
    check_apart(["a", "b"], [big[:, :2048], big[:, 2048:]], "x")  # a run per row: 4,096 runs
    with pytest.raises(MismatchError, match="share part of their memory"):
        check_apart(["a", "b"], [big[:, :2049], big[:, 2048:]], "x")
    buf = torch.zeros(4, 4)
    col = buf[:, 0]
    for other in (col.unsqueeze(1), col.as_strided((4, 1), (4, 7)), buf[:, 0:1], col.view(torch.int32)):
        check_apart(["a", "b"], [col, other], "x")
    with pytest.raises(MismatchError, match="share part of their memory"):
        check_apart(["a", "b"], [buf, buf.t()], "x")  # the same bytes in another order


def test_a_sliding_window_destination_is_refused_at_once() -> None:
    """unfold's windows: more elements than the locations they span, refused without counting
    their offsets (it took 13 s and 6.7 GB for 12 MB of windows, helper-66); a layout too big to
    count is "cannot tell" (None), and refused as a destination: taken as not overlapping, a load
    into one of 2M rows that did overlap mixed its values without a word (helper-67)."""
    from aiotensor._io import tensors as tensors_module
    from aiotensor._io.tensors import check_fillable, overlaps

    with mock.patch.object(tensors_module, "_COUNTED", 0):
        assert overlaps(torch.zeros(3_000_000).unfold(0, 64, 1))
        assert overlaps(torch.zeros(100).as_strided((10, 2, 3), (8, 3, 2))) is None
        with pytest.raises(MismatchError, match="do not show that each of its elements has a memory location of its own"):
            check_fillable(torch.zeros(100).as_strided((10, 2, 3), (8, 3, 2)), "t")
        check_fillable(torch.zeros(4, 6).t()[1:], "t")  # a transpose's slice: ordinary strides, nothing counted


_finite = hs.floats(allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(
    hs.recursive(
        hs.none() | hs.booleans() | hs.integers() | _finite | hs.text(),
        lambda inner: (
            hs.lists(inner, max_size=40)
            | hs.lists(inner, max_size=5).map(tuple)
            | hs.dictionaries(hs.text() | hs.integers() | hs.booleans() | hs.none() | _finite, inner, max_size=40)
        ),
        max_leaves=400,
    ),
    hs.sampled_from([1, 2, 3, 7, 2048]),
)
def test_piecewise_json_is_byte_identical_to_json_dumps(obj: Any, chunk: int) -> None:
    # small chunks: every way of cutting a container (slices of members, members walked one by one,
    # a big member after small ones, which the size estimate does not see) is exercised
    from unittest import mock

    from aiotensor._runtime import gil as _gil

    with mock.patch.object(_gil, "JSON_CHUNK_VALUES", chunk):
        assert _gil.dumps(obj) == json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@settings(max_examples=100, deadline=None)
@given(hs.lists(hs.tuples(hs.integers(0, 3000), hs.integers()), max_size=3000), hs.sampled_from([1, 7, 1024]))
def test_filled_is_update_a_slice_at_a_time(pairs: list[tuple[int, int]], per: int) -> None:
    """gil.filled makes the dict (the set) that one update makes, later pairs winning, whatever
    the slices: the keys repeat across them here."""
    from unittest import mock

    from aiotensor._runtime import gil as _gil

    with mock.patch.object(_gil, "_LISTED_PER_CALL", per):
        start = {-1: 0}
        got = _gil.filled(start, iter(pairs))
        assert got is start and list(got.items()) == list(({-1: 0} | dict(pairs)).items())
        assert _gil.filled(set(), (k for k, _ in pairs)) == {k for k, _ in pairs}


def test_quiet_gc_pauses_the_collector_and_restores_it_nested() -> None:
    import gc

    from aiotensor._runtime import gil as _gil

    seen = []
    inner = _gil.quiet_gc(lambda: seen.append(gc.isenabled()))
    outer = _gil.quiet_gc(lambda: (inner(), seen.append(gc.isenabled())))
    assert gc.isenabled()
    outer()
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        outer()
        assert not gc.isenabled()  # a collector the user turned off stays off
    finally:
        gc.enable()


def test_operations_pause_the_collector_and_lower_the_switch_interval_until_the_last_ends() -> None:
    import asyncio
    import gc
    import sys

    from aiotensor import Scheduler

    sched = Scheduler(switch_interval=0.0005)
    seen = []

    async def op(delay: float) -> None:
        with sched.operation():
            seen.append((gc.isenabled(), sys.getswitchinterval()))
            await asyncio.sleep(delay)
            seen.append((gc.isenabled(), sys.getswitchinterval()))

    async def main() -> None:
        await asyncio.gather(op(0.01), op(0.03))  # the first ends while the second runs

    before = sys.getswitchinterval()
    assert gc.isenabled() and before > 0.0005
    asyncio.run(main())
    assert seen == [(False, 0.0005)] * 4
    assert gc.isenabled() and sys.getswitchinterval() == before
    try:  # an interval the application set meanwhile is left as it set it
        with sched.operation():
            sys.setswitchinterval(0.002)
        assert sys.getswitchinterval() == 0.002
        with Scheduler(switch_interval=None).operation():
            assert sys.getswitchinterval() == 0.002 and not gc.isenabled()
    finally:
        sys.setswitchinterval(before)
        sched.close()


def test_a_long_pause_collects_the_young_garbage_in_the_workers(monkeypatch: Any) -> None:
    # saves back to back can keep the collector paused for minutes: the application's garbage
    # cycles made meanwhile are still collected, by a worker, every YOUNG_EVERY_S
    import asyncio
    import gc
    import weakref

    from aiotensor import Scheduler
    from aiotensor._runtime import gil as _gil

    class Node:
        pass

    sched = Scheduler()

    async def main() -> tuple[bool, bool]:
        with sched.operation():
            a, b = Node(), Node()
            a.other, b.other = b, a  # type: ignore[attr-defined]
            ref = weakref.ref(a)
            del a, b
            await sched.call(lambda: None)  # not due yet: the cycle stays
            kept = ref() is not None
            monkeypatch.setattr(_gil, "_next_young", 0.0)
            await sched.call(lambda: None)
            return kept, ref() is None

    assert gc.isenabled()
    try:
        assert asyncio.run(main()) == (True, True)
    finally:
        sched.close()


def _outcome(text: bytes, size: int) -> object:
    try:
        layout = st.parse(text, size, "f")
    except HeaderError as e:
        return ("error", str(e))
    return (layout.tensors, layout.metadata)


_KEYS = hs.text(alphabet=hs.sampled_from(["a", '"', "\\", "}", ",", ":", "{", " ", "é", "]"]), min_size=1, max_size=6)
_HEADER_ENTRY = hs.fixed_dictionaries(
    {
        "dtype": hs.one_of(hs.sampled_from(["U8", "F32", "BF16", "F7"]), hs.just({"a": "U8"})),
        "shape": hs.one_of(hs.lists(hs.integers(0, 3), max_size=2), hs.just([{"a": 1}])),
    },
    optional={"x": hs.just({}), "data_offsets": hs.just(None)},
)


@settings(max_examples=int(os.environ.get("AIOTENSOR_FUZZ_EXAMPLES", "300")), deadline=None)
@given(
    hs.lists(hs.tuples(_KEYS, _HEADER_ENTRY), max_size=8),
    hs.one_of(hs.none(), hs.dictionaries(_KEYS, hs.one_of(hs.text(max_size=3), hs.just([]), hs.just({})), max_size=2)),
    hs.sampled_from([(",", ":"), (", ", ": "), (",\n ", ": ")]),
    hs.integers(0, 3),
    hs.booleans(),
    hs.sampled_from([24, 60, 150]),
)
def test_the_fragment_parse_agrees_with_the_member_walk(
    entries: list[tuple[str, dict[str, Any]]], meta: Any, seps: tuple[str, str], dup: int, shuffle: bool, chars: int
) -> None:
    """Headers as writers make them and near misses (duplicate keys, keys holding '},"', empty or
    array values, extra fields, bad dtypes, whitespace): the C-scanner fragments accept exactly what
    the member-by-member walk accepts, with the same tensors, metadata and error."""

    members, pos = [], 0
    for key, e in entries:
        plain = isinstance(e["dtype"], str) and e["dtype"] in st.ITEMSIZE and all(type(d) is int for d in e["shape"])
        n = st.nbytes_of(e["dtype"], e["shape"]) if plain else 1
        item = {k: v for k, v in e.items() if k != "data_offsets"} | {"data_offsets": [pos, pos + n]}
        if "data_offsets" in e:  # a near miss: the field left out
            del item["data_offsets"]
        text = json.dumps(item, separators=seps)
        if e.get("x") == {}:  # and a field twice
            text = '{"dtype"' + seps[1] + '"U8"' + seps[0] + text[1:]
        members.append(f"{json.dumps(key)}{seps[1]}{text}")
        pos += n
    if dup and members:
        members.insert(dup % (len(members) + 1), members[0])
    if meta is not None:
        members.insert(len(members) // 2 if shuffle else 0, f'"__metadata__"{seps[1]}{json.dumps(meta, separators=seps)}')
    text = ("{" + seps[0].join(members) + "}   ").encode()
    size = 8 + len(text) + pos
    _three_ways_agree(text, size, chars)


def _three_ways_agree(text: bytes, size: int, chars: int) -> None:
    """The C helper's scan (in slices of one, two or all members), the C-scanner fragments of
    ``chars`` characters and the member walk give the same layout, or the same error."""
    from unittest import mock

    walks = []
    for per in (1, 2, 4096):
        with mock.patch.object(st, "_SPECS_PER_CALL", per):
            walks.append(_outcome(text, size))
    with mock.patch.object(st, "native", None), mock.patch.object(st, "_FRAGMENT_CHARS", chars):
        fast = _outcome(text, size)
    with mock.patch.object(st, "native", None), mock.patch.object(st, "_fragment", lambda *args: 0):
        slow = _outcome(text, size)
    assert walks == [slow] * 3 and fast == slow


# fields of a header entry made odd (data_offsets from the entry's place): what the member walk
# refuses, or takes the slow way
_HEADER_MISSES: dict[str, dict[str, Any]] = {
    "unknown dtype": {"dtype": "F7"},
    "dtype not a string": {"dtype": ["F32"]},
    "packed": {"dtype": "F4"},
    "empty": {"shape": [0], "data_offsets": [0, 0]},
    "empty, huge": {"shape": [0, 2**64], "data_offsets": [0, 0]},
    "scalar": {"shape": [], "data_offsets": [0, 4]},
    "bool dim": {"shape": [True], "data_offsets": [0, 4]},
    "shape not a list": {"shape": 1},
    "dims": {"shape": [1] * 65, "data_offsets": [0, 4]},
    "negative": {"data_offsets": [-4, 0]},
    "backwards": {"data_offsets": [4, 0]},
    "far past the end": {"data_offsets": [0, 10**6]},
    "float": {"data_offsets": [0.0, 4]},
    "bool": {"data_offsets": [False, 4]},
    "three": {"data_offsets": [0, 4, 4]},
    "not a list": {"data_offsets": 4},
    "wrong span": {"data_offsets": [0, 8]},
    "reordered": {},
}


@settings(max_examples=int(os.environ.get("AIOTENSOR_FUZZ_EXAMPLES", "300")), deadline=None)
@given(
    hs.lists(hs.sampled_from([*["ok"] * 8, *_HEADER_MISSES]), min_size=1, max_size=10),
    hs.one_of(hs.none(), hs.dictionaries(hs.sampled_from("ab"), hs.sampled_from(["v", "w", "x", [], 1]), max_size=2)),
    hs.integers(0, 10),
    hs.booleans(),
    hs.sampled_from([0, 0, 4]),
    hs.sampled_from([24, 60, 150]),
)
def test_header_fragments_taken_at_once_agree_with_the_member_walk(
    kinds: list[str], meta: dict[str, Any] | None, where: int, twice: bool, short: int, chars: int
) -> None:
    """Headers of entries as every writer makes them, with fields of some made odd, metadata with
    a key twice or a value not a string, a file too short for the last tensor: whole fragments
    taken at once (``bulk``, column by column) give the same layout, or the same error, as the
    member walk."""

    members, pos = [], 0
    for i, kind in enumerate(kinds):
        n = 4 * (i % 3 + 1)
        item: dict[str, Any] = {"dtype": "F32", "shape": [n // 4], "data_offsets": [0, n]}
        item.update(_HEADER_MISSES.get(kind, {}))
        if type(item["data_offsets"]) is list and type(item["data_offsets"][0]) is int:
            item["data_offsets"] = [pos + item["data_offsets"][0], pos + item["data_offsets"][1], *item["data_offsets"][2:]]
        if kind == "reordered":
            item = {"data_offsets": item.pop("data_offsets"), **item}
        pos += n if kind not in ("empty", "empty, huge") else 0
        members.append(f'"t{i}":{json.dumps(item, separators=(",", ":"))}')
    if meta is not None:
        text = json.dumps(meta, separators=(",", ":"))
        if twice and meta:  # a key twice
            text = text[:-1] + "," + text[1:]
        members.insert(where % (len(members) + 1), f'"__metadata__":{text}')
    text = ("{" + ",".join(members) + "}").encode()
    size = 8 + len(text) + pos - short
    _three_ways_agree(text, size, chars)


def test_real_headers_and_manifests_are_taken_a_fragment_at_a_time() -> None:
    """The column-by-column path (``bulk``) really serves what aiotensor and safetensors write:
    no entry of a 3,000-tensor header or manifest goes through the one-entry checks."""
    from unittest import mock

    from safetensors.torch import save as st_save

    blob = st_save({f"layer.{i}.weight": torch.ones(3, i % 5 + 1) for i in range(3000)}, {"format": "pt"})
    n = struct.unpack("<Q", blob[:8])[0]
    with mock.patch.object(st, "_spec", side_effect=AssertionError("one by one")), mock.patch.object(st, "native", None):
        parsed = st.parse(blob[8 : 8 + n], len(blob), "x")
    assert len(parsed.tensors) == 3000 and parsed.metadata == {"format": "pt"}
    specs = {e.key: e for e in parsed.tensors}
    m = mf.Manifest(
        7, {"dict": {k: {"tensor": k} for k in specs}}, {"s": len(blob)}, {k: mf.Entry("s", e, 5) for k, e in specs.items()}, {}
    )
    with mock.patch.object(mf, "_entry", side_effect=AssertionError("one by one")):
        assert mf.loads(mf.dumps(m), "m.json") == m


def test_a_header_of_many_tensors_is_parsed_in_fragments() -> None:
    """The fast path really serves real headers (here 3,000 tensors, a dozen fragments), and a
    value that is not an object sends the parse to the member walk, which names it."""
    from unittest import mock

    blob, layout = st.build([(f"layer.{i}.weight", "F32", (3, i % 5 + 1)) for i in range(3000)], {"format": "pt"})
    n = struct.unpack("<Q", blob[:8])[0]
    calls: list[int] = []
    real = st._TUPLES.raw_decode
    with mock.patch.object(st, "_TUPLES", mock.Mock(raw_decode=lambda s: calls.append(len(s)) or real(s))):
        with (
            mock.patch.object(json.decoder, "scanstring", side_effect=AssertionError("walked")),
            mock.patch.object(st, "native", None),
        ):
            parsed = st.parse(blob[8 : 8 + n], layout.file_size, "x")
    assert parsed.tensors == layout.tensors and parsed.metadata == {"format": "pt"}
    assert len(calls) > 3 and max(calls) <= 4 * st._FRAGMENT_CHARS + 2
    doc = json.loads(blob[8 : 8 + n])
    doc["layer.7.weight"] = [doc["layer.7.weight"]]
    bad = json.dumps(doc, separators=(",", ":")).encode()
    with pytest.raises(HeaderError, match="'layer.7.weight': entry must have exactly"):
        st.parse(bad, layout.file_size - n + len(bad), "x")


# a field of a manifest entry and a value the member walk refuses, or takes the slow way
_NEAR_MISSES: dict[str, tuple[str, Any]] = {
    "nested": ("shape", [{"a": 1}]),
    "twice": ("nbytes", 4),
    "short": ("crc32c", None),
    "reordered": ("dtype", "F32"),
    "bool": ("offset", True),
    "float": ("nbytes", 4.0),
    "negative": ("offset", -4),
    "crc too big": ("crc32c", 2**32),
    "crc bool": ("crc32c", False),
    "past the end": ("offset", 4097),
    "unknown shard": ("shard", "other.safetensors"),
    "shard not a string": ("shard", ["shard-00000.safetensors"]),
    "dtype not a string": ("dtype", ["F32"]),
    "packed": ("dtype", "F4"),
    "unknown dtype": ("dtype", "F7"),
    "zero dim": ("shape", [0]),
    "scalar": ("shape", []),
    "wrong size": ("nbytes", 8),
    "shape not a list": ("shape", 1),
    "dims": ("shape", [1] * 65),
    "huge": ("shape", [2**62]),
}


@settings(max_examples=int(os.environ.get("AIOTENSOR_FUZZ_EXAMPLES", "300")), deadline=None)
@given(
    hs.lists(hs.tuples(_KEYS, hs.sampled_from([*["ok"] * 6, *_NEAR_MISSES])), min_size=1, max_size=8),
    hs.lists(hs.tuples(_KEYS, hs.one_of(hs.integers(0, 8), hs.just({}))), max_size=3),
    hs.sampled_from([24, 60, 150]),
)
def test_manifest_fragments_agree_with_the_member_walk(entries: list[tuple[str, str]], aliases: list[Any], chars: int) -> None:
    """The manifest's tensor and alias tables (objects inside the document) parsed in fragments:
    the same manifest, or the same error, as the member walk."""
    from unittest import mock

    tensors: dict[str, Any] = {}
    for key, kind in entries:
        t: Any = dict(_ENTRY)
        if kind == "nested":
            t["shape"] = [{"a": 1}]
        elif kind == "short":
            del t["crc32c"]
        elif kind == "reordered":
            t = {"dtype": t.pop("dtype"), **t}
        elif kind in _NEAR_MISSES:
            field, value = _NEAR_MISSES[kind]
            t[field] = value
            if field == "shape" and isinstance(value, list) and value and value[0] != 0:  # only the shape odd
                t["nbytes"] = 4 * value[0]
        tensors[key] = t
    alias_doc = {k: (list(tensors)[v % len(tensors)] if isinstance(v, int) else v) for k, v in aliases}
    leaves = {k: {"tensor": k} for k in [*tensors, *alias_doc]}
    raw = _manifest(tensors=tensors, aliases=alias_doc, tree={"dict": leaves})
    for key, kind in entries:  # a field twice: JSON that json.dumps cannot make
        if kind == "twice":
            k = json.dumps(key, separators=(",", ":")).encode()
            raw = raw.replace(k + b':{"shard"', k + b':{"nbytes":4,"shard"', 1)
    digits = len(raw) - 10  # sealed again: the digits sit right before the closing '"}'
    raw = raw[:digits] + b"%08x" % _checksum.crc32c(raw[:digits] + b"0" * 8 + raw[-2:]) + raw[-2:]

    def outcome() -> object:
        try:
            return mf.loads(raw, "m.json")
        except ManifestError as e:
            return str(e)

    with mock.patch.object(st, "_FRAGMENT_CHARS", chars):
        fast = outcome()
    with mock.patch.object(st, "_fragment", lambda *args: 0):
        slow = outcome()
    assert fast == slow


# --- JSON values decoded a window at a time (formats/safetensors.scan) -----------------------------

_JSON = hs.recursive(
    hs.none()
    | hs.booleans()
    | hs.integers()
    | hs.floats(allow_nan=False, allow_infinity=False)
    | hs.text(alphabet=',[]{}":\\ ab'),
    lambda inner: (
        hs.lists(inner, max_size=12) | hs.dictionaries(hs.text(alphabet=',[]{}":\\ ab', max_size=6), inner, max_size=12)
    ),
    max_leaves=80,
)


@settings(max_examples=400, deadline=None)
@given(_JSON, hs.sampled_from([(",", ":"), (", ", ": ")]))
def test_a_value_decoded_a_window_at_a_time_is_the_one_call_s(value: Any, separators: tuple[str, str]) -> None:
    """With windows of a few characters, every way through scan (a window's last comma inside a
    string or a value below, a container's end inside a window, an element longer than a window)
    gives what one call of the C scanner gives, and ends where it ends."""
    doc = " " + json.dumps(value, separators=separators) + ' ,"next":[1,2]}'
    small, window = st._SMALL, st._WINDOW
    st._SMALL, st._WINDOW = 4, 24
    try:
        assert st.scan(doc, 1) == st._DECODE(doc, 1)
    finally:
        st._SMALL, st._WINDOW = small, window


def test_a_key_twice_in_other_windows_of_one_object_is_a_duplicate() -> None:
    tree = json.dumps({"dict": {f"k{i}": [i, {"v": i}] for i in range(5000)}})[:-2] + ', "k17": 0}}'  # far from its first
    head = {"format": mf.FORMAT, "version": 3, "step": 1, "shards": [], "table": _EMPTY_TABLE, "aliases": {}}
    text = json.dumps(head, separators=(",", ":"))[:-1] + ',"tree":' + tree + ',"checksum":"crc32c:00000000"}'
    raw = text.encode()
    raw = raw[: -len('00000000"}')] + b'%08x"}' % _checksum.crc32c(raw)  # sealed
    with pytest.raises(ManifestError, match="has the key 'k17' twice"):
        mf.loads(raw, "m.json")


_EMPTY_TABLE = {"keys": [], "shard": "", "dtype": "", "ndim": "", "dims": "", "offset": "", "crc32c": ""}


def test_a_big_state_tree_is_decoded_in_calls_of_at_most_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call of the C scanner holds the GIL throughout: a tree with a list of a million sample
    indices, decoded in one call, held it 65-80 ms while the event loop's thread waited. Here every
    call decodes at most a window's worth of characters, and the tree is the one json.loads reads."""
    tree = {"dict": {"w": {"tensor": "w"}, "sampler": {"dict": {"indices": {"list": list(range(200_000))}}},
                     "losses": {"dict": {f"sample-{i}": i * 0.5 for i in range(50_000)}},
                     "items": {"items": [[i, {"list": [i, "x,y"]}] for i in range(20_000)]}}}  # fmt: skip
    doc = {"format": mf.FORMAT, "version": 3, "step": 1, "shards": [{"file": "s", "size": 12}], "aliases": {},
           "table": {**_EMPTY_TABLE, "keys": ["w"], "shard": "0", "dtype": "F32", "ndim": "1", "dims": "1", "offset": "8", "crc32c": "0"},
           "tree": tree}  # fmt: skip
    raw = mf.seal(doc)
    spans: list[int] = []
    decode = st._DECODE

    def counted(text: str, at: int) -> tuple[Any, int]:
        value, end = decode(text, at)
        spans.append(end - at)
        return value, end

    monkeypatch.setattr(st, "_DECODE", counted)
    m = mf.loads(raw, "m.json")
    assert m.tree == json.loads(raw)["tree"]
    assert len(raw) > 40 * st._WINDOW and max(spans) <= st._WINDOW + 2, f"a call decoded {max(spans)} characters"


@settings(max_examples=300, deadline=None)
@given(_JSON, hs.integers(0, 10_000), hs.sampled_from([",", "]", "}", ",]", ",}", "", " ", "x", '"']))
@example(value={"k": 0, "x": {"a": 1, "k": 2}}, at=17, bad="}")  # the inner object closes early: "k" twice at the top
def test_a_broken_value_decoded_a_window_at_a_time_is_refused_as_one_call_refuses_it(value: Any, at: int, bad: str) -> None:
    """Found by review: after a window's cut on a trailing comma (``[1,2,]``), the next window
    decoded as the empty container, taken for the rest: the one call refuses it, and so must scan."""
    text = json.dumps(value, separators=(",", ":"))
    at %= len(text) + 1
    doc = " " + text[:at] + bad + text[at:] + ' ,"next":[1,2]}'
    small, window = st._SMALL, st._WINDOW
    st._SMALL, st._WINDOW = 4, 24
    try:
        try:
            one: Any = st._DECODE(doc, 1)
        except (ValueError, StopIteration):
            one = None
        except st._Duplicate as e:  # (the broken value closed an object early: a key twice at its level)
            one = ("twice", e.args)
        try:
            mine: Any = st.scan(doc, 1)
        except (ValueError, StopIteration):
            mine = None
        except st._Duplicate as e:
            mine = ("twice", e.args)
        assert mine == one
    finally:
        st._SMALL, st._WINDOW = small, window


def test_a_tower_of_nested_arrays_is_decoded_in_bounded_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each nesting level longer than a window tried its windows again (a review found 70 towers of
    60 levels over 7,000 numbers: 115 times json.loads); what decodes in vain is bounded by what
    decodes, past 64 windows."""
    tower = "[" * 60 + ",".join(["1234567"] * 9000) + "]" * 60
    doc = "[" + ",".join([tower] * 30) + "]"
    work: list[int] = []
    decode = st._DECODE

    def counted(text: str, at: int) -> tuple[Any, int]:
        try:
            value, end = decode(text, at)
        except (ValueError, StopIteration):
            work.append(len(text) - at)  # (a window: tried whole)
            raise
        work.append(end - at)
        return value, end

    monkeypatch.setattr(st, "_DECODE", counted)
    assert st.scan(doc, 0) == (json.loads(doc), len(doc))
    assert sum(work) < 6 * len(doc) + 64 * st._WINDOW, f"{sum(work) / len(doc):.1f} characters tried per character"


def test_ordered_dicts_nested_as_deep_as_flatten_allows_load() -> None:
    """Found by review: unflatten counted an OrderedDict (and a Counter) as two levels where flatten
    counts one, so a state of OrderedDicts nested 33-64 deep saved and could not be loaded."""
    for kind in (OrderedDict, Counter):
        state: Any = 5
        for _ in range(60):
            state = kind(x=state)
        tree, _ = flatten(state)
        got = unflatten(json.loads(json.dumps(tree)), lambda k: None, "m.json")
        assert flatten(got)[0] == tree and type(got) is kind  # (Counter's == of 60 levels compares 2**60 times)
    deep: Any = {"list": list(range(tree_module._BULK))}  # a plain list (copied whole) one level past the deepest
    for _ in range(65):
        deep = {"list": [deep]}
    with pytest.raises(ManifestError, match="nested too deep"):
        unflatten(deep, lambda k: None, "m.json")


_SCALAR = hs.none() | hs.booleans() | hs.integers() | hs.floats() | hs.text(max_size=5)


@settings(max_examples=300, deadline=None)
@given(hs.lists(_SCALAR, max_size=30) | hs.dictionaries(hs.text(max_size=4) | hs.integers(), _SCALAR, max_size=30), hs.booleans())
def test_flatten_copies_a_container_of_plain_scalars_as_its_walk_writes_it(value: Any, as_tuple: bool) -> None:
    """A list or dict of only plain scalars (a sampler's indices, per-sample losses) is copied by C
    loops, not walked value by value (a million took 0.35 s of a save): the tree is the walk's, nan
    and inf floats, int keys and all."""
    value = tuple(value) if as_tuple and isinstance(value, list) else value
    state = {"v": value, "deeper": {"v": value}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tree_module, "_BULK", 0)  # every container copied where it can be (256 values and more in use)
        fast = flatten(state)[0]
        copied = unflatten(json.loads(json.dumps(fast)), lambda k: None)
        mp.setattr(tree_module, "_flat", lambda obj: False)
        slow = flatten(state)[0]
    assert json.dumps(fast) == json.dumps(slow)
    assert json.dumps(copied) == json.dumps(unflatten(slow, lambda k: None))  # (walked: fewer than 256 values)


def test_a_state_changed_by_another_thread_while_it_is_walked_is_a_state_changed_error(monkeypatch: Any) -> None:
    """helper-60: a dict of the state grown by another thread (a forward under to_thread) while a
    save walked it was a bare RuntimeError; a key gone meanwhile a KeyError. Both are now
    StateChangedError (a StateError), saying what happened and that nothing was saved."""
    from aiotensor._runtime import gil
    from aiotensor.errors import StateChangedError

    log = {f"k{i}": float(i) for i in range(5000)}
    real = gil.slices

    def grown_meanwhile(items: Any, size: int = 4096) -> Any:
        for i, some in enumerate(real(items, size)):
            if i == 0 and "late" not in log:
                log["late"] = 1.0  # another thread's write, between two slices of the walk
            yield some

    monkeypatch.setattr(gil, "slices", grown_meanwhile)
    with pytest.raises(StateChangedError, match=r"changed while the save walked it \(RuntimeError: dictionary changed size"):
        flatten({"w": torch.ones(2), "log": log})
    monkeypatch.setattr(gil, "slices", real)

    m = {"a": torch.ones(1), "b": torch.ones(1)}
    real_tensor = tree_module._Flatten.tensor

    def b_deleted_meanwhile(self: Any, t: Any, name: str) -> Any:
        m.pop("b", None)  # another thread's delete, after the walk listed the dict's keys
        return real_tensor(self, t, name)

    monkeypatch.setattr(tree_module._Flatten, "tensor", b_deleted_meanwhile)
    with pytest.raises(StateChangedError, match=r"\(KeyError: 'b'\)"):
        flatten({"m": m})
    monkeypatch.setattr(tree_module._Flatten, "tensor", real_tensor)

    class Lazy(dict):  # type: ignore[type-arg]  # a mapping's own KeyError is its own (helper-61)
        def __getitem__(self, k: Any) -> Any:
            raise KeyError(f"{k} not downloaded")

    with pytest.raises(KeyError, match="not downloaded"):
        flatten({"m": Lazy(a=torch.ones(1))})


def test_a_header_that_lists_an_empty_tensor_after_another_at_its_offset_parses() -> None:
    """helper-62: specs already in file order are not sorted, but two at one offset (an empty
    tensor beside another) were left in header order, and a header listing the empty one second
    was refused as an overlap; safetensors loads it. Both parsers take it."""
    from unittest import mock

    header = json.dumps(
        {
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
        },
        separators=(",", ":"),
    ).encode()
    for native in (st.native, None):
        with mock.patch.object(st, "native", native):
            layout = st.parse(header, 8 + len(header) + 8, "f")
        assert [s.key for s in layout.tensors] == ["a", "b"]


def test_the_density_rule_counts_values_outside_strings_in_one_pass() -> None:
    """helper-71: commas in a string (labels as CSV) counted as JSON values, and a state holding
    150,000 small ints was refused on load after its commit. helper-73: the first fix's regex,
    on a hostile header with a string left open, restarted at every later quote (hours for a
    1 MB header, the GIL held). The values outside strings are counted; an unterminated string
    runs to the end; the values before it still count."""
    many = 1_100_000
    assert st.dense(json.dumps({"labels": "," * many}).encode()) is None
    assert st.dense(json.dumps([0] * 150_000).encode()) is None
    assert st.dense(json.dumps([0] * many).encode()) == many + 0  # (its commas and its bracket)
    assert st.dense(b'["' + b'\\"' * 200_000 + b"," * many) is None  # open to the end: one string
    assert st.dense(b"[" + b"1," * many + b'"' + b'\\"' * 200_000) == many + 1
    assert st.dense(b"[" + b"1," * many + b'"' + b'\\"' * 200_000 + b"\\") == many + 1  # (a lone backslash last: helper-75)
