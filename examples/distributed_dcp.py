"""torch.distributed.checkpoint through aiotensor: 2 ranks (gloo, on this machine) save a model whose
weight is sharded by rows (a DTensor), then one process loads the whole thing (DCP reshards).

    python examples/distributed_dcp.py [--root ckpts/] [--world 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from aiotensor.dcp import AiotensorReader, AiotensorWriter


def full_weight() -> torch.Tensor:
    return torch.arange(64 * 16, dtype=torch.float32).view(64, 16)


def rank(r: int, world: int, folder: str, port: int) -> None:
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=world, timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (world,))
        state = {"model": {"w": distribute_tensor(full_weight(), mesh, [Shard(0)]), "b": torch.ones(16)}, "step": 100}
        dcp.save(state, storage_writer=AiotensorWriter(folder))  # each rank writes its rows; one commit
        if r == 0:
            print(f"rank 0: saved {world} shards of model.w into {folder}", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=None)
    p.add_argument("--world", type=int, default=2)
    a = p.parse_args()
    root = a.root or tempfile.mkdtemp(prefix="aiotensor-dcp-")
    folder = os.path.join(root, "step-000000000100")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank, args=(a.world, folder, port), nprocs=a.world, join=True)
    warnings.simplefilter("ignore")
    into = {"model": {"w": torch.zeros(64, 16), "b": torch.zeros(16)}, "step": 0}
    dcp.load(into, storage_reader=AiotensorReader(folder))  # one process, the whole tensor
    print(f"loaded step {into['step']} in one process: model.w intact: {torch.equal(into['model']['w'], full_weight())}")
    with open(os.path.join(root, "latest")) as f:
        print(f"committed once, for every rank: `latest` names {f.read().strip()}")


if __name__ == "__main__":
    main()
