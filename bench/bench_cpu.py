"""CPU benchmark: aiotensor vs torch.save/load, safetensors and torch.distributed.checkpoint.

Measures in one run, with repetitions and medians:
  - the disk's limit (fio, sequential 1 MiB O_DIRECT, best of iodepth 16/64 × jobs 1/4) and one
    memcpy of the state_dict;
  - durable save (until fsync), cold restore into existing tensors (page cache evicted with
    posix_fadvise DONTNEED, every checkpoint saved and the disk settled first, readers in an order
    that rotates between repetitions) and warm restore, for every library, and
    torch.load(mmap=True) as a second reader of torch.save's file;
  - how long a background save holds the caller (aiotensor `staged`, `dcp.async_save` returning),
    and a fresh store's first save with and without staging memory reserved at open();
  - the lag of a 1 ms ticker on the event loop during an aiotensor save and load;
  - the peak extra RSS of an aiotensor restore into existing tensors.
Prints a table of GB/s and ratios and writes it to bench/results/.

    python bench/bench_cpu.py [--dir /tmp/aiotensor-bench] [--reps 3] [--small]
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
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch

import aiotensor
from aiotensor._bench import drop_cache


def transformer_state(layers: int = 24, d: int = 1024, vocab: int = 50257) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    s: dict[str, torch.Tensor] = {"embed.weight": torch.randn(vocab, d, generator=g)}
    for i in range(layers):
        p = f"layers.{i}."
        for name, shape in [("qkv", (3 * d, d)), ("proj", (d, d)), ("fc1", (4 * d, d)), ("fc2", (d, 4 * d))]:
            s[p + name + ".weight"] = torch.randn(*shape, generator=g)
            s[p + name + ".bias"] = torch.randn(shape[0], generator=g)
        for ln in ("ln1", "ln2"):
            s[p + ln + ".weight"] = torch.ones(d)
            s[p + ln + ".bias"] = torch.zeros(d)
    return s


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


evict = drop_cache  # the package's `aiotensor bench` evicts the same way


def fsync_path(path: str) -> None:
    paths = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


SETTLE_S = 5.0
RESERVE_PAUSE_S = 3.0  # between open(reserve=) and the first save


def settle(paths: list[str]) -> None:
    """Every file written and the VM's host given time to write it back before cold reads start."""
    for p in paths:
        fsync_path(p)
    os.sync()
    time.sleep(SETTLE_S)


def fio_limits(folder: str, size_mb: int) -> dict[str, float]:
    """Best sequential GB/s of fio (1 MiB, O_DIRECT) over iodepth 16/64 and 1/4 jobs."""
    if shutil.which("fio") is None:
        return {}
    out: dict[str, float] = {}
    for rw in ("write", "read"):
        if rw == "read":
            settle([])  # fio's reads would otherwise race the host's write-back of its own files
        best = 0.0
        for depth in (16, 64):
            for jobs in (1, 4):
                r = subprocess.run(
                    ["fio", "--name=seq", f"--directory={folder}", f"--rw={rw}", "--bs=1M", "--direct=1",
                     "--ioengine=libaio", f"--iodepth={depth}", f"--numjobs={jobs}", f"--size={size_mb // jobs}M",
                     "--group_reporting", "--output-format=json", "--end_fsync=1"],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                job = json.loads(r.stdout)["jobs"][0][rw]
                best = max(best, job["bw_bytes"] / 1e9)
        out[rw] = best
    for f in os.listdir(folder):
        if f.startswith("seq."):
            os.unlink(os.path.join(folder, f))
    return out


class PeakRSS:
    """Samples this process's RSS every millisecond in a thread; ``peak - base`` is the extra memory."""

    def __enter__(self) -> PeakRSS:
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *a: object) -> None:
        self._stop.set()
        self._t.join()
        self.extra = self.peak - self.base


class Ticker:
    """A 1 ms ticker on the loop; records how late each tick fired."""

    def __init__(self) -> None:
        self.lags: list[float] = []

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lags.append(time.perf_counter() - t - 0.001)

    def summary(self) -> tuple[float, float]:
        lags = sorted(self.lags) or [0.0]
        return lags[-1], lags[int(0.99 * (len(lags) - 1))]


async def bare_read_lag(path: str, threads: int = 4, chunk: int = 16 << 20) -> tuple[float, float]:
    """Loop lag while ``threads`` plain threads preadv ``path`` (no aiotensor code): the floor."""
    size = os.path.getsize(path)
    bufs = [bytearray(chunk) for _ in range(threads)]
    fd = os.open(path, os.O_RDONLY)

    def read(i: int) -> None:
        for off in range(i * chunk, size, threads * chunk):
            os.preadv(fd, [bufs[i]], off)

    ticker, stop = Ticker(), asyncio.Event()
    task = asyncio.create_task(ticker.run(stop))
    try:
        await asyncio.gather(*[asyncio.to_thread(read, i) for i in range(threads)])
    finally:
        stop.set()
        await task
        os.close(fd)
    return ticker.summary()


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


async def atimed(coro: Any) -> float:
    t = time.perf_counter()
    await coro
    return time.perf_counter() - t


async def timed_save(store: aiotensor.TensorStore, step: int, state: Any) -> tuple[float, float]:
    """Seconds from ``save()`` to ``staged``, and to committed."""
    t0 = time.perf_counter()
    h = store.save(step, state)
    await h.staged
    t_staged = time.perf_counter() - t0
    await h
    return t_staged, time.perf_counter() - t0


def med(xs: list[float]) -> float:
    return statistics.median(xs)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(os.cpu_count() or 2)
    base = args.dir
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    state = transformer_state(layers=2 if args.small else 24, vocab=5000 if args.small else 50257)
    size = nbytes(state)
    gb = size / 1e9
    print(f"state_dict: {len(state)} tensors, {gb:.3f} GB; {args.reps} repetitions, medians")
    res: dict[str, Any] = {"bytes": size, "reps": args.reps}

    res["disk"] = fio_limits(base, 2048 if not args.small else 256)
    res["memcpy_s"] = med([timed(lambda: {k: v.clone() for k, v in state.items()}) for _ in range(args.reps)])
    print(f"disk limit (fio): {res['disk']}; memcpy {gb / res['memcpy_s']:.2f} GB/s")

    into = {k: torch.zeros_like(v) for k, v in state.items()}  # touched, as a live model is
    save_s: dict[str, list[float]] = {}
    cold_s: dict[str, list[float]] = {}
    warm_s: dict[str, list[float]] = {}

    # --- the peers ------------------------------------------------------------------------
    def torch_save(p: str) -> None:
        torch.save(state, p)
        fsync_path(p)

    def torch_load(p: str, mmap: bool = False) -> None:
        loaded = torch.load(p, weights_only=True, mmap=mmap)
        for k, v in loaded.items():
            into[k].copy_(v)

    import safetensors.torch as st

    def st_save(p: str) -> None:
        st.save_file(state, p)
        fsync_path(p)

    def st_load(p: str) -> None:
        loaded = st.load_file(p)
        for k, v in loaded.items():
            into[k].copy_(v)

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)

    def dcp_save(p: str) -> None:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(p, sync_files=True))

    def dcp_load(p: str) -> None:
        dcp.load(into, storage_reader=dcp.FileSystemReader(p))

    # saver name -> (save, extension); reader name -> (the saver whose file it reads, load)
    savers = {"torch.save": (torch_save, ".pt"), "safetensors": (st_save, ".safetensors"), "dcp": (dcp_save, "")}
    readers: dict[str, tuple[str, Callable[[str], None]]] = {
        "torch.save": ("torch.save", torch_load),
        "torch.load(mmap)": ("torch.save", lambda p: torch_load(p, mmap=True)),
        "safetensors": ("safetensors", st_load),
        "dcp": ("dcp", dcp_load),
    }

    # Repetition 0 is a discarded warm-up: on a VM, the first touch of fresh guest memory (page
    # cache, new mappings) runs at a fraction of later speeds, and would punish whoever runs first.
    # Each repetition saves with every library, lets the disk settle, then reads every checkpoint
    # cold, in an order that rotates between repetitions: on this VM a file read straight after
    # its own save reads at about half speed while the host still writes it back (bench note in
    # cpu.md), which would measure the save order, not the readers.
    root = os.path.join(base, "aiotensor")
    held: list[float] = []
    lag_save: list[tuple[float, float]] = []
    lag_load: list[tuple[float, float]] = []
    peak: list[int] = []
    lag_bare: list[tuple[float, float]] = []
    async with aiotensor.TensorStore(root, keep_last=1) as store:
        for rep in range(args.reps + 1):
            keep = rep > 0
            ticker, stop = Ticker(), asyncio.Event()
            task = asyncio.create_task(ticker.run(stop))
            t_staged, t_save = await timed_save(store, rep, state)
            stop.set()
            await task
            if not keep:
                res["aiotensor_first_save_s"] = t_save
                res["lag_first_save_ms"] = 1e3 * ticker.summary()[0]
            else:
                held.append(t_staged)
                save_s.setdefault("aiotensor", []).append(t_save)
                lag_save.append(ticker.summary())
            files = {"aiotensor": store.path(rep)}
            for name, (save, ext) in savers.items():
                files[name] = os.path.join(base, f"{name}-{rep}{ext}")
                t_save = await asyncio.to_thread(timed, lambda: save(files[name]))
                if keep:
                    save_s.setdefault(name, []).append(t_save)
            await asyncio.to_thread(settle, list(files.values()))
            names = ["aiotensor", *readers]
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                if name != "aiotensor":
                    p = files[readers[name][0]]
                    load = readers[name][1]
                    evict(p)
                    t_cold = await asyncio.to_thread(timed, lambda: load(p))
                    t_warm = await asyncio.to_thread(timed, lambda: load(p))
                    if keep:
                        cold_s.setdefault(name, []).append(t_cold)
                        warm_s.setdefault(name, []).append(t_warm)
                    continue
                if keep:  # the machine's own floor: plain threads reading the same cold bytes
                    evict(store.path(rep))
                    lag_bare.append(await bare_read_lag(os.path.join(store.path(rep), "shard-00000.safetensors")))
                evict(store.path(rep))
                ticker, stop = Ticker(), asyncio.Event()
                task = asyncio.create_task(ticker.run(stop))
                with PeakRSS() as mem:
                    t_cold = await atimed(store.load(rep, into=into))
                stop.set()
                await task
                t_warm = await atimed(store.load(rep, into=into))
                if keep:
                    cold_s.setdefault("aiotensor", []).append(t_cold)
                    warm_s.setdefault("aiotensor", []).append(t_warm)
                    lag_load.append(ticker.summary())
                    peak.append(mem.extra)
                assert all(torch.equal(into[k], state[k]) for k in state)
            for name, p in files.items():
                if name != "aiotensor":
                    shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.unlink(p)
        res["pool_bytes"] = store.scheduler.workers * store.scheduler.slots.slot_bytes
    res["held_aiotensor_s"] = med(held)
    res["lag_save_ms"] = [1e3 * max(x[0] for x in lag_save), 1e3 * med([x[1] for x in lag_save])]
    res["lag_load_ms"] = [1e3 * max(x[0] for x in lag_load), 1e3 * med([x[1] for x in lag_load])]
    res["lag_bare_read_ms"] = [1e3 * max(x[0] for x in lag_bare), 1e3 * med([x[1] for x in lag_bare])]
    res["restore_peak_extra_bytes"] = max(peak)

    # the first save of a fresh store: staging memory mapped and touched by that save, or reserved
    # at open() (the trainer builds its model meanwhile: here, a pause)
    first: dict[str, list[float]] = {"fresh": [], "reserved": []}
    for rep in range(args.reps):
        for how in first:
            folder = os.path.join(base, f"first-{how}-{rep}")
            async with aiotensor.TensorStore(folder, reserve=state if how == "reserved" else None) as fresh:
                await asyncio.sleep(RESERVE_PAUSE_S)
                first[how].append((await timed_save(fresh, 0, state))[0])
            shutil.rmtree(folder, ignore_errors=True)
    res["first_held_s"] = {how: med(v) for how, v in first.items()}

    held_dcp = []
    for rep in range(args.reps):
        p = os.path.join(base, f"dcp-async-{rep}")
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(p, sync_files=True))
        held_dcp.append(time.perf_counter() - t0)
        fut.result()
        shutil.rmtree(p, ignore_errors=True)
    res["held_dcp_async_s"] = med(held_dcp)
    dist.destroy_process_group()

    res["save_s"] = {k: med(v) for k, v in save_s.items()}
    res["cold_s"] = {k: med(v) for k, v in cold_s.items()}
    res["cold_reps_s"] = cold_s  # per repetition: the disk drifts between repetitions, so ratios are paired below
    res["warm_s"] = {k: med(v) for k, v in warm_s.items()}
    shutil.rmtree(base, ignore_errors=True)
    return res


def ratio_table(targets: list[tuple[str, float, str]]) -> list[str]:
    return ["", "| ratio | value | target |", "|---|---|---|", *(f"| {n} | {v:.2f} | {t} |" for n, v, t in targets)]


def paired_cold(res: dict[str, Any]) -> float:
    """Median over repetitions of the best peer's cold read time over aiotensor's in the same
    repetition: the disk's speed drifts more between repetitions than libraries differ."""
    reps = res.get("cold_reps_s")
    if not reps:
        return float("nan")
    peers = [k for k in reps if k != "aiotensor"]
    return statistics.median(min(reps[k][i] for k in peers) / t for i, t in enumerate(reps["aiotensor"]))


def report(res: dict[str, Any]) -> str:
    gb = res["bytes"] / 1e9
    disk = res["disk"]
    memcpy = gb / res["memcpy_s"]
    lines = [
        f"# CPU benchmark ({platform.node() and 'dev machine'}: {os.cpu_count()} cores, torch {torch.__version__})",
        "",
        f"State: transformer fp32 state_dict, {gb:.3f} GB; medians of {res['reps']} repetitions.",
        f"Disk limit (fio seq 1 MiB O_DIRECT, best of qd16/64 × 1/4 jobs): write {disk.get('write', float('nan')):.2f} GB/s, "
        f"read {disk.get('read', float('nan')):.2f} GB/s. One memcpy of the state: {memcpy:.2f} GB/s.",
        "",
        "| library | durable save GB/s | cold restore GB/s | warm restore GB/s |",
        "|---|---|---|---|",
    ]

    def cell(m: str, k: str) -> str:
        return f"{gb / res[m][k]:.2f}" if k in res[m] else "—"

    for k in {**res["save_s"], **res["cold_s"]}:
        lines.append(f"| {k} | {cell('save_s', k)} | {cell('cold_s', k)} | {cell('warm_s', k)} |")
    best = {m: max(gb / s for k, s in res[m].items() if k != "aiotensor") for m in ("save_s", "cold_s", "warm_s")}
    a = {m: gb / res[m]["aiotensor"] for m in ("save_s", "cold_s", "warm_s")}
    targets = [
        ("durable save / best peer", a["save_s"] / best["save_s"], ">= 1.3"),
        ("durable save / disk write limit", a["save_s"] / disk["write"] if disk else float("nan"), ">= 0.8"),
        ("cold restore / best peer", a["cold_s"] / best["cold_s"], ">= 1.3"),
        ("cold restore / best peer, paired by repetition (median)", paired_cold(res), ">= 1.3"),
        ("cold restore / disk read limit", a["cold_s"] / disk["read"] if disk else float("nan"), ">= 0.9"),
        ("warm restore / memcpy", a["warm_s"] / memcpy, ">= 0.5"),
        ("caller held by background save / memcpy time", res["held_aiotensor_s"] / res["memcpy_s"], "<= 1.5"),
        ("caller held / dcp.async_save held", res["held_aiotensor_s"] / res["held_dcp_async_s"], "<= 0.3"),
        (
            "first save held, staging reserved at open() / memcpy time",
            res["first_held_s"]["reserved"] / res["memcpy_s"],
            "<= 1.5",
        ),
        ("loop lag during save, worst (ms)", res["lag_save_ms"][0], "<= 5"),
        ("loop lag during load, worst (ms)", res["lag_load_ms"][0], "<= 5"),
        (
            "restore peak extra RSS / (pool + 64 MiB)",
            res["restore_peak_extra_bytes"] / (res["pool_bytes"] + (64 << 20)),
            "<= 1.0",
        ),
    ]
    lines += ratio_table(targets)
    lines += [
        "",
        f"Caller held by a background save: aiotensor {1e3 * res['held_aiotensor_s']:.0f} ms (to `staged`), "
        f"dcp.async_save {1e3 * res['held_dcp_async_s']:.0f} ms; one memcpy {1e3 * res['memcpy_s']:.0f} ms. "
        f"A fresh store's first save holds it {1e3 * res['first_held_s']['fresh']:.0f} ms, "
        f"{1e3 * res['first_held_s']['reserved']:.0f} ms with `reserve=` the state at open() "
        f"({RESERVE_PAUSE_S:.0f} s before the save).",
        f"Loop lag (1 ms ticker): save worst {res['lag_save_ms'][0]:.2f} ms p99 {res['lag_save_ms'][1]:.2f} ms; "
        f"load worst {res['lag_load_ms'][0]:.2f} ms p99 {res['lag_load_ms'][1]:.2f} ms; "
        f"the first save (maps and touches the staging arena) worst {res['lag_first_save_ms']:.2f} ms. "
        f"The machine's floor, 4 plain threads reading the same cold file: worst {res['lag_bare_read_ms'][0]:.2f} ms "
        f"p99 {res['lag_bare_read_ms'][1]:.2f} ms.",
        f"Restore into existing tensors: peak extra RSS {res['restore_peak_extra_bytes'] / 2**20:.0f} MiB "
        f"(pool {res['pool_bytes'] / 2**20:.0f} MiB). First aiotensor save (maps staging): "
        f"{gb / res['aiotensor_first_save_s']:.2f} GB/s (warm-up round, not in the medians).",
    ]
    return "\n".join(lines) + "\n"


def parser(doc: str | None, name: str) -> argparse.ArgumentParser:
    """The options the newer benchmarks share: --reps, --dir (scratch folder), --out (results)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=f"/tmp/aiotensor-bench-{name}")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    return p


def write_results(folder: str, name: str, text: str, res: dict[str, Any]) -> None:
    """The table as ``name.md`` and the raw figures as ``name.json`` in ``folder``."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/aiotensor-bench")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--small", action="store_true", help="a small state, to check the script quickly")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = p.parse_args()
    res = asyncio.run(run(a))
    text = report(res)
    print(text)
    if not a.small:
        write_results(a.out, "cpu", text, res)


if __name__ == "__main__":
    main()
