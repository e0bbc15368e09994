"""Snapshotter: the trainer pattern keeps each step's values, and a slow disk never grows memory."""

from __future__ import annotations

import errno
import os
import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from aiotensor import Snapshotter, TensorStore
from aiotensor.errors import SaveCancelledError
from aiotensor.testing import FaultyEngine

pytestmark = pytest.mark.anyio


def _params() -> dict[str, torch.Tensor]:
    return {f"p{i}": torch.zeros(50_000) for i in range(4)}


async def _train(snap: Snapshotter, params: dict[str, torch.Tensor], steps: int, probe: Any = None) -> list[int]:
    saved = []
    for step in range(1, steps + 1):
        await anyio.lowlevel.checkpoint()  # forward/backward: staging of the last save runs meanwhile
        await snap.before_update()
        for p in params.values():
            p.fill_(float(step))  # optimizer.step(): every saved tensor changes
        if snap.save(step, {"params": params, "step": step}) is not None:
            saved.append(step)
        if probe is not None:
            probe()
    await snap.drain()
    return saved


async def test_every_checkpoint_holds_the_values_of_its_step(tmp_path: Any) -> None:
    params = _params()
    async with TensorStore(tmp_path) as store:
        snap = Snapshotter(store, policy="wait")
        saved = await _train(snap, params, 8)
        assert saved == store.steps() == list(range(1, 9))
        for step in saved:
            got = await store.load(step)
            assert got["step"] == step
            assert all(bool((t == step).all()) for t in got["params"].values()), step
    assert snap.started == 8 and snap.skipped == 0 and len(snap.held_seconds) == 7


def _slow_disk(seconds: float) -> FaultyEngine:
    def hook(op: tuple[Any, ...]) -> None:
        if op[0] == "sync":
            time.sleep(seconds)  # in a worker thread: a disk slower than the trainer

    return FaultyEngine(hook=hook)


@pytest.mark.parametrize("policy", ["skip", "wait"])
async def test_a_slow_disk_skips_or_waits_and_memory_stays_bounded(tmp_path: Any, policy: Any) -> None:
    params = _params()
    async with TensorStore(tmp_path, engine=_slow_disk(0.05), max_staged=2, keep_last=3) as store:
        snap = Snapshotter(store, policy=policy)
        in_flight: list[int] = []
        saved = await _train(snap, params, 12, probe=lambda: in_flight.append(len(store._in_flight)))
        assert snap.started + snap.skipped == 12 and snap.started == len(saved)
        assert max(in_flight) <= (2 if policy == "skip" else 3)  # max_staged arenas, plus one waiting
        assert store.staging._count <= 2
        if policy == "skip":
            assert snap.skipped > 0  # the disk could not keep up: checkpoints got sparser
        else:
            assert snap.skipped == 0
        assert store.steps() == saved[-3:]
        latest = await store.load()
        assert all(bool((t == latest["step"]).all()) for t in latest["params"].values())


async def test_a_failed_save_is_raised_by_the_next_call(tmp_path: Any) -> None:
    def hook(op: tuple[Any, ...]) -> None:
        if op[0] == "sync" and "step-000000000001" in str(op[1]):
            raise OSError(errno.EIO, "injected EIO")

    async with TensorStore(tmp_path, engine=FaultyEngine(hook=hook)) as store:
        snap = Snapshotter(store)
        snap.save(1, {"w": torch.ones(3)})
        await snap.before_update()  # staged fine; the write fails later
        with pytest.raises(OSError, match="injected EIO"):
            for _ in range(200):
                await anyio.sleep(0.01)
                snap.save(1000, {"w": torch.ones(3)})  # raises before it would save step 1000 twice
        assert snap.skipped + snap.started < 200
        snap.save(2, {"w": torch.ones(3)})
        await snap.drain()
        assert 1 not in store.steps() and 2 in store.steps()


async def test_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="policy"):
        Snapshotter(None, policy="drop")  # type: ignore[arg-type]


async def test_cancelling_before_update_cancels_that_save_and_keeps_the_others(tmp_path: Any) -> None:
    params = _params()
    async with TensorStore(tmp_path, engine=_slow_disk(0.2), max_staged=1) as store:
        snap = Snapshotter(store, policy="wait")
        first = snap.save(1, {"params": params})
        await snap.before_update()  # staged: the only arena now belongs to a save still writing
        second = snap.save(2, {"params": params})  # waits for the arena
        assert first is not None and second is not None
        with anyio.move_on_after(0.02) as scope:
            await snap.before_update()
        assert scope.cancelled_caught
        with pytest.raises(SaveCancelledError):
            await second
        await first
        assert store.steps() == [1]
        assert not any(".tmp-" in n for n in os.listdir(tmp_path))


async def test_a_training_loop_goes_on_after_a_before_update_timed_out(tmp_path: Any) -> None:
    """The save a timed-out before_update cancelled is not raised again by the next calls (every
    later save and drain raised SaveCancelledError for it: helper-36)."""
    params = _params()
    async with TensorStore(tmp_path, engine=_slow_disk(0.2)) as store:
        snap = Snapshotter(store)
        snap.save(1, {"params": params})
        with anyio.CancelScope() as scope:
            scope.cancel()  # (a timeout that expires before staging ends)
            await snap.before_update()
        snap.save(2, {"params": params})
        await snap.before_update()
        assert await snap.drain() == []
        assert store.steps() == [2]


async def test_every_failed_save_is_raised_as_its_own_error_in_turn(tmp_path: Any) -> None:
    """Two saves failing on a full disk: the snapshotter raised the first's OSError and dropped the
    second, which the store then raised from the next save as a SaveFailedError ("never awaited",
    of a handle the user never held): a trainer catching OSError crashed (helper-32). Each is now
    raised as it is, in turn."""

    def hook(op: tuple[Any, ...]) -> None:
        if op[0] == "sync" and any(f"step-00000000000{s}" in str(op[1]) for s in (1, 2)):
            raise OSError(errno.ENOSPC, "injected ENOSPC")

    async with TensorStore(tmp_path, engine=FaultyEngine(hook=hook)) as store:
        snap = Snapshotter(store, policy="wait")
        snap.save(1, {"w": torch.ones(3)})
        snap.save(2, {"w": torch.ones(3)})
        with anyio.fail_after(30):
            while not all(h.done() for h in snap._handles):
                await anyio.sleep(0.01)
        seen = []
        for step in (3, 4, 5):
            try:
                snap.save(step, {"w": torch.ones(3)})
            except OSError as e:  # never a SaveFailedError
                seen.append(str(e))
        assert len(seen) == 2 and all("injected ENOSPC" in m for m in seen), seen
        await snap.drain()
        assert store.steps() == [5]


async def test_a_trainer_whose_forward_is_synchronous_still_checkpoints(tmp_path: Any) -> None:
    """helper-50: README's and docs/store.md's loop with a synchronous forward (no other await) and
    the default ``"skip"``: once a save was skipped, ``before_update`` had nothing to wait for and
    never let the loop run, so the saves in flight never committed, every later save was skipped
    (0 checkpoints in 3 s of training) and a SIGTERM handler never ran. It gives the loop turns."""
    w = torch.zeros(64)
    async with TensorStore(tmp_path) as store:
        snap = Snapshotter(store)
        for step in range(400):
            time.sleep(0.002)  # noqa: ASYNC251 (forward/backward, holding the loop's thread: the point)
            await snap.before_update()
            w.add_(1)
            snap.save(step, {"w": w})
        during = store.steps()
        await snap.drain()
    assert len(during) > 4, during


async def test_what_a_snapshotter_keeps_is_bounded(tmp_path: Any) -> None:
    """helper-54: ``held_seconds`` and ``skipped_steps`` gained an entry a save and a skip, for ever,
    in a trainer that runs for days and never drains. They keep the newest 10,000."""
    from aiotensor import snapshot

    async with TensorStore(tmp_path) as store:
        snap = Snapshotter(store)
        for step in range(snapshot._KEPT + 50):
            snap.skipped_steps.append(step)
            snap.held_seconds.append(0.0)
        assert len(snap.skipped_steps) == len(snap.held_seconds) == snapshot._KEPT
        assert (await snap.drain())[-1] == snapshot._KEPT + 49 and not snap.skipped_steps


async def test_what_a_notebook_shows_of_a_snapshotter_and_a_stream(tmp_path: Any) -> None:
    """Default reprs (`<aiotensor.snapshot.Snapshotter object at 0x...>`) and `help(aiotensor.stream)`
    without its arguments were what a notebook showed (helper-55)."""
    import inspect

    import aiotensor

    assert {"device", "dtype", "keys", "rows", "verify"} <= set(inspect.signature(aiotensor.stream).parameters)
    await aiotensor.save_file({"w": torch.ones(8)}, tmp_path / "m.safetensors")
    async with aiotensor.stream(tmp_path / "m.safetensors") as s:
        assert [n async for n, _ in s] == ["w"]
        assert repr(s).startswith(f"<TensorStream of {str(tmp_path / 'm.safetensors')!r} to cpu")
    async with TensorStore(tmp_path / "ck") as store:
        snap = Snapshotter(store)
        snap.save(1, {"w": torch.ones(2)})
        await snap.drain()
        assert repr(snap) == f"<Snapshotter of {store!r}: policy='skip', 1 started, 0 skipped, 0 running>"
