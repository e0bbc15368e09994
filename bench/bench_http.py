"""A real HTTP server's request latency while a 1.4 GB checkpoint loads on its event loop (issue 11).

An aiohttp server runs in this process; a client in another process sends requests one at a time
over a keep-alive connection (a 2 ms pause between them) to 127.0.0.1 and records each latency.
Phases, each about as long as one load: idle; ``await store.load(into=)`` (aiotensor); and the peers
run the way a server would call them, ``await asyncio.to_thread(...)``: ``torch.load(mmap=True)``
+ copy, and ``safetensors.torch.load_file`` + copy. Every load is cold (the files are evicted from
the page cache first) and fills the same existing tensors. Requests are assigned to phases by the
time they started (CLOCK_MONOTONIC is shared by both processes). Repetitions; medians.
Target: worst request during the aiotensor load <= 2x the idle worst.

    python bench/bench_http.py [--reps 3] [--small] [--dir /tmp/aiotensor-bench-http]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_cpu import evict, fsync_path, nbytes, parser, ratio_table, transformer_state, write_results

import aiotensor

CLIENT = r"""
import http.client, json, sys, time
port, limit_s = int(sys.argv[1]), float(sys.argv[2])
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
rec, end = [], time.monotonic() + limit_s
print("ready", flush=True)
while time.monotonic() < end and len(rec) < 500_000:  # bounded in time and count
    t = time.monotonic()
    conn.request("GET", "/ping")
    r = conn.getresponse()
    r.read()
    rec.append((t, time.monotonic() - t))
    if r.status != 200:
        break
    if sys.stdin in __import__("select").select([sys.stdin], [], [], 0.002)[0]:
        break  # the server said stop
json.dump(rec, sys.stdout)
"""


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    from aiohttp import web
    from safetensors.torch import load_file as st_load
    from safetensors.torch import save_file as st_save

    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    state = transformer_state(layers=2 if a.small else 24, vocab=5000 if a.small else 50257)
    gb = nbytes(state) / 1e9
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    pt, sf, root = (os.path.join(a.dir, n) for n in ("state.pt", "state.safetensors", "store"))
    torch.save(state, pt)
    st_save(state, sf)
    fsync_path(pt)
    fsync_path(sf)
    store = aiotensor.TensorStore(root)
    await store.open()
    await store.save(1, state)
    del state

    async def ping(_: web.Request) -> web.Response:
        return web.json_response({"ok": 1, "t": time.monotonic()})

    app = web.Application()
    app.router.add_get("/ping", ping)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def copy_in(loaded: dict[str, torch.Tensor]) -> None:
        for k, v in loaded.items():
            into[k].copy_(v)

    async def ai() -> None:
        await store.load(1, into=into)

    async def torch_mmap() -> None:
        await asyncio.to_thread(lambda: copy_in(torch.load(pt, mmap=True, weights_only=True)))

    async def safetensors() -> None:
        await asyncio.to_thread(lambda: copy_in(st_load(sf)))

    async def idle() -> None:
        await asyncio.sleep(a.idle_s)

    loads: dict[str, tuple[Callable[[], Awaitable[None]], str | None]] = {
        "idle": (idle, None),
        "aiotensor load(into=)": (ai, store.path(1)),
        "to_thread(torch.load(mmap=True)) + copy": (torch_mmap, pt),
        "to_thread(safetensors.load_file) + copy": (safetensors, sf),
    }
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, str(port), str(600), stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert client.stdout is not None and client.stdin is not None
    await client.stdout.readline()
    await asyncio.sleep(0.5)  # the connection is up and warm
    windows: list[tuple[str, float, float]] = []
    seconds: dict[str, list[float]] = {}
    for _ in range(a.reps):
        for name, (fn, path) in loads.items():
            if path is not None:
                await asyncio.to_thread(evict, path)
            await asyncio.sleep(0.3)  # the eviction's own disk work settles
            t = time.monotonic()
            await fn()
            windows.append((name, t, time.monotonic()))
            seconds.setdefault(name, []).append(windows[-1][2] - t)
    client.stdin.write(b"stop\n")
    await client.stdin.drain()
    rec = json.loads(await client.stdout.read())
    await client.wait()
    await runner.cleanup()
    await store.close()
    shutil.rmtree(a.dir, ignore_errors=True)

    per: dict[str, list[dict[str, float]]] = {}
    for name, t0, t1 in windows:
        lat = sorted(dt for t, dt in rec if t0 <= t < t1)
        if lat:
            per.setdefault(name, []).append(
                {"n": len(lat), "p50": lat[len(lat) // 2], "p99": lat[int(0.99 * (len(lat) - 1))], "worst": lat[-1]}
            )
    res: dict[str, Any] = {"gb": gb, "reps": a.reps, "requests": len(rec), "phases": {}}
    for name, rows in per.items():
        res["phases"][name] = {k: statistics.median(r[k] for r in rows) for k in ("n", "p50", "p99", "worst")}
        res["phases"][name]["gbps"] = gb / statistics.median(seconds[name]) if name != "idle" else 0.0
    return res


def report(res: dict[str, Any], cmd: str) -> str:
    ph = res["phases"]
    idle = ph["idle"]["worst"]
    lines = [
        f"# HTTP request latency while a {res['gb']:.2f} GB checkpoint loads (aiohttp server, client in another process)",
        "",
        f"`{cmd}` — {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}; {res['reps']} repetitions "
        f"(medians of each phase's figures), {res['requests']} requests in all, one at a time with 2 ms pauses; "
        "cold loads into existing tensors.",
        "",
        "| phase | requests | p50 ms | p99 ms | worst ms | worst / idle worst | load GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, p in ph.items():
        lines.append(
            f"| {name} | {p['n']:.0f} | {1e3 * p['p50']:.2f} | {1e3 * p['p99']:.2f} | {1e3 * p['worst']:.1f} | "
            f"{p['worst'] / idle:.1f} | {p['gbps']:.2f} |"
        )
    a = ph["aiotensor load(into=)"]
    peer = min(v["worst"] for k, v in ph.items() if k.startswith("to_thread"))
    lines += ratio_table(
        [
            ("aiotensor worst / idle worst", a["worst"] / idle, "<= 2"),
            ("aiotensor worst / best peer's worst", a["worst"] / peer, "<= 1"),
            ("aiotensor p99 / idle p99", a["p99"] / ph["idle"]["p99"], ""),
        ]
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = parser(__doc__, "http")
    p.add_argument("--small", action="store_true")
    p.add_argument("--idle-s", type=float, default=1.5)
    a = p.parse_args()
    res = asyncio.run(main_async(a))
    text = report(res, "python bench/bench_http.py " + " ".join(sys.argv[1:]))
    print(text)
    write_results(a.out, "http-small" if a.small else "http", text, res)


if __name__ == "__main__":
    main()
