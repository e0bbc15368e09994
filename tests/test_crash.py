"""Crashes mid-save: SIGKILL at every engine operation of a save, in a forked child.

After each kill, opening the store must list only committed steps, load the newest bit for bit,
and leave no temporary leftovers. ``-m slow`` adds kills at random times (not at op boundaries).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import time
from typing import Any

import anyio
import pytest
import torch

from aiotensor import TensorStore
from aiotensor.root import step_dir_name
from aiotensor.testing import FaultyEngine

from .conftest import assert_state_equal, tmp_leftovers

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork + SIGKILL sweep is Linux-only")


# the same tensor in every step: incremental saves link its shard from the step before (the kill
# sweep and the power-cut replay cover that link)
FROZEN = torch.arange(20000, dtype=torch.float32)


def state_for(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(40000, generator=g), "b": torch.randn(3000, generator=g).double(), "frozen": FROZEN, "step": step}


def killed_in_child(work: Any, kill_at: int | None = None, kill_after_s: float | None = None) -> int:
    """Fork; the child runs ``anyio.run(work, engine)`` and is SIGKILLed before its engine's
    ``kill_at``-th op (or after ``kill_after_s``); returns its wait status."""
    pid = os.fork()
    if pid == 0:  # child: never returns
        code = 0
        try:
            count = 0

            def hook(op: tuple[Any, ...]) -> None:
                nonlocal count
                count += 1
                if count == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

            if kill_after_s is not None:
                import threading

                threading.Timer(kill_after_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
            anyio.run(work, FaultyEngine(hook=hook))
        except BaseException:
            import traceback

            traceback.print_exc()  # the parent's assertion says only that the child was not killed
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def save_in_child(root: str, step: int, kill_at: int | None = None, kill_after_s: float | None = None) -> int:
    """Fork; the child saves ``step`` and is SIGKILLed before its ``kill_at``-th engine op."""

    async def main(engine: FaultyEngine) -> None:
        async with TensorStore(root, engine=engine, chunk_bytes=4096, batch_bytes=4096) as s:
            await s.save(step, state_for(step))

    return killed_in_child(main, kill_at, kill_after_s)


def count_ops(root: str) -> int:
    eng = FaultyEngine()

    async def main() -> None:
        async with TensorStore(root, engine=eng, chunk_bytes=4096, batch_bytes=4096) as s:
            await s.save(2, state_for(2))

    anyio.run(main)
    reset_to_step_1(root)
    assert any(op[0] == "link" for op in eng.ops), "the save linked the frozen shard (an incremental save)"
    return len(eng.ops)


def reset_to_step_1(root: str) -> None:
    """Back to the disk before the save: step 1, named by `latest`."""
    shutil.rmtree(os.path.join(root, step_dir_name(2)))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(step_dir_name(1) + "\n")


def check_recovered(root: str, allowed: tuple[list[int], ...] = ([1], [1, 2])) -> int:
    """Open the store after a crash; check it lists ``allowed`` steps only, left no leftovers,
    loads the newest bit for bit, and that `latest` names a committed step. Return the newest."""

    async def main() -> int:
        async with TensorStore(root) as s:
            steps = s.steps()
            assert steps in allowed, steps
            assert tmp_leftovers(root) == []
            newest = steps[-1]
            assert_state_equal(state_for(newest), await s.load())
            with open(os.path.join(root, "latest")) as f:
                latest = f.read().strip()
            assert latest in [step_dir_name(n) for n in steps], f"`latest` names {latest!r}; committed: {steps}"
            return newest

    return anyio.run(main)


def commit_step_1(root: str) -> None:
    """Step 1 alone, saved after a step 0 (since deleted) so that its frozen tensor's shard carries
    the digest the next save links it by."""

    async def main() -> None:
        async with TensorStore(root) as s:
            zero = state_for(0)  # kept alive: step 1's new tensors cannot take its memory (and look unchanged)
            await s.save(0, zero)
            await s.save(1, state_for(1))
            assert s.steps() == [0, 1]
            await s.delete(0)

    anyio.run(main)


def check_after_crash(root: str) -> int:
    """:func:`check_recovered`, then reset the root to step 1 only."""
    newest = check_recovered(root)
    if newest == 2:
        reset_to_step_1(root)
    return newest


@pytest.fixture
def root(tmp_path: Any) -> str:
    r = str(tmp_path / "store")
    commit_step_1(r)
    return r


def test_sigkill_at_every_operation_of_a_save(root: str) -> None:
    total = count_ops(root)
    assert total >= 50, f"only {total} kill points"
    outcomes = {1: 0, 2: 0}
    for n in range(1, total + 1):
        status = save_in_child(root, 2, kill_at=n)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"op {n}: child was not killed"
        outcomes[check_after_crash(root)] += 1
    # the sweep reached both sides of the commit point
    assert outcomes[1] > 0 and outcomes[2] > 0, outcomes
    status = save_in_child(root, 2)  # and without a kill the save completes
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert check_after_crash(root) == 2


@pytest.mark.slow
def test_sigkill_at_random_times(root: str) -> None:
    rng = random.Random(0)
    t0 = time.perf_counter()
    save_in_child(root, 2)
    full = time.perf_counter() - t0
    check_after_crash(root)
    for _ in range(300):
        save_in_child(root, 2, kill_after_s=rng.uniform(0, full))
        check_after_crash(root)
