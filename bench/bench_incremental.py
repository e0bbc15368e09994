"""Incremental checkpoints (issue 28): bytes written, commit time and the trainer's hold, against a
full save of the same state at the same step, same run.

Three training states, ``--steps`` saves each (a "training step" between saves changes what trains,
in place, as an optimizer does):

- **lora**: the 1.42 GB transformer of ``bench_cpu`` frozen, plus rank-8 adapters on every
  linear layer (0.9 % of the parameters) and their AdamW moments (2.6 % of the bytes in all);
- **full**: every tensor changes at every step (full training);
- **half**: the first half of the layers frozen, the rest trained.

At every step the same state is saved twice, by a store with ``incremental=True`` (the default)
and one with ``incremental=False``, alternating which goes first; each save's hold (``save()`` to
``await handle.staged``), commit (to ``await handle``) and bytes written are recorded. Reported:
medians over the steps from the third on (the first two teach the store what does not change:
see ``aiotensor.store.saving``), of paired ratios, and the first two steps apart. Targets: lora
bytes <= 3 % of a full save's and commit >= 10x faster; full <= 1.05x a full save's commit; the
hold unchanged in all three.

    python bench/bench_incremental.py [--steps 10] [--dir /tmp/aiotensor-bench-incremental]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def make_state(kind: str) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The state to save and the tensors a training step changes."""
    from bench_cpu import transformer_state

    base = transformer_state()
    if kind == "full":
        return {"model": base}, list(base.values())
    if kind == "half":
        layers = sorted({k.split(".")[1] for k in base if k.startswith("layers.")}, key=int)
        trained = [t for k, t in base.items() if k.startswith("layers.") and int(k.split(".")[1]) >= len(layers) // 2]
        return {"model": base}, trained
    adapters: dict[str, torch.Tensor] = {}
    for k, t in base.items():
        if t.dim() == 2 and k.startswith("layers."):
            adapters[k.replace("weight", "lora_A")] = torch.randn(8, t.shape[1]) * 0.01
            adapters[k.replace("weight", "lora_B")] = torch.zeros(t.shape[0], 8)
    moments = {f"{k}.{m}": torch.zeros_like(t) for k, t in adapters.items() for m in ("exp_avg", "exp_avg_sq")}
    state = {"model": {**base, **adapters}, "optim": {"state": moments, "lr": 1e-4}}
    return state, [*adapters.values(), *moments.values()]


def train_step(trained: list[torch.Tensor], step: int) -> None:
    for t in trained:
        t.add_(1e-3 * (step + 1))


async def run(kind: str, steps: int, folder: str) -> dict[str, Any]:
    import aiotensor

    state, trained = make_state(kind)
    nbytes = sum(t.nbytes for t in _tensors(state))
    rows: list[dict[str, float]] = []
    shutil.rmtree(folder, ignore_errors=True)
    async with (
        aiotensor.TensorStore(os.path.join(folder, "incr"), keep_last=2) as incr,
        aiotensor.TensorStore(os.path.join(folder, "full"), keep_last=2, incremental=False) as full,
    ):
        for step in range(steps):
            train_step(trained, step)
            row: dict[str, float] = {}
            order = [("incr", incr), ("full", full)]
            for name, store in order if step % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                h = store.save(step, state)
                await h.staged
                row[f"{name}_held"] = time.perf_counter() - t0
                await h
                row[f"{name}_commit"] = time.perf_counter() - t0
                row[f"{name}_written"] = h.bytes_written
            rows.append(row)
            print(
                f"{kind} step {step}: incremental held {row['incr_held']:.3f}s commit {row['incr_commit']:.3f}s "
                f"wrote {row['incr_written'] / 1e6:.1f} MB | full held {row['full_held']:.3f}s "
                f"commit {row['full_commit']:.3f}s wrote {row['full_written'] / 1e6:.1f} MB",
                flush=True,
            )
    later = rows[2:]
    return {
        "bytes": nbytes,
        "steps": rows,
        "written_fraction": statistics.median(r["incr_written"] / r["full_written"] for r in later),
        "commit_speedup": statistics.median(r["full_commit"] / r["incr_commit"] for r in later),
        "after_staged_speedup": statistics.median(
            (r["full_commit"] - r["full_held"]) / (r["incr_commit"] - r["incr_held"]) for r in later
        ),
        "changed_fraction": sum(t.nbytes for t in trained) / nbytes,
        "held_ratio": statistics.median(r["incr_held"] / r["full_held"] for r in later),
        "first_two_commit_ratio": [r["incr_commit"] / r["full_commit"] for r in rows[:2]],
    }


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cases", default="lora,full,half")
    ap.add_argument("--dir", default="/tmp/aiotensor-bench-incremental")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "incremental"))
    a = ap.parse_args()
    res: dict[str, Any] = {"machine": f"{platform.node()} {os.cpu_count()} cores, torch {torch.__version__}"}
    for kind in a.cases.split(","):
        res[kind] = asyncio.run(run(kind, a.steps, a.dir))
    shutil.rmtree(a.dir, ignore_errors=True)
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    lines = [
        f"# Incremental checkpoints (issue 28): `python bench/bench_incremental.py --steps {a.steps}`",
        "",
        f"{res['machine']}. Medians over steps 2..{a.steps - 1} of paired ratios against a full save",
        "(`incremental=False`) of the same state at the same step.",
        "",
        "| case | state | bytes that changed | bytes written / full | commit speed-up (from save()) | (from staged) | held / full held | steps 0-1 commit / full |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind in a.cases.split(","):
        r = res[kind]
        first = ", ".join(f"{x:.2f}" for x in r["first_two_commit_ratio"])
        lines.append(
            f"| {kind} | {r['bytes'] / 1e9:.2f} GB | {r['changed_fraction']:.4f} | {r['written_fraction']:.4f} | "
            f"{r['commit_speedup']:.2f} | {r['after_staged_speedup']:.2f} | {r['held_ratio']:.2f} | {first} |"
        )
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
