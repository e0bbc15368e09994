"""GPU benchmark: checkpoints of CUDA state, aiotensor (each engine) vs torch, safetensors and DCP.

Run on an H200 on 2026-11-26 (``bench/device_gpu.sh``; bench/results/gpu.md). ``--device cpu --small`` runs the
same code on CPU tensors (bus figures and the pinned DCP stager then left out) to check the script.

Measures in one run, medians of ``--reps`` after a discarded warm-up:
  - the bus: pinned device → host and host → device bandwidth; the disk: fio (as bench_cpu);
  - time held by ``await handle.staged`` vs state bytes ÷ D2H bandwidth, and vs ``dcp.async_save``
    with its thread-based pinned stager ``DefaultStager(StagingOptions(True, False, True, True))`` (held until its
    ``staging_completion``);
  - durable save, and cold load to the GPU (new tensors and into existing ones), for aiotensor with
    each engine (posix; kvikio where it imports, with the mode that ran), torch.save/torch.load,
    safetensors (``load_file(device="cuda")``) and dcp.save/dcp.load. Each library saves all its
    repetitions, the disk is let settle (``os.sync``, then 5 s: a load right after a big write
    shares the disk with its write-back), then loads each cold (evicted first); aiotensor's two loads
    alternate which goes first. Every repetition's seconds are kept in the JSON (``raw_s``);
  - a training loop (a small transformer), step time with a Snapshotter checkpoint every step
    against the same loop without checkpoints.

    python bench/bench_gpu.py [--dir /tmp/aiotensor-bench-gpu] [--reps 3] [--big] [--device cpu --small]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import time
from typing import Any

import torch
from bench_cpu import SETTLE_S, atimed, evict, fio_limits, fsync_path, med, ratio_table, timed, timed_save, write_results
from torch import nn

import aiotensor
from aiotensor.engines import KvikioEngine, PosixEngine, kvikio_usable
from aiotensor.store.distributed import spent


def device_state(dev: str, layers: int, d: int, vocab: int) -> dict[str, torch.Tensor]:
    """A transformer-shaped fp32 state_dict made on ``dev`` (a 10 GB one is quick to make there)."""
    torch.manual_seed(0)
    s = {"embed.weight": torch.randn(vocab, d, device=dev)}
    for i in range(layers):
        for name, shape in [("qkv", (3 * d, d)), ("proj", (d, d)), ("fc1", (4 * d, d)), ("fc2", (d, 4 * d))]:
            s[f"layers.{i}.{name}.weight"] = torch.randn(*shape, device=dev)
            s[f"layers.{i}.{name}.bias"] = torch.randn(shape[0], device=dev)
    return s


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def bus(state: dict[str, torch.Tensor], reps: int) -> dict[str, float]:
    """Pinned D2H and H2D GB/s, one copy per tensor (the shape of a checkpoint), best of ``reps``
    (and D2H's median, to compare with the hold's median); and D2H into memory like a staging
    arena's (one anonymous mapping registered with ``cudaHostRegister``, tensors packed at
    64-byte-aligned offsets; and the same with transparent huge pages asked for), to tell a hold
    above the bus limit caused by the arena's kind of memory from one caused by the library's own
    work."""
    from aiotensor._runtime.buffers import HostBuffer, libc
    from aiotensor._runtime.cuda import Pinning

    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
    size = sum(v.nbytes for v in state.values())
    offsets, at = {}, 0
    for k, v in state.items():
        offsets[k], at = at, at + (v.nbytes + 63) // 64 * 64
    pinning = Pinning()

    def arena(huge: bool) -> tuple[Any, dict[str, torch.Tensor]]:
        buf = HostBuffer(at, populate=False)
        if huge and libc().madvise(buf.address, buf.nbytes, 14) != 0:  # MADV_HUGEPAGE
            print("madvise(MADV_HUGEPAGE) failed: the THP row is 4 KiB pages")
        buf.tensor.zero_()  # touched, as an arena is
        assert buf.pin(pinning), "no device had a context to pin the arena under"
        return buf, {k: buf.tensor[offsets[k] : offsets[k] + v.nbytes].view(v.dtype).view(v.shape) for k, v in state.items()}

    def timed(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        times = []
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return times

    d2h = timed([(host[k], v) for k, v in state.items()])
    out = {"d2h": size / min(d2h) / 1e9, "d2h_median": size / statistics.median(d2h[1:]) / 1e9}
    out["h2d"] = size / min(timed([(v, host[k]) for k, v in state.items()])) / 1e9
    del host
    for name, huge in [("d2h_arena", False), ("d2h_arena_thp", True)]:
        buf, packed = arena(huge)
        out[name] = size / min(timed([(packed[k], v) for k, v in state.items()])) / 1e9
        del packed
        pinning.unpin(buf.address)
        buf.close()
    torch._C._host_emptyCache()  # give the pinned buffers back: they would distort what follows
    return out


def dd_limits(folder: str, size_mb: int) -> dict[str, float]:
    """Where fio is missing (the lent GPU machines' image): dd's O_DIRECT 8 MiB sequential write and
    read, one request at a time, a lower bound of the disk's limit (res["disk_tool"] says which)."""
    out: dict[str, float] = {"tool": "dd"}  # type: ignore[dict-item]
    path = os.path.join(folder, "dd.bin")
    for rw, args in (
        ("write", ["if=/dev/zero", f"of={path}", "oflag=direct", "conv=fsync"]),
        ("read", [f"if={path}", "of=/dev/null", "iflag=direct"]),
    ):
        t = time.perf_counter()
        subprocess.run(["dd", *args, "bs=8M", f"count={size_mb // 8}"], check=True, capture_output=True)
        out[rw] = size_mb * (1 << 20) / (time.perf_counter() - t) / 1e9
    os.unlink(path)
    return out


def engines() -> dict[str, Any]:
    out: dict[str, Any] = {"aiotensor-posix": PosixEngine}
    if kvikio_usable():  # through cuFile whatever kvikio's mode, to keep measuring what "auto" decides
        out["aiotensor-kvikio"] = lambda: KvikioEngine(cufile="always")
    return out


async def checkpoint_io(args: argparse.Namespace, state: dict[str, torch.Tensor], res: dict[str, Any]) -> None:
    dev, base, reps = args.device, args.dir, args.reps
    into = {k: torch.zeros_like(v) for k, v in state.items()}  # a live model's parameters
    save_s: dict[str, list[float]] = {}
    load_s: dict[str, list[float]] = {}  # cold, new tensors on the device
    into_s: dict[str, list[float]] = {}  # cold, into existing device tensors
    held: list[float] = []

    def check(got: dict[str, torch.Tensor]) -> None:
        assert all(torch.equal(got[k], v) for k, v in state.items()), "loaded values differ"

    def settle() -> None:  # every save of a library written back before its loads (as bench_cpu)
        os.sync()
        time.sleep(SETTLE_S)

    for name, make in engines().items():
        root = os.path.join(base, name)
        async with aiotensor.TensorStore(root, engine=make(), keep_last=reps + 1) as store:
            res.setdefault("io_mode", {})[name] = store.io_mode
            for rep in range(reps + 1):
                t_staged, t_save = await timed_save(store, rep, state)
                if rep:
                    save_s.setdefault(name, []).append(t_save)
                    if name == "aiotensor-posix":
                        held.append(t_staged)
            settle()
            for rep in range(reps + 1):
                # new tensors first on even repetitions, into existing ones first on odd ones
                for kind in ("new", "into") if rep % 2 == 0 else ("into", "new"):
                    evict(store.path(rep))
                    if kind == "new":
                        t = await atimed(store.load(rep, device=dev))
                    else:
                        t = await atimed(store.load(rep, into=into))
                        check(into)
                    if rep:
                        (load_s if kind == "new" else into_s).setdefault(name, []).append(t)
        shutil.rmtree(root, ignore_errors=True)

    import safetensors.torch as st
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29518", rank=0, world_size=1)

    def torch_load(p: str) -> dict[str, torch.Tensor]:
        return torch.load(p, map_location=dev, weights_only=True)  # type: ignore[no-any-return]

    def dcp_load(p: str) -> dict[str, torch.Tensor]:
        out = {k: torch.empty_like(v) for k, v in state.items()}
        dcp.load(out, storage_reader=dcp.FileSystemReader(p))
        return out

    peers = {
        "torch.save": (lambda p: torch.save(state, p), torch_load, ".pt"),
        "safetensors": (lambda p: st.save_file(state, p), lambda p: st.load_file(p, device=dev), ".safetensors"),
        "dcp": (lambda p: dcp.save(state, storage_writer=dcp.FileSystemWriter(p, sync_files=True)), dcp_load, ""),
    }
    for name, (save, load, ext) in peers.items():
        paths = [os.path.join(base, f"{name}-{rep}{ext}") for rep in range(reps + 1)]
        for rep, p in enumerate(paths):
            t_save = await asyncio.to_thread(timed, lambda: (save(p), sync(dev), fsync_path(p)))
            if rep:
                save_s.setdefault(name, []).append(t_save)
        settle()
        for rep, p in enumerate(paths):
            evict(p)
            t0 = time.perf_counter()
            got = await asyncio.to_thread(load, p)
            sync(dev)
            t_load = time.perf_counter() - t0
            check(got)
            del got
            if rep:
                load_s.setdefault(name, []).append(t_load)
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.unlink(p)

    # DCP's pinned async stager: the trainer may change its tensors once staging_completion is done
    held_dcp: list[float] = []
    stager = None
    if dev == "cuda":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # pinned, async, non-blocking, but not shared memory: that needs a state-sized /dev/shm
        # (a container's 64 MB default dies with SIGBUS) and only matters across processes
        stager = DefaultStager(StagingOptions(True, False, True, True))
    res["dcp_stager"] = "DefaultStager(pinned, async)" if stager else "default"
    for rep in range(reps + 1):
        p = os.path.join(base, f"dcp-async-{rep}")
        t0 = time.perf_counter()
        w = dcp.FileSystemWriter(p, sync_files=True)
        try:
            r = (
                dcp.async_save(state, storage_writer=w, async_stager=stager)
                if stager
                else dcp.async_save(state, storage_writer=w)
            )
            if hasattr(r, "staging_completion"):
                r.staging_completion.result()
                done = r.upload_completion
            else:
                done = r
            t_held = time.perf_counter() - t0
            done.result()
        except KeyError as e:  # torch 2.11: a DefaultStager used again after it closed itself (pytorch#183413)
            if stager is None:
                raise
            print(f"DCP's pinned stager failed ({e!r}); timing DCP's default stager instead")
            stager.close()
            stager, res["dcp_stager"] = None, f"default (the pinned DefaultStager failed: KeyError {e})"
            shutil.rmtree(p, ignore_errors=True)
            continue
        if rep:
            held_dcp.append(t_held)
        shutil.rmtree(p, ignore_errors=True)
        if stager is not None and spent(stager):  # torch 2.11: it closed itself, as the store's Saver sees
            stager.close()
            stager = DefaultStager(StagingOptions(True, False, True, True))
            res["dcp_stager"] = "DefaultStager(pinned, async), a new one per save (torch 2.11 closes it after each)"
    while len(held_dcp) < reps:  # the repetitions the failed stager used up
        p = os.path.join(base, "dcp-async-extra")
        t0 = time.perf_counter()
        r = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(p, sync_files=True))
        held_dcp.append(time.perf_counter() - t0)
        r.result()
        shutil.rmtree(p, ignore_errors=True)
    if stager is not None:
        stager.close()
    dist.destroy_process_group()

    res["save_s"] = {k: med(v) for k, v in save_s.items()}
    res["load_s"] = {k: med(v) for k, v in load_s.items()}
    res["load_into_s"] = {k: med(v) for k, v in into_s.items()}
    res["held_s"] = med(held)
    res["held_dcp_s"] = med(held_dcp)
    res["raw_s"] = {"save": save_s, "load": load_s, "load_into": into_s, "held": held, "held_dcp": held_dcp}


def small_transformer(dev: str, d: int, layers: int, vocab: int) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=d, nhead=8, dim_feedforward=4 * d, batch_first=True)
    return nn.Sequential(nn.Embedding(vocab, d), nn.TransformerEncoder(layer, num_layers=layers), nn.Linear(d, vocab)).to(dev)


async def training_loop(args: argparse.Namespace, res: dict[str, Any]) -> None:
    """Step time with a checkpoint every step (Snapshotter, policy "skip") vs without."""
    dev = args.device
    d, layers, vocab, batch, seq = (256, 2, 2048, 4, 64) if args.small else (1024, 8, 32768, 16, 512)
    model = small_transformer(dev, d, layers, vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, vocab, (batch, seq + 1), device=dev)
    loss_fn = nn.CrossEntropyLoss()

    def forward_backward() -> None:
        logits = model(data[:, :-1])
        loss_fn(logits.reshape(-1, vocab), data[:, 1:].reshape(-1)).backward()

    async def run(steps: int, snap: aiotensor.Snapshotter | None, first: int = 0) -> float:
        sync(dev)
        t = time.perf_counter()
        for step in range(first, first + steps):
            if dev == "cuda":
                forward_backward()  # kernels are queued; the loop keeps running
            else:
                await asyncio.to_thread(forward_backward)
            if snap is not None:
                await snap.before_update()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if snap is not None:
                snap.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
            await asyncio.sleep(0)
        sync(dev)
        return (time.perf_counter() - t) / steps

    steps = 5 if args.small else 50
    await run(3, None)  # warm-up: kernels, the optimizer state
    without = [await run(steps, None) for _ in range(args.reps)]
    root = os.path.join(args.dir, "train")
    async with aiotensor.TensorStore(root, keep_last=2) as store:
        snap = aiotensor.Snapshotter(store, policy="skip")
        with_ = []
        for rep in range(args.reps):  # steps keep counting up across repetitions, as a run's do
            snap.started = snap.skipped = 0
            with_.append(await run(steps, snap, first=rep * steps))
            await snap.drain()
        ckpt = sum(t.nbytes for t in model.state_dict().values()) + sum(
            t.nbytes for s in opt.state_dict()["state"].values() for t in s.values() if isinstance(t, torch.Tensor)
        )
    res["train"] = {
        "params": sum(p.numel() for p in model.parameters()),
        "checkpoint_bytes": ckpt,
        "step_s_without": med(without),
        "step_s_with": med(with_),
        "saves_started_last_rep": snap.started,
        "saves_skipped_last_rep": snap.skipped,
        "held_ms_median": 1e3 * med(snap.held_seconds) if snap.held_seconds else 0.0,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    dev = args.device
    if args.small:
        layers, d, vocab = 2, 256, 5000
    elif args.big:
        layers, d, vocab = 12, 4096, 50257  # ~10.5 GB
    else:
        layers, d, vocab = 24, 1024, 50257  # ~1.4 GB
    state = device_state(dev, layers, d, vocab)
    size = sum(t.nbytes for t in state.values())
    res: dict[str, Any] = {"bytes": size, "reps": args.reps, "device": dev, "torch": torch.__version__}
    if dev == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
        res["bus"] = bus(state, args.reps)
    try:
        import kvikio

        res["kvikio"] = kvikio.__version__
    except Exception as e:  # not installed, or its libraries do not load here
        res["kvikio"] = f"unavailable ({type(e).__name__})"
    res["disk"] = fio_limits(args.dir, 256 if args.small else 4096) or dd_limits(args.dir, 256 if args.small else 4096)
    print(f"state: {size / 1e9:.2f} GB on {dev}; bus {res.get('bus')}; disk {res['disk']}; kvikio {res['kvikio']}")
    await checkpoint_io(args, state, res)
    del state
    await training_loop(args, res)
    shutil.rmtree(args.dir, ignore_errors=True)
    return res


def report(res: dict[str, Any]) -> str:
    gb = res["bytes"] / 1e9
    nan = float("nan")
    d2h, h2d = res.get("bus", {}).get("d2h", nan), res.get("bus", {}).get("h2d", nan)
    d2h_arena, d2h_thp = res.get("bus", {}).get("d2h_arena", nan), res.get("bus", {}).get("d2h_arena_thp", nan)
    d2h_median = res.get("bus", {}).get("d2h_median", nan)
    disk_read = res["disk"].get("read", nan)
    lines = [
        f"# GPU benchmark ({res.get('gpu', res['device'])}, torch {res['torch']}, kvikio {res['kvikio']})",
        "",
        f"State: transformer fp32 state_dict, {gb:.2f} GB on {res['device']}; medians of {res['reps']} repetitions.",
        f"Bus (pinned): D2H {d2h:.2f} GB/s, H2D {h2d:.2f} GB/s, D2H into a registered arena {d2h_arena:.2f} GB/s ({d2h_thp:.2f} with THP). Disk ({res['disk'].get('tool', 'fio')}): write {res['disk'].get('write', nan):.2f} GB/s, "
        f"read {disk_read:.2f} GB/s. aiotensor I/O modes: {res['io_mode']}.",
        "",
        "| library | durable save GB/s | cold load to device GB/s | cold load into device tensors GB/s |",
        "|---|---|---|---|",
    ]
    for k in res["save_s"]:
        into = res["load_into_s"].get(k)
        lines.append(
            f"| {k} | {gb / res['save_s'][k]:.2f} | {gb / res['load_s'][k]:.2f} | {f'{gb / into:.2f}' if into else '-'} |"
        )
    best_ours = min(v for k, v in res["load_s"].items() if k.startswith("aiotensor"))
    t = res["train"]
    targets = [
        ("held by staged / (bytes ÷ D2H)", res["held_s"] / (gb / d2h), "<= 1.2"),
        ("held by staged / (bytes ÷ D2H's median)", res["held_s"] / (gb / d2h_median), "(diagnosis)"),
        ("held by staged / (bytes ÷ D2H into a registered arena)", res["held_s"] / (gb / d2h_arena), "(diagnosis)"),
        ("held by staged / (bytes ÷ D2H into a registered arena, THP)", res["held_s"] / (gb / d2h_thp), "(diagnosis)"),
        ("held by staged / DCP async_save held", res["held_s"] / res["held_dcp_s"], "<= 0.5"),
        ("load to device / min(disk read, H2D)", (gb / best_ours) / min(disk_read, h2d), ">= 0.9"),
        ("load to device / safetensors load_file(device=)", res["load_s"]["safetensors"] / best_ours, ">= 1.5"),
        ("train step with a checkpoint every step / without", t["step_s_with"] / t["step_s_without"], "<= 1.10"),
    ]
    lines += ratio_table(targets)
    lines += [
        "",
        f"Held: aiotensor {1e3 * res['held_s']:.0f} ms to `staged`; DCP async_save with stager "
        f"{res['dcp_stager']}: {1e3 * res['held_dcp_s']:.0f} ms to `staging_completion`.",
        f"Training loop: {t['params'] / 1e6:.0f} M parameters, checkpoint {t['checkpoint_bytes'] / 1e9:.2f} GB; step "
        f"{1e3 * t['step_s_without']:.1f} ms without, {1e3 * t['step_s_with']:.1f} ms with a save() every step "
        f"(last repetition: {t['saves_started_last_rep']} saves started, {t['saves_skipped_last_rep']} skipped by the "
        f"'skip' policy because the disk was still writing; trainer held median {t['held_ms_median']:.1f} ms).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/aiotensor-bench-gpu")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--big", action="store_true", help="a 10 GB state instead of 1.4 GB")
    p.add_argument("--small", action="store_true", help="a tiny state and model, to check the script quickly")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run on a GPU machine, or check the script with --device cpu --small")
    res = asyncio.run(run(a))
    text = report(res)
    print(text)
    if not a.small:
        write_results(a.out, "gpu-10gb" if a.big else "gpu", text, res)


if __name__ == "__main__":
    main()
