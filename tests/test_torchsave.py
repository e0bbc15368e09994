"""torch.save files read without unrestricted pickle (issue 13, RELIABILITY 12): golden files from the
real torch.save, and hostile ones that must run nothing."""

from __future__ import annotations

import collections
import io
import os
import struct
import zipfile
from collections import OrderedDict
from typing import Any

import anyio
import pytest
import torch

from aiotensor import load_into, load_torch, stream
from aiotensor.errors import ChecksumError, UnsafeFileError

from .conftest import assert_state_equal
from .test_newuser import ALL_DTYPES, raw

pytestmark = pytest.mark.anyio


async def test_every_dtype_and_a_real_state_dict_from_torch_save(tmp_path: Any) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    base = torch.arange(20.0)
    state = {
        "model": model.state_dict(),
        "dtypes": {str(d): raw(d, (3, 4), i) for i, d in enumerate(ALL_DTYPES)},
        "view": base[3:9],  # shares its storage with `base`, at an offset
        "base": base,
        "strided": base.view(4, 5).t(),  # not contiguous: cut out of its storage
        "param": torch.nn.Parameter(torch.ones(3)),
        "meta": {"step": 7, "lr": 0.1, "names": ["a", "b"], "pair": (1, 2)},
    }
    torch.save(state, tmp_path / "s.pt")
    got = await load_torch(tmp_path / "s.pt")
    ref = torch.load(tmp_path / "s.pt", weights_only=True)
    assert type(got["model"]) is OrderedDict and got["model"]._metadata == ref["model"]._metadata
    got["param"] = got["param"].detach()
    ref["param"] = ref["param"].detach()
    assert_state_equal(ref, got)
    names = [n async for n, _ in stream(tmp_path / "s.pt", keys=["model.0.weight", "dtypes."])]
    assert sorted(names) == sorted(["model.0.weight", *(f"dtypes.{d}" for d in ALL_DTYPES)])


class Evil:
    def __reduce__(self) -> Any:
        return (os.system, ("touch pwned",))


def _rezip(src: str, dst: str, replace: dict[str, bytes] | None = None, compress: str | None = None) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = (replace or {}).get(info.filename.split("/", 1)[1], zin.read(info))
            kind = zipfile.ZIP_DEFLATED if compress and info.filename.endswith(compress) else zipfile.ZIP_STORED
            zout.writestr(info.filename, data, compress_type=kind)


async def test_hostile_torch_save_files_run_nothing(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.ones(4), "x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeFileError, match="posix.system|os.system"):
        await load_torch(tmp_path / "evil.pt")
    assert not (tmp_path / "pwned").exists()
    torch.save({"w": torch.ones(1000)}, tmp_path / "ok.pt")
    _rezip(str(tmp_path / "ok.pt"), str(tmp_path / "deflated.pt"), compress="data/0")
    with pytest.raises(UnsafeFileError, match="compressed"):
        await load_torch(tmp_path / "deflated.pt")
    _rezip(str(tmp_path / "ok.pt"), str(tmp_path / "short.pt"), replace={"data/0": b"\0" * 100})
    with pytest.raises(UnsafeFileError, match="declares 4000 bytes but its entry holds 100"):
        await load_torch(tmp_path / "short.pt")
    # a tensor claiming more of its storage than there is
    buf = io.BytesIO()
    torch.save({"w": torch.ones(10)}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        name = next(n for n in z.namelist() if n.endswith("data.pkl"))
        pkl = z.read(name).replace(b"K\n\x85", b"Kc\x85", 1)  # size (10,) -> (99,): past its 10-float storage
    (tmp_path / "ten.pt").write_bytes(buf.getvalue())
    _rezip(str(tmp_path / "ten.pt"), str(tmp_path / "past.pt"), replace={"data.pkl": pkl})
    with pytest.raises(UnsafeFileError, match="past the end of storage"):
        await load_torch(tmp_path / "past.pt")
    (tmp_path / "junk.pt").write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(UnsafeFileError, match="not a torch.save zip"):
        await load_torch(tmp_path / "junk.pt")


async def test_tensors_whose_dotted_names_collide_stay_distinct(tmp_path: Any) -> None:
    from safetensors.torch import load_file as st_load

    from aiotensor.cli import main

    state = {"a.b": torch.zeros(3), "a": {"b": torch.ones(3)}, 1: torch.full((2,), 7.0), "1": torch.full((2,), 8.0)}
    torch.save(state, tmp_path / "c.pt")
    got = await load_torch(tmp_path / "c.pt")
    assert_state_equal(got, torch.load(tmp_path / "c.pt", weights_only=True))  # each tensor its own values
    streamed = {n: t async for n, t in stream(tmp_path / "c.pt")}
    assert sorted(streamed) == ["1", "1#2", "a.b", "a.b#2"]  # named as TensorStore.save names them
    assert sorted(float(t[0]) for t in streamed.values()) == [0.0, 1.0, 7.0, 8.0]
    assert await anyio.to_thread.run_sync(main, ["convert", str(tmp_path / "c.pt"), str(tmp_path / "c.safetensors")]) == 0
    assert {k: float(t[0]) for k, t in st_load(tmp_path / "c.safetensors").items()} == {
        n: float(t[0]) for n, t in streamed.items()
    }


async def test_conj_and_neg_views_read_as_torch_load_reads_them(tmp_path: Any) -> None:
    # torch.save keeps x.conj() as x's storage plus a conj bit (and a negative view as a neg bit):
    # ignoring the bits reads the wrong values, silently
    x = torch.randn(2, 3, dtype=torch.complex64)
    r = torch.randn(5)
    state = {"x": x, "x_conj": x.conj(), "neg": torch._neg_view(r), "r": r}
    torch.save(state, tmp_path / "m.pt")
    want = {k: v.resolve_conj().resolve_neg() for k, v in torch.load(tmp_path / "m.pt", weights_only=True).items()}
    assert not torch.equal(want["x_conj"], x) and not torch.equal(want["neg"], r)

    got = await load_torch(tmp_path / "m.pt")
    assert got["x_conj"].is_conj() and got["x_conj"].untyped_storage().data_ptr() == got["x"].untyped_storage().data_ptr()
    assert_state_equal({k: v.resolve_conj().resolve_neg() for k, v in got.items()}, want)  # as torch.load: views, one storage
    async with stream(tmp_path / "m.pt") as s:
        streamed = {k: v.resolve_conj().resolve_neg() async for k, v in s}
    assert_state_equal(streamed, want)
    module = torch.nn.Module()
    for k, v in want.items():
        module.register_buffer(k, torch.zeros_like(v))
    await load_into(module, tmp_path / "m.pt")
    assert_state_equal(dict(module.state_dict()), want)


async def test_parameters_come_back_as_parameters_as_torch_load_gives_them(tmp_path: Any) -> None:
    lin = torch.nn.Linear(3, 2)
    state = {
        "w": lin.weight,
        "tied": lin.weight,
        "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "t": torch.ones(1),
    }
    torch.save(state, tmp_path / "m.pt")
    want = torch.load(tmp_path / "m.pt", weights_only=True)
    got = await load_torch(tmp_path / "m.pt")
    assert {k: (type(v), v.requires_grad) for k, v in got.items()} == {k: (type(v), v.requires_grad) for k, v in want.items()}
    assert type(got["w"]) is torch.nn.Parameter and got["w"] is got["tied"]  # one object, as the pickle shares it
    assert_state_equal({k: v.detach() for k, v in got.items()}, {k: v.detach() for k, v in want.items()})


async def test_counters_sizes_and_bytes_read_as_torch_load_reads_them(tmp_path: Any) -> None:
    # what torch.load(weights_only=True) admits in a state: a MultiStepLR state (its Counter), a
    # torch.Size, bytes (pickled through _codecs.encode); a bare storage is refused, not leaked
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    state = {
        "sched": torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4, 4]).state_dict(),
        "shape": torch.Size([2, 3]),
        "blob": b"\x00\xffbytes",
        "w": torch.ones(2),
    }
    torch.save(state, tmp_path / "m.pt")
    want = torch.load(tmp_path / "m.pt", weights_only=True)
    got = await load_torch(tmp_path / "m.pt")
    assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in want.items()}
    assert type(got["sched"]["milestones"]) is collections.Counter and got["sched"] == want["sched"]
    assert got["shape"] == want["shape"] and got["blob"] == want["blob"] and torch.equal(got["w"], want["w"])
    torch.save({"s": torch.ones(2).untyped_storage()}, tmp_path / "s.pt")
    with pytest.raises(UnsafeFileError, match="bare storage") as e:
        await load_torch(tmp_path / "s.pt")
    assert e.value.path == str(tmp_path / "s.pt")  # (it named no file: helper-50)


async def test_load_torch_of_other_than_a_torch_save_zip_says_so(tmp_path: Any) -> None:
    """helper-50: a legacy torch.save file, or junk, given to load_torch was a HeaderError about a
    safetensors header (its docstring: UnsafeFileError, not a torch.save zip)."""
    torch.save({"a": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    (tmp_path / "junk.pt").write_bytes(b"hello world, not a zip")
    with pytest.raises(UnsafeFileError, match="not a torch.save zip: the file is a pickle .a legacy torch.save"):
        await load_torch(tmp_path / "legacy.pt")
    with pytest.raises(UnsafeFileError, match="not a torch.save zip"):
        await load_torch(tmp_path / "junk.pt")


@pytest.mark.parametrize("protocol", [2, 4])
async def test_python_values_torch_load_admits_read_as_it_reads_them(tmp_path: Any, protocol: int) -> None:
    """helper-39: a set, complex, bytearray, torch.device, layout or qscheme in a state (a device in
    a saved config) was refused (UnsafeFileError) where torch.load(weights_only=True) loads them
    (from the default protocol 2; torch's own reader refuses protocol 4's opcodes); a bytearray
    of a size (bytearray(10**12) would allocate it) and a device of anything but a name and an
    index are still refused."""
    state = {
        "set": {1, 2}, "complex": complex(1, 2), "bytearray": bytearray(b"x\0y"), "device": torch.device("cuda", 1),
        "cpu": torch.device("cpu"), "layout": torch.strided, "qscheme": torch.per_tensor_affine, "w": torch.ones(2),
    }  # fmt: skip
    torch.save(state, tmp_path / "m.pt", pickle_protocol=protocol)
    want = torch.load(tmp_path / "m.pt", weights_only=True) if protocol == 2 else state
    got = await load_torch(tmp_path / "m.pt")
    assert {k: (type(v), v) for k, v in got.items() if k != "w"} == {k: (type(v), v) for k, v in want.items() if k != "w"}
    assert torch.equal(got["w"], want["w"])
    for name, args in (("bytearray", b"J\x00\x10\xa5\xd4\x85"), ("device", b"X\x03\x00\x00\x00cpuX\x01\x00\x00\x00x\x86")):
        pkl = b"\x80\x02}X\x01\x00\x00\x00xc__builtin__\n" if name == "bytearray" else b"\x80\x02}X\x01\x00\x00\x00xctorch\n"
        pkl += name.encode() + b"\n" + args + b"Rs."
        torch.save({"w": torch.ones(1)}, tmp_path / "ok.pt")
        _rezip(str(tmp_path / "ok.pt"), str(tmp_path / f"{name}.pt"), replace={"data.pkl": pkl})
        with pytest.raises(UnsafeFileError, match="refused"):
            await load_torch(tmp_path / f"{name}.pt")


async def test_the_values_torch_load_admits_are_made_within_bounds_and_errors_are_typed(tmp_path: Any) -> None:
    """helper-41's review of the admitted values: a set hashes its members as they go in (a tuple a
    million deep overflowed the C stack, one shared with itself 40 times took 2**40 steps), a set
    of tensors came back as internal objects, an encoding or a huge int raised LookupError or
    OverflowError, a memo made 400 copies of a 1 MB bytearray from a 1 MB pickle, and a torch
    global looked up by name imported torch._dynamo."""
    import pickle
    import sys

    class R:
        def __init__(self, f: Any, *a: Any) -> None:
            self.f, self.a = f, a

        def __reduce__(self) -> Any:
            return (self.f, self.a)

    t: Any = "x"
    for _ in range(40):
        t = (t, t)
    shared = pickle.dumps(t, protocol=2)[2:-1]
    big = b"a" * (1 << 20)
    cases = {
        "deep": b"\x80\x02c__builtin__\nset\nX\x01\x00\x00\x00x" + b"\x85" * 100_000 + b"\x85\x85R.",
        "shared": b"\x80\x02c__builtin__\nset\n" + shared + b"\x85\x85R.",
        "encoding": pickle.dumps({"x": R(bytearray, "abc", "rot13")}, protocol=2),
        "overflow": pickle.dumps({"x": R(complex, 10**400)}, protocol=2),
        "copies": pickle.dumps({"x": [R(bytearray, big) for _ in range(40)]}, protocol=4),  # (one big, memoized)
        "dynamo": b"\x80\x02}X\x01\x00\x00\x00xctorch.serialization\n_get_layout\nX\x0c\x00\x00\x00torch._dynamo\x85Rs.",
    }
    torch.save({"w": torch.ones(1)}, tmp_path / "ok.pt")
    had_dynamo = "torch._dynamo" in sys.modules
    for name, pkl in cases.items():
        _rezip(str(tmp_path / "ok.pt"), str(tmp_path / f"{name}.pt"), replace={"data.pkl": pkl})
        with pytest.raises(UnsafeFileError):
            await load_torch(tmp_path / f"{name}.pt")
    assert had_dynamo or "torch._dynamo" not in sys.modules
    for protocol in (2, 4):  # a set of tensors: refused, never handed out as what describes them
        torch.save({"s": {torch.ones(2)}}, tmp_path / "s.pt", pickle_protocol=protocol)
        with pytest.raises(UnsafeFileError, match="set"):
            await load_torch(tmp_path / "s.pt")


def _deep_and_shared() -> tuple[bytes, bytes]:
    """A tuple a million deep, and one shared with itself 40 times over (each pickled as it is
    pushed on the unpickler's stack, no PROTO or STOP)."""
    import pickle

    t: Any = "x"
    for _ in range(40):
        t = (t, t)
    return b"K\x01" + b"\x85" * 1_000_000, pickle.dumps(t, protocol=2)[2:-1]


@pytest.mark.parametrize(
    "case",
    [
        "dict key", "shared dict key", "set member", "frozenset", "OrderedDict pairs", "Counter", "shared Counter", "BUILD",
        "frame in a frame", "across a frame's end", "GET of a NUL", "Counter of sizes", "persistent id", "device",
        "negative memo key", "memo key far ahead",
    ],
)  # fmt: skip
async def test_what_the_unpickler_would_hash_is_bounded_before_it_runs(tmp_path: Any, case: str) -> None:
    """The C unpickler hashes dict keys and set members as they go in, before any hook sees them,
    and a tuple's hash recurses without a check: a key a million deep crashed the process (SIGSEGV,
    as torch.load(weights_only=True) still does) and one shared with itself 40 times over hashed
    for ever, by a dict, a protocol-4 set or frozenset, Counter or OrderedDict (docs/security.md's
    "known, open" of stop 57). Each is refused, typed, before anything is unpickled."""
    deep, shared = _deep_and_shared()
    pkl = {
        "dict key": b"\x80\x02}" + deep + b"K\x01s.",
        "shared dict key": b"\x80\x02}" + shared + b"K\x01s.",
        "set member": b"\x80\x04\x8f(" + deep + b"\x90.",
        "frozenset": b"\x80\x04(" + deep + b"\x91.",
        "OrderedDict pairs": b"\x80\x02ccollections\nOrderedDict\n](" + deep + b"K\x01\x86a\x85R.",
        "Counter": b"\x80\x02ccollections\nCounter\n](" + deep + b"e\x85R.",
        "shared Counter": b"\x80\x02ccollections\nCounter\n](" + shared + b"e\x85R.",
        # an object changed by a BUILD after the memo handed it out (as a key, its hash was counted
        # when it went in: changed, it would cost more each time it is hashed again)
        "BUILD": b"\x80\x02ccollections\nOrderedDict\n)Rq\x01h\x01}b.",
        # helper-48: where the C unpickler reads other bytes than a model reading straight through
        # (a frame's buffer; a text GET cut at its NUL), and values handed to code that hashes or
        # prints them (a Counter of one torch.Size 1,000 long named 5,000 times; an error message's
        # repr of a persistent id or a device's arguments shared 2**40 times over)
        "frame in a frame": b"\x80\x04\x95"
        + struct.pack("<Q", 10)
        + b"\x95"
        + struct.pack("<Q", len(deep) + 6)
        + b"."
        + b"}"
        + deep
        + b"K\x01s.",
        "across a frame's end": b"\x80\x04\x95" + struct.pack("<Q", 3) + b"J\x00\x00\x00.\x00\x000}" + deep + b"K\x01s.",
        "GET of a NUL": b"\x80\x02K\x01p0\n0g0\x00x\n0}" + deep + b"K\x01s.",
        "Counter of sizes": b"\x80\x02ccollections\nCounter\nctorch\nSize\n("
        + b"K\x01" * 1000
        + b"t\x85Rq\x010]("
        + b"h\x01" * 5000
        + b"e\x85R.",
        "persistent id": b"\x80\x02" + shared + b"Q.",
        "device": b"\x80\x02ctorch\ndevice\n" + shared + b"\x85R.",
        # a text PUT of -1 (the C unpickler's error): the model's memo, a list, must not take it as its last key
        "negative memo key": b"\x80\x02}" + shared + b"p41\n0K\x01p-1\n0g41\nK\x01s.",
        # a 12-byte pickle whose one PUT names key 2**27: the C unpickler makes room for it, 2.3 GB (helper-53)
        "memo key far ahead": b"\x80\x02}r" + struct.pack("<I", 1 << 27) + b".",
    }[case]
    torch.save({"w": torch.ones(1)}, tmp_path / "ok.pt")
    _rezip(str(tmp_path / "ok.pt"), str(tmp_path / "h.pt"), replace={"data.pkl": pkl})
    with pytest.raises(UnsafeFileError, match="refused"):
        await load_torch(tmp_path / "h.pt")


async def test_tuple_keys_and_values_torch_load_reads_are_read(tmp_path: Any) -> None:
    """What the bound admits: tuples as keys and in sets, nested a little, shared a little, and a
    MultiStepLR's Counter, as torch.load(weights_only=True) reads them."""
    pair = (1, ("a", 2.5))
    state = {
        "w": torch.ones(2), "by_pair": {pair: torch.zeros(1), (pair, pair): 3}, "od": OrderedDict([(pair, 1)]),
        "milestones": collections.Counter([pair, pair, 7]), "nested": {((((1,),),),): "deep enough"},
    }  # fmt: skip
    torch.save(state, tmp_path / "t.pt")
    want = torch.load(tmp_path / "t.pt", weights_only=True)
    got = await load_torch(tmp_path / "t.pt")
    assert {k: v for k, v in got.items() if k not in ("w", "by_pair")} == {
        k: v for k, v in want.items() if k not in ("w", "by_pair")
    }
    assert got["by_pair"][(pair, pair)] == 3 and torch.equal(got["by_pair"][pair], want["by_pair"][pair])


async def test_a_parameter_with_attributes_and_complex128_read_as_torch_load_reads_them(tmp_path: Any) -> None:
    p = torch.nn.Parameter(torch.randn(2, 3))
    p.tensor_model_parallel, p.partition_dim, p.note = True, 0, ["a", 1]  # Megatron marks its parameters so
    state = {"w": p, "c": torch.randn(3, dtype=torch.complex128)}
    torch.save(state, tmp_path / "m.pt")
    want = torch.load(tmp_path / "m.pt", weights_only=True)
    got = await load_torch(tmp_path / "m.pt")
    assert type(got["w"]) is torch.nn.Parameter and torch.equal(got["w"], want["w"])
    assert (got["w"].tensor_model_parallel, got["w"].partition_dim, got["w"].note) == (True, 0, ["a", 1])
    assert got["c"].dtype == torch.complex128 and torch.equal(got["c"], want["c"])
    q = torch.nn.Parameter(torch.ones(1))
    q.evil = torch.ones(1)  # an attribute that is a tensor: refused, not half-read
    torch.save({"q": q}, tmp_path / "q.pt")
    with pytest.raises(UnsafeFileError, match="attribute"):
        await load_torch(tmp_path / "q.pt")


@pytest.mark.parametrize("name", ["copy_", "data_ptr", "_backward_hooks", "big"])
async def test_parameter_attributes_that_are_not_new_plain_values_are_unsafe(tmp_path: Any, name: str) -> None:
    # a hostile file: an attribute that would shadow what a Parameter has, or a value a pickle
    # shares over and over (4 levels of one list 60 times: 13 million leaves from 2 KB, walked)
    p = torch.nn.Parameter(torch.zeros(2))
    if name == "big":
        v: Any = 0
        for _ in range(4):
            v = [v] * 60
        p.__dict__["shards"] = v
    else:
        p.__dict__[name] = 0  # what a hostile writer puts in the pickle, past Tensor's setters
    torch.save({"w": p}, tmp_path / "m.pt")
    assert (tmp_path / "m.pt").stat().st_size < 10_000
    with pytest.raises(UnsafeFileError, match="attribute"):
        await load_torch(tmp_path / "m.pt")


async def test_a_corrupt_storage_is_named_by_the_tensors_over_it(tmp_path: Any) -> None:
    """A torch.save zip checks a crc32 per storage record ("data/0"), which several tensors may
    view: the error names them, for every loader, not only the record."""
    state = {"a.weight": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(3)}
    state["a.view"] = state["a.weight"][2:4]  # the same storage
    path = tmp_path / "c.pt"
    torch.save(state, path)
    data = bytearray(path.read_bytes())
    info = next(i for i in zipfile.ZipFile(path).infolist() if i.filename.endswith("data/0"))
    data[info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + 5] ^= 1
    path.write_bytes(bytes(data))
    module = torch.nn.Module()
    module.register_buffer("b", torch.zeros(3))
    module.a = torch.nn.Module()
    module.a.register_buffer("weight", torch.zeros(8, 8))
    module.a.register_buffer("view", torch.zeros(2, 8))

    async def streamed() -> None:
        async with stream(path) as s:
            [_ async for _ in s]

    for load in (lambda: load_torch(path), streamed, lambda: load_into(module, path)):
        with pytest.raises(ChecksumError, match=r"record '0' \(the bytes of 'a.weight', 'a.view'\) is corrupt") as e:
            await load()
        assert e.value.key == "a.weight"


async def test_a_file_saved_without_crc32_loads_as_torch_load_loads_it(tmp_path: Any) -> None:
    """``torch.serialization.set_crc32_options(False)`` (faster saves) leaves every CRC-32 of the zip
    at 0: there is nothing to check, and every loader reads it as torch.load does. One flipped CRC
    in an otherwise checked file is still an error."""
    model = torch.nn.Linear(4, 3)
    path = tmp_path / "nocrc.pt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(model.state_dict(), path)
    finally:
        torch.serialization.set_crc32_options(True)
    assert all(i.CRC == 0 for i in zipfile.ZipFile(path).infolist())
    want = torch.load(path, weights_only=True)
    for verify in (True, False):
        assert_state_equal(await load_torch(path, verify=verify), want)
    async with stream(path) as s:
        assert_state_equal({n: t async for n, t in s}, want)
    fresh = torch.nn.Linear(4, 3)
    await load_into(fresh, path)
    assert_state_equal(fresh.state_dict(), want)
    from aiotensor.cli import main  # nothing was checked: verify says so (exit 3), never "OK"

    assert await anyio.to_thread.run_sync(main, ["verify", str(path)]) == 3
    checked = tmp_path / "checked.pt"
    torch.save(model.state_dict(), checked)
    data = bytearray(checked.read_bytes())
    with zipfile.ZipFile(checked) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
        central = z.start_dir  # the central directory, whose headers hold the CRC-32 that readers check
    at = data.index(info.orig_filename.encode(), central) - 46 + 16  # (the name at 46, the CRC-32 at 16)
    data[at : at + 4] = b"\0\0\0\0"
    checked.write_bytes(bytes(data))
    with pytest.raises(UnsafeFileError, match="Bad CRC-32 for file '.*data.pkl'"):
        await load_torch(checked)


async def test_a_big_endian_torch_save_file_is_refused_not_read_byte_swapped(tmp_path: Any) -> None:
    """torch.save on a big-endian host (s390x) records ``byteorder`` "big" and writes its storages so;
    torch.load swaps their bytes. aiotensor refuses such a file rather than hand out swapped values."""
    little = tmp_path / "le.pt"
    torch.save({"w": torch.arange(4, dtype=torch.float32)}, little)
    big = tmp_path / "be.pt"
    with zipfile.ZipFile(little) as zin, zipfile.ZipFile(big, "w") as z:
        for i in zin.infolist():
            data = zin.read(i.filename)
            if i.filename.endswith("/byteorder"):
                data = b"big"
            if i.filename.endswith("/data/0"):
                data = torch.arange(4, dtype=torch.float32).numpy().astype(">f4").tobytes()
            z.writestr(i.filename, data)
    assert torch.equal(torch.load(big, weights_only=True)["w"], torch.arange(4.0))
    with pytest.raises(UnsafeFileError, match="big-endian"):
        await load_torch(big)
    async with stream(big) as s:
        with pytest.raises(UnsafeFileError, match="big-endian"):
            [_ async for _ in s]
    assert_state_equal(await load_torch(little), {"w": torch.arange(4.0)})
    odd = tmp_path / "odd.pt"  # a record of 100 MB read whole was memory spent on a refusal
    with zipfile.ZipFile(little) as zin, zipfile.ZipFile(odd, "w") as z:
        for i in zin.infolist():
            z.writestr(i.filename, b"little" + b" " * 100 if i.filename.endswith("/byteorder") else zin.read(i.filename))
    with pytest.raises(UnsafeFileError, match="neither little nor big"):
        await load_torch(odd)


async def test_stream_dtype_keeps_a_negated_or_conjugated_view_s_values(tmp_path: Any) -> None:
    """helper-72: stream(dtype=) converted a view's whole storage and viewed the result, dropping
    torch's lazy neg and conj bits: z.conj().imag (a neg view) came back with its signs flipped."""
    z = torch.tensor([1 + 2j, 3 + 4j, 5 + 6j, 7 + 8j], dtype=torch.complex64)
    state = {
        "imag_of_conj": z.clone().conj().imag[:3],
        "neg": torch._neg_view(torch.arange(1.0, 9.0)[2:5]),
        "conj": z.clone()[1:3].conj(),
    }
    torch.save(state, tmp_path / "v.pt")
    want = {k: v.resolve_conj().resolve_neg() for k, v in state.items()}
    for rule in (torch.float64, lambda name, d: torch.complex128 if d == torch.complex64 else torch.float64):
        async with stream(tmp_path / "v.pt", dtype=rule) as s:
            got = {k: t async for k, t in s}
        for k, v in want.items():
            assert torch.equal(got[k].resolve_conj().resolve_neg(), v.to(got[k].dtype)), (k, rule)
