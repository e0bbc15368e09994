"""Checkpoints and weights on object storage (issue 27), against one SeaweedFS on loopback, same run.

Every repetition measures, in this order (rotating would not change what shares the 2 cores):

- **client**: a 256 MiB object PUT and GET by obstore (the client aiotensor uses) and by
  aiobotocore through s3fs (what DCP's ``FsspecWriter`` uses);
- **save**: a durable save of the state (``--gb``, the transformer of ``bench_cpu``) by
  ``TensorStore("s3://...")`` (to ``await handle``: the manifest is in the bucket) and by DCP's
  ``FsspecWriter`` over s3fs (4 threads) and by ``torch.save`` into s3torchconnector's
  ``S3Checkpoint`` writer; **restore**: ``store.load()``, DCP's ``FsspecReader`` into
  preallocated tensors, and ``torch.load`` from s3torchconnector's reader;
- **weights**: the state as one safetensors object read into CPU memory by ``aiotensor.load_file``
  and the Run:ai streamer (``SafetensorsStreamer``, its S3 backend; each tensor cloned, as its
  buffers are reused). tensorizer 2.12 refuses an endpoint that is not HTTPS (``ValueError:
  Non-HTTPS endpoint URLs are not allowed``), so it cannot run against this server;
- **tiered**: how long a save holds the trainer (``save()`` to ``await handle.staged``) with
  ``mirror="s3://..."`` against a local save, and how long until ``handle.mirrored``.

Beside each figure: the server's CPU seconds per wall second (weed's share of the 2 cores), since
loopback S3 here is CPU-bound. Reports medians of paired ratios (aiotensor / peer, time ratios
inverted so > 1 means aiotensor is faster).

    python bench/bench_objects.py [--gb 1.4] [--reps 3] [--dir /tmp/aiotensor-bench-objects]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import psutil
import torch

from aiotensor.testing import free_ports

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
KEY, SECRET = "bench", "bench-secret"


class Server:
    """SeaweedFS on loopback with one identity; ``cpu()`` is its CPU seconds so far."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        ports = free_ports(4)
        self.url = f"http://127.0.0.1:{ports[0]}"
        cfg = os.path.join(folder, "s3.json")
        ident = {"name": KEY, "credentials": [{"accessKey": KEY, "secretKey": SECRET}], "actions": ["Admin"]}
        with open(cfg, "w") as f:
            json.dump({"identities": [ident]}, f)
        weed = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
        s3, master, volume, filer = ports
        args = [
            weed, "server", f"-dir={folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3", f"-s3.port={s3}",
            f"-s3.config={cfg}", f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
            "-volume.max=64", "-master.volumeSizeLimitMB=1024", "-s3.port.iceberg=0", "-s3.port.lance=0",
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=open(os.path.join(folder, "weed.log"), "wb"), stderr=subprocess.STDOUT)
        os.environ.update(
            AWS_ENDPOINT_URL=self.url, AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, AWS_REGION="us-east-1",
            AWS_ALLOW_HTTP="true", AWS_EC2_METADATA_DISABLED="true", RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
        )  # fmt: skip
        import botocore.session

        client = botocore.session.get_session().create_client("s3", endpoint_url=self.url, region_name="us-east-1")
        deadline = time.monotonic() + 60
        while True:
            try:
                client.create_bucket(Bucket="bench")
                break
            except Exception as e:
                if "BucketAlready" in str(e):
                    break
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self.ps = psutil.Process(self.proc.pid)

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system + t.children_user + t.children_system

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def timed(server: Server, fn: Callable[[], Any]) -> tuple[float, float]:
    """(seconds, the server's CPU seconds per wall second meanwhile)."""
    c0, t0 = server.cpu(), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    return wall, (server.cpu() - c0) / wall


def run_async(coro_fn: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: asyncio.run(coro_fn())


def one_rep(
    server: Server, state: dict[str, torch.Tensor], folder: str, rep: int, parts: set[str]
) -> dict[str, tuple[float, float]]:
    import s3fs
    from obstore.store import S3Store

    out: dict[str, tuple[float, float]] = {}
    bucket = S3Store("bench", client_options={"allow_http": True})
    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, endpoint_url=server.url)
    if "client" in parts:
        client(server, bucket, fs, rep, out)
    if "checkpoint" in parts:
        checkpoint(server, state, fs, rep, out)
    if "weights" in parts:
        weights(server, state, bucket, folder, out)
    if "tiered" in parts:
        tiered_saves(server, state, folder, rep, out)
    return out


def client(server: Server, bucket: Any, fs: Any, rep: int, out: dict[str, tuple[float, float]]) -> None:
    import obstore

    blob = os.urandom(256 << 20)

    out["client put obstore"] = timed(server, lambda: obstore.put(bucket, f"c/{rep}/o", blob, use_multipart=False))
    out["client put s3fs"] = timed(server, lambda: fs.pipe(f"bench/c/{rep}/s", blob))
    out["client get obstore"] = timed(server, lambda: obstore.get(bucket, f"c/{rep}/o").bytes())
    out["client get s3fs"] = timed(server, lambda: fs.cat(f"bench/c/{rep}/s"))
    blob = b""


def checkpoint(server: Server, state: dict[str, torch.Tensor], fs: Any, rep: int, out: dict[str, tuple[float, float]]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # DCP's own, not re-exported

    import aiotensor

    root = f"s3://bench/store{rep}"

    async def save() -> None:
        async with aiotensor.TensorStore(root) as store:
            await store.save(1, state)

    out["save aiotensor"] = timed(server, run_async(save))
    out["save dcp-fsspec"] = timed(
        server, lambda: dcp.save(state, storage_writer=FsspecWriter(f"s3://bench/dcp{rep}", thread_count=4))
    )

    from s3torchconnector import S3Checkpoint, S3ClientConfig

    ck = S3Checkpoint(region="us-east-1", endpoint=server.url, s3client_config=S3ClientConfig(force_path_style=True))

    def s3torch_save() -> None:
        with ck.writer(f"s3://bench/s3torch{rep}.pt") as w:
            torch.save(state, w)

    out["save s3torchconnector"] = timed(server, s3torch_save)

    async def restore() -> None:
        async with aiotensor.TensorStore(root, readonly=True) as store:
            await store.load()

    out["restore aiotensor"] = timed(server, run_async(restore))
    into = {k: torch.empty_like(v) for k, v in state.items()}
    out["restore dcp-fsspec"] = timed(server, lambda: dcp.load(into, storage_reader=FsspecReader(f"s3://bench/dcp{rep}")))
    into = {}

    def s3torch_load() -> None:
        with ck.reader(f"s3://bench/s3torch{rep}.pt") as r:
            torch.load(r, weights_only=True)

    out["restore s3torchconnector"] = timed(server, s3torch_load)
    fs.rm(f"bench/dcp{rep}", recursive=True)


def weights(
    server: Server, state: dict[str, torch.Tensor], bucket: Any, folder: str, out: dict[str, tuple[float, float]]
) -> None:
    import obstore
    from safetensors.torch import save_file as st_save

    import aiotensor

    local = os.path.join(folder, "w.safetensors")
    if not os.path.exists(local):
        st_save(state, local)
        with open(local, "rb") as f:
            obstore.put(bucket, "w.safetensors", f.read(), use_multipart=False)

    out["weights aiotensor"] = timed(server, run_async(lambda: aiotensor.load_file("s3://bench/w.safetensors")))

    def runai() -> None:
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as s:
            s.stream_file("s3://bench/w.safetensors")
            for _, t in s.get_tensors():
                t.clone()  # its buffers are reused: a user keeps a copy

    out["weights runai"] = timed(server, runai)


def tiered_saves(
    server: Server, state: dict[str, torch.Tensor], folder: str, rep: int, out: dict[str, tuple[float, float]]
) -> None:
    import aiotensor

    async def tiered(mirror: bool) -> dict[str, float]:
        """Held times of a save with nothing in flight, and of the next save while the first one's
        upload runs (a loopback server on the same cores: its CPU competes with the staging copy)."""
        path = tempfile.mkdtemp(dir=folder)
        kw: dict[str, Any] = {"mirror": f"s3://bench/tier{rep}-{int(mirror)}"} if mirror else {}
        got: dict[str, float] = {}
        async with aiotensor.TensorStore(path, keep_last=1, **kw) as store:
            h = store.save(0, state)  # the staging arena is mapped by the first save
            await h.mirrored
            for step, what in ((1, "quiet"), (2, "busy")):
                t0 = time.perf_counter()
                h = store.save(step, state)
                await h.staged
                got[what] = time.perf_counter() - t0
                await h
            t0 = time.perf_counter()
            await h.mirrored
            got["upload"] = time.perf_counter() - t0
        shutil.rmtree(path)
        return got

    local = asyncio.run(tiered(False))
    c0, t0 = server.cpu(), time.perf_counter()
    mirrored = asyncio.run(tiered(True))
    share = (server.cpu() - c0) / (time.perf_counter() - t0)
    for what in ("quiet", "busy"):
        out[f"tiered held {what} local"] = (local[what], 0.0)
        out[f"tiered held {what} mirrored"] = (mirrored[what], share)


PAIRS = [  # (aiotensor, peer): the peer's time / ours
    ("client put obstore", "client put s3fs"),
    ("client get obstore", "client get s3fs"),
    ("save aiotensor", "save dcp-fsspec"),
    ("restore aiotensor", "restore dcp-fsspec"),
    ("save aiotensor", "save s3torchconnector"),
    ("restore aiotensor", "restore s3torchconnector"),
    ("weights aiotensor", "weights runai"),
    # here the ratio is mirrored / local held: target <= 1.05
    ("tiered held quiet local", "tiered held quiet mirrored"),
    ("tiered held busy local", "tiered held busy mirrored"),
]


def main() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # DCP's deprecation notes, once per call
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/aiotensor-bench-objects")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "objects"))
    ap.add_argument("--parts", default="client,checkpoint,weights,tiered", help="which measurements (comma-separated)")
    a = ap.parse_args()
    from bench_cpu import transformer_state

    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(os.path.join(a.dir, "weed"))
    state = transformer_state(layers=max(1, round(24 * a.gb / 1.4)))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    server = Server(os.path.join(a.dir, "weed"))
    reps: list[dict[str, tuple[float, float]]] = []
    try:
        for rep in range(a.reps):
            r = one_rep(server, state, a.dir, rep, set(a.parts.split(",")))
            reps.append(r)
            print(f"rep {rep}: " + ", ".join(f"{k} {v[0]:.2f}s ({v[1]:.2f} cpu)" for k, v in r.items()), flush=True)
    finally:
        server.stop()
    rows = {k: (statistics.median(r[k][0] for r in reps), statistics.median(r[k][1] for r in reps)) for k in reps[0]}
    ratios = {f"{o} / {p}": statistics.median(r[o][0] / r[p][0] for r in reps) for p, o in PAIRS if p in rows and o in rows}
    res = {
        "machine": f"{platform.node()} {os.cpu_count()} cores, torch {torch.__version__}",
        "bytes": nbytes,
        "reps": a.reps,
        "median_s_and_server_cpu": rows,
        "speedup_median_of_paired": ratios,
        "raw": reps,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    lines = [
        "# Object storage (issue 27): `python bench/bench_objects.py`",
        "",
        f"{res['machine']}; state {nbytes / 1e9:.2f} GB; {a.reps} repetitions; one SeaweedFS on loopback (same 2 cores).",
        "",
        "| operation | median s | GB/s | server CPU (cores) |",
        "|---|---|---|---|",
    ]
    for k, (s, cpu) in rows.items():
        size = (256 << 20) if k.startswith("client") else nbytes
        lines.append(f"| {k} | {s:.2f} | {size / s / 1e9:.2f} | {cpu:.2f} |")
    lines += ["", "| peer time / aiotensor time (median of paired ratios; > 1: aiotensor faster) | ratio |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in ratios.items()]
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
