"""Event-loop responsiveness with many small tensors (issue 11): aiotensor against torch.save/torch.load
and safetensors run in a thread (``asyncio.to_thread``), in the same run.

For a state of N small tensors (default 20,000) it measures: how long ``store.save()`` itself holds
the caller, save (durable) + load time, and the lag of a 1 ms ticker task on the loop (worst and p99)
during each tool's save and load; the idle loop's lag is the floor. Several repetitions, medians.
The serving paths are timed too: ``aiotensor.stream`` of the safetensors file (every tensor kept)
and ``aiotensor.load_into`` a module of those parameters. What a load returns is kept until the
ticker stops, then freed in a thread: freeing 20,000 tensors is the caller's work, whoever made them.

``--where``: at each tick of aiotensor's rows later than 2 ms, where every busy worker thread stands
(its two innermost frames), counted and printed, most often first. The thread that held the GIL
let it go at the first check after its long call, so it stands just past that call (or in the
line that freed what a function held as it returned): how the C loops over 20,000 items that held
the GIL 1-5 ms each were found.

    python bench/bench_loop.py [--tensors 20000] [--reps 3] [--dir /tmp/aiotensor-bench-loop] [--where]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from safetensors.torch import load_file as st_load
from safetensors.torch import save_file as st_save

sys.path.insert(0, os.path.dirname(__file__))
from bench_cpu import Ticker, fsync_path, parser, write_results

import aiotensor


def small_state(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i // 4}.p{i % 4}": torch.randn(64, generator=g) for i in range(n)}


class WhereTicker(Ticker):
    """A :class:`Ticker` that counts, at each tick later than 2 ms, where the busy worker threads stand."""

    def __init__(self, seen: Counter[str]) -> None:
        super().__init__()
        self.seen, self.loop_thread = seen, threading.get_ident()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lags.append(time.perf_counter() - t - 0.001)
            if self.lags[-1] > 0.002:
                for tid, frame in sys._current_frames().items():
                    where = []
                    while frame is not None and len(where) < 2:
                        where.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}")
                        frame = frame.f_back
                    if tid != self.loop_thread and not any(w.startswith(IDLE) for w in where):
                        self.seen[" < ".join(where)] += 1


IDLE = ("threads.py", "threading.py", "queue.py", "_asyncio.py")  # a worker waiting for work
WHERE: Counter[str] | None = None  # --where


async def with_ticker(fn: Callable[[], Awaitable[Any]], where: bool = False) -> tuple[float, float, float]:
    """Seconds ``fn`` took, and the ticker's worst and p99 lag (ms) meanwhile."""
    ticker, stop = (WhereTicker(WHERE) if where and WHERE is not None else Ticker()), asyncio.Event()
    task = asyncio.create_task(ticker.run(stop))
    await asyncio.sleep(0.01)
    kept: list[Any] = []
    t = time.perf_counter()
    try:
        kept.append(await fn())
    finally:
        dt = time.perf_counter() - t
        stop.set()
        await task
    await asyncio.to_thread(kept.clear)
    worst, p99 = ticker.summary()
    return dt, 1e3 * worst, 1e3 * p99


class Params(torch.nn.Module):
    """A module whose state_dict has :func:`small_state`'s keys and shapes."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.ParameterDict() for _ in range((n + 3) // 4))
        for i in range(n):
            self.layers[i // 4][f"p{i % 4}"] = torch.nn.Parameter(torch.zeros(64))


async def streamed(path: str) -> dict[str, torch.Tensor]:
    async with aiotensor.stream(path) as s:
        return {name: t async for name, t in s}


async def run(a: argparse.Namespace) -> dict[str, Any]:
    state = small_state(a.tensors)
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    res: dict[str, Any] = {"tensors": a.tensors, "bytes": sum(t.nbytes for t in state.values())}
    rows: dict[str, list[tuple[float, ...]]] = {}

    def add(name: str, *vals: float) -> None:
        rows.setdefault(name, []).append(vals)

    async def idle() -> None:
        await asyncio.sleep(1.0)

    module = Params(a.tensors)
    async with aiotensor.TensorStore(os.path.join(a.dir, "store"), keep_last=1) as store:
        for rep in range(a.reps + 1):  # the first round warms up (maps staging) and is not counted
            add("idle", *await with_ticker(idle))
            held: list[float] = []

            async def save(step: int = rep) -> None:
                t = time.perf_counter()
                h = store.save(step, state)
                held.append(time.perf_counter() - t)
                await h

            s = await with_ticker(save, where=bool(rep))
            ld = await with_ticker(store.load, where=bool(rep))
            if rep:
                add("aiotensor", s[0], ld[0], s[1], s[2], ld[1], ld[2], held[0] * 1e3)

            p = os.path.join(a.dir, f"t{rep}.pt")

            def tsave() -> None:
                torch.save(state, p)
                fsync_path(p)

            s = await with_ticker(lambda: asyncio.to_thread(tsave))
            ld = await with_ticker(lambda: asyncio.to_thread(torch.load, p))
            if rep:
                add("torch.save/load (to_thread)", s[0], ld[0], s[1], s[2], ld[1], ld[2], float("nan"))
            q = os.path.join(a.dir, f"s{rep}.safetensors")

            def ssave() -> None:
                st_save(state, q)
                fsync_path(q)

            s = await with_ticker(lambda: asyncio.to_thread(ssave))
            ld = await with_ticker(lambda: asyncio.to_thread(st_load, q))
            if rep:
                add("safetensors (to_thread)", s[0], ld[0], s[1], s[2], ld[1], ld[2], float("nan"))
            ld = await with_ticker(lambda: streamed(q), where=bool(rep))
            nan = float("nan")
            if rep:
                add("aiotensor.stream (of that file)", nan, ld[0], nan, nan, ld[1], ld[2], nan)
            ld = await with_ticker(lambda: aiotensor.load_into(module, q), where=bool(rep))
            if rep:
                add("aiotensor.load_into (a module)", nan, ld[0], nan, nan, ld[1], ld[2], nan)
    res["rows"] = {k: [statistics.median(c) for c in zip(*v, strict=True)] for k, v in rows.items()}
    shutil.rmtree(a.dir, ignore_errors=True)
    return res


def report(res: dict[str, Any]) -> str:
    r = res["rows"]
    lines = [
        f"# Event loop with {res['tensors']} small tensors ({res['bytes'] / 1e6:.1f} MB), medians",
        "",
        "| tool | save s | load s | save+load vs torch | loop worst / p99 during save (ms) | during load (ms) | save() call held (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    base = r["torch.save/load (to_thread)"][0] + r["torch.save/load (to_thread)"][1]
    for name in r:
        if name == "idle":
            continue
        s, ld, sw, sp, lw, lp, held = r[name]
        if s != s:  # a load only
            lines.append(f"| {name} | - | {ld:.3f} | - | - | {lw:.1f} / {lp:.1f} | - |")
            continue
        lines.append(
            f"| {name} | {s:.3f} | {ld:.3f} | {base / (s + ld):.2f}x | {sw:.1f} / {sp:.1f} | {lw:.1f} / {lp:.1f} | "
            + ("-" if held != held else f"{held:.2f}")
            + " |"
        )
    idle = r["idle"]
    lines += ["", f"Idle loop (the floor): worst {idle[1]:.1f} ms, p99 {idle[2]:.1f} ms.", ""]
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__, "loop")
    p.add_argument("--tensors", type=int, default=20_000)
    p.add_argument("--where", action="store_true", help="where worker threads stand at ticks later than 2 ms")
    a = p.parse_args()
    global WHERE
    WHERE = Counter() if a.where else None
    res = asyncio.run(run(a))
    text = report(res)
    print(text)
    if WHERE is not None:
        print("Where the busy worker threads stood at aiotensor's ticks later than 2 ms (count, innermost frame first):")
        print("\n".join(f"{n:5d}  {w}" for w, n in WHERE.most_common(15)))
    write_results(a.out, f"loop-{a.tensors}", text, res)


if __name__ == "__main__":
    main()
