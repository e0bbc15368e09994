"""The event loop's worst tick during object-storage saves and loads (issue 27): a 1 ms ticker on
the loop while a TensorStore saves and loads, and ``stream`` reads a step and a torch.save object,
against one SeaweedFS on loopback (same cores). Writes ``bench/results/objects-loop.md``.

    python bench/objects_loop.py
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from bench_objects import Server

import aiotensor

OUT = os.path.join(os.path.dirname(__file__), "results", "objects-loop.md")


async def ticked(fn: Callable[[], Awaitable[Any]], server: Server) -> tuple[float, float, float, float]:
    """(seconds, loop worst and p99 lateness of a 1 ms ticker in ms, the server's CPU share)."""
    lates: list[float] = []

    async def tick() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lates.append(time.perf_counter() - t - 0.001)

    task = asyncio.create_task(tick())
    c0, t0 = server.cpu(), time.perf_counter()
    await fn()
    wall = time.perf_counter() - t0
    task.cancel()
    s = sorted(lates) or [0.0]
    return wall, 1e3 * s[-1], 1e3 * s[int(0.99 * (len(s) - 1))], (server.cpu() - c0) / wall


async def main() -> None:
    server = Server(tempfile.mkdtemp(prefix="weed-"))
    rows = []
    try:
        states = {
            "1.0 GB, 64 tensors": {f"w{i}": torch.randn(4_000_000) for i in range(64)},
            "0.2 GB, 20,000 tensors": {f"t{i}": torch.randn(2500) for i in range(20_000)},
        }
        for name, state in states.items():
            root = f"s3://bench/loop-{len(state)}"
            async with aiotensor.TensorStore(root, keep_last=2) as store:
                for step in range(2):

                    async def save(step: int = step) -> None:
                        await store.save(step, state)

                    rows.append((f"store.save {name} (save {step + 1})", await ticked(save, server)))
                rows.append((f"store.load {name}", await ticked(store.load, server)))
            pt = f"s3://bench/loop-{len(state)}.pt"
            await aiotensor.save_torch(state, pt)
            for what, url in (("a step", root), ("a torch.save object", pt)):

                async def streamed(url: str = url) -> None:
                    async for _ in aiotensor.stream(url):
                        pass

                rows.append((f"stream {what}, {name}", await ticked(streamed, server)))
    finally:
        server.stop()
    lines = [
        "# The event loop during object-storage saves and loads: `python bench/objects_loop.py`",
        "",
        f"vm {os.cpu_count()} cores, torch {torch.__version__}; one SeaweedFS on loopback, on the same cores. A 1 ms ticker on",
        "the loop; its lateness is how long the loop could not run a callback (the LIBRARY limit: 10 ms worst).",
        "",
        "| operation | s | loop worst (ms) | p99 (ms) | server CPU (cores) |",
        "|---|---|---|---|---|",
        *(f"| {n} | {s:.2f} | {w:.1f} | {p:.1f} | {c:.2f} |" for n, (s, w, p, c) in rows),
    ]
    with open(OUT, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    asyncio.run(main())
