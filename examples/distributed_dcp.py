"""A TensorStore under a process group: 2 ranks (gloo, on this machine) save a model whose weight is
sharded by rows (a DTensor) with ``TensorStore(root, distributed=True)`` (DCP plans, aiotensor writes,
rank 0 commits once), load it back into their shards, then one process loads the whole thing.

    python examples/distributed_dcp.py [--root ckpts/] [--world 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import warnings
from datetime import timedelta

import anyio
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from aiotensor import TensorStore
from aiotensor.dcp import AiotensorReader


def full_weight() -> torch.Tensor:
    return torch.arange(64 * 16, dtype=torch.float32).view(64, 16)


async def train(r: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    state = {"model": {"w": distribute_tensor(full_weight(), mesh, [Shard(0)]), "b": torch.ones(16)}, "step": 100}
    async with TensorStore(root, distributed=True, keep_last=2) as store:  # every rank, same root
        handle = store.save(100, state)  # every rank: each writes its own rows; one commit for all
        await handle.staged  # training may change the weights from here on
        await handle
        if r == 0:
            print(f"rank 0: saved {world} shards of model.w as step 100 in {root}", flush=True)
        into = {"model": {"w": distribute_tensor(torch.zeros(64, 16), mesh, [Shard(0)]), "b": torch.zeros(16)}, "step": 0}
        await store.load(into=into)  # each rank reads its own rows (any world size: DCP reshards)
        ok = torch.equal(into["model"]["w"].full_tensor(), full_weight())
        if r == 0:
            print(f"every rank loaded its rows back: {ok}", flush=True)


def rank(r: int, world: int, root: str, port: int) -> None:
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=world, timeout=timedelta(seconds=60))
    try:
        anyio.run(train, r, world, root)
        dist.barrier()  # every rank done before any tears the group down (gloo's threads meet a peer gone)
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
    mp.spawn(rank, args=(a.world, root, port), nprocs=a.world, join=True)
    warnings.simplefilter("ignore")
    into = {"model": {"w": torch.zeros(64, 16), "b": torch.zeros(16)}, "step": 0}
    dcp.load(into, storage_reader=AiotensorReader(folder))  # plain DCP, one process, the whole tensor
    print(f"loaded step {into['step']} in one process: model.w intact: {torch.equal(into['model']['w'], full_weight())}")
    with open(os.path.join(root, "latest")) as f:
        print(f"committed once, for every rank: `latest` names {f.read().strip()}")


if __name__ == "__main__":
    main()
