"""A real HTTP server's request latency while a 1.4 GB checkpoint loads on its event loop (issue 11).

An aiohttp server (a cheap JSON endpoint) runs on this process's event loop; a client in another
process sends requests one at a time over a keep-alive connection to 127.0.0.1 (a 2 ms pause between
them, bounded in count and time) and records each one's latency. Phases, each at least --phase-s
seconds of loads (a load is repeated until its phase is that long): idle; ``await store.load(step,
into=)`` (aiotensor); and the peers run the way a server would call them, ``await
asyncio.to_thread(...)``: ``torch.load(mmap=True)`` + copy, and ``safetensors.torch.load_file`` +
copy; then the aiotensor phase again with its worker threads at the process's own priority
(``nice=0``; by default they run 10 nice levels lower), to show what that choice is worth. Every load is cold (the files' pages are dropped
with posix_fadvise DONTNEED before each one, outside the measured windows, and mincore checks it) and
fills the same existing tensors. A request belongs to a phase when it overlaps one of the phase's load
windows (CLOCK_MONOTONIC is shared by both processes). Repetitions; medians of the per-repetition
figures. Target: worst request during the aiotensor load <= 2x the idle worst. BENCH_HTTP_DUMP=FILE
writes every request's (start, latency) and the load windows as JSON.

    python bench/bench_http.py [--gb 1.4] [--reps 3] [--phase-s 4] [--dir /tmp/aiotensor-bench-http]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psutil
import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_cpu import evict, fsync_path, nbytes, parser, ratio_table, transformer_state, write_results

import aiotensor

D = 1024
NICE0 = "aiotensor load(into=), workers at nice 0"
FULL_VOCAB = 50257
LAYER_BYTES = 4 * (12 * D * D + 9 * D + 4 * D)  # qkv, proj, fc1, fc2 (+ biases), two layer norms

# The client: plain http.client (one keep-alive connection), one request at a time. It stops on a
# line on stdin, after `limit_s` seconds or after 200,000 requests, whichever comes first, and then
# prints [start, latency] pairs as JSON.
CLIENT = r"""
import http.client, json, select, sys, time
port, limit_s = int(sys.argv[1]), float(sys.argv[2])
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
conn.request("GET", "/compute?n=7")
conn.getresponse().read()
rec, end = [], time.monotonic() + limit_s
print("ready", flush=True)
while time.monotonic() < end and len(rec) < 200_000:
    t = time.monotonic()
    conn.request("GET", "/compute?n=%d" % (len(rec) % 100))
    r = conn.getresponse()
    body = r.read()
    rec.append((t, time.monotonic() - t))
    if r.status != 200 or not body:
        break
    if select.select([sys.stdin], [], [], 0.002)[0]:
        break  # the server said stop
json.dump(rec, sys.stdout)
"""


def sized_state(gb: float) -> dict[str, torch.Tensor]:
    """bench_cpu's transformer state (d=1024) with as many layers as fit in ``gb``; the vocabulary
    shrinks when even one layer and the full embedding would not."""
    budget = int(gb * 1e9)
    layers = (budget - 4 * FULL_VOCAB * D) // LAYER_BYTES
    if layers >= 1:
        return transformer_state(layers=int(layers), d=D, vocab=FULL_VOCAB)
    return transformer_state(layers=1, d=D, vocab=max(1000, (budget - LAYER_BYTES) // (4 * D)))


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident(path: str) -> float:
    """The fraction of a file's (or a folder's files') pages in the page cache (mmap + mincore)."""
    paths = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    total = res = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return float("nan")
            try:
                n = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
                vec = (ctypes.c_ubyte * n)()
                if _libc.mincore(addr, size, vec) != 0:
                    return float("nan")
                total += n
                res += sum(b & 1 for b in bytes(vec))
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return res / total if total else 0.0


def cpu_s(procs: list[psutil.Process]) -> tuple[float, float]:
    """Seconds of CPU so far: (every vCPU's busy time minus ``procs``' own, the hypervisor's steal)."""
    with open("/proc/stat") as f:
        v = [int(x) / os.sysconf("SC_CLK_TCK") for x in f.readline().split()[1:]]
    busy = v[0] + v[1] + v[2] + v[5] + v[6]  # user nice system irq softirq
    mine = sum(sum(p.cpu_times()[:2]) for p in procs)
    return busy - mine, v[7]


def worst_at(rec: list[list[float]], windows: list[tuple[float, float]]) -> tuple[int, float]:
    """Which load (index) the worst overlapping request fell in, and ms from that load's start."""
    best = (0.0, 0, 0.0)
    for i, (t0, t1) in enumerate(windows):
        for t, dt in rec:
            if t < t1 and t + dt > t0 and dt > best[0]:
                best = (dt, i, 1e3 * (t - t0))
    return best[1], best[2]


def latencies(rec: list[list[float]], windows: list[tuple[float, float]]) -> list[float]:
    """Latencies of the requests that overlap any of ``windows``."""
    return sorted(dt for t, dt in rec if any(t < t1 and t + dt > t0 for t0, t1 in windows))


def summary(lat: list[float]) -> dict[str, float]:
    return {"n": len(lat), "p50": lat[len(lat) // 2], "p99": lat[int(0.99 * (len(lat) - 1))], "worst": lat[-1]}


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    from aiohttp import web
    from safetensors.torch import load_file as st_load
    from safetensors.torch import save_file as st_save

    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    state = sized_state(a.gb)
    gb = nbytes(state) / 1e9
    print(f"state: {len(state)} tensors, {gb:.3f} GB", flush=True)
    into = {k: torch.zeros_like(v) for k, v in state.items()}  # touched, as a live model's are
    pt, sf, root = (os.path.join(a.dir, n) for n in ("state.pt", "state.safetensors", "store"))
    torch.save(state, pt)
    st_save(state, sf)
    fsync_path(pt)
    fsync_path(sf)
    store = aiotensor.TensorStore(root)
    await store.open()
    await store.save(1, state)
    await store.load(1, into=into)
    assert all(torch.equal(into[k], state[k]) for k in state)
    del state

    async def compute(req: web.Request) -> web.Response:
        n = int(req.query.get("n", "10"))
        a_, b_ = 0, 1
        for _ in range(n):
            a_, b_ = b_, a_ + b_
        return web.json_response({"n": n, "fib": a_})

    app = web.Application()
    app.router.add_get("/compute", compute)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def copy_in(loaded: dict[str, torch.Tensor]) -> None:
        for k, v in loaded.items():
            into[k].copy_(v)

    same_priority = aiotensor.TensorStore(root, readonly=True, nice=0)
    await same_priority.open()

    async def ai() -> None:
        await store.load(1, into=into)

    async def ai_nice0() -> None:
        await same_priority.load(1, into=into)

    async def torch_mmap() -> None:
        await asyncio.to_thread(lambda: copy_in(torch.load(pt, mmap=True, weights_only=True)))

    async def safetensors() -> None:
        await asyncio.to_thread(lambda: copy_in(st_load(sf)))

    async def idle() -> None:
        await asyncio.sleep(a.phase_s)

    # name -> (one load, the files to evict first)
    phases: dict[str, tuple[Callable[[], Awaitable[None]], str | None]] = {
        "idle": (idle, None),
        "aiotensor load(into=)": (ai, store.path(1)),
        "to_thread(torch.load(mmap=True)) + copy": (torch_mmap, pt),
        "to_thread(safetensors.load_file) + copy": (safetensors, sf),
        NICE0: (ai_nice0, store.path(1)),
    }
    n_phases = a.reps * len(phases)
    limit_s = 60 + n_phases * (a.phase_s + 10) * max(1.0, a.gb)
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, str(port), str(limit_s), stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert client.stdout is not None and client.stdin is not None
    await client.stdout.readline()
    await asyncio.sleep(0.5)  # the connection is up and warm

    windows: dict[str, list[list[tuple[float, float]]]] = {n: [] for n in phases}  # per rep, per load
    seconds: dict[str, list[float]] = {n: [] for n in phases}
    # per rep, per phase second: the hypervisor's steal, and the CPU of processes other than ours
    steal: dict[str, list[float]] = {n: [] for n in phases}
    other: dict[str, list[float]] = {n: [] for n in phases}
    procs = [psutil.Process(), psutil.Process(client.pid)]
    cache_left: list[float] = []
    for rep in range(a.reps):
        for name, (fn, path) in phases.items():
            mine: list[tuple[float, float]] = []
            busy = stolen = others = 0.0
            while busy < a.phase_s:
                if path is not None:
                    await asyncio.to_thread(evict, path)
                    cache_left.append(await asyncio.to_thread(resident, path))
                await asyncio.sleep(0.3)  # the eviction's own work settles; requests here are not counted
                o0, st0 = cpu_s(procs)
                t = time.monotonic()
                try:
                    await fn()
                finally:
                    t1 = time.monotonic()
                    o1, st1 = cpu_s(procs)
                    stolen += st1 - st0
                    others += o1 - o0
                mine.append((t, t1))
                busy += t1 - t
                if path is not None:
                    seconds[name].append(t1 - t)
            windows[name].append(mine)
            steal[name].append(stolen / busy)
            other[name].append(others / busy)
            print(f"rep {rep}: {name}: {len(mine)} loads in {busy:.1f} s", flush=True)
    client.stdin.write(b"stop\n")
    await client.stdin.drain()
    rec = json.loads(await client.stdout.read())
    await client.wait()
    await runner.cleanup()
    await store.close()
    await same_priority.close()
    shutil.rmtree(a.dir, ignore_errors=True)
    if os.environ.get("BENCH_HTTP_DUMP"):
        with open(os.environ["BENCH_HTTP_DUMP"], "w") as f:
            json.dump({"rec": rec, "windows": windows}, f)

    res: dict[str, Any] = {
        "gb": gb,
        "reps": a.reps,
        "phase_s": a.phase_s,
        "requests": len(rec),
        "cache_left_max": max(cache_left) if cache_left else 0.0,
        "phases": {},
        "per_rep": {},
    }
    for name, reps in windows.items():
        rows = [summary(latencies(rec, w)) for w in reps]
        for r, w, st, ot in zip(rows, reps, steal[name], other[name], strict=True):
            r["worst_load"], r["worst_at_ms"] = worst_at(rec, w)
            r["steal_frac"], r["other_cpu"] = st, ot
        res["per_rep"][name] = rows
        res["phases"][name] = {k: statistics.median(r[k] for r in rows) for k in ("n", "p50", "p99", "worst")}
        res["phases"][name]["loads"] = sum(len(w) for w in reps)
        res["phases"][name]["steal_frac"] = statistics.median(steal[name])
        res["phases"][name]["other_cpu"] = max(other[name])
        res["phases"][name]["gbps"] = gb / statistics.median(seconds[name]) if seconds[name] else 0.0
    return res


def report(res: dict[str, Any], cmd: str) -> str:
    ph = res["phases"]
    idle = ph["idle"]["worst"]
    cache = res["cache_left_max"]
    cold = "cold" if cache < 0.05 else f"NOT fully cold (up to {100 * cache:.0f}% of a file still cached)"
    lines = [
        f"# HTTP request latency while a {res['gb']:.2f} GB checkpoint loads (aiohttp server, client in another process)",
        "",
        f"`{cmd}` — {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}; {res['reps']} repetitions "
        f"(medians of each phase's per-repetition figures), {res['requests']} requests in all, one at a time "
        f"with 2 ms pauses over one keep-alive connection (http.client in its own process) to an aiohttp "
        f"JSON endpoint on this process's loop. Each phase is at least {res['phase_s']:g} s of loads, the load "
        f"repeated back to back; every load {cold} (posix_fadvise DONTNEED before each, checked with mincore: at "
        f"most {100 * cache:.1f}% of the pages left), into existing tensors. A request counts for a phase "
        "when it overlaps one of its loads.",
        "",
        "| phase | loads | requests | p50 ms | p99 ms | worst ms | worst / idle worst | load GB/s | VM steal | other CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in ph.items():
        gbps = f"{p['gbps']:.2f}" if p["gbps"] else "—"
        lines.append(
            f"| {name} | {p['loads'] if name != 'idle' else '—'} | {p['n']:.0f} | {1e3 * p['p50']:.2f} | "
            f"{1e3 * p['p99']:.2f} | {1e3 * p['worst']:.1f} | {p['worst'] / idle:.1f} | {gbps} | {100 * p['steal_frac']:.1f}% | {p['other_cpu']:.2f} |"
        )
    a = ph["aiotensor load(into=)"]
    peer = min(v["worst"] for k, v in ph.items() if k.startswith("to_thread"))
    met = a["worst"] / idle <= 2
    lines += ratio_table(
        [
            ("aiotensor worst / idle worst", a["worst"] / idle, "<= 2"),
            ("aiotensor worst / best peer's worst", a["worst"] / peer, "<= 1"),
            ("aiotensor p99 / idle p99", a["p99"] / ph["idle"]["p99"], ""),
            ("aiotensor worst, workers at nice 0 / idle worst", ph[NICE0]["worst"] / idle, "(the old default)"),
        ]
    )
    lines += [
        "",
        f"Target (worst request during the aiotensor load <= 2x the idle worst): "
        f"{'met' if met else 'not met'} ({1e3 * a['worst']:.1f} ms against {1e3 * idle:.1f} ms idle).",
        "",
        "Worst request per repetition, ms (where: which load of the phase, ms after that load began; the other CPU "
        "meanwhile, in cores):",
        "",
        *(
            f"- {name}: "
            + ", ".join(
                f"{1e3 * r['worst']:.1f} (load #{r['worst_load']}, +{r['worst_at_ms']:.0f} ms; other CPU {r['other_cpu']:.2f})"
                for r in rows
            )
            for name, rows in res["per_rep"].items()
        ),
        "",
        "VM steal: the share of the phase's time that the hypervisor gave this VM's vCPUs to something else "
        "(/proc/stat, both vCPUs summed, over the phase's loads; median of the repetitions). Other CPU: vCPUs "
        "busy with anything but this process and its client (other processes, kernel threads such as the "
        "block layer's), in cores, the highest of the repetitions: well above ~0.1 means the machine was not "
        "quiet.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = parser(__doc__, "http")
    p.add_argument("--gb", type=float, default=1.4, help="size of the state (at most)")
    p.add_argument("--phase-s", type=float, default=4.0, help="seconds of loads (or idle) per phase")
    a = p.parse_args()
    res = asyncio.run(main_async(a))
    text = report(res, "python bench/bench_http.py " + " ".join(sys.argv[1:]))
    print(text)
    write_results(a.out, "http" if a.gb == 1.4 else f"http-{a.gb:g}gb", text, res)


if __name__ == "__main__":
    main()
