"""A model server's first load (issue 26): each load in a fresh process, as a server loads its
weights once per process, the file in the page cache (a restart, or a file just downloaded).

``bench_serving.py`` times loads back to back in one process, where a copying peer gets memory that
glibc hands back already faulted in by the load before; in a fresh process every tool faults in
every page it copies into. Tools: the copying peers of ``bench_serving.py`` (safetensors mmap +
clone and pread, ``torch.load(mmap=True)`` + clone, fastsafetensors, the Run:ai streamer,
tensorizer) and ours (``stream``, ``load_file``, a store's ``load()``, with and without verifying
its checksums); ``load_into`` is left out (it reads into a module whose memory its construction
touched). Every repetition runs every tool once, each in its own process, in turn; a ratio is the
fastest copying peer's time over ours in the same repetition (> 1: we are faster), the table gives
medians. The limit beside them: one copy of the state into fresh memory, in a fresh process too.

    python bench/bench_fresh.py [--layers 8] [--reps 5] [--dir /tmp/aiotensor-bench-fresh]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from safetensors.torch import save_file as st_save

sys.path.insert(0, os.path.dirname(__file__))
from bench_cpu import parser, transformer_state, write_results
from bench_serving import ours, peers, warm

import aiotensor

OURS = ("aiotensor.stream", "aiotensor.load_file", "aiotensor store.load()", "aiotensor store.load(verify=False)")
LIMIT = "limit: one copy into fresh memory"
SKIP = ("safetensors mmap (no copy)", "aiotensor.load_into", "aiotensor.load_file(mmap)",
        "aiotensor.load_file(mmap, verify=False)", "aiotensor store.load(mmap)")  # fmt: skip


def tools(d: str) -> dict[str, Any]:
    src, store = os.path.join(d, "model.safetensors"), os.path.join(d, "store")
    out: dict[str, Any] = {
        k: (lambda fn: lambda: asyncio.to_thread(fn))(fn) for k, fn in peers(src, f"{d}/model.pt", f"{d}/model.tensors").items()
    }
    out |= ours(src, store, {})

    async def unverified() -> dict[str, torch.Tensor]:
        async with aiotensor.TensorStore(store, readonly=True) as s:
            return await s.load(verify=False)

    out["aiotensor store.load(verify=False)"] = unverified
    return {k: v for k, v in out.items() if k not in SKIP}


def child(d: str, tool: str) -> None:
    """One load in this fresh process: its seconds on stdout, as JSON."""
    if tool == LIMIT:
        src = torch.ones(os.path.getsize(os.path.join(d, "model.safetensors")) // 4)  # touched: the copy's source
        t0 = time.perf_counter()
        out = torch.empty_like(src).copy_(src)
        print(json.dumps({"s": time.perf_counter() - t0}))
        del out
        return
    fn = tools(d)[tool]

    async def one() -> float:
        t0 = time.perf_counter()
        got = await fn()
        s = time.perf_counter() - t0
        assert got, tool
        return s

    print(json.dumps({"s": asyncio.run(one())}))


async def save(store: str, state: dict[str, torch.Tensor]) -> None:
    async with aiotensor.TensorStore(store) as s:
        await s.save(1, state)


def run(a: argparse.Namespace) -> dict[str, Any]:
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    state = transformer_state(layers=a.layers, d=1024, vocab=32000)
    st_save(state, os.path.join(a.dir, "model.safetensors"))
    torch.save(state, os.path.join(a.dir, "model.pt"))
    from tensorizer import TensorSerializer

    ser = TensorSerializer(os.path.join(a.dir, "model.tensors"))
    ser.write_state_dict(state)
    ser.close()

    asyncio.run(save(os.path.join(a.dir, "store"), state))
    nbytes = sum(t.nbytes for t in state.values())
    del state
    paths = [os.path.join(r, f) for r, _, fs in os.walk(a.dir) for f in fs]
    names = [*tools(a.dir), LIMIT]
    times: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(a.reps):
        for name in names:
            warm(paths)
            got = subprocess.run(
                [sys.executable, __file__, "--child", name, "--dir", a.dir], capture_output=True, text=True, check=True
            )
            times[name].append(json.loads(got.stdout.strip().splitlines()[-1])["s"])
    shutil.rmtree(a.dir, ignore_errors=True)
    return {"bytes": nbytes, "reps": a.reps, "times": times}


def report(res: dict[str, Any]) -> str:
    times, gb = res["times"], res["bytes"] / 1e9
    peers_ = [k for k in times if k not in (*OURS, LIMIT)]
    best = [min(times[k][i] for k in peers_) for i in range(res["reps"])]
    lines = [
        "# A server's first load: each load in a fresh process, the file in the page cache",
        "",
        f"`python bench/bench_fresh.py --reps {res['reps']}`: one safetensors file of {gb:.2f} GB (the transformer state of "
        "`bench_serving.py`); ratio: the fastest copying peer's time over ours in the same repetition, median (> 1: faster).",
        "",
        "| tool | GB/s | ratio |",
        "|---|---|---|",
    ]
    for k, v in times.items():
        ratio = f"{statistics.median(b / s for b, s in zip(best, v, strict=True)):.2f}" if k in OURS else ""
        lines.append(f"| {k} | {gb / statistics.median(v):.2f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if "--child" in sys.argv:
        c = argparse.ArgumentParser()
        c.add_argument("--child")
        c.add_argument("--dir")
        a = c.parse_args()
        child(a.dir, a.child)
        return
    p = parser(__doc__, "fresh")
    p.add_argument("--layers", type=int, default=8)
    a = p.parse_args()
    a.reps = max(a.reps, 1)
    res = run(a)
    text = report(res)
    print(text)
    write_results(a.out, "fresh", text, res)


if __name__ == "__main__":
    main()
