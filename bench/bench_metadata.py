"""The event loop while a store saves and loads a step with big non-tensor values: a training
state's sampler keeps a list of every sample index (``--indices``, a million by default) and a
dict of per-sample losses (``--losses``, 300,000), beside one small tensor.

For each: the time of ``store.save()`` (durable) and ``store.load()``, and the lag of a 1 ms
ticker task on the loop (worst and p99) meanwhile; torch.save/torch.load of the same state in a
thread (``asyncio.to_thread``) beside it, in the same repetitions. Medians; writes
bench/results/metadata.md and .json. Run it with another tree first on ``PYTHONPATH`` to measure
that tree.

    python bench/bench_metadata.py [--reps 5] [--indices 1000000] [--losses 300000]
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_cpu import fsync_path, parser, write_results
from bench_loop import with_ticker

import aiotensor


def states(a: Any) -> dict[str, dict[str, Any]]:
    w = torch.randn(256, 256)
    return {
        f"a list of {a.indices:,} ints": {"w": w, "sampler": {"indices": list(range(a.indices))}},
        f"a dict of {a.losses:,} floats": {"w": w, "losses": {f"sample-{i}": i * 0.5 for i in range(a.losses)}},
    }


async def run(a: Any) -> dict[str, Any]:
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    res: dict[str, Any] = {"aiotensor": os.path.dirname(aiotensor.__file__), "reps": a.reps, "cases": {}}
    for name, state in states(a).items():
        rows: dict[str, list[tuple[float, ...]]] = {}
        root = os.path.join(a.dir, "store")
        async with aiotensor.TensorStore(root, keep_last=1) as store:
            for rep in range(a.reps + 1):  # the first warms up
                s = await with_ticker(lambda rep=rep: store.save(rep, state))
                ld = await with_ticker(store.load)
                p = os.path.join(a.dir, f"t{rep}.pt")

                def tsave(p: str = p) -> None:
                    torch.save(state, p)
                    fsync_path(p)

                ts = await with_ticker(lambda: asyncio.to_thread(tsave))
                tl = await with_ticker(lambda p=p: asyncio.to_thread(torch.load, p))
                os.unlink(p)
                if rep:
                    rows.setdefault("aiotensor store", []).append((*s, *ld))
                    rows.setdefault("torch.save/load (to_thread)", []).append((*ts, *tl))
        shutil.rmtree(root, ignore_errors=True)
        res["cases"][name] = {k: [statistics.median(c) for c in zip(*v, strict=True)] for k, v in rows.items()}
    shutil.rmtree(a.dir, ignore_errors=True)
    return res


def report(res: dict[str, Any]) -> str:
    lines = [f"# The event loop with big non-tensor values in the state ({res['reps']} repetitions, medians)", ""]
    lines += [f"aiotensor from `{res['aiotensor']}`.", ""]
    for name, rows in res["cases"].items():
        lines += [
            f"## {name}",
            "",
            "| tool | save s | loop worst / p99 during save (ms) | load s | during load (ms) |",
            "|---|---|---|---|---|",
        ]
        for tool, (s, sw, sp, ld, lw, lp) in rows.items():
            lines.append(f"| {tool} | {s:.3f} | {sw:.1f} / {sp:.1f} | {ld:.3f} | {lw:.1f} / {lp:.1f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__, "metadata")
    p.add_argument("--indices", type=int, default=1_000_000)
    p.add_argument("--losses", type=int, default=300_000)
    a = p.parse_args()
    res = asyncio.run(run(a))
    text = report(res)
    print(text)
    write_results(a.out, "metadata", text, res)


if __name__ == "__main__":
    main()
