"""What reading a pickle safely costs: aiotensor's guard and restricted unpickler against the plain
C unpickler, on the pickles a user's checkpoints hold and on hostile ones.

aiotensor reads two pickled formats without running them: DCP's ``.metadata`` (DCP's own reader
calls ``pickle.load`` on it) and a torch.save zip's ``data.pkl`` (``torch.load(weights_only=True)``
reads it through torch's restricted unpickler). Before unpickling, :func:`check_hashing` models
the pickle's memo and the cost of hashing its keys (a hostile pickle can make a dict's hashing
take 2**40 steps); the restricted unpickler then admits only the classes each format uses. Cases:

- ``dcp``: the ``.metadata`` of a DCP checkpoint of ``--tensors`` tensors (``dcp.save`` with
  ``FileSystemWriter``, one process): ``pickle.loads`` (DCP's reader) against
  ``dcp_metadata.loads_pickle`` (guard, restricted unpickler, the description aiotensor reads by);
  the guard alone beside them.
- ``torch.save``: a file of ``--tensors`` tensors: ``torch.load(mmap=True, weights_only=True)``
  against ``torchsave.parse_path`` (zip, guard, restricted unpickler; neither reads the tensors'
  bytes); the guard on its ``data.pkl`` alone beside them.
- hostile memo pickles of ``--memo`` entries (``one value named N times``, ``N empty dicts``): the
  guard against ``pickle.loads`` (the C unpickler has no guard: it takes what the pickle asks).

Per case: thread CPU time (medians of ``--reps``, each pair run back to back, the ratio per
repetition: ours over the plain one's, < 1 is faster) and the peak of Python's allocations
(tracemalloc, one run each). Writes bench/results/pickles.md and .json.

    python bench/bench_pickles.py [--tensors 20000] [--memo 6000000] [--reps 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
import tracemalloc
import warnings
import zipfile
from collections.abc import Callable
from typing import Any

import torch

from aiotensor.engines import PosixEngine
from aiotensor.formats import dcp_metadata, torchsave
from aiotensor.formats.pickled import check_hashing

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def cpu(fn: Callable[[], Any]) -> float:
    gc.collect()
    t = time.thread_time()
    try:
        fn()
    except Exception:  # a hostile pickle refused: the time to refuse it counts
        pass
    return time.thread_time() - t


def peak(fn: Callable[[], Any]) -> float:
    """MB of Python allocations at the peak of ``fn()``."""
    gc.collect()
    tracemalloc.start()
    try:
        fn()
    except Exception:
        pass
    _, top = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return top / 1e6


def outcome(fn: Callable[[], Any]) -> str:
    try:
        fn()
        return "read"
    except Exception as e:
        return f"refused ({type(e).__name__})"


def cases(a: Any, d: str) -> dict[str, dict[str, Callable[[], Any]]]:
    import torch.distributed.checkpoint as dcp

    state = {f"layers.{i}.weight": torch.randn(2, 2) for i in range(a.tensors)}
    folder = os.path.join(d, "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder))
    meta = open(os.path.join(folder, ".metadata"), "rb").read()
    pt = os.path.join(d, "state.pt")
    torch.save(state, pt)
    with zipfile.ZipFile(pt) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    eng = PosixEngine()
    n = a.memo
    one = (
        b"\x80\x04" + pickle.EMPTY_LIST + pickle.NONE + pickle.MEMOIZE + (pickle.BINGET + b"\0" + pickle.MEMOIZE + pickle.POP) * n
    )
    dicts = b"\x80\x04" + pickle.EMPTY_LIST + (pickle.EMPTY_DICT + pickle.MEMOIZE + pickle.POP) * n
    return {
        f"DCP .metadata, {a.tensors:,} tensors ({len(meta) / 1e6:.1f} MB)": {
            "plain": lambda: pickle.loads(meta),
            "aiotensor": lambda: dcp_metadata.loads_pickle(meta, "x"),
            "guard alone": lambda: check_hashing(meta, "x"),
        },
        f"torch.save, {a.tensors:,} tensors (data.pkl {len(pkl) / 1e6:.1f} MB)": {
            "plain": lambda: torch.load(pt, mmap=True, weights_only=True),
            "aiotensor": lambda: torchsave.parse_path(eng, pt),
            "guard alone": lambda: check_hashing(pkl, "x"),
        },
        f"hostile: one value named {n:,} times ({len(one + pickle.STOP) / 1e6:.0f} MB)": {
            "plain": lambda: pickle.loads(one + pickle.STOP),
            "aiotensor": lambda: check_hashing(one + pickle.STOP, "x"),
        },
        f"hostile: {n:,} empty dicts ({len(dicts + pickle.STOP) / 1e6:.0f} MB)": {
            "plain": lambda: pickle.loads(dicts + pickle.STOP),
            "aiotensor": lambda: check_hashing(dicts + pickle.STOP, "x"),
        },
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tensors", type=int, default=20000)
    p.add_argument("--memo", type=int, default=6_000_000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args()
    res: dict[str, Any] = {"tensors": a.tensors, "memo": a.memo, "reps": a.reps, "torch": torch.__version__, "cases": {}}
    with tempfile.TemporaryDirectory() as d:
        for name, tools in cases(a, d).items():
            times: dict[str, list[float]] = {k: [] for k in tools}
            for _ in range(a.reps):
                for k, fn in tools.items():
                    times[k].append(cpu(fn))
            ratios = [o / b for o, b in zip(times["aiotensor"], times["plain"], strict=True)]
            row = {
                "ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
                "ratio": statistics.median(ratios),
                "peak_mb": {k: peak(fn) for k, fn in tools.items()},
                "outcome": {k: outcome(fn) for k, fn in tools.items()},
            }
            res["cases"][name] = row
            print(name, json.dumps(row), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "pickles.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [
        "# Reading pickles safely: aiotensor's guard and restricted unpickler against the plain C unpickler",
        "",
        f"`python bench/bench_pickles.py --tensors {a.tensors} --memo {a.memo} --reps {a.reps}` (torch {torch.__version__}); "
        "thread CPU time, medians; ratio: ours over the plain reader's, paired per repetition (< 1: faster); "
        "peak: Python allocations (tracemalloc).",
        "",
        "| case | plain reader ms | aiotensor ms | ratio | guard alone ms | plain peak MB | aiotensor peak MB | outcome (plain / aiotensor) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in res["cases"].items():
        ms, pk, out = row["ms"], row["peak_mb"], row["outcome"]
        guard = f"{ms['guard alone']:.0f}" if "guard alone" in ms else "(it is the guard)"
        lines.append(
            f"| {name} | {ms['plain']:.0f} | {ms['aiotensor']:.0f} | {row['ratio']:.2f} | {guard} | "
            f"{pk['plain']:.0f} | {pk['aiotensor']:.0f} | {out['plain']} / {out['aiotensor']} |"
        )
    lines += [
        "",
        "Plain readers: DCP's `FileSystemReader.read_metadata` is `pickle.load`; `torch.load(mmap=True, weights_only=True)` "
        "maps the tensors' bytes without reading them, as `parse_path` does not read them.",
    ]
    with open(os.path.join(a.out, "pickles.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
