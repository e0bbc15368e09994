"""Ranks for tests/test_dcp.py: ``python -m tests._dcp_ranks ROLE PATH WORLD`` under torch.multiprocessing."""

from __future__ import annotations

import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from aiotensor.dcp import AiotensorWriter

ROWS, COLS = 8, 6


def full() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).view(ROWS, COLS)


def rank_main(rank: int, world: int, path: str, port: int, fail: bool) -> None:
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        state = {"w": distribute_tensor(full(), mesh, [Shard(0)]), "b": torch.ones(3) * 7, "step": 5}
        writer = AiotensorWriter(path)
        if fail and rank == 1:
            writer.write_data = lambda plan, planner: (_ for _ in ()).throw(OSError(28, "injected: no space left"))  # type: ignore[method-assign]
        dcp.save(state, storage_writer=writer)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    path, world, port, fail = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "fail"
    mp.spawn(rank_main, args=(world, path, port, fail), nprocs=world, join=True)
