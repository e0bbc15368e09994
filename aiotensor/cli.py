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

from . import commit, errors, knobs, serving, sources
from . import root as _root
from ._runtime.scheduler import Scheduler, own_scheduler
from .commit import Publication
from .engines import Engine, default_engine
from .errors import CheckpointNotFoundError, annotate_oserror
from .files import save_file, write_safetensors
from .formats import tree
from .formats.dcp_metadata import JSON_NAME, PICKLE_NAME
from .location import absolute, engine_for, is_folder, local_path
from .serving import save_torch
from .store import TensorStore
from .store.steps import check_step

DCP_NAMES = (JSON_NAME, PICKLE_NAME)

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
        n = int(float(t[: len(t) - len(unit)]) * units[unit])
    except (ValueError, OverflowError):  # (inf)
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (a positive size, e.g. 2GB, 512M)")
    return n


def _path(text: str, objects: bool = False) -> str:
    try:
        return local_path(text, objects=objects)
    except errors.UnsupportedLocationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _where(text: str) -> str:
    """A path to read: local, or ``s3://``."""
    return _path(text, objects=True)


def _engine(path: str) -> Engine:
    return engine_for(path) or default_engine()


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


# --- what a path is: the library's one resolver ------------------------------------------------


def _resolve(path: str) -> sources.Source:
    """What ``path`` is and holds (blocking: the command runs no event loop while it asks)."""
    return sources.resolve(_engine(path), path)


def _row(e: sources.Entry) -> dict[str, Any]:
    return {"dtype": str(e.dtype).removeprefix("torch."), "shape": list(e.shape), "bytes": e.nbytes}


def _tensors(src: str, window: int = 64 << 20) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``src`` under each of its names, as the library streams it (a DCP
    checkpoint's whole tensors, assembled from their chunks)."""

    async def gen() -> AsyncIterator[tuple[str, torch.Tensor]]:
        async with serving.stream(src, window_bytes=window) as s:
            async for name, t in s:
                yield name, t

    return gen()


_TENSOR = torch.empty(0, device="meta")  # a tensor: a torch.save file's Parameter wraps it (an object() failed there)


def _values(src: sources.Source) -> list[str]:
    """The places of the non-tensor values of ``src``'s state (what a flat tensor file drops); each
    shared container counted once."""
    if src.state is None:
        return []
    found: list[str] = []
    seen: set[int] = set()

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor) and obj.is_meta:  # _TENSOR, or a Parameter of it (a tensor of a DCP
            return  # checkpoint's pickled value is a value safetensors drops)
        if isinstance(obj, (dict, list, tuple)):
            if id(obj) in seen:
                return
            seen.add(id(obj))
            for k, v in obj.items() if isinstance(obj, dict) else enumerate(obj):
                walk(v, f"{path}.{k}" if path else str(k))
        else:
            found.append(path or "<root>")

    walk(src.state(lambda name: _TENSOR), "")
    return found


# --- commands --------------------------------------------------------------------------------------


def cmd_ls(a: argparse.Namespace) -> int:
    engine = _engine(a.root)
    try:
        names = engine.listdir(a.root)
    except OSError as e:  # (an object store's answer names its request, not the URL: helper-74)
        raise annotate_oserror(e, f"listing {a.root}", unless_named=True) from None
    if not _root.is_store(names):
        raise CheckpointNotFoundError(
            f"{a.root}: not a store root (no committed step, latest or lock; `aiotensor inspect` reads other folders)"
        )
    listing = _root.scan(engine, a.root, {})
    rows: list[dict[str, Any]] = []
    damaged = 0
    for step, name in sorted(listing.committed.items()):
        try:
            src = sources.step(engine, os.path.join(a.root, name), step)
            mtime = engine.stat(src.files[0] if src.files else src.path).st_mtime
            written, linked = _shard_bytes(engine, src.path) or (src.stored_bytes, 0)
        except (errors.AiotensorError, OSError) as e:  # one bad step: listed as such, the others too (helper-60)
            if isinstance(e, FileNotFoundError) and not commit.has_records(engine, os.path.join(a.root, name)):
                continue  # retired by its writer since the scan
            damaged += 1
            rows.append({"step": step, "name": name, "state": f"damaged: {type(e).__name__}: {e}"})
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime))
        count = sum(len(e.names) for e in src.entries)
        rows.append(
            {
                "step": step,
                "time": when,
                "bytes": src.stored_bytes,
                "written": written,
                "reused": linked,
                "tensors": count,
                "state": "committed",
            }
        )
    rows += [{"name": n, "state": "in progress or left by a crash"} for n in sorted(listing.leftovers)]
    rows += [{"name": n, "state": f"ignored: {why}"} for n, why in sorted(listing.ignored.items())]
    if a.json:
        print(json.dumps({"root": a.root, "latest": listing.latest, "entries": rows}, indent=1))
        return BAD if damaged else 0
    print(f"{a.root}  (latest: {listing.latest or '-'})")
    for r in rows:
        if r["state"] == "committed":
            reused = f"  (written {_human(r['written'])}, reused {_human(r['reused'])})" if r["reused"] else ""
            print(f"  step {r['step']:>12}  {r['time']}  {_human(r['bytes']):>10}  {r['tensors']:>6} tensors{reused}")
        else:
            print(f"  {r['name']}  [{r['state']}]")
    if not listing.committed:
        print("  no committed step")
    return BAD if damaged else 0


def _shard_bytes(engine: Engine, folder: str) -> tuple[int, int] | None:
    """The bytes of a step's shard files written for it and those that are an earlier step's files
    (incremental saves), as its save's ``handle.bytes_written`` and ``bytes_reused`` counted them;
    None for a DCP step (no manifest: nothing reused)."""
    if not engine.exists(os.path.join(folder, _root.MANIFEST)):
        return None
    m = _root.read_manifest(engine, folder)
    reused = sum(size for shard, size in m.shards.items() if shard in m.reused)
    return sum(m.shards.values()) - reused, reused


def cmd_inspect(a: argparse.Namespace) -> int:
    src = _resolve(a.path)
    tensors: dict[str, dict[str, Any]] = {}
    for e in src.entries:
        row = _row(e)
        tensors[e.names[0]] = row
        for alias in e.names[1:]:
            tensors[alias] = {**row, "tied_to": e.names[0]}
    total = src.stored_bytes  # a storage several tensors share counted once
    extra: dict[str, Any] = {"files": len(src.files), "checksummed": src.checksummed}
    if src.step is not None:
        extra |= {"step": src.step, "folder": src.path}
    if src.metadata:
        extra["metadata"] = {os.path.basename(f): m for f, m in src.metadata.items()}
    values = _values(src)
    if values:
        extra["values"] = values[:1000]
    if a.json:
        print(json.dumps({"path": a.path, "kind": src.kind, "tensors": tensors, "total_bytes": total, **extra}, indent=1))
        return 0
    head = f"{a.path}: {src.kind}, {len(tensors)} tensors, {_human(total)}" + (
        f", step {src.step}" if src.step is not None else ""
    )
    print(head + (f", {_count(len(values), 'other value')}" if values else ""))
    width = max((len(k) for k in tensors), default=0)
    for name, t in tensors.items():
        tied = f"  (= {t['tied_to']})" if "tied_to" in t else ""
        print(f"  {name:<{width}}  {t['dtype']:<16} {t['shape']!s:<20} {_human(t['bytes']):>10}{tied}")
    return 0


VERIFIED, BAD, UNVERIFIABLE = 0, 1, 3


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _store_root(engine: Engine, path: str) -> bool:
    """Is ``path`` a store root (not one of its steps, nor a checkpoint folder of its own)?"""
    names = engine.listdir(path) if is_folder(engine, path) else []
    return bool(names) and _root.is_store(names) and not {_root.MANIFEST, *DCP_NAMES} & set(names)


def cmd_verify(a: argparse.Namespace) -> int:
    """Read every tensor of every file; exit 0 if every byte was checked against a checksum its
    writer recorded, 3 if everything read whole but some files carry no checksums (structure only:
    a changed value cannot be seen), 1 if anything is bad."""
    bad: list[str] = []
    checked: list[sources.Source] = []
    gone: list[str] = []  # steps a writer retired while they were verified
    engine = _engine(a.path)
    root = _store_root(engine, a.path)
    if root:
        listing = _root.scan(engine, a.path, {})
        paths = [os.path.join(a.path, n) for _, n in sorted(listing.committed.items())]
        # a folder named as a step that is none (no valid manifest, cannot be read): `latest` may name
        # it; one retired while it was listed is gone
        for n, why in sorted(listing.ignored.items()):
            if _root.parse_step(n) is not None and why != _root.DCP_OWN:
                (bad.append(f"{n}: {why}") if engine.exists(os.path.join(a.path, n)) else gone.append(n))
    else:
        paths = [a.path]
    for path in paths:
        try:
            src = _resolve(path)
            progress = Progress(f"verifying {path}", src.stored_bytes)

            async def run(source: str = src.path, bar: Progress = progress) -> None:
                async for _name, t in _tensors(source):
                    bar.add(t.untyped_storage().nbytes() if not t.is_contiguous() else t.nbytes)

            try:
                anyio.run(run)
            finally:
                progress.close()
            checked.append(src)
        except (errors.AiotensorError, OSError) as e:
            if root and isinstance(e, FileNotFoundError) and not commit.has_records(engine, path):
                gone.append(os.path.basename(path))  # retention of a store being trained, not a fault
                continue
            bad.append(f"{type(e).__name__}: {e}")
    for line in bad:
        print(f"BAD  {line}")
    if bad:
        print(f"BAD  {a.path}: {_count(len(bad), 'problem')}; {len(checked)} of {_count(len(paths), 'source')} read whole")
        return BAD
    retired = f" ({_count(len(gone), 'step')} retired by its writer meanwhile: {', '.join(gone[:5])})" if gone else ""
    if not checked:
        print(f"NONE {a.path}: nothing to verify, no committed step{retired}")
        return UNVERIFIABLE
    files = sum(len(s.files) for s in checked)
    count = sum(len(e.names) for s in checked for e in s.entries)
    kind = "steps" if len(checked) > 1 else "step" if root else "source"
    what = f"{a.path}: {len(checked)} {kind}{retired}, {files} files, {count} tensors read whole"
    plain = [f for s in checked if not s.checksummed for f in s.files]
    if plain:
        shown = ", ".join(os.path.basename(f) for f in plain[:5]) + (" ..." if len(plain) > 5 else "")
        print(f"READ {what}; NOT VERIFIED: {shown} carry no checksums (structure only: a changed value cannot be seen)")
        return UNVERIFIABLE
    print(f"OK   {what}, every byte checked against the checksum its writer recorded")
    return VERIFIED


def cmd_convert(a: argparse.Namespace) -> int:
    progress = Progress(f"converting {a.src}", 0)
    try:
        what = anyio.run(
            lambda: convert(a.src, a.dst, to=a.to, shard_size=a.shard_size, step=a.step, overwrite=a.overwrite, progress=progress)
        )
    finally:
        progress.close()
    print(f"wrote {a.dst} ({what})")
    return 0


async def convert(
    src: str,
    dst: str,
    *,
    to: str | None = None,
    shard_size: int = knobs.SHARD_BYTES,
    step: int | None = None,
    overwrite: bool = False,
    scheduler: Scheduler | None = None,
    progress: Progress | None = None,
) -> str:
    """Convert ``src`` (any path :func:`aiotensor.sources.resolve` reads) to ``dst``; returns what
    it wrote.

    ``step``: where ``src`` is a store root, the step read (default: its newest), kept as the
    output's step; otherwise the step a checkpoint output is saved as (default 0).
    ``to``: ``"checkpoint"`` (a store root: the whole state, values and nesting kept, as the
    source's step), ``"torch"`` (a torch.save file: the same) or ``"safetensors"`` (tensors only,
    by their dotted names; what it cannot hold is named in the result). Default: from ``dst``
    (``.pt``/``.bin``: torch; ``.safetensors``: safetensors; else with ``step`` of a source that is
    no store root: checkpoint; else safetensors). Safetensors go to one file, or, where ``dst`` is a
    folder (ends with ``/``, exists as one, or has no ``.safetensors`` name and the tensors exceed
    ``shard_size``), to a Hugging Face folder: ``model.safetensors``, or shards of at most
    ``shard_size`` with their index. Every output is published whole (:mod:`aiotensor.commit`),
    through ``scheduler``'s engine; an existing output is refused unless ``overwrite`` (a file).

    Raises:
        FileExistsError: ``dst`` exists (a folder output must be new or empty).
        ValueError: a file name for an output that needs shards; ``shard_size`` < 1.
        What reading ``src`` raises.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be a positive number of bytes, got {shard_size}")
    root = step is not None and await anyio.to_thread.run_sync(_store_root, _engine(src), src)
    if root:  # `convert ROOT out.safetensors --step 10`: step 10 of the store (it wrote a store of the newest)
        assert step is not None
        check_step(step)
        listing = await anyio.to_thread.run_sync(_root.scan, _engine(src), src, {})
        if step not in listing.committed:
            raise errors.CheckpointNotFoundError(
                f"no committed step {step} in {src} (committed: {sorted(listing.committed)[-5:]})"
            )
        src = os.path.join(src, _root.step_dir_name(step))
    to = to or (
        "torch"
        if dst.endswith((".pt", ".bin"))
        else "safetensors"
        if dst.endswith(".safetensors") or step is None
        else "checkpoint"
    )
    if step is not None and not root and to != "checkpoint":
        raise ValueError(
            f"--step {step}: {src} is no store root to read it from, and the output is not a checkpoint to save it as"
        )
    info = await anyio.to_thread.run_sync(_resolve, src)
    total = info.stored_bytes
    progress = progress or Progress("", total)
    progress.total = total
    engine = _engine(dst)
    is_dir = await anyio.to_thread.run_sync(is_folder, engine, dst)
    folder = to == "safetensors" and (dst.endswith(os.sep) or is_dir or (total > shard_size and not dst.endswith(".safetensors")))
    if to == "safetensors" and total > shard_size and not folder:
        raise ValueError(
            f"{src} holds {_human(total)}, over the shard size {_human(shard_size)}: name a folder (DST/) for shards"
        )
    dst = absolute(dst)
    if to != "checkpoint" and await anyio.to_thread.run_sync(_taken, engine, dst, folder, overwrite):
        raise FileExistsError(f"{dst} exists" + ("" if folder else ": pass --overwrite to replace it"))
    values = _values(info)
    dropped = values if to == "safetensors" else []
    async with own_scheduler(scheduler, engine_for(dst, scheduler)) as sched:
        if folder:
            n = await _write_folder(sched, src, dst, total, shard_size, progress)
            what = f"safetensors, {n} {'shards' if n > 1 else 'file'}"
        else:
            got = {name: t async for name, t in _counted(_tensors(src), progress)}
            if to == "safetensors":
                await save_file(got, dst, scheduler=sched)
            else:
                state = info.state(got.__getitem__) if info.state is not None else got
                if to == "torch":  # (numpy scalars as Python values: torch.load(weights_only=True) refuses numpy's)
                    await save_torch(tree.python_values(state), dst, scheduler=sched)
                else:
                    async with TensorStore(dst, engine=sched.engine) as store:
                        await store.save(step if step is not None else info.step or 0, state)  # a step keeps its number
            what = to
    names = [n for e in info.entries for n in e.names]
    others = f" and {_count(len(values), 'other value')}" if to != "safetensors" and values else ""
    kept = f"{what}, {len(names)} tensors{others}"
    if dropped:
        more = " ..." if len(dropped) > 8 else ""
        kept += f"; dropped {len(dropped)} values safetensors cannot hold: {', '.join(dropped[:8])}{more}"
    if to == "safetensors" and info.state is not None and (renamed := _renamed(names)):  # (a flat file renames nothing)
        more = " ..." if len(renamed) > 8 else ""
        kept += (
            f"; {_count(len(renamed), 'tensor')} renamed, their dotted names taken by another "
            f"({{'a.b': x, 'a': {{'b': y}}}}, {{1: x, '1': y}}): {', '.join(renamed[:8])}{more}"
        )
    return kept


def _renamed(names: list[str]) -> list[str]:
    """The names a flat output gives tensors whose dotted names collide (``key#2``...: formats.tree.unique_key)."""
    have = set(names)
    return [n for n in names if (cut := n.rpartition("#"))[1] and cut[2].isdigit() and cut[0] in have]


def _taken(engine: Engine, dst: str, folder: bool, overwrite: bool) -> bool:
    if not engine.exists(dst):
        return False
    if not engine.renames:  # an object, or a prefix with objects under it
        return folder or not overwrite or is_folder(engine, dst)
    if folder:
        return not os.path.isdir(dst) or os.path.islink(dst) or bool(os.listdir(dst))
    return not overwrite or os.path.isdir(dst)


async def _write_folder(sched: Scheduler, src: str, dst: str, total: int, shard_size: int, progress: Progress) -> int:
    """A Hugging Face folder of safetensors (see :func:`convert`), published whole; memory: one
    shard and the read window. Returns the number of files."""
    # an empty folder there is replaced (a rename onto an empty folder), as DCP's writer allows
    async with Publication(sched, dst, folder=True, tmp=commit.hidden_temp(dst)) as pub:
        parts: list[list[str]] = []
        part: dict[str, torch.Tensor] = {}
        size = 0
        async for name, t in _counted(_tensors(src), progress):
            if part and size + t.nbytes > shard_size:
                parts.append(await _write_part(sched, pub.tmp, len(parts), part))
                part, size = {}, 0
            part[name] = t
            size += t.nbytes
        parts.append(await _write_part(sched, pub.tmp, len(parts), part))
        if len(parts) == 1:
            await sched.call(sched.engine.rename, os.path.join(pub.tmp, "part-00000"), os.path.join(pub.tmp, sources.SINGLE))
        else:
            weight_map: dict[str, str] = {}
            for i, names in enumerate(parts, 1):
                final = os.path.join(pub.tmp, f"model-{i:05d}-of-{len(parts):05d}.safetensors")
                await sched.call(sched.engine.rename, os.path.join(pub.tmp, f"part-{i - 1:05d}"), final)
                weight_map |= dict.fromkeys(names, os.path.basename(final))
            index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode()
            await sched.call(commit.write_small, sched.engine, os.path.join(pub.tmp, sources.INDEX), index)
        await pub.publish()
    return len(parts)


async def _counted(
    tensors: AsyncIterator[tuple[str, torch.Tensor]], progress: Progress
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    async for name, t in tensors:
        progress.add(t.nbytes)
        yield name, t


async def _write_part(sched: Scheduler, folder: str, i: int, part: dict[str, torch.Tensor]) -> list[str]:
    """One shard of a folder output, durably, under a temporary name inside the folder being published."""
    await write_safetensors(sched, os.path.join(folder, f"part-{i:05d}"), part)
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
    verbose = "log what the library does (logger 'aiotensor') to stderr"
    p.add_argument("-v", "--verbose", action="store_true", help=verbose)
    common = argparse.ArgumentParser(add_help=False)  # -v after the command too (`aiotensor ls -v ckpts/`)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose)
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser(
        "ls",
        parents=[common],
        help="committed steps of a store root, and what else is in it (read-only)",
        epilog="example: aiotensor ls ckpts/ --json",
    )
    ls.add_argument("root", type=_where)
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(fn=cmd_ls)
    ins = sub.add_parser("inspect", parents=[common], help="tensors (name, dtype, shape, bytes) from headers only",
                         aliases=["info"], epilog="example: aiotensor inspect model.safetensors --json")  # fmt: skip
    ins.add_argument("path", type=_where)
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.set_defaults(fn=cmd_inspect)
    ver = sub.add_parser("verify", help="re-read all, check every checksum (exit 0 all checked, 3 some files carry none, 1 bad)",
                         epilog="example: aiotensor verify ckpts/ && python train.py --resume", parents=[common])  # fmt: skip
    ver.add_argument("path", type=_where)
    ver.set_defaults(fn=cmd_verify)
    conv = sub.add_parser("convert", help="any readable format to safetensors (sharded + index), a checkpoint or torch.save",
                          epilog="examples:\n  aiotensor convert model.pt model.safetensors\n"
                                 "  aiotensor convert hf-folder/ ckpts/ --to checkpoint --step 0",
                          formatter_class=argparse.RawDescriptionHelpFormatter, parents=[common])  # fmt: skip
    conv.add_argument("src", type=_where)
    conv.add_argument("dst", type=_where)
    conv.add_argument("--to", choices=["safetensors", "checkpoint", "torch"], help="output format (default: from DST)")
    conv.add_argument("--shard-size", type=_size, default=_size("4GB"), help="largest safetensors shard (default 4GB)")
    conv.add_argument(
        "--step",
        type=int,
        help="of a store root SRC: the step to convert (default: its newest); of another SRC: the step of a "
        "--to checkpoint output (default 0)",
    )
    conv.add_argument("--overwrite", action="store_true", help="replace DST if it is an existing file")
    conv.set_defaults(fn=cmd_convert)
    bench = sub.add_parser("bench", help="this machine's disk and memcpy, then aiotensor vs torch.save, safetensors and DCP",
                           epilog="example: aiotensor bench --dir /mnt/nvme --size 2GB --out bench.md",
                           parents=[common])  # fmt: skip
    bench.add_argument("--dir", type=_path, default="/tmp", help="where to write (the disk to measure)")
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
    except BrokenPipeError:  # `aiotensor inspect ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 0
    except (errors.AiotensorError, OSError, ValueError) as e:
        print(f"aiotensor {a.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
