"""Tensors made of a source's entries (:mod:`aiotensor.sources`): every span read straight into the
memory the tensor ends up in, once. A tensor that is one span of its file is read into itself; a
torch.save storage is read once into a buffer and every tensor over it is a view (as ``torch.load``
makes them: an expanded view stays as small as its storage); a DCP chunk is read into its place in
the whole tensor. :func:`prepare` and :func:`finish` block (allocations, copies): worker threads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter, is_, is_not, itemgetter
from typing import NamedTuple

import torch

from .._runtime import cuda, gil
from .._runtime.scheduler import Priority, Scheduler
from ..errors import ChecksumError
from ..formats import safetensors as st
from ..formats import torchsave as ts
from ..formats.dtypes import PACKED, SAFETENSORS_TO_TORCH, torch_shape
from .read import Check, close, open_read, read_tensors, written
from .tensors import Block, Target, assign, carve, carved_targets, modified


class Span(NamedTuple):
    """Bytes of one file: ``spec`` says where (absolute offset, length) and what they hold read as
    one tensor; ``crc`` is their crc32c where the writer recorded one."""

    path: str
    spec: st.TensorSpec
    crc: int | None
    kind: str = "crc32c"  # or "crc32": a zip entry's (a torch.save storage)


class Part(NamedTuple):
    """How a tensor (or a chunk of one) is made of a span: the span's bytes themselves, or ``view``
    of them (a torch.save tensor over its storage); ``at`` places a chunk in the whole tensor."""

    span: Span
    view: ts.TensorRef | None = None
    at: tuple[int, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.view.size) if self.view is not None else torch_shape(self.span.spec.dtype, self.span.spec.shape)


class Entry(NamedTuple):
    """One tensor of a source, under each of its names (a tied weight has several)."""

    names: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    parts: tuple[Part, ...]
    requires_grad: bool = False

    @property
    def nbytes(self) -> int:
        """Its bytes as a dense tensor (a view can have more than it stores)."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def whole(self) -> Span | None:
        """The span that is this tensor, byte for byte, if there is one (no view, no chunks)."""
        p = self.parts[0]
        return p.span if len(self.parts) == 1 and p.view is None and p.at is None else None


DtypeRule = torch.dtype | Callable[[str, torch.dtype], torch.dtype | None] | None


def cast_to(rule: DtypeRule, name: str, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype ``rule`` converts a tensor ``name`` of ``dtype`` to, or None. A dtype converts
    floating-point tensors only, as ``nn.Module.to(dtype)`` and ``from_pretrained(dtype=)`` do,
    but not packed ones (two 4-bit values a byte, which torch cannot convert: an NVFP4 checkpoint's
    weights stay packed beside its scales); a callable decides for each tensor."""
    if rule is None:
        return None
    if callable(rule) and not isinstance(rule, torch.dtype):
        got = rule(name, dtype)
        if got is not None and not isinstance(got, torch.dtype):  # (torch's .to() raised a RuntimeError: helper-50)
            raise TypeError(f"the dtype rule returned {got!r} for tensor {name!r}: a torch.dtype or None, to keep its own")
        return got
    return rule if dtype.is_floating_point and dtype != rule and dtype not in _PACKED else None


_PACKED = frozenset(SAFETENSORS_TO_TORCH[k] for k in PACKED if k in SAFETENSORS_TO_TORCH)


def check_rule(rule: object) -> None:
    """Raises TypeError unless ``rule`` is a :data:`DtypeRule` (a dtype given as a string, say)."""
    if not (rule is None or isinstance(rule, torch.dtype) or callable(rule)):
        raise TypeError(f"dtype must be a torch.dtype, a callable (name, dtype) -> dtype or None, or None; got {rule!r}")


@dataclass
class Assembly:
    """The reads to do (``targets``, by file) and how the tensors are finished once they are done."""

    targets: dict[str, list[Target]] = field(default_factory=dict)
    out: list[torch.Tensor] = field(default_factory=list)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (destination, view), after the reads

    def add(self, span: Span, tensor: torch.Tensor, verify: bool, block: Block | None = None) -> None:
        target = Target(span.spec, tensor, span.crc if verify else None, span.kind, block)
        self.targets.setdefault(span.path, []).append(target)

    @property
    def nbytes(self) -> int:
        return sum(t.spec.nbytes for ts_ in self.targets.values() for t in ts_)


def prepare(
    entries: Sequence[Entry], device: torch.device, verify: bool, into: Sequence[torch.Tensor | None] | None = None
) -> Assembly:
    """Allocate what ``entries`` are read into (``into[i]``: entry ``i``'s destination, of its dtype
    and shape, or None: a new tensor on ``device``) and list the reads."""
    a = Assembly()
    wholes = _wholes(entries)
    if wholes and None not in wholes and len(paths := set(map(_PATH, wholes))) == 1:
        crcs = map(_CRC, wholes) if verify else repeat(None)
        if into is None and len(gil.filled(set(), wholes)) == len(wholes):  # (one set() of 20,000 spans: 2 ms of the GIL)
            # nearly every batch of a stream or a file: new tensors, each one span of one file (each
            # span once: one that two entries share is read once below), made column by column
            a.out, a.targets[paths.pop()] = carved_targets(gil.listed(map(_SPEC, wholes)), crcs, map(_KIND, wholes), device)
            return a
        if into is not None and all(map(is_not, into, repeat(None))):
            # a load into a module's tensors: each span read into its entry's (column by column)
            a.out = list(into)  # type: ignore[arg-type]  # (none is None)
            a.targets[paths.pop()] = st.rows(Target, map(_SPEC, wholes), into, crcs, map(_KIND, wholes), repeat(None))
            return a
    made = _carved(wholes, device, into)
    read: set[Span] = set()
    buffers: dict[Span, torch.Tensor] = {}  # spans read into a buffer, read once whatever shares them

    def buffer(span: Span) -> torch.Tensor:
        buf = buffers.get(span)
        if buf is None:
            buf = buffers[span] = torch.empty(span.spec.nbytes, dtype=torch.uint8, device=device)
            a.add(span, buf, verify)
        return buf

    for i, (e, whole) in enumerate(zip(entries, wholes, strict=True)):
        dest = into[i] if into is not None else None
        if whole is not None and dest is not None:
            a.add(whole, dest, verify)
            t = dest
        elif whole is not None:
            t, block = made[whole]
            if whole not in read:  # a span two entries share: one tensor, read once
                read.add(whole)
                a.add(whole, t, verify, block)
        elif len(e.parts) == 1 and e.parts[0].at is None:  # a view of a storage
            assert e.parts[0].view is not None
            view = ts.view_of(buffer(e.parts[0].span), e.parts[0].view)
            t = view if dest is None else dest
            if dest is not None:
                a.copies.append((dest, view))
        else:  # chunks, each into its place in the whole
            t = dest if dest is not None else torch.empty(e.shape, dtype=e.dtype, device=device)
            for p in e.parts:
                place = t[tuple(slice(o, o + n) for o, n in zip(p.at, p.shape, strict=True))] if p.at else t
                if p.view is None:
                    a.add(p.span, place.detach(), verify)
                else:
                    a.copies.append((place, ts.view_of(buffer(p.span), p.view)))
        a.out.append(t)
    return a


_PATH, _SPEC, _CRC, _KIND = attrgetter("path"), attrgetter("spec"), attrgetter("crc"), attrgetter("kind")


def _wholes(entries: Sequence[Entry]) -> list[Span | None]:
    """:attr:`Entry.whole` of each of ``entries``, by C loops where every one is one part that is
    neither a view nor a chunk (the property costs 0.5 us a call: 10 ms per 20,000 tensors)."""
    parts = gil.listed(map(_PARTS, entries))
    if set(map(len, parts)) == {1}:
        firsts = gil.listed(map(_FIRST, parts))
        if all(map(is_, map(_VIEW, firsts), repeat(None))) and all(map(is_, map(_AT, firsts), repeat(None))):
            return gil.listed(map(_SPAN, firsts))
    return [e.whole for e in entries]


_PARTS, _FIRST, _VIEW, _AT, _SPAN = attrgetter("parts"), itemgetter(0), attrgetter("view"), attrgetter("at"), attrgetter("span")


def _carved(
    wholes: Sequence[Span | None], device: torch.device, into: Sequence[torch.Tensor | None] | None
) -> dict[Span, tuple[torch.Tensor, Block | None]]:
    """New tensors for the entries that are a span each (``wholes[i]``: :attr:`Entry.whole`),
    carved file by file (:func:`~aiotensor._io.tensors.carve`). A torch.save storage stays an
    allocation of its own, as ``torch.load`` makes it: its views' ``untyped_storage()`` is that
    storage alone."""
    by_file: dict[str, dict[Span, None]] = {}
    for i, whole in enumerate(wholes):
        if whole is not None and (into is None or into[i] is None):
            by_file.setdefault(whole.path, {})[whole] = None
    made: dict[Span, tuple[torch.Tensor, Block | None]] = {}
    for spans in by_file.values():
        made |= zip(spans, carve([s.spec for s in spans], device), strict=True)
    return made


def finish(a: Assembly, names: Sequence[str] = (), dtype: DtypeRule = None) -> list[torch.Tensor]:
    """After the reads: views copied where they go, and ``dtype`` applied (see :func:`cast_to`; a
    view is converted by converting its storage once, so it stays a view)."""
    with torch.no_grad():
        for dst, view in a.copies:
            assign(dst, view)
    a.copies.clear()
    if dtype is None:
        return a.out
    converted: dict[tuple[int, torch.dtype, torch.dtype], torch.Tensor] = {}
    out = []
    for name, t in zip(names, a.out, strict=True):
        want = cast_to(dtype, name, t.dtype)
        out.append(t if want is None else _converted(t, want, converted))
    return out


def _converted(
    t: torch.Tensor, want: torch.dtype, done: dict[tuple[int, torch.dtype, torch.dtype], torch.Tensor]
) -> torch.Tensor:
    """``t`` as ``want``: a tensor that is not its storage's bytes in order (a view) is converted by
    converting its storage, so that it stays a view (an expanded view is never materialized); a
    lazily negated or conjugated view by its values (converting its storage dropped the bit: sign-
    flipped values, helper-72)."""
    storage = t.untyped_storage()
    whole = storage.nbytes() // t.element_size()
    if (t.is_contiguous() and t.numel() == whole) or storage.nbytes() % t.element_size() or t.is_neg() or t.is_conj():
        return t.to(want)
    key = (storage.data_ptr(), t.dtype, want)
    conv = done.get(key)
    if conv is None:
        conv = done[key] = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (whole,), (1,)).to(want)
    return conv.as_strided(t.shape, t.stride(), t.storage_offset())


async def read(
    sched: Scheduler,
    entries: Sequence[Entry],
    device: torch.device,
    verify: bool = True,
    into: Sequence[torch.Tensor | None] | None = None,
    dtype: DtypeRule = None,
    checks: Mapping[str, Check] | None = None,
) -> list[torch.Tensor]:
    """Read ``entries`` (see :func:`prepare`), one file at a time, and finish them; CUDA memory is
    allocated and finished on the caller's current stream. ``checks``: what each file must pass as
    it is opened (``Source.checks``).

    Raises:
        ChecksumError, FormatError, OSError: as :func:`~aiotensor._io.read.read_tensors`.
        SourceChangedError, ManifestError: a file failed its check.

    Cancellation: returns once no thread writes into the tensors any more.
    """
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def start() -> Assembly:
        with cuda.on_streams([stream]):
            return prepare(entries, device, verify, into)

    def end(a: Assembly) -> list[torch.Tensor]:
        modified(into or ())
        with cuda.on_streams([stream]):
            return finish(a, [e.names[0] for e in entries], dtype)

    a = await sched.call(start, priority=Priority.LOAD, home=True)
    try:
        for path, targets in a.targets.items():
            fd = await open_read(sched, path, (checks or {}).get(path))
            try:
                await read_named(sched, fd, path, targets, entries)
            finally:
                await close(sched, fd)
    except BaseException:
        if into:  # (some may hold new bytes now)
            await written(sched, into)
        raise
    return await sched.call(end, a, priority=Priority.LOAD)


async def read_named(sched: Scheduler, fd: int, path: str, targets: Sequence[Target], entries: Sequence[Entry]) -> None:
    """:func:`~aiotensor._io.read.read_tensors` of ``entries``' ``targets`` in the open file
    ``path``; a ChecksumError names the tensors over the record whose bytes failed (:func:`_named`)."""
    try:
        await read_tensors(sched, fd, path, targets, Priority.LOAD)
    except ChecksumError as e:
        raise _named(e, entries, path) from None


def _named(e: ChecksumError, entries: Sequence[Entry], path: str) -> ChecksumError:
    """``e`` naming the tensors whose bytes failed where its key is a record of the file, not a
    tensor's name (a torch.save storage, which several tensors may view; a chunk)."""
    names = [n for x in entries if any(p.span.path == path and p.span.spec.key == e.key for p in x.parts) for n in x.names]
    if not names or e.key in names:
        return e
    was, now = f"tensor {e.key!r}", f"record {e.key!r} (the bytes of {_few(names)})"
    reason = e.reason.replace(was, now, 1) if e.reason.startswith(was) else f"{e.reason} ({now})"
    return ChecksumError(reason, e.path, names[0])


def _few(names: list[str]) -> str:
    return ", ".join(map(repr, names[:5])) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def stored_bytes(entries: Sequence[Entry]) -> int:
    """The bytes reading ``entries`` moves (a span shared by several counted once)."""
    return sum(s.spec.nbytes for s in {p.span for e in entries for p in e.parts})


__all__ = [
    "Assembly", "DtypeRule", "Entry", "Part", "Span", "cast_to", "check_rule", "finish", "prepare", "read", "read_named",
    "stored_bytes",
]  # fmt: skip
