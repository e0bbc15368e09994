"""Serving (issue 13): streaming weights into memory, against the peers and the disk, in one run.

One state (default ~300 MB of transformer weights) as one safetensors file and as 4 Hugging Face
shards, read cold (pages dropped) and warm, by ``aiotensor.stream`` (tensors consumed as they land),
``safetensors.load_file`` and ``torch.load(mmap=True)``, each + a copy into owned memory (both map
the file and read nothing until a tensor is touched), both in ``asyncio.to_thread``.
Reports: time to the first tensor, throughput, peak extra RSS, and the worst / p99 lag of a 1 ms
ticker on the loop; the fio sequential read limit of the same folder. Medians of ``--reps``.

    python bench/bench_serving.py [--layers 6] [--reps 3] [--dir /tmp/aiotensor-bench-serving]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from safetensors.torch import load_file as st_load
from safetensors.torch import save_file as st_save

sys.path.insert(0, os.path.dirname(__file__))
from bench_cpu import PeakRSS, Ticker, evict, fio_limits, parser, transformer_state, write_results

import aiotensor


async def measure(fn: Callable[[Callable[[], None]], Awaitable[Any]]) -> dict[str, float]:
    """Run ``fn(first)`` (it calls ``first()`` when its first tensor is usable) under a ticker and
    an RSS sampler."""
    ticker, stop = Ticker(), asyncio.Event()
    task = asyncio.create_task(ticker.run(stop))
    await asyncio.sleep(0.01)
    first: list[float] = []
    t0 = time.perf_counter()
    with PeakRSS() as rss:
        out = await fn(lambda: first.append(time.perf_counter()) if not first else None)
        total = time.perf_counter() - t0
        del out
    stop.set()
    await task
    worst, p99 = ticker.summary()
    return {
        "total_s": total,
        "first_s": (first[0] - t0) if first else total,
        "rss_mb": rss.extra / 1e6,
        "worst_ms": 1e3 * worst,
        "p99_ms": 1e3 * p99,
    }


async def run(a: argparse.Namespace) -> dict[str, Any]:
    state = transformer_state(layers=a.layers, d=1024, vocab=32000)
    nbytes = sum(t.nbytes for t in state.values())
    shutil.rmtree(a.dir, ignore_errors=True)
    one, hf = os.path.join(a.dir, "one"), os.path.join(a.dir, "hf")
    os.makedirs(one)
    os.makedirs(hf)
    st_save(state, os.path.join(one, "model.safetensors"))
    keys = list(state)
    parts = [keys[i::4] for i in range(4)]
    weight_map = {}
    for i, ks in enumerate(parts, 1):
        name = f"model-{i:05d}-of-00004.safetensors"
        st_save({k: state[k] for k in ks}, os.path.join(hf, name))
        weight_map |= dict.fromkeys(ks, name)
    with open(os.path.join(hf, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": nbytes}, "weight_map": weight_map}, f)
    pt = os.path.join(a.dir, "model.pt")
    torch.save(state, pt)
    del state
    res: dict[str, Any] = {"bytes": nbytes, "disk": fio_limits(a.dir, 512), "rows": {}}

    def files(src: str) -> list[str]:
        return [os.path.join(src, n) for n in sorted(os.listdir(src)) if n.endswith(".safetensors")]

    async def ours(src: str, first: Callable[[], None]) -> Any:
        out = {}
        async with aiotensor.stream(src) as s:
            async for name, t in s:
                first()
                out[name] = t
        return out

    def st_owned(f: str) -> dict[str, torch.Tensor]:
        # safetensors maps the file: a tensor's bytes are read when first touched, so copy them
        # into owned memory, as a server does before it serves (or moves them to the GPU)
        return {k: v.clone() for k, v in st_load(f).items()}

    async def safetensors_(src: str, first: Callable[[], None]) -> Any:
        out = {}
        for f in files(src):
            out |= await asyncio.to_thread(st_owned, f)
            first()
        return out

    def torch_mmap(first: Callable[[], None]) -> Any:
        m = torch.load(pt, mmap=True, weights_only=True)
        out = {}
        for k, v in m.items():
            out[k] = v.clone()
            first()
        return out

    tools: dict[str, Callable[[str, bool], Callable[[Callable[[], None]], Awaitable[Any]]]] = {
        "aiotensor.stream": lambda src, _: lambda first: ours(src, first),
        "safetensors.load_file": lambda src, _: lambda first: safetensors_(src, first),
        "torch.load(mmap)+copy": lambda src, _: lambda first: asyncio.to_thread(torch_mmap, first),
    }
    for layout, src in (("one file", one), ("4 HF shards", hf)):
        for cold in (True, False):
            for name, make in tools.items():
                if name.startswith("torch") and layout != "one file":
                    continue
                runs = []
                for _ in range(a.reps):
                    for p in (src, pt):
                        evict(p) if cold else None
                    runs.append(await measure(make(src, cold)))
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                res["rows"][f"{name} | {layout} | {'cold' if cold else 'warm'}"] = med
    shutil.rmtree(a.dir, ignore_errors=True)
    return res


def report(res: dict[str, Any]) -> str:
    gb = res["bytes"] / 1e9
    lines = [
        f"# Serving: {gb:.2f} GB of transformer weights, medians",
        "",
        f"Disk limit (fio sequential read): {res['disk'].get('read', float('nan')):.2f} GB/s.",
        "",
        "| tool | layout | cache | first tensor (ms) | GB/s | peak extra RSS (MB) | loop worst / p99 (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, r in res["rows"].items():
        name, layout, cache = key.split(" | ")
        lines.append(
            f"| {name} | {layout} | {cache} | {1e3 * r['first_s']:.0f} | {gb / r['total_s']:.2f} | {r['rss_mb']:.0f} | "
            f"{r['worst_ms']:.1f} / {r['p99_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = parser(__doc__, "serving")
    p.add_argument("--layers", type=int, default=6)
    a = p.parse_args()
    res = asyncio.run(run(a))
    text = report(res)
    print(text)
    write_results(a.out, "serving", text, res)


if __name__ == "__main__":
    main()
