"""A model server's loads, each tool in a process of its own (issue 26): the first load of a fresh
process (a restart, or a file just downloaded: every tool faults in every page it copies into) and
the later loads of the same process (a server that reloads or hot-swaps: memory the last load freed
comes back), the file in the page cache.

``bench_serving.py`` times every tool back to back in one process, where what one tool freed and in
which thread decides whether the next finds memory already faulted in (glibc keeps an arena per
thread): its warm figures swing by 2x from run to run with the same code. Here nothing else runs
in a tool's process. Tools: the copying peers of ``bench_serving.py`` (safetensors mmap + clone and
pread, ``torch.load(mmap=True)`` + clone, fastsafetensors, the Run:ai streamer, tensorizer) and
ours (``stream``, ``load_file``, a store's ``load()``, with and without verifying its checksums);
``load_into`` is left out (it reads into a module whose memory its construction touched). Layouts:
one file of transformer weights (``--layers``) and ``--small`` small tensors in one file. Every
repetition runs every tool once, each in its own process, ``--loads`` loads there; a ratio is the
fastest copying peer's time over ours in the same repetition (> 1: we are faster), the tables give
medians, for the first load and for the median of the later ones. The limit beside them: copies of
the state, in a process of their own too (the first into fresh memory, the later ones into the
same memory, touched: a copy with no page fault).

    python bench/bench_fresh.py [--layers 8] [--small 20000] [--reps 5] [--loads 5] [--dir /tmp/aiotensor-bench-fresh]
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
LIMIT = "limit: one copy (first into fresh memory, later into touched)"
SKIP = ("safetensors mmap (no copy)", "aiotensor.load_into", "aiotensor.load_file(mmap)",
        "aiotensor.load_file(mmap, verify=False)", "aiotensor store.load(mmap)")  # fmt: skip


def tools(d: str) -> dict[str, Any]:
    src, store = os.path.join(d, "model.safetensors"), os.path.join(d, "store")
    tz = os.path.join(d, "model.tensors")  # tensorizer cannot write every layout
    out: dict[str, Any] = {
        k: (lambda fn: lambda: asyncio.to_thread(fn))(fn)
        for k, fn in peers(src, os.path.join(d, "model.pt"), tz if os.path.exists(tz) else None).items()
    }
    out |= ours(src, store, {})

    async def unverified() -> dict[str, torch.Tensor]:
        async with aiotensor.TensorStore(store, readonly=True) as s:
            return await s.load(verify=False)

    out["aiotensor store.load(verify=False)"] = unverified
    return {k: v for k, v in out.items() if k not in SKIP}


def child(d: str, tool: str, loads: int) -> None:
    """``loads`` loads in this fresh process: their seconds on stdout, as JSON."""
    times: list[float] = []
    if tool == LIMIT:
        src = torch.ones(os.path.getsize(os.path.join(d, "model.safetensors")) // 4)  # touched: the copy's source
        out = torch.empty(0)
        for i in range(loads):  # the first into fresh memory, the later ones into the same, touched
            t0 = time.perf_counter()
            out = (torch.empty_like(src) if i == 0 else out).copy_(src)
            times.append(time.perf_counter() - t0)
        print(json.dumps({"s": times}))
        return
    fn = tools(d)[tool]

    async def run() -> None:
        for _ in range(loads):
            t0 = time.perf_counter()
            got = await fn()
            times.append(time.perf_counter() - t0)
            assert got, tool
            del got

    asyncio.run(run())
    print(json.dumps({"s": times}))


async def save(store: str, state: dict[str, torch.Tensor]) -> None:
    async with aiotensor.TensorStore(store) as s:
        await s.save(1, state)


def run(a: argparse.Namespace) -> dict[str, Any]:
    shutil.rmtree(a.dir, ignore_errors=True)
    layouts: dict[str, Any] = {}
    for name, state in (("one file", transformer_state(layers=a.layers, d=1024, vocab=32000)),
                        (f"{a.small} tensors", {f"blocks.{i}.p": torch.randn(1280 + i % 7) for i in range(a.small)})):  # fmt: skip
        d = os.path.join(a.dir, name.replace(" ", "_"))
        os.makedirs(d)
        st_save(state, os.path.join(d, "model.safetensors"))
        torch.save(state, os.path.join(d, "model.pt"))
        from tensorizer import TensorSerializer

        try:
            ser = TensorSerializer(os.path.join(d, "model.tensors"))
            ser.write_state_dict(state)
            ser.close()
        except RuntimeError:  # tensorizer 2.12 cannot write 20,000 tensors ("Metadata overflow")
            os.remove(os.path.join(d, "model.tensors"))
        asyncio.run(save(os.path.join(d, "store"), state))
        nbytes = sum(t.nbytes for t in state.values())
        del state
        paths = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]
        names = [*tools(d), LIMIT]
        times: dict[str, list[list[float]]] = {k: [] for k in names}
        for _ in range(a.reps):
            for tool in names:
                warm(paths)
                got = subprocess.run(
                    [sys.executable, __file__, "--child", tool, "--dir", d, "--loads", str(a.loads)],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                times[tool].append(json.loads(got.stdout.strip().splitlines()[-1])["s"])
        layouts[name] = {"bytes": nbytes, "times": times}
        print(name, "done", flush=True)
    shutil.rmtree(a.dir, ignore_errors=True)
    return {"reps": a.reps, "loads": a.loads, "layouts": layouts}


def report(res: dict[str, Any]) -> str:
    lines = [
        "# A server's loads, each tool in a process of its own, the file in the page cache",
        "",
        f"`python bench/bench_fresh.py --reps {res['reps']} --loads {res['loads']}`: the first load of a fresh process, and "
        "the median of its later loads (nothing else loaded in that process); ratio: the fastest copying peer's time over ours "
        "in the same repetition, median (> 1: faster).",
    ]
    for name, lay in res["layouts"].items():
        gb, times = lay["bytes"] / 1e9, lay["times"]
        first = {k: [v[0] for v in runs] for k, runs in times.items()}
        later = {k: [statistics.median(v[1:]) for v in runs] for k, runs in times.items() if len(runs[0]) > 1}
        peers_ = [k for k in times if k not in (*OURS, LIMIT)]
        lines += [
            "",
            f"## {name} ({gb:.2f} GB)",
            "",
            "| tool | first GB/s | ratio | later GB/s | ratio |",
            "|---|---|---|---|---|",
        ]
        best = {w: [min(t[k][i] for k in peers_) for i in range(res["reps"])] for w, t in (("first", first), ("later", later))}
        for k in times:
            row = []
            for w, t in (("first", first), ("later", later)):
                if k not in t:
                    row += ["", ""]
                    continue
                ratio = statistics.median(b / s for b, s in zip(best[w], t[k], strict=True)) if k in OURS else None
                row += [f"{gb / statistics.median(t[k]):.2f}", "" if ratio is None else f"{ratio:.2f}"]
            lines.append(f"| {k} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if "--child" in sys.argv:
        c = argparse.ArgumentParser()
        c.add_argument("--child")
        c.add_argument("--dir")
        c.add_argument("--loads", type=int, default=1)
        a = c.parse_args()
        child(a.dir, a.child, a.loads)
        return
    p = parser(__doc__, "fresh")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--small", type=int, default=20_000)
    p.add_argument("--loads", type=int, default=5, help="loads in each process: the first, then the later ones")
    a = p.parse_args()
    a.reps = max(a.reps, 1)
    res = run(a)
    text = report(res)
    print(text)
    write_results(a.out, "fresh", text, res)


if __name__ == "__main__":
    main()
