"""A model server's reloads, seen from its event loop: how long each takes and how late a 1 ms
ticker task on the loop fires meanwhile (worst and p99), for a bfloat16 model of transformer-sized
tensors (an embedding of 32,000 x 2048, 131 MB, and ``--layers`` blocks of 2048 x 2048 attention
and 2048 x 5632 MLP matrices, 78 MB a block).

Ours: ``load_into`` the serving module, ``prepare_swap`` + ``apply()`` (a second copy, switched
between two requests), ``load_file`` and ``stream`` (every tensor kept). What a user of the peers
writes in an async server instead, in a worker thread so the loop keeps running:
``asyncio.to_thread(model.load_state_dict, safetensors.torch.load_file(path))`` (its mmap default,
then a copy into the module) and the same with its ``pread`` backend. Each repetition runs every
tool back to back with the file in the page cache; medians over repetitions. For ``load_into``,
which ends where the peers do (the module filled in place), the ratio of the faster peer's time over
ours in the same repetition (> 1: we are faster); the others end elsewhere (``prepare_swap`` fills
a second copy in fresh memory, so that the module serves whole versions only; ``load_file`` and
``stream`` return new tensors). The idle loop's lag is the floor.

    python bench/bench_swap.py [--layers 6] [--reps 5] [--swaps 8]

Then the resident memory after each of ``--swaps`` whole-model swaps, each tool in a process of its
own: ``prepare_swap`` + ``apply()`` against safetensors' ``pread`` load switched in with
``load_state_dict(assign=True)`` (what glibc keeps of the weights switched out shows here).
"""

from __future__ import annotations

import asyncio
import gc
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from safetensors.torch import load_file as st_load
from safetensors.torch import save_file as st_save

sys.path.insert(0, os.path.dirname(__file__))
from bench_cpu import Ticker, parser, write_results

import aiotensor

D, F, VOCAB = 2048, 5632, 32000


def model(layers: int) -> torch.nn.Module:
    m = torch.nn.Module()
    m.add_module("embed", torch.nn.Embedding(VOCAB, D))  # 131 MB: above glibc's mmap threshold, as in every LLM
    for i in range(layers):
        block = torch.nn.Module()
        for n in ("q", "k", "v", "o"):
            block.add_module(n, torch.nn.Linear(D, D, bias=False))
        block.add_module("up", torch.nn.Linear(D, F, bias=False))
        block.add_module("down", torch.nn.Linear(F, D, bias=False))
        block.add_module("norm", torch.nn.LayerNorm(D))
        m.add_module(f"layer{i}", block)
    return m.to(torch.bfloat16)


async def measure(fn: Callable[[], Awaitable[Any]]) -> dict[str, float]:
    ticker, stop = Ticker(), asyncio.Event()
    task = asyncio.create_task(ticker.run(stop))
    await asyncio.sleep(0.005)
    t0 = time.perf_counter()
    out = await fn()
    took = time.perf_counter() - t0
    stop.set()
    await task
    del out  # what a load returns is the caller's to free, not the tool's: outside the ticks
    worst, p99 = ticker.summary()
    return {"s": took, "worst_ms": 1e3 * worst, "p99_ms": 1e3 * p99}


async def run(layers: int, reps: int, folder: str) -> dict[str, Any]:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"model-{VOCAB}-{layers}x{D}.safetensors")
    serving = model(layers)
    if not os.path.exists(path):
        st_save({k: v.contiguous() for k, v in model(layers).state_dict().items()}, path)

    async def swap() -> None:
        (await aiotensor.prepare_swap(serving, path)).apply()

    async def stream() -> dict[str, torch.Tensor]:
        async with aiotensor.stream(path) as s:
            return {k: t async for k, t in s}

    def peer(backend: str) -> Callable[[], Awaitable[Any]]:
        return lambda: asyncio.to_thread(lambda: serving.load_state_dict(st_load(path, backend=backend)))

    tools: dict[str, Callable[[], Awaitable[Any]]] = {
        "idle loop (floor)": lambda: asyncio.sleep(0.1),
        "safetensors load_file + load_state_dict, in a thread": peer("mmap"),
        "safetensors load_file(pread) + load_state_dict, in a thread": peer("pread"),
        "aiotensor load_into": lambda: aiotensor.load_into(serving, path),
        "aiotensor prepare_swap + apply": swap,
        "aiotensor load_file": lambda: aiotensor.load_file(path),
        "aiotensor stream": stream,
    }
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in tools}
    for _ in range(reps):
        with open(path, "rb") as f:  # in the page cache
            while f.read(64 << 20):
                pass
        for name, fn in tools.items():
            gc.collect()
            rows[name].append(await measure(fn))
    return {"bytes": os.path.getsize(path), "rows": rows}


MEMORY_CHILD = r"""
import asyncio, gc, sys, time, psutil, torch
sys.path.insert(0, sys.argv[4])
from safetensors.torch import load_file as st_load
import aiotensor, bench_swap
tool, path, swaps = sys.argv[1], sys.argv[2], int(sys.argv[3])
m = bench_swap.model(int(sys.argv[5]))
rss = []

async def main():
    for _ in range(swaps):
        if tool == "ours":
            (await aiotensor.prepare_swap(m, path)).apply()
        else:  # new tensors switched in, as a peer's user swaps whole weights
            m.load_state_dict(st_load(path, backend="pread"), assign=True)
        gc.collect()
        await asyncio.sleep(0.3)  # (ours frees the old weights in a worker thread)
        rss.append(psutil.Process().memory_info().rss)

asyncio.run(main())
print(" ".join(str(r >> 20) for r in rss))
"""


def memory(path: str, layers: int, swaps: int) -> dict[str, list[int]]:
    """Resident memory (MiB) after each of ``swaps`` swaps of a whole model, each tool in a
    process of its own: ours (``prepare_swap`` + ``apply``) and safetensors' ``pread`` load switched
    in with ``load_state_dict(assign=True)``."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    out = {}
    for tool in ("ours", "safetensors pread + load_state_dict(assign=True)"):
        got = subprocess.run(
            [sys.executable, "-c", MEMORY_CHILD, "ours" if tool == "ours" else "peer", path, str(swaps), here, str(layers)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        out[tool] = [int(x) for x in got.stdout.split()]
    return out


def table(res: dict[str, Any]) -> str:
    rows = res["rows"]
    best = [min(a["s"], b["s"]) for a, b in zip(*(v for k, v in rows.items() if k.startswith("safetensors")), strict=True)]
    out = [
        f"# A model server's reloads, seen from its event loop ({res['bytes'] / 1e9:.2f} GB of bfloat16, warm)\n",
        "| tool | time (ms) | faster peer ÷ ours | loop worst (ms) | loop p99 (ms) |",
        "|---|---|---|---|---|",
    ]
    for name, runs in rows.items():
        same_end = name == "aiotensor load_into"  # the module filled in place, as the peers leave it
        ratio = statistics.median(b / r["s"] for b, r in zip(best, runs, strict=True)) if same_end else None
        out.append(
            f"| {name} | {1e3 * statistics.median(r['s'] for r in runs):.0f} | {'' if ratio is None else f'{ratio:.2f}'} | "
            f"{statistics.median(r['worst_ms'] for r in runs):.1f} | {statistics.median(r['p99_ms'] for r in runs):.1f} |"
        )
    if res.get("memory"):
        out += ["", "Resident memory (MiB) after each swap of the whole model, each tool in a process of its own:", ""]
        out += ["| tool | " + " | ".join(f"swap {i + 1}" for i in range(len(next(iter(res["memory"].values()))))) + " |"]
        out += ["|---|" + "---|" * len(next(iter(res["memory"].values())))]
        out += [f"| {tool} | " + " | ".join(map(str, rss)) + " |" for tool, rss in res["memory"].items()]
    return "\n".join(out) + "\n"


def main() -> None:
    p = parser(__doc__, "swap")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--swaps", type=int, default=8, help="swaps per process in the memory section")
    a = p.parse_args()
    a.reps = max(a.reps, 1)
    res = asyncio.run(run(a.layers, a.reps, a.dir))
    res["memory"] = memory(os.path.join(a.dir, f"model-{VOCAB}-{a.layers}x{D}.safetensors"), a.layers, a.swaps)
    text = table(res)
    print(text)
    write_results(a.out, "swap", text, res)


if __name__ == "__main__":
    main()
