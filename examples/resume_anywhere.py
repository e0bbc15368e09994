"""Resume anywhere: a run on 2 ranks resumes on 1 process, which resumes on 3 ranks, and every
loss after each resume is the uninterrupted run's, bit for bit.

A small MLP whose every parameter is sharded by rows across the ranks (a DTensor), trained with
AdamW and a StepLR schedule; a Snapshotter checkpoints every step in the background into
``TensorStore(root, distributed=True)``. Then:

1. the uninterrupted run: 2 ranks (gloo, on this machine), steps 0..7, losses recorded;
2. one plain process opens the 2 ranks' root with a plain ``TensorStore``, loads step 4 (model,
   AdamW moments, learning rates, the scheduler's counters: whole tensors, assembled from both
   ranks' rows), trains steps 4 and 5 and snapshots into a root of its own;
3. 3 ranks open that single-process root with ``TensorStore(distributed=True)``, load step 6 into
   their 3-way shards (DCP reshards; the optimizer's non-tensor settings come along) and train
   steps 6 and 7.

    python examples/resume_anywhere.py [--root ckpts/]

Every process computes the full batch's loss and gradient (the shards are gathered for the
forward), so the run is deterministic at any world size and the comparison is exact. The state is
``torch.distributed.checkpoint.state_dict.get_state_dict``'s: parameter names, not ids, key the
optimizer's state, the same on 1 or N processes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import warnings
from datetime import timedelta
from typing import Any

import anyio
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.func import functional_call

from aiotensor import Snapshotter, TensorStore

STEPS, FIRST_RESUME, SECOND_RESUME = 8, 4, 6


class Trainer:
    """Model, optimizer and schedule; sharded by rows over ``mesh`` (None: one plain process)."""

    def __init__(self, mesh: Any) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 6))
        if mesh is not None:  # every first dimension (24 or 6) divides by 1, 2 and 3
            for mod in self.model.modules():
                for name, p in list(mod.named_parameters(recurse=False)):
                    setattr(mod, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.05, foreach=False)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)

    def forward_backward(self, k: int) -> float:
        """Batch ``k``'s loss and gradients (parameters and optimizer state unchanged)."""
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(32, 12, generator=g), torch.randn(32, 6, generator=g)
        full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in self.model.named_parameters()}
        loss = torch.nn.functional.mse_loss(functional_call(self.model, full, (x,)), y)
        loss.backward()
        return loss.item()

    def update(self) -> None:
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def state(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim, "sched": self.sched.state_dict(), "step": 0}

    def restore(self, state: dict[str, Any]) -> int:
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.sched.load_state_dict(state["sched"])
        return int(state["step"])


async def train(t: Trainer, store: TensorStore, start: int, stop: int, losses: dict[int, float]) -> None:
    """Steps ``start``..``stop``-1, snapshotting the state after each (as step k+1: k+1 updates done)."""
    snap = Snapshotter(store)
    for k in range(start, stop):
        losses[k] = await anyio.to_thread.run_sync(t.forward_backward, k)  # the last snapshot stages meanwhile
        await snap.before_update()  # its tensors are copied out: the update may change them
        t.update()
        snap.save(k + 1, t.state() | {"step": k + 1}, force=k == stop - 1)
    await snap.drain()


async def ranks_main(rank: int, world: int, root: str, resume_from: str | None, out: str) -> None:
    t = Trainer(init_device_mesh("cpu", (world,)))
    losses: dict[int, float] = {}
    async with TensorStore(root if resume_from is None else resume_from, distributed=True) as store:
        if resume_from is None:
            await train(t, store, 0, STEPS, losses)
            return _report(rank, out, losses)
        into = t.state()
        await store.load(SECOND_RESUME, into=into)  # the single process's step, into 3-way shards
        start = t.restore(into)
    async with TensorStore(root, distributed=True) as store:
        await train(t, store, start, STEPS, losses)
    _report(rank, out, losses)


def _report(rank: int, out: str, losses: dict[int, float]) -> None:
    if rank == 0:
        with open(out, "w") as f:
            json.dump({str(k): v for k, v in losses.items()}, f)


def ranks(rank: int, world: int, root: str, resume_from: str | None, out: str, port: int) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # the same kernels at every world size
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        anyio.run(ranks_main, rank, world, root, resume_from, out)
    finally:
        dist.destroy_process_group()


async def one_process(ranks_root: str, root: str) -> dict[int, float]:
    t = Trainer(None)
    async with TensorStore(ranks_root, readonly=True) as store:
        into = t.state()
        await store.load(FIRST_RESUME, into=into)  # what 2 ranks saved, as whole tensors
        start = t.restore(into)
    losses: dict[int, float] = {}
    async with TensorStore(root) as store:
        await train(t, store, start, SECOND_RESUME, losses)
    return losses


def spawn(world: int, root: str, resume_from: str | None, out: str) -> dict[int, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(ranks, args=(world, root, resume_from, out, port), nprocs=world, join=True)
    with open(out) as f:
        return {int(k): v for k, v in json.load(f).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=None, help="a folder for the three roots (default: a new temporary one)")
    a = p.parse_args()
    base = a.root or tempfile.mkdtemp(prefix="aiotensor-resume-")
    two, one, three = (os.path.join(base, n) for n in ("2-ranks", "1-process", "3-ranks"))
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    straight = spawn(2, two, None, os.path.join(base, "losses-2.json"))
    print(f"2 ranks trained steps 0-{STEPS - 1} without a stop, a snapshot after every step in {two}")
    resumed = anyio.run(one_process, two, one)
    print(f"1 process resumed from the 2 ranks' step {FIRST_RESUME}, trained to step {SECOND_RESUME - 1}, snapshots in {one}")
    resumed |= spawn(3, three, one, os.path.join(base, "losses-3.json"))
    print(f"3 ranks resumed from the single process's step {SECOND_RESUME}, trained to step {STEPS - 1}")
    for k in range(FIRST_RESUME, STEPS):
        where = "1 process" if k < SECOND_RESUME else "3 ranks  "
        print(f"step {k}: loss {straight[k]!r:<22} resumed on {where} {resumed[k]!r:<22} same: {straight[k] == resumed[k]}")
    for who, ks in (("1 process", range(FIRST_RESUME, SECOND_RESUME)), ("3 ranks", range(SECOND_RESUME, STEPS))):
        print(
            f"after resuming on {who}, the next losses match the uninterrupted run exactly: {all(straight[k] == resumed[k] for k in ks)}"
        )


if __name__ == "__main__":
    main()
