"""20,000 small tensors, warm, in one process: each of aiotensor's loaders against safetensors'
``load_file(backend="pread")`` (its fastest copying loader on this layout) in the same repetition,
the median of the paired ratios (> 1: faster). With ``--other TREE`` (a ``git worktree`` of another
commit) the two trees run alternately, each in a process of its own, so that a change is measured
against the machine's drift.

    python bench/bench_small.py [--layout flat|matrix] [--tensors 20000] [--reps 7] [--runs 2] [--other TREE] [--busy]

Loaders: ``load_file``, ``stream`` (every tensor kept), ``load_into`` a module holding those
tensors (one submodule per tensor: ``bench_serving.Holder``), and a store's ``load()`` (of a store
each tree saves itself). Every file is read into the page cache before each repetition. Layouts:
``flat``, bench_serving's (1-D float32 tensors of ~5 KB: 0.1 GB), and ``matrix`` (2-D float32
tensors of 32 B to 512 B: almost no bytes, so every microsecond is per-tensor work).

``--busy``: a thread of pure Python spins beside every loader, as an application's threads run
beside a hot swap's load (request handlers, a tokenizer). A loader that gives the GIL up around
each tensor's read waits a switch interval to take it back each time it loses it to that thread
(5 ms by default; aiotensor sets 1 ms during its operations, ``Scheduler(switch_interval=)``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = r"""
import asyncio, gc, hashlib, os, statistics, sys, time
tree, folder, reps, busy = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "busy"
sys.path.insert(0, tree); sys.path.insert(0, os.path.join(tree, "bench"))
import torch
from safetensors.torch import load_file as st_load
from bench_serving import Holder
import aiotensor
path = os.path.join(folder, "small.safetensors")
# a store per tree, saved by that tree (two commits may write different manifests)
store = os.path.join(folder, "store-" + hashlib.sha1(os.path.realpath(tree).encode()).hexdigest()[:8])
holder = Holder(st_load(path))

async def save():
    async with aiotensor.TensorStore(store) as s:
        await s.save(1, st_load(path))

if not os.path.exists(store):
    asyncio.run(save())

def warm():  # every file in the page cache: a store writes its shards with O_DIRECT (not cached),
    # and our loads read what the cache lacks with O_DIRECT (leaving it uncached)
    for root, _, files in os.walk(folder):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                while fh.read(64 << 20):
                    pass

async def stream():
    out = {}
    async with aiotensor.stream(path) as s:
        async for k, t in s:
            out[k] = t
    return out

async def sload():
    async with aiotensor.TensorStore(store, readonly=True) as s:
        return await s.load()

async def into():
    await aiotensor.load_into(holder, path)

tools = {"safetensors pread": lambda: asyncio.to_thread(st_load, path, backend="pread"),
         "load_file": lambda: aiotensor.load_file(path), "stream": stream, "load_into": into, "store load()": sload}

def spin():  # an application thread that never waits: each loader shares the GIL with it
    x = 0
    while True:
        x += 1

async def main():
    if busy:
        import threading
        threading.Thread(target=spin, daemon=True).start()
    res = {}
    for _ in range(reps):
        warm()
        for k, fn in tools.items():
            gc.collect()
            t = time.perf_counter()
            x = await fn()
            res.setdefault(k, []).append(time.perf_counter() - t)
            del x
    base = res["safetensors pread"]
    for k, v in res.items():
        print("%s\t%.1f\t%.2f" % (k, 1e3 * statistics.median(v), statistics.median(b / a for a, b in zip(v, base))))

asyncio.run(main())
"""


def setup(folder: str, n: int, layout: str) -> None:
    import torch
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "small.safetensors")
    if os.path.exists(path):
        return
    g = torch.Generator().manual_seed(0)
    if layout == "flat":
        state = {f"blocks.{i}.p": torch.randn(1280 + i % 7, generator=g) for i in range(n)}
    else:
        state = {f"blocks.{i}.w": torch.randn(1 + i % 16, 8, generator=g) for i in range(n)}
    save_file(state, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", choices=["flat", "matrix"], default="flat")
    p.add_argument("--tensors", type=int, default=20_000)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--runs", type=int, default=2, help="child processes per tree, alternating")
    p.add_argument("--other", help="another tree (a git worktree) to run alternately")
    p.add_argument("--busy", action="store_true", help="a thread of pure Python runs beside every loader")
    p.add_argument("--dir", default="/tmp/aiotensor-bench-small")
    a = p.parse_args()
    folder = os.path.join(a.dir, f"{a.layout}-{a.tensors}")
    setup(folder, a.tensors, a.layout)
    trees = {"this tree": os.path.dirname(HERE)} | ({"other": os.path.abspath(a.other)} if a.other else {})
    rows: dict[str, dict[str, list[str]]] = {}
    for _ in range(a.runs):
        for name, tree in trees.items():
            got = subprocess.run(
                [sys.executable, "-c", CHILD, tree, folder, str(a.reps), "busy" if a.busy else "idle"],
                capture_output=True,
                text=True,
                check=True,
            )
            for line in got.stdout.strip().splitlines():
                tool, ms, ratio = line.split("\t")
                rows.setdefault(tool, {}).setdefault(name, []).append(f"{ratio} ({ms} ms)")
    beside = ", beside a thread of pure Python" if a.busy else ""
    print(
        f"# {a.tensors} small tensors ({a.layout}), warm, one process{beside}: ratio to safetensors pread (> 1: faster), per run\n"
    )
    print("| tool | " + " | ".join(trees) + " |\n|---|" + "---|" * len(trees))
    for tool, by in rows.items():
        print(f"| {tool} | " + " | ".join(", ".join(by.get(t, [])) for t in trees) + " |")


if __name__ == "__main__":
    main()
