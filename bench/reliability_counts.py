"""Counts for bench/results/reliability.md: kill points, and power cuts over the shipped and four broken protocols."""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pathlib import Path

from tests import test_powerloss as P
from tests.test_crash import commit_step_1, count_ops

d = tempfile.mkdtemp()
r = os.path.join(d, "store")
commit_step_1(r)  # step 1 after a step 0: the save of step 2 links its frozen shard (an incremental save)
print("kill points:", count_ops(r))
for bug in [None, *P.BROKEN]:
    t = Path(tempfile.mkdtemp())
    ops = P.recorded(t)
    if bug:
        ops = P.BROKEN[bug](ops)
    for lost in ("empty", "zeros"):
        outcomes, failures = P.sweep(t, ops, lost)
        print(
            f"{bug or 'as shipped'} [{lost}]: {len(ops) + 1} cuts, outcomes {outcomes}, failing cuts {len(failures)}",
            ("; first: " + failures[0][:160]) if failures else "",
        )
