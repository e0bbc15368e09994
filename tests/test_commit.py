"""One commit protocol under every writer (issue 25): a SIGKILL before every engine operation, and a
power cut after every one, leave the old version whole or the new one whole, never a mix, for
``save_file``, ``save_torch``, the DCP writer and ``convert`` as for the store (``test_crash.py``,
``test_powerloss.py``): each of them now writes through its scheduler's engine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
import torch
from safetensors.torch import load_file as st_load_file

from aiotensor import Scheduler, TensorStore, save_file, save_torch, stream
from aiotensor.cli import convert
from aiotensor.engines import Engine
from aiotensor.root import step_dir_name
from aiotensor.testing import FaultyEngine

from .conftest import bits
from .test_crash import killed_in_child
from .test_powerloss import Disk, snapshot

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="fork + SIGKILL sweep is Linux-only"),
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"),
]


def tensors_for(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(3000, generator=g), "b": torch.randn(300, generator=g).double(), "i": torch.arange(7) * version}


def which(got: dict[str, torch.Tensor]) -> int:
    """The version ``got`` holds whole, bit for bit (else AssertionError)."""
    for v in (1, 2):
        want = tensors_for(v)
        if set(got) == set(want) and all(torch.equal(bits(got[k]), bits(want[k])) for k in want):
            return v
    raise AssertionError(f"neither version, whole: {sorted(got)}")


def visible(folder: str) -> list[str]:
    """What a user sees: no unfinished file may show under a name that is not hidden."""
    return sorted(n for n in os.listdir(folder) if not n.startswith("."))


def sched(engine: Engine) -> Scheduler:
    return Scheduler(engine, workers=2, chunk_bytes=4096, batch_bytes=8192)


@dataclass
class Writer:
    prepare: Callable[[str], None]  # the disk before: version 1 (or nothing)
    write: Callable[[str, Engine], Awaitable[None]]  # version 2, through ``engine``
    check: Callable[[str], int]  # the version the folder holds whole (0: none), else AssertionError


# --- save_file and save_torch: one file replaced -----------------------------------------------


def _file_writer(name: str, save: Any, load: Any) -> Writer:
    def prepare(folder: str) -> None:
        anyio.run(lambda: save(tensors_for(1), os.path.join(folder, name)))

    async def write(folder: str, engine: Engine) -> None:
        await save(tensors_for(2), os.path.join(folder, name), scheduler=sched(engine))

    def check(folder: str) -> int:
        assert visible(folder) == [name], os.listdir(folder)
        return which(load(os.path.join(folder, name)))

    return Writer(prepare, write, check)


# --- the DCP writer: a step of a store root -------------------------------------------------------


def _dcp_prepare(root: str) -> None:
    import torch.distributed.checkpoint as dcp

    from aiotensor.dcp import AiotensorWriter

    warnings.simplefilter("ignore")
    dcp.save(tensors_for(1), storage_writer=AiotensorWriter(os.path.join(root, step_dir_name(1))))


async def _dcp_write(root: str, engine: Engine) -> None:
    import torch.distributed.checkpoint as dcp

    from aiotensor.dcp import AiotensorWriter

    warnings.simplefilter("ignore")
    writer = AiotensorWriter(os.path.join(root, step_dir_name(2)), engine=engine)
    await anyio.to_thread.run_sync(lambda: dcp.save(tensors_for(2), storage_writer=writer))


def _dcp_check(root: str) -> int:
    async def main() -> int:
        async with TensorStore(root) as store:  # a writer: removes the leftovers of a killed save
            assert store.steps() in ([1], [1, 2]), store.steps()
            newest = store.steps()[-1]
            assert which(await store.load()) == newest
        latest = open(os.path.join(root, "latest")).read().strip()
        assert latest in [step_dir_name(s) for s in (1, newest)], latest
        assert [n for n in os.listdir(root) if ".tmp-" in n] == [], os.listdir(root)
        return newest

    return anyio.run(main)


# --- convert: a new sharded folder ---------------------------------------------------------------


def _convert_prepare(folder: str) -> None:  # the source sits beside the folder; the output does not exist
    anyio.run(lambda: save_file(tensors_for(2), os.path.join(os.path.dirname(folder), "src.safetensors")))


async def _convert_write(folder: str, engine: Engine) -> None:
    src = os.path.join(os.path.dirname(folder), "src.safetensors")
    await convert(src, os.path.join(folder, "out"), shard_size=8192, scheduler=sched(engine))


def _convert_check(folder: str) -> int:
    if visible(folder) == []:
        return 0
    assert visible(folder) == ["out"], os.listdir(folder)
    out = os.path.join(folder, "out")
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert sorted(set(index["weight_map"].values())) == sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))

    async def read() -> dict[str, torch.Tensor]:
        return {n: t async for n, t in stream(out)}

    return which(anyio.run(read))


WRITERS = {
    "save_file": _file_writer("model.safetensors", save_file, st_load_file),
    "save_torch": _file_writer("model.pt", save_torch, lambda p: torch.load(p, weights_only=True)),
    "dcp": Writer(_dcp_prepare, _dcp_write, _dcp_check),
    "convert": Writer(_convert_prepare, _convert_write, _convert_check),
}
BEFORE = {"save_file": 1, "save_torch": 1, "dcp": 1, "convert": 0}


def _run_killed(w: Writer, folder: str, kill_at: int) -> int:
    """Fork; the child writes version 2 and is SIGKILLed before its ``kill_at``-th engine op."""
    return killed_in_child(lambda engine: w.write(folder, engine), kill_at)


def _prepared(tmp_path: Any, w: Writer) -> tuple[str, str]:
    """A pristine copy of the disk before the write, and the folder writes go to."""
    pristine, folder = str(tmp_path / "pristine" / "d"), str(tmp_path / "live" / "d")
    os.makedirs(pristine)
    w.prepare(pristine)
    shutil.copytree(os.path.dirname(pristine), os.path.dirname(folder))
    return pristine, folder


def _reset(pristine: str, folder: str) -> None:
    shutil.rmtree(os.path.dirname(folder))
    shutil.copytree(os.path.dirname(pristine), os.path.dirname(folder))


@pytest.mark.parametrize("name", list(WRITERS))
def test_sigkill_before_every_operation_of_every_writer(tmp_path: Any, name: str) -> None:
    if name == "dcp" and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        # an H200 run: DCP's planner asks each tensor is_pinned(), a CUDA call that fails in a child
        # forked once the parent has CUDA (an earlier test of this process used it); CPU runs test it
        pytest.skip("dcp.save cannot run in a child forked after CUDA was initialized")
    w = WRITERS[name]
    pristine, folder = _prepared(tmp_path, w)
    recorder = FaultyEngine()
    anyio.run(w.write, folder, recorder)
    total = len(recorder.ops)
    assert total >= 10, recorder.ops
    assert w.check(folder) == 2
    outcomes: dict[int, int] = {}
    for n in range(1, total + 1):
        _reset(pristine, folder)
        status = _run_killed(w, folder, n)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"op {n}: the child was not killed"
        try:
            got = w.check(folder)
        except AssertionError as e:
            raise AssertionError(f"killed before op {n} {recorder.ops[n - 1][:2]}: {e}") from e
        assert got in (BEFORE[name], 2), (n, got)
        outcomes[got] = outcomes.get(got, 0) + 1
    assert set(outcomes) == {BEFORE[name], 2}, outcomes  # kills fell on both sides of the commit point


@pytest.mark.parametrize("lost_data", ["empty", "zeros"])
@pytest.mark.parametrize("name", list(WRITERS))
def test_power_cut_after_every_operation_of_every_writer(tmp_path: Any, name: str, lost_data: str) -> None:
    w = WRITERS[name]
    pristine, folder = _prepared(tmp_path, w)
    recorder = FaultyEngine(record_data=True)
    anyio.run(w.write, folder, recorder)
    ops = [op for op in recorder.ops if str(op[1]).startswith(folder)]
    outcomes: dict[int, int] = {}
    for k in range(len(ops) + 1):
        disk = Disk(folder, snapshot(pristine))
        for op in ops[:k]:
            disk.apply(op)
        cut = str(tmp_path / f"cut-{k}" / "d")
        shutil.copytree(os.path.dirname(pristine), os.path.dirname(cut))  # the source of convert, beside it
        shutil.rmtree(cut)
        disk.materialize(cut, zeros=lost_data == "zeros")
        try:
            got = w.check(cut)
        except AssertionError as e:
            raise AssertionError(f"power cut after op {k} {ops[k - 1][:2] if k else ''}: {e}") from e
        outcomes[got] = outcomes.get(got, 0) + 1
        shutil.rmtree(os.path.dirname(cut))
    assert set(outcomes) == {BEFORE[name], 2}, outcomes


@pytest.mark.parametrize("name", ["save_file", "save_torch", "convert"])
def test_the_power_cut_check_catches_a_writer_that_skips_its_fsync(tmp_path: Any, name: str) -> None:
    w = WRITERS[name]
    pristine, folder = _prepared(tmp_path, w)
    recorder = FaultyEngine(record_data=True)
    anyio.run(w.write, folder, recorder)
    ops = [op for op in recorder.ops if str(op[1]).startswith(folder) and op[0] != "sync"]  # the bug
    failures = 0
    for k in range(len(ops) + 1):
        disk = Disk(folder, snapshot(pristine))
        for op in ops[:k]:
            disk.apply(op)
        cut = str(tmp_path / f"cut-{k}" / "d")
        shutil.copytree(os.path.dirname(pristine), os.path.dirname(cut))
        shutil.rmtree(cut)
        disk.materialize(cut, zeros=False)
        try:
            w.check(cut)
        except Exception:  # a torn file may fail any reader: that is what this check looks for
            failures += 1
        shutil.rmtree(os.path.dirname(cut))
    assert failures, "no power cut lost anything"
