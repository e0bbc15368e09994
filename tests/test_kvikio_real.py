"""The real kvikio package, where it is installed (``tox -e kvikio-cpu``; skipped otherwise): the
names and signatures the stand-in in ``tests/fake_kvikio`` mirrors must be the real ones, and the
engine must build, set kvikio up and run its host paths. On a machine without ``libcuda.so.1``
kvikio's own I/O cannot run; what needs a GPU is in ``tests/test_gpu.py``."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import torch

from aiotensor import KvikioEngine, TensorStore, load_file, save_file
from aiotensor._runtime.scheduler import Scheduler
from aiotensor.engines import kvikio as engine_module

from .conftest import assert_state_equal, small_state
from .test_kvikio import FAKE, REAL_LAYOUT, REAL_SIGNATURES

pytestmark = pytest.mark.anyio


def _real() -> Any:
    spec = importlib.util.find_spec("kvikio")
    if spec is None or FAKE in (spec.origin or ""):
        pytest.skip("the real kvikio is not installed (tox -e kvikio-cpu)")
    return importlib.import_module("kvikio")


def test_the_real_package_has_what_the_stand_in_mirrors() -> None:
    _real()
    for module, names in REAL_LAYOUT.items():
        m = importlib.import_module(module)
        missing = [n for n in names if not hasattr(m, n)]
        assert not missing, (module, missing)
    cufile = importlib.import_module("kvikio.cufile")
    for qual, params in REAL_SIGNATURES.items():
        cls, meth = qual.split(".")
        got = list(inspect.signature(getattr(getattr(cufile, cls), meth)).parameters)
        assert got[: len(params)] == params, (qual, got)


async def test_the_engine_sets_the_real_kvikio_up_and_runs_host_paths(tmp_path: Any) -> None:
    _real()
    engine_module.forget_setup()
    eng = KvikioEngine(num_threads=3, task_size=1 << 20)
    mode = await Scheduler(eng).run_sync(lambda: eng.mode)  # in a worker, as the library does
    assert mode in ("gds", "cufile-compat", "compat", "cufile", "unavailable"), mode
    state = small_state(3)
    async with TensorStore(tmp_path / "ck", engine=eng) as store:
        await store.save(1, state)
        assert_state_equal(await store.load(1), state)
    w = {"w": torch.randn(100_000)}
    await save_file(w, tmp_path / "w.safetensors", scheduler=Scheduler(eng))
    assert torch.equal((await load_file(tmp_path / "w.safetensors", scheduler=Scheduler(eng)))["w"], w["w"])
