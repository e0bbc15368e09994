"""How long a save of many small tensors holds the trainer (issue 26), against a clone of the same
tensors in the same process (what any snapshot must at least do: copy every tensor), and against
``dcp.async_save``'s hold (``--dcp``).

Two states of 20,000 tensors (0.33 GB): ``flat``, a dict of 20,000 float32 tensors of 16 KB, and
``optim``, a model of 5,000 such tensors with Adam's state (``exp_avg``, ``exp_avg_sq``, ``step``
per parameter, as ``optimizer.state_dict()`` gives it). Each (tree, state, ``incremental``) runs in a
process of its own: 7 saves to a store, one in 7 parameters changed between saves, each preceded by
a clone of every tensor; the hold is ``save()`` to ``await handle.staged``; medians over saves 2-7
of the paired ratio hold / clone. With ``--other TREE`` (a ``git worktree`` of another commit) the
two trees run alternately, so that a change is measured against the machine's drift.

    python bench/bench_hold_many.py [--runs 2] [--other TREE] [--dcp] [--out bench/results/hold-many]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile

from bench_hold import run_json, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = r"""
import asyncio, json, os, statistics, sys, time
tree, shape, mode, folder = sys.argv[1:5]
sys.path.insert(0, tree)
import torch

n = 5000 if shape == "optim" else 20000
params = [torch.nn.Parameter(torch.randn(4096)) for _ in range(n)]
model = {f"layers.{i}.weight": p.detach() for i, p in enumerate(params)}
opt = None
if shape == "optim":
    opt = torch.optim.Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()

def state():
    return {"model": model, "step": 0} if opt is None else {"model": model, "optim": opt.state_dict(), "step": 0}

def tensors(s):
    out = list(s["model"].values())
    for per in (s["optim"]["state"].values() if "optim" in s else ()):
        out += [v for v in per.values() if isinstance(v, torch.Tensor)]
    return out

def change():
    with torch.no_grad():
        for p in params[::7]:
            p.add_(1)

holds, clones = [], []
if mode == "dcp":
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    for step in range(4):
        s = state()
        t = time.perf_counter(); c = [x.clone() for x in tensors(s)]; clones.append(time.perf_counter() - t); del c
        change()
        t = time.perf_counter()
        fut = dcp.async_save(s, storage_writer=dcp.FileSystemWriter(os.path.join(folder, str(step))))
        holds.append(time.perf_counter() - t)
        fut.result()
    dist.destroy_process_group()
else:
    import aiotensor
    async def main():
        async with aiotensor.TensorStore(folder, incremental=mode == "incremental", keep_last=2) as store:
            for step in range(7):
                s = state()
                t = time.perf_counter(); c = [x.clone() for x in tensors(s)]; clones.append(time.perf_counter() - t); del c
                change()
                t = time.perf_counter()
                h = store.save(step, s)
                await h.staged
                holds.append(time.perf_counter() - t)
                await h
    asyncio.run(main())
print(json.dumps({"tensors": len(tensors(state())), "hold_s": holds[1:], "clone_s": clones[1:],
                  "ratio": statistics.median(h / c for h, c in zip(holds[1:], clones[1:]))}))
"""
SHAPES = ("flat", "optim")
MODES = ("incremental", "full")
WHO = {"incremental": "TensorStore()", "full": "TensorStore(incremental=False)", "dcp": "dcp.async_save"}


def child(tree: str, shape: str, mode: str, folder: str) -> dict[str, object]:
    return run_json(CHILD, [tree, shape, mode, folder], folder)  # type: ignore[no-any-return]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--other", help="a worktree of another commit, run alternately")
    p.add_argument("--dcp", action="store_true", help="dcp.async_save's hold too")
    p.add_argument("--dir", default=None)
    p.add_argument("--out", default=os.path.join(HERE, "results", "hold-many"))
    a = p.parse_args()
    root = os.path.dirname(HERE)
    trees = {"this": root, **({"other": os.path.abspath(a.other)} if a.other else {})}
    work = a.dir or tempfile.mkdtemp(prefix="aiotensor-hold-many-")
    results: dict[str, list[float]] = {}
    raw = []
    for run in range(a.runs):
        for shape in SHAPES:
            for mode in (*MODES, *(("dcp",) if a.dcp and run == 0 else ())):
                names = list(trees) if mode != "dcp" else ["this"]
                for name in names if run % 2 == 0 else names[::-1]:
                    r = child(trees[name], shape, mode, os.path.join(work, "store"))
                    results.setdefault(f"{name} {shape} {mode}", []).append(r["ratio"])  # type: ignore[arg-type]
                    raw.append({"tree": name, "shape": shape, "mode": mode, **r})
                    hold = 1e3 * statistics.median(r["hold_s"])  # type: ignore[arg-type]
                    clone = 1e3 * statistics.median(r["clone_s"])  # type: ignore[arg-type]
                    print(
                        f"run {run} {name:5} {shape:5} {mode:11} hold {hold:7.1f} ms  clone {clone:6.1f} ms  ratio {r['ratio']:.2f}",
                        flush=True,
                    )
    shutil.rmtree(work, ignore_errors=True)
    lines = [
        "# How long a save of 20,000 small tensors holds the trainer",
        "",
        f"`python bench/bench_hold_many.py --runs {a.runs}{' --other TREE' if a.other else ''}{' --dcp' if a.dcp else ''}` — "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {__import__('torch').__version__}. Hold / clone of the same tensors "
        "in the same process (median of saves 2-7 per process; the range over processes). Target: <= 1.2.",
        "",
        "| tree | state | saved by | hold / clone |",
        "|---|---|---|---|",
        *(f"| {k.split()[0]} | {k.split()[1]} | {WHO[k.split()[2]]} | {min(v):.2f}-{max(v):.2f} |" for k, v in results.items()),
    ]
    write_results(a.out, lines, raw)


if __name__ == "__main__":
    main()
