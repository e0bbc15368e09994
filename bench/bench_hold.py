"""How long a save holds the trainer, first and later (issue 26), against a memcpy of the state.

Every repetition runs three fresh processes (a first save is a process's first touch of its staging
memory, which nothing earlier in the process may have warmed), in an order that rotates:

- ``limit``: the state (the 1.42 GB transformer of ``bench_cpu``), then one clone of it into fresh
  memory (what a first save must at least do: fault in as many new pages), then a memcpy into
  memory already touched (what a later save's staging copy is), three times, the median kept;
- ``fresh``: a new store's first save, then three more: held (``save()`` to ``await staged``) and
  committed (to ``await handle``);
- ``reserved``: the same with ``TensorStore(reserve=state)`` and a pause of 3 s after ``open()``
  (the trainer builds its model meanwhile).

Reports the medians over repetitions of paired ratios: later held / memcpy (target <= 1.2), first
held / later held and first commit / later commit, with and without ``reserve=`` (<= 1.5, <= 1.2),
and the first save's hold against the fresh-memory clone measured in the same repetition.

    python bench/bench_hold.py [--reps 3] [--dir /tmp/aiotensor-bench-hold]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = r"""
import asyncio, json, os, statistics, sys, time
sys.path.insert(0, sys.argv[3])
import torch
import aiotensor
from bench_cpu import transformer_state

mode, folder = sys.argv[1], sys.argv[2]
state = transformer_state()
out = {"bytes": sum(t.numel() * t.element_size() for t in state.values())}
if mode == "limit":
    t = time.perf_counter(); fresh = [v.clone() for v in state.values()]; out["clone_fresh_s"] = time.perf_counter() - t
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for d, s in zip(fresh, state.values()):
            d.copy_(s)
        times.append(time.perf_counter() - t)
    out["memcpy_s"] = statistics.median(times)
else:
    async def main():
        async with aiotensor.TensorStore(folder, reserve=state if mode == "reserved" else None) as store:
            if mode == "reserved":
                await asyncio.sleep(3)
            held, commit = [], []
            for step in range(4):
                t = time.perf_counter()
                h = store.save(step, state)
                await h.staged
                held.append(time.perf_counter() - t)
                await h
                commit.append(time.perf_counter() - t)
        out.update(first_held_s=held[0], first_commit_s=commit[0],
                   later_held_s=statistics.median(held[1:]), later_commit_s=statistics.median(commit[1:]))
    asyncio.run(main())
print(json.dumps(out))
"""
MODES = ("limit", "fresh", "reserved")


def run_json(code: str, args: list[str], folder: str) -> Any:
    """Run ``code`` in a fresh Python process with ``args`` (``folder`` removed before and after):
    the JSON of its output's last line."""
    shutil.rmtree(folder, ignore_errors=True)
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    shutil.rmtree(folder, ignore_errors=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(args)}: {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def write_results(out: str, lines: list[str], raw: Any) -> None:
    """Print the report's ``lines``, and write them to ``out.md``, the measurements to ``out.json``."""
    text = "\n".join(lines) + "\n"
    print(text)
    with open(out + ".md", "w") as f:
        f.write(text)
    with open(out + ".json", "w") as f:
        json.dump(raw, f, indent=1)


def child(mode: str, folder: str) -> dict[str, float]:
    return run_json(CHILD, [mode, folder, HERE], folder)  # type: ignore[no-any-return]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default="/tmp/aiotensor-bench-hold")
    p.add_argument("--out", default=os.path.join(HERE, "results", "hold"))
    a = p.parse_args()
    reps: list[dict[str, dict[str, float]]] = []
    for rep in range(a.reps):
        order = MODES[rep % 3 :] + MODES[: rep % 3]
        r = {mode: child(mode, os.path.join(a.dir, mode)) for mode in order}
        reps.append(r)
        print(json.dumps(r), flush=True)

    def med(f: object) -> float:
        return statistics.median(f(r) for r in reps)  # type: ignore[operator]

    gb = reps[0]["limit"]["bytes"] / 1e9
    rows = [
        (
            "later save held / memcpy into touched memory",
            med(lambda r: r["fresh"]["later_held_s"] / r["limit"]["memcpy_s"]),
            "<= 1.2",
        ),
    ]
    for how in ("fresh", "reserved"):
        label = "without reserve=" if how == "fresh" else "with reserve= (3 s before)"
        rows += [
            (
                f"first save held / later held, {label}",
                med(lambda r, h=how: r[h]["first_held_s"] / r[h]["later_held_s"]),
                "<= 1.5",
            ),
            (
                f"first commit / later commit, {label}",
                med(lambda r, h=how: r[h]["first_commit_s"] / r[h]["later_commit_s"]),
                "<= 1.2",
            ),
        ]
    rows.append(
        (
            "first save held without reserve= / clone into fresh memory",
            med(lambda r: r["fresh"]["first_held_s"] / r["limit"]["clone_fresh_s"]),
            "(the limit)",
        )
    )
    ms = {k: 1e3 * med(lambda r, k=k: r[k[0]][k[1]]) for k in [
        ("limit", "memcpy_s"), ("limit", "clone_fresh_s"), ("fresh", "first_held_s"), ("fresh", "later_held_s"),
        ("fresh", "first_commit_s"), ("fresh", "later_commit_s"), ("reserved", "first_held_s"),
        ("reserved", "later_held_s"), ("reserved", "first_commit_s"), ("reserved", "later_commit_s"),
    ]}  # fmt: skip
    lines = [
        "# How long a save holds the trainer, first and later",
        "",
        f"`python bench/bench_hold.py --reps {a.reps}` — {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"a {gb:.2f} GB fp32 transformer state; each repetition three fresh processes (limit, fresh store, reserved store), "
        "medians of the per-repetition ratios.",
        "",
        "| ratio | value | target |",
        "|---|---|---|",
        *(f"| {n} | {v:.2f} | {t} |" for n, v, t in rows),
        "",
        "Medians (ms): memcpy into touched memory {:.0f}, clone into fresh memory {:.0f}; without reserve= first save held {:.0f}, "
        "later {:.0f}, first commit {:.0f}, later {:.0f}; with reserve= first held {:.0f}, later {:.0f}, first commit {:.0f}, "
        "later {:.0f}.".format(*ms.values()),
    ]
    write_results(a.out, lines, reps)


if __name__ == "__main__":
    main()
