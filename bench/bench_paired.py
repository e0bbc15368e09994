"""Paired benchmark of two versions of aiotensor: the same operations, alternating between the two
trees in one run, each repetition a fresh child process per tree; reports the median of the paired
ratios (this tree / the other), since absolute times on a shared VM drift between repetitions.

    git worktree add /tmp/aiotensor-old <commit>
    python bench/bench_paired.py --other /tmp/aiotensor-old [--reps 5] [--gb 0.5]

Operations (public API only, the same in both trees): a durable TensorStore save (and how long
``staged`` held the caller), a cold and a warm load into existing tensors, save_file and load_file,
a warm stream of a file, load_torch, and a save and load of 20,000 small tensors; and torch.load,
the same in both, as a control of the machine's drift.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = r"""
import sys
tree, folder, gb = sys.argv[1], sys.argv[2], float(sys.argv[3])
sys.path.insert(0, tree)
import asyncio, json, os, shutil, time
import torch
import aiotensor
from aiotensor._bench import drop_cache

assert aiotensor.__file__.startswith(tree), aiotensor.__file__
g = torch.Generator().manual_seed(0)
n = int(gb * 1e9 / 4 / 24)
state = {"model": {f"layer{i}.w": torch.randn(n, generator=g) for i in range(24)}, "step": 1}
small = {f"t{i}": torch.randn(16, generator=g) for i in range(20_000)}
out = {}

def clock(name, fn):
    t = time.perf_counter(); r = asyncio.run(fn()); out[name] = time.perf_counter() - t; return r

async def save():
    async with aiotensor.TensorStore(os.path.join(folder, "root")) as s:
        h = s.save(1, state); t = time.perf_counter(); await h.staged; out["save staged (s)"] = time.perf_counter() - t; await h

async def load():
    into = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}, "step": 0}
    async with aiotensor.TensorStore(os.path.join(folder, "root"), readonly=True) as s:
        await s.load(into=into)

flat = state["model"]
async def save_file(): await aiotensor.save_file(flat, os.path.join(folder, "m.safetensors"))
async def load_file(): await aiotensor.load_file(os.path.join(folder, "m.safetensors"))
async def stream():
    async with aiotensor.stream(os.path.join(folder, "m.safetensors")) as s:
        async for _ in s: pass
async def load_torch(): await aiotensor.load_torch(os.path.join(folder, "m.pt"))
async def small_roundtrip():
    async with aiotensor.TensorStore(os.path.join(folder, "small")) as s:
        await s.save(1, small); await s.load(1)

clock("store save (s)", save)
drop_cache(os.path.join(folder, "root"))
clock("store load cold (s)", load)
clock("store load warm (s)", load)
clock("save_file (s)", save_file)
clock("load_file warm (s)", load_file)
clock("stream warm (s)", stream)
torch.save(flat, os.path.join(folder, "m.pt"))
clock("load_torch warm (s)", load_torch)
async def torch_load(): torch.load(os.path.join(folder, "m.pt"))
clock("control: torch.load warm (s)", torch_load)  # the same code in both runs: what the machine drifts
clock("20,000 tensors save+load (s)", small_roundtrip)
print(json.dumps(out))
"""


def run(tree: str, gb: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="aiotensor-paired-", dir=os.environ.get("BENCH_DIR")) as folder:
        r = subprocess.run([sys.executable, "-c", CHILD, tree, folder, str(gb)], capture_output=True, text=True, cwd=folder)
        if r.returncode:
            raise SystemExit(f"{tree}: {r.stderr[-3000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--other", required=True, help="a checkout of the version to compare with")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--gb", type=float, default=0.5, help="the store's state size")
    p.add_argument("--out", default=os.path.join(HERE, "results", "reshape"))
    p.add_argument("--note", action="append", default=[], help="a line added under the table (repeatable)")
    a = p.parse_args()
    this = os.path.dirname(HERE)
    runs: dict[str, list[dict[str, float]]] = {"this": [], "other": []}
    for rep in range(a.reps):
        order = ("other", "this") if rep % 2 == 0 else ("this", "other")  # alternate who goes first
        for who in order:
            runs[who].append(run(this if who == "this" else a.other, a.gb))
            print(f"rep {rep + 1} {who}: {runs[who][-1]}", file=sys.stderr)
    rows = []
    for op in runs["this"][0]:
        ratios = [t[op] / o[op] for t, o in zip(runs["this"], runs["other"], strict=True)]
        rows.append((op, statistics.median(o[op] for o in runs["other"]), statistics.median(t[op] for t in runs["this"]),
                     statistics.median(ratios), min(ratios), max(ratios)))  # fmt: skip
    lines = [
        f"# Paired: this tree vs {a.other} ({a.reps} repetitions, {a.gb} GB state, alternating)",
        "",
        "| operation | other, median | this, median | this / other, median of pairs | range |",
        "|---|---|---|---|---|",
        *[f"| {op} | {o:.3f} | {t:.3f} | {m:.2f} | {lo:.2f}-{hi:.2f} |" for op, o, t, m, lo, hi in rows],
        "",
        "Times in seconds; a ratio under 1 means this tree is faster. The control row runs torch.load in",
        "both: its spread is the machine's, not aiotensor's.",
        *[f"\n{n}" for n in a.note],
    ]
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".md", "w") as f:
        f.write(text + "\n")
    with open(a.out + ".json", "w") as f:
        json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
