"""Ranks for tests/test_dcp.py: ``python -m tests._dcp_ranks PATH WORLD PORT MODE [OUT]``.

Each rank is a spawned process of its own (not ``mp.spawn``, which kills the survivors as soon as
one rank dies: the SIGKILL test needs to see what the survivors do). Each rank writes what it saw
to ``OUT/rank-R.json``; the exit status is 0 only if every rank exited 0.

Modes: ``ok``/``fail`` (DCP with AiotensorWriter), ``store`` (a TensorStore under the group: saves,
retention, a resharding load), ``stages`` (each rank its own tensors, strict), ``load`` (WORLD ranks load the ``store`` root into their shards),
``store-fail`` (rank 1 hits ENOSPC), ``kill`` (rank 1 is SIGKILLed while writing), ``cancel-one``
(rank 1 cancels a save the others make), ``steps-differ`` (each rank saves a step of its own),
``values`` (a numpy float saved, an argparse.Namespace refused), ``rollback`` (rollback and delete on every rank),
``two-roots`` (two stores on one group, saves and loads interleaved), ``destroyed`` (the group destroyed
under a save).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
import traceback
import warnings
import weakref
from datetime import timedelta
from typing import Any

import torch

ROWS, COLS = 8, 6
TIMEOUT = 20  # the process group's: a rank that dies fails the others within this


def full(step: int = 0) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).view(ROWS, COLS) + step


def rank_main(rank: int, world: int, path: str, port: int, mode: str, out: str) -> None:
    import anyio
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from aiotensor import TensorStore
    from aiotensor.dcp import AiotensorWriter
    from aiotensor.errors import DistributedError, MismatchError

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT))
    mesh = init_device_mesh("cpu", (world,))
    report: dict[str, Any] = {"rank": rank}

    def sharded(step: int) -> dict[str, Any]:
        return {"w": distribute_tensor(full(step), mesh, [Shard(0)]), "b": torch.ones(3) * step, "step": step}

    def fail_writes(exc: BaseException | None) -> None:
        def write_data(self: Any, plan: Any, planner: Any) -> Any:
            if exc is None:
                os.kill(os.getpid(), signal.SIGKILL)
            raise exc  # type: ignore[misc]

        AiotensorWriter.write_data = write_data  # type: ignore[method-assign]

    async def with_store() -> None:
        async with TensorStore(path, distributed=True, keep_last=2) as store:
            if mode == "store":
                for step in (1, 2, 3):
                    h = store.save(step, sharded(step))
                    await h.staged
                    await h
                report["steps"] = store.steps()
                into = sharded(0)
                await store.load(into=into)
                report["loaded_ok"] = bool(torch.equal(into["w"].full_tensor(), full(3))) and into["step"] == 3
                report["whole_ok"] = bool(torch.equal((await store.load())["w"], full(3)))
                # a saved tensor `into` lacks (a fresh optimizer's moments): DCP would skip it
                # silently; strict, it is refused, as in one process; strict=False loads the rest
                lacking = {k: v for k, v in sharded(0).items() if k != "b"}
                try:
                    await store.load(into=lacking)
                    report["strict_lacking"] = "loaded"
                except (MismatchError, DistributedError) as e:  # the coordinator's, and the others naming it
                    report["strict_lacking"] = "unexpected keys ['b']" in str(e)
                await store.load(into=lacking, strict=False)
                report["partial_ok"] = bool(torch.equal(lacking["w"].full_tensor(), full(3)))
            elif mode == "stages":  # pipeline stages: each rank saves and loads its own layers only
                mine = {"model": {f"layers.{rank}.w": torch.full((4, 4), float(rank + 1))}}
                await store.save(1, mine)
                into = {"model": {f"layers.{rank}.w": torch.zeros(4, 4)}}
                await store.load(1, into=into)  # strict: every saved tensor is some rank's
                report["loaded_ok"] = bool(into["model"][f"layers.{rank}.w"].eq(rank + 1).all())
                report["keys"] = sorted(into["model"])  # another stage's layers never put there
            elif mode in ("cancel-one", "steps-differ"):  # ranks out of step: every rank abandons that save
                await store.save(1, sharded(1))
                if mode == "cancel-one":
                    h = store.save(2, sharded(2))
                    if rank == 1:
                        h.cancel()  # before it joined any collective
                else:
                    h = store.save(10 + rank, sharded(10 + rank))
                try:
                    await h
                    report["error"] = None
                except BaseException as e:
                    report["error"] = f"{type(e).__name__}: {e}"
                await store.save(3, sharded(3))  # the ranks are in step again
                report["steps"] = store.steps()
                report["loaded_ok"] = bool(torch.equal((await store.load())["w"], full(3)))
            elif mode == "rollback":  # every rank calls it; rank 0 deletes, every view follows
                for step in (1, 2, 3):
                    await store.save(step, sharded(step))
                report["rolled"] = await store.rollback(2)  # (keep_last=2: steps 2 and 3)
                report["view"] = store.steps()
                await store.save(3, sharded(33))  # again, after the divergence
                await store.delete(2)
                report["steps"] = store.steps()
                report["loaded_ok"] = bool(torch.equal((await store.load())["w"], full(33)))
            elif mode == "values":  # values as a store keeps them, or refused at save
                import argparse

                import numpy as np

                await store.save(1, sharded(1) | {"best": np.float64(0.25), "seen": np.int64(5), "sched": {"last_epoch": 7}})
                into = sharded(0) | {"best": 0.0, "seen": 0}
                await store.load(into=into)
                report["best"] = [into["best"], type(into["best"]).__name__]
                report["seen"] = [into["seen"], type(into["seen"]).__name__]
                lacking = {"w": sharded(0)["w"], "b": torch.zeros(3), "sched": {}}  # a fresh scheduler's {}
                await store.load(1, into=lacking)  # strict: the saved values it lacks are put there
                report["added"] = [lacking.get("step"), lacking.get("best"), lacking["sched"]]
                try:
                    await store.save(2, sharded(2) | {"args": argparse.Namespace(lr=0.1)})
                except Exception as e:
                    report["error"] = f"{type(e).__name__}: {e}"
                try:  # two values DCP names alike (helper-60: DCP's bare ValueError)
                    await store.save(2, sharded(2) | {"d": {1: 1.0, "1": 2.0}})
                except Exception as e:
                    report["named_twice"] = f"{type(e).__name__}: {e}"
                # helper-77: MultiStepLR's milestones (a Counter of ints) came back under "2" beside 2,
                # and the next save refused the duplicate; ranks whose states differ in structure
                # committed a step no load took
                import collections

                await store.save(3, sharded(3) | {"sched": {"milestones": collections.Counter({2: 1, 4: 1})}})
                into = sharded(0) | {"sched": {"milestones": collections.Counter({2: 1, 4: 1})}}
                await store.load(3, into=into)
                report["milestones"] = sorted(map(repr, into["sched"]["milestones"]))
                await store.save(4, into)
                try:
                    await store.save(5, sharded(5) | {"extra": {"x": 1} if rank == 1 else 1})
                except Exception as e:
                    report["structure"] = f"{type(e).__name__}: {e}"
                report["steps"] = store.steps()
            elif mode == "two-roots":  # two stores on one group, a load called after a save
                async with TensorStore(path + "-b", distributed=True) as other:
                    loads = []
                    for step in range(1, 7):
                        ha = store.save(step, sharded(step))
                        await anyio.sleep(0.004 * rank * (step % 2))  # the ranks' calls a little apart
                        hb = other.save(step, {"w": distribute_tensor(-full(step), mesh, [Shard(0)])})
                        if step > 1:  # called after save(step): it runs after it, on every rank
                            into = sharded(0)
                            await store.load(step - 1, into=into)
                            loads.append(bool(torch.equal(into["w"].full_tensor(), full(step - 1))))
                        await ha
                        await hb
                    report["loads_ok"] = loads
                    # called in different orders on the ranks (helper-42): refused, not paired across roots
                    first, second = (store, other) if rank == 0 else (other, store)
                    handles = [first.save(7, sharded(7)), second.save(7, sharded(7))]
                    report["crossed"] = []
                    for h in handles:
                        try:
                            await h
                            report["crossed"].append("committed")
                        except Exception as e:
                            report["crossed"].append(f"{type(e).__name__}: {e}")
                    report["a_ok"] = [bool(torch.equal((await store.load(s))["w"], full(s))) for s in store.steps()]
                    report["b_ok"] = [bool(torch.equal((await other.load(s))["w"], -full(s))) for s in other.steps()]
            elif mode == "open-late":  # rank 0's open waits for its lock while another store's save is called
                other = TensorStore(path + "-b", distributed=True)
                if rank == 0:  # (a departing writer's lock, say)
                    taking = other._open_writer

                    async def slow() -> None:
                        await anyio.sleep(1.0)
                        await taking()

                    other._open_writer = slow  # type: ignore[method-assign]

                async def save_a() -> None:
                    await anyio.sleep(0.3)  # called after the open, on every rank
                    await store.save(1, sharded(1))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(other.open)
                    tg.start_soon(save_a)
                try:
                    await other.save(1, sharded(11))
                    report["loaded_ok"] = [
                        bool(torch.equal((await store.load(1))["w"], full(1))),
                        bool(torch.equal((await other.load(1))["w"], full(11))),
                    ]
                finally:
                    await other.close()
            elif mode == "cancel-load":  # asyncio's own cancellation of a load waiting for its turn, on rank 1
                import asyncio

                states = [sharded(k) for k in range(4)]  # (distribute_tensor is a collective: made first)
                await store.save(1, states[1])
                if rank == 0:
                    await asyncio.sleep(1.0)
                h = store.save(2, states[2])  # rank 1's load waits behind it (rank 0 comes later)
                try:
                    if rank == 1:
                        await asyncio.wait_for(store.load(1, into=states[0]), 0.3)
                    else:
                        await store.load(1, into=states[0])
                    report["load"] = "loaded"
                except BaseException as e:
                    report["load"] = f"{type(e).__name__}: {e}"
                await h
                await store.save(3, states[3])  # the ranks are still in step
                report["steps"] = store.steps()
            elif mode == "keys-differ":  # one DTensor under another name on each rank: DCP's plan fails
                w = sharded(1)["w"]
                try:
                    await store.save(1, {"w" if rank == 0 else "v": w})
                    report["error"] = None
                except Exception as e:
                    report["error"] = f"{type(e).__name__}: {e}"
                await store.save(2, sharded(2))  # in step again
                report["steps"] = store.steps()
            elif mode == "destroyed":  # the group destroyed under a save in flight
                await store.save(1, sharded(1))
                h = store.save(2, sharded(2))
                await h.staged
                dist.destroy_process_group()
                try:
                    await h
                    report["error"] = None
                except Exception as e:
                    report["error"] = f"{type(e).__name__}: {e}"
            elif mode == "load":
                into = sharded(0)
                await store.load(3, into=into)
                report["rows"] = into["w"].to_local().shape[0]  # this rank's share: 3, 3, 2 of 8
                report["loaded_ok"] = bool(torch.equal(into["w"].full_tensor(), full(3))) and into["step"] == 3
            else:
                await store.save(1, sharded(1))
                if rank == 1:
                    fail_writes(OSError(28, "injected: no space left") if mode == "store-fail" else None)
                t = time.monotonic()
                try:
                    await store.save(2, sharded(2))
                except BaseException as e:
                    report["error"] = f"{type(e).__name__}: {e}"
                    report["notes"] = getattr(e, "__notes__", [])
                    report["seconds"] = time.monotonic() - t
                    report["steps"] = store.steps()
                    if mode == "kill":
                        return  # the group is broken: leaving the store must not need it
                    raise

    try:
        if mode in ("ok", "fail"):
            if mode == "fail" and rank == 1:
                fail_writes(OSError(28, "injected: no space left"))
            dcp.save(sharded(5) | {"b": torch.ones(3) * 7}, storage_writer=AiotensorWriter(path))
        else:
            anyio.run(with_store)
    except BaseException:
        report["traceback"] = traceback.format_exc()[-3000:]
        raise
    finally:
        if mode != "kill" and dist.is_initialized():
            from aiotensor.store.distributed import _SIDES

            sides = [weakref.ref(side._group()) for side in _SIDES.values() if side._group() is not None]
            dist.destroy_process_group()
            gc.collect()
            report["side_groups_left"] = sum(ref() is not None for ref in sides)  # freed with torch's registry
        with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
            json.dump(report, f)


def _run_rank(rank: int, world: int, path: str, port: int, mode: str, out: str) -> None:
    """One rank; it leaves with ``os._exit``: importing torch.distributed.checkpoint keeps 10 more
    references to the default group (torch's, not aiotensor's), so its gloo threads live on into the
    interpreter's exit, where a rank now and then aborted ("terminate called without an active
    exception", pytorch/pytorch#179291) after it had done and reported everything."""
    code = 0
    try:
        rank_main(rank, world, path, port, mode, out)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    import multiprocessing as mp

    path, world, port, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    out = sys.argv[5] if len(sys.argv) > 5 else os.path.dirname(os.path.abspath(path))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_run_rank, args=(r, world, path, port, mode, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT * 4)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    print(json.dumps({"exitcodes": codes}))
    sys.exit(0 if all(c == 0 for c in codes) else 1)
