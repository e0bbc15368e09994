"""An async training loop that snapshots in the background, then restores and checks.

The recommended pattern, as ``aiotensor.Snapshotter`` runs it: save right after
``optimizer.step()``, let staging run while the next forward/backward runs, and wait for the copy
out (``await snap.before_update()``) just before the next ``optimizer.step()`` (the only thing
that mutates the saved tensors). The trainer is held only by that await; the write to disk
overlaps training. If the disk falls behind, saves are skipped (``policy="skip"``) rather than
queued in memory. On a CPU the forward/backward must run in a
worker thread (as any blocking work in an async program should), or the loop, and with it the
store, stands still while it computes.

    python examples/train_snapshot.py [--root DIR] [--steps N] [--every K]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time

import torch
from torch import nn

import aiotensor


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
    return nn.Sequential(nn.Embedding(4096, 512), nn.TransformerEncoder(layer, num_layers=6), nn.Linear(512, 4096))


def snapshot_state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, object]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


async def train(root: str, steps: int, every: int) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    data = torch.randint(0, 4096, (8, 65), generator=torch.Generator().manual_seed(1))
    handles: list[aiotensor.SaveHandle] = []
    reference: dict[str, torch.Tensor] = {}
    async with aiotensor.TensorStore(root, keep_last=2) as store:
        snap = aiotensor.Snapshotter(store, policy="skip")
        t_train = time.perf_counter()

        def forward_backward() -> torch.Tensor:
            logits = model(data[:, :-1])
            loss = loss_fn(logits.reshape(-1, 4096), data[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            return loss

        for step in range(1, steps + 1):
            # CPU compute runs in a worker thread so the event loop (and the store) keeps going;
            # on a GPU the kernels are launched asynchronously and this is not needed
            loss = await asyncio.to_thread(forward_backward)
            await snap.before_update()  # the only wait: tensors copied out before they change
            opt.step()
            if step % every == 0 or step == steps:
                # the last step is forced: never skipped even if the disk is behind
                h = snap.save(step, snapshot_state(model, opt, step), force=step == steps)
                if h is not None:
                    handles.append(h)
                    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
                print(f"step {step:4d}  loss {loss.item():.4f}  snapshot {'started' if h else 'skipped: disk busy'}")
        train_s = time.perf_counter() - t_train
        t0 = time.perf_counter()
        await snap.drain()  # all committed and durable (or raises)
        drain_s = time.perf_counter() - t0

        saved = handles[-1].nbytes
        stage = [h.stage_seconds for h in handles if h.stage_seconds is not None]
        print(
            f"\nsaved {len(handles)} snapshots of {saved / 1e6:.1f} MB each ({snap.skipped} skipped); "
            f"kept steps {store.steps()} in {root}"
        )
        held = snap.held_seconds
        print(
            f"trainer held by `await staged`: median {1e3 * statistics.median(held):.1f} ms, "
            f"max {1e3 * max(held):.1f} ms (staging copy took median {1e3 * statistics.median(stage):.1f} ms, "
            f"{saved / statistics.median(stage) / 1e9:.2f} GB/s)"
        )
        commit = statistics.median(h.commit_seconds for h in handles if h.commit_seconds)
        print(
            f"each snapshot committed (durable) {commit:.2f} s after save() (median), "
            f"{saved / commit / 1e9:.2f} GB/s while training ran"
        )
        print(f"training ran {train_s:.2f} s; waiting for the last writes after it took {drain_s:.2f} s")

        fresh = make_model()
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4)
        t0 = time.perf_counter()
        restored = await store.load()
        load_s = time.perf_counter() - t0
        fresh.load_state_dict(restored["model"])
        fresh_opt.load_state_dict(restored["optim"])
        same = all(torch.equal(fresh.state_dict()[k], v) for k, v in reference.items())
        print(
            f"restored step {restored['step']} in {load_s:.3f} s ({saved / load_s / 1e9:.2f} GB/s, checksums verified); "
            f"bit-exact with the weights at that step: {same}"
        )
        if not same:
            raise SystemExit("restore mismatch")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=None, help="checkpoint folder (default: a temporary one, removed after)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4)
    a = p.parse_args()
    root = a.root or tempfile.mkdtemp(prefix="aiotensor-demo-")
    try:
        try:
            import uvloop

            uvloop.run(train(root, a.steps, a.every))
        except ImportError:
            asyncio.run(train(root, a.steps, a.every))
    finally:
        if a.root is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
