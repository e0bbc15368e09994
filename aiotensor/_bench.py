"""``aiotensor bench``: this machine's disk and memcpy, then aiotensor against torch.save/torch.load,
safetensors and torch.distributed.checkpoint on the same state, in one run; a table of ratios, a Markdown report, a PNG plot.

Smaller and self-contained (it ships in the package) next to ``bench/bench_cpu.py``, which also
runs fio and is what ``bench/results/`` reports.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import shutil
import statistics
import time
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from .store import TensorStore

MiB = 1 << 20


def state_of(nbytes: int) -> dict[str, torch.Tensor]:
    """A transformer-like state of about ``nbytes``: a few big matrices and many small vectors."""
    g = torch.Generator().manual_seed(0)
    d = 1024
    n = max(1, nbytes // (4 * d * d + 8 * d))
    out = {}
    for i in range(n):
        out[f"layers.{i}.w"] = torch.randn(d, d, generator=g)
        out[f"layers.{i}.b"] = torch.randn(2 * d, generator=g)
    return out


def drop_cache(path: str) -> None:
    """Drop a file's (or a folder's files') pages from the page cache (fsync'ed first)."""
    paths = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_limit(folder: str, nbytes: int) -> dict[str, float]:
    """Sequential write (O_DIRECT where the file system takes it, fsync'ed) and cold read of one
    file with 16 MiB calls from a page-aligned buffer: GB/s, the disk's own limit for this run."""
    path = os.path.join(folder, "disk-probe")
    buf = mmap.mmap(-1, 16 * MiB)
    buf.write(os.urandom(16 * MiB))
    view = memoryview(buf)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    t = time.perf_counter()
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:
        fd = os.open(path, flags, 0o644)
    try:
        for off in range(0, nbytes, len(view)):
            os.pwrite(fd, view, off)
        os.fsync(fd)
    finally:
        os.close(fd)
    write = nbytes / (time.perf_counter() - t) / 1e9
    drop_cache(path)
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.readv(fd, [view]):
            pass
    finally:
        os.close(fd)
    read = nbytes / (time.perf_counter() - t) / 1e9
    view.release()
    buf.close()
    os.remove(path)
    return {"write": write, "read": read}


async def _timed(fn: Callable[[], Awaitable[Any]]) -> float:
    t = time.perf_counter()
    await fn()
    return time.perf_counter() - t


async def run(folder: str, nbytes: int, reps: int, report: Callable[[str], None] = print) -> dict[str, Any]:
    """Every figure of the report, measured in ``folder`` with a state of about ``nbytes``."""
    from safetensors.torch import load_file as st_load
    from safetensors.torch import save_file as st_save

    os.makedirs(folder, exist_ok=True)
    state = state_of(nbytes)
    size = sum(t.nbytes for t in state.values())
    res: dict[str, Any] = {"bytes": size, "disk": await asyncio.to_thread(disk_limit, folder, size)}
    t = time.perf_counter()
    for _ in range(reps):
        {k: v.clone() for k, v in state.items()}
    res["memcpy_gbs"] = size * reps / (time.perf_counter() - t) / 1e9
    report(
        f"disk write {res['disk']['write']:.2f} GB/s, read {res['disk']['read']:.2f} GB/s; memcpy {res['memcpy_gbs']:.2f} GB/s"
    )

    def fsynced(save: Callable[[Any, str], None]) -> Callable[[Any, str], None]:
        def run(s: Any, p: str) -> None:
            save(s, p)
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        return run

    peers: dict[str, tuple[Callable[[Any, str], None], Callable[[str], Any]]] = {
        "torch.save": (fsynced(torch.save), lambda p: {k: v.clone() for k, v in torch.load(p, weights_only=True).items()}),
        "safetensors": (fsynced(st_save), lambda p: {k: v.clone() for k, v in st_load(p).items()}),
    }

    def dcp_save(s: Any, p: str) -> None:
        from torch.distributed.checkpoint.state_dict_saver import save

        shutil.rmtree(p, ignore_errors=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns when there is no process group
            save(s, checkpoint_id=p)

    def dcp_load(p: str) -> Any:
        from torch.distributed.checkpoint.state_dict_loader import load

        into = {k: torch.empty_like(v) for k, v in state.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load(into, checkpoint_id=p)
        return into

    peers["dcp"] = (dcp_save, dcp_load)
    rows: dict[str, dict[str, float]] = {}
    async with TensorStore(os.path.join(folder, "store"), keep_last=1) as store:
        await store.save(0, state)  # maps and touches the staging arena once
        steps = iter(range(1, reps + 1))

        async def save_ours() -> str:
            step = next(steps)
            await store.save(step, state)
            return store.path(step)

        rows["aiotensor"] = await _measure(save_ours, store.load, reps, size)
    for name, (save, load) in peers.items():
        path = os.path.join(folder, name)

        async def save_peer(save: Any = save, path: str = path) -> str:
            await asyncio.to_thread(save, state, path)
            return path

        async def load_peer(load: Any = load, path: str = path) -> Any:
            return await asyncio.to_thread(load, path)

        rows[name] = await _measure(save_peer, load_peer, reps, size)
    res["rows"] = rows
    shutil.rmtree(folder, ignore_errors=True)
    return res


async def _measure(
    save: Callable[[], Awaitable[str]], load: Callable[[], Awaitable[Any]], reps: int, size: int
) -> dict[str, float]:
    """Median durable-save and cold-load GB/s, and the worst loop lag during the loads (ms)."""
    saves, loads, lags = [], [], []
    for _ in range(reps):
        t = time.perf_counter()
        written = await save()
        saves.append(time.perf_counter() - t)
        await asyncio.to_thread(drop_cache, written)
        ticker = _Ticker()
        task = asyncio.create_task(ticker.run())
        loads.append(await _timed(load))
        task.cancel()
        lags.append(ticker.worst)
    return {"save": size / statistics.median(saves) / 1e9, "load": size / statistics.median(loads) / 1e9,
            "lag_ms": 1e3 * statistics.median(lags)}  # fmt: skip


class _Ticker:
    """A 1 ms ticker on the loop; ``worst`` is its largest lateness in seconds."""

    def __init__(self) -> None:
        self.worst = 0.0

    async def run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - t - 0.001)


def markdown(res: dict[str, Any], png: str | None) -> str:
    rows, disk = res["rows"], res["disk"]
    best_save = max(r["save"] for k, r in rows.items() if k != "aiotensor")
    best_load = max(r["load"] for k, r in rows.items() if k != "aiotensor")
    ours = rows["aiotensor"]
    lines = [
        f"# aiotensor bench: {res['bytes'] / 1e9:.2f} GB state",
        "",
        f"Disk: write {disk['write']:.2f} GB/s (fsync'ed), cold read {disk['read']:.2f} GB/s; "
        f"memcpy {res['memcpy_gbs']:.2f} GB/s.",
        "",
        "| tool | durable save GB/s | cold load GB/s | loop worst lag during load (ms) |",
        "|---|---|---|---|",
        *(f"| {k} | {r['save']:.2f} | {r['load']:.2f} | {r['lag_ms']:.1f} |" for k, r in rows.items()),
        "",
        "| ratio | value |",
        "|---|---|",
        f"| save / best peer | {ours['save'] / best_save:.2f} |",
        f"| save / disk write | {ours['save'] / disk['write']:.2f} |",
        f"| load / best peer | {ours['load'] / best_load:.2f} |",
        f"| load / disk read | {ours['load'] / disk['read']:.2f} |",
        "",
    ]
    lines.append(f"![throughput and loop lag]({os.path.basename(png)})" if png else "(no plot: `pip install 'aiotensor[plot]'`)")
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: str) -> bool:
    """A PNG of throughput and loop lag per tool; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = res["rows"]
    names = list(rows)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(names))
    a.bar([i - 0.2 for i in x], [rows[n]["save"] for n in names], 0.4, label="durable save")
    a.bar([i + 0.2 for i in x], [rows[n]["load"] for n in names], 0.4, label="cold load")
    a.axhline(res["disk"]["write"], ls="--", c="C0", lw=1, label="disk write")
    a.axhline(res["disk"]["read"], ls=":", c="C1", lw=1, label="disk read")
    a.set_xticks(list(x), names)
    a.set_ylabel("GB/s")
    a.legend(fontsize=8)
    a.set_title("throughput")
    b.bar(names, [rows[n]["lag_ms"] for n in names], color="C2")
    b.set_ylabel("ms")
    b.set_title("worst event-loop lag during load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
