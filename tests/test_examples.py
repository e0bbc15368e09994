"""The README's examples run end to end: the training demo (a short run), then the command line on
the checkpoints it left (the model server has its own test, tests/test_model_server.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_training_demo_then_the_command_line_on_its_checkpoints(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpts")
    demo = [sys.executable, "examples/train_snapshot.py", "--root", root, "--steps", "3", "--every", "2"]
    r = subprocess.run(demo, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "bit-exact with the weights at that step: True" in r.stdout and "trainer held" in r.stdout
    for args, expect in ((["ls", root], "step"), (["verify", root], "OK"), (["inspect", root], "tensors")):
        r = subprocess.run([sys.executable, "-m", "aiotensor", *args], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and expect in r.stdout, r.stdout + r.stderr


def _example(name: str, root: Any, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, f"examples/{name}", "--root", str(root)], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_the_distributed_example(tmp_path: Any) -> None:
    r = _example("distributed_dcp.py", tmp_path, 180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "every rank loaded its rows back: True" in r.stdout
    assert "model.w intact: True" in r.stdout and "`latest` names step-000000000100" in r.stdout


def test_resume_anywhere_matches_the_uninterrupted_run_exactly(tmp_path: Any) -> None:
    """2 ranks -> 1 process -> 3 ranks, AdamW and a schedule, a Snapshotter saving in the background
    while the trainer's DTensor all-gathers run (issue 23.3, and the store's own gloo group)."""
    r = _example("resume_anywhere.py", tmp_path, 240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "after resuming on 1 process, the next losses match the uninterrupted run exactly: True" in r.stdout, r.stdout
    assert "after resuming on 3 ranks, the next losses match the uninterrupted run exactly: True" in r.stdout, r.stdout
