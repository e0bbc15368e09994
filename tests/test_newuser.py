"""What a new user hit (issue 10): plain OSErrors, conj/neg views, parameters as targets, every
safetensors dtype against the real `safetensors` package, checksummed single files, OrderedDicts,
clear errors, and a Snapshotter that never drops the last step silently."""

from __future__ import annotations

import errno
import json
import logging
import struct
import threading
from collections import OrderedDict
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file as st_load
from safetensors.torch import save_file as st_save

import aiotensor
from aiotensor import PosixEngine, Snapshotter, TensorStore, load_file, read_header, save_file
from aiotensor.errors import ChecksumError, HeaderError, StateError
from aiotensor.testing import FaultyEngine

from .conftest import assert_state_equal, bits

pytestmark = pytest.mark.anyio

NEW_DTYPES = [torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
ALL_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64, torch.uint64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
    *NEW_DTYPES,
]  # fmt: skip


def raw(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    n = int(torch.Size(shape).numel()) * dtype.itemsize
    r = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return (r % 2 if dtype == torch.bool else r).view(dtype).reshape(shape)


# --- item 2: one plain OSError ---------------------------------------------------------------------


class FullDisk(PosixEngine):
    """Every write after the first ``ok`` bytes fails with ENOSPC, in every worker at once."""

    def __init__(self, ok: int) -> None:
        super().__init__(direct=False)
        self.ok = ok
        self.written = 0
        self.lock = threading.Lock()

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        with self.lock:
            self.written += len(buf)
            full = self.written > self.ok
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().pwrite(fd, buf, offset)


async def test_a_full_disk_is_one_plain_oserror_naming_the_file(tmp_path: Any) -> None:
    state = {f"t{i}": torch.randn(1 << 16) for i in range(16)}  # 4 MiB in 256 KiB pieces over 4 workers
    async with TensorStore(tmp_path / "s", engine=FullDisk(1 << 20), chunk_bytes=1 << 18) as store:
        with pytest.raises(OSError) as ei:
            await store.save(1, state)
    assert type(ei.value) is OSError and ei.value.errno == errno.ENOSPC, repr(ei.value)
    assert "shard-00000.safetensors" in str(ei.value)
    sched = aiotensor.Scheduler(FullDisk(1 << 20), chunk_bytes=1 << 18)
    with pytest.raises(OSError) as ei:
        await save_file(state, tmp_path / "f.safetensors", scheduler=sched)
    assert type(ei.value) is OSError and ei.value.errno == errno.ENOSPC and "f.safetensors" in str(ei.value)


# --- item 3: conj/neg views are not their base -----------------------------------------------------


async def test_conj_and_neg_views_saved_beside_their_base_keep_their_values(tmp_path: Any) -> None:
    z = torch.randn(8, dtype=torch.complex64)
    f = torch.randn(8)
    state = {"z": z, "zc": z.conj(), "f": f, "fn": f._neg_view()}
    async with TensorStore(tmp_path) as store:
        await store.save(1, state)
        out = await store.load(1)
    assert torch.equal(out["zc"], z.conj()) and torch.equal(out["fn"], -f) and torch.equal(out["z"], z)
    await save_file(state, tmp_path / "f.safetensors")
    got = await load_file(tmp_path / "f.safetensors")
    assert torch.equal(got["zc"], z.conj()) and torch.equal(got["fn"], -f)


# --- item 4: parameters that require grad as targets ----------------------------------------------


async def test_into_parameters_that_require_grad(tmp_path: Any) -> None:
    src = torch.nn.Linear(64, 32)
    dst = torch.nn.Linear(64, 32)
    tied = {"a": dst.weight, "b": dst.weight}
    await save_file(dict(src.named_parameters()), tmp_path / "m.safetensors")
    for chunk in (4096, 1 << 20):  # row pieces through bounce slots, and whole tensors
        sched = aiotensor.Scheduler(chunk_bytes=chunk)
        await load_file(tmp_path / "m.safetensors", into=dict(dst.named_parameters()), scheduler=sched)
        assert torch.equal(dst.weight, src.weight) and dst.weight.requires_grad
    async with TensorStore(tmp_path / "s", chunk_bytes=4096) as store:
        await store.save(1, {"a": src.weight, "b": src.weight.t()})  # a stored alias and a separate view
        await store.save(2, {"a": src.weight, "b": src.weight})
        await store.load(2, into=tied)
        assert torch.equal(dst.weight, src.weight)


# --- item 5: every dtype, both ways, with the real safetensors ------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
async def test_every_dtype_round_trips_with_the_real_safetensors(tmp_path: Any, dtype: torch.dtype) -> None:
    t = {"x": raw(dtype, (3, 4)), "y": raw(dtype, (5,), 1), "e": raw(dtype, (0, 2))}
    st_save(t, str(tmp_path / "theirs.safetensors"))
    got = await load_file(tmp_path / "theirs.safetensors")
    assert all(got[k].dtype == dtype and got[k].shape == t[k].shape and torch.equal(bits(got[k]), bits(t[k])) for k in t)
    await save_file(t, tmp_path / "ours.safetensors")
    back = st_load(str(tmp_path / "ours.safetensors"))
    assert all(back[k].dtype == dtype and back[k].shape == t[k].shape and torch.equal(bits(back[k]), bits(t[k])) for k in t)
    async with TensorStore(tmp_path / "s", chunk_bytes=4096) as store:
        await store.save(1, t)
        assert_state_equal(t, await store.load(1))
        info = await store.info(1)
        assert info["x"].dtype == dtype and info["x"].shape == (3, 4)


async def test_a_packed_f4_shape_must_hold_whole_bytes(tmp_path: Any) -> None:
    header = json.dumps({"x": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}).encode()
    (tmp_path / "odd.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    with pytest.raises(HeaderError, match="multiple of 2"):
        await load_file(tmp_path / "odd.safetensors")
    with pytest.raises(StateError, match="0-d"):
        await save_file({"s": raw(torch.float4_e2m1fn_x2, ())}, tmp_path / "s.safetensors")


# --- item 7: checksummed single files, metadata, headers -----------------------------------------


async def test_single_files_carry_checksums_and_keep_metadata(tmp_path: Any) -> None:
    path = tmp_path / "m.safetensors"
    t = {"a": torch.randn(1000), "b": torch.arange(10)}
    await save_file(t, path, metadata={"format": "pt", "note": "hello"})
    info = await read_header(path)
    assert info.metadata == {"format": "pt", "note": "hello"} and info.checksummed
    assert info.tensors["a"].shape == (1000,) and info.tensors["b"].dtype == torch.int64
    assert st_load(str(path))["a"].equal(t["a"])  # still a standard file
    # without metadata, the file still says what transformers' from_pretrained asks of a file
    # that has metadata (ours always has: the checksums): "format": "pt"; a format given wins
    await save_file(t, tmp_path / "plain.safetensors")
    await save_file(t, tmp_path / "np.safetensors", metadata={"format": "np"})
    with safe_open(str(tmp_path / "plain.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt"
    assert (await read_header(tmp_path / "np.safetensors")).metadata == {"format": "np"}
    data = bytearray(path.read_bytes())
    data[-200] ^= 0x01  # one flipped bit in "a"
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="'a'") as ei:
        await load_file(path)
    assert ei.value.key == "a" and str(path) in str(ei.value)
    assert (await load_file(path, verify=False))["b"].equal(t["b"])
    st_save(t, str(tmp_path / "theirs.safetensors"))  # no checksums: loads, nothing to verify
    assert not (await read_header(tmp_path / "theirs.safetensors")).checksummed
    with pytest.raises(StateError, match="aiotensor's own"):
        await save_file(t, path, metadata={"aiotensor.crc32c": "{}"})


# --- item 8: OrderedDict and _metadata -------------------------------------------------------------


async def test_a_module_state_dict_comes_back_as_it_was(tmp_path: Any) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    sd = model.state_dict()
    async with TensorStore(tmp_path) as store:
        await store.save(1, {"model": sd, "plain": {"a": 1}})
        out = await store.load(1)
    assert type(out["model"]) is OrderedDict and type(out["plain"]) is dict
    assert out["model"]._metadata == sd._metadata  # type: ignore[attr-defined]
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    assert not fresh.load_state_dict(out["model"]).missing_keys


# --- item 9: clear errors --------------------------------------------------------------------------


async def test_files_that_are_not_safetensors_say_so(tmp_path: Any) -> None:
    (tmp_path / "notes.txt").write_text("this is just some text, long enough to have a prefix")
    with pytest.raises(HeaderError, match="is not a safetensors file"):
        await load_file(tmp_path / "notes.txt")
    torch.save({"w": torch.ones(3)}, tmp_path / "model.pt")
    with pytest.raises(HeaderError, match=r"zip archive \(a torch.save file\?\)"):
        await load_file(tmp_path / "model.pt")


@pytest.mark.filterwarnings("ignore:.*nested tensors is in prototype:UserWarning")
@pytest.mark.filterwarnings("ignore:.*quantize_per_tensor.*deprecated:UserWarning")
async def test_odd_tensors_are_refused_with_state_error(tmp_path: Any) -> None:
    odd = {
        "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "nested_jagged": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
        "sparse": torch.eye(3).to_sparse(),
        "quantized": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
        "meta": torch.empty(3, device="meta"),
    }
    async with TensorStore(tmp_path) as store:
        for step, (name, t) in enumerate(odd.items()):
            with pytest.raises(StateError, match=name):
                await store.save(step, {name: t})
            with pytest.raises(StateError):
                await save_file({name: t}, tmp_path / f"{name}.safetensors")
        assert store.steps() == []


# --- item 11: the last step is never skipped silently ---------------------------------------------


async def test_the_final_step_can_be_forced_and_drain_reports_skips(tmp_path: Any, caplog: Any) -> None:
    import time

    def slow(op: tuple[Any, ...]) -> None:
        if op[0] == "sync":
            time.sleep(0.05)

    params = {"w": torch.zeros(10_000)}
    async with TensorStore(tmp_path, engine=FaultyEngine(hook=slow), max_staged=1) as store:
        snap = Snapshotter(store)  # policy "skip"
        for step in range(1, 6):
            await snap.before_update()
            params["w"].fill_(step)
            snap.save(step, {"w": params["w"]}, force=step == 5)
        skipped = await snap.drain()
        assert 5 in store.steps() and skipped and 5 not in skipped
        assert float((await store.load(5))["w"][0]) == 5.0
        # without force, drain says the last one was skipped
        h = snap.save(6, {"w": params["w"]})
        assert h is not None
        assert snap.save(7, {"w": params["w"]}) is None
        with caplog.at_level(logging.WARNING, logger="aiotensor"):
            assert await snap.drain() == [7]
        assert "step 7" in caplog.text and "force=True" in caplog.text


# s3:// is served (tests/test_objects.py); every other scheme is refused
URLS = ["gs://b/w.safetensors", "https://host/w.safetensors", "file:///tmp/x", "s4://bucket/run1/", "S3://bucket/run1/"]
# a storage scheme without its "//": made a local folder "s3:" (helper-25's trial)
MISTYPED = ["s3:/bucket/run1", "s3:bucket/w.safetensors", "gs:/b/w.safetensors"]


async def _enter(cm: Any) -> None:
    async with cm:
        async for _ in cm:
            pass


@pytest.mark.parametrize("url", URLS + MISTYPED)
async def test_a_url_is_refused_before_anything_is_made(url: str, tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    """A URL taken as a relative path made a folder named ``s3:`` in the working directory, and a
    save seemed to reach the bucket: every entry point refuses it, naming the scheme."""
    from aiotensor.dcp import AiotensorReader, AiotensorWriter
    from aiotensor.errors import UnsupportedLocationError

    monkeypatch.chdir(tmp_path)
    state = {"w": torch.ones(3)}
    calls: list[Any] = [
        lambda: TensorStore(url),
        lambda: save_file(state, url),
        lambda: load_file(url),
        lambda: read_header(url),
        lambda: aiotensor.load_torch(url),
        lambda: aiotensor.save_torch(state, url),
        lambda: aiotensor.load_into(torch.nn.Linear(1, 1), url),
        lambda: aiotensor.prepare_swap(torch.nn.Linear(1, 1), url),
        lambda: _enter(aiotensor.stream(url)),
        lambda: AiotensorWriter(url),
        lambda: AiotensorReader(url),
    ]
    for call in calls:
        with pytest.raises(UnsupportedLocationError, match=url.split(":")[0] + "://"):
            made = call()
            if hasattr(made, "__await__"):
                await made
    from aiotensor.cli import main

    for args in (["ls", url], ["convert", "x.safetensors", url]):
        with pytest.raises(SystemExit) as exit_:  # the CLI says it as a usage error
            main(args)
        assert exit_.value.code == 2 and ("is a URL" if url in URLS else "mistyped URL") in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    if url in MISTYPED:  # a local folder so named stays reachable
        async with TensorStore(f"./{url}") as store:
            await store.save(1, state)


@pytest.mark.parametrize("name", ["run:1", "C:\\ckpt", "a/b:c", "s3:"])
async def test_names_with_a_colon_are_still_paths(name: str, tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    async with TensorStore(name) as store:
        await store.save(0, {"w": torch.ones(2)})
    assert (tmp_path / name).is_dir()
