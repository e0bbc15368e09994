"""The ``aiotensor`` command: list, inspect, verify and convert checkpoints and weight files.

A thin layer over the public API; every command is read-only except ``convert`` (which writes its
output atomically). Exit codes: 0 success, 1 a check failed (``verify``) or the input is bad, 2
usage errors.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import torch

from . import commit, errors, serving, sources
from . import root as _root
from ._runtime.scheduler import Scheduler, own_scheduler
from .commit import Publication
from .files import read_header, save_file, tensor_info, write_safetensors
from .formats import torchsave as ts
from .serving import save_torch
from .store import TensorStore

EXAMPLES = """examples:
  aiotensor ls ckpts/                        committed steps, and what else is in the folder
  aiotensor inspect ckpts/                   the newest step's tensors (dtype, shape, bytes)
  aiotensor inspect model.safetensors --json
  aiotensor verify ckpts/                    re-read every step and check every crc32c
  aiotensor convert model.pt model.safetensors
  aiotensor convert ckpts/ hf-out/ --shard-size 2GB   Hugging Face shards with an index
  aiotensor bench --dir /mnt/nvme --size 2GB  disk limit, memcpy, aiotensor vs peers; report + plot

PATH may be a store root, a step folder, a safetensors file, a Hugging Face folder, a torch.save
zip (.pt/.bin, read without unrestricted pickle) or a DCP checkpoint (aiotensor's, or DCP's own
FileSystemWriter folder, whose .metadata pickle is read with an allow-list)."""


def _size(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in units else ""
    try:
        return int(float(t[: len(t) - len(unit)]) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GB, 512M)") from None


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


class Progress:
    """Bytes and throughput on stderr when it is a terminal; silent otherwise."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.done = what, total, 0
        self.tty = sys.stderr.isatty()
        self.t0 = self.last = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.tty and (now - self.last > 0.1 or self.done >= self.total):
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            pct = 100 * self.done / self.total if self.total else 100
            sys.stderr.write(f"\r{self.what}: {_human(self.done)} / {_human(self.total)} ({pct:.0f}%), {_human(rate)}/s ")
            sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


# --- what a path is --------------------------------------------------------------------------------


def _kind(path: str) -> str:
    """``root``, ``step``, ``hf`` (a folder of weight files), ``safetensors`` or ``torch``."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, _root.MANIFEST)):
            return "step"
        if _dcp().is_checkpoint(path):
            return "dcp"
        names = os.listdir(path)
        if any(_root.parse_step(n) is not None for n in names) or _root.LATEST in names or _root.LOCK in names:
            return "root"
        return "hf"
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or folder")
    with open(path, "rb") as f:
        return "torch" if ts.is_torch_zip(f.read(4)) else "safetensors"


def _dcp() -> Any:
    from . import dcp  # imports torch.distributed: only when a DCP checkpoint is involved

    return dcp


def _infos(path: str, kind: str, sched: Scheduler) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensor name -> info dict, extra facts) from headers and manifests only."""
    if kind == "dcp":
        meta = _dcp().reader_for(path).read_metadata()
        tensors = {}
        for fqn, m in meta.state_dict_metadata.items():
            if hasattr(m, "size"):
                dtype = m.properties.dtype
                nbytes = torch.Size(m.size).numel() * dtype.itemsize
                tensors[fqn] = {"dtype": str(dtype).removeprefix("torch."), "shape": list(m.size), "bytes": nbytes}
        return tensors, {"chunks": sum(len(getattr(m, "chunks", [])) for m in meta.state_dict_metadata.values())}
    if kind in ("root", "step"):
        folder = path if kind == "step" else sources.newest_step(sched, path)
        m = _root.read_manifest(sched.engine, folder)
        specs = {k: e.spec for k, e in m.entries.items()} | {a: m.entries[t].spec for a, t in m.aliases.items()}
        tensors = {k: _row(tensor_info(s)) for k, s in specs.items()}
        return tensors, {"step": m.step, "folder": folder, "aliases": dict(m.aliases), "shards": len(m.shards)}
    if kind == "torch":
        tensors = {}

        def add(name: str, ref: ts.TensorRef) -> None:
            tensors[name] = {"dtype": str(ref.dtype).removeprefix("torch."), "shape": list(ref.size), "bytes": ref.nbytes}

        ts.map_tensors(ts.parse_path(os.path.realpath(path)), add)
        return tensors, {}
    files = sources.hf_files(sched.engine, path) if kind == "hf" else [path]
    tensors, meta = {}, {}
    for f in files:
        info = anyio.run(read_header, f)
        tensors |= {k: _row(t) for k, t in info.tensors.items()}
        meta[os.path.basename(f)] = {"metadata": info.metadata, "checksummed": info.checksummed}
    return tensors, {"files": meta}


def _row(t: Any) -> dict[str, Any]:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "bytes": t.nbytes}


# --- commands --------------------------------------------------------------------------------------


async def _tensors(src: str, kind: str) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``src`` with its dotted name: streamed, or for a DCP checkpoint (sharded:
    it must be assembled) loaded whole in a worker thread."""
    if kind == "dcp":
        state = await anyio.to_thread.run_sync(_dcp().load_full, src)
        for name, t in _flat(state, ""):
            yield name, t
        return
    async with serving.stream(src, window_bytes=64 << 20) as s:
        async for name, t in s:
            yield name, t


def _flat(tree: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        return [(prefix, tree)]
    if isinstance(tree, dict):
        return [x for k, v in tree.items() for x in _flat(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(tree, (list, tuple)):
        return [x for i, v in enumerate(tree) for x in _flat(v, f"{prefix}.{i}" if prefix else str(i))]
    return []


def cmd_ls(a: argparse.Namespace) -> int:
    sched = Scheduler()
    listing = _root.scan(sched.engine, a.root, {})
    rows: list[dict[str, Any]] = []
    for step, name in sorted(listing.committed.items()):
        folder = os.path.join(a.root, name)
        m = _root.read_manifest(sched.engine, folder, step)
        mtime = os.stat(os.path.join(folder, _root.MANIFEST)).st_mtime
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime))
        count = len(m.entries) + len(m.aliases)
        rows.append({"step": step, "time": when, "bytes": sum(m.shards.values()), "tensors": count, "state": "committed"})
    rows += [{"name": n, "state": "in progress or left by a crash"} for n in sorted(listing.leftovers)]
    rows += [{"name": n, "state": f"ignored: {why}"} for n, why in sorted(listing.ignored.items())]
    if a.json:
        print(json.dumps({"root": a.root, "latest": listing.latest, "entries": rows}, indent=1))
        return 0
    print(f"{a.root}  (latest: {listing.latest or '-'})")
    for r in rows:
        if r["state"] == "committed":
            print(f"  step {r['step']:>12}  {r['time']}  {_human(r['bytes']):>10}  {r['tensors']:>6} tensors")
        else:
            print(f"  {r['name']}  [{r['state']}]")
    if not listing.committed:
        print("  no committed step")
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    kind = _kind(a.path)
    tensors, extra = _infos(a.path, kind, Scheduler())
    total = sum(t["bytes"] for t in tensors.values())
    if a.json:
        print(json.dumps({"path": a.path, "kind": kind, "tensors": tensors, "total_bytes": total, **extra}, indent=1))
        return 0
    print(f"{a.path}: {kind}, {len(tensors)} tensors, {_human(total)}" + (f", step {extra['step']}" if "step" in extra else ""))
    width = max((len(k) for k in tensors), default=0)
    for name, t in tensors.items():
        print(f"  {name:<{width}}  {t['dtype']:<16} {t['shape']!s:<20} {_human(t['bytes']):>10}")
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    kind = _kind(a.path)
    sched = Scheduler()
    if kind == "root":
        listing = _root.scan(sched.engine, a.path, {})
        sources = [os.path.join(a.path, n) for _, n in sorted(listing.committed.items())]
        bad = [f"{n}: {why}" for n, why in listing.ignored.items() if "not a valid checkpoint" in why]
    else:
        sources, bad = [a.path], []
    for src in sources:
        total = sum(t["bytes"] for t in _infos(src, _kind(src), sched)[0].values())
        progress = Progress(f"verifying {src}", total)
        try:

            async def run(source: str = src, bar: Progress = progress) -> None:
                async for _name, t in _tensors(source, _kind(source)):
                    bar.add(t.nbytes)

            anyio.run(run)
        except (errors.FormatError, OSError) as e:
            bad.append(f"{type(e).__name__}: {e}")
        finally:
            progress.close()
    for line in bad:
        print(f"BAD  {line}")
    if not bad:
        print(f"OK   {a.path}: {len(sources)} checked, every tensor intact" + (" (crc32c)" if kind in ("root", "step") else ""))
    return 1 if bad else 0


def cmd_convert(a: argparse.Namespace) -> int:
    progress = Progress(f"converting {a.src}", 0)
    try:
        what = anyio.run(lambda: convert(a.src, a.dst, to=a.to, shard_size=a.shard_size, step=a.step, progress=progress))
    finally:
        progress.close()
    print(f"wrote {a.dst} ({what})")
    return 0


async def convert(
    src: str,
    dst: str,
    *,
    to: str | None = None,
    shard_size: int = 4 << 30,
    step: int | None = None,
    scheduler: Scheduler | None = None,
    progress: Progress | None = None,
) -> str:
    """Convert ``src`` (any readable path) to ``dst``: ``to`` is ``"safetensors"`` (one file, or a
    folder of shards of at most ``shard_size`` with an index), ``"checkpoint"`` (a store root) or
    ``"torch"`` (default: from ``dst``'s name). Safetensors output streams (memory: one shard and
    the read window); checkpoint and torch.save output hold the whole state. Every output is
    published whole (:mod:`aiotensor.commit`), through ``scheduler``'s engine. Returns what it wrote."""
    kind = await anyio.to_thread.run_sync(_kind, src)
    to = to or ("torch" if dst.endswith((".pt", ".bin")) else "checkpoint" if step is not None else "safetensors")
    tensors, _ = await anyio.to_thread.run_sync(_infos, src, kind, Scheduler())
    total = sum(t["bytes"] for t in tensors.values())
    progress = progress or Progress("", total)
    progress.total = total
    sharded = to == "safetensors" and total > shard_size
    if sharded and await anyio.to_thread.run_sync(os.path.lexists, dst):
        raise FileExistsError(f"{dst} exists: the sharded output is a new folder")
    dst = os.path.abspath(dst)  # noqa: ASYNC240 - getcwd, no disk access
    async with own_scheduler(scheduler) as sched:
        if not sharded:
            state = {name: t async for name, t in _counted(_tensors(src, kind), progress)}
            if to == "checkpoint":
                async with TensorStore(dst, engine=sched.engine) as store:
                    await store.save(step or 0, state)
            elif to == "torch":
                await save_torch(state, dst, scheduler=sched)
            else:
                await save_file(state, dst, scheduler=sched)
            return f"{to}, {len(tensors)} tensors"
        async with Publication(sched, dst, folder=True, tmp=commit.hidden_temp(dst)) as pub:  # whole, or not at all
            parts: list[list[str]] = []
            part: dict[str, torch.Tensor] = {}
            size = 0
            async for name, t in _counted(_tensors(src, kind), progress):
                if part and size + t.nbytes > shard_size:
                    parts.append(await _write_part(sched, pub.tmp, len(parts), part))
                    part, size = {}, 0
                part[name] = t
                size += t.nbytes
            parts.append(await _write_part(sched, pub.tmp, len(parts), part))
            weight_map: dict[str, str] = {}
            for i, names in enumerate(parts, 1):
                final = os.path.join(pub.tmp, f"model-{i:05d}-of-{len(parts):05d}.safetensors")
                await sched.call(sched.engine.rename, os.path.join(pub.tmp, f"part-{i - 1:05d}"), final)
                weight_map |= dict.fromkeys(names, os.path.basename(final))
            index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode()
            await sched.call(commit.write_small, sched.engine, os.path.join(pub.tmp, sources.INDEX), index)
            await pub.publish()
    return f"{to}, sharded, {len(tensors)} tensors"


async def _counted(
    tensors: AsyncIterator[tuple[str, torch.Tensor]], progress: Progress
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    async for name, t in tensors:
        progress.add(t.nbytes)
        yield name, t


async def _write_part(sched: Scheduler, folder: str, i: int, part: dict[str, torch.Tensor]) -> list[str]:
    """One shard of a sharded output, durably, under a temporary name inside the folder being published."""
    await write_safetensors(sched, os.path.join(folder, f"part-{i:05d}"), part, {"format": "pt"})
    return list(part)


def cmd_bench(a: argparse.Namespace) -> int:
    from . import _bench

    folder = os.path.join(a.dir, f"aiotensor-bench-{os.getpid()}")
    res = anyio.run(_bench.run, folder, a.size, a.reps, lambda line: print(line, file=sys.stderr))
    png = os.path.splitext(a.out)[0] + ".png"
    if not _bench.plot(res, png):
        png = None
    text = _bench.markdown(res, png)
    with open(a.out, "w") as f:
        f.write(text)
    print(text)
    print(f"report: {a.out}" + (f", plot: {png}" if png else ""))
    return 0


def parser() -> argparse.ArgumentParser:
    desc = "List, inspect, verify and convert checkpoints and weight files."
    p = argparse.ArgumentParser(prog="aiotensor", description=desc, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("-v", "--verbose", action="store_true", help="log what the library does (logger 'aiotensor') to stderr")
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser(
        "ls",
        help="committed steps of a store root, and what else is in it (read-only)",
        epilog="example: aiotensor ls ckpts/ --json",
    )
    ls.add_argument("root")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(fn=cmd_ls)
    ins = sub.add_parser("inspect", help="tensors (name, dtype, shape, bytes) from headers only",
                         epilog="example: aiotensor inspect model.safetensors --json")  # fmt: skip
    ins.add_argument("path")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.set_defaults(fn=cmd_inspect)
    ver = sub.add_parser("verify", help="re-read everything and check structure and every checksum (exit 1 if bad)",
                         epilog="example: aiotensor verify ckpts/ && python train.py --resume")  # fmt: skip
    ver.add_argument("path")
    ver.set_defaults(fn=cmd_verify)
    conv = sub.add_parser("convert", help="any readable format to safetensors (sharded + index), a checkpoint or torch.save",
                          epilog="examples:\n  aiotensor convert model.pt model.safetensors\n"
                                 "  aiotensor convert hf-folder/ ckpts/ --to checkpoint --step 0",
                          formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--to", choices=["safetensors", "checkpoint", "torch"], help="output format (default: from DST)")
    conv.add_argument("--shard-size", type=_size, default=_size("4GB"), help="largest safetensors shard (default 4GB)")
    conv.add_argument("--step", type=int, help="the step, for --to checkpoint (default 0)")
    conv.set_defaults(fn=cmd_convert)
    bench = sub.add_parser("bench", help="this machine's disk and memcpy, then aiotensor vs torch.save, safetensors and DCP",
                           epilog="example: aiotensor bench --dir /mnt/nvme --size 2GB --out bench.md")  # fmt: skip
    bench.add_argument("--dir", default="/tmp", help="where to write (the disk to measure)")
    bench.add_argument("--size", type=_size, default=_size("512MB"), help="state size (default 512MB)")
    bench.add_argument("--reps", type=int, default=2, help="repetitions (medians)")
    bench.add_argument("--out", default="aiotensor-bench.md", help="the Markdown report (a PNG plot beside it)")
    bench.set_defaults(fn=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        return int(a.fn(a))
    except (errors.AiotensorError, OSError) as e:
        print(f"aiotensor {a.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
