"""Nothing the library does holds the event loop: saves and loads of a 300-tensor and a 20,000-tensor
state run under asyncio's debug mode, which logs every callback (one step of a task) that runs longer
than ``slow_callback_duration``; none may come from the library (issue 11)."""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import pytest
import torch

from aiotensor import TensorStore, load_file, save_file

# seconds: above what a 2-core machine shows for any Python program in debug mode (GIL hand-offs of
# 5 ms each, a full garbage collection walking a 20,000-tensor state: 100-170 ms), below the 0.5-1 s that walking such
# a state on the loop took; bench/bench_loop.py measures the real stalls against peers
SLOW = 0.2


def many_tensors(n: int) -> dict[str, Any]:
    return {f"layers.{i}": {"w": torch.full((16,), float(i)), "b": torch.zeros(2)} for i in range(n // 2)}


@pytest.mark.parametrize(("n", "frozen"), [(300, False), (20_000, False), (20_000, True)])
def test_no_library_callback_blocks_the_loop(tmp_path: Any, caplog: Any, n: int, frozen: bool) -> None:
    # frozen: the user's state moved out of the collector's reach with gc.freeze(), as the README
    # advises for states of many tensors; what is left to stall the loop is then the library's own
    # work, held to a tighter limit
    state = many_tensors(n)
    flat = {f"t{i}": torch.full((16,), float(i)) for i in range(n)}

    async def main() -> None:
        asyncio.get_running_loop().slow_callback_duration = SLOW / 2 if frozen else SLOW
        async with TensorStore(tmp_path / "store", keep_last=2) as store:
            for step in range(3):
                h = store.save(step, state)
                await h.staged
                await h
            await store.load()
            await store.load(into=state)
            await store.refresh()
        await save_file(flat, tmp_path / "f.safetensors")
        await load_file(tmp_path / "f.safetensors")

    gc.collect()
    if frozen:
        gc.freeze()
    try:
        with caplog.at_level(logging.WARNING, logger="asyncio"):
            asyncio.run(main(), debug=True)
    finally:
        gc.unfreeze()
    slow = [r.getMessage() for r in caplog.records if r.name == "asyncio" and "took" in r.getMessage()]
    assert slow == [], "\n".join(slow)
