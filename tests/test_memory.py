"""Host memory stays bounded over many background saves (RSS back to its baseline)."""

from __future__ import annotations

import gc
from typing import Any

import psutil
import pytest
import torch

from aiotensor import TensorStore

pytestmark = pytest.mark.anyio


async def test_twenty_background_saves_do_not_grow_memory(tmp_path: Any, anyio_backend: Any) -> None:
    if anyio_backend[1]:
        pytest.skip("one event loop is enough for a memory test")
    state = {f"w{i}": torch.randn(1 << 20) for i in range(8)}  # 32 MiB
    proc = psutil.Process()
    rss: list[int] = []
    staging: list[int] = []
    async with TensorStore(tmp_path, keep_last=2, max_staged=2) as store:
        for step in range(20):
            h = store.save(step, state, background=True)
            await h.staged
            for v in state.values():
                v.add_(1)
            await h
            gc.collect()
            rss.append(proc.memory_info().rss)
            staging.append(store.staging.mapped_bytes)
    # after warm-up, staging is mapped once and RSS stays flat (within 16 MiB of noise)
    assert len(set(staging[2:])) == 1, staging
    assert max(rss[5:]) - rss[4] < 16 << 20, [r >> 20 for r in rss]
