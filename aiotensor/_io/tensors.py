"""Tensors as the I/O steps see them: their bytes, the checks a destination or source passes, read
targets, and the CUDA stream rules (the consumer's stream, the producers' work).

Nothing here does file I/O; :func:`copy_tensor` and :func:`materialize` block (on CUDA, until the
copy is done) and run in worker threads.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from operator import attrgetter, itemgetter, le
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import knobs
from .._runtime import cuda, gil
from .._runtime.buffers import PAGE, map_copy, round_up
from .._runtime.scheduler import Priority, Scheduler
from ..errors import MismatchError, StateError, annotate_oserror
from ..formats import checksum
from ..formats import safetensors as st
from ..formats.dtypes import PACKED, SAFETENSORS_TO_TORCH, TORCH_TO_SAFETENSORS, torch_shape


def check_tensor(key: str, t: torch.Tensor, devices: tuple[str, ...] = ("cpu",), *, stored: bool = True) -> str:
    """The safetensors dtype of ``t``, or a StateError naming ``key`` and saying what to do
    (``stored``: ``key`` names it in a file's header too, where ``__metadata__`` is taken)."""
    if stored and key == st.METADATA_KEY:
        raise StateError(f"a tensor cannot be named {key!r}: a safetensors header keeps its metadata under that name")
    if t.is_nested:
        raise StateError(f"tensor {key!r} is a nested tensor; store its components (t.unbind()) or t.to_padded_tensor(0)")
    if t.layout != torch.strided:
        raise StateError(f"tensor {key!r} has layout {t.layout}; only dense (strided) tensors are stored (use .to_dense())")
    if t.is_quantized:
        raise StateError(f"tensor {key!r} is quantized; store t.int_repr(), t.q_scale() and t.q_zero_point() instead")
    if t._is_zerotensor():  # (its memory is none: a copy of its bytes read address 0, helper-67)
        raise StateError(f"tensor {key!r} is a ZeroTensor (zeros without memory); save torch.zeros_like(t) instead")
    if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        raise StateError(
            f"tensor {key!r} is a {type(t).__name__}, a tensor subclass that is not plain memory "
            "(DTensor: open the store with distributed=True on every rank, or save .full_tensor(); "
            "others: convert to a plain tensor)"
        )
    if not (
        (t.is_cpu and "cpu" in devices) or (t.is_cuda and "cuda" in devices) or t.device.type in devices
    ):  # (t.device: 0.8 us)
        raise StateError(f"tensor {key!r} is on {t.device}; this store handles {', '.join(devices)} tensors")
    dtype = TORCH_TO_SAFETENSORS.get(t.dtype)
    if dtype is None:
        raise StateError(f"tensor {key!r} has dtype {t.dtype}, which safetensors cannot store")
    if dtype in PACKED and t.dim() == 0:
        raise StateError(f"tensor {key!r}: a 0-d {t.dtype} cannot be stored (safetensors counts its packed values)")
    return dtype


def check_tensors(tensors: list[tuple[str, torch.Tensor]], devices: tuple[str, ...] = ("cpu",)) -> list[str]:
    """:func:`check_tensor` of each ``(key, tensor)``: their safetensors dtypes, asked by C loops
    :data:`_CHECKED` tensors at a time (a slice with anything to refuse, or a packed dtype, is
    checked one by one, so the error is :func:`check_tensor`'s)."""
    out: list[str] = []
    for i in range(0, len(tensors), _CHECKED):
        some = tensors[i : i + _CHECKED]
        ts = list(map(_SECOND, some))
        dtypes: list[Any] = list(map(TORCH_TO_SAFETENSORS.get, map(_DTYPE, ts)))
        if (
            None in dtypes  # (a quantized tensor's dtype among them: no test of is_quantized)
            or not PACKED.keys().isdisjoint(dtypes)
            or st.METADATA_KEY in map(_FIRST, some)
            or any(map(_IS_NESTED, ts))
            or not {torch.strided}.issuperset(map(_LAYOUT, ts))
            or any(k.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__ for k in set(map(type, ts)))  # type: ignore[attr-defined]
            or not (("cpu" in devices and all(map(_IS_CPU, ts))) or ("cuda" in devices and all(map(_IS_CUDA, ts))))
        ):
            dtypes = [check_tensor(key, t, devices) for key, t in some]
        out += dtypes
    return out


_CHECKED = 1024
_DATA_PTR, _NBYTES_OF = torch.Tensor.data_ptr, attrgetter("nbytes")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_DTYPE, _LAYOUT, _IS_NESTED = attrgetter("dtype"), attrgetter("layout"), attrgetter("is_nested")


def byte_tensor(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor on its device (no copy)."""
    if t.dtype == torch.uint8 and t.dim() == 1 and not t.requires_grad:
        return t  # a block's memory: three ops saved (each gives the GIL away and waits to get it back)
    return t.detach().reshape(-1).view(torch.uint8)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (no copy)."""
    if t.numel() == 0:
        return memoryview(bytearray())
    return byte_tensor(t).numpy().data.cast("B")


def plain(t: torch.Tensor) -> bool:
    """Are ``t``'s values its memory's bytes, in order (contiguous, no lazy conj/neg bit)?"""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def direct(t: torch.Tensor) -> bool:
    """Can bytes be read straight into (or written straight from) ``t``'s memory?"""
    return t.is_cpu and plain(t)  # (is_cpu: 0.05 us; t.device makes a torch.device, 0.3 us)


def all_direct(ts: list[torch.Tensor]) -> bool:
    """:func:`direct` of every one of ``ts``, asked by C loops (~0.1 us a tensor, against ~0.6)."""
    return (
        all(map(_IS_CPU, ts))
        and all(map(torch.Tensor.is_contiguous, ts))
        and not any(map(torch.Tensor.is_conj, ts))
        and not any(map(torch.Tensor.is_neg, ts))
    )


_IS_CPU, _IS_CUDA = attrgetter("is_cpu"), attrgetter("is_cuda")


def materialize(t: torch.Tensor) -> torch.Tensor:
    """A :func:`plain` tensor with ``t``'s values (``t`` itself when it is one; blocks: on CUDA it
    returns once the copy is done, so a copy stream or cuFile may read the result)."""
    if plain(t):
        return t
    out = t.resolve_conj().resolve_neg().contiguous()
    if out.device.type == "cuda":
        torch.cuda.current_stream(out.device).synchronize()
    return out


def io_bytes(eng: Any, t: torch.Tensor) -> memoryview | torch.Tensor:
    """A :func:`plain` tensor's bytes as an engine moves them: a flat uint8 tensor where the engine
    reads and writes that memory itself (or must bounce it: CUDA memory, posix engine), else a
    memoryview of host memory."""
    return byte_tensor(t) if eng.handles_device(t) or t.device.type != "cpu" else byte_view(t)


def spans(n: int, chunk: int, start: int = 0) -> Iterator[tuple[int, int]]:
    """``[a, b)`` pieces of ``n`` bytes of at most ``chunk``, cut where ``start + a`` is a multiple of ``chunk``."""
    a = 0
    while a < n:
        b = min(n, a + chunk - (start + a) % chunk)
        yield a, b
        a = b


def crc_of_pieces(crcs: Sequence[tuple[int, int]], kind: str = "crc32c") -> int:
    """Combine ``(crc, length)`` of consecutive pieces into the crc of the whole."""
    if not crcs:
        return 0
    total = crcs[0][0]  # the crc of the first piece is its own: no combining (the common case)
    for c, n in crcs[1:]:
        total = checksum.combine(total, c, n, kind)
    return total


def writing(t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """What an in-place write to ``t`` runs under: ``torch.inference_mode()`` where ``t`` is an
    inference tensor (made under that mode, as a server's module often is: torch refuses in-place
    writes to one outside it, from any thread), nothing otherwise."""
    return torch.inference_mode() if t.is_inference() else contextlib.nullcontext()


def assign(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, an inference tensor ``dst`` too (:func:`writing`)."""
    with writing(dst):
        dst.copy_(src)


def modified(tensors: Iterable[torch.Tensor | None]) -> None:
    """Tell autograd that a load wrote ``tensors`` in place (their version counters move, as a
    ``copy_`` moves them): a graph made from their old values then refuses ``backward()``, as
    after torch's ``load_state_dict``, instead of using the new ones (helper-47). None is passed
    over, and so are inference tensors (they keep no counter: torch passes over them, ~2.5 ms
    per 20,000 tensors less than asking each; where it refuses them, they are left out here)."""
    ts = [t for t in tensors if t is not None]
    if not ts:
        return
    try:
        torch.autograd.graph.increment_version(ts)
    except RuntimeError:  # (inference tensors, where torch refuses them; a counter moved twice is harmless)
        torch.autograd.graph.increment_version([t for t in ts if not t.is_inference()])


def copy_tensor(sched: Scheduler, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (:func:`assign`) in a worker thread; between a bounce slot and CUDA memory
    on the copy stream, returning once the copy is done (the slot is then free again)."""
    if dst.device.type == "cuda" or src.device.type == "cuda":
        assert sched.cuda is not None
        sched.slots.pin(sched.cuda.pinning)
        with writing(dst):
            cuda.copy(sched.cuda, dst, src)
    else:
        assign(dst, src)


def new_tensor(spec: st.TensorSpec, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of ``spec``'s dtype and shape on ``device``, to read it into."""
    return torch.empty(torch_shape(spec.dtype, spec.shape), dtype=SAFETENSORS_TO_TORCH[spec.dtype], device=device)


def check_into(
    given: Mapping[str, torch.Tensor],
    specs: Mapping[str, st.TensorSpec],
    devices: tuple[str, ...],
    where: str,
    *,
    missing_ok: bool = False,
    unexpected_ok: bool = False,
    new: Collection[str] = (),
    source: Callable[[str], str] | None = None,
) -> tuple[list[str], list[str], set[str]]:
    """``given`` (``into``'s tensors) has exactly ``specs``' keys, each a tensor of its spec's dtype
    and shape on a device this machine handles; else MismatchError (StateError for the device).
    The words are ``load_state_dict``'s, ``into`` in the module's place: a key of ``into`` that
    ``where`` lacks is missing (``missing_ok``: left alone), a key of ``where`` that ``into`` lacks
    is unexpected (``unexpected_ok``: not read), unless it is one of ``new`` (read into a new
    tensor). Returns the missing and unexpected keys let pass, and the stored tensors not to read
    (:func:`tie_skips`; ``source(key)``: the stored key a key of ``into`` reads, an alias's)."""
    odd = [k for k, t in given.items() if k in specs and not isinstance(t, torch.Tensor)]
    if odd:  # (elsewhere a module's _extra_state, say: a missing key, as load_state_dict has it)
        raise MismatchError(f"`into` holds {type(given[odd[0]]).__name__} at {odd[0]!r} where a tensor is read: {odd[:5]}")
    missing, unexpected = sorted(set(given) - set(specs)), sorted(set(specs) - set(given) - set(new))
    refused = ([] if missing_ok else missing), ([] if unexpected_ok else unexpected)
    if refused[0] or refused[1]:
        raise MismatchError(f"`into` does not match {where}: {mismatch(*refused, '`into`')}")
    for k, t in given.items():
        spec = specs.get(k)
        if spec is None:
            continue
        if t.is_meta:
            raise MismatchError(
                f"tensor {k!r} of `into` is on the meta device: `into` is filled in place, so its tensors must have "
                "memory (module.to_empty(device=...) first; or load a module with aiotensor.load_into, which materializes it)"
            )
        check_tensor(k, t, devices, stored=False)
        want, shape = SAFETENSORS_TO_TORCH[spec.dtype], torch_shape(spec.dtype, spec.shape)
        if tuple(t.shape) != shape or t.dtype != want:
            raise MismatchError(f"tensor {k!r}: {where} has {want} {list(shape)}, `into` has {t.dtype} {list(t.shape)}")
        check_fillable(t, f"tensor {k!r} of `into`")
    read = [k for k in given if k in specs]
    return missing, unexpected, tie_skips(read, check_apart(read, [given[k] for k in read], "`into`"), source)


def tie_skips(keys: Sequence[str], ties: list[list[int]], source: Callable[[str], str] | None = None) -> set[str]:
    """The stored tensors not to read for ``ties`` (:func:`check_apart`'s groups of ``keys``: one
    tensor of ``into`` under several keys), each key reading ``source(key)`` (itself by default):
    a tie gets the stored tensor its last key reads, as ``load_state_dict`` leaves a tie with its
    last name's value; read from each, the bytes were a mix of the two (helper-72).

    Raises:
        MismatchError: a stored tensor a tie does not read is read for a key of ``into`` outside
            that tie (an alias of it that is another tensor: it would get the tie's value)."""
    src = source or str
    skip: dict[str, int] = {}  # stored key -> the tie that does not read it
    for g, tie in enumerate(ties):
        names = [keys[i] for i in tie]
        skip |= dict.fromkeys({src(n) for n in names} - {src(names[-1])}, g)
    if skip:
        group = {keys[i]: g for g, tie in enumerate(ties) for i in tie}
        for k in keys:
            lost = skip.get(src(k))
            if lost is not None and group.get(k) != lost:
                raise MismatchError(
                    f"`into` holds one tensor under {[keys[i] for i in ties[lost]]}, stored as different tensors, and "
                    f"{k!r} reads {src(k)!r} too into other memory: load into a state without the tie, or untie it"
                )
    return set(skip)


def check_apart(names: Sequence[str], tensors: Sequence[torch.Tensor], what: str) -> list[list[int]]:
    """A MismatchError where two of ``tensors`` (``names``, of ``what``) share part of their memory
    without being one view of it (a tied weight: both get the same bytes): a load fills the shared
    bytes with whichever came last, mixing the two (helper-67: two slices of one buffer, each read
    in turn). The spans are compared by C loops (numpy's sort); two that begin at one byte share it
    unless they are one view (:func:`_view`); where a strided view's span meets another's (a
    transpose, a column slice: they may interleave without sharing an element), their bytes are
    compared (helper-68: a column slice and a row slice of one buffer, mixed).

    Returns the ties: the positions of each group of ``tensors`` that are one view (one tensor
    under several names), in order, a group of two or more each. A load reads one stored tensor
    into each (:func:`tie_skips`; a module's: ``serving.module._tied_elsewhere``): read from each
    name, their bytes were written over each other in parallel pieces, a mix of the two (helper-72)."""
    if len(tensors) < 2:
        return []
    at = np.array(gil.listed(map(_DATA_PTR, tensors)), np.int64)  # (a slice per C loop: the GIL changes hands)
    span = np.array(gil.listed(map(_NBYTES_OF, tensors)), np.int64)
    plain = np.array(gil.listed(map(torch.Tensor.is_contiguous, tensors)), bool)
    keep = np.flatnonzero(span > 0)
    for i in keep[~plain[keep]]:  # (few)
        span[i] = byte_span(tensors[i])
    if keep.size < 2:
        return []
    order = keep[np.lexsort((keep, span[keep], at[keep]))]  # (a tie's names in their order)
    lo = at[order]
    tie = np.zeros(order.size, bool)
    ties: list[list[int]] = []
    for k in np.flatnonzero(lo[1:] == lo[:-1]) + 1:  # two that begin at one byte: one view, or they share it
        i, j = int(order[k - 1]), int(order[k])
        if _view(tensors[i]) != _view(tensors[j]):
            _shared(names, what, i, j)
        if tie[k - 1]:  # (the group goes on)
            ties[-1].append(j)
        else:
            ties.append([i, j])
        tie[k] = True
    order = order[~tie]
    lo, hi = at[order], at[order] + span[order]
    top = np.maximum.accumulate(hi)
    meets = top[:-1] > lo[1:]  # a span meets one before it
    if not meets.any():
        return ties
    group = np.r_[0, np.cumsum(~meets)]  # spans that meet, chained
    for g in np.unique(group[1:][meets]):
        members = order[group == g]
        if plain[members].all():  # contiguous spans that meet share bytes
            _shared(names, what, int(members[0]), int(members[1]))
        _apart_runs(names, tensors, what, [int(i) for i in members])
    return ties


def byte_span(t: torch.Tensor) -> int:
    """The bytes from a non-empty tensor's first element to past its last (a strided view's reach)."""
    return (sum((n - 1) * st_ for n, st_ in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


def _view(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors that begin at one byte one view of it (the same bytes, in the same
    order): a contiguous one, its bytes; a strided one, its dimensions of more than one element
    (size, byte stride) and its element's size (a size-1 dimension's stride is no part of it)."""
    if t.is_contiguous():
        return ("contiguous", t.nbytes)
    size = t.element_size()
    return ("strided", size, tuple((n, st_ * size) for n, st_ in zip(t.shape, t.stride(), strict=True) if n != 1))


def _apart_runs(names: Sequence[str], tensors: Sequence[torch.Tensor], what: str, members: list[int]) -> None:
    """:func:`check_apart` for tensors whose spans meet, one of them strided: by their runs of
    consecutive bytes (a strided view's innermost dimension of stride 1 is one run: a column slice of
    a row-major matrix is a run per row), at most :data:`_COUNTED` runs; beyond, refused as not shown
    apart."""
    runs: list[tuple[int, list[tuple[int, int]]]] = []  # each one's run length, and its other dimensions
    for i in members:
        t = tensors[i]
        if t.is_contiguous():
            runs.append((t.nbytes, []))
            continue
        dims = [(n, st_) for n, st_ in zip(t.shape, t.stride(), strict=True) if n > 1]
        inner = next(((n, st_) for n, st_ in dims if st_ == 1), None)  # a run of elements
        runs.append(((inner[0] if inner else 1) * t.element_size(), [d for d in dims if d != inner]))
    if sum(math.prod(n for n, _ in outer) for _, outer in runs) > _COUNTED:
        raise MismatchError(
            f"tensors {names[members[0]]!r} and {names[members[1]]!r} of {what} are views of one buffer too big to tell "
            "apart run by run: give each its own memory"
        )
    starts, ends, owner = [], [], []
    for i, (length, outer) in zip(members, runs, strict=True):
        t = tensors[i]
        first = t.data_ptr() + _offsets(outer).numpy() * t.element_size()
        starts.append(first)
        ends.append(first + length)
        owner.append(np.full(first.size, i))
    lo, hi, who = np.concatenate(starts), np.concatenate(ends), np.concatenate(owner)
    order = np.argsort(lo, kind="stable")
    lo, hi, who = lo[order], hi[order], who[order]
    top = np.maximum.accumulate(hi)
    clash = np.flatnonzero(top[:-1] > lo[1:])
    if clash.size:
        j = int(clash[0]) + 1
        _shared(names, what, int(who[np.flatnonzero(hi[:j] > lo[j])[0]]), int(who[j]))


def _shared(names: Sequence[str], what: str, i: int, j: int) -> None:
    raise MismatchError(
        f"tensors {names[i]!r} and {names[j]!r} of {what} share part of their memory (views of one buffer that overlap): "
        "a load would fill the shared bytes with whichever came last; give each its own memory, or make them one "
        "tensor (a tie)"
    )


_COUNTED = 1 << 22  # offsets overlaps() and _apart_runs() count at most (32 MB of int64s, ~0.3 s)


def check_fillable(t: torch.Tensor, what: str) -> None:
    """A MismatchError where two elements of ``t`` (``what``, in the message) are one memory
    location, or may be (:func:`overlaps`): no load can fill it (torch's ``copy_`` mixes the values
    without a word)."""
    if t.is_contiguous():  # (nothing to look at: 50,000 tensors of a state cost 60 ms, helper-66)
        return
    strides = t.stride()
    if 0 in strides and t.numel() > 1 and any(n > 1 for st_, n in zip(strides, t.shape, strict=True) if st_ == 0):
        raise MismatchError(f"{what} is expanded (a stride of 0): its elements share memory, not fillable")
    shared = overlaps(t)
    if shared is None:
        raise MismatchError(
            f"{what} has strides {list(strides)} for its shape {list(t.shape)}, which do not show that each of its "
            f"elements has a memory location of its own, and at over {_COUNTED:,} elements they are not counted: "
            "load into a contiguous tensor (or a transpose or slice of one)"
        )
    if shared:
        raise MismatchError(
            f"{what} has strides {list(strides)} for its shape {list(t.shape)}: some of its elements are one memory "
            "location (as_strided), so no load can fill it"
        )


def overlaps(t: torch.Tensor) -> bool | None:
    """Do two elements of ``t`` lie at one memory location (an ``as_strided`` view of overlapping
    strides)? None: it cannot tell. Each dimension's stride, smallest first, must pass every offset
    the smaller ones reach (a contiguous tensor, a transpose, a slice: ~1 us). Where it does not:
    more elements than locations they span overlap (a sliding window, ``unfold``); else, up to
    :data:`_COUNTED` elements, their offsets are counted (a layout no ordinary view has); beyond,
    None (counting them took seconds and gigabytes, helper-66; taken as not overlapping, a load
    into one of 2M rows mixed its values without a word, helper-67)."""
    if t.numel() <= 1:
        return False
    dims = sorted((st_, n) for st_, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    reach = 0
    for stride, n in dims:
        if stride <= reach:
            break
        reach += stride * (n - 1)
    else:
        return False
    span = sum(stride * (n - 1) for stride, n in dims) + 1
    if t.numel() > span:
        return True
    if t.numel() > _COUNTED:
        return None
    return int(torch.unique(_offsets([(n, stride) for stride, n in dims])).numel()) < t.numel()


def _offsets(dims: Iterable[tuple[int, int]]) -> torch.Tensor:
    """The offset of every index of dimensions ``(size, stride)``, in elements (int64)."""
    offsets = torch.zeros(1, dtype=torch.int64)
    for n, stride in dims:
        offsets = (offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * stride).reshape(-1)
    return offsets


def mismatch(missing: list[str], unexpected: list[str], side: str) -> str:
    """``load_state_dict``'s words for a mismatch, ``side`` in the module's place: the names only
    ``side`` has are missing, those only the source has unexpected; each list only where it has names."""
    parts = [f"missing keys {_few(missing)} (only in {side})"] if missing else []
    parts += [f"unexpected keys {_few(unexpected)} (not in {side})"] if unexpected else []
    return ", ".join(parts)


def _few(keys: list[str]) -> str:
    return f"{keys[:5]}{'...' if len(keys) > 5 else ''}"


def check_device(sched: Scheduler, device: str | torch.device) -> torch.device:
    """``device`` as a torch.device, or ValueError where this machine cannot load to it."""
    dev = torch.device(device)
    if dev.type not in sched.devices:
        raise ValueError(f"cannot load to {device}: this machine handles {', '.join(sched.devices)} tensors")
    if dev.type == "cuda" and dev.index is None:  # worker threads make the tensors: the caller's current device
        dev = torch.device("cuda", current_device())
    return dev


async def load_device(sched: Scheduler, device: str | torch.device) -> torch.device:
    """:func:`check_device`'s device, with CUDA initialized outside the event loop's thread where
    this is the process's first CUDA use (:func:`aiotensor._runtime.cuda.initialized`)."""
    dev = check_device(sched, device)
    if dev.type == "cuda":
        await cuda.initialized(dev)
    return dev


def current_device() -> int:
    """The caller's current CUDA device, without initializing CUDA on the caller's thread (often
    the event loop's). Before torch initialized CUDA no thread has chosen a device through torch
    (``set_device`` and ``with torch.cuda.device(k)`` initialize it): 0. Not seen: a device chosen
    through another library's runtime calls (CuPy's), or a stream made and set without a device
    before CUDA was initialized (``torch.cuda.set_stream(torch.cuda.Stream())``)."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0  # type: ignore[no-untyped-call]


async def wait_for_streams(sched: Scheduler, tensors: Iterable[torch.Tensor]) -> None:
    """Before writing into CUDA tensors: wait (in a worker thread) for the work already queued on
    their devices' current streams, which may still read them. Copies on the copy stream and
    cuFile reads are not ordered after that work otherwise."""
    if sched.cuda is None:
        return
    events = cuda.record_producers(tensors)
    if events:
        await sched.call(cuda.synchronize, events, priority=Priority.LOAD)


@dataclass(eq=False)
class Block:
    """New tensors of one file carved from one page-aligned allocation (:func:`carve`): ``memory``
    holds the file's bytes from ``offset`` (page-aligned) to ``end`` and beyond, up to a page
    boundary; the tensors are views of it. Read in few big pieces, with O_DIRECT straight in where
    the engine can."""

    offset: int
    end: int
    memory: torch.Tensor  # uint8, page-aligned, its length a multiple of the page


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of ``nbytes`` (rounded up to a page) at a page-aligned address."""
    n = round_up(max(nbytes, 1))
    raw = torch.empty(n + PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + n]


def carve(specs: Sequence[st.TensorSpec], device: torch.device) -> list[tuple[torch.Tensor, Block | None]]:
    """New tensors to read ``specs`` (of one file) into, in their order, each with the block it is
    carved from. On the CPU, neighbours in the file of at most :data:`knobs.CARVE_TENSOR_BYTES`
    are read into a page-aligned allocation of at most :data:`knobs.CARVE_BLOCK_BYTES`, each a
    tensor with a storage of its own over its bytes there (:func:`views`); a bigger tensor has an
    allocation of its own. Elsewhere, and for a tensor whose offset is not a multiple of its item
    size, a plain new tensor."""
    out: list[tuple[torch.Tensor, Block | None]] = [(_EMPTY, None)] * len(specs)
    if device.type != "cpu":
        return [(new_tensor(s, device), None) for s in specs]
    run: list[int] = []

    def flush() -> None:
        if not run:
            return
        lo, end = specs[run[0]].offset // PAGE * PAGE, specs[run[-1]].offset + specs[run[-1]].nbytes
        block = Block(lo, end, aligned_empty(end - lo))
        for i, t in zip(run, views(block.memory, lo, [specs[i] for i in run]), strict=True):
            out[i] = (t, block)
        run.clear()

    # columns, made by C loops: this loop runs once per tensor (tens of thousands)
    offsets, nbytes = gil.listed(map(_OFFSET, specs)), gil.listed(map(_NBYTES, specs))
    items = gil.listed(map(_ITEMSIZE, map(SAFETENSORS_TO_TORCH.__getitem__, map(_DTYPE, specs))))
    most, block_most = knobs.CARVE_TENSOR_BYTES, knobs.CARVE_BLOCK_BYTES
    start = end = 0  # where the run's first tensor begins and its last ends
    # in file order already, nearly always (a sort of 20,000 is one C call, 2 ms with the GIL held)
    ordered = all(map(le, offsets, islice(offsets, 1, None)))
    for i in range(len(specs)) if ordered else sorted(range(len(specs)), key=offsets.__getitem__):
        at, n = offsets[i], nbytes[i]
        if n == 0 or at % items[i] or n % items[i]:
            out[i] = (new_tensor(specs[i], device), None)
            continue
        big = n > most
        if run and (big or not 0 <= at - end <= PAGE or at + n - start > block_most):
            flush()
        if not run:
            start = at
        run.append(i)
        end = at + n
        if big:
            flush()
    flush()
    return out


def carved_targets(
    specs: Sequence[st.TensorSpec], crcs: Iterable[int | None], kinds: Iterable[str], device: torch.device
) -> tuple[list[torch.Tensor], list[Target]]:
    """:func:`carve` ``specs`` (of one file), and the reads into what it made: the new tensors, in
    the order of ``specs``, and a target for each, with its checksum to check (``crcs``, None:
    none) of its ``kinds`` (made column by column: tens of thousands of tensors)."""
    made = carve(specs, device)
    tensors = gil.listed(map(_FIRST, made))
    return tensors, st.rows(Target, specs, tensors, crcs, kinds, map(_SECOND, made))


_EMPTY = torch.empty(0)


def mapped(fd: int, path: str, size: int, specs: Sequence[st.TensorSpec], crcs: Sequence[int | None] | None) -> list[Target]:
    """A copy-on-write mapping of the open file ``fd`` (``path``) of ``size`` bytes and a view of it for each
    of ``specs`` (validated against the file), each with its crc (``crcs[i]``; None: none to check).
    A tensor at an offset that is not a multiple of its item size is copied out. Writes to a view
    stay in this process; the mapping lives as long as any view of it (and keeps the file's inode:
    a file deleted meanwhile is still read).

    Raises:
        OSError: the file is shorter than ``size`` now, or cannot be mapped, naming it."""
    whole = _EMPTY.view(torch.uint8)
    block = None
    if size:
        try:
            whole = torch.from_numpy(map_copy(fd, size))  # alive as long as any tensor over it
        except OSError as e:
            raise annotate_oserror(e, f"mapping {path}") from e
        block = Block(0, size, whole)  # verified in big pieces of the mapping, not tensor by tensor
    tensors: list[torch.Tensor] = [_EMPTY] * len(specs)
    viewed = []
    for i, s in enumerate(specs):
        dtype, shape = SAFETENSORS_TO_TORCH[s.dtype], torch_shape(s.dtype, s.shape)
        if not s.nbytes:
            tensors[i] = torch.empty(shape, dtype=dtype)
        elif s.offset % dtype.itemsize:
            tensors[i] = whole[s.offset : s.offset + s.nbytes].clone().view(dtype).view(shape)
        else:
            viewed.append(i)
    viewed.sort(key=lambda i: specs[i].offset)
    for i, t in zip(viewed, views(whole, 0, [specs[i] for i in viewed]), strict=True):
        tensors[i] = t
    ours = set(viewed)
    return [
        Target(s, t, None if crcs is None else crcs[i], block=block if i in ours else None)
        for i, (s, t) in enumerate(zip(specs, tensors, strict=True))
    ]


def views(memory: torch.Tensor, base: int, specs: Sequence[st.TensorSpec]) -> list[torch.Tensor]:
    """Tensors over ``memory`` (uint8 on the CPU, its byte 0 the file's byte ``base``) for ``specs``
    (none empty, each at a multiple of its item size from ``base``), each with a storage of its own
    over its bytes (a numpy array of its shape handed to ``torch.from_numpy``; where numpy lacks
    the dtype, ``torch.frombuffer`` for one dimension, else an integer array of the same item size
    viewed as the dtype), as the tensors of ``torch.load`` and of
    safetensors have one each. As views of one storage, ``torch.save``, ``pickle`` or ``deepcopy``
    of one tensor carried the whole allocation, ``resize_`` wrote over its neighbours,
    ``safetensors.torch.save_model`` refused them and ``torch.set_rng_state`` (which ignores a
    storage offset) crashed the process. Such a storage cannot be resized, and keeps ``memory``
    alive. (About 1 us a tensor where numpy has its dtype: 16 ms per 20,000 of one or two
    dimensions, where splits of one view took 8 and 10; 2 us for others of two dimensions, where
    ``frombuffer`` then ``resize_`` took 6 and gave the GIL up in each ``resize_``.)"""
    buf = memory.numpy()
    out = []
    for s in specs:
        kind = _NUMPY.get(s.dtype)
        if kind is not None:  # one numpy array of its shape over its bytes, its memory torch's storage
            out.append(torch.from_numpy(np.ndarray(s.shape, kind, buf, s.offset - base)))
            continue
        dtype = SAFETENSORS_TO_TORCH[s.dtype]  # numpy lacks it (bfloat16, float8)
        shape = torch_shape(s.dtype, s.shape)
        if len(shape) == 1:  # made in one call
            out.append(torch.frombuffer(buf, dtype=dtype, count=s.nbytes // dtype.itemsize, offset=s.offset - base))
        else:  # an integer array of its item size and shape, viewed as its dtype
            ints = _BITS[dtype.itemsize]
            out.append(torch.from_numpy(np.ndarray(shape, ints, buf, s.offset - base)).view(dtype))
    return out


_BITS: dict[int, np.dtype[Any]] = {1: np.dtype(np.uint8), 2: np.dtype(np.int16), 4: np.dtype(np.int32), 8: np.dtype(np.int64)}


_NUMPY = {
    k: np.dtype(v)
    for k, v in {
        "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16, "I32": np.int32, "U32": np.uint32,
        "I64": np.int64, "U64": np.uint64, "F16": np.float16, "F32": np.float32, "F64": np.float64, "C64": np.complex64,
    }.items()
}  # fmt: skip


_DTYPE, _OFFSET, _NBYTES, _ITEMSIZE = attrgetter("dtype"), attrgetter("offset"), attrgetter("nbytes"), attrgetter("itemsize")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


class Target(NamedTuple):
    """Read ``spec``'s bytes into ``tensor`` (same dtype and shape); check ``crc`` if given (a
    crc32c, or zlib's crc32 with ``kind="crc32"``: a zip entry's). ``block``: the tensor was carved
    from it (:func:`carve`); the block's pieces are read instead of the tensor's."""

    spec: st.TensorSpec
    tensor: torch.Tensor
    crc: int | None
    kind: str = "crc32c"
    block: Block | None = None
