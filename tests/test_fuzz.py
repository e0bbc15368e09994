"""Fuzzing every reader: any input loads in bounds or raises the library's FormatError.

Covered: the manifest parser (raw bytes, and valid manifests with fields replaced by arbitrary
JSON), and the whole load path of a committed checkpoint whose manifest or shard is damaged (bit
flips, truncation, zeroed 4 KiB blocks, random overwrites). The safetensors header parser has its
own property in test_formats.py. Set AIOTENSOR_FUZZ_EXAMPLES for a long campaign (bench/results/
reliability.md records one).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from aiotensor import TensorStore
from aiotensor._io import read as read_module
from aiotensor.errors import FormatError, ManifestError
from aiotensor.formats import checksum
from aiotensor.formats import manifest as mf
from aiotensor.formats.tree import unflatten

from .conftest import assert_state_equal, manifest_rows, set_manifest_rows

EXAMPLES = int(os.environ.get("AIOTENSOR_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def the_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(300, generator=g)
    return {
        "model": {"w": w, "tied": w, "h": torch.randn(10, 10, generator=g).half(), "i": torch.arange(5)},
        "optim": {"step": 3, "lrs": [0.1, (1, "a")], "none": None},
    }


_CACHE: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def _remove_what_was_made_once() -> Iterator[None]:
    """The files written once for this module's tests (``_CACHE``) go with it: they were left in
    the temporary folder, three more each run (helper-25's trial)."""
    yield
    for path in _CACHE.values():
        shutil.rmtree(path if os.path.isdir(path) else os.path.dirname(path), ignore_errors=True)
    _CACHE.clear()


def committed_checkpoint() -> str:
    """A committed checkpoint folder, written once per test session."""
    if "root" not in _CACHE:
        root = tempfile.mkdtemp(prefix="aiotensor-fuzz-")

        async def main() -> None:
            async with TensorStore(root) as s:
                await s.save(1, the_state())

        anyio.run(main)
        _CACHE["root"] = root
    return os.path.join(_CACHE["root"], "step-000000000001")


def load_copy(files: dict[str, bytes]) -> Any:
    """Write a checkpoint folder holding ``files`` and load it with a store."""
    root = tempfile.mkdtemp(prefix="aiotensor-fuzz-case-")
    try:
        folder = os.path.join(root, "step-000000000001")
        os.mkdir(folder)
        for name, data in files.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)

        async def main() -> Any:
            async with TensorStore(root) as s:
                return await s.load(1)

        return anyio.run(main)
    finally:
        shutil.rmtree(root)


def original_files() -> dict[str, bytes]:
    folder = committed_checkpoint()
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


@hs.composite
def damage(draw: hs.DrawFn) -> tuple[str, str, int, bytes]:
    name = draw(hs.sampled_from(sorted(original_files())))
    kind = draw(hs.sampled_from(["flip", "truncate", "zero-block", "overwrite", "insert"]))
    size = len(original_files()[name])
    pos = draw(hs.integers(0, size - 1))
    data = draw(hs.binary(min_size=1, max_size=64)) if kind in ("overwrite", "insert") else b""
    if kind == "flip":
        data = bytes([1 << draw(hs.integers(0, 7))])
    return name, kind, pos, data


def apply(files: dict[str, bytes], name: str, kind: str, pos: int, data: bytes) -> dict[str, bytes]:
    b = bytearray(files[name])
    if kind == "flip":
        b[pos] ^= data[0]
    elif kind == "truncate":
        del b[pos:]
    elif kind == "zero-block":
        start = pos - pos % 4096
        b[start : start + 4096] = bytes(len(b[start : start + 4096]))
    elif kind == "overwrite":
        b[pos : pos + len(data)] = data
    else:
        b[pos:pos] = data
    return {**files, name: bytes(b)}


@FUZZ
@given(damage())
def test_damaged_checkpoint_loads_exactly_or_raises_format_error(case: tuple[str, str, int, bytes]) -> None:
    name, kind, pos, data = case
    files = apply(original_files(), name, kind, pos, data)
    try:
        got = load_copy(files)
    except FormatError as e:
        assert any(f in str(e) for f in files), str(e)  # the error names a file of the checkpoint
        return
    # it loaded: the damage hit bytes that carry no data (padding, a JSON space, ...)
    assert_state_equal(the_state(), got)


@FUZZ
@given(hs.binary(max_size=2000))
def test_any_bytes_as_a_manifest_raise_manifest_error(data: bytes) -> None:
    try:
        m = mf.loads(data, "m.json")
    except ManifestError:
        return
    unflatten(m.tree, lambda k: k, "m.json")


_LEAF = (
    hs.none()
    | hs.booleans()
    | hs.integers(-(2**70), 2**70)
    | hs.floats(allow_nan=False, allow_infinity=False)
    | hs.text(max_size=20)
)
# two levels of nesting, spelled out (hs.recursive raised a spurious deprecation warning in a long run)
JSON = (
    _LEAF | hs.lists(_LEAF, max_size=4) | hs.dictionaries(hs.text(max_size=10), _LEAF | hs.lists(_LEAF, max_size=3), max_size=4)
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


@FUZZ
@given(hs.data())
def test_valid_manifest_with_any_field_replaced_raises_manifest_error_or_loads(data: hs.DataObject) -> None:
    doc = json.loads(original_files()["manifest.json"])
    path = data.draw(hs.sampled_from(_paths(doc)[1:]))
    value = data.draw(JSON)
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    try:
        m = mf.loads(mf.seal(doc), "m.json")
        unflatten(m.tree, lambda k: torch.zeros(1), "m.json")
    except ManifestError:
        pass


def test_a_manifest_claiming_a_huge_tensor_allocates_nothing(tmp_path: Any) -> None:
    """A hostile manifest that lists a terabyte tensor (and a matching shard size) is refused
    before anything is allocated: shard sizes are checked against the files first."""
    files = original_files()
    doc = json.loads(files["manifest.json"])
    shard = doc["shards"][0]["file"]
    doc["shards"][0]["size"] = (1 << 40) + 4096
    rows = manifest_rows(doc)
    for entry in rows.values():
        if entry["shard"] == shard:
            entry.update(shape=[1 << 38], nbytes=1 << 40, dtype="F32", offset=4096)
            break
    set_manifest_rows(doc, rows)
    files["manifest.json"] = mf.seal(doc)
    with pytest.raises(ManifestError, match="does not hold the tensors the manifest lists"):
        load_copy(files)


def test_a_manifest_pointing_two_tensors_at_the_same_bytes_is_refused(tmp_path: Any) -> None:
    """The shard's header is compared with the one the manifest's entries make, which holds their
    keys, dtypes and shapes but no offsets: the offsets must run on from the header with no gap
    or overlap. Here a tensor's bytes are said to be its neighbour's (the header stays the same)."""
    files = original_files()
    doc = json.loads(files["manifest.json"])
    shard = doc["shards"][0]["file"]
    rows = manifest_rows(doc)
    mine = sorted((e["offset"], k) for k, e in rows.items() if e["shard"] == shard)
    assert len(mine) >= 2
    rows[mine[1][1]]["offset"] = mine[0][0]
    set_manifest_rows(doc, rows)
    files["manifest.json"] = mf.seal(doc)
    with pytest.raises(ManifestError, match="does not hold the tensors the manifest lists"):
        load_copy(files)


@pytest.mark.parametrize("recorded", [True, False])
def test_a_shards_header_is_checked_by_its_recorded_crc_else_rebuilt(recorded: bool, monkeypatch: Any) -> None:
    """Each shard's ``header_crc32c`` is the crc32c of its header (length prefix to padding). A
    header that is not the one written (another crc, or none recorded) is rebuilt from the entries
    and compared, then parsed: the same tensors under other metadata still load, a renamed one not."""
    files = original_files()
    doc = json.loads(files["manifest.json"])
    shard = doc["shards"][0]["file"]
    raw = files[shard]
    assert doc["shards"][0]["header_crc32c"] == checksum.crc32c(raw[: 8 + struct.unpack("<Q", raw[:8])[0]])
    if recorded:  # its header is taken as written, not rebuilt from the entries
        with monkeypatch.context() as m:
            m.setattr(read_module, "shard_header", lambda specs: pytest.fail("the header was rebuilt"))
            assert_state_equal(load_copy(files), the_state())
    else:  # a version 1 manifest: no header crcs, its tensors an object of objects
        for s in doc["shards"]:
            del s["header_crc32c"]
        rows = manifest_rows(doc)
        doc = {("tensors" if k == "table" else k): (rows if k == "table" else v) for k, v in doc.items()}
        doc["version"] = 1
        files["manifest.json"] = mf.seal(doc)
    assert_state_equal(load_copy(files), the_state())
    other = raw.replace(b'"format":"pt"', b'"format":"np"', 1)
    assert other != raw
    assert_state_equal(load_copy({**files, shard: other}), the_state())
    renamed = raw.replace(b'"model.h"', b'"model.H"', 1)
    assert renamed != raw
    with pytest.raises(ManifestError, match="does not hold the tensors the manifest lists"):
        load_copy({**files, shard: renamed})


@pytest.mark.parametrize("version", [0, 4, True, "3"])
def test_a_manifest_of_another_version_is_refused(version: Any) -> None:
    files = original_files()
    doc = json.loads(files["manifest.json"])
    doc["version"] = version
    with pytest.raises(ManifestError, match=r"is not supported \(this aiotensor reads 1, 2 and 3\)"):
        mf.loads(mf.seal(doc), "m.json")
    if type(version) is int:  # a listing reads the version from the first bytes
        with pytest.raises(ManifestError, match="is not supported"):
            mf.sealed_step(mf.seal(doc), "m.json")


# --- torch.save zips and DCP checkpoints (issue 22: the readers of files aiotensor did not write) ---


def _torch_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(64, generator=g)
    return {"w": base, "view": base[8:24], "col": torch.randn(6, 5, generator=g).t(), "i": torch.arange(9), "meta": {"lr": 0.1}}


def _torch_bytes() -> bytes:
    if "torch" not in _CACHE:
        path = os.path.join(tempfile.mkdtemp(prefix="aiotensor-fuzz-pt-"), "s.pt")
        torch.save(_torch_state(), path)
        _CACHE["torch"] = path
    with open(_CACHE["torch"], "rb") as f:
        return f.read()


@hs.composite
def _bytes_damage(draw: hs.DrawFn, size: int) -> tuple[str, int, bytes]:
    kind = draw(hs.sampled_from(["flip", "truncate", "zero-block", "overwrite", "insert"]))
    pos = draw(hs.integers(0, size - 1))
    data = draw(hs.binary(min_size=1, max_size=64)) if kind in ("overwrite", "insert") else b""
    if kind == "flip":
        data = bytes([1 << draw(hs.integers(0, 7))])
    return kind, pos, data


@FUZZ
@given(hs.data())
def test_a_damaged_torch_save_file_loads_exactly_or_raises_format_error(data: hs.DataObject) -> None:
    from aiotensor import load_torch

    original = _torch_bytes()
    kind, pos, extra = data.draw(_bytes_damage(len(original)))
    damaged = apply({"s.pt": original}, "s.pt", kind, pos, extra)["s.pt"]
    folder = tempfile.mkdtemp(prefix="aiotensor-fuzz-case-")
    try:
        path = os.path.join(folder, "s.pt")
        with open(path, "wb") as f:
            f.write(damaged)
        try:
            got = anyio.run(load_torch, path)
        except FormatError as e:
            assert path in str(e), str(e)
            return
        # it loaded: the damage hit bytes no reader uses (a timestamp, a comment...): values exact,
        # as checked by each storage's zip CRC-32 (torch.load never checks them)
        assert_state_equal(_torch_state(), got)
    finally:
        shutil.rmtree(folder)


def _dcp_folders() -> dict[str, str]:
    """A DCP checkpoint of each writer (aiotensor's, DCP's own FileSystemWriter), written once."""
    if "dcp" not in _CACHE:
        import warnings

        import torch.distributed.checkpoint as dcp

        from aiotensor.dcp import AiotensorWriter

        root = tempfile.mkdtemp(prefix="aiotensor-fuzz-dcp-")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(_dcp_state(), storage_writer=AiotensorWriter(os.path.join(root, "ours")))
            dcp.save(_dcp_state(), checkpoint_id=os.path.join(root, "theirs"))
        _CACHE["dcp"] = root
    return {k: os.path.join(_CACHE["dcp"], k) for k in ("ours", "theirs")}


def _dcp_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"model": {"w": torch.randn(20, 7, generator=g), "b": torch.arange(7.0)}, "step": 4, "lrs": [0.5, 0.25]}


@FUZZ
@given(hs.data())
def test_a_damaged_dcp_checkpoint_loads_exactly_or_raises_format_error(data: hs.DataObject) -> None:
    from aiotensor.dcp import load_full

    writer = data.draw(hs.sampled_from(["ours", "theirs"]))
    src = _dcp_folders()[writer]
    name = data.draw(hs.sampled_from(sorted(os.listdir(src))))
    with open(os.path.join(src, name), "rb") as f:
        original = f.read()
    kind, pos, extra = data.draw(_bytes_damage(len(original)))
    folder = tempfile.mkdtemp(prefix="aiotensor-fuzz-case-")
    try:
        case = os.path.join(folder, writer)
        shutil.copytree(src, case)
        with open(os.path.join(case, name), "wb") as f:
            f.write(apply({name: original}, name, kind, pos, extra)[name])
        try:
            got = load_full(case)
        except FormatError as e:
            assert case in str(e), str(e)
            return
        except FileNotFoundError as e:  # DCP's own metadata pickle carries no checksum: a flip there
            # can name another data file (hypothesis found 'relative_path', a field name), missing
            assert writer == "theirs" and name == ".metadata" and case in str(e), str(e)
            return
        if writer == "ours":  # sealed metadata, a crc32c per item: whatever loads is exact
            assert_state_equal(_dcp_state(), got)
        elif name != ".metadata":  # DCP's own: each tensor a zip whose CRC-32s are checked (its metadata
            # pickle and its pickled values carry no checksum: a flip there can change them silently)
            want = _dcp_state()["model"]
            assert all(torch.equal(got["model"][k], v) for k, v in want.items())
    finally:
        shutil.rmtree(folder)


@FUZZ
@given(hs.binary(max_size=3000))
def test_any_bytes_as_dcp_metadata_raise_format_error_or_describe(data: bytes) -> None:
    from aiotensor.formats import dcp_metadata as dm

    for loads in (dm.loads_json, lambda b, p: dm.loads_pickle(b, p)[1]):
        try:
            d = loads(data, "m")
        except FormatError:
            continue
        dm.check(d, lambda name: 1 << 20, "m")  # or raises ManifestError: never another exception


@FUZZ
@given(hs.data())
def test_valid_dcp_metadata_with_any_field_replaced_is_refused_or_loads(data: hs.DataObject) -> None:
    from aiotensor.dcp import load_full
    from aiotensor.formats import dcp_metadata as dm

    src = _dcp_folders()["ours"]
    with open(os.path.join(src, dm.JSON_NAME), "rb") as f:
        doc = json.loads(f.read())
    path = data.draw(hs.sampled_from(_paths(doc)[1:]))
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = data.draw(JSON)
    folder = tempfile.mkdtemp(prefix="aiotensor-fuzz-case-")
    try:
        case = os.path.join(folder, "ours")
        shutil.copytree(src, case)
        with open(os.path.join(case, dm.JSON_NAME), "wb") as f:
            f.write(mf.seal(doc))  # sealed: a crafted file, not a corrupt one
        try:
            load_full(case)
        except FormatError:
            pass
        except FileNotFoundError as e:  # a data file it names is not there (as a manifest's missing shard)
            assert "is missing" in str(e), e
    finally:
        shutil.rmtree(folder)
