"""The ``gds`` extra resolves beside the pinned torch to a kvikio of torch's CUDA major (issue 24.2).

Slow (it asks PyPI, about 30 s): ``pytest -m slow tests/test_packaging.py``. ``pip install --dry-run
--report`` resolves without downloading the wheels."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def resolve(tmp_path: Path, extra: str) -> dict[str, str]:
    report = tmp_path / f"{extra}.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--report", str(report)]
    proc = subprocess.run([*cmd, "torch==2.13.0", f"{ROOT}[{extra}]"], capture_output=True, text=True, timeout=600)
    if proc.returncode and "Could not fetch" in proc.stderr + proc.stdout:
        pytest.skip("PyPI is not reachable")
    assert proc.returncode == 0, proc.stderr[-2000:]
    got: dict[str, Any] = json.loads(report.read_text())
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in got["install"]}


@pytest.mark.parametrize("extra,kvikio,toolkit", [("gds", "kvikio-cu13", "13."), ("gds-cu12", "kvikio-cu12", "12.")])
def test_the_gds_extra_matches_cuda_majors(tmp_path: Path, extra: str, kvikio: str, toolkit: str) -> None:
    pkgs = resolve(tmp_path, extra)
    assert pkgs["torch"].split("+")[0] == "2.13.0" and kvikio in pkgs, sorted(pkgs)
    if extra == "gds":  # torch 2.13's wheels are CUDA 13 builds: the toolkit kvikio pulls is the same major
        assert pkgs.get("cuda-toolkit", toolkit).startswith(toolkit), pkgs.get("cuda-toolkit")
