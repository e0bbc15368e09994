"""Child processes for the several-processes tests: ``python -m tests._procs ROLE ROOT [N]``.

- ``hold ROOT``: open a writer store, print "locked", hold the lock until killed (or stdin closes).
- ``hold-and-fork ROOT``: the same, having forked a helper that sleeps a minute; prints "locked PID".
- ``writer ROOT N``: save steps 1..N with keep_last=2 (each a tensor filled with its step), print "done".
- ``reader ROOT``: open read-only, then until ROOT/stop exists: refresh, load the newest step and check
  every value; also open and close a second read-only store each round (what an evaluator does).
  Prints "loads=<n> vanished=<n>" and exits 0, or raises on any wrong value.
"""

from __future__ import annotations

import os
import signal
import sys

import anyio
import torch

from aiotensor import TensorStore
from aiotensor.errors import CheckpointNotFoundError

SIZE = 20_000


def state(step: int) -> dict[str, object]:
    return {"w": torch.full((SIZE,), float(step)), "b": torch.full((7,), -float(step)), "step": step}


async def hold(root: str) -> None:
    async with TensorStore(root):
        print("locked", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)


async def hold_and_fork(root: str) -> None:
    """Hold the lock, and fork a helper (a multiprocessing worker) that outlives this process."""
    async with TensorStore(root):
        pid = os.fork()
        if pid == 0:  # the helper: sleeps (a plain process now, no loop), holding nothing of the store
            signal.pause()
            os._exit(0)
        print(f"locked {pid}", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)


async def writer(root: str, n: int) -> None:
    async with TensorStore(root, keep_last=2, lock_timeout=30) as store:
        for step in range(1, n + 1):
            await store.save(step, state(step))
            assert store.steps()[-1] == step
    print("done", flush=True)


async def reader(root: str) -> None:
    loads = vanished = 0
    stop = os.path.join(root, "stop")
    async with TensorStore(root, readonly=True) as store:
        while not os.path.exists(stop):
            async with TensorStore(root, readonly=True) as evaluator:  # opening never disturbs the writer
                evaluator.steps()
            await store.refresh()
            step = store.latest()
            if step is None:
                await anyio.sleep(0.001)
                continue
            try:
                got = await store.load(step)
            except CheckpointNotFoundError:
                vanished += 1  # retired between refresh and load: allowed, never partial data
                continue
            assert got["step"] == step, (got["step"], step)
            assert bool((got["w"] == float(step)).all()) and bool((got["b"] == -float(step)).all()), step
            loads += 1
    print(f"loads={loads} vanished={vanished}", flush=True)


def main() -> None:
    role, root, *rest = sys.argv[1:]
    if role == "hold":
        anyio.run(hold, root)
    elif role == "hold-and-fork":
        anyio.run(hold_and_fork, root)
    elif role == "writer":
        anyio.run(writer, root, int(rest[0]))
    elif role == "reader":
        anyio.run(reader, root)
    else:
        raise SystemExit(f"unknown role {role}")


if __name__ == "__main__":
    main()
