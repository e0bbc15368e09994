"""Distributed benchmark (issue 14): aiotensor as torch.distributed.checkpoint's storage against DCP's own
FileSystemWriter/FileSystemReader, with 2 and 4 gloo ranks on this machine, in one run.

A model-like state of ``--gb`` GB (2-D float32 tensors, each row-sharded across the ranks as a
DTensor) is saved and loaded by every rank together; rank 0 times each operation between barriers.
Per world size it measures, with repetitions and medians:
  - durable save (every rank's files fsync'ed, the checkpoint committed): ``dcp.save`` with
    ``AiotensorWriter``, with ``FileSystemWriter(thread_count=1, 2, 4)`` (``sync_files=True``), and a
    ``TensorStore(distributed=True)`` save;
  - cold load into the existing DTensors (every file evicted from the page cache first):
    ``AiotensorReader``, ``FileSystemReader``, and ``TensorStore.load(into=)``;
  - time held by ``dcp.async_save`` (until the call returns, DCP's default stager) with either writer,
    and by a distributed ``TensorStore.save`` (until ``staged``);
and the disk's own limit (fio, as bench_cpu.py) once. Writes bench/results/dcp.md and dcp.json.

    python bench/bench_dcp.py [--gb 1.4] [--worlds 2,4] [--reps 3] [--dir /tmp/aiotensor-bench-dcp]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from bench_cpu import evict, fio_limits, parser, ratio_table, write_results

THREADS = (1, 2, 4)


def rank_main(rank: int, world: int, a: argparse.Namespace, port: int, out: str) -> None:
    import anyio
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from aiotensor import TensorStore
    from aiotensor.dcp import AiotensorReader, AiotensorWriter

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    mesh = init_device_mesh("cpu", (world,))
    n = 24
    rows = int(a.gb * 1e9 / 4 / n / 4096) // world * world
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.w": distribute_tensor(torch.randn(rows, 4096, generator=g), mesh, [Shard(0)]) for i in range(n)}
    total = n * rows * 4096 * 4
    res: dict[str, list[float]] = {}
    base = os.path.join(a.dir, f"w{world}")

    def timed(name: str, fn: Callable[[], Any], cold: str | None = None) -> None:
        if cold is not None and rank == 0:
            evict(cold)
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        res.setdefault(name, []).append(time.perf_counter() - t)

    def fresh(path: str) -> str:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        return path

    def held(name: str, make: Callable[[], Any]) -> None:
        dist.barrier()
        t = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=make())
        res.setdefault(f"held {name}", []).append(time.perf_counter() - t)
        fut.result()
        res.setdefault(f"async total {name}", []).append(time.perf_counter() - t)

    async def store_ops(root: str) -> None:
        # one store for every repetition, as a trainer keeps it: its stager's CPU copies are reused
        async with TensorStore(root, distributed=True, keep_last=1) as store:
            for step in range(a.reps + 1):  # step 0 warms up (the stager's first allocation)
                dist.barrier()
                t = time.perf_counter()
                h = store.save(step, state)
                await h.staged
                held = time.perf_counter() - t
                await h
                dist.barrier()
                saved = time.perf_counter() - t
                if rank == 0:
                    evict(store.path(step))
                dist.barrier()
                t = time.perf_counter()
                await store.load(step, into=state)
                dist.barrier()
                loaded = time.perf_counter() - t
                if step == 0:
                    res["first held store"] = [held]
                    continue
                for k, v in (("held store", held), ("save store", saved), ("load store", loaded)):
                    res.setdefault(k, []).append(v)

    for _ in range(a.reps):
        ai = fresh(os.path.join(base, "ai", "step-000000000001"))
        timed("save aiotensor", lambda: dcp.save(state, storage_writer=AiotensorWriter(ai)))
        timed("load aiotensor", lambda: dcp.load(state, storage_reader=AiotensorReader(ai)), cold=ai)
        for t in THREADS:
            fs = fresh(os.path.join(base, f"fs{t}"))
            timed(f"save fs{t}", lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(fs, thread_count=t)))
        timed("load fs", lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(fs)), cold=fs)
        for t in THREADS:
            fresh(os.path.join(base, f"fs{t}"))
        ai2 = fresh(os.path.join(base, "ai2", "step-000000000001"))
        held("aiotensor", lambda: AiotensorWriter(ai2))
        fs2 = fresh(os.path.join(base, "fs-async"))
        held("fs", lambda: dcp.FileSystemWriter(fs2, thread_count=max(THREADS)))
        fresh(base)
    anyio.run(store_ops, os.path.join(base, "store"))
    fresh(base)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world": world, "bytes": total, "times": res}, f)
    dist.destroy_process_group()


def run_world(world: int, a: argparse.Namespace) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(a.dir, f"result-{world}.json")
    mp.spawn(rank_main, args=(world, a, port, out), nprocs=world, join=True)
    with open(out) as f:
        r: dict[str, Any] = json.load(f)
    r["med"] = {k: statistics.median(v) for k, v in r.pop("times").items()}
    return r


def report(res: dict[str, Any], cmd: str) -> str:
    disk = res["disk"]
    lines = [
        "# aiotensor as DCP storage vs DCP's FileSystemWriter/Reader",
        "",
        f"`{cmd}` — {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo ranks on one machine, "
        f"{res['reps']} repetitions (medians). Disk limit (fio, 1 MiB O_DIRECT): write {disk.get('write', 0):.2f} GB/s, "
        f"read {disk.get('read', 0):.2f} GB/s. Loads are cold (every file evicted with POSIX_FADV_DONTNEED first).",
    ]
    for r in res["worlds"]:
        gb, m = r["bytes"] / 1e9, r["med"]
        best_fs = min(THREADS, key=lambda t: m[f"save fs{t}"])
        rate = {k: gb / v for k, v in m.items() if k.startswith(("save", "load", "async total"))}
        lines += [
            "",
            f"## {r['world']} ranks, {gb:.2f} GB in total",
            "",
            "| operation | aiotensor | DCP FileSystem | TensorStore(distributed=True) |",
            "|---|---|---|---|",
            f"| durable save, GB/s | {rate['save aiotensor']:.2f} | {rate[f'save fs{best_fs}']:.2f} (thread_count={best_fs}; "
            + ", ".join(f"{t}: {rate[f'save fs{t}']:.2f}" for t in THREADS)
            + f") | {rate['save store']:.2f} |",
            f"| cold load into DTensors, GB/s | {rate['load aiotensor']:.2f} | {rate['load fs']:.2f} | {rate['load store']:.2f} |",
            f"| held by dcp.async_save (default stager) / store `staged`, ms | {1e3 * m['held aiotensor']:.0f} | "
            f"{1e3 * m['held fs']:.0f} | {1e3 * m['held store']:.0f} |",
            f"| async save until durable, GB/s | {rate['async total aiotensor']:.2f} | {rate['async total fs']:.2f} | |",
            "",
            f"The distributed store's first save held {1e3 * m['first held store']:.0f} ms (its stager's CPU copies are "
            "allocated and page-faulted once; later saves reuse them, as DCP's stager does with "
            "`cache_staged_state_dict=True`). DCP's default stager allocates afresh on every `async_save`.",
        ]
        lines += ratio_table(
            [
                ("save: aiotensor / best FileSystemWriter", m[f"save fs{best_fs}"] / m["save aiotensor"], ">= 1.3"),
                ("load: aiotensor / FileSystemReader", m["load fs"] / m["load aiotensor"], ">= 1.3"),
                ("save: aiotensor / disk write limit", rate["save aiotensor"] / disk["write"] if disk else 0, ""),
                ("load: aiotensor / disk read limit", rate["load aiotensor"] / disk["read"] if disk else 0, ""),
                ("held: store `staged` / DCP default stager", m["held store"] / m["held fs"], "<= 0.5"),
            ]
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = parser(__doc__, "dcp")
    p.add_argument("--gb", type=float, default=1.4)
    p.add_argument("--worlds", default="2,4")
    a = p.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    res: dict[str, Any] = {"reps": a.reps, "disk": fio_limits(a.dir, min(2048, int(a.gb * 1000)))}
    res["worlds"] = [run_world(int(w), a) for w in a.worlds.split(",")]
    text = report(res, "python bench/bench_dcp.py " + " ".join(sys.argv[1:]))
    print(text)
    write_results(a.out, "dcp" if a.gb >= 1 else "dcp-small", text, res)
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
