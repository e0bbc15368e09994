"""A real full disk: a small tmpfs and a small loop-mounted ext4 fill up in the middle of a save.

Needs root (mount); skipped with the reason otherwise. After the disk fills: the save raises an
``OSError`` with errno ENOSPC naming the file, nothing is committed, no temporary folder is left,
the previous checkpoint loads bit for bit, and once space is freed the next save works.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from aiotensor import TensorStore

from .conftest import assert_state_equal, tmp_leftovers

pytestmark = [pytest.mark.anyio, pytest.mark.root]

MiB = 1 << 20


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture(params=["tmpfs", "ext4"])
def small_fs(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    """An 8 MiB file system mounted on a fresh folder."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root on Linux")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        if request.param == "tmpfs":
            _run("mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt))
        else:
            if shutil.which("mkfs.ext4") is None:
                pytest.skip("mkfs.ext4 is not installed")
            img = tmp_path / "fs.img"
            with open(img, "wb") as f:
                f.truncate(8 * MiB)
            _run("mkfs.ext4", "-q", "-F", "-m", "0", str(img))
            _run("mount", "-o", "loop", str(img), str(mnt))
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
        pytest.skip(f"cannot mount a {request.param} here: {detail}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def state(n_floats: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n_floats, generator=g), "step": seed}


async def test_disk_fills_mid_save(small_fs: str) -> None:
    root = os.path.join(small_fs, "ckpt")
    first = state(256 * 1024, 1)  # 1 MiB
    async with TensorStore(root) as store:
        await store.save(1, first)
        free = shutil.disk_usage(small_fs).free
        big = state(int(free * 1.5) // 4, 2)  # larger than what is left: fails part-way through
        with pytest.raises(OSError) as ei:
            await store.save(2, big)
        err = ei.value
        assert err.errno == errno.ENOSPC, err
        assert "shard-00000.safetensors" in str(err) and "No space left on device" in str(err), str(err)
        assert not str(err).endswith("None"), str(err)
        assert store.steps() == [1]
        assert tmp_leftovers(root) == []
        assert sorted(os.listdir(root)) == [".aiotensor.lock", "latest", "step-000000000001"]
        assert_state_equal(first, await store.load())
        # the failed save's space came back: a save that fits now works
        small = state(1024, 3)
        await store.save(3, small)
        assert store.steps() == [1, 3]
    async with TensorStore(root) as again:
        assert again.steps() == [1, 3]
        assert_state_equal(small, await again.load(3))
        assert_state_equal(first, await again.load(1))
