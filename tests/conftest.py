from __future__ import annotations

import math
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import torch

import aiotensor
from aiotensor.formats.dtypes import ITEMSIZE as ST_ITEMSIZE
from aiotensor.testing import FaultyEngine

try:
    import uvloop  # noqa: F401

    _BACKENDS: list[Any] = [
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
except ImportError:  # pragma: no cover - uvloop is a Linux dependency
    _BACKENDS = [pytest.param(("asyncio", {}), id="asyncio")]


ALL_BACKENDS = [*_BACKENDS, pytest.param(("trio", {}), id="trio")]  # for tests that take trio too


@pytest.fixture(params=_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


@pytest.fixture(params=["posix", "faulty"])
def engine(request: pytest.FixtureRequest) -> aiotensor.Engine:
    """Every engine the store runs on here; kvikio joins on GPU machines."""
    if request.param == "posix":
        return aiotensor.PosixEngine()
    return FaultyEngine()


def small_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 32, generator=g)
    return {
        "model": {"embed.weight": w, "lm_head.weight": w, "ln.bias": torch.randn(32, generator=g)},
        "optim": {
            "state": {0: {"exp_avg": torch.randn(64, 32, generator=g), "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "foreach": None}],
        },
        "step": seed,
    }


def assert_state_equal(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        assert torch.equal(bits(a), bits(b)), f"{path}: values differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_state_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_state_equal(x, y, f"{path}.{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, path


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, for bit-exact comparison (NaNs compare equal, -0.0 differs from 0.0)."""
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def tmp_leftovers(root: str) -> list[str]:
    return [n for n in os.listdir(root) if ".tmp-" in n]


@pytest.fixture
def one_rank_group(tmp_path: Any) -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def cuda_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """``aiotensor._runtime.cuda.available()`` as on a machine with a GPU that CUDA was not yet
    initialized on (the answer it kept per process replaced for this test only)."""
    from aiotensor._runtime import cuda

    monkeypatch.setattr(cuda, "_devices_seen", lambda visible: True)


_COLUMNS = ("shard", "dtype", "shape", "offset", "nbytes", "crc32c")


def manifest_rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tensor table of a manifest as the store writes it (version 3: a string per column) as
    rows, ``{key: {"shard": file, "dtype", "shape", "offset", "nbytes", "crc32c"}}`` (version 1's
    entries), for a test to edit and write back with :func:`set_manifest_rows`."""
    t, files = doc["table"], [s["file"] for s in doc["shards"]]
    numbers = {c: [int(x) for x in t[c].split()] for c in ("shard", "ndim", "dims", "offset", "crc32c")}
    dims = iter(numbers["dims"])
    shapes = [[next(dims) for _ in range(n)] for n in numbers["ndim"]]
    out = {}
    for i, (key, dtype) in enumerate(zip(t["keys"], t["dtype"].split(), strict=True)):
        nbytes = math.prod(shapes[i]) * ST_ITEMSIZE[dtype] // (2 if dtype == "F4" else 1)
        row = (files[numbers["shard"][i]], dtype, shapes[i], numbers["offset"][i], nbytes, numbers["crc32c"][i])
        out[key] = dict(zip(_COLUMNS, row, strict=True))
    return out


def set_manifest_rows(doc: dict[str, Any], rows: dict[str, dict[str, Any]]) -> None:
    """Write ``rows`` back as ``doc``'s table (``nbytes`` is not written: a tensor's bytes follow from its shape)."""
    files = {s["file"]: i for i, s in enumerate(doc["shards"])}
    r = list(rows.values())
    columns = {
        "shard": [files[x["shard"]] for x in r],
        "dtype": [x["dtype"] for x in r],
        "ndim": [len(x["shape"]) for x in r],
        "dims": [d for x in r for d in x["shape"]],
        "offset": [x["offset"] for x in r],
        "crc32c": [x["crc32c"] for x in r],
    }
    doc["table"] = {"keys": list(rows)} | {c: " ".join(map(str, v)) for c, v in columns.items()}


async def cancel_task_once(run: Callable[[], Awaitable[object]], started: threading.Event) -> None:
    """Run ``run()`` as an asyncio task, cancel it (asyncio's own ``Task.cancel()``, which an anyio
    shield does not hold) once ``started`` is set (from a worker thread), and check it ends cancelled."""
    import asyncio

    task = asyncio.ensure_future(run())
    await anyio.to_thread.run_sync(started.wait)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
