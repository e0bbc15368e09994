"""Where the event loop's stalls during a cold 1.4 GB load come from (issue 11), and what the
settings aimed at them are worth: the worker threads' priority (``TensorStore(nice=)``), the GIL
switch interval during the load (``TensorStore(switch_interval=)``) and the largest read into host
memory (``aiotensor.knobs.HOST_READ_BYTES``).

A 1 ms ticker runs on the loop while ``store.load(step, into=)`` reads a cold checkpoint (page cache
dropped before each load). Around every tick it reads the loop thread's ``/proc/self/task/<tid>/
schedstat``: the time the thread spent runnable but waiting for a core (run-queue delay) and on a
core. A late tick whose lateness is run-queue delay waited for a CPU (worker threads, the kernel
copying for them, other processes); one that was not runnable waited for the GIL. Linux only.

    python bench/bench_stall_cause.py [--gb 1.4] [--reps 3] [--dir /tmp/aiotensor-bench-stall]
"""

from __future__ import annotations

import asyncio
import os
import platform
import shutil
import statistics
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_cpu import evict, nbytes, parser, write_results
from bench_http import sized_state

import aiotensor
from aiotensor import knobs

LATE = 0.004  # a tick this late (s) counts as a stall

# name -> (nice, largest host read, workers, GIL switch interval during the load)
CONFIGS = {
    "defaults (nice 10, 1 MiB reads, 4 workers, switch interval 1 ms)": (10, 1 << 20, 4, 0.001),
    "switch interval 5 ms (Python's default)": (10, 1 << 20, 4, None),
    "nice 0": (0, 1 << 20, 4, 0.001),
    "256 KiB reads": (10, 256 << 10, 4, 0.001),
    "16 MiB reads": (10, 16 << 20, 4, 0.001),
    "nice 0, 16 MiB reads, 5 ms (before issue 11's fixes)": (0, 16 << 20, 4, None),
    "2 workers": (10, 1 << 20, 2, 0.001),
}


def schedstat(tid: int) -> tuple[float, float]:
    """(seconds on a core, seconds runnable waiting for one) of thread ``tid``."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        on, wait, _ = f.read().split()
    return int(on) / 1e9, int(wait) / 1e9


async def ticker(stop: asyncio.Event, ticks: list[tuple[float, float]]) -> None:
    tid = threading.get_native_id()
    while not stop.is_set():
        _, w0 = schedstat(tid)
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        late = time.perf_counter() - t - 0.001
        ticks.append((late, schedstat(tid)[1] - w0))


async def one_load(store: aiotensor.TensorStore, into: dict[str, torch.Tensor], gb: float) -> dict[str, float]:
    await asyncio.to_thread(evict, store.path(1))  # every file of the step
    await asyncio.sleep(0.3)
    stop, ticks = asyncio.Event(), []
    task = asyncio.create_task(ticker(stop, ticks))
    await asyncio.sleep(0.05)
    t = time.perf_counter()
    await store.load(1, into=into)
    seconds = time.perf_counter() - t
    stop.set()
    await task
    lates = sorted(late for late, _ in ticks)
    stalls = [(late, wait) for late, wait in ticks if late > LATE]
    return {
        "gbps": gb / seconds,
        "worst_ms": 1e3 * lates[-1],
        "p99_ms": 1e3 * lates[int(0.99 * (len(lates) - 1))],
        "stalled_ms": 1e3 * sum(late for late, _ in stalls),
        "runqueue_ms": 1e3 * sum(min(late, wait) for late, wait in stalls),
    }


async def run(a: Any) -> dict[str, Any]:
    shutil.rmtree(a.dir, ignore_errors=True)
    state = sized_state(a.gb)
    gb = nbytes(state) / 1e9
    async with aiotensor.TensorStore(a.dir) as store:
        await store.save(1, state)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    default_piece = knobs.HOST_READ_BYTES
    try:
        for rep in range(a.reps):
            for name, (nice, piece, workers, interval) in CONFIGS.items():
                knobs.HOST_READ_BYTES = piece
                opts = {"nice": nice, "workers": workers, "switch_interval": interval}
                async with aiotensor.TensorStore(a.dir, readonly=True, **opts) as store:
                    rows[name].append(await one_load(store, state, gb))
                print(f"rep {rep}: {name}: {rows[name][-1]}", flush=True)
    finally:
        knobs.HOST_READ_BYTES = default_piece
        shutil.rmtree(a.dir, ignore_errors=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rows.items()}
    return {"gb": gb, "reps": a.reps, "rows": rows, "medians": med}


def report(res: dict[str, Any]) -> str:
    lines = [
        f"# Event-loop stalls during a cold {res['gb']:.2f} GB `load(into=)`, and their cause",
        "",
        f"`python bench/bench_stall_cause.py` — {platform.node()}, {os.cpu_count()} cores, kernel {platform.release()}, "
        f"torch {torch.__version__}; {res['reps']} loads per row (rows interleaved), medians. A stall is a 1 ms "
        f'tick that fired more than {LATE * 1e3:.0f} ms late; "waiting for a core" is the part of the stalls the '
        "loop's thread spent runnable on the run queue (`/proc/self/task/<tid>/schedstat`); the rest it was not "
        "runnable: waiting for the GIL.",
        "",
        "| settings | load GB/s | tick worst ms | tick p99 ms | stalled ms per load | of which waiting for a core |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in res["medians"].items():
        share = m["runqueue_ms"] / m["stalled_ms"] if m["stalled_ms"] else 0.0
        lines.append(
            f"| {name} | {m['gbps']:.2f} | {m['worst_ms']:.1f} | {m['p99_ms']:.1f} | {m['stalled_ms']:.0f} | {100 * share:.0f}% |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = parser(__doc__, "stall")
    p.add_argument("--gb", type=float, default=1.4)
    a = p.parse_args()
    res = asyncio.run(run(a))
    text = report(res)
    print(text)
    write_results(a.out, "stall-cause", text, res)


if __name__ == "__main__":
    main()
