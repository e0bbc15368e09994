"""What the manifest's version 3 (a tensor table of columns) buys a store of many small tensors.

One store step of ``--small`` tensors (20,000 of 1,280-1,286 float32 by default, 0.1 GB, as
``bench_serving.py``'s small layout), and beside it the same step with its manifest written as
version 2 (the same entries as an object of objects, sealed again). In each repetition, in
alternating order and in this one process, warm: ``manifest.loads`` of each, ``manifest.dumps`` of
the entries (version 3; version 2's size is the file's), ``store.load()`` of each step, and
safetensors' ``load_file`` (its ``pread`` path) of a safetensors file of the same tensors. Reports
medians and the medians of the paired ratios; writes bench/results/manifest.md and .json.

    python bench/bench_manifest.py [--reps 9] [--small 20000]
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

import torch
from safetensors.torch import load_file as st_load
from safetensors.torch import save_file as st_save

import aiotensor
from aiotensor.formats import manifest as mf
from aiotensor.formats.dtypes import ITEMSIZE

sys.path.insert(0, os.path.dirname(__file__))
from bench_cpu import parser, write_results


def as_version_2(doc: dict[str, Any]) -> dict[str, Any]:
    """A version 3 manifest document as version 2 wrote it: its table as ``tensors``, in place."""
    t, files = doc["table"], [s["file"] for s in doc["shards"]]
    shard, ndim, dims, offset, crc = ([int(x) for x in t[c].split()] for c in ("shard", "ndim", "dims", "offset", "crc32c"))
    it = iter(dims)
    shapes = [[next(it) for _ in range(n)] for n in ndim]
    tensors = {}
    for i, (key, dtype) in enumerate(zip(t["keys"], t["dtype"].split(), strict=True)):
        n = torch.Size(shapes[i]).numel() * ITEMSIZE[dtype]
        tensors[key] = {
            "shard": files[shard[i]],
            "dtype": dtype,
            "shape": shapes[i],
            "offset": offset[i],
            "nbytes": n,
            "crc32c": crc[i],
        }
    out = {("tensors" if k == "table" else k): (tensors if k == "table" else v) for k, v in doc.items() if k != "checksum"}
    out["version"] = 2
    return out


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


async def run(a: Any) -> dict[str, Any]:
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    state = {f"blocks.{i}.p": torch.randn(1280 + i % 7) for i in range(a.small)}
    roots = {v: os.path.join(a.dir, f"v{v}") for v in (2, 3)}
    for root in roots.values():
        async with aiotensor.TensorStore(root) as store:
            await store.save(1, state)
    path = {v: os.path.join(root, "step-000000000001", "manifest.json") for v, root in roots.items()}
    with open(path[2], "rb") as f:
        doc = json.loads(f.read())
    with open(path[2], "wb") as f:
        f.write(mf.seal(as_version_2(doc)))
    raw = {}
    for v, p in path.items():
        with open(p, "rb") as f:
            raw[v] = f.read()
    assert mf.loads(raw[2], path[2]) == mf.loads(raw[3], path[3])
    src = os.path.join(a.dir, "model.safetensors")
    st_save(state, src)
    m = mf.loads(raw[3], path[3])

    async def store_load(v: int) -> float:
        async with aiotensor.TensorStore(roots[v], readonly=True) as store:
            t = time.perf_counter()
            got = await store.load()
            dt = time.perf_counter() - t
        del got
        return dt

    rows: dict[str, list[float]] = {
        k: [] for k in ("loads v2", "loads v3", "dumps v3", "store.load v2", "store.load v3", "safetensors pread")
    }
    for r in range(a.reps + 1):
        order = (2, 3) if r % 2 else (3, 2)
        got: dict[str, float] = {}
        for v in order:
            got[f"loads v{v}"] = timed(lambda v=v: mf.loads(raw[v], path[v]))
        got["dumps v3"] = timed(lambda: mf.dumps(m))
        for v in order:
            got[f"store.load v{v}"] = await store_load(v)
        got["safetensors pread"] = await asyncio.to_thread(timed, lambda: st_load(src))
        if r:  # the first is a warm-up
            for k, v in got.items():
                rows[k].append(v)
    shutil.rmtree(a.dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    paired = {
        "loads v3 / v2 (time)": statistics.median(x / y for x, y in zip(rows["loads v3"], rows["loads v2"], strict=True)),
        "store.load v3 / v2 (time)": statistics.median(
            x / y for x, y in zip(rows["store.load v3"], rows["store.load v2"], strict=True)
        ),
        "safetensors pread / store.load v3 (> 1: ours faster)": statistics.median(
            x / y for x, y in zip(rows["safetensors pread"], rows["store.load v3"], strict=True)
        ),
        "safetensors pread / store.load v2": statistics.median(
            x / y for x, y in zip(rows["safetensors pread"], rows["store.load v2"], strict=True)
        ),
    }
    sizes = {f"manifest v{v} bytes": len(b) for v, b in raw.items()}
    return {"tensors": a.small, "reps": a.reps, "median_s": med, "paired": paired, **sizes, "rows": rows}


def report(res: dict[str, Any]) -> str:
    lines = [
        f"# Manifest version 3 against version 2: {res['tensors']} tensors, {res['reps']} repetitions (warm)",
        "",
        f"Manifest: {res['manifest v2 bytes']:,} bytes as version 2, {res['manifest v3 bytes']:,} as version 3.",
        "",
        "| what | median (ms) |",
        "|---|---|",
        *(f"| {k} | {v * 1e3:.1f} |" for k, v in res["median_s"].items()),
        "",
        "| paired ratio (median) | |",
        "|---|---|",
        *(f"| {k} | {v:.2f} |" for k, v in res["paired"].items()),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__, "manifest")
    p.add_argument("--small", type=int, default=20000)
    a = p.parse_args()
    res = asyncio.run(run(a))
    text = report(res)
    print(text)
    write_results(a.out, "manifest", text, res)


if __name__ == "__main__":
    main()
